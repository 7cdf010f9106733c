"""The doctor's probes: each ``probe_*`` looks at one part of the machine, returns plain JSON-able
data and never raises, so tests replace them (``monkeypatch.setattr(probes, "probe_torch", ...)``)
to simulate a machine (a GPU, an old driver, a CPU PyTorch) on any machine. Triton is optional
and imported only inside its probe.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from flash_attn import _version, dispatch
from flash_attn.aot import library as op_library, manifest as aot_manifest
from flash_attn.aot.archs import parse_arch
from flash_attn.doctor import install, nvidia, symbols

# Compiled extensions of upstream flash-attn that, when left behind, break in telling ways.
FOREIGN_EXTENSIONS = ("flash_attn_2_cuda",)


def error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def probe_python() -> dict:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "platform": platform.platform(),
    }


def probe_package() -> dict:
    """This package: version, folder, and how it got there (conda, pip, editable, source tree)."""
    this_dir = install.package_dir()
    this_init = this_dir / "__init__.py"
    info: dict[str, Any] = {"version": getattr(_version, "__version__", "unknown"), "location": str(this_dir),
                            "install": "unknown", "distributions": []}
    try:
        records = [install.dist_record(d, this_init) for d in install.distributions()]
    except Exception as exc:  # noqa: BLE001
        records = []
        info["distributions_error"] = error_text(exc)
    info["distributions"] = records
    conda = None
    try:
        conda = install.conda_record(this_init)
    except Exception:  # noqa: BLE001
        pass
    ours = next((r for r in records if r["owns_this_package"]), None)
    if conda is not None:
        info["install"] = "conda"
        info["conda"] = conda
    elif ours is not None and ours["editable"]:
        info["install"] = "editable"
        info["source"] = ours["source"]
    elif ours is not None:
        info["install"] = ours["installer"] or "pip"
    else:
        info["install"] = "source tree (not installed)"
    if ours is not None:
        info["installer"] = ours["installer"]
    return info


def _cuda_available(torch: Any, info: dict) -> bool:
    """``torch.cuda.is_available()``, keeping its warning (e.g. a driver too old) as a fact."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = torch.cuda.is_available()
        except Exception as exc:  # noqa: BLE001
            available = False
            info["cuda_error"] = error_text(exc)
    messages = [str(w.message).strip() for w in caught]
    if messages:
        info["cuda_warning"] = " ".join(messages)
    return bool(available)


def _torch_devices(torch: Any, info: dict) -> list[dict]:
    devices = []
    try:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            device = {
                "index": index,
                "name": props.name,
                "capability": [props.major, props.minor],
                "memory_bytes": int(props.total_memory),
            }
            if info.get("hip"):  # an AMD GPU: its gcnArchName names it (the capability is a stand-in)
                device["gcn_arch"] = getattr(props, "gcnArchName", None)
            devices.append(device)
    except Exception as exc:  # noqa: BLE001
        info["cuda_error"] = error_text(exc)
    return devices


def probe_torch() -> dict:
    """PyTorch: version, build (CPU/CUDA/ROCm), C++ ABI, and the GPUs it can use."""
    info: dict[str, Any] = {"installed": False}
    try:
        import torch  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        info["error"] = error_text(exc)
        return info
    info.update(
        installed=True,
        version=torch.__version__,
        location=str(Path(torch.__file__).parent),
        cuda=torch.version.cuda,
        hip=getattr(torch.version, "hip", None),
        cxx11_abi=bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
    )
    info["build"] = "ROCm" if info["hip"] else ("CUDA" if info["cuda"] else "CPU")
    info["cuda_available"] = _cuda_available(torch, info)
    info["devices"] = _torch_devices(torch, info) if info["cuda_available"] else []
    mps = getattr(torch.backends, "mps", None)
    info["mps_available"] = bool(mps is not None and mps.is_available())
    xpu = getattr(torch, "xpu", None)
    try:
        info["xpu_available"] = bool(xpu is not None and xpu.is_available())
    except Exception:  # noqa: BLE001  (a broken XPU runtime is no XPU)
        info["xpu_available"] = False
    return info


def probe_driver() -> dict:
    """The NVIDIA driver as the driver API (libcuda) sees it, independent of PyTorch's build."""
    info: dict[str, Any] = {
        "found": False, "source": "libcuda", "library": None, "release": nvidia.kernel_module_release(),
        "cuda_version": None, "devices": [], "error": None,
    }
    try:
        if not nvidia.read_libcuda(info):
            nvidia.read_nvidia_smi(info)
    except Exception as exc:  # noqa: BLE001
        info["error"] = error_text(exc)
    info["cuda_version_text"] = nvidia.cuda_version_text(info["cuda_version"])
    return info


def probe_op_library() -> dict:
    """The op library (``flash_attn/_C``): loaded or why not, its build configuration."""
    try:
        status = op_library.status()
    except Exception as exc:  # noqa: BLE001  (status() should never raise; a doctor double-checks)
        return {"loaded": False, "path": None, "reason": error_text(exc), "build_config": {}, "installed": False}
    info = {
        "loaded": status.loaded,
        "path": status.path,
        "reason": status.reason,
        "build_config": dict(status.build_config),
        "installed": status.path is not None and Path(status.path).is_file(),
        "from_env": status.from_env,
    }
    if status.loaded and status.build_config.get("cuda", True):
        try:
            info["cuda_info"] = op_library.cuda_info()
        except Exception as exc:  # noqa: BLE001
            info["cuda_info_error"] = error_text(exc)
    return info


def _archs_in(manifest: Any) -> list[str]:
    """Architecture names in a manifest: a top-level ``archs`` list, else every ``arch`` value."""
    if isinstance(manifest, dict) and isinstance(manifest.get("archs"), list):
        return [str(a) for a in manifest["archs"]]
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "arch" and isinstance(value, str):
                    if value not in found:
                        found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(manifest)
    return found


def probe_kernels() -> dict:
    """The ahead-of-time kernel images the ``aot`` backend would load: the manifest it finds
    (``$FLASH_ATTN_AOT_DIR``, else ``_aot/`` in the package) and its architectures."""
    info: dict[str, Any] = {"manifest": None, "archs": [], "error": None,
                            "from_env": bool(os.environ.get(aot_manifest.DIR_ENV))}
    try:
        folder = aot_manifest.find_manifest_dir()
        if folder is None:
            return info
        info["manifest"] = str(Path(folder) / "manifest.json")
        loaded, why_not = aot_manifest.manifest()
        if loaded is None:
            info["error"] = why_not
            return info
        usable = set(loaded.archs)  # the architectures of entries that passed the manifest's checks
        named = [a for a in _archs_in(loaded.data) if a in usable]
        info["archs"] = [parse_arch(a).name for a in named + sorted(usable - set(named))]
    except Exception as exc:  # noqa: BLE001  (a malformed manifest is reported, not raised)
        info["error"] = f"cannot read {info['manifest']}: {error_text(exc)}"
        return info
    info["kernel_count"] = len(loaded.entries)
    unusable = loaded.unusable_images()
    if unusable:  # image files that are gone or damaged: all of them, the warning at a call names one
        info["unusable_images"] = unusable
    if loaded.problems:  # entries left out (never used): how many, and the first few reasons
        info["invalid_entries"] = {"count": len(loaded.problems), "first": loaded.problems[:3]}
    return info


def probe_triton() -> dict:
    if importlib.util.find_spec("triton") is None:
        return {"installed": False, "error": "not installed"}
    try:
        import triton  # noqa: PLC0415  (optional)
    except Exception as exc:  # noqa: BLE001
        return {"installed": False, "error": f"cannot be imported: {error_text(exc)}"}
    return {"installed": True, "version": getattr(triton, "__version__", "unknown"),
            "location": str(Path(triton.__file__).parent)}


def probe_copies() -> dict:
    """Every ``flash_attn`` package reachable through ``sys.path``, and which one wins."""
    this_dir = install.package_dir()
    copies = []
    seen: set[Path] = set()
    for position, entry in enumerate(sys.path):
        candidate = Path(entry or os.getcwd()) / "flash_attn"
        try:
            if not (candidate / "__init__.py").is_file():
                continue
            resolved = candidate.resolve()
        except OSError:
            continue
        if resolved in seen:
            continue
        seen.add(resolved)
        copies.append({"path": str(resolved), "sys_path_index": position, "version": install.read_version(resolved),
                       "kind": install.describe_copy(resolved), "is_this": resolved == this_dir})
    if this_dir not in seen:
        # Reached through a meta-path finder (an editable install) rather than a sys.path entry.
        copies.append({"path": str(this_dir), "sys_path_index": None, "version": install.read_version(this_dir),
                       "kind": "this package", "is_this": True})
    resolved = install.import_resolution("flash_attn")
    return {"this": str(this_dir), "import_resolves_to": resolved, "copies": copies}


def _import_extension(name: str, entry: dict) -> None:
    try:
        # upstream's extension links libtorch: torch must be loaded first, as upstream does.
        import torch  # noqa: F401, PLC0415

        importlib.import_module(name)
        entry["imports"] = True
    except BaseException as exc:  # noqa: BLE001  (an extension's init can raise anything)
        entry["error"] = error_text(exc)
        match = re.search(r"undefined symbol: (\S+)", str(exc))
        if match:
            entry["undefined_symbol"] = symbols.explain_undefined_symbol(match.group(1), probe_torch())


def probe_foreign_extensions() -> list[dict]:
    """Compiled extensions of upstream flash-attn on ``sys.path``: do they import, and if not, why."""
    results = []
    for name in FOREIGN_EXTENSIONS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        entry: dict[str, Any] = {"module": name, "path": spec.origin, "imports": False}
        _import_extension(name, entry)
        results.append(entry)
    return results


def _backend_on(device: Any, requested: str, info: dict) -> dict:
    """What ``auto`` picks on one device, why Triton cannot run, and why the requested one cannot."""
    entry: dict[str, Any] = {"index": device.index}
    try:
        choice, reasons = dispatch.auto_choice(device)
        entry.update(auto=choice, reasons=reasons)
    except Exception as exc:  # noqa: BLE001
        entry.update(auto="reference", reasons=[f"auto_choice failed: {error_text(exc)}"])
    try:
        entry["triton_reason"] = dispatch.unavailable_reason("triton", device)
    except Exception as exc:  # noqa: BLE001
        entry["triton_reason"] = error_text(exc)
    if requested not in ("", "auto") and "requested_error" not in info:
        try:
            entry["requested_reason"] = dispatch.unavailable_reason(requested, device)
        except Exception as exc:  # noqa: BLE001
            entry["requested_reason"] = error_text(exc)
    return entry


def route_of(device: Any) -> dict:
    """What a call on ``device`` does with the environment as set (:func:`flash_attn.dispatch.route`,
    the dispatcher's own decision): the backends it runs on, or the error every call raises."""
    try:
        decided = dispatch.route(device)
    except Exception as exc:  # noqa: BLE001  (a doctor reports, never raises)
        return {"device": str(device), "backends": [], "error": f"the dispatcher's decision failed: {error_text(exc)}",
                "passed_over": []}
    return {"device": str(device), "backends": list(decided.backends),
            "error": None if decided.error is None else str(decided.error), "passed_over": list(decided.passed_over)}


def probe_backends(torch_info: dict) -> dict:
    """``FLASH_ATTN_BACKEND``, what a call on each device does (``routes``: the CPU, every GPU
    PyTorch can use, MPS) and what ``auto`` picks on each GPU (``devices``)."""
    import torch  # noqa: PLC0415

    info: dict[str, Any] = {"requested": os.environ.get(dispatch.BACKEND_ENV, "auto"), "devices": [], "routes": [],
                            "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLASH_ATTN_")}}
    try:
        dispatch.requested_backend()
    except ValueError as exc:
        info["requested_error"] = str(exc)
    gpus = [torch.device("cuda", d["index"]) for d in torch_info.get("devices", [])] \
        if torch_info.get("cuda_available") else []
    others = [torch.device("mps")] if torch_info.get("mps_available") else []
    info["routes"] = [route_of(device) for device in [torch.device("cpu"), *gpus, *others]]
    requested = info["requested"].strip().lower()
    for device in gpus:
        info["devices"].append(_backend_on(device, requested, info))
    return info
