"""FlashAttention-3's interface (``fa3_interface/flash_attn_interface.py``) against the float64 oracle.

The module is loaded from the source tree (support/fa3.py). Its signatures are compared with
upstream FA3's, recorded from ``hopper/flash_attn_interface.py`` at 0251105a
(tests/data/upstream-surface-0251105a.json); its results with the oracle of ``support/oracle.py``,
forward and gradients, for the dense, varlen (packed and padded sides, ``seqused_*``), cache and
combine calls; what it refuses, with the argument named.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from support.fa3 import fa3_interface
from support.inputs import cu_from_lens, gen, randn
from support.oracle import attention_ref, attention_varlen_ref, kvcache_ref, oracle_pair
from support.options import test_device
from support.tolerance import backward_floor, check_close

F32, F16 = torch.float32, torch.float16
RECORD = Path(__file__).resolve().parents[1] / "data" / "upstream-surface-0251105a.json"


@pytest.fixture(scope="module")
def fa3():
    return fa3_interface()


def test_signatures_are_fa3s(fa3):
    """Every FA3 function, with FA3's parameters in FA3's order and FA3's defaults; the only
    addition is the keyword-only ``s_aux`` (FA3 forks' sinks) at the end."""
    recorded = json.loads(RECORD.read_text())["fa3_signatures"]
    assert set(recorded) <= set(fa3.__all__)
    for name, params in recorded.items():
        ours = inspect.signature(getattr(fa3, name)).parameters
        positional = [(p.name, None if p.default is inspect.Parameter.empty else repr(p.default))
                      for p in ours.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        want = [(n, d) for n, kind, d in params if kind == "positional"]
        assert [n for n, _ in positional] == [n for n, _ in want], name
        for (n, got), (_, expected) in zip(positional, want):
            assert got == expected or eval(expected, {"torch": torch}) == eval(got, {"torch": torch}), (name, n, got, expected)
        extra = [p.name for p in ours.values() if p.kind is p.KEYWORD_ONLY]
        assert extra in ([], ["s_aux"]), (name, extra)


@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", ["causal_gqa", "window_softcap", "qv_sinks", "dv_differs"])
def test_func_against_the_oracle(fa3, dtype, case):
    b, sq, sk, h, hk, d, dv = 2, 9, 13, 4, 2, 32, 32
    kw, causal, window, softcap, scale = {}, False, (-1, -1), 0.0, None
    if case == "causal_gqa":
        causal = True
    elif case == "window_softcap":
        window, softcap, scale = (5, 2), 3.0, 0.3
    elif case == "dv_differs":
        dv = 16
    g = gen(11)
    q, k, v = randn((b, sq, h, d), dtype, g), randn((b, sk, hk, d), dtype, g), randn((b, sk, hk, dv), dtype, g)
    tensors = [q, k, v]
    sinks = qv = None
    if case == "qv_sinks":
        qv = randn((b, sq, h, dv), dtype, g)
        sinks = randn((h,), F32, g)
        tensors += [qv, sinks]
    dout = randn((b, sq, h, dv), dtype, g)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    lq, lk, lv, *rest = leaves
    out, lse = fa3.flash_attn_func(lq, lk, lv, scale, causal, rest[0] if rest else None, window_size=window,
                                   softcap=softcap, return_attn_probs=True, s_aux=rest[1] if rest else None)
    assert lse.shape == (b, h, sq) and lse.dtype == F32
    grads = torch.autograd.grad(out, leaves, dout)

    def oracle(q, k, v, qv=None, sinks=None, compute_dtype=None):
        return attention_ref(q, k, v, softmax_scale=scale, causal=causal, window=window, softcap=softcap,
                             qv=qv, sinks=sinks, compute_dtype=compute_dtype)

    ref, ref_grads, naive, naive_grads = oracle_pair(oracle, tensors, dout)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, dtype, "lse")
    floor = backward_floor(q, k, v, dout, scale)
    for name, got, want, rough in zip("q k v qv sinks".split(), grads, ref_grads, naive_grads):
        check_close(got, want, rough, dtype, f"d{name}", grad=True, floor=floor)
    # the plain call returns out alone, equal to the tuple's
    assert torch.equal(fa3.flash_attn_func(q, k, v, scale, causal, qv, window_size=window, softcap=softcap,
                                           s_aux=sinks), out.detach())


def test_qkvpacked_with_num_heads_q(fa3):
    """FA3's GQA packing: ``(batch, seqlen, num_heads_q + 2 * nheads_k, headdim)``."""
    g = gen(3)
    qkv = randn((2, 7, 6 + 2 * 2, 16), F32, g)
    got = fa3.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=6)
    q, k, v = qkv.split([6, 2, 2], dim=2)
    ref = attention_ref(q, k, v, causal=True)
    naive = attention_ref(q, k, v, causal=True, compute_dtype=None)
    check_close(got, ref.out, naive.out, F32, "out")
    stacked = torch.stack([q[:, :, :2], k, v], dim=2)
    assert torch.equal(fa3.flash_attn_qkvpacked_func(stacked), fa3.flash_attn_func(*stacked.unbind(2)))


@pytest.mark.parametrize("layout", ["packed", "padded_q_packed_k", "padded_both"])
def test_varlen_seqused_against_the_oracle(fa3, layout):
    """``seqused_q``/``seqused_k`` keep the first rows of each slot: the oracle sees only those rows;
    the rows past ``seqused_q`` get 0, logsumexp +inf and no gradient."""
    dtype, h, hk, d = F32, 4, 2, 16
    slots_q, slots_k = [5, 3, 6], [7, 4, 8]
    used_q, used_k = [4, 0, 6], [5, 4, 2]
    g = gen(5)
    if layout == "packed":
        q = randn((sum(slots_q), h, d), dtype, g)
        k, v = randn((sum(slots_k), hk, d), dtype, g), randn((sum(slots_k), hk, d), dtype, g)
        cu_q, cu_k = cu_from_lens(slots_q), cu_from_lens(slots_k)
        starts_q, starts_k = cu_q.tolist()[:-1], cu_k.tolist()[:-1]
        flat_q, flat_k = q, k
    else:
        q = randn((3, max(slots_q), h, d), dtype, g)
        cu_q, starts_q = None, [i * max(slots_q) for i in range(3)]
        if layout == "padded_both":
            k, v = randn((3, max(slots_k), hk, d), dtype, g), randn((3, max(slots_k), hk, d), dtype, g)
            cu_k, starts_k = None, [i * max(slots_k) for i in range(3)]
        else:
            k, v = randn((sum(slots_k), hk, d), dtype, g), randn((sum(slots_k), hk, d), dtype, g)
            cu_k = cu_from_lens(slots_k)
            starts_k = cu_k.tolist()[:-1]
    sinks = randn((h,), F32, g)
    seqused_q = torch.tensor(used_q, dtype=torch.int32, device=test_device())
    seqused_k = torch.tensor(used_k, dtype=torch.int32, device=test_device())
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa3.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(slots_q), max(slots_k), seqused_q, seqused_k,
                                          causal=True, return_attn_probs=True, s_aux=sinks)
    dout = randn(out.shape, dtype, g)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    flat = lambda t: t if t.dim() == 3 else t.flatten(0, 1)  # noqa: E731
    rows_q = torch.tensor([s + i for s, n in zip(starts_q, used_q) for i in range(n)], dtype=torch.long)
    rows_k = torch.tensor([s + i for s, n in zip(starts_k, used_k) for i in range(n)], dtype=torch.long)
    qu, ku, vu = flat(q)[rows_q], flat(k)[rows_k], flat(v)[rows_k]
    douts = flat(dout)[rows_q]

    def oracle(q, k, v, compute_dtype=None):
        return attention_varlen_ref(q, k, v, cu_from_lens(used_q).tolist(), cu_from_lens(used_k).tolist(),
                                    causal=True, sinks=sinks, compute_dtype=compute_dtype)

    ref, ref_grads, naive, naive_grads = oracle_pair(oracle, [qu, ku, vu], douts)
    flat_out, flat_lse = flat(out), (lse if cu_q is not None else lse.transpose(0, 1).flatten(1, 2))
    check_close(flat_out[rows_q], ref.out, naive.out, dtype, "out")
    check_close(flat_lse[:, rows_q], ref.lse, naive.lse, dtype, "lse")
    unused_q = torch.ones(flat_out.shape[0], dtype=torch.bool)
    unused_q[rows_q] = False
    assert (flat_out[unused_q] == 0).all() and (flat_lse[:, unused_q] == float("inf")).all()
    assert (flat(dq)[unused_q] == 0).all()
    unused_k = torch.ones(flat(k).shape[0], dtype=torch.bool)
    unused_k[rows_k] = False
    assert (flat(dk)[unused_k] == 0).all() and (flat(dv)[unused_k] == 0).all()
    for name, got, rows, want, rough in (("q", dq, rows_q, ref_grads[0], naive_grads[0]),
                                         ("k", dk, rows_k, ref_grads[1], naive_grads[1]),
                                         ("v", dv, rows_k, ref_grads[2], naive_grads[2])):
        check_close(flat(got)[rows], want, rough, dtype, f"d{name}", grad=True)
    if layout != "packed":
        assert out.shape == (3, max(slots_q), h, d) and lse.shape == (3, h, max(slots_q))


def test_varlen_without_seqused_is_flash_attn_varlen(fa3):
    from flash_attn import flash_attn_varlen_func

    g = gen(9)
    q, k, v = randn((10, 2, 16), F32, g), randn((12, 2, 16), F32, g), randn((12, 2, 16), F32, g)
    cu_q, cu_k = cu_from_lens([4, 6]), cu_from_lens([5, 7])
    out = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 7, causal=True, window_size=(3, 0), softcap=2.0)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 7, causal=True, window_size=(3, 0),
                                                   softcap=2.0))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_against_the_oracle(fa3, paged):
    """New tokens appended in place, sinks, FA3's return tuple; ``page_table`` of page size 3."""
    dtype, b, h, hk, d, sn = F32, 2, 4, 2, 16, 2
    g = gen(21)
    q = randn((b, 3, h, d), dtype, g)
    k_new, v_new = randn((b, sn, hk, d), dtype, g), randn((b, sn, hk, d), dtype, g)
    sinks = randn((h,), F32, g)
    seqlens = torch.tensor([4, 7], dtype=torch.int32, device=test_device())
    if paged:
        k_cache, v_cache = randn((8, 3, hk, d), dtype, g), randn((8, 3, hk, d), dtype, g)
        page_table = torch.tensor([[5, 0, 2, 7], [1, 6, 3, 4]], dtype=torch.int32, device=test_device())
    else:
        k_cache, v_cache = randn((b, 12, hk, d), dtype, g), randn((b, 12, hk, d), dtype, g)
        page_table = None
    ref = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=page_table,
                      causal=True, sinks=sinks)
    naive = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=page_table,
                        causal=True, sinks=sinks, compute_dtype=None)
    metadata = fa3.get_scheduler_metadata(b, 3, 12, h, hk, d, seqlens, dtype, causal=True)
    result = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                         page_table=page_table, causal=True, scheduler_metadata=metadata,
                                         pack_gqa=True, return_softmax_lse=True, s_aux=sinks)
    assert isinstance(result, tuple) and len(result) == 4  # FA3's (out, lse, out_accum, lse_accum)
    out, lse = result[:2]
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, dtype, "lse")
    written = ref.written
    assert torch.equal(k_cache[written].double(), ref.k_cache[written])
    assert torch.equal(v_cache[written].double(), ref.v_cache[written])


def test_kvcache_mla_decode_with_qv(fa3):
    """MLA decoding as FA3 spells it (DeepSeek's is 64 + 512; here 64 + 256, head dim 512 being
    another change): q of the rope dims and qv of the latent dims against a 64-wide k cache and the
    latent cache as v."""
    g = gen(2)
    q, qv = randn((1, 1, 2, 64), F32, g), randn((1, 1, 2, 256), F32, g)
    k_cache, v_cache = randn((1, 6, 1, 64), F32, g), randn((1, 6, 1, 256), F32, g)
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, cache_seqlens=6)
    ref = kvcache_ref(q, k_cache, v_cache, cache_seqlens=6, qv=qv)
    naive = kvcache_ref(q, k_cache, v_cache, cache_seqlens=6, qv=qv, compute_dtype=None)
    check_close(out, ref.out, naive.out, F32, "out")


def test_combine_against_float64(fa3):
    """Splits' outputs and logsumexps merged, rows whose splits are all -inf included (upstream's
    test_flash_attn_combine: non-contiguous partials)."""
    g = gen(4)
    splits, b, s, h, d = 3, 2, 5, 4, 8
    out_partial = randn((splits * 2, b, h, s, d), F32, g).transpose(2, 3)[:splits]
    lse_partial = randn((splits, b, h * 2, s), F32, g).transpose(-1, -2)[:, :, :, :h]
    lse_partial[1:, 0] = float("-inf")
    lse_partial[:, 1, 0, 0] = float("-inf")
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=F16)
    p, lp = out_partial.double(), lse_partial.double()
    lse_ref = torch.logsumexp(lp, dim=0)
    weights = torch.nan_to_num(torch.exp(lp - lse_ref), nan=0.0)
    out_ref = (weights.unsqueeze(-1) * p).sum(0)
    assert out.dtype == F16 and out.shape == (b, s, h, d) and lse.shape == (b, s, h)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-3, atol=1e-3)
    assert lse[1, 0, 0] == float("-inf") and (out[1, 0, 0] == 0).all()
    into = torch.empty(b, s, h, d, device=out.device)
    assert fa3.flash_attn_combine(out_partial, lse_partial, out=into)[0] is into
    torch.testing.assert_close(into.double(), out_ref, rtol=1e-6, atol=1e-6)


def test_scheduler_hints_change_nothing(fa3):
    g = gen(8)
    q, k, v = randn((1, 6, 4, 16), F32, g), randn((1, 9, 2, 16), F32, g), randn((1, 9, 2, 16), F32, g)
    base = fa3.flash_attn_func(q, k, v, causal=True)
    for hints in ({"num_splits": 4}, {"pack_gqa": True}, {"pack_gqa": False}, {"sm_margin": 8}):
        assert torch.equal(fa3.flash_attn_func(q, k, v, causal=True, **hints), base), hints


@pytest.mark.parametrize("argument", ["q_descale", "k_descale", "v_descale", "attention_chunk"])
def test_fp8_descale_and_chunks_are_refused(fa3, argument):
    g = gen(1)
    q = randn((1, 4, 2, 16), F32, g)
    value = 128 if argument == "attention_chunk" else torch.ones(1, 2)
    calls = [lambda: fa3.flash_attn_func(q, q, q, **{argument: value}),
             lambda: fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu_from_lens([4]), cu_from_lens([4]), 4, 4,
                                                **{argument: value}),
             lambda: fa3.flash_attn_with_kvcache(q, q, q, cache_seqlens=4, **{argument: value})]
    for call in calls:
        with pytest.raises(NotImplementedError, match=argument):
            call()


@pytest.mark.parametrize("argument", ["cu_seqlens_k_new", "rotary_seqlens"])
def test_kvcache_arguments_it_cannot_take_are_refused(fa3, argument):
    g = gen(1)
    q = randn((1, 4, 2, 16), F32, g)
    with pytest.raises(NotImplementedError, match=argument):
        fa3.flash_attn_with_kvcache(q, q, q, cache_seqlens=4, **{argument: cu_from_lens([4])})


@pytest.mark.parametrize("new_tokens", ["none", "padded", "packed"])
def test_kvcache_with_packed_q_against_the_oracle(fa3, new_tokens):
    """FA3's ``cu_seqlens_q`` (speculative decoding, chunked prefill against a cache): each
    sequence's queries against its own cache row, new tokens appended first; one oracle call per
    sequence, with the cache as it was before the call."""
    dtype, h, hk, d = F32, 4, 2, 16
    lens_q, lens_new, seqlens = [2, 0, 3], [1, 2, 2], [3, 5, 1]
    g = gen(31)
    q = randn((sum(lens_q), h, d), dtype, g)
    k_cache, v_cache = randn((3, 10, hk, d), dtype, g), randn((3, 10, hk, d), dtype, g)
    before = (k_cache.clone(), v_cache.clone())
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=test_device())
    batch_idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=test_device())
    cu_q = cu_from_lens(lens_q)
    kw = {}
    if new_tokens == "padded":
        k_new, v_new = randn((3, 2, hk, d), dtype, g), randn((3, 2, hk, d), dtype, g)
        kw = dict(k=k_new, v=v_new)
        new_of = lambda b: (k_new[b:b + 1], v_new[b:b + 1])  # noqa: E731
    elif new_tokens == "packed":
        k_new, v_new = randn((sum(lens_new), hk, d), dtype, g), randn((sum(lens_new), hk, d), dtype, g)
        cu_new = cu_from_lens(lens_new)
        kw = dict(k=k_new, v=v_new, cu_seqlens_k_new=cu_new)
        new_of = lambda b: (k_new[cu_new[b]:cu_new[b + 1]].unsqueeze(0), v_new[cu_new[b]:cu_new[b + 1]].unsqueeze(0))  # noqa: E731
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx,
                                               cu_seqlens_q=cu_q, max_seqlen_q=3, causal=True, return_softmax_lse=True,
                                               **kw)
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    starts = cu_q.tolist()
    for b in range(3):
        # a sequence without queries still appends its new tokens (checked below)
        q_b = q[starts[b]:starts[b + 1]].unsqueeze(0) if lens_q[b] else randn((1, 1, h, d), dtype, g)
        args = dict(cache_seqlens=[seqlens[b]], cache_batch_idx=[int(batch_idx[b])], causal=True)
        k_b, v_b = new_of(b) if new_tokens != "none" else (None, None)
        ref = kvcache_ref(q_b, *before, k_b, v_b, **args)
        if k_b is not None:
            row = int(batch_idx[b])
            written = ref.written[row]
            assert written.any() and torch.equal(k_cache[row][written].double(), ref.k_cache[row][written])
            assert torch.equal(v_cache[row][written].double(), ref.v_cache[row][written])
        if lens_q[b] == 0:
            continue
        naive = kvcache_ref(q_b, *before, k_b, v_b, compute_dtype=None, **args)
        check_close(out[starts[b]:starts[b + 1]], ref.out[0], naive.out[0], dtype, f"out[{b}]")
        check_close(lse[:, starts[b]:starts[b + 1]], ref.lse[0], naive.lse[0], dtype, f"lse[{b}]")


def test_bad_seqused_and_s_aux_are_named(fa3):
    g = gen(1)
    q = randn((6, 2, 16), F32, g)
    cu = cu_from_lens([2, 4])
    with pytest.raises(ValueError, match="seqused_k"):
        fa3.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, seqused_k=torch.tensor([3, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="seqused_q"):
        fa3.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, seqused_q=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="s_aux"):
        fa3.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, s_aux=[0.0, 0.0])


@pytest.mark.parametrize("flag", ["causal", "deterministic"])
def test_flags_are_bools(fa3, flag):
    """A string for a flag is refused by name, not read by its truth value (flash_attn's check_flag)."""
    q = randn((1, 4, 2, 16), F32, gen(2))
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        fa3.flash_attn_func(q, q, q, **{flag: "yes"})
    cu = cu_from_lens([4])
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, **{flag: "no"})
