"""KV-cache attention on the Triton kernels (append + rotary, split-KV attention, combine).

Every case runs the launches of :func:`flash_attn.planning.plan.plan_kvcache` and compares with the
float64 oracle of ``support/oracle.py`` under the tolerance rule of ``support/tolerance.py``
(the cases and their check: ``support/kvcache_cases.py``):

* ``interpret`` mode: Triton's interpreter on CPU tensors (always runs; shapes are kept small);
* ``triton`` mode: the same cases compiled for the GPU (``@pytest.mark.gpu``, skipped without
  CUDA).

Besides out and lse, each case checks the cache after the call: rows the call writes hold the
(rotated) new k / v, every other row is bit-for-bit unchanged.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn.planning import plan

from support.kvcache_cases import (
    CASES,
    DTYPES,
    MODES,
    SPLIT_CASES,
    Case,
    check_cache,
    check_case,
    make_inputs,
    oracle_result,
    run_kernels,
)
from support.tolerance import check_close


# ---------------------------------------------------------------------------------------------
# The feature matrix (num_splits=0: the heuristic, which splits these small problems).


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_matches_oracle(name, dtype, mode):
    check_case(CASES[name], dtype, mode)


@pytest.mark.parametrize("mode", MODES)
def test_headdim_256(mode):
    check_case(Case(seqlens=(33, 50), nheads=2, nheads_k=1, headdim=256, seqlen_cache=64, seqlen_new=1,
                    rotary="neox", causal=True), torch.float16, mode)


@pytest.mark.parametrize("mode", MODES)
def test_float32_inputs(mode):
    check_case(Case(seqlens=(21, 50), nheads=4, nheads_k=2, seqlen_new=2, rotary="interleaved"),
               torch.float32, mode)


# ---------------------------------------------------------------------------------------------
# Without cache_seqlens: every sequence's whole cache, its row count a number in the plan.

WHOLE_CACHE = {  # every sequence's cache_seqlens is the capacity, which is what the oracle is given
    "plain_gqa": Case(seqlens=(80, 80), nheads=4, nheads_k=2),
    "paged_causal_sq2": Case(seqlens=(64, 64), seqlen_q=2, seqlen_cache=64, page_size=16, causal=True),
    "leftpad_alibi_split": Case(seqlens=(80, 80), leftpad=(7, 0), alibi="heads", num_splits=3),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(WHOLE_CACHE))
def test_the_whole_cache_without_cache_seqlens(name, mode):
    """A call without cache_seqlens (``None``) attends to every sequence's whole cache: the plan
    passes the cache's rows as a number (``seqlen_cache``) and no tensor of lengths (its slot an
    unused buffer), and the result is the oracle's with cache_seqlens = the capacity."""
    from flash_attn.params import AttentionParams, KVCacheInputs

    case = WHOLE_CACHE[name]
    device = torch.device("cuda" if mode == "triton" else "cpu")
    args = make_inputs(case, torch.float16, device)
    assert args["cache_seqlens"].tolist() == [case.seqlen_cache] * case.batch
    out, lse = run_kernels(case, {**args, "cache_seqlens": None}, mode)
    ref, naive = oracle_result(case, args), oracle_result(case, args, compute_dtype=None)
    check_close(out, ref.out, naive.out, torch.float16, "out")
    check_close(lse, ref.lse, naive.lse, torch.float16, "lse")
    cache = KVCacheInputs(args["k_cache"], args["v_cache"], None, block_table=args.get("block_table"),
                          cache_leftpad=args.get("cache_leftpad"))
    planned = plan.plan_kvcache(plan.describe_kvcache(args["q"], AttentionParams(0.125, -1, -1), cache,
                                                      args.get("alibi_slopes")), plan.Target("sm90", 132, aot=True))
    split = next(launch for launch in planned.launches if launch.kernel == "split_kv_kernel")
    assert dict(split.args)["seqlen_cache"] == case.seqlen_cache
    assert not any(value == "seqlens" for launch in planned.launches for _, value in launch.args)
    assert any(b.slot == "no_seqlens" and b.unused for b in planned.buffers)


def test_a_call_that_appends_or_rotates_without_cache_seqlens_is_refused_by_the_planner():
    """The positions of new rows and of rotary come from cache_seqlens: the public function fills
    one for those calls (:mod:`flash_attn.kvcache`); a plan without one refuses them loudly."""
    from flash_attn.params import AttentionParams, KVCacheInputs

    args = make_inputs(Case(seqlens=(3, 4), seqlen_new=1), torch.float16, torch.device("cpu"))
    cache = KVCacheInputs(args["k_cache"], args["v_cache"], None, args["k"], args["v"])
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        plan.plan_kvcache(plan.describe_kvcache(args["q"], AttentionParams(0.125, -1, -1), cache),
                          plan.Target("sm90", 132, aot=True))


# ---------------------------------------------------------------------------------------------
# Splitting the keys never changes the result beyond rounding (SPLIT_CASES).


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_num_splits_agree(name, dtype, mode, monkeypatch):
    from flash_attn.planning import kvcache as kv_planner

    chosen, key_blocks = [], []
    original = kv_planner.choose_num_splits

    def record(requested, programs, blocks, sms):
        chosen.append(original(requested, programs, blocks, sms))
        key_blocks.append(blocks)
        return chosen[-1]

    monkeypatch.setattr(kv_planner, "choose_num_splits", record)  # where the KV-cache planner calls it
    results = {n: check_case(SPLIT_CASES[name], dtype, mode, num_splits=n) for n in (1, 3, 0, 1000)}
    # 3 requested splits become fewer only where the key blocks are fewer: a GPU's wide key blocks
    # over a short cache (long_append_paged's 96 keys: one block on an H200); the interpreter's
    # narrow blocks split every case; 0 (the heuristic) splits only caches of at least
    # 2 * MIN_BLOCKS_PER_SPLIT blocks
    assert chosen[0] == 1 and chosen[1] == min(3, key_blocks[1]), f"splits used: {chosen} of {key_blocks} blocks"
    assert mode != "interpret" or chosen[1] > 1, f"splits used: {chosen} of {key_blocks} blocks"
    out1, lse1 = results[1]
    for n, (out, lse) in results.items():
        # same inputs, different summation order only
        assert (out.float() - out1.float()).abs().max().item() <= 4 * torch.finfo(dtype).eps, f"num_splits={n}"
        assert torch.equal(torch.isinf(lse), torch.isinf(lse1))
        finite = torch.isfinite(lse1)
        assert (lse[finite] - lse1[finite]).abs().max().item() <= 1e-5, f"num_splits={n}"


@pytest.mark.parametrize("name", ["long_append_paged", "sinks_gqa_dv", "unseen_new_rows", "gqa_append_d32"])
def test_results_do_not_depend_on_the_order_programs_run_in(name, monkeypatch):
    """The interpreter with its programs run in reverse order (last grid index first).

    A GPU runs the programs of a launch in any order, concurrently; the interpreter runs them one
    after another, first grid index first. The fused append relies on no order: each program
    copies the new rows it reads itself, the first program also those nobody reads. Reversed, a
    program that read a new row before another copied it would read the stale cache. What this
    cannot show: that a program's own copies are visible to its threads on a GPU (the CTA barrier
    after them; the ``triton`` mode of these tests and ``.ci/gpu-check`` run that)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    in_order = builder.set_grid_idx

    def reversed_grid_idx(x, y, z):
        nx, ny, nz = builder.grid_dim
        in_order(nx - 1 - x, ny - 1 - y, nz - 1 - z)

    monkeypatch.setattr(builder, "set_grid_idx", reversed_grid_idx)
    case = {**CASES, **SPLIT_CASES}[name]
    check_case(case, torch.float16, "interpret", num_splits=3)


def test_split_heuristic():
    choose = plan.choose_num_splits
    assert choose(1, programs=1, key_blocks=100, sms=108) == 1  # 1 = no split
    assert choose(3, programs=1, key_blocks=100, sms=108) == 3  # honoured
    assert choose(50, programs=1, key_blocks=4, sms=108) == 4  # clamped to the key blocks
    assert choose(0, programs=200, key_blocks=100, sms=108) == 1  # the SMs are already busy
    assert choose(0, programs=8, key_blocks=1000, sms=108) == 26  # 208 of 216 slots (2 per SM)
    assert choose(0, programs=1, key_blocks=2000, sms=132) == 118  # <= MAX_SPLITS, 17 blocks each
    assert choose(0, programs=2, key_blocks=20, sms=108) == 2  # >= 8 blocks per split
    assert choose(0, programs=2, key_blocks=5, sms=108) == 1  # too few blocks to split
    assert choose(0, programs=2, key_blocks=70, sms=8) == 8  # 8 splits of 9 blocks (the last 7)
    assert choose(0, programs=4, key_blocks=0, sms=108) == 1
    # a last wave nearly empty costs a whole wave: 150 programs on 264 slots run best as 7 splits
    # (1,050 programs in 3.98 waves), not 2 (300 in 1.14)
    assert choose(0, programs=150, key_blocks=1024, sms=132) == 7
    # the best split counts measured on an H100 (132 SMs; d128, 128-key blocks, 8 KV heads;
    # benchmarks/README.md, "Decode"): batch x cache -> programs, key blocks -> splits
    assert choose(0, programs=8, key_blocks=128, sms=132) == 16  # batch 1, 16k
    assert choose(0, programs=8, key_blocks=1024, sms=132) == 32  # batch 1, 128k
    assert choose(0, programs=32, key_blocks=128, sms=132) == 8  # batch 4, 16k
    assert choose(0, programs=32, key_blocks=1024, sms=132) == 8  # batch 4, 128k (9: 0.65x FA2 on an H200)
    assert choose(0, programs=128, key_blocks=1024, sms=132) == 2  # batch 16, 128k
    assert choose(0, programs=512, key_blocks=128, sms=132) == 1  # batch 64


# ---------------------------------------------------------------------------------------------
# Through the public API and the dispatcher.


@pytest.mark.parametrize("mode", MODES)
def test_public_api(mode, monkeypatch):
    from flash_attn import dispatch
    from flash_attn.flash_attn_interface import flash_attn_with_kvcache

    reason = dispatch.unavailable_reason(mode, torch.device("cuda" if mode == "triton" else "cpu"))
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", mode)
    case = Case(seqlens=(20, 44), seqlen_q=2, nheads=4, nheads_k=2, seqlen_new=2, rotary="neox", causal=True)
    device = torch.device("cuda" if mode == "triton" else "cpu")
    args = make_inputs(case, torch.float16, device)
    before = {"k": args["k_cache"].clone(), "v": args["v_cache"].clone()}
    out, lse = flash_attn_with_kvcache(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"],
        rotary_cos=args["rotary_cos"], rotary_sin=args["rotary_sin"], cache_seqlens=args["cache_seqlens"],
        causal=True, rotary_interleaved=False, return_softmax_lse=True,
    )
    ref = oracle_result(case, {**args, "k_cache": before["k"], "v_cache": before["v"]})
    naive = oracle_result(case, {**args, "k_cache": before["k"], "v_cache": before["v"]}, compute_dtype=None)
    check_close(out, ref.out, naive.out, torch.float16, "out")
    check_close(lse, ref.lse, naive.lse, torch.float16, "lse")
    check_cache("k_cache", args["k_cache"], before["k"], ref.k_cache, ref.written, True)
