"""Triton kernels that prepare a KV-cache call: append the new k/v rows, rotate k and q.

``flash_attn_with_kvcache`` writes the new tokens into the cache *before* attending. Without
rotary the attention kernel (:mod:`flash_attn.kernels.decode`) appends a few new rows itself on
NVIDIA GPUs (one launch fewer: :func:`flash_attn.planning.decode_configs.fuses_append`,
:data:`~flash_attn.planning.decode_configs.FUSED_APPEND_ROWS`); otherwise (rotary, more rows, AMD
GPUs, no query row to attend) two kernels do the work here:

* :func:`append_kv_kernel` copies ``k_new``/``v_new`` row ``t`` of batch entry ``b`` into cache
  row ``cache_seqlens[b] + t`` (of cache sequence ``cache_batch_idx[b]``, or through the pages of
  ``block_table[b]``), rotating k by the angles of that absolute row on the way;
* :func:`rotary_q_kernel` writes a rotated copy of q: row ``t`` at position
  ``cache_seqlens[b] + t`` (``PER_ROW_POSITION``, used for causal/local calls) or every row at
  ``cache_seqlens[b]``.

Rotary embedding (RoPE) with tables ``cos``/``sin`` of shape ``(seqlen_ro, rotary_dim / 2)``
rotates feature pairs ``(2i, 2i + 1)`` (``INTERLEAVED``, GPT-J) or ``(i, i + rotary_dim / 2)``
(GPT-NeoX) of the first ``rotary_dim`` features; the rest pass through. The arithmetic runs in
fp32 and is rounded once to the tensor's dtype.

AOT rules (as for every kernel in this package): sizes and strides are ordinary integer
arguments, features are ``tl.constexpr`` flags, no autotuning, no host-side state. Every load and
store masks ``offs_d < head_dim`` with the run-time head dim, so a ``BLOCK_D`` wider than the head
dim is exact; ``PAGED=True`` also serves a non-paged cache ``(b_cache, s, hk, d)`` as pages of
``s`` rows with a ``(b, 1)`` block table (the launcher's superset mode,
:mod:`flash_attn.planning.decode_configs`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotated_rows(
    row_ptrs,
    offs_d,
    row_mask,
    positions,
    Cos,
    Sin,
    stride_ro,
    rotary_half,
    head_dim,
    INTERLEAVED: tl.constexpr,
    HAS_ROTARY: tl.constexpr,
):
    """Rows ``row_ptrs[:, None] + offs_d[None, :]`` loaded and (if ``HAS_ROTARY``) rotated.

    ``row_ptrs``: pointers to the first feature of each row, ``(BLOCK_T,)``; ``positions``: the
    rotary position of each row (its ``cos``/``sin`` table row). Returns fp32
    ``(BLOCK_T, BLOCK_D)``; masked entries are 0.
    """
    d_mask = offs_d < head_dim
    mask = row_mask[:, None] & d_mask[None, :]
    x = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ROTARY:
        in_rotary = offs_d < 2 * rotary_half
        if INTERLEAVED:
            partner = offs_d ^ 1
            angle = offs_d // 2
            first = (offs_d % 2) == 0
        else:
            low = offs_d < rotary_half
            partner = tl.where(low, offs_d + rotary_half, offs_d - rotary_half)
            angle = tl.where(low, offs_d, offs_d - rotary_half)
            first = low
        rot_mask = row_mask[:, None] & in_rotary[None, :]
        x_partner = tl.load(row_ptrs[:, None] + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
        table = positions[:, None].to(tl.int64) * stride_ro + angle[None, :]
        cos = tl.load(Cos + table, mask=rot_mask, other=1.0).to(tl.float32)
        sin = tl.load(Sin + table, mask=rot_mask, other=0.0).to(tl.float32)
        # (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)
        x = x * cos + tl.where(first[None, :], -x_partner, x_partner) * sin
    return x


@triton.jit
def _head_row_block(seqlen, nheads, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's ``(b, h, offs_t, offs_d, offs_t < seqlen)`` in a grid of
    ``batch * nheads * cdiv(seqlen, BLOCK_T)`` blocks of ``BLOCK_T`` rows of one head."""
    num_t_blocks = tl.cdiv(seqlen, BLOCK_T)
    pid_bh = tl.program_id(0) // num_t_blocks
    pid_t = tl.program_id(0) % num_t_blocks
    b = pid_bh // nheads
    h = pid_bh % nheads
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    return b, h, offs_t, offs_d, offs_t < seqlen


@triton.jit
def append_kv_kernel(
    K_new,
    V_new,
    K_cache,
    V_cache,
    Cos,
    Sin,
    Seqlens,
    BatchIdx,
    BlockTable,
    stride_knb,
    stride_kns,
    stride_knh,
    stride_vnb,
    stride_vns,
    stride_vnh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_btb,
    stride_ro,
    nheads_k,
    seqlen_new,
    head_dim,
    head_dim_v,
    rotary_half,
    page_size,
    identity_table,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Grid ``(batch * nheads_k * cdiv(seqlen_new, BLOCK_T),)``: one block of new rows of one head.

    ``K_cache``/``V_cache`` are ``(batch_cache, seqlen_cache, nheads_k, d or dv)`` or, when
    ``PAGED``, a page pool ``(num_pages, page_size, nheads_k, d or dv)`` (then ``stride_*cb`` is the
    page stride); v's rows have ``head_dim_v`` columns (``BLOCK_DV``), k's ``head_dim``.
    """
    b, h, offs_t, offs_d, t_mask = _head_row_block(seqlen_new, nheads_k, BLOCK_T, BLOCK_D)
    positions = tl.load(Seqlens + b) + offs_t  # absolute cache rows, also the rotary positions

    if PAGED:
        # identity_table: a plain cache addressed as one page per sequence (the table is not read)
        from_table = (offs_t * 0 + identity_table) == 0  # a tensor: the int may arrive as a constant
        page = tl.load(BlockTable + b.to(tl.int64) * stride_btb + positions // page_size, mask=t_mask & from_table,
                       other=0)
        seq = tl.where(from_table, page.to(tl.int64), b.to(tl.int64))
        rows = (positions % page_size).to(tl.int64)
    else:
        if HAS_BATCH_IDX:
            seq = tl.load(BatchIdx + b).to(tl.int64)
        else:
            seq = b.to(tl.int64)
        rows = positions.to(tl.int64)
    k_dst = K_cache + seq * stride_kcb + rows * stride_kcs + h * stride_kch
    v_dst = V_cache + seq * stride_vcb + rows * stride_vcs + h * stride_vch

    k_src = K_new + b.to(tl.int64) * stride_knb + offs_t * stride_kns + h * stride_knh
    v_src = V_new + b.to(tl.int64) * stride_vnb + offs_t * stride_vns + h * stride_vnh
    k = rotated_rows(k_src, offs_d, t_mask, positions, Cos, Sin, stride_ro, rotary_half, head_dim,
                     INTERLEAVED, HAS_ROTARY)
    d_mask = offs_d < head_dim
    mask = t_mask[:, None] & d_mask[None, :]
    tl.store(k_dst[:, None] + offs_d[None, :], k.to(K_cache.dtype.element_ty), mask=mask)
    offs_dv = tl.arange(0, BLOCK_DV)
    v_mask = t_mask[:, None] & (offs_dv < head_dim_v)[None, :]
    v = tl.load(v_src[:, None] + offs_dv[None, :], mask=v_mask, other=0.0)
    tl.store(v_dst[:, None] + offs_dv[None, :], v, mask=v_mask)


@triton.jit
def rotary_q_kernel(
    Q,
    Q_out,
    Cos,
    Sin,
    Seqlens,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_ro,
    nheads,
    seqlen_q,
    head_dim,
    rotary_half,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PER_ROW_POSITION: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Grid ``(batch * nheads * cdiv(seqlen_q, BLOCK_T),)``: ``Q_out = rotary(Q)`` for one head.

    Row ``t`` of batch entry ``b`` sits at position ``cache_seqlens[b] + t`` when
    ``PER_ROW_POSITION``, otherwise at ``cache_seqlens[b]``.
    """
    b, h, offs_t, offs_d, t_mask = _head_row_block(seqlen_q, nheads, BLOCK_T, BLOCK_D)
    start = tl.load(Seqlens + b)
    if PER_ROW_POSITION:
        positions = start + offs_t
    else:
        positions = start + offs_t * 0
    src = Q + b.to(tl.int64) * stride_qb + offs_t * stride_qs + h * stride_qh
    dst = Q_out + b.to(tl.int64) * stride_ob + offs_t * stride_os + h * stride_oh
    q = rotated_rows(src, offs_d, t_mask, positions, Cos, Sin, stride_ro, rotary_half, head_dim,
                     INTERLEAVED, True)
    mask = t_mask[:, None] & (offs_d < head_dim)[None, :]
    tl.store(dst[:, None] + offs_d[None, :], q.to(Q_out.dtype.element_ty), mask=mask)
