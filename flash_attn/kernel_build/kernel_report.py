"""What a compiled image says about its own quality, read without a GPU.

From Triton's TTGIR, the PTX and the SASS (``cuobjdump -sass``) of one image, :func:`analyse`
reports per image:

* every tensor-core product (``tt.dot``, ``ttng.warp_group_dot``, ``ttng.tc_gen5_mma``): its MMA
  family (``mma.sync``, ``wgmma``, ``tcgen05``, or ``fma`` without tensor cores), shape, the
  instruction's N, and its *replication*: how many warps compute the same result element (a
  64-row tile on two warpgroups that both compute all 64 rows has replication 2);
* ``products_per_step``: the products in the innermost loop that has the most of them (the fused
  backward does 5 per (query tile, key block) pair, 7 half-width ones with its head dim split over
  two programs; the split dK/dV + dQ kernels 4 + 3);
* ``spill_ops_in_loops``: register spill loads/stores (``LDL``/``STL``) inside SASS loops, where
  they cost on every step (a spill outside loops is paid once), and ``spill_bytes_in_loops``, the
  bytes a thread moves with them per pass;
* ``ctas_per_sm`` from registers x threads (every warp the image runs: a warp-specialised one's
  partitions too) and shared memory; TMA (``cp.async.bulk.tensor``) and TMA reductions
  (``cp.reduce.async.bulk.tensor``: the fused backward's dQ with ``dq_tma``);
  ``wgmma_wait_max``: the most wgmma groups left in flight at a wait (0: every wgmma is waited on
  at once, no overlap of the tensor cores with the softmax);
* ``warp_specialized``: Triton split the kernel into producer and consumer warp groups
  (``ttg.warp_specialize``; ``requested_registers``: the registers each partition asks for).

Targets: :func:`target_misses` holds the training images of sm_90a and sm_100a to theirs,
:func:`mma_sync_misses` those of the mma.sync families (sm80, sm86, sm120) to FlashAttention-2's
tiles (:data:`MMA_SYNC_FLOORS`). These are necessary conditions for speed, not proof of it: only a
GPU says how fast. Pure text parsing (no triton, no torch; the launch-config table and the kernel
declarations for what the design computes).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Optional

from flash_attn.aot import archs
from flash_attn.planning import configs, declarations, families

__all__ = ["analyse", "dots", "layouts", "MMA_SYNC_FLOORS", "mma_sync_misses", "replication", "sass_loop_spill_bytes",
           "sass_loop_spills", "STEP_KERNEL_KINDS"]

# kernels whose programs own a block of keys and walk query tiles: ``BLOCK_N`` keys per program
STEP_KERNEL_KINDS = frozenset({"bwd_dkdv", "bwd_fused"})
REGISTERS_PER_SM = 65536
RESERVED_SHARED_PER_CTA = 1024

_LAYOUT_DEF = re.compile(r"^(#[\w]+) = (#[\w.]+)<(.*)>\s*$", re.M)
_TENSOR = re.compile(r"(tensor|!ttg\.memdesc)<([\dx]+)x\w+(?:, (#[\w]+))?")
_DOT_OPS = {"tt.dot": "dot", "ttng.warp_group_dot": "wgmma", "ttng.tc_gen5_mma": "tcgen05"}
_DOT_LINE = re.compile(r"\b(tt\.dot|ttng\.warp_group_dot|ttng\.tc_gen5_mma)\b")


def _ints(text: str, name: str) -> Optional[list]:
    match = re.search(rf"\b{name}\s*=\s*\[([^\]]*)\]", text)
    return [int(x) for x in match.group(1).split(",") if x.strip()] if match else None


def _bases(text: str, name: str) -> Optional[list]:
    match = re.search(rf"\b{name}\s*=\s*\[((?:\[[^\]]*\],?\s*)*)\]", text)
    if not match:
        return None
    return [[int(x) for x in b.split(",") if x.strip()] for b in re.findall(r"\[([^\]]*)\]", match.group(1))]


def layouts(ttgir: str) -> dict:
    """``#alias -> {"kind": ..., fields}`` for the layout attributes a TTGIR module defines."""
    out = {}
    for alias, kind, body in _LAYOUT_DEF.findall(ttgir):
        entry: dict = {"kind": kind.split(".")[-1]}
        for field in ("warpsPerCTA", "instrShape", "sizePerThread", "threadsPerWarp"):
            value = _ints(body, field)
            if value is not None:
                entry[field] = value
        major = re.search(r"versionMajor\s*=\s*(\d+)", body)
        if major:
            entry["version"] = int(major.group(1))
        for field in ("blockM", "blockN"):
            value = re.search(rf"\b{field}\s*=\s*(\d+)", body)
            if value:
                entry[field] = int(value.group(1))
        warp = _bases(body, "warp")
        if warp is not None:
            entry["warp"] = warp
        out[alias] = entry
    return out


def replication(layout: dict, shape: list) -> int:
    """How many warps hold each element of a ``shape`` tensor in ``layout`` (1: none replicated)."""
    kind = layout.get("kind")
    if kind in ("nvidia_mma", "amd_mfma"):
        wm, wn = layout["warpsPerCTA"][-2:]
        instr_m = 16 if kind == "nvidia_mma" else layout["instrShape"][0]
        instr_n = layout["instrShape"][1]
        m, n = shape[-2:]
        return max(1, wm * instr_m // m) * max(1, wn * instr_n // n)
    if kind in ("linear", "amd_wmma") and "warp" in layout:  # WMMA's warps as linear bases
        return 2 ** sum(1 for basis in layout["warp"] if not any(basis))
    if kind == "blocked":
        factor = 1
        for size, dim_threads, dim_warps, extent in zip(layout["sizePerThread"], layout["threadsPerWarp"],
                                                        layout["warpsPerCTA"], shape):
            covered_by_warps = size * dim_threads * dim_warps
            factor *= max(1, min(dim_warps, covered_by_warps // extent))
        return factor
    return 1


def _shape(text: str) -> list:
    return [int(x) for x in text.split("x")]


def _dot_lines(ttgir: str):
    """``(line number, op, operand types)`` of every product in a TTGIR module."""
    for number, line in enumerate(ttgir.splitlines()):
        match = _DOT_LINE.search(line)
        if match and " : " in line:
            types = _TENSOR.findall(line.split(" : ", 1)[1])
            if len(types) >= 3:
                yield number, _DOT_OPS[match.group(1)], types


def dots(ttgir: str) -> list[dict]:
    """Every tensor-core product of a TTGIR module, in order (``in_loop``: inside an ``scf.for``;
    ``loop``: the innermost one, an index into :func:`_loops`)."""
    defs = layouts(ttgir)
    loops = _loops(ttgir)
    tmem_loads = [(_shape(m.group(1)), m.group(2)) for m in
                  re.finditer(r"ttng\.tmem_load .*-> tensor<([\dx]+)x\w+, (#[\w]+)>", ttgir)]
    out = []
    for number, op, (a, b, c) in ((n, op, types[:3]) for n, op, types in _dot_lines(ttgir)):
        m, k = _shape(a[1])[-2:]
        n = _shape(b[1])[-1]
        result = defs.get(c[2] or "", {})
        entry = {"family": op, "shape": [m, n, k]}
        if op == "dot":
            entry["family"] = _dot_family(result)
        if result.get("kind") in ("nvidia_mma", "amd_mfma"):
            entry["warps"] = result["warpsPerCTA"][-2:]
            entry["instr_n"] = result["instrShape"][1]
            entry["replication"] = replication(result, [m, n])
        elif op == "tcgen05":
            # one thread issues it; the warps that read its result from tensor memory may repeat work
            entry["instr_n"] = result.get("blockN", n)
            same = [replication(defs.get(alias, {}), shape) for shape, alias in tmem_loads if shape == [m, n]]
            entry["replication"] = max(same, default=1)
        else:
            entry["replication"] = replication(result, [m, n]) if result else 1
        inside = [(end - start, index) for index, (start, end) in enumerate(loops) if start < number < end]
        entry["loop"] = min(inside)[1] if inside else None
        entry["in_loop"] = bool(inside)
        out.append(entry)
    return out


def _dot_family(result: dict) -> str:
    """The matrix instructions of a ``tt.dot`` whose result has layout ``result``: NVIDIA's by
    the MMA version, AMD's by the layout (``amd_mfma``: CDNA's MFMA, ``amd_wmma``: RDNA's WMMA);
    ``fma`` for a product Triton computes with plain multiply-adds."""
    kind = result.get("kind")
    if kind == "nvidia_mma":
        return {2: "mma.sync", 3: "wgmma"}.get(result.get("version"), "fma")
    return {"amd_mfma": "mfma", "amd_wmma": "wmma"}.get(kind, "fma")


def _loops(ttgir: str) -> list[tuple[int, int]]:
    """Line ranges ``[start, end]`` of every ``scf.for`` body (matched by indentation)."""
    lines = ttgir.splitlines()
    ranges = []
    for i, line in enumerate(lines):
        if re.search(r"\bscf\.for\b", line) and line.rstrip().endswith("{"):
            indent = len(line) - len(line.lstrip())
            for j in range(i + 1, len(lines)):
                other = lines[j]
                if other.strip().startswith("}") and len(other) - len(other.lstrip()) == indent:
                    ranges.append((i, j))
                    break
    return ranges


def products_per_step(found: list[dict], ttgir: str) -> int:
    """Products in the innermost loop (one that holds no other) with the most of them; 0 when no
    product is inside one. Products a software pipeline peeled off into an outer loop do not count."""
    loops = _loops(ttgir)
    innermost = {i for i, (start, end) in enumerate(loops)
                 if not any(start < s and e < end for s, e in loops)}
    per_loop: dict = {}
    for entry in found:
        if entry.get("loop") in innermost:
            per_loop[entry["loop"]] = per_loop.get(entry["loop"], 0) + 1
    return max(per_loop.values(), default=0)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


_SPILL_OP = re.compile(r"\b(?:LDL|STL)(\.\w+)*")
# bytes a thread moves with one LDL/STL of this width suffix (none: 32 bits)
_SPILL_WIDTH = {".64": 8, ".128": 16, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2}


def _loop_spill_ops(sass: str) -> list[str]:
    """The ``LDL``/``STL`` instructions inside an innermost loop of the SASS (the range of a
    backward branch that holds no other)."""
    rows = [(int(addr, 16), text) for addr, text in _SASS_LINE.findall(sass)]
    loops = []
    for addr, text in rows:
        branch = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) <= addr:
            loops.append((int(branch.group(1), 16), addr))
    innermost = [(lo, hi) for lo, hi in loops if not any(lo < a and b < hi for a, b in loops)]
    return [text for addr, text in rows
            if _SPILL_OP.search(text) and any(lo <= addr <= hi for lo, hi in innermost)]


def sass_loop_spills(sass: str) -> int:
    """``LDL``/``STL`` instructions inside an innermost loop of the SASS: paid on every step of
    the main loops."""
    return len(_loop_spill_ops(sass))


def sass_loop_spill_bytes(sass: str) -> int:
    """The bytes one thread moves to and from its spill stack in one pass through the innermost
    loops of the SASS (each ``LDL``/``STL`` by its width: ``.64`` 8, ``.128`` 16, plain 4)."""
    total = 0
    for text in _loop_spill_ops(sass):
        suffixes = _SPILL_OP.search(text).group(0).split(".")[1:]
        total += next((_SPILL_WIDTH["." + s] for s in suffixes if "." + s in _SPILL_WIDTH), 4)
    return total


def ctas_per_sm(regs: Optional[int], threads: int, shared: int, shared_limit: int) -> Optional[int]:
    """Resident programs per SM allowed by registers (8-register granularity) and shared memory."""
    if not regs:
        return None
    by_regs = REGISTERS_PER_SM // (math.ceil(regs / 8) * 8 * threads)
    by_shared = (shared_limit + RESERVED_SHARED_PER_CTA) // (shared + RESERVED_SHARED_PER_CTA)
    return min(by_regs, by_shared)


def analyse(ttgir: str, ptx: str, sass: str, *, kind: Optional[str], block_n: int, num_warps: int, shared: int,
            regs: Optional[int], stack: Optional[int], shared_limit: int, found: Optional[list] = None,
            block_m: Optional[int] = None) -> dict:
    """The static report of one image (see the module docstring); ``found``: :func:`dots` of the
    TTGIR when the caller has them already (every image of one compile shares its TTGIR)."""
    found = dots(ttgir) if found is None else found
    main = [d for d in found if d["in_loop"]] or found
    waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
    wgmma_n = [d["instr_n"] for d in main if d["family"] == "wgmma"]
    threads = num_warps * 32
    return {
        "mma_families": sorted({d["family"] for d in found}),
        "dots": [{k: d[k] for k in ("family", "shape", "instr_n", "warps", "replication", "in_loop") if k in d}
                 for d in found],
        "max_replication": max((d["replication"] for d in found), default=1),
        "min_wgmma_n": min(wgmma_n) if wgmma_n else None,
        "products_per_step": products_per_step(found, ttgir),
        "keys_per_cta": block_n if kind in STEP_KERNEL_KINDS else None,
        "spill_bytes": stack,
        # no stack frame, no spill instruction: the SASS is only read for kernels with one
        "spill_ops_in_loops": sass_loop_spills(sass) if sass else (0 if stack == 0 else None),
        "spill_bytes_in_loops": sass_loop_spill_bytes(sass) if sass else (0 if stack == 0 else None),
        "block_m": block_m,
        "block_n": block_n,
        "threads": threads,
        "regs_x_threads": regs * threads if regs else None,
        "dynamic_shared": shared,
        "ctas_per_sm": ctas_per_sm(regs, threads, shared, shared_limit),
        "tma": "cp.async.bulk.tensor" in ptx,
        "tma_reduce": "cp.reduce.async.bulk.tensor" in ptx,
        "wgmma_wait_max": max(waits) if waits else None,
        "warp_specialized": "ttg.warp_specialize(" in ttgir,
        "requested_registers": _requested_registers(ttgir),
    }


def _requested_registers(ttgir: str) -> Optional[list]:
    match = re.search(r"requestedRegisters = array<i32: ([\d, ]+)>", ttgir)
    return [int(x) for x in match.group(1).split(",")] if match else None


# --- the static targets of the training kernels -----------------------------------------------------

TRAINING_KERNELS = ("attn_fwd_kernel", "attn_bwd_kernel")
# deterministic=True's kernels (the split backward): held to the same targets on sm_90a, where
# they walk the fused backward's tiles (their Blackwell and Ampere tables are older and unmeasured)
DETERMINISTIC_KERNELS = tuple(k.name for k in declarations.KERNELS.values()
                              if k.config_kind in configs.SPLIT_BACKWARD_KINDS)
_PRODUCTS_PER_STEP = {"attn_fwd_kernel": 2, "attn_bwd_kernel": 5, "attn_bwd_dkdv_kernel": 4, "attn_bwd_dq_kernel": 3}
# the fused backward with its head dim split over two programs (configs.gradient_columns) also
# computes the scores and dP over the other half: two more products, each half as wide (split
# over more, it computes them from whole rows: the design's products, no more)
_SPLIT_EXTRA_PRODUCTS = 2
MIN_KEYS_PER_CTA = 128  # per dK/dV program, head dims <= 128 (FA2 and FA3 walk 128 keys)
MIN_WGMMA_N = 64
# Beyond this head dim the tiles are 16 rows a warp, the fewest without a replicated product (an
# accumulator of 512 columns takes 256 registers a thread even so): the targets there are no
# replicated product and every main product on tensor cores (tensor_core_misses), not the widths.
WIDEST_TARGET_HEAD_DIM = 256


def target_misses(row: dict) -> list[str]:
    """Why one build-report row of a training kernel (forward, fused backward; on sm_90a also the
    deterministic dK/dV and dQ kernels) on sm_90a or sm_100a misses the static targets; empty when
    it meets them:

    * no product computed by more than one warp (replication 1);
    * the main products (those over the program's own rows: the backward's keys, the forward's
      queries; the backward's per-step dQ product is not one) on the architecture's tensor cores: wgmma with
      N >= 64 (or the product's whole N, at head dim 32) on sm_90a, tcgen05 on sm_100a;
    * the products per step of the design (forward 2, fused backward 5, dK/dV 4, dQ 3: nothing
      recomputed; two more, half-width, where the head dim is split over two programs);
    * at head dims <= 128, at least 128 keys per dK/dV program.

    Beyond head dim :data:`WIDEST_TARGET_HEAD_DIM` (512) only the first two (:func:`tensor_core_misses`
    and the architecture's MMA).
    """
    misses = tensor_core_misses(row)
    if not row.get("dots") or not any(d.get("in_loop") for d in row["dots"]):
        return misses
    kernel, arch = row["kernel"], row["arch"]
    main = _main_products(row)
    want = "tcgen05" if arch.startswith("sm_100") else "wgmma" if arch.startswith("sm_90") else None
    if want is not None:
        other = [d for d in main if d["family"] != want]
        if other:
            misses.append(f"main products not on {want}: {', '.join(_dot_text(d) for d in other)}")
    if max(row.get("block_d", 0), row.get("block_dv", 0)) > WIDEST_TARGET_HEAD_DIM:
        return misses
    if want == "wgmma":
        # a product narrower than 64 (head dim 32) cannot have a wider instruction
        narrow = [d for d in main if d["family"] == "wgmma" and d.get("instr_n", 0) < min(MIN_WGMMA_N, d["shape"][1])]
        if narrow:
            misses.append(f"wgmma N < {MIN_WGMMA_N}: {', '.join(_dot_text(d) for d in narrow)}")
    expected = _PRODUCTS_PER_STEP.get(kernel)
    kind = declarations.get(kernel).config_kind
    family = configs.arch_family(archs.parse_arch(arch).capability)
    if expected is not None and configs.gradient_parts(kind, family, row["block_d"], row.get("block_dv")) == 2:
        expected += _SPLIT_EXTRA_PRODUCTS
    if expected is not None and row.get("products_per_step") != expected:
        misses.append(f"{row.get('products_per_step')} products per step, the design does {expected}")
    keys = row.get("keys_per_cta")
    if keys is not None and row.get("block_d", 0) <= 128 and keys < MIN_KEYS_PER_CTA:
        misses.append(f"{keys} keys per dK/dV program (< {MIN_KEYS_PER_CTA})")
    return misses


def _main_products(row: dict) -> list[dict]:
    """The products in loops over the program's own rows: a dK/dV program's keys, else the widest M
    (its dQ^T product has the head dim as M)."""
    loop = [d for d in row["dots"] if d.get("in_loop")]
    rows = row.get("keys_per_cta") or max(d["shape"][0] for d in loop)
    return [d for d in loop if d["shape"][0] == rows]


def tensor_core_misses(row: dict) -> list[str]:
    """Why one build-report row misses the targets of every training image on every architecture:
    a tensor-core product in a loop, tensor-core instructions in the PTX, no product computed by
    more than one warp, and every main product on tensor cores (not ``fma``)."""
    loop = [d for d in row.get("dots", []) if d.get("in_loop")]
    if not loop:
        return ["no tensor-core product inside a loop"]
    misses = []
    if not row.get("ptx_mma"):
        misses.append("no tensor-core instruction in the PTX (an empty kernel?)")
    replicated = [d for d in row["dots"] if d["replication"] > 1]
    if replicated:
        misses.append(f"replicated work: {', '.join(_dot_text(d) for d in replicated)}")
    scalar = [d for d in _main_products(row) if d["family"] == "fma"]
    if scalar:
        misses.append(f"main products without tensor cores: {', '.join(_dot_text(d) for d in scalar)}")
    return misses


def _dot_text(d: dict) -> str:
    m, n, k = d["shape"]
    return f"{d['family']} {m}x{n}x{k} (N {d.get('instr_n')}, x{d['replication']})"


# --- the floors of the mma.sync families (A100; RTX 30/40/50, A10/A40, L4/L40S) ------------------


class MmaSyncFloor(NamedTuple):
    """FlashAttention-2's tiles on one mma.sync family, the least its training images at head dims
    <= :data:`FLOOR_HEAD_DIM` may have (with no product computed by two warps)."""

    dkdv_keys: int  # keys per dK/dV program (the deterministic dK/dV kernel and the fused backward)
    forward_keys: int  # keys per forward step
    forward_tile: int  # query rows x keys of a forward step


# FA2: A100 (163 KB of shared memory) 128 x 64 forward steps and 128 keys per dK/dV program at d128;
# its 99 KB variants (sm86, sm89; here sm120 too, families.lineage) 128 x 32 forward steps (64 x 64
# causal: the same area) and 64 keys per dK/dV program
MMA_SYNC_FLOORS = {"sm80": MmaSyncFloor(128, 64, 128 * 64), "sm86": MmaSyncFloor(64, 32, 128 * 32)}
FLOOR_HEAD_DIM = 128
# bytes one thread may move to and from its spill stack per pass through the inner loops
# (spill_bytes_in_loops) in an entry no GPU has measured (configs.SPILLS_MEASURED)
MAX_LOOP_SPILL_BYTES = 256


def mma_sync_floor(family: str) -> Optional[MmaSyncFloor]:
    """The floors of ``family`` (its own, else its nearest config parent's); ``None``: no mma.sync family."""
    return next((MMA_SYNC_FLOORS[name] for name in families.lineage(family) if name in MMA_SYNC_FLOORS), None)


def mma_sync_misses(row: dict, family: str, spills_measured: bool = False) -> list[str]:
    """Why one build-report row of a training image (forward, dK/dV, dQ, fused backward) that
    ``family``'s devices run misses its floors; empty when it meets them:

    * every main product on mma.sync, none computed by more than one warp (:func:`tensor_core_misses`);
    * at head dims <= :data:`FLOOR_HEAD_DIM`: the family's keys per dK/dV program and forward
      step and its forward tile (:data:`MMA_SYNC_FLOORS`);
    * at most :data:`MAX_LOOP_SPILL_BYTES` of spill traffic a thread in the inner loops, unless
      ``spills_measured`` (a GPU measured the entry: ``configs.SPILLS_MEASURED``); unknown counts
      as too many.
    """
    floor = mma_sync_floor(family)
    if floor is None:
        raise ValueError(f"{family} is no mma.sync family with floors ({', '.join(MMA_SYNC_FLOORS)})")
    misses = tensor_core_misses(row)
    other = [d for d in _main_products(row) if d["family"] != "mma.sync"] if row.get("dots") else []
    if other:
        misses.append(f"main products not on mma.sync: {', '.join(_dot_text(d) for d in other)}")
    kind = declarations.get(row["kernel"]).config_kind
    if max(row["block_d"], row.get("block_dv") or 0) <= FLOOR_HEAD_DIM:
        keys = row.get("block_n")
        if kind in STEP_KERNEL_KINDS and (keys or 0) < floor.dkdv_keys:
            misses.append(f"{keys} keys per dK/dV program (< {floor.dkdv_keys} on {family})")
        if kind == "fwd":
            tile = (row.get("block_m") or 0) * (keys or 0)
            if (keys or 0) < floor.forward_keys or tile < floor.forward_tile:
                misses.append(f"forward steps of {row.get('block_m')} x {keys} (< {floor.forward_keys} keys or "
                              f"< {floor.forward_tile} rows x keys on {family})")
    spilled = row.get("spill_bytes_in_loops")
    if not spills_measured and (spilled is None or spilled > MAX_LOOP_SPILL_BYTES):
        misses.append(f"{spilled} B of spills a thread in the inner loops (> {MAX_LOOP_SPILL_BYTES}, unmeasured)")
    return misses
