"""Upstream's ``flash_attn.ops.triton.mlp``: ``FusedDenseSqreluDense``, the MLP
``fc2(relu(fc1(x)) ** 2)`` whose first layer, bias and squared ReLU are one fused matmul
(:func:`~flash_attn.ops.triton.linear.triton_linear_act`), and whose backward fuses the second
layer's input gradient with the squared ReLU's derivative
(:func:`~flash_attn.ops.triton.linear.triton_dgrad_act`).

``checkpoint_lvl`` trades memory for recomputation in the backward: 0 keeps the pre-activation and
the activation, 1 keeps the pre-activation only (the activation is recomputed), 2 keeps neither
(the first layer is recomputed).

Differences from upstream: every dtype takes the fused ops (upstream sends bf16 to cuBLAS and
PyTorch's activation instead, having measured its autotuned kernel slower there; the results are
the same up to rounding); the weight gradients and the second layer are plain PyTorch matmuls
(upstream's are cuBLAS calls in its CUDA extension); and the module also runs off CUDA, on the
exact PyTorch paths of the linear ops.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_attn import validation
from flash_attn.ops.triton.linear import triton_dgrad_act, triton_linear_act

__all__ = ["FusedDenseSqreluDenseFunc", "fused_dense_sqrelu_dense_function", "FusedDenseSqreluDense"]

CHECKPOINT_LEVELS = (0, 1, 2)

# upstream's flash_attn.utils.torch.custom_fwd / custom_bwd (CUDA autocast), written out here: the
# ops layer does not import the higher flash_attn.utils layer
_custom_fwd = torch.amp.custom_fwd(device_type="cuda")
_custom_bwd = torch.amp.custom_bwd(device_type="cuda")


def _check_checkpoint_lvl(checkpoint_lvl) -> None:
    if isinstance(checkpoint_lvl, bool) or checkpoint_lvl not in CHECKPOINT_LEVELS:
        raise AssertionError(f"checkpoint_lvl must be one of {CHECKPOINT_LEVELS}, got {checkpoint_lvl!r}")


def _check_args(x, weight1, bias1, weight2, bias2) -> None:
    """Upstream's AssertionError, naming the argument: tensors of x's device, ``weight1``
    ``(hidden, in)`` and ``weight2`` ``(out, hidden)`` matrices, biases of their rows."""
    for name, t in (("x", x), ("weight1", weight1), ("bias1", bias1), ("weight2", weight2), ("bias2", bias2)):
        if not isinstance(t, torch.Tensor):
            raise AssertionError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise AssertionError(f"{name} is on {t.device} but x is on {x.device}")
    for name, w, inputs in (("weight1", weight1, x.shape[-1] if x.dim() else None), ("weight2", weight2, None)):
        if w.dim() != 2:
            raise AssertionError(f"{name} must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight1.shape[1]:
        raise AssertionError(f"Incompatible dimensions: x {tuple(x.shape)} - weight1 {tuple(weight1.shape)}")
    if weight2.shape[1] != weight1.shape[0]:
        raise AssertionError(f"Incompatible dimensions: weight1 {tuple(weight1.shape)} - weight2 {tuple(weight2.shape)}")
    for name, b, w in (("bias1", bias1, weight1), ("bias2", bias2, weight2)):
        if tuple(b.shape) != (w.shape[0],):
            raise AssertionError(f"Incompatible dimensions: {name} {tuple(b.shape)} must be ({w.shape[0]},)")


def _first_layer(x2d, weight1, bias1, save_act_input: bool):
    """``(relu(x2d @ weight1.T + bias1) ** 2, pre-activation or None)``."""
    result = triton_linear_act(x2d, weight1, bias1, activation="squared_relu", save_act_input=save_act_input)
    return result if save_act_input else (result, None)


def _squared_relu(act_input):
    """``relu(act_input) ** 2`` computed in fp32 (float64 for float64), rounded once."""
    compute = torch.float64 if act_input.dtype == torch.float64 else torch.float32
    return (F.relu(act_input.to(compute)) ** 2).to(act_input.dtype)


def _autocast_dtype(device_type: str):
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class FusedDenseSqreluDenseFunc(torch.autograd.Function):
    """``fc2(relu(fc1(x)) ** 2)`` with biases, saving what ``checkpoint_lvl`` says."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, x, weight1, bias1, weight2, bias2, checkpoint_lvl=0):
        _check_checkpoint_lvl(checkpoint_lvl)
        _check_args(x, weight1, bias1, weight2, bias2)
        dtype = _autocast_dtype(x.device.type)
        tensors = [x, weight1, bias1, weight2, bias2]
        if dtype is not None:
            tensors = [t.to(dtype) for t in tensors]
        x, weight1, bias1, weight2, bias2 = (t.contiguous() for t in tensors)
        batch_shape = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        output1, act_input = _first_layer(x2d, weight1, bias1, save_act_input=checkpoint_lvl != 2)
        output2 = F.linear(output1, weight2, bias2)
        ctx.checkpoint_lvl = checkpoint_lvl
        saved = {0: (act_input, output1), 1: (act_input,), 2: ()}[checkpoint_lvl]
        ctx.save_for_backward(x, weight1, bias1, weight2, *saved)
        return output2.reshape(*batch_shape, output2.shape[-1])

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output):
        x, weight1, bias1, weight2, *rest = ctx.saved_tensors
        x2d = x.reshape(-1, x.shape[-1])
        if ctx.checkpoint_lvl == 0:
            act_input, output1 = rest
        elif ctx.checkpoint_lvl == 1:
            (act_input,) = rest
            output1 = _squared_relu(act_input)
        else:
            output1, act_input = _first_layer(x2d, weight1, bias1, save_act_input=True)
        g2d = grad_output.contiguous().reshape(-1, grad_output.shape[-1])
        grad_weight2 = g2d.t() @ output1
        grad_bias2 = g2d.sum(dim=0)
        grad_act_input = triton_dgrad_act(g2d, weight2, activation="squared_relu", act_input=act_input)
        grad_input = grad_act_input @ weight1
        grad_weight1 = grad_act_input.t() @ x2d
        grad_bias1 = grad_act_input.sum(dim=0)
        return grad_input.reshape_as(x), grad_weight1, grad_bias1, grad_weight2, grad_bias2, None


fused_dense_sqrelu_dense_function = FusedDenseSqreluDenseFunc.apply


class FusedDenseSqreluDense(nn.Module):
    """``fc2(relu(fc1(x)) ** 2)`` with ``fc1``/``fc2`` ``nn.Linear`` layers (both with bias: the
    fused function needs them, as upstream's). ``hidden_features`` defaults to
    ``4 * in_features``, ``out_features`` to ``in_features``."""

    def __init__(self, in_features, hidden_features=None, out_features=None, bias1=True, bias2=True,
                 checkpoint_lvl=0, device=None, dtype=None):
        _check_checkpoint_lvl(checkpoint_lvl)
        for name, value in (("in_features", in_features), ("hidden_features", hidden_features),
                            ("out_features", out_features)):
            if value is not None:
                validation.check_int(value, name, minimum=1)
        for name, value in (("bias1", bias1), ("bias2", bias2)):
            if not validation.check_flag(value, name):
                raise AssertionError(f"{name}=False: DenseSqreluDense module without bias is currently not supported")
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features * 4
        self.checkpoint_lvl = checkpoint_lvl
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x):
        return fused_dense_sqrelu_dense_function(
            x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.checkpoint_lvl
        )
