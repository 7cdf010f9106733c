"""An independent, naive attention oracle written straight from the formulas of the flash-attn API.

Nothing here imports :mod:`flash_attn`: the oracle must be able to disagree with the library.
Everything is computed with the full ``(seqlen_q x seqlen_k)`` score matrix and explicit boolean
masks, one formula per line:

* scores ``s[i, j] = scale * q_i . k_j`` (query head ``h`` reads kv head ``h // (H / Hk)``); v and
  the output may have their own head dim; with MLA's absorbed queries ``qv`` (like q with v's head
  dim) ``s[i, j] = scale * (q_i . k_j + qv_i . v_j)``;
* softcap: ``s = c * tanh(s / c)`` when ``c > 0``;
* ALiBi: ``s += -slope * |i + sk - sq - j|``;
* mask (bottom-right aligned): key ``j`` is visible to query ``i`` iff
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (``-1`` = unbounded; causal = ``right 0``);
* attention sinks: one more column per row holding the head's sink logit, always visible, whose
  value vector is 0 (it only joins the denominator; a sink of ``-inf`` is none);
* ``P = softmax(s)`` over visible keys (and the sink); ``lse = log sum exp s`` over them;
* dropout with an explicit keep mask: ``out = (P * keep / (1 - p)) @ v``;
* a row that sees no key: out 0, lse +inf, P 0;
* special values, as upstream's kernels: a NaN or +inf among a row's visible scores makes its
  out, lse and P NaN (the row max carries it); a row whose visible scores are all -inf is a row
  that sees no key; hidden keys never reach a row (their k and v are not read: a NaN there changes
  nothing). Scores are computed in float64, so inputs whose products overflow float32 are
  outside what this oracle describes.

``compute_dtype=torch.float64`` gives the oracle; ``compute_dtype=None`` gives the *naive
low-precision* variant: the same math with every matmul, the softmax and the weighted sum done in
the input dtype (fp16 / bf16 / fp32). The gap between that variant and the float64 oracle measures
how much error plain arithmetic in that dtype makes, and calibrates the tolerance of the tests
(see ``support/tolerance.py``).

Every function is differentiable with autograd (no in-place tricks), so gradients of the
float64 oracle are the reference for dq / dk / dv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

F64 = torch.float64


def visible_mask(sq: int, sk: int, left: int, right: int, causal: bool, device=None) -> torch.Tensor:
    """Boolean ``(sq, sk)``: True where query ``i`` may attend key ``j`` (bottom-right aligned)."""
    if causal:
        right = 0
    i = torch.arange(sq, device=device).view(sq, 1)
    j = torch.arange(sk, device=device).view(1, sk)
    diag = i + sk - sq  # the key aligned with query i
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        mask = mask & (j >= diag - left)
    if right >= 0:
        mask = mask & (j <= diag + right)
    return mask


def alibi_bias(slopes_h: torch.Tensor, sq: int, sk: int, dtype) -> torch.Tensor:
    """``(h, sq, sk)``: ``-slope * |i + sk - sq - j|``."""
    i = torch.arange(sq, device=slopes_h.device).view(sq, 1)
    j = torch.arange(sk, device=slopes_h.device).view(1, sk)
    dist = (i + sk - sq - j).abs().to(dtype)
    return -slopes_h.to(dtype).view(-1, 1, 1) * dist


@dataclass
class RefResult:
    out: torch.Tensor  # like q
    lse: torch.Tensor  # float64 (or compute dtype) (b, h, sq) / (h, total_q) for varlen
    probs: torch.Tensor  # (b, h, sq, sk): softmax probabilities before dropout


def attention_single(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0,
                     slopes_h=None, keep=None, dropout_p=0.0, compute_dtype=F64, qv=None, sinks=None):
    """One sequence. q ``(sq, h, d)``, k ``(sk, hk, d)``, v ``(sk, hk, dv)``; slopes_h ``(h,)`` or
    None; keep ``(h, sq, sk)`` bool or None; qv ``(sq, h, dv)`` or None; sinks ``(h,)`` or None.
    Returns out ``(sq, h, dv)`` in the compute dtype, lse ``(h, sq)``, probs ``(h, sq, sk)`` (the
    keys' probabilities; with sinks they sum to less than 1)."""
    cd = compute_dtype or q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    sq, h, d = q.shape
    sk, hk, _ = k.shape
    group = h // hk
    # query head hh uses kv head hh // group
    kv_head = torch.arange(h, device=q.device) // group
    kh = k[:, kv_head]  # (sk, h, d)
    vh = v[:, kv_head]
    s = torch.einsum("ihd,jhd->hij", q, kh) * scale  # (h, sq, sk)
    if qv is not None:
        s = s + torch.einsum("ihe,jhe->hij", qv.to(cd), vh) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if slopes_h is not None:
        s = s + alibi_bias(slopes_h, sq, sk, cd)
    mask = visible_mask(sq, sk, window[0], window[1], causal, device=q.device).expand(h, sq, sk)
    if sinks is not None:
        # the sink as one more key of every row: always visible (unless -inf), value 0
        sink_column = sinks.to(cd).view(h, 1, 1).expand(h, sq, 1)
        s = torch.cat([s, sink_column], dim=-1)
        mask = torch.cat([mask, (sink_column > float("-inf")).detach()], dim=-1)
    s_masked = s.masked_fill(~mask, float("-inf"))  # a fill, not an addition: a hidden NaN stays hidden
    row_max = s_masked.amax(dim=-1, keepdim=True) if s.shape[-1] > 0 else torch.zeros(h, sq, 1, dtype=cd, device=q.device)
    # a row without visible keys (or only -inf scores) shifts by 0, so that e is 0, not NaN; a NaN
    # or +inf row max stays and makes the row NaN
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max).detach()
    e = torch.exp(s_masked - row_max).masked_fill(~mask, 0.0)  # exactly 0 where masked
    denom = e.sum(dim=-1, keepdim=True)
    empty = denom == 0  # no visible key with a finite score (a NaN sum is not empty)
    safe_denom = torch.where(empty, torch.ones_like(denom), denom)
    p = (e / safe_denom)[..., :sk]  # the sink's column holds no value: only its share of the denominator
    lse = torch.where(empty, torch.full_like(denom, float("inf")), row_max + torch.log(safe_denom))
    p_used = p
    if keep is not None:
        p_used = p * keep.to(cd) / (1.0 - dropout_p)
    if torch.isfinite(vh).all():
        out = torch.einsum("hij,jhd->ihd", p_used, vh)
    else:  # sum over the visible keys only: a hidden key's weight 0 times its NaN would reach the row
        terms = (p_used.unsqueeze(-1) * vh.permute(1, 0, 2).unsqueeze(1)).masked_fill(~mask[..., :sk].unsqueeze(-1), 0.0)
        out = terms.sum(dim=2).permute(1, 0, 2)
    return out, lse.squeeze(-1), p


def _slopes_for(alibi_slopes, b):
    if alibi_slopes is None:
        return None
    return alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]


def default_scale(q, qv=None) -> float:
    """``1 / sqrt(features)`` of the scores: q's head dim, plus qv's when given."""
    return (q.shape[-1] + (0 if qv is None else qv.shape[-1])) ** -0.5


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                  alibi_slopes=None, keep=None, dropout_p=0.0, compute_dtype=F64, qv=None, sinks=None) -> RefResult:
    """Dense: q ``(b, sq, h, d)``, k ``(b, sk, hk, d)``, v ``(b, sk, hk, dv)``; keep ``(b, h, sq, sk)``
    bool; qv ``(b, sq, h, dv)``; sinks ``(h,)``."""
    scale = default_scale(q, qv) if softmax_scale is None else softmax_scale
    outs, lses, probs = [], [], []
    for b in range(q.shape[0]):
        o, l, p = attention_single(
            q[b], k[b], v[b], scale=scale, causal=causal, window=window, softcap=softcap,
            slopes_h=_slopes_for(alibi_slopes, b), keep=None if keep is None else keep[b],
            dropout_p=dropout_p, compute_dtype=compute_dtype, qv=None if qv is None else qv[b], sinks=sinks)
        outs.append(o), lses.append(l), probs.append(p)
    cd = compute_dtype or q.dtype
    if not outs:
        b, sq, h, d = q.shape
        sk = k.shape[1]
        return RefResult(q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=cd), q.new_zeros((0, h, sq), dtype=cd),
                         q.new_zeros((0, h, sq, sk), dtype=cd))
    return RefResult(torch.stack(outs), torch.stack(lses), torch.stack(probs))


def attention_varlen_ref(q, k, v, cu_q: Sequence[int], cu_k: Sequence[int], *, softmax_scale=None,
                         causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                         keep=None, dropout_p=0.0, block_table=None, compute_dtype=F64,
                         max_seqlen_q=None, max_seqlen_k=None, qv=None, sinks=None) -> RefResult:
    """Varlen by looping over sequences. q ``(total_q, h, d)``; k/v ``(total_k, hk, d)`` or, with
    ``block_table`` (a list of lists of page indices), a page pool ``(blocks, page, hk, d)``.
    keep: ``(b, h, max_sq, max_sk)`` bool. Returns lse ``(h, total_q)`` and probs
    ``(b, h, max_sq, max_sk)`` (zero outside each sequence's lengths)."""
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    batch = len(cu_q) - 1
    scale = default_scale(q, qv) if softmax_scale is None else softmax_scale
    cd = compute_dtype or q.dtype
    lens_q = [cu_q[i + 1] - cu_q[i] for i in range(batch)]
    lens_k = [cu_k[i + 1] - cu_k[i] for i in range(batch)]
    msq = max_seqlen_q if max_seqlen_q is not None else max(lens_q, default=0)
    msk = max_seqlen_k if max_seqlen_k is not None else max(lens_k, default=0)
    h = q.shape[1]
    outs, lses = [], []
    probs = []
    for b in range(batch):
        qb = q[cu_q[b]:cu_q[b + 1]]
        if block_table is None:
            kb, vb = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        else:
            kb, vb = gather_pages(k, v, block_table[b], lens_k[b])
        kp = None if keep is None else keep[b, :, :lens_q[b], :lens_k[b]]
        o, l, p = attention_single(qb, kb, vb, scale=scale, causal=causal, window=window,
                                   softcap=softcap, slopes_h=_slopes_for(alibi_slopes, b),
                                   keep=kp, dropout_p=dropout_p, compute_dtype=compute_dtype,
                                   qv=None if qv is None else qv[cu_q[b]:cu_q[b + 1]], sinks=sinks)
        outs.append(o), lses.append(l)
        full = torch.zeros(h, msq, msk, dtype=cd, device=q.device)
        full[:, :lens_q[b], :lens_k[b]] = p.detach()
        probs.append(full)
    out = torch.cat(outs) if outs else q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=cd)
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros((h, 0), dtype=cd)
    pr = torch.stack(probs) if probs else q.new_zeros((0, h, msq, msk), dtype=cd)
    return RefResult(out, lse, pr)


def gather_pages(k_pages, v_pages, pages: Sequence[int], length: int):
    """The first ``length`` rows of the pages ``pages`` laid end to end."""
    page = k_pages.shape[1]
    n = -(-length // page)
    idx = torch.as_tensor([int(x) for x in pages[:n]], dtype=torch.long, device=k_pages.device)
    kb = k_pages[idx].reshape(n * page, *k_pages.shape[2:])[:length]
    vb = v_pages[idx].reshape(n * page, *v_pages.shape[2:])[:length]
    return kb, vb


# ---------------------------------------------------------------------------------------------
# Rotary embeddings (our own tiny implementation).


def rotary(x, positions, cos, sin, interleaved: bool):
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` features of ``x`` ``(s, h, d)``; token
    ``t`` uses row ``positions[t]`` of the tables. interleaved: pairs (0,1), (2,3), ...;
    otherwise (GPT-NeoX): pairs (i, i + rotary_dim/2). Computed in float64."""
    x = x.to(F64)
    half = cos.shape[1]
    rd = 2 * half
    pos = torch.as_tensor(positions, dtype=torch.long, device=x.device)
    c = cos.to(F64)[pos].unsqueeze(1)  # (s, 1, half)
    s_ = sin.to(F64)[pos].unsqueeze(1)
    if interleaved:
        x0, x1 = x[..., 0:rd:2], x[..., 1:rd:2]
        r0 = x0 * c - x1 * s_
        r1 = x0 * s_ + x1 * c
        rot = torch.stack([r0, r1], dim=-1).flatten(-2)
    else:
        x0, x1 = x[..., :half], x[..., half:rd]
        rot = torch.cat([x0 * c - x1 * s_, x0 * s_ + x1 * c], dim=-1)
    return torch.cat([rot, x[..., rd:]], dim=-1)


# ---------------------------------------------------------------------------------------------
# KV cache.


@dataclass
class KVCacheRef:
    out: torch.Tensor  # (b, sq, h, d) float64
    lse: torch.Tensor  # (b, h, sq)
    k_cache: torch.Tensor  # expected cache after the call (float64, same layout as the input)
    v_cache: torch.Tensor
    written: torch.Tensor  # bool, shape of the cache's first two dims: rows the call writes


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None,
                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                rotary_interleaved=True, alibi_slopes=None, compute_dtype=F64, qv=None, sinks=None) -> KVCacheRef:
    """Naive ``flash_attn_with_kvcache``.

    Per batch entry b: its cache rows are ``k_cache[cache_batch_idx[b]]`` (or the pages
    ``block_table[b]`` laid end to end). New k (rotated at positions ``cache_seqlens[b] + t``
    when rotary tables are given) and v are written at rows ``cache_seqlens[b] + t``. Keys
    attended: rows ``leftpad[b] : cache_seqlens[b] + seqlen_new`` (positions start at 0 at
    ``leftpad``). q is rotated at positions ``cache_seqlens[b] + t`` if causal or local,
    otherwise every q row at ``cache_seqlens[b]``; rotary positions are absolute cache rows.
    cache_seqlens etc. are python lists or int32 tensors."""
    cd = compute_dtype or q.dtype
    batch, sq, h, d = q.shape
    tolist = lambda t: None if t is None else [int(x) for x in (t.tolist() if torch.is_tensor(t) else t)]
    if cache_seqlens is None:
        cap = k_cache.shape[1] if block_table is None else len(tolist(block_table[0])) * k_cache.shape[1]
        seqlens = [cap] * batch
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * batch
    else:
        seqlens = tolist(cache_seqlens)
    bidx = tolist(cache_batch_idx) or list(range(batch))
    pads = tolist(cache_leftpad) or [0] * batch
    scale = default_scale(q, qv) if softmax_scale is None else softmax_scale
    sn = 0 if k is None else k.shape[1]
    new_k = k_cache.detach().to(F64).clone()
    new_v = v_cache.detach().to(F64).clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    local = causal or tuple(window) != (-1, -1)
    outs, lses = [], []
    for b in range(batch):
        L = seqlens[b]
        if block_table is None:
            row_of = lambda r, b=b: (bidx[b], r)
        else:
            pages = tolist(block_table[b])
            page = k_cache.shape[1]
            row_of = lambda r, pages=pages, page=page: (pages[r // page], r % page)
        qb = q[b].to(F64)
        if sn:
            kn = k[b].to(F64)
            if rotary_cos is not None:
                kn = rotary(kn, [L + t for t in range(sn)], rotary_cos, rotary_sin, rotary_interleaved)
                qpos = [L + t for t in range(sq)] if local else [L] * sq
                qb = rotary(qb, qpos, rotary_cos, rotary_sin, rotary_interleaved)
            for t in range(sn):
                blk, r = row_of(L + t)
                new_k[blk, r] = kn[t]
                new_v[blk, r] = v[b, t].to(F64)
                written[blk, r] = True
        end = L + sn
        rows = [row_of(r) for r in range(pads[b], end)]
        if rows:
            kb = torch.stack([new_k[blk, r] for blk, r in rows])
            vb = torch.stack([new_v[blk, r] for blk, r in rows])
        else:
            kb = new_k.new_zeros((0,) + tuple(k_cache.shape[2:]))
            vb = new_v.new_zeros((0,) + tuple(v_cache.shape[2:]))
        qvb = None if qv is None else qv[b]  # not rotated
        if compute_dtype is None:
            # the low-precision variant sees the cache as stored in the input dtype
            qb, kb, vb = qb.to(q.dtype), kb.to(q.dtype), vb.to(q.dtype)
        o, l, _ = attention_single(qb, kb, vb, scale=scale, causal=causal, window=window,
                                   softcap=softcap, slopes_h=_slopes_for(alibi_slopes, b),
                                   compute_dtype=cd, qv=qvb, sinks=sinks)
        outs.append(o), lses.append(l)
    return KVCacheRef(torch.stack(outs), torch.stack(lses), new_k, new_v, written)


def oracle_pair(fn, tensors, dout=None, **kwargs):
    """Run oracle ``fn(*tensors, compute_dtype=..., **kwargs)`` twice: in float64 (the reference)
    and naively in the inputs' dtype. With ``dout``, also backpropagate ``dout`` through both.

    Returns ``(ref, ref_grads, naive, naive_grads)``; grads are lists aligned with ``tensors``
    (``None`` without ``dout``).
    """
    results = []
    for cd in (F64, None):
        ins = [t.detach().to(F64 if cd is F64 else t.dtype).requires_grad_(dout is not None) for t in tensors]
        res = fn(*ins, compute_dtype=cd, **kwargs)
        grads = None
        if dout is not None:
            g = dout.detach().to(F64 if cd is F64 else dout.dtype)
            if res.out.requires_grad:
                grads = torch.autograd.grad(res.out, ins, g, allow_unused=True)
            else:
                grads = [None] * len(ins)
            grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(ins, grads)]
        results.append((res, grads))
    (ref, ref_grads), (naive, naive_grads) = results
    return ref, ref_grads, naive, naive_grads
