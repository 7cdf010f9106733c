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
from flash_attn.backends.contract import runs_every_call

__all__ = ["BACKEND", "unavailable_reason", "forward", "backward", "forward_kvcache", "engine"]

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


def forward(*args, chunks: Chunks = None, **kwargs) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The contract's ``forward`` (:mod:`flash_attn.backends.contract`): ``(out, lse, s_dmask)``."""
    return _layouts.forward(engine(chunks), *args, **kwargs)


def backward(*args, chunks: Chunks = None, **kwargs) -> tuple[Tensor, ...]:
    """The contract's ``backward``: ``(dq, dk, dv)`` shaped like q, k, v (the page pool when
    paged), and with ``return_delta`` Delta ``rowsum(dout * out)`` fp32 shaped like lse. Always
    deterministic; the gradients are computed in the engine's own (fp32) buffers."""
    return _layouts.backward(engine(chunks), *args, **kwargs)


def forward_kvcache(*args, chunks: Chunks = None, **kwargs) -> tuple[Tensor, Tensor]:
    """The contract's ``forward_kvcache``: ``(out (b, sq, h, d), lse fp32 (b, h, sq))``
    (:func:`flash_attn.backends._layouts.forward_kvcache`)."""
    return _layouts.forward_kvcache(engine(chunks), *args, **kwargs)


BACKEND = runs_every_call("reference", unavailable_reason, forward, backward, forward_kvcache)
