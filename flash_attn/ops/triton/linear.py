"""A linear layer with its bias and activation fused into the matmul (upstream's
``flash_attn.ops.triton.linear``: ``triton_linear_act`` and ``triton_dgrad_act``).

* ``triton_linear_act(x, weight, bias, activation, save_act_input)`` computes
  ``out = act(x @ weight.T + bias)``; with ``save_act_input=True`` it also returns the
  pre-activation ``x @ weight.T + bias`` (rounded to ``x``'s dtype), which the backward needs.
* ``triton_dgrad_act(grad_output, weight, activation, act_input)`` computes
  ``(grad_output @ weight) * act'(act_input)``: in an MLP ``fc2(act(fc1(x)))``, given the gradient
  of fc2's output, fc2's weight and fc1's saved pre-activation, the gradient of that pre-activation.

Activations: ``"id"`` (none) and the helpers of :mod:`flash_attn.ops.triton.k_activations`:
``"relu"``, ``"leaky_relu"``, ``"gelu"`` (exact, erf), ``"gelu_approx"`` (tanh) and
``"squared_relu"``. (Upstream's wrappers accept ``id``, ``gelu``, ``gelu_approx`` and
``squared_relu`` only; the ReLUs are an addition.) Derivatives at 0 are taken from the right.

Where the arithmetic runs:

* CUDA tensors (fp16/bf16/fp32): one Triton kernel per call, compiled by Triton's JIT on first use.
  Products accumulate in fp32; the bias, the activation and its derivative are evaluated in fp32
  on the accumulator and the result is rounded once to the input dtype. fp32 inputs use TF32
  exactly when ``torch.backends.cuda.matmul.allow_tf32`` allows it (as ``F.linear`` does) and the
  GPU has it (on ROCm: CDNA3's XF32; other AMD GPUs exact fp32).
  Tiles come from a small fixed table chosen by the problem's shape and dtype (no autotuning).
* every other device, float64, and installs without Triton: the same formulas in PyTorch, in
  float32 (float64 for float64 inputs).

Bad input raises ``AssertionError`` (upstream's type) naming what is wrong.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from flash_attn.backends import devices
from flash_attn.ops.triton import cuda_launch, triton_modules

triton, tl = triton_modules()  # Triton is optional: without it (or without CUDA) the PyTorch path runs
if triton is not None:
    from flash_attn.ops.triton import k_activations as ka

__all__ = ["triton_linear_act", "triton_dgrad_act"]

ACTIVATIONS = ("id", "relu", "leaky_relu", "gelu", "gelu_approx", "squared_relu")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LEAKY_SLOPE = 0.01
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


# --- the activations in PyTorch (the path off CUDA) ----------------------------------------------


def _gelu_approx_grad(x: Tensor) -> Tensor:
    t = torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + _CUBIC * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * x * x)


def _gelu_grad(x: Tensor) -> Tensor:
    return 0.5 * (1.0 + torch.erf(x * math.sqrt(0.5))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _step(x: Tensor, below: float) -> Tensor:
    return torch.where(x >= 0, torch.ones_like(x), torch.full_like(x, below))


_TORCH_FORWARD: dict[str, Callable[[Tensor], Tensor]] = {
    "id": lambda x: x,
    "relu": F.relu,
    "leaky_relu": lambda x: F.leaky_relu(x, _LEAKY_SLOPE),
    "gelu": F.gelu,
    "gelu_approx": lambda x: F.gelu(x, approximate="tanh"),
    "squared_relu": lambda x: F.relu(x) ** 2,
}
_TORCH_DERIVATIVE: dict[str, Callable[[Tensor], Tensor]] = {
    "id": torch.ones_like,
    "relu": lambda x: _step(x, 0.0),
    "leaky_relu": lambda x: _step(x, _LEAKY_SLOPE),
    "gelu": _gelu_grad,
    "gelu_approx": _gelu_approx_grad,
    "squared_relu": lambda x: 2.0 * F.relu(x),
}


# --- the Triton kernels ----------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _activation(x, ACTIVATION: tl.constexpr):
        if ACTIVATION == "relu":
            x = ka.relu(x)
        elif ACTIVATION == "leaky_relu":
            x = ka.leaky_relu(x)
        elif ACTIVATION == "gelu":
            x = ka.gelu(x)
        elif ACTIVATION == "gelu_approx":
            x = ka.gelu_approx(x)
        elif ACTIVATION == "squared_relu":
            x = ka.squared_relu(x)
        return x

    @triton.jit
    def _activation_derivative(x, ACTIVATION: tl.constexpr):
        if ACTIVATION == "relu":
            d = ka.relu_grad(x)
        elif ACTIVATION == "leaky_relu":
            d = ka.leaky_relu_grad(x)
        elif ACTIVATION == "gelu":
            d = ka.gelu_grad(x)
        elif ACTIVATION == "gelu_approx":
            d = ka.gelu_approx_grad(x)
        else:
            d = ka.squared_relu_grad(x)
        return d

    @triton.jit
    def _matmul_tile(a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr):
        """``A[rows, :] @ B[:, cols]`` accumulated in fp32 (out-of-range rows/cols read 0)."""
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
        b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_inside = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=(rows[:, None] < M) & k_inside[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_inside[:, None] & (cols[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        return acc

    @triton.jit
    def _linear_act_kernel(out_ptr, act_input_ptr, x_ptr, w_ptr, bias_ptr, M, N, K,
                           stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
                           HAS_BIAS: tl.constexpr, SAVE_ACT_INPUT: tl.constexpr, ACTIVATION: tl.constexpr,
                           INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """Program (row block, column block): ``act(x @ w.T + bias)`` of that tile; ``out`` and
        ``act_input`` are row-major with row stride ``stride_om``."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _matmul_tile(x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
                           BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        offsets = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        if SAVE_ACT_INPUT:
            tl.store(act_input_ptr + offsets, acc.to(act_input_ptr.dtype.element_ty), mask=inside)
        acc = _activation(acc, ACTIVATION)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _dgrad_act_kernel(out_ptr, act_input_ptr, g_ptr, w_ptr, M, N, K,
                          stride_gm, stride_gk, stride_wk, stride_wn, stride_om, stride_actm,
                          ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (row block, column block): ``(g @ w) * act'(act_input)`` of that tile."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _matmul_tile(g_ptr, w_ptr, rows, cols, M, N, K, stride_gm, stride_gk, stride_wk, stride_wn,
                           BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        if ACTIVATION != "id":
            pre = tl.load(act_input_ptr + rows[:, None].to(tl.int64) * stride_actm + cols[None, :],
                          mask=inside, other=0.0).to(tl.float32)
            acc = acc * _activation_derivative(pre, ACTIVATION)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=inside)


# The tests swap this for Triton's interpreter on CPU tensors (flash_attn.backends._interpreter).
_launch: Callable = cuda_launch


class _Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _pick_tiles(M: int, N: int, K: int, dtype: torch.dtype) -> _Tiles:
    """A fixed table instead of autotuning: small row blocks for few rows (decoding), large tiles
    for big half-precision problems, moderate ones for fp32 (twice the bytes per element)."""
    del K  # the K loop is tiled the same way for every shape
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    if dtype != torch.float32 and M >= 128 and N >= 128:
        return _Tiles(128, 128, 32, 8, 3)
    return _Tiles(block_m, 64, 32, 4, 3)


def _kernel_applies(x: Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in _KERNEL_DTYPES


def _input_precision(x: Tensor) -> str:
    """fp32 products: ``"tf32"`` where PyTorch allows it and Triton has it for the device (ROCm:
    CDNA3 only, :func:`flash_attn.backends.devices.takes_tf32`), else exact. fp16/bf16 operands
    have no choice: ``"ieee"``, which every backend accepts (Triton's AMD one refuses ``"tf32"``
    for them too, but on CDNA3)."""
    if x.dtype != torch.float32 or not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    if x.is_cuda and not devices.takes_tf32(x.device):
        return "ieee"
    return "tf32"


def _grid(M: int, N: int, tiles: _Tiles):
    return (triton.cdiv(M, tiles.block_m), triton.cdiv(N, tiles.block_n))


def _linear_act_triton(x2d, weight, bias, activation, save_act_input):
    M, K = x2d.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x2d.dtype, device=x2d.device)
    act_input = torch.empty_like(out) if save_act_input else None
    if M == 0 or N == 0:
        return out, act_input
    tiles = _pick_tiles(M, N, K, x2d.dtype)
    _launch(_linear_act_kernel, _grid(M, N, tiles), out_ptr=out,
            act_input_ptr=act_input if save_act_input else out, x_ptr=x2d, w_ptr=weight,
            bias_ptr=bias if bias is not None else out, M=M, N=N, K=K,
            stride_xm=x2d.stride(0), stride_xk=x2d.stride(1), stride_wn=weight.stride(0),
            stride_wk=weight.stride(1), stride_om=out.stride(0), HAS_BIAS=bias is not None,
            SAVE_ACT_INPUT=save_act_input, ACTIVATION=activation,
            INPUT_PRECISION=_input_precision(x2d), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out, act_input


def _dgrad_act_triton(g2d, weight, activation, act2d):
    M, K = g2d.shape
    N = weight.shape[1]
    out = torch.empty(M, N, dtype=g2d.dtype, device=g2d.device)
    if M == 0 or N == 0:
        return out
    tiles = _pick_tiles(M, N, K, g2d.dtype)
    _launch(_dgrad_act_kernel, _grid(M, N, tiles), out_ptr=out,
            act_input_ptr=act2d if act2d is not None else out, g_ptr=g2d, w_ptr=weight, M=M, N=N, K=K,
            stride_gm=g2d.stride(0), stride_gk=g2d.stride(1), stride_wk=weight.stride(0),
            stride_wn=weight.stride(1), stride_om=out.stride(0),
            stride_actm=act2d.stride(0) if act2d is not None else 0, ACTIVATION=activation,
            INPUT_PRECISION=_input_precision(g2d), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


# --- the PyTorch path --------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _linear_act_torch(x2d, weight, bias, activation, save_act_input):
    cd = _compute_dtype(x2d.dtype)
    pre = F.linear(x2d.to(cd), weight.to(cd), None if bias is None else bias.to(cd))
    out = _TORCH_FORWARD[activation](pre).to(x2d.dtype)
    return out, pre.to(x2d.dtype) if save_act_input else None


def _dgrad_act_torch(g2d, weight, activation, act2d):
    cd = _compute_dtype(g2d.dtype)
    grad = g2d.to(cd) @ weight.to(cd)
    if activation != "id":
        grad = grad * _TORCH_DERIVATIVE[activation](act2d.to(cd))
    return grad.to(g2d.dtype)


# --- the public functions ----------------------------------------------------------------------------


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _check_activation(activation: str) -> None:
    _require(isinstance(activation, str) and activation in ACTIVATIONS,
             f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _require_tensor(t, name: str) -> None:
    _require(isinstance(t, Tensor), f"{name} must be a tensor, got {type(t).__name__}")


def _check_linear_args(x: Tensor, weight: Tensor, bias: Optional[Tensor], save_act_input=False) -> None:
    _require_tensor(x, "x")
    _require_tensor(weight, "weight")
    if bias is not None:
        _require_tensor(bias, "bias")
    _require(isinstance(save_act_input, bool), f"save_act_input must be a bool, got {save_act_input!r}")
    _require(weight.dim() == 2, f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    _require(x.dim() >= 1, "x must have at least one dimension (in_features)")
    _require(x.dtype == weight.dtype, f"x and weight must have the same dtype, got {x.dtype} and {weight.dtype}")
    _require(x.shape[-1] == weight.shape[1],
             f"Incompatible dimensions: x {tuple(x.shape)} - weight {tuple(weight.shape)}")
    _require(x.device == weight.device, f"x and weight must be on one device, got {x.device} and {weight.device}")
    if bias is not None:
        _require(x.dtype == bias.dtype, f"Input and bias must have the same dtype, got {x.dtype} and {bias.dtype}")
        _require(tuple(bias.shape) == (weight.shape[0],),
                 f"Incompatible dimensions in between weight {tuple(weight.shape)} and bias {tuple(bias.shape)} "
                 f"(bias must be (out_features,))")
        _require(bias.device == x.device, f"x and bias must be on one device, got {x.device} and {bias.device}")


def _as_rows(t: Tensor) -> Tensor:
    """``t`` as a 2-D ``(rows, features)`` matrix; copied only when no stride is 1 (the kernel
    takes any strides, but a matrix strided in both dimensions reads badly)."""
    rows = t.reshape(-1, t.shape[-1])
    if rows.stride(0) != 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def triton_linear_act(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: str = "id",
    save_act_input: bool = False,
):
    """``activation(x @ weight.T + bias)`` for ``x`` ``(..., in_features)``, ``weight``
    ``(out_features, in_features)`` and ``bias`` ``(out_features,)`` or ``None``, all of one dtype.

    Returns the output ``(..., out_features)`` in ``x``'s dtype, and with ``save_act_input=True``
    the pair ``(output, act_input)`` where ``act_input`` is the pre-activation of the same shape.
    """
    _check_activation(activation)
    _check_linear_args(x, weight, bias, save_act_input)
    batch_shape = x.shape[:-1]
    x2d, weight = _as_rows(x), _as_rows(weight)
    bias = bias.contiguous() if bias is not None else None
    run = _linear_act_triton if _kernel_applies(x2d) else _linear_act_torch
    out, act_input = run(x2d, weight, bias, activation, save_act_input)
    out = out.reshape(*batch_shape, out.shape[-1])
    if not save_act_input:
        return out
    return out, act_input.reshape(*batch_shape, act_input.shape[-1])


def _check_dgrad_args(grad_output: Tensor, weight: Tensor, activation: str, act_input: Optional[Tensor]) -> None:
    _require_tensor(grad_output, "grad_output")
    _require_tensor(weight, "weight")
    if act_input is not None:
        _require_tensor(act_input, "act_input")
    _require(weight.dim() == 2, f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    _require(grad_output.dim() >= 1, "grad_output must have at least one dimension (out_features)")
    _require(grad_output.dtype == weight.dtype,
             f"grad_output and weight must have the same dtype, got {grad_output.dtype} and {weight.dtype}")
    _require(grad_output.shape[-1] == weight.shape[0],
             f"Incompatible dimensions: grad_output {tuple(grad_output.shape)} - weight {tuple(weight.shape)}")
    _require(grad_output.device == weight.device,
             f"grad_output and weight must be on one device, got {grad_output.device} and {weight.device}")
    if activation == "id":
        return
    _require(act_input is not None, f"act_input is required for activation {activation}")
    expected = (*grad_output.shape[:-1], weight.shape[1])
    _require(tuple(act_input.shape) == expected,
             f"act_input must have shape {expected} (grad_output's rows, in_features), got {tuple(act_input.shape)}")
    _require(act_input.device == grad_output.device,
             f"act_input must be on {grad_output.device}, got {act_input.device}")


def triton_dgrad_act(
    grad_output: Tensor,
    weight: Tensor,
    activation: str = "id",
    act_input: Optional[Tensor] = None,
) -> Tensor:
    """``(grad_output @ weight) * activation'(act_input)`` for ``grad_output``
    ``(..., out_features)`` and ``weight`` ``(out_features, in_features)``: the gradient of the
    pre-activation of the layer *before* ``weight``, given that layer's saved ``act_input``
    ``(..., in_features)`` (required unless ``activation == "id"``). Returns ``(..., in_features)``
    in ``grad_output``'s dtype."""
    _check_activation(activation)
    _check_dgrad_args(grad_output, weight, activation, act_input)
    batch_shape = grad_output.shape[:-1]
    g2d, weight = _as_rows(grad_output), _as_rows(weight)
    act2d = act_input.reshape(-1, act_input.shape[-1]).contiguous() if activation != "id" else None
    run = _dgrad_act_triton if _kernel_applies(g2d) else _dgrad_act_torch
    grad_input = run(g2d, weight, activation, act2d)
    return grad_input.reshape(*batch_shape, grad_input.shape[-1])
