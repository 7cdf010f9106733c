"""``torch.compile(fullgraph=True)`` of a small attention *module* (projections, GQA, rotary-free
causal self-attention) built on ``flash_attn_func`` and ``flash_attn_varlen_func``: it compiles
without graph breaks, matches eager, and its backward gives the same parameter and input
gradients. (tests/integration/test_compile.py covers the bare functions.)

Inductor (the default backend) needs a C compiler on CPU.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from flash_attn import flash_attn_func, flash_attn_varlen_func

from support.options import test_device

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class SelfAttention(nn.Module):
    """Causal grouped-query self-attention with a sliding window, dense or varlen."""

    def __init__(self, dim=64, heads=4, kv_heads=2, window=24):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, dim // heads, window
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)

    def _split(self, x):
        q, k, v = self.qkv(self.norm(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        shape = x.shape[:-1]
        return (q.unflatten(-1, (self.heads, self.head_dim)), k.unflatten(-1, (self.kv_heads, self.head_dim)),
                v.unflatten(-1, (self.kv_heads, self.head_dim)), shape)

    def forward(self, x):  # x: (batch, seqlen, dim)
        q, k, v, shape = self._split(x)
        o = flash_attn_func(q, k, v, causal=True, window_size=(self.window, 0))
        return x + self.out(o.reshape(*shape, -1))

    def forward_varlen(self, x, cu_seqlens, max_seqlen: int):  # x: (total, dim)
        q, k, v, shape = self._split(x)
        o = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True,
                                   window_size=(self.window, 0))
        return x + self.out(o.reshape(*shape, -1))


def _needs_compiler():
    if test_device().type == "cpu" and shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("inductor on CPU needs a C compiler")


def _module(dtype):
    torch.manual_seed(0)
    return SelfAttention().to(device=test_device(), dtype=dtype)


def _run(module, fn, x, *extra):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = fn(x, *extra)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(g)
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    return out.detach(), x.grad.detach(), grads


def _compare(module, eager_fn, x, *extra, tol):
    _needs_compiler()
    torch._dynamo.reset()
    compiled = torch.compile(eager_fn, fullgraph=True)  # fullgraph: any graph break is an error
    out_e, dx_e, grads_e = _run(module, eager_fn, x, *extra)
    out_c, dx_c, grads_c = _run(module, compiled, x, *extra)
    torch.testing.assert_close(out_c, out_e, **tol)
    torch.testing.assert_close(dx_c, dx_e, **tol)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


FP32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dense_module_compiles_fullgraph_matches_eager_and_backward(dtype):
    module = _module(dtype)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(2)).to(test_device(), dtype)
    _compare(module, module, x, tol=FP32_TOL if dtype == torch.float32 else BF16_TOL)


def test_varlen_module_compiles_fullgraph_matches_eager_and_backward():
    module = _module(torch.float32)
    lengths = [7, 30, 1, 18]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=test_device())
    x = torch.randn(sum(lengths), 64, generator=torch.Generator().manual_seed(3)).to(test_device())
    _compare(module, module.forward_varlen, x, cu, max(lengths), tol=FP32_TOL)


def test_module_has_no_graph_breaks():
    module = _module(torch.float32)
    x = torch.randn(1, 16, 64).to(test_device())
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=test_device())
    for fn, args in ((module, (x,)), (module.forward_varlen, (x[0], cu, 11))):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(fn)(*args)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


def test_varlen_module_recompiles_only_for_new_shapes():
    """New packed lengths, even a new number of sequences, reuse the one dynamic-shape graph."""
    _needs_compiler()
    module = _module(torch.float32)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(module.forward_varlen, backend=counter, fullgraph=True, dynamic=True)
    for lengths in ([3, 9], [8, 4], [5, 11], [2, 3, 4]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=test_device())
        x = torch.randn(sum(lengths), 64).to(test_device())
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, cu, max(lengths)), module.forward_varlen(x, cu, max(lengths)), **FP32_TOL)
    assert counter.frame_count == 1, counter.frame_count
