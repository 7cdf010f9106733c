"""What a kernel compiled for an AMD GPU says about itself, read without the GPU.

From Triton's TTGIR and the ``amdgcn`` assembly of one compile, :func:`analyse` reports, in the
build report's style (:mod:`flash_attn.kernel_build.kernel_report`):

* every product (``tt.dot``): ``mfma`` (CDNA's matrix cores), ``wmma`` (RDNA's) or ``fma`` (plain
  multiply-adds), its shape, instruction and replication; the products per step of the innermost
  loop; and the matrix instructions of the assembly (``v_mfma_*`` / ``v_wmma_*``, by name);
* ``spill_bytes``: the scratch (private segment) a wave uses, which on AMD is where registers
  spill; ``spill_ops_in_loops``: scratch loads and stores inside the assembly's innermost loops;
* ``vgprs`` (architectural + accumulation registers on CDNA), ``sgprs`` and ``occupancy``: the
  waves per SIMD those registers (and LDS) allow, as LLVM states it;
* ``dynamic_shared`` (the LDS one workgroup uses, Triton's count) against ``lds_limit``;
* ``fp32_atomics``: how the kernel adds floats to memory (the fused backward's dQ): ``native``
  (``*_atomic_add_f32``) or ``cas`` (a compare-and-swap loop, where the target has no float add).

The targets (:func:`target_misses`) are those of issue 47: every product on the family's matrix
instructions, within LDS, and on CDNA no scratch at head dims <= 128. Necessary conditions for
speed, not proof of it: only a GPU says how fast. Pure text parsing (no triton, no torch).
"""

from __future__ import annotations

import re
from typing import Optional

from flash_attn.kernel_build import kernel_report
from flash_attn.planning import families

__all__ = ["analyse", "resources", "matrix_instructions", "scratch_ops_in_loops", "fp32_atomics", "target_misses",
           "SCRATCH_FREE_UP_TO"]

# On CDNA no scratch at head dims up to this (issue 47's target; RDNA records the least it reaches)
SCRATCH_FREE_UP_TO = 128

_COMMENT = re.compile(r"^\s*;\s*(NumVgprs|NumAgprs|TotalNumVgprs|TotalNumSgprs|NumSgprs|ScratchSize|Occupancy|"
                      r"codeLenInByte)\s*[:=]\s*(\d+)", re.M)
_MATRIX = re.compile(r"^\s*(v_(?:mfma|wmma|smfmac|swmmac)\w*)", re.M)
_SCRATCH = re.compile(r"^\s*scratch_(?:load|store)\w*", re.M)


def resources(amdgcn: str) -> dict:
    """Registers, scratch, occupancy and code size of the kernel, from LLVM's comments (the last
    value of each: the kernel's, after any helper functions')."""
    found: dict = {}
    for name, value in _COMMENT.findall(amdgcn):
        found[name] = int(value)
    vgprs = found.get("TotalNumVgprs", found.get("NumVgprs"))
    return {"vgprs": vgprs, "agprs": found.get("NumAgprs", 0), "sgprs": found.get("TotalNumSgprs", found.get("NumSgprs")),
            "scratch_bytes": found.get("ScratchSize"), "occupancy": found.get("Occupancy"),
            "code_bytes": found.get("codeLenInByte")}


def matrix_instructions(amdgcn: str) -> dict:
    """``{instruction: count}`` of the MFMA / WMMA instructions in the assembly."""
    counts: dict = {}
    for name in _MATRIX.findall(amdgcn):
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _lines(amdgcn: str) -> list[str]:
    return [line.split(";", 1)[0].rstrip() for line in amdgcn.splitlines()]


def scratch_ops_in_loops(amdgcn: str) -> int:
    """Scratch loads/stores inside an innermost loop of the assembly (a label and a later branch
    back to it, holding no other such range): paid on every step of the main loops."""
    lines = _lines(amdgcn)
    labels = {}
    loops = []
    for number, line in enumerate(lines):
        label = re.match(r"^(\.?\w+):", line)
        if label:
            labels[label.group(1)] = number
            continue
        branch = re.match(r"^\s*s_(?:c?branch\w*)\s+(\.?\w+)\s*$", line)
        if branch and branch.group(1) in labels:
            loops.append((labels[branch.group(1)], number))
    innermost = [(lo, hi) for lo, hi in loops if not any(lo < a and b < hi for a, b in loops)]
    spills = [n for n, line in enumerate(lines) if _SCRATCH.match(line)]
    return sum(1 for n in spills if any(lo <= n <= hi for lo, hi in innermost))


def fp32_atomics(amdgcn: str) -> Optional[str]:
    """How the kernel adds fp32 values to global memory: ``"native"`` (a float atomic add
    instruction), ``"cas"`` (compare-and-swap loops: the target has none), ``None`` (no atomics)."""
    if re.search(r"^\s*(?:global|buffer|flat)_atomic_(?:add_f32|pk_add_f32)\b", amdgcn, re.M):
        return "native"
    if re.search(r"^\s*(?:global|buffer|flat)_atomic_cmpswap\w*", amdgcn, re.M):
        return "cas"
    return None


def analyse(ttgir: str, amdgcn: str, *, kind: Optional[str], block_n: int, num_warps: int, wave_size: int,
            lds: int, lds_limit: int) -> dict:
    """The static report of one AMD compile (see the module docstring)."""
    found = kernel_report.dots(ttgir)
    res = resources(amdgcn)
    return {
        "mma_families": sorted({d["family"] for d in found}),
        "dots": [{k: d[k] for k in ("family", "shape", "instr_n", "warps", "replication", "in_loop") if k in d}
                 for d in found],
        "max_replication": max((d["replication"] for d in found), default=1),
        "products_per_step": kernel_report.products_per_step(found, ttgir),
        "keys_per_cta": block_n if kind in kernel_report.STEP_KERNEL_KINDS else None,
        "matrix_instructions": matrix_instructions(amdgcn),
        "spill_bytes": res["scratch_bytes"],
        "spill_ops_in_loops": scratch_ops_in_loops(amdgcn),
        "vgprs": res["vgprs"],
        "agprs": res["agprs"],
        "sgprs": res["sgprs"],
        "occupancy": res["occupancy"],
        "code_bytes": res["code_bytes"],
        "threads": num_warps * wave_size,
        "dynamic_shared": lds,
        "lds_limit": lds_limit,
        "fp32_atomics": fp32_atomics(amdgcn),
    }


def target_misses(row: dict) -> list[str]:
    """Why one AMD report row misses issue 47's static targets (empty when it meets them):

    * every product on the family's matrix instructions (MFMA on CDNA, WMMA on RDNA), and the
      assembly holding them (an empty kernel would have none);
    * the LDS one workgroup uses within the family's limit;
    * on CDNA, no scratch at head dims <= :data:`SCRATCH_FREE_UP_TO` (RDNA's scratch is recorded
      in the report, the least its tables reach, not held to zero).
    """
    family = families.get(row["family"])
    misses = []
    products = row.get("dots", [])
    other = [d for d in products if d["family"] != family.mma]
    if other:
        misses.append(f"products not on {family.mma}: " + ", ".join(
            f"{d['family']} {'x'.join(map(str, d['shape']))}" for d in other))
    if products and not row.get("matrix_instructions"):
        misses.append(f"no {family.mma} instruction in the assembly (an empty kernel?)")
    if row["dynamic_shared"] > row["lds_limit"]:
        misses.append(f"{row['dynamic_shared']} B of LDS > the {row['lds_limit']} B a workgroup may use")
    if family.mma == "mfma" and (row.get("block_d") or 0) <= SCRATCH_FREE_UP_TO and row.get("spill_bytes"):
        misses.append(f"{row['spill_bytes']} B of scratch (spilled registers) at head dim {row.get('block_d')}")
    return misses
