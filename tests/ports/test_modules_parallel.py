"""The tensor-parallel modules over torch.distributed (gloo, 2 CPU processes) against the
single-process modules in float64 with the same (full) weights: ``ParallelMHA`` (sequence
parallel and not, GQA, rotary, kv-cache decoding), ``ParallelMLP``, ``ParallelGatedMlp``,
``ParallelGPT2Embeddings``, and the collectives of ``flash_attn.utils.distributed``.

Each rank builds the full module (same seed everywhere), copies its shard of every weight into
the parallel module (the layout upstream's parallel modules use: per rank, its query heads, then
its key heads, then its value heads), runs forward and backward on its part of the input, and
reports the largest difference from the full module's output and gradients. The single-process
modules themselves are checked against float64 oracles in tests/ports/test_modules.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from support import gloo_ranks

WORLD = 2
E, H, D, B, S = 32, 4, 8, 2, 6


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _rows(w, starts_sizes):
    return torch.cat([w[s: s + n] for s, n in starts_sizes])


def _mha_case(rank, world, sequence_parallel, num_heads_kv, rotary, flash=False):
    from flash_attn.modules.mha import MHA, ParallelMHA

    group = dist.group.WORLD
    # flash: this package's kernels (fp32: they take no float64), with ALiBi, whose slopes
    # each rank must take for its own heads
    kw = dict(causal=True, rotary_emb_dim=rotary, use_flash_attn=flash, use_alibi=flash)
    dtype = torch.float32 if flash else torch.float64
    torch.manual_seed(0)
    full = MHA(E, H, num_heads_kv=num_heads_kv, layer_idx=0, **kw).to(dtype)
    par = ParallelMHA(E, H, group, num_heads_kv=num_heads_kv, layer_idx=0,
                      sequence_parallel=sequence_parallel, **kw).to(dtype)
    hk = num_heads_kv or H
    hq_local, hk_local = H // world, hk // world
    q0, k0 = rank * hq_local * D, rank * hk_local * D
    qkv_rows = [(q0, hq_local * D), (H * D + k0, hk_local * D), (H * D + hk * D + k0, hk_local * D)]
    with torch.no_grad():
        par.Wqkv.weight.copy_(_rows(full.Wqkv.weight, qkv_rows))
        par.Wqkv.bias.copy_(_rows(full.Wqkv.bias, qkv_rows))
        par.out_proj.weight.copy_(full.out_proj.weight[:, q0: q0 + hq_local * D])
        if rank == 0:
            par.out_proj.bias.copy_(full.out_proj.bias)
    assert (par.out_proj.bias is not None) == (rank == 0)  # the bias is added once

    x = torch.randn(B, S, E, generator=torch.Generator().manual_seed(1), dtype=dtype)
    g = torch.randn(B, S, E, generator=torch.Generator().manual_seed(2), dtype=dtype)
    x_full = x.clone().requires_grad_(True)
    out_full = full(x_full)
    out_full.backward(g)
    if sequence_parallel:  # each rank: its slice of the (batch * seqlen) tokens
        chunk = B * S // world
        mine = slice(rank * chunk, (rank + 1) * chunk)
        x_mine = x.flatten(0, 1)[mine].clone().requires_grad_(True)
        out = par(x_mine, seqlen=S)
        out.backward(g.flatten(0, 1)[mine])
        errors = {"out": _err(out, out_full.flatten(0, 1)[mine]),
                  "dx": _err(x_mine.grad, x_full.grad.flatten(0, 1)[mine])}
    else:
        x_mine = x.clone().requires_grad_(True)
        out = par(x_mine)
        out.backward(g)
        errors = {"out": _err(out, out_full), "dx": _err(x_mine.grad, x_full.grad)}
    errors["dWqkv"] = _err(par.Wqkv.weight.grad, _rows(full.Wqkv.weight.grad, qkv_rows))
    errors["dWout"] = _err(par.out_proj.weight.grad, full.out_proj.weight.grad[:, q0: q0 + hq_local * D])
    if rank == 0:
        errors["dbout"] = _err(par.out_proj.bias.grad, full.out_proj.bias.grad)

    # kv-cache decoding through the parallel module equals the full forward
    if not sequence_parallel:
        from flash_attn.utils.generation import InferenceParams

        params = InferenceParams(max_seqlen=S, max_batch_size=B)
        with torch.no_grad():
            steps = [par(x[:, :3], inference_params=params)]
            params.seqlen_offset = 3
            for t in range(3, S):
                steps.append(par(x[:, t: t + 1], inference_params=params))
                params.seqlen_offset += 1
        errors["decode"] = _err(torch.cat(steps, 1), out_full)
        assert par.allocate_inference_cache(B, S).shape == (B, S, 2, hk_local, D)
    return errors


def _mlp_case(rank, world, gated, sequence_parallel, fused=False):
    from flash_attn.modules.mlp import GatedMlp, Mlp, ParallelGatedMlp, ParallelMLP
    from flash_attn.ops.fused_dense import FusedMLP, ParallelFusedMLP

    group = dist.group.WORLD
    torch.manual_seed(0)
    if gated:
        full = GatedMlp(E, hidden_features=48, multiple_of=8, activation=F.silu).double()
        par = ParallelGatedMlp(E, group, hidden_features=48, multiple_of=8, activation=F.silu,
                               sequence_parallel=sequence_parallel).double()
        hidden = 48
        # per rank fc1 rows are [value, gate] of its hidden slice; the full layer is [value, gate]
        h_local = hidden // world
        fc1_rows = [(rank * h_local, h_local), (hidden + rank * h_local, h_local)]
    elif fused:  # upstream's ops.fused_dense (sqrelu: its one activation that is not Mlp's default)
        full = FusedMLP(E, hidden_features=40, activation="sqrelu", checkpoint_lvl=1).double()
        par = ParallelFusedMLP(E, hidden_features=40, activation="sqrelu", process_group=group,
                               sequence_parallel=sequence_parallel, checkpoint_lvl=1).double()
        h_local = 40 // world
        fc1_rows = [(rank * h_local, h_local)]
    else:
        full = Mlp(E, hidden_features=40).double()
        par = ParallelMLP(E, hidden_features=40, process_group=group,
                          sequence_parallel=sequence_parallel).double()
        h_local = 40 // world
        fc1_rows = [(rank * h_local, h_local)]
    cols = slice(rank * h_local, (rank + 1) * h_local)
    with torch.no_grad():
        par.fc1.weight.copy_(_rows(full.fc1.weight, fc1_rows))
        par.fc1.bias.copy_(_rows(full.fc1.bias, fc1_rows))
        par.fc2.weight.copy_(full.fc2.weight[:, cols])
        if rank == 0:
            par.fc2.bias.copy_(full.fc2.bias)
    x = torch.randn(B * S, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x_full = x.clone().requires_grad_(True)
    out_full = full(x_full)
    out_full.sum().backward()
    mine = slice(rank * (B * S // world), (rank + 1) * (B * S // world)) if sequence_parallel else slice(None)
    x_mine = x[mine].clone().requires_grad_(True)
    out = par(x_mine)
    out.sum().backward()
    return {"out": _err(out, out_full[mine]), "dx": _err(x_mine.grad, x_full.grad[mine]),
            "dfc1": _err(par.fc1.weight.grad, _rows(full.fc1.weight.grad, fc1_rows)),
            "dfc2": _err(par.fc2.weight.grad, full.fc2.weight.grad[:, cols])}


def _embedding_case(rank, world, sequence_parallel):
    from flash_attn.modules.embedding import GPT2Embeddings, ParallelGPT2Embeddings

    group = dist.group.WORLD
    vocab, positions = 20, 8
    torch.manual_seed(0)
    full = GPT2Embeddings(E, vocab, positions).double()
    par = ParallelGPT2Embeddings(E, vocab, positions, group, sequence_parallel=sequence_parallel).double()
    rows, cols = vocab // world, E // world
    with torch.no_grad():
        par.word_embeddings.weight.copy_(full.word_embeddings.weight[rank * rows: (rank + 1) * rows])
        par.position_embeddings.weight.copy_(full.position_embeddings.weight[:, rank * cols: (rank + 1) * cols])
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(4))
    ref = full(ids).flatten(0, 1)
    out = par(ids, combine_batch_seqlen_dim=True)
    mine = slice(rank * (B * S // world), (rank + 1) * (B * S // world)) if sequence_parallel else slice(None)
    out.sum().backward()
    ref.sum().backward()
    # Each rank's output (a slice of the tokens with sequence_parallel) gets gradient 1; the
    # reduce-scatter's backward gathers it back, so every token's gradient is 1, as in `ref`.
    return {"out": _err(out, ref[mine]),
            "dword": _err(par.word_embeddings.weight.grad,
                          full.word_embeddings.weight.grad[rank * rows: (rank + 1) * rows]),
            "dpos": _err(par.position_embeddings.weight.grad,
                         full.position_embeddings.weight.grad[:, rank * cols: (rank + 1) * cols])}


def _collectives_case(rank, world):
    from flash_attn.utils.distributed import (
        all_gather,
        all_reduce,
        allreduce_sequence_parallel_grad,
        get_dim_for_local_rank,
        reduce_scatter,
        sync_shared_params,
    )

    group = dist.group.WORLD
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    gathered = all_gather(x, group)
    gathered.backward(torch.arange(12, dtype=torch.float64).view(4, 3))
    # the gradient of a gather is the (summed over ranks) slice of this rank's rows
    expected_dx = world * torch.arange(12, dtype=torch.float64).view(4, 3)[rank * 2: rank * 2 + 2]
    errors = {"all_gather": _err(gathered, torch.cat([torch.full((2, 3), float(r + 1)) for r in range(world)])),
              "all_gather_grad": _err(x.grad, expected_dx)}
    y = torch.arange(4, dtype=torch.float64).view(4, 1).mul(rank + 1).requires_grad_(True)
    scattered = reduce_scatter(y, group)
    total = torch.arange(4, dtype=torch.float64).view(4, 1) * sum(r + 1 for r in range(world))
    errors["reduce_scatter"] = _err(scattered, total[rank * 2: rank * 2 + 2])
    scattered.sum().backward()
    errors["reduce_scatter_grad"] = _err(y.grad, torch.ones(4, 1))
    z = torch.tensor([float(rank)], requires_grad=True)
    before = z.detach().clone()
    summed = all_reduce(z, group)
    errors["all_reduce"] = _err(summed, torch.tensor([float(sum(range(world)))]))
    errors["all_reduce_input_untouched"] = _err(z.detach(), before)
    errors["dims"] = float(sum(get_dim_for_local_rank(7, world, r) for r in range(world)) != 7)

    lin = torch.nn.Linear(2, 2)
    for p in lin.parameters():
        p._shared_params = True
        p._sequence_parallel = True
    with torch.no_grad():
        lin.weight.fill_(rank + 1)
    sync_shared_params(lin, group)
    errors["sync_shared_params"] = _err(lin.weight, torch.ones(2, 2))
    lin(torch.ones(1, 2) * (rank + 1)).sum().backward()
    allreduce_sequence_parallel_grad(lin, group)
    errors["allreduce_sequence_parallel_grad"] = _err(lin.weight.grad, torch.full((2, 2), float(sum(r + 1 for r in range(world)))))
    return errors


CASES = {
    "mha_seqpar": lambda r, w: _mha_case(r, w, True, None, 0),
    "mha_gqa_rotary": lambda r, w: _mha_case(r, w, False, 2, 8),
    "mha_rotary_seqpar_gqa": lambda r, w: _mha_case(r, w, True, 2, 8),
    "mha_plain": lambda r, w: _mha_case(r, w, False, None, 0),
    "mha_flash_alibi_gqa_fp32": lambda r, w: _mha_case(r, w, False, 2, 0, flash=True),
    "mha_flash_alibi_seqpar_fp32": lambda r, w: _mha_case(r, w, True, None, 0, flash=True),
    "mlp_seqpar": lambda r, w: _mlp_case(r, w, False, True),
    "mlp": lambda r, w: _mlp_case(r, w, False, False),
    "gated_mlp_seqpar": lambda r, w: _mlp_case(r, w, True, True),
    "fused_mlp_seqpar": lambda r, w: _mlp_case(r, w, False, True, fused=True),
    "fused_mlp": lambda r, w: _mlp_case(r, w, False, False, fused=True),
    "embeddings_seqpar": lambda r, w: _embedding_case(r, w, True),
    "embeddings": lambda r, w: _embedding_case(r, w, False),
    "collectives": _collectives_case,
}


def worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    gloo_ranks.run_cases(CASES, rank, world, init_file, result_dir)


def test_parallel_modules_over_gloo_equal_the_single_process_modules(tmp_path, monkeypatch):
    gloo_ranks.skip_unless_cpu_ranks_can_run(monkeypatch)
    results = gloo_ranks.spawn(worker, WORLD, tmp_path)
    for rank, cases in results.items():
        assert set(cases) == set(CASES)
        for name, errors in cases.items():
            for what, err in errors.items():
                # float64 on both sides: sums of a few dozen products in another order;
                # fp32 (flash cases): the same, a few hundred fp32 ulps of values of order 1
                tol = 2e-5 if name.endswith("fp32") else 1e-12
                assert err <= tol, f"rank {rank} {name}: {what} differs by {err:.3e}"


def test_parallel_modules_need_a_process_group():
    from flash_attn.modules.mlp import ParallelMLP

    with pytest.raises(ValueError, match="process_group"):
        ParallelMLP(8)
