"""Every public function against the independent float64 oracle (``tests/support/oracle.py``).

Forward outputs, logsumexp, attention probabilities and gradients are checked with the tolerance
rule of ``support.tolerance.check_close``. The dense matrix is *pairwise* (every pair of values of any two
factors appears in at least one case), generated deterministically, instead of the full cross
product, so the file stays fast on a CPU. Long sequences only appear with small head dims,
batch 1.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib

import pytest
import torch

from flash_attn import (
    dispatch,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

from support.inputs import cu_from_lens, gen, make_slopes, randn
from support.options import backends_here, test_device
from support.oracle import attention_ref, attention_varlen_ref, kvcache_ref, oracle_pair
from support.tolerance import DTYPE_IDS, backward_floor, check_close

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32

# mask name -> (causal, window_size)
MASKS = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "local": (False, (17, 9)),
    "causal_left": (True, (24, -1)),
    "right_only": (False, (-1, 3)),
    "diag": (False, (0, 0)),
}


# ---------------------------------------------------------------------------------------------
# Pairwise case generation.


def pairwise(factors: dict, valid, seed: int = 0, tries: int = 300) -> list[dict]:
    """Greedy all-pairs: a deterministic list of cases covering every feasible pair of values."""
    rng = random.Random(seed)
    names = list(factors)

    def pairs_of(case):
        return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}

    uncovered = {
        (a, i, b, j)
        for a, b in itertools.combinations(names, 2)
        for i in range(len(factors[a]))
        for j in range(len(factors[b]))
    }
    cases = []
    while uncovered:
        target = min(uncovered)
        best, best_gain = None, 0
        for _ in range(tries):
            cand = {n: rng.randrange(len(factors[n])) for n in names}
            cand[target[0]], cand[target[2]] = target[1], target[3]
            decoded = {n: factors[n][cand[n]] for n in names}
            if not valid(decoded):
                continue
            gain = len(pairs_of(cand) & uncovered)
            if gain > best_gain:
                best, best_gain = cand, gain
        if best is None:  # infeasible pair under the constraints
            uncovered.discard(target)
            continue
        cases.append({n: factors[n][best[n]] for n in names})
        uncovered -= pairs_of(best)
    return cases


DENSE_FACTORS = {
    "dtype": [FP16, BF16, FP32],
    "d": [32, 40, 59, 64, 96, 128, 192, 256],
    "seqlens": [(1, 1), (1, 128), (113, 113), (128, 128), (113, 257), (257, 113), (257, 257),
                (1025, 1025), (1, 1025), (1025, 128)],
    "heads": [(2, 2), (4, 2), (3, 1)],  # MHA, GQA, MQA
    "mask": list(MASKS),
    "softcap": [0.0, 2.5],
    "alibi": [None, "h", "bh"],
    "scale": [None, 0.3],
    "batch": [1, 2],
    "probs": [False, True],
}


def _dense_valid(c) -> bool:
    big = max(c["seqlens"])
    if big > 300 and (c["d"] > 64 or c["batch"] > 1 or c["heads"][0] > 3):
        return False
    if big > 200 and c["d"] > 128 and c["batch"] > 1:
        return False
    return True


DENSE_CASES = pairwise(DENSE_FACTORS, _dense_valid)


def _case_id(c) -> str:
    sq, sk = c["seqlens"]
    h, hk = c["heads"]
    parts = [DTYPE_IDS[c["dtype"]], f"d{c['d']}", f"s{sq}x{sk}", f"h{h}k{hk}", c["mask"], f"b{c['batch']}"]
    if c["softcap"]:
        parts.append(f"cap{c['softcap']}")
    if c["alibi"]:
        parts.append(f"alibi_{c['alibi']}")
    if c["scale"]:
        parts.append(f"scale{c['scale']}")
    if c["probs"]:
        parts.append("probs")
    return "-".join(parts)


def _slopes(kind, batch, h, seed=11):
    if kind is None:
        return None
    return make_slopes((h,) if kind == "h" else (batch, h), seed=seed)


def _check_grads(tensors, ref_grads, naive_grads, dtype, names, dout, ref, softmax_scale=None):
    """Compare ``t.grad`` of q, k, v with the oracle's gradients (tolerance rule with the fp32
    backward floor of :func:`support.tolerance.backward_floor`)."""
    floor = backward_floor(*tensors[:3], dout, softmax_scale, ref.probs)
    for t, rg, ng, name in zip(tensors, ref_grads, naive_grads, names):
        assert t.grad is not None, f"no gradient for {name}"
        check_close(t.grad, rg, ng, dtype, name, grad=True, floor=floor)


def test_pairwise_matrix_covers_the_brief():
    """The generated dense matrix really covers every value of every factor."""
    for name, values in DENSE_FACTORS.items():
        seen = {repr(c[name]) for c in DENSE_CASES}
        assert seen == {repr(v) for v in values}, name
    assert 60 <= len(DENSE_CASES) <= 110


@pytest.mark.parametrize("case", DENSE_CASES, ids=_case_id)
def test_flash_attn_func_vs_oracle(case):
    dtype, d, (sq, sk), (h, hk), b = case["dtype"], case["d"], case["seqlens"], case["heads"], case["batch"]
    causal, window = MASKS[case["mask"]]
    seed = zlib.crc32(_case_id(case).encode()) % 10_000
    g = gen(seed)
    q = randn((b, sq, h, d), dtype, g, requires_grad=True)
    k = randn((b, sk, hk, d), dtype, g, requires_grad=True)
    v = randn((b, sk, hk, d), dtype, g, requires_grad=True)
    dout = randn((b, sq, h, d), dtype, g)
    slopes = _slopes(case["alibi"], b, h)
    opts = dict(softmax_scale=case["scale"], causal=causal, softcap=case["softcap"], alibi_slopes=slopes)
    res = flash_attn_func(q, k, v, window_size=window, return_attn_probs=case["probs"], **opts)
    out = res[0] if case["probs"] else res
    assert out.dtype == dtype and out.device == q.device and tuple(out.shape) == (b, sq, h, d)
    out.backward(dout)
    ref, ref_grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, window=window, **opts)
    check_close(out, ref.out, naive.out, dtype, "out")
    if case["probs"]:
        _, lse, s_dmask = res
        assert lse.dtype == torch.float32 and tuple(lse.shape) == (b, h, sq)
        assert s_dmask.dtype == torch.float32 and tuple(s_dmask.shape) == (b, h, sq, sk)
        check_close(lse, ref.lse, naive.lse, FP32, "softmax_lse")
        check_close(s_dmask, ref.probs, naive.probs, FP32, "S_dmask")
    _check_grads([q, k, v], ref_grads, naive_grads, dtype, ["dq", "dk", "dv"], dout, ref, case["scale"])


def test_return_attn_probs_returns_lse_and_probabilities():
    """Small hand-checkable case: lse is log(sum(exp(scores))), S_dmask rows sum to 1 and are
    exactly 0 on masked keys (dropout_p = 0)."""
    g = gen(5)
    q = randn((1, 3, 1, 8), FP32, g)
    k = randn((1, 5, 1, 8), FP32, g)
    v = randn((1, 5, 1, 8), FP32, g)
    out, lse, s = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    scores = torch.einsum("qd,kd->qk", q[0, :, 0].double(), k[0, :, 0].double()) / math.sqrt(8)
    # bottom-right causal: query i sees keys j <= i + 2
    for i in range(3):
        visible = scores[i, : i + 3]
        assert lse[0, 0, i].item() == pytest.approx(torch.logsumexp(visible, 0).item(), abs=1e-5)
        p = torch.softmax(visible, 0)
        torch.testing.assert_close(s[0, 0, i, : i + 3].double().cpu(), p.cpu(), atol=1e-6, rtol=1e-5)
        assert (s[0, 0, i, i + 3:] == 0).all()
        torch.testing.assert_close(out[0, i, 0].double().cpu(), (p @ v[0, : i + 3, 0].double()).cpu(), atol=1e-5, rtol=1e-5)


def test_default_softmax_scale_is_inverse_sqrt_headdim():
    g = gen(6)
    q, k, v = (randn((1, 7, 2, 24), FP32, g) for _ in range(3))
    default = flash_attn_func(q, k, v)
    explicit = flash_attn_func(q, k, v, softmax_scale=24 ** -0.5)
    other = flash_attn_func(q, k, v, softmax_scale=1.0)
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)
    assert (default - other).abs().max() > 1e-3


def test_strided_inputs_other_than_last_dim():
    """q/k/v that are slices of bigger tensors (non-contiguous, last dim stride 1) work."""
    g = gen(7)
    big = randn((2, 20, 3, 4, 48), FP16, g)
    q = big[:, 3:15, 0, :, 5:37]  # strided in every dim but the last
    k = big[:, :, 1, :2, :32]
    v = big[:, :, 2, 2:, 16:48]
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = flash_attn_func(q, k, v, causal=True)
    ref, _, naive, _ = oracle_pair(attention_ref, [q, k, v], causal=True)
    check_close(out, ref.out, naive.out, FP16, "out")


# ---------------------------------------------------------------------------------------------
# Packed dense variants: gradients land in the packed tensor.


@pytest.mark.parametrize(
    "dtype,b,s,h,d,mask,softcap,alibi",
    [
        (FP16, 2, 113, 2, 64, "causal", 0.0, None),
        (BF16, 1, 128, 3, 40, "local", 0.0, "bh"),
        (FP32, 2, 57, 2, 96, "full", 3.0, "h"),
        (FP16, 1, 1, 2, 256, "full", 0.0, None),
    ],
)
def test_qkvpacked_vs_oracle(dtype, b, s, h, d, mask, softcap, alibi):
    causal, window = MASKS[mask]
    g = gen(21)
    qkv = randn((b, s, 3, h, d), dtype, g, requires_grad=True)
    dout = randn((b, s, h, d), dtype, g)
    slopes = _slopes(alibi, b, h)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, causal=causal, window_size=window, softcap=softcap,
                                           alibi_slopes=slopes, return_attn_probs=True)
    out.backward(dout)
    q, k, v = qkv.detach().unbind(2)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, causal=causal, window=window,
                                     softcap=softcap, alibi_slopes=slopes)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "softmax_lse")
    floor = backward_floor(q, k, v, dout, None, ref.probs)
    check_close(qkv.grad, torch.stack(rg, 2), torch.stack(ng, 2), dtype, "dqkv", grad=True, floor=floor)


@pytest.mark.parametrize(
    "dtype,b,sq,sk,h,hk,d,mask,alibi",
    [
        (FP16, 2, 113, 257, 4, 2, 64, "causal", None),
        (BF16, 1, 257, 113, 3, 1, 32, "causal_left", "h"),
        (FP32, 2, 1, 128, 2, 2, 128, "full", "bh"),
        (FP16, 1, 64, 64, 6, 3, 192, "right_only", None),
    ],
)
def test_kvpacked_vs_oracle(dtype, b, sq, sk, h, hk, d, mask, alibi):
    causal, window = MASKS[mask]
    g = gen(22)
    q = randn((b, sq, h, d), dtype, g, requires_grad=True)
    kv = randn((b, sk, 2, hk, d), dtype, g, requires_grad=True)
    dout = randn((b, sq, h, d), dtype, g)
    slopes = _slopes(alibi, b, h)
    out = flash_attn_kvpacked_func(q, kv, causal=causal, window_size=window, alibi_slopes=slopes)
    out.backward(dout)
    k, v = kv.detach().unbind(2)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, causal=causal, window=window,
                                     alibi_slopes=slopes)
    check_close(out, ref.out, naive.out, dtype, "out")
    floor = backward_floor(q, k, v, dout, None, ref.probs)
    check_close(q.grad, rg[0], ng[0], dtype, "dq", grad=True, floor=floor)
    check_close(kv.grad, torch.stack(rg[1:], 2), torch.stack(ng[1:], 2), dtype, "dkv", grad=True, floor=floor)


# ---------------------------------------------------------------------------------------------
# Fully masked rows: output 0, lse +inf, no NaN anywhere (forward and backward).


@pytest.mark.parametrize(
    "sq,sk,causal,window",
    [(7, 3, True, (-1, -1)), (9, 4, False, (0, 0)), (8, 3, False, (1, 0)), (6, 2, False, (-1, 1))],
)
@pytest.mark.parametrize("dtype", [FP16, FP32])
def test_fully_masked_rows_give_zero_and_no_nan(sq, sk, causal, window, dtype):
    g = gen(31)
    q = randn((2, sq, 2, 32), dtype, g, requires_grad=True)
    k = randn((2, sk, 2, 32), dtype, g, requires_grad=True)
    v = randn((2, sk, 2, 32), dtype, g, requires_grad=True)
    out, lse, s = flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    dout = torch.ones_like(out)
    out.backward(dout)
    for t in (out, s, q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, causal=causal, window=window)
    empty_rows = torch.isinf(ref.lse)
    assert empty_rows.any(), "test case should contain rows without keys"
    assert torch.isposinf(lse.cpu()[empty_rows.cpu()]).all()
    assert (out.detach().permute(0, 2, 1, 3).cpu()[empty_rows.cpu()] == 0).all()
    assert (q.grad.permute(0, 2, 1, 3).cpu()[empty_rows.cpu()] == 0).all()
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "lse")
    _check_grads([q, k, v], rg, ng, dtype, ["dq", "dk", "dv"], dout, ref)


# ---------------------------------------------------------------------------------------------
# Varlen.


VARLEN_CASES = [
    # dtype, lens_q, lens_k, h, hk, d, mask, softcap, alibi, probs
    (FP16, [5, 0, 17, 1], [9, 3, 0, 40], 2, 2, 64, "causal", 0.0, None, True),
    (BF16, [113, 31, 64], [113, 31, 64], 4, 2, 40, "full", 0.0, "bh", False),
    (FP32, [1, 128, 0, 7], [257, 1, 12, 0], 3, 1, 59, "local", 2.0, "h", True),
    (FP16, [33, 200], [100, 17], 2, 1, 128, "causal_left", 0.0, "bh", False),
    (BF16, [0, 0, 3], [4, 0, 0], 2, 2, 256, "full", 0.0, None, True),
    (FP32, [16, 16, 16], [16, 16, 16], 2, 2, 32, "right_only", 0.0, None, False),
]


def _varlen_inputs(dtype, lens_q, lens_k, h, hk, d, seed):
    g = gen(seed)
    q = randn((sum(lens_q), h, d), dtype, g, requires_grad=True)
    k = randn((sum(lens_k), hk, d), dtype, g, requires_grad=True)
    v = randn((sum(lens_k), hk, d), dtype, g, requires_grad=True)
    dout = randn((sum(lens_q), h, d), dtype, g)
    return q, k, v, dout


def _cu_list(lens):
    return cu_from_lens(lens, device="cpu").tolist()


def _lens_id(lens):
    return "_".join(map(str, lens)) or "none"


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{DTYPE_IDS[c[0]]}-q{_lens_id(c[1])}-k{_lens_id(c[2])}-{c[6]}")
def test_varlen_func_vs_oracle(case):
    dtype, lens_q, lens_k, h, hk, d, mask, softcap, alibi, probs = case
    causal, window = MASKS[mask]
    batch = len(lens_q)
    q, k, v, dout = _varlen_inputs(dtype, lens_q, lens_k, h, hk, d, seed=41)
    slopes = _slopes(alibi, batch, h)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    max_q, max_k = max(lens_q), max(lens_k)
    res = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                 softcap=softcap, alibi_slopes=slopes, return_attn_probs=probs)
    out = res[0] if probs else res
    assert tuple(out.shape) == tuple(q.shape) and out.dtype == dtype
    out.backward(dout)
    ref, rg, naive, ng = oracle_pair(
        attention_varlen_ref, [q, k, v], dout, cu_q=_cu_list(lens_q), cu_k=_cu_list(lens_k),
        causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
    check_close(out, ref.out, naive.out, dtype, "out")
    if probs:
        _, lse, s = res
        assert tuple(lse.shape) == (h, sum(lens_q)) and lse.dtype == torch.float32
        assert tuple(s.shape) == (batch, h, max_q, max_k) and s.dtype == torch.float32
        check_close(lse, ref.lse, naive.lse, FP32, "softmax_lse")
        for b in range(batch):
            lq, lk = lens_q[b], lens_k[b]
            check_close(s[b, :, :lq, :lk], ref.probs[b, :, :lq, :lk], naive.probs[b, :, :lq, :lk], FP32, f"S_dmask[{b}]")
    _check_grads([q, k, v], rg, ng, dtype, ["dq", "dk", "dv"], dout, ref)


def test_varlen_max_seqlen_larger_than_needed_is_harmless():
    lens_q, lens_k = [3, 9], [12, 5]
    q, k, v, _ = _varlen_inputs(FP32, lens_q, lens_k, 2, 2, 32, seed=42)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    exact = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 12, causal=True)
    loose, lse, s = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 30, causal=True, return_attn_probs=True)
    torch.testing.assert_close(exact, loose, atol=1e-5, rtol=1e-5)
    assert tuple(s.shape) == (2, 2, 20, 30)


def test_varlen_equals_dense_per_sequence():
    """Each varlen sequence equals flash_attn_func on that sequence alone (independent of the
    oracle: catches cross-sequence leaks in masks, ALiBi and offsets)."""
    lens_q, lens_k = [7, 1, 20], [30, 4, 20]
    h, hk, d = 4, 2, 32
    q, k, v, _ = _varlen_inputs(FP32, lens_q, lens_k, h, hk, d, seed=43)
    slopes = make_slopes((3, h), seed=3)
    out = flash_attn_varlen_func(q, k, v, cu_from_lens(lens_q), cu_from_lens(lens_k), 20, 30,
                                 causal=True, alibi_slopes=slopes)
    cq, ck = _cu_list(lens_q), _cu_list(lens_k)
    for b in range(3):
        qb = q[cq[b]:cq[b + 1]].unsqueeze(0)
        kb, vb = k[ck[b]:ck[b + 1]].unsqueeze(0), v[ck[b]:ck[b + 1]].unsqueeze(0)
        dense = flash_attn_func(qb, kb, vb, causal=True, alibi_slopes=slopes[b])
        torch.testing.assert_close(out[cq[b]:cq[b + 1]], dense[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,lens,h,d,mask", [
    (FP16, [17, 0, 64, 1], 2, 64, "causal"),
    (FP32, [40, 41], 3, 40, "local"),
])
def test_varlen_qkvpacked_vs_oracle(dtype, lens, h, d, mask):
    causal, window = MASKS[mask]
    g = gen(44)
    qkv = randn((sum(lens), 3, h, d), dtype, g, requires_grad=True)
    dout = randn((sum(lens), h, d), dtype, g)
    cu = cu_from_lens(lens)
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=causal, window_size=window,
                                                  return_attn_probs=True)
    out.backward(dout)
    q, k, v = qkv.detach().unbind(1)
    ref, rg, naive, ng = oracle_pair(attention_varlen_ref, [q, k, v], dout, cu_q=_cu_list(lens),
                                     cu_k=_cu_list(lens), causal=causal, window=window)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "lse")
    floor = backward_floor(q, k, v, dout, None, ref.probs)
    check_close(qkv.grad, torch.stack(rg, 1), torch.stack(ng, 1), dtype, "dqkv", grad=True, floor=floor)


@pytest.mark.parametrize("dtype,lens_q,lens_k,h,hk,d,mask,alibi", [
    (BF16, [5, 60, 0], [70, 1, 9], 4, 2, 96, "causal", "h"),
    (FP32, [128, 3], [128, 200], 2, 1, 32, "full", None),
])
def test_varlen_kvpacked_vs_oracle(dtype, lens_q, lens_k, h, hk, d, mask, alibi):
    causal, window = MASKS[mask]
    g = gen(45)
    q = randn((sum(lens_q), h, d), dtype, g, requires_grad=True)
    kv = randn((sum(lens_k), 2, hk, d), dtype, g, requires_grad=True)
    dout = randn((sum(lens_q), h, d), dtype, g)
    slopes = _slopes(alibi, len(lens_q), h)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_from_lens(lens_q), cu_from_lens(lens_k),
                                          max(lens_q), max(lens_k), causal=causal, window_size=window,
                                          alibi_slopes=slopes)
    out.backward(dout)
    k, v = kv.detach().unbind(1)
    ref, rg, naive, ng = oracle_pair(attention_varlen_ref, [q, k, v], dout, cu_q=_cu_list(lens_q),
                                     cu_k=_cu_list(lens_k), causal=causal, window=window, alibi_slopes=slopes)
    check_close(out, ref.out, naive.out, dtype, "out")
    floor = backward_floor(q, k, v, dout, None, ref.probs)
    check_close(q.grad, rg[0], ng[0], dtype, "dq", grad=True, floor=floor)
    check_close(kv.grad, torch.stack(rg[1:], 1), torch.stack(ng[1:], 1), dtype, "dkv", grad=True, floor=floor)


# ---------------------------------------------------------------------------------------------
# Varlen with a paged KV (block_table).


def _page_table(lens_k, page, extra_pages, seed):
    """A shuffled page pool: returns (num_blocks, block_table rows as lists). Unused table slots
    point at a junk page that no sequence owns."""
    needed = [-(-n // page) for n in lens_k]
    num_blocks = sum(needed) + extra_pages
    perm = list(range(num_blocks))
    random.Random(seed).shuffle(perm)
    junk = perm.pop()  # a page no sequence owns
    width = max(max(needed), 1) + 1
    table, pos = [], 0
    for n in needed:
        row = perm[pos:pos + n]
        pos += n
        table.append(row + [junk] * (width - n))
    return num_blocks, table


@pytest.mark.parametrize("page,dtype,lens_q,lens_k,h,hk,d,mask", [
    (16, FP16, [3, 40, 0, 1], [50, 40, 7, 0], 4, 2, 64, "causal"),
    (16, FP32, [1, 1, 1], [33, 16, 1], 2, 1, 32, "full"),
    (256, BF16, [100, 7], [300, 7], 2, 2, 40, "local"),
    (256, FP32, [64], [513], 2, 2, 128, "causal"),
])
def test_varlen_paged_kv_vs_oracle(page, dtype, lens_q, lens_k, h, hk, d, mask):
    causal, window = MASKS[mask]
    num_blocks, table = _page_table(lens_k, page, extra_pages=3, seed=page + len(lens_q))
    g = gen(46)
    q = randn((sum(lens_q), h, d), dtype, g, requires_grad=True)
    k_pages = randn((num_blocks, page, hk, d), dtype, g, requires_grad=True)
    v_pages = randn((num_blocks, page, hk, d), dtype, g, requires_grad=True)
    dout = randn((sum(lens_q), h, d), dtype, g)
    block_table = torch.tensor(table, dtype=torch.int32, device=test_device())
    out = flash_attn_varlen_func(q, k_pages, v_pages, cu_from_lens(lens_q), cu_from_lens(lens_k),
                                 max(lens_q), max(lens_k), causal=causal, window_size=window,
                                 block_table=block_table)
    ref, rg, naive, ng = oracle_pair(attention_varlen_ref, [q, k_pages, v_pages], dout, cu_q=_cu_list(lens_q),
                                     cu_k=_cu_list(lens_k), causal=causal, window=window, block_table=table)
    check_close(out, ref.out, naive.out, dtype, "out")
    out.backward(dout)
    _check_grads([q, k_pages, v_pages], rg, ng, dtype, ["dq", "dk_pages", "dv_pages"], dout, ref)


def test_paged_kv_equals_contiguous_kv():
    """Paged and contiguous layouts of the same keys give the same output (oracle-free)."""
    lens_q, lens_k, page = [4, 9], [37, 20], 16
    num_blocks, table = _page_table(lens_k, page, extra_pages=2, seed=5)
    g = gen(47)
    q = randn((sum(lens_q), 2, 32), FP32, g)
    k_pages = randn((num_blocks, page, 2, 32), FP32, g)
    v_pages = randn((num_blocks, page, 2, 32), FP32, g)
    ks, vs = [], []
    for b, n in enumerate(lens_k):
        rows_k = torch.cat([k_pages[p] for p in table[b]])[:n]
        rows_v = torch.cat([v_pages[p] for p in table[b]])[:n]
        ks.append(rows_k), vs.append(rows_v)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    paged = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 9, 37, causal=True,
                                   block_table=torch.tensor(table, dtype=torch.int32, device=q.device))
    flat = flash_attn_varlen_func(q, torch.cat(ks), torch.cat(vs), cu_q, cu_k, 9, 37, causal=True)
    torch.testing.assert_close(paged, flat, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# KV cache.


def _rotary_tables(seqlen_ro, rotary_dim, dtype, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).to(dtype).to(test_device()), torch.sin(ang).to(dtype).to(test_device())


KVCACHE_CASES = [
    # name, overrides
    ("no_append_int_seqlens", dict(sn=0, int_seqlens=True)),
    ("no_append_full_cache", dict(sn=0, seqlens_none=True)),
    ("append1_gqa_causal", dict(sn=1, sq=1, h=4, hk=2, causal=True)),
    ("append3_rotary_interleaved_causal", dict(sn=3, sq=3, rotary="interleaved", causal=True)),
    ("append2_rotary_neox_partial_noncausal", dict(sn=2, sq=2, rotary="neox", rotary_dim=32, d=64)),
    ("append_rotary_interleaved_partial_local", dict(sn=4, sq=4, rotary="interleaved", rotary_dim=16, window=(5, 0), d=48)),
    ("append_rotary_neox_full_noncausal_sq1", dict(sn=1, sq=1, rotary="neox", d=64, dtype=BF16)),
    ("cache_batch_idx", dict(sn=2, sq=2, batch_idx=True, causal=True)),
    ("cache_leftpad_rotary", dict(sn=2, sq=2, leftpad=True, rotary="interleaved", causal=True)),
    ("cache_leftpad_no_append_alibi", dict(sn=0, sq=3, leftpad=True, alibi="bh", causal=True)),
    ("paged16_rotary", dict(sn=3, sq=3, page=16, rotary="neox", causal=True, dtype=FP32)),
    ("paged256_append", dict(sn=2, sq=1, page=256, cap=512, h=6, hk=2)),
    ("softcap_alibi_h", dict(sn=1, sq=1, softcap=3.0, alibi="h", dtype=BF16)),
    ("mqa_d256_fp32", dict(sn=1, sq=2, h=3, hk=1, d=256, dtype=FP32, causal=True)),
    ("sq_gt_new_causal_fp32", dict(sn=2, sq=5, causal=True, dtype=FP32)),
]


def _kvcache_setup(dtype=FP16, b=3, sq=1, h=2, hk=2, d=64, cap=40, sn=1, rotary=None, rotary_dim=None,
                   batch_idx=False, leftpad=False, page=None, causal=False, window=(-1, -1), softcap=0.0,
                   alibi=None, int_seqlens=False, seqlens_none=False, seed=51):
    g = gen(seed)
    rnd = random.Random(seed)
    cache_b = b + 2 if batch_idx else b
    if page is not None:
        pages_per_seq = -(-cap // page)
        cap = pages_per_seq * page
        num_blocks = b * pages_per_seq + 2
        k_cache = randn((num_blocks, page, hk, d), dtype, g)
        v_cache = randn((num_blocks, page, hk, d), dtype, g)
        perm = list(range(num_blocks))
        rnd.shuffle(perm)
        table = [perm[i * pages_per_seq:(i + 1) * pages_per_seq] for i in range(b)]
        block_table = torch.tensor(table, dtype=torch.int32, device=test_device())
    else:
        k_cache = randn((cache_b, cap, hk, d), dtype, g)
        v_cache = randn((cache_b, cap, hk, d), dtype, g)
        block_table = None
    q = randn((b, sq, h, d), dtype, g)
    k_new = randn((b, sn, hk, d), dtype, g) if sn else None
    v_new = randn((b, sn, hk, d), dtype, g) if sn else None
    if seqlens_none:
        seqlens = None
    elif int_seqlens:
        seqlens = cap - sn - 3
    else:
        seqlens = [rnd.randrange(0 if not leftpad else 4, cap - sn + 1) for _ in range(b)]
        seqlens[0] = cap - sn  # one sequence fills the cache exactly
    cache_seqlens = (seqlens if seqlens is None or isinstance(seqlens, int)
                     else torch.tensor(seqlens, dtype=torch.int32, device=test_device()))
    cache_batch_idx = None
    if batch_idx:
        idx = list(range(cache_b))
        rnd.shuffle(idx)
        cache_batch_idx = torch.tensor(idx[:b], dtype=torch.int32, device=test_device())
    cache_leftpad = None
    if leftpad:
        cache_leftpad = torch.tensor([rnd.randrange(0, s + 1) for s in seqlens], dtype=torch.int32, device=test_device())
    cos = sin = None
    if rotary:
        cos, sin = _rotary_tables(cap, rotary_dim or d, dtype)
    slopes = _slopes(alibi, b, h)
    kwargs = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                  cache_leftpad=cache_leftpad, block_table=block_table, causal=causal, window_size=window,
                  softcap=softcap, rotary_interleaved=(rotary != "neox"), alibi_slopes=slopes)
    return q, k_cache, v_cache, k_new, v_new, kwargs


def _kvcache_oracles(q, k_cache, v_cache, k_new, v_new, kw):
    okw = dict(kw)
    okw["window"] = okw.pop("window_size")
    ref = kvcache_ref(q, k_cache, v_cache, k_new, v_new, **okw)
    naive = kvcache_ref(q, k_cache, v_cache, k_new, v_new, compute_dtype=None, **okw)
    return ref, naive


@pytest.mark.parametrize("name,over", KVCACHE_CASES, ids=[c[0] for c in KVCACHE_CASES])
def test_kvcache_vs_oracle(name, over):
    q, k_cache, v_cache, k_new, v_new, kw = _kvcache_setup(**over)
    dtype = q.dtype
    k_orig, v_orig = k_cache.clone(), v_cache.clone()
    ref, naive = _kvcache_oracles(q, k_orig, v_orig, k_new, v_new, kw)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, return_softmax_lse=True, **kw)
    assert tuple(out.shape) == tuple(q.shape) and out.dtype == dtype
    assert tuple(lse.shape) == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "softmax_lse")
    # the cache is mutated exactly at the appended rows and nowhere else
    written = ref.written.cpu()
    assert int(written.sum()) == (0 if k_new is None else k_new.shape[0] * k_new.shape[1])
    kc, vc, ko, vo = (t.cpu() for t in (k_cache, v_cache, k_orig, v_orig))
    assert torch.equal(kc[~written], ko[~written]), "k_cache changed outside the appended rows"
    assert torch.equal(vc[~written], vo[~written]), "v_cache changed outside the appended rows"
    if k_new is not None:
        assert torch.equal(vc[written], ref.v_cache.cpu()[written].to(dtype)), "appended v rows differ from v"
        expected_k = ref.k_cache.cpu()[written]
        if kw["rotary_cos"] is None:
            assert torch.equal(kc[written], expected_k.to(dtype)), "appended k rows differ from k"
        else:
            check_close(kc[written], expected_k, expected_k.to(dtype), dtype, "rotated k in cache")


def _attended(k_cache, kw, batch: int, appended: int) -> torch.Tensor:
    """bool over the cache's rows (``(cache batch, row)``, or ``(page, row)`` when paged): the
    rows some batch entry attends, ``[cache_leftpad[b], cache_seqlens[b] + appended)``."""
    seqlens, leftpad = kw["cache_seqlens"], kw["cache_leftpad"]
    ends = [int(n) + appended for n in (seqlens.tolist() if isinstance(seqlens, torch.Tensor) else [seqlens] * batch)]
    starts = [0] * batch if leftpad is None else leftpad.tolist()
    attended = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, (start, end) in enumerate(zip(starts, ends)):
        if kw["block_table"] is not None:
            page = k_cache.shape[1]
            for row in range(start, end):
                attended[int(kw["block_table"][b, row // page]), row % page] = True
        else:
            attended[b if kw["cache_batch_idx"] is None else int(kw["cache_batch_idx"][b]), start:end] = True
    return attended


@pytest.mark.parametrize("name,over", [c for c in KVCACHE_CASES if not c[1].get("seqlens_none")],
                         ids=[c[0] for c in KVCACHE_CASES if not c[1].get("seqlens_none")])
def test_kvcache_reads_no_row_it_does_not_attend(name, over, monkeypatch):
    """The cache rows a call does not attend (past a sequence's end, before its left padding, other
    cache entries and pages) may hold anything, as in a cache made by ``torch.empty``: with NaN
    there, every backend here gives the oracle's answer over the finite cache."""
    q, k_cache, v_cache, k_new, v_new, kw = _kvcache_setup(**over)
    ref, naive = _kvcache_oracles(q, k_cache.clone(), v_cache.clone(), k_new, v_new, kw)
    unattended = ~_attended(k_cache, kw, q.shape[0], 0 if k_new is None else k_new.shape[1]).to(k_cache.device)
    assert unattended.any()
    monkeypatch.setenv("FLASH_ATTN_STRICT_BACKEND", "1")
    ran = []
    for backend in backends_here():
        if backend == "interpret" and q.dtype == BF16:
            continue  # Triton's interpreter computes bf16 arithmetic wrongly (its fp16 and fp32 run)
        monkeypatch.setenv("FLASH_ATTN_BACKEND", backend)
        kc, vc = k_cache.clone(), v_cache.clone()
        kc[unattended], vc[unattended] = float("nan"), float("nan")
        try:
            out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, return_softmax_lse=True, **kw)
        except dispatch.BackendRefusedError as exc:
            if "inputs (the kernels take fp16/bf16)" in str(exc) or "not compiled ahead of time" in str(exc):
                continue
            raise
        ran.append(backend)
        check_close(out, ref.out, naive.out, q.dtype, f"{backend} out")
        check_close(lse, ref.lse, naive.lse, FP32, f"{backend} softmax_lse")
    assert ran


def _misaligned_like(t):
    """``t``'s values in a view whose data starts one element past an allocation's start (the same
    shape, strides and dtype: the same call signature, another pointer alignment)."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t)
    return view


def test_repeated_calls_of_one_signature_match_the_oracle(monkeypatch):
    """A signature's later calls run its held plan, from the third on its lane
    (:func:`flash_attn.dispatch.run_lane`): each round new values of the same signature (a no-grad
    dense forward, and a decode step appending to its cache), one round with q misaligned (which no
    lane takes), against the oracle every time: on the kernel backends here whose lanes run
    without a JIT (``aot`` on a GPU, ``interpret`` on the CPU; triton's compiles would cost a GPU
    window more than the rest of this file), and the others (``cpu``, ``reference``: no lanes)."""
    monkeypatch.setenv("FLASH_ATTN_STRICT_BACKEND", "1")
    ran = []
    backends = [b for b in backends_here() if b != "triton"]
    if not {"aot", "interpret"} & set(backends):
        pytest.skip(f"no kernel backend with lanes runs here without a JIT (backends here: {backends_here()})")
    for backend in backends:
        monkeypatch.setenv("FLASH_ATTN_BACKEND", backend)
        for n in range(5):
            g = gen(60 + n)
            q, k, v = randn((2, 33, 4, 32), FP16, g), randn((2, 33, 2, 32), FP16, g), randn((2, 33, 2, 32), FP16, g)
            step = _kvcache_setup(dtype=FP16, b=2, sq=1, h=4, hk=2, d=32, cap=48, sn=1, causal=True, seed=70 + n)
            ref, _, naive, _ = oracle_pair(attention_ref, [q, k, v], causal=True)
            step_ref, step_naive = _kvcache_oracles(step[0], step[1].clone(), step[2].clone(), step[3], step[4], step[5])
            if n == 3:
                q, step = _misaligned_like(q), (_misaligned_like(step[0]), *step[1:])
            try:
                out = flash_attn_func(q, k, v, causal=True)
                step_out = flash_attn_with_kvcache(*step[:5], **step[5])
            except dispatch.BackendRefusedError as exc:
                if "inputs (the kernels take fp16/bf16)" in str(exc) or "not compiled ahead of time" in str(exc):
                    break
                raise
            check_close(out, ref.out, naive.out, FP16, f"{backend} out, round {n}")
            check_close(step_out, step_ref.out, step_naive.out, FP16, f"{backend} decode out, round {n}")
        else:
            ran.append(backend)
    assert {"aot", "interpret"} & set(ran)


def test_kvcache_num_splits_never_changes_the_result():
    results = []
    for splits in (0, 1, 3):
        q, k_cache, v_cache, k_new, v_new, kw = _kvcache_setup(dtype=FP16, b=2, sq=1, cap=300, sn=1, causal=True, seed=52)
        if not results:
            ref, naive = _kvcache_oracles(q, k_cache.clone(), v_cache.clone(), k_new, v_new, kw)
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, num_splits=splits,
                                           return_softmax_lse=True, **kw)
        check_close(out, ref.out, naive.out, FP16, f"out(num_splits={splits})")
        check_close(lse, ref.lse, naive.lse, FP32, f"lse(num_splits={splits})")
        results.append((out, lse, k_cache, v_cache))
    for out, lse, kc, vc in results[1:]:
        check_close(out, results[0][0], naive.out, FP16, "out vs num_splits=0")
        assert torch.equal(kc, results[0][2]) and torch.equal(vc, results[0][3])


def test_kvcache_without_lse_returns_only_out():
    q, k_cache, v_cache, k_new, v_new, kw = _kvcache_setup(sn=1, seed=53)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(q.shape)


def test_kvcache_empty_cache_rows_without_keys():
    """cache_seqlens 0 and no new keys: every row sees nothing -> out 0, lse +inf."""
    g = gen(54)
    q = randn((2, 3, 2, 32), FP32, g)
    kc = randn((2, 10, 2, 32), FP32, g)
    vc = randn((2, 10, 2, 32), FP32, g)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=0, return_softmax_lse=True)
    assert (out == 0).all() and torch.isposinf(lse).all()


def test_kvcache_matches_flash_attn_func_on_the_updated_cache():
    """Oracle-free cross-check: kvcache == flash_attn_func over the cache rows it attends."""
    q, k_cache, v_cache, k_new, v_new, kw = _kvcache_setup(dtype=FP32, b=2, sq=2, sn=2, causal=True, seed=55)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)
    for b, n in enumerate(kw["cache_seqlens"].tolist()):
        dense = flash_attn_func(q[b:b + 1], k_cache[b:b + 1, : n + 2], v_cache[b:b + 1, : n + 2], causal=True)
        torch.testing.assert_close(out[b:b + 1], dense, atol=1e-5, rtol=1e-5)


def test_kvcache_strided_cache_is_updated_in_place():
    """A cache that is a view (heads sliced out of a bigger buffer) is written through the view:
    the caller's storage must see the appended rows."""
    g = gen(56)
    storage_k = randn((2, 16, 4, 32), FP16, g)
    storage_v = randn((2, 16, 4, 32), FP16, g)
    k_cache, v_cache = storage_k[:, :, 1:3], storage_v[:, :, 2:]
    assert not k_cache.is_contiguous()
    before_k, before_v = storage_k.clone(), storage_v.clone()
    q = randn((2, 2, 4, 32), FP16, g)
    k_new, v_new = randn((2, 2, 2, 32), FP16, g), randn((2, 2, 2, 32), FP16, g)
    seqlens = torch.tensor([3, 14], dtype=torch.int32, device=q.device)
    ref, naive = _kvcache_oracles(q, k_cache.clone(), v_cache.clone(), k_new, v_new,
                                  dict(cache_seqlens=seqlens, causal=True, window_size=(-1, -1)))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)
    check_close(out, ref.out, naive.out, FP16, "out")
    expect_k, expect_v = before_k.clone(), before_v.clone()
    for b, n in enumerate([3, 14]):
        expect_k[b, n:n + 2, 1:3] = k_new[b]
        expect_v[b, n:n + 2, 2:] = v_new[b]
    assert torch.equal(storage_k, expect_k) and torch.equal(storage_v, expect_v)


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32])
def test_large_scores_do_not_overflow(dtype):
    """Scores far beyond exp()'s range (|s| ~ 1000) must be handled by max subtraction."""
    g = gen(57)
    q = randn((1, 64, 2, 64), dtype, g, scale=4.0, requires_grad=True)
    k = randn((1, 80, 2, 64), dtype, g, scale=4.0, requires_grad=True)
    v = randn((1, 80, 2, 64), dtype, g, requires_grad=True)
    dout = randn((1, 64, 2, 64), dtype, g)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=2.0, causal=True, return_attn_probs=True)
    out.backward(dout)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, softmax_scale=2.0, causal=True)
    assert ref.lse.abs().max() > 200
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "lse")
    _check_grads([q, k, v], rg, ng, dtype, ["dq", "dk", "dv"], dout, ref, 2.0)
