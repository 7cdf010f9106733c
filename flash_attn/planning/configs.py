"""Launch configurations of the attention kernels per GPU architecture family.

A configuration is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, with three switches where the
kernels have them: ``tma`` (tensor-descriptor loads, :func:`uses_tma`), ``ws`` (Triton's warp
specialisation of the forward, :func:`uses_ws`) and ``dq_tma`` (the fused backward's dQ by TMA
reductions, :func:`uses_dq_tma`); and the knobs Triton's AMD backend takes (``waves_per_eu``,
``matrix_instr_nonkdim``, ``kpack``: :func:`compiler_options`). The tables are keyed by kernel
kind, architecture family and head-dimension bucket; :func:`pick_config` looks one up. Nothing
here is tuned at run time (the kernels are compiled ahead of time), so the table *is* the tuning.

``num_warps`` counts warps of the family's wave size (:attr:`flash_attn.planning.families.Family.
wave_size`): 32 threads on NVIDIA and RDNA, 64 on CDNA, where ``num_warps=4`` is 256 threads
(:func:`threads`).

The families, their shared memory and whose rows a family without its own takes are declared in
:mod:`flash_attn.planning.families`; the head-dimension buckets (one entry per bucket in every row)
in :mod:`flash_attn.limits`.

Shared memory is what limits the blocks: every entry must fit its family's per-block limit
(:data:`SHARED_MEMORY_LIMIT`), which ``tests/kernels/test_triton_kernels.py`` checks with
:func:`estimate_shared_memory` (and, for a few entries, with the compiler's own count).

Kinds:

* ``"fwd"``: forward; ``BLOCK_M`` query rows per program, key tiles of ``BLOCK_N``.
* ``"bwd_dkdv"``: dK/dV; ``BLOCK_N`` key rows per program, query tiles of ``BLOCK_M``.
* ``"bwd_dq"``: dQ; ``BLOCK_M`` query rows per program, key tiles of ``BLOCK_N``.
* ``"bwd_fused"``: the fused backward (dK/dV, dQ by atomic add); ``BLOCK_N`` key rows per program,
  query tiles of ``BLOCK_M``.

The small kernels (backward preprocess, softmax probabilities for testing) reuse the ``fwd``
blocks.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

from flash_attn import limits
from flash_attn.planning import families
from flash_attn.planning.families import arch_family

__all__ = [
    "Config",
    "HEADDIM_BUCKETS",
    "FEATURE_BUCKETS",
    "FAMILY_CAPABILITY",
    "SHARED_MEMORY_LIMIT",
    "INTERPRETER_CONFIGS",
    "arch_family",
    "estimate_shared_memory",
    "compiler_options",
    "padded_headdim",
    "pick",
    "pick_config",
    "refusal",
    "threads",
]


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: Optional[bool] = None  # tensor-descriptor loads (forward, fused backward); None: uses_tma's default
    ws: bool = False  # warp specialisation (the forward on Hopper: uses_ws); implies tma
    dq_tma: bool = False  # the fused backward's dQ added by TMA bulk reductions (uses_dq_tma)
    # Triton's AMD knobs (compiler_options; the defaults are Triton's own, and NVIDIA's configs keep them):
    waves_per_eu: int = 0  # waves per SIMD the register allocation aims at (0: as many as fit)
    matrix_instr_nonkdim: int = 0  # MFMA/WMMA instruction M = N: 16 or 32 (0: Triton's choice)
    kpack: int = 1  # operand elements per LDS read of an MFMA (CDNA3: 1 or 2; later ones take 1)


class Refused(NamedTuple):
    """A head-dim bucket a family's kernels do not run, and why (the planner refuses those calls)."""

    reason: str


class WithFeatures(NamedTuple):
    """An entry of an AMD row whose score-features variant takes its own config (the features'
    extra live tiles spill in the lean one)."""

    lean: Optional[Config]
    features: Config


HEADDIM_BUCKETS = limits.HEADDIM_BUCKETS
# The score-features variant is built from head-dim bucket 64 up: smaller head dims run on the 64
# kernels exactly (run-time head-dim mask).
FEATURE_BUCKETS = tuple(b for b in HEADDIM_BUCKETS if b >= 64)
KINDS = ("fwd", "bwd_dkdv", "bwd_dq", "bwd_fused")
# the split backward's kinds: every call with deterministic=True, and the rest where the fused
# backward has no config (fused_backward)
SPLIT_BACKWARD_KINDS = ("bwd_dkdv", "bwd_dq")

# Bytes of shared memory one block may use (opt-in maximum) per architecture family.
SHARED_MEMORY_LIMIT = families.column("shared_memory")
# Each family's own compute capability: the target its images are compiled for.
FAMILY_CAPABILITY = families.column("image_capability")

_C = Config
# (kind, family) -> one config per head-dimension bucket (HEADDIM_BUCKETS: headdim <= 32, <= 64,
# <= 128, <= 256). A family without a row of its own takes its config parent's (families.lineage).
#
# The rule (measurements and the choice of each entry: benchmarks/README.md, "Launch configs"):
# fit shared memory; the architecture's tensor-core instructions; on Hopper and Blackwell no
# product computed twice (128-row tiles for 8 warps); then the largest tiles and the deepest
# pipeline. A register spill is allowed where the bigger tile is expected to be faster; the GPU
# sweep (`bench tune`) is what settles it.
#
# Head dim 512 (the last entry; read from compiles for sm_80, sm_90a, sm_100f and sm_120f, none run on
# a GPU yet: benchmarks/README.md, "Head dim 512"): no product computed twice anywhere, 16 rows a
# warp. The forward splits the output's columns over two programs (OUTPUT_COLUMNS) and spills at
# most 184 B (sm_80), none on sm_90a; the backward splits the gradients' columns over four
# (GRADIENT_COLUMNS) and still spills 0.8-2 KB a thread (its dK/dV tiles take 128 registers, whole
# rows of Q and dO or K and V feed the scores): the smallest tiles that fit, fewest spills in the
# loops of those tried.
_TABLE: dict[tuple[str, str], tuple[Optional[Config], ...]] = {
    # Ampere datacenter (A100): 163 KB; mma.sync with cp.async pipelining. Consumer Ampere / Ada
    # (sm86, sm87, sm89) and consumer Blackwell (sm120, its child): 99 KB. No product computed by
    # two warps (16 rows a warp and up: the dK/dV programs' keys, the forward's and dQ's queries),
    # FlashAttention-2's tiles or wider at head dims <= 128 (kernel_report.MMA_SYNC_FLOORS: 128 keys
    # per dK/dV program, 128 x 64 forward steps), then the fewest spills in the loops; none run on a
    # GPU yet (benchmarks/README.md, "The mma.sync families"). Where both families take one entry,
    # the sm_80 image holds one kernel for both. d256's dK/dV splits its columns over two programs
    # (SPLIT_COLUMN_FAMILIES): 128 keys on 8 warps (sm80); on 99 KB 32 on 2 warps (64 on 4 pass
    # its shared memory with 32 queries a step and compute S and dP twice with 16).
    ("fwd", "sm80"): (_C(128, 64, 8, 3), _C(128, 64, 8, 3), _C(128, 64, 8, 2), _C(64, 32, 4, 2), _C(64, 32, 4, 2)),
    ("bwd_dkdv", "sm80"): (_C(32, 128, 8, 2), _C(32, 128, 8, 1), _C(32, 128, 8, 2), _C(16, 128, 8, 1), _C(16, 32, 2, 2)),
    ("bwd_dq", "sm80"): (_C(128, 64, 8, 2), _C(128, 32, 8, 2), _C(64, 64, 8, 2), _C(32, 32, 4, 2), _C(32, 16, 2, 1)),
    ("fwd", "sm86"): (_C(128, 64, 8, 3), _C(128, 64, 8, 3), _C(128, 64, 8, 2), _C(64, 32, 4, 2), _C(32, 16, 2, 2)),
    ("bwd_dkdv", "sm86"): (_C(32, 128, 8, 2), _C(32, 128, 8, 1), _C(16, 128, 8, 2), _C(16, 32, 2, 2), _C(16, 32, 2, 1)),
    ("bwd_dq", "sm86"): (_C(128, 64, 8, 2), _C(128, 32, 8, 2), _C(64, 32, 4, 2), _C(32, 32, 4, 2), _C(32, 16, 2, 1)),
    # Hopper (H100/H200): 227 KB; wgmma. Larger key tiles for small head dims; the H200 sweep of
    # 2026-11-27 chose d64's 64 rows on one warpgroup and d256's K/V by TMA.
    ("fwd", "sm90"): (_C(128, 128, 8, 3), _C(64, 128, 4, 3), _C(128, 64, 8, 3), _C(128, 64, 8, 2, tma=True),
                       _C(128, 32, 8, 2)),
    # deterministic=True: dK/dV as the fused backward walks it (128 keys on two warpgroups, Q and
    # dO by TMA, d256's head dim split over two programs), dQ on 128-row tiles (64 replicated S)
    ("bwd_dkdv", "sm90"): (_C(32, 128, 8, 2), _C(64, 128, 8, 2), _C(64, 128, 8, 2), _C(32, 128, 8, 2), _C(16, 64, 4, 1)),
    ("bwd_dq", "sm90"): (_C(128, 64, 8, 2), _C(128, 64, 8, 2), _C(128, 64, 8, 2), _C(128, 32, 8, 2), _C(64, 16, 4, 1)),
    # The fused backward (deterministic=False). None: the split dK/dV + dQ kernels run instead
    # (benchmarks/README.md, "The fused backward"). On mma.sync (sm80, sm86, sm120) the fused
    # kernel replicates or spills KBs where the split ones do not, and neither is measured there.
    # Hopper: 128 keys per program on two warpgroups (no replicated product), 64 queries per
    # step, wgmma N >= 64 on the main products; it spills (d128: ~0.8 KB), which the sweep weighs.
    # d128 in three stages (the H200 sweep). d256 splits the head dim over two programs
    # (GRADIENT_COLUMNS): 32 queries a step in two stages is the tile whose operands still fit the
    # 227 KB of shared memory; its dQ shares added by TMA reductions (the H200 sweep).
    # mma.sync (unmeasured, chosen from the compiled kernels): on sm80 at d128, 128 keys on 8 warps
    # walking 16 queries a step (FlashAttention-2's design: 5 products a step against the split
    # kernels' 7, none replicated, its spills outside the loop); at d32/d64 its dQ^T product (head
    # dim x queries) is replicated on 8 warps and at d256 its operands pass 163 KB; on 99 KB (sm86,
    # sm120) its 64-key tile on 4 warps spills 1.5 KB (128 keys do not fit): the split kernels there.
    ("bwd_fused", "sm80"): (None, None, _C(16, 128, 8, 2), None, None),
    ("bwd_fused", "sm86"): (None, None, None, None, None),
    # Head dim 512: the split kernels. The fused kernel (16 x 64 on 4 warps, its columns split over
    # four programs) ran on an H200 on 2026-11-30 with dQ wrong (fp16, causal, sinks: max error
    # 1.24) and an illegal address (448/320), where the split kernels matched the oracle
    # (benchmarks/README.md, "Issue 42: the first GPU window of the new call path").
    ("bwd_fused", "sm90"): (_C(64, 128, 8, 2), _C(128, 128, 8, 2), _C(64, 128, 8, 3), _C(32, 128, 8, 2, dq_tma=True),
                             None),
    # Datacenter Blackwell (B200/GB200, sm100/sm103): the same shared memory as Hopper; tcgen05
    # MMAs. Its forward is Hopper's (its parent's) until a Blackwell GPU measures its own.
    ("bwd_dkdv", "sm100"): (_C(32, 128, 8, 2), _C(32, 128, 8, 2), _C(32, 64, 8, 1), _C(16, 32, 8, 2), _C(16, 64, 4, 1)),
    ("bwd_dq", "sm100"): (_C(128, 64, 8, 2), _C(128, 64, 8, 2), _C(128, 64, 8, 2), _C(64, 32, 8, 2), _C(64, 16, 4, 1)),
    # Blackwell's fused backward (tcgen05, unmeasured: no Blackwell GPU has run it): tensor memory
    # (512 fp32 columns) holds dK, dV, S, dP and dQ, so d128 takes 32 queries a step to keep two
    # stages (64 x 128 fits one stage and spills 163 instructions in its loop; 32 x 128 s2: 3); d256
    # fits with its gradient columns split over two programs (dK and dV 128 columns each), Hopper's tile.
    # Head dim 512: the split kernels, as on Hopper, whose fused kernel of the same design failed
    # on an H200 (cause not found; nothing shows it Hopper's alone).
    ("bwd_fused", "sm100"): (_C(64, 128, 8, 2), _C(64, 128, 8, 2), _C(32, 128, 8, 2), _C(32, 128, 8, 2), None),
}

# AMD (ROCm PyTorch, Triton's JIT; families.py: CDNA's MFMA on 64-thread waves, RDNA's WMMA on 32).
# One row per head-dim bucket: (fwd, bwd_dkdv, bwd_dq, bwd_fused) as in _TABLE, or Refused(why)
# for a bucket the family's kernels cannot run; a family without rows takes its config parent's.
# A bucket added to limits.HEADDIM_BUCKETS is one row per family here (checked at import).
#
# The rule (no AMD GPU has measured them: chosen from the compiled kernels, the static report of
# `python -m flash_attn amd-kernels`, benchmarks/README.md "AMD"): every product on the matrix
# instructions and the LDS within the workgroup's limit; on CDNA no scratch at head dims <= 128,
# on RDNA the least scratch any tile reaches; then at least two waves per SIMD (waves_per_eu=2)
# where the registers allow it; then the largest tiles.
#
# Head dim 512 (issue 44; the sweep in benchmarks/README.md "AMD", head dim 512): NVIDIA's design,
# the forward's output columns over two programs (OUTPUT_COLUMNS) and the backward's gradient
# columns over four (gradient_columns). On CDNA3 a 128-row forward or a 128-key dK/dV tile takes
# 128 KB of LDS (64 KB allowed), 32 rows on 4 waves repeat products: 64 x 16 with no scratch at two
# waves per SIMD, the backward on 16 x 64 (dK/dV, fused) and 64 x 16 (dQ), none with scratch (MI350's
# 160 KB would hold 128 x 32, at one wave per SIMD: its parent's row). RDNA's WMMA keeps 16 rows
# a wave and dQ's 16 x 512 fp32 accumulator alone takes 256 registers of a 32-lane wave: every tile
# spills; the least scratch tried (RDNA3 ~1.9 / 2.5 / 5.0 KB forward / dK/dV / dQ, RDNA4 52 B /
# 472 B / 1.4 KB).
_A, _WF = Config, WithFeatures
_AMD: dict[str, dict[int, object]] = {
    # MI300 (gfx942; MI350, gfx950, its child): 4 waves of 64 = 256 threads per program; fused
    # backward (native fp32 atomics), 128 keys per dK/dV program up to d128. Each entry the
    # largest tile without scratch (and at two waves per SIMD where one exists): d128's forward
    # 128x64 keeps 80 B of scratch at two waves, so 128x32. With the score features, the d64
    # forward keeps 792 B (at two waves; 28 B on gfx950 with 128x32), d128 1.2 KB; d128's dQ 480 B.
    "cdna3": {
        32: (_A(128, 64, 4, 2, waves_per_eu=2), _A(32, 128, 4, 1), _A(128, 32, 4, 1), _A(16, 128, 4, 1)),
        64: (_WF(_A(128, 64, 4, 2, waves_per_eu=2), _A(128, 32, 4, 2)), _A(32, 128, 4, 1), _A(128, 32, 4, 1),
             _A(16, 128, 4, 1)),
        128: (_WF(_A(128, 32, 4, 2, waves_per_eu=2), _A(128, 32, 4, 2)), _A(16, 128, 4, 1),
              _WF(_A(128, 64, 4, 1), _A(128, 32, 4, 1)), _A(16, 128, 4, 1)),
        256: (_A(128, 32, 4, 2), _A(16, 64, 4, 1), _A(64, 32, 4, 1), _A(16, 128, 4, 1)),
        512: (_A(64, 16, 4, 2), _A(16, 64, 4, 1), _A(64, 16, 4, 1), _A(16, 64, 4, 1)),
    },
    # RX 7000 (gfx1100/1101): 32-thread waves, WMMA on 16-row tiles per wave, whose operands take
    # twice the registers of RDNA4's: the backward spills with every tile (the least the sweep
    # found: d64 dK/dV 88 B, dQ 304 B; d128 forward 204 B, dK/dV 912 B, dQ 780 B). Its float
    # atomics are compare-and-swap loops: the split backward, no fused one.
    "rdna3": {
        32: (_A(128, 32, 8, 2), _A(16, 128, 8, 1), _A(128, 32, 8, 1), None),
        64: (_WF(_A(128, 32, 8, 2), _A(128, 16, 8, 2)), _A(16, 128, 8, 1), _A(128, 32, 8, 1), None),
        128: (_A(64, 16, 4, 2), _A(16, 128, 8, 1), _A(128, 16, 8, 1), None),
        256: (_A(64, 16, 4, 2), _A(16, 64, 4, 1), _A(64, 16, 4, 1), None),
        512: (_A(64, 16, 8, 1), _A(16, 32, 8, 1), _A(64, 16, 8, 1), None),
    },
    # RX 9000 (gfx1201/1200): none of its lean images spills up to d64; d128's dK/dV keeps 276 B.
    # Native float atomics, but the fused backward spills where the split kernels do not.
    "rdna4": {
        32: (_A(128, 64, 8, 2), _A(16, 128, 8, 1), _A(128, 32, 8, 1), None),
        64: (_WF(_A(128, 64, 8, 2), _A(128, 32, 8, 2)), _A(16, 128, 8, 1), _A(128, 32, 8, 1), None),
        128: (_A(128, 32, 8, 2), _A(16, 128, 8, 1), _A(128, 16, 8, 1), None),
        256: (_A(64, 32, 4, 2), _A(16, 64, 4, 1), _A(64, 16, 4, 1), None),
        512: (_A(32, 16, 4, 1), _A(16, 32, 8, 1), _A(64, 16, 8, 1), None),
    },
}


def _amd_rows(rows_by_family: dict) -> tuple[dict, dict, dict]:
    """``(table rows, features rows, refused buckets)`` of the bucket-major AMD rows: ``(kind,
    family) -> one entry per bucket`` for :data:`_TABLE` and :data:`_FEATURES_TABLE` (``None``: the
    lean entry), ``(family, bucket) -> reason`` for :func:`refusal`."""
    table: dict = {}
    features: dict = {}
    refused: dict = {}
    for family, rows in rows_by_family.items():
        if set(rows) != set(HEADDIM_BUCKETS):
            raise ValueError(f"AMD launch configs of {family}: rows for head-dim buckets {sorted(rows)}; one per "
                             f"head-dim bucket {HEADDIM_BUCKETS} expected (a config tuple or Refused(why))")
        for bucket, row in rows.items():
            if isinstance(row, Refused):
                refused[(family, bucket)] = row.reason
            elif len(row) != len(KINDS):
                raise ValueError(f"AMD launch configs of {family}, head dim {bucket}: {len(row)} entries; one per "
                                 f"kind {KINDS} expected")
        for i, kind in enumerate(KINDS):
            entries = [None if isinstance(rows[b], Refused) else rows[b][i] for b in HEADDIM_BUCKETS]
            table[(kind, family)] = tuple(e.lean if isinstance(e, WithFeatures) else e for e in entries)
            if any(isinstance(e, WithFeatures) for e in entries):
                features[(kind, family)] = tuple(e.features if isinstance(e, WithFeatures) else None for e in entries)
    return table, features, refused


_AMD_TABLE, _AMD_FEATURES, _REFUSED = _amd_rows(_AMD)
_TABLE.update(_AMD_TABLE)

# The score-features variant (softcap + ALiBi + dropout compiled in, each switched at run time):
# where the lean entry spills with the extra live tiles, the largest tile that does not (same rule;
# benchmarks/README.md). ``None``: the lean entry; the entry of head dims <= 32 is unused (they run
# on the 64 kernels: FEATURE_BUCKETS). A family without a row takes its config parent's.
_F = Config(128, 64, 8, 2)
_FEATURES_TABLE: dict[tuple[str, str], tuple[Optional[Config], ...]] = {
    # mma.sync: 128 keys on 8 warps, 16 queries a step (d64: 238 registers with Triton 3.9, where
    # 16 x 64 on 8 warps spilled 8 B with 3.7 and computed S twice; d128 in one stage: the lean
    # 32 x 128 keeps 2 KB of stack with the features' tiles, 16 x 128 in two stages 376 B and 43
    # spill instructions in its loop, in one 88 B and none); sm86's dQ on 128 rows in one stage (64 x 32 computed its
    # 64 rows twice on 8 warps and keeps 16 B of stack on 4)
    ("bwd_dkdv", "sm80"): (None, _C(16, 128, 8, 1), _C(16, 128, 8, 1), None, None),
    ("bwd_dkdv", "sm86"): (None, _C(16, 128, 8, 1), _C(16, 128, 8, 1), None, None),
    ("bwd_dq", "sm86"): (None, None, _C(128, 32, 8, 1), None, None),
    ("bwd_fused", "sm80"): (None, None, _C(16, 128, 8, 1), None, None),  # s2 spills 223 instructions in its loop
    ("fwd", "sm90"): (None, _F, _F, None, None),
    ("bwd_dkdv", "sm90"): (None, None, _C(32, 128, 8, 2), None, None),
    ("bwd_dq", "sm90"): (None, None, _C(128, 32, 8, 2), None, None),
    # d128: the lean 64x128 keeps ~1.1 KB of stack and ~1,250 spill instructions in its loop with
    # the features' live tiles; 32 queries a step in two stages: 0.4 KB and 85
    # d64: the lean 128x128 (the sweep's) keeps 1.6 KB of stack and ~1,600 spill instructions in
    # its loop with the features' tiles; 64x128 (the lean entry before the sweep) 344 B and 64
    ("bwd_fused", "sm90"): (None, _C(64, 128, 8, 2), _C(32, 128, 8, 2), None, None),
    # 128x32: compiles 30-40 % faster than 128x64, and at d256 128x64 keeps 56 B of stack, 128x32 none
    ("fwd", "sm100"): (None, _C(128, 32, 8, 2), _C(128, 32, 8, 2), _C(128, 32, 8, 2), None),
    ("bwd_dkdv", "sm100"): (None, _C(16, 64, 8, 1), _C(16, 64, 8, 1), None, None),
    ("bwd_dq", "sm100"): (None, None, _C(64, 32, 8, 2), None, None),  # d64: 64x32 keeps 8 B, 128x64 none
    # with the features' tiles, spill instructions in the loop: d64 the lean 64x128 80, 32x128 6;
    # d256 the lean 32x128 90, 16x128 s3 none
    ("bwd_fused", "sm100"): (None, _C(32, 128, 8, 2), None, _C(16, 128, 8, 3), None),
}
_FEATURES_TABLE.update(_AMD_FEATURES)  # AMD: in its rows above (WithFeatures)

# The exact-call images (full attention, head dim = BLOCK_D; declarations.EXACT_IMAGE_*) carry
# their own tile where the sweep measured one faster for them than the lean entry, which serves
# causal and windowed calls too; ``None``: the lean entry. Chosen by the sweep's full-attention rows
# (`bench tune --tune-step fold`; benchmarks/README.md, "Exact-call configs"). A family without a
# row takes its config parent's.
_EXACT_TABLE: dict[tuple[str, str], tuple[Optional[Config], ...]] = {
    ("fwd", "sm90"): (None, _C(128, 64, 8, 3), None, None, None),
    ("bwd_fused", "sm90"): (None, None, None, _C(32, 128, 8, 2), None),
    # Blackwell ships no exact-call images (declarations.EXACT_IMAGE_FAMILIES) and no GPU has
    # measured them: its JIT runs exact calls on its lean tiles, not Hopper's exact ones
    ("fwd", "sm100"): (None, None, None, None, None),
    ("bwd_fused", "sm100"): (None, None, None, None, None),
}

# The mma.sync entries (kind, family, head-dim bucket, variant) whose spills in the inner loops
# beyond kernel_report.MAX_LOOP_SPILL_BYTES a GPU measured faster than a tile that spills less:
# only these may ship such spills (tests/aot/test_mma_sync_floors.py). None: no GPU has run them.
SPILLS_MEASURED: frozenset = frozenset()

# The interpreter runs every program one after the other on the CPU: small blocks keep the numpy
# work per tile small while still exercising several tiles per sequence (and tiles that straddle
# pages of 16 rows). BLOCK_M != BLOCK_N on purpose, so that the stage bounds are tested properly.
INTERPRETER_CONFIGS = {
    "fwd": Config(32, 16, 1, 1),
    "bwd_dkdv": Config(16, 32, 1, 1),
    "bwd_dq": Config(32, 16, 1, 1),
    "bwd_fused": Config(16, 32, 1, 1),
}


def _check_rows(*tables: dict) -> None:
    """Every row has one entry per head-dimension bucket (a bucket added or removed cannot shift
    the entries of a row silently)."""
    for table in tables:
        for key, row in table.items():
            if len(row) != len(HEADDIM_BUCKETS):
                raise ValueError(f"launch-config row {key} has {len(row)} entries; one per head-dim bucket "
                                 f"{HEADDIM_BUCKETS} expected")


_check_rows(_TABLE, _FEATURES_TABLE, _EXACT_TABLE)


def refusal(headdim: int, family: str) -> Optional[str]:
    """Why ``family``'s kernels do not run ``headdim`` (its bucket's row is :class:`Refused`), else
    ``None``; looked up along the config parents like the rows."""
    bucket = HEADDIM_BUCKETS[_bucket(headdim)]
    for name in families.lineage(family):
        if (name, bucket) in _REFUSED:
            return _REFUSED[(name, bucket)]
        if name in _AMD:
            return None  # the family's own rows decide
    return None


def threads(config: Config, family: str) -> int:
    """Threads of one program of ``config`` on ``family``: ``num_warps`` times its wave size (32,
    or 64 on CDNA); the interpreter's: 32 per warp."""
    family_record = families.FAMILIES.get(family)
    return config.num_warps * (family_record.wave_size if family_record is not None else 32)


_AMD_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")


def compiler_options(config: Config, family: str) -> dict:
    """The options Triton compiles a launch of ``config`` with on ``family``: ``num_warps`` and
    ``num_stages`` everywhere, and on AMD families the knobs of its backend (``waves_per_eu``,
    ``matrix_instr_nonkdim``, ``kpack``), which the NVIDIA backend does not accept."""
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    family_record = families.FAMILIES.get(family)
    if family_record is not None and family_record.vendor == "amd":
        options.update((name, getattr(config, name)) for name in _AMD_OPTIONS)
    return options


def padded_headdim(headdim: int) -> int:
    """``BLOCK_D``: the next power of two >= max(headdim, 16)."""
    return max(16, 1 << (max(headdim, 1) - 1).bit_length())


def _bucket(headdim: int) -> int:
    for i, limit in enumerate(HEADDIM_BUCKETS):
        if headdim <= limit:
            return i
    raise ValueError(f"head dimension {headdim} > {HEADDIM_BUCKETS[-1]} is not supported by the kernels")


def pick(kind: str, headdim: int, family: str, features: bool = False, exact: bool = False) -> Optional[Config]:
    """Launch configuration of kernel ``kind`` for ``headdim`` on architecture ``family``
    (``"sm80"``, ..., or ``"interpret"`` for Triton's interpreter). ``features``: the
    score-features variant (softcap, ALiBi and dropout compiled in), whose extra live tiles need
    smaller blocks in places (:data:`_FEATURES_TABLE`). ``exact``: the exact-call image (full
    attention, head dim = ``BLOCK_D``; :data:`_EXACT_TABLE`). ``None`` only for ``"bwd_fused"``
    where the split backward kernels run instead (:func:`fused_backward`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
    if features and exact:
        raise ValueError("the score-features variant has no exact-call image")
    bucket = _bucket(headdim)
    if _overrides:
        key = (kind, family, HEADDIM_BUCKETS[bucket], _variant(features, exact))
        if key in _overrides:
            return _overrides[key]
    if family == "interpret":
        return INTERPRETER_CONFIGS[kind]
    if features:
        bucket = max(bucket, _bucket(FEATURE_BUCKETS[0]))
    why = refusal(HEADDIM_BUCKETS[bucket], family)
    if why is not None:
        raise ValueError(f"head dim {headdim} on {family}: {why}")
    special = _FEATURES_TABLE if features else _EXACT_TABLE if exact else None
    if special is not None:
        entry = _row(special, kind, family)[bucket]
        if entry is not None:
            return entry
    row = _row(_TABLE, kind, family)
    if row is _NO_ROW:
        raise KeyError(f"no {kind} launch configs for family {family!r} (nor for its config parents)")
    return row[bucket]


_NO_ROW = (None,) * len(HEADDIM_BUCKETS)


def _row(table: dict, kind: str, family: str) -> tuple:
    """The row of ``kind`` on ``family`` in ``table``: its own, else its nearest config parent's
    (:func:`flash_attn.planning.families.lineage`), else :data:`_NO_ROW`."""
    for name in families.lineage(family):
        row = table.get((kind, name))
        if row is not None:
            return row
    return _NO_ROW


VARIANTS = ("lean", "features", "exact")


def _variant(features: bool, exact: bool) -> str:
    return "features" if features else "exact" if exact else "lean"


_overrides: dict = {}


@contextlib.contextmanager
def overridden(entries: dict):
    """Within the block, :func:`pick` answers ``entries[(kind, family, head-dim bucket, variant)]``
    (a config, or ``None`` for ``"bwd_fused"``: the split kernels) for those keys (``variant``: one
    of :data:`VARIANTS`): how the tuning
    sweep (:mod:`flash_attn.bench.tune`) runs a candidate through the real planner. Backends
    cache plans: forget them on entry and exit (``KernelBackend.forget_plans``). Not thread-safe."""
    saved = dict(_overrides)
    _overrides.update(entries)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def fused_backward(headdim: int, family: str, features: bool = False, exact: bool = False) -> Optional[Config]:
    """The fused backward's config, or ``None`` where the split kernels serve
    ``deterministic=False`` calls too."""
    return pick("bwd_fused", headdim, family, features, exact)


# deterministic=True through the fused backward, FlashAttention-2's way: each program walks several
# key blocks in turn and adds dQ into sums of its own (one Q-shaped fp32 buffer per split), which
# the convert kernel adds up in a fixed order: five products per tile pair, against the split
# kernels' seven. At most this many splits per family (memory: splits x dQ in fp32); where the
# splits cannot keep every SM busy (few batch x kv heads) or the family is absent, the split
# kernels run (they spread over key blocks and query blocks alike).
DETERMINISTIC_SPLITS = {"sm90": 8, "sm100": 8, "interpret": 8}


def deterministic_splits(family: str) -> int:
    """The most splits of the fused backward for ``deterministic=True`` on ``family`` (0: the split
    kernels serve it); :func:`overridden` with the key ``("deterministic_splits", family)``."""
    return _overrides.get(("deterministic_splits", family), DETERMINISTIC_SPLITS.get(family, 0))


# The gradient columns per dK/dV program: at head dim 256 two programs share a key block, each
# recomputing the scores and dP over all 256 columns (seven half-width products per tile pair
# instead of five) so that its half of dK/dV fits in registers (benchmarks/README.md). Split where
# the wider of q's and v's head dims exceeds GRADIENT_COLUMNS, into parts of GRADIENT_COLUMNS, q's
# and v's columns alike (at 512 four programs, each computing the scores and dP from whole rows:
# with two, their dK and dV tiles alone take 256 registers a thread and spilled 2-3 KB; the build
# report). Where: the fused backward everywhere, the deterministic dK/dV kernel on the families
# listed (Hopper; the mma.sync families, whose 128 or 64 keys a program keep no d256 rows in
# registers; Blackwell keeps whole rows on its small tiles, as measured before the split existed)
# and everywhere beyond WHOLE_ROWS columns.
GRADIENT_COLUMNS = 128
SPLIT_COLUMN_FAMILIES = {"bwd_dkdv": frozenset({"sm90", "sm80", "sm86"})}  # and who takes their rows
WHOLE_ROWS = 256


def gradient_parts(kind: str, family: str, block_d: int, block_dv: Optional[int] = None) -> int:
    """The programs one key block's dK/dV columns are split over (1, 2 or 4) in the dK/dV program
    sized by ``kind`` on ``family`` for ``BLOCK_D`` (q/k) and ``BLOCK_DV`` (v; default ``BLOCK_D``)."""
    widest = max(block_d, block_d if block_dv is None else block_dv)
    # the family whose row sizes the program decides (its tiles were chosen for its split)
    owner = next((name for name in families.lineage(family) if (kind, name) in _TABLE), family)
    splits = kind == "bwd_fused" or owner in SPLIT_COLUMN_FAMILIES.get(kind, ()) or widest > WHOLE_ROWS
    return widest // GRADIENT_COLUMNS if splits and widest > GRADIENT_COLUMNS else 1


def gradient_columns(kind: str, family: str, block_d: int, block_dv: Optional[int] = None) -> int:
    """``BLOCK_DOUT`` (q/k's gradient columns per program; v's are ``BLOCK_DV`` over as many parts)
    of the dK/dV program sized by ``kind`` on ``family``."""
    return block_d // gradient_parts(kind, family, block_d, block_dv)


# The forward's output (v) columns per program: beyond this, two programs share a query block, each
# computing the scores in full and half of the output. An output tile of BLOCK_M x 512 fp32 takes
# 256 registers a thread wherever no warp repeats another's scores (each warp's 16 rows and up), so
# head dim 512 would spill its accumulator at every key tile; the split recomputes the scores
# instead (1.5x the products, none replicated).
OUTPUT_COLUMNS = 256


def output_columns(block_dv: int) -> int:
    """``BLOCK_DVOUT`` of the forward: the output columns one program computes."""
    return min(block_dv, OUTPUT_COLUMNS)


# Where a kernel streams its tiles through tensor descriptors (the tensor memory accelerator, TMA)
# unless its config says otherwise (Config.tma: a measured exception, or a sweep candidate). The
# fused backward's Q and dO on Hopper: dropping the address arithmetic halves its loop's register
# spills (benchmarks/README.md); the interpreter runs the Hopper kernels' path. The forward's K
# and V: nowhere by default (it spills only at d256, 8-48 B; the sweep times its "-tma" candidates).
TMA_FAMILIES = {"bwd_fused": frozenset({"sm90", "interpret"}), "bwd_dkdv": frozenset({"sm90"}), "fwd": frozenset()}


def uses_tma(kind: str, family: str, config: Optional[Config] = None) -> bool:
    """``TMA`` of the kernel sized by ``kind`` on ``family`` with ``config``."""
    if uses_ws(kind, family, config):
        return True
    if config is not None and config.tma is not None:
        return config.tma
    return family in TMA_FAMILIES.get(kind, ())


# Where a config may ask Triton to warp-specialise the kernel's key loop (Config.ws): a producer
# warpgroup streams K/V by TMA while consumer warpgroups (BLOCK_M / 64 of them, num_warps each
# besides the producer's) compute, as FlashAttention-3 does. Triton 3.9 does it for the forward
# (one loop, descriptor loads only) on Hopper and, with its own partitions around tcgen05 and
# tensor memory, on Blackwell; the interpreter runs the same single-loop code.
WS_FAMILIES = {"fwd": frozenset({"sm90", "sm100", "interpret"})}


def uses_ws(kind: str, family: str, config: Optional[Config] = None) -> bool:
    """``WS`` of the kernel sized by ``kind`` on ``family`` with ``config``."""
    return bool(config is not None and config.ws and family in WS_FAMILIES.get(kind, ()))


# Where a config may have the fused backward add its dQ share by TMA bulk reductions
# (``cp.reduce.async.bulk.tensor``: the tile staged in shared memory, one instruction per tile)
# instead of per-element atomics from registers, as FlashAttention-3 does: Hopper (sm_90a: d128
# exact loop spills 62 -> 12, d64 38 -> 3; benchmarks/README.md), and the interpreter, which runs
# it through a stand-in reduction (flash_attn/backends/_interpreter.py). A sweep candidate.
DQ_TMA_FAMILIES = {"bwd_fused": frozenset({"sm90", "interpret"})}


def uses_dq_tma(kind: str, family: str, config: Optional[Config] = None) -> bool:
    """``TMA_DQ`` of the kernel sized by ``kind`` on ``family`` with ``config``."""
    return bool(config is not None and config.dq_tma and family in DQ_TMA_FAMILIES.get(kind, ()))


def pick_config(kind: str, headdim: int, capability: Optional[tuple[int, int]], features: bool = False,
                exact: bool = False) -> Config:
    """:func:`pick` for a compute capability (``None``: Triton's interpreter)."""
    return pick(kind, headdim, "interpret" if capability is None else arch_family(capability), features, exact)


# Blackwell's tcgen05 MMAs (families.MMA_KINDS) stage more operands (and their mbarriers) in shared memory than the
# register-operand MMAs of sm80/sm90. Measured with the compiler: ~0.5 KB more for the forward,
# up to ~22% more for the backward kernels (whose probability tiles feed two MMAs each).
_TCGEN05_BARRIER_BYTES = 1024
_TCGEN05_BACKWARD_FACTOR = 1.25
# The fused backward, whose probability tiles tcgen05 can read from tensor memory: at most 7 % over
# the count above in its shipped sm100 images (d128 32x128 s2: 123,216 B against 115,200; d256
# 32x128 s2: 188,776 against 214,016)
_TCGEN05_FUSED_BACKWARD_FACTOR = 1.08
# the barriers of a warp-specialised forward's buffer ring (measured: 384-576 B on sm90)
_WS_BARRIER_BYTES = 1024
# the barriers of the forward's K/V stages by TMA (measured: 32 B on sm90, d256 in two stages)
_TMA_BARRIER_BYTES = 1024


def estimate_shared_memory(kind: str, config: Config, headdim: int, family: str = "sm80",
                           elem_bytes: int = 2, headdim_v: Optional[int] = None) -> int:
    """Upper estimate (bytes) of the shared memory one program of ``kind`` needs on ``family`` (q/k
    of ``headdim``, v of ``headdim_v``, default the same).

    Operand tiles that stay resident are counted once, tiles streamed through the software
    pipeline ``num_stages`` times (one buffer per stage), plus one fp16/bf16 probability tile
    (``BLOCK_M x BLOCK_N``) staged for the second matmul (two in the fused backward: dS^T too, for
    dQ); on tcgen05 families (sm100) a margin for its operand staging. The forward as the compiler
    builds it: on mma.sync one buffer fewer (the pipeline's last stage is read into registers, at
    least one buffer), on wgmma and tcgen05 no probability tile (it feeds the second product from
    registers or tensor memory) but the barriers of K/V by TMA. Compiled kernels use at most this
    (checked against the compiler's ``metadata.shared`` for every entry when the table was made,
    and for a few entries in the tests); usually less.
    """
    d = padded_headdim(headdim)
    dv = d if headdim_v is None else padded_headdim(headdim_v)
    bm, bn, stages = config.block_m, config.block_n, max(config.num_stages, 1)
    row_stats = 0
    mma = families.mma(family)
    if kind == "fwd":
        resident = bm * d  # Q
        streamed = bn * (d + output_columns(dv))  # K, this program's columns of V
        if mma == "mma.sync":
            stages = max(stages - 1, 1)
    elif kind == "bwd_dq":
        resident = bm * (d + dv)  # Q, dO
        streamed = bn * (d + dv)  # K, V
    elif kind in ("bwd_dkdv", "bwd_fused"):
        resident = bn * (d + dv)  # K, V (with the head dim split, as two halves: the same bytes)
        streamed = bm * (d + dv)  # Q, dO
        row_stats = 2 * 4 * bm  # bytes: the fp32 lse and delta of the streamed rows
    else:
        raise ValueError(f"unknown kernel kind {kind!r}")
    staged = bm * bn * (2 if kind == "bwd_fused" else 1)  # the fused backward also stages dS^T for dQ
    if kind == "fwd" and mma in ("wgmma", "tcgen05"):
        staged = _TMA_BARRIER_BYTES // elem_bytes if uses_tma(kind, family, config) else 0
    if uses_dq_tma(kind, family, config):
        staged += bm * gradient_columns(kind, family, d, dv) * 4 // elem_bytes  # the fp32 dQ tile for TMA
    if uses_ws(kind, family, config):
        # warp-specialised: P stays in registers; Triton adds half a Q tile of at least 128
        # columns and its barriers (measured with the compiler for every "-ws" sweep candidate)
        staged = bm // 2 * max(d, 128) + _WS_BARRIER_BYTES // elem_bytes
    estimate = elem_bytes * (resident + stages * streamed + staged) + stages * row_stats
    if mma == "tcgen05":
        if kind == "fwd":
            return estimate + _TCGEN05_BARRIER_BYTES
        return int(estimate * (_TCGEN05_FUSED_BACKWARD_FACTOR if kind == "bwd_fused" else _TCGEN05_BACKWARD_FACTOR))
    return estimate
