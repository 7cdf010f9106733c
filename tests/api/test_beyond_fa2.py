"""Beyond flash-attn 2.8: head dims up to 512, v's own head dim, attention sinks and MLA's ``qv``,
through the public functions, against the float64 oracle (``tests/support/oracle.py``, which states
each of them independently: a sink is one more, always visible, key column with value 0; ``qv``
adds ``qv . v`` to the scores).

Forward (out, lse) and every gradient (q, k, v, qv, the sinks) on the backend of this run
(``--flash-backend``; the cpu backend on the CPU) and on the ``reference`` backend, with the
features they combine with: masks, softcap, ALiBi, dropout, GQA, varlen (empty sequences), paged
K/V, the KV cache (append, rotary, pages, left padding); hypothesis over shapes; and the argument
checks. The kernels' side of the same features: ``tests/kernels``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

from support.inputs import cu_from_lens, gen, make_slopes, randn
from support.options import backend_name, test_device
from support.oracle import attention_ref, attention_varlen_ref, kvcache_ref, oracle_pair
from support.tolerance import backward_floor, check_close

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


@pytest.fixture(params=["this run's", "reference"])
def backend(request, monkeypatch):
    """The run's backend and the exact PyTorch reference (where the run's is another)."""
    if request.param == "reference":
        if backend_name() == "reference":
            pytest.skip("the run's backend is the reference")
        monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    return request.param


def _sinks(h: int, seed: int, requires_grad: bool = True) -> torch.Tensor:
    """fp32 sinks of either sign around the scores' scale (some rows dominated by them)."""
    s = 2.0 * torch.randn(h, generator=gen(seed + 7), dtype=FP32)
    return s.to(test_device()).requires_grad_(requires_grad)


def _oracle(fn, with_qv: bool, with_sinks: bool):
    """``fn`` taking q, k, v and then qv and sinks positionally, where present (for oracle_pair)."""

    def call(q, k, v, *extra, **kwargs):
        return fn(q, k, v, qv=extra[0] if with_qv else None, sinks=extra[-1] if with_sinks else None, **kwargs)

    return call


def _check(out, lse, tensors, dout, ref, rg, naive, ng, dtype, names, grads=True):
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32 if dtype == FP32 else dtype, "lse")
    if not grads:
        return
    out.backward(dout)
    qv = tensors[names.index("qv")] if "qv" in names else None
    floor = backward_floor(tensors[0], tensors[1], tensors[2], dout, None, ref.probs, qv=qv)
    for t, r, n, name in zip(tensors, rg, ng, names):
        assert t.grad is not None, f"no gradient for {name}"
        check_close(t.grad, r, n, dtype, f"d{name}", grad=True, floor=floor)


DENSE_CASES = [
    # (dtype, d, dv, h, hk, sq, sk, mask, qv, sinks, features)
    (FP32, 192, 128, 4, 2, 37, 45, "causal", False, True, {}),
    (BF16, 128, 64, 4, 1, 33, 20, "full", False, True, {"softcap": 5.0}),
    (FP16, 256, 128, 2, 2, 40, 40, "local", False, False, {"alibi": "bh"}),
    (FP32, 64, 128, 4, 4, 17, 64, "full", True, True, {}),
    (FP32, 32, 48, 2, 1, 30, 18, "causal", True, False, {"softcap": 2.0}),
    (FP16, 64, 64, 6, 2, 50, 20, "causal", False, True, {}),  # rows without keys: lse = sink
    (FP32, 512, 512, 2, 1, 24, 31, "causal", False, True, {"dropout_p": 0.2}),
    (BF16, 448, 320, 2, 2, 20, 21, "full", True, True, {}),
    (FP32, 64, 512, 4, 1, 9, 40, "full", True, True, {}),  # MLA's 64 + 512
]
MASKS = {"full": (False, (-1, -1)), "causal": (True, (-1, -1)), "local": (False, (9, 3))}


def _case_id(c):
    dtype, d, dv, h, hk, sq, sk, mask, qv, sinks, feats = c
    return "-".join([str(dtype).split(".")[-1], f"d{d}v{dv}", f"h{h}-{hk}", f"{sq}x{sk}", mask]
                    + (["qv"] if qv else []) + (["sinks"] if sinks else []) + sorted(feats))


@pytest.mark.parametrize("case", DENSE_CASES, ids=_case_id)
def test_dense_matches_oracle(case, backend):
    dtype, d, dv, h, hk, sq, sk, mask, with_qv, with_sinks, feats = case
    seed = 3
    g = gen(seed)
    q = randn((2, sq, h, d), dtype, g, requires_grad=True)
    k = randn((2, sk, hk, d), dtype, g, requires_grad=True)
    v = randn((2, sk, hk, dv), dtype, g, requires_grad=True)
    qv = randn((2, sq, h, dv), dtype, g, requires_grad=True) if with_qv else None
    sinks = _sinks(h, seed) if with_sinks else None
    causal, window = MASKS[mask]
    slopes = make_slopes((2, h), seed) if feats.get("alibi") else None
    dropout_p = feats.get("dropout_p", 0.0)
    torch.manual_seed(11)
    out, lse, probs = flash_attn_func(q, k, v, dropout_p, causal=causal, window_size=window,
                                      softcap=feats.get("softcap", 0.0), alibi_slopes=slopes,
                                      return_attn_probs=True, qv=qv, learnable_sink=sinks)
    assert out.shape == (2, sq, h, dv)
    kwargs = dict(causal=causal, window=window, softcap=feats.get("softcap", 0.0), alibi_slopes=slopes)
    if dropout_p:
        # the dropped entries, from the signs of the returned probabilities (the mask the backend drew)
        kwargs.update(keep=probs >= 0, dropout_p=dropout_p)
    tensors = [t for t in (q, k, v, qv, sinks) if t is not None]
    names = [n for n, t in zip(("q", "k", "v", "qv", "sinks"), (q, k, v, qv, sinks)) if t is not None]
    dout = randn(tuple(out.shape), dtype, g)
    ref, rg, naive, ng = oracle_pair(_oracle(attention_ref, with_qv, with_sinks), tensors, dout, **kwargs)
    _check(out, lse, tensors, dout, ref, rg, naive, ng, dtype, names)


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("with_qv", [False, True], ids=["", "qv"])
def test_varlen_matches_oracle(paged, with_qv, backend):
    """Sequences of other lengths (empty ones included) with sinks, v's own head dim, qv; paged K/V
    (the backward of pages runs on the reference, any backend)."""
    dtype, h, hk, d, dv = FP32, 4, 2, 96, 64
    lens_q, lens_k = [5, 0, 33, 17], [9, 4, 0, 40]
    g = gen(5)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    q = randn((sum(lens_q), h, d), dtype, g, requires_grad=True)
    qv = randn((sum(lens_q), h, dv), dtype, g, requires_grad=True) if with_qv else None
    sinks = _sinks(h, 5)
    extra, block_table = {}, None
    if paged:
        page = 16
        need = [max(1, -(-n // page)) for n in lens_k]
        order = torch.randperm(sum(need) + 2, generator=g).tolist()
        table, used = [], 0
        for n in need:
            table.append(order[used:used + n] + [0] * (max(need) - n))
            used += n
        k = randn((sum(need) + 2, page, hk, d), dtype, g, requires_grad=True)
        v = randn((sum(need) + 2, page, hk, dv), dtype, g, requires_grad=True)
        block_table = torch.tensor(table, dtype=torch.int32, device=test_device())
        extra["block_table"] = table
    else:
        k = randn((sum(lens_k), hk, d), dtype, g, requires_grad=True)
        v = randn((sum(lens_k), hk, dv), dtype, g, requires_grad=True)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                         return_attn_probs=True, block_table=block_table, qv=qv,
                                         learnable_sink=sinks)
    tensors = [t for t in (q, k, v, qv, sinks) if t is not None]
    names = [n for n, t in zip(("q", "k", "v", "qv", "sinks"), (q, k, v, qv, sinks)) if t is not None]
    dout = randn(tuple(out.shape), dtype, g)
    ref, rg, naive, ng = oracle_pair(_oracle(attention_varlen_ref, with_qv, True), tensors, dout, causal=True,
                                     cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), **extra)
    _check(out, lse, tensors, dout, ref, rg, naive, ng, dtype, names)


def test_packed_functions_take_sinks(backend):
    """``learnable_sink`` through the qkv- and kv-packed functions (their gradients into the pack)."""
    g = gen(9)
    qkv = randn((2, 20, 3, 4, 32), FP32, g, requires_grad=True)
    sinks = _sinks(4, 9)
    out = flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=sinks)
    q, k, v = qkv.detach().unbind(2)
    ref = attention_ref(q, k, v, causal=True, sinks=sinks.detach())
    torch.testing.assert_close(out.double(), ref.out, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert qkv.grad is not None and sinks.grad is not None
    kv = qkv.detach()[:, :, 1:].clone().requires_grad_()
    out2 = flash_attn_kvpacked_func(q, kv, causal=True, learnable_sink=sinks.detach())
    torch.testing.assert_close(out2.double(), ref.out, atol=1e-5, rtol=1e-5)
    cu = cu_from_lens([20, 20])
    out3 = flash_attn_varlen_qkvpacked_func(qkv.detach().flatten(0, 1), cu, 20, causal=True,
                                            learnable_sink=sinks.detach())
    torch.testing.assert_close(out3.double(), ref.out.flatten(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["plain", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_matches_oracle(paged, num_splits, backend):
    """MLA decoding as FlashAttention-3 spells it (q 64 with qv 512 against a 64-wide k cache and a
    512-wide latent cache, one kv head for 16 query heads) with sinks and a new token appended with
    rotary; the split count changes nothing (the sink is counted once)."""
    dtype, b, h, hk, d, dv, cap = FP32, 2, 16, 1, 64, 512, 96
    g = gen(13)
    q = randn((b, 1, h, d), dtype, g)
    qv = randn((b, 1, h, dv), dtype, g)
    k_new, v_new = randn((b, 1, hk, d), dtype, g), randn((b, 1, hk, dv), dtype, g)
    seqlens = torch.tensor([30, 70], dtype=torch.int32, device=test_device())
    leftpad = torch.tensor([0, 9], dtype=torch.int32, device=test_device())
    cos, sin = (randn((cap, 16), dtype, g) for _ in range(2))
    sinks = _sinks(h, 13, requires_grad=False)
    if paged:
        page = 16
        k_cache, v_cache = randn((2 * cap // page, page, hk, d), dtype, g), randn((2 * cap // page, page, hk, dv), dtype, g)
        table = torch.arange(2 * cap // page, dtype=torch.int32, device=test_device()).flip(0).view(b, -1)
        extra = dict(block_table=table)
        leftpad = None
    else:
        k_cache, v_cache = randn((b, cap, hk, d), dtype, g), randn((b, cap, hk, dv), dtype, g)
        extra = dict(cache_leftpad=leftpad)
    ref = kvcache_ref(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                      causal=True, qv=qv, sinks=sinks, **extra)
    naive = kvcache_ref(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                        causal=True, qv=qv, sinks=sinks, compute_dtype=None, **extra)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, causal=True,
                                       num_splits=num_splits, return_softmax_lse=True, qv=qv, learnable_sink=sinks,
                                       **extra)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, dtype, "lse")
    written = ref.written
    assert torch.equal(v_cache.double()[written], ref.v_cache[written])


def test_rows_without_keys_have_the_sink_as_lse():
    """A row that sees no key: output 0 and lse the sink (the sink's share is the whole denominator);
    a sink of -inf is none (lse +inf, as without)."""
    q, k, v = (torch.randn(1, 6, 2, 16, generator=gen(1)) for _ in range(3))
    sinks = torch.tensor([0.5, float("-inf")])
    out, lse, _ = flash_attn_func(q, k[:, :2], v[:, :2], causal=True, return_attn_probs=True, learnable_sink=sinks)
    # bottom-right causal with 6 queries and 2 keys: rows 0-3 see nothing
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.equal(lse[0, 0, :4], torch.full((4,), 0.5))
    assert torch.equal(lse[0, 1, :4], torch.full((4,), float("inf")))
    out0, lse0, _ = flash_attn_func(q, k[:, :0], v[:, :0], return_attn_probs=True, learnable_sink=sinks)
    assert torch.equal(out0, torch.zeros_like(out0)) and torch.equal(lse0[0, 0], torch.full((6,), 0.5))


def test_a_sink_of_minus_infinity_is_no_sink():
    q, k, v = (torch.randn(2, 9, 3, 32, generator=gen(2)) for _ in range(3))
    plain = flash_attn_func(q, k, v, causal=True)
    none = flash_attn_func(q, k, v, causal=True, learnable_sink=torch.full((3,), float("-inf")))
    torch.testing.assert_close(none, plain)


def test_default_scale_counts_qv_features():
    """FlashAttention-3's default with qv: ``(headdim + headdim_v) ** -0.5``."""
    g = gen(4)
    q, k = randn((1, 5, 2, 16), FP32, g), randn((1, 7, 2, 16), FP32, g)
    v, qv = randn((1, 7, 2, 48), FP32, g), randn((1, 5, 2, 48), FP32, g)
    out = flash_attn_func(q, k, v, qv=qv)
    ref = attention_ref(q, k, v, qv=qv, softmax_scale=64 ** -0.5)
    torch.testing.assert_close(out.double(), ref.out, atol=1e-5, rtol=1e-5)


def test_sinks_change_the_output_and_their_gradient_is_returned_only_when_asked():
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen(6), requires_grad=True) for _ in range(3))
    sinks = torch.zeros(2)
    with_sink = flash_attn_func(q, k, v, learnable_sink=sinks)
    assert not torch.allclose(with_sink, flash_attn_func(q, k, v))
    with_sink.sum().backward()  # sinks.requires_grad is False: nothing to return for it
    assert sinks.grad is None and q.grad is not None


# ---------------------------------------------------------------------------------------------
# Hypothesis over shapes: q/k and v head dims drawn independently, sinks and qv at random.


@st.composite
def problems(draw):
    hk = draw(st.integers(1, 2))
    h = hk * draw(st.integers(1, 3))
    d = draw(st.sampled_from([8, 16, 24, 40, 64, 96, 128, 192, 256, 320, 512]))
    dv = draw(st.sampled_from([8, 16, 40, 64, 128, 192, 256, 512]))
    return dict(h=h, hk=hk, d=d, dv=dv, sq=draw(st.integers(1, 24)), sk=draw(st.integers(0, 24)),
                batch=draw(st.integers(1, 2)), causal=draw(st.booleans()), sinks=draw(st.booleans()),
                qv=draw(st.booleans()), softcap=draw(st.sampled_from([0.0, 0.0, 3.0])),
                dtype=draw(st.sampled_from([FP32, FP16, BF16])), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(p=problems())
def test_random_problems_match_oracle(p):
    g = gen(p["seed"])
    b, h, hk, d, dv, dtype = p["batch"], p["h"], p["hk"], p["d"], p["dv"], p["dtype"]
    q = randn((b, p["sq"], h, d), dtype, g, requires_grad=True)
    k = randn((b, p["sk"], hk, d), dtype, g, requires_grad=True)
    v = randn((b, p["sk"], hk, dv), dtype, g, requires_grad=True)
    qv = randn((b, p["sq"], h, dv), dtype, g, requires_grad=True) if p["qv"] else None
    sinks = _sinks(h, p["seed"]) if p["sinks"] else None
    out, lse, _ = flash_attn_func(q, k, v, causal=p["causal"], softcap=p["softcap"], return_attn_probs=True,
                                  qv=qv, learnable_sink=sinks)
    tensors = [t for t in (q, k, v, qv, sinks) if t is not None]
    names = [n for n, t in zip(("q", "k", "v", "qv", "sinks"), (q, k, v, qv, sinks)) if t is not None]
    dout = randn(tuple(out.shape), dtype, g)
    ref, rg, naive, ng = oracle_pair(_oracle(attention_ref, p["qv"], p["sinks"]), tensors, dout,
                                     causal=p["causal"], softcap=p["softcap"])
    _check(out, lse, tensors, dout, ref, rg, naive, ng, dtype, names, grads=p["sk"] > 0)


# ---------------------------------------------------------------------------------------------
# What validation accepts, and the messages of what it does not.


def _qkv(d=32, dv=32, h=4, hk=2):
    g = gen(0)
    return (torch.randn(1, 5, h, d, generator=g), torch.randn(1, 7, hk, d, generator=g),
            torch.randn(1, 7, hk, dv, generator=g))


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (256, 128), (8, 512), (512, 8), (512, 512), (576, 512)])
def test_head_dim_pairs(d, dv):
    """Any q/k head dim and any v head dim from 1 to 512: accepted; beyond, a clear error."""
    q, k, v = _qkv(d, dv)
    if d > 512:
        with pytest.raises(ValueError, match=r"headdim must be between 1 and 512, got 576"):
            flash_attn_func(q, k, v)
    else:
        assert flash_attn_func(q, k, v).shape == (1, 5, 4, dv)


def test_v_head_dim_above_512():
    q, k, v = _qkv(64, 520)
    with pytest.raises(ValueError, match=r"headdim_v \(v's head dim\) must be between 1 and 512, got 520"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("sinks,error,match", [
    (torch.zeros(4, dtype=torch.float16), TypeError, r"learnable_sink must be a float32 tensor of shape \(4,\)"),
    ([0.0] * 4, TypeError, r"learnable_sink must be a float32 tensor"),
    (torch.zeros(2), ValueError, r"learnable_sink must have shape \(4,\)"),
    (torch.zeros(1, 4), ValueError, r"learnable_sink must have shape \(4,\)"),
    (torch.zeros(4, device="meta"), ValueError, r"learnable_sink is on meta but q is on cpu"),
])
def test_bad_sinks(sinks, error, match):
    q, k, v = _qkv()
    for call in (lambda: flash_attn_func(q, k, v, learnable_sink=sinks),
                 lambda: flash_attn_with_kvcache(q, k, v, learnable_sink=sinks)):
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("shape,dtype,match", [
    ((1, 5, 4, 16), FP32, r"qv must have shape .* = \(1, 5, 4, 48\)"),
    ((1, 5, 2, 48), FP32, r"qv must have shape"),
    ((1, 5, 4, 48), FP16, r"qv has dtype torch.float16 but q has torch.float32"),
])
def test_bad_qv(shape, dtype, match):
    q, k, v = _qkv(32, 48)
    qv = torch.zeros(shape, dtype=dtype)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attn_func(q, k, v, qv=qv)


def test_kvcache_head_dims_and_new_rows():
    """The caches may have their own head dims; new k/v rows must match them."""
    g = gen(3)
    q = torch.randn(2, 1, 4, 64, generator=g)
    k_cache, v_cache = torch.randn(2, 10, 2, 64, generator=g), torch.randn(2, 10, 2, 32, generator=g)
    k_new, v_new = torch.randn(2, 1, 2, 64, generator=g), torch.randn(2, 1, 2, 64, generator=g)
    seqlens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k and v must have shapes \(2, 1, 2, 64\) and \(2, 1, 2, 32\)"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new[..., :32], cache_seqlens=seqlens)
    assert out.shape == (2, 1, 4, 32)


def test_dropout_with_sinks_keeps_the_forward_mask():
    """Dropout with sinks: the backward regenerates the forward's mask (the keep mask from the seed
    the forward drew), so the gradient matches the oracle given that mask."""
    g = gen(8)
    b, s, h, d = 1, 24, 2, 32
    q, k, v = (randn((b, s, h, d), FP32, g, requires_grad=True) for _ in range(3))
    sinks = _sinks(h, 8)
    torch.manual_seed(5)
    out, lse, probs = flash_attn_func(q, k, v, 0.3, causal=True, return_attn_probs=True, learnable_sink=sinks)
    keep = probs >= 0
    dout = randn(tuple(out.shape), FP32, g)
    tensors = [q, k, v, sinks]
    ref, rg, naive, ng = oracle_pair(_oracle(attention_ref, False, True), tensors, dout, causal=True, keep=keep,
                                     dropout_p=0.3)
    _check(out, lse, tensors, dout, ref, rg, naive, ng, FP32, ["q", "k", "v", "sinks"])
