"""``python -m flash_attn info``: what this installation ships (AOT kernels and the op library)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Optional

from flash_attn.aot import library as op_library, manifest


def summary(folder: Optional[Path] = None) -> dict:
    """Machine-readable summary: the AOT kernel folder, its archs/kernels/bytes, the op library."""
    folder = Path(folder) if folder else manifest.find_manifest_dir()
    out: dict = {"aot_dir": str(folder) if folder else None}
    if folder is not None and (folder / "manifest.json").is_file():
        data = json.loads((folder / "manifest.json").read_text())
        kernels = data.get("kernels", [])
        out.update(
            triton=data.get("triton"),
            archs=data.get("archs", []),
            images=len(kernels),
            images_by_arch=dict(Counter(k["arch"] for k in kernels)),
            specs=len({k["key"] for k in kernels}),
            bytes=sum((folder / k["image"]).stat().st_size for k in kernels if (folder / k["image"]).is_file()),
        )
        report = folder / "build-report.json"
        if report.is_file():
            data = json.loads(report.read_text())
            out["build"] = {k: data["totals"].get(k) for k in ("wall_seconds", "peak_rss_mb", "bytes", "raw_bytes")}
            out["ptxas"] = data.get("ptxas")
    else:
        out.update(archs=[], images=0, specs=0, bytes=0)
    status = op_library.status()
    out["op_library"] = {"loaded": status.loaded, "path": status.path, "reason": status.reason,
                         "build_config": status.build_config}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--aot-dir", default=None, help="an AOT kernel folder (default: the installed one)")


def run(args: argparse.Namespace) -> int:
    info = summary(args.aot_dir)
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    print(f"AOT kernels:     {info['aot_dir'] or 'none installed'}")
    if info["images"]:
        by_arch = ", ".join(f"{a}: {n}" for a, n in sorted(info["images_by_arch"].items()))
        print(f"  archs:         {', '.join(info['archs'])}")
        print(f"  kernels:       {info['specs']} specialisations, {info['images']} images ({by_arch})")
        raw = (info.get("build") or {}).get("raw_bytes")
        inflated = f", {raw / 1e6:.1f} MB uncompressed" if raw else ""
        print(f"  bytes:         {info['bytes'] / 1e6:.1f} MB stored{inflated} (triton {info['triton']})")
        if info.get("build"):
            b = info["build"]
            print(f"  build:         {b['wall_seconds']} s wall, peak RSS {b['peak_rss_mb']} MB")
    lib = info["op_library"]
    state = "loaded" if lib["loaded"] else f"not loaded: {lib['reason']}"
    print(f"op library:      {lib['path'] or '-'} ({state})")
    cfg = lib.get("build_config") or {}
    if cfg:
        print(f"  cuda:          {cfg.get('cuda')} runtime {cfg.get('cuda_runtime') or '-'}, archs {cfg.get('cuda_archs') or '-'}")
    return 0
