"""The reference backend: exact flash-attn 2.8 semantics in plain PyTorch, on any device.

The definition the kernels are checked against, and nothing else: the tiled engine of
:mod:`flash_attn.backends._reference_core` (online softmax forward, flash backward; masking,
ALiBi, softcap and dropout as :mod:`flash_attn.kernels.masking` states them), never holding a
full ``(sq x sk)`` score matrix, on the three layouts of the contract
(:mod:`flash_attn.backends._layouts`). CPU tensors go to the faster :mod:`flash_attn.backends.cpu`
under ``auto``; this backend runs them when ``FLASH_ATTN_BACKEND=reference`` names it.

Every function takes ``chunks``: the ``(query rows, key columns)`` of a tile to use instead of
those the tile budget gives (tests run many small, ragged chunks with it).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from flash_attn.backends import _layouts
from flash_attn.backends import _reference_core as core
from flash_attn.backends._layouts import delta  # noqa: F401  (part of this backend's API: lowlevel)
from flash_attn.params import AttentionParams, KVCacheInputs, VarlenLayout

__all__ = ["unavailable_reason", "forward", "backward", "forward_kvcache", "engine"]

Chunks = Optional[tuple[int, int]]


@functools.lru_cache(maxsize=16)
def engine(chunks: Chunks = None) -> _layouts.Engine:
    """The tiled engine as an :class:`~flash_attn.backends._layouts.Engine` (with ``chunks``)."""
    return _layouts.Engine(
        forward=lambda problem, params, return_softmax: core.attention_forward(problem, params, chunks),
        backward=lambda problem, params, dout, out, lse: core.attention_backward(
            problem, params, dout, out, lse, chunks),
        probabilities=lambda problem, params, lse, sk: core.softmax_with_dropout_signs(
            problem, params, lse, sk, chunks),
    )


def unavailable_reason(device: torch.device) -> Optional[str]:
    """The reference backend runs wherever PyTorch does."""
    return None


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: AttentionParams,
    *,
    varlen: Optional[VarlenLayout] = None,
    alibi_slopes: Optional[Tensor] = None,
    return_softmax: bool = False,
    chunks: Chunks = None,
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(out, lse, s_dmask)``; shapes as in :mod:`flash_attn.backends`."""
    return _layouts.forward(engine(chunks), q, k, v, params, varlen, alibi_slopes, return_softmax)


def backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    params: AttentionParams,
    *,
    varlen: Optional[VarlenLayout] = None,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    grads: Optional[tuple] = None,
    return_delta: bool = False,
    chunks: Chunks = None,
) -> tuple[Tensor, ...]:
    """``(dq, dk, dv)`` shaped like q, k, v (the page pool when paged), and with ``return_delta``
    Delta ``rowsum(dout * out)`` fp32 shaped like lse.

    ``deterministic`` and ``grads`` are accepted for the contract: this backend is always
    deterministic, and computes its gradients in its own (fp32) buffers, never in the caller's.
    """
    return _layouts.backward(engine(chunks), dout, q, k, v, out, lse, params, varlen, alibi_slopes, return_delta)


def forward_kvcache(
    q: Tensor, params: AttentionParams, cache: KVCacheInputs, *, alibi_slopes: Optional[Tensor] = None,
    chunks: Chunks = None,
) -> tuple[Tensor, Tensor]:
    """``(out (b, sq, h, d), lse fp32 (b, h, sq))`` of ``flash_attn_with_kvcache``
    (:func:`flash_attn.backends._layouts.forward_kvcache`)."""
    return _layouts.forward_kvcache(engine(chunks), q, params, cache, alibi_slopes)
