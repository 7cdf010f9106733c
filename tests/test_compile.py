"""``torch.compile(fullgraph=True)`` traces the public functions without graph breaks (they are
``torch.library`` custom ops), matches eager, and the compiled backward works.

The default inductor backend is used (it needs a C compiler on CPU; gcc is enough).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func

from conftest import cu_from_lens, gen, randn, test_device

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
