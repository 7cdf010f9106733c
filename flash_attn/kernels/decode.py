"""Triton kernels of KV-cache attention (decoding): split-KV attention and the split combine.

``flash_attn_with_kvcache`` usually has very few query rows (often one token) and many keys, so
one program per (batch, head) would leave most of the GPU idle. :func:`split_kv_kernel` therefore

* packs the whole query-head group of one kv head into the rows of a tile: row ``m`` of a tile
  is query row ``t = m // group`` of head ``kv_head * group + m % group``, so decoding with
  ``seqlen_q = 1`` and GQA still feeds ``BLOCK_M >= 16`` rows to the tensor cores, and K/V are
  read once per kv head (never repeated per query head);
* splits the visible key blocks of each sequence into ``num_splits`` contiguous ranges, one per
  program, each producing a normalised partial output (fp32) and its logsumexp;

and :func:`combine_splits_kernel` merges the partial results by their logsumexp. With a single
split the attention kernel writes the final output directly and no combine runs. Without rotary
(and on NVIDIA GPUs: :func:`flash_attn.planning.decode_configs.fuses_append`) the attention
kernel also appends the call's few new keys and values to the cache (``seqlen_append``), so a
decoding step is one or two launches.

Keys of batch entry ``b`` are cache rows ``cache_leftpad[b] : cache_seqlens[b] + seqlen_new``
(``sk`` of them) of cache sequence ``cache_batch_idx[b]`` or of the pages ``block_table[b]``; key
``j`` (``j = 0`` at ``cache_leftpad[b]``) is visible to query row ``i`` iff
``i + sk - sq - window_left <= j <= i + sk - sq + window_right`` (``-1`` = unbounded). Scores are
``softcap * tanh(scale * q.k / softcap)`` (or ``scale * q.k``) minus ``slope * |i + sk - sq - j|``
with ALiBi (:func:`flash_attn.kernels.masking.logits_log2`); the online softmax runs in base 2
with ``log2(e)`` folded into the scale.

A row that sees no key produces out 0 and lse ``empty_lse`` (+inf for the final result, -inf
for a partial result, so that it weighs nothing in the combine).

AOT rules: sizes, strides and scalars are plain arguments; features are ``tl.constexpr`` flags;
no autotuning; every pointer has one element type per q/k/v dtype (the final output ``Out`` and
the fp32 partial output ``OutPart`` are separate arguments, chosen at run time by the number of
splits). ``split_kv_kernel``'s specialisations: ``BLOCK_M``/``BLOCK_N``/``BLOCK_D`` (from
:data:`flash_attn.planning.decode_configs.DECODE_CONFIGS`), ``IS_LOCAL``, ``HAS_SOFTCAP``,
``HAS_ALIBI``, ``PAGED``, ``HAS_BATCH_IDX``, ``HAS_LEFTPAD``; each flag's "on" variant is exact
for calls without the feature (``-1`` window bounds, ``softcap = 0``, zero slopes, a non-paged
cache as pages of its whole length, zero left padding), which the launcher's *superset mode*
uses (:mod:`flash_attn.planning.decode_configs`). Performance note for the compiled variants: the
feature mask ``offs_d < head_dim`` only lets K/V loads vectorise (16-byte loads, ``cp.async``
pipelining) when the compiler knows ``head_dim`` (and the strides, pointers) are multiples of 8
elements; Triton's JIT specialises that automatically, an ahead-of-time build must declare it
(``tt.divisibility``, :func:`flash_attn.planning.decode_configs.aot_divisibility`). Without it
the kernels are correct but issue scalar loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flash_attn.kernels import masking
from flash_attn.kernels.tiles import LN2, LOG2E, online_softmax_step


@triton.jit
def _key_block_range(t_first, t_last, seqlen_q, seqlen_k, window_left, window_right,
                     BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr):
    """Key blocks that query rows ``[t_first, t_last]`` visit: ``[lo, hi)``.

    The packed-row counterpart of :func:`flash_attn.kernels.masking.key_block_range` (a tile of
    ``BLOCK_M`` packed rows holds a run of ``t_last - t_first + 1`` query rows that is not a
    compile-time size). Block indices; divisions only of values clamped to ``>= 0``. A bound of
    ``-1`` leaves its side exactly as without ``IS_LOCAL``, so ``IS_LOCAL=True`` serves non-local
    calls too (the ahead-of-time superset relies on it).
    """
    first = seqlen_k * 0
    last = seqlen_k  # one past
    if IS_LOCAL:
        lowest, highest = masking.window_bounds(seqlen_q, seqlen_k, window_left, window_right)
        first = tl.maximum(t_first + lowest, 0)
        last = tl.minimum(tl.maximum(t_last + highest + 1, 0), seqlen_k)
    lo = first // BLOCK_N
    return lo, tl.maximum((last + BLOCK_N - 1) // BLOCK_N, lo)


@triton.jit
def _cache_rows(rows, row_mask, seq, bt_row, page_size, identity_table, PAGED: tl.constexpr):
    """Where cache rows ``rows`` (row indices of one sequence) live: ``(slot, row)`` int64, i.e.
    the page and the row inside it when ``PAGED``, else the cache sequence ``seq`` and ``rows``.
    ``identity_table != 0`` (paged only): the table is not read, sequence ``b`` is page ``seq``
    (a plain cache addressed as one page of ``page_size`` rows per sequence)."""
    if PAGED:
        # a tensor compare: an int argument equal to 1 may arrive as a compile-time constant
        from_table = (rows * 0 + identity_table) == 0
        page = tl.load(bt_row + rows // page_size, mask=row_mask & from_table, other=0).to(tl.int64)
        page = tl.where(from_table, page, seq)
        return page, (rows % page_size).to(tl.int64)
    else:
        return seq + rows.to(tl.int64) * 0, rows.to(tl.int64)


@triton.jit
def _attend_blocks(
    acc, m_i, l_i, q, qv, row_pos, slope_log2,
    K, V, seq, bt_row, block_start, block_end, first_row, seqlen_k, seqlen_q, offs_d, d_mask, offs_dv, dv_mask,
    page_size, stride_kb, stride_ks, k_head, stride_vb, stride_vs, v_head,
    qk_scale_log2, cap_on, cap_in, cap_out_log2, window_left, window_right, identity_table,
    BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    PAGED: tl.constexpr, HAS_QV: tl.constexpr,
):
    """Online softmax over key blocks ``[block_start, block_end)`` (positions ``j``, 0-based).

    ``acc`` (fp32 ``(BLOCK_M, BLOCK_DV)``), ``m_i`` (running max, base-2 units) and ``l_i`` (running
    sum) are updated and returned. Every block is masked (key range and window): decoding is bound
    by reading K/V, not by the mask arithmetic. The score scalars come from
    :func:`flash_attn.kernels.masking.score_scalars`; ``slope_log2`` is the ALiBi slope of each
    row times ``log2(e)``. ``HAS_QV``: each V block is also scored against ``qv`` (MLA), read
    before the scores and used again for the output.
    """
    for block in range(block_start, block_end):
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seqlen_k
        rows = first_row + offs_n
        slot, row = _cache_rows(rows, n_mask, seq, bt_row, page_size, identity_table, PAGED)
        k_off = slot * stride_kb + row * stride_ks + k_head
        v_off = slot * stride_vb + row * stride_vs + v_head
        k = tl.load(K + k_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        if HAS_QV:
            v = tl.load(V + v_off[:, None] + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
            qk = tl.dot(qv, tl.trans(v), qk, input_precision="ieee")
        # softcap (switched at run time by cap_on), ALiBi and the mask: the rule of every kernel
        s, _ = masking.logits_log2(qk, row_pos[:, None], offs_n[None, :], seqlen_q, seqlen_k, qk_scale_log2,
                                   cap_on, cap_in, cap_out_log2, slope_log2[:, None], window_left, window_right,
                                   True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI)
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        if not HAS_QV:
            v = tl.load(V + v_off[:, None] + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return acc, m_i, l_i


@triton.jit
def _program_tile(seqlen_q, group, nheads_k, BLOCK_M: tl.constexpr):
    """This program's ``(b, kv_head, m_block, split, num_splits)``: axis 0 is (batch entry, kv
    head) x row blocks, row block fastest (so any batch x heads fits the grid), axis 1 the split."""
    num_m_blocks = tl.cdiv(seqlen_q * group, BLOCK_M)
    pid_bh = tl.program_id(0) // num_m_blocks
    m_block = tl.program_id(0) % num_m_blocks
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    return pid_bh // nheads_k, pid_bh % nheads_k, m_block, split, num_splits


@triton.jit
def _cache_sequence(b, Seqlens, Leftpad, BatchIdx, BlockTable, seqlen_new, seqlen_cache, use_leftpad, stride_btb,
                    PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr):
    """Where the keys of batch entry ``b`` live: ``(first_row, seqlen_k, seq, bt_row)``, i.e. cache
    rows ``[first_row, first_row + seqlen_k)`` of cache sequence ``seq`` (int64; its page when the
    table is the identity) or of the pages listed at ``bt_row`` (its block-table row). The cache
    rows in use: ``cache_seqlens[b]``, or with ``seqlen_cache >= 0`` that number for every entry
    (``Seqlens`` then not read)."""
    if HAS_LEFTPAD:
        first_row = tl.load(Leftpad + b, mask=use_leftpad != 0, other=0)
    else:
        first_row = 0
    cached = tl.load(Seqlens + b, mask=seqlen_cache < 0, other=0)
    seqlen_k = tl.where(seqlen_cache < 0, cached, seqlen_cache) + seqlen_new - first_row
    if PAGED:
        seq = b.to(tl.int64)
        bt_row = BlockTable + b.to(tl.int64) * stride_btb
    else:
        if HAS_BATCH_IDX:
            seq = tl.load(BatchIdx + b).to(tl.int64)
        else:
            seq = b.to(tl.int64)
        bt_row = BlockTable
    return first_row, seqlen_k, seq, bt_row


@triton.jit
def _packed_rows(m_block, kv_head, seqlen_q, group, BLOCK_M: tl.constexpr):
    """The tile's packed rows ``m -> (query row m // group, head kv_head * group + m % group)``:
    ``(row_pos, head, m_mask)``."""
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seqlen_q * group
    return offs_m // group, kv_head * group + offs_m % group, m_mask


@triton.jit
def _load_packed_q(Q, b, row_pos, head, m_mask, offs_d, d_mask, stride_qb, stride_qs, stride_qh):
    """The ``(BLOCK_M, BLOCK_D)`` query tile of the packed rows (zeros outside them)."""
    q_off = b.to(tl.int64) * stride_qb + row_pos.to(tl.int64) * stride_qs + head * stride_qh
    return tl.load(Q + q_off[:, None] + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _alibi_slopes_log2(Alibi, b, head, m_mask, stride_ab, use_alibi, HAS_ALIBI: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    """Each packed row's ALiBi slope times ``log2(e)`` (fp32; zero when ``use_alibi == 0``)."""
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * stride_ab + head, mask=m_mask & ((head * 0 + use_alibi) != 0), other=0.0)
        return slope.to(tl.float32) * LOG2E
    else:
        return tl.zeros([BLOCK_M], dtype=tl.float32)


@triton.jit
def _split_share(m_block, split, num_splits, seqlen_q, group, seqlen_k, window_left, window_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_LOCAL: tl.constexpr):
    """This split's contiguous share ``[start, end)`` of the key blocks some row of the tile sees
    (``ceil(blocks / num_splits)`` per split; empty for the splits past the last block)."""
    t_first = (m_block * BLOCK_M) // group
    t_last = (tl.minimum((m_block + 1) * BLOCK_M, seqlen_q * group) - 1) // group
    block_lo, block_hi = _key_block_range(t_first, t_last, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N,
                                          IS_LOCAL)
    per_split = (block_hi - block_lo + num_splits - 1) // num_splits
    start = tl.minimum(block_lo + split * per_split, block_hi)
    return start, tl.minimum(start + per_split, block_hi)


@triton.jit
def _normalised(acc, m_i, l_i, empty_lse):
    """The online softmax's result: ``(out, lse)``, lse in natural log (``empty_lse`` and out 0
    for a row that saw no key)."""
    seen = l_i != 0.0  # a NaN sum (NaN or +inf scores) stays NaN
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    return out, tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, empty_lse)


@triton.jit
def _row_sinks_log2(Sinks, head, m_mask, use_sinks):
    """Each packed row's attention sink (its head's, times ``log2(e)``), ``-inf`` where there is
    none (``use_sinks == 0``: ``Sinks`` is not read)."""
    on = m_mask & ((head * 0 + use_sinks) != 0)  # a tensor compare: the int may arrive as a constant
    return tl.load(Sinks + head, mask=on, other=float("-inf")).to(tl.float32) * LOG2E


@triton.jit
def _store_out(Out, OutPart, out, b, split, num_splits, row_pos, head, m_mask, offs_d, d_mask, stride_ob, stride_os,
               stride_oh, stride_px, stride_pb, stride_ps, stride_ph):
    """``out`` into the final output (one split, in ``Out``'s dtype) or into this split's fp32
    partial output."""
    row_off = row_pos.to(tl.int64)
    o_mask = m_mask[:, None] & d_mask[None, :]
    # a branch on a uniform scalar around stores only: nothing is yielded, no extra live tiles
    if num_splits == 1:
        o_off = b.to(tl.int64) * stride_ob + row_off * stride_os + head * stride_oh
        tl.store(Out + o_off[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
    else:
        p_off = split.to(tl.int64) * stride_px + b.to(tl.int64) * stride_pb + row_off * stride_ps + head * stride_ph
        tl.store(OutPart + p_off[:, None] + offs_d[None, :], out, mask=o_mask)


@triton.jit
def _store_lse(Lse, lse, b, split, row_pos, head, m_mask, stride_lx, stride_lb, stride_ls, stride_lh):
    """This split's logsumexp of each packed row (the final one when there is one split)."""
    l_off = split.to(tl.int64) * stride_lx + b.to(tl.int64) * stride_lb + row_pos.to(tl.int64) * stride_ls \
        + head * stride_lh
    tl.store(Lse + l_off, lse, mask=m_mask)


@triton.jit
def _append_rows(K, V, K_new, V_new, b, kv_head, m_block, split, start, end, seqlen_k, seqlen_append, Seqlens, seq,
                 bt_row, page_size, identity_table, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh, offs_d, d_mask, offs_dv,
                 dv_mask, BLOCK_N: tl.constexpr, BLOCK_NEW: tl.constexpr, PAGED: tl.constexpr):
    """The fused append: new rows ``t`` of this (batch entry, kv head) copied from ``K_new``/``V_new``
    to cache rows ``cache_seqlens[b] + t`` (keys ``seqlen_k - seqlen_append + t``).

    Each program copies the new keys of its own share of key blocks ``[start, end)`` and then
    waits for its threads (a CTA barrier orders their global writes before its reads), so it reads
    them from the cache as the rest; the first row block's first split copies every new row, also
    those no program's share holds (keys no query row sees). Programs that copy the same row write
    the same bytes: whatever order they run in, every read of a new row finds its new value.
    ``seqlen_append <= BLOCK_NEW``: one tile, no loop (a loop here cost the attention loop
    registers on sm86: 3 -> 2 CTAs per SM at head dim 128).
    """
    new_start = seqlen_k - seqlen_append
    own_lo = tl.minimum(tl.maximum(start * BLOCK_N - new_start, 0), seqlen_append)
    own_hi = tl.maximum(tl.minimum(end * BLOCK_N - new_start, seqlen_append), own_lo)
    first = (m_block == 0) & (split == 0)
    lo = tl.where(first, 0, own_lo)
    hi = tl.where(first, seqlen_append, own_hi)
    row0 = tl.load(Seqlens + b, mask=seqlen_append > 0, other=0)  # (a call that appends has cache_seqlens)
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh
    k_src = K_new + b.to(tl.int64) * stride_knb + kv_head.to(tl.int64) * stride_knh
    v_src = V_new + b.to(tl.int64) * stride_vnb + kv_head.to(tl.int64) * stride_vnh
    offs_t = lo + tl.arange(0, BLOCK_NEW)  # seqlen_append <= BLOCK_NEW: one tile
    t_mask = offs_t < hi
    slot, row = _cache_rows(row0 + offs_t, t_mask, seq, bt_row, page_size, identity_table, PAGED)
    src = offs_t.to(tl.int64)
    k_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_src + (src * stride_kns)[:, None] + offs_d[None, :], mask=k_mask)
    tl.store(K + (slot * stride_kb + row * stride_ks + k_head)[:, None] + offs_d[None, :], k, mask=k_mask)
    v_mask = t_mask[:, None] & dv_mask[None, :]
    v = tl.load(v_src + (src * stride_vns)[:, None] + offs_dv[None, :], mask=v_mask)
    tl.store(V + (slot * stride_vb + row * stride_vs + v_head)[:, None] + offs_dv[None, :], v, mask=v_mask)
    tl.debug_barrier()


@triton.jit
def split_kv_kernel(
    Q, K, V, Out, OutPart, Lse,
    Seqlens, Leftpad, BatchIdx, BlockTable, Alibi, Sinks, QV, K_new, V_new,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_px, stride_pb, stride_ps, stride_ph,
    stride_lx, stride_lb, stride_ls, stride_lh,
    stride_qvb, stride_qvs, stride_qvh,
    stride_knb, stride_kns, stride_knh,
    stride_vnb, stride_vns, stride_vnh,
    stride_btb, stride_ab,
    nheads_k, seqlen_q, seqlen_new, seqlen_append, seqlen_cache, group, head_dim, head_dim_v, page_size,
    use_leftpad, use_alibi, use_sinks, identity_table,
    softmax_scale, softcap, window_left, window_right, empty_lse,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_NEW: tl.constexpr,
    IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, HAS_QV: tl.constexpr,
):
    """Grid ``(batch * nheads_k * cdiv(seqlen_q * group, BLOCK_M), num_splits)``.

    Program ``((b * nheads_k + kv_head) * m_blocks + m_block, split)`` attends the packed rows
    ``[m_block * BLOCK_M, ...)`` of kv head ``kv_head`` to its share of the visible key blocks and
    stores the normalised result and its natural-log logsumexp at ``Lse + split * stride_lx +
    ...``. The result goes to the final output ``Out`` (q's dtype, strides ``stride_o*``) when
    there is one split, else to the fp32 scratch ``OutPart + split * stride_px + ...``: two
    pointers chosen at run time rather than one pointer of either type, so that the kernel has a
    single signature per dtype (an ahead-of-time build compiles one kernel, not two).

    q/k have ``head_dim`` columns (``BLOCK_D``), v and the output ``head_dim_v`` (``BLOCK_DV``);
    ``QV`` (``HAS_QV``): MLA's absorbed queries, like q with ``head_dim_v`` columns. The attention
    sinks (``use_sinks``) join the row sums here when there is one split, else in the combine (once
    per row, not per split).

    ``seqlen_append`` (0: none; at most ``BLOCK_NEW``) fuses the append: the call's last
    ``seqlen_append`` keys are copied from ``K_new``/``V_new`` (``(batch, seqlen_new, nheads_k, d or
    dv)``, strides ``stride_kn*``/``stride_vn*``) to cache rows ``cache_seqlens[b] + t``
    (:func:`_append_rows`) before the program reads its keys from the cache. With 0 the new keys
    (if any: ``seqlen_new``) are in the cache already: an append kernel wrote them before.
    ``seqlen_cache`` (``-1``: read ``Seqlens``): every entry's cache rows, for a call without
    cache_seqlens (then ``Seqlens`` is not read, nor appended to).
    """
    b, kv_head, m_block, split, num_splits = _program_tile(seqlen_q, group, nheads_k, BLOCK_M)
    first_row, seqlen_k, seq, bt_row = _cache_sequence(b, Seqlens, Leftpad, BatchIdx, BlockTable, seqlen_new,
                                                       seqlen_cache, use_leftpad, stride_btb, PAGED, HAS_BATCH_IDX,
                                                       HAS_LEFTPAD)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < head_dim_v
    start, end = _split_share(m_block, split, num_splits, seqlen_q, group, seqlen_k, window_left, window_right,
                              BLOCK_M, BLOCK_N, IS_LOCAL)
    # first, with little else live: the copy's tiles cost no registers beside the loop's
    _append_rows(K, V, K_new, V_new, b, kv_head, m_block, split, start, end, seqlen_k, seqlen_append, Seqlens, seq,
                 bt_row, page_size, identity_table, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh, offs_d, d_mask, offs_dv,
                 dv_mask, BLOCK_N, BLOCK_NEW, PAGED)
    row_pos, head, m_mask = _packed_rows(m_block, kv_head, seqlen_q, group, BLOCK_M)
    q = _load_packed_q(Q, b, row_pos, head, m_mask, offs_d, d_mask, stride_qb, stride_qs, stride_qh)
    qv = q
    if HAS_QV:
        qv = _load_packed_q(QV, b, row_pos, head, m_mask, offs_dv, dv_mask, stride_qvb, stride_qvs, stride_qvh)
    slope_log2 = _alibi_slopes_log2(Alibi, b, head, m_mask, stride_ab, use_alibi, HAS_ALIBI, BLOCK_M)
    qk_scale_log2, cap_on, cap_in, cap_out_log2 = masking.score_scalars(softmax_scale, softcap, HAS_SOFTCAP)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = _row_sinks_log2(Sinks, head, m_mask, use_sinks * (num_splits == 1))  # else the combine adds them
    l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, qv, row_pos, slope_log2, K, V, seq, bt_row, start, end, first_row, seqlen_k, seqlen_q,
        offs_d, d_mask, offs_dv, dv_mask, page_size, stride_kb, stride_ks, kv_head.to(tl.int64) * stride_kh,
        stride_vb, stride_vs, kv_head.to(tl.int64) * stride_vh, qk_scale_log2, cap_on, cap_in, cap_out_log2,
        window_left, window_right, identity_table, BLOCK_N, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, PAGED, HAS_QV)

    out, lse = _normalised(acc, m_i, l_i, empty_lse)
    _store_out(Out, OutPart, out, b, split, num_splits, row_pos, head, m_mask, offs_dv, dv_mask, stride_ob, stride_os,
               stride_oh, stride_px, stride_pb, stride_ps, stride_ph)
    _store_lse(Lse, lse, b, split, row_pos, head, m_mask, stride_lx, stride_lb, stride_ls, stride_lh)


@triton.jit
def combine_splits_kernel(
    OutPart,
    LsePart,
    Out,
    Lse,
    Sinks,
    stride_px,
    stride_pb,
    stride_ps,
    stride_ph,
    stride_mx,
    stride_mb,
    stride_ms,
    stride_mh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_ls,
    stride_lh,
    num_splits,
    seqlen_q,
    nheads,
    head_dim,
    use_sinks,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(batch * cdiv(seqlen_q * nheads, BLOCK_R),)``: merge ``num_splits`` partial results.

    Row ``r`` of batch entry ``b`` is query row ``r // nheads`` of head ``r % nheads``. With
    partial logsumexps ``lse_s`` and normalised partial outputs ``o_s``:
    ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse) o_s``. Splits with
    ``lse_s = -inf`` (no visible key) weigh nothing; a row with none at all gets out 0, lse +inf.
    With ``use_sinks`` the row's attention sink (``Sinks[head]``, a logit with no value) joins the
    sum once: it weighs ``exp(sink - lse)`` and adds nothing to the output.
    ``OutPart`` strides: ``stride_p*``; ``LsePart`` strides: ``stride_m*``; ``head_dim``: the
    output's (v's).
    """
    num_r_blocks = tl.cdiv(seqlen_q * nheads, BLOCK_R)
    b = (tl.program_id(0) // num_r_blocks).to(tl.int64)
    pid_r = tl.program_id(0) % num_r_blocks
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = offs_r < seqlen_q * nheads
    d_mask = offs_d < head_dim
    t = (offs_r // nheads).to(tl.int64)
    h = offs_r % nheads
    lse_ptrs = LsePart + b * stride_mb + t * stride_ms + h * stride_mh
    part_ptrs = OutPart + b * stride_pb + t[:, None] * stride_ps + h[:, None] * stride_ph + offs_d[None, :]
    mask = r_mask[:, None] & d_mask[None, :]

    sink = _row_sinks_log2(Sinks, h, r_mask, use_sinks) * LN2  # natural units, -inf without
    lse_max = sink
    for s in range(0, num_splits):
        lse_s = tl.load(lse_ptrs + s * stride_mx, mask=r_mask, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse_s)
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.math.exp2((sink - shift) * LOG2E)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        lse_s = tl.load(lse_ptrs + s * stride_mx, mask=r_mask, other=float("-inf"))
        w = tl.math.exp2((lse_s - shift) * LOG2E)
        o_s = tl.load(part_ptrs + s * stride_px, mask=mask, other=0.0)
        total += w
        acc += w[:, None] * o_s
    seen = total != 0.0  # a NaN split (NaN or +inf scores) makes the row NaN
    total_safe = tl.where(seen, total, 1.0)
    out = acc / total_safe[:, None]
    lse = tl.where(seen, shift + tl.log(total_safe), float("inf"))
    o_ptrs = Out + b * stride_ob + t[:, None] * stride_os + h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + b * stride_lb + t * stride_ls + h * stride_lh, lse, mask=r_mask)
