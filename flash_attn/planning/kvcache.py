"""The KV-cache call's plan (``flash_attn_with_kvcache``): append the new keys and values to the
cache (rotated, with rotary; a few without rotary inside the attention kernel, on NVIDIA GPUs),
rotate q, attend over the cache in key splits, combine the splits.

For the ahead-of-time images (``Target(aot=True)``) every launch is one of the shipped superset
variants (:mod:`flash_attn.planning.decode_configs`): a plain cache is addressed as one page per
sequence, the features are switched at run time, and caches the images cannot address (they are
written in place, so they cannot be copied into the kernels' layout) are refused.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from flash_attn import limits
from flash_attn.limits import cdiv
from flash_attn.params import cache_capacity
from flash_attn.planning import configs, decode_configs as dc
from flash_attn.planning.launches import (Launch, Planned, Refusal, Target, finish, head_dim_refusal, kernel_refusal,
                                         launch, named)
from flash_attn.planning.layouts import Layouts, alibi_batch_stride, effective_strides, fits
from flash_attn.planning.shapes import KVCacheShape, Scalars, Slot, is_local

__all__ = ["plan_kvcache", "choose_num_splits"]


def choose_num_splits(requested: int, programs: int, key_blocks: int, sms: int) -> int:
    """How many key splits to launch.

    ``programs``: attention programs without splitting (batch * nheads_k * query tiles);
    ``key_blocks``: the most key blocks one program may have to visit. ``requested > 0`` is
    honoured, clamped to ``key_blocks`` (more splits would only be empty). ``requested == 0``:
    the GPU runs ``slots = sms *`` :data:`~decode_configs.SPLIT_PROGRAMS_PER_SM` programs at once;
    one split when the programs already fill ~80% of the slots; otherwise the fewest splits whose
    waves of programs are nearly (95%) as full as the best count's, a last wave that runs almost
    empty costing a whole wave's time. At most :data:`~decode_configs.MAX_SPLITS`, no split shorter
    than :data:`~decode_configs.MIN_BLOCKS_PER_SPLIT` blocks, and then the fewest splits that give
    every split the same number of blocks, so that no split is left empty.
    """
    key_blocks = max(int(key_blocks), 1)
    if requested > 0:
        return max(1, min(int(requested), key_blocks))
    slots = sms * dc.SPLIT_PROGRAMS_PER_SM
    programs = max(int(programs), 1)
    if programs >= 0.8 * slots:
        return 1
    most = max(1, min(dc.MAX_SPLITS, key_blocks // dc.MIN_BLOCKS_PER_SPLIT))

    def fullness(splits: int) -> float:
        waves = programs * splits / slots
        return waves / math.ceil(waves)

    best = max(fullness(s) for s in range(1, most + 1))
    splits = next(s for s in range(1, most + 1) if fullness(s) >= 0.95 * best)
    per_split = cdiv(key_blocks, splits)
    return cdiv(key_blocks, per_split)


def _max_visible_keys(capacity: int, scalars: Scalars, query_rows_per_tile: int) -> int:
    """Upper bound on the keys one query tile sees: the cache capacity, or the window span."""
    if scalars.window_left >= 0 and scalars.window_right >= 0:
        return min(capacity, scalars.window_left + scalars.window_right + query_rows_per_tile)
    return capacity


def _cache_refusal(s: KVCacheShape) -> Optional[Refusal]:
    """Why the ahead-of-time decode kernels cannot address these caches: the images assume the
    kernels' layout, and the caches, written in place, cannot be copied into it."""
    for name, t in (("k_cache", s.k_cache), ("v_cache", s.v_cache)):
        if not t.aligned:
            return Refusal(f"{name} is not 16-byte aligned")
        if not fits(t, "rows"):
            return Refusal(f"{name} has strides {t.strides}: not multiples of {limits.STRIDE_MULTIPLE} elements "
                           f"with a contiguous last dimension")
    return None


def _kvcache_refusal(s: KVCacheShape, target: Target) -> Optional[Refusal]:
    head_dim, head_dim_v = s.q.shape[3], s.v_cache.shape[3]
    if target.aot:
        why = kernel_refusal(s.q.dtype, head_dim, target) or kernel_refusal(s.q.dtype, head_dim_v, target)
        if why is None:
            superset = dc.superset_refusal(target.family, head_dim, head_dim_v, s.qv is not None)
            why = Refusal(superset) if superset is not None else _cache_refusal(s)
        return why
    return head_dim_refusal(head_dim, target, head_dim_v)


class _CacheAddress(NamedTuple):
    """How the kernels find a sequence's cache rows: in pages of ``page_size`` rows listed by
    ``block_table`` (row stride ``stride_btb``), or, when ``identity_table``, page ``b`` for
    sequence ``b``. ``paged``/``batch_idx``: the kernels' ``PAGED``/``HAS_BATCH_IDX`` flags."""

    block_table: Slot
    stride_btb: int
    identity_table: int
    page_size: int
    capacity: int  # the cache rows one sequence can address
    paged: bool
    batch_idx: bool


def _cache_address(s: KVCacheShape, lay: Layouts, superset: bool, int32_unused: Slot) -> _CacheAddress:
    """The caller's block table; in superset mode (the ahead-of-time images, always paged) a
    plain cache is addressed as one page per sequence: page ``cache_batch_idx[b]`` (a column view
    of it) or page ``b`` (the identity table). ``int32_unused``: an int32 pointer no kernel reads."""
    paged, page_size = s.block_table is not None, s.k_cache.shape[1]
    identity_table = 0
    if paged:
        block_table = lay.input("block_table", s.block_table, "plain")
    elif superset and s.batch_idx is not None:
        block_table = lay.column("block_table", "batch_idx", s.batch_idx)
    else:
        block_table, identity_table = int32_unused, int(superset)
        lay.strides["block_table"] = (0, 0)
    capacity = cache_capacity(s.k_cache, s.block_table)
    flags = (True, False) if superset else (paged, s.batch_idx is not None and not paged)
    return _CacheAddress(block_table, lay.strides["block_table"][0], identity_table, page_size, capacity, *flags)


class _KVCall(NamedTuple):
    """One KV-cache call as its launches see it: sizes, tensors by slot, the cache's addressing.
    ``superset``: planned for the ahead-of-time images (inputs in the ``"rows"`` layout, results
    padded, every feature compiled in). Optional pointers a call lacks stand as another tensor of
    the call of the same type, which the kernel does not read: ``lse`` (fp32), ``seqlens`` (int32;
    without cache_seqlens an int32 buffer no kernel reads, and ``seqlen_cache`` the cache's rows)."""

    s: KVCacheShape
    superset: bool
    lay: Layouts
    batch: int
    seqlen_q: int
    nheads: int
    nheads_k: int
    head_dim: int
    head_dim_v: int
    seqlen_new: int
    block_d: int
    block_dv: int
    q: Slot
    out: Slot
    lse: Slot
    seqlens: Slot
    seqlen_cache: int  # every sequence's cache rows where the call has no cache_seqlens, else -1
    cos: Slot
    sin: Slot
    rotary_half: int
    stride_ro: int
    leftpad: Slot
    batch_idx: Slot
    alibi: Slot
    sinks: Slot
    qv: Optional[Slot]
    cache: _CacheAddress

    @property
    def rows(self) -> str:
        """The layout q-like inputs are brought into."""
        return "rows" if self.superset else "plain"

    @property
    def lse_rows(self) -> tuple:
        """lse ``(batch, nheads, seqlen_q)``: its strides in the kernels' (batch, row, head) order."""
        b, h, s = self.lay.strides["lse"]
        return b, s, h


def _kv_call(s: KVCacheShape, target: Target) -> _KVCall:
    """Lays out the call's inputs and results (in this order: the order of its preparations and buffers)."""
    superset = target.aot
    batch, seqlen_q, nheads, head_dim = s.q.shape
    head_dim_v = s.v_cache.shape[3]
    lay = Layouts()
    q = lay.input("q", s.q, "rows" if superset else "plain")
    qv = lay.input("qv", s.qv, "rows" if superset else "plain") if s.qv is not None else None
    lay.strides["k_cache"] = effective_strides(s.k_cache)
    lay.strides["v_cache"] = effective_strides(s.v_cache)
    out = lay.buffer("out", (batch, seqlen_q, nheads, head_dim_v), s.q.dtype, padded=superset)
    lse = lay.buffer("lse", (batch, nheads, seqlen_q), torch.float32)
    if s.seqlens is not None:
        seqlens = lay.input("seqlens", s.seqlens, "plain")
    elif s.cos is None and s.k_new is None:
        seqlens = lay.buffer("no_seqlens", (1,), torch.int32, unused=True)  # the kernels read seqlen_cache
    else:
        raise ValueError("a KV-cache call that appends or rotates needs cache_seqlens (the positions)")
    if s.cos is not None:
        how = "fp32" if superset else "plain"
        cos, sin = lay.input("cos", s.cos, how), lay.input("sin", s.sin, how)
        rotary_half, stride_ro = s.cos.shape[1], lay.strides["cos"][0]
    else:
        cos = sin = lse
        rotary_half = stride_ro = 0
    leftpad = lay.input("leftpad", s.leftpad, "plain") if s.leftpad is not None else seqlens
    batch_idx = lay.input("batch_idx", s.batch_idx, "plain") if s.batch_idx is not None else seqlens
    alibi = lay.input("alibi", s.alibi, "plain") if s.alibi is not None else lse
    sinks = lay.input("sinks", s.sinks, "plain") if s.sinks is not None else lse
    cache = _cache_address(s, lay, superset, seqlens)
    block_d, block_dv = dc.block_dims(head_dim, head_dim_v, superset, s.qv is not None)
    seqlen_new = 0 if s.k_new is None else s.k_new.shape[1]
    return _KVCall(s=s, superset=superset, lay=lay, batch=batch, seqlen_q=seqlen_q, nheads=nheads,
                   nheads_k=s.k_cache.shape[2], head_dim=head_dim, head_dim_v=head_dim_v, seqlen_new=seqlen_new,
                   block_d=block_d, block_dv=block_dv, q=q, out=out, lse=lse, seqlens=seqlens,
                   seqlen_cache=-1 if s.seqlens is not None else cache.capacity, cos=cos, sin=sin,
                   rotary_half=rotary_half, stride_ro=stride_ro, leftpad=leftpad, batch_idx=batch_idx, alibi=alibi,
                   sinks=sinks, qv=qv, cache=cache)


def _kv_splits(kv: _KVCall, target: Target) -> tuple:
    """The split kernel's config, its query tiles per (batch, kv head), and the number of key splits."""
    s, group = kv.s, kv.nheads // kv.nheads_k
    rows = kv.seqlen_q * group
    config = dc.decode_config(target.family, max(kv.block_d, kv.block_dv), rows, fp32=s.q.dtype == torch.float32)
    m_blocks = cdiv(rows, config.block_m)
    query_rows_per_tile = min(kv.seqlen_q, cdiv(config.block_m, group) + 1)
    capacity = kv.cache.capacity
    key_blocks = cdiv(_max_visible_keys(capacity, s.scalars, query_rows_per_tile), config.block_n) + 1
    key_blocks = min(key_blocks, max(cdiv(capacity, config.block_n), 1))
    splits = choose_num_splits(s.num_splits, kv.batch * kv.nheads_k * m_blocks, key_blocks, target.sm_count)
    return config, m_blocks, splits


class _Partials(NamedTuple):
    """Where the split kernel writes: with one split, out and lse themselves; with several, fp32
    partial results ``(splits, batch, seqlen_q, nheads[, head_dim])`` for the combine."""

    splits: int
    out: Slot
    out_strides: tuple  # (split, batch, row, head)
    lse: Slot
    lse_strides: tuple  # (split, batch, row, head)
    empty_lse: float  # the lse of a row that sees no key


def _kv_partials(kv: _KVCall, splits: int) -> _Partials:
    if splits == 1:
        return _Partials(1, kv.lse, (0, 0, 0, 0), kv.lse, (0, *kv.lse_rows), float("inf"))
    lay = kv.lay
    out_part = lay.buffer("out_part", (splits, kv.batch, kv.seqlen_q, kv.nheads, kv.head_dim_v), torch.float32)
    lse_part = lay.buffer("lse_part", (splits, kv.batch, kv.seqlen_q, kv.nheads), torch.float32)
    return _Partials(splits, out_part, lay.strides["out_part"][:4], lse_part, lay.strides["lse_part"], float("-inf"))


def _new_kv(kv: _KVCall) -> dict:
    """The new keys and values as the kernels that append them take them (``K_new``, ``V_new`` and
    their strides), laid out in the call's layout."""
    lay, s = kv.lay, kv.s
    k_new, v_new = lay.input("k_new", s.k_new, kv.rows), lay.input("v_new", s.v_new, kv.rows)
    return dict(K_new=k_new, V_new=v_new, **named("stride_kn", "bsh", lay.rows("k_new")),
                **named("stride_vn", "bsh", lay.rows("v_new")))


def _append_launch(kv: _KVCall) -> Launch:
    """Writes the new keys and values (rotated, with rotary) into the cache."""
    s, lay, cache = kv.s, kv.lay, kv.cache
    grid = (kv.batch * kv.nheads_k * cdiv(kv.seqlen_new, dc.APPEND_BLOCK_T),)
    return launch("append_kv_kernel", grid, dict(
        **_new_kv(kv), K_cache=Slot("k_cache"), V_cache=Slot("v_cache"), Cos=kv.cos, Sin=kv.sin,
        Seqlens=kv.seqlens, BatchIdx=kv.batch_idx, BlockTable=cache.block_table,
        **named("stride_kc", "bsh", lay.strides["k_cache"][:3]),
        **named("stride_vc", "bsh", lay.strides["v_cache"][:3]),
        stride_btb=cache.stride_btb, stride_ro=kv.stride_ro, nheads_k=kv.nheads_k, seqlen_new=kv.seqlen_new,
        head_dim=kv.head_dim, head_dim_v=kv.head_dim_v, rotary_half=kv.rotary_half, page_size=cache.page_size,
        identity_table=cache.identity_table),
        dict(dc.append_constexprs(kv.block_d, cache.paged, cache.batch_idx, s.cos is not None, s.rotary_interleaved,
                                  kv.block_dv)),
        dc.AUX_CONFIG)


def _rotary_q_launch(kv: _KVCall, q_rot: Slot) -> Launch:
    """Writes q rotated into ``q_rot``."""
    lay = kv.lay
    grid = (kv.batch * kv.nheads * cdiv(kv.seqlen_q, dc.APPEND_BLOCK_T),)
    return launch("rotary_q_kernel", grid, dict(
        Q=kv.q, Q_out=q_rot, Cos=kv.cos, Sin=kv.sin, Seqlens=kv.seqlens,
        **named("stride_q", "bsh", lay.rows(kv.q)), **named("stride_o", "bsh", lay.rows(q_rot)),
        stride_ro=kv.stride_ro, nheads=kv.nheads, seqlen_q=kv.seqlen_q, head_dim=kv.head_dim,
        rotary_half=kv.rotary_half),
        dc.rotary_q_constexprs(kv.block_d, is_local(kv.s.scalars), kv.s.rotary_interleaved), dc.ROTARY_CONFIG)


def _plain_decode(kv: _KVCall, config: configs.Config, target: Target) -> bool:
    """Whether the shipped exact-call image of the decoding step serves this launch exactly
    (:data:`flash_attn.planning.decode_configs.SPLIT_KV_EXACT`)."""
    s, sc = kv.s, kv.s.scalars
    # a window whose left side is unbounded masks nothing for one query row (aligned bottom-right)
    unmasked = not is_local(sc) or (kv.seqlen_q == 1 and sc.window_left < 0)
    return (dc.ships_exact(target.family) and kv.block_d == kv.block_dv
            and config == dc.bucket_configs(target.family, kv.block_d)[0] and unmasked and sc.softcap == 0.0
            and s.alibi is None and s.leftpad is None and s.block_table is None and s.batch_idx is None
            and s.qv is None)


def _split_kv_features(kv: _KVCall, config: configs.Config, target: Target) -> dict:
    """The split kernel's feature flags: the call's own (JIT), else the shipped exact-call image's
    where it serves the call, else every feature (superset)."""
    if kv.superset:
        if _plain_decode(kv, config, target):
            return dict(dc.SPLIT_KV_EXACT)
        return dict(dc.SPLIT_KV_SUPERSET, HAS_QV=kv.s.qv is not None)
    s = kv.s
    return dict(IS_LOCAL=is_local(s.scalars), HAS_SOFTCAP=s.scalars.softcap > 0.0, HAS_ALIBI=s.alibi is not None,
                HAS_LEFTPAD=s.leftpad is not None, PAGED=kv.cache.paged, HAS_BATCH_IDX=kv.cache.batch_idx,
                HAS_QV=s.qv is not None)


def _new_rows(kv: _KVCall, fused: bool, q: Slot) -> dict:
    """The split kernel's new-rows arguments: ``k_new``/``v_new`` when it appends them itself
    (``fused``), else a pointer it does not read (``q``) and no rows."""
    if not fused:
        return dict(K_new=q, V_new=q, **named("stride_kn", "bsh", (0, 0, 0)), **named("stride_vn", "bsh", (0, 0, 0)),
                    seqlen_append=0)
    return dict(_new_kv(kv), seqlen_append=kv.seqlen_new)


def _split_kv_launch(kv: _KVCall, q: Slot, config: configs.Config, m_blocks: int, parts: _Partials,
                     target: Target, fused: bool) -> Launch:
    """Attention of q (``q``: rotated or not) over the cache, its keys in ``parts.splits`` splits;
    ``fused``: the kernel first appends the new keys and values itself."""
    s, lay, cache, sc = kv.s, kv.lay, kv.cache, kv.s.scalars
    return launch("split_kv_kernel", (kv.batch * kv.nheads_k * m_blocks, parts.splits), dict(
        Q=q, K=Slot("k_cache"), V=Slot("v_cache"), Out=kv.out, OutPart=parts.out, Lse=parts.lse,
        Seqlens=kv.seqlens, Leftpad=kv.leftpad, BatchIdx=kv.batch_idx, BlockTable=cache.block_table, Alibi=kv.alibi,
        Sinks=kv.sinks, QV=kv.qv if kv.qv is not None else q, **_new_rows(kv, fused, q),
        **named("stride_qv", "bsh", lay.rows(kv.qv) if kv.qv is not None else (0, 0, 0)),
        **named("stride_q", "bsh", lay.rows(q)), **named("stride_k", "bsh", lay.strides["k_cache"][:3]),
        **named("stride_v", "bsh", lay.strides["v_cache"][:3]), **named("stride_o", "bsh", lay.rows(kv.out)),
        **named("stride_p", "xbsh", parts.out_strides), **named("stride_l", "xbsh", parts.lse_strides),
        stride_btb=cache.stride_btb, stride_ab=alibi_batch_stride(lay, s.alibi),
        nheads_k=kv.nheads_k, seqlen_q=kv.seqlen_q, seqlen_new=kv.seqlen_new, seqlen_cache=kv.seqlen_cache,
        group=kv.nheads // kv.nheads_k,
        head_dim=kv.head_dim, head_dim_v=kv.head_dim_v, page_size=cache.page_size,
        use_leftpad=int(s.leftpad is not None), use_alibi=int(s.alibi is not None), use_sinks=int(s.sinks is not None),
        identity_table=cache.identity_table, softmax_scale=sc.softmax_scale, softcap=sc.softcap,
        window_left=sc.window_left, window_right=sc.window_right, empty_lse=parts.empty_lse),
        dc.split_kv_constexprs(config, kv.block_d, _split_kv_features(kv, config, target), kv.block_dv), config)


def _combine_launch(kv: _KVCall, parts: _Partials) -> Launch:
    """Merges the splits' partial results into out and lse."""
    grid = (kv.batch * cdiv(kv.seqlen_q * kv.nheads, dc.COMBINE_BLOCK_R),)
    return launch("combine_splits_kernel", grid, dict(
        OutPart=parts.out, LsePart=parts.lse, Out=kv.out, Lse=kv.lse, Sinks=kv.sinks,
        **named("stride_p", "xbsh", parts.out_strides), **named("stride_m", "xbsh", parts.lse_strides),
        **named("stride_o", "bsh", kv.lay.rows(kv.out)), **named("stride_l", "bsh", kv.lse_rows),
        num_splits=parts.splits, seqlen_q=kv.seqlen_q, nheads=kv.nheads, head_dim=kv.head_dim_v,
        use_sinks=int(kv.s.sinks is not None)),
        dc.combine_constexprs(kv.block_dv), dc.COMBINE_CONFIG)


def plan_kvcache(s: KVCacheShape, target: Target) -> Planned:
    """Append the new keys/values (:func:`_append_launch`), rotate q (:func:`_rotary_q_launch`),
    attend over the cache in key splits (:func:`_split_kv_launch`), combine them (:func:`_combine_launch`).

    Without rotary, up to :data:`~decode_configs.FUSED_APPEND_ROWS` new rows are appended by the
    attention kernel itself where :func:`~decode_configs.fuses_append` (one launch fewer: a
    decoding step is two launches, or one without splits); with rotary the append kernel rotates
    k first."""
    why = _kvcache_refusal(s, target)
    if why is not None:
        return why
    kv = _kv_call(s, target)
    launches = []
    queries = kv.batch * kv.nheads * kv.seqlen_q
    appends = s.k_new is not None and kv.seqlen_new > 0 and kv.batch * kv.nheads_k > 0
    fused = (appends and queries > 0 and s.cos is None and kv.seqlen_new <= dc.FUSED_APPEND_ROWS
             and dc.fuses_append(target.family))
    if appends and not fused:
        launches.append(_append_launch(kv))
    q = kv.q
    if s.cos is not None and queries > 0:
        q = kv.lay.buffer("q_rot", s.q.shape, s.q.dtype, padded=kv.superset)
        launches.append(_rotary_q_launch(kv, q))
    if queries > 0:
        config, m_blocks, splits = _kv_splits(kv, target)
        parts = _kv_partials(kv, splits)
        launches.append(_split_kv_launch(kv, q, config, m_blocks, parts, target, fused))
        if splits > 1:
            launches.append(_combine_launch(kv, parts))
    return finish(s.q.dtype, kv.lay, launches, ("out", "lse"))
