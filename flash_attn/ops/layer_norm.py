"""Upstream's ``flash_attn.ops.layer_norm`` (the ``dropout_layer_norm`` CUDA extension's Python API;
conda-forge's ``flash-attn-layer-norm``), on this package's fused norm, :mod:`flash_attn.ops.triton.layer_norm`.

``dropout(x0 * rowscale * layerscale) + residual`` then LayerNorm, with the same arguments,
defaults and returns as upstream; the second output of ``..._parallel_residual`` is the Triton
norm's ``x1`` / ``weight1``. Triton kernels on CUDA, exact PyTorch elsewhere, every dtype and hidden
size the Triton norm takes (upstream's extension: hidden sizes up to 8192 in steps of 8).
``layerscale`` (upstream's per-feature ``colscale``) multiplies ``x0`` before the fused call, so
its gradient comes from autograd. The ``*Fn`` classes keep upstream's ``.apply`` argument order;
their autograd formula is the Triton norm's.

The ``*_subset`` variants (upstream's stochastic depth fused into the norm) scatter the present
rows of ``x0`` into the full rows, add, normalise and gather the output rows, each a PyTorch
index operation around the same fused norm. Not provided: the ``_dropout_add_layer_norm_*``
wrappers of the extension's raw entry points (docs/compatibility.md, "Upstream's module surface").
"""

from __future__ import annotations

import torch

from flash_attn import validation
from flash_attn.ops.triton.layer_norm import layer_norm_fn

__all__ = [
    "DropoutAddLayerNorm", "DropoutAddLayerNormFn", "DropoutAddLayerNormParallelResidualFn", "DropoutAddLayerNormSubsetFn",
    "dropout_add_layer_norm", "dropout_add_layer_norm_parallel_residual", "dropout_add_layer_norm_subset", "layer_norm",
    "maybe_align",
]  # check_module_options and the _check helpers are flash_attn.ops.rms_norm's too, not upstream's API


def maybe_align(x, alignment_in_bytes=16):
    """``x`` itself if its data is aligned to ``alignment_in_bytes``, else an aligned copy."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"maybe_align: x must be a torch.Tensor, got {type(x).__name__}")
    alignment_in_bytes = validation.check_int(alignment_in_bytes, "alignment_in_bytes", minimum=1)
    return x if x.data_ptr() % alignment_in_bytes == 0 else x.clone()


def _check(inputs: dict, residual=None, features: dict = None, rowscale=None, dropout_p=0.0, epsilon=0.0,
           flags: dict = None, subset: bool = False, residual_name: str = "residual") -> None:
    """Upstream's arguments under upstream's names (the Triton norm underneath names its own):
    ``inputs`` the rows to normalise (the first one sets the shape; the others may be None),
    ``features`` per-feature tensors ``(hidden,)`` or None, ``rowscale`` one scale per row,
    ``subset``: the residual holds the full rows (only its width is checked)."""
    (first_name, first), *others = inputs.items()
    _float_tensor(first, first_name)
    if first.dim() < 1 or first.shape[-1] == 0:
        raise ValueError(f"{first_name} must have shape (..., hidden_size) with hidden_size >= 1, got {tuple(first.shape)}")
    hidden, rows = first.shape[-1], first.numel() // first.shape[-1]
    for name, t in others:
        if t is not None:
            _float_tensor(t, name)
            _same(t, name, first.shape, first, first_name)
    if residual is not None:
        _float_tensor(residual, residual_name)
        _same(residual, residual_name, None if subset else first.shape, first, first_name)
        if residual.dim() < 1 or residual.shape[-1] != hidden:
            raise ValueError(f"{residual_name} must have shape (..., {hidden}), got {tuple(residual.shape)}")
    for name, t in (features or {}).items():
        if t is not None:
            _float_tensor(t, name)
            _same(t, name, (hidden,), first, first_name)
    if rowscale is not None:
        _float_tensor(rowscale, "rowscale")
        _same(rowscale, "rowscale", None, first, first_name)
        if rowscale.numel() != rows:
            raise ValueError(f"rowscale must have one entry per row ({rows}), got shape {tuple(rowscale.shape)}")
    if not 0.0 <= validation._real(dropout_p, "dropout_p", "a float in [0, 1)") < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if not validation._real(epsilon, "epsilon", "a float >= 0") >= 0.0:
        raise ValueError(f"epsilon must be a float >= 0, got {epsilon!r}")
    for name, value in (flags or {}).items():
        validation.check_flag(value, name)


def _float_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {validation._describe(t)}")


def _same(t, name: str, shape, first, first_name: str) -> None:
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (from {first_name}'s {tuple(first.shape)}), "
                         f"got {tuple(t.shape)}")
    if t.device != first.device:
        raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def _check_subsets(x0, residual, x0_subset, out_subset, rowscale_const, out_numrows) -> None:
    for name, t in (("x0_subset", x0_subset), ("out_subset", out_subset)):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (batch, seqlen), got {validation._describe(t)}")
        if t.device != x0.device:
            raise ValueError(f"{name} is on {t.device} but x0 is on {x0.device}")
    if x0_subset.shape != out_subset.shape:
        raise ValueError(f"out_subset must have x0_subset's shape {tuple(x0_subset.shape)}, got {tuple(out_subset.shape)}")
    if residual is not None and residual.numel() != x0_subset.numel() * x0.shape[-1]:
        raise ValueError(f"residual must hold the full rows ({x0_subset.numel()}, {x0.shape[-1]}) of x0_subset, "
                         f"got shape {tuple(residual.shape)}")
    validation._real(rowscale_const, "rowscale_const", "a float")
    validation.check_int(out_numrows, "out_numrows", minimum=0)


def _masks(result, dropped, return_dmask: bool):
    """The Triton norm's ``y[, y1][, residual][, mask, mask1]`` as upstream's extension returns it:
    the masks (uint8, 1 = kept) only when asked for, one per dropped input (``dropped``: x0[, x1]),
    all ones without dropout."""
    if not return_dmask:
        return result
    *values, mask, mask1 = result
    masks = [torch.ones(x.shape, dtype=torch.uint8, device=x.device) if m is None else m.to(torch.uint8).view(x.shape)
             for m, x in zip((mask, mask1), dropped)]
    return (*values, *masks)


def _scaled(x0, layerscale):
    return x0 if layerscale is None else x0 * layerscale


class DropoutAddLayerNormFn:
    """Upstream's autograd class, by its ``apply``: ``(x0, residual, gamma, beta, rowscale, colscale,
    dropout_p, epsilon, residual_in_fp32=False, prenorm=False, is_rms_norm=False, return_dmask=False)``."""

    @staticmethod
    def apply(x0, residual, gamma, beta, rowscale, colscale, dropout_p, epsilon, residual_in_fp32=False,
              prenorm=False, is_rms_norm=False, return_dmask=False):
        _check({"x0": x0}, residual, {"gamma": gamma, "beta": beta, "colscale": colscale}, rowscale, dropout_p,
               epsilon, {"residual_in_fp32": residual_in_fp32, "prenorm": prenorm, "is_rms_norm": is_rms_norm,
                         "return_dmask": return_dmask})
        result = layer_norm_fn(_scaled(x0, colscale), gamma, beta, residual, eps=epsilon, dropout_p=dropout_p,
                               rowscale=rowscale, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                               is_rms_norm=is_rms_norm, return_dropout_mask=return_dmask)
        return _masks(result, (x0,), return_dmask)


class DropoutAddLayerNormParallelResidualFn:
    """Upstream's autograd class, by its ``apply``: ``(x0, x1, residual, gamma0, beta0, gamma1, beta1,
    dropout_p, epsilon, residual_in_fp32=False, prenorm=False, is_rms_norm=False, return_dmask=False)``."""

    @staticmethod
    def apply(x0, x1, residual, gamma0, beta0, gamma1, beta1, dropout_p, epsilon, residual_in_fp32=False,
              prenorm=False, is_rms_norm=False, return_dmask=False):
        _check({"x0": x0, "x1": x1}, residual, {"gamma0": gamma0, "beta0": beta0, "gamma1": gamma1, "beta1": beta1},
               None, dropout_p, epsilon, {"residual_in_fp32": residual_in_fp32, "prenorm": prenorm,
                                          "is_rms_norm": is_rms_norm, "return_dmask": return_dmask})
        result = layer_norm_fn(x0, gamma0, beta0, residual, x1, gamma1, beta1, eps=epsilon, dropout_p=dropout_p,
                               prenorm=prenorm, residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm,
                               return_dropout_mask=return_dmask)
        if gamma1 is None:  # upstream returns (out0, None, ...) without a second norm
            result = (result,) if not isinstance(result, tuple) else result
            result = (result[0], None, *result[1:])
        return _masks(result, (x0,) if x1 is None else (x0, x1), return_dmask)


def _present(subset):
    """Positions (in the full rows) a subset map marks present, and the row each maps to
    (``subset[i] = k > 0``: full row i is row k - 1 of the subset tensor)."""
    rows = subset.reshape(-1).long()
    where = torch.nonzero(rows > 0).squeeze(1)
    return where, rows[where] - 1


class DropoutAddLayerNormSubsetFn:
    """Upstream's autograd class, by its ``apply``: ``(x0, residual, gamma, beta, colscale, x0_subset,
    out_subset, dropout_p, epsilon, rowscale_const, out_numrows, residual_in_fp32=False,
    prenorm=False, is_rms_norm=False, return_dmask=False)``.

    ``x0`` holds only the present rows: ``x0_subset`` ``(batch, seqlen)`` int32 maps full row ``i``
    to row ``x0_subset[i] - 1`` of ``x0`` (0: absent, i.e. zero), ``out_subset`` likewise to the
    ``out_numrows`` output rows. ``z = dropout(x0 * colscale * rowscale_const) + residual`` over the
    full rows; returns ``LayerNorm(z)`` at the output rows ``(out_numrows, hidden)``, with ``prenorm``
    also ``z`` ``(batch * seqlen, hidden)``, with ``return_dmask`` ``x0``'s uint8 mask."""

    @staticmethod
    def apply(x0, residual, gamma, beta, colscale, x0_subset, out_subset, dropout_p, epsilon, rowscale_const,
              out_numrows, residual_in_fp32=False, prenorm=False, is_rms_norm=False, return_dmask=False):
        _check({"x0": x0}, residual, {"gamma": gamma, "beta": beta, "colscale": colscale}, None, dropout_p, epsilon,
               {"residual_in_fp32": residual_in_fp32, "prenorm": prenorm, "is_rms_norm": is_rms_norm,
                "return_dmask": return_dmask}, subset=True)
        _check_subsets(x0, residual, x0_subset, out_subset, rowscale_const, out_numrows)
        hidden = x0.shape[-1]
        full = x0_subset.numel()
        x0_at, x0_rows = _present(x0_subset)
        scaled = _scaled(x0, colscale) * rowscale_const
        x_full = scaled.new_zeros((full, hidden)).index_copy(0, x0_at, scaled.reshape(-1, hidden)[x0_rows])
        res = None if residual is None else residual.reshape(full, hidden)
        result = layer_norm_fn(x_full, gamma, beta, res, eps=epsilon, dropout_p=dropout_p, prenorm=True,
                               residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm,
                               return_dropout_mask=return_dmask)
        y, z = result[:2]
        out_at, out_rows = _present(out_subset)
        out = y.new_zeros((out_numrows, hidden)).index_copy(0, out_rows, y[out_at])
        outs = (out, z) if prenorm else (out,)
        if return_dmask:
            mask = result[2]
            dmask = torch.ones(x0.shape, dtype=torch.uint8, device=x0.device)
            if mask is not None:
                dmask.reshape(-1, hidden)[x0_rows] = mask[x0_at].to(torch.uint8)
            outs = outs + (dmask,)
        return outs[0] if len(outs) == 1 else outs


def dropout_add_layer_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale=None, x0_subset=None,
                                  out_subset=None, rowscale_const=1.0, out_numrows=0, prenorm=False,
                                  residual_in_fp32=False, return_dropout_mask=False):
    """:func:`dropout_add_layer_norm` over a subset of rows (see :class:`DropoutAddLayerNormSubsetFn`)."""
    return subset_norm(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset, out_subset,
                       rowscale_const, out_numrows, prenorm, residual_in_fp32, return_dropout_mask, False)


def subset_norm(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset, out_subset, rowscale_const,
                out_numrows, prenorm, residual_in_fp32, return_dropout_mask, is_rms_norm):
    """The subset functions' body (checked under the functions' names), LayerNorm or RMSNorm."""
    _check({"x0": x0}, residual, {"weight": weight, "bias": bias, "layerscale": layerscale}, None, dropout_p, epsilon,
           {"prenorm": prenorm, "residual_in_fp32": residual_in_fp32, "return_dropout_mask": return_dropout_mask},
           subset=True)
    return DropoutAddLayerNormSubsetFn.apply(x0, residual, weight, bias, layerscale, x0_subset, out_subset, dropout_p,
                                             epsilon, rowscale_const, out_numrows, residual_in_fp32, prenorm,
                                             is_rms_norm, return_dropout_mask)


def layer_norm(x, weight, bias, epsilon):
    _check({"x": x}, None, {"weight": weight, "bias": bias}, epsilon=epsilon)
    return DropoutAddLayerNormFn.apply(x, None, weight, bias, None, None, 0.0, epsilon, False)


def dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """``LayerNorm(dropout(x0 * rowscale * layerscale) + residual)``; returns ``out``, with ``prenorm``
    ``(out, residual_out)``, with ``return_dropout_mask`` the uint8 mask last. residual_in_fp32
    only has an effect if residual is None."""
    return dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                            residual_in_fp32, return_dropout_mask, False)


def dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm, residual_in_fp32,
                     return_dropout_mask, is_rms_norm):
    """The dropout_add functions' body (checked under the functions' names), LayerNorm or RMSNorm."""
    _check({"x0": x0}, residual, {"weight": weight, "bias": bias, "layerscale": layerscale}, rowscale, dropout_p,
           epsilon, {"prenorm": prenorm, "residual_in_fp32": residual_in_fp32,
                     "return_dropout_mask": return_dropout_mask})
    return DropoutAddLayerNormFn.apply(x0, residual, weight, bias, rowscale, layerscale, dropout_p, epsilon,
                                       residual_in_fp32, prenorm, is_rms_norm, return_dropout_mask)


def dropout_add_layer_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon,
                                             prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """``z = dropout(x0) + dropout(x1) + residual``; returns ``(LayerNorm(z; weight0, bias0),
    LayerNorm(z; weight1, bias1) or None)``, with ``prenorm`` also ``z``, with ``return_dropout_mask``
    the masks of x0 and x1."""
    return parallel_residual_norm(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                                  residual_in_fp32, return_dropout_mask, False)


def parallel_residual_norm(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                           residual_in_fp32, return_dropout_mask, is_rms_norm):
    """The parallel-residual functions' body (checked under the functions' names), LayerNorm or RMSNorm."""
    _check({"x0": x0, "x1": x1}, residual, {"weight0": weight0, "bias0": bias0, "weight1": weight1, "bias1": bias1},
           None, dropout_p, epsilon, {"prenorm": prenorm, "residual_in_fp32": residual_in_fp32,
                                      "return_dropout_mask": return_dropout_mask})
    return DropoutAddLayerNormParallelResidualFn.apply(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p,
                                                       epsilon, residual_in_fp32, prenorm, is_rms_norm,
                                                       return_dropout_mask)


def check_module_options(hidden_size, eps, dtype, p=0.0, **flags) -> None:
    """The norm modules' constructor arguments (also :mod:`flash_attn.ops.rms_norm`'s)."""
    validation.check_int(hidden_size, "hidden_size", minimum=1)
    if not 0.0 <= validation._real(p, "p", "a float in [0, 1)") < 1.0:
        raise ValueError(f"p must be a dropout probability in [0, 1), got {p!r}")
    if not validation._real(eps, "eps", "a float >= 0") >= 0.0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    for name, value in flags.items():
        validation.check_flag(value, name)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")


class DropoutAddLayerNorm(torch.nn.Module):
    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False, device=None, dtype=None):
        super().__init__()
        check_module_options(hidden_size, eps, dtype, p=p, prenorm=prenorm, residual_in_fp32=residual_in_fp32)
        self.prenorm, self.p, self.eps, self.residual_in_fp32 = prenorm, p, eps, residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, x0, residual=None):
        return dropout_add_layer_norm(x0, residual, self.weight, self.bias, self.p if self.training else 0.0,
                                      self.eps, prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)
