"""Counter-based dropout RNG shared by every backend.

The keep/drop decision for one attention-probability entry is a *pure function* of
``(seed, batch, head, row, col)``. Nothing depends on how a backend tiles the work, so the
backward pass regenerates exactly the forward's mask, and a Triton kernel and the PyTorch
reference draw the same mask.

Algorithm (bit-identical to Triton's ``tl.philox`` / ``tl.uint_to_uniform_float``)
-------------------------------------------------------------------------------
* Philox4x32 with 10 rounds, key ``(seed & 0xffffffff, (seed >> 32) & 0xffffffff)``.
* Counter words ``(c0, c1, c2, c3) = (col, row, head, batch)``: ``col``/``row`` are the key/query
  positions *inside the sequence* (for varlen: relative to the sequence start), ``head`` is the
  query head index, ``batch`` the batch (varlen: sequence) index. Each must lie in ``[0, 2**32)``.
* Only the first output word is used; it becomes a float in ``[0, 1)`` exactly as Triton's
  ``uint_to_uniform_float`` does it: reinterpret as int32, fold negatives with ``~x``, convert to
  fp32 and multiply by the fp32 constant ``4.6566127342e-10``.
* The entry is kept iff ``uniform >= p`` (with ``p`` rounded to fp32), so ``p = 0`` keeps all.

The equivalent Triton code for a tile is::

    r, _, _, _ = tl.philox(seed, cols, rows, head, batch)   # int32/uint32 counters
    keep = tl.uint_to_uniform_float(r) >= p

``tests/kernels/test_dropout_rng.py`` checks bit-equality against Triton's interpreter.

Why int64 arithmetic: PyTorch has no full uint32 arithmetic, so every 32-bit word lives in an
int64 tensor masked to 32 bits. The readable :func:`philox4x32` splits the 32x32->64-bit
multiply into 16-bit halves (each partial product stays below 2**48, no overflow).

What the backends call, :func:`keep_mask`, computes the same first word with far fewer passes
(measured on one thread, a 4 x 64 x 512 tile: see :func:`philox_first_word`): the 64-bit product
is taken as the int64 multiply's wrapped result, whose bits are the exact product's (checked
once, on the CPU; other devices use the split); the rounds after the counters stop broadcasting
run in place on five int64 buffers the caller may lend; the last two rounds compute only what
the first word needs; and ``uniform >= p`` becomes an integer range check around the smallest
kept word.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

__all__ = [
    "philox4x32", "philox_first_word", "uint32_to_uniform_float", "dropout_uniform", "keep_mask", "smallest_kept_word",
]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF

# Philox4x32 constants (the same ones Triton uses for 32-bit counters).
_PHILOX_KEY_A = 0x9E3779B9  # key schedule increments (golden ratio, sqrt(3) - 1)
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53  # round multipliers
_PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10

# Largest fp32 such that (2**31 - 1) * scale < 1.0 after rounding (Triton's choice).
_UNIFORM_SCALE = 4.6566127342e-10

IntOrTensor = Union[int, torch.Tensor]


def _mul_hi_lo(a: torch.Tensor, const: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * const`` for ``a`` in ``[0, 2**32)`` (int64 tensor).

    ``a`` is split into 16-bit halves so each partial product is below ``2**48`` and the int64
    arithmetic never overflows.
    """
    t_lo = (a & 0xFFFF) * const  # < 2**48
    t_hi = (a >> 16) * const  # < 2**48
    # a * const == t_hi * 2**16 + t_lo
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & _MASK32
    return hi, lo


def philox4x32(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    seed: IntOrTensor,
    rounds: int = PHILOX_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-``rounds`` of the counter ``(c0, c1, c2, c3)`` under the 64-bit key ``seed``.

    Counters are int64 tensors holding values in ``[0, 2**32)`` (they broadcast); returns the
    four output words the same way. Matches ``triton.language.philox(seed, c0, c1, c2, c3)``.
    ``seed`` is an int or a one-element int64 tensor (the forward's ``rng_state``, read where it
    lives: on a GPU the key stays on the device, nothing waits for it).
    """
    k0, k1 = _key(seed, c0.device)
    for _ in range(rounds):
        c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1, _mul_hi_lo)
        k0, k1 = _next_key(k0, k1)
    return c0, c1, c2, c3


def _key(seed: IntOrTensor, device: torch.device) -> tuple[IntOrTensor, IntOrTensor]:
    """The two 32-bit key words of a 64-bit ``seed``."""
    if isinstance(seed, torch.Tensor):
        seed = seed.reshape(()).to(device=device, dtype=torch.int64)
        return seed & _MASK32, (seed >> 32) & _MASK32  # the two words of the int64 as uint64
    seed &= _MASK64
    return seed & _MASK32, seed >> 32


def _next_key(k0: IntOrTensor, k1: IntOrTensor) -> tuple[IntOrTensor, IntOrTensor]:
    return (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32


def _round(c0, c1, c2, c3, k0, k1, mul_hi_lo):
    """One Philox round, out of place (the words may still broadcast against each other)."""
    hi_b, lo_b = mul_hi_lo(c2, _PHILOX_ROUND_B)
    hi_a, lo_a = mul_hi_lo(c0, _PHILOX_ROUND_A)
    return hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a


def _mul_hi_lo_wrapped(a: torch.Tensor, const: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_mul_hi_lo` from one int64 multiply: ``a * const < 2**64``, and the multiply keeps
    its low 64 bits (where the device's multiply wraps: :func:`_multiply_wraps`)."""
    product = a * const
    return (product >> 32) & _MASK32, product & _MASK32


@functools.cache
def _multiply_wraps(device_type: str) -> bool:
    """Whether int64 multiplication on this kind of device keeps the low 64 bits of a product
    that overflows (C++ does not promise it), checked against Python's integers on the largest
    words. Only the CPU is checked: reading an answer back from another device would wait for
    it (and break CUDA-graph capture), so other devices keep the exact split multiply."""
    if device_type != "cpu":
        return False
    words = [2**32 - 1, 2**31, 0x89ABCDEF, 0x12345678, 1, 0]
    a = torch.tensor(words, dtype=torch.int64)
    for const in (_PHILOX_ROUND_A, _PHILOX_ROUND_B):
        hi, lo = _mul_hi_lo_wrapped(a, const)
        if hi.tolist() != [w * const >> 32 for w in words] or lo.tolist() != [w * const & _MASK32 for w in words]:
            return False
    return True


def philox_first_word(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    seed: IntOrTensor,
    buffers: Optional[Sequence[torch.Tensor]] = None,
) -> torch.Tensor:
    """The first word of :func:`philox4x32` (10 rounds), in the broadcast shape of the counters.

    The first two rounds run out of place: the counters broadcast (columns x rows x heads), so
    their words are still small. The other rounds run in place on five full-size int64 tensors:
    ``buffers`` (each at least the broadcast size; the result is a view of one of them) or new
    ones. Measured (one thread, a 4 x 64 x 512 tile): 17 ms for :func:`philox4x32` and the
    float uniform, 2.8 ms for this and :func:`keep_mask`'s comparison.
    """
    device = c0.device
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    if not _multiply_wraps(device.type):
        return philox4x32(c0, c1, c2, c3, seed)[0].expand(shape)
    k0, k1 = _key(seed, device)
    words = (c0, c1, c2, c3)
    for _ in range(2):
        words = _round(*words, k0, k1, _mul_hi_lo_wrapped)
        k0, k1 = _next_key(k0, k1)
    size = torch.Size(shape).numel()
    if buffers is None:
        buffers = [torch.empty(size, dtype=torch.int64, device=device) for _ in range(5)]
    w0, w1, w2, w3, spare = (b.view(-1)[:size].view(shape) for b in buffers)
    for buffer, word in zip((w0, w1, w2, w3), words):
        buffer.copy_(word.expand(shape))
    for _ in range(PHILOX_ROUNDS - 4):
        # c0, c1, c2, c3 <- hi(c2 * B) ^ c1 ^ k0, lo(c2 * B), hi(c0 * A) ^ c3 ^ k1, lo(c0 * A)
        w2.mul_(_PHILOX_ROUND_B)
        w0.mul_(_PHILOX_ROUND_A)
        torch.bitwise_right_shift(w2, 32, out=spare).bitwise_and_(_MASK32).bitwise_xor_(w1).bitwise_xor_(k0)
        w2.bitwise_and_(_MASK32)
        torch.bitwise_right_shift(w0, 32, out=w1).bitwise_and_(_MASK32).bitwise_xor_(w3).bitwise_xor_(k1)
        w0.bitwise_and_(_MASK32)
        w0, w1, w2, w3, spare = spare, w2, w1, w0, w3
        k0, k1 = _next_key(k0, k1)
    # round 9: only the words round 10 reads (c1 and c2)
    w2.mul_(_PHILOX_ROUND_B).bitwise_and_(_MASK32)
    w0.mul_(_PHILOX_ROUND_A)
    torch.bitwise_right_shift(w0, 32, out=spare).bitwise_and_(_MASK32).bitwise_xor_(w3).bitwise_xor_(k1)
    w1, w2 = w2, spare
    k0, k1 = _next_key(k0, k1)
    # round 10: the first word
    w2.mul_(_PHILOX_ROUND_B)
    return torch.bitwise_right_shift(w2, 32, out=w0).bitwise_and_(_MASK32).bitwise_xor_(w1).bitwise_xor_(k0)


def uint32_to_uniform_float(x: torch.Tensor) -> torch.Tensor:
    """Map uint32 words (in an int64 tensor) to fp32 in ``[0, 1)`` like Triton does.

    Triton reinterprets the word as int32 and replaces a negative ``v`` by ``~v``; for the
    unsigned value ``x >= 2**31`` that is ``x ^ 0xffffffff``, a value in ``[0, 2**31)``.
    """
    folded = torch.where(x >= 2**31, x ^ _MASK32, x)
    scale = torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=x.device)
    # int -> fp32 rounds to nearest, then one fp32 multiply: both as in the Triton kernel.
    return folded.to(torch.float32) * scale


def _as_counter(value: IntOrTensor, device: torch.device) -> torch.Tensor:
    """An int64 counter tensor on ``device`` (python ints become 0-dim tensors)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.int64)
    return torch.tensor(int(value), dtype=torch.int64, device=device)


def _counter_device(*values: IntOrTensor) -> torch.device:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def dropout_uniform(
    seed: IntOrTensor, batch: IntOrTensor, head: IntOrTensor, rows: IntOrTensor, cols: IntOrTensor
) -> torch.Tensor:
    """fp32 uniforms in ``[0, 1)`` for the broadcast of ``batch, head, rows, cols``.

    Counter layout ``(col, row, head, batch)``; see the module docstring.
    """
    return uint32_to_uniform_float(_first_words(seed, batch, head, rows, cols, None))


def _first_words(seed, batch, head, rows, cols, buffers) -> torch.Tensor:
    device = _counter_device(batch, head, rows, cols)
    c_batch, c_head, c_rows, c_cols = (_as_counter(x, device) for x in (batch, head, rows, cols))
    return philox_first_word(c_cols, c_rows, c_head, c_batch, seed, buffers)


@functools.lru_cache(maxsize=64)
def smallest_kept_word(p: float) -> int:
    """The smallest folded word (``w`` or ``w ^ 0xffffffff``, whichever is below ``2**31``)
    whose uniform is ``>= p``; ``2**31`` when none is. The uniform ``fp32(fp32(folded) * scale)`` does not
    decrease with the word, so ``uniform >= p`` iff ``folded >= smallest_kept_word(p)``: found by
    bisection, computing the uniform with :func:`uint32_to_uniform_float` itself."""
    threshold = torch.tensor(p, dtype=torch.float32)

    def kept(folded: int) -> bool:
        return bool(uint32_to_uniform_float(torch.tensor(folded, dtype=torch.int64)) >= threshold)

    lo, hi = 0, 2**31  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if kept(mid) else (mid + 1, hi)
    return lo


def keep_mask(
    seed: IntOrTensor,
    batch: IntOrTensor,
    head: IntOrTensor,
    rows: IntOrTensor,
    cols: IntOrTensor,
    p: float,
    buffers: Optional[Sequence[torch.Tensor]] = None,
) -> torch.Tensor:
    """Bool tensor: ``True`` where dropout with probability ``p`` keeps the entry.

    ``batch``/``head``/``rows``/``cols`` are ints or integer tensors that broadcast together; the
    result has their broadcast shape. Pure in its arguments: any tiling gives the same mask.
    ``buffers``: five int64 tensors of at least the result's size to work in
    (:func:`philox_first_word`).
    """
    words = _first_words(seed, batch, head, rows, cols, buffers)
    # Triton folds a word w >= 2**31 (a negative int32) to w ^ 0xffffffff = 2**32 - 1 - w, so
    # with s = smallest_kept_word(p) <= 2**31: w < 2**31 is kept iff w >= s, and w >= 2**31 iff
    # 2**32 - 1 - w >= s. Both at once: s <= w <= 2**32 - 1 - s.
    smallest = smallest_kept_word(float(p))
    return (words >= smallest) & (words <= _MASK32 - smallest)
