"""Bad arguments raise a clear exception whose message names the offending argument; degenerate
but valid inputs (empty batches / sequences) return well-shaped results and support backward."""

from __future__ import annotations

import re

import pytest
import torch

from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

from support.inputs import cu_from_lens, gen, randn
from support.options import test_device

FP16, FP32 = torch.float16, torch.float32


def qkv(b=2, sq=5, sk=7, h=4, hk=2, d=32, dtype=FP16, seed=0):
    g = gen(seed)
    return (randn((b, sq, h, d), dtype, g), randn((b, sk, hk, d), dtype, g), randn((b, sk, hk, d), dtype, g))


def varlen(lens_q=(3, 4), lens_k=(5, 2), h=4, hk=2, d=32, dtype=FP16):
    g = gen(1)
    q = randn((sum(lens_q), h, d), dtype, g)
    k = randn((sum(lens_k), hk, d), dtype, g)
    v = randn((sum(lens_k), hk, d), dtype, g)
    return q, k, v, cu_from_lens(lens_q), cu_from_lens(lens_k), max(lens_q), max(lens_k)


@pytest.fixture
def host_value_checks(monkeypatch):
    """Checks that read tensor contents (cu_seqlens, cache lengths, page tables) run on the host
    for CPU tensors always and for GPU tensors only with FLASH_ATTN_DEBUG=1: reading a GPU tensor
    waits for the device and breaks CUDA-graph capture (tests/integration/test_no_host_sync.py)."""
    monkeypatch.setenv("FLASH_ATTN_DEBUG", "1")


def raises(exc, *words):
    """pytest.raises whose message must contain every word (case-insensitive)."""
    pattern = "".join(f"(?=.*{re.escape(w)})" for w in words)
    return pytest.raises(exc, match=re.compile(pattern, re.IGNORECASE | re.DOTALL))


# ---------------------------------------------------------------------------------------------
# Shapes.


def test_wrong_rank_q():
    q, k, v = qkv()
    with raises(ValueError, "q", "dims"):
        flash_attn_func(q[0], k, v)


def test_wrong_rank_varlen_k():
    q, k, v, cq, ck, mq, mk = varlen()
    with raises(ValueError, "k", "(total_k, nheads_k, headdim)"):
        flash_attn_varlen_func(q, k.unsqueeze(0), v, cq, ck, mq, mk)


def test_wrong_rank_packed():
    q, k, v = qkv(h=2, hk=2, sk=5)
    with raises(ValueError, "qkv"):
        flash_attn_qkvpacked_func(torch.stack([q, k, v], 2)[0])
    with raises(ValueError, "qkv", "3"):  # dim 2 must be 3
        flash_attn_qkvpacked_func(torch.stack([q, k], 2))
    with raises(ValueError, "kv", "2"):
        flash_attn_kvpacked_func(q, torch.stack([k, v, v], 2))


def test_shape_mismatch_k_v():
    q, k, v = qkv()
    with raises(ValueError, "k and v"):
        flash_attn_func(q, k, v[:, :-1])


def test_shape_mismatch_batch_q_k():
    q, k, v = qkv()
    with raises(ValueError, "q and k", "batch"):
        flash_attn_func(q[:1], k, v)


def test_nheads_not_multiple_of_nheads_k():
    q, k, v = qkv(h=5, hk=2)
    with raises(ValueError, "nheads", "multiple"):
        flash_attn_func(q, k, v)


def test_headdim_q_differs_from_k():
    q, _, _ = qkv(d=32)
    _, k, v = qkv(d=40)
    with raises(ValueError, "headdim"):
        flash_attn_func(q, k, v)


def test_headdim_above_512():
    q, k, v = qkv(d=520, b=1, sq=2, sk=2)
    with raises(ValueError, "headdim", "512"):
        flash_attn_func(q, k, v)


# ---------------------------------------------------------------------------------------------
# dtypes, devices, layout.


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else torch.int8])
def test_unsupported_dtype(dtype):
    q, k, v = qkv()
    with raises(TypeError, "q", "float16"):
        flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype))


def test_qkv_dtypes_differ():
    q, k, v = qkv()
    with raises(TypeError, "k", "dtype"):
        flash_attn_func(q, k.to(torch.bfloat16), v)
    with raises(TypeError, "v", "dtype"):
        flash_attn_func(q, k, v.float())


def test_tensors_on_different_devices():
    q, k, v = qkv()
    with raises(ValueError, "k", "device"):
        flash_attn_func(q, k.to("meta"), v)
    with raises(ValueError, "v", "device"):
        flash_attn_func(q, k, v.to("meta"))


def test_last_dim_not_contiguous():
    g = gen(2)
    q = randn((2, 5, 4, 64), FP16, g)[..., ::2]
    _, k, v = qkv()
    assert q.stride(-1) != 1
    with raises(ValueError, "q", "contiguous"):
        flash_attn_func(q, k, v)
    with raises(ValueError, "k", "contiguous"):
        flash_attn_func(qkv()[0], randn((2, 7, 2, 64), FP16, g)[..., 1::2], v)


def test_other_strided_dims_are_accepted():
    g = gen(3)
    big = randn((2, 10, 8, 40), FP16, g)
    q = big[:, 2:7, ::2, 4:36]  # strided everywhere except the last dim
    _, k, v = qkv()
    out = flash_attn_func(q, k, v)
    assert tuple(out.shape) == (2, 5, 4, 32) and not torch.isnan(out).any()
    torch.testing.assert_close(out, flash_attn_func(q.contiguous(), k, v), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# cu_seqlens / max_seqlen / block_table.


def test_cu_seqlens_not_int32():
    q, k, v, cq, ck, mq, mk = varlen()
    with raises(TypeError, "cu_seqlens_q", "int32"):
        flash_attn_varlen_func(q, k, v, cq.long(), ck, mq, mk)
    with raises(TypeError, "cu_seqlens_k", "int32"):
        flash_attn_varlen_func(q, k, v, cq, ck.float(), mq, mk)
    with raises(TypeError, "cu_seqlens_q"):
        flash_attn_varlen_func(q, k, v, [0, 3, 7], ck, mq, mk)


def test_cu_seqlens_not_1d():
    q, k, v, cq, ck, mq, mk = varlen()
    with raises(ValueError, "cu_seqlens_q", "1-D"):
        flash_attn_varlen_func(q, k, v, cq.view(1, -1), ck.view(1, -1), mq, mk)


@pytest.mark.usefixtures("host_value_checks")
def test_cu_seqlens_decreasing():
    q, k, v, _, ck, mq, mk = varlen()
    cq = torch.tensor([0, 5, 7], dtype=torch.int32, device=q.device)
    flash_attn_varlen_func(q, k, v, cq, ck, 5, mk)  # valid
    bad = torch.tensor([0, 5, 3, 7], dtype=torch.int32, device=q.device)
    bad_k = torch.tensor([0, 2, 4, 7], dtype=torch.int32, device=q.device)
    with raises(ValueError, "cu_seqlens_q", "non-decreasing"):
        flash_attn_varlen_func(q, k, v, bad, bad_k, 7, 7)


@pytest.mark.usefixtures("host_value_checks")
def test_cu_seqlens_must_start_at_zero():
    q, k, v, _, ck, mq, mk = varlen()
    cq = torch.tensor([1, 3, 7], dtype=torch.int32, device=q.device)
    with raises(ValueError, "cu_seqlens_q"):
        flash_attn_varlen_func(q, k, v, cq, ck, 7, mk)


def test_cu_seqlens_q_and_k_lengths_differ():
    q, k, v, cq, _, mq, mk = varlen()
    ck = torch.tensor([0, 2, 5, 7], dtype=torch.int32, device=q.device)
    with raises(ValueError, "cu_seqlens_q", "cu_seqlens_k"):
        flash_attn_varlen_func(q, k, v, cq, ck, mq, mk)


@pytest.mark.usefixtures("host_value_checks")
def test_cu_seqlens_last_entry_not_total():
    q, k, v, cq, ck, mq, mk = varlen()
    with raises(ValueError, "cu_seqlens_q"):
        flash_attn_varlen_func(q, k, v, cu_from_lens([3, 3]), ck, mq, mk)
    with raises(ValueError, "cu_seqlens_k"):
        flash_attn_varlen_func(q, k, v, cq, cu_from_lens([5, 3]), mq, mk)


@pytest.mark.usefixtures("host_value_checks")
def test_max_seqlen_smaller_than_a_length():
    q, k, v, cq, ck, mq, mk = varlen()
    with raises(ValueError, "max_seqlen_q"):
        flash_attn_varlen_func(q, k, v, cq, ck, mq - 1, mk)
    with raises(ValueError, "max_seqlen_k"):
        flash_attn_varlen_func(q, k, v, cq, ck, mq, mk - 1)


def test_max_seqlen_not_an_int():
    q, k, v, cq, ck, mq, mk = varlen()
    with raises(ValueError, "max_seqlen_q"):
        flash_attn_varlen_func(q, k, v, cq, ck, -1, mk)


def test_varlen_packed_wrong_pack_dim():
    q, k, v, cq, ck, mq, mk = varlen(lens_q=(3, 4), lens_k=(3, 4), h=2, hk=2)
    with raises(ValueError, "qkv"):
        flash_attn_varlen_qkvpacked_func(torch.stack([q, k], 1), cq, mq)
    with raises(ValueError, "kv"):
        flash_attn_varlen_kvpacked_func(q, torch.stack([k, v, v], 1), cq, ck, mq, mk)


def _paged(page=16, lens_k=(20, 5), num_blocks=4):
    g = gen(4)
    q = randn((4, 2, 32), FP16, g)
    kp = randn((num_blocks, page, 2, 32), FP16, g)
    vp = randn((num_blocks, page, 2, 32), FP16, g)
    return q, kp, vp, cu_from_lens([2, 2]), cu_from_lens(lens_k)


@pytest.mark.usefixtures("host_value_checks")
def test_block_table_out_of_range():
    q, kp, vp, cq, ck = _paged()
    ok = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=q.device)
    flash_attn_varlen_func(q, kp, vp, cq, ck, 2, 20, block_table=ok)
    for bad_page in (4, -1):
        bad = torch.tensor([[0, bad_page], [2, 3]], dtype=torch.int32, device=q.device)
        with raises(IndexError, "block_table"):
            flash_attn_varlen_func(q, kp, vp, cq, ck, 2, 20, block_table=bad)


@pytest.mark.usefixtures("host_value_checks")
def test_block_table_too_few_pages_for_a_sequence():
    q, kp, vp, cq, ck = _paged(lens_k=(40, 5))
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=q.device)
    with raises(ValueError, "block_table"):
        flash_attn_varlen_func(q, kp, vp, cq, ck, 2, 40, block_table=bt)


def test_block_table_wrong_dtype_or_rows():
    q, kp, vp, cq, ck = _paged()
    with raises(TypeError, "block_table", "int32"):
        flash_attn_varlen_func(q, kp, vp, cq, ck, 2, 20, block_table=torch.tensor([[0, 1], [2, 3]], device=q.device))
    with raises(ValueError, "block_table"):
        flash_attn_varlen_func(q, kp, vp, cq, ck, 2, 20,
                               block_table=torch.tensor([[0, 1]], dtype=torch.int32, device=q.device))


# ---------------------------------------------------------------------------------------------
# KV cache.


def _cache(b=2, cap=8, sn=1, d=32, dtype=FP16):
    g = gen(5)
    q = randn((b, 1, 4, d), dtype, g)
    kc, vc = randn((b, cap, 2, d), dtype, g), randn((b, cap, 2, d), dtype, g)
    kn, vn = randn((b, sn, 2, d), dtype, g), randn((b, sn, 2, d), dtype, g)
    return q, kc, vc, kn, vn


@pytest.mark.usefixtures("host_value_checks")
def test_kv_cache_too_small_for_the_append():
    q, kc, vc, kn, vn = _cache(cap=8, sn=3)
    seqlens = torch.tensor([5, 6], dtype=torch.int32, device=q.device)
    kc0 = kc.clone()
    with raises(ValueError, "cache"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens)
    assert torch.equal(kc, kc0), "a rejected call must not write into the cache"
    flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([5, 4], dtype=torch.int32, device=q.device))


@pytest.mark.usefixtures("host_value_checks")
def test_kv_cache_seqlens_beyond_cache():
    q, kc, vc, _, _ = _cache(cap=8)
    with raises(ValueError, "cache"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=9)


def test_kv_cache_seqlens_wrong_dtype():
    q, kc, vc, kn, vn = _cache()
    with raises(TypeError, "cache_seqlens", "int32"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([1, 2], device=q.device))
    with raises(TypeError, "cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=1.5)


def test_kv_cache_append_needs_seqlens_and_both_k_v():
    q, kc, vc, kn, vn = _cache()
    with raises(ValueError, "cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn)
    with raises(ValueError, "k and v"):
        flash_attn_with_kvcache(q, kc, vc, kn, None, cache_seqlens=1)


@pytest.mark.usefixtures("host_value_checks")
def test_kv_cache_batch_idx_out_of_range():
    q, kc, vc, kn, vn = _cache()
    with raises(IndexError, "cache_batch_idx"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=1,
                                cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32, device=q.device))


@pytest.mark.usefixtures("host_value_checks")
def test_kv_cache_leftpad_beyond_seqlens():
    q, kc, vc, kn, vn = _cache()
    with raises(ValueError, "cache_leftpad"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=2,
                                cache_leftpad=torch.tensor([0, 3], dtype=torch.int32, device=q.device))


@pytest.mark.usefixtures("host_value_checks")
def test_kv_cache_rotary_errors():
    q, kc, vc, kn, vn = _cache(d=32)
    cos = torch.ones(8, 8, dtype=FP16, device=q.device)
    with raises(ValueError, "rotary_cos", "rotary_sin"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, cache_seqlens=1)
    with raises(ValueError, "rotary"):
        flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=cos, cache_seqlens=1)
    big = torch.ones(8, 20, dtype=FP16, device=q.device)
    with raises(ValueError, "rotary_dim", "headdim"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=big, rotary_sin=big, cache_seqlens=1)
    short = torch.ones(4, 8, dtype=FP16, device=q.device)
    with raises(ValueError, "rotary"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=short, rotary_sin=short, cache_seqlens=5)


def test_kv_cache_num_splits_negative():
    q, kc, vc, kn, vn = _cache()
    with raises(ValueError, "num_splits"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=1, num_splits=-1)


def test_kv_cache_shape_mismatch():
    q, kc, vc, kn, vn = _cache()
    with raises(ValueError, "k_cache", "v_cache"):
        flash_attn_with_kvcache(q, kc, vc[:, :-1], cache_seqlens=1)
    with raises(ValueError, "k and v"):
        flash_attn_with_kvcache(q, kc, vc, kn[:, :, :1], vn[:, :, :1], cache_seqlens=1)


# ---------------------------------------------------------------------------------------------
# Scalar options.


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_p_out_of_range(p):
    q, k, v = qkv()
    with raises(ValueError, "dropout_p"):
        flash_attn_func(q, k, v, dropout_p=p)


def test_negative_softcap():
    q, k, v = qkv()
    with raises(ValueError, "softcap"):
        flash_attn_func(q, k, v, softcap=-1.0)
    q1, kc, vc, _, _ = _cache()
    with raises(ValueError, "softcap"):
        flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=2, softcap=-0.5)


@pytest.mark.parametrize("window", [(-2, -1), (-1, -5), (3, -2)])
def test_window_size_below_minus_one(window):
    q, k, v = qkv()
    with raises(ValueError, "window_size"):
        flash_attn_func(q, k, v, window_size=window)


def test_window_size_not_a_pair():
    q, k, v = qkv()
    with raises(ValueError, "window_size"):
        flash_attn_func(q, k, v, window_size=(1, 2, 3))


def test_alibi_slopes_wrong_shape():
    q, k, v = qkv(b=2, h=4)
    for shape in [(3,), (2, 3), (1, 2, 4), (4, 2)]:
        with raises(ValueError, "alibi_slopes"):
            flash_attn_func(q, k, v, alibi_slopes=torch.rand(shape, device=q.device))


def test_alibi_slopes_wrong_dtype():
    q, k, v = qkv(b=2, h=4)
    for dtype in (torch.float16, torch.float64):
        with raises(TypeError, "alibi_slopes", "float32"):
            flash_attn_func(q, k, v, alibi_slopes=torch.rand(4, device=q.device).to(dtype))
    with raises(TypeError, "alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=[0.1, 0.2, 0.3, 0.4])


def test_alibi_slopes_wrong_device():
    q, k, v = qkv(b=2, h=4)
    with raises(ValueError, "alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.rand(4, device="meta"))


def test_softmax_scale_not_a_number():
    q, k, v = qkv()
    with raises(TypeError, "softmax_scale"):
        flash_attn_func(q, k, v, softmax_scale="0.1")


# ---------------------------------------------------------------------------------------------
# Backend selection.


def test_bogus_backend_name(monkeypatch):
    q, k, v = qkv()
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "warpdrive")
    with raises(ValueError, "FLASH_ATTN_BACKEND", "warpdrive"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("name", ["aot", "triton"])
def test_unavailable_backend_on_cpu(monkeypatch, name):
    if test_device().type != "cpu":
        pytest.skip("GPU backends may be available on this device")
    q, k, v = qkv()
    monkeypatch.setenv("FLASH_ATTN_BACKEND", name)
    with raises(RuntimeError, "FLASH_ATTN_BACKEND", name):
        flash_attn_func(q, k, v)
    # the same process recovers when the variable is fixed (read on every call)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    flash_attn_func(q, k, v)


# ---------------------------------------------------------------------------------------------
# Empty inputs: well-shaped outputs, lse +inf for rows without keys, working backward.


def _backward_ok(out, *leaves):
    out.backward(torch.ones_like(out))
    for t in leaves:
        assert t.grad is not None and t.grad.shape == t.shape and not torch.isnan(t.grad).any()


@pytest.mark.parametrize("b,sq,sk", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0)])
def test_empty_dense(b, sq, sk):
    g = gen(6)
    q = randn((b, sq, 4, 32), FP16, g, requires_grad=True)
    k = randn((b, sk, 2, 32), FP16, g, requires_grad=True)
    v = randn((b, sk, 2, 32), FP16, g, requires_grad=True)
    out, lse, s = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert tuple(out.shape) == (b, sq, 4, 32) and out.dtype == FP16
    assert tuple(lse.shape) == (b, 4, sq) and lse.dtype == FP32
    assert tuple(s.shape) == (b, 4, sq, sk)
    assert (out == 0).all() and torch.isposinf(lse).all()
    _backward_ok(out, q, k, v)
    assert (q.grad == 0).all() and (k.grad == 0).all() and (v.grad == 0).all()


def test_empty_dense_seqlen_k_zero_with_dropout_and_packed_kv():
    g = gen(7)
    q = randn((2, 3, 2, 16), FP32, g, requires_grad=True)
    kv = randn((2, 0, 2, 2, 16), FP32, g, requires_grad=True)
    out = flash_attn_kvpacked_func(q, kv, dropout_p=0.1)
    assert tuple(out.shape) == (2, 3, 2, 16) and (out == 0).all()
    _backward_ok(out, q, kv)


@pytest.mark.parametrize("lens_q,lens_k", [([0, 0], [0, 0]), ([0, 0], [3, 4]), ([2, 3], [0, 0]), ([], [])])
def test_empty_varlen(lens_q, lens_k):
    g = gen(8)
    q = randn((sum(lens_q), 4, 32), FP16, g, requires_grad=True)
    k = randn((sum(lens_k), 2, 32), FP16, g, requires_grad=True)
    v = randn((sum(lens_k), 2, 32), FP16, g, requires_grad=True)
    mq, mk = max(lens_q, default=0), max(lens_k, default=0)
    out, lse, s = flash_attn_varlen_func(q, k, v, cu_from_lens(lens_q), cu_from_lens(lens_k), mq, mk,
                                         causal=True, return_attn_probs=True)
    assert tuple(out.shape) == (sum(lens_q), 4, 32)
    assert tuple(lse.shape) == (4, sum(lens_q))
    assert tuple(s.shape) == (len(lens_q), 4, mq, mk)
    assert (out == 0).all() and torch.isposinf(lse).all()
    _backward_ok(out, q, k, v)


def test_empty_varlen_qkvpacked():
    qkv_ = torch.zeros((0, 3, 2, 64), dtype=torch.bfloat16, device=test_device(), requires_grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv_, cu_from_lens([0, 0, 0]), 0)
    assert tuple(out.shape) == (0, 2, 64)
    _backward_ok(out, qkv_)


def test_empty_kvcache_batch():
    g = gen(9)
    q = randn((0, 1, 4, 32), FP16, g)
    kc, vc = randn((0, 8, 2, 32), FP16, g), randn((0, 8, 2, 32), FP16, g)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, return_softmax_lse=True)
    assert tuple(out.shape) == (0, 1, 4, 32) and tuple(lse.shape) == (0, 4, 1)


def test_kvcache_empty_query_still_appends():
    """seqlen_q 0: empty output, but the new k/v are still written into the cache."""
    g = gen(10)
    q = randn((2, 0, 4, 32), FP16, g)
    kc, vc = randn((2, 8, 2, 32), FP16, g), randn((2, 8, 2, 32), FP16, g)
    kn, vn = randn((2, 1, 2, 32), FP16, g), randn((2, 1, 2, 32), FP16, g)
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3, return_softmax_lse=True)
    assert tuple(out.shape) == (2, 0, 4, 32) and tuple(lse.shape) == (2, 4, 0)
    assert torch.equal(kc[:, 3], kn[:, 0]) and torch.equal(vc[:, 3], vn[:, 0])
