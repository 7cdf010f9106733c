"""Rotary embeddings against a naive per-token complex-number oracle in float64: the PyTorch path,
the Triton kernel (flash_attn.ops.triton.rotary) in Triton's interpreter, upstream's autograd for
in-place rotation of a leaf that requires grad (apply_rotary_emb, apply_rotary_emb_qkv_ and _kv_),
torch.compile(fullgraph=True) with gradients, and a short hypothesis fuzz of the kernel."""

import math

import pytest
import torch

from flash_attn.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
)

# Tolerances against the float64 oracle rounded to the output dtype: one unit in the last place
# (a float32 computation may round a tie the other way), nothing more.
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=1e-5, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-4, rtol=8e-3),
    torch.float64: dict(atol=1e-12, rtol=1e-12),
}


def assert_matches(out, ref):
    """``out`` equals the float64 ``ref`` rounded once to ``out.dtype``, up to one ulp."""
    torch.testing.assert_close(out.cpu(), ref.to(out.dtype), **TOL[out.dtype])


def random_table(seqlen_ro, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(seqlen_ro, half, generator=g, dtype=torch.float64) * 2 * math.pi
    return torch.cos(angle), torch.sin(angle)


def rotate_token(vec, pos, cos, sin, interleaved):
    """Rotate one token's features (headdim,) at position ``pos``; None means unrotated."""
    out = vec.double().clone()
    if pos is None:
        return out
    half = cos.shape[1]
    rd = 2 * half
    # Multiplying (a + ib) by (cos + i sin) is the rotation of the pair (a, b).
    z = torch.complex(cos[pos].double(), sin[pos].double())
    if interleaved:
        pairs = torch.view_as_complex(out[:rd].reshape(half, 2).contiguous())
        out[:rd] = torch.view_as_real(pairs * z).reshape(rd)
    else:
        pairs = torch.complex(out[:half], out[half:rd])
        rot = pairs * z
        out[:half], out[half:rd] = rot.real, rot.imag
    return out


def oracle_dense(x, cos, sin, interleaved, offsets):
    """x (batch, seqlen, nheads, headdim); offsets: list of ints per batch."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for b in range(x.shape[0]):
        for j in range(x.shape[1]):
            for h in range(x.shape[2]):
                out[b, j, h] = rotate_token(x[b, j, h], j + offsets[b], cos, sin, interleaved)
    return out


def oracle_varlen(x, cos, sin, interleaved, cu, offsets):
    """x (total, nheads, headdim); cu and offsets are Python lists."""
    out = x.double().clone()
    for b in range(len(cu) - 1):
        for t in range(cu[b], cu[b + 1]):
            for h in range(x.shape[1]):
                out[t, h] = rotate_token(x[t, h], t - cu[b] + offsets[b], cos, sin, interleaved)
    return out


def make_offsets(kind, batch):
    if kind == "zero":
        return 0, [0] * batch
    if kind == "int":
        return 3, [3] * batch
    values = [2, 0, 5][:batch]
    dtype = torch.int32 if kind == "tensor32" else torch.int64
    return torch.tensor(values, dtype=dtype), values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset_kind", ["zero", "int", "tensor32", "tensor64"])
@pytest.mark.parametrize("rotary_dim", [8, 4])
@pytest.mark.parametrize("interleaved", [False, True])
def test_dense_matches_oracle(interleaved, rotary_dim, offset_kind, dtype):
    batch, seqlen, nheads, headdim = 3, 5, 2, 8
    x = torch.randn(batch, seqlen, nheads, headdim).to(dtype)
    cos, sin = random_table(12, rotary_dim // 2)
    offsets, offset_list = make_offsets(offset_kind, batch)
    out = apply_rotary_emb(
        x, cos.float(), sin.float(), interleaved=interleaved, seqlen_offsets=offsets
    )
    assert out.dtype == dtype and out.shape == x.shape
    ref = oracle_dense(x, cos.float(), sin.float(), interleaved, offset_list)
    assert_matches(out, ref)
    # The features past rotary_dim are passed through bit for bit.
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_rotation_changes_values_and_norm_is_kept():
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64)
    cos, sin = random_table(6, 4)
    out = apply_rotary_emb(x, cos, sin)
    assert not torch.allclose(out, x)
    # Each pair is rotated, so the per-pair norm (hence the total norm) is unchanged.
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_styles_differ():
    x = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    cos, sin = random_table(4, 4)
    assert not torch.allclose(
        apply_rotary_emb(x, cos, sin, interleaved=True), apply_rotary_emb(x, cos, sin)
    )


def test_position_zero_with_zero_angle_is_identity():
    x = torch.randn(2, 3, 2, 6)
    cos, sin = torch.ones(3, 3), torch.zeros(3, 3)
    torch.testing.assert_close(apply_rotary_emb(x, cos, sin), x)


def test_computes_in_fp32_even_when_table_is_half():
    # fp16 cos/sin are upcast, and the result is rounded to x's dtype only once.
    x = torch.randn(2, 4, 2, 8, dtype=torch.float16)
    cos, sin = random_table(4, 4)
    out = apply_rotary_emb(x, cos.half(), sin.half())
    ref = oracle_dense(x, cos.half(), sin.half(), False, [0, 0])
    assert_matches(out, ref)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace(interleaved, dtype):
    x = torch.randn(2, 4, 3, 8).to(dtype)
    cos, sin = random_table(8, 3)
    expected = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=2)
    x_before = x.clone()
    out = apply_rotary_emb(x, cos, sin, interleaved, inplace=True, seqlen_offsets=2)
    assert out is x
    torch.testing.assert_close(x, expected, atol=0, rtol=0)
    assert not torch.equal(x, x_before)
    assert torch.equal(x[..., 6:], x_before[..., 6:])


@pytest.mark.parametrize("offset_kind", ["zero", "int", "tensor32", "tensor64"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_varlen_matches_oracle(interleaved, offset_kind):
    cu_list = [0, 3, 3, 7]  # the middle sequence is empty
    total, nheads, headdim = 7, 2, 8
    x = torch.randn(total, nheads, headdim)
    cos, sin = random_table(10, 3)
    offsets, offset_list = make_offsets(offset_kind, 3)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    out = apply_rotary_emb(
        x, cos, sin, interleaved, seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=4
    )
    ref = oracle_varlen(x, cos, sin, interleaved, cu_list, offset_list)
    assert_matches(out, ref)


def test_varlen_positions_restart_per_sequence():
    # Two identical sequences packed together must be rotated identically.
    seq = torch.randn(4, 2, 8)
    x = torch.cat([seq, seq])
    cos, sin = random_table(4, 4)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    out = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=4)
    torch.testing.assert_close(out[:4], out[4:])
    torch.testing.assert_close(out[:4], apply_rotary_emb(seq[None], cos, sin)[0])


def test_varlen_inplace_and_rows_outside_sequences_untouched():
    x = torch.randn(6, 1, 4)
    cos, sin = random_table(4, 2)
    cu = torch.tensor([0, 2, 4], dtype=torch.int64)
    ref = oracle_varlen(x, cos, sin, False, [0, 2, 4], [0, 0])
    x_tail = x[4:].clone()
    out = apply_rotary_emb(x, cos, sin, inplace=True, cu_seqlens=cu, max_seqlen=2)
    assert out is x
    torch.testing.assert_close(x.double(), ref)
    assert torch.equal(x[4:], x_tail)


def test_tensor_offsets_past_table_are_left_unrotated():
    x = torch.randn(2, 3, 1, 4)
    cos, sin = random_table(4, 2)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 2]))
    # Batch 1 covers positions 2, 3, 4: the last one is past the 4-row table.
    torch.testing.assert_close(out[1, 2], x[1, 2])
    assert_matches(out[1, :2], oracle_dense(x[1:, :2], cos, sin, False, [2])[0])


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_dense(interleaved):
    x = torch.randn(2, 3, 2, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = random_table(5, 2)
    cos.requires_grad_()
    sin.requires_grad_()
    offsets = torch.tensor([0, 2])
    assert torch.autograd.gradcheck(
        lambda x, c, s: apply_rotary_emb(x, c, s, interleaved, seqlen_offsets=offsets),
        (x, cos, sin),
    )


def test_gradcheck_varlen_and_inplace():
    x = torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True)
    cos, sin = random_table(4, 2)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda x: apply_rotary_emb(x, cos, sin, True, cu_seqlens=cu, max_seqlen=3), (x,)
    )
    assert torch.autograd.gradcheck(
        lambda x: apply_rotary_emb(x.clone(), cos, sin, inplace=True, cu_seqlens=cu, max_seqlen=3),
        (x,),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_is_rotation_by_minus_angle(dtype):
    x = torch.randn(2, 4, 2, 8).to(dtype).requires_grad_()
    cos, sin = random_table(6, 3)
    grad = torch.randn(2, 4, 2, 8).to(dtype)
    apply_rotary_emb(x, cos, sin, seqlen_offsets=1).backward(grad)
    expected = oracle_dense(grad, cos, -sin, False, [1, 1])
    assert_matches(x.grad, expected)


def test_apply_rotary_emb_torch_matches_oracle():
    x = torch.randn(2, 4, 2, 8, dtype=torch.float64)
    cos, sin = random_table(4, 3)
    for interleaved in (False, True):
        ref = oracle_dense(x, cos, sin, interleaved, [0, 0])
        torch.testing.assert_close(apply_rotary_emb_torch(x, cos, sin, interleaved), ref)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shape=(2, 3, 2, 4), half=3), "rotary_dim"),
        (dict(shape=(2, 3, 2, 8), half=2, sin_half=3), "same shape"),
        (dict(shape=(2, 3, 2, 8), half=2, seqlen_ro=2), "exceeds"),
        (dict(shape=(2, 3, 2, 8), half=2, seqlen_ro=4, offsets=2), "exceeds"),
        (dict(shape=(2, 3, 2, 8), half=2, offsets=-1), ">= 0"),
        (dict(shape=(2, 3, 2, 8), half=2, offsets=torch.tensor([1, 2, 3])), "shape"),
        (dict(shape=(2, 3, 2, 8), half=2, offsets=torch.tensor([1.0, 2.0])), "int32 or int64"),
        (dict(shape=(2, 3, 2, 8), half=2, seqlen_ro=2, offsets=torch.tensor([0, 0])), "longer"),
        (dict(shape=(3, 2, 8), half=2), "batch, seqlen"),
        (dict(shape=(2, 3, 2, 8), half=0), "at least one column"),
    ],
)
def test_errors(kwargs, match):
    x = torch.randn(*kwargs["shape"])
    seqlen_ro = kwargs.get("seqlen_ro", 8)
    cos = torch.randn(seqlen_ro, kwargs["half"])
    sin = torch.randn(seqlen_ro, kwargs.get("sin_half", kwargs["half"]))
    with pytest.raises(ValueError, match=match):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=kwargs.get("offsets", 0))


def test_errors_varlen_and_table_rank():
    cos, sin = torch.randn(4, 2), torch.randn(4, 2)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen"):
        apply_rotary_emb(torch.randn(5, 1, 4), cos, sin, cu_seqlens=cu)
    with pytest.raises(ValueError, match="total, nheads"):
        apply_rotary_emb(torch.randn(1, 5, 1, 4), cos, sin, cu_seqlens=cu, max_seqlen=3)
    with pytest.raises(ValueError, match="exceeds"):
        apply_rotary_emb(torch.randn(5, 1, 4), cos, sin, 0, False, 2, cu, 3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        apply_rotary_emb(torch.randn(5, 1, 4), cos, sin, cu_seqlens=cu.float(), max_seqlen=3)
    with pytest.raises(ValueError, match="seqlen_ro"):
        apply_rotary_emb(torch.randn(1, 2, 1, 4), torch.randn(8), torch.randn(8))


def _qkv_reference(qkv, cos, sin, cos_k, sin_k, interleaved, offsets, num_heads_q):
    """Oracle for packed qkv given per-batch offsets (list)."""
    if qkv.ndim == 5:
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q_ref = oracle_dense(q, cos, sin, interleaved, offsets)
        k_ref = oracle_dense(k, cos_k, sin_k, interleaved, offsets)
        return torch.stack([q_ref, k_ref, v.double()], dim=2)
    nk = (qkv.shape[2] - num_heads_q) // 2
    q, k, v = qkv.split([num_heads_q, nk, nk], dim=2)
    q_ref = oracle_dense(q, cos, sin, interleaved, offsets)
    k_ref = oracle_dense(k, cos_k, sin_k, interleaved, offsets)
    return torch.cat([q_ref, k_ref, v.double()], dim=2)


@pytest.mark.parametrize("layout", ["packed3", "gqa"])
@pytest.mark.parametrize("separate_k", [False, True])
@pytest.mark.parametrize("offset_kind", ["zero", "tensor32"])
def test_qkv_inplace(layout, separate_k, offset_kind):
    batch, seqlen, headdim = 3, 4, 8
    if layout == "packed3":
        qkv, num_heads_q = torch.randn(batch, seqlen, 3, 2, headdim), None
    else:
        qkv, num_heads_q = torch.randn(batch, seqlen, 4 + 2 * 2, headdim), 4
    cos, sin = random_table(10, 3)
    cos_k, sin_k = random_table(10, 3, seed=1) if separate_k else (None, None)
    offsets, offset_list = make_offsets(offset_kind, batch)
    ref = _qkv_reference(
        qkv, cos, sin, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
        True, offset_list, num_heads_q,
    )
    out = apply_rotary_emb_qkv_(
        qkv, cos.float(), sin.float(),
        None if cos_k is None else cos_k.float(), None if sin_k is None else sin_k.float(),
        interleaved=True, seqlen_offsets=offsets, num_heads_q=num_heads_q,
    )
    assert out is qkv
    assert_matches(qkv, ref)


def test_qkv_gradient():
    leaf = torch.randn(2, 3, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    cos, sin = random_table(3, 2)
    weight = torch.randn(leaf.shape, dtype=torch.float64)
    (apply_rotary_emb_qkv_(leaf.clone(), cos, sin) * weight).sum().backward()
    expected = weight.clone()
    expected[:, :, 0] = oracle_dense(weight[:, :, 0], cos, -sin, False, [0, 0])
    expected[:, :, 1] = oracle_dense(weight[:, :, 1], cos, -sin, False, [0, 0])
    torch.testing.assert_close(leaf.grad, expected)


def test_qkv_errors():
    cos, sin = torch.randn(4, 2), torch.randn(4, 2)
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(torch.randn(1, 2, 6, 4), cos, sin)
    with pytest.raises(ValueError, match="heads"):
        apply_rotary_emb_qkv_(torch.randn(1, 2, 7, 4), cos, sin, num_heads_q=4)
    with pytest.raises(ValueError, match="3, nheads"):
        apply_rotary_emb_qkv_(torch.randn(1, 2, 2, 2, 4), cos, sin)
    with pytest.raises(ValueError, match="together"):
        apply_rotary_emb_qkv_(torch.randn(1, 2, 3, 2, 4), cos, sin, cos_k=cos)


def test_kv_inplace_rotates_only_k():
    kv = torch.randn(2, 4, 2, 3, 8)
    cos, sin = random_table(9, 4)
    k_ref = oracle_dense(kv[:, :, 0], cos, sin, False, [5, 5])
    v_before = kv[:, :, 1].clone()
    out = apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=5)
    assert out is kv
    assert_matches(kv[:, :, 0], k_ref)
    assert torch.equal(kv[:, :, 1], v_before)
    with pytest.raises(ValueError, match="2, nheads"):
        apply_rotary_emb_kv_(torch.randn(2, 4, 3, 3, 8), cos, sin)


def reference_tables(dim, base, length, scale_base=None):
    """cos/sin (and XPos k tables) from the formulas, in float64."""
    i = torch.arange(dim // 2, dtype=torch.float64)
    inv_freq = base ** (-2 * i / dim)
    pos = torch.arange(length, dtype=torch.float64)
    angle = pos[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    if scale_base is None:
        return cos, sin, cos, sin
    zeta = (2 * i + 0.4 * dim) / (1.4 * dim)
    xpos = zeta[None, :] ** ((pos - length // 2) / scale_base)[:, None]
    return cos * xpos, sin * xpos, cos / xpos, sin / xpos


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_module_qkv(interleaved):
    dim, seqlen = 6, 5
    module = RotaryEmbedding(dim, base=100.0, interleaved=interleaved)
    qkv = torch.randn(2, seqlen, 3, 2, 8)
    cos, sin, _, _ = reference_tables(dim, 100.0, seqlen + 2)
    ref = _qkv_reference(qkv, cos, sin, cos, sin, interleaved, [2, 2], None)
    out = module(qkv, seqlen_offset=2)
    assert out is qkv
    assert module._seq_len_cached == seqlen + 2
    torch.testing.assert_close(qkv.double(), ref, atol=1e-5, rtol=1e-5)


def test_rotary_embedding_module_kv_and_tensor_offsets():
    dim = 8
    module = RotaryEmbedding(dim)
    q = torch.randn(2, 3, 4, 8)
    kv = torch.randn(2, 3, 2, 2, 8)
    offsets = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen"):
        module(q.clone(), kv.clone(), seqlen_offset=offsets)
    cos, sin, _, _ = reference_tables(dim, 10000.0, 16)
    q_ref = oracle_dense(q, cos, sin, False, [1, 4])
    k_ref = oracle_dense(kv[:, :, 0], cos, sin, False, [1, 4])
    v_before = kv[:, :, 1].clone()
    q_out, kv_out = module(q, kv, seqlen_offset=offsets, max_seqlen=16)
    assert q_out is q and kv_out is kv
    torch.testing.assert_close(q.double(), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[:, :, 0].double(), k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv[:, :, 1], v_before)


def test_rotary_embedding_partial_dim_and_gqa():
    module = RotaryEmbedding(4)
    qkv = torch.randn(1, 3, 3 + 2, 8)  # 3 q heads, 1 k head, 1 v head
    cos, sin, _, _ = reference_tables(4, 10000.0, 3)
    ref = _qkv_reference(qkv, cos, sin, cos, sin, False, [0], 3)
    module(qkv, num_heads_q=3)
    torch.testing.assert_close(qkv.double(), ref, atol=1e-5, rtol=1e-5)


def test_rotary_embedding_xpos():
    dim, scale_base, seqlen = 8, 16.0, 6
    module = RotaryEmbedding(dim, scale_base=scale_base)
    qkv = torch.randn(1, seqlen, 3, 2, dim)
    cos_q, sin_q, cos_k, sin_k = reference_tables(dim, 10000.0, seqlen, scale_base)
    ref = _qkv_reference(qkv, cos_q, sin_q, cos_k, sin_k, False, [0], None)
    module(qkv)
    torch.testing.assert_close(qkv.double(), ref, atol=1e-5, rtol=1e-5)
    # The decay is real: q and k were scaled in opposite directions.
    assert not torch.allclose(cos_q, cos_k)

    q = torch.randn(1, seqlen, 2, dim)
    kv = torch.randn(1, seqlen, 2, 2, dim)
    q_ref = oracle_dense(q, cos_q, sin_q, False, [0])
    k_ref = oracle_dense(kv[:, :, 0], cos_k, sin_k, False, [0])
    module(q, kv)
    torch.testing.assert_close(q.double(), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[:, :, 0].double(), k_ref, atol=1e-5, rtol=1e-5)


def test_rotary_embedding_cache_policy():
    module = RotaryEmbedding(4)
    module(torch.randn(1, 4, 3, 1, 4))
    first = module._cos_cached
    assert module._seq_len_cached == 4
    module(torch.randn(1, 2, 3, 1, 4))  # shorter: the cache is reused
    assert module._cos_cached is first
    module(torch.randn(1, 2, 3, 1, 4), seqlen_offset=5)  # needs 7 rows: rebuilt
    assert module._seq_len_cached == 7 and module._cos_cached.shape == (7, 2)
    module(torch.randn(1, 2, 3, 1, 4, dtype=torch.float64))  # new dtype: rebuilt
    assert module._cos_cached.dtype == torch.float64
    with torch.inference_mode():
        module(torch.randn(1, 9, 3, 1, 4))
    assert module._cos_cached.is_inference()
    module.train()
    module(torch.randn(1, 2, 3, 1, 4))
    assert not module._cos_cached.is_inference()


def test_rotary_embedding_half_module_keeps_fp32_tables():
    module = RotaryEmbedding(8, base=10000.0).to(torch.bfloat16)
    qkv = torch.randn(1, 64, 3, 1, 8, dtype=torch.bfloat16)
    module(qkv)
    cos_ref, _, _, _ = reference_tables(8, 10000.0, 64)
    # Tables come out in bf16 but were computed in fp32: only the final rounding differs.
    torch.testing.assert_close(module._cos_cached.double(), cos_ref, atol=4e-3, rtol=0)


def test_torch_compile():
    torch._dynamo.reset()
    cos, sin = random_table(12, 3)
    cos, sin = cos.float(), sin.float()

    def fn(x, offsets, xv, cu):
        a = apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
        b = apply_rotary_emb(x, cos, sin, interleaved=True, seqlen_offsets=offsets)
        c = apply_rotary_emb(xv, cos, sin, cu_seqlens=cu, max_seqlen=4)
        return a, b, c

    x = torch.randn(2, 4, 2, 8)
    xv = torch.randn(6, 2, 8)
    offsets = torch.tensor([1, 3])
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    compiled = torch.compile(fn, backend="aot_eager")
    for got, want in zip(compiled(x, offsets, xv, cu), fn(x, offsets, xv, cu)):
        torch.testing.assert_close(got, want)


# --- the Triton kernel: in Triton's interpreter on the CPU, compiled on CUDA (--flash-device cuda) -----

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flash_attn.backends import _interpreter  # noqa: E402
from flash_attn.ops.triton import rotary as rotary_ops  # noqa: E402
from flash_attn.ops.triton.rotary import apply_rotary  # noqa: E402
from support.options import skip_unless_the_interpreter_runs, test_device  # noqa: E402


def on_device(*tensors):
    """The kernel tests' inputs, drawn on the CPU, on the device under test."""
    moved = tuple(t.to(test_device()) for t in tensors)
    return moved if len(moved) > 1 else moved[0]


def route_to_kernel(mp):
    """Every rotation through the Triton kernel: on CUDA compiled by Triton's JIT, on the CPU run
    by Triton's interpreter."""
    if test_device().type != "cuda":
        skip_unless_the_interpreter_runs()
        mp.setattr(rotary_ops, "_launch", _interpreter.launch)
        mp.setattr(rotary_ops, "_kernel_applies", lambda x: x.dtype != torch.float64)
    elif rotary_ops.triton is None:
        pytest.skip("Triton is not installed: the rotary kernel cannot run on CUDA")


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """Route every rotation (also apply_rotary_emb's) through the Triton kernel (see
    route_to_kernel); 4-token row blocks, so that sequences span several programs."""
    route_to_kernel(monkeypatch)
    real = rotary_ops._rotate_triton
    calls = []

    def small_blocks(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs, block_m=4)

    monkeypatch.setattr(rotary_ops, "_rotate_triton", small_blocks)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offset_kind", ["int", "tensor32", "tensor64"])
@pytest.mark.parametrize("rotary_dim", [8, 6])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_kernel_dense_matches_oracle(interpreted_kernel, inplace, interleaved, rotary_dim, offset_kind, dtype):
    batch, seqlen, nheads, headdim = 3, 9, 2, 10
    x = torch.randn(batch, seqlen, nheads, headdim).to(dtype)
    cos, sin = random_table(16, rotary_dim // 2)
    offsets, offset_list = make_offsets(offset_kind, batch)
    ref = oracle_dense(x, cos.float(), sin.float(), interleaved, offset_list)
    x = on_device(x)
    before = x.clone()
    out = apply_rotary(x, *on_device(cos.float(), sin.float()),
                       seqlen_offsets=on_device(offsets) if torch.is_tensor(offsets) else offsets,
                       interleaved=interleaved, inplace=inplace)
    assert interpreted_kernel, "the kernel did not run"
    assert (out is x) == inplace
    if not inplace:
        assert torch.equal(x, before)
    assert_matches(out, ref)
    assert torch.equal(out[..., rotary_dim:], before[..., rotary_dim:])


@pytest.mark.parametrize("offset_kind", ["zero", "tensor32"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_kernel_varlen_matches_oracle(interpreted_kernel, inplace, interleaved, offset_kind):
    cu_list = [0, 5, 5, 11]  # an empty sequence; rows 11 and 12 belong to none and pass through
    x = torch.randn(13, 2, 8)
    cos, sin = random_table(14, 3)
    offsets, offset_list = make_offsets(offset_kind, 3)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    ref = oracle_varlen(x, cos.float(), sin.float(), interleaved, cu_list, offset_list)
    out = apply_rotary(*on_device(x, cos.float(), sin.float()),
                       seqlen_offsets=on_device(offsets) if torch.is_tensor(offsets) else offsets,
                       cu_seqlens=on_device(cu), max_seqlen=6, interleaved=interleaved, inplace=inplace)
    assert interpreted_kernel
    assert_matches(out, ref)


def test_kernel_conjugate_strided_input_and_positions_past_the_table(interpreted_kernel):
    qkv = on_device(torch.randn(2, 5, 3, 2, 8))
    k = qkv[:, :, 1]  # not contiguous
    cos, sin = random_table(6, 4)
    offsets = torch.tensor([0, 3])  # batch 1 reaches positions 6 and 7: past the 6-row table
    out = apply_rotary(k, *on_device(cos.float(), sin.float(), offsets), conjugate=True)
    assert interpreted_kernel
    ref = oracle_dense(k[:, :3].cpu(), cos.float(), -sin.float(), False, [0, 3])
    assert_matches(out[:, :3], ref)
    assert torch.equal(out[1, 3:], k[1, 3:])  # unrotated, as upstream's kernel leaves them


def test_kernel_negative_positions_of_unchecked_offsets_rotate_nothing(interpreted_kernel, monkeypatch):
    """Offsets whose values are not read on the host (a GPU's, without FLASH_ATTN_DEBUG=1: no
    ``min()``, comparison and device assert per call) may reach negative positions: the kernel
    leaves those rows unrotated, as it does past the table. The stand-in: ``host_reads_values``
    answering as for a GPU tensor."""
    from flash_attn import validation  # noqa: PLC0415

    monkeypatch.setattr(validation, "host_reads_values", lambda t: False)
    x = on_device(torch.randn(2, 4, 2, 8))
    cos, sin = random_table(6, 4)
    out = apply_rotary(x, *on_device(cos.float(), sin.float(), torch.tensor([-2, 1])))
    assert interpreted_kernel
    assert torch.equal(out[0, :2], x[0, :2])  # positions -2 and -1: unrotated
    assert_matches(out[0:1, 2:], oracle_dense(x[0:1, 2:].cpu(), cos.float(), sin.float(), False, [0]))
    assert_matches(out[1], oracle_dense(x[1:2].cpu(), cos.float(), sin.float(), False, [1])[0])


def test_apply_rotary_pytorch_path_conjugate_undoes_the_rotation():
    x = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    cos, sin = random_table(6, 4)
    rotated = apply_rotary(x, cos, sin, seqlen_offsets=2, interleaved=True)
    assert_matches(rotated, oracle_dense(x, cos, sin, True, [2, 2]))
    back = apply_rotary(rotated, cos, sin, seqlen_offsets=2, interleaved=True, conjugate=True)
    torch.testing.assert_close(back, x, rtol=1e-12, atol=1e-12)


def test_kernel_forward_and_backward_through_apply_rotary_emb(interpreted_kernel):
    x = on_device(torch.randn(2, 6, 2, 8)).requires_grad_()
    cos, sin = random_table(8, 4)
    grad = torch.randn(2, 6, 2, 8)
    cos_d, sin_d, offsets = on_device(cos.float(), sin.float(), torch.tensor([2, 0]))
    out = apply_rotary_emb(x, cos_d, sin_d, seqlen_offsets=offsets)
    out.backward(on_device(grad))
    assert len(interpreted_kernel) == 2  # the forward and the backward
    assert_matches(out.detach(), oracle_dense(x.detach().cpu(), cos.float(), sin.float(), False, [2, 0]))
    assert_matches(x.grad, oracle_dense(grad, cos.float(), -sin.float(), False, [2, 0]))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(batch=st.integers(1, 3), seqlen=st.integers(1, 9), nheads=st.integers(1, 3), half=st.integers(1, 5),
       extra=st.integers(0, 3), interleaved=st.booleans(), inplace=st.booleans(), tensor_offsets=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kernel_fuzz(batch, seqlen, nheads, half, extra, interleaved, inplace, tensor_offsets, seed):
    with pytest.MonkeyPatch.context() as mp:
        route_to_kernel(mp)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, seqlen, nheads, 2 * half + extra, generator=g)
        cos, sin = random_table(seqlen + 4, half, seed=seed)
        offset_list = torch.randint(0, 5, (batch,), generator=g).tolist()
        offsets = torch.tensor(offset_list) if tensor_offsets else offset_list[0]
        if not tensor_offsets:
            offset_list = [offset_list[0]] * batch
        ref = oracle_dense(x, cos.float(), sin.float(), interleaved, offset_list)
        out = apply_rotary(*on_device(x, cos.float(), sin.float()),
                           seqlen_offsets=on_device(offsets) if torch.is_tensor(offsets) else offsets,
                           interleaved=interleaved, inplace=inplace)
        assert_matches(out, ref)


# --- upstream's autograd for in-place rotation ------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_inplace_on_a_leaf_that_requires_grad(interleaved):
    """Upstream's own test pattern: ``x`` a leaf with requires_grad, ``inplace=True``."""
    x = torch.randn(2, 5, 2, 8, requires_grad=True)
    x_before = x.detach().clone()
    cos, sin = random_table(7, 3)
    grad = torch.randn(2, 5, 2, 8)
    out = apply_rotary_emb(x, cos.float(), sin.float(), interleaved, inplace=True, seqlen_offsets=1)
    ref = oracle_dense(x_before, cos.float(), sin.float(), interleaved, [1, 1])
    assert out.data_ptr() == x.data_ptr()  # written in place: a view of x, as upstream
    assert_matches(x.detach(), ref)
    assert_matches(out.detach(), ref)
    out.backward(grad)
    assert_matches(x.grad, oracle_dense(grad, cos.float(), -sin.float(), interleaved, [1, 1]))


def test_inplace_on_a_non_leaf_keeps_its_history():
    # x is marked modified: using x itself afterwards (not the return value) differentiates right
    leaf = torch.randn(1, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    x = leaf * 2
    cos, sin = random_table(4, 4)
    out = apply_rotary_emb(x, cos, sin, inplace=True)
    assert out is x
    (x * x).sum().backward()
    rotated = oracle_dense(leaf.detach() * 2, cos, sin, False, [0])
    expected = 2 * oracle_dense(2 * rotated, cos, -sin, False, [0])
    torch.testing.assert_close(leaf.grad, expected)


def test_inplace_leaf_with_differentiable_tables_is_refused():
    x = torch.randn(1, 3, 1, 4, requires_grad=True)
    cos, sin = random_table(3, 2)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rotary_emb(x, cos.float().requires_grad_(), sin.float(), inplace=True)


@pytest.mark.parametrize("layout", ["packed3", "gqa", "kv"])
def test_packed_inplace_on_a_leaf_that_requires_grad(layout):
    cos, sin = random_table(6, 3)
    if layout == "kv":
        packed = torch.randn(2, 4, 2, 2, 8, dtype=torch.float64, requires_grad=True)
        out = apply_rotary_emb_kv_(packed, cos, sin, seqlen_offsets=2)
        parts = [(0, slice(None))]
    elif layout == "packed3":
        packed = torch.randn(2, 4, 3, 2, 8, dtype=torch.float64, requires_grad=True)
        out = apply_rotary_emb_qkv_(packed, cos, sin, seqlen_offsets=2)
        parts = [(0, slice(None)), (1, slice(None))]
    else:
        packed = torch.randn(2, 4, 3 + 2, 8, dtype=torch.float64, requires_grad=True)  # 3 q, 1 k, 1 v
        out = apply_rotary_emb_qkv_(packed, cos, sin, seqlen_offsets=2, num_heads_q=3)
        parts = [(None, slice(0, 3)), (None, slice(3, 4))]
    weight = torch.randn(packed.shape, dtype=torch.float64)
    (out * weight).sum().backward()
    expected = weight.clone()
    for index, heads in parts:
        view = (slice(None), slice(None), index, heads) if index is not None else (slice(None), slice(None), heads)
        expected[view] = oracle_dense(weight[view], cos, -sin, False, [2, 2])
    torch.testing.assert_close(packed.grad, expected)


def test_torch_compile_fullgraph_with_gradients():
    torch._dynamo.reset()
    cos, sin = random_table(10, 3)
    cos, sin = cos.float(), sin.float()

    def fn(x, offsets):
        return apply_rotary_emb(x, cos, sin, interleaved=True, seqlen_offsets=offsets).square().sum()

    x_eager = torch.randn(2, 5, 2, 8, requires_grad=True)
    x_comp = x_eager.detach().clone().requires_grad_()
    offsets = torch.tensor([1, 4])
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    loss_eager, loss_comp = fn(x_eager, offsets), compiled(x_comp, offsets)
    loss_eager.backward()
    loss_comp.backward()
    torch.testing.assert_close(loss_comp, loss_eager)
    torch.testing.assert_close(x_comp.grad, x_eager.grad)


@pytest.mark.parametrize("packing", ["qkv", "kv"])
def test_torch_compile_of_the_in_place_packed_rotation_on_a_leaf(packing):
    """Upstream's expectation: ``torch.compile(apply_rotary_emb_qkv_)`` (and ``_kv_``) on a packed
    leaf that requires grad gives the eager values, writes them into the leaf, and the same
    gradient (dynamo used to refuse "a view of a leaf Variable that requires grad is being used in
    an in-place operation")."""
    g = torch.Generator().manual_seed(5)
    shape = (2, 8, 3 if packing == "qkv" else 2, 2, 16)
    data = torch.randn(shape, generator=g)
    cos, sin = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    weights = torch.randn(shape, generator=g)
    fn = apply_rotary_emb_qkv_ if packing == "qkv" else apply_rotary_emb_kv_
    results = []
    for run in (fn, torch.compile(fn, backend="aot_eager")):
        leaf = data.clone().requires_grad_()
        out = run(leaf, cos, sin)
        (out * weights).sum().backward()
        results.append((out.detach().clone(), leaf.detach().clone(), leaf.grad))
    (out_e, leaf_e, grad_e), (out_c, leaf_c, grad_c) = results
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(leaf_c, leaf_e)  # rotated in place, as eagerly
    torch.testing.assert_close(grad_c, grad_e)
    assert not torch.equal(leaf_e, data)
