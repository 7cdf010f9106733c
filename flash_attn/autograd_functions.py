"""Upstream flash-attn 2.8's autograd classes and helpers of ``flash_attn.flash_attn_interface``.

Code outside the package subclasses or calls these directly (``FlashAttnFunc.apply(...)``,
``FlashAttnVarlenFunc``, the ``_wrapped_flash_attn_*`` custom-op handles of sink and
context-parallel extensions); :mod:`flash_attn.flash_attn_interface` re-exports them. Each class is
a ``torch.autograd.Function`` with upstream's ``forward`` arguments (``is_grad_enabled`` last) and
returns, built on the low-level ops of :mod:`flash_attn.lowlevel`: the forward saves q, k, v, out,
the logsumexp and the dropout seed, the backward recomputes through ``_flash_attn_backward``. The
public functions do not go through them (they call the ``flash_attn::forward`` op, which
``torch.compile`` traces whole).
"""

from __future__ import annotations

import os

import torch

from flash_attn import validation
from flash_attn.lowlevel import (  # noqa: F401  (the fakes re-exported under upstream's names)
    _flash_attn_backward,
    _flash_attn_backward_fake,
    _flash_attn_forward,
    _flash_attn_forward_fake,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_backward_fake,
    _flash_attn_varlen_forward,
    _flash_attn_varlen_forward_fake,
    round_multiple,
)

__all__ = [
    "FlashAttnFunc", "FlashAttnKVPackedFunc", "FlashAttnQKVPackedFunc",
    "FlashAttnVarlenFunc", "FlashAttnVarlenKVPackedFunc", "FlashAttnVarlenQKVPackedFunc",
]

# Upstream's switch to AMD's Triton kernels; read for compatibility, changes nothing here (every
# device runs this package's backends, FLASH_ATTN_BACKEND chooses).
USE_TRITON_ROCM = os.getenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE") == "TRUE"

# Upstream registers its low-level functions as torch.library custom ops when PyTorch has them,
# else these no-op decorators stand in; here they always are custom ops (flash_attn::_flash_attn_*).
_torch_custom_op_wrapper = torch.library.custom_op
_torch_register_fake_wrapper = torch.library.register_fake
_wrapped_flash_attn_forward = torch.ops.flash_attn._flash_attn_forward
_wrapped_flash_attn_varlen_forward = torch.ops.flash_attn._flash_attn_varlen_forward
_wrapped_flash_attn_backward = torch.ops.flash_attn._flash_attn_backward
_wrapped_flash_attn_varlen_backward = torch.ops.flash_attn._flash_attn_varlen_backward


def noop_custom_op_wrapper(name, fn=None, /, *, mutates_args, device_types=None, schema=None):
    """``torch.library.custom_op``'s stand-in for a PyTorch without it: the function itself."""
    def wrap(func):
        return func
    return wrap if fn is None else fn


def noop_register_fake_wrapper(op, fn=None, /, *, lib=None, _stacklevel=1):
    """``torch.library.register_fake``'s stand-in for a PyTorch without it: the function itself."""
    def wrap(func):
        return func
    return wrap if fn is None else fn


def maybe_contiguous(x):
    """``x`` with a contiguous last dimension (``None`` stays ``None``)."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """Upstream's key-block width of its CUDA kernels, which its tests use to lay out ``S_dmask``;
    here ``S_dmask`` is never padded, so the width is the smallest, 1 key, on every device."""
    if head_dim > 512:
        raise ValueError(f"head_dim must be at most 512, got {head_dim}")
    return 1


def _scale(softmax_scale, head_dim: int) -> float:
    return head_dim ** -0.5 if softmax_scale is None else softmax_scale


def _save(ctx, is_grad, tensors, **options) -> None:
    if is_grad:
        ctx.save_for_backward(*tensors)
        for name, value in options.items():
            setattr(ctx, name, value)


def _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_softmax, is_grad):
    softmax_scale = _scale(softmax_scale, q.shape[-1])
    out, lse, s_dmask, rng_state = _wrapped_flash_attn_forward(
        q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
        return_softmax and dropout_p > 0)
    _save(ctx, is_grad, (q, k, v, out, lse, rng_state), dropout_p=dropout_p, softmax_scale=softmax_scale,
          causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
          deterministic=deterministic)
    return out if not return_softmax else (out, lse, s_dmask)


def _dense_backward(ctx, dout, dq, dk, dv):
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    _wrapped_flash_attn_backward(
        dout, q, k, v, out, lse, dq, dk, dv, ctx.dropout_p, ctx.softmax_scale, ctx.causal, ctx.window_size[0],
        ctx.window_size[1], ctx.softcap, ctx.alibi_slopes, ctx.deterministic, rng_state=rng_state)


def _varlen_forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_softmax,
                    block_table, is_grad):
    softmax_scale = _scale(softmax_scale, q.shape[-1])
    out, lse, s_dmask, rng_state = _wrapped_flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size[0], window_size[1], softcap, alibi_slopes, return_softmax and dropout_p > 0, block_table)
    _save(ctx, is_grad, (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state), dropout_p=dropout_p,
          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic)
    return out if not return_softmax else (out, lse, s_dmask)


def _varlen_backward(ctx, dout, dq, dk, dv):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
    _wrapped_flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
        ctx.dropout_p, ctx.softmax_scale, ctx.causal, ctx.window_size[0], ctx.window_size[1], ctx.softcap,
        ctx.alibi_slopes, ctx.deterministic, rng_state=rng_state)


def _grads_like(*tensors):
    return [torch.empty_like(t) for t in tensors]


def _checked(q, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_softmax,
             is_grad_enabled) -> tuple[int, int]:
    """The options the low-level ops do not see as given (the window is split, the flags are read
    here first): named errors for them, as flash_attn_func's. Returns ``window_size`` as two ints."""
    validation.check_softmax_scale(softmax_scale)
    window = validation.check_options(dropout_p, softcap, window_size, None, 0, 0, q.device)  # alibi: the op's
    for value, name in ((causal, "causal"), (deterministic, "deterministic"), (return_softmax, "return_softmax"),
                        (is_grad_enabled, "is_grad_enabled")):
        validation.check_flag(value, name)
    return window


def _check_packed(t, name: str, ndim: int, dim: int, count: int, layout: str) -> None:
    shape = validation.check_tensor(t, name, ndim, layout)
    if shape[dim] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(shape)}")


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        validation.check_dense_qkv(q, k, v)
        window_size = _checked(q, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               return_softmax, is_grad_enabled)
        is_grad = is_grad_enabled and any(t.requires_grad for t in (q, k, v))
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax, is_grad)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = _grads_like(q, k, v)
        _dense_backward(ctx, dout, dq, dk, dv)
        return dq, dk, dv, *(None,) * 9


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        _check_packed(qkv, "qkv", 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
        window_size = _checked(qkv, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               return_softmax, is_grad_enabled)
        q, k, v = qkv.detach().unbind(dim=2)
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax, is_grad_enabled and qkv.requires_grad)

    @staticmethod
    def backward(ctx, dout, *args):
        q = ctx.saved_tensors[0]
        dqkv = torch.empty((*q.shape[:-2], 3, *q.shape[-2:]), dtype=q.dtype, device=q.device)
        _dense_backward(ctx, dout, *dqkv.unbind(dim=2))
        return dqkv, *(None,) * 9


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        validation.check_tensor(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")
        _check_packed(kv, "kv", 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
        window_size = _checked(q, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               return_softmax, is_grad_enabled)
        k, v = kv.detach().unbind(dim=2)
        is_grad = is_grad_enabled and (q.requires_grad or kv.requires_grad)
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax, is_grad)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k = ctx.saved_tensors[:2]
        dq = torch.empty_like(q)
        dkv = torch.empty((*k.shape[:-2], 2, *k.shape[-2:]), dtype=k.dtype, device=k.device)
        _dense_backward(ctx, dout, dq, *dkv.unbind(dim=2))
        return dq, dkv, *(None,) * 9


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table,
                is_grad_enabled):
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            validation.check_tensor(t, name, 3, f"(total_{name if name == 'q' else 'k'}, nheads, headdim)")
        window_size = _checked(q, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               return_softmax, is_grad_enabled)
        is_grad = is_grad_enabled and any(t.requires_grad for t in (q, k, v))
        return _varlen_forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax, block_table, is_grad)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v = ctx.saved_tensors[:3]
        dq, dk, dv = _grads_like(q, k, v)
        _varlen_backward(ctx, dout, dq, dk, dv)
        return dq, dk, dv, *(None,) * 14


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, is_grad_enabled):
        _check_packed(qkv, "qkv", 4, 1, 3, "(total, 3, nheads, headdim)")
        window_size = _checked(qkv, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               return_softmax, is_grad_enabled)
        q, k, v = qkv.detach().unbind(dim=1)
        return _varlen_forward(ctx, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax, None, is_grad_enabled and qkv.requires_grad)

    @staticmethod
    def backward(ctx, dout, *args):
        q = ctx.saved_tensors[0]
        dqkv = torch.empty((q.shape[0], 3, *q.shape[1:]), dtype=q.dtype, device=q.device)
        _varlen_backward(ctx, dout, *dqkv.unbind(dim=1))
        return dqkv, *(None,) * 11


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled):
        validation.check_tensor(q, "q", 3, "(total_q, nheads, headdim)")
        _check_packed(kv, "kv", 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
        window_size = _checked(q, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                               return_softmax, is_grad_enabled)
        k, v = kv.detach().unbind(dim=1)
        is_grad = is_grad_enabled and (q.requires_grad or kv.requires_grad)
        return _varlen_forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax, None, is_grad)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k = ctx.saved_tensors[:2]
        dq = torch.empty_like(q)
        dkv = torch.empty((k.shape[0], 2, *k.shape[1:]), dtype=k.dtype, device=k.device)
        _varlen_backward(ctx, dout, dq, *dkv.unbind(dim=1))
        return dq, dkv, *(None,) * 13
