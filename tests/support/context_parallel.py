"""Ring attention over torch.distributed, written the way context-parallel libraries use the
low-level API (``_flash_attn_forward`` / ``_flash_attn_backward``); run by
``tests/integration/test_context_parallel.py`` in separate processes over the ``gloo`` backend.

Each rank holds one slice of the sequence (its queries, keys and values). Key/value blocks travel
around the ring; every rank attends its queries to each block it receives, merges the partial
outputs with the returned log-sum-exp, and in the backward recomputes each block's share of the
gradient from the *merged* (global) ``out`` and ``softmax_lse``. Key/value gradients travel with
their block and are home after a full turn.

Layouts:

* ``ring``: rank ``r`` holds the contiguous ``r``-th slice;
* ``zigzag`` (causal load balancing): the sequence is cut in ``2 * world`` chunks and rank ``r``
  holds chunks ``r`` and ``2 * world - 1 - r``, so every rank has the same causal work.

This file is a helper, not a test module: the worker must be importable in spawned processes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from support import gloo_ranks
from flash_attn import flash_attn_func
from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

CASES = [
    # name, layout, causal, dtype
    ("ring", "ring", False, torch.float32),
    ("ring-causal", "ring", True, torch.float32),
    ("zigzag-causal", "zigzag", True, torch.float32),
    ("zigzag-causal-bf16", "zigzag", True, torch.bfloat16),
]
BATCH, NHEADS, NHEADS_K, HEADDIM, CHUNK = 2, 4, 2, 32, 8
SCALE = HEADDIM ** -0.5


def local_rows(layout: str, rank: int, world: int, seqlen: int) -> torch.Tensor:
    """The global sequence positions rank ``rank`` holds, in its local order."""
    if layout == "ring":
        size = seqlen // world
        return torch.arange(rank * size, (rank + 1) * size)
    half = seqlen // (2 * world)
    first = torch.arange(rank * half, (rank + 1) * half)
    second = torch.arange((2 * world - 1 - rank) * half, (2 * world - rank) * half)
    return torch.cat([first, second])


def block_plan(layout: str, causal: bool, rank: int, source: int, local: int):
    """How local queries attend to the key block of rank ``source``:
    ``(query rows, key rows, causal)`` as slices of the local tensors, or None (nothing visible)."""
    everything = slice(0, local)
    if not causal:
        return everything, everything, False
    if source == rank:
        return everything, everything, True  # the diagonal block (zigzag: both chunks line up)
    if layout == "ring":
        return (everything, everything, False) if source < rank else None
    half = slice(0, local // 2), slice(local // 2, local)
    if source < rank:  # its first chunk precedes both of ours, its second follows both
        return everything, half[0], False
    return half[1], everything, False  # only our late chunk sees its (earlier) two chunks


class Ring:
    """Send to the next rank, receive from the previous one."""

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def shift(self, *tensors):
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, r in zip(tensors, received):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), (self.rank + 1) % self.world))
            ops.append(dist.P2POp(dist.irecv, r, (self.rank - 1) % self.world))
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return received


def ring_forward(q, k, v, layout, causal):
    """Local output (q's dtype) and fp32 log-sum-exp ``(b, h, local)`` over the whole sequence."""
    ring = Ring()
    b, local, h, d = q.shape
    out = torch.zeros(b, local, h, d, dtype=torch.float32)
    lse = torch.full((b, h, local), float("-inf"))
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        plan = block_plan(layout, causal, ring.rank, source, local)
        if plan is not None:
            rows, cols, block_causal = plan
            block_out, block_lse, _, _ = _flash_attn_forward(
                q[:, rows], k[:, cols], v[:, cols], 0.0, SCALE, block_causal, -1, -1, 0.0, None, False)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            old_w = torch.exp(lse[:, :, rows] - merged).transpose(1, 2).unsqueeze(-1)
            new_w = torch.exp(block_lse - merged).transpose(1, 2).unsqueeze(-1)
            out[:, rows] = out[:, rows] * old_w + block_out.float() * new_w
            lse[:, :, rows] = merged
        if step + 1 < ring.world:
            k, v = ring.shift(k, v)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, layout, causal):
    """Local ``dq, dk, dv`` (fp32): each block's backward uses the global ``out``/``lse``."""
    ring = Ring()
    local = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk, dv = torch.zeros(k.shape, dtype=torch.float32), torch.zeros(v.shape, dtype=torch.float32)
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        plan = block_plan(layout, causal, ring.rank, source, local)
        if plan is not None:
            rows, cols, block_causal = plan
            bq, bk, bv = torch.empty_like(q[:, rows]), torch.empty_like(k[:, cols]), torch.empty_like(v[:, cols])
            _flash_attn_backward(dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows],
                                 bq, bk, bv, 0.0, SCALE, block_causal, -1, -1, 0.0, None, False)
            dq[:, rows] += bq.float()
            dk[:, cols] += bk.float()
            dv[:, cols] += bv.float()
        # the block and its gradient accumulator move on together; after a full turn the
        # accumulator is back at the block's owner
        if step + 1 < ring.world:
            k, v, dk, dv = ring.shift(k, v, dk, dv)
        else:
            dk, dv = ring.shift(dk, dv)
    return dq, dk, dv


def _max_error(got, want) -> float:
    return (got.double() - want.double()).abs().max().item()


def run_case(layout, causal, dtype, rank, world):
    seqlen = 2 * world * CHUNK
    g = torch.Generator().manual_seed(1234)  # the same full inputs on every rank
    shape_q, shape_k = (BATCH, seqlen, NHEADS, HEADDIM), (BATCH, seqlen, NHEADS_K, HEADDIM)
    q, dout = (torch.randn(shape_q, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(shape_k, generator=g).to(dtype) for _ in range(2))
    # single process, whole sequence: the reference
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    full_out = flash_attn_func(*leaves, softmax_scale=SCALE, causal=causal)
    full_out.backward(dout)
    rows = local_rows(layout, rank, world, seqlen)
    mine = [t[:, rows].contiguous() for t in (q, k, v, dout)]
    out, lse = ring_forward(*mine[:3], layout, causal)
    dq, dk, dv = ring_backward(mine[3], *mine[:3], out, lse, layout, causal)
    return {
        "out": _max_error(out, full_out.detach()[:, rows]),
        "dq": _max_error(dq, leaves[0].grad[:, rows]),
        "dk": _max_error(dk, leaves[1].grad[:, rows]),
        "dv": _max_error(dv, leaves[2].grad[:, rows]),
        "scale": max(full_out.detach().abs().max().item(), *(t.grad.abs().max().item() for t in leaves)),
    }


def worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    with gloo_ranks.process_group(rank, world, init_file):
        results = {name: run_case(layout, causal, dtype, rank, world) for name, layout, causal, dtype in CASES}
        gloo_ranks.write_result(result_dir, rank, results)
