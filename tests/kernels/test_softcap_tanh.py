"""The kernels' softcap ``tanh`` (:func:`flash_attn.kernels.masking.tanh`), run in Triton's
interpreter on a dense grid against float64: within 2 ulp of fp32 everywhere, including small
arguments, where ``1 - 2 / (exp(2x) + 1)`` alone cancels (softcap ``c * tanh(x / c)`` lost its
precision as ``c`` grew), with the limits +-1 and NaN kept."""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from flash_attn.backends import _interpreter as interpreter  # noqa: E402
from flash_attn.kernels import masking  # noqa: E402

from support.options import skip_unless_the_interpreter_runs  # noqa: E402


@triton.jit
def _tanh_probe(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, masking.tanh(x), mask=offs < n)


def _kernel_tanh(x: torch.Tensor) -> torch.Tensor:
    skip_unless_the_interpreter_runs()
    y = torch.empty_like(x)
    block = 1024
    interpreter.launch(_tanh_probe, (math.ceil(x.numel() / block),), x, y, x.numel(), BLOCK=block)
    return y


def _ulps(got: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    exact = torch.tanh(x.double())
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp(min=torch.finfo(torch.float32).tiny)
    return (got.double() - exact).abs() / ulp


def test_within_two_ulp_from_tiny_to_saturated_arguments():
    magnitudes = torch.cat([torch.logspace(-30, 1.5, 60001, dtype=torch.float64), torch.linspace(0.4, 0.7, 20001,
                                                                                                  dtype=torch.float64)])
    x = torch.cat([magnitudes, -magnitudes]).float()
    ulps = _ulps(_kernel_tanh(x), x)
    assert ulps.max() <= 2.0, f"{ulps.max():.2f} ulp at x = {x[ulps.argmax()].item():.6g}"


def test_limits_and_nan():
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e30, -1e30])
    y = _kernel_tanh(x)
    assert y[:2].tolist() == [1.0, -1.0] and math.isnan(y[2]) and y[3:5].tolist() == [0.0, 0.0]
    assert y[5:].tolist() == [1.0, -1.0]
