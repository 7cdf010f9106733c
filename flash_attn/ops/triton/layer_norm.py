"""Upstream's ``flash_attn.ops.triton.layer_norm``: dropout + residual + LayerNorm / RMSNorm, fused.

Names, signatures, defaults and return values are upstream's (flash-attn 2.8.4 source):
:func:`layer_norm_fn`, :func:`rms_norm_fn`, :class:`LayerNormFn`, :class:`RMSNorm`,
:func:`layer_norm_linear_fn` / :class:`LayerNormLinearFn`, and the references
:func:`layer_norm_ref` / :func:`rms_norm_ref`.

What one call computes, per row of ``x`` (all in fp32)::

    h = dropout(x * rowscale) [+ dropout(x1)] [+ residual]       # residual_out = h
    y = norm(h) * weight + bias   [,  y1 = norm(h) * weight1 + bias1]

``norm`` is LayerNorm, or RMSNorm (``is_rms_norm``); ``zero_centered_weight`` uses ``weight + 1``.
``prenorm`` also returns ``residual_out`` (in ``residual``'s dtype, fp32 with
``residual_in_fp32``, else ``x``'s), ``return_dropout_mask`` the keep-masks.

Where it runs: on CUDA tensors the Triton kernels of :mod:`._layer_norm_kernels` (JIT-compiled by
Triton on first use; no ahead-of-time images ship for them), through :class:`LayerNormFn`, an
autograd function with a kernel backward; nothing there reads a device value on the host. On every
other device :func:`layer_norm_fn` / :func:`rms_norm_fn` run the same formulas as plain PyTorch
ops, differentiated by autograd (so ``torch.compile(fullgraph=True)`` traces them). Dropout masks
come from PyTorch's default generator on both paths (``torch.manual_seed``), not the same bits.
:class:`LayerNormFn` called directly with CPU tensors runs its kernels in Triton's interpreter
(slow; that is how the tests check the kernels without a GPU).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from flash_attn import validation
from flash_attn.ops.triton import triton_available

__all__ = [
    "layer_norm_ref",
    "rms_norm_ref",
    "LayerNormFn",
    "layer_norm_fn",
    "rms_norm_fn",
    "RMSNorm",
    "LayerNormLinearFn",
    "layer_norm_linear_fn",
]

_MAX_ROW_BYTES = 65536  # upstream's limit for one row in one program (registers)


# ----------------------------------------------------------------------------------------------
# References (upstream exports them; its tests and downstream tests compare against them)
# ----------------------------------------------------------------------------------------------


def _ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, zero_centered_weight,
         dropout_mask, dropout_mask1, upcast, is_rms_norm):
    _check_args(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, None, None,
                flags=dict(prenorm=prenorm, zero_centered_weight=zero_centered_weight, upcast=upcast),
                masks=dict(dropout_mask=dropout_mask, dropout_mask1=dropout_mask1))
    out_dtype = x.dtype
    if upcast:
        x, weight, bias, residual, x1, weight1, bias1 = (
            t.float() if t is not None else None for t in (x, weight, bias, residual, x1, weight1, bias1))
    if zero_centered_weight:
        weight = weight + 1.0
        weight1 = weight1 + 1.0 if weight1 is not None else None
    if x1 is not None and rowscale is not None:
        raise ValueError("rowscale is not supported with x1 (parallel LayerNorm)")
    if rowscale is not None:
        x = x * rowscale[..., None]

    def drop(t, mask):
        if dropout_p == 0.0:
            return t
        if mask is None:
            return F.dropout(t, p=dropout_p)
        return t.masked_fill(~mask, 0.0) / (1.0 - dropout_p)

    x = drop(x, dropout_mask)
    if x1 is not None:
        x = x + drop(x1, dropout_mask1)
    if residual is not None:
        x = (x + residual).to(x.dtype)

    def norm(w, b):
        if is_rms_norm:
            y = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * w
            y = y + b if b is not None else y
        else:
            y = F.layer_norm(x.to(w.dtype), x.shape[-1:], weight=w, bias=b, eps=eps)
        return y.to(out_dtype)

    outs = (norm(weight, bias),) + ((norm(weight1, bias1),) if weight1 is not None else ())
    outs = outs + ((x,) if prenorm else ())
    return outs[0] if len(outs) == 1 else outs


def layer_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                   rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None,
                   upcast=False):
    """LayerNorm in plain PyTorch ops, in the input dtype (fp32 with ``upcast``); ``dropout_mask``
    (bool, True = keep) replays a fused call's dropout."""
    return _ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                zero_centered_weight, dropout_mask, dropout_mask1, upcast, is_rms_norm=False)


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                 rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None,
                 upcast=False):
    """:func:`layer_norm_ref` for RMSNorm."""
    return _ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                zero_centered_weight, dropout_mask, dropout_mask1, upcast, is_rms_norm=True)


# ----------------------------------------------------------------------------------------------
# Argument checks (shared by both paths)
# ----------------------------------------------------------------------------------------------


def maybe_contiguous(x):
    """Upstream's helper: ``x`` contiguous in memory (``None`` stays ``None``)."""
    return x.contiguous() if x is not None and not x.is_contiguous() else x


def maybe_contiguous_lastdim(x):
    """Upstream's helper: ``x`` with a contiguous last dimension (``None`` stays ``None``)."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def _check_float_tensor(t, name: str, device) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {_describe(t)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def _check_args(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, out, residual_out,
                flags: Optional[dict] = None, out_dtype=None, names=("weight", "bias"), masks: Optional[dict] = None) -> None:
    """Every argument of a norm call: the tensors (``names``: what the caller calls weight and bias),
    ``eps``, ``dropout_p``, the bool ``flags`` (name -> value), ``out_dtype`` and the references'
    dropout ``masks`` (name -> value)."""
    _check_float_tensor(x, "x", x.device if isinstance(x, torch.Tensor) else None)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (feature) dimension, got shape {tuple(x.shape)}")
    for flag, value in (flags or {}).items():
        validation.check_flag(value, flag)
    if out_dtype is not None:
        if not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype must be a torch.dtype or None, got {out_dtype!r}")
        if not out_dtype.is_floating_point:
            raise ValueError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
    for name, mask in (masks or {}).items():
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError(f"{name} must be a bool tensor (True = keep), got {_describe(mask)}")
            if mask.device != x.device:
                raise ValueError(f"{name} is on {mask.device} but x is on {x.device}")
            if mask.shape != x.shape:
                raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(mask.shape)}")
    n = x.shape[-1]
    for name, t in ((names[0], weight), (names[1], bias), ("weight1", weight1), ("bias1", bias1)):
        if t is None and name != names[0]:
            continue
        _check_float_tensor(t, name, x.device)
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},) (x's last dimension), got {tuple(t.shape)}")
    for name, t in (("residual", residual), ("x1", x1), ("out", out), ("residual_out", residual_out)):
        if t is not None:
            _check_float_tensor(t, name, x.device)
            if t.shape != x.shape:
                raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if bias1 is not None and weight1 is None:
        raise ValueError("bias1 needs weight1 (the second output's weight)")
    if rowscale is not None:
        _check_float_tensor(rowscale, "rowscale", x.device)
        if rowscale.shape != x.shape[:-1]:
            raise ValueError(f"rowscale must have shape {tuple(x.shape[:-1])} (x's rows), got {tuple(rowscale.shape)}")
        if x1 is not None:
            raise ValueError("rowscale is not supported with x1 (parallel LayerNorm), as in flash-attn")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def _residual_dtype(x, residual, residual_in_fp32, residual_out) -> torch.dtype:
    if residual_out is not None:
        return residual_out.dtype
    if residual is not None:
        return residual.dtype
    return torch.float32 if residual_in_fp32 else x.dtype


def _pack(y, y1, residual_out, mask, mask1, prenorm, return_dropout_mask):
    """Upstream's result tuple: ``y[, y1][, residual_out][, mask, mask1]`` (a bare ``y`` alone)."""
    outs = (y,) + ((y1,) if y1 is not None else ()) + ((residual_out,) if prenorm else ())
    if return_dropout_mask:
        outs = outs + (mask, mask1)
    return outs[0] if len(outs) == 1 else outs


# ----------------------------------------------------------------------------------------------
# The PyTorch path (every device but CUDA): the kernels' formulas, differentiated by autograd
# ----------------------------------------------------------------------------------------------


def _is_plain(x, residual, x1, rowscale, dropout_p) -> bool:
    """Nothing is added to or scales ``x`` before the norm."""
    return residual is None and x1 is None and rowscale is None and dropout_p == 0.0


def _scale(w: torch.Tensor, zero_centered_weight: bool) -> torch.Tensor:
    return w.float() + 1.0 if zero_centered_weight else w.float()


class _CpuRmsNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, computed in fp32 (fp64 for fp64)
    and rounded once: PyTorch's CPU ``F.rms_norm`` is a chain of ops whose backward is recorded op
    by op; this saves only ``x`` and the per-row rstd (benchmarks/README.md, "RMSNorm's own
    autograd function"). The row formulas are :func:`_affine_rows` / :func:`_norm_backward_rows`."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        rows = x.reshape(-1, x.shape[-1])
        rstd = torch.linalg.vector_norm(rows, dim=-1, dtype=acc).square_().div_(rows.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(rows, weight, rstd)
        return _affine_rows(rows, weight, None, None, rstd).to(x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, rstd = ctx.saved_tensors
        dx, dweight, _ = _norm_backward_rows(dy.reshape(rows.shape), None, rows, weight, None, None, rstd,
                                             ctx.needs_input_grad[1])
        return dx.to(rows.dtype).view(dy.shape), dweight, None


def _plain_norm(x, weight, bias, eps, is_rms_norm):
    """The norm of ``x`` alone (weight and bias in x's dtype)."""
    if not is_rms_norm:
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    y = _CpuRmsNorm.apply(x, weight, eps) if x.device.type == "cpu" else F.rms_norm(x, x.shape[-1:], weight, eps=eps)
    return y + bias if bias is not None else y


def _torch_norm(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, residual_in_fp32,
                zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype, out, residual_out):
    res_dtype = _residual_dtype(x, residual, residual_in_fp32, residual_out)
    y_dtype = out.dtype if out is not None else (out_dtype or x.dtype)
    normalise = F.rms_norm if is_rms_norm else F.layer_norm  # PyTorch's own: fast, differentiable, traceable
    mask = mask1 = None
    y1 = None
    if (_is_plain(x, residual, x1, rowscale, dropout_p) and weight1 is None and not zero_centered_weight
            and all(t is None or t.dtype == x.dtype for t in (weight, bias))):
        # nothing before the norm and parameters in x's dtype: PyTorch's norm takes x as it is (it
        # accumulates in fp32 and rounds once, as the kernel does) without an fp32 copy of x
        h = x
        y = _plain_norm(x, weight, bias, eps, is_rms_norm).to(y_dtype)
    else:
        h = x.float()
        if rowscale is not None:
            h = h * rowscale.float().unsqueeze(-1)
        if dropout_p > 0.0:
            mask = torch.rand(x.shape, device=x.device) > dropout_p  # keep, as the kernel draws it
            h = torch.where(mask, h / (1.0 - dropout_p), 0.0)
        if x1 is not None:
            h1 = x1.float()
            if dropout_p > 0.0:
                mask1 = torch.rand(x.shape, device=x.device) > dropout_p
                h1 = torch.where(mask1, h1 / (1.0 - dropout_p), 0.0)
            h = h + h1
        if residual is not None:
            h = h + residual  # promotes to fp32 without a converted copy
        if weight1 is None:
            y = normalise(h, h.shape[-1:], _scale(weight, zero_centered_weight), eps=eps)
            y = (y + bias.float() if bias is not None else y).to(y_dtype)
        else:  # two outputs share one normalisation
            xhat = normalise(h, h.shape[-1:], eps=eps)
            y, y1 = ((xhat * _scale(w, zero_centered_weight) + (b.float() if b is not None else 0.0)).to(y_dtype)
                     for w, b in ((weight, bias), (weight1, bias1)))
    res = h.to(res_dtype) if prenorm or residual_out is not None else None
    if out is not None:  # upstream writes into given buffers; copy_ keeps the autograd graph
        y = out.copy_(y)
    if residual_out is not None:
        res = residual_out.copy_(res)
    return _pack(y, y1, res, mask, mask1, prenorm, return_dropout_mask)


# ----------------------------------------------------------------------------------------------
# The kernel path
# ----------------------------------------------------------------------------------------------


def _kernels():
    from flash_attn.ops.triton import _layer_norm_kernels  # noqa: PLC0415  (Triton is optional off CUDA)

    return _layer_norm_kernels


def _launch(kernel, grid, device: torch.device, **kwargs) -> None:
    """The kernel on CUDA; elsewhere (the tests' CPU tensors) in Triton's interpreter."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](**kwargs)
    else:
        from flash_attn.backends import _interpreter  # noqa: PLC0415  (numpy-heavy, tests only)

        _interpreter.launch(kernel, grid, **kwargs)


def _block_n(x: torch.Tensor) -> int:
    n = x.shape[-1]
    block = 1 << max(n - 1, 0).bit_length()
    if block * x.element_size() > _MAX_ROW_BYTES:
        raise RuntimeError(f"This layer norm doesn't support feature dim >= 64KB: x's last dimension is {n} "
                           f"({x.dtype}); rows of at most {_MAX_ROW_BYTES // x.element_size()} elements fit")
    return block


def _num_warps(block_n: int) -> int:
    return min(max(block_n // 256, 1), 16)


def _rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as (rows, features) with a unit last stride (a view where possible)."""
    if t is None:
        return None
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _none_as_empty(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Custom ops return tensors, not None: an absent output travels as an empty tensor."""
    return like.new_empty(0) if t is None else t


def _empty_as_none(t: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t.dim() == 1 and t.shape[0] == 0 else t


def _needs_residual_out(has_residual, has_x1, has_rowscale, dropout_p, res_dtype, x_dtype) -> bool:
    """Upstream writes ``residual_out`` only where it differs from ``x``; otherwise ``x`` is it."""
    return has_residual or has_x1 or has_rowscale or dropout_p > 0.0 or res_dtype != x_dtype


def _own_dresidual(has_residual, has_x1, has_rowscale, dropout_p, x_dtype, res_dtype) -> bool:
    """The residual's gradient is ``dx`` itself unless dropout / rowscale / x1 / a dtype change
    sit between them."""
    return has_residual and (has_x1 or has_rowscale or dropout_p > 0.0 or x_dtype != res_dtype)


@torch.library.custom_op("flash_attn::fused_norm_forward", mutates_args=())
def _fused_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
    x1: Optional[torch.Tensor], weight1: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
    rowscale: Optional[torch.Tensor], eps: float, dropout_p: float, zero_centered_weight: bool, is_rms_norm: bool,
    store_mask: bool, y_dtype: torch.dtype, res_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """The forward kernel on 2-D ``x``: ``(y, y1, residual_out, mean, rstd, seeds, mask, mask1)``,
    absent ones empty (``residual_out`` is absent where it would equal ``x``). A custom op, so
    ``torch.compile`` keeps it whole (fake implementation below) and nothing aliases an input."""
    m, n = x.shape
    y = torch.empty_like(x, dtype=y_dtype)
    y1 = torch.empty_like(y) if weight1 is not None else None
    res = None
    if _needs_residual_out(residual is not None, x1 is not None, rowscale is not None, dropout_p, res_dtype, x.dtype):
        res = torch.empty_like(x, dtype=res_dtype)
    mean = torch.empty(m, dtype=torch.float32, device=x.device) if not is_rms_norm else None
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    seeds = None
    if dropout_p > 0.0:  # one philox key per row (and per row of x1), drawn on the device
        seeds = torch.randint(2**31 - 1, (m if x1 is None else 2 * m,), device=x.device, dtype=torch.int64)
    store_mask = store_mask and dropout_p > 0.0
    mask = torch.empty(m, n, dtype=torch.bool, device=x.device) if store_mask else None
    mask1 = torch.empty(m, n, dtype=torch.bool, device=x.device) if store_mask and x1 is not None else None
    block = _block_n(x)
    if m:
        _launch(_kernels().norm_forward_kernel, (m,), x.device,
                X=x, X1=x1, RESIDUAL=residual, ROWSCALE=rowscale, SEEDS=seeds, W=weight, B=bias, W1=weight1,
                B1=bias1, Y=y, Y1=y1, RESIDUAL_OUT=res, MASK=mask, MASK1=mask1, MEAN=mean, RSTD=rstd,
                stride_x=x.stride(0), stride_x1=x1.stride(0) if x1 is not None else 0,
                stride_res=residual.stride(0) if residual is not None else 0, stride_y=y.stride(0),
                stride_y1=y1.stride(0) if y1 is not None else 0, stride_res_out=res.stride(0) if res is not None else 0,
                M=m, N=n, eps=float(eps), dropout_p=float(dropout_p),
                BLOCK_N=block, IS_RMS_NORM=bool(is_rms_norm), ZERO_CENTERED=bool(zero_centered_weight),
                HAS_X1=x1 is not None, HAS_RESIDUAL=residual is not None, HAS_ROWSCALE=rowscale is not None,
                HAS_DROPOUT=dropout_p > 0.0, STORE_MASK=store_mask, STORE_RESIDUAL_OUT=res is not None,
                HAS_BIAS=bias is not None, HAS_W1=weight1 is not None, HAS_B1=bias1 is not None,
                num_warps=_num_warps(block))
    return tuple(_none_as_empty(t, x) for t in (y, y1, res, mean, rstd, seeds, mask, mask1))


@_fused_norm_forward.register_fake
def _(x, weight, bias, residual, x1, weight1, bias1, rowscale, eps, dropout_p, zero_centered_weight, is_rms_norm,
      store_mask, y_dtype, res_dtype):
    m, n = x.shape
    _block_n(x)
    store = store_mask and dropout_p > 0.0
    needs_res = _needs_residual_out(residual is not None, x1 is not None, rowscale is not None, dropout_p, res_dtype,
                                    x.dtype)

    def new(present, shape, dtype):  # a distinct empty tensor for each absent output (no aliasing)
        return x.new_empty(shape if present else 0, dtype=dtype if present else x.dtype)

    return (new(True, (m, n), y_dtype), new(weight1 is not None, (m, n), y_dtype), new(needs_res, (m, n), res_dtype),
            new(not is_rms_norm, m, torch.float32), new(True, m, torch.float32),
            new(dropout_p > 0.0, m if x1 is None else 2 * m, torch.int64), new(store, (m, n), torch.bool),
            new(store and x1 is not None, (m, n), torch.bool))


def _programs(device: torch.device, m: int) -> int:
    """Programs of the backward: a few per SM on CUDA (each sums its rows' dw); few elsewhere."""
    if device.type == "cuda":
        return max(1, min(m, torch.cuda.get_device_properties(device).multi_processor_count * 8))
    return max(1, min(m, 4))


@torch.library.custom_op("flash_attn::fused_norm_backward", mutates_args=())
def _fused_norm_backward(
    dy: torch.Tensor, dy1: Optional[torch.Tensor], dresidual: Optional[torch.Tensor], h: torch.Tensor,
    weight: torch.Tensor, bias: Optional[torch.Tensor], weight1: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
    mean: Optional[torch.Tensor], rstd: torch.Tensor, rowscale: Optional[torch.Tensor], seeds: Optional[torch.Tensor],
    dropout_p: float, has_residual: bool, has_x1: bool, zero_centered_weight: bool, is_rms_norm: bool,
    x_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel: ``(dx, dw, db, dresidual, dx1, dw1, db1)``, absent ones empty
    (``dresidual`` / ``dx1`` are absent where they equal ``dx``). ``h`` is the saved
    ``residual_out``: the kernel recomputes the normalised rows from it and the statistics."""
    m, n = h.shape
    dx = torch.empty((m, n), dtype=x_dtype, device=h.device)
    own = _own_dresidual(has_residual, has_x1, rowscale is not None, dropout_p, x_dtype, h.dtype)
    dres_in = torch.empty_like(h) if own else None
    dx1 = torch.empty_like(dx) if has_x1 and dropout_p > 0.0 else None
    programs = _programs(h.device, m)
    dw_part = torch.zeros((programs, n), dtype=torch.float32, device=h.device)
    db_part = torch.zeros_like(dw_part) if bias is not None else None
    dw1_part = torch.zeros_like(dw_part) if weight1 is not None else None
    db1_part = torch.zeros_like(dw_part) if bias1 is not None else None
    block = _block_n(h)
    if m:
        _launch(_kernels().norm_backward_kernel, (programs,), h.device,
                H=h, DY=dy, DY1=dy1, DRESIDUAL=dresidual, W=weight, W1=weight1, MEAN=mean, RSTD=rstd,
                ROWSCALE=rowscale, SEEDS=seeds, DX=dx, DX1=dx1, DRESIDUAL_IN=dres_in, DW_PART=dw_part,
                DB_PART=db_part, DW1_PART=dw1_part, DB1_PART=db1_part,
                stride_h=h.stride(0), stride_dy=dy.stride(0), stride_dy1=dy1.stride(0) if dy1 is not None else 0,
                stride_dres=dresidual.stride(0) if dresidual is not None else 0, stride_dx=dx.stride(0),
                stride_dx1=dx1.stride(0) if dx1 is not None else 0,
                stride_dres_in=dres_in.stride(0) if dres_in is not None else 0,
                M=m, N=n, dropout_p=float(dropout_p), rows_per_program=math.ceil(m / programs),
                BLOCK_N=block, IS_RMS_NORM=bool(is_rms_norm), ZERO_CENTERED=bool(zero_centered_weight),
                HAS_DY1=dy1 is not None, HAS_DRESIDUAL=dresidual is not None, STORE_DRESIDUAL=dres_in is not None,
                HAS_ROWSCALE=rowscale is not None, HAS_DROPOUT=dropout_p > 0.0, STORE_DX1=dx1 is not None,
                HAS_BIAS=bias is not None, HAS_B1=bias1 is not None, num_warps=_num_warps(block))
    dw = dw_part.sum(0).to(weight.dtype)
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    dw1 = dw1_part.sum(0).to(weight1.dtype) if weight1 is not None else None
    db1 = db1_part.sum(0).to(bias1.dtype) if bias1 is not None else None
    return tuple(_none_as_empty(t, h) for t in (dx, dw, db, dres_in, dx1, dw1, db1))


@_fused_norm_backward.register_fake
def _(dy, dy1, dresidual, h, weight, bias, weight1, bias1, mean, rstd, rowscale, seeds, dropout_p, has_residual,
      has_x1, zero_centered_weight, is_rms_norm, x_dtype):
    own = _own_dresidual(has_residual, has_x1, rowscale is not None, dropout_p, x_dtype, h.dtype)

    def like(t):  # a distinct empty tensor for each absent output (no aliasing)
        return torch.empty_like(t) if t is not None else h.new_empty(0)

    return (h.new_empty(h.shape, dtype=x_dtype), like(weight), like(bias), like(h if own else None),
            h.new_empty(h.shape, dtype=x_dtype) if has_x1 and dropout_p > 0.0 else h.new_empty(0), like(weight1),
            like(bias1))


class LayerNormFn(torch.autograd.Function):
    """The fused norm with its Triton kernels, forward and backward (upstream's ``LayerNormFn``,
    same ``apply`` arguments), through the custom ops ``flash_attn::fused_norm_forward`` /
    ``fused_norm_backward``. CUDA tensors run compiled kernels; CPU tensors run them in Triton's
    interpreter (slow: :func:`layer_norm_fn` takes the PyTorch path there)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False, is_rms_norm=False,
                return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
        _check_args(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, out, residual_out,
                    _flags(prenorm, residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask), out_dtype)
        shape = x.shape
        res_dtype = _residual_dtype(x, residual, residual_in_fp32, residual_out)
        y_dtype = out.dtype if out is not None else (out_dtype or x.dtype)
        weight, bias, weight1, bias1 = (t.contiguous() if t is not None else None for t in (weight, bias, weight1, bias1))
        rowscale = rowscale.reshape(-1).contiguous() if rowscale is not None else None
        x2 = _rows(x)
        results = _fused_norm_forward(x2, weight, bias, _rows(residual), _rows(x1), weight1, bias1, rowscale,
                                      float(eps), float(dropout_p), bool(zero_centered_weight), bool(is_rms_norm),
                                      bool(return_dropout_mask), y_dtype, res_dtype)
        y, y1, res, mean, rstd, seeds, mask, mask1 = (_empty_as_none(t) for t in results)
        y = y.view(shape)
        res = res.view(shape) if res is not None else x  # upstream hands back x itself here
        if out is not None:  # given buffers receive the results (the op itself writes fresh tensors)
            y = out.copy_(y)
        if residual_out is not None:
            res = residual_out.copy_(res)
        ctx.save_for_backward(res, weight, bias, weight1, bias1, rowscale, seeds, mean, rstd)
        ctx.shape, ctx.x_dtype, ctx.dropout_p, ctx.prenorm = shape, x.dtype, float(dropout_p), bool(prenorm)
        ctx.has_residual, ctx.has_x1 = residual is not None, x1 is not None
        ctx.zero_centered_weight, ctx.is_rms_norm = bool(zero_centered_weight), bool(is_rms_norm)
        if mask is not None:
            ctx.mark_non_differentiable(*(t for t in (mask, mask1) if t is not None))
        shaped = (t.view(shape) if t is not None else None for t in (y1, mask, mask1))
        y1, mask, mask1 = shaped
        return _pack(y, y1, res, mask, mask1, prenorm, return_dropout_mask)

    @staticmethod
    def backward(ctx, dy, *rest):
        h, weight, bias, weight1, bias1, rowscale, seeds, mean, rstd = ctx.saved_tensors
        rest = list(rest)
        dy1 = rest.pop(0) if weight1 is not None else None
        dresidual = rest.pop(0) if ctx.prenorm else None
        n = ctx.shape[-1]
        h2 = _rows(h)
        # an output unused by the loss may come as None: its gradient is zero
        dy = _rows(dy) if dy is not None else torch.zeros(h2.shape, dtype=ctx.x_dtype, device=h.device)
        if weight1 is not None and dy1 is None:
            dy1 = torch.zeros_like(dy)
        results = _fused_norm_backward(dy, _rows(dy1), _rows(dresidual), h2.view(-1, n), weight, bias, weight1,
                                       bias1, mean, rstd, rowscale, seeds, ctx.dropout_p, ctx.has_residual,
                                       ctx.has_x1, ctx.zero_centered_weight, ctx.is_rms_norm, ctx.x_dtype)
        dx, dw, db, dres, dx1, dw1, db1 = (_empty_as_none(t) for t in results)
        if ctx.has_residual and dres is None:
            dres = dx
        if ctx.has_x1 and dx1 is None:
            dx1 = dx
        shape = ctx.shape
        return (dx.view(shape), dw, db, dres.view(shape) if dres is not None else None,
                dx1.view(shape) if dx1 is not None else None, dw1, db1) + (None,) * 11


# ----------------------------------------------------------------------------------------------
# Public functions and the module
# ----------------------------------------------------------------------------------------------


def _norm(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, residual_in_fp32,
          zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype, out, residual_out):
    args = (x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, residual_in_fp32,
            zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype, out, residual_out)
    if isinstance(x, torch.Tensor) and x.is_cuda and triton_available():
        return LayerNormFn.apply(*args)
    _check_args(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, out, residual_out,
                _flags(prenorm, residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask), out_dtype)
    return _torch_norm(*args)


def _flags(prenorm, residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask) -> dict:
    return dict(prenorm=prenorm, residual_in_fp32=residual_in_fp32, zero_centered_weight=zero_centered_weight,
                is_rms_norm=is_rms_norm, return_dropout_mask=return_dropout_mask)


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False, is_rms_norm=False,
                  return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    """Fused ``dropout(x * rowscale) [+ dropout(x1)] [+ residual]`` then LayerNorm (RMSNorm with
    ``is_rms_norm``) with ``weight``/``bias`` [and a second output with ``weight1``/``bias1``].

    Returns ``y``; with ``weight1`` also ``y1``; with ``prenorm`` also ``residual_out`` (the sum
    before the norm, in ``residual``'s dtype, fp32 with ``residual_in_fp32``); with
    ``return_dropout_mask`` also the bool keep-masks of ``x`` and ``x1`` (None without dropout),
    in that order. ``out`` / ``residual_out`` are optional buffers written in place; ``out_dtype``
    is ``y``'s dtype (default ``x``'s). See the module docstring for where it runs.
    """
    return _norm(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, residual_in_fp32,
                 zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype, out, residual_out)


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    """:func:`layer_norm_fn` with RMSNorm (``x * rsqrt(mean(x^2) + eps) * weight [+ bias]``)."""
    return _norm(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, residual_in_fp32,
                 zero_centered_weight, True, return_dropout_mask, out_dtype, out, residual_out)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension (no bias), with optional fused residual add and dropout
    (in training only), as upstream's ``flash_attn.ops.triton.layer_norm.RMSNorm``."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None, dtype=None):
        super().__init__()
        hidden_size = validation.check_int(hidden_size, "hidden_size", minimum=1)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
        zero_centered_weight = validation.check_flag(zero_centered_weight, "zero_centered_weight")
        if dtype is not None and isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        # the effective scale starts at 1 either way
        torch.nn.init.zeros_(self.weight) if self.zero_centered_weight else torch.nn.init.ones_(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        validation.check_flag(prenorm, "prenorm")
        validation.check_flag(residual_in_fp32, "residual_in_fp32")
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
                           prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                           zero_centered_weight=self.zero_centered_weight)


def _linear_dtype(y: torch.Tensor) -> torch.dtype:
    """The linear layer's dtype: autocast's for the tensor's device when autocast is on."""
    device = y.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else y.dtype


class LayerNormLinearFn(torch.autograd.Function):
    """Norm then ``F.linear`` (upstream's ``LayerNormLinearFn``, same ``apply`` arguments). The
    normalised activations are not kept for the backward: it recomputes them from the saved
    residual stream and statistics (one row tensor less in memory)."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-6, prenorm=False,
                residual_in_fp32=False, is_rms_norm=False):
        _check_args(x, norm_weight, norm_bias, residual, None, None, None, eps, 0.0, None, None, None,
                    dict(prenorm=prenorm, residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm),
                    names=("norm_weight", "norm_bias"))
        _check_float_tensor(linear_weight, "linear_weight", x.device)
        if linear_weight.dim() != 2 or linear_weight.shape[1] != x.shape[-1]:
            raise ValueError(f"linear_weight must have shape (out_features, {x.shape[-1]}), got "
                             f"{tuple(linear_weight.shape)}")
        if linear_bias is not None:
            _check_float_tensor(linear_bias, "linear_bias", x.device)
            if tuple(linear_bias.shape) != (linear_weight.shape[0],):
                raise ValueError(f"linear_bias must have shape ({linear_weight.shape[0]},) (out_features), got "
                                 f"{tuple(linear_bias.shape)}")
        shape = x.shape
        with torch.no_grad():
            h = _torch_norm(x.detach(), norm_weight, norm_bias, residual, None, None, None, eps, 0.0, None, True,
                            residual_in_fp32, False, is_rms_norm, False, None, None, None)[1]
            h = h.reshape(-1, shape[-1])
            hf = h.float()
            mean = None if is_rms_norm else hf.mean(-1)
            centred = hf if is_rms_norm else hf - mean.unsqueeze(-1)
            rstd = torch.rsqrt(centred.square().mean(-1) + eps)
            y = _affine_rows(h, norm_weight, norm_bias, mean, rstd).to(x.dtype)
        dtype = _linear_dtype(y)
        linear_weight = linear_weight.to(dtype)
        linear_bias = linear_bias.to(dtype) if linear_bias is not None else None
        out = F.linear(y.to(dtype), linear_weight, linear_bias)
        ctx.save_for_backward(h, norm_weight, norm_bias, linear_weight, mean, rstd)
        ctx.shape, ctx.x_dtype, ctx.prenorm = shape, x.dtype, bool(prenorm)
        ctx.has_residual, ctx.is_rms_norm, ctx.has_linear_bias = residual is not None, bool(is_rms_norm), linear_bias is not None
        out = out.view(*shape[:-1], out.shape[-1])
        return (out, h.view(shape)) if prenorm else out

    @staticmethod
    def backward(ctx, dout, *rest):
        h, norm_weight, norm_bias, linear_weight, mean, rstd = ctx.saved_tensors
        dout = dout.reshape(-1, dout.shape[-1])
        y = _affine_rows(h, norm_weight, norm_bias, mean, rstd).to(linear_weight.dtype)
        dlinear_weight = dout.t().to(y.dtype) @ y
        dlinear_bias = dout.sum(0) if ctx.has_linear_bias else None
        dy = (dout.to(linear_weight.dtype) @ linear_weight).float()
        dresidual = rest[0].reshape(-1, h.shape[-1]).float() if ctx.prenorm and rest[0] is not None else None
        dx, dw, db = _norm_backward_rows(dy, dresidual, h, norm_weight, norm_bias, mean, rstd)
        dres = dx.to(h.dtype).view(ctx.shape) if ctx.has_residual else None
        return (dx.to(ctx.x_dtype).view(ctx.shape), dw, db, dlinear_weight, dlinear_bias, dres, None, None, None, None)


def _normalised_rows(h, mean, rstd):
    """A copy of rows ``h`` in rstd's dtype, centred (LayerNorm: ``mean`` given) and scaled by
    ``rstd``: the one temporary the row formulas below work in."""
    xhat = h.to(rstd.dtype, copy=True)
    if mean is not None:
        xhat.sub_(mean.unsqueeze(-1))
    return xhat.mul_(rstd.unsqueeze(-1))


def _affine_rows(h, weight, bias, mean, rstd):
    y = _normalised_rows(h, mean, rstd).mul_(weight.to(rstd.dtype))
    return y.add_(bias.to(rstd.dtype)) if bias is not None else y


def _norm_backward_rows(dy, dresidual, h, weight, bias, mean, rstd, parameter_grads=True):
    """The kernel's backward formulas in PyTorch (in rstd's dtype, fp32 or fp64): ``dx`` (with
    the residual's gradient added), ``dweight``, ``dbias`` (``None`` without ``parameter_grads``:
    a full pass over the rows saved). Neither ``dy`` nor ``h`` is written."""
    xhat = _normalised_rows(h, mean, rstd)
    dw = (dy * xhat).sum(0).to(weight.dtype) if parameter_grads else None
    db = dy.sum(0).to(bias.dtype) if bias is not None and parameter_grads else None
    g = dy.to(rstd.dtype, copy=True).mul_(weight.to(rstd.dtype))  # one dtype per op: the fast CPU loops
    g_mean = g.mean(-1, keepdim=True) if mean is not None else None
    dh = g.sub_(xhat.mul_(torch.linalg.vecdot(g, xhat, dim=-1).div_(h.shape[-1]).unsqueeze(-1)))
    if g_mean is not None:
        dh.sub_(g_mean)
    dh.mul_(rstd.unsqueeze(-1))
    if dresidual is not None:
        dh.add_(dresidual)
    return dh, dw, db


def layer_norm_linear_fn(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-6,
                         prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    """``F.linear(norm(x [+ residual]), linear_weight, linear_bias)`` (and ``residual_out`` with
    ``prenorm``); under autocast the linear runs in autocast's dtype, as upstream's."""
    return LayerNormLinearFn.apply(x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps, prenorm,
                                   residual_in_fp32, is_rms_norm)
