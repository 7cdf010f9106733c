"""Plain-data descriptions of one attention call, shared by every backend.

The public functions normalise user arguments into these objects once, so a backend never
re-derives defaults (softmax scale, causal-as-window, ...) and all backends agree on them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch


class KeyLengths(NamedTuple):
    """The key :func:`flash_attn.validation.checked_call` gives the signatures that join a class of
    dense calls that differ only in k and v's key length and strides (a KV cache kept as growing
    tensors: Hugging Face's ``generate()`` passes one more key every step; the signature that made
    the class has a plain key): ``own``, the signature's own, under which the layers below hold its
    plans, and
    ``shared``, the class's, under which they hold what serves every signature of the class (the
    forward's template plan, filled in from a new signature's k and v,
    :mod:`flash_attn.planning.extents`)."""

    shared: int
    own: int


def own_key(key):
    """The key of a call's own signature: ``key`` itself, or a :class:`KeyLengths`'s ``own``."""
    return key.own if type(key) is KeyLengths else key


class AttentionParams(NamedTuple):
    """Scalar options of an attention call (a named tuple: made on every call, and a tuple is
    the cheapest immutable record).

    Masking is expressed only through the window: query ``i`` sees key ``j`` iff
    ``i + sk - sq - window_left <= j <= i + sk - sq + window_right`` (bottom-right aligned; a
    bound of ``-1`` is unbounded). ``causal=True`` is ``window_right=0``.
    """

    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    # Key of the counter-based dropout RNG: drawn once per forward on the device (the forward's
    # ``rng_state``, a one-element int64 tensor) and handed to the backward, which regenerates the
    # very same mask from it. A plain int works too (tests, direct backend calls).
    dropout_seed: Union[int, torch.Tensor] = 0
    # The public function's checked call signature (:func:`flash_attn.validation.checked_call`'s
    # int for it, or a :class:`KeyLengths`), when it made one: everything but the data pointers
    # that decides this call's plan, so the kernel backends find the plan by it without
    # describing the call again. ``None``: describe.
    call: Optional[Union[int, KeyLengths]] = None

    @property
    def is_local(self) -> bool:
        return window_applies(self.window_left, self.window_right)


def window_applies(window_left: int, window_right: int) -> bool:
    """True when any window bound applies (causal counts as local with left unbounded)."""
    return window_left >= 0 or window_right >= 0


class VarlenLayout(NamedTuple):
    """Sequences packed along dim 0: sequence ``b`` is rows ``cu[b]:cu[b+1]`` (a named tuple: made
    by every packed forward and backward).

    With a ``block_table`` (paged K/V), ``k``/``v`` are ``(num_blocks, page_size, nheads_k, d)``
    and sequence ``b``'s keys are the first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` rows of the
    pages ``block_table[b, 0], block_table[b, 1], ...`` laid end to end.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: Optional[torch.Tensor] = None


class KVCacheInputs(NamedTuple):
    """Everything ``flash_attn_with_kvcache`` adds to a plain attention call (a named tuple: made
    on every decode step, and a frozen dataclass costs ~0.6 us more to make).

    ``cache_seqlens[b]`` counts cache rows from index 0 (the left padding included); the new
    ``k``/``v`` rows are written at ``cache_seqlens[b], cache_seqlens[b] + 1, ...`` and the keys
    attended to are cache rows ``cache_leftpad[b] : cache_seqlens[b] + seqlen_new``, whose
    positions for masking and ALiBi start at 0 at ``cache_leftpad[b]``. Rotary angles use the
    absolute cache row index.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: Optional[torch.Tensor]  # int32 (batch,); None: every sequence's whole cache (its capacity)
    k_new: Optional[torch.Tensor] = None
    v_new: Optional[torch.Tensor] = None
    cache_batch_idx: Optional[torch.Tensor] = None
    cache_leftpad: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    rotary_cos: Optional[torch.Tensor] = None
    rotary_sin: Optional[torch.Tensor] = None
    rotary_interleaved: bool = True
    num_splits: int = 0


def cache_capacity(cache, block_table=None) -> int:
    """The cache rows one sequence can address: its row of pages when paged (``block_table``
    ``(batch, pages)`` over a page pool ``(num_blocks, page_size, ...)``), else the cache's sequence
    length (``(batch_cache, seqlen_cache, ...)``). Tensors or anything with their ``shape``."""
    if block_table is None:
        return cache.shape[1]
    return block_table.shape[1] * cache.shape[1]
