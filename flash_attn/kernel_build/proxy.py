"""The images of the mma.sync proxy on Hopper: the attention kernels with the launch configs of the
``sm80`` and ``sm86`` tables, compiled as the portable ``compute_80`` PTX the default build ships
(Triton's sm_80 code: ``mma.sync`` products, ``cp.async`` loads, no wgmma or TMA), which an H200's
driver compiles for itself. With ``FLASH_ATTN_FORCE_FAMILY=sm80`` or ``sm86``
(:mod:`flash_attn.aot.forced`) the ``aot`` backend then plans with that family's tiles and runs
them from these images: ``bench gpu --family`` and ``.ci/gpu-window prepare-proxy`` / ``proxy``.

Why PTX and not an sm_90 cubin: Triton compiles capability 9.0 for ``sm_90a`` with wgmma; its
``DISABLE_MMA_V3=1`` switch keeps mma.sync there, but the rest of the compile stays Hopper's (another
PTX ISA, the code reordered). The sm_80 PTX is the very code A100 and RTX 30xx/40xx users run
(their cubin is ptxas's assembly of it); only the last step, PTX to SASS, is the H200 driver's
instead of ptxas's for sm_80/sm_86 (``benchmarks/README.md``, "The mma.sync proxy on the H200").

The set is derived from the tables, never copied: per family the image carries
(:func:`~flash_attn.planning.families.families_for` of 8.0), the lean attention kernels (and the
exact-call images where the family ships them) of :func:`~flash_attn.aot.specializations.attention_specs`
in ``bf16`` at the benchmark's head dims. :func:`verify` reads every built image back and holds
it to what the proxy claims.

    python -m flash_attn.kernel_build.proxy build OUT [--jobs N]
    python -m flash_attn.kernel_build.proxy verify OUT [--sass]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Sequence

from flash_attn.aot import archs, library as op_library, specializations as S
from flash_attn.planning import declarations, families

ARCH = "compute_80"
DTYPE = "bf16"
HEAD_DIMS = (64, 128, 256)  # bench gpu --family's head dims
# kernels that multiply tiles: their PTX must hold mma.sync (the preprocess and dQ conversion do not)
PRODUCT_KINDS = ("bwd_dkdv", "bwd_dq", "bwd_fused")
_NOT_AMPERE = ("wgmma", "tcgen05", "cp.async.bulk.tensor", "setmaxnreg")  # Hopper/Blackwell-only PTX


def proxy_families() -> tuple[str, ...]:
    """The families whose configs the proxy images carry (those of the ``compute_80`` image)."""
    return families.families_for(archs.parse_arch(ARCH).capability)


def specs(capability: tuple[int, int] = (8, 0), head_dims: Sequence[int] = HEAD_DIMS) -> list[S.Spec]:
    """The proxy's specialisations (``capability``: what :func:`flash_attn.kernel_build.build.plan`
    passes; the set is that of the ``compute_80`` image whatever it is)."""
    out: dict = {}
    for family in proxy_families():
        out.update(dict.fromkeys(S.attention_specs(family, DTYPE, head_dims, with_features=False)))
    return list(out)


def build(out_dir: Path, jobs: int | None = None, quiet: bool = False, head_dims: Sequence[int] = HEAD_DIMS) -> dict:
    """Compile the proxy images into ``out_dir`` (a manifest folder for ``FLASH_ATTN_AOT_DIR``)."""
    from flash_attn.kernel_build import build as kernel_build  # noqa: PLC0415  (imports triton)

    return kernel_build.build(Path(out_dir), ARCH, jobs, quiet, specs=lambda cap: specs(cap, head_dims))


def _is_product_kernel(kernel: str) -> bool:
    decl = declarations.get(kernel)
    return decl.config_kind in PRODUCT_KINDS or kernel == "attn_fwd_kernel"


def image_facts(ptx: str) -> dict:
    """What a PTX image is: its ``.target``, whether it holds mma.sync, cp.async, and which
    instructions of later GPUs it uses."""
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    return {"target": target.group(1) if target else None, "mma_sync": "mma.sync" in ptx,
            "cp_async": "cp.async" in ptx, "later": [name for name in _NOT_AMPERE if name in ptx]}


def assembled(ptx: str, arch: str) -> dict:
    """The PTX assembled by ptxas for ``arch`` (``sm_90``: what the H200's driver does with it, by
    the toolkit's ptxas rather than the driver's): registers, stack and local bytes (spills), and
    the SASS MMA families (``HMMA``: mma.sync; ``HGMMA`` would be wgmma)."""
    import tempfile  # noqa: PLC0415

    from flash_attn.kernel_build import build as kernel_build  # noqa: PLC0415

    cubin = kernel_build.assemble(ptx, arch, 80)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = kernel_build.resource_usage(path, kernel_build.cuobjdump_path())
    usage.pop("_sass", None)
    return {k: usage.get(k) for k in ("reg", "stack", "local", "shared", "sass_mma")}


def verify(out_dir: Path, sass: bool = False) -> tuple[dict, list[str]]:
    """Reads every image of the proxy folder back: ``(summary, problems)``. Every image must be
    ``compute_80`` PTX for ``.target sm_80`` with no instruction of a later GPU; every kernel that
    multiplies tiles must hold mma.sync; every family the image carries must have its forward,
    dK/dV (or fused) and dQ images at each head dim. With ``sass``, each image is also assembled
    for sm_80 (what A100/RTX 30xx users run) and sm_90 (:func:`assembled`): the summary's
    ``assembled`` lists both per image, and an sm_90 assembly without HMMA, or with HGMMA, is a
    problem."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    problems, by_kernel, total, assembly = [], {}, 0, {}
    keys = {e["key"] for e in manifest["kernels"]}
    for entry in manifest["kernels"]:
        path = out_dir / entry["image"]
        total += path.stat().st_size
        ptx = op_library.read_image(path).decode()
        facts = image_facts(ptx)
        by_kernel.setdefault(entry["kernel"], []).append(facts)
        where = f"{entry['key']} ({entry['arch']})"
        if sass:
            assembly[entry["key"]] = {arch: assembled(ptx, arch) for arch in ("sm_80", "sm_90")}
            mma = assembly[entry["key"]]["sm_90"]["sass_mma"] or []
            if "HGMMA" in mma or (_is_product_kernel(entry["kernel"]) and "HMMA" not in mma):
                problems.append(f"{where}: its sm_90 assembly has {mma or 'no MMA'}, not HMMA alone")
        if entry["arch"] != ARCH or not entry["image"].endswith(".ptx" + op_library.COMPRESSED_SUFFIX):
            problems.append(f"{where}: not {ARCH} PTX")
        if facts["target"] != "sm_80":
            problems.append(f"{where}: .target {facts['target']}, not sm_80")
        if facts["later"]:
            problems.append(f"{where}: uses {', '.join(facts['later'])} (not Ampere code)")
        if _is_product_kernel(entry["kernel"]) and not facts["mma_sync"]:
            problems.append(f"{where}: no mma.sync in its PTX")
    for family in proxy_families():
        for spec in S.attention_specs(family, DTYPE, HEAD_DIMS, with_features=False):
            if spec.key not in keys:
                problems.append(f"{family}: {spec.key} is missing (rebuild: the tables changed since)")
    summary = {"arch": ARCH, "families": list(proxy_families()), "images": len(manifest["kernels"]),
               "bytes": total, "kernels": {k: {"images": len(v), "mma.sync": sum(f["mma_sync"] for f in v),
                                               "cp.async": sum(f["cp_async"] for f in v)}
                                           for k, v in sorted(by_kernel.items())}}
    if sass:
        summary["assembled"] = assembly
    return summary, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_attn.kernel_build.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("build", "verify"))
    parser.add_argument("out", type=Path, help="the proxy's image folder (FLASH_ATTN_AOT_DIR on the GPU)")
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compiles (default: $MAX_JOBS or CPUs)")
    parser.add_argument("--sass", action="store_true",
                        help="also assemble each image for sm_80 and sm_90 (ptxas; a few seconds an image): registers, "
                             "spills and SASS MMA of what A100 users run and of what the H200 runs")
    args = parser.parse_args(argv)
    if args.step == "build":
        report = build(args.out, args.jobs)
        t = report["totals"]
        print(f"proxy images: {t['kernels']} {ARCH} PTX for {'/'.join(proxy_families())} into {args.out}: "
              f"{t['bytes'] / 1e6:.2f} MB, {t['wall_seconds']:.0f} s wall, {t['compile_cpu_seconds']:.0f} s compile")
    summary, problems = verify(args.out, args.sass)
    print(json.dumps(summary, indent=1))
    for problem in problems:
        print(f"proxy image problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
