"""Where the GPU architecture is chosen: launch configurations of the attention kernels.

A configuration is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``. The tables are keyed by kernel
kind, architecture family and head-dimension bucket; :func:`pick_config` looks one up. Nothing
here is tuned at run time (the kernels are compiled ahead of time), so the table *is* the tuning.

Shared memory is what limits the blocks: every entry must fit its architecture's per-block limit
(:data:`SHARED_MEMORY_LIMIT`), which ``tests/test_triton_kernels.py`` checks with
:func:`estimate_shared_memory` (and, for a few entries, with the compiler's own count).

Kinds:

* ``"fwd"``: forward; ``BLOCK_M`` query rows per program, key tiles of ``BLOCK_N``.
* ``"bwd_dkdv"``: dK/dV; ``BLOCK_N`` key rows per program, query tiles of ``BLOCK_M``.
* ``"bwd_dq"``: dQ; ``BLOCK_M`` query rows per program, key tiles of ``BLOCK_N``.

The small kernels (backward preprocess, softmax probabilities for testing) reuse the ``fwd``
blocks.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = [
    "Config",
    "HEADDIM_BUCKETS",
    "SHARED_MEMORY_LIMIT",
    "INTERPRETER_CONFIGS",
    "arch_family",
    "estimate_shared_memory",
    "padded_headdim",
    "pick",
    "pick_config",
]


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


HEADDIM_BUCKETS = (32, 64, 128, 256)
KINDS = ("fwd", "bwd_dkdv", "bwd_dq")

# Bytes of shared memory one block may use (opt-in maximum) per architecture family.
SHARED_MEMORY_LIMIT = {
    "sm80": 163 * 1024,  # A100
    "sm86": 99 * 1024,  # RTX 30xx / A10 / A40 (sm86), L4 / RTX 40xx (sm89), sm87
    "sm90": 227 * 1024,  # H100 / H200
    "sm100": 227 * 1024,  # B200 / GB200
    "sm120": 99 * 1024,  # RTX 50xx
}

_C = Config
# (kind, family) -> configs for headdim <= 32, <= 64, <= 128, <= 256.
#
# How the entries were chosen (no GPU needed): every entry fits its shared memory (the estimate
# below, and the compiler's own count), and every head-dim <= 128 entry compiles to the folded
# specialisation (IS_LOCAL + PAD_HEADDIM + IS_VARLEN) with no stack frame and no local memory on
# its architecture (``cuobjdump --dump-resource-usage``: STACK:0 LOCAL:0, checked by
# ``tests/test_aot_build.py`` on the build report), preferring the largest tiles that do; ties go
# to deeper pipelines. 8 warps everywhere: 4 warps spill with these tiles and 16 warps cap a
# thread at 128 registers. Measured with Triton 3.9 (registers, bf16 == fp16):
#
# * sm80 fwd d128: 128x64 s3 kept 16 B of stack at 255 registers -> 128x32 s3 (196).
# * sm80/sm86 bwd_dq d64: 128x64 -> 128x32 (178; 128x64 s2 and 64x64 spill).
# * sm80/sm86 bwd_dkdv d64: 32x128 s2 spilled 16 B; 16x128 s2 8 B, 32x64 s2 64 B -> 32x128 s1
#   (237; the streamed Q/dO tiles lose their second buffer, the key tile stays 128 rows).
# * sm80/sm86 bwd_dkdv d128: 32x64 s2 (40 B) -> 16x64 s2 (246).
# * sm90 fwd d128: 128x64 s3 (64 B) -> 128x64 s2 (220). sm90 bwd_dkdv d128: 16x128 (80 B) ->
#   16x64 (249).
# * sm100 bwd_dkdv d128 (tcgen05): every s2 tile with >= 64 key rows spills 270-800 B (16x128:
#   464 B); 32x64 s1 has none (214). Tiles with 32 key rows compile to mma.sync instead.
# * head dim 256 (spills allowed there; the tensor-core family is not): wgmma/tcgen05 need >= 64
#   rows per MMA tile. sm90/sm100 bwd_dq: 32x32 (mma.sync) -> 64x16 wgmma (229, no spill) on sm90
#   and 64x32 tcgen05 (128, no spill) on sm100. sm90 bwd_dkdv: 16x32 (mma.sync, 8 B) -> 16x64
#   wgmma, which keeps a 504 B stack frame (the 64x256 fp32 dK and dV accumulators are 128 registers
#   a thread on their own; 16 warps spill more). sm100 bwd_dkdv stays at 16x32 (mma.sync): with
#   64 key rows the two 64x256 fp32 accumulators fill the 512 tensor-memory columns and Triton
#   emits an empty kernel (4 registers, no MMA) instead of an error.
_TABLE: dict[tuple[str, str], tuple[Config, Config, Config, Config]] = {
    # Ampere datacenter (A100): 163 KB; mma.sync with cp.async pipelining.
    ("fwd", "sm80"): (_C(128, 64, 8, 3), _C(128, 64, 8, 3), _C(128, 32, 8, 3), _C(64, 32, 8, 2)),
    ("bwd_dkdv", "sm80"): (_C(32, 128, 8, 2), _C(32, 128, 8, 1), _C(16, 64, 8, 2), _C(16, 32, 8, 2)),
    ("bwd_dq", "sm80"): (_C(128, 64, 8, 2), _C(128, 32, 8, 2), _C(64, 64, 8, 2), _C(64, 32, 8, 2)),
    # Consumer Ampere / Ada (sm86, sm87, sm89) and, below, consumer Blackwell (sm120): 99 KB.
    ("fwd", "sm86"): (_C(128, 64, 8, 3), _C(128, 64, 8, 3), _C(128, 32, 8, 2), _C(64, 32, 8, 1)),
    ("bwd_dkdv", "sm86"): (_C(32, 128, 8, 2), _C(32, 128, 8, 1), _C(16, 64, 8, 2), _C(16, 32, 8, 2)),
    ("bwd_dq", "sm86"): (_C(128, 64, 8, 2), _C(128, 32, 8, 2), _C(64, 32, 4, 2), _C(32, 32, 4, 2)),
    # Hopper (H100/H200): 227 KB; wgmma. Larger key tiles for small head dims.
    ("fwd", "sm90"): (_C(128, 128, 8, 3), _C(128, 128, 8, 3), _C(128, 64, 8, 2), _C(64, 32, 8, 2)),
    ("bwd_dkdv", "sm90"): (_C(32, 128, 8, 2), _C(32, 128, 8, 2), _C(16, 64, 8, 2), _C(16, 64, 8, 2)),
    ("bwd_dq", "sm90"): (_C(128, 64, 8, 2), _C(128, 64, 8, 2), _C(128, 64, 8, 2), _C(64, 16, 8, 2)),
}
# Datacenter Blackwell (B200/GB200, sm100/sm103): the same shared memory as Hopper; tcgen05 MMAs.
_TABLE.update({(kind, "sm100"): _TABLE[(kind, "sm90")] for kind in KINDS})
_TABLE[("bwd_dkdv", "sm100")] = (_C(32, 128, 8, 2), _C(32, 128, 8, 2), _C(32, 64, 8, 1), _C(16, 32, 8, 2))
_TABLE[("bwd_dq", "sm100")] = (_C(128, 64, 8, 2), _C(128, 64, 8, 2), _C(128, 64, 8, 2), _C(64, 32, 8, 2))
_TABLE.update({(kind, "sm120"): _TABLE[(kind, "sm86")] for kind in KINDS})

# The score-features variant (softcap + ALiBi + dropout compiled in, each switched at run time):
# where the lean entry spills with the extra live tiles, the largest tile that does not (same rule
# and measurement as above, on the features kernels; Triton 3.9, cuobjdump STACK). ``None``: the
# lean entry is fine. Buckets: head dim <= 32 runs on the 64 kernels, 256 keeps the lean entries.
#
# * fwd: 128x128 spills on sm90 (56 B) and sm100 (536 B); 128x64 d128 too (8 B, 32 B) -> 128x32.
#   Also smaller code: the sm100 128x128 features kernel is a 2.8 MB cubin and 38 s to compile.
# * bwd_dkdv: 32x128 spills 144-608 B everywhere at d64; 16x64 s1 does not (sm80/86/100/120).
#   sm80/86 d128: 16x64 s1 sits at 255 registers and keeps 8 B of stack with Triton 3.7 -> 16x32
#   s2 (236 with 3.7, 241 with 3.9).
#   sm90 d128: every wgmma tile spills (16x64 s1 128 B, s2 48 B, 4 warps 216 B, 32x64 432 B), so
#   16x32 s2 (mma.sync, 200 registers) - the one features kernel without its arch's best MMA.
# * bwd_dq d128: 64x64 s2 / 128x64 s2 spill on sm86 (24 B with 4 warps), sm90 (208 B), sm100 (96 B),
#   sm120 (8 B) -> 64x32 8 warps everywhere (none spills).
_F = Config(128, 32, 8, 2)
_FEATURES_TABLE: dict[tuple[str, str], tuple[Optional[Config], ...]] = {
    ("bwd_dkdv", "sm80"): (None, _C(16, 64, 8, 1), _C(16, 32, 8, 2), None),
    ("bwd_dkdv", "sm86"): (None, _C(16, 64, 8, 1), _C(16, 32, 8, 2), None),
    ("bwd_dq", "sm86"): (None, None, _C(64, 32, 8, 2), None),
    ("fwd", "sm90"): (None, _F, _F, None),
    ("bwd_dkdv", "sm90"): (None, _C(16, 64, 8, 1), _C(16, 32, 8, 2), None),
    ("bwd_dq", "sm90"): (None, None, _C(64, 32, 8, 2), None),
    ("fwd", "sm100"): (None, _F, _F, None),
    ("bwd_dkdv", "sm100"): (None, _C(16, 64, 8, 1), _C(16, 64, 8, 1), None),
    ("bwd_dq", "sm100"): (None, None, _C(64, 32, 8, 2), None),  # d64: 64x32 keeps 8 B, 128x64 none
    # sm120 = sm86 (as in the lean table): a GPU running the sm_80 PTX finds the same kernels
    ("bwd_dkdv", "sm120"): (None, _C(16, 64, 8, 1), _C(16, 64, 8, 1), None),
    ("bwd_dq", "sm120"): (None, None, _C(64, 32, 8, 2), None),
}

# The interpreter runs every program one after the other on the CPU: small blocks keep the numpy
# work per tile small while still exercising several tiles per sequence (and tiles that straddle
# pages of 16 rows). BLOCK_M != BLOCK_N on purpose, so that the stage bounds are tested properly.
INTERPRETER_CONFIGS = {
    "fwd": Config(32, 16, 1, 1),
    "bwd_dkdv": Config(16, 32, 1, 1),
    "bwd_dq": Config(32, 16, 1, 1),
}


def arch_family(capability: tuple[int, int]) -> str:
    """The table family of a CUDA compute capability ``(major, minor)``."""
    major, minor = capability
    if major == 8:
        return "sm80" if minor == 0 else "sm86"
    if major == 9:
        return "sm90"
    if major in (10, 11):
        return "sm100"
    if major >= 12:
        return "sm120"
    return "sm80"  # sm75 and older are not supported by the kernels; keep a sane default


def padded_headdim(headdim: int) -> int:
    """``BLOCK_D``: the next power of two >= max(headdim, 16)."""
    return max(16, 1 << (max(headdim, 1) - 1).bit_length())


def _bucket(headdim: int) -> int:
    for i, limit in enumerate(HEADDIM_BUCKETS):
        if headdim <= limit:
            return i
    raise ValueError(f"head dimension {headdim} > {HEADDIM_BUCKETS[-1]} is not supported by the kernels")


def pick(kind: str, headdim: int, family: str, features: bool = False) -> Config:
    """Launch configuration of kernel ``kind`` for ``headdim`` on architecture ``family``
    (``"sm80"``, ..., or ``"interpret"`` for Triton's interpreter). ``features``: the
    score-features variant (softcap, ALiBi and dropout compiled in), whose extra live tiles need
    smaller blocks in places (:data:`_FEATURES_TABLE`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
    if family == "interpret":
        return INTERPRETER_CONFIGS[kind]
    key = (kind, family)
    bucket = _bucket(headdim)
    if features:
        # the score-features kernels are built from head-dim bucket 64 up (see specializations)
        bucket = max(bucket, 1)
    if features and key in _FEATURES_TABLE:
        override = _FEATURES_TABLE[key][bucket]
        if override is not None:
            return override
    return _TABLE[key][bucket]


def pick_config(kind: str, headdim: int, capability: Optional[tuple[int, int]], features: bool = False) -> Config:
    """:func:`pick` for a compute capability (``None``: Triton's interpreter)."""
    return pick(kind, headdim, "interpret" if capability is None else arch_family(capability), features)


# Blackwell's tcgen05 MMAs stage more operands (and their mbarriers) in shared memory than the
# register-operand MMAs of sm80/sm90. Measured with the compiler: ~0.5 KB more for the forward,
# up to ~22% more for the backward kernels (whose probability tiles feed two MMAs each).
_SM100_BARRIER_BYTES = 1024
_SM100_BACKWARD_FACTOR = 1.25


def estimate_shared_memory(kind: str, config: Config, headdim: int, family: str = "sm80",
                           elem_bytes: int = 2) -> int:
    """Upper estimate (bytes) of the shared memory one program of ``kind`` needs on ``family``.

    Operand tiles that stay resident are counted once, tiles streamed through the software
    pipeline ``num_stages`` times (one buffer per stage), plus one fp16/bf16 probability tile
    (``BLOCK_M x BLOCK_N``) staged for the second matmul; on sm100 a margin for tcgen05 operand
    staging. Compiled kernels use at most this (checked against the compiler's ``metadata.shared``
    for every entry when the table was made, and for a few entries in the tests); usually less.
    """
    d = padded_headdim(headdim)
    bm, bn, _, stages = config
    stages = max(stages, 1)
    if kind in ("fwd", "bwd_dq"):
        resident = bm * d * (1 if kind == "fwd" else 2)  # Q (and dO)
        streamed = 2 * bn * d  # K, V
    elif kind == "bwd_dkdv":
        resident = 2 * bn * d  # K, V
        streamed = 2 * bm * d  # Q, dO (lse, delta: negligible)
    else:
        raise ValueError(f"unknown kernel kind {kind!r}")
    estimate = elem_bytes * (resident + stages * streamed + bm * bn)
    if family == "sm100":
        estimate = estimate + _SM100_BARRIER_BYTES if kind == "fwd" else int(estimate * _SM100_BACKWARD_FACTOR)
    return estimate
