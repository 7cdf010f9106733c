"""flash_attn.modules (mha, mlp, block, embedding) against float64 oracles written here.

Each module runs in fp32 (on ``--flash-device``) and is compared, forward and backward (input and
every parameter gradient), with the same computation written out below in float64 from the
module's weights: naive softmax attention (causal aligned bottom-right, GQA by repeating kv
heads, key padding, sliding window, ALiBi), rotary by its formula, layer norm by its formula.
Also: kv-cache decoding step by step equals the oracle of the whole sequence, the errors for bad
arguments, the "not provided" ImportErrors (fused_dense, layer_norm, rms_norm, models.*), and the
signatures against upstream's source (UPSTREAM_SIGNATURES, parsed from upstream's commit below).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from support.options import test_device
from flash_attn.modules.block import Block, ParallelBlock, StochasticDepth
from flash_attn.modules.embedding import (
    BertEmbeddings,
    ColumnParallelEmbedding,
    GPT2Embeddings,
    VocabParallelEmbedding,
)
from flash_attn.modules.mha import (
    MHA,
    CrossAttention,
    FlashCrossAttention,
    FlashSelfAttention,
    LinearResidual,
    SelfAttention,
    get_alibi_slopes,
)
from flash_attn.modules.mlp import FusedMLP, GatedMlp, Mlp
from flash_attn.utils.generation import InferenceParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

E, H, D = 64, 4, 16  # embed dim, heads, head dim


def dev():
    return test_device()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dev())


def assert_close(actual, expected, what="", rel=2e-5):
    """fp32 result vs float64 oracle: within ``rel`` of the oracle's largest magnitude (a few
    hundred fp32 ulps: sums over 64-wide dot products and softmax) plus a floor near 0."""
    expected = expected.to(torch.float64)
    tol = rel * max(1.0, expected.abs().max().item())
    err = (actual.to(torch.float64) - expected).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3e} > {tol:.3e}"


# ---------------------------------------------------------------------------------------------
# float64 oracles
# ---------------------------------------------------------------------------------------------


def attention_oracle(q, k, v, causal=False, key_mask=None, scale=None, window=(-1, -1),
                     alibi=None, key_lengths=None):
    """q ``(B, Sq, H, D)``, k/v ``(B, Sk, Hk, D)``. Query i sits at key position
    ``i + L - Sq`` (bottom-right alignment; L = key length, per batch from ``key_lengths``)."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    sq, sk = q.shape[1], k.shape[1]
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lengths = torch.full((q.shape[0],), sk) if key_lengths is None else key_lengths.cpu()
    row = (torch.arange(sq)[None, :, None] + lengths[:, None, None] - sq).to(q.device)  # (B, Sq, 1)
    col = torch.arange(sk, device=q.device)[None, None, :]
    allowed = torch.ones(q.shape[0], sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= col <= row
    if window[0] >= 0:
        allowed &= col >= row - window[0]
    if window[1] >= 0:
        allowed &= col <= row + window[1]
    if key_mask is not None:
        allowed &= key_mask[:, None, :]
    if alibi is not None:
        scores = scores - alibi.double().view(1, -1, 1, 1) * (row - col).abs()[:, None]
    # A query that may see no key gets output 0 (FlashAttention's convention), not NaN.
    seen = allowed.any(-1, keepdim=True)[:, None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf")).masked_fill(~seen, 0.0)
    probs = torch.softmax(scores, dim=-1) * seen
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def rotary_oracle(x, rotary_dim, offset=0, base=10000.0, interleaved=False):
    """Rotate the first ``rotary_dim`` dims of x ``(B, S, H, D)``: pairs (i, i + rd/2), or
    (2i, 2i+1) interleaved, by angle ``position * base ** (-2i / rd)``."""
    pos = torch.arange(x.shape[1], dtype=torch.float64, device=x.device) + offset
    freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=x.device) / rotary_dim)
    angle = pos[:, None] * freq[None, :]  # (S, rd/2)
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = rot.chunk(2, dim=-1)
        rot = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([rot, rest], dim=-1)


def causal_depthwise_oracle(x, weight, bias):
    """y[t] = w0 x[t-2] + w1 x[t-1] + w2 x[t] + b per channel; x ``(B, S, C)``."""
    padded = F.pad(x, (0, 0, 2, 0))
    w = weight[:, 0, :]  # (C, 3)
    y = sum(w[:, j] * padded[:, j: j + x.shape[1]] for j in range(3))
    return y + bias


def linear(x, p, name):
    bias = p.get(f"{name}.bias")
    y = x @ p[f"{name}.weight"].T
    return y + bias if bias is not None else y


def mha_oracle(m: MHA, p, x, x_kv=None, key_mask=None, offset=0, mixer_subset=None):
    """MHA's computation from its parameters ``p`` (float64)."""
    hq, hk, d = m.num_heads, m.num_heads_kv, m.head_dim
    if m.cross_attn:
        xq = x if mixer_subset is None else x[:, mixer_subset]
        q = linear(xq, p, "Wq")
        kv = linear(x_kv if x_kv is not None else x, p, "Wkv")
        k, v = kv.split(hk * d, dim=-1)
    else:
        qkv = linear(x, p, "Wqkv")
        if m.dwconv and hq == hk:
            qkv = causal_depthwise_oracle(qkv, p["dwconv_qkv.weight"], p["dwconv_qkv.bias"])
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        if m.dwconv and hq != hk:
            q = causal_depthwise_oracle(q, p["dwconv_q.weight"], p["dwconv_q.bias"])
            kv = causal_depthwise_oracle(torch.cat([k, v], -1), p["dwconv_kv.weight"],
                                         p["dwconv_kv.bias"])
            k, v = kv.split(hk * d, dim=-1)
    q, k, v = q.unflatten(-1, (hq, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))
    if m.rotary_emb_dim:
        q = rotary_oracle(q, m.rotary_emb_dim, offset, m.rotary_emb.base, m.rotary_emb.interleaved)
        k = rotary_oracle(k, m.rotary_emb_dim, offset, m.rotary_emb.base, m.rotary_emb.interleaved)
    inner = m.inner_attn
    alibi = getattr(inner, "alibi_slopes", None)
    context = attention_oracle(
        q, k, v, causal=m.causal, key_mask=key_mask, scale=inner.softmax_scale,
        window=getattr(inner, "window_size", (-1, -1)), alibi=alibi,
    )
    return linear(context.flatten(-2), p, "out_proj")


def params64(module):
    return {n: t.detach().double().requires_grad_(True) for n, t in module.named_parameters()}


def check_forward_backward(module, oracle, *inputs, rel=2e-5, pick=0):
    """Module (fp32) vs ``oracle(p64, *inputs64)``: output (``out[pick]`` of a tuple), grad of
    every input and parameter."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = module(*xs)
    out = out[pick] if isinstance(out, tuple) else out
    g = randn(*out.shape, seed=99)
    out.backward(g)
    p = params64(module)
    x64 = [t.detach().double().requires_grad_(True) if t.is_floating_point() else t for t in inputs]
    ref = oracle(p, *x64)
    ref.backward(g.double())
    assert_close(out, ref, "forward", rel)
    for i, (x, x_ref) in enumerate(zip(xs, x64)):
        if x.is_floating_point():
            assert_close(x.grad, x_ref.grad, f"grad of input {i}", rel)
    for name, param in module.named_parameters():
        if p[name].grad is None:  # not on the path to this output
            assert param.grad is None or not param.grad.any(), name
            continue
        assert_close(param.grad, p[name].grad, f"grad of {name}", rel)


# ---------------------------------------------------------------------------------------------
# MHA vs the oracle
# ---------------------------------------------------------------------------------------------

MHA_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "gqa": dict(num_heads_kv=2, causal=True),
    "mqa": dict(num_heads_kv=1),
    "rotary": dict(rotary_emb_dim=16, causal=True),
    "rotary_half_interleaved_gqa": dict(rotary_emb_dim=8, rotary_emb_interleaved=True,
                                        num_heads_kv=2, causal=True),
    "rotary_base": dict(rotary_emb_dim=16, rotary_emb_base=500.0),
    "no_bias_scale": dict(qkv_proj_bias=False, out_proj_bias=False, softmax_scale=0.3),
    "dwconv": dict(dwconv=True, causal=True),
    "dwconv_gqa": dict(dwconv=True, num_heads_kv=2, causal=True),
    "return_residual": dict(return_residual=True),
    "checkpointing": dict(checkpointing=True, causal=True),
}
FLASH_ONLY_CASES = {
    "window": dict(window_size=(2, 1)),
    "window_causal_gqa": dict(window_size=(3, 0), causal=True, num_heads_kv=2),
    "alibi": dict(use_alibi=True, causal=True),
    "alibi_noncausal": dict(use_alibi=True),
}


def _mha(seed=0, **kwargs):
    torch.manual_seed(seed)
    return MHA(E, H, device=dev(), **kwargs)


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("case", sorted(MHA_CASES))
def test_mha_self_attention_matches_oracle(case, use_flash_attn):
    m = _mha(use_flash_attn=use_flash_attn, **MHA_CASES[case])
    x = randn(2, 7, E)
    check_forward_backward(m, lambda p, x: mha_oracle(m, p, x), x)
    if m.return_residual:
        out, residual = m(x)
        assert residual is x


@pytest.mark.parametrize("case", sorted(FLASH_ONLY_CASES))
def test_mha_window_and_alibi_match_oracle(case):
    m = _mha(use_flash_attn=True, **FLASH_ONLY_CASES[case])
    check_forward_backward(m, lambda p, x: mha_oracle(m, p, x), randn(2, 9, E))


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    heads_kv_group=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (3, 3), (6, 2)]),
    head_dim=st.sampled_from([8, 16, 24]),
    batch=st.integers(1, 3),
    seqlen=st.integers(1, 9),
    causal=st.booleans(),
    use_flash_attn=st.booleans(),
    rotary=st.sampled_from([0, 8]),
    interleaved=st.booleans(),
    bias=st.booleans(),
)
def test_mha_fuzz_matches_oracle(heads_kv_group, head_dim, batch, seqlen, causal, use_flash_attn,
                                 rotary, interleaved, bias):
    heads, heads_kv = heads_kv_group[0], heads_kv_group[0] // heads_kv_group[1]
    torch.manual_seed(0)
    m = MHA(heads * head_dim, heads, num_heads_kv=heads_kv, causal=causal, qkv_proj_bias=bias,
            rotary_emb_dim=rotary, rotary_emb_interleaved=interleaved, use_flash_attn=use_flash_attn,
            device=dev())
    x = randn(batch, seqlen, heads * head_dim, seed=seqlen)
    check_forward_backward(m, lambda p, x: mha_oracle(m, p, x), x)


def test_alibi_slopes_follow_the_paper():
    # power of two: 2^(-8/n * (i+1)); otherwise the power below, then every other of the one above
    assert get_alibi_slopes(8) == pytest.approx([2 ** -(i + 1) for i in range(8)])
    assert get_alibi_slopes(4) == pytest.approx([2 ** (-2 * (i + 1)) for i in range(4)])
    six = get_alibi_slopes(6)
    assert six[:4] == pytest.approx(get_alibi_slopes(4))
    assert six[4:] == pytest.approx(get_alibi_slopes(8)[0::2][:2])


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
@pytest.mark.parametrize("num_heads_kv", [None, 2])
def test_mha_cross_attention_matches_oracle(use_flash_attn, num_heads_kv):
    m = _mha(cross_attn=True, causal=True, num_heads_kv=num_heads_kv, use_flash_attn=use_flash_attn)
    x, x_kv = randn(2, 5, E, seed=1), randn(2, 8, E, seed=2)
    check_forward_backward(m, lambda p, x, x_kv: mha_oracle(m, p, x, x_kv), x, x_kv)
    # mixer_subset: queries from a subset of x (e.g. a ViT's CLS token)
    out = m(x, x_kv, mixer_subset=slice(0, 1))
    assert out.shape == (2, 1, E)
    assert_close(out, mha_oracle(m, params64(m), x.double(), x_kv.double(), mixer_subset=slice(0, 1)),
                 "mixer_subset")


def test_mha_key_padding_mask_matches_oracle():
    m = _mha(use_flash_attn=False, num_heads_kv=2)
    lengths = torch.tensor([7, 4])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).to(dev())
    x = randn(2, 7, E, seed=3)
    out = m(x, key_padding_mask=mask)
    ref = mha_oracle(m, params64(m), x.double(), key_mask=mask)
    assert_close(out, ref, "key_padding_mask")


@pytest.mark.parametrize("num_heads_kv,causal", [(None, True), (2, True), (None, False)])
def test_mha_varlen_cu_seqlens_matches_oracle_per_sequence(num_heads_kv, causal):
    m = _mha(use_flash_attn=True, num_heads_kv=num_heads_kv, causal=causal)
    lengths = [5, 1, 8]
    cu = torch.tensor([0, 5, 6, 14], dtype=torch.int32, device=dev())
    x = randn(sum(lengths), E, seed=4).requires_grad_(True)
    out = m(x, cu_seqlens=cu, max_seqlen=max(lengths))
    g = randn(*out.shape, seed=5)
    out.backward(g)
    p = params64(m)
    x64 = x.detach().double().requires_grad_(True)
    ref = torch.cat([mha_oracle(m, p, x64[None, s:e])[0] for s, e in zip(cu[:-1], cu[1:])])
    ref.backward(g.double())
    assert_close(out, ref, "varlen forward")
    assert_close(x.grad, x64.grad, "varlen dx")
    for name, param in m.named_parameters():
        assert_close(param.grad, p[name].grad, f"varlen grad of {name}")


# ---------------------------------------------------------------------------------------------
# kv-cache decoding through InferenceParams
# ---------------------------------------------------------------------------------------------

DECODE_CASES = {
    "plain": dict(),
    "gqa": dict(num_heads_kv=2),
    "rotary16_fused_path": dict(rotary_emb_dim=16),  # flash: rotary inside flash_attn_with_kvcache
    "rotary8_gqa": dict(rotary_emb_dim=8, num_heads_kv=1, rotary_emb_interleaved=True),
    "window": dict(window_size=(3, 0)),
}


@pytest.mark.parametrize("case,use_flash_attn", [
    (case, flash) for case in sorted(DECODE_CASES) for flash in (False, True)
    if flash or "window_size" not in DECODE_CASES[case]  # sliding window: flash only
])
def test_kv_cache_decoding_step_by_step_matches_oracle_of_whole_sequence(case, use_flash_attn):
    kwargs = DECODE_CASES[case]
    m = _mha(use_flash_attn=use_flash_attn, causal=True, layer_idx=3, **kwargs)
    x = randn(2, 9, E, seed=6)
    params = InferenceParams(max_seqlen=12, max_batch_size=2)
    outs = []
    with torch.no_grad():
        outs.append(m(x[:, :4], inference_params=params))  # the prompt
        params.seqlen_offset += 4
        for t in range(4, 9):
            outs.append(m(x[:, t: t + 1], inference_params=params))
            params.seqlen_offset += 1
    ref = mha_oracle(m, params64(m), x.double())
    assert_close(torch.cat(outs, dim=1), ref, "decoded")
    cache = params.key_value_memory_dict[3]
    assert cache.shape == (2, 12, 2, m.num_heads_kv, D)


def test_allocate_inference_cache_is_used_in_place():
    m = _mha(use_flash_attn=True, causal=True, layer_idx=0, num_heads_kv=2)
    cache = m.allocate_inference_cache(2, 10)
    assert cache.shape == (2, 10, 2, 2, D) and cache.dtype == m.out_proj.weight.dtype
    assert m.allocate_inference_cache(1, 4, dtype=torch.bfloat16).dtype == torch.bfloat16
    params = InferenceParams(max_seqlen=10, max_batch_size=2, key_value_memory_dict={0: cache})
    x = randn(2, 3, E, seed=7)
    with torch.no_grad():
        m(x[:, :2], inference_params=params)
        params.seqlen_offset = 2
        m(x[:, 2:], inference_params=params)
    assert params.key_value_memory_dict[0] is cache
    qkv = F.linear(x, m.Wqkv.weight, m.Wqkv.bias)
    k = qkv[..., H * D: H * D + 2 * D].unflatten(-1, (2, D))
    torch.testing.assert_close(cache[:, :3, 0], k, rtol=0, atol=1e-6)


def test_inference_params_reset():
    lengths = torch.tensor([3, 5])
    params = InferenceParams(max_seqlen=8, max_batch_size=2, seqlen_offset=5,
                             lengths_per_sample=lengths)
    params.key_value_memory_dict[0] = "kept"
    params.reset(16, 4)
    assert (params.max_seqlen, params.max_batch_size, params.seqlen_offset) == (16, 4, 0)
    assert lengths.tolist() == [0, 0] and params.key_value_memory_dict == {0: "kept"}
    assert InferenceParams(4, 1).key_value_memory_dict is not InferenceParams(4, 1).key_value_memory_dict


# ---------------------------------------------------------------------------------------------
# the inner attention modules on their own
# ---------------------------------------------------------------------------------------------


def test_inner_attention_modules_match_oracle():
    q, k, v = randn(2, 5, H, D, seed=8), randn(2, 7, 2, D, seed=9), randn(2, 7, 2, D, seed=10)
    kv = torch.stack([k, v], dim=2)
    qkv = torch.stack([randn(2, 6, H, D, seed=s) for s in (11, 12, 13)], dim=2)
    q64, k64, v64 = q.double(), k.double(), v.double()
    for cls in (FlashCrossAttention, CrossAttention):
        for causal in (False, True):
            out = cls(causal=causal, softmax_scale=0.2)(q, kv)
            assert_close(out, attention_oracle(q64, k64, v64, causal=causal, scale=0.2), cls.__name__)
    for cls in (FlashSelfAttention, SelfAttention):
        out = cls(causal=True)(qkv)
        ref = attention_oracle(*qkv.double().unbind(2), causal=True)
        assert_close(out, ref, cls.__name__)
        # the per-call `causal` overrides the constructor's
        assert_close(cls(causal=True)(qkv, causal=False), attention_oracle(*qkv.double().unbind(2)),
                     f"{cls.__name__} causal override")


def test_cross_attention_key_padding_causal_aligns_to_real_key_length():
    q, kv = randn(2, 3, H, D, seed=14), randn(2, 6, 2, H, D, seed=15)
    lengths = torch.tensor([6, 4])
    mask = (torch.arange(6)[None] < lengths[:, None]).to(dev())
    out = CrossAttention(causal=True)(q, kv, key_padding_mask=mask)
    ref = attention_oracle(q.double(), *kv.double().unbind(2), causal=True, key_mask=mask,
                           key_lengths=lengths)
    assert_close(out, ref, "cross key padding")


def test_self_attention_key_padding_causal_is_top_left():
    qkv = randn(2, 6, 3, H, D, seed=16)
    mask = (torch.arange(6)[None] < torch.tensor([[6], [3]])).to(dev())
    out = SelfAttention(causal=True)(qkv, key_padding_mask=mask)
    ref = attention_oracle(*qkv.double().unbind(2), causal=True, key_mask=mask)
    # rows of padded queries see only padded-out keys after the real ones; compare real rows
    assert_close(out[1, :3], ref[1, :3], "padded batch")
    assert_close(out[0], ref[0], "full batch")


def test_flash_cross_attention_varlen_matches_oracle():
    lq, lk = [2, 4], [5, 3]
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32, device=dev())
    cu_k = torch.tensor([0, 5, 8], dtype=torch.int32, device=dev())
    q, kv = randn(6, H, D, seed=17), randn(8, 2, 2, D, seed=18)
    out = FlashCrossAttention(causal=True)(q, kv, cu_seqlens=cu_q, max_seqlen=4,
                                           cu_seqlens_k=cu_k, max_seqlen_k=5)
    for b in range(2):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = attention_oracle(q[None, qs].double(), *kv[None, ks].double().unbind(2), causal=True)
        assert_close(out[qs], ref[0], f"sequence {b}")


def test_attention_dropout_only_in_training():
    qkv = randn(1, 8, 3, H, D, seed=19)
    for cls in (FlashSelfAttention, SelfAttention):
        module = cls(attention_dropout=0.5)
        module.eval()
        assert_close(module(qkv), attention_oracle(*qkv.double().unbind(2)), f"{cls.__name__} eval")
        module.train()
        torch.manual_seed(0)
        dropped = module(qkv)
        assert (dropped - module.eval()(qkv)).abs().max() > 1e-3, f"{cls.__name__}: no dropout in training"


def test_linear_residual_returns_input():
    layer = LinearResidual(8, 3, device=dev())
    x = randn(2, 8)
    out, residual = layer(x)
    assert residual is x
    assert_close(out, x.double() @ layer.weight.double().T + layer.bias.double(), "LinearResidual")


# ---------------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(embed_dim=60, num_heads=8), "embed_dim"),
    (dict(num_heads_kv=3), "num_heads_kv"),
    (dict(rotary_emb_dim=8, cross_attn=True), "cross_attn"),
    (dict(use_alibi=True), "use_flash_attn"),
    (dict(window_size=(4, 0)), "use_flash_attn"),
])
def test_mha_constructor_errors_name_the_argument(kwargs, match):
    args = dict(embed_dim=E, num_heads=H)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MHA(**args)


def test_mha_forward_errors_name_the_argument():
    x = randn(2, 4, E)
    mask = torch.ones(2, 4, dtype=torch.bool, device=dev())
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=dev())
    with pytest.raises(ValueError, match="key_padding_mask"):
        _mha(use_flash_attn=True)(x, key_padding_mask=mask)
    with pytest.raises(ValueError, match="cu_seqlens"):
        _mha(use_flash_attn=False)(x.flatten(0, 1), cu_seqlens=cu, max_seqlen=4)
    with pytest.raises(ValueError, match="max_seqlen"):
        _mha(use_flash_attn=True)(x.flatten(0, 1), cu_seqlens=cu)
    with pytest.raises(ValueError, match="torch.int32"):
        _mha(use_flash_attn=True)(x.flatten(0, 1), cu_seqlens=cu.long(), max_seqlen=4)
    with pytest.raises(ValueError, match="x_kv"):
        _mha()(x, x_kv=x)
    with pytest.raises(ValueError, match="layer_idx"):
        _mha()(x, inference_params=InferenceParams(8, 2))
    with pytest.raises(ValueError, match="max_seqlen"):
        _mha(layer_idx=0)(x, inference_params=InferenceParams(3, 2))
    with pytest.raises(ValueError, match="max_batch_size"):
        _mha(layer_idx=0)(x, inference_params=InferenceParams(8, 1))
    with pytest.raises(NotImplementedError, match="dwconv"):
        _mha(dwconv=True, layer_idx=0)(x, inference_params=InferenceParams(8, 2))


def test_fused_bias_fc_is_accepted_and_ignored_like_upstream():
    # Upstream's MHA stopped using FusedDense ("Don't use FusedDense anymore", 2025): the flag is
    # still a parameter, its projections are nn.Linear either way.
    fused, plain = _mha(seed=1, fused_bias_fc=True), _mha(seed=1)
    assert type(fused.Wqkv) is nn.Linear
    x = randn(1, 3, E)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------


def gelu64(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def test_mlp_matches_oracle():
    torch.manual_seed(0)
    m = Mlp(E, hidden_features=48, out_features=32, device=dev())
    assert (m.fc1.out_features, m.fc2.out_features) == (48, 32)
    assert Mlp(E).fc1.out_features == 4 * E
    check_forward_backward(m, lambda p, x: linear(gelu64(linear(x, p, "fc1")), p, "fc2"), randn(2, 5, E))
    relu = Mlp(E, activation=F.relu, bias1=False, bias2=False, return_residual=True, device=dev())
    assert relu.fc1.bias is None and relu.fc2.bias is None
    x = randn(3, E, seed=1)
    out, residual = relu(x)
    assert residual is x
    assert_close(out, linear(torch.relu(linear(x.double(), params64(relu), "fc1")), params64(relu), "fc2"),
                 "relu mlp")


@pytest.mark.parametrize("activation", [F.sigmoid, F.silu, F.gelu], ids=["glu", "swiglu", "geglu"])
def test_gated_mlp_matches_oracle(activation):
    torch.manual_seed(0)
    m = GatedMlp(E, hidden_features=40, multiple_of=16, activation=activation, device=dev())
    assert m.fc1.out_features == 2 * 48 and m.fc2.in_features == 48  # 40 rounded up to 16s
    act64 = {F.sigmoid: torch.sigmoid, F.silu: lambda t: t * torch.sigmoid(t), F.gelu: gelu64}[activation]

    def oracle(p, x):
        value, gate = linear(x, p, "fc1").chunk(2, dim=-1)
        return linear(value * act64(gate), p, "fc2")

    check_forward_backward(m, oracle, randn(2, 5, E))


def test_gated_mlp_default_hidden_is_8_thirds_rounded_up():
    assert GatedMlp(96).fc2.in_features == 256  # int(8 * 96 / 3) = 256
    assert GatedMlp(100).fc2.in_features == 384  # 266 rounded up to 128s
    assert GatedMlp(100, multiple_of=1).fc2.in_features == 266


def test_fused_mlp_is_upstreams_fused_dense_mlp():
    """FusedMLP (tests/ports/test_fused_ops.py checks it against the oracle) is the Mlp computation."""
    fused, plain = FusedMLP(E, 2 * E, activation="relu").to(dev()), Mlp(E, 2 * E, activation=F.relu).to(dev())
    plain.load_state_dict(fused.state_dict())
    x = randn(2, 5, E)
    torch.testing.assert_close(fused(x), plain(x))


# ---------------------------------------------------------------------------------------------
# Block / ParallelBlock
# ---------------------------------------------------------------------------------------------


def layer_norm64(x, p, name, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"]


def _sub(p, prefix):
    return {n[len(prefix) + 1:]: t for n, t in p.items() if n.startswith(prefix + ".")}


def _block(prenorm=True, **kwargs):
    torch.manual_seed(0)
    mixer = lambda dim: MHA(dim, H, causal=True, use_flash_attn=True, device=dev())  # noqa: E731
    mlp = lambda dim: Mlp(dim, hidden_features=2 * dim, device=dev())  # noqa: E731
    block = Block(E, mixer_cls=mixer, mlp_cls=mlp, prenorm=prenorm, **kwargs)
    return block.to(dev())


def _mixer64(block, p, h):
    return mha_oracle(block.mixer, _sub(p, "mixer"), h)


def _mlp64(p, h):
    return linear(gelu64(linear(h, p, "mlp.fc1")), p, "mlp.fc2")


def test_prenorm_block_matches_oracle():
    block = _block(prenorm=True)
    x, residual = randn(2, 6, E, seed=1), randn(2, 6, E, seed=2)

    def oracle(p, x, residual):
        r1 = x + residual
        h = _mixer64(block, p, layer_norm64(r1, p, "norm1"))
        r2 = h + r1
        return _mlp64(p, layer_norm64(r2, p, "norm2")), r2

    check_forward_backward(block, lambda p, x, r: oracle(p, x, r)[0], x, residual)
    out, res = block(x, residual)
    assert_close(res, oracle(params64(block), x.double(), residual.double())[1], "residual out")
    # first block: no residual in, the same as a zero residual
    out0, res0 = block(x)
    ref_out, ref_res = oracle(params64(block), x.double(), torch.zeros_like(x, dtype=torch.float64))
    assert_close(out0, ref_out, "first block")
    assert_close(res0, ref_res, "first block residual")


def test_postnorm_block_matches_oracle():
    block = _block(prenorm=False)

    def oracle(p, x):
        h = layer_norm64(_mixer64(block, p, x) + x, p, "norm1")
        return layer_norm64(_mlp64(p, h) + h, p, "norm2")

    check_forward_backward(block, oracle, randn(2, 6, E, seed=3))
    with pytest.raises(ValueError, match="residual"):
        block(randn(2, 6, E), randn(2, 6, E))


def test_postnorm_block_with_return_residual_sublayers():
    torch.manual_seed(0)
    block = Block(E, mixer_cls=lambda d: MHA(d, H, return_residual=True, device=dev()),
                  mlp_cls=lambda d: Mlp(d, return_residual=True, device=dev()), prenorm=False,
                  return_residual=True).to(dev())

    def oracle(p, x):
        h = layer_norm64(_mixer64(block, p, x) + x, p, "norm1")
        return layer_norm64(_mlp64(p, h) + h, p, "norm2")

    check_forward_backward(block, oracle, randn(2, 6, E, seed=4))


def test_block_residual_in_fp32_and_identity_mlp():
    block = Block(E, mixer_cls=lambda d: MHA(d, H, device=dev()), mlp_cls=nn.Identity,
                  residual_in_fp32=True).to(device=dev(), dtype=torch.bfloat16)
    assert not hasattr(block, "norm2")
    x = randn(2, 3, E).bfloat16()
    hidden, residual = block(x)
    assert hidden.dtype == torch.bfloat16 and residual.dtype == torch.float32
    with pytest.raises(ValueError, match="residual_in_fp32"):
        Block(E, prenorm=False, residual_in_fp32=True)


def test_block_marks_norm_params_and_allocates_cache():
    block = Block(E, mixer_cls=lambda d: MHA(d, H, layer_idx=0), sequence_parallel=True,
                  mark_shared_params=True)
    for norm in (block.norm1, block.norm2):
        assert all(p._sequence_parallel and p._shared_params for p in norm.parameters())
    assert block.allocate_inference_cache(3, 5).shape == (3, 5, 2, H, D)
    assert isinstance(Block(128).mixer, MHA) and Block(128).mixer.num_heads == 2  # dim // 64


def test_stochastic_depth_drops_whole_rows_and_rescales():
    layer = StochasticDepth(0.25, mode="row")
    x = torch.ones(4000, 3, 2)
    torch.manual_seed(0)
    y = layer(x)
    per_row = y.flatten(1)
    assert ((per_row == 0).all(1) | (per_row == 1 / 0.75).all(1)).all()  # all-or-nothing per row
    dropped = (per_row[:, 0] == 0).double().mean().item()
    assert abs(dropped - 0.25) < 0.03
    assert layer.eval()(x) is x
    batch = StochasticDepth(0.5, mode="batch").train()(x)
    assert batch.unique().numel() == 1
    with pytest.raises(ValueError, match="p"):
        StochasticDepth(1.5)
    with pytest.raises(ValueError, match="mode"):
        StochasticDepth(0.1, mode="col")


def test_block_drop_path_in_training():
    # no MLP: the residual returned is drop_path1(x) + residual_in
    block = Block(E, mixer_cls=lambda d: MHA(d, H, device=dev()), mlp_cls=nn.Identity,
                  drop_path1=0.5).to(dev())
    block.train()
    x = randn(64, 2, E, seed=5)
    torch.manual_seed(1)
    _, residual = block(x, torch.zeros_like(x))
    kept = residual.flatten(1).abs().amax(1) > 0
    # a dropped row's residual is exactly 0, a kept one is 2x (1 / (1 - 0.5))
    assert 0 < kept.sum() < 64
    assert_close(residual[kept], 2 * x[kept].double(), "kept rows")


def test_parallel_block_matches_oracle():
    torch.manual_seed(0)
    block = ParallelBlock(E, mixer_cls=lambda d: MHA(d, H, causal=True, device=dev()),
                          mlp_cls=lambda d: Mlp(d, hidden_features=2 * d, device=dev())).to(dev())

    def oracle(p, h1, h2, residual):
        r = h1 + h2 + residual
        return _mixer64(block, p, layer_norm64(r, p, "norm1")), _mlp64(p, layer_norm64(r, p, "norm2")), r

    h1, h2, res = randn(2, 5, E, seed=6), randn(2, 5, E, seed=7), randn(2, 5, E, seed=8)
    for i in range(3):
        check_forward_backward(block, lambda p, a, b, c, i=i: oracle(p, a, b, c)[i], h1, h2, res,
                               pick=i)
        block.zero_grad(set_to_none=True)
    tied = ParallelBlock(E, mixer_cls=lambda d: MHA(d, H, device=dev()), tied_norm=True).to(dev())
    a, b, _ = tied(h1)
    assert not hasattr(tied, "norm2")
    assert_close(b, _mlp64(params64(tied), layer_norm64(h1.double(), params64(tied), "norm1")), "tied norm")


def _layer_norm_module():
    try:
        return importlib.import_module("flash_attn.ops.triton.layer_norm")
    except ImportError as exc:
        pytest.skip(f"flash_attn.ops.triton.layer_norm is not importable yet: {exc}")


@pytest.mark.parametrize("prenorm", [True, False], ids=["prenorm", "postnorm"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_fused_dropout_add_ln_block_matches_unfused(prenorm, norm):
    ln = _layer_norm_module()
    norm_cls = nn.LayerNorm if norm == "layer" else ln.RMSNorm
    blocks = []
    for fused in (False, True):
        torch.manual_seed(0)
        blocks.append(Block(E, mixer_cls=lambda d: MHA(d, H, causal=True, device=dev()),
                            norm_cls=norm_cls, prenorm=prenorm, fused_dropout_add_ln=fused).to(dev()))
    x, residual = randn(2, 5, E, seed=9), randn(2, 5, E, seed=10)
    args = (x, residual) if prenorm else (x,)
    plain, fused = blocks[0](*args), blocks[1](*args)
    for a, b in zip(plain if prenorm else [plain], fused if prenorm else [fused]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prenorm", [True, False], ids=["prenorm", "postnorm"])
def test_fused_drop_path_as_rowscale_matches_unfused(prenorm):
    """Stochastic depth reaches the fused norm as its per-row scale: with the same random rows
    dropped (same seed: both draw one Bernoulli per row), fused and unfused blocks agree."""
    _layer_norm_module()
    blocks = []
    for fused in (False, True):
        torch.manual_seed(0)
        blocks.append(Block(E, mixer_cls=lambda d: MHA(d, H, device=dev()), mlp_cls=nn.Identity,
                            prenorm=prenorm, drop_path1=0.5, fused_dropout_add_ln=fused).to(dev()).train())
    x, residual = randn(16, 3, E, seed=14), randn(16, 3, E, seed=15)
    args = (x, residual) if prenorm else (x,)
    outs = []
    for block in blocks:
        torch.manual_seed(7)
        out = block(*args)
        outs.append(out if prenorm else (out,))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied_norm", [False, True], ids=["two_norms", "tied_norm"])
def test_fused_dropout_add_ln_parallel_block_matches_unfused(tied_norm):
    _layer_norm_module()
    blocks = []
    for fused in (False, True):
        torch.manual_seed(0)
        blocks.append(ParallelBlock(E, mixer_cls=lambda d: MHA(d, H, device=dev()),
                                    tied_norm=tied_norm, fused_dropout_add_ln=fused).to(dev()))
    h1, h2, res = randn(2, 5, E, seed=11), randn(2, 5, E, seed=12), randn(2, 5, E, seed=13)
    for args in ((h1, h2, res), (h1,)):  # (h1,): the first block, no MLP output or residual yet
        for a, b in zip(blocks[0](*args), blocks[1](*args)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_fused_dropout_add_ln_refuses_other_norms():
    _layer_norm_module()
    with pytest.raises(ValueError, match="norm_cls"):
        Block(E, norm_cls=nn.Identity, fused_dropout_add_ln=True)


# ---------------------------------------------------------------------------------------------
# embeddings
# ---------------------------------------------------------------------------------------------


def test_gpt2_embeddings_match_oracle():
    torch.manual_seed(0)
    emb = GPT2Embeddings(E, 50, 16, device=dev())
    ids = torch.tensor([[3, 7, 49], [0, 1, 2]], device=dev())
    w, pos = emb.word_embeddings.weight.double(), emb.position_embeddings.weight.double()
    assert_close(emb(ids), w[ids] + pos[:3], "positions 0..")
    position_ids = torch.tensor([[5, 6, 7], [1, 1, 1]], device=dev())
    assert_close(emb(ids, position_ids), w[ids] + pos[position_ids], "explicit positions")
    proj = GPT2Embeddings(E, 50, 0, word_embed_proj_dim=8, padding_idx=0, device=dev())
    assert not hasattr(proj, "position_embeddings") and proj.project_in.bias is None
    expected = proj.word_embeddings.weight.double()[ids] @ proj.project_in.weight.double().T
    assert_close(proj(ids), expected, "word_embed_proj_dim")
    assert proj.word_embeddings.padding_idx == 0


def test_bert_embeddings_match_oracle():
    torch.manual_seed(0)
    emb = BertEmbeddings(E, 30, 10, 2, device=dev())
    ids = torch.tensor([[3, 7, 29, 1]], device=dev())
    types = torch.tensor([[0, 0, 1, 1]], device=dev())
    w = emb.word_embeddings.weight.double()
    pos, typ = emb.position_embeddings.weight.double(), emb.token_type_embeddings.weight.double()
    assert_close(emb(ids, token_type_ids=types), w[ids] + pos[:4] + typ[types], "with types")
    assert_close(emb(ids), w[ids] + pos[:4] + typ[0], "type 0 by default")
    bare = BertEmbeddings(E, 30, 0, 0, device=dev())
    assert_close(bare(ids), bare.word_embeddings.weight.double()[ids], "no positions, no types")


def test_parallel_embeddings_without_process_group_are_plain_embeddings():
    assert VocabParallelEmbedding(12, 4).weight.shape == (12, 4)
    assert ColumnParallelEmbedding(12, 4).weight.shape == (12, 4)
    emb = VocabParallelEmbedding(12, 4, padding_idx=1)
    ids = torch.tensor([[1, 11]])
    torch.testing.assert_close(emb(ids), emb.weight[ids], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# what is not provided says so
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["baichuan", "bert", "bigcode", "btlm", "falcon", "gpt", "gpt_neox", "gptj",
                                  "llama", "opt", "vit"])
def test_every_upstream_model_module_imports(name):
    """Upstream's model modules all exist (their behaviour: tests/ports/test_models_*.py)."""
    source = subprocess.run(["git", "-C", str(UPSTREAM_MIRROR), "show", f"{UPSTREAM_COMMIT}:flash_attn/models/{name}.py"],
                            capture_output=True, text=True) if UPSTREAM_MIRROR.exists() else None
    module = importlib.import_module(f"flash_attn.models.{name}")
    if source is not None and source.returncode == 0:  # every public function and class upstream defines
        tree = ast.parse(source.stdout)
        public = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}
        missing = sorted(n for n in public if not hasattr(module, n))
        assert not missing, f"flash_attn.models.{name} lacks upstream's {missing}"


def test_upstream_style_optional_import_finds_the_fused_dense_api():
    # upstream's modules do `try: from flash_attn.ops.fused_dense import ... except ImportError`
    try:
        from flash_attn.ops.fused_dense import FusedDense
    except ImportError:
        FusedDense = None
    assert FusedDense is not None and issubclass(FusedDense, torch.nn.Linear)


# ---------------------------------------------------------------------------------------------
# signatures: upstream's source, Dao-AILab/flash-attention commit
# 0251105a2fb19d2957484b7f023cd8c115286ced (flash_attn/__init__.py: 2.8.4), parsed with ast
# (parameter names, order and default expressions; `self` included)
# ---------------------------------------------------------------------------------------------

UPSTREAM_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"
UPSTREAM_SIGNATURES = {
    'flash_attn.modules.block.Block.__init__': 'self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout, prenorm=True, resid_dropout1=0.0, resid_dropout2=0.0, drop_path1=0.0, drop_path2=0.0, fused_dropout_add_ln=False, return_residual=False, residual_in_fp32=False, sequence_parallel=False, mark_shared_params=False',  # noqa: E501
    'flash_attn.modules.block.Block.allocate_inference_cache': 'self, batch_size, max_seqlen, dtype=None, **kwargs',
    'flash_attn.modules.block.Block.forward': 'self, hidden_states, residual=None, mixer_subset=None, mixer_kwargs=None',
    'flash_attn.modules.block.ParallelBlock.__init__': 'self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout, resid_dropout1=0.0, resid_dropout2=0.0, tied_norm=False, fused_dropout_add_ln=False, residual_in_fp32=False, sequence_parallel=False, mark_shared_params=False',  # noqa: E501
    'flash_attn.modules.block.ParallelBlock.allocate_inference_cache': 'self, batch_size, max_seqlen, dtype=None, **kwargs',
    'flash_attn.modules.block.ParallelBlock.forward': 'self, hidden_states1, hidden_states2=None, residual=None, mixer_kwargs=None',
    'flash_attn.modules.embedding.BertEmbeddings.__init__': 'self, embed_dim, vocab_size, max_position_embeddings, type_vocab_size, padding_idx=None, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.embedding.BertEmbeddings.forward': 'self, input_ids, position_ids=None, token_type_ids=None',
    'flash_attn.modules.embedding.ColumnParallelEmbedding.__init__': 'self, num_embeddings, embedding_dim, *args, process_group=None, **kwargs',
    'flash_attn.modules.embedding.GPT2Embeddings.__init__': 'self, embed_dim, vocab_size, max_position_embeddings, padding_idx=None, word_embed_proj_dim=None, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.embedding.GPT2Embeddings.forward': 'self, input_ids, position_ids=None',
    'flash_attn.modules.embedding.ParallelGPT2Embeddings.__init__': 'self, embed_dim, vocab_size, max_position_embeddings, process_group, padding_idx=None, sequence_parallel=True, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.embedding.ParallelGPT2Embeddings.forward': 'self, input_ids, position_ids=None, combine_batch_seqlen_dim=False',
    'flash_attn.modules.embedding.VocabParallelEmbedding.__init__': 'self, num_embeddings, *args, process_group=None, padding_idx=None, **kwargs',
    'flash_attn.modules.embedding.VocabParallelEmbedding.forward': 'self, input',
    'flash_attn.modules.mha.CrossAttention.__init__': 'self, causal=False, softmax_scale=None, attention_dropout=0.0',
    'flash_attn.modules.mha.CrossAttention.forward': 'self, q, kv, causal=None, key_padding_mask=None',
    'flash_attn.modules.mha.FlashCrossAttention.__init__': 'self, causal=False, softmax_scale=None, attention_dropout=0.0, alibi_slopes=None, window_size=(-1, -1), deterministic=False',  # noqa: E501
    'flash_attn.modules.mha.FlashCrossAttention.forward': 'self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None',
    'flash_attn.modules.mha.FlashSelfAttention.__init__': 'self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1), alibi_slopes=None, deterministic=False',  # noqa: E501
    'flash_attn.modules.mha.FlashSelfAttention.forward': 'self, qkv, causal=None, cu_seqlens=None, max_seqlen=None',
    'flash_attn.layers.patch_embed.PatchEmbed.__init__': 'self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None, flatten=True, bias=True, fused_bias_fc=False',  # noqa: E501
    'flash_attn.layers.patch_embed.PatchEmbed.forward': 'self, x',
    'flash_attn.modules.mha.MHA.__init__': 'self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True, out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None, dwconv=False, rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None, rotary_emb_interleaved=False, use_alibi=False, window_size=(-1, -1), fused_bias_fc=False, use_flash_attn=False, return_residual=False, checkpointing=False, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.mha.MHA._apply_rotary_update_kvcache_attention': 'self, q, kv, inference_params',
    'flash_attn.modules.mha.MHA._update_kv_cache': 'self, kv, inference_params',
    'flash_attn.modules.mha.MHA._update_kvcache_attention': 'self, q, kv, inference_params',
    'flash_attn.modules.mha.MHA.allocate_inference_cache': 'self, batch_size, max_seqlen, dtype=None',
    'flash_attn.modules.mha.MHA.forward': 'self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None, inference_params=None, **kwargs',  # noqa: E501
    'flash_attn.modules.mha.ParallelMHA.__init__': 'self, embed_dim, num_heads, process_group, num_heads_kv=None, qkv_proj_bias=True, out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None, rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None, rotary_emb_interleaved=False, use_alibi=False, window_size=(-1, -1), use_flash_attn=False, checkpointing=False, sequence_parallel=True, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.mha.ParallelMHA._apply_rotary_update_kvcache_attention': 'self, q, kv, inference_params',
    'flash_attn.modules.mha.ParallelMHA._update_kv_cache': 'self, kv, inference_params',
    'flash_attn.modules.mha.ParallelMHA._update_kvcache_attention': 'self, q, kv, inference_params',
    'flash_attn.modules.mha.ParallelMHA.allocate_inference_cache': 'self, batch_size, max_seqlen, dtype=None',
    'flash_attn.modules.mha.ParallelMHA.forward': 'self, x, seqlen=None, inference_params=None, **kwargs',
    'flash_attn.modules.mha.SelfAttention.__init__': 'self, causal=False, softmax_scale=None, attention_dropout=0.0',
    'flash_attn.modules.mha.SelfAttention.forward': 'self, qkv, causal=None, key_padding_mask=None',
    'flash_attn.modules.mha._update_kv_cache': 'kv, inference_params, layer_idx',
    'flash_attn.modules.mha.get_alibi_slopes': 'nheads',
    'flash_attn.modules.mlp.GatedMlp.__init__': 'self, in_features, hidden_features=None, out_features=None, activation=F.sigmoid, bias1=True, bias2=True, multiple_of=128, return_residual=False, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.mlp.GatedMlp.forward': 'self, x',
    'flash_attn.modules.mlp.Mlp.__init__': 'self, in_features, hidden_features=None, out_features=None, activation=F.gelu, bias1=True, bias2=True, return_residual=False, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.mlp.Mlp.forward': 'self, x',
    'flash_attn.modules.mlp.ParallelGatedMlp.__init__': 'self, in_features, process_group, hidden_features=None, out_features=None, activation=F.sigmoid, bias1=True, bias2=True, multiple_of=128, sequence_parallel=True, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.mlp.ParallelGatedMlp.forward': 'self, x',
    'flash_attn.modules.mlp.ParallelMLP.__init__': 'self, in_features, hidden_features=None, out_features=None, activation=F.gelu, process_group=None, sequence_parallel=True, bias1=True, bias2=True, device=None, dtype=None',  # noqa: E501
    'flash_attn.modules.mlp.ParallelMLP.forward': 'self, x',
    'flash_attn.utils.distributed.all_gather_raw': 'input_, process_group, async_op=False',
    'flash_attn.utils.distributed.all_reduce_raw': 'input_, process_group, async_op=False',
    'flash_attn.utils.distributed.allreduce_sequence_parallel_grad': 'model, process_group',
    'flash_attn.utils.distributed.get_dim_for_local_rank': 'dim, world_size, local_rank, multiple_of=1',
    'flash_attn.utils.distributed.reduce_scatter_raw': 'input_, process_group, async_op=False',
    'flash_attn.utils.distributed.sync_shared_params': 'model, process_group',
    'flash_attn.utils.generation.GenerationMixin.allocate_inference_cache': 'self, batch_size, max_seqlen, dtype=None, **kwargs',
    'flash_attn.utils.generation.GenerationMixin.generate': 'self, input_ids, max_length, top_k=1, top_p=0.0, temperature=1.0, return_dict_in_generate=False, output_scores=False, **kwargs',  # noqa: E501
    'flash_attn.utils.generation.allocate_inference_cache': 'max_batch_size, max_seqlen, nheads, headdim, layers, device, dtype=torch.float16',
    'flash_attn.utils.generation.decode': 'input_ids, model, max_length, top_k=1, top_p=0.0, temperature=1.0, eos_token_id=None, teacher_outputs=None, vocab_size=None, tensor_parallel=1, cg=False, enable_timing=False',  # noqa: E501
    'flash_attn.utils.generation.modify_logits_for_top_k_filtering': 'logits, top_k',
    'flash_attn.utils.generation.modify_logits_for_top_p_filtering': 'logits, top_p',
    'flash_attn.utils.generation.sample': 'logits, top_k=1, top_p=0.0, temperature=1.0',
    # the models, upstream's other utils and its Triton linear / MLP / activation helpers (its
    # autotuning internals init_to_zero, get_configs_io_bound, kernel_fwd and kernel_bwd are not
    # reproduced: our kernels use a fixed tile table)
    'flash_attn.models.gpt.create_mixer_cls': 'config, layer_idx=None, process_group=None, device=None, dtype=None',
    'flash_attn.models.gpt.create_mlp_cls': 'config, layer_idx=None, process_group=None, device=None, dtype=None',
    'flash_attn.models.gpt.create_block': 'config, layer_idx=None, process_group=None, device=None, dtype=None',
    'flash_attn.models.gpt.GPTPreTrainedModel.__init__': 'self, config, *inputs, **kwargs',
    'flash_attn.models.gpt.GPTPreTrainedModel.from_pretrained': 'cls, model_name, config, *args, strict=True, device=None, dtype=None, world_size=1, rank=0, **kwargs',  # noqa: E501
    'flash_attn.models.gpt.GPTModel.__init__': 'self, config: GPT2Config, process_group=None, device=None, dtype=None',
    'flash_attn.models.gpt.GPTModel.tie_weights': 'self',
    'flash_attn.models.gpt.GPTModel.allocate_inference_cache': 'self, batch_size, max_seqlen, dtype=None, **kwargs',
    'flash_attn.models.gpt.GPTModel.forward': 'self, input_ids, position_ids=None, inference_params=None',
    'flash_attn.models.gpt.GPTLMHeadModel.__init__': 'self, config: GPT2Config, process_group=None, device=None, dtype=None',  # noqa: E501
    'flash_attn.models.gpt.GPTLMHeadModel.tie_weights': 'self',
    'flash_attn.models.gpt.GPTLMHeadModel.allocate_inference_cache': 'self, batch_size, max_seqlen, dtype=None, **kwargs',  # noqa: E501
    'flash_attn.models.gpt.GPTLMHeadModel.forward': 'self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0',  # noqa: E501
    'flash_attn.models.gpt.GPTLMHeadModel.load_state_dict': 'self, state_dict, strict=True',
    'flash_attn.models.gpt.shard_state_dict_tp': 'state_dict, config, world_size, rank',
    'flash_attn.models.gpt.combine_state_dicts_tp': 'state_dicts: List[Dict[str, torch.Tensor]], config: GPT2Config',
    'flash_attn.models.gpt.remap_state_dict_hf_gpt2': 'state_dict, config',
    'flash_attn.models.gpt.remap_state_dict_megatron': 'state_dict, config',
    'flash_attn.models.llama.remap_state_dict_meta_llama': 'state_dict: Dict[str, torch.Tensor], config: GPT2Config',
    'flash_attn.models.llama.remap_state_dict_hf_llama': 'state_dict: Dict[str, torch.Tensor], config: GPT2Config',
    'flash_attn.models.llama.inv_remap_state_dict_hf_llama': 'state_dict: Dict[str, torch.Tensor], config: GPT2Config',
    'flash_attn.models.llama.config_from_meta_checkpoint': 'checkpoint_path: Union[str, os.PathLike], model_name: str',
    'flash_attn.models.llama.config_from_hf_checkpoint': 'checkpoint_path: Union[str, os.PathLike], model_name: str',
    'flash_attn.models.llama.config_from_checkpoint': "checkpoint_path: Union[str, os.PathLike], model_name: str, checkpoint_format='meta'",  # noqa: E501
    'flash_attn.models.llama.state_dicts_from_checkpoint': 'checkpoint_path: Union[str, os.PathLike], model_name: str',
    'flash_attn.models.llama.llama_config_to_gpt2_config': 'llama_config: LlamaConfig',
    'flash_attn.models.bert.create_mixer_cls': 'config, cross_attn=False, return_residual=False',
    'flash_attn.models.bert.create_mlp_cls': 'config, layer_idx=None, return_residual=False',
    'flash_attn.models.bert.create_block': 'config, layer_idx=None',
    'flash_attn.models.bert.BertEncoder.__init__': 'self, config: BertConfig',
    'flash_attn.models.bert.BertEncoder.forward': 'self, hidden_states, key_padding_mask=None, subset_mask=None',
    'flash_attn.models.bert.BertPooler.__init__': 'self, config',
    'flash_attn.models.bert.BertPooler.forward': 'self, hidden_states, pool=True',
    'flash_attn.models.bert.BertPredictionHeadTransform.__init__': 'self, config',
    'flash_attn.models.bert.BertPredictionHeadTransform.forward': 'self, hidden_states: torch.Tensor',
    'flash_attn.models.bert.BertLMPredictionHead.__init__': 'self, config',
    'flash_attn.models.bert.BertLMPredictionHead.forward': 'self, hidden_states',
    'flash_attn.models.bert.BertPreTrainingHeads.__init__': 'self, config',
    'flash_attn.models.bert.BertPreTrainingHeads.forward': 'self, sequence_output, pooled_output',
    'flash_attn.models.bert.BertPreTrainedModel.__init__': 'self, config, *inputs, **kwargs',
    'flash_attn.models.bert.BertPreTrainedModel.from_pretrained': 'cls, model_name, config, *inputs, **kwargs',
    'flash_attn.models.bert.BertModel.__init__': 'self, config: BertConfig, add_pooling_layer=True',
    'flash_attn.models.bert.BertModel.forward': 'self, input_ids, position_ids=None, token_type_ids=None, attention_mask=None, masked_tokens_mask=None',  # noqa: E501
    'flash_attn.models.bert.BertForPreTraining.__init__': 'self, config: BertConfig',
    'flash_attn.models.bert.BertForPreTraining.tie_weights': 'self',
    'flash_attn.models.bert.BertForPreTraining.forward': 'self, input_ids, position_ids=None, token_type_ids=None, attention_mask=None, labels=None, next_sentence_label=None',  # noqa: E501
    'flash_attn.models.bert.remap_state_dict': 'state_dict, config: PretrainedConfig',
    'flash_attn.models.bert.inv_remap_state_dict': 'state_dict, config: PretrainedConfig',
    'flash_attn.models.vit.create_mixer_cls': 'num_heads, qkv_bias, attn_drop, use_flash_attn, fused_bias_fc, cross_attn=False',  # noqa: E501
    'flash_attn.models.vit.create_mlp_cls': 'embed_dim, mlp_ratio, act_layer, fused_mlp',
    'flash_attn.models.vit.create_block': 'embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, drop_path1, drop_path2, norm_layer, act_layer, use_flash_attn, fused_bias_fc, fused_mlp, fused_dropout_add_ln, layer_idx=None, n_layer=None, last_layer_subset=False',  # noqa: E501
    'flash_attn.models.vit.VisionTransformer.__init__': "self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool='token', embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=True, init_values=None, class_token=True, no_embed_class=False, pre_norm=False, fc_norm=None, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0, weight_init='', embed_layer=PatchEmbed, norm_layer=None, act_layer=None, use_flash_attn=False, fused_bias_fc=False, fused_mlp=False, fused_dropout_add_ln=False",  # noqa: E501
    'flash_attn.models.vit.VisionTransformer.init_weights': "self, mode=''",
    'flash_attn.models.vit.VisionTransformer.no_weight_decay': 'self',
    'flash_attn.models.vit.VisionTransformer.forward_features': 'self, x, all_tokens=True',
    'flash_attn.models.vit.VisionTransformer.forward_head': 'self, x, pre_logits: bool=False',
    'flash_attn.models.vit.VisionTransformer.forward': 'self, x',
    'flash_attn.models.vit.VisionTransformer.load_state_dict': 'self, state_dict, strict=True',
    'flash_attn.models.vit.init_weights_vit_timm': "module: nn.Module, name: str=''",
    'flash_attn.models.vit.vit_base_patch16_224': 'pretrained=False, **kwargs',
    'flash_attn.models.opt.remap_state_dict_hf_opt': 'state_dict, config',
    'flash_attn.models.opt.opt_config_to_gpt2_config': 'opt_config: OPTConfig',
    'flash_attn.models.falcon.remap_state_dict_hf_falcon': 'state_dict, config',
    'flash_attn.models.falcon.falcon_config_to_gpt2_config': 'falcon_config: FalconConfig',
    'flash_attn.models.gptj.remap_state_dict_hf_gptj': 'state_dict, config',
    'flash_attn.models.gptj.gptj_config_to_gpt2_config': 'gptj_config: GPTJConfig',
    'flash_attn.models.gpt_neox.remap_state_dict_hf_gpt_neox': 'state_dict, config',
    'flash_attn.models.gpt_neox.gpt_neox_config_to_gpt2_config': 'gpt_neox_config: GPTNeoXConfig',
    'flash_attn.models.bigcode.remap_state_dict_hf_bigcode': 'state_dict, config: PretrainedConfig',
    'flash_attn.models.bigcode.inv_remap_state_dict_hf_bigcode': 'state_dict, config: PretrainedConfig',
    'flash_attn.models.bigcode.bigcode_config_to_gpt2_config': 'bigcode_config: GPTBigCodeConfig',
    'flash_attn.models.baichuan.remap_state_dict_hf_baichuan': 'state_dict, config',
    'flash_attn.models.baichuan.baichuan_config_to_gpt2_config': 'baichuan_config: PretrainedConfig',
    'flash_attn.models.btlm.remap_state_dict_hf_btlm': 'state_dict, config',
    'flash_attn.models.btlm.btlm_config_to_gpt2_config': 'btlm_config: PretrainedConfig',
    'flash_attn.utils.pretrained.state_dict_from_pretrained': 'model_name, device=None, dtype=None',
    'flash_attn.utils.torch.custom_amp_decorator': 'dec: Callable, cuda_amp_deprecated: bool',
    'flash_attn.utils.testing.generate_random_padding_mask': "max_seqlen, batch_size, device, mode='random', zero_lengths=False",  # noqa: E501
    'flash_attn.utils.testing.generate_qkv': 'q, k, v, query_padding_mask=None, key_padding_mask=None, qv=None, kvpacked=False, qkvpacked=False, query_unused_mask=None, key_unused_mask=None',  # noqa: E501
    'flash_attn.utils.testing.construct_local_mask': 'seqlen_q, seqlen_k, window_size=(None, None), sink_token_length=0, query_padding_mask=None, key_padding_mask=None, key_leftpad=None, device=None',  # noqa: E501
    'flash_attn.utils.testing.construct_chunk_mask': 'seqlen_q, seqlen_k, attention_chunk, query_padding_mask=None, key_padding_mask=None, key_leftpad=None, device=None',  # noqa: E501
    'flash_attn.utils.testing.attention_ref': 'q, k, v, query_padding_mask=None, key_padding_mask=None, key_leftpad=None, attn_bias=None, dropout_p=0.0, dropout_mask=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None, window_size=(None, None), attention_chunk=0, sink_token_length=0, learnable_sink: Optional[torch.Tensor]=None, softcap=0.0, upcast=True, reorder_ops=False, intermediate_dtype=None',  # noqa: E501
    'flash_attn.utils.library.triton_op': 'name: str, fn: Optional[Callable]=None, /, *, mutates_args: Union[str, Iterable[str]], schema: Optional[str]=None, allow_decomposition=True',  # noqa: E501
    'flash_attn.utils.generation.InferenceParams.reset': 'self, max_seqlen, max_batch_size',
    'flash_attn.utils.generation.sample_speculative': 'logits, logits_draft, tokens_draft, top_k=1, top_p=0.0, temperature=1.0',  # noqa: E501
    'flash_attn.utils.generation.decode_speculative': 'input_ids, model, model_draft, max_length, speculative_lookahead=3, top_k=1, top_p=0.0, temperature=1.0, eos_token_id=None, vocab_size=None, tensor_parallel=1, cg=False, enable_timing=False, debug=False',  # noqa: E501
    'flash_attn.utils.generation.update_graph_cache': 'model, cache, batch_size, seqlen_og, max_seqlen, decoding_seqlens=(1,), tensor_parallel=1, dtype=None, n_warmups=2',  # noqa: E501
    'flash_attn.utils.generation.capture_graph': 'model, inference_params, batch_size, max_seqlen, decoding_seqlen=1, mempool=None, n_warmups=2',  # noqa: E501
    'flash_attn.ops.triton.linear.triton_linear_act': "x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]=None, activation: str='id', save_act_input: bool=False",  # noqa: E501
    'flash_attn.ops.triton.linear.triton_dgrad_act': "grad_output: torch.Tensor, weight: torch.Tensor, activation: str='id', act_input: Optional[torch.Tensor]=None",  # noqa: E501
    'flash_attn.ops.triton.mlp.FusedDenseSqreluDenseFunc.forward': 'ctx, x, weight1, bias1, weight2, bias2, checkpoint_lvl=0',  # noqa: E501
    'flash_attn.ops.triton.mlp.FusedDenseSqreluDenseFunc.backward': 'ctx, grad_output',
    'flash_attn.ops.triton.mlp.FusedDenseSqreluDense.__init__': 'self, in_features, hidden_features=None, out_features=None, bias1=True, bias2=True, checkpoint_lvl=0, device=None, dtype=None',  # noqa: E501
    'flash_attn.ops.triton.mlp.FusedDenseSqreluDense.forward': 'self, x',
    'flash_attn.ops.triton.k_activations.get_triton_activation_kernel': 'activation: Optional[Activation]',
    'flash_attn.ops.triton.k_activations.get_triton_activation_bwd_kernel': 'activation: Optional[Activation]',
    'flash_attn.ops.triton.k_activations.tanh': 'x',
    'flash_attn.ops.triton.k_activations.cosh': 'x',
    'flash_attn.ops.triton.k_activations.relu': 'x',
    'flash_attn.ops.triton.k_activations.relu_grad': 'x',
    'flash_attn.ops.triton.k_activations.squared_relu': 'x',
    'flash_attn.ops.triton.k_activations.squared_relu_grad': 'x',
    'flash_attn.ops.triton.k_activations.leaky_relu': 'x',
    'flash_attn.ops.triton.k_activations.leaky_relu_grad': 'x',
    'flash_attn.ops.triton.k_activations.gelu': 'x',
    'flash_attn.ops.triton.k_activations.gelu_grad': 'x',
    'flash_attn.ops.triton.k_activations.gelu_approx': 'x',
    'flash_attn.ops.triton.k_activations.gelu_approx_grad': 'x',
}
def _defaults_namespace() -> dict:
    from flash_attn.layers.patch_embed import PatchEmbed  # noqa: PLC0415

    return {"nn": nn, "F": F, "torch": torch, "PatchEmbed": PatchEmbed}


_DEFAULTS_NAMESPACE = _defaults_namespace()


def parse_signature(text: str):
    """``[(name, default-or-REQUIRED)]`` of a parameter list written as Python source; ``*args``
    and ``**kwargs`` appear as ``"*args"`` / ``"**kwargs"``."""
    args = ast.parse(f"def f({text}): pass").body[0].args
    out = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(positional, defaults):
        out.append((arg.arg, inspect.Parameter.empty if default is None
                    else eval(ast.unparse(default), dict(_DEFAULTS_NAMESPACE))))
    if args.vararg:
        out.append(("*" + args.vararg.arg, inspect.Parameter.empty))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append((arg.arg, inspect.Parameter.empty if default is None
                    else eval(ast.unparse(default), dict(_DEFAULTS_NAMESPACE))))
    if args.kwarg:
        out.append(("**" + args.kwarg.arg, inspect.Parameter.empty))
    return out


def ours(qualified: str):
    parts = qualified.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualified)


def our_parameters(fn):
    if inspect.ismethod(fn) and isinstance(fn.__self__, type):  # a classmethod: upstream's source has cls
        fn = fn.__func__
    fn = getattr(fn, "fn", fn)  # a Triton JIT function: the Python function it compiles
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append((prefix + p.name, p.default))
    return out


@pytest.mark.parametrize("name", sorted(UPSTREAM_SIGNATURES))
def test_signature_matches_upstream(name):
    assert our_parameters(ours(name)) == parse_signature(UPSTREAM_SIGNATURES[name]), name


def test_inference_params_fields_match_upstream():
    import dataclasses

    fields = [(f.name, f.default if f.default is not dataclasses.MISSING else "factory"
               if f.default_factory is not dataclasses.MISSING else "required")
              for f in dataclasses.fields(InferenceParams)]
    assert fields == [("max_seqlen", "required"), ("max_batch_size", "required"), ("seqlen_offset", 0),
                      ("batch_size_offset", 0), ("key_value_memory_dict", "factory"),
                      ("lengths_per_sample", None)]


UPSTREAM_MIRROR = Path("/work/.mirror/Dao-AILab+flash-attention/repo")


def test_recorded_signatures_are_upstreams_source():
    """Where upstream's git mirror is at hand, the table above is what its source says."""
    if not UPSTREAM_MIRROR.exists() or shutil.which("git") is None:
        pytest.skip("upstream's git mirror is not on this machine; the table above is the record")
    files = set(subprocess.run(["git", "-C", str(UPSTREAM_MIRROR), "ls-tree", "-r", "--name-only", UPSTREAM_COMMIT],
                               capture_output=True, text=True, check=True).stdout.split())
    for name, text in UPSTREAM_SIGNATURES.items():
        module_parts = name.split(".")
        n = next(n for n in range(len(module_parts), 0, -1) if "/".join(module_parts[:n]) + ".py" in files)
        path = "/".join(module_parts[:n]) + ".py"
        source = subprocess.run(["git", "-C", str(UPSTREAM_MIRROR), "show", f"{UPSTREAM_COMMIT}:{path}"],
                                capture_output=True, text=True, check=True).stdout
        node = ast.parse(source)
        for attr in module_parts[n:]:
            node = next(c for c in node.body if isinstance(c, (ast.ClassDef, ast.FunctionDef))
                        and c.name == attr)
        upstream = ast.unparse(node.args)
        assert parse_signature(upstream) == parse_signature(text), name


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


# rotary: q rotated in place, k inside the packed kv (GQA) or q and k inside the packed qkv (MHA)
@pytest.mark.parametrize("rotary", [None, "gqa", "packed"])
@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
def test_mha_compiles_fullgraph_and_matches_eager(use_flash_attn, rotary):
    if dev().type == "cpu" and shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("inductor on CPU needs a C compiler")
    m = _mha(use_flash_attn=use_flash_attn, causal=True, num_heads_kv=H if rotary == "packed" else 2,
             rotary_emb_dim=8 if rotary else 0)
    x = randn(2, 6, E, seed=20)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    x_e, x_c = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_e, out_c = m(x_e), compiled(x_c)
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    out_e.sum().backward()
    out_c.sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, rtol=1e-4, atol=1e-5)
