"""Upstream's ``flash_attn.ops.rms_norm`` (built on the ``dropout_layer_norm`` CUDA extension;
conda-forge's ``flash-attn-layer-norm``), on :mod:`flash_attn.ops.layer_norm` with RMSNorm:
``x * rsqrt(mean(x^2) + eps) * weight``. Same arguments, defaults and returns as upstream.
"""

from __future__ import annotations

import torch

from flash_attn.ops.layer_norm import (
    DropoutAddLayerNormFn,
    _check,
    check_module_options,
    dropout_add_norm,
    parallel_residual_norm,
    subset_norm,
)

__all__ = ["DropoutAddRMSNorm", "RMSNorm", "dropout_add_rms_norm", "dropout_add_rms_norm_parallel_residual",
           "dropout_add_rms_norm_subset", "rms_norm"]


def rms_norm(x, weight, epsilon):
    _check({"x": x}, None, {"weight": weight}, epsilon=epsilon)
    return DropoutAddLayerNormFn.apply(x, None, weight, None, None, None, 0.0, epsilon, False, False, True)


def dropout_add_rms_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                         prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """``RMSNorm(dropout(x0 * rowscale * layerscale) + residual)``, returns as
    :func:`flash_attn.ops.layer_norm.dropout_add_layer_norm`."""
    return dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                            residual_in_fp32, return_dropout_mask, True)


def dropout_add_rms_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale=None, x0_subset=None,
                                out_subset=None, rowscale_const=1.0, out_numrows=0, prenorm=False,
                                residual_in_fp32=False, return_dropout_mask=False):
    return subset_norm(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset, out_subset,
                       rowscale_const, out_numrows, prenorm, residual_in_fp32, return_dropout_mask, True)


def dropout_add_rms_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon,
                                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    return parallel_residual_norm(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                                  residual_in_fp32, return_dropout_mask, True)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
        super().__init__()
        check_module_options(hidden_size, eps, dtype)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class DropoutAddRMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False, device=None, dtype=None):
        super().__init__()
        check_module_options(hidden_size, eps, dtype, p=p, prenorm=prenorm, residual_in_fp32=residual_in_fp32)
        self.prenorm, self.p, self.eps, self.residual_in_fp32 = prenorm, p, eps, residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x0, residual=None):
        return dropout_add_rms_norm(x0, residual, self.weight, None, self.p if self.training else 0.0, self.eps,
                                    prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)
