"""Host side of KV-cache attention: the split heuristic and the launch sequence.

:func:`forward_kvcache` runs ``flash_attn_with_kvcache`` with the Triton kernels of
:mod:`flash_attn.kernels.kvcache_append` and :mod:`flash_attn.kernels.decode`:

1. ``append_kv_kernel`` writes ``k_new``/``v_new`` into the cache in place (rotating k);
2. ``rotary_q_kernel`` makes a rotated copy of q (only with rotary tables);
3. ``split_kv_kernel`` attends, each program one kv head's query-head group over one split of
   the key blocks;
4. ``combine_splits_kernel`` merges the splits (skipped when there is a single split).

Every launch goes through :func:`flash_attn.kernels.launch._run`, the package's single launch
point, as the kernel's name, the grid, the runtime arguments in signature order, every constexpr
by name and the launch config; ``executor`` (the ``aot`` backend's precompiled images, a test's
recorder) runs it, by default Triton (compiled, or interpreted when ``interpret``).

``superset=True`` restricts the launches to the fixed set of constexpr combinations of
:func:`flash_attn.kernels.decode_configs.aot_variants` (every feature compiled in and switched
at run time, exact for every call) and lays every argument out as an ahead-of-time build
declares it; calls it cannot serve exactly raise
:class:`~flash_attn.kernels.decode_configs.DecodeLayoutUnsupported` before anything runs.

Nothing here reads tensor values on the host (no device synchronisation), so the sequence can be
captured in a CUDA graph. Launch configurations come from
:data:`~flash_attn.kernels.decode_configs.DECODE_CONFIGS`, keyed by GPU architecture family and
head-dim bucket. This module does not import Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from flash_attn.kernels import configs, launch, registry
from flash_attn.kernels import decode_configs as dc
from flash_attn.kernels.decode_configs import (  # noqa: F401  (also importable from here, as before)
    APPEND_BLOCK_T,
    AUX_CONFIG,
    ROTARY_CONFIG,
    COMBINE_BLOCK_R,
    COMBINE_CONFIG,
    DECODE_CONFIGS,
    INTERPRET_NUM_SMS,
    MAX_SPLITS,
    DecodeLayoutUnsupported,
)
from flash_attn.params import AttentionParams, KVCacheInputs

Config = configs.Config  # (block_m, block_n, num_warps, num_stages)

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def decode_family(device: Optional[torch.device], interpret: bool) -> str:
    """``"interpret"``, or the architecture family (:func:`configs.arch_family`) of ``device``."""
    if interpret:
        return "interpret"
    return configs.arch_family(torch.cuda.get_device_capability(device))


def pick_decode_config(family: str, headdim: int, packed_rows: int, dtype: torch.dtype) -> Config:
    """Launch configuration of ``split_kv_kernel`` (:func:`decode_configs.decode_config`)."""
    return dc.decode_config(family, headdim, packed_rows, fp32=dtype == torch.float32)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device, interpret: bool) -> int:
    if interpret or device.type != "cuda":
        return INTERPRET_NUM_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------------------------
# The split heuristic
# ----------------------------------------------------------------------------------------------


def choose_num_splits(requested: int, programs: int, key_blocks: int, sms: int) -> int:
    """How many key splits to launch.

    ``programs``: attention programs without splitting (batch * nheads_k * query tiles);
    ``key_blocks``: the most key blocks one program may have to visit. ``requested > 0`` is
    honoured, clamped to ``key_blocks`` (more splits would only be empty). ``requested == 0``:
    one split when the programs already fill ~80% of the SMs; otherwise enough splits that
    ``programs * splits >= sms``, at most ``key_blocks`` and :data:`MAX_SPLITS`, then reduced to
    the fewest splits that give every split the same number of blocks
    (``ceil(key_blocks / splits)``), so that no split is left empty.
    """
    key_blocks = max(int(key_blocks), 1)
    if requested > 0:
        return max(1, min(int(requested), key_blocks))
    if programs >= 0.8 * sms:
        return 1
    splits = min(-(-sms // max(programs, 1)), key_blocks, MAX_SPLITS)
    per_split = -(-key_blocks // splits)
    return -(-key_blocks // per_split)


def _max_visible_keys(capacity: int, params: AttentionParams, query_rows_per_tile: int) -> int:
    """Upper bound on the keys one query tile sees: the cache capacity, or the window span."""
    if params.window_left >= 0 and params.window_right >= 0:
        return min(capacity, params.window_left + params.window_right + query_rows_per_tile)
    return capacity


# ----------------------------------------------------------------------------------------------
# The arguments of one call
# ----------------------------------------------------------------------------------------------


def superset_refusal(q: torch.Tensor, cache: KVCacheInputs) -> Optional[str]:
    """Why superset mode cannot run this call exactly, or ``None`` (no GPU, no launch needed).

    The caches are written in place, so unlike the inputs they cannot be copied into the aligned
    layout the compiled kernels assume (:func:`decode_configs.superset_refusal`).
    """
    caches = {name: (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
              for name, t in (("k_cache", cache.k_cache), ("v_cache", cache.v_cache))}
    return dc.superset_refusal(_DTYPE_NAMES.get(q.dtype, str(q.dtype)), q.shape[-1], caches)


def _cache_strides(t: torch.Tensor) -> list[int]:
    """(slot, row, head) strides of a cache or page pool; 0 for a dimension of size 1, whose index
    is always 0 (so its arbitrary stride neither matters nor breaks the multiple-of-8 contract)."""
    return [s if n > 1 else 0 for n, s in zip(t.shape[:3], t.stride()[:3])]


@dataclass
class _Layout:
    """The tensors and flags of one call as the kernels take them (placeholders where unused)."""

    k_new: Optional[torch.Tensor]
    v_new: Optional[torch.Tensor]
    seqlens: torch.Tensor
    leftpad: torch.Tensor
    batch_idx: torch.Tensor
    block_table: torch.Tensor
    page_size: int
    alibi: torch.Tensor
    stride_ab: int
    cos: torch.Tensor
    sin: torch.Tensor
    rotary_half: int
    # constexpr flags
    paged: bool
    has_batch_idx: bool
    has_leftpad: bool
    has_alibi: bool


def _layout(q: torch.Tensor, cache: KVCacheInputs, alibi_slopes: Optional[torch.Tensor], superset: bool) -> _Layout:
    """The call's tensors, and in superset mode every tensor argument 16-byte aligned with strides
    that are multiples of 8 elements (``launch.ready`` copies inputs only where needed; the caches
    were checked by :func:`superset_refusal`) and the features switched on with neutral values."""
    batch, nheads, device = q.shape[0], q.shape[2], q.device
    k_cache = cache.k_cache
    rotary = cache.rotary_cos is not None
    if rotary:
        cos, sin = cache.rotary_cos, cache.rotary_sin
        rotary_half = cos.shape[1]
    else:
        cos = sin = torch.empty(1, dtype=torch.float32, device=device)
        rotary_half = 0
    if not superset:
        seqlens = cache.cache_seqlens
        paged = cache.block_table is not None
        return _Layout(
            k_new=cache.k_new, v_new=cache.v_new, seqlens=seqlens,
            leftpad=cache.cache_leftpad if cache.cache_leftpad is not None else seqlens,
            batch_idx=cache.cache_batch_idx if cache.cache_batch_idx is not None else seqlens,
            block_table=cache.block_table if paged else seqlens, page_size=k_cache.shape[1],
            alibi=alibi_slopes if alibi_slopes is not None else torch.empty(1, dtype=torch.float32, device=device),
            stride_ab=alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
            cos=cos.contiguous(), sin=sin.contiguous(), rotary_half=rotary_half,
            paged=paged, has_batch_idx=cache.cache_batch_idx is not None and not paged,
            has_leftpad=cache.cache_leftpad is not None, has_alibi=alibi_slopes is not None,
        )

    ready = launch.ready
    seqlens = ready(cache.cache_seqlens)
    if cache.block_table is not None:
        block_table = ready(cache.block_table.to(torch.int32))
    else:
        # a cache (b_cache, s, hk, d) is a pool of pages of s rows: sequence b is page
        # cache_batch_idx[b] (or b), so the (b, 1) table addresses exactly the same elements
        if cache.cache_batch_idx is not None:
            index = ready(cache.cache_batch_idx)
        else:
            index = launch.read_only_constant("arange", batch, 1, torch.int32, device)
        block_table = index.view(batch, 1)
    if alibi_slopes is not None:
        alibi = ready(alibi_slopes.to(torch.float32))
    else:
        alibi = launch.read_only_constant("zeros", nheads, 1, torch.float32, device)  # a zero slope adds exactly 0
    return _Layout(
        k_new=None if cache.k_new is None else ready(cache.k_new),
        v_new=None if cache.v_new is None else ready(cache.v_new),
        seqlens=seqlens,
        leftpad=ready(cache.cache_leftpad) if cache.cache_leftpad is not None
        else launch.read_only_constant("zeros", batch, 1, torch.int32, device),
        batch_idx=seqlens,  # unused: HAS_BATCH_IDX=False, the index is in the block table
        block_table=block_table, page_size=k_cache.shape[1],
        alibi=alibi, stride_ab=alibi.stride(0) if alibi.dim() == 2 else 0,
        # fp32 tables whatever the caller's dtype (exact; the kernels compute in fp32), so the
        # pointer types depend on the q/k/v dtype alone
        cos=ready(cos.to(torch.float32)), sin=ready(sin.to(torch.float32)), rotary_half=rotary_half,
        paged=True, has_batch_idx=False, has_leftpad=True, has_alibi=True,
    )


# ----------------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------------


def _append_and_rotate(q: torch.Tensor, params: AttentionParams, cache: KVCacheInputs, lay: _Layout, block_d: int,
                       interpret: bool, executor) -> torch.Tensor:
    if cache.k_new is None:
        return q
    batch, seqlen_q, nheads, headdim = q.shape
    k_new, v_new = lay.k_new, lay.v_new
    seqlen_new, nheads_k = k_new.shape[1], k_new.shape[2]
    rotary = cache.rotary_cos is not None
    interleaved = bool(cache.rotary_interleaved)
    k_cache, v_cache = cache.k_cache, cache.v_cache
    device = q.device
    if seqlen_new > 0 and batch * nheads_k > 0:
        grid = (registry.cdiv(seqlen_new, APPEND_BLOCK_T), batch * nheads_k)
        args = [
            k_new, v_new, k_cache, v_cache, lay.cos, lay.sin, lay.seqlens, lay.batch_idx, lay.block_table,
            k_new.stride(0), k_new.stride(1), k_new.stride(2),
            v_new.stride(0), v_new.stride(1), v_new.stride(2),
            *_cache_strides(k_cache), *_cache_strides(v_cache),
            lay.block_table.stride(0), lay.cos.stride(0),
            nheads_k, seqlen_new, headdim, lay.rotary_half, lay.page_size,
        ]
        flags = dc.append_constexprs(block_d, lay.paged, lay.has_batch_idx, rotary, interleaved)
        launch._run("append_kv_kernel", grid, args, flags, AUX_CONFIG, interpret, device, executor)
    if not rotary:
        return q
    q_rot = torch.empty((batch, seqlen_q, nheads, headdim), dtype=q.dtype, device=device)
    if q.numel() > 0:
        grid = (registry.cdiv(seqlen_q, APPEND_BLOCK_T), batch * nheads)
        args = [
            q, q_rot, lay.cos, lay.sin, lay.seqlens,
            q.stride(0), q.stride(1), q.stride(2),
            q_rot.stride(0), q_rot.stride(1), q_rot.stride(2),
            lay.cos.stride(0), nheads, seqlen_q, headdim, lay.rotary_half,
        ]
        # causal/local calls rotate query row t at position cache_seqlens + t, others all at cache_seqlens
        flags = dc.rotary_q_constexprs(block_d, params.is_local, interleaved)
        launch._run("rotary_q_kernel", grid, args, flags, ROTARY_CONFIG, interpret, device, executor)
    return q_rot


def _checked_q(q: torch.Tensor, cache: KVCacheInputs, superset: bool) -> torch.Tensor:
    """In superset mode: refuse (before anything runs) what the fixed specialisations cannot serve
    exactly, and give q the aligned layout they assume. Otherwise q as it is."""
    if not superset:
        return q
    why = superset_refusal(q, cache)
    if why is not None:
        raise DecodeLayoutUnsupported(why)
    return launch.ready(q)


def _block_d(headdim: int, superset: bool) -> int:
    """``BLOCK_D``: the head-dim bucket in superset mode (64/128/256), else the next power of two."""
    return dc.superset_block_d(headdim) if superset else configs.padded_headdim(headdim)


def append_and_rotate(q: torch.Tensor, params: AttentionParams, cache: KVCacheInputs, *, interpret: bool,
                      executor=None, superset: bool = False) -> torch.Tensor:
    """Append ``cache.k_new``/``v_new`` to the cache (rotating k) and return q, rotated if asked."""
    q = _checked_q(q, cache, superset)
    lay = _layout(q, cache, None, superset)
    return _append_and_rotate(q, params, cache, lay, _block_d(q.shape[-1], superset), interpret, executor)


def forward_kvcache(
    q: torch.Tensor,
    params: AttentionParams,
    cache: KVCacheInputs,
    *,
    alibi_slopes: Optional[torch.Tensor] = None,
    interpret: bool,
    executor=None,
    superset: bool = False,
    family: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_with_kvcache`` on the Triton kernels; the backend contract's ``forward_kvcache``.

    Returns ``(out (b, sq, h, d) like q, lse fp32 (b, h, sq))``; mutates the cache in place.
    ``interpret=True`` runs every kernel in Triton's interpreter (CPU tensors). ``executor``: see
    :func:`flash_attn.kernels.launch._run`. ``superset``: launch only the specialisations of
    :func:`decode_configs.aot_variants` (fp16/bf16, head dims multiple of 8; raises
    :class:`DecodeLayoutUnsupported` before touching anything otherwise). ``family``: the
    architecture family whose launch configs to use (default: the device's, ``"interpret"`` in
    the interpreter); lets the interpreter run, and a test check, exactly the launches a GPU
    family would get.
    """
    q = _checked_q(q, cache, superset)
    batch, seqlen_q, nheads, headdim = q.shape
    device = q.device
    block_d = _block_d(headdim, superset)
    lay = _layout(q, cache, alibi_slopes, superset)
    q = _append_and_rotate(q, params, cache, lay, block_d, interpret, executor)
    k_cache, v_cache = cache.k_cache, cache.v_cache
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    out = torch.empty((batch, seqlen_q, nheads, headdim), dtype=q.dtype, device=device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=device)
    if q.numel() == 0:
        return out, lse

    capacity = (cache.block_table.shape[1] * lay.page_size if cache.block_table is not None
                else k_cache.shape[1])
    seqlen_new = 0 if cache.k_new is None else cache.k_new.shape[1]

    rows = seqlen_q * group
    config = pick_decode_config(family or decode_family(device, interpret), headdim, rows, q.dtype)
    block_m, block_n = config.block_m, config.block_n
    m_blocks = registry.cdiv(rows, block_m)
    query_rows_per_tile = min(seqlen_q, registry.cdiv(block_m, group) + 1)
    key_blocks = registry.cdiv(_max_visible_keys(capacity, params, query_rows_per_tile), block_n) + 1
    key_blocks = min(key_blocks, max(registry.cdiv(capacity, block_n), 1))
    splits = choose_num_splits(cache.num_splits, batch * nheads_k * m_blocks, key_blocks,
                               num_sms(device, interpret))

    # one split writes out/lse directly; several write fp32 partial results for the combine
    if splits == 1:
        out_part = torch.empty(1, dtype=torch.float32, device=device)  # unused placeholder
        p_strides = (0, 0, 0, 0)
        lse_buf = lse
        l_strides = (0, lse.stride(0), lse.stride(2), lse.stride(1))
        empty_lse = float("inf")
    else:
        out_part = torch.empty((splits, batch, seqlen_q, nheads, headdim), dtype=torch.float32, device=device)
        p_strides = out_part.stride()[:4]
        lse_buf = torch.empty((splits, batch, seqlen_q, nheads), dtype=torch.float32, device=device)
        l_strides = lse_buf.stride()
        empty_lse = float("-inf")

    if superset:
        features = dc.SPLIT_KV_SUPERSET
    else:
        features = dict(IS_LOCAL=params.is_local, HAS_SOFTCAP=params.softcap > 0.0, HAS_ALIBI=lay.has_alibi,
                        PAGED=lay.paged, HAS_BATCH_IDX=lay.has_batch_idx, HAS_LEFTPAD=lay.has_leftpad,
                        ONE_PASS=False)
    args = [
        q, k_cache, v_cache, out, out_part, lse_buf, lay.seqlens, lay.leftpad, lay.batch_idx, lay.block_table,
        lay.alibi,
        q.stride(0), q.stride(1), q.stride(2), *_cache_strides(k_cache), *_cache_strides(v_cache),
        out.stride(0), out.stride(1), out.stride(2), *p_strides, *l_strides,
        lay.block_table.stride(0), lay.stride_ab,
        nheads_k, seqlen_q, seqlen_new, group, headdim, lay.page_size,
        float(params.softmax_scale), float(params.softcap), int(params.window_left), int(params.window_right),
        empty_lse,
    ]
    launch._run("split_kv_kernel", (splits, batch * nheads_k, m_blocks), args,
                dc.split_kv_constexprs(config, block_d, features), config, interpret, device, executor)
    if splits > 1:
        args = [
            out_part, lse_buf, out, lse,
            *out_part.stride()[:4], *lse_buf.stride(),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(2), lse.stride(1),
            splits, seqlen_q, nheads, headdim,
        ]
        launch._run("combine_splits_kernel", (registry.cdiv(seqlen_q * nheads, COMBINE_BLOCK_R), batch), args,
                    dc.combine_constexprs(block_d), COMBINE_CONFIG, interpret, device, executor)
    return out, lse
