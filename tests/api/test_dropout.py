"""Dropout: reproducibility from ``torch.manual_seed``, statistics of the mask, and exactness of the
output and gradients given the mask that ``S_dmask`` reveals (negative = dropped).

The keep mask is read back as ``S_dmask >= 0``. Entries whose probability is exactly 0 (masked
keys, or underflow) carry no information (``-0.0 >= 0``), but they contribute nothing to the
output or gradients either, so the oracle does not care which way they are read.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func

from support.inputs import cu_from_lens, gen, make_slopes, randn
from support.oracle import attention_ref, attention_varlen_ref, oracle_pair
from support.tolerance import DTYPE_IDS, backward_floor, check_close

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def _inputs(dtype, b, sq, sk, h, hk, d, seed, grad=True):
    g = gen(seed)
    q = randn((b, sq, h, d), dtype, g, requires_grad=grad)
    k = randn((b, sk, hk, d), dtype, g, requires_grad=grad)
    v = randn((b, sk, hk, d), dtype, g, requires_grad=grad)
    dout = randn((b, sq, h, d), dtype, g)
    return q, k, v, dout


def test_same_seed_gives_identical_output_and_mask():
    q, k, v, _ = _inputs(FP16, 2, 65, 70, 4, 2, 32, seed=1, grad=False)
    torch.manual_seed(1234)
    out1, lse1, s1 = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    torch.manual_seed(1234)
    out2, lse2, s2 = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    assert torch.equal(out1, out2) and torch.equal(s1, s2) and torch.equal(lse1, lse2)
    # asking for the probabilities does not change the mask that is drawn
    torch.manual_seed(1234)
    out3 = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    assert torch.equal(out1, out3)
    # and the dropout really does something
    out_nodrop = flash_attn_func(q, k, v, causal=True)
    assert (out1.float() - out_nodrop.float()).abs().max() > 0.05


def test_different_seeds_give_different_masks():
    q, k, v, _ = _inputs(FP32, 1, 64, 64, 2, 2, 32, seed=2, grad=False)
    torch.manual_seed(1)
    out1, _, s1 = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    torch.manual_seed(2)
    out2, _, s2 = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    keep1, keep2 = s1 >= 0, s2 >= 0
    assert (keep1 != keep2).float().mean() > 0.3  # independent masks differ in ~half the entries
    assert not torch.equal(out1, out2)
    # consecutive calls without reseeding draw fresh masks too
    _, _, s3 = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    assert not torch.equal(s3 >= 0, keep2)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.83])
def test_kept_fraction_within_five_sigma(p):
    b, h, s = 2, 4, 128
    q, k, v, _ = _inputs(FP32, b, s, s, h, h, 16, seed=3, grad=False)
    torch.manual_seed(7)
    _, _, sd = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    informative = sd != 0
    n = int(informative.sum())
    assert n > 0.99 * b * h * s * s
    kept = float((sd[informative] > 0).float().mean())
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 5 * sigma, f"kept fraction {kept:.4f}, expected {1 - p:.4f} +- {5 * sigma:.4f}"
    # every (batch, head) slice has its own mask, and each one has the right rate too
    keep = sd > 0
    n_slice = s * s
    sig_slice = math.sqrt(p * (1 - p) / n_slice)
    for bi in range(b):
        for hi in range(h):
            frac = float(keep[bi, hi].float().mean())
            assert abs(frac - (1 - p)) < 5 * sig_slice
    assert not torch.equal(keep[0, 0], keep[0, 1])
    assert not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])  # rows differ
    assert not torch.equal(keep[0, 0, :, 0], keep[0, 0, :, 1])  # columns differ


DROPOUT_CASES = [
    # dtype, b, sq, sk, h, hk, d, causal, window, alibi, p
    (FP32, 2, 37, 53, 2, 2, 32, False, (-1, -1), None, 0.17),
    (FP16, 1, 113, 113, 4, 2, 64, True, (-1, -1), "h", 0.3),
    (BF16, 2, 64, 31, 3, 1, 40, False, (8, 4), None, 0.5),
    (FP32, 1, 40, 90, 2, 1, 96, True, (20, -1), "bh", 0.9),
]


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=lambda c: f"{DTYPE_IDS[c[0]]}-s{c[2]}x{c[3]}-h{c[4]}k{c[5]}-p{c[10]}")
def test_dropout_output_and_grads_match_oracle_with_revealed_mask(case):
    dtype, b, sq, sk, h, hk, d, causal, window, alibi, p = case
    q, k, v, dout = _inputs(dtype, b, sq, sk, h, hk, d, seed=4)
    slopes = None if alibi is None else make_slopes((h,) if alibi == "h" else (b, h), seed=4)
    torch.manual_seed(99)
    out, lse, sd = flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window, alibi_slopes=slopes,
                                   return_attn_probs=True)
    # consume the RNG and run another dropout forward before the backward: the backward must
    # still use the mask of *its* forward
    torch.rand(1000)
    flash_attn_func(q.detach(), k.detach(), v.detach(), dropout_p=p, causal=causal, window_size=window)
    out.backward(dout)
    keep = sd >= 0
    opts = dict(causal=causal, window=window, alibi_slopes=slopes)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, keep=keep, dropout_p=p, **opts)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "softmax_lse (dropout does not change it)")
    check_close(sd.abs(), ref.probs, naive.probs, FP32, "|S_dmask| (probabilities before dropout)")
    floor = backward_floor(q, k, v, dout, None, ref.probs, dropout_p=p)
    for t, r, n, name in zip((q, k, v), rg, ng, ("dq", "dk", "dv")):
        check_close(t.grad, r, n, dtype, name, grad=True, floor=floor)


def test_dropout_varlen_matches_oracle():
    lens_q, lens_k = [5, 0, 40, 17], [33, 6, 40, 0]
    h, hk, d, p = 4, 2, 32, 0.25
    g = gen(5)
    q = randn((sum(lens_q), h, d), FP32, g, requires_grad=True)
    k = randn((sum(lens_k), hk, d), FP32, g, requires_grad=True)
    v = randn((sum(lens_k), hk, d), FP32, g, requires_grad=True)
    dout = randn((sum(lens_q), h, d), FP32, g)
    torch.manual_seed(5)
    out, lse, sd = flash_attn_varlen_func(q, k, v, cu_from_lens(lens_q), cu_from_lens(lens_k), 40, 40,
                                          dropout_p=p, causal=True, return_attn_probs=True)
    torch.rand(10)
    out.backward(dout)
    keep = sd >= 0
    cu = lambda lens: cu_from_lens(lens, device="cpu").tolist()
    ref, rg, naive, ng = oracle_pair(attention_varlen_ref, [q, k, v], dout, cu_q=cu(lens_q), cu_k=cu(lens_k),
                                     causal=True, keep=keep, dropout_p=p)
    check_close(out, ref.out, naive.out, FP32, "out")
    floor = backward_floor(q, k, v, dout, None, ref.probs, dropout_p=p)
    for t, r, n, name in zip((q, k, v), rg, ng, ("dq", "dk", "dv")):
        check_close(t.grad, r, n, FP32, name, grad=True, floor=floor)
    # sequences get different masks (the sequence index feeds the RNG); seq 2 is 40x40 causal
    keep2 = keep[2, 0, :40, :40]
    assert 0.6 < float(keep2.float().mean()) < 0.9


def test_dropout_packed_gradients_use_forward_mask():
    g = gen(6)
    qkv = randn((2, 50, 3, 2, 64), FP16, g, requires_grad=True)
    dout = randn((2, 50, 2, 64), FP16, g)
    torch.manual_seed(11)
    out, _, sd = flash_attn_qkvpacked_func(qkv, dropout_p=0.2, causal=True, return_attn_probs=True)
    torch.manual_seed(12)  # reseeding before the backward must not matter
    out.backward(dout)
    q, k, v = qkv.detach().unbind(2)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, causal=True, keep=sd >= 0, dropout_p=0.2)
    check_close(out, ref.out, naive.out, FP16, "out")
    check_close(qkv.grad, torch.stack(rg, 2), torch.stack(ng, 2), FP16, "dqkv", grad=True)


@pytest.mark.parametrize("dtype", [FP16, FP32])
def test_dropout_zero_gives_probabilities(dtype):
    q, k, v, _ = _inputs(dtype, 2, 30, 45, 2, 1, 32, seed=7, grad=False)
    out, lse, sd = flash_attn_func(q, k, v, dropout_p=0.0, causal=True, return_attn_probs=True)
    assert (sd >= 0).all()
    ref, _, naive, _ = oracle_pair(attention_ref, [q, k, v], causal=True)
    check_close(sd, ref.probs, naive.probs, FP32, "S_dmask")
    # rows sum to 1
    torch.testing.assert_close(sd.sum(-1).double().cpu(), torch.ones(2, 2, 30, dtype=torch.float64), atol=1e-5, rtol=0)


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A mode that changes nothing, but sends the calls through the custom op (the path of
    torch.compile, dispatch modes and fake tensors) instead of the direct eager path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_custom_op_path_draws_the_mask_of_the_direct_path():
    """Through the op, the seed is drawn by an aten random op before the op (so compilers keep two
    calls apart, tests/integration/test_compile.py): the same draw from the same generator as the direct eager
    path, so ``torch.manual_seed`` gives the same mask either way, and the backward uses it."""
    q, k, v, dout = _inputs(FP32, 1, 33, 40, 2, 1, 32, seed=8)
    results = []
    for mode in (None, _PassThrough()):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(77)
        with mode if mode is not None else torch.enable_grad():
            out, _, sd = flash_attn_func(*leaves, dropout_p=0.4, causal=True, return_attn_probs=True)
            again = flash_attn_func(*leaves, dropout_p=0.4, causal=True)
            out.backward(dout)
        results.append((out.detach(), sd, again.detach(), [t.grad for t in leaves]))
    (out_d, sd_d, again_d, grads_d), (out_op, sd_op, again_op, grads_op) = results
    assert torch.equal(sd_op >= 0, sd_d >= 0) and torch.equal(out_op, out_d)
    assert torch.equal(again_op, again_d) and not torch.equal(again_op, out_op)  # the next call: a new mask
    for got, want in zip(grads_op, grads_d):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
