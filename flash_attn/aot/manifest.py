"""The manifest of the shipped kernel images (``_aot/manifest.json``, written by
:mod:`flash_attn.aot.build`): where it is, what it holds, and which image a device with a given
driver can run."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Optional

from flash_attn.aot import archs, library as op_library

DIR_ENV = "FLASH_ATTN_AOT_DIR"


class Manifest:
    """``manifest.json`` of an AOT kernel folder, indexed by ``(image arch, spec key)``."""

    def __init__(self, folder: Path, data: dict):
        self.folder = Path(folder)
        self.data = data
        self.entries = {(e["arch"], e["key"]): e for e in data.get("kernels", [])}
        self.archs = sorted({e["arch"] for e in data.get("kernels", [])})

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        return cls(folder, json.loads((Path(folder) / "manifest.json").read_text()))

    def lookup(self, arch: str, key: str) -> Optional[dict]:
        return self.entries.get((arch, key))

    def requirement(self, arch: str) -> Optional[tuple[int, int]]:
        """The oldest CUDA driver release (major, minor) that loads the images of ``arch``: the
        ptxas release for cubins (minor-version compatible), the PTX ISA's release for PTX."""
        need = None
        for (a, _), entry in self.entries.items():
            if a == arch:
                found = _entry_requirement(entry)
                if found is not None and (need is None or found > need):
                    need = found
        return need

    def image_for(self, capability: tuple[int, int], driver: Optional[tuple[int, int]] = None) -> archs.ImageChoice:
        """The image a device of ``capability`` runs, among those a driver of release ``driver``
        (``None``: unknown) can load."""
        loadable, refused = [], []
        for arch in self.archs:
            need = self.requirement(arch)
            if driver is not None and need is not None and not _driver_loads(driver, need, arch):
                refused.append(f"{arch} needs a driver for CUDA >= {need[0]}.{need[1]}")
            else:
                loadable.append(arch)
        choice = archs.select_image(capability, loadable)
        if not choice.supported and refused:
            runnable = [a for a in self.archs if archs.parse_arch(a).runs_on(*capability)]
            if runnable:
                why = "; ".join(r for r in refused if r.split()[0] in runnable)
                return archs.ImageChoice(
                    "unsupported", None,
                    f"the images for compute capability {capability[0]}.{capability[1]} need a newer NVIDIA driver "
                    f"({why}; this driver supports CUDA {driver[0]}.{driver[1]}): update the driver, or install a "
                    f"flash-attn build for an older CUDA")
        return choice


def _entry_requirement(entry: dict) -> Optional[tuple[int, int]]:
    text = entry.get("ptx_isa") if entry["arch"].startswith("compute_") else entry.get("ptxas")
    if not text:
        return None
    major, minor = (int(x) for x in str(text).split(".")[:2])
    return ptx_isa_release(major, minor) if entry["arch"].startswith("compute_") else (major, minor)


# PTX ISA version -> the CUDA release that introduced it (8.x is CUDA 12.x with a gap at 12.6/12.7).
_PTX_ISA_8 = {0: (12, 0), 1: (12, 1), 2: (12, 2), 3: (12, 3), 4: (12, 4), 5: (12, 5), 6: (12, 7), 7: (12, 8), 8: (12, 9)}


def ptx_isa_release(major: int, minor: int) -> tuple[int, int]:
    """The CUDA release whose driver first compiles PTX ISA ``major.minor``."""
    if major == 8:
        return _PTX_ISA_8.get(minor, (12, 9))
    if major >= 9:
        return (major + 4, minor)  # ISA 9.0 came with CUDA 13.0
    return (11, 8)


def _driver_loads(driver: tuple[int, int], need: tuple[int, int], arch: str) -> bool:
    if arch.startswith("compute_"):
        return driver >= need
    return driver[0] >= need[0]  # cubins: the same major release is enough (minor-version compatibility)


_dirs: dict[tuple, Optional[Path]] = {}


def find_manifest_dir() -> Optional[Path]:
    """``$FLASH_ATTN_AOT_DIR``, else ``_aot/`` in a folder of the package (looked up once)."""
    key = (os.environ.get(DIR_ENV), tuple(op_library.package_folders()))
    if key not in _dirs:
        _dirs[key] = Path(key[0]) if key[0] else next(
            (f / "_aot" for f in key[1] if (f / "_aot" / "manifest.json").is_file()), None)
    return _dirs[key]


_manifest_cache: dict[str, object] = {}
_lock = threading.Lock()


def manifest() -> tuple[Optional[Manifest], str]:
    """The installed manifest, or ``(None, why not)``; read once per folder."""
    folder = find_manifest_dir()
    if folder is None:
        return None, ("no ahead-of-time kernels are installed (flash_attn/_aot/manifest.json is missing: "
                      "a CPU-only build, or build them with `python -m flash_attn build-kernels`)")
    key = str(folder)
    with _lock:
        if key not in _manifest_cache:
            try:
                _manifest_cache[key] = Manifest.load(folder)
            except (OSError, ValueError) as exc:
                _manifest_cache[key] = f"cannot read {folder / 'manifest.json'}: {exc}"
    value = _manifest_cache[key]
    return (value, "") if isinstance(value, Manifest) else (None, str(value))


def driver_release() -> Optional[tuple[int, int]]:
    """The CUDA release the NVIDIA driver supports (e.g. ``(13, 0)``), as the op library's CUDA
    runtime reads it; ``None`` when unknown."""
    version = op_library.cuda_info()["driver_version"]
    return (version // 1000, version % 1000 // 10) if version > 0 else None
