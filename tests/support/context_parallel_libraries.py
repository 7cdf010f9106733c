"""Real context-parallel libraries running on this package, each rank of a ``gloo`` process group
calling the library's own functions, which call our low-level API exactly as they call upstream's:

* ring-flash-attention (``ring-flash-attn`` on PyPI, zhuzilin): ring, zigzag, stripe and llama3
  (varlen); it calls ``_flash_attn_forward`` / ``_flash_attn_backward`` and the varlen pair by
  keyword, reading their defaults through ``._init_fn``;
* yunchang (long-context-attention, feifeibear): ``LongContextAttention``, Ulysses all-to-all
  combined with a ring (USP), calling the same functions positionally.

Run by ``tests/integration/test_context_parallel_libraries.py`` in separate processes. Each case gives every
rank the same full inputs, lets the library compute its rank's slice, and compares output and
gradients with the float64 oracle on the whole sequence (independent of both the library and
this package).

This file is a helper, not a test module: the worker must be importable in spawned processes.
"""

from __future__ import annotations

import importlib
import types

import torch

from support import gloo_ranks, oracle

BATCH, NHEADS, NHEADS_K, HEADDIM = 2, 4, 2, 32
SCALE = HEADDIM ** -0.5
# packed sequences of the varlen cases: each length a multiple of 2 * 4 (zigzag cuts a sequence
# in 2 * world pieces) for worlds 2 and 4
VARLEN_LENGTHS = (16, 40, 24)

# name -> (library function, layout, causal, dtype). The ring, zigzag and stripe functions of
# ring-flash-attn 0.1.8 are right only in half precision (the dtypes upstream's kernels take): their
# backward keeps the first block's gradient as ``block_dq_buffer.to(torch.float32)``, which in fp32
# is the buffer itself, so the next block's backward overwrites it (measured here: dq off by the
# size of the gradients). llama3 has no such buffer and runs in fp32 as well.
CASES = {
    "ring": ("ring_flash_attn_func", "ring", False, torch.bfloat16),
    "ring-causal": ("ring_flash_attn_func", "ring", True, torch.bfloat16),
    "zigzag-causal": ("zigzag_ring_flash_attn_func", "zigzag", True, torch.bfloat16),
    "zigzag-causal-fp16": ("zigzag_ring_flash_attn_func", "zigzag", True, torch.float16),
    "stripe-causal": ("stripe_flash_attn_func", "stripe", True, torch.bfloat16),
    "ring-varlen": ("ring_flash_attn_varlen_func", "ring", False, torch.bfloat16),
    "ring-varlen-causal": ("ring_flash_attn_varlen_func", "ring", True, torch.bfloat16),
    "zigzag-varlen-causal": ("zigzag_ring_flash_attn_varlen_func", "zigzag", True, torch.bfloat16),
    "llama3-varlen": ("llama3_flash_attn_varlen_func", "contiguous", False, torch.float32),
    "llama3-varlen-causal": ("llama3_flash_attn_varlen_func", "contiguous", True, torch.float32),
    "llama3-varlen-causal-bf16": ("llama3_flash_attn_varlen_func", "contiguous", True, torch.bfloat16),
}


def import_library() -> types.ModuleType:
    """The ``ring_flash_attn`` package.

    ring-flash-attn 0.1.8's ``__init__`` imports its Hugging Face adapter, which imports
    ``is_flash_attn_greater_or_equal_2_10`` from ``transformers.modeling_flash_attention_utils``;
    Transformers 5 keeps that function only in ``transformers.utils``, so the import fails
    (zhuzilin/ring-flash-attention PR #88, open). The name is put back where the adapter looks for
    it; the attention functions tested here do not use the adapter.
    """
    import transformers.modeling_flash_attention_utils as fa_utils
    import transformers.utils

    name = "is_flash_attn_greater_or_equal_2_10"
    if not hasattr(fa_utils, name):
        setattr(fa_utils, name, getattr(transformers.utils, name))
    return importlib.import_module("ring_flash_attn")


def sequence_pieces(layout: str, rank: int, world: int, start: int, length: int) -> list[torch.Tensor]:
    """The global positions of one sequence ``start:start+length`` that ``rank`` holds, in its
    local order, for the layouts the library expects."""
    positions = torch.arange(start, start + length)
    if layout == "ring":
        return [positions.chunk(world)[rank]]
    if layout == "zigzag":
        chunks = positions.chunk(2 * world)
        return [chunks[rank], chunks[2 * world - 1 - rank]]
    if layout == "stripe":
        return [positions[rank::world]]
    raise ValueError(layout)


def local_rows(layout: str, rank: int, world: int, lengths) -> torch.Tensor:
    """The packed global rows ``rank`` holds: every sequence's share (``contiguous``: one slice of
    the packed tokens, as llama3's context parallelism cuts them)."""
    total = sum(lengths)
    if layout == "contiguous":
        return torch.arange(total).chunk(world)[rank]
    starts = torch.tensor((0,) + tuple(lengths)).cumsum(0)[:-1].tolist()
    return torch.cat([piece for start, length in zip(starts, lengths)
                      for piece in sequence_pieces(layout, rank, world, start, length)])


def _inputs(dtype, lengths, dense: bool):
    g = torch.Generator().manual_seed(4321)  # the same full inputs on every rank
    rows = sum(lengths)
    shape_q, shape_k = (rows, NHEADS, HEADDIM), (rows, NHEADS_K, HEADDIM)
    if dense:
        shape_q, shape_k = (BATCH,) + shape_q, (BATCH,) + shape_k
    q, dout = (torch.randn(shape_q, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(shape_k, generator=g).to(dtype) for _ in range(2))
    return q, k, v, dout


def _oracle(q, k, v, dout, causal, lengths):
    """Float64 output and gradients of the whole sequence(s)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    if lengths is None:
        out = oracle.attention_ref(*leaves, softmax_scale=SCALE, causal=causal).out
    else:
        cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
        out = oracle.attention_varlen_ref(*leaves, cu, cu, softmax_scale=SCALE, causal=causal).out
    out.backward(dout.double())
    return out.detach(), *(t.grad for t in leaves)


def _run_library(library, function, layout, causal, mine, rank, world, lengths):
    """The library's output for this rank's slice, with autograd through it."""
    q, k, v = mine
    fn = getattr(library, function)
    if lengths is None:
        return fn(q, k, v, softmax_scale=SCALE, causal=causal)
    if layout == "contiguous":
        cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
        cu_q, cu_k, max_q, max_k, k_slice = library.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, heads_k_stride=1, local_k_slice=k_slice,
                  softmax_scale=SCALE, causal=causal)
    # ring / zigzag varlen: every sequence holds 1/world of its tokens on each rank
    local_cu = torch.tensor([0] + [n // world for n in lengths]).cumsum(0).to(torch.int32)
    return fn(q, k, v, local_cu, max(lengths) // world, softmax_scale=SCALE, causal=causal)


def run_case(library, name: str, rank: int, world: int) -> dict:
    function, layout, causal, dtype = CASES[name]
    varlen = "varlen" in function
    lengths = VARLEN_LENGTHS if varlen else None
    q, k, v, dout = _inputs(dtype, VARLEN_LENGTHS if varlen else (8 * world,), dense=not varlen)
    rows = local_rows(layout, rank, world, lengths or (q.shape[1],))
    return _compare(q, k, v, dout, causal, lengths, rows, 0 if varlen else 1,
                    lambda mine: _run_library(library, function, layout, causal, mine, rank, world, lengths))


def _compare(q, k, v, dout, causal, lengths, rows, axis, run) -> dict:
    """Errors of ``run``'s output and gradients for the local ``rows`` (along ``axis``) against
    the float64 oracle of the whole inputs, the largest oracle value, and the result dtypes."""
    want = _oracle(q, k, v, dout, causal, lengths)
    mine = [t.index_select(axis, rows).contiguous().requires_grad_() for t in (q, k, v)]
    out = run(mine)
    out.backward(dout.index_select(axis, rows))
    got = [out.detach()] + [t.grad for t in mine]
    return {
        "errors": {what: (g.double() - w.index_select(axis, rows)).abs().max().item()
                   for what, g, w in zip(("out", "dq", "dk", "dv"), got, want)},
        "scale": max(w.abs().max().item() for w in want),
        "dtypes": [str(g.dtype) for g in got],
    }


def ring_flash_attn_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    with gloo_ranks.process_group(rank, world, init_file):
        library = import_library()
        results = {name: run_case(library, name, rank, world) for name in CASES}
        gloo_ranks.write_result(result_dir, rank, results)


# --- yunchang ---------------------------------------------------------------------------------------

# name -> (ring implementation, Ulysses degree, ring degree, causal); world = Ulysses x ring.
# bf16 only: yunchang's ring functions keep ring-flash-attn's fp32 buffer aliasing (above). No ring
# of one rank (Ulysses alone): the ring's backward then sends to itself, which NCCL allows and
# gloo does not ("Pair is not connected").
USP_CASES = {
    2: {
        "ring": ("basic", 1, 2, False),
        "ring-causal": ("basic", 1, 2, True),
        "zigzag-causal": ("zigzag", 1, 2, True),
    },
    4: {
        "usp": ("basic", 2, 2, False),
        "usp-zigzag-causal": ("zigzag", 2, 2, True),
        "usp-stripe-causal": ("strip", 2, 2, True),
    },
}
USP_DTYPE = torch.bfloat16


def run_usp_case(name: str, rank: int, world: int) -> dict:
    import yunchang

    impl, ulysses, ring, causal = USP_CASES[world][name]
    yunchang.set_seq_parallel_pg(ulysses, ring, rank, world)
    q, k, v, dout = _inputs(USP_DTYPE, (8 * world,), dense=True)
    # the library's own layout functions say which rows a rank holds
    extract = yunchang.EXTRACT_FUNC_DICT[impl]
    positions = torch.arange(q.shape[1], dtype=torch.float64).view(1, -1, 1)
    rows = extract(positions, rank, world, ring, ulysses).reshape(-1).long()
    attention = yunchang.LongContextAttention(ring_impl_type=impl)
    return _compare(q, k, v, dout, causal, None, rows, 1,
                    lambda mine: attention(*mine, softmax_scale=SCALE, causal=causal))


def yunchang_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    with gloo_ranks.process_group(rank, world, init_file):
        results = {name: run_usp_case(name, rank, world) for name in USP_CASES[world]}
        gloo_ranks.write_result(result_dir, rank, results)
