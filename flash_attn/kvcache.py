"""The KV-cache call behind :func:`flash_attn.flash_attn_with_kvcache` and upstream's
``fwd_kvcache`` entry point: its arguments checked and normalised, then the custom op."""

from __future__ import annotations

from typing import Optional

import torch

from flash_attn import custom_ops, dispatch, validation
from flash_attn.params import cache_capacity


def forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            qv=None, sinks=None):
    """``(out, lse)`` of :func:`flash_attn.flash_attn_with_kvcache` (same arguments; ``sinks`` is
    its ``learnable_sink``)."""
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, alibi_slopes, qv, sinks)
    scalars = (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits)
    held = _held_form(tensors, rotary_cos)
    if held is not None:  # a call whose whole route the backend holds (dispatch.run_held): its checks passed before
        made = dispatch.run_held(_TAG, held[0], scalars, held[1])
        if made is not None:
            custom_ops.bump_appended(k, k_cache, v_cache)
            return made[0], made[1]
    (scale, left, right, softcap, rotary_interleaved, num_splits), call = validation.checked_call(
        _TAG, tensors, scalars, _checks)
    # One int for every sequence: a tensor of it. None: every sequence's whole cache, which the
    # kernels take as a number (no tensor made per call), unless rotary needs the positions.
    if (cache_seqlens is None and rotary_cos is not None) or isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_capacity(k_cache, block_table) if cache_seqlens is None
                                   else cache_seqlens, dtype=torch.int32, device=q.device)
    out, lse = custom_ops.forward_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, rotary_cos, rotary_sin, alibi_slopes, scale, left, right, softcap, rotary_interleaved, num_splits,
        qv, sinks, call=call,
    )
    if held is not None and type(call) is int:
        slots = tuple(slot for slot, t in zip(_SLOTS, tensors) if t is not None)
        dispatch.hold_held(_TAG, "forward_kvcache", call, held[0], slots, scalars, held[1], ("out", "lse"))
    return out, lse


_TAG = "flash_attn_with_kvcache"
# the slot of each of forward's tensors, in its order (flash_attn.backends._execute.kvcache_inputs' names)
_SLOTS = ("q", "k_cache", "v_cache", "k_new", "v_new", "cos", "sin", "seqlens", "batch_idx", "leftpad", "block_table",
          "alibi", "qv", "sinks")
_Tensor, _grad_enabled = torch.Tensor, torch.is_grad_enabled


def _held_form(tensors: tuple, rotary_cos) -> Optional[tuple]:
    """``(the tensors given, what a held lane's key holds of all: each one's shape or None)`` of a
    call a held lane may take, or ``None``: a tensor that is not a plain one, a graph to record,
    lengths given as an int or left out beside rotary (the slow route makes a tensor of them),
    values checked on the host (CPU tensors, ``FLASH_ATTN_DEBUG``)."""
    cache_seqlens = tensors[7]
    if type(cache_seqlens) is int or (cache_seqlens is None and rotary_cos is not None):
        return None
    given = tuple([t for t in tensors if t is not None])
    for t in given:
        if type(t) is not _Tensor:
            return None
    if _grad_enabled() and custom_ops.any_requires_grad(*given):
        return None
    if custom_ops._checks_values(tensors[0]):  # (read per call: the benchmark stub replaces it)
        return None
    return given, tuple([None if t is None else t.shape for t in tensors])


def _checks(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, qv, sinks, softmax_scale, causal, window_size, softcap, rotary_interleaved,
            num_splits):
    """The metadata checks; returns the normalised ``(softmax_scale, window_left, window_right, softcap,
    rotary_interleaved, num_splits)``."""
    q, k_new, v_new, cache_seqlens = _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    batch, _, nheads, headdim = q.shape
    _check_kvcache_extras(q, k_cache, block_table, k_new, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, num_splits)
    window_size = validation.check_options(0.0, softcap, window_size, alibi_slopes, batch, nheads, q.device)
    validation.check_qv(qv, q, v_cache.shape[-1], "(batch, seqlen_q, nheads, headdim_v)")
    validation.check_sinks(sinks, nheads, q.device)
    if qv is not None:
        headdim += qv.shape[-1]  # the default scale counts both products' features
    # like upstream, a bound no smaller than the cache is unbounded (this decides whether q is
    # rotated as a local/causal block or at one position)
    causal = validation.check_flag(causal, "causal")
    left, right = validation.bounded_window(causal, window_size, cache_capacity(k_cache, block_table))
    scale = validation.softmax_scale(softmax_scale, headdim)
    return (scale, left, right, validation.softcap_value(softcap, scale),
            validation.check_flag(rotary_interleaved, "rotary_interleaved"), int(num_splits))


def _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
    validation.check_tensor(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    cache_layout = "(num_blocks, page_block_size, nheads_k, headdim)" if block_table is not None else "(batch_cache, seqlen_cache, nheads_k, headdim)"
    validation.check_tensor(k_cache, "k_cache", 4, cache_layout)
    validation.check_tensor(v_cache, "v_cache", 4, cache_layout.replace("headdim)", "headdim_v)"))
    validation.check_same(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree except in headdim, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    validation.check_heads(q.shape[2], k_cache.shape[2], q.shape[3], k_cache.shape[3], v_cache.shape[3])
    batch = q.shape[0]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or both None)")
    if k is not None:
        validation.check_tensor(k, "k", 4, "(batch, seqlen_new, nheads_k, headdim)")
        validation.check_tensor(v, "v", 4, "(batch, seqlen_new, nheads_k, headdim_v)")
        validation.check_same(("q", q), ("k", k), ("v", v))
        expected_k = (batch, k.shape[1]) + tuple(k_cache.shape[2:])
        expected_v = (batch, k.shape[1]) + tuple(v_cache.shape[2:])
        if tuple(k.shape) != expected_k or tuple(v.shape) != expected_v:
            raise ValueError(f"k and v must have shapes {expected_k} and {expected_v} (batch, seqlen_new, nheads_k, "
                             f"headdim / headdim_v of the caches), got {tuple(k.shape)} and {tuple(v.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when new k/v are appended to the cache")
    if block_table is not None:
        validation.check_block_table(block_table, batch, q.device)
    if cache_seqlens is None:
        cache_seqlens = cache_capacity(k_cache, block_table)
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor of shape (batch,), got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    validation.check_index_vector(cache_seqlens, "cache_seqlens", batch, q.device)
    return q, k, v, cache_seqlens


def _check_kvcache_extras(q, k_cache, block_table, k_new, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, num_splits):
    batch = q.shape[0]
    if cache_batch_idx is not None and block_table is not None:
        raise ValueError("cache_batch_idx cannot be combined with block_table: a paged cache maps each sequence to "
                         "its pages through block_table (reorder block_table's rows instead)")
    if cache_batch_idx is None and block_table is None and k_cache.shape[0] < batch:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {batch}; pass cache_batch_idx to map them")
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            validation.check_index_vector(t, name, batch, q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k_new is None:
            raise ValueError("rotary_cos/rotary_sin only apply when new k/v are passed")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {validation._describe(t)}")
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating-point tensor (the cos / sin of the angles), got {t.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        if 2 * rotary_cos.shape[1] > q.shape[-1]:
            raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]}) must not exceed headdim {q.shape[-1]}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = heuristic), got {num_splits!r}")
