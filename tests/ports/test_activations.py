"""``flash_attn.ops.activations``: upstream's names and parameters, each function and autograd
function against a float64 oracle (the textbook formula, differentiated by autograd), the output
dtypes, and a ``torch.compile(fullgraph=True)`` trace."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from flash_attn.ops import activations as act

from support.tolerance import check_close

FP32, BF16, FP64 = torch.float32, torch.bfloat16, torch.float64

# upstream flash_attn/ops/activations.py (flash-attn 2.8.4 source, commit 0251105a): name -> parameters
UPSTREAM = {
    "bias_gelu": ["y", "bias"], "bias_gelu_back": ["g", "y", "bias"], "gelu_fwd": ["x"], "gelu_bwd": ["g", "x"],
    "relu_bwd": ["g", "x"], "sqrelu_fwd": ["x"], "sqrelu_bwd": ["g", "x"], "swiglu_fwd": ["x", "y"],
    "swiglu_bwd": ["x", "y", "g"],
}
APPLY = {"bias_gelu_impl": "GeLUFunction", "fast_gelu_impl": "FastGeLUFunction", "swiglu": "SwiGLUFunction"}


def test_names_and_parameters_match_upstream():
    for name, params in UPSTREAM.items():
        assert list(inspect.signature(getattr(act, name)).parameters) == params, name
    for name, cls in APPLY.items():
        assert getattr(act, name) == getattr(act, cls).apply, name


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu_mul(x, y):
    return x / (1 + torch.exp(-x)) * y


def _inputs(dtype, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 2).to(dtype) for s in shapes]


def _oracle(fn, inputs, dout, dtype=FP64):
    """``fn`` on ``inputs`` in ``dtype`` and the gradients of ``sum(out * dout)``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad((out * dout.to(dtype)).sum(), leaves)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("which", ["bias_gelu_impl", "fast_gelu_impl", "swiglu"])
def test_autograd_functions_vs_oracle(which, dtype):
    fn, oracle_fn, shapes = {
        "bias_gelu_impl": (act.bias_gelu_impl, lambda y, b: gelu_tanh(y + b), [(3, 5, 16), (16,)]),
        "fast_gelu_impl": (act.fast_gelu_impl, gelu_tanh, [(4, 33)]),
        "swiglu": (act.swiglu, silu_mul, [(4, 33), (4, 33)]),
    }[which]
    inputs = [t.requires_grad_() for t in _inputs(dtype, *shapes)]
    out = fn(*inputs)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    dout = _inputs(dtype, out.shape, seed=1)[0]
    grads = torch.autograd.grad(out, inputs, dout)
    ref, ref_grads = _oracle(oracle_fn, inputs, dout)
    naive, naive_grads = _oracle(oracle_fn, inputs, dout, dtype)
    check_close(out, ref, naive, dtype, which)
    for i, (a, r, n) in enumerate(zip(grads, ref_grads, naive_grads)):
        assert a.dtype == dtype and a.shape == inputs[i].shape
        check_close(a, r, n, dtype, f"{which} grad {i}", grad=True)


def test_plain_functions_vs_oracle():
    x, y, g = _inputs(FP32, (6, 20), (6, 20), (6, 20))
    x[0, :3] = torch.tensor([0.0, -1e-3, 1e-3])  # relu's boundary, where upstream passes g at x == 0
    x64, y64, g64 = x.double().requires_grad_(), y.double().requires_grad_(), g.double()
    check_close(act.gelu_fwd(x), gelu_tanh(x64), gelu_tanh(x), FP32, "gelu_fwd")
    check_close(act.gelu_fwd(x), torch.nn.functional.gelu(x64, approximate="tanh"),
                torch.nn.functional.gelu(x, approximate="tanh"), FP32, "vs F.gelu")
    (dgelu,) = torch.autograd.grad(gelu_tanh(x64), x64, g64)
    check_close(act.gelu_bwd(g, x), dgelu, dgelu.float(), FP32, "gelu_bwd", grad=True)
    sq = torch.relu(x64) ** 2
    check_close(act.sqrelu_fwd(x), sq, torch.relu(x) ** 2, FP32, "sqrelu_fwd")
    (dsq,) = torch.autograd.grad(sq, x64, g64)
    check_close(act.sqrelu_bwd(g, x), dsq, dsq.float(), FP32, "sqrelu_bwd", grad=True)
    assert torch.equal(act.relu_bwd(g, x), torch.where(x >= 0, g, torch.zeros_like(g)))
    assert act.relu_bwd(g, x)[0, 0] == g[0, 0] and act.relu_bwd(g, x)[0, 1] == 0
    dx, dy = torch.autograd.grad(silu_mul(x64, y64), (x64, y64), g64)
    got_dx, got_dy = act.swiglu_bwd(x, y, g)
    check_close(act.swiglu_fwd(x, y), silu_mul(x64, y64), silu_mul(x, y), FP32, "swiglu_fwd")
    check_close(got_dx, dx, dx.float(), FP32, "swiglu_bwd dx", grad=True)
    check_close(got_dy, dy, dy.float(), FP32, "swiglu_bwd dy", grad=True)
    b = _inputs(FP32, (20,), seed=2)[0]
    b64 = b.double().requires_grad_()
    x64b = x.double().requires_grad_()
    dxb, db = torch.autograd.grad(gelu_tanh(x64b + b64), (x64b, b64), g64)
    got_dx, got_db = act.bias_gelu_back(g, x, b)
    check_close(act.bias_gelu(x, b), gelu_tanh(x64 + b64), gelu_tanh(x + b), FP32, "bias_gelu")
    check_close(got_dx, dxb, dxb.float(), FP32, "bias_gelu_back dy", grad=True)
    check_close(got_db, db, db.float(), FP32, "bias_gelu_back dbias", grad=True)


def test_compile_fullgraph():
    torch._dynamo.reset()

    def mlp(x, y, b):
        return act.swiglu(act.bias_gelu_impl(x, b), y) + act.sqrelu_fwd(x)

    x, y, b = (t.requires_grad_() for t in _inputs(FP32, (4, 8), (4, 8), (8,)))
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    eager = mlp(x, y, b)
    got = compiled(x, y, b)
    torch.testing.assert_close(got, eager)
    for a, e in zip(torch.autograd.grad(got.sum(), (x, y, b)), torch.autograd.grad(eager.sum(), (x, y, b))):
        torch.testing.assert_close(a, e)
