"""The static kernel report (:mod:`flash_attn.kernel_build.kernel_report`) and the targets it holds the
training kernels to on sm_90a and sm_100a.

The parser is checked on small hand-written TTGIR/SASS excerpts (in Triton 3.9's syntax); the
targets on the real images: sm_90a from the build report of the installed (or freshly built)
images, sm_100a compiled here (no GPU needed). A planted 16-row tile must fail the targets.
What this cannot show: speed. A kernel that meets every target may still be slow; only a GPU
run (`python -m flash_attn bench tune`) says how fast.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from flash_attn.kernel_build import kernel_report as R
from flash_attn.planning import configs

WGMMA_8x1 = "#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 64, 16]}>"
WGMMA_4x2 = "#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 32, 16]}>"
MMA_V2 = "#mma2 = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 8]}>"
LINEAR = ("#linear = #ttg.linear<{register = [[0, 1]], lane = [[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]], "
          "warp = [[32, 0], [64, 0], [0, 0]], block = []}>")


def test_replication_of_mma_and_linear_layouts():
    defs = R.layouts("\n".join([WGMMA_8x1, WGMMA_4x2, MMA_V2, LINEAR]))
    # 8 warps along M cover 128 rows: a 64-row product is computed twice, a 128-row one once
    assert R.replication(defs["#mma"], [64, 64]) == 2
    assert R.replication(defs["#mma"], [128, 64]) == 1
    assert R.replication(defs["#mma1"], [64, 64]) == 1  # 4 x 2 warps: 64 rows, 2 x 32 columns
    assert R.replication(defs["#mma1"], [64, 32]) == 2
    assert R.replication(defs["#mma2"], [16, 64]) == 8  # mma.sync: 16 rows a warp
    assert R.replication(defs["#linear"], [128, 64]) == 2  # a zero warp basis: two warps, same data


_TTGIR = f"""{WGMMA_8x1}
{WGMMA_4x2}
module {{
  tt.func public @k() {{
    %a = ttng.warp_group_dot %q, %k, %z {{isAsync = true}} : !ttg.memdesc<128x64xbf16, #shared, #smem> * !ttg.memdesc<64x64xbf16, #shared1, #smem> -> tensor<128x64xf32, #mma> loc(#loc1)
    %r:2 = scf.for %i = %c0 to %n step %c64 iter_args(%x = %a) -> (tensor<128x64xf32, #mma>) : i32 {{
      %s = ttng.warp_group_dot %q, %k, %z {{isAsync = true}} : !ttg.memdesc<128x64xbf16, #shared, #smem> * !ttg.memdesc<64x64xbf16, #shared1, #smem> -> tensor<128x64xf32, #mma> loc(#loc2)
      %o = ttng.warp_group_dot %p, %v, %x {{isAsync = true}} : tensor<128x64xbf16, #ttg.dot_op<{{opIdx = 0, parent = #mma, kWidth = 2}}>> * !ttg.memdesc<64x64xbf16, #shared, #smem> -> tensor<128x64xf32, #mma> loc(#loc3)
      %d = ttng.warp_group_dot %t, %k2, %z2 {{isAsync = true}} : tensor<64x128xbf16, #ttg.dot_op<{{opIdx = 0, parent = #mma1, kWidth = 2}}>> * !ttg.memdesc<128x64xbf16, #shared, #smem> -> tensor<64x64xf32, #mma1> loc(#loc4)
      scf.yield %o : tensor<128x64xf32, #mma> loc(#loc5)
    }} loc(#loc6)
    tt.return loc(#loc7)
  }} loc(#loc8)
}} loc(#loc9)
"""


def test_dots_loops_and_products_per_step():
    found = R.dots(_TTGIR)
    assert [d["shape"] for d in found] == [[128, 64, 64], [128, 64, 64], [128, 64, 64], [64, 64, 128]]
    assert [d["in_loop"] for d in found] == [False, True, True, True]
    assert {d["family"] for d in found} == {"wgmma"}
    assert [d["instr_n"] for d in found] == [64, 64, 64, 32]
    assert R.products_per_step(found, _TTGIR) == 3  # the peeled product before the loop is not a step's


_SASS = """
        /*0100*/                   STL [R1+0x10], R2 ;
        /*0110*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0120*/                   LDL R3, [R1+0x10] ;
        /*0130*/                   STL.64 [R1+0x18], R4 ;
        /*0140*/               @P0 BRA 0x110 ;
        /*0150*/                   LDL R3, [R1+0x10] ;
        /*0160*/                   EXIT ;
"""


def test_spills_inside_loops_are_counted():
    assert R.sass_loop_spills(_SASS) == 2  # the STL before the loop and the LDL after it are paid once
    assert R.sass_loop_spill_bytes(_SASS) == 4 + 8  # LDL: 32 bits, STL.64: 64


def test_the_build_reads_the_sass_where_there_is_a_stack_frame():
    """The build disassembles only images with a stack frame: without one there is no spill
    instruction (0 in loops), with one and no SASS the count is unknown (None), never 0."""
    common = dict(kind="bwd_fused", block_n=128, num_warps=8, shared=1024, regs=128, shared_limit=227 * 1024,
                  found=[])
    assert R.analyse("", "", "", stack=0, **common)["spill_ops_in_loops"] == 0
    assert R.analyse("", "", "", stack=8, **common)["spill_ops_in_loops"] is None
    assert R.analyse("", "", _SASS, stack=8, **common)["spill_ops_in_loops"] == 2


def test_ctas_per_sm():
    assert R.ctas_per_sm(255, 256, 160 * 1024, 227 * 1024) == 1
    assert R.ctas_per_sm(128, 256, 64 * 1024, 227 * 1024) == 2  # 2 x 256 x 128 registers fill the SM


# --- the targets on real images ---------------------------------------------------------------------


def _compile_row(kernel: str, block_d: int, config: configs.Config, cap: int, features: bool = False) -> dict:
    """One image through the real build step (``compile_job``): its build-report row."""
    pytest.importorskip("triton")
    from flash_attn.aot import specializations as S
    from flash_attn.kernel_build import build as aot_build

    family = configs.arch_family((cap // 10, cap % 10))
    spec = S.attention_spec(kernel, "bf16", block_d, config, family, features)
    return aot_build.report_row(spec, {90: "sm_90a", 100: "sm_100a"}[cap])


def _training_rows(report: dict, arch: str) -> list[dict]:
    return [r for r in report["kernels"] if r["arch"] == arch and r["image"] == "cubin"
            and r["kernel"] in R.TRAINING_KERNELS]


def test_sm90a_training_images_meet_the_static_targets(report):
    """Every forward and fused-backward image of sm_90a (lean and score-features, fp16 and bf16,
    every head dim) as built: no replicated product, main products on wgmma with N >= 64, 2 / 5
    products per step, >= 128 keys per dK/dV program at head dims <= 128."""
    rows = _training_rows(report, "sm_90a")
    kernels = {(r["kernel"], r["block_d"]) for r in rows}
    assert {("attn_bwd_kernel", d) for d in (32, 64, 128, 256)} <= kernels, kernels
    assert {("attn_fwd_kernel", d) for d in (32, 64, 128, 256)} <= kernels, kernels
    misses = {r["key"]: R.target_misses(r) for r in rows}
    assert not {k: v for k, v in misses.items() if v}, json.dumps(misses, indent=1)
    # the report carries the whole static picture per image; the fused backward streams Q and dO
    # through tensor descriptors (configs.uses_tma), the forward K and V where its entry says (d256)
    for r in rows:
        forward_tma = configs.uses_tma("fwd", "sm90", configs.pick("fwd", r["block_d"], "sm90", r["features"]))
        assert r["regs_x_threads"] and r["ctas_per_sm"] >= 1
        assert r["tma"] is (r["kernel"] == "attn_bwd_kernel" or forward_tma), r["key"]
        assert r["spill_ops_in_loops"] is not None and r["wgmma_wait_max"] is not None


def test_sm90a_deterministic_images_meet_the_static_targets(report):
    """``deterministic=True``'s dK/dV and dQ images of sm_90a (lean and score-features, fp16 and
    bf16, every head dim): no replicated product, wgmma with the widest N their tiles allow, 4
    (dK/dV; 6 with d256's column split) and 3 (dQ) products per step, >= 128 keys per dK/dV program
    at head dims <= 128, Q and dO of the dK/dV kernel through tensor descriptors."""
    rows = [r for r in report["kernels"] if r["arch"] == "sm_90a" and r["image"] == "cubin"
            and r["kernel"] in R.DETERMINISTIC_KERNELS]
    assert {(r["kernel"], r["block_d"]) for r in rows} == {(k, d) for k in R.DETERMINISTIC_KERNELS
                                                           for d in (32, 64, 128, 256, 512)}
    misses = {r["key"]: R.target_misses(r) for r in rows}
    assert not {k: v for k, v in misses.items() if v}, json.dumps(misses, indent=1)
    assert all(r["tma"] is (r["kernel"] == "attn_bwd_dkdv_kernel") for r in rows)
    split = [r for r in rows if r["kernel"] == "attn_bwd_dkdv_kernel" and r["block_d"] == 256]
    assert split and all(r["products_per_step"] == 6 for r in split)


def test_beyond_fa2_images_meet_the_static_targets(report):
    """The images beyond FlashAttention-2, as built: head dim 512 (forward with its output columns
    split over two programs, backward with its gradient columns split over four) and the 256/128
    pair (192/128 calls), on sm_80 and sm_90a, fp16 and bf16, every training and backward kernel:
    every main product on tensor cores (mma.sync on sm_80, wgmma on sm_90a) and no product
    computed twice (sm_80's pair images take its head-dim-256 tiles, which since issue 48 repeat
    none either); on sm_90a every other target of ``target_misses`` too. What no report can show:
    their speed (unmeasured) and their spills (the backward's at head dim 512: 0.8-2 KB)."""
    kernels = (*R.TRAINING_KERNELS, *R.DETERMINISTIC_KERNELS)
    rows = [r for r in report["kernels"] if r["image"] == "cubin" and r["kernel"] in kernels
            and (r["block_d"] == 512 or r.get("block_dv", r["block_d"]) != r["block_d"])]
    built = {(r["arch"], r["kernel"], r["block_d"], r["block_dv"]) for r in rows}
    expected = {("sm_80", k, d, dv) for k in ("attn_fwd_kernel", *R.DETERMINISTIC_KERNELS) for d, dv in ((512, 512), (256, 128))}
    expected |= {("sm_90a", k, d, dv) for k in kernels for d, dv in ((512, 512), (256, 128))
                 if k != "attn_bwd_kernel" or configs.fused_backward(d, "sm90") is not None}
    assert expected <= built, sorted(expected - built)

    held = {r["key"] + "@" + r["arch"]: R.tensor_core_misses(r) for r in rows}
    assert not {k: v for k, v in held.items() if v}, json.dumps(held, indent=1)
    assert all("mma.sync" in {d["family"] for d in r["dots"] if d["in_loop"]} for r in rows if r["arch"] == "sm_80")
    hopper = {r["key"]: R.target_misses(r) for r in rows if r["arch"] == "sm_90a"}
    assert not {k: v for k, v in hopper.items() if v}, json.dumps(hopper, indent=1)


def test_the_widest_targets_are_the_tensor_core_ones():
    """At head dim 512 a 16-row tile a warp is the design: a fused backward of 64 keys a program on
    one warpgroup, its gradient columns in four parts (5 products a step, two of them over whole
    rows) meets the targets there, not at head dim 128 (64 keys < 128); a replicated or scalar main
    product misses them at every head dim."""
    # a 64-wide product on N-16 instructions: below the width target at head dim 128, tolerated at 512
    dots = [{"family": "wgmma", "shape": [64, 64, 512], "instr_n": 16, "replication": 1, "in_loop": True},
            {"family": "wgmma", "shape": [64, 128, 16], "instr_n": 128, "replication": 1, "in_loop": True}]
    row = {"key": "k", "kernel": "attn_bwd_kernel", "arch": "sm_90a", "block_d": 512, "block_dv": 512,
           "ptx_mma": ["wgmma"], "products_per_step": 5, "keys_per_cta": 64, "dots": dots}
    assert R.target_misses(row) == []
    narrow = R.target_misses({**row, "block_d": 128, "block_dv": 128})
    assert any("keys per dK/dV program" in m for m in narrow) and any("wgmma N < 64" in m for m in narrow)
    scalar = [{**dots[0], "family": "fma"}, dots[1]]
    assert any("without tensor cores" in m for m in R.tensor_core_misses({**row, "dots": scalar}))
    twice = [{**dots[0], "replication": 2}, dots[1]]
    assert any("replicated work" in m for m in R.target_misses({**row, "dots": twice}))


# sm_100a: the shipped forward and fused backward (head dim 256 with its gradient columns split),
# and head dim 512's entries, which Blackwell's JIT runs (no image ships: the only check of them):
# the backward is the fused kernel where the table has one, else the split kernels
def _sm100_cases():
    dims = (64, 128, 256, 512)
    split = (("attn_bwd_dkdv_kernel", "bwd_dkdv"), ("attn_bwd_dq_kernel", "bwd_dq"))
    return [("attn_fwd_kernel", d, configs.pick("fwd", d, "sm100")) for d in dims] + \
        [("attn_bwd_kernel", d, configs.fused_backward(d, "sm100")) for d in dims
         if configs.fused_backward(d, "sm100") is not None] + \
        [(kernel, d, configs.pick(kind, d, "sm100")) for d in dims if configs.fused_backward(d, "sm100") is None
         for kernel, kind in split]


@pytest.mark.slow
@pytest.mark.parametrize("kernel,block_d,config", _sm100_cases(), ids=lambda x: str(x))
def test_sm100a_training_images_meet_the_static_targets(kernel, block_d, config):
    row = _compile_row(kernel, block_d, config, 100)
    assert R.target_misses(row) == [], row


def _warp_specialised_candidates(family: str):
    from flash_attn.bench import tune

    return [(d, c) for d, listed in tune.CANDIDATES[("fwd", family)].items() for c in listed if c.ws]


@pytest.mark.slow
@pytest.mark.parametrize("block_d,config", _warp_specialised_candidates("sm90"), ids=lambda x: str(x))
def test_sm90a_warp_specialised_forward_candidates_are_split_into_producer_and_consumers(block_d, config):
    """The sweep's "-ws" forward candidates as built: Triton really split them (a kernel it could
    not split compiles anyway, as a plain 4-warp one), 4 + 8 warps launched, K/V by TMA, no
    spill, within Hopper's shared memory, and the static targets of every training image. The
    folded image (window and head-dim padding compiled in), whose key-range selects were once
    branches that kept Triton from splitting it."""
    row = _compile_row("attn_fwd_kernel", block_d, config, 90)
    assert row["warp_specialized"] and row["threads"] == 12 * 32 and row["tma"], row
    estimate = configs.estimate_shared_memory("fwd", config, block_d, "sm90")
    assert row["spill_bytes"] == 0 and row["dynamic_shared"] <= estimate <= configs.SHARED_MEMORY_LIMIT["sm90"], row
    assert R.target_misses(row) == [], row


@pytest.mark.slow
@pytest.mark.parametrize("block_d,config", _warp_specialised_candidates("sm100"), ids=lambda x: str(x))
def test_sm100a_warp_specialised_forward_candidates(block_d, config):
    """Blackwell's "-ws" forward candidates as built: split into partitions (20 warps with the
    8-warp softmax), K/V by TMA, products on tcgen05, no spill up to head dim 128, within the
    estimated shared memory, the static targets met."""
    row = _compile_row("attn_fwd_kernel", block_d, config, 100)
    assert row["warp_specialized"] and row["tma"] and row["threads"] > config.num_warps * 32, row
    assert row["dynamic_shared"] <= configs.estimate_shared_memory("fwd", config, block_d, "sm100") \
        <= configs.SHARED_MEMORY_LIMIT["sm100"], row
    assert block_d > 128 or row["spill_bytes"] == 0, row
    assert R.target_misses(row) == [], row


def test_fused_backward_ships_on_hopper_and_datacenter_blackwell():
    """Where a GPU with wgmma or tensor memory runs it: Hopper and Blackwell at every head dim but
    512 (the fused kernel there failed on an H200, the split kernels passed); of the mma.sync families (the sm_80 code) only the A100 at head dim 128, where 128 keys on 8
    warps replicate no product and keep their loop free of spills (tests/aot/test_mma_sync_floors.py);
    elsewhere Ampere, Ada and consumer Blackwell run the split kernels."""
    dims = (32, 64, 128, 256, 512)
    for family in ("sm90", "sm100"):
        assert [d for d in dims if configs.fused_backward(d, family) is None] == [512]
    assert [d for d in dims if configs.fused_backward(d, "sm80") is not None] == [128]
    assert all(configs.fused_backward(d, family) is None for d in dims for family in ("sm86", "sm120"))


@pytest.mark.slow
def test_sm90a_fused_backward_with_dq_by_tma_reductions():
    """The sweep's "-red" candidates compile to TMA bulk reductions for dQ
    (``cp.reduce.async.bulk.tensor``), meet the static targets and fit shared memory within the
    estimate."""
    from flash_attn.bench import tune

    red = [(d, c) for (kind, family), by_d in tune.CANDIDATES.items() if (kind, family) == ("bwd_fused", "sm90")
           for d, cands in by_d.items() for c in cands if c is not None and c.dq_tma]
    assert {d for d, _ in red} == {64, 128, 256}
    for d, config in red:
        row = _compile_row("attn_bwd_kernel", d, config, 90)
        assert row["tma_reduce"] and row["tma"], (d, config)
        assert R.target_misses(row) == [], (d, config, R.target_misses(row))
        assert row["dynamic_shared"] <= configs.estimate_shared_memory("bwd_fused", config, d, "sm90") \
            <= configs.SHARED_MEMORY_LIMIT["sm90"]


@pytest.mark.slow
def test_a_planted_16_row_tile_fails_the_targets():
    """The old dK/dV tile (16 queries x 64 keys, 8 warps) in the fused kernel: both warpgroups
    compute the same 64-key products, and 64 keys per program is below the target."""
    row = _compile_row("attn_bwd_kernel", 128, configs.Config(16, 64, 8, 2), 90)
    misses = R.target_misses(row)
    assert any("replicated work" in m for m in misses), misses
    assert any("keys per dK/dV program" in m for m in misses), misses
    assert any("wgmma N <" in m for m in misses), misses


def test_the_dkdv_kernels_products_follow_its_column_split():
    """dK/dV at head dim 256 splits its columns on Hopper (6 products a step), not on Blackwell
    (4): the same row meets the target on one and misses it on the other; a replicated 64-key
    tile (the old sm_90a entry) misses it."""
    dots = [{"family": "wgmma", "shape": [128, 32, 128], "instr_n": 32, "replication": 1, "in_loop": True},
            {"family": "wgmma", "shape": [128, 128, 32], "instr_n": 128, "replication": 1, "in_loop": True}]
    row = {"key": "k", "kernel": "attn_bwd_dkdv_kernel", "arch": "sm_90a", "block_d": 256, "ptx_mma": ["wgmma"],
           "products_per_step": 6, "keys_per_cta": 128, "dots": dots}
    assert R.target_misses(row) == []
    assert any("6 products per step, the design does 4" in m for m in R.target_misses({**row, "arch": "sm_100a"}))
    old = {**row, "block_d": 128, "products_per_step": 4, "keys_per_cta": 64,
           "dots": [{"family": "wgmma", "shape": [64, 16, 128], "instr_n": 8, "replication": 2, "in_loop": True}]}
    misses = R.target_misses(old)
    assert any("replicated work" in m for m in misses) and any("keys per dK/dV program" in m for m in misses)


def test_an_empty_kernel_fails_the_targets():
    """Triton 3.9 emits an empty kernel when tcgen05 tiles overflow tensor memory (the fused
    backward at head dim 128 with two stages on sm_100a): the report flags it."""
    row = {"key": "k", "kernel": "attn_bwd_kernel", "arch": "sm_100a", "block_d": 128, "ptx_mma": [],
           "products_per_step": 5, "keys_per_cta": 128,
           "dots": [{"family": "tcgen05", "shape": [128, 64, 128], "instr_n": 64, "replication": 1, "in_loop": True}]}
    assert any("empty kernel" in m for m in R.target_misses(row))


@pytest.mark.slow
def test_the_build_refuses_an_empty_kernel():
    with pytest.raises(RuntimeError, match="empty kernel"):
        _compile_row("attn_bwd_kernel", 128, configs.Config(64, 128, 8, 2), 100)


@pytest.fixture(scope="module")
def report() -> dict:
    """The build report of the installed images, or of a fresh sm_80/sm_90a build."""
    from flash_attn.aot import manifest as aot_manifest
    from flash_attn.kernel_build import build as aot_build

    installed = aot_manifest.find_manifest_dir()
    if installed is not None and (installed / "build-report.json").is_file():
        data = json.loads((installed / "build-report.json").read_text())
        if any(r.get("arch") == "sm_90a" and "dots" in r for r in data.get("kernels", [])):
            return data
    out = Path(tempfile.mkdtemp(prefix="aot-report-"))
    aot_build.build(out, "90", quiet=True)
    return json.loads((out / "build-report.json").read_text())
