"""How this package was installed and which other ``flash_attn`` copies are around, read from
distribution metadata, ``conda-meta`` and the folders on ``sys.path``; nothing is imported."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional


def package_dir() -> Path:
    """The folder of this ``flash_attn`` package."""
    return Path(__file__).resolve().parents[1]


def distributions() -> list[importlib.metadata.Distribution]:
    """Distributions that are flash-attn under any spelling, or that ship ``flash_attn/``."""
    found = []
    for dist in importlib.metadata.distributions():
        try:
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        except Exception:  # noqa: BLE001  (a broken .dist-info must not break the doctor)
            continue
        if name == "flash-attn" or name.startswith("flash-attn-"):
            found.append(dist)
    return found


def _direct_url(dist: importlib.metadata.Distribution) -> tuple[bool, Optional[str]]:
    """(editable, source folder) from PEP 610's ``direct_url.json``."""
    text = dist.read_text("direct_url.json")
    if not text:
        return False, None
    try:
        data = json.loads(text)
    except ValueError:
        data = {}
    url = data.get("url", "")
    return bool(data.get("dir_info", {}).get("editable")), url[len("file://") :] if url.startswith("file://") else None


def _package_init(dist: importlib.metadata.Distribution, editable: bool, source: Optional[str]) -> Optional[Path]:
    if editable and source:
        return Path(source) / "flash_attn" / "__init__.py"
    for file in dist.files or ():
        if str(file).replace("\\", "/") == "flash_attn/__init__.py":
            return Path(dist.locate_file(file))
    return None


def dist_record(dist: importlib.metadata.Distribution, this_init: Path) -> dict:
    """One installed distribution: where, by what installer, and whether it owns ``this_init``."""
    record: dict[str, Any] = {
        "name": dist.metadata["Name"], "version": dist.version, "location": None, "installer": None,
        "editable": False, "source": None, "owns_this_package": False, "package_dir": None,
    }
    try:
        record["location"] = str(Path(dist.locate_file("")).resolve())
    except Exception:  # noqa: BLE001
        pass
    installer = dist.read_text("INSTALLER")
    record["installer"] = installer.strip() if installer else None
    record["editable"], record["source"] = _direct_url(dist)
    package_init = _package_init(dist, record["editable"], record["source"])
    if package_init is not None:
        record["package_dir"] = str(package_init.resolve().parent)
        record["owns_this_package"] = package_init.resolve() == this_init
    return record


def conda_record(this_init: Path) -> Optional[dict]:
    """The conda package that installed this copy, from ``<prefix>/conda-meta/*.json``."""
    meta = Path(sys.prefix) / "conda-meta"
    if not meta.is_dir():
        return None
    for path in sorted(meta.glob("flash[-_]attn*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for file in data.get("files", ()):
            if file.replace("\\", "/").endswith("flash_attn/__init__.py"):
                if (Path(sys.prefix) / file).resolve() == this_init:
                    return {
                        "name": data.get("name"),
                        "version": data.get("version"),
                        "build": data.get("build"),
                        "channel": data.get("channel") or data.get("url"),
                    }
    return None


def read_version(package_dir: Path) -> Optional[str]:
    """``__version__`` of a ``flash_attn`` folder, read from its files."""
    for name in ("_version.py", "__init__.py", "version.py"):
        try:
            text = (package_dir / name).read_text(errors="replace")
        except OSError:
            continue
        match = re.search(r"__version__\s*=\s*[\"']([^\"']+)[\"']", text)
        if match:
            return match.group(1)
    return None


def describe_copy(folder: Path) -> str:
    """What kind of flash_attn this folder holds, judged from its files."""
    if folder.resolve() == package_dir():
        return "this package"
    try:
        text = (folder / "flash_attn_interface.py").read_text(errors="replace")
    except OSError:
        text = ""
    if "flash_attn_2_cuda" in text:
        return "upstream flash-attn (Dao-AILab), which needs its compiled flash_attn_2_cuda extension"
    if (folder / "cute").is_dir():
        return "upstream flash-attn 4 (CuTe DSL)"
    return "an unknown flash_attn package"


def import_resolution(name: str) -> Optional[str]:
    """Where a fresh ``import name`` would come from under the current ``sys.path`` and finders."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, None)
        except Exception:  # noqa: BLE001
            continue
        if spec is None:
            continue
        # The origin (the package's __init__.py) first: an editable install's finder may list a
        # folder holding only build outputs (scikit-build-core: _C/, _aot/) before the sources.
        if spec.origin and spec.has_location:
            return str(Path(spec.origin).resolve().parent)
        if spec.submodule_search_locations:
            return str(Path(list(spec.submodule_search_locations)[0]).resolve())
    return None
