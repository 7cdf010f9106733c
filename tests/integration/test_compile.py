"""``torch.compile(fullgraph=True)`` traces the public functions without graph breaks (they are
``torch.library`` custom ops), matches eager, and the compiled backward works.

The default inductor backend is used (it needs a C compiler on CPU; gcc is enough).

Dropout under compile: two identical dropout calls draw two masks (the compiler must not merge
them), ``torch.manual_seed`` reproduces a compiled call, and the compiled backward uses the mask
of its own forward (gradients equal the float64 oracle's given the mask ``S_dmask`` reveals).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func

from support.inputs import cu_from_lens, gen, randn
from support.options import test_device
from support.oracle import attention_ref, oracle_pair
from support.tolerance import check_close

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FP16 = torch.float16


def _needs_compiler():
    if test_device().type == "cpu" and shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("inductor on CPU needs a C compiler")


def dense_block(q, k, v, slopes):
    # a little surrounding math so the graph has more than the custom op in it
    out = flash_attn_func(q * 1.5, k, v, causal=True, alibi_slopes=slopes, window_size=(16, -1))
    return (out.float() * 2.0).sum(dim=-1)


def varlen_block(q, k, v, cu_q, cu_k, max_q: int, max_k: int):
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softcap=3.0)
    return out.float().relu() + 1.0


def _fresh(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _compare(eager_fn, inputs, n_grad, extra):
    """Run eager and compiled (fullgraph) on cloned leaves; compare outputs and gradients."""
    _needs_compiler()
    torch._dynamo.reset()
    compiled = torch.compile(eager_fn, fullgraph=True)
    leaves_e = _fresh(*inputs[:n_grad])
    leaves_c = _fresh(*inputs[:n_grad])
    out_e = eager_fn(*leaves_e, *extra)
    out_c = compiled(*leaves_c, *extra)
    torch.testing.assert_close(out_c, out_e, atol=2e-3, rtol=2e-3)
    g = torch.randn(out_e.shape, generator=gen(0)).to(out_e.device)
    out_e.backward(g)
    out_c.backward(g)
    for a, b in zip(leaves_c, leaves_e):
        assert a.grad is not None
        torch.testing.assert_close(a.grad, b.grad, atol=5e-3, rtol=5e-3)


def test_explain_reports_no_graph_breaks():
    g = gen(1)
    q, k, v = (randn((1, 12, 2, 32), FP16, g) for _ in range(3))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(dense_block)(q, k, v, None)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_dense_matches_eager_and_backward_works():
    g = gen(2)
    q = randn((2, 40, 4, 64), FP16, g)
    k = randn((2, 50, 2, 64), FP16, g)
    v = randn((2, 50, 2, 64), FP16, g)
    slopes = torch.rand(4, generator=gen(3)).to(test_device())
    _compare(dense_block, [q, k, v], 3, [slopes])


def test_compiled_varlen_matches_eager_and_backward_works():
    g = gen(4)
    lens_q, lens_k = [5, 30, 1], [17, 30, 40]
    q = randn((sum(lens_q), 4, 32), FP16, g)
    k = randn((sum(lens_k), 4, 32), FP16, g)
    v = randn((sum(lens_k), 4, 32), FP16, g)
    _compare(varlen_block, [q, k, v], 3, [cu_from_lens(lens_q), cu_from_lens(lens_k), 30, 40])


# ---------------------------------------------------------------------------------------------
# Dropout under torch.compile. The mask is read from the output, so that every backend serves
# the calls (the aot backend refuses return_attn_probs): v holds one unit vector per key
# (v[b, j, h] = e_j), so out[b, i, h, j] = P[i, j] * keep[i, j] / (1 - p), and without a causal
# mask every P[i, j] > 0: keep = out != 0.

COMPILERS = ["aot_eager", "inductor"]
DROP = 0.5


def two_dropout_calls(q, k, v):
    """The same dropout call twice: eagerly two masks, and so compiled."""
    return flash_attn_func(q, k, v, dropout_p=DROP), flash_attn_func(q, k, v, dropout_p=DROP)


def _dropout_inputs(grad):
    g = gen(8)
    q, k = randn((1, 24, 2, 32), FP16, g, requires_grad=grad), randn((1, 32, 2, 32), FP16, g, requires_grad=grad)
    v = torch.eye(32).view(1, 32, 1, 32).expand(1, 32, 2, 32).to(test_device(), FP16).requires_grad_(grad)
    return q, k, v


def _keep(out):
    """The mask ``(b, h, sq, sk)`` an output of :func:`_dropout_inputs`' values reveals."""
    return (out != 0).permute(0, 2, 1, 3)


def _compiled(compiler):
    if compiler == "inductor":
        _needs_compiler()
    torch._dynamo.reset()
    return torch.compile(two_dropout_calls, backend=compiler, fullgraph=True)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiled_identical_dropout_calls_draw_different_masks(compiler, grad):
    out1, out2 = _compiled(compiler)(*_dropout_inputs(grad))
    keep1, keep2 = _keep(out1), _keep(out2)
    assert 0.4 < float(keep1.float().mean()) < 0.6  # the mask really is read from the output
    differ = float((keep1 != keep2).float().mean())
    assert differ > 0.3, f"the two calls' masks differ in only {differ:.0%} of the entries"


@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiled_dropout_reproduces_with_manual_seed(compiler):
    compiled = _compiled(compiler)
    inputs = _dropout_inputs(False)
    torch.manual_seed(21)
    first = compiled(*inputs)
    torch.manual_seed(21)
    again = compiled(*inputs)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(compiled(*inputs)[0], first[0])  # without reseeding: new masks


@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiled_dropout_backward_uses_its_forwards_mask(compiler):
    """The gradients of two dropout calls in one compiled graph equal the oracle's, each call
    with the mask its own forward revealed (a backward that drew a new seed, or that used the
    other call's mask, would not)."""
    compiled = _compiled(compiler)
    q, k, v = _dropout_inputs(True)
    g = gen(9)
    douts = randn(q.shape, FP16, g), randn(q.shape, FP16, g)
    outs = compiled(q, k, v)
    torch.rand(100, device=test_device())  # the generator moves on before the backward
    sum((out.float() * dout.float()).sum() for out, dout in zip(outs, douts)).backward()
    ref_sum, naive_sum = [0, 0, 0], [0, 0, 0]
    for out, dout in zip(outs, douts):
        ref, ref_grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, keep=_keep(out),
                                                         dropout_p=DROP)
        check_close(out, ref.out, naive.out, FP16, "out")
        ref_sum = [a + b for a, b in zip(ref_sum, ref_grads)]
        naive_sum = [a + b for a, b in zip(naive_sum, naive_grads)]
    for t, ref, naive, name in zip((q, k, v), ref_sum, naive_sum, ("dq", "dk", "dv")):
        check_close(t.grad, ref, naive, FP16, name, grad=True)
