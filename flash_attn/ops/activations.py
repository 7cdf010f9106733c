"""Upstream's ``flash_attn.ops.activations``: GeLU (tanh approximation), squared ReLU and SwiGLU
with hand-written backwards, under upstream's names.

Upstream compiles these with ``torch.jit.script`` and CUDA's jiterator (``swiglu``, CUDA only).
Here they are plain PyTorch ops (fp32 math, results in the input dtype), so they run on every
device and trace under ``torch.compile``. One intended difference: upstream's
``GeLUFunction.backward`` returns a malformed gradient tuple; ours returns ``(d input, d bias)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "bias_gelu", "bias_gelu_back", "GeLUFunction", "bias_gelu_impl",
    "gelu_fwd", "gelu_bwd", "FastGeLUFunction", "fast_gelu_impl",
    "relu_bwd", "sqrelu_fwd", "sqrelu_bwd",
    "swiglu_fwd", "swiglu_bwd", "SwiGLUFunction", "swiglu",
]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715  # the tanh approximation's cubic coefficient


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + _CUBIC * x * x)))


def _gelu_slope(x: torch.Tensor) -> torch.Tensor:
    """d gelu / dx of the tanh approximation."""
    t = torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + _CUBIC * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * x * x)


def gelu_fwd(x):
    """GeLU, tanh approximation (``F.gelu(x, approximate="tanh")``), in ``x``'s dtype."""
    return _gelu(x.float()).to(x.dtype)


def gelu_bwd(g, x):
    """The gradient of :func:`gelu_fwd` at ``x`` times ``g``, in ``x``'s dtype."""
    return (_gelu_slope(x.float()) * g.float()).to(x.dtype)


def bias_gelu(y, bias):
    """``gelu_fwd(y + bias)`` (``bias`` broadcast over the last dimension), in ``y``'s dtype."""
    return _gelu(y.float() + bias.float()).to(y.dtype)


def bias_gelu_back(g, y, bias):
    """``(d y, d bias)`` of :func:`bias_gelu` for the output gradient ``g``; ``d bias`` sums
    ``d y`` over every leading dimension (upstream: over dim 0 of a ``(B, D)`` input)."""
    grad = _gelu_slope(y.float() + bias.float()) * g.float()
    return grad.to(y.dtype), grad.reshape(-1, grad.shape[-1]).sum(0).to(bias.dtype)


class GeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return bias_gelu(input, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        return bias_gelu_back(grad_output, input, bias)


bias_gelu_impl = GeLUFunction.apply


class FastGeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return gelu_fwd(input)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        return gelu_bwd(grad_output, input)


fast_gelu_impl = FastGeLUFunction.apply


def relu_bwd(g, x):
    """The ReLU gradient as upstream's: ``g`` where ``x >= 0`` (0 included), else 0."""
    return torch.where(x >= 0, g, 0.0).to(x.dtype)


def sqrelu_fwd(x):
    """Squared ReLU ``relu(x) ** 2``, in ``x``'s dtype."""
    r = F.relu(x.float())
    return (r * r).to(x.dtype)


def sqrelu_bwd(g, x):
    """The gradient of :func:`sqrelu_fwd`: ``2 * g * relu(x)``, in ``x``'s dtype."""
    return (2.0 * g.float() * F.relu(x.float())).to(x.dtype)


def swiglu_fwd(x, y):
    """SwiGLU ``silu(x) * y`` in fp32, returned in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.sigmoid(xf) * y.float()).to(x.dtype)


def swiglu_bwd(x, y, g):
    """``(d x, d y)`` of :func:`swiglu_fwd` for the output gradient ``g`` (upstream's argument
    order), in ``x``'s dtype."""
    xf, yf, gf = x.float(), y.float(), g.float()
    s = torch.sigmoid(xf)
    dx = s * (1.0 + xf * (1.0 - s)) * gf * yf
    dy = xf * s * gf
    return dx.to(x.dtype), dy.to(x.dtype)


# Upstream's CUDA jiterator sources of the two functions above (torch.cuda.jiterator._create_jit_fn
# and _create_multi_output_jit_fn compile them on first use); this package computes SwiGLU with the
# PyTorch functions above on every device, the strings are for code that builds its own jiterator.
swiglu_fwd_codestring = """
template <typename T> T swiglu_fwd(T x, T y) {
    return float(x) * float(y) / (1.0f + ::exp(-float(x)));
}
"""
swiglu_bwd_codestring = """
template <typename T> void swiglu_bwd(T x, T y, T g, T& dx, T& dy) {
    float s = 1.0f / (1.0f + ::exp(-float(x)));
    dx = s * (1.0f + float(x) * (1.0f - s)) * float(g) * float(y);
    dy = float(x) * s * float(g);
}
"""


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return swiglu_fwd(x, y)

    @staticmethod
    def backward(ctx, dout):
        x, y = ctx.saved_tensors
        return swiglu_bwd(x, y, dout)


swiglu = SwiGLUFunction.apply
