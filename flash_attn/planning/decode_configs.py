"""Launch configurations of the KV-cache (decode) kernels and the ahead-of-time set of their
*superset* variants: which ``(kernel, constexprs, launch config)`` combinations exist.

Pure Python (no torch, no triton import), like :mod:`flash_attn.planning.configs`.

A compiled specialisation fixes every ``tl.constexpr``; the planner's ahead-of-time target
(:func:`flash_attn.planning.plan.plan_kvcache`) uses only the combinations below, each *exact* for
every call it serves (only dead work differs):

``split_kv_kernel``      :data:`SPLIT_KV_SUPERSET`: the window (``-1`` = unbounded), softcap
                         (``softcap > 0``), ALiBi (``use_alibi``) and left padding
                         (``use_leftpad``) are switched at run time; a plain cache
                         ``(b_cache, s, hk, d)`` is addressed as pages of ``s`` rows, page
                         ``cache_batch_idx[b]`` (a ``(b, 1)`` table) or page ``b``
                         (``identity_table``); ``BLOCK_M``/``BLOCK_N`` both configs of
                         :data:`DECODE_CONFIGS`; ``BLOCK_D`` the head-dim bucket 64/128/256
                         (loads and stores mask the run-time head dim).
                         On families that ship exact-call images, also :data:`SPLIT_KV_EXACT`
                         for the plain decoding step (the decode config of each bucket).
``append_kv_kernel``     paged the same way, ``(HAS_ROTARY, INTERLEAVED)`` as the call needs
                         (without rotary ``split_kv_kernel`` appends up to
                         :data:`FUSED_APPEND_ROWS` rows itself; this one the others).
``rotary_q_kernel``      ``PER_ROW_POSITION`` x ``INTERLEAVED`` as the call needs.
``combine_splits_kernel`` as it is.

Rotary tables are passed as fp32 (exact; the kernels compute in fp32), so every pointer type is a
function of the q/k/v dtype alone. Caches are written in place and cannot be copied into the
layout the images assume (16-byte aligned, strides multiples of 8 elements): the planner refuses
others, and the dispatcher falls back, before anything runs.
"""

from __future__ import annotations

import itertools

from flash_attn import limits
from flash_attn.planning import configs, declarations, families

__all__ = [
    "DECODE_CONFIGS",
    "APPEND_BLOCK_T",
    "FUSED_APPEND_ROWS",
    "FUSED_APPEND_VENDORS",
    "fuses_append",
    "COMBINE_BLOCK_R",
    "MAX_SPLITS",
    "SPLIT_PROGRAMS_PER_SM",
    "MIN_BLOCKS_PER_SPLIT",
    "INTERPRET_NUM_SMS",
    "AUX_CONFIG",
    "ROTARY_CONFIG",
    "COMBINE_CONFIG",
    "FAMILIES",
    "HEADDIM_BUCKETS",
    "bucket_configs",
    "SPLIT_KV_SUPERSET",
    "SPLIT_KV_EXACT",
    "ships_exact",
    "APPEND_ROTARY",
    "headdim_bucket",
    "decode_config",
    "superset_block_d",
    "split_kv_constexprs",
    "append_constexprs",
    "rotary_q_constexprs",
    "combine_constexprs",
    "aot_variants",
]

Config = configs.Config  # (block_m, block_n, num_warps, num_stages)

# ----------------------------------------------------------------------------------------------
# Launch configurations
# ----------------------------------------------------------------------------------------------

_C = Config
# (arch family, largest head dim of the bucket) -> (decode config, many-rows config); a family
# without rows of its own takes its config parent's (flash_attn.planning.families). The first
# is used when the packed query rows ``seqlen_q * nheads / nheads_k`` fit its BLOCK_M of 16 (one
# MMA tile: decoding, also with GQA groups up to 16), the second otherwise (speculative decoding,
# prefill against a cache). Decoding is bound by reading K/V: wide key blocks keep many loads in
# flight. Every entry was compiled for its architecture (worst-case flags: paged, local, ALiBi,
# softcap, leftpad, i.e. the superset variant, fp16 and bf16; sm86 entries for the sm_80 image that
# those GPUs run) and fits its shared memory without register spills (cuobjdump STACK:0; Triton
# 3.9), but sm120's head-dim-128 decode tile, whose superset image keeps 8 bytes of stack outside
# its loop (128 registers) since the attention kernel appends new rows itself. The sm86
# head-dim-64 many-rows tile uses 8 warps: with 4 warps the superset variant kept 24 bytes of
# stack in the sm_80 image (255 registers); with 8 it needs 189.
DECODE_CONFIGS: dict[tuple[str, int], tuple[Config, Config]] = {
    # A100: 163 KB shared memory, mma.sync + cp.async
    ("sm80", 64): (_C(16, 128, 4, 3), _C(64, 128, 8, 3)),
    ("sm80", 128): (_C(16, 64, 4, 3), _C(32, 64, 4, 3)),
    ("sm80", 256): (_C(16, 64, 8, 2), _C(32, 64, 8, 2)),
    ("sm80", 512): (_C(16, 16, 4, 2), _C(32, 32, 8, 2)),
    # consumer Ampere / Ada (sm86/87/89) and consumer Blackwell (sm120, its parent): 99 KB
    ("sm86", 64): (_C(16, 128, 4, 2), _C(64, 64, 8, 2)),
    ("sm86", 128): (_C(16, 64, 4, 2), _C(32, 64, 4, 2)),
    ("sm86", 256): (_C(16, 32, 4, 2), _C(32, 32, 4, 2)),
    ("sm86", 512): (_C(16, 16, 4, 2), _C(32, 16, 8, 2)),
    # H100/H200 and B200 (sm100, its parent): 227 KB; BLOCK_M = 16 rows use mma.sync, 64-row tiles wgmma on sm90
    ("sm90", 64): (_C(16, 128, 4, 4), _C(64, 128, 8, 4)),
    ("sm90", 128): (_C(16, 128, 4, 3), _C(64, 64, 8, 3)),
    ("sm90", 256): (_C(16, 64, 8, 2), _C(32, 64, 8, 2)),
    ("sm90", 512): (_C(16, 32, 8, 2), _C(32, 32, 8, 2)),
    # AMD (Triton's JIT; configs.py's AMD rule): CDNA (MI300, and MI350 its child) on 64-thread
    # waves, where 4 warps are 256 threads; RDNA (RX 7000, and RX 9000 its child) on 32-thread waves
    ("cdna3", 64): (_C(16, 128, 4, 2), _C(64, 64, 4, 2)),
    ("cdna3", 128): (_C(16, 64, 4, 2), _C(64, 64, 4, 2)),
    ("cdna3", 256): (_C(16, 64, 4, 1), _C(32, 32, 4, 1)),
    # d512: no scratch on CDNA (many rows: 64 x 16, no product repeated); RDNA's least (~0.7 / 0.9 KB)
    ("cdna3", 512): (_C(16, 64, 4, 1), _C(64, 16, 4, 1)),
    ("rdna3", 64): (_C(16, 64, 4, 2), _C(64, 32, 4, 2)),
    ("rdna3", 128): (_C(16, 64, 4, 2), _C(32, 32, 4, 2)),
    ("rdna3", 256): (_C(16, 32, 4, 1), _C(32, 32, 4, 1)),
    ("rdna3", 512): (_C(16, 16, 4, 1), _C(32, 16, 4, 1)),
    # Triton's interpreter: small key blocks so that the tests cross several blocks and pages
    ("interpret", 64): (_C(16, 32, 1, 1), _C(64, 32, 1, 1)),
    ("interpret", 128): (_C(16, 32, 1, 1), _C(64, 32, 1, 1)),
    ("interpret", 256): (_C(16, 16, 1, 1), _C(32, 16, 1, 1)),
    ("interpret", 512): (_C(16, 16, 1, 1), _C(32, 16, 1, 1)),
}

# The most new rows split_kv_kernel appends itself (a call without rotary; more: append_kv_kernel
# first): decoding's one token, speculative decoding's few, copied as one tile (its BLOCK_NEW).
FUSED_APPEND_ROWS = 16
# Where split_kv_kernel appends them: its programs read their own copies after a CTA barrier, which
# orders global memory on NVIDIA GPUs (PTX bar.sync); how Triton lowers it for AMD GPUs (s_barrier,
# with or without a wait for the stores) is not established, so they run the append kernel first.
# The interpreter runs programs one after another.
FUSED_APPEND_VENDORS = ("nvidia",)
# Rows per program of the append / rotary kernels and of the combine kernel.
APPEND_BLOCK_T = 16
COMBINE_BLOCK_R = 16
# Launch configs of those small kernels (they have no BLOCK_M/BLOCK_N: the block fields are 0).
# The append/rotary kernels have no loop, so there is nothing to pipeline; the combine loops over
# the splits and keeps Triton's default 3 stages. Append and rotary q run 16 warps: with 4 or 8,
# ptxas 13.0 spills a register pair in some variants (e.g. the fp16 GPT-NeoX append at 48
# registers on sm_90a); with 16, none of them on sm_80/90a/100a/120a, fp16 or bf16, any bucket.
AUX_CONFIG = Config(0, 0, 16, 1)
ROTARY_CONFIG = Config(0, 0, 16, 1)
COMBINE_CONFIG = Config(0, 0, 4, 3)
# Most splits the heuristic picks (the combine reads every split of every row).
MAX_SPLITS = 128
# The split heuristic (flash_attn.planning.plan.choose_num_splits) aims at this many programs per
# SM (the d128 decode kernel's occupancy on sm_90a) with at least MIN_BLOCKS_PER_SPLIT key blocks
# per split: the best split counts measured on an H100 (benchmarks/README.md, "Decode").
SPLIT_PROGRAMS_PER_SM = 2
MIN_BLOCKS_PER_SPLIT = 8
# SM count assumed in Triton's interpreter (an A100's), so that the heuristic is exercised.
INTERPRET_NUM_SMS = 108

# Every GPU family runs the decode kernels (a mapping: iterating it gives the family names).
FAMILIES = families.FAMILIES
# The decode kernels are built from head-dim bucket 64 up: their BLOCK_M of 16 packed query rows
# is one MMA tile, and smaller head dims run on the 64 kernels exactly (run-time head-dim mask).
HEADDIM_BUCKETS = tuple(b for b in limits.HEADDIM_BUCKETS if b >= 64)
# The buckets of the shipped superset images (within the build's budget: head dim 512 decodes on
# the JIT, but MLA's 64/512 with qv, QV_FAMILIES).
IMAGE_BUCKETS = tuple(b for b in HEADDIM_BUCKETS if b <= 256)


def headdim_bucket(head_dim: int) -> int:
    """The :data:`DECODE_CONFIGS` bucket of ``head_dim`` (the smallest bucket holding it)."""
    for bucket in HEADDIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head dim {head_dim} > {HEADDIM_BUCKETS[-1]} is not supported by the decode kernels")


def bucket_configs(family: str, bucket: int) -> tuple[Config, Config]:
    """``(decode config, many-rows config)`` of head-dim ``bucket`` on ``family`` (:data:`FAMILIES`
    or ``"interpret"``): its own row, else its config parent's."""
    for name in families.lineage(family):
        row = DECODE_CONFIGS.get((name, bucket))
        if row is not None:
            return row
    raise KeyError(f"no decode configs for family {family!r} (nor for its config parents) at head dim {bucket}")


def decode_config(family: str, head_dim: int, packed_rows: int, fp32: bool = False) -> Config:
    """Launch configuration of ``split_kv_kernel`` on ``family`` for ``seqlen_q * group = packed_rows``.

    ``family``: a GPU family of :data:`FAMILIES` or ``"interpret"``. float32 inputs (never in
    superset mode) take the FMA path with tiles twice as big in bytes: key blocks of at most 32
    (16 for head dim 256), at most 32 rows, no software pipelining (a rare case; it is correct
    but may spill registers).
    """
    bucket = headdim_bucket(head_dim)
    small, large = bucket_configs(family, bucket)
    config = small if packed_rows <= small.block_m else large
    if fp32 and family != "interpret":
        block_m = min(config.block_m, 32)
        block_n = min(config.block_n, 32 if bucket <= 128 else 16)
        config = Config(block_m, block_n, 8 if block_m > 16 else 4, 1)
    return config


# ----------------------------------------------------------------------------------------------
# The constexprs of each launch (the launcher builds its flags with these, in both modes)
# ----------------------------------------------------------------------------------------------

# superset mode: every feature compiled in and switched at run time (see the module doc); attention
# sinks are a run-time switch of every variant
SPLIT_KV_SUPERSET = dict(IS_LOCAL=True, HAS_SOFTCAP=True, HAS_ALIBI=True, PAGED=True, HAS_BATCH_IDX=False,
                         HAS_LEFTPAD=True, HAS_QV=False)
# The exact-call image of the plain decoding step: a contiguous cache (no block table, no
# cache_batch_idx) read without the paged addressing's divisions, and no window (causal with one
# query row masks nothing), softcap, ALiBi or left padding. Shipped for the decode config (packed
# rows <= its BLOCK_M) of each head-dim bucket, where the attention kernels' exact images ship.
SPLIT_KV_EXACT = dict(IS_LOCAL=False, HAS_SOFTCAP=False, HAS_ALIBI=False, PAGED=False, HAS_BATCH_IDX=False,
                      HAS_LEFTPAD=False, HAS_QV=False)
# MLA decoding as FlashAttention-3 spells it: q/k of head dim 64 (the rotary part) and qv/v of 512
# (the absorbed queries against the latent cache), the superset variant with HAS_QV; where it ships
# (family -> bool, a family not listed takes its nearest listed config parent's answer:
# declarations.listed): Hopper, where MLA models are served (other qv calls run on the JIT), and the
# interpreter's superset target (the tests run Hopper's launches there).
QV_HEAD_DIMS = (64, 512)
QV_FAMILIES = {"sm90": True, "sm100": False, "interpret": True}
# (HAS_ROTARY, INTERLEAVED) of append_kv_kernel: no rotary, GPT-NeoX halves, GPT-J pairs
APPEND_ROTARY = ((False, False), (True, False), (True, True))


def superset_block_d(head_dim: int) -> int:
    """``BLOCK_D`` of a superset launch: the head-dim bucket (64, 128, 256 or 512)."""
    return headdim_bucket(head_dim)


def ships_qv(family: str) -> bool:
    """Whether ``family``'s images hold the MLA decode kernel (``qv``, :data:`QV_HEAD_DIMS`)."""
    return declarations.listed(family, QV_FAMILIES)


def superset_refusal(family: str, head_dim: int, head_dim_v: int, qv: bool) -> str | None:
    """Why no shipped superset image serves a KV-cache call of these head dims (with ``qv``), or ``None``."""
    pair = (superset_block_d(head_dim), superset_block_d(head_dim_v))
    if qv:
        if pair == QV_HEAD_DIMS and ships_qv(family):
            return None
        shipping = ", ".join(name for name, ships in QV_FAMILIES.items() if ships and name in FAMILIES)
        return (f"qv with head dims {head_dim}/{head_dim_v} on {family} (MLA's absorbed queries are compiled ahead of "
                f"time for {QV_HEAD_DIMS[0]}/{QV_HEAD_DIMS[1]} on {shipping})")
    if max(pair) not in IMAGE_BUCKETS:
        return f"head dimension {max(head_dim, head_dim_v)} in the KV-cache call (compiled ahead of time up to {IMAGE_BUCKETS[-1]})"
    return None


def block_dims(head_dim: int, head_dim_v: int, superset: bool, qv: bool = False) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_DV)`` of the decode kernels for q/k's and v's head dims: each padded to a
    power of two >= 16 (JIT); in superset mode the bucket of the wider one for both (the narrower
    one's columns masked at run time), but for ``qv`` calls the MLA image's own pair."""
    if not superset:
        return configs.padded_headdim(head_dim), configs.padded_headdim(head_dim_v)
    if qv:
        return superset_block_d(head_dim), superset_block_d(head_dim_v)
    widest = superset_block_d(max(head_dim, head_dim_v))
    return widest, widest


def split_kv_constexprs(config: Config, block_d: int, features: dict, block_dv: int | None = None) -> dict:
    """Every constexpr of ``split_kv_kernel``: the tile sizes (``block_dv``: v's head-dim block,
    default ``block_d``; ``BLOCK_NEW``: :data:`FUSED_APPEND_ROWS`) and the feature flags
    ``features`` (``IS_LOCAL``, ``HAS_SOFTCAP``, ``HAS_ALIBI``, ``PAGED``, ``HAS_BATCH_IDX``,
    ``HAS_LEFTPAD``, ``HAS_QV``)."""
    return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
                BLOCK_DV=block_d if block_dv is None else block_dv, BLOCK_NEW=FUSED_APPEND_ROWS, **features)


def append_constexprs(block_d: int, paged: bool, batch_idx: bool, rotary: bool, interleaved: bool,
                      block_dv: int | None = None) -> dict:
    """Every constexpr of ``append_kv_kernel`` (``INTERLEAVED`` only counts with rotary)."""
    return dict(BLOCK_T=APPEND_BLOCK_T, BLOCK_D=block_d, BLOCK_DV=block_d if block_dv is None else block_dv,
                PAGED=paged, HAS_BATCH_IDX=batch_idx, HAS_ROTARY=rotary, INTERLEAVED=rotary and interleaved)


def rotary_q_constexprs(block_d: int, per_row_position: bool, interleaved: bool) -> dict:
    """Every constexpr of ``rotary_q_kernel``."""
    return dict(BLOCK_T=APPEND_BLOCK_T, BLOCK_D=block_d, PER_ROW_POSITION=per_row_position,
                INTERLEAVED=interleaved)


def combine_constexprs(block_d: int) -> dict:
    """Every constexpr of ``combine_splits_kernel``."""
    return dict(BLOCK_R=COMBINE_BLOCK_R, BLOCK_D=block_d)


def fuses_append(family: str) -> bool:
    """Whether ``split_kv_kernel`` appends a call's new rows itself on ``family`` (a GPU family or
    ``"interpret"``): :data:`FUSED_APPEND_VENDORS`."""
    return family == "interpret" or families.get(family).vendor in FUSED_APPEND_VENDORS


def ships_exact(family: str) -> bool:
    """Whether ``family``'s images include :data:`SPLIT_KV_EXACT` (where the attention kernels'
    exact-call images ship: :data:`flash_attn.planning.declarations.EXACT_IMAGE_FAMILIES`)."""
    return declarations.listed(family, declarations.EXACT_IMAGE_FAMILIES)


def aot_variants(family: str, buckets: tuple = IMAGE_BUCKETS) -> list[tuple[str, dict, Config]]:
    """Every ``(kernel name, constexprs, launch config)`` that superset mode launches on GPU
    architecture family ``family`` (:data:`FAMILIES`) for an fp16 or bf16 call (the list is the
    same for both dtypes, which are a separate axis), for the head-dim ``buckets`` (default: those
    of the shipped images; a JIT's report takes every bucket). No duplicates."""
    if family not in FAMILIES:
        raise ValueError(f"unknown architecture family {family!r}; expected one of {tuple(FAMILIES)}")
    out: list[tuple[str, dict, Config]] = []
    for bucket in buckets:
        for config in dict.fromkeys(bucket_configs(family, bucket)):  # decode, many-rows (deduplicated)
            out.append(("split_kv_kernel", split_kv_constexprs(config, bucket, SPLIT_KV_SUPERSET), config))
        if ships_exact(family):
            config = bucket_configs(family, bucket)[0]
            out.append(("split_kv_kernel", split_kv_constexprs(config, bucket, SPLIT_KV_EXACT), config))
        for rotary, interleaved in APPEND_ROTARY:
            out.append(("append_kv_kernel", append_constexprs(bucket, True, False, rotary, interleaved), AUX_CONFIG))
        for per_row, interleaved in itertools.product((False, True), repeat=2):
            out.append(("rotary_q_kernel", rotary_q_constexprs(bucket, per_row, interleaved), ROTARY_CONFIG))
        out.append(("combine_splits_kernel", combine_constexprs(bucket), COMBINE_CONFIG))
    if ships_qv(family):
        d, dv = QV_HEAD_DIMS
        for config in dict.fromkeys(bucket_configs(family, dv)):
            features = dict(SPLIT_KV_SUPERSET, HAS_QV=True)
            out.append(("split_kv_kernel", split_kv_constexprs(config, d, features, dv), config))
        for rotary, interleaved in APPEND_ROTARY:
            out.append(("append_kv_kernel", append_constexprs(d, True, False, rotary, interleaved, dv), AUX_CONFIG))
        out.append(("combine_splits_kernel", combine_constexprs(dv), COMBINE_CONFIG))
    return out
