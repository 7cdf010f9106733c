"""Triton forward kernel of FlashAttention-2, dense and varlen in one family.

Dense and varlen calls run the same compiled kernel: ``packed`` (a run-time argument) says
whether sequences are packed along dim 0 with ``cu_seqlens`` (:func:`sequence_bounds`).

One program computes ``BLOCK_M`` query rows of one (batch entry, query head): it walks the key
tiles that the rows can see (:func:`~flash_attn.kernels.masking.key_block_range`, so causal and
sliding-window attention skip every fully masked tile) in three stages - masked edge tiles, the
unmasked interior, masked edge tiles - each a call of :func:`_attend_key_tiles`, and keeps an
online softmax in fp32 with ``exp2`` (the softmax scale is folded into ``log2(e)``).

Feature flags (``tl.constexpr``):

``IS_LOCAL``    window mask (causal is the window ``(-1, 0)``); bounds are run-time ints
``HAS_SOFTCAP`` ``softcap * tanh(scale * qk / softcap)``
``HAS_ALIBI``   ``- slope * |i + sk - sq - j|`` with per-(batch,)head fp32 slopes (``use_alibi``
                switches it off at run time)
``HAS_DROPOUT`` counter-based Philox dropout (:mod:`flash_attn.kernels.dropout_rng`)
``IS_PAGED``    K/V rows gathered through ``block_table`` pages of ``page_size`` rows (varlen only)
``PAD_HEADDIM`` ``head_dim < BLOCK_D`` or ``head_dim_v < BLOCK_DV``: the padded feature columns are masked
``HAS_QV``      MLA's absorbed queries: ``qv`` ``(.., head_dim_v)`` scored against V, the logit of
                key ``j`` is ``scale * (q . k_j + qv . v_j)``

``BLOCK_M``/``BLOCK_N`` come from :mod:`flash_attn.planning.configs`, ``BLOCK_D`` is the head dim
of q/k and ``BLOCK_DV`` that of v and the output (``head_dim_v``, which may differ), each padded to
a power of two >= 16. Everything else (sizes, strides, scale, window) is a plain argument, so one
compiled specialisation serves every input with the same flags (ahead-of-time compilation); the
dropout seed is an int64 read from the device (``DropoutSeed``), so a CUDA graph replay draws a
fresh one. The last dimension of every tensor must be contiguous (stride 1).

Attention sinks (``use_sinks``, a run-time switch of every variant): ``Sinks`` holds one fp32 logit
per query head that joins every row's softmax denominator with no value (``exp(sink - m)`` added to
the sum, the row's lse includes it); the online softmax starts from it (:func:`~flash_attn.kernels.
tiles.sink_state`), so a row that sees no key gets output 0 and lse ``sink``.

MHA/GQA/MQA: query head ``h`` reads kv head ``h // group``; K/V are never repeated.
A row that sees no key (or only ``-inf`` scores) gets output 0 and lse ``+inf``; a NaN or ``+inf``
among a row's visible scores makes its output and lse NaN (upstream's semantics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flash_attn.kernels import masking
from flash_attn.kernels.dropout_rng import dropout_keep
from flash_attn.kernels.tiles import (
    LN2, LOG2E, alibi_slope_log2, block_and_batch, head_rows, kv_row_ptrs, load_seed, online_softmax_step, row_ptrs,
    sequence_bounds, sink_state, stride_16b,
)


@triton.jit
def _key_rows(src, rows, start_n, offs_n, col0, offs_c, c_mask, seqlen_k, MASKED: tl.constexpr,
              PAD_HEADDIM: tl.constexpr, TMA: tl.constexpr):
    """One K or V tile: rows ``start_n ...`` (``rows``: their pointers) and columns ``offs_c``
    (from ``col0``; ``c_mask``: those inside the head dim), zeros outside; through the tensor
    descriptor ``src`` with ``TMA`` (its bounds mask). Interior tiles (not ``MASKED``) lie inside
    ``seqlen_k``."""
    if TMA:
        tile = src.load([start_n, col0])
    else:
        if MASKED:
            mask = (offs_n < seqlen_k)[:, None] & c_mask[None, :]
        else:
            mask = c_mask[None, :]
        if MASKED or PAD_HEADDIM:
            tile = tl.load(rows[:, None] + offs_c[None, :], mask=mask, other=0.0)
        else:
            tile = tl.load(rows[:, None] + offs_c[None, :])
    return tile


@triton.jit
def _attend_key_tiles(
    acc, m_i, l_i, q, qv, offs_m, offs_d, d_mask, v_start, offs_dv, dv_mask,
    K_head, V_head, K_desc, V_desc, bt_row, lo, hi,
    seqlen_q, seqlen_k, page_size, stride_kpage, stride_ks, stride_vpage, stride_vs,
    qk_scale_log2, cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right,
    dropout_p, dropout_seed, b, h,
    MASKED: tl.constexpr, IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_PAGED: tl.constexpr, PAD_HEADDIM: tl.constexpr, HAS_QV: tl.constexpr,
    BLOCK_N: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
):
    """Online-softmax update of one query block over the key tiles ``[lo, hi)``.

    ``MASKED`` applies bounds and window (edge tiles); interior tiles lie inside ``seqlen_k`` and
    are fully visible, so they load without a row mask and compute no mask at all. With ``TMA``
    K and V come through the tensor descriptors ``K_desc``/``V_desc`` (whose bounds mask). ``WS``:
    Triton warp-specialises the loop (a producer warpgroup loads, consumer warpgroups compute).
    ``HAS_QV``: the V tile is loaded first and scored against ``qv`` too. V's columns: ``offs_dv``
    (from ``v_start``), this program's share of the output's.
    """
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_rows = kv_row_ptrs(K_head, start_n, seqlen_k, bt_row, page_size, stride_kpage, stride_ks, BLOCK_N, IS_PAGED)
        v_rows = kv_row_ptrs(V_head, start_n, seqlen_k, bt_row, page_size, stride_vpage, stride_vs, BLOCK_N, IS_PAGED)
        k = _key_rows(K_desc, k_rows, start_n, offs_n, 0, offs_d, d_mask, seqlen_k, MASKED, PAD_HEADDIM, TMA)
        qk = tl.dot(q, tl.trans(k))
        if HAS_QV:
            v = _key_rows(V_desc, v_rows, start_n, offs_n, v_start, offs_dv, dv_mask, seqlen_k, MASKED, PAD_HEADDIM,
                          TMA)
            qk = tl.dot(qv, tl.trans(v), qk)
        s, _ = masking.logits_log2(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, qk_scale_log2,
                                   cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right,
                                   MASKED, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI)
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        if HAS_DROPOUT:
            if dropout_p > 0.0:  # compiled in, active per launch
                keep = dropout_keep(dropout_seed, b, h, offs_m[:, None], offs_n[None, :], dropout_p)
                p = tl.where(keep, p, 0.0)
        if not HAS_QV:
            v = _key_rows(V_desc, v_rows, start_n, offs_n, v_start, offs_dv, dv_mask, seqlen_k, MASKED, PAD_HEADDIM,
                          TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, Out, LSE,
    CuSeqlensQ, CuSeqlensK, BlockTable, AlibiSlopes, DropoutSeed, Sinks, QV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_qvb, stride_qvs, stride_qvh,
    stride_lb, stride_lh,
    stride_btb, stride_ab,
    seqlen_q, seqlen_k, group, head_dim, head_dim_v, page_size, packed, use_alibi, use_sinks,
    softmax_scale, softcap, window_left, window_right, dropout_p,
    IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_PAGED: tl.constexpr, PAD_HEADDIM: tl.constexpr, HAS_QV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DVOUT: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
):
    """Grid ``(cdiv(max_seqlen_q, BLOCK_M) * batch, nheads * BLOCK_DV // BLOCK_DVOUT)``
    (:func:`block_and_batch`; axis 1 is query head x part).

    With ``BLOCK_DVOUT < BLOCK_DV`` the output's (v's) columns are split over programs: each
    computes the scores in full and the output's ``BLOCK_DVOUT`` columns of its part (FlashAttention's
    accumulator of a 512-wide head takes twice the registers a thread has; the scores are recomputed
    instead), and the first part stores lse.

    Dense: q ``(b, sq, h, d)``, k ``(b, sk, hk, d)``, v ``(b, sk, hk, dv)``, out ``(b, sq, h, dv)``,
    lse ``(b, h, sq)``. Varlen: the same without the batch dim, rows packed (``stride_*b`` = 0) or,
    for K/V, paged: page pools ``(pages, page_size, hk, d or dv)`` with ``stride_kb`` the page
    stride; lse ``(h, total_q)``. ``stride_lb``/``stride_lh`` address lse (its row stride is 1).
    ``AlibiSlopes`` is fp32 ``(h,)`` (``stride_ab`` = 0) or ``(b, h)``; ``Sinks`` fp32 ``(h,)``
    (read when ``use_sinks``); ``QV`` like q with v's head dim (``HAS_QV``).

    ``WS`` (with ``TMA``, not paged): one warp-specialised loop over every key tile, each masked,
    and Q through a descriptor too: Triton 3.9's Hopper warp specialisation takes one loop and
    tensor-descriptor loads only, and no early return.
    """
    stride_qb, stride_qs, stride_qh = stride_16b(stride_qb), stride_16b(stride_qs), stride_16b(stride_qh)
    stride_kb, stride_ks, stride_kh = stride_16b(stride_kb), stride_16b(stride_ks), stride_16b(stride_kh)
    stride_vb, stride_vs, stride_vh = stride_16b(stride_vb), stride_16b(stride_vs), stride_16b(stride_vh)
    stride_ob, stride_os, stride_oh = stride_16b(stride_ob), stride_16b(stride_os), stride_16b(stride_oh)
    # heavy causal blocks (large row index) first: better load balance at the tail of the grid
    pid_m, b = block_and_batch(seqlen_q, BLOCK_M, True)
    DV_PARTS: tl.constexpr = BLOCK_DV // BLOCK_DVOUT
    if HAS_QV:
        tl.static_assert(DV_PARTS == 1, "qv is scored against all of v's columns: they are not split")
    h = tl.program_id(1) // DV_PARTS
    v_start = (tl.program_id(1) % DV_PARTS) * BLOCK_DVOUT
    dropout_seed = load_seed(DropoutSeed, HAS_DROPOUT)
    q_start, seqlen_q = sequence_bounds(b, CuSeqlensQ, seqlen_q, packed)
    k_start, seqlen_k = sequence_bounds(b, CuSeqlensK, seqlen_k, packed)
    start_m = pid_m * BLOCK_M
    # TMA: K/V tiles through tensor descriptors (paged K/V is gathered row by row: pointers)
    USE_TMA: tl.constexpr = TMA and not IS_PAGED
    USE_WS: tl.constexpr = WS and USE_TMA
    if not USE_WS:  # a block without rows would visit no key tile anyway (key_block_range)
        if start_m >= seqlen_q:
            return
    kv_h = h // group

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = v_start + tl.arange(0, BLOCK_DVOUT)
    d_mask = offs_d < head_dim
    dv_mask = offs_dv < head_dim_v
    m_mask = offs_m < seqlen_q
    q_mask = m_mask[:, None]
    o_mask = m_mask[:, None]
    if PAD_HEADDIM:
        q_mask = q_mask & d_mask[None, :]
        o_mask = o_mask & dv_mask[None, :]

    b64 = b.to(tl.int64)
    Q_head = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
    if USE_WS:
        q = head_rows(Q_head, seqlen_q, head_dim, stride_qs, True, BLOCK_M, BLOCK_D).load([start_m, 0])
    else:
        q = tl.load(row_ptrs(Q_head, start_m, stride_qs, BLOCK_M)[:, None] + offs_d[None, :], mask=q_mask,
                    other=0.0)
    qv = q
    if HAS_QV:
        stride_qvb, stride_qvs, stride_qvh = stride_16b(stride_qvb), stride_16b(stride_qvs), stride_16b(stride_qvh)
        QV_head = QV + b64 * stride_qvb + q_start.to(tl.int64) * stride_qvs + h * stride_qvh
        qv = tl.load(row_ptrs(QV_head, start_m, stride_qvs, BLOCK_M)[:, None] + offs_dv[None, :],
                     mask=m_mask[:, None] & dv_mask[None, :], other=0.0)
    if IS_PAGED:
        K_head = K + kv_h * stride_kh
        V_head = V + kv_h * stride_vh
        bt_row = BlockTable + b64 * stride_btb
    else:
        K_head = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + kv_h * stride_kh
        V_head = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + kv_h * stride_vh
        bt_row = BlockTable

    K_desc = head_rows(K_head, seqlen_k, head_dim, stride_ks, USE_TMA, BLOCK_N, BLOCK_D)
    V_desc = head_rows(V_head, seqlen_k, head_dim_v, stride_vs, USE_TMA, BLOCK_N, BLOCK_DVOUT)
    qk_scale_log2, cap_on, cap_in, cap_out_log2 = masking.score_scalars(softmax_scale, softcap, HAS_SOFTCAP)
    slope_log2 = alibi_slope_log2(AlibiSlopes, b, h, stride_ab, use_alibi, HAS_ALIBI)

    m_i, l_i = sink_state(Sinks, h, use_sinks, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_DVOUT], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = masking.key_block_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                                     BLOCK_M, BLOCK_N, IS_LOCAL)
    if USE_WS:  # every tile masked, in one loop
        acc, m_i, l_i = _attend_key_tiles(
            acc, m_i, l_i, q, qv, offs_m, offs_d, d_mask, v_start, offs_dv, dv_mask, K_head, V_head, K_desc, V_desc,
            bt_row,
            lo, hi, seqlen_q, seqlen_k, page_size, stride_kb, stride_ks, stride_vb, stride_vs,
            qk_scale_log2, cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right, dropout_p, dropout_seed,
            b, h, True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, IS_PAGED, PAD_HEADDIM, HAS_QV, BLOCK_N, True,
            True)
    else:
        # stage 1: masked tiles left of the interior (sliding window's left edge)
        acc, m_i, l_i = _attend_key_tiles(
            acc, m_i, l_i, q, qv, offs_m, offs_d, d_mask, v_start, offs_dv, dv_mask, K_head, V_head, K_desc, V_desc,
            bt_row,
            lo, mid_lo, seqlen_q, seqlen_k, page_size, stride_kb, stride_ks, stride_vb, stride_vs,
            qk_scale_log2, cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right, dropout_p, dropout_seed,
            b, h, True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, IS_PAGED, PAD_HEADDIM, HAS_QV, BLOCK_N, USE_TMA,
            False)
        # stage 2: the interior, no mask
        acc, m_i, l_i = _attend_key_tiles(
            acc, m_i, l_i, q, qv, offs_m, offs_d, d_mask, v_start, offs_dv, dv_mask, K_head, V_head, K_desc, V_desc,
            bt_row,
            mid_lo, mid_hi, seqlen_q, seqlen_k, page_size, stride_kb, stride_ks, stride_vb, stride_vs,
            qk_scale_log2, cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right, dropout_p, dropout_seed,
            b, h, False, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, IS_PAGED, PAD_HEADDIM, HAS_QV, BLOCK_N, USE_TMA,
            False)
        # stage 3: masked tiles right of the interior (diagonal, last partial tile)
        acc, m_i, l_i = _attend_key_tiles(
            acc, m_i, l_i, q, qv, offs_m, offs_d, d_mask, v_start, offs_dv, dv_mask, K_head, V_head, K_desc, V_desc,
            bt_row,
            mid_hi, hi, seqlen_q, seqlen_k, page_size, stride_kb, stride_ks, stride_vb, stride_vs,
            qk_scale_log2, cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right, dropout_p, dropout_seed,
            b, h, True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, IS_PAGED, PAD_HEADDIM, HAS_QV, BLOCK_N, USE_TMA,
            False)

    seen = l_i != 0.0  # 0: no visible key (or only -inf scores); a NaN sum (NaN or +inf scores) stays NaN
    inv_l = 1.0 / tl.where(seen, l_i, 1.0)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)  # exactly 1 when dropout is off at run time
    out = acc * inv_l[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("inf"))

    O_head = Out + b64 * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh
    o_rows = row_ptrs(O_head, start_m, stride_os, BLOCK_M)
    tl.store(o_rows[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
    L_head = LSE + b64 * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start
    tl.store(L_head + offs_m, lse, mask=m_mask & ((offs_m * 0 + v_start) == 0))  # the first part's


@triton.jit
def attn_probs_kernel(
    Q, K, LSE, S,
    CuSeqlensQ, CuSeqlensK, BlockTable, AlibiSlopes, DropoutSeed,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_lb, stride_lh,
    stride_pb, stride_ph, stride_ps,
    stride_btb, stride_ab,
    seqlen_q, seqlen_k, group, head_dim, page_size, packed, use_alibi,
    softmax_scale, softcap, window_left, window_right, dropout_p,
    IS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_PAGED: tl.constexpr, PAD_HEADDIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``return_softmax`` (testing only): the probabilities ``exp(logit - lse)``, negated where
    dropout drops them, into a zero-initialised fp32 ``S (b, h, max_sq, max_sk)`` (column stride 1).

    Same grid and arguments as :func:`attn_fwd_kernel` (minus V/Out) and the same score helpers,
    applied after the forward has produced ``lse``.
    """
    stride_qb, stride_qs, stride_qh = stride_16b(stride_qb), stride_16b(stride_qs), stride_16b(stride_qh)
    stride_kb, stride_ks, stride_kh = stride_16b(stride_kb), stride_16b(stride_ks), stride_16b(stride_kh)
    pid_m, b = block_and_batch(seqlen_q, BLOCK_M, False)
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
    d_mask = offs_d < head_dim
    m_mask = offs_m < seqlen_q
    b64 = b.to(tl.int64)
    Q_head = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
    q_rows = row_ptrs(Q_head, start_m, stride_qs, BLOCK_M)
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if IS_PAGED:
        K_head = K + kv_h * stride_kh
        bt_row = BlockTable + b64 * stride_btb
    else:
        K_head = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + kv_h * stride_kh
        bt_row = BlockTable
    L_head = LSE + b64 * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start
    lse = tl.load(L_head + offs_m, mask=m_mask, other=float("inf"))
    lse_log2 = lse * LOG2E
    qk_scale_log2, cap_on, cap_in, cap_out_log2 = masking.score_scalars(softmax_scale, softcap, HAS_SOFTCAP)
    slope_log2 = alibi_slope_log2(AlibiSlopes, b, h, stride_ab, use_alibi, HAS_ALIBI)
    S_rows = row_ptrs(S + b64 * stride_pb + tl.cast(h, tl.int64) * stride_ph, start_m, stride_ps, BLOCK_M)[:, None]
    for start_n in range(0, seqlen_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_rows = kv_row_ptrs(K_head, start_n, seqlen_k, bt_row, page_size, stride_kb, stride_ks, BLOCK_N, IS_PAGED)
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=(offs_n < seqlen_k)[:, None] & d_mask[None, :],
                    other=0.0)
        qk = tl.dot(q, tl.trans(k))
        s, _ = masking.logits_log2(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, qk_scale_log2,
                                   cap_on, cap_in, cap_out_log2, slope_log2, window_left, window_right,
                                   True, IS_LOCAL, HAS_SOFTCAP, HAS_ALIBI)
        p = tl.math.exp2(s - lse_log2[:, None])
        if HAS_DROPOUT:
            if dropout_p > 0.0:
                keep = dropout_keep(dropout_seed, b, h, offs_m[:, None], offs_n[None, :], dropout_p)
                p = tl.where(keep, p, -p)
        tl.store(S_rows + offs_n[None, :], p, mask=m_mask[:, None] & (offs_n < seqlen_k)[None, :])
