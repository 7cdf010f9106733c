"""``deterministic=True``: the backward is bit-reproducible run to run (dense, GQA, varlen,
dropout). The forward is always deterministic."""

from __future__ import annotations

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_varlen_func

from support.inputs import cu_from_lens, gen, randn
from support.options import test_device
from support.tolerance import DTYPE_IDS

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def _grads(fn, tensors, dout, seed=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    if seed is not None:
        torch.manual_seed(seed)
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _assert_bit_identical(a, b):
    for x, y, name in zip(a, b, ("out", "dq", "dk", "dv")):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("dtype,h,hk,causal", [(FP16, 4, 4, False), (BF16, 6, 2, True), (FP32, 3, 1, True)],
                         ids=lambda x: DTYPE_IDS.get(x, str(x)))
def test_dense_backward_is_bit_reproducible(dtype, h, hk, causal):
    g = gen(1)
    q = randn((2, 200, h, 64), dtype, g)
    k = randn((2, 300, hk, 64), dtype, g)
    v = randn((2, 300, hk, 64), dtype, g)
    dout = randn((2, 200, h, 64), dtype, g)
    fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=True)
    _assert_bit_identical(_grads(fn, [q, k, v], dout), _grads(fn, [q, k, v], dout))


@pytest.mark.parametrize("causal", [False, True])
def test_long_backward_is_bit_reproducible(causal):
    """GPU sizes (4 x 4096 tokens, 8 / 4 heads): on Hopper and Blackwell the fused kernel runs
    it in 8 splits, each program walking 4 key blocks of 128 and adding dQ into sums of its own
    (the shorter calls above give each split one key block); elsewhere the split kernels."""
    if test_device().type != "cuda":
        pytest.skip("GPU sizes: the fused kernel's splits walk several key blocks on a GPU")
    g = gen(6)
    q = randn((4, 4096, 8, 128), BF16, g)
    k, v = randn((4, 4096, 4, 128), BF16, g), randn((4, 4096, 4, 128), BF16, g)
    dout = randn((4, 4096, 8, 128), BF16, g)
    fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=True)
    _assert_bit_identical(_grads(fn, [q, k, v], dout), _grads(fn, [q, k, v], dout))


def test_kvpacked_gqa_backward_is_bit_reproducible():
    g = gen(2)
    q = randn((1, 150, 8, 32), BF16, g)
    kv = randn((1, 150, 2, 2, 32), BF16, g)
    dout = randn((1, 150, 8, 32), BF16, g)
    fn = lambda q, kv: flash_attn_kvpacked_func(q, kv, window_size=(32, 8), deterministic=True)
    _assert_bit_identical(_grads(fn, [q, kv], dout), _grads(fn, [q, kv], dout))


def test_varlen_backward_is_bit_reproducible():
    lens_q, lens_k = [100, 0, 37, 256], [80, 9, 37, 300]
    g = gen(3)
    q = randn((sum(lens_q), 6, 40), FP16, g)
    k = randn((sum(lens_k), 2, 40), FP16, g)
    v = randn((sum(lens_k), 2, 40), FP16, g)
    dout = randn((sum(lens_q), 6, 40), FP16, g)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    fn = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 256, 300, causal=True, deterministic=True)
    _assert_bit_identical(_grads(fn, [q, k, v], dout), _grads(fn, [q, k, v], dout))


def test_dropout_backward_is_bit_reproducible_with_the_same_seed():
    g = gen(4)
    q, k, v = (randn((2, 90, 4, 64), FP16, g) for _ in range(3))
    dout = randn((2, 90, 4, 64), FP16, g)
    fn = lambda q, k, v: flash_attn_func(q, k, v, dropout_p=0.2, causal=True, deterministic=True)
    _assert_bit_identical(_grads(fn, [q, k, v], dout, seed=3), _grads(fn, [q, k, v], dout, seed=3))


def test_deterministic_flag_does_not_change_the_gradient_values():
    """deterministic=True/False differ at most by rounding (same math)."""
    g = gen(5)
    q, k, v = (randn((1, 64, 2, 32), FP32, g) for _ in range(3))
    dout = randn((1, 64, 2, 32), FP32, g)
    a = _grads(lambda q, k, v: flash_attn_func(q, k, v, causal=True, deterministic=True), [q, k, v], dout)
    b = _grads(lambda q, k, v: flash_attn_func(q, k, v, causal=True, deterministic=False), [q, k, v], dout)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
