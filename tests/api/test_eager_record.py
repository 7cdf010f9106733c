"""The eager calls' autograd record (``custom_ops._Attention`` for q, k, v alone, ``_AttentionWithExtras``
when ALiBi slopes, qv or sinks come too): the right one is chosen, and ALiBi slopes stay an autograd
input without a gradient, as in upstream's ``FlashAttnFunc`` (a call whose only tensor that requires
grad is the slopes still has a graph, and its backward gives the slopes none). Gradients against the
naive float64 attention."""

import pytest
import torch

from flash_attn import custom_ops, dispatch, flash_attn_func
from support.oracle import attention_ref


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "reference")  # no direct route: every eager call is recorded here


def _qkv(requires_grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 9, 4, 16, generator=g, requires_grad=requires_grad) for _ in range(3)]


def test_plain_calls_record_q_k_v_only():
    q, k, v = _qkv()
    out = flash_attn_func(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == custom_ops._Attention.__name__ + "Backward"
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_ref(q64, k64, v64, causal=True).out, (q64, k64, v64), dout.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


def test_alibi_slopes_are_an_input_without_a_gradient():
    q, k, v = _qkv(requires_grad=False)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    out = flash_attn_func(q, k, v, alibi_slopes=slopes, causal=True)
    assert out.requires_grad and type(out.grad_fn).__name__ == custom_ops._AttentionWithExtras.__name__ + "Backward"
    out.sum().backward()
    assert slopes.grad is None
    q.requires_grad_()
    out = flash_attn_func(q, k, v, alibi_slopes=slopes.detach(), causal=True)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, (q,), dout)
    q64 = q.detach().double().requires_grad_()
    ref = attention_ref(q64, k.double(), v.double(), causal=True, alibi_slopes=slopes.detach().double()).out
    (want,) = torch.autograd.grad(ref, (q64,), dout.double())
    torch.testing.assert_close(dq.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("function", [custom_ops._Attention, custom_ops._AttentionWithExtras,
                                      custom_ops._HeldAttention, custom_ops._HeldPackedAttention])
def test_the_records_node_calls_the_functions_backward_itself(function):
    """The autograd engine calls a record's node's ``apply``: for our Functions that is their
    ``backward`` itself (custom_ops._direct_backward), not torch's Python wrapper around it."""
    assert function._backward_cls.apply is vars(function)["backward"].__func__


def test_a_records_node_still_runs_hooks_and_direct_apply():
    """What goes through a node besides the engine's call: the hooks on it (run by the engine's C++
    side) and ``grad_fn.apply`` called by hand, the gradients the oracle's."""
    q, k, v = _qkv()
    out = flash_attn_func(q, k, v, causal=True)
    seen = []
    out.grad_fn.register_prehook(lambda grads: seen.append("pre"))
    out.grad_fn.register_hook(lambda grads_in, grads_out: seen.append(len(grads_in)))
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert seen == ["pre", 3]  # a gradient for each tensor input: q, k, v
    by_hand = out.grad_fn.apply(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_ref(q64, k64, v64, causal=True).out, (q64, k64, v64), dout.double())
    for a, b, c in zip(got, by_hand, want):
        torch.testing.assert_close(a.double(), c, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(b.double(), c, atol=2e-5, rtol=2e-5)
