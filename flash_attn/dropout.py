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

``tests/test_dropout_rng.py`` checks bit-equality against Triton's interpreter.

Why int64 arithmetic: PyTorch has no full uint32 arithmetic, so every 32-bit word lives in an
int64 tensor masked to 32 bits. The 32x32->64-bit multiply could overflow int64, so it is split
into 16-bit halves (each partial product stays below 2**48).
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["philox4x32", "uint32_to_uniform_float", "dropout_uniform", "keep_mask"]

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
    if isinstance(seed, torch.Tensor):
        seed = seed.reshape(()).to(device=c0.device, dtype=torch.int64)
        k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32  # the two words of the int64 as uint64
    else:
        seed &= _MASK64
        k0, k1 = seed & _MASK32, seed >> 32
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


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
    device = _counter_device(batch, head, rows, cols)
    c_batch, c_head, c_rows, c_cols = (_as_counter(x, device) for x in (batch, head, rows, cols))
    shape = torch.broadcast_shapes(c_batch.shape, c_head.shape, c_rows.shape, c_cols.shape)
    word, _, _, _ = philox4x32(c_cols, c_rows, c_head, c_batch, seed)
    return uint32_to_uniform_float(word.expand(shape))


def keep_mask(
    seed: IntOrTensor,
    batch: IntOrTensor,
    head: IntOrTensor,
    rows: IntOrTensor,
    cols: IntOrTensor,
    p: float,
) -> torch.Tensor:
    """Bool tensor: ``True`` where dropout with probability ``p`` keeps the entry.

    ``batch``/``head``/``rows``/``cols`` are ints or integer tensors that broadcast together; the
    result has their broadcast shape. Pure in its arguments: any tiling gives the same mask.
    """
    uniform = dropout_uniform(seed, batch, head, rows, cols)
    threshold = torch.tensor(p, dtype=torch.float32, device=uniform.device)
    return uniform >= threshold
