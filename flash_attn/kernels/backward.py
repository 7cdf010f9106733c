"""Triton backward kernels of FlashAttention-2: preprocess, then fused (atomic dQ) or split.

* :func:`attn_bwd_preprocess_kernel`: ``delta = rowsum(dO * O)`` (fp32, laid out like lse), and
  for the fused backward the zeroed dQ sums.
* :func:`attn_bwd_kernel` (``deterministic=False``, flash-attn's default): one program owns
  ``BLOCK_N`` key rows of one *kv* head and walks the query tiles that see them
  (:func:`~flash_attn.kernels.masking.query_block_range`), for every query head of its GQA group
  in turn, so dK/dV of a group are summed in registers; each tile's dQ share is added atomically
  into an fp32 buffer, which :func:`attn_bwd_dq_convert_kernel` scales and rounds. Five products
  per tile pair; the order of the dQ additions varies from run to run.
* ``deterministic=True``: :func:`attn_bwd_dkdv_kernel` (the same program without dQ) and
  :func:`attn_bwd_dq_kernel`, where one program owns ``BLOCK_M`` query rows of one query head and
  walks their key tiles (:func:`~flash_attn.kernels.masking.key_block_range`). Every output
  element is written by exactly one program and summed in a fixed order (bit-identical across
  runs), at the price of recomputing the probabilities in both kernels (seven products).

Gradients, with ``P`` the softmax, ``Z`` the dropout keep mask over ``1 - p`` and
``delta = rowsum(dO * O)``::

    dV = (P * Z)^T dO
    dS = P * (Z * (dO V^T) - delta)         (w.r.t. the logits)
    dS_qk = dS * scale * (1 - tanh^2)       (softcap; without it just * scale)
    dQ = dS_qk K,   dK = dS_qk^T Q

The feature flags and argument conventions are those of :mod:`flash_attn.kernels.forward`
(paged K/V and ``qv`` are not supported here: the launcher falls back to the reference backend);
q/k have ``head_dim`` columns in ``BLOCK_D``, v/dO/O ``head_dim_v`` in ``BLOCK_DV``. The backward
needs nothing of attention sinks: the forward's lse includes the sink, so ``P = exp(s - lse)`` is
already each key's share, and the sink's own gradient, ``-sum(exp(sink - lse) * delta)`` over a
head's rows, is computed from lse and delta outside the kernels (:mod:`flash_attn.custom_ops`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flash_attn.kernels import masking
from flash_attn.kernels.dropout_rng import dropout_keep
from flash_attn.kernels.tiles import (
    LOG2E, alibi_slope_log2, block_and_batch, head_rows, load_seed, row_ptrs, sequence_bounds, stride_16b,
)


@triton.jit
def attn_bwd_preprocess_kernel(
    Out, dOut, Delta, dQAccum, CuSeqlensQ,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh,
    stride_ab, stride_as, stride_ah,
    seqlen_q, head_dim, head_dim_v, packed, slices, split_stride,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Grid ``(cdiv(max_seqlen_q, BLOCK_M) * batch, nheads)``; ``Delta`` laid out like lse.

    ``delta = rowsum(dO * O)`` over the output's ``head_dim_v`` columns. It also zeroes the same
    rows of the ``slices`` dQ sums in ``dQAccum`` (the fused backward's, fp32, laid out like Q with
    the strides given, each ``split_stride`` elements after the one before): the buffer needs no
    memset of its own, one launch fewer per backward (FlashAttention-2 clears it here too). Only
    the columns inside q's ``head_dim``, which are all the fused backward adds into and the convert
    reads. ``slices == 0``: ``dQAccum`` is not written."""
    stride_ob, stride_os, stride_oh = stride_16b(stride_ob), stride_16b(stride_os), stride_16b(stride_oh)
    stride_dob, stride_dos, stride_doh = stride_16b(stride_dob), stride_16b(stride_dos), stride_16b(stride_doh)
    stride_ab, stride_as, stride_ah = stride_16b(stride_ab), stride_16b(stride_as), stride_16b(stride_ah)
    pid_m, b = block_and_batch(seqlen_q, BLOCK_M, False)
    h = tl.program_id(1)
    q_start, seqlen_q = sequence_bounds(b, CuSeqlensQ, seqlen_q, packed)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = offs_m < seqlen_q
    mask = m_mask[:, None] & (offs_d < head_dim)[None, :]
    o_mask = m_mask[:, None] & (offs_dv < head_dim_v)[None, :]
    b64 = b.to(tl.int64)
    q0 = q_start.to(tl.int64)
    o_rows = row_ptrs(Out + b64 * stride_ob + q0 * stride_os + h * stride_oh, start_m, stride_os, BLOCK_M)
    do_rows = row_ptrs(dOut + b64 * stride_dob + q0 * stride_dos + h * stride_doh, start_m, stride_dos, BLOCK_M)
    o = tl.load(o_rows[:, None] + offs_dv[None, :], mask=o_mask, other=0.0).to(tl.float32)
    do = tl.load(do_rows[:, None] + offs_dv[None, :], mask=o_mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(Delta + b64 * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start + offs_m, delta, mask=m_mask)
    a_rows = row_ptrs(dQAccum + b64 * stride_ab + q0 * stride_as + h * stride_ah, start_m, stride_as, BLOCK_M)
    for split in range(slices):
        a_split = a_rows + tl.cast(split, tl.int64) * stride_16b(split_stride)
        tl.store(a_split[:, None] + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=mask)


@triton.jit
def _query_rows(src, start_m, stride_s, col0, c_mask, seqlen_q, MASKED: tl.constexpr, PAD_HEADDIM: tl.constexpr,
                TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows ``start_m ...`` and columns ``col0 ...`` (``c_mask``: those inside the head dim) of a
    query-side tile (Q or dO), zeros outside: through ``src``'s tensor descriptor (``TMA``: its
    bounds do the masking) or from ``src``, the head's first row, with row stride ``stride_s``."""
    if TMA:
        tile = src.load([start_m, col0])
    else:
        rows = row_ptrs(src, start_m, stride_s, BLOCK_M)[:, None] + (col0 + tl.arange(0, BLOCK_C))[None, :]
        if MASKED:
            row_mask = start_m + tl.arange(0, BLOCK_M) < seqlen_q
            tile = tl.load(rows, mask=row_mask[:, None] & c_mask[None, :], other=0.0)
        elif PAD_HEADDIM:
            tile = tl.load(rows, mask=c_mask[None, :], other=0.0)
        else:
            tile = tl.load(rows)
    return tile


@triton.jit
def _dkdv_query_tiles(
    dk, dv, k, v, k_rest, v_rest, offs_n, o_start, o_mask, r_start, r_mask, vo_start, vo_mask, vr_start, vr_mask,
    Q_src, dO_src, Qr_src, dOr_src, dQ_dst, L_head, D_head, lo, hi,
    stride_qs, stride_dos, stride_dqs, seqlen_q, seqlen_k,
    qk_scale_log2, cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right,
    dropout_p, dropout_seed, b, h,
    MASKED: tl.constexpr, IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PAD_HEADDIM: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_DOUT: tl.constexpr, BLOCK_DVOUT: tl.constexpr, REST_D: tl.constexpr, REST_DV: tl.constexpr,
    SPLIT: tl.constexpr, TMA: tl.constexpr, TMA_DQ: tl.constexpr,
):
    """Accumulate dK/dV of one key block over the query tiles ``[lo, hi)`` of one query head;
    with ``ATOMIC_DQ`` also add this key block's share of dQ (unscaled, fp32) into ``dQ_dst``:
    the head's first row (per-element atomics) or, with ``TMA_DQ``, its tensor descriptor (one
    bulk reduction per tile, its bounds dropping what lies past the rows and the head dim).
    The gradients cover the ``BLOCK_DOUT`` head-dim columns of q/k from ``o_start`` (``k`` holds
    them) and the ``BLOCK_DVOUT`` columns of v/dO from ``vo_start`` (``v`` holds them). ``SPLIT``
    1: these are half of the columns and those from ``r_start``/``vr_start`` (``k_rest``/``v_rest``,
    ``REST_D``/``REST_DV`` wide) the other half: the scores and dP are summed over both halves, the
    three gradient products use this program's half only, and every operand is loaded once.
    ``SPLIT`` 2 (more than two parts): ``k_rest``/``v_rest`` are all of K's and V's columns, the
    scores and dP are computed from them and whole Q/dO rows, the gradient products from this
    program's columns (loaded again). ``Q_src``/``dO_src``: the query head's tensor descriptors
    (``TMA``) or first rows; ``Qr_src``/``dOr_src`` the same for the other columns (``REST_D``/
    ``REST_DV`` wide blocks).

    Tiles are laid out keys x queries (transposed scores), so both products are plain dots.
    Interior tiles (``MASKED`` False) are fully inside ``seqlen_q`` and fully visible.
    """
    offs_o = o_start + tl.arange(0, BLOCK_DOUT)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _query_rows(Q_src, start_m, stride_qs, o_start, o_mask, seqlen_q, MASKED, PAD_HEADDIM, TMA, BLOCK_M,
                        BLOCK_DOUT)
        do = _query_rows(dO_src, start_m, stride_dos, vo_start, vo_mask, seqlen_q, MASKED, PAD_HEADDIM, TMA, BLOCK_M,
                         BLOCK_DVOUT)
        if MASKED:
            m_mask = offs_m < seqlen_q
            lse_log2 = tl.load(L_head + offs_m, mask=m_mask, other=0.0) * LOG2E
            delta = tl.load(D_head + offs_m, mask=m_mask, other=0.0)
        else:
            lse_log2 = tl.load(L_head + offs_m) * LOG2E
            delta = tl.load(D_head + offs_m)
        if SPLIT == 2:
            q_rest = _query_rows(Qr_src, start_m, stride_qs, r_start, r_mask, seqlen_q, MASKED, PAD_HEADDIM, TMA,
                                 BLOCK_M, REST_D)
            qk_t = tl.dot(k_rest, tl.trans(q_rest))
        else:
            qk_t = tl.dot(k, tl.trans(q))
            if SPLIT == 1:
                q_rest = _query_rows(Qr_src, start_m, stride_qs, r_start, r_mask, seqlen_q, MASKED, PAD_HEADDIM, TMA,
                                     BLOCK_M, REST_D)
                qk_t = tl.dot(k_rest, tl.trans(q_rest), qk_t)
        s_t, tanh_t = masking.logits_log2(qk_t, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, qk_scale_log2,
                                          cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right,
                                          MASKED, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI)
        p_t = tl.math.exp2(s_t - lse_log2[None, :])
        if SPLIT == 2:
            do_rest = _query_rows(dOr_src, start_m, stride_dos, vr_start, vr_mask, seqlen_q, MASKED, PAD_HEADDIM, TMA,
                                  BLOCK_M, REST_DV)
            dp_t = tl.dot(v_rest, tl.trans(do_rest))
        else:
            dp_t = tl.dot(v, tl.trans(do))
            if SPLIT == 1:
                do_rest = _query_rows(dOr_src, start_m, stride_dos, vr_start, vr_mask, seqlen_q, MASKED, PAD_HEADDIM,
                                      TMA, BLOCK_M, REST_DV)
                dp_t = tl.dot(v_rest, tl.trans(do_rest), dp_t)
        p_drop_t = p_t
        if HAS_DROPOUT:
            if dropout_p > 0.0:  # compiled in, active per launch
                keep_t = dropout_keep(dropout_seed, b, h, offs_m[None, :], offs_n[:, None], dropout_p)
                inv_keep = 1.0 / (1.0 - dropout_p)
                p_drop_t = tl.where(keep_t, p_t * inv_keep, 0.0)
                dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
        dv = tl.dot(p_drop_t.to(do.dtype), do, dv)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if ATOMIC_DQ:
            if BLOCK_M < 64:
                # as dQ^T: with fewer than 64 queries a step dQ is too short for wgmma (and an
                # mma.sync product would keep a second copy of K in shared memory)
                dq = tl.trans(tl.dot(tl.trans(k), ds_t))
            else:
                dq = tl.dot(tl.trans(ds_t), k)
            if TMA_DQ:
                dQ_dst.atomic_add([start_m, o_start], dq)
            else:
                dq_ptrs = row_ptrs(dQ_dst, start_m, stride_dqs, BLOCK_M)[:, None] + offs_o[None, :]
                if MASKED:
                    tl.atomic_add(dq_ptrs, dq, mask=(offs_m < seqlen_q)[:, None] & o_mask[None, :], sem="relaxed")
                elif PAD_HEADDIM:
                    tl.atomic_add(dq_ptrs, dq, mask=o_mask[None, :], sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_program(
    split, splits, b, split_stride,
    Q, K, V, dOut, LSE, Delta, dK, dV, dQAccum,
    CuSeqlensQ, CuSeqlensK, AlibiSlopes, DropoutSeed,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v, packed, use_alibi,
    softmax_scale, softcap, window_left, window_right, dropout_p,
    IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PAD_HEADDIM: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DOUT: tl.constexpr, TMA: tl.constexpr, TMA_DQ: tl.constexpr,
):
    """The key blocks ``split, split + splits, ...`` of batch entry ``b`` and one kv head, one
    after the other: dK/dV over every query tile of the group's heads that sees the block (and,
    with ``ATOMIC_DQ``, the block's share of dQ added into ``dQAccum``, whose sums of this split
    start ``split * split_stride`` elements in; with ``TMA_DQ`` by TMA bulk reductions). With
    ``BLOCK_DOUT < BLOCK_D`` the gradients' head-dim columns are split over ``BLOCK_D //
    BLOCK_DOUT`` programs (grid axis 1 is kv head x part), those of q/k and of v/dO alike (v's
    ``BLOCK_DV`` in parts of ``BLOCK_DV // parts``): each recomputes the scores and dP over all
    columns (two parts: from its half and the other; more: from whole rows) and keeps only its
    columns of dK/dV in registers. With ``TMA`` the streamed Q and dO tiles come through tensor
    descriptors (Hopper's tensor memory accelerator: no address arithmetic in registers; Triton
    keeps the descriptors in its global scratch, 128 B each; up to two parts)."""
    stride_qb, stride_qs, stride_qh = stride_16b(stride_qb), stride_16b(stride_qs), stride_16b(stride_qh)
    stride_kb, stride_ks, stride_kh = stride_16b(stride_kb), stride_16b(stride_ks), stride_16b(stride_kh)
    stride_vb, stride_vs, stride_vh = stride_16b(stride_vb), stride_16b(stride_vs), stride_16b(stride_vh)
    stride_dob, stride_dos, stride_doh = stride_16b(stride_dob), stride_16b(stride_dos), stride_16b(stride_doh)
    stride_dkb, stride_dks, stride_dkh = stride_16b(stride_dkb), stride_16b(stride_dks), stride_16b(stride_dkh)
    stride_dvb, stride_dvs, stride_dvh = stride_16b(stride_dvb), stride_16b(stride_dvs), stride_16b(stride_dvh)
    stride_dqb, stride_dqs, stride_dqh = stride_16b(stride_dqb), stride_16b(stride_dqs), stride_16b(stride_dqh)
    D_PARTS: tl.constexpr = BLOCK_D // BLOCK_DOUT
    BLOCK_DVOUT: tl.constexpr = BLOCK_DV // D_PARTS
    kv_h = tl.program_id(1) // D_PARTS
    dropout_seed = load_seed(DropoutSeed, HAS_DROPOUT)
    q_start, seqlen_q = sequence_bounds(b, CuSeqlensQ, seqlen_q, packed)
    k_start, seqlen_k = sequence_bounds(b, CuSeqlensK, seqlen_k, packed)
    # the scores' other columns: none (one part), the other half (two), or all of them (more)
    SPLIT: tl.constexpr = 0 if D_PARTS == 1 else 1 if D_PARTS == 2 else 2
    REST_D: tl.constexpr = BLOCK_D if SPLIT == 2 else BLOCK_DOUT
    REST_DV: tl.constexpr = BLOCK_DV if SPLIT == 2 else BLOCK_DVOUT
    part = tl.program_id(1) % D_PARTS
    o_start = part * BLOCK_DOUT
    offs_o = o_start + tl.arange(0, BLOCK_DOUT)
    o_mask = offs_o < head_dim
    r_start = (1 - part) * BLOCK_DOUT if SPLIT == 1 else 0
    offs_r = r_start + tl.arange(0, REST_D)
    r_mask = offs_r < head_dim
    vo_start = part * BLOCK_DVOUT  # the same for v's columns
    offs_vo = vo_start + tl.arange(0, BLOCK_DVOUT)
    vo_mask = offs_vo < head_dim_v
    vr_start = (1 - part) * BLOCK_DVOUT if SPLIT == 1 else 0
    offs_vr = vr_start + tl.arange(0, REST_DV)
    vr_mask = offs_vr < head_dim_v
    b64 = b.to(tl.int64)
    k0 = k_start.to(tl.int64)
    q0 = q_start.to(tl.int64)
    dq_split = tl.cast(split, tl.int64) * stride_16b(split_stride)  # this split's dQ sums (0: all share one)
    qk_scale_log2, cap_on, cap_in, cap_out_log2 = masking.score_scalars(softmax_scale, softcap, HAS_SOFTCAP)
    # the fused kernel walks its split's key blocks; the dK/dV kernel has one key block a program
    # and no loop (wrapped in one, its sm_80 images kept a stack frame: there it is the default)
    if ATOMIC_DQ:
        for pid_n in range(split, tl.cdiv(seqlen_k, BLOCK_N), splits):
            _dkdv_key_block(
                pid_n, b, b64, q0, k0, kv_h, o_start, offs_o, o_mask, r_start, offs_r, r_mask, vo_start, offs_vo,
                vo_mask, vr_start, offs_vr, vr_mask, dq_split, dropout_seed, qk_scale_log2, cap_on, cap_in,
                cap_out_log2, Q, K, V, dOut, LSE, Delta, dK, dV, dQAccum, AlibiSlopes,
                stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
                stride_dvh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ab,
                seqlen_q, seqlen_k, group, head_dim, head_dim_v, use_alibi, softmax_scale, window_left, window_right,
                dropout_p, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, ATOMIC_DQ, BLOCK_M, BLOCK_N,
                BLOCK_DOUT, BLOCK_DVOUT, REST_D, REST_DV, SPLIT, TMA, TMA_DQ)
    elif split * BLOCK_N < seqlen_k:
        _dkdv_key_block(
            split, b, b64, q0, k0, kv_h, o_start, offs_o, o_mask, r_start, offs_r, r_mask, vo_start, offs_vo,
            vo_mask, vr_start, offs_vr, vr_mask, dq_split, dropout_seed, qk_scale_log2, cap_on, cap_in,
            cap_out_log2, Q, K, V, dOut, LSE, Delta, dK, dV, dQAccum, AlibiSlopes,
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
            stride_dvh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ab,
            seqlen_q, seqlen_k, group, head_dim, head_dim_v, use_alibi, softmax_scale, window_left, window_right,
            dropout_p, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, ATOMIC_DQ, BLOCK_M, BLOCK_N,
            BLOCK_DOUT, BLOCK_DVOUT, REST_D, REST_DV, SPLIT, TMA, TMA_DQ)


@triton.jit
def _dkdv_key_block(
    pid_n, b, b64, q0, k0, kv_h, o_start, offs_o, o_mask, r_start, offs_r, r_mask, vo_start, offs_vo, vo_mask,
    vr_start, offs_vr, vr_mask, dq_split, dropout_seed, qk_scale_log2, cap_on, cap_in, cap_out_log2,
    Q, K, V, dOut, LSE, Delta, dK, dV, dQAccum, AlibiSlopes,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
    stride_dvh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ab,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v, use_alibi, softmax_scale, window_left, window_right, dropout_p,
    IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PAD_HEADDIM: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DOUT: tl.constexpr, BLOCK_DVOUT: tl.constexpr, REST_D: tl.constexpr, REST_DV: tl.constexpr,
    SPLIT: tl.constexpr, TMA: tl.constexpr, TMA_DQ: tl.constexpr,
):
    """Key block ``pid_n`` of :func:`_dkdv_program` (sequence-relative bounds, this program's
    columns): its dK/dV, stored, and its dQ shares."""
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < seqlen_k)[:, None]
    own_mask = n_mask & o_mask[None, :]  # this program's columns of the key block
    own_v_mask = n_mask & vo_mask[None, :]
    k_rows = row_ptrs(K + b64 * stride_kb + k0 * stride_ks + kv_h * stride_kh, start_n, stride_ks, BLOCK_N)
    v_rows = row_ptrs(V + b64 * stride_vb + k0 * stride_vs + kv_h * stride_vh, start_n, stride_vs, BLOCK_N)
    k = tl.load(k_rows[:, None] + offs_o[None, :], mask=own_mask, other=0.0)
    v = tl.load(v_rows[:, None] + offs_vo[None, :], mask=own_v_mask, other=0.0)
    if SPLIT > 0:
        # the other program's columns (two parts), or every column (more)
        k_rest = tl.load(k_rows[:, None] + offs_r[None, :], mask=n_mask & r_mask[None, :], other=0.0)
        v_rest = tl.load(v_rows[:, None] + offs_vr[None, :], mask=n_mask & vr_mask[None, :], other=0.0)
    else:
        k_rest = k
        v_rest = v
    dk = tl.zeros([BLOCK_N, BLOCK_DOUT], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DVOUT], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = masking.query_block_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                       BLOCK_M, BLOCK_N, IS_LOCAL)
    # the query heads of this kv head's group, one after the other: dK/dV summed in registers
    for h in range(kv_h * group, kv_h * group + group):
        slope_log2 = alibi_slope_log2(AlibiSlopes, b, h, stride_ab, use_alibi, HAS_ALIBI)
        Q_head = Q + b64 * stride_qb + q0 * stride_qs + h * stride_qh
        dO_head = dOut + b64 * stride_dob + q0 * stride_dos + h * stride_doh
        dQ_head = dQAccum + dq_split + b64 * stride_dqb + q0 * stride_dqs + h * stride_dqh
        L_head = LSE + b64 * stride_lb + tl.cast(h, tl.int64) * stride_lh + q0
        D_head = Delta + b64 * stride_lb + tl.cast(h, tl.int64) * stride_lh + q0
        Q_src = head_rows(Q_head, seqlen_q, head_dim, stride_qs, TMA, BLOCK_M, BLOCK_DOUT)
        dO_src = head_rows(dO_head, seqlen_q, head_dim_v, stride_dos, TMA, BLOCK_M, BLOCK_DVOUT)
        Qr_src = Q_src  # the other columns' blocks: those of this program (up to two parts) or whole rows
        dOr_src = dO_src
        if SPLIT == 2:
            Qr_src = head_rows(Q_head, seqlen_q, head_dim, stride_qs, TMA, BLOCK_M, REST_D)
            dOr_src = head_rows(dO_head, seqlen_q, head_dim_v, stride_dos, TMA, BLOCK_M, REST_DV)
        dQ_dst = head_rows(dQ_head, seqlen_q, head_dim, stride_dqs, TMA_DQ, BLOCK_M, BLOCK_DOUT)
        dk, dv = _dkdv_query_tiles(
            dk, dv, k, v, k_rest, v_rest, offs_n, o_start, o_mask, r_start, r_mask, vo_start, vo_mask, vr_start,
            vr_mask, Q_src, dO_src, Qr_src, dOr_src, dQ_dst, L_head, D_head, lo, mid_lo,
            stride_qs, stride_dos, stride_dqs, seqlen_q, seqlen_k, qk_scale_log2, cap_on, cap_in, cap_out_log2,
            slope_log2, window_left, window_right, dropout_p, dropout_seed, b, h,
            True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, ATOMIC_DQ, BLOCK_M, BLOCK_DOUT,
            BLOCK_DVOUT, REST_D, REST_DV, SPLIT, TMA, TMA_DQ)
        dk, dv = _dkdv_query_tiles(
            dk, dv, k, v, k_rest, v_rest, offs_n, o_start, o_mask, r_start, r_mask, vo_start, vo_mask, vr_start,
            vr_mask, Q_src, dO_src, Qr_src, dOr_src, dQ_dst, L_head, D_head, mid_lo, mid_hi,
            stride_qs, stride_dos, stride_dqs, seqlen_q, seqlen_k, qk_scale_log2, cap_on, cap_in, cap_out_log2,
            slope_log2, window_left, window_right, dropout_p, dropout_seed, b, h,
            False, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, ATOMIC_DQ, BLOCK_M, BLOCK_DOUT,
            BLOCK_DVOUT, REST_D, REST_DV, SPLIT, TMA, TMA_DQ)
        dk, dv = _dkdv_query_tiles(
            dk, dv, k, v, k_rest, v_rest, offs_n, o_start, o_mask, r_start, r_mask, vo_start, vo_mask, vr_start,
            vr_mask, Q_src, dO_src, Qr_src, dOr_src, dQ_dst, L_head, D_head, mid_hi, hi,
            stride_qs, stride_dos, stride_dqs, seqlen_q, seqlen_k, qk_scale_log2, cap_on, cap_in, cap_out_log2,
            slope_log2, window_left, window_right, dropout_p, dropout_seed, b, h,
            True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, ATOMIC_DQ, BLOCK_M, BLOCK_DOUT,
            BLOCK_DVOUT, REST_D, REST_DV, SPLIT, TMA, TMA_DQ)

    dk = dk * softmax_scale
    dk_rows = row_ptrs(dK + b64 * stride_dkb + k0 * stride_dks + kv_h * stride_dkh, start_n, stride_dks, BLOCK_N)
    dv_rows = row_ptrs(dV + b64 * stride_dvb + k0 * stride_dvs + kv_h * stride_dvh, start_n, stride_dvs, BLOCK_N)
    tl.store(dk_rows[:, None] + offs_o[None, :], dk.to(dK.dtype.element_ty), mask=own_mask)
    tl.store(dv_rows[:, None] + offs_vo[None, :], dv.to(dV.dtype.element_ty), mask=own_v_mask)


@triton.jit
def attn_bwd_kernel(
    Q, K, V, dOut, LSE, Delta, dK, dV, dQAccum,
    CuSeqlensQ, CuSeqlensK, AlibiSlopes, DropoutSeed,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v, packed, use_alibi, splits, split_stride,
    softmax_scale, softcap, window_left, window_right, dropout_p,
    IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PAD_HEADDIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DOUT: tl.constexpr, TMA: tl.constexpr, TMA_DQ: tl.constexpr,
):
    """The fused backward: grid ``(splits * batch, nheads_k * BLOCK_D // BLOCK_DOUT)``, as
    :func:`attn_bwd_dkdv_kernel`, plus dQ added atomically (fp32, unscaled) into ``dQAccum``
    (zeroed by the preprocess; :func:`attn_bwd_dq_convert_kernel` finishes it): five products per
    tile pair instead of the split kernels' seven (seven with the head dim split in two).

    ``deterministic=False``: ``splits = cdiv(max_seqlen_k, BLOCK_N)``, one key block per program,
    ``split_stride = 0``: every program adds into one Q-shaped buffer, in an order that varies
    between runs. ``deterministic=True`` (FlashAttention-2's way): fewer splits, each program
    walks the key blocks ``split, split + splits, ...`` in turn and adds into its split's own
    Q-shaped sums (``split * split_stride`` elements in), which only its own threads touch, in
    program order; the convert kernel adds the splits up in a fixed order."""
    batch = tl.num_programs(0) // splits
    _dkdv_program(
        tl.program_id(0) // batch, splits, tl.program_id(0) % batch, split_stride,
        Q, K, V, dOut, LSE, Delta, dK, dV, dQAccum, CuSeqlensQ, CuSeqlensK, AlibiSlopes, DropoutSeed,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ab,
        seqlen_q, seqlen_k, group, head_dim, head_dim_v, packed, use_alibi, softmax_scale, softcap, window_left,
        window_right, dropout_p, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, True, BLOCK_M, BLOCK_N,
        BLOCK_D, BLOCK_DV, BLOCK_DOUT, TMA, TMA_DQ)


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, dOut, LSE, Delta, dK, dV,
    CuSeqlensQ, CuSeqlensK, AlibiSlopes, DropoutSeed,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh, stride_ab,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v, packed, use_alibi,
    softmax_scale, softcap, window_left, window_right, dropout_p,
    IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PAD_HEADDIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DOUT: tl.constexpr, TMA: tl.constexpr,
):
    """dK/dV of ``deterministic=True`` (no atomics; :func:`attn_bwd_dq_kernel` computes dQ): grid
    ``(cdiv(max_seqlen_k, BLOCK_N) * batch, nheads_k * BLOCK_D // BLOCK_DOUT)``, the fused
    backward's program without dQ (its head-dim split and tensor descriptors where the planner
    sets them); ``LSE``/``Delta`` share strides.

    dK/dV have K/V's shape (``(b, sk, hk, d)`` / ``(.., dv)`` or ``(total_k, hk, d)`` / ``(.., dv)``)
    and dtype.
    """
    # the first key blocks are seen by the most queries under a causal mask: they go first
    pid_n, b = block_and_batch(seqlen_k, BLOCK_N, False)
    _dkdv_program(
        pid_n, tl.cdiv(seqlen_k, BLOCK_N), b, 0,
        Q, K, V, dOut, LSE, Delta, dK, dV, dK, CuSeqlensQ, CuSeqlensK, AlibiSlopes, DropoutSeed,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        0, 0, 0, stride_lb, stride_lh, stride_ab,
        seqlen_q, seqlen_k, group, head_dim, head_dim_v, packed, use_alibi, softmax_scale, softcap, window_left,
        window_right, dropout_p, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, False, BLOCK_M, BLOCK_N,
        BLOCK_D, BLOCK_DV, BLOCK_DOUT, TMA, False)


@triton.jit
def attn_bwd_dq_convert_kernel(
    dQAccum, dQ, CuSeqlensQ,
    stride_ab, stride_as, stride_ah,
    stride_dqb, stride_dqs, stride_dqh,
    seqlen_q, head_dim, packed, slices, split_stride, softmax_scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``dQ = softmax_scale *`` the sum of the ``slices`` dQ sums in ``dQAccum`` (``split_stride``
    elements apart), added in their order, in dQ's dtype; grid ``(cdiv(max_seqlen_q, BLOCK_M) *
    batch, nheads)``."""
    stride_ab, stride_as, stride_ah = stride_16b(stride_ab), stride_16b(stride_as), stride_16b(stride_ah)
    stride_dqb, stride_dqs, stride_dqh = stride_16b(stride_dqb), stride_16b(stride_dqs), stride_16b(stride_dqh)
    pid_m, b = block_and_batch(seqlen_q, BLOCK_M, False)
    h = tl.program_id(1)
    q_start, seqlen_q = sequence_bounds(b, CuSeqlensQ, seqlen_q, packed)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seqlen_q)[:, None] & (offs_d < head_dim)[None, :]
    b64 = b.to(tl.int64)
    q0 = q_start.to(tl.int64)
    a_rows = row_ptrs(dQAccum + b64 * stride_ab + q0 * stride_as + h * stride_ah, start_m, stride_as, BLOCK_M)
    dq_rows = row_ptrs(dQ + b64 * stride_dqb + q0 * stride_dqs + h * stride_dqh, start_m, stride_dqs, BLOCK_M)
    dq = tl.load(a_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    for split in range(1, slices):
        a_split = a_rows + tl.cast(split, tl.int64) * stride_16b(split_stride)
        dq += tl.load(a_split[:, None] + offs_d[None, :], mask=mask, other=0.0)
    tl.store(dq_rows[:, None] + offs_d[None, :], (dq * softmax_scale).to(dQ.dtype.element_ty), mask=mask)


@triton.jit
def _dq_key_tiles(
    dq, q, do, lse_log2, delta, offs_m, offs_d, d_mask, offs_dv, dv_mask,
    K_head, V_head, lo, hi, stride_ks, stride_vs, seqlen_q, seqlen_k,
    qk_scale_log2, cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right,
    dropout_p, dropout_seed, b, h,
    MASKED: tl.constexpr, IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PAD_HEADDIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate dQ of one query block over the key tiles ``[lo, hi)``."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = (offs_n < seqlen_k)[:, None]
            k_mask = n_mask & d_mask[None, :]
            v_mask = n_mask & dv_mask[None, :]
        else:
            k_mask = d_mask[None, :]
            v_mask = dv_mask[None, :]
        k_ptrs = row_ptrs(K_head, start_n, stride_ks, BLOCK_N)[:, None] + offs_d[None, :]
        v_ptrs = row_ptrs(V_head, start_n, stride_vs, BLOCK_N)[:, None] + offs_dv[None, :]
        if MASKED or PAD_HEADDIM:
            k = tl.load(k_ptrs, mask=k_mask, other=0.0)
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k))
        s, tanh_s = masking.logits_log2(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, qk_scale_log2,
                                        cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right,
                                        MASKED, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI)
        p = tl.math.exp2(s - lse_log2[:, None])
        dp = tl.dot(do, tl.trans(v))
        if HAS_DROPOUT:
            if dropout_p > 0.0:
                keep = dropout_keep(dropout_seed, b, h, offs_m[:, None], offs_n[None, :], dropout_p)
                dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, dOut, LSE, Delta, dQ,
    CuSeqlensQ, CuSeqlensK, AlibiSlopes, DropoutSeed,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_ab,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v, packed, use_alibi,
    softmax_scale, softcap, window_left, window_right, dropout_p,
    IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PAD_HEADDIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Grid ``(cdiv(max_seqlen_q, BLOCK_M) * batch, nheads)``; dQ has Q's shape and dtype."""
    stride_qb, stride_qs, stride_qh = stride_16b(stride_qb), stride_16b(stride_qs), stride_16b(stride_qh)
    stride_kb, stride_ks, stride_kh = stride_16b(stride_kb), stride_16b(stride_ks), stride_16b(stride_kh)
    stride_vb, stride_vs, stride_vh = stride_16b(stride_vb), stride_16b(stride_vs), stride_16b(stride_vh)
    stride_dob, stride_dos, stride_doh = stride_16b(stride_dob), stride_16b(stride_dos), stride_16b(stride_doh)
    stride_dqb, stride_dqs, stride_dqh = stride_16b(stride_dqb), stride_16b(stride_dqs), stride_16b(stride_dqh)
    pid_m, b = block_and_batch(seqlen_q, BLOCK_M, True)
    h = tl.program_id(1)
    dropout_seed = load_seed(DropoutSeed, HAS_DROPOUT)
    q_start, seqlen_q = sequence_bounds(b, CuSeqlensQ, seqlen_q, packed)
    k_start, seqlen_k = sequence_bounds(b, CuSeqlensK, seqlen_k, packed)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    kv_h = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < head_dim
    dv_mask = offs_dv < head_dim_v
    m_mask = offs_m < seqlen_q
    q_mask = m_mask[:, None] & d_mask[None, :]
    b64 = b.to(tl.int64)
    q0 = q_start.to(tl.int64)
    k0 = k_start.to(tl.int64)
    q_rows = row_ptrs(Q + b64 * stride_qb + q0 * stride_qs + h * stride_qh, start_m, stride_qs, BLOCK_M)
    do_rows = row_ptrs(dOut + b64 * stride_dob + q0 * stride_dos + h * stride_doh, start_m, stride_dos, BLOCK_M)
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(do_rows[:, None] + offs_dv[None, :], mask=m_mask[:, None] & dv_mask[None, :], other=0.0)
    lse_offset = b64 * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start
    lse_log2 = tl.load(LSE + lse_offset + offs_m, mask=m_mask, other=0.0) * LOG2E
    delta = tl.load(Delta + lse_offset + offs_m, mask=m_mask, other=0.0)
    K_head = K + b64 * stride_kb + k0 * stride_ks + kv_h * stride_kh
    V_head = V + b64 * stride_vb + k0 * stride_vs + kv_h * stride_vh

    qk_scale_log2, cap_on, cap_in, cap_out_log2 = masking.score_scalars(softmax_scale, softcap, HAS_SOFTCAP)
    slope_log2 = alibi_slope_log2(AlibiSlopes, b, h, stride_ab, use_alibi, HAS_ALIBI)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = masking.key_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                                     BLOCK_M, BLOCK_N, IS_LOCAL)
    dq = _dq_key_tiles(dq, q, do, lse_log2, delta, offs_m, offs_d, d_mask, offs_dv, dv_mask, K_head, V_head, lo,
                       mid_lo, stride_ks, stride_vs, seqlen_q, seqlen_k, qk_scale_log2, cap_on, cap_in, cap_out_log2,
                       slope_log2, window_left, window_right, dropout_p, dropout_seed, b, h,
                       True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, BLOCK_N)
    dq = _dq_key_tiles(dq, q, do, lse_log2, delta, offs_m, offs_d, d_mask, offs_dv, dv_mask, K_head, V_head, mid_lo,
                       mid_hi, stride_ks, stride_vs, seqlen_q, seqlen_k, qk_scale_log2, cap_on, cap_in, cap_out_log2,
                       slope_log2, window_left, window_right, dropout_p, dropout_seed, b, h,
                       False, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, BLOCK_N)
    dq = _dq_key_tiles(dq, q, do, lse_log2, delta, offs_m, offs_d, d_mask, offs_dv, dv_mask, K_head, V_head, mid_hi,
                       hi, stride_ks, stride_vs, seqlen_q, seqlen_k, qk_scale_log2, cap_on, cap_in, cap_out_log2,
                       slope_log2, window_left, window_right, dropout_p, dropout_seed, b, h,
                       True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, PAD_HEADDIM, BLOCK_N)
    dq = dq * softmax_scale
    dq_rows = row_ptrs(dQ + b64 * stride_dqb + q0 * stride_dqs + h * stride_dqh, start_m, stride_dqs, BLOCK_M)
    tl.store(dq_rows[:, None] + offs_d[None, :], dq.to(dQ.dtype.element_ty), mask=q_mask)
