"""The reference backend (and the cpu backend) against an independent, naive float64 attention.

The oracle below builds the full score matrix and the masks straight from the formulas of
:class:`flash_attn.params.AttentionParams`; gradients come from autograd on it. Tests run the
reference's tiled engine with tiny chunks (its ``chunks`` parameter), so the online softmax and
the tile skipping run across many ragged chunks; the tests taking the ``engine`` fixture also run
on the cpu backend (PyTorch's fused CPU kernels where they apply, the tiled engine elsewhere).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flash_attn.backends import _layouts
from flash_attn.backends import _reference_core as core
from flash_attn.backends import cpu
from flash_attn.backends import reference as reference_backend
from flash_attn.dropout import keep_mask
from flash_attn.params import AttentionParams, KVCacheInputs, VarlenLayout

INF = float("inf")


class _Chunked:
    """The reference backend with ``chunks`` (query rows x key columns per tile) given to every
    call unless the call gives its own: ragged 5 x 7 chunks here."""

    def __init__(self, chunks):
        self.chunks = chunks

    def forward(self, *args, **kwargs):
        return reference_backend.forward(*args, **{"chunks": self.chunks, **kwargs})

    def backward(self, *args, **kwargs):
        return reference_backend.backward(*args, **{"chunks": self.chunks, **kwargs})

    def forward_kvcache(self, *args, **kwargs):
        return reference_backend.forward_kvcache(*args, **{"chunks": self.chunks, **kwargs})


reference = _Chunked((5, 7))


def _tiled(tuning: core.Tuning, chunks=None) -> _layouts.Engine:
    """The tiled engine with ``tuning``'s budgets (and ``chunks``, when given, instead of the tile budget's)."""
    return _layouts.Engine(
        forward=lambda problem, params, return_softmax: core.attention_forward(problem, params, chunks, tuning),
        backward=lambda problem, params, dout, out, lse: core.attention_backward(
            problem, params, dout, out, lse, chunks, tuning),
        probabilities=lambda problem, params, lse, sk: core.softmax_with_dropout_signs(
            problem, params, lse, sk, chunks, tuning),
    )


@pytest.fixture(params=["reference", "cpu"])
def engine(request):
    """Runs a test twice: on the reference's tiled engine (ragged chunks), and on the cpu backend
    (the fused CPU kernels where they apply)."""
    return reference if request.param == "reference" else cpu


# ----------------------------------------------------------------------------------------------
# The naive float64 oracle
# ----------------------------------------------------------------------------------------------


def naive_attention(q, k, v, *, scale, window=(-1, -1), softcap=0.0, slopes=None, keep=None, dropout_p=0.0):
    """One sequence: q ``(sq, h, d)``, k/v ``(sk, hk, d)`` (float64, may require grad).

    Returns ``out (sq, h, d)``, ``lse (h, sq)`` (+inf on rows that see no key) and the softmax
    probabilities ``(h, sq, sk)``. ``keep`` (bool ``(h, sq, sk)``) applies dropout.
    """
    sq, h, _ = q.shape
    sk, hk, _ = k.shape
    group = h // hk
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k_rep) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    diagonal = i + sk - sq
    if slopes is not None:
        s = s - slopes.to(s.dtype).view(h, 1, 1) * (diagonal - j).abs()
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if window[0] >= 0:
        visible &= j >= diagonal - window[0]
    if window[1] >= 0:
        visible &= j <= diagonal + window[1]
    s = s.masked_fill(~visible, -INF)
    empty = ~visible.any(-1).view(1, sq, 1)
    s_safe = s.masked_fill(empty, 0.0)  # keeps autograd NaN-free on rows without keys
    probs = torch.softmax(s_safe, -1) * ~empty
    lse = torch.logsumexp(s_safe, -1).masked_fill(empty.view(1, sq), INF)
    weights = probs if keep is None else probs * keep / (1 - dropout_p)
    out = torch.einsum("hqk,khd->qhd", weights, v_rep)
    return out, lse, probs


def naive_with_grads(q, k, v, dout, **kwargs):
    """Oracle out/lse/probs plus dq, dk, dv (autograd) for one sequence, in float64."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse, probs = naive_attention(q, k, v, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), lse.detach(), probs.detach(), dq, dk, dv


def close(actual, expected, atol=2e-5, rtol=2e-5):
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def random_qkv(b, sq, sk, h, hk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    return make(b, sq, h, d), make(b, sk, hk, d), make(b, sk, hk, d), make(b, sq, h, d)


def params_for(d, window=(-1, -1), softcap=0.0, dropout_p=0.0, seed=0):
    return AttentionParams(1 / math.sqrt(d), window[0], window[1], softcap, dropout_p, seed)


# ----------------------------------------------------------------------------------------------
# Dense
# ----------------------------------------------------------------------------------------------

DENSE_CASES = {
    "mha": dict(sq=13, sk=17, h=4, hk=4),
    "gqa_causal_sq<sk": dict(sq=13, sk=29, h=4, hk=2, window=(-1, 0)),
    "mqa_causal_sq>sk": dict(sq=29, sk=13, h=4, hk=1, window=(-1, 0)),
    "window_both": dict(sq=20, sk=20, h=2, hk=2, window=(3, 2)),
    "window_left_causal": dict(sq=10, sk=25, h=2, hk=1, window=(4, 0)),
    "window_left_only": dict(sq=18, sk=11, h=2, hk=2, window=(5, -1)),
    "window_right_only_sq>sk": dict(sq=18, sk=11, h=2, hk=2, window=(-1, 3)),
    "softcap_causal": dict(sq=15, sk=15, h=4, hk=2, window=(-1, 0), softcap=1.5),
    "alibi_h_causal": dict(sq=12, sk=19, h=4, hk=2, window=(-1, 0), alibi="h"),
    "alibi_bh": dict(sq=12, sk=19, h=4, hk=4, alibi="bh"),
    "alibi_window_softcap": dict(sq=16, sk=9, h=4, hk=1, window=(2, 1), softcap=3.0, alibi="bh"),
}


def _slopes(kind, b, h):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(7)
    return torch.rand((h,) if kind == "h" else (b, h), generator=g) * 0.5


@pytest.mark.parametrize("case", DENSE_CASES, ids=list(DENSE_CASES))
def test_dense_forward_backward_match_naive(case, engine):
    cfg = dict(DENSE_CASES[case])
    b, d = 2, 16
    q, k, v, dout = random_qkv(b, cfg["sq"], cfg["sk"], cfg["h"], cfg["hk"], d)
    window, softcap = cfg.get("window", (-1, -1)), cfg.get("softcap", 0.0)
    slopes = _slopes(cfg.get("alibi"), b, cfg["h"])
    params = params_for(d, window, softcap)
    out, lse, s_dmask = engine.forward(q, k, v, params, alibi_slopes=slopes)
    assert s_dmask is None and out.dtype == q.dtype and lse.dtype == torch.float32
    dq, dk, dv = engine.backward(dout, q, k, v, out, lse, params, alibi_slopes=slopes)
    assert not any(torch.isnan(x).any() for x in (out, lse, dq, dk, dv))
    for i in range(b):
        row_slopes = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[i])
        ref = naive_with_grads(q[i], k[i], v[i], dout[i], scale=params.softmax_scale, window=window,
                               softcap=softcap, slopes=row_slopes)
        close(out[i], ref[0])
        close(lse[i], ref[1])
        for got, want in zip((dq[i], dk[i], dv[i]), ref[3:]):
            close(got, want, atol=1e-4, rtol=1e-4)


def test_rows_without_keys_give_zero_out_inf_lse_and_zero_grads(engine):
    # Causal with sq > sk: the first sq - sk rows see nothing; a tiny window empties more.
    q, k, v, dout = random_qkv(1, 12, 5, 2, 2, 8)
    for window in [(-1, 0), (0, 0)]:
        params = params_for(8, window)
        out, lse, _ = engine.forward(q, k, v, params)
        dq, dk, dv = engine.backward(dout, q, k, v, out, lse, params)
        assert torch.all(out[0, :7] == 0) and torch.all(lse[0, :, :7] == INF)
        assert torch.all(dq[0, :7] == 0)
        assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
        ref = naive_with_grads(q[0], k[0], v[0], dout[0], scale=params.softmax_scale, window=window)
        close(out[0], ref[0])
        for got, want in zip((dq[0], dk[0], dv[0]), ref[3:]):
            close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preload", [True, False], ids=["kv-converted-once", "kv-per-tile"])
@pytest.mark.parametrize("chunks", [(1, 1), (3, 64), (64, 2), None])
def test_chunk_shapes_do_not_change_the_result(chunks, preload):
    tuning = core.DEFAULT_TUNING if preload else core.Tuning(preload_budget_bytes=0)
    engine = _tiled(tuning, chunks)
    q, k, v, dout = random_qkv(2, 11, 14, 2, 1, 8, seed=3)
    params = params_for(8, (6, 0), softcap=2.0)
    out, lse, _ = _layouts.forward(engine, q, k, v, params)
    dq, dk, dv = _layouts.backward(engine, dout, q, k, v, out, lse, params)
    ref = naive_with_grads(q[1], k[1], v[1], dout[1], scale=params.softmax_scale, window=(6, 0), softcap=2.0)
    close(out[1], ref[0])
    close(lse[1], ref[1])
    for got, want in zip((dq[1], dk[1], dv[1]), ref[3:]):
        close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype, engine):
    q, k, v, dout = random_qkv(2, 21, 33, 4, 2, 16, dtype=dtype)
    params = params_for(16, (-1, 0))
    out, lse, _ = engine.forward(q, k, v, params)
    dq, dk, dv = engine.backward(dout, q, k, v, out, lse, params)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-2 if dtype == torch.float16 else 4e-2
    for i in range(2):
        ref = naive_with_grads(q[i], k[i], v[i], dout[i], scale=params.softmax_scale, window=(-1, 0))
        close(out[i], ref[0], atol=tol, rtol=tol)
        close(lse[i], ref[1], atol=1e-3, rtol=1e-3)  # lse is fp32 from exact (upcast) inputs
        for got, want in zip((dq[i], dk[i], dv[i]), ref[3:]):
            close(got, want, atol=4 * tol, rtol=4 * tol)


def test_return_softmax_without_dropout_is_the_probabilities():
    q, k, v, _ = random_qkv(2, 9, 12, 2, 2, 8)
    params = params_for(8, (-1, 0))
    _, _, s_dmask = reference.forward(q, k, v, params, return_softmax=True)
    assert s_dmask.shape == (2, 2, 9, 12) and s_dmask.dtype == torch.float32
    for i in range(2):
        probs = naive_attention(q[i].double(), k[i].double(), v[i].double(), scale=params.softmax_scale, window=(-1, 0))[2]
        close(s_dmask[i], probs)


# ----------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------


def test_dense_dropout_matches_oracle_with_mask_from_s_dmask():
    b, sq, sk, h, hk, d, p = 2, 14, 19, 4, 2, 8, 0.3
    q, k, v, dout = random_qkv(b, sq, sk, h, hk, d, seed=5)
    params = params_for(d, (-1, 0), dropout_p=p, seed=123456789)
    out, lse, s_dmask = reference.forward(q, k, v, params, return_softmax=True)
    dq, dk, dv = reference.backward(dout, q, k, v, out, lse, params)
    # The mask is the documented pure function of (seed, batch, head, row, col).
    positions = dict(batch=torch.arange(b).view(b, 1, 1, 1), head=torch.arange(h).view(1, h, 1, 1),
                     rows=torch.arange(sq).view(1, 1, sq, 1), cols=torch.arange(sk).view(1, 1, 1, sk))
    expected_keep = keep_mask(params.dropout_seed, p=p, **positions)
    nonzero = s_dmask != 0
    assert torch.equal((s_dmask > 0)[nonzero], expected_keep[nonzero])
    kept = expected_keep[nonzero].float().mean().item()
    assert 0.55 < kept < 0.85
    for i in range(b):
        ref = naive_with_grads(q[i], k[i], v[i], dout[i], scale=params.softmax_scale, window=(-1, 0),
                               keep=expected_keep[i], dropout_p=p)
        close(s_dmask[i].abs(), ref[2])
        close(out[i], ref[0])
        close(lse[i], ref[1])  # lse ignores dropout
        for got, want in zip((dq[i], dk[i], dv[i]), ref[3:]):
            close(got, want, atol=1e-4, rtol=1e-4)


def test_dropout_mask_does_not_depend_on_chunking():
    q, k, v, _ = random_qkv(1, 10, 13, 2, 2, 8)
    params = params_for(8, dropout_p=0.5, seed=99)
    results = []
    for chunks in [(1, 1), (4, 5), (10, 13)]:
        results.append(reference.forward(q, k, v, params, return_softmax=True, chunks=chunks))
    for out, _, s_dmask in results[1:]:
        assert torch.equal(s_dmask < 0, results[0][2] < 0)
        close(out, results[0][0], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Varlen and paged varlen
# ----------------------------------------------------------------------------------------------


def _varlen_case(seqlens_q, seqlens_k, h, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, dout = torch.randn(total_q, h, d, generator=g), torch.randn(total_q, h, d, generator=g)
    k, v = torch.randn(total_k, hk, d, generator=g), torch.randn(total_k, hk, d, generator=g)
    layout = VarlenLayout(cu(seqlens_q), cu(seqlens_k), max(seqlens_q), max(seqlens_k))
    return q, k, v, dout, layout


def _check_varlen(q, k_seqs, v_seqs, dout, layout, params, out, lse, grads, *, window, slopes=None,
                  s_dmask=None, dk_seqs=None, dv_seqs=None):
    """Compare every sequence with the oracle; ``k_seqs[b]`` are sequence b's contiguous keys."""
    cu_q = layout.cu_seqlens_q.tolist()
    dq = grads[0]
    for b in range(len(cu_q) - 1):
        q0, q1 = cu_q[b], cu_q[b + 1]
        if q1 == q0:
            continue
        row_slopes = None if slopes is None else slopes[b]
        keep = None if s_dmask is None else ~(s_dmask[b, :, : q1 - q0, : k_seqs[b].shape[0]] < 0)
        ref = naive_with_grads(q[q0:q1], k_seqs[b], v_seqs[b], dout[q0:q1], scale=params.softmax_scale,
                               window=window, slopes=row_slopes, keep=keep, dropout_p=params.dropout_p)
        close(out[q0:q1], ref[0])
        close(lse[:, q0:q1], ref[1])
        close(dq[q0:q1], ref[3], atol=1e-4, rtol=1e-4)
        if dk_seqs is not None:
            close(dk_seqs[b], ref[4], atol=1e-4, rtol=1e-4)
            close(dv_seqs[b], ref[5], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window,alibi,dropout_p", [((-1, -1), False, 0.0), ((-1, 0), True, 0.0), ((3, 1), False, 0.25)])
def test_varlen_matches_naive_including_empty_sequences(window, alibi, dropout_p, engine):
    seqlens_q, seqlens_k = [3, 0, 7, 6, 4, 0], [4, 5, 0, 13, 2, 0]
    h, hk, d = 4, 2, 8
    q, k, v, dout, layout = _varlen_case(seqlens_q, seqlens_k, h, hk, d)
    slopes = torch.rand(len(seqlens_q), h) if alibi else None
    params = params_for(d, window, dropout_p=dropout_p, seed=42)
    out, lse, s_dmask = engine.forward(q, k, v, params, varlen=layout, alibi_slopes=slopes, return_softmax=True)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    assert s_dmask.shape == (len(seqlens_q), h, max(seqlens_q), max(seqlens_k))
    grads = engine.backward(dout, q, k, v, out, lse, params, varlen=layout, alibi_slopes=slopes)
    assert all(torch.isfinite(x).all() for x in grads)
    # Sequence 2 has queries but no keys: zeros and +inf.
    assert torch.all(out[3:10] == 0) and torch.all(lse[:, 3:10] == INF)
    cu_k = layout.cu_seqlens_k.tolist()
    k_seqs = [k[cu_k[b] : cu_k[b + 1]] for b in range(len(seqlens_k))]
    v_seqs = [v[cu_k[b] : cu_k[b + 1]] for b in range(len(seqlens_k))]
    dk_seqs = [grads[1][cu_k[b] : cu_k[b + 1]] for b in range(len(seqlens_k))]
    dv_seqs = [grads[2][cu_k[b] : cu_k[b + 1]] for b in range(len(seqlens_k))]
    _check_varlen(q, k_seqs, v_seqs, dout, layout, params, out, lse, grads, window=window, slopes=slopes,
                  s_dmask=s_dmask if dropout_p > 0 else None, dk_seqs=dk_seqs, dv_seqs=dv_seqs)
    if dropout_p > 0:  # dropout counters are positions inside the sequence, batch = sequence index
        keep = keep_mask(params.dropout_seed, 3, torch.arange(h).view(h, 1, 1), torch.arange(6).view(1, 6, 1),
                         torch.arange(13).view(1, 1, 13), dropout_p)
        probs = s_dmask[3, :, :6, :13]
        assert torch.equal((probs > 0)[probs != 0], keep[probs != 0])


def test_paged_varlen_gradients_land_in_the_page_pool(engine):
    seqlens_q, seqlens_k = [5, 3, 0, 8], [9, 1, 6, 16]
    h, hk, d, page = 2, 1, 8, 4
    q, _, _, dout, layout = _varlen_case(seqlens_q, seqlens_k, h, hk, d, seed=11)
    g = torch.Generator().manual_seed(12)
    num_pages = 12
    k_pool, v_pool = torch.randn(num_pages, page, hk, d, generator=g), torch.randn(num_pages, page, hk, d, generator=g)
    block_table = torch.randperm(num_pages, generator=g)[: 4 * 3].view(4, 3).to(torch.int32)
    layout = VarlenLayout(layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_seqlen_q, layout.max_seqlen_k, block_table)
    params = params_for(d, (-1, 0))
    out, lse, _ = engine.forward(q, k_pool, v_pool, params, varlen=layout)
    grads = engine.backward(dout, q, k_pool, v_pool, out, lse, params, varlen=layout)
    assert grads[1].shape == k_pool.shape and grads[2].shape == v_pool.shape
    seq_rows = lambda pool, b: pool[block_table[b].long()].flatten(0, 1)[: seqlens_k[b]]
    k_seqs = [seq_rows(k_pool, b) for b in range(4)]
    v_seqs = [seq_rows(v_pool, b) for b in range(4)]
    dk_seqs = [seq_rows(grads[1], b) for b in range(4)]
    dv_seqs = [seq_rows(grads[2], b) for b in range(4)]
    _check_varlen(q, k_seqs, v_seqs, dout, layout, params, out, lse, grads, window=(-1, 0),
                  dk_seqs=dk_seqs, dv_seqs=dv_seqs)
    # Pages no sequence uses get no gradient.
    used = torch.zeros(num_pages, dtype=torch.bool)
    for b, n in enumerate(seqlens_k):
        used[block_table[b, : -(-n // page)].long()] = True
    assert torch.all(grads[1][~used] == 0)


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


def naive_rotary(x, cos, sin, positions, interleaved):
    """float64 RoPE of ``x (s, h, d)`` at integer ``positions (s,)``."""
    x = x.double()
    half = cos.shape[1]
    c, s = cos[positions].double().unsqueeze(1), sin[positions].double().unsqueeze(1)
    rot = x[..., : 2 * half]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1)
    return torch.cat((out, x[..., 2 * half :]), -1)


KV_CASES = {
    "append_causal": dict(window=(-1, 0)),
    "decode_no_new": dict(s_new=0, sq=1),
    "rotary_interleaved_causal": dict(rotary=True, interleaved=True, window=(-1, 0)),
    "rotary_neox_noncausal": dict(rotary=True, interleaved=False),
    "batch_idx_leftpad_alibi": dict(batch_idx=True, leftpad=True, alibi=True, window=(-1, 0)),
    "paged_rotary_window": dict(paged=True, rotary=True, interleaved=False, window=(4, 0)),
    "paged_leftpad_noncausal": dict(paged=True, leftpad=True),
}


@pytest.mark.parametrize("case", KV_CASES, ids=list(KV_CASES))
def test_kvcache_matches_naive(case, engine):
    cfg = KV_CASES[case]
    B, h, hk, d, capacity, page = 3, 4, 2, 16, 24, 4
    sq, s_new = cfg.get("sq", 3), cfg.get("s_new", 3)
    window = cfg.get("window", (-1, -1))
    g = torch.Generator().manual_seed(21)
    seqlens = torch.tensor([5, 0, 12], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 7], dtype=torch.int32) if cfg.get("leftpad") else None
    batch_idx = torch.tensor([3, 0, 1], dtype=torch.int32) if cfg.get("batch_idx") else None
    n_cache = 4 if batch_idx is not None else B
    q = torch.randn(B, sq, h, d, generator=g)
    k_new = torch.randn(B, s_new, hk, d, generator=g) if s_new else None
    v_new = torch.randn(B, s_new, hk, d, generator=g) if s_new else None
    dense_k = torch.randn(n_cache, capacity, hk, d, generator=g)
    dense_v = torch.randn(n_cache, capacity, hk, d, generator=g)
    cos = sin = None
    if cfg.get("rotary"):
        angles = torch.rand(capacity, 3, generator=g) * 6  # rotary_dim 6 < d: the rest passes through
        cos, sin = angles.cos(), angles.sin()
    block_table = None
    if cfg.get("paged"):
        num_pages = B * capacity // page + 2
        block_table = torch.randperm(num_pages, generator=g)[: B * capacity // page].view(B, -1).to(torch.int32)
        k_cache = torch.randn(num_pages, page, hk, d, generator=g)
        v_cache = torch.randn(num_pages, page, hk, d, generator=g)
        for b in range(B):  # the logical per-sequence cache the oracle reads
            dense_k[b] = k_cache[block_table[b].long()].flatten(0, 1)
            dense_v[b] = v_cache[block_table[b].long()].flatten(0, 1)
    else:
        k_cache, v_cache = dense_k.clone(), dense_v.clone()
    slopes = torch.rand(B, h, generator=g) if cfg.get("alibi") else None
    cache = KVCacheInputs(k_cache, v_cache, seqlens, k_new, v_new, batch_idx, leftpad, block_table, cos, sin,
                          cfg.get("interleaved", True))
    params = params_for(d, window)
    out, lse = engine.forward_kvcache(q, params, cache, alibi_slopes=slopes)
    assert out.shape == q.shape and lse.shape == (B, h, sq)

    for b in range(B):
        row = b if batch_idx is None else int(batch_idx[b])
        start = 0 if leftpad is None else int(leftpad[b])
        end = int(seqlens[b]) + s_new
        keys, values = dense_k[row].double().clone(), dense_v[row].double().clone()
        q_b = q[b].double()
        new_rows = torch.arange(int(seqlens[b]), end)
        if s_new:
            k_b = k_new[b].double()
            if cos is not None:
                k_b = naive_rotary(k_b, cos, sin, new_rows, cfg.get("interleaved", True))
            keys[new_rows], values[new_rows] = k_b, v_new[b].double()
            # The new rows were written into the cache in place (through the page table if paged).
            if block_table is None:
                written_k, written_v = k_cache[row, new_rows], v_cache[row, new_rows]
            else:
                flat = new_rows
                pages = block_table[b].long()[flat // page]
                written_k, written_v = k_cache[pages, flat % page], v_cache[pages, flat % page]
            close(written_k, k_b, atol=1e-6, rtol=1e-6)
            close(written_v, v_new[b], atol=0, rtol=0)
        if cos is not None:
            local = window != (-1, -1)
            q_pos = int(seqlens[b]) + (torch.arange(sq) if local else torch.zeros(sq, dtype=torch.long))
            q_b = naive_rotary(q_b, cos, sin, q_pos, cfg.get("interleaved", True))
        ref_out, ref_lse, _ = naive_attention(q_b, keys[start:end], values[start:end], scale=params.softmax_scale,
                                              window=window, slopes=None if slopes is None else slopes[b])
        close(out[b], ref_out)
        close(lse[b], ref_lse)


# ----------------------------------------------------------------------------------------------
# Memory and work: no full score matrix, masked chunks skipped
# ----------------------------------------------------------------------------------------------


class _AllocationRecorder(TorchDispatchMode):
    """Records the largest tensor any op produced, how many matmuls ran, and the sizes of the
    tensors ops allocated (outputs on a storage none of the op's inputs had)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.matmuls = 0
        self.allocated = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.mm, torch.ops.aten.baddbmm):
            self.matmuls += 1
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if t.untyped_storage().data_ptr() not in inputs:
                    self.allocated.append(t.numel())
        return result


def test_no_full_score_matrix_is_allocated():
    """With a 64 KiB tile budget, no op output may reach the size of one head's sq x sk scores."""
    tuning = core.Tuning(tile_budget_bytes=64 << 10)
    engine = _tiled(tuning)
    sq = sk = 256
    q, k, v, dout = random_qkv(1, sq, sk, 2, 1, 8)
    params = params_for(8, dropout_p=0.1, seed=1)
    with _AllocationRecorder() as recorder:
        out, lse, _ = _layouts.forward(engine, q, k, v, params)
        _layouts.backward(engine, dout, q, k, v, out, lse, params)
    # No op output exceeds one fp32 tile of the (dropout-shrunk) budget: 8192 elements here,
    # an eighth of one head's scores (inputs are 256 x 2 x 8).
    tile_elements = tuning.tile_budget_bytes // core.DROPOUT_TILE_SHRINK // 4
    assert tile_elements <= sq * sk // 8
    assert recorder.largest <= tile_elements
    # The recorder does see a full score matrix when the chunks cover everything.
    with _AllocationRecorder() as recorder:
        reference.forward(q, k, v, params_for(8), chunks=(sq, sk))
    assert recorder.largest >= sq * sk


def test_causal_skips_fully_masked_key_chunks():
    q, k, v, _ = random_qkv(1, 128, 128, 2, 2, 8)
    counts = {}
    for name, window in [("full", (-1, -1)), ("causal", (-1, 0)), ("local", (8, 0))]:
        with _AllocationRecorder() as recorder:
            reference.forward(q, k, v, params_for(8, window), chunks=(16, 16))
        counts[name] = recorder.matmuls
    # 8 x 8 tiles in full; causal visits the 36 on or below the diagonal; local (8, 0) one tile
    # for the first row chunk and two for each later one (rows 16..31 see columns 8..31).
    assert counts["causal"] * 64 == counts["full"] * 36
    assert counts["local"] * 64 == counts["full"] * 15


def test_tiles_reuse_their_buffers():
    """No tensor is allocated per tile: four times the tiles, as many tile-sized allocations.

    Sizes are chosen so that every per-call tensor (K/V in fp32, outputs, gradients) is at least
    half a tile at both lengths and every per-row tensor (lse, row statistics) below it. Softcap in bf16 takes the most
    buffers; ALiBi and dropout (index and mask tensors per tile) are not covered."""
    chunk_q, chunk_k = 16, 32
    tile = 2 * chunk_q * chunk_k  # batch 1, 2 heads

    def tile_sized_allocations(seqlen):
        q, k, v, dout = random_qkv(1, seqlen, seqlen, 2, 2, 16, dtype=torch.bfloat16)
        params = params_for(16, softcap=5.0)
        for _ in range(2):  # the second call: the thread's scratch exists by then
            with _AllocationRecorder() as recorder:
                out, lse, _ = reference.forward(q, k, v, params, chunks=(chunk_q, chunk_k))
                reference.backward(dout, q, k, v, out, lse, params, chunks=(chunk_q, chunk_k))
        return sum(1 for n in recorder.allocated if n >= tile // 2)

    per_call = tile_sized_allocations(64)  # 8 tiles
    assert 0 < per_call == tile_sized_allocations(128)  # 32 tiles


def test_a_thread_keeps_its_scratch_between_calls_within_a_bound():
    cpu = torch.device("cpu")
    with core._scratch_for(cpu, 64, core.Tuning(kept_scratch_bytes=4 * 32)) as first:  # keeps at most 128 bytes
        small = first.take("small", 4, 4).data_ptr()
        first.take("large", 64)
        with core._scratch_for(cpu, 64) as nested:  # a call made during another: its own
            assert nested is not first
            assert nested.take("small", 4, 4).data_ptr() != small
        assert getattr(core._KEPT, "scratch", None) is not nested  # and it is not kept
    assert core._KEPT.scratch is first  # one scratch per thread: the outermost call's
    with core._scratch_for(cpu, 64) as again:
        assert again.take("small", 4, 4).data_ptr() == small  # kept: already paged in
        assert "large" not in again._buffers  # over the bound: handed back


def test_threads_running_the_engine_at_once_get_their_own_answers():
    """Scratch is per thread: two threads computing different problems at the same time get
    bitwise what each gets alone."""
    import threading  # noqa: PLC0415

    problems = [random_qkv(1, 96, 96, 2, 1, 16, seed=seed) for seed in (1, 2)]
    params = params_for(16, window=(-1, 0), softcap=5.0)

    def run(q, k, v, dout):
        out, lse, _ = reference.forward(q, k, v, params)
        return (out, *reference.backward(dout, q, k, v, out, lse, params)[:3])

    alone = [run(*p) for p in problems]
    together = [None, None]

    def worker(i):
        for _ in range(5):
            together[i] = run(*problems[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(together, alone):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_default_chunk_sizes_respect_the_budget():
    q = torch.empty(1, 16384, 8, 64)
    problem = _layouts._dense_problem(q, q[:, :, :1], q[:, :, :1], None)
    chunk_q, chunk_k = core.chunk_sizes(problem, params_for(64))
    assert 4 * 8 * chunk_q * chunk_k <= core.DEFAULT_TUNING.tile_budget_bytes
    # not degenerate: whole rows of 64 queries at least, tiles TILE_ASPECT times as wide as tall
    assert chunk_q >= 64 and core.TILE_ASPECT * chunk_q <= chunk_k < (core.TILE_ASPECT + 1) * chunk_q
    decode = _layouts._dense_problem(q[:, :1], q[:, :, :1], q[:, :, :1], None)
    assert core.chunk_sizes(decode, params_for(64)) == (1, 16384)


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import resource, time, torch
    from flash_attn.backends import cpu
    from flash_attn.params import AttentionParams
    torch.set_num_threads(2)
    s, h, d = 16384, 8, 64
    q, k, v = (torch.randn(1, s, h, d) for _ in range(3))
    warm = cpu.forward(q[:, :64], k[:, :64], v[:, :64], AttentionParams(0.125))  # load kernels
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out, lse, _ = cpu.forward(q, k, v, AttentionParams(0.125))
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024, seconds)
    """
)


@pytest.mark.slow
def test_long_sequence_forward_peak_memory_under_1_gib():
    """seqlen 16384, 8 heads, d 64, fp32: the full scores would be 8 GiB; we must stay < 1 GiB.

    ru_maxrss (peak resident set, KiB on Linux) is read before and after the forward in a fresh
    process, so the delta is the real peak of everything the forward allocated.
    """
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, check=True,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    peak_bytes, seconds = result.stdout.split()
    assert int(peak_bytes) < 1 << 30, f"peak extra memory {int(peak_bytes) / 2**20:.0f} MiB in {float(seconds):.1f}s"


def _naive_visible(sq, start, length, left, right, i, c) -> bool:
    """Whether query row ``i`` sees stored key column ``c``, straight from the definition:
    key position ``j = c - start`` inside the sequence, and within the window around the
    bottom-right aligned diagonal ``i + length - sq``."""
    j, diagonal = c - start, i + length - sq
    return (0 <= j < length and (left < 0 or j >= diagonal - left) and (right < 0 or j <= diagonal + right))


@pytest.mark.parametrize("sequences", [1, 3])
def test_tile_masks_match_the_definition(sequences):
    """The additive mask of any tile (triangle fills for one shared key range, index tensors for
    several) is 0 exactly where the definition says the key is visible, else -inf."""
    rng = random.Random(sequences)
    for _ in range(400):
        sq, n_cols = rng.randint(1, 24), rng.randint(1, 40)
        starts = [rng.randint(0, 4) for _ in range(sequences)]
        lengths = [rng.randint(0, max(0, n_cols - s)) for s in starts]
        left, right = rng.choice([-1, rng.randint(0, 12)]), rng.choice([-1, 0, rng.randint(0, 12)])
        i0, c0 = rng.randrange(sq), rng.randrange(n_cols)
        i1, c1 = rng.randint(i0 + 1, sq), rng.randint(c0 + 1, n_cols)
        problem = core.Problem(q=torch.empty(sequences, sq, 1, 8), load_kv=None, n_cols=n_cols, nheads_k=1,
                               head_dim_v=8, key_start=starts, key_len=lengths)
        params = params_for(8, window=(left, right))
        mask = core._tile_mask(problem, params, i0, i1, c0, c1)
        want = torch.tensor([[[0.0 if _naive_visible(sq, s, n, left, right, i, c) else float("-inf")
                               for c in range(c0, c1)] for i in range(i0, i1)] for s, n in zip(starts, lengths)])
        got = mask.expand(sequences, 1, 1, i1 - i0, c1 - c0)[:, 0, 0]
        assert torch.equal(got, want), (sq, n_cols, starts, lengths, left, right, i0, i1, c0, c1)
