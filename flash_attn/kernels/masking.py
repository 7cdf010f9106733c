"""Where the mask is computed: which (query, key) pairs are visible, ALiBi, softcap, tile ranges.

Every Triton kernel of the package (forward, backward, decode) takes its masking from here, so
the rule lives in one place. Positions are 0-based *inside one sequence*; with ``sq`` queries
and ``sk`` keys, the diagonal offset is ``sk - sq`` (bottom-right alignment) and query ``i``
sees key ``j`` iff::

    0 <= i < sq,  0 <= j < sk,
    i + (sk - sq) - window_left <= j <= i + (sk - sq) + window_right

where a negative window bound means "unbounded on that side" (``-1`` in
:class:`flash_attn.params.AttentionParams`). ``causal`` is the window ``(-1, 0)``, so kernels
need a single ``IS_LOCAL`` flag for both causal and sliding-window attention.

Two kinds of helper:

* element-wise rules (``*_at``): ``q_pos`` and ``k_pos`` are integer tensors that broadcast
  against each other, so a kernel may lay its tile out as (queries x keys) or, like the dK/dV
  kernel, as (keys x queries).
* tile ranges (``key_block_range``/``query_block_range``): which key (or query) tiles a block can
  see at all, split into the tiles that need the element-wise mask and the interior tiles that
  are fully visible (and fully in bounds), so kernels skip every fully masked tile and only pay
  for masking on the edges.

All integer arithmetic here avoids dividing negative numbers: the GPU truncates towards zero but
Triton's interpreter floors, so values are clamped to ``>= 0`` before every ``//``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


# ---------------------------------------------------------------------------------------------
# Element-wise rules.


@triton.jit
def window_bounds(seqlen_q, seqlen_k, window_left, window_right):
    """``(lowest, highest)``: query ``i`` sees key ``j`` (both in bounds) iff
    ``lowest <= j - i <= highest``, the window as two scalars per sequence.

    An unbounded side (``-1``) gets a bound that no in-bounds ``j - i`` crosses (``-seqlen_q``,
    ``seqlen_k``), and a side wider than that is clamped to it: the same window, with every sum
    inside int32 (a window near ``2**31`` wrapped around and masked every key)."""
    diag = seqlen_k - seqlen_q
    lowest = tl.where(window_left >= 0, diag - tl.minimum(window_left, seqlen_k), -seqlen_q)
    highest = tl.where(window_right >= 0, diag + tl.minimum(window_right, seqlen_q), seqlen_k)
    return lowest, highest


@triton.jit
def visible_at(q_pos, k_pos, seqlen_q, seqlen_k, window_left, window_right, IS_LOCAL: tl.constexpr):
    """Bool: query ``q_pos`` sees key ``k_pos`` (broadcasting; bounds and window, see module doc)."""
    ok = (q_pos < seqlen_q) & (k_pos < seqlen_k)
    if IS_LOCAL:
        # per query the first and last key it sees, then two compares per element
        lowest, highest = window_bounds(seqlen_q, seqlen_k, window_left, window_right)
        ok = ok & (k_pos >= q_pos + lowest) & (k_pos <= q_pos + highest)
    return ok


@triton.jit
def alibi_bias_at(slope, q_pos, k_pos, seqlen_q, seqlen_k):
    """fp32 ALiBi bias ``-slope * |q_pos + sk - sq - k_pos|`` (broadcasting).

    Pass ``slope * log2(e)`` to get the bias in the base-2 units of an exp2 softmax.
    """
    dist = (q_pos + (seqlen_k - seqlen_q) - k_pos).to(tl.float32)
    return -slope * tl.abs(dist)


# tanh's odd polynomial below TANH_POLY_BOUND: tanh(x) = x + x^3 (c1 + c2 x^2 + ... + c5 x^8), fitted
# (least squares on Chebyshev nodes) to tanh's relative error over [0, 0.5625]: under 1 ulp in fp32
# there, and 1 - 2 / (e^2x + 1) under 2 ulp above (tests/kernels/test_softcap_tanh.py measures both).
TANH_POLY_BOUND = tl.constexpr(0.5625)
TANH_C1 = tl.constexpr(-0.33333313)
TANH_C2 = tl.constexpr(0.13332427)
TANH_C3 = tl.constexpr(-0.05383512)
TANH_C4 = tl.constexpr(0.02099918)
TANH_C5 = tl.constexpr(-0.006169445)


@triton.jit
def tanh(x):
    """fp32 ``tanh`` within 2 ulp everywhere: ``1 - 2 / (2**(2|x| log2 e) + 1)`` (one ``exp2``) where
    ``|x| >= 0.5625``, an odd polynomial below, where that form cancels (its error is ~eps / |x|
    relative: softcap ``c * tanh(x / c)`` lost all precision as ``c`` grew). Limits +-1 at +-inf; NaN
    stays NaN."""
    z = x * x
    poly = x + x * z * (TANH_C1 + z * (TANH_C2 + z * (TANH_C3 + z * (TANH_C4 + z * TANH_C5))))
    size = tl.abs(x)
    large = 1.0 - 2.0 / (tl.math.exp2(size * (2.0 * LOG2E)) + 1.0)
    return tl.where(size < TANH_POLY_BOUND, poly, tl.where(x < 0.0, -large, large))


# ---------------------------------------------------------------------------------------------
# Tile ranges. Each returns ``(lo, mid_lo, mid_hi, hi)``: the block visits
# ``[lo, mid_lo)`` with the mask, ``[mid_lo, mid_hi)`` without it and ``[mid_hi, hi)`` with it
# again (tile starts step by the tile size from ``lo``); nothing outside ``[lo, hi)`` is visible.


@triton.jit
def _floor_to(x, BLOCK: tl.constexpr):
    return (tl.maximum(x, 0) // BLOCK) * BLOCK


@triton.jit
def _ceil_to(x, BLOCK: tl.constexpr):
    return ((tl.maximum(x, 0) + BLOCK - 1) // BLOCK) * BLOCK


@triton.jit
def _ordered_range(lo, mid_lo, mid_hi, hi, empty):
    """Clamp to ``lo <= mid_lo <= mid_hi <= hi``; an ``empty`` block gets the empty range at ``lo``."""
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.maximum(tl.minimum(mid_hi, hi), mid_lo)
    hi = tl.where(empty, lo, hi)
    mid_lo = tl.where(empty, lo, mid_lo)
    mid_hi = tl.where(empty, lo, mid_hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def key_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr):
    """Key positions that the query rows ``[start_m, start_m + BLOCK_M)`` must visit.

    Interior key tiles ``[mid_lo, mid_hi)`` lie inside ``[0, seqlen_k)`` and are visible to
    every valid row of the block, so they need no mask. Rows at or beyond ``seqlen_q`` do not
    count (their results are never stored).
    """
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    lo = start_m * 0
    hi = seqlen_k + lo
    mid_lo = lo
    mid_hi = _floor_to(seqlen_k, BLOCK_N)
    if IS_LOCAL:
        # every row of the block together: keys [start_m + lowest, last_m + highest] (an
        # unbounded side reaches past the sequence and clamps to it; no branch: Triton's warp
        # specialisation takes none into its loop's bounds)
        lowest, highest = window_bounds(seqlen_q, seqlen_k, window_left, window_right)
        lo = _floor_to(start_m + lowest, BLOCK_N)
        mid_lo = _ceil_to(last_m + lowest, BLOCK_N)
        hi = tl.minimum(tl.maximum(last_m + highest + 1, 0), seqlen_k)
        mid_hi = _floor_to(tl.minimum(start_m + highest + 1, seqlen_k), BLOCK_N)
    # a block without valid rows visits nothing
    return _ordered_range(lo, mid_lo, mid_hi, hi, last_m < start_m)


@triton.jit
def query_block_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr):
    """Query positions that see any key of ``[start_n, start_n + BLOCK_N)`` (for dK/dV).

    Interior query tiles ``[mid_lo, mid_hi)`` lie inside ``[0, seqlen_q)`` and see every valid
    key of the block. Keys at or beyond ``seqlen_k`` do not count (never stored).
    """
    last_n = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    lo = start_n * 0
    hi = seqlen_q + lo
    mid_lo = lo
    mid_hi = _floor_to(seqlen_q, BLOCK_M)
    if IS_LOCAL:
        # query i sees key j iff j - highest <= i <= j - lowest
        lowest, highest = window_bounds(seqlen_q, seqlen_k, window_left, window_right)
        lo = _floor_to(start_n - highest, BLOCK_M)
        mid_lo = _ceil_to(last_n - highest, BLOCK_M)
        hi = tl.minimum(tl.maximum(last_n - lowest + 1, 0), seqlen_q)
        mid_hi = _floor_to(tl.minimum(start_n - lowest + 1, seqlen_q), BLOCK_M)
    return _ordered_range(lo, mid_lo, mid_hi, hi, last_n < start_n)


# ---------------------------------------------------------------------------------------------
# Scores -> logits.


@triton.jit
def score_scalars(softmax_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Per-program scalars of :func:`logits_log2`: ``(qk_scale_log2, cap_on, cap_in, cap_out_log2)``.

    ``cap_on`` is ``softcap > 0``; with it off the cap scalars are finite placeholders (never a
    division by zero) that :func:`logits_log2` does not use.
    """
    qk_scale_log2 = softmax_scale * LOG2E
    cap_on = softcap > 0.0
    cap_in = softmax_scale * 1.0
    cap_out_log2 = qk_scale_log2 * 0.0 + LOG2E
    if HAS_SOFTCAP:
        safe_cap = tl.where(cap_on, softcap, 1.0)
        cap_in = softmax_scale / safe_cap
        cap_out_log2 = safe_cap * LOG2E
    return qk_scale_log2, cap_on, cap_in, cap_out_log2


@triton.jit
def logits_log2(qk, q_pos, k_pos, seqlen_q, seqlen_k, qk_scale_log2, cap_on, cap_in, cap_out_log2, slope_log2,
                window_left, window_right, MASKED: tl.constexpr, IS_LOCAL: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Logits in base-2 units from raw fp32 dot products ``qk`` (any tile orientation).

    ``logit = softcap(scale * qk) + alibi`` times ``log2(e)``, ``-inf`` where ``MASKED`` and not
    :func:`visible_at`. Scalars come precomputed per program: ``qk_scale_log2 = scale * log2 e``;
    with softcap ``cap_in = scale / softcap`` and ``cap_out_log2 = softcap * log2 e``;
    ``slope_log2 = slope * log2 e``. Returns ``(logits, t)`` with ``t = tanh(qk * cap_in)`` (the
    backward's softcap derivative is ``1 - t**2``; ``t`` is unused and free without softcap).

    ``HAS_SOFTCAP`` compiles softcapping in; the run-time ``cap_on`` (``softcap > 0``) decides per
    launch, so one compiled kernel serves calls with and without it (``t`` is then 0). A zero
    ALiBi slope adds exactly nothing.
    """
    if HAS_SOFTCAP:
        # selects on a uniform scalar, not a branch: a run-time `if` around tensors doubles the
        # live tiles and made the backward kernels spill (sm_80 d128 dQ: 1440 B of stack)
        t = tl.where(cap_on, tanh(qk * cap_in), 0.0)
        s = tl.where(cap_on, t * cap_out_log2, qk * qk_scale_log2)
    else:
        t = qk
        s = qk * qk_scale_log2
    if HAS_ALIBI:
        s = s + alibi_bias_at(slope_log2, q_pos, k_pos, seqlen_q, seqlen_k)
    if MASKED:
        s = tl.where(visible_at(q_pos, k_pos, seqlen_q, seqlen_k, window_left, window_right, IS_LOCAL),
                     s, float("-inf"))
    return s, t
