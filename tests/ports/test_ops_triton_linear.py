"""flash_attn.ops.triton.{k_activations, linear, mlp} against float64 oracles written here.

* the activation helpers of k_activations, each run by a small elementwise kernel, against the
  definitions (derivatives by float64 autograd of the definitions);
* triton_linear_act / triton_dgrad_act through their Triton kernels (in Triton's interpreter on
  CPU tensors; compiled on CUDA with ``--flash-device cuda``) and through their PyTorch path,
  against ``act(x @ w.T + b)`` and ``(g @ w) * act'(pre)`` in float64, for every activation;
* FusedDenseSqreluDense (forward and every gradient, each checkpoint level) against a naive float64
  ``fc2(relu(fc1(x)) ** 2)`` with autograd.

The interpreter computes bf16 arithmetic wrongly, so kernels are checked in fp32 and fp16 there;
bf16 goes through the PyTorch paths. Tolerances follow support/tolerance.py's rule: at most twice the error of
the same computation done naively in the input dtype, plus one rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.options import skip_unless_the_interpreter_runs, test_device
from support.tolerance import check_close
from flash_attn.ops.triton import k_activations as ka
from flash_attn.ops.triton import linear as linear_ops
from flash_attn.ops.triton.linear import triton_dgrad_act, triton_linear_act
from flash_attn.ops.triton.mlp import FusedDenseSqreluDense, fused_dense_sqrelu_dense_function

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from flash_attn.backends import _interpreter  # noqa: E402

ACTIVATIONS = ("id", "relu", "leaky_relu", "gelu", "gelu_approx", "squared_relu")
# bf16 only where the kernels are compiled (the interpreter's bf16 arithmetic is wrong)
KERNEL_DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if test_device().type == "cuda" else ())


# --- the float64 definitions -------------------------------------------------------------------------


def definition(name: str, x: torch.Tensor) -> torch.Tensor:
    """Each activation straight from its formula (float64 in, float64 out)."""
    if name == "id":
        return x
    if name == "relu":
        return torch.where(x >= 0, x, torch.zeros_like(x))
    if name == "leaky_relu":
        return torch.where(x >= 0, x, 0.01 * x)
    if name == "gelu":
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if name == "gelu_approx":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "squared_relu":
        return torch.where(x >= 0, x, torch.zeros_like(x)) ** 2
    raise KeyError(name)


def derivative(name: str, x: torch.Tensor) -> torch.Tensor:
    """d definition / dx at every element of ``x``, by float64 autograd."""
    x = x.detach().double().requires_grad_()
    (grad,) = torch.autograd.grad(definition(name, x).sum(), x)
    return grad


# --- the activation helpers, each in a small kernel ---------------------------------------------------


@triton.jit
def _helper_kernel(x_ptr, y_ptr, n, NAME: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if NAME == "tanh":
        y = ka.tanh(x)
    elif NAME == "cosh":
        y = ka.cosh(x)
    elif NAME == "relu":
        y = ka.relu(x)
    elif NAME == "relu_grad":
        y = ka.relu_grad(x)
    elif NAME == "leaky_relu":
        y = ka.leaky_relu(x)
    elif NAME == "leaky_relu_grad":
        y = ka.leaky_relu_grad(x)
    elif NAME == "gelu":
        y = ka.gelu(x)
    elif NAME == "gelu_grad":
        y = ka.gelu_grad(x)
    elif NAME == "gelu_approx":
        y = ka.gelu_approx(x)
    elif NAME == "gelu_approx_grad":
        y = ka.gelu_approx_grad(x)
    elif NAME == "squared_relu":
        y = ka.squared_relu(x)
    else:
        y = ka.squared_relu_grad(x)
    tl.store(y_ptr + offs, y, mask=offs < n)


def run_helper(name: str, x: torch.Tensor) -> torch.Tensor:
    """The helper ``name`` on the fp32 values ``x`` (CPU), on the device under test."""
    device = test_device()
    xs = x.float().to(device)
    y = torch.empty_like(xs)
    launch = _interpreter.launch
    if device.type == "cuda":
        launch = linear_ops.cuda_launch
    else:
        skip_unless_the_interpreter_runs()
    launch(_helper_kernel, (triton.cdiv(xs.numel(), 64),), x_ptr=xs, y_ptr=y, n=xs.numel(), NAME=name, BLOCK=64)
    return y.cpu().double()


def helper_inputs() -> torch.Tensor:
    """Normal values plus large ones (tanh/exp must saturate, not overflow to NaN), none at 0."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(150, generator=g) * 2, torch.tensor([-30.0, -9.0, 9.0, 30.0, 1e-3, -1e-3])])
    return x.float()


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "gelu", "gelu_approx", "squared_relu"])
def test_activation_helpers_match_their_definitions(name):
    x = helper_inputs()
    ref = definition(name, x.double())
    torch.testing.assert_close(run_helper(name, x), ref, rtol=1e-5, atol=1e-6)
    grad = run_helper(name + "_grad", x)
    torch.testing.assert_close(grad, derivative(name, x), rtol=1e-5, atol=1e-6)


def test_tanh_and_cosh_helpers():
    x = helper_inputs()
    torch.testing.assert_close(run_helper("tanh", x), torch.tanh(x.double()), rtol=1e-5, atol=1e-6)
    small = x[x.abs() < 20]  # cosh(30) is beyond fp32's precision of interest; exp stays finite
    torch.testing.assert_close(run_helper("cosh", small), torch.cosh(small.double()), rtol=1e-5, atol=1e-6)


def test_the_derivative_at_zero_is_taken_from_the_right():
    # upstream's convention (x >= 0): relu'(0) = 1, leaky_relu'(0) = 1, squared_relu'(0) = 0
    zero = torch.zeros(4)
    assert run_helper("relu_grad", zero).eq(1).all()
    assert run_helper("leaky_relu_grad", zero).eq(1).all()
    assert run_helper("squared_relu_grad", zero).eq(0).all()


def test_activation_lookups():
    for member in ka.Activation:
        assert ka.get_triton_activation_kernel(member).fn.__name__ == member.value
        assert ka.get_triton_activation_bwd_kernel(member.value).fn.__name__ == member.value + "_grad"
    assert ka.get_triton_activation_kernel(None) is None
    assert ka.get_triton_activation_bwd_kernel(None) is None
    assert ka.Activation("gelu_approx") is ka.Activation.GeLUApprox and ka.Activation.ReLU == "relu"
    with pytest.raises(ValueError):
        ka.get_triton_activation_kernel("swish")


# --- triton_linear_act / triton_dgrad_act -------------------------------------------------------------


class KernelRoute:
    """Route the linear ops through their Triton kernels: in the interpreter on CPU tensors, compiled
    on CUDA. Records the kernels launched."""

    def __init__(self, monkeypatch, tiles=(16, 16, 16)):
        self.launched = []
        device = test_device()
        real = _interpreter.launch if device.type != "cuda" else linear_ops.cuda_launch
        if device.type != "cuda":
            skip_unless_the_interpreter_runs()
            monkeypatch.setattr(linear_ops, "_kernel_applies", lambda x: x.dtype != torch.float64)

        def launch(kernel, grid, **kwargs):
            self.launched.append(kernel.fn.__name__)
            real(kernel, grid, **kwargs)

        monkeypatch.setattr(linear_ops, "_launch", launch)
        if tiles is not None:  # small tiles: ragged edges on every side and several K steps
            monkeypatch.setattr(linear_ops, "_pick_tiles", lambda M, N, K, dtype: linear_ops._Tiles(*tiles, 4, 2))


@pytest.fixture
def kernels(monkeypatch):
    return KernelRoute(monkeypatch)


def make_linear(dtype, batch=(3, 7), in_features=40, out_features=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features)
    b = torch.randn(out_features, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def forward_oracle(x, w, b, activation):
    """``(act(pre), pre)`` in float64, and the same done naively in the inputs' dtype."""
    pre = F.linear(x.double(), w.double(), None if b is None else b.double())
    naive_pre = F.linear(x, w, b)
    return definition(activation, pre), pre, definition(activation, naive_pre)


def on_device(*tensors, device=None):
    return tuple(t.to(device or test_device()) for t in tensors)


def check_forward(x, w, b, activation, save_act_input, device=None):
    ref, ref_pre, naive = forward_oracle(x, w, b, activation)
    xd, wd = on_device(x, w, device=device)
    bd = None if b is None else b.to(xd.device)
    result = triton_linear_act(xd, wd, bd, activation=activation, save_act_input=save_act_input)
    out = result[0] if save_act_input else result
    assert out.dtype == x.dtype and out.device == xd.device
    check_close(out, ref, naive, x.dtype, f"{activation} output")
    if save_act_input:
        assert result[1].dtype == x.dtype
        check_close(result[1], ref_pre, F.linear(x, w, b), x.dtype, f"{activation} act_input")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_act_kernel(kernels, activation, dtype):
    x, w, b = make_linear(dtype)
    check_forward(x, w, b, activation, save_act_input=True)
    check_forward(x, w, None, activation, save_act_input=False)
    assert kernels.launched == ["_linear_act_kernel"] * 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), in_features=st.integers(1, 70), out_features=st.integers(1, 70),
       activation=st.sampled_from(ACTIVATIONS), bias=st.booleans(), dtype=st.sampled_from(KERNEL_DTYPES),
       tiles=st.tuples(st.sampled_from([16, 32]), st.sampled_from([16, 32]), st.sampled_from([16, 32])),
       seed=st.integers(0, 2**16))
def test_linear_kernels_on_random_shapes(monkeypatch, rows, in_features, out_features, activation, bias, dtype,
                                         tiles, seed):
    """Fuzz: shapes that do and do not fill the tiles, every activation, with or without bias,
    forward and dgrad through the kernels, against the float64 definitions."""
    KernelRoute(monkeypatch, tiles)
    x, w, b = make_linear(dtype, (rows,), in_features, out_features, seed)
    check_forward(x, w, b if bias else None, activation, save_act_input=activation != "id")
    check_dgrad(activation, dtype, rows, in_features, out_features, seed=seed)


def check_dgrad(activation, dtype, rows=21, in_features=37, out_features=26, device=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    grad_output = torch.randn(rows, out_features, generator=g).to(dtype)
    w = (torch.randn(out_features, in_features, generator=g) / math.sqrt(out_features)).to(dtype)
    pre = (torch.randn(rows, in_features, generator=g) * 2).to(dtype)
    ref = (grad_output.double() @ w.double()) * derivative(activation, pre)
    naive = (grad_output @ w) * derivative(activation, pre).to(dtype)
    gd, wd, pd = on_device(grad_output, w, pre, device=device)
    out = triton_dgrad_act(gd, wd, activation=activation, act_input=None if activation == "id" else pd)
    assert out.dtype == dtype
    check_close(out, ref, naive, dtype, f"{activation} dgrad")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dgrad_act_kernel(kernels, activation, dtype):
    check_dgrad(activation, dtype)
    assert kernels.launched == ["_dgrad_act_kernel"]


def test_kernels_with_the_default_tile_table(monkeypatch):
    route = KernelRoute(monkeypatch, tiles=None)
    x, w, b = make_linear(torch.float16, batch=(130,), in_features=48, out_features=150)
    check_forward(x, w, b, "gelu_approx", save_act_input=True)  # 128 x 128 tiles
    x, w, b = make_linear(torch.float32, batch=(70,), in_features=48, out_features=150)
    check_forward(x, w, b, "relu", save_act_input=True)  # 64 x 64 tiles
    x, w, b = make_linear(torch.float32, batch=(5,), in_features=33, out_features=20)
    check_forward(x, w, b, "squared_relu", save_act_input=False)  # 16-row tiles
    check_dgrad("gelu", torch.float32, rows=9)
    assert route.launched == ["_linear_act_kernel"] * 3 + ["_dgrad_act_kernel"]


def test_kernels_take_strided_and_transposed_operands(kernels):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 19, generator=g).t()  # (19, 40) with stride (1, 19)
    w_t = torch.randn(40, 24, generator=g) / 6
    w = w_t.t()  # (24, 40), column-major
    b = torch.randn(24, generator=g)
    ref, _, naive = forward_oracle(x, w, b, "gelu")
    out = triton_linear_act(*on_device(x, w, b), activation="gelu")
    check_close(out, ref, naive, torch.float32, "transposed operands")


def test_empty_inputs(kernels):
    x, w, b = make_linear(torch.float32, batch=(0,))
    out, pre = triton_linear_act(*on_device(x, w, b), activation="relu", save_act_input=True)
    assert out.shape == (0, 37) and pre.shape == (0, 37)
    grad_output, act_input = on_device(torch.zeros(0, 37), torch.zeros(0, 40))
    assert triton_dgrad_act(grad_output, w.to(test_device()), "relu", act_input).shape == (0, 40)


# --- the PyTorch path -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_pytorch_path(activation, dtype):
    # CPU tensors: the path every device but CUDA takes
    x, w, b = make_linear(dtype, batch=(2, 5), in_features=12, out_features=9)
    check_forward(x, w, b, activation, save_act_input=True, device="cpu")
    check_forward(x, w, None, activation, save_act_input=False, device="cpu")
    check_dgrad(activation, dtype, rows=6, in_features=9, out_features=7, device="cpu")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, w, b: triton_linear_act(x, w, b, activation="swish"), "activation must be one of"),
        (lambda x, w, b: triton_linear_act(x, w.double(), b), "same dtype"),
        (lambda x, w, b: triton_linear_act(x, w, b.half()), "same dtype"),
        (lambda x, w, b: triton_linear_act(x, w[:, :-1], None), "Incompatible dimensions"),
        (lambda x, w, b: triton_linear_act(x, w, b[:-1]), "Incompatible dimensions"),
        (lambda x, w, b: triton_linear_act(x, w[0], b), "weight must be 2-D"),
        (lambda x, w, b: triton_dgrad_act(torch.randn(3, 37), w, "gelu"), "act_input is required"),
        (lambda x, w, b: triton_dgrad_act(torch.randn(3, 37), w, "gelu", torch.randn(3, 39)),
         "act_input must have shape"),
        (lambda x, w, b: triton_dgrad_act(torch.randn(3, 36), w), "Incompatible dimensions"),
        (lambda x, w, b: triton_dgrad_act(torch.randn(3, 37), w, "tanh"), "activation must be one of"),
    ],
)
def test_bad_input_raises_assertion_error(call, match):
    x, w, b = make_linear(torch.float32, batch=(3,))
    with pytest.raises(AssertionError, match=match):
        call(x, w, b)


# --- FusedDenseSqreluDense ----------------------------------------------------------------------------


def naive_mlp(x, w1, b1, w2, b2):
    hidden = F.linear(x, w1, b1)
    return F.linear(torch.where(hidden >= 0, hidden, torch.zeros_like(hidden)) ** 2, w2, b2)


def run_mlp_and_compare(module, dtype, seed=5):
    device = module.fc1.weight.device
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, module.fc1.in_features, generator=g).to(dtype)
    dout = torch.randn(2, 9, module.fc2.out_features, generator=g).to(dtype)
    params = [module.fc1.weight, module.fc1.bias, module.fc2.weight, module.fc2.bias]
    results = {}
    for kind, cd in (("ref", torch.float64), ("naive", dtype)):
        leaves = [t.detach().cpu().to(cd).requires_grad_() for t in [x, *params]]
        out = naive_mlp(*leaves)
        results[kind] = (out, torch.autograd.grad(out, leaves, dout.to(cd)))
    xd = x.to(device).requires_grad_()
    out = module(xd)
    grads = torch.autograd.grad(out, [xd, *params], dout.to(device))
    check_close(out, results["ref"][0], results["naive"][0], dtype, "mlp output")
    for name, ours, ref, naive in zip(["x", "w1", "b1", "w2", "b2"], grads, results["ref"][1], results["naive"][1]):
        check_close(ours, ref, naive, dtype, f"mlp d{name}", grad=True)


def make_mlp(dtype, checkpoint_lvl, seed=4, device=None):
    torch.manual_seed(seed)
    module = FusedDenseSqreluDense(24, 40, 20, checkpoint_lvl=checkpoint_lvl)
    return module.to(device=device or test_device(), dtype=dtype)


@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_mlp_through_the_kernels(kernels, dtype, checkpoint_lvl):
    run_mlp_and_compare(make_mlp(dtype, checkpoint_lvl), dtype)
    recompute = ["_linear_act_kernel"] if checkpoint_lvl == 2 else []
    assert kernels.launched == ["_linear_act_kernel", *recompute, "_dgrad_act_kernel"]


@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_mlp_pytorch_path(dtype, checkpoint_lvl):
    run_mlp_and_compare(make_mlp(dtype, checkpoint_lvl, device="cpu"), dtype)


def test_mlp_defaults_and_function():
    module = FusedDenseSqreluDense(8)
    assert (module.fc1.in_features, module.fc1.out_features, module.fc2.out_features) == (8, 32, 8)
    x = torch.randn(3, 8, dtype=torch.float64)
    p = [module.fc1.weight, module.fc1.bias, module.fc2.weight, module.fc2.bias]
    out = fused_dense_sqrelu_dense_function(x.float(), *p)
    torch.testing.assert_close(out.double(), naive_mlp(x, *(t.double() for t in p)), rtol=1e-5, atol=1e-5)


def test_mlp_under_autocast_runs_in_the_autocast_dtype():
    module = FusedDenseSqreluDense(8, 16)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x.requires_grad_())
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and module.fc1.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias1=False), "without bias"), (dict(bias2=False), "without bias"),
    (dict(checkpoint_lvl=3), "checkpoint_lvl"),
])
def test_mlp_bad_configuration(kwargs, match):
    with pytest.raises(AssertionError, match=match):
        FusedDenseSqreluDense(8, **kwargs)
