"""An eager forward without dropout keeps no ``rng_state`` (nothing reads it; on a GPU it was an
allocation per call); when its backward runs through the ``flash_attn::backward`` op instead of
the op's body (a ``__torch_dispatch__`` mode active at backward time), the gradients are still
the naive float64 attention's. The op is given a placeholder int64 tensor there, as its schema
asks; this test cannot show that part: in eager mode torch 2.13's custom op also takes ``None``."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_attn import custom_ops, dispatch, flash_attn_func
from support.oracle import attention_ref


class _Ops(TorchDispatchMode):
    """Passes every op through, naming the ``flash_attn`` ones it saw."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "flash_attn":
            self.seen.append(func.name())
        return func(*args, **(kwargs or {}))


def test_the_backward_through_the_op_after_an_eager_forward(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "reference")  # no direct route: the eager forward is recorded
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 16, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 9, 3, 16, generator=g)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith(custom_ops._Attention.__name__)
    with _Ops() as ops:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert any(name.startswith("flash_attn::backward") for name in ops.seen)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = attention_ref(q64, k64, v64, causal=True).out
    ref = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    for got, exp in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), exp, atol=2e-5, rtol=2e-5)
