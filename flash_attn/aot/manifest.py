"""The manifest of the shipped kernel images (``_aot/manifest.json``, written by
:mod:`flash_attn.kernel_build.build`): where it is, what it holds, and which image a device with a
given driver can run.

The manifest is checked once, when it is read (:func:`check_entry`, the one place that knows its
schema): a file that is not a manifest at all (not an object, no ``kernels`` list, a newer format,
no usable entry) makes the ``aot`` backend unavailable with the reason; a malformed entry is left
out (its image is never used) and listed in :attr:`Manifest.problems`, which the doctor shows. Nothing
here raises once a :class:`Manifest` exists.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Optional

from flash_attn.aot import archs, library as op_library

DIR_ENV = "FLASH_ATTN_AOT_DIR"
# The manifest format this flash_attn reads (flash_attn.kernel_build.build writes it).
FORMAT = 1


class ManifestError(ValueError):
    """A ``manifest.json`` that cannot serve as a manifest at all."""


# The schema of one entry: what the backend and the op library read (flash_attn.aot.library).
_REQUIRED = {"arch": str, "key": str, "image": str, "name": str, "signature": list, "num_warps": int, "shared": int}
_OPTIONAL = {"num_ctas": int, "global_scratch_size": int, "global_scratch_align": int, "profile_scratch_size": int,
             "profile_scratch_align": int, "launch_cooperative_grid": bool, "launch_pdl": bool}
_VERSION_RE = re.compile(r"^\d+\.\d+")


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _is(value, kind: type) -> bool:
    # bool is an int in Python, but not in the manifest
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def check_entry(entry) -> Optional[str]:
    """Why ``entry`` (one item of ``kernels``) cannot be used, or ``None`` when it can."""
    if not isinstance(entry, dict):
        return f"an entry must be an object, got {_type_name(entry)}"
    for field, kind in _REQUIRED.items():
        if field not in entry:
            return f"no {field!r}"
        if not _is(entry[field], kind) or (kind in (str, list) and not entry[field]):
            return f"{field!r} must be a non-empty {kind.__name__}, got {entry[field]!r:.60}"
    for field, kind in _OPTIONAL.items():
        if field in entry and not _is(entry[field], kind):
            return f"{field!r} must be {kind.__name__}, got {entry[field]!r:.60}"
    try:
        canonical = archs.parse_arch(entry["arch"]).name
    except ValueError as exc:
        return str(exc)
    if canonical != entry["arch"]:
        return f"'arch' must be written {canonical!r}, got {entry['arch']!r}"
    if not all(isinstance(t, str) and t for t in entry["signature"]):
        return "'signature' must list the kernel's argument types as strings"
    if entry["num_warps"] < 1 or entry["shared"] < 0:
        return f"'num_warps' ({entry['num_warps']}) must be >= 1 and 'shared' ({entry['shared']}) >= 0"
    for field in ("ptxas", "ptx_isa"):
        value = entry.get(field)
        if value is not None and not (isinstance(value, str) and _VERSION_RE.match(value)):
            return f"{field!r} must be a version string like '13.0' or null, got {value!r:.60}"
    return None


def _describe(index: int, entry) -> str:
    name = entry.get("key") if isinstance(entry, dict) else None
    return f"entry {index}" + (f" ({name}, {entry.get('arch')})" if isinstance(name, str) else "")


def check_manifest(data) -> tuple[list[dict], list[str], dict]:
    """``(usable entries, problems, {(arch, key): problem})`` of a parsed ``manifest.json``;
    raises :class:`ManifestError` when the file as a whole cannot be used."""
    if not isinstance(data, dict):
        raise ManifestError(f"the manifest must be a JSON object, got {_type_name(data)}")
    version = data.get("format", FORMAT)
    if not _is(version, int) or version > FORMAT:
        raise ManifestError(f"manifest format {version!r} is not one this flash_attn reads ({FORMAT}): "
                            f"written by another version (reinstall, or rebuild the kernels)")
    kernels = data.get("kernels")
    if not isinstance(kernels, list):
        raise ManifestError(f"'kernels' must be a list of entries, got {_type_name(kernels)}")
    usable, problems, invalid = [], [], {}
    for index, entry in enumerate(kernels):
        why = check_entry(entry)
        if why is None:
            usable.append(entry)
            continue
        problems.append(f"{_describe(index, entry)}: {why}")
        if isinstance(entry, dict) and isinstance(entry.get("arch"), str) and isinstance(entry.get("key"), str):
            invalid[(entry["arch"], entry["key"])] = why
    if kernels and not usable:
        raise ManifestError(f"none of its {len(kernels)} kernel entries can be used (first: {problems[0]})")
    return usable, problems, invalid


class Manifest:
    """``manifest.json`` of an AOT kernel folder, checked (:func:`check_manifest`) and indexed by
    ``(image arch, spec key)``; ``problems`` lists the entries left out and why."""

    def __init__(self, folder: Path, data: dict):
        self.folder = Path(folder)
        self.data = data
        usable, self.problems, self.invalid = check_manifest(data)
        self.entries = {(e["arch"], e["key"]): e for e in usable}
        self.archs = sorted({e["arch"] for e in usable})

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        return cls(folder, json.loads((Path(folder) / "manifest.json").read_text()))

    def lookup(self, arch: str, key: str) -> Optional[dict]:
        return self.entries.get((arch, key))

    def why_missing(self, arch: str, key: str) -> str:
        """Why :meth:`lookup` found no usable entry."""
        problem = self.invalid.get((arch, key))
        if problem is not None:
            return f"the manifest entry of {key} ({arch}) is malformed ({problem}): rebuild the kernels or reinstall"
        return f"{key} is not in the {arch} image set of this installation"

    def unusable_images(self) -> list[str]:
        """The image files of usable entries that cannot be used: missing, unreadable, empty, or
        stored compressed without a zlib header (damage past the header shows at the first call
        that needs the image). Each file is looked at once, not read whole."""
        bad = []
        for entry in self.entries.values():
            path = self.folder / entry["image"]
            try:
                with open(path, "rb") as file:
                    head = file.read(2)
            except OSError as exc:
                bad.append(f"{entry['image']}: {exc.strerror or exc}")
                continue
            if not head:
                bad.append(f"{entry['image']}: empty")
            elif str(path).endswith(op_library.COMPRESSED_SUFFIX) and not _zlib_header(head):
                bad.append(f"{entry['image']}: not zlib data")
        return bad

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

    def image_for(self, capability: tuple[int, int], driver: Optional[tuple[int, int]] = None,
                  among: Optional[list] = None) -> archs.ImageChoice:
        """The image a device of ``capability`` runs, among those a driver of release ``driver``
        (``None``: unknown) can load (and, given ``among``, of those architectures only)."""
        loadable, refused = [], []
        for arch in self.archs if among is None else [a for a in self.archs if a in among]:
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


def _zlib_header(head: bytes) -> bool:
    """RFC 1950: deflate (method 8) and a header checksum that divides by 31."""
    return len(head) == 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0


def _entry_requirement(entry: dict) -> Optional[tuple[int, int]]:
    text = entry.get("ptx_isa") if entry["arch"].startswith("compute_") else entry.get("ptxas")
    if not text:
        return None
    major, minor = (int(x) for x in _VERSION_RE.match(text).group(0).split("."))
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
            except (OSError, ValueError, RecursionError) as exc:  # ManifestError is a ValueError
                _manifest_cache[key] = f"cannot read {folder / 'manifest.json'}: {exc}"
    value = _manifest_cache[key]
    return (value, "") if isinstance(value, Manifest) else (None, str(value))


def driver_release() -> Optional[tuple[int, int]]:
    """The CUDA release the NVIDIA driver supports (e.g. ``(13, 0)``), as the op library's CUDA
    runtime reads it; ``None`` when unknown."""
    version = op_library.cuda_info()["driver_version"]
    return (version // 1000, version % 1000 // 10) if version > 0 else None
