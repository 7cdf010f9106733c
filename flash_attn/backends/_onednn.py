"""PyTorch's fused CPU attention kernel, recomputed tile by tile on oneDNN's fp32 matrix products,
for CPUs where PyTorch's BLAS multiplies fp32 matrices at a fraction of the CPU's speed.

PyTorch multiplies fp32 matrices on the CPU with its BLAS (MKL in the x86 wheels), and so does
its fused attention kernel. On AMD CPUs MKL takes its AVX2 code path even where the CPU has
AVX-512, and oneDNN (which PyTorch also ships: ``mkldnn::_linear_pointwise``) multiplies about
twice as fast there, with the same largest error against float64 (benchmarks/README.md).

:func:`forward` and :func:`backward` compute exactly the contract of
``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward for what
:mod:`._cpu_fused` asks of them: ``(B, h, s, d)`` fp32 inputs (bf16 ones converted block by block
or head by head, computed in fp32), GQA (query head ``j`` reads key
head ``j // (h // hk)``), the top-left causal mask, the natural-log log-sum-exp, and a backward
that takes the caller's ``out`` and ``lse``. Per query head, blocks of 128-256 rows meet blocks
of 2048 keys (a score tile of 1-2 MiB; the sizes are the tuning's ``onednn_*``:
:class:`._reference_core.Tuning`); the softmax runs online across key blocks; causal rows
skip the key blocks they cannot see and mask only the block on their diagonal. The scale is
folded into q in base 2, so a tile's probabilities are one subtraction and one ``exp2``. The
backward's dQ product runs on PyTorch's BLAS, which reads the transposed tile without a copy.

Whether this runs is measured, not guessed (:func:`faster_here`): where the two libraries tie
(expected where MKL runs at the CPU's full width, as on Intel CPUs, or the CPU has no AVX-512; not
measured here) the fused kernel stays.

Known cost: oneDNN's product has no ``out=``, so every score tile is a fresh tensor, and glibc
returns and refaults some of that memory from call to call (a library should not tell glibc to
keep its memory for its process).
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Optional

import torch
from torch import Tensor

from flash_attn.backends._reference_core import DEFAULT_TUNING, Tuning, softcap_scores_

# "auto" (default): where :func:`faster_here` says so; "1": wherever it applies; "0": never.
MODE_ENV = "FLASH_ATTN_CPU_ONEDNN"
# auto mode uses oneDNN where its products are at least this much faster than the BLAS's
# (:func:`faster_here`) ...
REQUIRED_PRODUCT_SPEEDUP = 1.5
# ... with at most this many threads (the counts measured), and with more than one thread
# only from MULTI_THREAD_MIN rows and keys: the tile loop parallelises less well than the fused
# kernel's loop over heads and row blocks.
MAX_AUTO_THREADS = 2
MULTI_THREAD_MIN = 4096

_LOG2E = math.log2(math.e)


def _linear_op():
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    try:
        return op.default if op is not None and torch.backends.mkldnn.is_available() else None
    except AttributeError:  # an op namespace that does not have the overload
        return None


# oneDNN's fp32 product (``mkldnn::_linear_pointwise``), or None where this PyTorch has none.
LINEAR = _linear_op()


def _mm(linear, x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` in fp32 on oneDNN (``linear``: :data:`LINEAR`). ``w`` must be contiguous: a
    strided one takes oneDNN's reference path, three orders of magnitude slower."""
    return linear(x, w, None, "none", [], "")


class _TransposedBlocks:
    """``x (s, d)`` as contiguous ``(d, cols)`` weights, the ones that multiply a tile by rows
    ``c0:c1`` of ``x``: whole blocks of ``block`` rows (the tiles' keys) are made once, a causal
    tile's shorter block is copied when asked for (a strided weight would be slow, :func:`_mm`)."""

    def __init__(self, x: Tensor, block: int):
        self.x, self.block = x, block
        self.blocks = [_fp32_copy(x[c0:c0 + block].t()) for c0 in range(0, x.shape[0], block)]

    def __getitem__(self, cols: tuple[int, int]) -> Tensor:
        c0, c1 = cols
        block = self.blocks[c0 // self.block]
        return block if block.shape[1] == c1 - c0 else _fp32_copy(self.x[c0:c1].t())


def _fp32_copy(x: Tensor) -> Tensor:
    """A contiguous fp32 copy of ``x``: layout and dtype changed in one pass."""
    return torch.empty(x.shape, dtype=torch.float32).copy_(x)


def applies(rows: int, cols: int, tuning: Tuning = DEFAULT_TUNING, linear=LINEAR, faster=None) -> bool:
    """Whether a call of ``rows`` queries and ``cols`` keys (CPU, no mask, a dtype it takes) runs
    here, with oneDNN's product ``linear`` (None: none) and ``faster(threads)`` saying whether it
    is much faster than the BLAS (:func:`faster_here` when not given)."""
    if linear is None or rows < tuning.onednn_min_rows or cols < tuning.onednn_min_cols:
        return False
    chosen = mode()
    if chosen != "auto":
        return chosen == "1"
    threads = torch.get_num_threads()
    if threads > MAX_AUTO_THREADS or (threads > 1 and min(rows, cols) < MULTI_THREAD_MIN):
        return False
    return (faster or faster_here)(threads)


_MODES = {"auto": "auto", "": "auto", "1": "1", "on": "1", "true": "1", "yes": "1", "0": "0", "off": "0",
          "false": "0", "no": "0"}


def mode() -> str:
    """``FLASH_ATTN_CPU_ONEDNN`` as ``"auto"``, ``"1"`` or ``"0"``; ValueError for anything else."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower()
    if value not in _MODES:
        raise ValueError(f"{MODE_ENV}={value!r} is not a setting; expected auto, 1 or 0")
    return _MODES[value]


def settings_error():
    """Why ``FLASH_ATTN_CPU_ONEDNN`` is invalid, or None (the cpu backend's settings check)."""
    try:
        mode()
    except ValueError as exc:
        return str(exc)
    return None


@functools.cache
def faster_here(threads: int) -> bool:
    """Whether oneDNN's fp32 products are much faster than PyTorch's BLAS on this CPU with
    ``threads`` threads: the cause of this module's gain, and a property of the CPU and the BLAS,
    so the choice does not flip from run to run.

    One (256, 64) x (64, 2048) product of each, five alternating rounds after a warm-up, fastest
    of each (~10 ms once per process). Its own generator leaves the global RNG alone.
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(DEFAULT_TUNING.onednn_full_forward_rows, 64, generator=generator)
    w = torch.randn(DEFAULT_TUNING.onednn_cols, 64, generator=generator)
    times = {"blas": [], "onednn": []}
    try:
        with torch.no_grad():
            for round_ in range(6):
                for name, call in (("blas", lambda: torch.mm(a, w.t())), ("onednn", lambda: _mm(LINEAR, a, w))):
                    start = time.perf_counter()
                    call()
                    if round_:
                        times[name].append(time.perf_counter() - start)
    except (RuntimeError, TypeError):  # an internal op whose schema changed: keep the fused kernel
        return False
    return min(times["onednn"]) * REQUIRED_PRODUCT_SPEEDUP <= min(times["blas"])


def warm_up() -> None:
    """A process's one-time set-up: oneDNN's first product (its library state, ~15 MiB of memory)
    and :func:`faster_here`'s probe, so that a benchmark does not count them as a call's."""
    if LINEAR is not None:
        faster_here(torch.get_num_threads())


def _check(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, attn_mask: Optional[Tensor],
           dtypes: tuple[torch.dtype, ...]) -> None:
    if dropout_p != 0 or attn_mask is not None:
        raise ValueError("the oneDNN attention kernels take no dropout and no explicit mask")
    if not (q.dtype == k.dtype == v.dtype and q.dtype in dtypes) or q.device.type != "cpu":
        names = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"this oneDNN attention kernel takes {names} CPU tensors of one dtype")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads")


@functools.lru_cache(maxsize=4)
def _upper_triangle(n: int) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool).triu_(1)


def _above_diagonal(rows: int, cols: int, tile_rows: int) -> Tensor:
    """Where column ``j > i`` in a causal tile's ``rows x cols`` part that starts at its first
    row's diagonal (the rest of the tile is visible to every row); tiles of ``tile_rows`` rows."""
    return _upper_triangle(tile_rows)[:rows, :cols]


@functools.lru_cache(maxsize=4)
def _lower_triangle(n: int) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril_(-1)


def _below_diagonal(cols: int, rows: int, tile_rows: int) -> Tensor:
    """:func:`_above_diagonal` transposed: where key ``j > i`` in a transposed causal tile's
    ``cols x rows`` part."""
    return _lower_triangle(tile_rows)[:cols, :rows]


def _key_blocks(i0: int, i1: int, sk: int, causal: bool, block: int):
    """``(c0, c1, masked)`` of the key blocks of ``block`` keys that rows ``i0:i1`` see; with the
    top-left causal mask row ``i`` sees keys ``<= i``, and the tiles' rows dividing ``block``
    puts every masked block's first key at or left of its first row: no row of a tile sees
    nothing, and the hidden part lies in the tile's last ``c1 - i0`` columns
    (:func:`_above_diagonal`)."""
    end = min(sk, i1) if causal else sk
    for c0 in range(0, end, block):
        c1 = min(end, c0 + block)
        yield c0, c1, causal and c1 - 1 > i0


class _Softcap:
    """Softcap ``c * tanh(x / c)`` on one call's base-2 scores (q is multiplied by ``q_scale``, so
    that its products are ``u = 2x / c``), in one of two forms, chosen by the call's bound of the
    raw scores, ``scale * max |q_i| * max |k_j|``:

    * ``c`` at most 4 times that bound: ``2c * sigmoid(u)``, one fast pass. It is the softcapped
      score plus ``c`` (every score shifted alike: the softmax ignores it, ``shift`` takes it out of
      lse), within ``c * eps`` of it: 4 ulp of the largest score the call can have;
    * a larger ``c``, where ``c * eps`` would dwarf the scores (as ``x / c`` tends to 0 the softcap
      tends to ``x``): the exact ``expm1`` form of
      :func:`~flash_attn.backends._reference_core.softcap_scores_`.
    """

    def __init__(self, softcap: float, scale: float, q: Tensor, k: Tensor):
        self.q_scale = 2.0 * scale / softcap
        self.out = softcap * _LOG2E
        bound = abs(scale) * float(_row_norms_max(q)) * float(_row_norms_max(k))
        self.sigmoid = softcap <= 4.0 * bound  # False for a NaN bound: the exact form
        self.shift = self.out if self.sigmoid else 0.0
        # the sigmoid form's derivative is sigmoid (1 - sigmoid) = (1 - tanh^2) / 4
        self.derivative_scale = 4.0 if self.sigmoid else 1.0

    def scores_(self, s: Tensor, keep_derivative: bool = False) -> tuple[Tensor, float, Optional[Tensor]]:
        """The products ``s`` made softcapped base-2 scores, in place, up to a factor:
        ``(scores / factor, factor, derivative over derivative_scale or None)``; the scores include
        ``shift``. (The callers multiply by the factor in the pass that takes the softmax's shift.)"""
        if not self.sigmoid:
            t, derivative = softcap_scores_(s, 1.0, torch.empty_like(s), keep_derivative)
            return t, self.out, derivative
        sigmoid = s.sigmoid_()
        derivative = torch.addcmul(sigmoid, sigmoid, sigmoid, value=-1.0) if keep_derivative else None
        return sigmoid, 2.0 * self.out, derivative


def _row_norms_max(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).amax()


@torch.no_grad()
def forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, is_causal: bool = False, *,
            attn_mask: Optional[Tensor] = None, scale: Optional[float] = None, softcap: float = 0.0,
            tuning: Tuning = DEFAULT_TUNING, linear=LINEAR) -> tuple[Tensor, Tensor]:
    """``(out (B, h, sq, d), lse fp32 (B, h, sq))`` as the fused kernel's forward, computed in
    fp32; bf16 inputs are converted block by block, and only ``out`` is rounded back to bf16.
    ``softcap``: scores ``c * tanh(x / c)`` (0: none), which the fused kernel has no counterpart
    for. ``tuning``: the tile sizes; ``linear``: oneDNN's product (:data:`LINEAR`)."""
    _check(q, k, v, dropout_p, attn_mask, (torch.float32, torch.bfloat16))
    B, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = h // hk
    scale = d ** -0.5 if scale is None else scale
    capped = _Softcap(softcap, scale, q, k) if softcap > 0 else None
    c = capped.q_scale if capped else scale * _LOG2E  # scores in base 2
    out = torch.empty(B, sq, h, v.shape[-1], dtype=q.dtype).transpose(1, 2)
    lse = torch.empty(B, h, sq, dtype=torch.float32)
    rows = tuning.onednn_rows if is_causal else tuning.onednn_full_forward_rows
    block = tuning.onednn_cols
    for b in range(B):
        for jk in range(hk):
            k_head = _fp32_copy(k[b, jk])
            v_cols = _TransposedBlocks(v[b, jk], block)  # P @ V is linear(P, V^T)
            for j in range(jk * group, (jk + 1) * group):
                q_head = _fp32_copy(q[b, j]).mul_(c)
                for i0 in range(0, sq, rows):
                    i1 = min(sq, i0 + rows)
                    m = total = acc = None
                    for c0, c1, masked in _key_blocks(i0, i1, sk, is_causal, block):
                        s = _mm(linear, q_head[i0:i1], k_head[c0:c1])
                        factor = 1.0  # the base-2 scores are factor * s
                        if capped:
                            s, factor, _ = capped.scores_(s)
                        if masked:
                            s[:, i0 - c0:].masked_fill_(_above_diagonal(i1 - i0, c1 - i0, rows), float("-inf"))
                        block_max = s.amax(-1, keepdim=True).mul_(factor)
                        if m is None:
                            m = block_max
                        else:
                            new_m = torch.maximum(m, block_max)
                            alpha = torch.exp2(m - new_m)
                            m = new_m
                        p = torch.add(m.neg(), s, alpha=factor, out=s).exp2_()  # exp2(factor * s - m), one pass
                        part = _mm(linear, p, v_cols[c0, c1])
                        if acc is None:
                            acc, total = part, p.sum(-1, keepdim=True)
                        else:
                            acc.mul_(alpha).add_(part)
                            total = total.mul_(alpha).add_(p.sum(-1, keepdim=True))
                    out[b, j, i0:i1] = acc.div_(total)
                    lse[b, j, i0:i1] = (m + total.log2() - (capped.shift if capped else 0.0)).squeeze(-1) / _LOG2E
    return out, lse


@torch.no_grad()
def backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, logsumexp: Tensor,
             dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask: Optional[Tensor] = None,
             scale: Optional[float] = None, softcap: float = 0.0, tuning: Tuning = DEFAULT_TUNING,
             linear=LINEAR, grad_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` as the fused kernel's backward: the probabilities come from the given
    ``logsumexp`` and the correction term from the given ``out``. bf16 inputs are converted head
    by head and computed as their fp32 values are (PyTorch's bf16 backward kernel is the quicker
    one without softcap); the gradients are summed in fp32 and rounded once to ``grad_dtype``.
    ``softcap``, ``tuning`` and ``linear`` as :func:`forward`'s."""
    _check(q, k, v, dropout_p, attn_mask, (torch.float32, torch.bfloat16))
    B, h, sq, d = q.shape
    hk, sk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    group = h // hk
    scale = d ** -0.5 if scale is None else scale
    capped = _Softcap(softcap, scale, q, k) if softcap > 0 else None
    c = capped.q_scale if capped else scale * _LOG2E
    grad_scale = scale * (capped.derivative_scale if capped else 1.0)
    dq = torch.empty(B, sq, h, d, dtype=grad_dtype).transpose(1, 2)
    dk = torch.empty(B, sk, hk, d, dtype=grad_dtype).transpose(1, 2)
    dv = torch.empty(B, sk, hk, dv_dim, dtype=grad_dtype).transpose(1, 2)
    # one head's fp32 sums, reused from head to head
    dq_head, dk_head, dv_head = torch.empty(sq, d), torch.empty(sk, d), torch.empty(sk, dv_dim)
    neg_lse2 = logsumexp * -_LOG2E - (capped.shift if capped else 0.0)  # in the scores' units
    rows, block = tuning.onednn_rows, tuning.onednn_cols
    for b in range(B):
        for jk in range(hk):
            k_head, v_head = _fp32_copy(k[b, jk]), _fp32_copy(v[b, jk])
            dk_head.zero_()
            dv_head.zero_()
            for j in range(jk * group, (jk + 1) * group):
                q_head, do_head = _fp32_copy(q[b, j]), _fp32_copy(grad_out[b, j])
                q_scaled = q_head * c
                delta = (do_head * out[b, j]).sum(-1)  # rowsum(dO * O) in fp32
                dq_head.zero_()
                for i0 in range(0, sq, rows):
                    i1 = min(sq, i0 + rows)
                    q_cols = q_head[i0:i1].t().contiguous()
                    do_rows = do_head[i0:i1]
                    do_cols = do_rows.t().contiguous()
                    neg_lse2_row, delta_row = neg_lse2[b, j, i0:i1].view(1, -1), delta[i0:i1].view(1, -1)
                    for c0, c1, masked in _key_blocks(i0, i1, sk, is_causal, block):
                        # the tile transposed, (keys, rows): dV and dK take it as it is, and dQ
                        # from the BLAS, which reads it transposed without a copy (oneDNN copies a
                        # strided operand, and K^T's columns of a causal tile too: measured slower)
                        s = _mm(linear, k_head[c0:c1], q_scaled[i0:i1])
                        derivative, factor = None, 1.0
                        if capped:
                            s, factor, derivative = capped.scores_(s, keep_derivative=True)
                        p = torch.add(neg_lse2_row, s, alpha=factor, out=s).exp2_()
                        if masked:
                            p[i0 - c0:].masked_fill_(_below_diagonal(c1 - i0, i1 - i0, rows), 0.0)
                        dv_head[c0:c1] += _mm(linear, p, do_cols)
                        ds = _mm(linear, v_head[c0:c1], do_rows).sub_(delta_row).mul_(p)
                        if derivative is not None:
                            ds.mul_(derivative)  # d(c tanh(x / c)) / dx
                        dk_head[c0:c1] += _mm(linear, ds, q_cols)
                        dq_head[i0:i1].addmm_(ds.t(), k_head[c0:c1])
                dq[b, j] = dq_head.mul_(grad_scale)
            dk[b, jk] = dk_head.mul_(grad_scale)
            dv[b, jk] = dv_head
    return dq, dk, dv
