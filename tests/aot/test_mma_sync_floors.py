"""The static floors of the mma.sync families (A100: sm80; RTX 30/40, A10/A40, L4/L40S: sm86; RTX
50: sm120) on every training image their devices run at head dims <= 128: forward, deterministic
dK/dV and dQ, fused backward; lean and score-features variants.

Held (:func:`flash_attn.kernel_build.kernel_report.mma_sync_misses`): no product computed by two
warps, every main product on mma.sync, the family's FlashAttention-2 tile or wider
(``kernel_report.MMA_SYNC_FLOORS``), at most ``MAX_LOOP_SPILL_BYTES`` of spill traffic a thread in
the inner loops unless a GPU measured the entry (``configs.SPILLS_MEASURED``, empty). The sm80
and sm86 configs compile into the sm_80 image (``families.Family.image_carries``): their rows
come from the build report of the installed images, and an image missing there (a build without
sm_80, an older report) is compiled here; sm_120 (sm120 takes sm86's tables, compiled for
``sm_120f``) is compiled here, bf16 only: the launch configs take no dtype, and the sm_80 rows
show fp16 and bf16 images of one tile with the same products, warps and replication.
What this cannot show: speed (no GPU has run these tables).
"""

from __future__ import annotations

import json

import pytest

from flash_attn.aot import specializations as S
from flash_attn.kernel_build import kernel_report as R
from flash_attn.planning import configs, declarations, families

TRAINING_KERNELS = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "attn_bwd_kernel")
FLOOR_BLOCK_DS = tuple(d for d in configs.HEADDIM_BUCKETS if d <= R.FLOOR_HEAD_DIM)


def _launches(family: str, dtype: str) -> list[tuple[S.Spec, str]]:
    """``(spec, variant)`` of every training image ``family``'s devices run at head dims <= 128."""
    out = []
    for spec, _ in S.attention_launches(family, dtype, FLOOR_BLOCK_DS):
        if spec.kernel in TRAINING_KERNELS:
            flags = dict(spec.flags)
            decl = declarations.get(spec.kernel)
            exact = bool(decl.exact) and decl.serves_exactly(flags)
            out.append((spec, "features" if flags.get("HAS_SOFTCAP") else "exact" if exact else "lean"))
    return out


def _measured(spec: S.Spec, family: str, variant: str) -> bool:
    """Whether a GPU measured the entry (``configs.SPILLS_MEASURED``, looked up like its row)."""
    kind = declarations.get(spec.kernel).config_kind
    return any((kind, name, spec.block_d, variant) in configs.SPILLS_MEASURED for name in families.lineage(family))


def _row(rows: dict, spec: S.Spec, arch: str) -> dict:
    """The report row of ``spec`` on ``arch``: the installed build's, else compiled here."""
    from flash_attn.kernel_build import build as aot_build

    row = rows.get((spec.key, arch))
    if row is None or "spill_bytes_in_loops" not in row:
        pytest.importorskip("triton")
        row = rows[(spec.key, arch)] = aot_build.report_row(spec, arch)
    return row


@pytest.fixture(scope="module")
def rows() -> dict:
    """(image key, arch) -> the installed build report's cubin rows (none without installed images)."""
    from flash_attn.aot import manifest as aot_manifest

    installed = aot_manifest.find_manifest_dir()
    if installed is None or not (installed / "build-report.json").is_file():
        return {}
    report = json.loads((installed / "build-report.json").read_text())
    return {(r["key"], r["arch"]): r for r in report["kernels"] if r.get("image") == "cubin"}


def _misses(rows: dict, family: str, arch: str, dtype: str) -> dict:
    out = {}
    for spec, variant in _launches(family, dtype):
        row = _row(rows, spec, arch)
        out[f"{family} {spec.key} ({variant})"] = R.mma_sync_misses(row, family, _measured(spec, family, variant))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sm80", "sm86"])
@pytest.mark.parametrize("dtype", S.DTYPES)
def test_sm80_image_meets_the_floors(rows, family, dtype):
    """sm80's and sm86's training images in the sm_80 image, fp16 and bf16."""
    launches = _launches(family, dtype)
    kinds = {declarations.get(spec.kernel).config_kind for spec, _ in launches}
    assert {"fwd", "bwd_dkdv", "bwd_dq"} <= kinds, kinds
    misses = _misses(rows, family, "sm_80", dtype)
    assert not {k: v for k, v in misses.items() if v}, json.dumps(misses, indent=1)


@pytest.mark.slow
def test_sm120_images_meet_the_floors(rows):
    """sm120's training images, compiled for sm_120f (the default build's target; not in CI's)."""
    misses = _misses(rows, "sm120", "sm_120f", "bf16")
    assert not {k: v for k, v in misses.items() if v}, json.dumps(misses, indent=1)


@pytest.mark.slow
def test_the_tiles_do_not_depend_on_the_dtype(rows):
    """What lets sm_120 be checked in bf16 alone: one launch config for both dtypes (the tables
    take none), and on sm_80 the fp16 and bf16 images of each tile compute the same products on
    the same warps (replication included)."""
    for family in ("sm80", "sm86"):
        fp16, bf16 = (_launches(family, dtype) for dtype in ("fp16", "bf16"))
        assert [s.key.replace(".fp16.", ".bf16.") for s, _ in fp16] == [s.key for s, _ in bf16]
        for (a, _), (b, _) in zip(fp16, bf16):
            shape = [{k: d[k] for k in ("shape", "warps", "replication", "in_loop")}
                     for d in _row(rows, a, "sm_80")["dots"]]
            assert shape == [{k: d[k] for k in ("shape", "warps", "replication", "in_loop")}
                             for d in _row(rows, b, "sm_80")["dots"]], (a.key, b.key)


def _planted(kernel: str, block_m: int, block_n: int, replication: int = 1, loop_bytes: int = 0) -> dict:
    m = block_n if kernel in ("attn_bwd_dkdv_kernel", "attn_bwd_kernel") else block_m
    dots = [{"family": "mma.sync", "shape": [m, 16, 128], "instr_n": 8, "warps": [8, 1], "replication": replication,
             "in_loop": True}]
    return {"key": "k", "kernel": kernel, "arch": "sm_80", "block_d": 128, "block_dv": 128, "ptx_mma": ["mma.sync"],
            "dots": dots, "block_m": block_m, "block_n": block_n, "spill_bytes_in_loops": loop_bytes}


def test_the_old_tiles_miss_the_floors():
    """The tables before the floors: sm80's d128 dK/dV of 16 x 64 on 8 warps (S and dP computed
    four times over, 64 keys) and its 128 x 32 forward; 64 keys per dK/dV program meet sm86's floor
    but not sm80's; a tile spilling 300 B a thread in its loop ships only measured."""
    old = R.mma_sync_misses(_planted("attn_bwd_dkdv_kernel", 16, 64, replication=4), "sm80")
    assert any("replicated work" in m for m in old) and any("keys per dK/dV program" in m for m in old), old
    narrow = R.mma_sync_misses(_planted("attn_fwd_kernel", 128, 32), "sm80")
    assert any("forward steps of 128 x 32" in m for m in narrow), narrow
    assert R.mma_sync_misses(_planted("attn_fwd_kernel", 128, 32), "sm120") == []
    assert R.mma_sync_misses(_planted("attn_fwd_kernel", 64, 64), "sm86") == []  # FA2's causal tile there
    assert R.mma_sync_misses(_planted("attn_bwd_dkdv_kernel", 16, 64), "sm120") == []
    spilling = _planted("attn_bwd_dkdv_kernel", 32, 128, loop_bytes=300)
    assert any("spills" in m for m in R.mma_sync_misses(spilling, "sm80"))
    assert R.mma_sync_misses(spilling, "sm80", spills_measured=True) == []
    assert any("spills" in m for m in R.mma_sync_misses({**spilling, "spill_bytes_in_loops": None}, "sm80"))
    with pytest.raises(ValueError):
        R.mma_sync_misses(spilling, "sm90")
