"""Triton side of the dropout RNG: the keep mask of a tile, identical to :mod:`flash_attn.dropout`.

The decision for one probability entry is a pure function of ``(seed, batch, head, row, col)``:
Philox4x32-10 with key ``seed`` (64 bit) on the counter ``(col, row, head, batch)``, first output
word mapped to ``[0, 1)`` by ``tl.uint_to_uniform_float``, kept iff ``uniform >= p`` (``p`` in
fp32). ``row``/``col`` are positions inside the sequence, ``head`` the *query* head and ``batch``
the batch entry (varlen: the sequence index). Forward, backward and the PyTorch reference backend
therefore draw the same mask whatever their tiling.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dropout_keep(seed, batch, head, q_pos, k_pos, dropout_p):
    """Bool tile: True where the entry (``q_pos``, ``k_pos``) survives dropout.

    ``q_pos`` and ``k_pos`` are int32 tensors that broadcast against each other (a tile may be
    queries x keys or keys x queries); ``seed`` is an int64 scalar, ``batch``/``head`` int32
    scalars, ``dropout_p`` the fp32 drop probability.
    """
    cols = k_pos + q_pos * 0  # broadcast both counters to the tile shape
    rows = q_pos + k_pos * 0
    heads = cols * 0 + head
    batches = cols * 0 + batch
    word, _, _, _ = tl.philox(seed, cols.to(tl.uint32), rows.to(tl.uint32), heads.to(tl.uint32),
                              batches.to(tl.uint32))
    return tl.uint_to_uniform_float(word) >= dropout_p
