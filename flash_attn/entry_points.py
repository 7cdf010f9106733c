"""``flash_attn_gpu``: upstream's handle to its compiled entry points, on every backend.

Upstream's interface module does ``import flash_attn_2_cuda as flash_attn_gpu`` and some code
calls that extension directly (``flash_attn_gpu.fwd(...)``). This module offers the same five
functions with the same positional arguments (flash-attn 2.8.4, ``csrc/flash_attn/flash_api.cpp``)
and the same list results, implemented with this package's custom ops, so such code runs on any
device and backend:

* ``fwd``, ``varlen_fwd`` -> ``[out, softmax_lse, S_dmask, rng_state]``
* ``bwd``, ``varlen_bwd`` -> ``[dq, dk, dv, softmax_d]`` (gradient buffers allocated when None)
* ``fwd_kvcache`` -> ``[out, softmax_lse]``

A given ``out`` is written in place. The RNG generator slot (``unused_generator_compat``), kept
upstream only so the positions stay, must be None (a RuntimeError otherwise, upstream's message):
dropout masks come from PyTorch's default generator (``torch.manual_seed``).
"""

from __future__ import annotations

import torch

from flash_attn import kvcache, validation
from flash_attn.lowlevel import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)

__all__ = ["fwd", "varlen_fwd", "bwd", "varlen_bwd", "fwd_kvcache"]


def _no_generator(gen) -> None:
    """Checked first, before any other argument, as upstream's TORCH_CHECK is."""
    if gen is not None:
        raise RuntimeError(
            "flash-attn: the RNG `generator` argument is no longer supported and must be None "
            "(unused_generator_compat); dropout (when enabled) uses the default generator (seed it with "
            "torch.manual_seed)."
        )


def _scalars(p_dropout=0.0, is_causal=False, **flags) -> None:
    """The arguments these entry points name differently from the functions they call, checked
    under upstream's names (``p_dropout``, ``is_causal``, ...)."""
    p = validation._real(p_dropout, "p_dropout", "a float in [0, 1)")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p_dropout must be in [0, 1), got {p_dropout!r}")
    validation.check_flag(is_causal, "is_causal")
    for name, flag in flags.items():
        validation.check_flag(flag, name)


def _into(out, result: torch.Tensor) -> torch.Tensor:
    """Upstream's optional ``out`` argument: write the result there (same shape/dtype/device)."""
    if out is None:
        return result
    if not isinstance(out, torch.Tensor) or out.shape != result.shape or out.dtype != result.dtype or out.device != result.device:
        raise ValueError(
            f"out must be a {result.dtype} tensor of shape {tuple(result.shape)} on {result.device}, got "
            f"{type(out).__name__ if not isinstance(out, torch.Tensor) else f'{out.dtype} {tuple(out.shape)} on {out.device}'}"
        )
    return out.copy_(result)


def _grad_buffers(q, k, v, dq, dk, dv):
    return (torch.empty_like(q) if dq is None else dq, torch.empty_like(k) if dk is None else dk,
            torch.empty_like(v) if dv is None else dv)


def fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
        softcap, return_softmax, unused_generator_compat):
    _no_generator(unused_generator_compat)
    _scalars(p_dropout, is_causal)
    o, lse, s_dmask, rng_state = _flash_attn_forward(
        q, k, v, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
        return_softmax,
    )
    return [_into(out, o), lse, s_dmask, rng_state]


def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, return_softmax, unused_generator_compat, num_splits=0):
    _no_generator(unused_generator_compat)
    _scalars(p_dropout, is_causal)
    o, lse, s_dmask, rng_state = _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k,
        seqused_k, zero_tensors, num_splits,
    )
    return [_into(out, o), lse, s_dmask, rng_state]


def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, deterministic, unused_generator_compat, rng_state):
    _no_generator(unused_generator_compat)
    _scalars(p_dropout, is_causal)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv)
    softmax_d = _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, p_dropout, softmax_scale, is_causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state,
    )
    return [dq, dk, dv, softmax_d]


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, deterministic, unused_generator_compat, rng_state):
    _no_generator(unused_generator_compat)
    _scalars(p_dropout, is_causal)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv)
    softmax_d = _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
        deterministic, rng_state, zero_tensors,
    )
    return [dq, dk, dv, softmax_d]


def fwd_kvcache(q, kcache, vcache, k, v, seqlens_k, rotary_cos, rotary_sin, cache_batch_idx, leftpad_k,
                block_table, alibi_slopes, out, softmax_scale, is_causal, window_size_left, window_size_right,
                softcap, is_rotary_interleaved, num_splits):
    _scalars(is_causal=is_causal, is_rotary_interleaved=is_rotary_interleaved)
    validation.check_tensor(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
    for name, cache in (("kcache", kcache), ("vcache", vcache)):  # upstream's names for k_cache, v_cache
        validation.check_tensor(cache, name, 4, "(batch_cache, seqlen_cache, nheads_k, headdim) or pages")
        validation.check_same(("q", q), (name, cache))
    for name, t in (("seqlens_k", seqlens_k), ("leftpad_k", leftpad_k)):  # cache_seqlens, cache_leftpad
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an int32 tensor of shape (batch,), got {type(t).__name__}")
    for name, bound in (("window_size_left", window_size_left), ("window_size_right", window_size_right)):
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise TypeError(f"{name} must be an int (negative: unbounded), got {bound!r}")
    window = (-1 if window_size_left < 0 else window_size_left, -1 if window_size_right < 0 else window_size_right)
    o, lse = kvcache.forward(
        q, kcache, vcache, k, v, rotary_cos, rotary_sin, seqlens_k, cache_batch_idx, leftpad_k, block_table,
        softmax_scale, is_causal, window, softcap, is_rotary_interleaved, alibi_slopes, num_splits,
    )
    return [_into(out, o), lse]
