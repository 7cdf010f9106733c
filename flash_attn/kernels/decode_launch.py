"""Host side of KV-cache attention: launch configs, the split heuristic and the launch sequence.

:func:`forward_kvcache` runs ``flash_attn_with_kvcache`` with the Triton kernels of
:mod:`flash_attn.kernels.kvcache_append` and :mod:`flash_attn.kernels.decode`:

1. ``append_kv_kernel`` writes ``k_new``/``v_new`` into the cache in place (rotating k);
2. ``rotary_q_kernel`` makes a rotated copy of q (only with rotary tables);
3. ``split_kv_kernel`` attends, each program one kv head's query-head group over one split of
   the key blocks;
4. ``combine_splits_kernel`` merges the splits (skipped when there is a single split).

Nothing here reads tensor values on the host (no device synchronisation), so the sequence can be
captured in a CUDA graph. Launch configurations come from :data:`DECODE_CONFIGS`, keyed by GPU
architecture family and head-dim bucket.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from flash_attn.kernels import configs, registry
from flash_attn.params import AttentionParams, KVCacheInputs

# ----------------------------------------------------------------------------------------------
# Launch configurations
# ----------------------------------------------------------------------------------------------


Config = configs.Config  # (block_m, block_n, num_warps, num_stages)

# (arch family, largest head dim of the bucket) -> (decode config, many-rows config). The first
# is used when the packed query rows ``seqlen_q * nheads / nheads_k`` fit its BLOCK_M of 16 (one
# MMA tile: decoding, also with GQA groups up to 16), the second otherwise (speculative decoding,
# prefill against a cache). Decoding is bound by reading K/V: wide key blocks keep many loads in
# flight. Every entry was compiled for its architecture (worst-case flags: paged, local, ALiBi,
# softcap, leftpad) and fits its shared memory without register spills (cuobjdump STACK:0).
_C = Config
DECODE_CONFIGS: dict[tuple[str, int], tuple[Config, Config]] = {
    # A100: 163 KB shared memory, mma.sync + cp.async
    ("sm80", 64): (_C(16, 128, 4, 3), _C(64, 128, 8, 3)),
    ("sm80", 128): (_C(16, 64, 4, 3), _C(32, 64, 4, 3)),
    ("sm80", 256): (_C(16, 64, 8, 2), _C(32, 64, 8, 2)),
    # consumer Ampere / Ada (sm86/87/89) and consumer Blackwell (sm120): 99 KB
    ("sm86", 64): (_C(16, 128, 4, 2), _C(64, 64, 4, 2)),
    ("sm86", 128): (_C(16, 64, 4, 2), _C(32, 64, 4, 2)),
    ("sm86", 256): (_C(16, 32, 4, 2), _C(32, 32, 4, 2)),
    # H100/H200 and B200: 227 KB; BLOCK_M = 16 rows use mma.sync, 64-row tiles wgmma on sm90
    ("sm90", 64): (_C(16, 128, 4, 4), _C(64, 128, 8, 4)),
    ("sm90", 128): (_C(16, 128, 4, 3), _C(64, 64, 8, 3)),
    ("sm90", 256): (_C(16, 64, 8, 2), _C(32, 64, 8, 2)),
    # Triton's interpreter: small key blocks so that the tests cross several blocks and pages
    ("interpret", 64): (_C(16, 32, 1, 1), _C(64, 32, 1, 1)),
    ("interpret", 128): (_C(16, 32, 1, 1), _C(64, 32, 1, 1)),
    ("interpret", 256): (_C(16, 16, 1, 1), _C(32, 16, 1, 1)),
}
for _bucket in (64, 128, 256):
    DECODE_CONFIGS[("sm100", _bucket)] = DECODE_CONFIGS[("sm90", _bucket)]
    DECODE_CONFIGS[("sm120", _bucket)] = DECODE_CONFIGS[("sm86", _bucket)]
# Rows per program of the append / rotary kernels and of the combine kernel.
APPEND_BLOCK_T = 16
COMBINE_BLOCK_R = 16
# Most splits the heuristic picks (the combine reads every split of every row).
MAX_SPLITS = 128
# SM count assumed in Triton's interpreter (an A100's), so that the heuristic is exercised.
INTERPRET_NUM_SMS = 108


def decode_family(device: Optional[torch.device], interpret: bool) -> str:
    """``"interpret"``, or the architecture family (:func:`configs.arch_family`) of ``device``."""
    if interpret:
        return "interpret"
    return configs.arch_family(torch.cuda.get_device_capability(device))


def pick_decode_config(family: str, headdim: int, packed_rows: int, dtype: torch.dtype) -> Config:
    """Launch configuration of ``split_kv_kernel`` for ``seqlen_q * group = packed_rows`` rows.

    float32 inputs take the FMA path with tiles twice as big in bytes: key blocks of at most 32
    (16 for head dim 256), at most 32 rows, no software pipelining (a rare case; it is correct
    but may spill registers).
    """
    bucket = next((b for b in (64, 128, 256) if headdim <= b), None)
    if bucket is None:
        raise ValueError(f"head dim {headdim} > 256 is not supported by the decode kernels")
    small, large = DECODE_CONFIGS[(family, bucket)]
    config = small if packed_rows <= small.block_m else large
    if dtype == torch.float32 and family != "interpret":
        block_m = min(config.block_m, 32)
        block_n = min(config.block_n, 32 if bucket <= 128 else 16)
        config = Config(block_m, block_n, 8 if block_m > 16 else 4, 1)
    return config


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
# Launching
# ----------------------------------------------------------------------------------------------


def _launch(kernel: str, grid, interpret: bool, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, compiled for the GPU or run in Triton's interpreter;
    ``kernel`` is a name of :mod:`flash_attn.kernels.registry`, resolved (importing Triton) here only."""
    if interpret:
        from flash_attn.kernels import interpreter  # noqa: PLC0415

        interpreter.launch(registry.jit_function(kernel), grid, *args, **kwargs)
    else:
        registry.jit_function(kernel)[grid](*args, **kwargs)


def append_and_rotate(q: torch.Tensor, params: AttentionParams, cache: KVCacheInputs, *, interpret: bool) -> torch.Tensor:
    """Append ``cache.k_new``/``v_new`` to the cache (rotating k) and return q, rotated if asked."""
    if cache.k_new is None:
        return q
    batch, seqlen_q, nheads, headdim = q.shape
    k_new, v_new = cache.k_new, cache.v_new
    seqlen_new, nheads_k = k_new.shape[1], k_new.shape[2]
    rotary = cache.rotary_cos is not None
    k_cache, v_cache = cache.k_cache, cache.v_cache
    seqlens = cache.cache_seqlens
    if rotary:
        cos = cache.rotary_cos.contiguous()
        sin = cache.rotary_sin.contiguous()
        rotary_half = cos.shape[1]
    else:
        cos = sin = torch.empty(1, dtype=torch.float32, device=q.device)
        rotary_half = 0
    paged = cache.block_table is not None
    block_table = cache.block_table if paged else seqlens
    batch_idx = cache.cache_batch_idx if cache.cache_batch_idx is not None else seqlens
    block_d = configs.padded_headdim(headdim)
    num_warps = 1 if interpret else 4
    if seqlen_new > 0 and batch * nheads_k > 0:
        grid = (registry.cdiv(seqlen_new, APPEND_BLOCK_T), batch * nheads_k)
        _launch(
            "append_kv_kernel", grid, interpret,
            k_new, v_new, k_cache, v_cache, cos, sin, seqlens, batch_idx, block_table,
            k_new.stride(0), k_new.stride(1), k_new.stride(2),
            v_new.stride(0), v_new.stride(1), v_new.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0), cos.stride(0),
            nheads_k, seqlen_new, headdim, rotary_half, k_cache.shape[1],
            BLOCK_T=APPEND_BLOCK_T, BLOCK_D=block_d, PAGED=paged,
            HAS_BATCH_IDX=cache.cache_batch_idx is not None and not paged,
            HAS_ROTARY=rotary, INTERLEAVED=bool(cache.rotary_interleaved),
            num_warps=num_warps,
        )
    if not rotary:
        return q
    q_rot = torch.empty((batch, seqlen_q, nheads, headdim), dtype=q.dtype, device=q.device)
    if q.numel() > 0:
        grid = (registry.cdiv(seqlen_q, APPEND_BLOCK_T), batch * nheads)
        _launch(
            "rotary_q_kernel", grid, interpret,
            q, q_rot, cos, sin, seqlens,
            q.stride(0), q.stride(1), q.stride(2),
            q_rot.stride(0), q_rot.stride(1), q_rot.stride(2),
            cos.stride(0), nheads, seqlen_q, headdim, rotary_half,
            BLOCK_T=APPEND_BLOCK_T, BLOCK_D=block_d, PER_ROW_POSITION=params.is_local,
            INTERLEAVED=bool(cache.rotary_interleaved), num_warps=num_warps,
        )
    return q_rot


def forward_kvcache(
    q: torch.Tensor,
    params: AttentionParams,
    cache: KVCacheInputs,
    *,
    alibi_slopes: Optional[torch.Tensor] = None,
    interpret: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_with_kvcache`` on the Triton kernels; the backend contract's ``forward_kvcache``.

    Returns ``(out (b, sq, h, d) like q, lse fp32 (b, h, sq))``; mutates the cache in place.
    ``interpret=True`` runs every kernel in Triton's interpreter (CPU tensors).
    """
    q = append_and_rotate(q, params, cache, interpret=interpret)
    batch, seqlen_q, nheads, headdim = q.shape
    k_cache, v_cache = cache.k_cache, cache.v_cache
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    device = q.device
    out = torch.empty((batch, seqlen_q, nheads, headdim), dtype=q.dtype, device=device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=device)
    if q.numel() == 0:
        return out, lse

    paged = cache.block_table is not None
    seqlens = cache.cache_seqlens
    page_size = k_cache.shape[1]
    capacity = cache.block_table.shape[1] * page_size if paged else k_cache.shape[1]
    seqlen_new = 0 if cache.k_new is None else cache.k_new.shape[1]

    rows = seqlen_q * group
    config = pick_decode_config(decode_family(device, interpret), headdim, rows, q.dtype)
    block_m, block_n = config.block_m, config.block_n
    m_blocks = registry.cdiv(rows, block_m)
    query_rows_per_tile = min(seqlen_q, registry.cdiv(block_m, group) + 1)
    key_blocks = registry.cdiv(_max_visible_keys(capacity, params, query_rows_per_tile), block_n) + 1
    key_blocks = min(key_blocks, max(registry.cdiv(capacity, block_n), 1))
    splits = choose_num_splits(cache.num_splits, batch * nheads_k * m_blocks, key_blocks,
                               num_sms(device, interpret))

    if splits == 1:
        out_buf, lse_buf = out, lse
        o_strides = (0, out.stride(0), out.stride(1), out.stride(2))
        l_strides = (0, lse.stride(0), lse.stride(2), lse.stride(1))
        empty_lse = float("inf")
    else:
        out_buf = torch.empty((splits, batch, seqlen_q, nheads, headdim), dtype=torch.float32, device=device)
        lse_buf = torch.empty((splits, batch, seqlen_q, nheads), dtype=torch.float32, device=device)
        o_strides = out_buf.stride()[:4]
        l_strides = lse_buf.stride()
        empty_lse = float("-inf")

    if alibi_slopes is not None:
        alibi = alibi_slopes
        stride_ab = alibi.stride(0) if alibi.dim() == 2 else 0
    else:
        alibi = torch.empty(1, dtype=torch.float32, device=device)
        stride_ab = 0
    block_table = cache.block_table if paged else seqlens
    batch_idx = cache.cache_batch_idx if cache.cache_batch_idx is not None else seqlens
    leftpad = cache.cache_leftpad if cache.cache_leftpad is not None else seqlens

    grid = (splits, batch * nheads_k, m_blocks)
    _launch(
        "split_kv_kernel", grid, interpret,
        q, k_cache, v_cache, out_buf, lse_buf, seqlens, leftpad, batch_idx, block_table, alibi,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *o_strides, *l_strides,
        block_table.stride(0), stride_ab,
        nheads_k, seqlen_q, seqlen_new, group, headdim, page_size,
        float(params.softmax_scale), float(params.softcap),
        int(params.window_left), int(params.window_right), empty_lse,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=configs.padded_headdim(headdim),
        IS_LOCAL=params.is_local, HAS_SOFTCAP=params.softcap > 0.0,
        HAS_ALIBI=alibi_slopes is not None, PAGED=paged,
        HAS_BATCH_IDX=cache.cache_batch_idx is not None and not paged,
        HAS_LEFTPAD=cache.cache_leftpad is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        grid = (registry.cdiv(seqlen_q * nheads, COMBINE_BLOCK_R), batch)
        _launch(
            "combine_splits_kernel", grid, interpret,
            out_buf, lse_buf, out, lse,
            out_buf.stride(0), out_buf.stride(1), out_buf.stride(2), out_buf.stride(3),
            lse_buf.stride(0), lse_buf.stride(1), lse_buf.stride(2), lse_buf.stride(3),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(2), lse.stride(1),
            splits, seqlen_q, nheads, headdim,
            BLOCK_R=COMBINE_BLOCK_R, BLOCK_D=configs.padded_headdim(headdim),
            num_warps=1 if interpret else 4,
        )
    return out, lse
