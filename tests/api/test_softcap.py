"""Softcap ``c * tanh(x / c)`` on every backend this machine runs: exact at both ends (small and
large ``x / c``: within the tolerance rule of the float64 oracle for ``c`` from 30 to 1e10, forward
and backward, where computing it as ``2c * sigmoid(2x / c) - c`` or ``1 - 2 / (exp + 1)`` lost
all precision as ``c`` grew), and ``c = inf`` is no softcap (the limit of ``c * tanh(x / c)``)."""

from __future__ import annotations

import pytest
import torch

from flash_attn import dispatch, flash_attn_func

from support.inputs import gen, randn
from support.oracle import attention_ref, oracle_pair
from support.options import backends_here
from support.tolerance import backward_floor, check_close

BACKENDS = backends_here()


def _on(backend, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_BACKEND", backend)
    return torch.float32 if backend in ("cpu", "reference") else torch.float16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [30.0, 1e3, 1e5, 1e10])
def test_large_softcaps_stay_exact(backend, softcap, monkeypatch):
    dtype = _on(backend, monkeypatch)
    g = gen(3)
    q, k, v, dout = (randn((1, 96, 2, 64), dtype, g, scale=3.0, requires_grad=i < 3) for i in range(4))
    out = flash_attn_func(q, k, v, causal=True, softcap=softcap)
    assert dispatch.last_backend() == backend
    out.backward(dout)
    ref, ref_grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, causal=True, softcap=softcap)
    check_close(out, ref.out, naive.out, dtype, "out")
    floor = backward_floor(q, k, v, dout, None, ref.probs)
    for t, want, approx, name in zip((q, k, v), ref_grads, naive_grads, ("dq", "dk", "dv")):
        check_close(t.grad, want, approx, dtype, name, grad=True, floor=floor)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_softcap_is_no_softcap(backend, monkeypatch):
    dtype = _on(backend, monkeypatch)
    g = gen(4)
    q, k, v = (randn((2, 40, 2, 32), dtype, g) for _ in range(3))
    capped = flash_attn_func(q, k, v, causal=True, softcap=float("inf"), return_attn_probs=True)
    plain = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    for got, want in zip(capped, plain):
        assert torch.equal(got, want)
