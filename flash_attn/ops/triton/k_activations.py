"""Activation functions and their derivatives as ``@triton.jit`` helpers, under upstream's names
(``flash_attn.ops.triton.k_activations``), for use inside our Triton kernels
(:mod:`flash_attn.ops.triton.linear` fuses them into a matmul's epilogue).

Every helper takes a tensor of the kernel's values and returns one of the same shape:

* ``relu``, ``leaky_relu`` (slope 0.01), ``squared_relu`` (``relu(x) ** 2``), ``gelu`` (the exact,
  erf-based GeLU) and ``gelu_approx`` (the tanh approximation);
* the ``*_grad`` helpers return the derivative of the activation *at its input* ``x`` (the caller
  multiplies it with the incoming gradient). As upstream's, ``relu_grad``, ``leaky_relu_grad`` and
  ``squared_relu_grad`` take the derivative at 0 from the right (``x >= 0``).

Call them on float32 values (our kernels convert after loading): besides being the precision the
epilogues want, it is what Triton's interpreter computes correctly (its bf16 arithmetic is wrong).

:class:`Activation` names them; :func:`get_triton_activation_kernel` and
:func:`get_triton_activation_bwd_kernel` map a name (or ``None``: no activation) to the helpers.
Without Triton the module still imports: the enum is there, the helpers and the two look-ups are
not usable (they raise ``ImportError``).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Optional

from flash_attn.ops.triton import triton_modules

# upstream's module constants: sqrt(2 / pi) (GELU's tanh approximation), 1 / sqrt(2) (erf GELU),
# 1 / sqrt(2 pi) (the normal density)
_sqrt2pi = math.sqrt(2.0 / math.pi)
_sqrt1_2 = math.sqrt(1.0 / 2)
_gaussian_pdf_normalization = 1.0 / math.sqrt(2 * math.pi)

triton, tl = triton_modules()  # Triton is optional: without it (or without CUDA) the PyTorch path runs

__all__ = ["Activation", "get_triton_activation_kernel", "get_triton_activation_bwd_kernel"]
_HELPERS = (
    "tanh", "cosh", "relu", "relu_grad", "squared_relu", "squared_relu_grad",
    "leaky_relu", "leaky_relu_grad", "gelu", "gelu_grad", "gelu_approx", "gelu_approx_grad",
)

class Activation(str, Enum):
    """The activations of this module by upstream's names (the value is the name)."""

    SquaredReLU = "squared_relu"
    GeLU = "gelu"
    GeLUApprox = "gelu_approx"
    LeakyReLU = "leaky_relu"
    ReLU = "relu"

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"value {value!r} is not an Activation; expected one of {[a.value for a in cls]}")


def _require_triton() -> None:
    if triton is None:
        raise ImportError("the Triton activation helpers need Triton, which is not installed")


def get_triton_activation_kernel(activation: Optional[Activation]):
    """The ``@triton.jit`` helper computing ``activation`` (a name or :class:`Activation`);
    ``None`` (or ``""``) gives ``None``. An unknown name raises ``ValueError``."""
    if not activation:
        return None
    _require_triton()
    return _FORWARD[Activation(activation)]


def get_triton_activation_bwd_kernel(activation: Optional[Activation]):
    """The ``@triton.jit`` helper computing the derivative of ``activation`` at its input;
    ``None`` (or ``""``) gives ``None``. An unknown name raises ``ValueError``."""
    if not activation:
        return None
    _require_triton()
    return _BACKWARD[Activation(activation)]


if triton is not None:
    # constexpr: a @triton.jit function may only read module constants declared so
    # (written after the tensor in products: the interpreter turns ``constexpr * tensor`` into a
    # constexpr wrapping a tensor, which tl.exp then rejects)
    _SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
    _SQRT_HALF = tl.constexpr(math.sqrt(0.5))
    _INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))  # the standard normal density at 0
    _CUBIC = tl.constexpr(0.044715)  # the tanh approximation's cubic coefficient
    _LEAKY_SLOPE = tl.constexpr(0.01)

    @triton.jit
    def tanh(x):
        # from e^{-2|x|} <= 1, which cannot overflow; odd symmetry gives the sign
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x >= 0, t, -t)

    @triton.jit
    def cosh(x):
        e = tl.exp(x)
        return 0.5 * (e + 1.0 / e)

    @triton.jit
    def relu(x):
        return tl.where(x >= 0, x, 0.0)

    @triton.jit
    def relu_grad(x):
        return tl.where(x >= 0, 1.0, 0.0)

    @triton.jit
    def squared_relu(x):
        r = tl.where(x >= 0, x, 0.0)
        return r * r

    @triton.jit
    def squared_relu_grad(x):
        return tl.where(x >= 0, 2.0 * x, 0.0)

    @triton.jit
    def leaky_relu(x):
        return tl.where(x >= 0, x, x * _LEAKY_SLOPE)

    @triton.jit
    def leaky_relu_grad(x):
        return tl.where(x >= 0, 1.0, _LEAKY_SLOPE)

    @triton.jit
    def gelu(x):
        return 0.5 * x * (1.0 + tl.math.erf(x * _SQRT_HALF))

    @triton.jit
    def gelu_grad(x):
        # Phi(x) + x * phi(x)
        cdf = 0.5 * (1.0 + tl.math.erf(x * _SQRT_HALF))
        return cdf + x * _INV_SQRT_2PI * tl.exp(-0.5 * x * x)

    @triton.jit
    def gelu_approx(x):
        return 0.5 * x * (1.0 + tanh(x * _SQRT_2_OVER_PI * (1.0 + x * x * _CUBIC)))

    @triton.jit
    def gelu_approx_grad(x):
        t = tanh(x * _SQRT_2_OVER_PI * (1.0 + x * x * _CUBIC))
        slope_of_inner = (1.0 + x * x * (3.0 * _CUBIC)) * _SQRT_2_OVER_PI
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * slope_of_inner

    _FORWARD = {
        Activation.ReLU: relu, Activation.LeakyReLU: leaky_relu, Activation.GeLU: gelu,
        Activation.GeLUApprox: gelu_approx, Activation.SquaredReLU: squared_relu,
    }
    _BACKWARD = {
        Activation.ReLU: relu_grad, Activation.LeakyReLU: leaky_relu_grad, Activation.GeLU: gelu_grad,
        Activation.GeLUApprox: gelu_approx_grad, Activation.SquaredReLU: squared_relu_grad,
    }
    __all__ += _HELPERS
