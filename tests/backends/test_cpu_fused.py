"""The cpu backend (:mod:`flash_attn.backends.cpu`, its plan in :mod:`flash_attn.backends._cpu_fused`):
PyTorch's own CPU attention kernels, called so that they compute exactly flash-attn's semantics.

* the call plan covers exactly the visible (query, key) pairs, each once (checked against the
  oracle's mask, independently of any attention arithmetic);
* forward and backward against the float64 oracle on an engine of small blocks
  (``cpu.engine(tuning)``), so that windows, edges, merges and masks all occur on small shapes,
  and with the CPU's features faked, so that every half-precision policy runs on any CPU;
* the fused kernels really run where they apply, and the tiled engine where they do not;
* plain eager calls go straight to the one kernel call (``cpu.direct_forward``; autograd then records
  PyTorch's own formula for the kernel) exactly where the general plan is that call, with the
  general path's results bit for bit.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_varlen_func
from flash_attn.backends import _causal_tree as tree
from flash_attn.backends import _cpu_fused as fused
from flash_attn.backends import _layouts, cpu
from flash_attn.backends._reference_core import DEFAULT_TUNING, Tuning
from flash_attn.params import AttentionParams, KVCacheInputs, VarlenLayout

from support.inputs import cu_from_lens, gen, make_slopes, randn
from support.options import test_device
from support.oracle import attention_ref, attention_varlen_ref, kvcache_ref, oracle_pair, visible_mask
from support.tolerance import backward_floor, check_close

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32

pytestmark = pytest.mark.skipif(test_device().type != "cpu" or fused.OPS is None,
                                reason="the fused path serves CPU tensors (PyTorch's CPU attention kernels)")


# Blocks of a few rows, so that every kind of call appears on small shapes.
SMALL_BLOCKS = Tuning(
    band_min_rows=4, band_min_rows_half_backward=6,  # the half-precision backward cut unlike the forward
    band_max_rows=8, min_mask_rows=3, mask_budget_bytes=2048, tree_base_rows=4, tree_min_rows=8,
    bf16_tree_min_rows=16, bf16_full_fp32_min=32,
)


@pytest.fixture
def small_blocks() -> _layouts.Engine:
    """The cpu backend's engine on :data:`SMALL_BLOCKS`, on this CPU."""
    return cpu.engine(SMALL_BLOCKS)


def _cpu(fast: bool) -> fused.Features:
    """This CPU, said to have (or to lack) native fp16 products and AMX."""
    return dataclasses.replace(fused.THIS_CPU, native_fp16=lambda: fast, amx=lambda: fast)


def _window(causal: bool) -> tuple[int, int]:
    return (-1, 0) if causal else (-1, -1)


def _forward_backward(engine, q, k, v, dout, params, **options):
    """``out, lse, (dq, dk, dv)`` of the contract's forward and backward on ``engine``."""
    out, lse, _ = _layouts.forward(engine, q, k, v, params, **options)
    return out, lse, _layouts.backward(engine, dout, q, k, v, out, lse, params, **options)


def _check_vs_oracle(out, grads, q, k, v, dout, ref, rg, naive, ng, dtype, scale):
    check_close(out, ref.out, naive.out, dtype, "out")
    floor = backward_floor(q, k, v, dout, scale, ref.probs)
    for grad, want, approx, name in zip(grads, rg, ng, ("dq", "dk", "dv")):
        check_close(grad, want, approx, dtype, name, grad=True, floor=floor)


def _covered(sq: int, sk: int, left: int, right: int, dtype=FP32, backward=False) -> torch.Tensor:
    """How often each (row, key) pair is computed by the plan, honouring each call's mask."""
    q = torch.zeros(1, sq, 1, 1, dtype=dtype)
    k = torch.zeros(1, sk, 1, 1, dtype=dtype)
    problem = _layouts._dense_problem(q, k, k, None)
    params = AttentionParams(1.0, left, right)
    count = torch.zeros(sq, sk, dtype=torch.int64)
    for group in fused.plan(problem, params, backward=backward, tuning=SMALL_BLOCKS):
        assert len({(c.i0, c.i1) for c in group}) == 1, "calls of a group share their rows"
        for call in group:
            rows, cols = call.i1 - call.i0, call.c1 - call.c0
            assert rows > 0 and cols > 0
            if call.masked:
                seen = fused._mask(problem, params, call)[0][0, 0] == 0
            elif call.causal:
                seen = torch.ones(rows, cols, dtype=torch.bool).tril_()
            else:
                seen = torch.ones(rows, cols, dtype=torch.bool)
            count[call.i0:call.i1, call.c0:call.c1] += seen
    return count


def test_plan_covers_each_visible_pair_exactly_once():
    rng = random.Random(0)
    windows = [-1, 0, 1, 3, 7, 20]
    cases = [(sq, sk, left, right) for sq, sk in [(1, 1), (5, 17), (17, 5), (16, 16), (33, 40), (40, 33), (9, 64)]
             for left, right in itertools.product(windows, windows)]
    for sq, sk, left, right in cases + [(rng.randint(1, 70), rng.randint(1, 70), rng.choice(windows),
                                         rng.choice(windows)) for _ in range(100)]:
        expected = visible_mask(sq, sk, left, right, causal=False).to(torch.int64)
        for dtype, backward in [(FP32, False), (FP32, True), (BF16, True)]:  # bf16's backward: other blocks
            count = _covered(sq, sk, left, right, dtype, backward)
            assert torch.equal(count, expected), (sq, sk, left, right, dtype, backward)


def test_plan_shapes():
    """No mask at all for full and causal attention; masks only on the edges of a window."""
    def calls(sq, sk, left, right):
        q, k = torch.zeros(1, sq, 1, 1), torch.zeros(1, sk, 1, 1)
        problem = _layouts._dense_problem(q, k, k, None)
        return [c for g in fused.plan(problem, AttentionParams(1.0, left, right)) for c in g]

    assert [(c.causal, c.masked) for c in calls(100, 100, -1, -1)] == [(False, False)]
    assert [(c.causal, c.masked) for c in calls(100, 100, -1, 0)] == [(True, False)]
    assert [(c.c0, c.c1, c.causal) for c in calls(30, 100, -1, 0)] == [(0, 70, False), (70, 100, True)]
    assert [(c.i0, c.c1, c.causal) for c in calls(100, 30, -1, 0)] == [(70, 30, True)]
    window = calls(4096, 4096, 1024, 0)
    masked = sum((c.i1 - c.i0) * (c.c1 - c.c0) for c in window if c.masked)
    computed = sum((c.i1 - c.i0) * (c.c1 - c.c0) for c in window)
    assert masked < 0.25 * computed and computed < 1.3 * 4096 * 1025
    narrow = calls(1024, 1024, 255, 0)  # one masked call per block of 128 rows
    assert [(c.i0, c.i1, c.c0, c.c1, c.masked) for c in narrow] == [
        (i, i + 128, max(0, i - 255), i + 128, True) for i in range(0, 1024, 128)]


CASES = [
    # dtype, b, sq, sk, h, hk, d, window, alibi
    (FP32, 2, 37, 37, 4, 2, 32, (-1, -1), None),
    (BF16, 1, 29, 61, 2, 1, 64, (-1, 0), None),
    (FP16, 2, 61, 29, 3, 1, 40, (-1, 0), None),
    (FP32, 1, 50, 50, 2, 2, 16, (6, 0), None),
    (BF16, 2, 45, 70, 4, 4, 32, (9, 4), None),
    (FP32, 1, 70, 45, 2, 1, 32, (-1, 5), None),
    (FP16, 1, 40, 40, 4, 2, 32, (12, -1), None),
    (FP32, 2, 33, 47, 4, 2, 32, (-1, 0), "h"),
    (BF16, 2, 47, 33, 2, 2, 64, (5, 5), "bh"),
    (FP32, 1, 30, 30, 2, 1, 8, (-1, -1), "bh"),
    (BF16, 1, 70, 70, 2, 1, 32, (9, 0), "bh"),   # causal window + ALiBi: masked, plain and causal calls merged
    (FP16, 2, 60, 25, 2, 2, 32, (-1, 0), "h"),   # causal ALiBi, rows without keys
    (FP32, 1, 64, 64, 4, 1, 32, (-1, 0), "h"),   # causal ALiBi in one call
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-s{c[2]}x{c[3]}-h{c[4]}k{c[5]}-w{c[7]}-{c[8]}".replace("torch.", ""))
def test_fused_forward_backward_vs_oracle(case, small_blocks):
    dtype, b, sq, sk, h, hk, d, window, alibi = case
    g = gen(sq + 3 * sk)
    q, k, v = randn((b, sq, h, d), dtype, g), randn((b, sk, hk, d), dtype, g), randn((b, sk, hk, d), dtype, g)
    dout = randn((b, sq, h, d), dtype, g)
    slopes = None if alibi is None else make_slopes((h,) if alibi == "h" else (b, h), seed=3)
    out, _, grads = _forward_backward(small_blocks, q, k, v, dout, AttentionParams(0.3, *window), alibi_slopes=slopes)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, window=window, alibi_slopes=slopes,
                                     softmax_scale=0.3)
    _check_vs_oracle(out, grads, q, k, v, dout, ref, rg, naive, ng, dtype, 0.3)


def test_fused_varlen_and_kvcache_vs_oracle(small_blocks):
    lens_q, lens_k = [9, 0, 30, 4], [20, 3, 30, 0]
    g = gen(5)
    q = randn((sum(lens_q), 4, 32), BF16, g)
    k, v = (randn((sum(lens_k), 2, 32), BF16, g) for _ in range(2))
    dout = randn(q.shape, BF16, g)
    slopes = make_slopes((4, 4), seed=6)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    varlen = VarlenLayout(cu_q, cu_k, 30, 30)
    params = AttentionParams(32 ** -0.5, 7, 0)  # causal, window (7, -1)
    out, _, grads = _forward_backward(small_blocks, q, k, v, dout, params, varlen=varlen, alibi_slopes=slopes)
    ref, rg, naive, ng = oracle_pair(attention_varlen_ref, [q, k, v], dout, cu_q=cu_q.tolist(), cu_k=cu_k.tolist(),
                                     causal=True, window=(7, -1), alibi_slopes=slopes)
    _check_vs_oracle(out, grads, q, k, v, dout, ref, rg, naive, ng, BF16, None)
    # the KV cache: per-sequence key ranges (left padding, lengths) in one batched masked call
    qc = randn((3, 5, 4, 32), FP32, g)
    k_cache, v_cache = randn((3, 40, 2, 32), FP32, g), randn((3, 40, 2, 32), FP32, g)
    seqlens = torch.tensor([3, 17, 35], dtype=torch.int32)
    leftpad = torch.tensor([0, 4, 30], dtype=torch.int32)
    kwargs = dict(cache_seqlens=seqlens, cache_leftpad=leftpad, causal=True, alibi_slopes=slopes[:3])
    cache = KVCacheInputs(k_cache, v_cache, seqlens, cache_leftpad=leftpad)
    out, lse = _layouts.forward_kvcache(small_blocks, qc, AttentionParams(32 ** -0.5, -1, 0), cache,
                                        alibi_slopes=slopes[:3])
    expected = kvcache_ref(qc, k_cache, v_cache, **kwargs)
    naive = kvcache_ref(qc, k_cache, v_cache, compute_dtype=None, **kwargs)
    check_close(out, expected.out, naive.out, FP32, "kvcache out")
    check_close(lse, expected.lse, naive.lse, FP32, "kvcache lse")


def test_causal_tree_covers_the_triangle_exactly_once():
    """The tree's parts (diagonal blocks, levels of rectangles, tail) compute every (row, key)
    pair of a causal square with key <= row exactly once, and no other pair."""
    for n in list(range(8, 80)) + [127, 128, 129, 255, 1000]:
        index = torch.arange(n).view(1, n, 1)
        count = torch.zeros(n, n, dtype=torch.int64)
        for rows, cols, causal, _ in tree._parts(n, SMALL_BLOCKS.tree_base_rows):
            for r, c in zip(rows(index)[0, :, :, 0], cols(index)[0, :, :, 0]):
                seen = torch.ones(len(r), len(c), dtype=torch.int64)
                count[r.view(-1, 1), c.view(1, -1)] += seen.tril_() if causal else seen
        assert torch.equal(count, torch.ones(n, n, dtype=torch.int64).tril_()), n


@pytest.mark.parametrize("dtype, b, sq, sk, h, hk", [
    (FP32, 1, 64, 64, 2, 2),    # a power-of-two body: diagonal blocks and four levels
    (FP32, 2, 37, 37, 4, 2),    # a tail of rows, GQA
    (FP32, 2, 20, 53, 2, 1),    # bottom-right causal with sq < sk: a full call beside the tree
    (FP32, 1, 70, 33, 2, 1),    # sq > sk: the first rows see nothing
    (BF16, 2, 45, 45, 4, 4),    # bf16 on its own kernel (with AMX): one causal call each way
], ids=str)
def test_causal_tree_vs_oracle(dtype, b, sq, sk, h, hk):
    """Forward (out and lse) and backward of causal squares cut into a tree, against the oracle."""
    engine = cpu.engine(SMALL_BLOCKS, _cpu(fast=True))
    g = gen(sq * sk + b)
    q = randn((b, sq, h, 32), dtype, g)
    k, v = (randn((b, sk, hk, 32), dtype, g) for _ in range(2))
    dout = randn(q.shape, dtype, g)
    params = AttentionParams(0.4, -1, 0)
    result = {}
    calls = _fused_calls(lambda: result.update(zip(("out", "lse", "_"), _layouts.forward(engine, q, k, v, params))))
    out, lse = result["out"], result["lse"]
    calls += _fused_calls(lambda: result.update(grads=_layouts.backward(engine, dout, q, k, v, out, lse, params)))
    # the square's kernel calls: one per part of the tree in fp32, one in bf16; a full call beside it when sq < sk
    square = len(tree._parts(min(sq, sk), SMALL_BLOCKS.tree_base_rows)) if dtype == FP32 else 1
    beside = 1 if sq < sk else 0
    assert [name for name, _ in calls] == ["forward"] * (square + beside) + ["backward"] * (square + beside), calls
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, window=(-1, 0), softmax_scale=0.4)
    check_close(lse, ref.lse, naive.lse, FP32, "lse")
    _check_vs_oracle(out, result["grads"], q, k, v, dout, ref, rg, naive, ng, dtype, 0.4)


_KERNELS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("forward", 0),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": ("backward", 1),
}
_DTYPE_NAMES = {"float": FP32, "c10::BFloat16": BF16, "c10::Half": FP16}


def _fused_calls(fn) -> list[tuple[str, torch.dtype]]:
    """``("forward" or "backward", dtype of q)`` of each fused kernel call PyTorch ran while
    ``fn`` ran, whether our plan called it or autograd's own formula for the kernel did."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    calls = []
    for event in prof.events():
        if event.name in _KERNELS:
            name, q_position = _KERNELS[event.name]
            calls.append((name, _DTYPE_NAMES[event.input_dtypes[q_position]]))
    return calls


def _count_fused_calls(fn) -> int:
    return len(_fused_calls(fn))


@pytest.mark.parametrize("dtype, fast_half, features, computed_in", [
    (FP16, False, {"causal": True}, (FP32, FP32)),        # no native fp16 products: fp32 both ways
    (FP16, True, {"causal": True}, (FP16, FP16)),
    (BF16, False, {"causal": True}, (FP32, BF16)),        # no AMX: the fp32 tree forward
    (BF16, True, {"causal": True}, (BF16, BF16)),
    (BF16, False, {}, (BF16, BF16)),                      # full attention below the size it gains
    (BF16, False, {"n": 40}, (FP32, BF16)),               # full attention from it, no AMX: fp32 forward
    (BF16, True, {"n": 40}, (BF16, BF16)),
    (BF16, False, {"causal": True, "alibi": True}, (BF16, BF16)),
], ids=str)
def test_half_precision_computed_in_fp32_where_faster(dtype, fast_half, features, computed_in):
    """Half-precision problems run on the fp32 kernels where PyTorch's half kernels are the slower
    ones (fp16 without native fp16 products; the bf16 causal forward and the larger bf16 full
    forward without AMX): the kernels see the dtype the policy names, and the results match the
    oracle either way."""
    engine = cpu.engine(SMALL_BLOCKS, _cpu(fast_half))
    g = gen(11)
    b, n, h = 2, features.get("n", 24), 2
    q, k, v = (randn((b, n, h, 32), dtype, g) for _ in range(3))
    dout = randn(q.shape, dtype, g)
    slopes = make_slopes((b, h), seed=5) if features.get("alibi") else None
    window = _window(features.get("causal", False))
    params = AttentionParams(0.3, *window)
    result = {}
    calls = _fused_calls(lambda: result.update(zip(("out", "lse", "_"), _layouts.forward(
        engine, q, k, v, params, alibi_slopes=slopes))))
    out, lse = result["out"], result["lse"]
    calls += _fused_calls(lambda: result.update(grads=_layouts.backward(
        engine, dout, q, k, v, out, lse, params, alibi_slopes=slopes)))
    forward_dtypes = {d for name, d in calls if name == "forward"}
    backward_dtypes = {d for name, d in calls if name == "backward"}
    assert (forward_dtypes, backward_dtypes) == ({computed_in[0]}, {computed_in[1]}), calls
    assert out.dtype == dtype and result["grads"][0].dtype == dtype
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, window=window, softmax_scale=0.3,
                                     alibi_slopes=slopes)
    _check_vs_oracle(out, result["grads"], q, k, v, dout, ref, rg, naive, ng, dtype, 0.3)


def test_fused_kernels_run_where_they_apply(monkeypatch):
    """The cpu backend (auto's choice for CPU tensors) calls the fused kernels wherever they apply;
    the reference backend never does."""
    g = gen(7)
    q, k, v = (randn((1, 64, 2, 32), BF16, g, requires_grad=True) for _ in range(3))
    assert _count_fused_calls(lambda: flash_attn_func(q, k, v, causal=True).sum().backward()) == 2
    assert dispatch.last_backend() == "cpu"
    assert _count_fused_calls(lambda: flash_attn_func(q, k, v, window_size=(8, 8))) > 0
    assert _count_fused_calls(lambda: flash_attn_func(q, k, v, softcap=5.0).sum().backward()) == 0
    assert _count_fused_calls(lambda: flash_attn_func(q, k, v, dropout_p=0.1).sum().backward()) == 0
    assert dispatch.last_backend() == "cpu"
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    assert _count_fused_calls(lambda: flash_attn_func(q, k, v, causal=True).sum().backward()) == 0
    assert dispatch.last_backend() == "reference"


def test_mask_blocks_stay_within_the_budget():
    """ALiBi over 4k keys: non-causal builds mask blocks within the mask budget; causal builds
    none (a per-key broadcast row and a per-row lse term instead)."""
    q = torch.zeros(2, 4096, 8, 1)
    problem = _layouts._dense_problem(q, q[:, :, :2], q[:, :, :2], torch.ones(2, 8))
    calls = [c for g in fused.plan(problem, AttentionParams(1.0, -1, -1)) for c in g]
    assert len(calls) > 1 and all(c.masked for c in calls)
    for call in calls:
        assert 4 * 2 * 8 * (call.i1 - call.i0) * (call.c1 - call.c0) <= DEFAULT_TUNING.mask_budget_bytes
    causal = [c for g in fused.plan(problem, AttentionParams(1.0, -1, 0)) for c in g]
    assert [c.masked for c in causal] == [False]
    columns, rows = fused._alibi_columns(problem, causal[0])
    assert columns.shape == (2, 8, 1, 4096) and rows.shape == (2, 8, 4096)


# ----------------------------------------------------------------------------------------------
# Plain dense calls: straight to the one kernel call (cpu.direct_forward)
# ----------------------------------------------------------------------------------------------

# (dtype, sq, sk, h, hk, causal, amx and native fp16, goes straight to the kernel). With
# SMALL_BLOCKS a causal fp32 square of 8 rows or more is cut as a tree, bf16 from 16 rows
# (without AMX, in fp32).
PLAIN_CASES = [
    (FP32, 37, 37, 4, 2, False, False, True),    # full, GQA
    (FP32, 20, 53, 2, 1, False, False, True),    # full, sq < sk
    (BF16, 53, 20, 2, 2, False, False, True),    # full, sq > sk
    (BF16, 40, 36, 2, 2, False, False, False),   # full bf16 from the size its fp32 forward gains, no AMX
    (BF16, 40, 36, 2, 2, False, True, True),     # the same with AMX: one bf16 call
    (FP16, 30, 30, 2, 1, False, True, True),     # fp16 with native products
    (FP16, 30, 30, 2, 1, False, False, False),   # fp16 without: computed in fp32
    (FP32, 7, 7, 2, 1, True, False, True),       # a causal square below the tree's size
    (FP32, 24, 24, 2, 1, True, False, False),    # the fp32 tree
    (BF16, 24, 24, 2, 2, True, True, True),      # bf16 causal with AMX: one call each way
    (BF16, 24, 24, 2, 2, True, False, False),    # without AMX: the fp32 tree forward
    (BF16, 12, 12, 2, 2, True, False, True),     # below the size the bf16 forward gains from the tree
    (FP32, 20, 33, 2, 1, True, False, False),    # bottom-right causal, sq < sk: two calls
    (FP32, 33, 20, 2, 1, True, False, False),    # sq > sk: rows without keys
]


def _went_straight(out: torch.Tensor) -> bool:
    """Whether autograd recorded PyTorch's own formula for the fused kernel (the direct route of
    plain calls) rather than this package's (the op and the general plan)."""
    fn = out.grad_fn
    while fn is not None and fn.name().startswith("Transpose"):
        fn = fn.next_functions[0][0]
    return fn is not None and "FlashAttentionForCpu" in fn.name()


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A tracing-like mode: calls under it take the op (and the general plan), never the direct route."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype, sq, sk, h, hk, causal, fast_cpu, direct", PLAIN_CASES, ids=str)
def test_plain_calls_go_straight_to_the_kernel(dtype, sq, sk, h, hk, causal, fast_cpu, direct):
    """The plain calls whose general plan is one kernel call in their own dtype skip the op, the
    dispatcher and the plan (``cpu.direct_forward`` answers them; for the engine of SMALL_BLOCKS on
    a CPU with or without AMX and native fp16 here); the results match the oracle, and match the
    general path's exactly (the same kernel calls, forward and backward)."""
    tuning, features = SMALL_BLOCKS, _cpu(fast_cpu)
    engine = cpu.engine(tuning, features)
    g = gen(sq * 7 + sk)
    q = randn((2, sq, h, 32), dtype, g, requires_grad=True)
    k, v = (randn((2, sk, hk, 32), dtype, g, requires_grad=True) for _ in range(2))
    dout = randn(q.shape, dtype, g)
    window = _window(causal)
    params = AttentionParams(0.3, *window)
    straight = cpu.direct_forward(q, k, v, None, None, None, None, sq, sk, 0.3, *window, 0.0, 0.0, False, False,
                                  tuning=tuning, features=features)
    assert (straight is not None) == direct
    if direct:  # autograd records PyTorch's own formula for the kernel
        out = straight[0]
        assert _went_straight(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    else:
        out, _, grads = _forward_backward(engine, q, k, v, dout, params)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()

    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, window=window, softmax_scale=0.3)
    _check_vs_oracle(out, grads, q, k, v, dout, ref, rg, naive, ng, dtype, 0.3)

    if direct:  # the general path makes the very same kernel calls
        general, _, general_grads = _forward_backward(engine, q, k, v, dout, params)
        assert torch.equal(general, out)
        for general_grad, grad in zip(general_grads, grads):
            assert torch.equal(general_grad, grad)


def test_only_plain_eager_cpu_backend_calls_go_straight_to_the_kernel(monkeypatch):
    """Every option the kernel cannot compute, every backend but cpu (the reference included) and
    tracing modes all take the general path (which is still right)."""
    g = gen(3)
    q, k, v = (randn((1, 16, 2, 32), FP32, g, requires_grad=True) for _ in range(3))
    slopes = make_slopes((2,), seed=1)

    def check(expected: bool, **options):
        out = flash_attn_func(q, k, v, **options)
        out = out[0] if isinstance(out, tuple) else out
        assert _went_straight(out) == expected, options

    check(True)
    assert dispatch.last_backend() == "cpu"
    check(True, causal=True, deterministic=True)
    for options in ({"window_size": (4, 4)}, {"window_size": (-1, 3)}, {"window_size": (5, 0)},
                    {"alibi_slopes": slopes}, {"softcap": 3.0}, {"dropout_p": 0.1}, {"return_attn_probs": True}):
        check(False, **options)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    assert not _went_straight(flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 16, 16))

    with _PassThrough():
        check(False)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    check(False)
    assert dispatch.last_backend() == "reference"
    if dispatch.unavailable_reason("interpret", q.device) is None:
        monkeypatch.setenv("FLASH_ATTN_BACKEND", "interpret")
        half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
        assert cpu.direct_forward(*half, None, None, None, None, 16, 16, 32 ** -0.5, -1, -1, 0.0, 0.0, False, False)
        out = flash_attn_func(*half)  # bf16: the interpreted kernels take it, and it would go straight on cpu
        assert not _went_straight(out) and dispatch.last_backend() == "interpret"
        ref, _, naive, _ = oracle_pair(attention_ref, half)
        check_close(out, ref.out, naive.out, BF16, "out")
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "cpu")
    check(True)


def test_plain_calls_record_autograd_only_when_asked():
    g = gen(4)
    q, k, v = (randn((1, 16, 2, 32), FP32, g, requires_grad=True) for _ in range(3))
    assert flash_attn_func(q, k, v).grad_fn is not None
    with torch.no_grad():
        assert flash_attn_func(q, k, v).grad_fn is None
    with torch.inference_mode():
        out = flash_attn_func(q, k, v)
    assert out.grad_fn is None and out.is_inference()
    assert flash_attn_func(q.detach(), k.detach(), v.detach()).grad_fn is None
