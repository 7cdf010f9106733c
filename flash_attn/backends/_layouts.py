"""The three input layouts of the backend contract as batched problems, for any engine.

An engine (:class:`Engine`) computes one :class:`~flash_attn.backends._reference_core.Problem`;
this module adapts the layouts of :mod:`flash_attn.backends` to it, for the reference and the
cpu backends alike:

* dense ``(b, s, h, d)`` tensors: one batched problem, no python loop over the batch;
* varlen (packed) tensors: one problem per sequence; paged K/V are gathered per sequence
  (``index_select`` of its pages) and their gradients scatter-added back into the page pool;
* the KV cache: new rows (rotary applied) are written into the cache in place, then one
  batched problem reads the cache chunk by chunk (through the page table when paged).

Dropout uses :func:`flash_attn.dropout.keep_mask` with positions inside each sequence, so the
mask does not depend on chunking and matches the Triton kernels bit for bit.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from flash_attn.backends import _reference_core as core
from flash_attn.params import AttentionParams, KVCacheInputs, VarlenLayout, cache_capacity
from flash_attn.rotation import rotate_pairs


class Engine(NamedTuple):
    """How one problem is computed.

    ``forward(problem, params, return_softmax) -> (out, lse)``; ``backward(problem, params, dout,
    out, lse) -> (dq, dk, dv)``, and ``dqv`` too for a problem with ``qv``; ``probabilities(problem,
    params, lse, sk) -> fp32 (B, h, sq, sk)`` (the softmax, negated where dropout drops, from the
    forward's lse).
    """

    forward: Callable
    backward: Callable
    probabilities: Callable


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


def _slopes_for(alibi_slopes: Optional[Tensor], batch: Optional[int] = None) -> Optional[Tensor]:
    """ALiBi slopes as fp32 ``(1 or B, h)``; ``batch`` picks one row of ``(b, h)`` slopes."""
    if alibi_slopes is None:
        return None
    slopes = alibi_slopes.to(torch.float32)
    if slopes.dim() == 1:
        return slopes.unsqueeze(0)
    return slopes if batch is None else slopes[batch : batch + 1]


def _column_loader(k: Tensor, v: Tensor) -> core.KVLoader:
    """Loader over contiguous keys ``k, v (B, sk, hk, d)``."""
    return lambda c0, c1: (k[:, c0:c1], v[:, c0:c1])


def _dense_problem(
    q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], first_batch: int = 0,
    qv: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
) -> core.Problem:
    """A problem over ``q (B, sq, h, d)`` and keys ``k, v (B, sk, hk, d / dv)``, all of equal
    length (``qv``: ``(B, sq, h, dv)``; ``sinks``: ``(h,)``)."""
    return core.Problem(
        q=q,
        load_kv=_column_loader(k, v),
        n_cols=k.shape[1],
        nheads_k=k.shape[2],
        head_dim_v=v.shape[-1],
        key_start=[0],
        key_len=[k.shape[1]],
        first_batch=first_batch,
        alibi_slopes=alibi_slopes,
        qv=qv,
        sinks=sinks,
    )


# ----------------------------------------------------------------------------------------------
# Varlen: one dense problem per sequence
# ----------------------------------------------------------------------------------------------


def _sequence_pages(varlen: VarlenLayout, b: int, seqlen_k: int, page_size: int) -> Tensor:
    """Indices of the pages holding sequence ``b``'s ``seqlen_k`` keys."""
    npages = -(-seqlen_k // page_size)
    return varlen.block_table[b, :npages].to(torch.int64)


def _sequence_kv(
    k: Tensor, v: Tensor, varlen: VarlenLayout, b: int, k0: int, k1: int
) -> tuple[Tensor, Tensor]:
    """Sequence ``b``'s keys as contiguous ``(sk, hk, d)`` tensors (gathering pages if paged)."""
    if varlen.block_table is None:
        return k[k0:k1], v[k0:k1]
    pages = _sequence_pages(varlen, b, k1 - k0, k.shape[1])
    gather = lambda pool: pool.index_select(0, pages).flatten(0, 1)[: k1 - k0]
    return gather(k), gather(v)


def _sequence_problems(q: Tensor, k: Tensor, v: Tensor, varlen: VarlenLayout, alibi_slopes: Optional[Tensor],
                       qv: Optional[Tensor] = None, sinks: Optional[Tensor] = None):
    """Yield ``(b, q0, q1, k0, k1, problem)`` for every sequence with at least one query row."""
    cu_q = varlen.cu_seqlens_q.tolist()
    cu_k = varlen.cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        kb, vb = _sequence_kv(k, v, varlen, b, k0, k1)
        slopes = _slopes_for(alibi_slopes, b)
        qv_b = None if qv is None else qv[q0:q1].unsqueeze(0)
        problem = _dense_problem(q[q0:q1].unsqueeze(0), kb.unsqueeze(0), vb.unsqueeze(0), slopes, b, qv_b, sinks)
        yield b, q0, q1, k0, k1, problem


def _varlen_forward(engine, q, k, v, params, varlen, alibi_slopes, return_softmax, qv=None, sinks=None):
    total_q, h, _ = q.shape
    batch = varlen.cu_seqlens_q.shape[0] - 1
    out = q.new_zeros(total_q, h, v.shape[-1])
    lse = torch.full((h, total_q), float("inf"), dtype=torch.float32, device=q.device)
    s_dmask = None
    if return_softmax:
        shape = (batch, h, varlen.max_seqlen_q, varlen.max_seqlen_k)
        s_dmask = torch.zeros(shape, dtype=torch.float32, device=q.device)
    for b, q0, q1, k0, k1, problem in _sequence_problems(q, k, v, varlen, alibi_slopes, qv, sinks):
        out_b, lse_b = engine.forward(problem, params, return_softmax)
        out[q0:q1] = out_b[0]
        lse[:, q0:q1] = lse_b[0]
        if return_softmax:
            probs = engine.probabilities(problem, params, lse_b, k1 - k0)
            s_dmask[b, :, : q1 - q0, : k1 - k0] = probs[0]
    return out, lse, s_dmask


def _scatter_pages(pool_grad: Tensor, grad: Tensor, pages: Tensor) -> None:
    """Add a sequence's key gradient ``(sk, hk, d)`` into ``pool_grad (num_pages, page, hk, d)``."""
    page_size = pool_grad.shape[1]
    padded = pool_grad.new_zeros(pages.shape[0] * page_size, *grad.shape[1:])
    padded[: grad.shape[0]] = grad
    # index_add_ accumulates, so pages shared by several sequences get every contribution.
    pool_grad.index_add_(0, pages, padded.view(pages.shape[0], page_size, *grad.shape[1:]))


def _varlen_backward(engine, dout, q, k, v, out, lse, params, varlen, alibi_slopes, qv=None):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    dqv = None if qv is None else torch.zeros(qv.shape, dtype=torch.float32, device=qv.device)
    for b, q0, q1, k0, k1, problem in _sequence_problems(q, k, v, varlen, alibi_slopes, qv):
        dq_b, dk_b, dv_b, *dqv_b = engine.backward(
            problem, params, dout[q0:q1].unsqueeze(0), out[q0:q1].unsqueeze(0), lse[:, q0:q1].unsqueeze(0)
        )
        dq[q0:q1] = dq_b[0]
        if dqv is not None:
            dqv[q0:q1] = dqv_b[0][0]
        if varlen.block_table is None:
            dk[k0:k1] += dk_b[0]
            dv[k0:k1] += dv_b[0]
        else:
            pages = _sequence_pages(varlen, b, k1 - k0, k.shape[1])
            _scatter_pages(dk, dk_b[0], pages)
            _scatter_pages(dv, dv_b[0], pages)
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return grads if dqv is None else (*grads, dqv.to(qv.dtype))


# ----------------------------------------------------------------------------------------------
# The contract's forward / backward, on an engine
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def forward(engine: Engine, q: Tensor, k: Tensor, v: Tensor, params: AttentionParams, *,
            varlen: Optional[VarlenLayout] = None, alibi_slopes: Optional[Tensor] = None,
            return_softmax: bool = False, sinks: Optional[Tensor] = None,
            qv: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The contract's ``forward`` (:mod:`flash_attn.backends.contract`) on ``engine``:
    ``(out, lse, s_dmask)``."""
    if varlen is not None:
        return _varlen_forward(engine, q, k, v, params, varlen, alibi_slopes, return_softmax, qv, sinks)
    problem = _dense_problem(q, k, v, _slopes_for(alibi_slopes), qv=qv, sinks=sinks)
    out, lse = engine.forward(problem, params, return_softmax)
    s_dmask = engine.probabilities(problem, params, lse, k.shape[1]) if return_softmax else None
    return out, lse, s_dmask


@torch.no_grad()
def backward(engine: Engine, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             params: AttentionParams, *, varlen: Optional[VarlenLayout] = None,
             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False, grads: Optional[tuple] = None,
             return_delta: bool = False, qv: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """The contract's ``backward`` on ``engine``: ``(dq, dk, dv)`` in the inputs' dtypes (and
    ``dqv`` with ``qv``; then Delta with ``return_delta``).

    ``deterministic`` and ``grads`` are accepted for the contract: the engines are always
    deterministic, and compute their gradients in their own buffers, never in the caller's.
    """
    if varlen is not None:
        result = _varlen_backward(engine, dout, q, k, v, out, lse, params, varlen, alibi_slopes, qv)
    else:
        problem = _dense_problem(q, k, v, _slopes_for(alibi_slopes), qv=qv)
        computed = engine.backward(problem, params, dout, out, lse)
        result = tuple(g.to(like.dtype) for g, like in zip(computed, (q, k, v, qv)))
    return (*result, delta(dout, out, varlen is not None)) if return_delta else result


def delta(dout: Tensor, out: Tensor, packed: bool) -> Tensor:
    """Delta ``rowsum(dout * out)`` in fp32, laid out like lse: ``(b, h, sq)``, packed ``(h, total)``."""
    rows = torch.linalg.vecdot(dout.to(torch.float32), out.to(torch.float32))  # (b, sq, h) or (total, h)
    return rows.t() if packed else rows.transpose(1, 2)


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


def _rotate_at(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of ``x (B, s, h, d)`` with row ``positions[b, t]`` of the tables.

    cos/sin: ``(seqlen_ro, rotary_dim / 2)``; features past ``rotary_dim`` pass through.
    ``interleaved`` rotates pairs ``(2i, 2i+1)`` (GPT-J), else ``(i, i + rotary_dim/2)`` (NeoX).
    Computed in fp32 and rounded once to ``x.dtype``, like the fused kernels.
    """
    half = cos.shape[1]
    rotary_dim = 2 * half
    c = cos[positions].to(torch.float32).unsqueeze(2)  # (B, s, 1, half)
    s = sin[positions].to(torch.float32).unsqueeze(2)
    rotated = rotate_pairs(x[..., :rotary_dim].to(torch.float32), c, s, interleaved)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def _cache_rows(cache: KVCacheInputs, batch: int) -> Tensor:
    """int64 ``(B,)``: the cache batch row of each query batch entry (non-paged caches)."""
    if cache.cache_batch_idx is not None:
        return cache.cache_batch_idx.to(torch.int64)
    return torch.arange(batch, device=cache.k_cache.device)


def _append_new_rows(cache: KVCacheInputs, k_new: Tensor, seqlens: Tensor) -> None:
    """Write ``k_new``/``cache.v_new (B, s_new, hk, d)`` into the cache in place at rows
    ``seqlens[b] + t`` (through the page table when paged)."""
    B, s_new = k_new.shape[:2]
    rows = seqlens.unsqueeze(1) + torch.arange(s_new, device=seqlens.device)  # (B, s_new)
    if cache.block_table is None:
        batch_rows = _cache_rows(cache, B).unsqueeze(1).expand(B, s_new)
        cache.k_cache[batch_rows, rows] = k_new.to(cache.k_cache.dtype)
        cache.v_cache[batch_rows, rows] = cache.v_new.to(cache.v_cache.dtype)
        return
    page_size = cache.k_cache.shape[1]
    table = cache.block_table.to(torch.int64)
    pages = table.gather(1, rows // page_size)
    cache.k_cache[pages, rows % page_size] = k_new.to(cache.k_cache.dtype)
    cache.v_cache[pages, rows % page_size] = cache.v_new.to(cache.v_cache.dtype)


def _cache_loader(cache: KVCacheInputs, batch: int) -> core.KVLoader:
    """Loader of cache columns ``c0:c1`` for every batch entry, ``(B, c1 - c0, hk, d)``.

    Only the requested columns are gathered, so the cache is never copied whole.
    """
    k_cache, v_cache = cache.k_cache, cache.v_cache
    if cache.block_table is None:
        if cache.cache_batch_idx is None:
            return lambda c0, c1: (k_cache[:batch, c0:c1], v_cache[:batch, c0:c1])
        rows = _cache_rows(cache, batch)
        # Slice the columns first (a view), so index_select copies only this chunk.
        return lambda c0, c1: (
            k_cache[:, c0:c1].index_select(0, rows),
            v_cache[:, c0:c1].index_select(0, rows),
        )

    page_size = k_cache.shape[1]
    # Table entries past a sequence's end may be arbitrary; clamp them to valid pages (the
    # columns they hold are masked anyway).
    table = cache.block_table.to(torch.int64).clamp(0, k_cache.shape[0] - 1)

    def load(c0: int, c1: int) -> tuple[Tensor, Tensor]:
        p0, p1 = c0 // page_size, -(-c1 // page_size)
        pages = table[:, p0:p1]  # (B, np)
        lo = c0 - p0 * page_size
        gather = lambda pool: pool[pages].flatten(1, 2)[:, lo : lo + (c1 - c0)]
        return gather(k_cache), gather(v_cache)

    return load


def _attended_rows_only(load: core.KVLoader, starts: Tensor, ends: Tensor, key_start: list,
                        key_end: list) -> core.KVLoader:
    """``load`` with the rows outside each batch entry's ``[start, end)`` set to 0 where a chunk
    holds any: every batch entry's chunk spans the longest sequence's columns, and rows nobody
    wrote (past a shorter sequence's end, before its left padding) may hold anything, NaN included
    (a cache made by ``torch.empty``): their scores are masked, but ``0 * NaN`` in ``p @ v`` is not 0.
    ``starts``/``ends``: the bounds per batch entry on the cache's device; ``key_start``/``key_end``:
    the same, read on the host."""
    first, last = max(key_start, default=0), min(key_end, default=0)  # the columns every batch entry attends
    if first == 0 and last == max(key_end, default=0):
        return load  # no chunk holds a row to hide
    device, lower, upper = starts.device, starts[:, None], ends[:, None]

    def load_attended(c0: int, c1: int) -> tuple[Tensor, Tensor]:
        k, v = load(c0, c1)
        if first <= c0 and c1 <= last:
            return k, v
        columns = torch.arange(c0, c1, device=device)
        keep = ((columns >= lower) & (columns < upper))[:, :, None, None]
        return k.where(keep, 0), v.where(keep, 0)

    return load_attended


@torch.no_grad()
def forward_kvcache(
    engine: Engine, q: Tensor, params: AttentionParams, cache: KVCacheInputs, *,
    alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None, qv: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``(out (b, sq, h, d), lse fp32 (b, h, sq))`` of ``flash_attn_with_kvcache``.

    Appends ``cache.k_new``/``v_new`` in place (after rotary on k) and rotates q (at
    ``cache_seqlens[b] + t`` when local/causal, else at ``cache_seqlens[b]`` for every row)
    before attending to cache rows ``cache_leftpad[b] : cache_seqlens[b] + seqlen_new``.
    ``cache.num_splits`` is a GPU scheduling hint and is ignored here. With a block table,
    ``cache_batch_idx`` is not used (flash-attn does not support combining them).
    """
    B, sq = q.shape[:2]
    device = q.device
    seqlens = (torch.full((B,), cache_capacity(cache.k_cache, cache.block_table), dtype=torch.int64, device=device)
               if cache.cache_seqlens is None else cache.cache_seqlens.to(device=device, dtype=torch.int64))
    s_new = 0 if cache.k_new is None else cache.k_new.shape[1]
    rotary = cache.rotary_cos is not None
    if cache.k_new is not None:
        k_new = cache.k_new
        if rotary:
            positions = seqlens.unsqueeze(1) + torch.arange(s_new, device=device)
            k_new = _rotate_at(k_new, cache.rotary_cos, cache.rotary_sin, positions, cache.rotary_interleaved)
        _append_new_rows(cache, k_new, seqlens)
    if rotary:
        # Local/causal queries sit at consecutive positions after the cache; otherwise flash-attn
        # rotates every query row at position cache_seqlens[b].
        steps = torch.arange(sq, device=device)
        if not params.is_local:
            steps = torch.zeros_like(steps)
        positions = seqlens.unsqueeze(1) + steps
        q = _rotate_at(q, cache.rotary_cos, cache.rotary_sin, positions, cache.rotary_interleaved)

    ends = seqlens + s_new  # one past the last attended cache row
    starts = torch.zeros_like(ends)
    if cache.cache_leftpad is not None:
        starts = cache.cache_leftpad.to(device=device, dtype=torch.int64)
    key_start, key_end = starts.tolist(), ends.tolist()
    problem = core.Problem(
        q=q,
        load_kv=_attended_rows_only(_cache_loader(cache, B), starts, ends, key_start, key_end),
        n_cols=max(key_end, default=0),
        nheads_k=cache.k_cache.shape[-2],
        head_dim_v=cache.v_cache.shape[-1],
        key_start=key_start,
        key_len=[end - start for start, end in zip(key_start, key_end)],
        alibi_slopes=_slopes_for(alibi_slopes),
        qv=qv,
        sinks=sinks,
    )
    return engine.forward(problem, params, False)
