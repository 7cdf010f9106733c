"""Launch configurations of the KV-cache (decode) kernels and the ahead-of-time set of their
*superset mode*: which ``(kernel, constexprs, launch config)`` combinations exist, and the
argument types and alignments an ahead-of-time build may declare for them.

Pure Python (no torch, no triton import), like :mod:`flash_attn.kernels.configs`, so that the set
is unit-tested, and read by the build and the ``aot`` backend, anywhere.

Superset mode (``decode_launch.forward_kvcache(..., superset=True)``)
--------------------------------------------------------------------
A compiled specialisation fixes every ``tl.constexpr``. In superset mode the launcher uses only
the combinations below, each of which is *exact* for every call it serves (it computes what the
call's own specialisation computes; only dead work differs):

``split_kv_kernel``      :data:`SPLIT_KV_SUPERSET`:

    ``IS_LOCAL=True``        the window bounds are run-time ints with ``-1`` = unbounded; the tile
                             ranges (``decode._key_block_range``) and the element mask
                             (``masking.visible_at``) treat ``-1`` exactly as the non-local
                             variant does, so non-causal, causal and sliding windows all run here.
    ``HAS_SOFTCAP=True``     switched at run time by ``softcap > 0`` with selects on that uniform
                             scalar (``masking.logits_log2``), no run-time branch around tiles.
    ``HAS_ALIBI=True``       calls without ALiBi pass zero slopes (``torch.zeros(nheads)``, fp32):
                             a zero slope adds exactly 0.
    ``PAGED=True``           a non-paged cache ``(b_cache, s, hk, d)`` is addressed as pages of
                             ``page_size = s`` rows with the block table ``cache_batch_idx`` (or
                             ``arange(b)``) as an int32 ``(b, 1)`` tensor: page ``table[b, 0]``,
                             row ``r % s = r`` is the very same element.
    ``HAS_BATCH_IDX=False``  (folded into the block table above).
    ``HAS_LEFTPAD=True``     zeros when the call has no ``cache_leftpad``.
    ``ONE_PASS=True``        one masked loop over the split's key blocks (the same values as the
                             masked / interior / masked stages; a third of the code and compile
                             time: the 4-architecture build stays inside its 10 minutes).
    ``BLOCK_M``/``BLOCK_N``  both configs of :data:`DECODE_CONFIGS` for the family and bucket
                             (the decode one and the many-rows one), with their warps/stages.
    ``BLOCK_D``              the head-dim bucket: 64, 128 or 256 (:func:`superset_block_d`). Every
                             load and store masks ``offs_d < head_dim`` with the run-time head
                             dim, so a smaller head dim is exact on a wider tile (zero features add
                             nothing to ``q.k``; padded output columns are never stored):
                             head dims 8..64 -> 64, 72..128 -> 128, 136..256 -> 256.

``append_kv_kernel``     ``PAGED=True`` (the same page trick), ``HAS_BATCH_IDX=False``,
                         ``(HAS_ROTARY, INTERLEAVED)`` as the call needs: :data:`APPEND_ROTARY`
                         (3 combinations; ``INTERLEAVED`` is meaningless without rotary and
                         always ``False`` then).
``rotary_q_kernel``      ``PER_ROW_POSITION`` x ``INTERLEAVED`` as the call needs (4).
``combine_splits_kernel`` as it is (``BLOCK_R``, ``BLOCK_D``).

The rotary tables are passed as fp32 (an fp16/bf16 table converts exactly; the kernels compute
in fp32 anyway), so every pointer type is a function of the q/k/v dtype alone
(:func:`aot_arg_types`). Inputs are fp16 or bf16 (fp32 decoding stays on Triton's JIT or the
reference) and head dims are multiples of 8 (:data:`HEADDIM_DIVISOR`, declared to the compiler
so that the masked K/V loads stay 16-byte vector loads).

Per family that is ``len(HEADDIM_BUCKETS) * (split configs + 3 + 4 + 1)`` specialisations per
dtype: 30 on every family (:func:`aot_variants`), for each of fp16 and bf16.

Alignment contract (what :func:`aot_divisibility` declares, and why it holds)
----------------------------------------------------------------------------
Every pointer argument is 16-byte aligned: inputs go through ``launch.ready`` (a copy only when
they are not), outputs, scratch and placeholders are fresh allocations. The caches are written in
place and cannot be copied: a cache that is not 16-byte aligned, or whose strides (but the last)
are not multiples of 8 elements, is refused with :class:`DecodeLayoutUnsupported` before anything
runs. Integer arguments declared divisible by 8 are the head dim and the strides of tensors
whose strides are multiples of 8 elements by construction (q, k_new, v_new, the caches, out, the
fp32 partial output, the rotated q); the strides of lse (``(b, h, sq)``), of the block table (a
``(b, 1)`` table has stride 1), of the ALiBi slopes and rotary tables, and sizes such as
``page_size`` or ``seqlen_q`` are declared nothing.
"""

from __future__ import annotations

import itertools
from typing import Optional

from flash_attn.kernels import configs, registry

__all__ = [
    "DECODE_CONFIGS",
    "APPEND_BLOCK_T",
    "COMBINE_BLOCK_R",
    "MAX_SPLITS",
    "INTERPRET_NUM_SMS",
    "AUX_CONFIG",
    "ROTARY_CONFIG",
    "COMBINE_CONFIG",
    "FAMILIES",
    "HEADDIM_BUCKETS",
    "HEADDIM_DIVISOR",
    "SUPERSET_DTYPES",
    "SPLIT_KV_SUPERSET",
    "APPEND_ROTARY",
    "DecodeLayoutUnsupported",
    "headdim_bucket",
    "decode_config",
    "superset_block_d",
    "split_kv_constexprs",
    "append_constexprs",
    "rotary_q_constexprs",
    "combine_constexprs",
    "aot_variants",
    "aot_arg_types",
    "aot_divisibility",
    "aot_signature",
    "superset_refusal",
]

Config = configs.Config  # (block_m, block_n, num_warps, num_stages)

# ----------------------------------------------------------------------------------------------
# Launch configurations
# ----------------------------------------------------------------------------------------------

_C = Config
# (arch family, largest head dim of the bucket) -> (decode config, many-rows config). The first
# is used when the packed query rows ``seqlen_q * nheads / nheads_k`` fit its BLOCK_M of 16 (one
# MMA tile: decoding, also with GQA groups up to 16), the second otherwise (speculative decoding,
# prefill against a cache). Decoding is bound by reading K/V: wide key blocks keep many loads in
# flight. Every entry was compiled for its architecture (worst-case flags: paged, local, ALiBi,
# softcap, leftpad, i.e. the superset variant, fp16 and bf16; sm86 entries for the sm_80 image that
# those GPUs run) and fits its shared memory without register spills (cuobjdump STACK:0; Triton
# 3.9). The sm86 head-dim-64 many-rows tile uses 8 warps: with 4 warps the superset variant kept
# 24 bytes of stack in the sm_80 image (255 registers); with 8 it needs 189.
DECODE_CONFIGS: dict[tuple[str, int], tuple[Config, Config]] = {
    # A100: 163 KB shared memory, mma.sync + cp.async
    ("sm80", 64): (_C(16, 128, 4, 3), _C(64, 128, 8, 3)),
    ("sm80", 128): (_C(16, 64, 4, 3), _C(32, 64, 4, 3)),
    ("sm80", 256): (_C(16, 64, 8, 2), _C(32, 64, 8, 2)),
    # consumer Ampere / Ada (sm86/87/89) and consumer Blackwell (sm120): 99 KB
    ("sm86", 64): (_C(16, 128, 4, 2), _C(64, 64, 8, 2)),
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
# Launch configs of those small kernels (they have no BLOCK_M/BLOCK_N: the block fields are 0).
# The append/rotary kernels have no loop, so there is nothing to pipeline; the combine loops over
# the splits and keeps Triton's default 3 stages, what it always ran with.
AUX_CONFIG = Config(0, 0, 4, 1)
# rotary_q with 4 warps keeps 8 bytes of stack on sm_100a (fp16, d128, per-row positions, GPT-NeoX
# halves); 8 warps have none on any architecture
ROTARY_CONFIG = Config(0, 0, 8, 1)
COMBINE_CONFIG = Config(0, 0, 4, 3)
# Most splits the heuristic picks (the combine reads every split of every row).
MAX_SPLITS = 128
# SM count assumed in Triton's interpreter (an A100's), so that the heuristic is exercised.
INTERPRET_NUM_SMS = 108

FAMILIES = ("sm80", "sm86", "sm90", "sm100", "sm120")
HEADDIM_BUCKETS = (64, 128, 256)


def headdim_bucket(head_dim: int) -> int:
    """The :data:`DECODE_CONFIGS` bucket of ``head_dim`` (the smallest bucket holding it)."""
    for bucket in HEADDIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head dim {head_dim} > {HEADDIM_BUCKETS[-1]} is not supported by the decode kernels")


def decode_config(family: str, head_dim: int, packed_rows: int, fp32: bool = False) -> Config:
    """Launch configuration of ``split_kv_kernel`` on ``family`` for ``seqlen_q * group = packed_rows``.

    ``family``: a GPU family of :data:`FAMILIES` or ``"interpret"``. float32 inputs (never in
    superset mode) take the FMA path with tiles twice as big in bytes: key blocks of at most 32
    (16 for head dim 256), at most 32 rows, no software pipelining (a rare case; it is correct
    but may spill registers).
    """
    bucket = headdim_bucket(head_dim)
    small, large = DECODE_CONFIGS[(family, bucket)]
    config = small if packed_rows <= small.block_m else large
    if fp32 and family != "interpret":
        block_m = min(config.block_m, 32)
        block_n = min(config.block_n, 32 if bucket <= 128 else 16)
        config = Config(block_m, block_n, 8 if block_m > 16 else 4, 1)
    return config


# ----------------------------------------------------------------------------------------------
# The constexprs of each launch (the launcher builds its flags with these, in both modes)
# ----------------------------------------------------------------------------------------------

# superset mode: every feature compiled in and switched at run time (see the module doc)
SPLIT_KV_SUPERSET = dict(IS_LOCAL=True, HAS_SOFTCAP=True, HAS_ALIBI=True, PAGED=True, HAS_BATCH_IDX=False,
                         HAS_LEFTPAD=True, ONE_PASS=True)
# (HAS_ROTARY, INTERLEAVED) of append_kv_kernel: no rotary, GPT-NeoX halves, GPT-J pairs
APPEND_ROTARY = ((False, False), (True, False), (True, True))
SUPERSET_DTYPES = ("fp16", "bf16")
HEADDIM_DIVISOR = 8


class DecodeLayoutUnsupported(RuntimeError):
    """Superset mode cannot run this call exactly with its fixed specialisations (a cache that is
    misaligned or has strides that are not multiples of 8 elements, a head dim that is not a
    multiple of 8, fp32 inputs). Raised before anything is launched (the cache is untouched);
    the ``aot`` backend falls back to another backend."""


def superset_block_d(head_dim: int) -> int:
    """``BLOCK_D`` of a superset launch: the head-dim bucket (64, 128 or 256)."""
    return headdim_bucket(head_dim)


def split_kv_constexprs(config: Config, block_d: int, features: dict) -> dict:
    """Every constexpr of ``split_kv_kernel``: the tile sizes and the feature flags ``features``
    (``IS_LOCAL``, ``HAS_SOFTCAP``, ``HAS_ALIBI``, ``PAGED``, ``HAS_BATCH_IDX``, ``HAS_LEFTPAD``)."""
    return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d, **features)


def append_constexprs(block_d: int, paged: bool, batch_idx: bool, rotary: bool, interleaved: bool) -> dict:
    """Every constexpr of ``append_kv_kernel`` (``INTERLEAVED`` only counts with rotary)."""
    return dict(BLOCK_T=APPEND_BLOCK_T, BLOCK_D=block_d, PAGED=paged, HAS_BATCH_IDX=batch_idx,
                HAS_ROTARY=rotary, INTERLEAVED=rotary and interleaved)


def rotary_q_constexprs(block_d: int, per_row_position: bool, interleaved: bool) -> dict:
    """Every constexpr of ``rotary_q_kernel``."""
    return dict(BLOCK_T=APPEND_BLOCK_T, BLOCK_D=block_d, PER_ROW_POSITION=per_row_position,
                INTERLEAVED=interleaved)


def combine_constexprs(block_d: int) -> dict:
    """Every constexpr of ``combine_splits_kernel``."""
    return dict(BLOCK_R=COMBINE_BLOCK_R, BLOCK_D=block_d)


def aot_variants(family: str) -> list[tuple[str, dict, Config]]:
    """Every ``(kernel name, constexprs, launch config)`` that superset mode launches on GPU
    architecture family ``family`` (:data:`FAMILIES`) for an fp16 or bf16 call (the list is the
    same for both dtypes, which are a separate axis). No duplicates."""
    if family not in FAMILIES:
        raise ValueError(f"unknown architecture family {family!r}; expected one of {FAMILIES}")
    out: list[tuple[str, dict, Config]] = []
    for bucket in HEADDIM_BUCKETS:
        for config in dict.fromkeys(DECODE_CONFIGS[(family, bucket)]):  # decode, many-rows (deduplicated)
            out.append(("split_kv_kernel", split_kv_constexprs(config, bucket, SPLIT_KV_SUPERSET), config))
        for rotary, interleaved in APPEND_ROTARY:
            out.append(("append_kv_kernel", append_constexprs(bucket, True, False, rotary, interleaved), AUX_CONFIG))
        for per_row, interleaved in itertools.product((False, True), repeat=2):
            out.append(("rotary_q_kernel", rotary_q_constexprs(bucket, per_row, interleaved), ROTARY_CONFIG))
        out.append(("combine_splits_kernel", combine_constexprs(bucket), COMBINE_CONFIG))
    return out


# ----------------------------------------------------------------------------------------------
# The runtime arguments: Triton signature types and declared divisibility
# ----------------------------------------------------------------------------------------------

# Per kernel, (type, names) in signature order; "*dt" is the q/k/v element type (fp16 / bf16).
# Sizes, strides and window bounds are i32 (the aot backend range-checks them), scalars fp32.
_ARG_TYPES: dict[str, tuple[tuple[str, str], ...]] = {
    "split_kv_kernel": (
        ("*dt", "Q K V Out"),
        ("*fp32", "OutPart Lse"),
        ("*i32", "Seqlens Leftpad BatchIdx BlockTable"),
        ("*fp32", "Alibi"),
        ("i32", "stride_qb stride_qt stride_qh stride_kb stride_kt stride_kh stride_vb stride_vt stride_vh "
                "stride_ob stride_ot stride_oh stride_ps stride_pb stride_pt stride_ph "
                "stride_ls stride_lb stride_lt stride_lh stride_btb stride_ab "
                "nheads_k seqlen_q seqlen_new group head_dim page_size"),
        ("fp32", "softmax_scale softcap"),
        ("i32", "window_left window_right"),
        ("fp32", "empty_lse"),
    ),
    "combine_splits_kernel": (
        ("*fp32", "OutPart LsePart"),
        ("*dt", "Out"),
        ("*fp32", "Lse"),
        ("i32", "stride_ps stride_pb stride_pt stride_ph stride_qs stride_qb stride_qt stride_qh "
                "stride_ob stride_ot stride_oh stride_lb stride_lt stride_lh num_splits seqlen_q nheads head_dim"),
    ),
    "append_kv_kernel": (
        ("*dt", "K_new V_new K_cache V_cache"),
        ("*fp32", "Cos Sin"),
        ("*i32", "Seqlens BatchIdx BlockTable"),
        ("i32", "stride_knb stride_knt stride_knh stride_vnb stride_vnt stride_vnh "
                "stride_kcb stride_kct stride_kch stride_vcb stride_vct stride_vch stride_btb stride_ro "
                "nheads_k seqlen_new head_dim rotary_half page_size"),
    ),
    "rotary_q_kernel": (
        ("*dt", "Q Q_out"),
        ("*fp32", "Cos Sin"),
        ("*i32", "Seqlens"),
        ("i32", "stride_qb stride_qt stride_qh stride_ob stride_ot stride_oh stride_ro "
                "nheads seqlen_q head_dim rotary_half"),
    ),
}

# Integer arguments the launcher guarantees to be multiples of 8 in superset mode (see the module
# doc): the head dim (refused otherwise) and the strides of tensors laid out with strides that are
# multiples of 8 elements (inputs through ``launch.ready``, fresh outputs, checked caches).
_DIVISIBLE_BY_8: dict[str, str] = {
    "split_kv_kernel": "stride_qb stride_qt stride_qh stride_kb stride_kt stride_kh stride_vb stride_vt stride_vh "
                       "stride_ob stride_ot stride_oh stride_ps stride_pb stride_pt stride_ph head_dim",
    "combine_splits_kernel": "stride_ps stride_pb stride_pt stride_ph stride_ob stride_ot stride_oh head_dim",
    "append_kv_kernel": "stride_knb stride_knt stride_knh stride_vnb stride_vnt stride_vnh "
                        "stride_kcb stride_kct stride_kch stride_vcb stride_vct stride_vch head_dim",
    "rotary_q_kernel": "stride_qb stride_qt stride_qh stride_ob stride_ot stride_oh head_dim",
}


def _kernel_entry(table: dict, kernel: str):
    try:
        return table[kernel]
    except KeyError:
        raise KeyError(f"{kernel!r} is not a decode kernel; expected one of {sorted(table)}") from None


def aot_arg_types(kernel: str, dtype: str) -> dict[str, str]:
    """Triton signature type of every runtime argument of ``kernel`` (name -> ``"*fp16"``,
    ``"*bf16"``, ``"*fp32"``, ``"*i32"``, ``"i32"`` or ``"fp32"``) for q/k/v of ``dtype``
    (``"fp16"`` or ``"bf16"``), in signature order."""
    if dtype not in SUPERSET_DTYPES:
        raise ValueError(f"decode kernels are compiled for {SUPERSET_DTYPES}, not {dtype!r}")
    out = {}
    for ty, names in _kernel_entry(_ARG_TYPES, kernel):
        for name in names.split():
            out[name] = "*" + dtype if ty == "*dt" else ty
    order = registry.arg_names(kernel)
    return {name: out[name] for name in sorted(out, key=order.index)}


def aot_divisibility(kernel: str) -> dict[str, int]:
    """Declared divisibility (``tt.divisibility``) per runtime argument: 16 (bytes) for every
    pointer, 8 for the integers listed in ``_DIVISIBLE_BY_8``; arguments not listed: none."""
    out = {name: 16 for name, ty in aot_arg_types(kernel, SUPERSET_DTYPES[0]).items() if ty.startswith("*")}
    out.update({name: 8 for name in _kernel_entry(_DIVISIBLE_BY_8, kernel).split()})
    return out


def aot_signature(kernel: str, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    """``(signature, attrs)`` for ``triton.compile(ASTSource(fn, signature, constexprs, attrs))``
    of one variant of :func:`aot_variants`: constexprs as ``"constexpr"``, the rest typed by
    :func:`aot_arg_types`, with :func:`aot_divisibility` as ``tt.divisibility`` attributes."""
    types = aot_arg_types(kernel, dtype)
    divisible = aot_divisibility(kernel)
    signature: dict = {}
    attrs: dict = {}
    for index, name in enumerate(registry.arg_names(kernel)):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types[name]
        if name in divisible:
            attrs[(index,)] = [["tt.divisibility", divisible[name]]]
    return signature, attrs


def superset_refusal(dtype: str, head_dim: int, caches: dict) -> Optional[str]:
    """Why superset mode cannot run a call exactly, or ``None``.

    ``dtype``: ``"fp16"``/``"bf16"``/other; ``caches``: name -> ``(data_ptr, shape, strides)`` of
    the caches, which are written in place and so cannot be copied into an aligned layout. A
    stride of a size-1 dimension never matters (the launcher passes 0 for it).
    """
    if dtype not in SUPERSET_DTYPES:
        return f"{dtype} inputs (the decode kernels are compiled for fp16/bf16)"
    if head_dim % HEADDIM_DIVISOR or head_dim > HEADDIM_BUCKETS[-1]:
        return f"head dimension {head_dim} (compiled for a multiple of {HEADDIM_DIVISOR} up to {HEADDIM_BUCKETS[-1]})"
    for name, (data_ptr, shape, strides) in caches.items():
        if data_ptr % 16:
            return f"{name} is not 16-byte aligned (data_ptr % 16 = {data_ptr % 16})"
        if strides[-1] != 1 and shape[-1] > 1:
            return f"{name} has a non-contiguous last dimension (strides {tuple(strides)})"
        if any(s % HEADDIM_DIVISOR for n, s in zip(shape[:-1], strides[:-1]) if n > 1):
            return f"{name} has strides {tuple(strides)}, not multiples of {HEADDIM_DIVISOR} elements"
    return None
