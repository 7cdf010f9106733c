"""``python -m flash_attn doctor`` (also the ``flash-attn-doctor`` script): what is installed, what
runs where, and what to fix.

It reports this package (version, location, how it was installed), Python, PyTorch (version, CUDA
version, CPU/CUDA/ROCm build), the NVIDIA driver (asked directly through ``libcuda``, so it is seen
even by a CPU build of PyTorch), every visible GPU, the op library and the GPU architectures this
installation ships kernels for, and which backend ``FLASH_ATTN_BACKEND=auto`` uses on each GPU
(and, when it is not ``aot``, why). Then it explains every problem it finds with a concrete fix:

=========================  ======================================================================
check                      problem
=========================  ======================================================================
``torch-cpu-build``        a CPU build of PyTorch on a machine with an NVIDIA GPU
``driver-too-old``         the driver's CUDA version is older than the major CUDA version that
                           PyTorch (or the op library) was built with
``torch-cuda-unusable``    a CUDA PyTorch that cannot use the GPUs the driver sees
``arch-not-shipped``       a GPU whose architecture has no shipped kernel image (and whether
                           PTX, Triton or only the reference backend covers it)
``triton-missing``         Triton is not installed although a GPU needs it
``shadowed``               another ``flash_attn`` earlier on ``sys.path`` (e.g. upstream's wheel)
``other-copy``             another ``flash_attn`` later on ``sys.path`` / a second distribution
``foreign-extension``      a ``flash_attn_2_cuda`` that does not import; an ``undefined symbol``
                           is demangled and explained (C++ ABI / PyTorch version mismatch)
``op-library``             the op library (``flash_attn/_C``) fails to load, or is missing
``gpu-backend``            a GPU that runs on the (slow) reference backend or only on Triton
``backend-env``            ``FLASH_ATTN_BACKEND`` is invalid or cannot run on a GPU
=========================  ======================================================================

Exit status: 0 when no problem (``error``) was found, 1 otherwise (``--strict``: warnings too).
``--json`` prints the same facts and findings as one JSON object.

Every probe is a module-level function (``probe_*``) that never raises, so tests replace them to
simulate a machine (a GPU, an old driver, a CPU PyTorch) on any machine.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from flash_attn import limits

# Oldest Linux driver of each CUDA major version (NVIDIA's CUDA compatibility tables).
MIN_DRIVER_FOR_CUDA_MAJOR = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# Where the kernel build puts the manifest of shipped images, relative to a folder of the package.
MANIFEST_LOCATIONS = ("_aot/manifest.json", "_C/manifest.json", "aot/manifest.json", "manifest.json")
# Compiled extensions of upstream flash-attn that, when left behind, break in telling ways.
FOREIGN_EXTENSIONS = ("flash_attn_2_cuda",)
# The oldest GPU the Triton kernels support.
TRITON_MIN_CAPABILITY = limits.MIN_CAPABILITY

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    """One diagnosis: ``check`` is a stable id (see the module docstring)."""

    check: str
    severity: str  # "error" | "warning" | "info"
    summary: str
    detail: str = ""
    fix: str = ""


@dataclass
class Report:
    facts: dict
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def exit_status(self, strict: bool = False) -> int:
        return 1 if self.errors or (strict and self.warnings) else 0

    def to_json(self, strict: bool = False) -> dict:
        return {
            **self.facts,
            "findings": [asdict(f) for f in self.findings],
            "healthy": not self.errors,
            "exit_status": self.exit_status(strict),
        }


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _this_package_dir() -> Path:
    return Path(__file__).resolve().parent


def _cuda_version_text(encoded: Optional[int]) -> Optional[str]:
    """12040 -> "12.4" (the driver API's encoding)."""
    if not encoded:
        return None
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def _major(version: Optional[str]) -> Optional[int]:
    if not version:
        return None
    match = re.match(r"(\d+)", str(version))
    return int(match.group(1)) if match else None


def _version_tuple(version: Optional[str]) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version or "")[:2])


# =============================================================================================
# Probes: each returns plain data (JSON-able) and never raises.
# =============================================================================================


def probe_python() -> dict:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "platform": platform.platform(),
    }


def _distributions() -> list[importlib.metadata.Distribution]:
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


def _dist_record(dist: importlib.metadata.Distribution, this_init: Path) -> dict:
    record: dict[str, Any] = {
        "name": dist.metadata["Name"],
        "version": dist.version,
        "location": None,
        "installer": None,
        "editable": False,
        "source": None,
        "owns_this_package": False,
        "package_dir": None,
    }
    try:
        record["location"] = str(Path(dist.locate_file("")).resolve())
    except Exception:  # noqa: BLE001
        pass
    installer = dist.read_text("INSTALLER")
    record["installer"] = installer.strip() if installer else None
    direct_url = dist.read_text("direct_url.json")
    if direct_url:
        try:
            data = json.loads(direct_url)
        except ValueError:
            data = {}
        record["editable"] = bool(data.get("dir_info", {}).get("editable"))
        url = data.get("url", "")
        if url.startswith("file://"):
            record["source"] = url[len("file://") :]
    package_init: Optional[Path] = None
    if record["editable"] and record["source"]:
        package_init = Path(record["source"]) / "flash_attn" / "__init__.py"
    else:
        for file in dist.files or ():
            if str(file).replace("\\", "/") == "flash_attn/__init__.py":
                package_init = Path(dist.locate_file(file))
                break
    if package_init is not None:
        record["package_dir"] = str(package_init.resolve().parent)
        record["owns_this_package"] = package_init.resolve() == this_init
    return record


def _conda_record(this_init: Path) -> Optional[dict]:
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


def probe_package() -> dict:
    """This package: version, folder, and how it got there."""
    this_dir = _this_package_dir()
    this_init = this_dir / "__init__.py"
    try:
        from flash_attn._version import __version__ as version  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        version = f"unknown ({_error_text(exc)})"
    info: dict[str, Any] = {"version": version, "location": str(this_dir), "install": "unknown", "distributions": []}
    try:
        records = [_dist_record(d, this_init) for d in _distributions()]
    except Exception as exc:  # noqa: BLE001
        records = []
        info["distributions_error"] = _error_text(exc)
    info["distributions"] = records
    conda = None
    try:
        conda = _conda_record(this_init)
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


def probe_torch() -> dict:
    info: dict[str, Any] = {"installed": False}
    try:
        import torch  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        info["error"] = _error_text(exc)
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
    devices = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = torch.cuda.is_available()
        except Exception as exc:  # noqa: BLE001
            available = False
            info["cuda_error"] = _error_text(exc)
    messages = [str(w.message).strip() for w in caught]
    if messages:
        info["cuda_warning"] = " ".join(messages)
    info["cuda_available"] = bool(available)
    if available:
        try:
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                devices.append({
                    "index": index,
                    "name": props.name,
                    "capability": [props.major, props.minor],
                    "memory_bytes": int(props.total_memory),
                })
        except Exception as exc:  # noqa: BLE001
            info["cuda_error"] = _error_text(exc)
    info["devices"] = devices
    mps = getattr(torch.backends, "mps", None)
    info["mps_available"] = bool(mps is not None and mps.is_available())
    return info


def _driver_release() -> Optional[str]:
    """The NVIDIA kernel module's version (e.g. "550.54.14"), Linux only."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return match.group(1) if match else None


def _driver_library_names() -> list[str]:
    if sys.platform.startswith("win"):
        return ["nvcuda.dll"]
    if sys.platform == "darwin":
        return []
    names = ["libcuda.so.1", "libcuda.so"]
    found = ctypes.util.find_library("cuda")
    if found and found not in names:
        names.append(found)
    return names


def _probe_libcuda(info: dict) -> bool:
    """Fill ``info`` from the driver API; False when no driver library could be opened."""
    errors = []
    lib = None
    for name in _driver_library_names():
        try:
            lib = ctypes.CDLL(name)
            info["library"] = name
            break
        except OSError as exc:
            errors.append(str(exc))
    if lib is None:
        info["error"] = "no NVIDIA driver library (" + ("; ".join(errors) or "not a Linux/Windows system") + ")"
        return False
    info["found"] = True

    def error_name(code: int) -> str:
        text = ctypes.c_char_p()
        try:
            if lib.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value:
                return f"{text.value.decode()} ({code})"
        except Exception:  # noqa: BLE001
            pass
        return str(code)

    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
        info["cuda_version"] = version.value
    rc = lib.cuInit(0)
    if rc != 0:
        info["error"] = f"cuInit failed: {error_name(rc)}"
        return True
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        info["error"] = f"cuDeviceGetCount failed: {error_name(rc)}"
        return True
    total_mem = getattr(lib, "cuDeviceTotalMem_v2", None) or lib.cuDeviceTotalMem
    for index in range(count.value):
        device = ctypes.c_int(0)
        if lib.cuDeviceGet(ctypes.byref(device), index) != 0:
            continue
        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(name, 256, device)
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # COMPUTE_CAPABILITY_MAJOR
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # COMPUTE_CAPABILITY_MINOR
        memory = ctypes.c_size_t(0)
        total_mem(ctypes.byref(memory), device)
        info["devices"].append({
            "index": index,
            "name": name.value.decode(errors="replace"),
            "capability": [major.value, minor.value],
            "memory_bytes": int(memory.value),
        })
    return True


def _probe_nvidia_smi(info: dict) -> None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,compute_cap,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        info["error"] = f"{info.get('error') or ''}; nvidia-smi failed: {exc}".lstrip("; ")
        return
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        index, name, cap, mem_mib, release = parts[:5]
        cap_parts = cap.split(".")
        info["devices"].append({
            "index": int(index),
            "name": name,
            "capability": [int(cap_parts[0]), int(cap_parts[1])] if len(cap_parts) == 2 else None,
            "memory_bytes": int(float(mem_mib) * (1 << 20)) if mem_mib.replace(".", "").isdigit() else None,
        })
        info["release"] = info["release"] or release
    if info["devices"]:
        info["found"] = True
        info["source"] = "nvidia-smi"


def probe_driver() -> dict:
    """The NVIDIA driver as the driver API (libcuda) sees it, independent of PyTorch's build."""
    info: dict[str, Any] = {
        "found": False, "source": "libcuda", "library": None, "release": _driver_release(),
        "cuda_version": None, "devices": [], "error": None,
    }
    try:
        if not _probe_libcuda(info):
            _probe_nvidia_smi(info)
    except Exception as exc:  # noqa: BLE001
        info["error"] = _error_text(exc)
    info["cuda_version_text"] = _cuda_version_text(info["cuda_version"])
    return info


def probe_op_library() -> dict:
    from flash_attn import _aot_library  # noqa: PLC0415

    try:
        status = _aot_library.status()
    except Exception as exc:  # noqa: BLE001  (status() should never raise; a doctor double-checks)
        return {"loaded": False, "path": None, "reason": _error_text(exc), "build_config": {}, "installed": False}
    info = {
        "loaded": status.loaded,
        "path": status.path,
        "reason": status.reason,
        "build_config": dict(status.build_config),
        "installed": status.path is not None and Path(status.path).is_file(),
    }
    if status.loaded and status.build_config.get("cuda", True):
        try:
            info["cuda_info"] = _aot_library.cuda_info()
        except Exception as exc:  # noqa: BLE001
            info["cuda_info_error"] = _error_text(exc)
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
    """The ahead-of-time kernel images this installation ships (``manifest.json``)."""
    import flash_attn  # noqa: PLC0415
    from flash_attn.aot_images import parse_arch  # noqa: PLC0415

    info: dict[str, Any] = {"manifest": None, "archs": [], "error": None}
    for folder in flash_attn.__path__:
        for relative in MANIFEST_LOCATIONS:
            candidate = Path(folder) / relative
            if candidate.is_file():
                info["manifest"] = str(candidate)
                break
        if info["manifest"]:
            break
    if info["manifest"] is None:
        return info
    try:
        manifest = json.loads(Path(info["manifest"]).read_text())
        archs = [parse_arch(a).name for a in _archs_in(manifest)]
    except (OSError, ValueError) as exc:
        info["error"] = f"cannot read {info['manifest']}: {_error_text(exc)}"
        return info
    info["archs"] = archs
    if isinstance(manifest, dict) and isinstance(manifest.get("kernels"), (list, dict)):
        info["kernel_count"] = len(manifest["kernels"])
    return info


def probe_triton() -> dict:
    if importlib.util.find_spec("triton") is None:
        return {"installed": False, "error": "not installed"}
    try:
        import triton  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        return {"installed": False, "error": f"cannot be imported: {_error_text(exc)}"}
    return {"installed": True, "version": getattr(triton, "__version__", "unknown"), "location": str(Path(triton.__file__).parent)}


def _read_version(package_dir: Path) -> Optional[str]:
    for name in ("_version.py", "__init__.py", "version.py"):
        try:
            text = (package_dir / name).read_text(errors="replace")
        except OSError:
            continue
        match = re.search(r"__version__\s*=\s*[\"']([^\"']+)[\"']", text)
        if match:
            return match.group(1)
    return None


def _describe_copy(package_dir: Path) -> str:
    """What kind of flash_attn this folder holds, judged from its files (it is not imported)."""
    if package_dir.resolve() == _this_package_dir():
        return "this package"
    interface = package_dir / "flash_attn_interface.py"
    try:
        text = interface.read_text(errors="replace")
    except OSError:
        text = ""
    if "flash_attn_2_cuda" in text:
        return "upstream flash-attn (Dao-AILab), which needs its compiled flash_attn_2_cuda extension"
    if (package_dir / "cute").is_dir():
        return "upstream flash-attn 4 (CuTe DSL)"
    return "an unknown flash_attn package"


def _import_resolution(name: str) -> Optional[str]:
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


def probe_copies() -> dict:
    """Every ``flash_attn`` package reachable through ``sys.path``, and which one wins."""
    this_dir = _this_package_dir()
    copies = []
    seen: set[Path] = set()
    for position, entry in enumerate(sys.path):
        base = Path(entry or os.getcwd())
        candidate = base / "flash_attn"
        try:
            if not (candidate / "__init__.py").is_file():
                continue
            resolved = candidate.resolve()
        except OSError:
            continue
        if resolved in seen:
            continue
        seen.add(resolved)
        copies.append({
            "path": str(resolved),
            "sys_path_index": position,
            "version": _read_version(resolved),
            "kind": _describe_copy(resolved),
            "is_this": resolved == this_dir,
        })
    if this_dir not in seen:
        # Reached through a meta-path finder (an editable install) rather than a sys.path entry.
        copies.append({"path": str(this_dir), "sys_path_index": None, "version": _read_version(this_dir),
                       "kind": "this package", "is_this": True})
    resolved = _import_resolution("flash_attn")
    return {"this": str(this_dir), "import_resolves_to": resolved, "copies": copies}


def _demangle_cxa(symbol: str) -> Optional[str]:
    names = ["libstdc++.so.6", ctypes.util.find_library("stdc++"), ctypes.util.find_library("c++abi")]
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)
            libc = ctypes.CDLL(None)
        except OSError:
            continue
        fn = getattr(lib, "__cxa_demangle", None)
        if fn is None:
            continue
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
        status = ctypes.c_int(0)
        pointer = fn(symbol.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not pointer:
            return None
        try:
            return ctypes.string_at(pointer).decode(errors="replace")
        finally:
            libc.free.argtypes = [ctypes.c_void_p]
            libc.free(pointer)
    return None


def _demangle_cxxfilt(symbol: str) -> Optional[str]:
    exe = shutil.which("c++filt")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, symbol], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out if out and out != symbol else None


def qualified_name_hint(symbol: str) -> Optional[str]:
    """The leading qualified name of an Itanium-mangled symbol without a demangler:
    ``_ZN3c104cuda9SetDeviceEi`` -> ``c10::cuda::SetDevice``."""
    match = re.match(r"_ZN?[KVr]*", symbol)
    if not match:
        return None
    pos, parts = match.end(), []
    while True:
        num = re.match(r"(\d+)", symbol[pos:])
        if not num:
            break
        length = int(num.group(1))
        start = pos + len(num.group(1))
        parts.append(symbol[start : start + length])
        pos = start + length
    return "::".join(parts) or None


def demangle(symbol: str) -> Optional[str]:
    """A C++ symbol in readable form: libstdc++'s ``__cxa_demangle``, else ``c++filt``."""
    if not symbol.startswith("_Z"):
        return None
    return _demangle_cxa(symbol) or _demangle_cxxfilt(symbol)


def explain_undefined_symbol(symbol: str, torch_info: dict) -> dict:
    """What an ``undefined symbol`` in someone else's compiled extension means."""
    readable = demangle(symbol)
    hint = qualified_name_hint(symbol)
    text = readable or hint or symbol
    namespace = (hint or text).split("::")[0]
    torch_namespaces = {"c10", "at", "torch", "caffe2", "aoti_torch"}
    reasons = []
    # Which std::string ABI the missing symbol was compiled with: std::__cxx11 = the C++11 ABI
    # (_GLIBCXX_USE_CXX11_ABI=1); a plain std::basic_string / std::string = the old one.
    if "__cxx11" in symbol:
        wanted_abi: Optional[bool] = True
    elif "basic_string" in (readable or "") or re.search(r"Ss|Sb", symbol[2:]):
        wanted_abi = False
    else:
        wanted_abi = None
    torch_abi = torch_info.get("cxx11_abi")
    if wanted_abi is not None and torch_abi is not None and wanted_abi != torch_abi:
        reasons.append(
            f"a C++ ABI mismatch: the extension was built with _GLIBCXX_USE_CXX11_ABI={int(wanted_abi)} "
            f"(std::string is {'std::__cxx11::basic_string' if wanted_abi else 'the pre-C++11 std::basic_string'}), "
            f"the installed torch with _GLIBCXX_USE_CXX11_ABI={int(torch_abi)}"
        )
    if namespace in torch_namespaces or symbol.startswith(("aoti_torch", "torch_")):
        reasons.append(
            f"it is a PyTorch C++ symbol ({namespace}::...) that the installed torch {torch_info.get('version', '?')} "
            "does not export: the extension was compiled against a different PyTorch version, and PyTorch's C++ "
            "ABI changes between versions"
        )
    if not reasons:
        reasons.append("the library it needs at run time is a different version than the one it was built against")
    return {"symbol": symbol, "demangled": readable, "name": hint, "explanation": "; ".join(reasons)}


def probe_foreign_extensions() -> list[dict]:
    """Compiled extensions of upstream flash-attn on ``sys.path``: do they import, and if not, why."""
    results = []
    torch_info = None
    for name in FOREIGN_EXTENSIONS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        entry: dict[str, Any] = {"module": name, "path": spec.origin, "imports": False}
        try:
            # upstream's extension links libtorch: torch must be loaded first, as upstream does.
            import torch  # noqa: F401, PLC0415

            importlib.import_module(name)
            entry["imports"] = True
        except BaseException as exc:  # noqa: BLE001  (an extension's init can raise anything)
            entry["error"] = _error_text(exc)
            match = re.search(r"undefined symbol: (\S+)", str(exc))
            if match:
                if torch_info is None:
                    torch_info = probe_torch()
                entry["undefined_symbol"] = explain_undefined_symbol(match.group(1), torch_info)
        results.append(entry)
    return results


def probe_backends(torch_info: dict) -> dict:
    """``FLASH_ATTN_BACKEND`` and what ``auto`` picks on each GPU PyTorch can use."""
    from flash_attn import dispatch  # noqa: PLC0415

    info: dict[str, Any] = {"requested": os.environ.get(dispatch.BACKEND_ENV, "auto"), "devices": []}
    try:
        dispatch.requested_backend()
    except ValueError as exc:
        info["requested_error"] = str(exc)
    if not torch_info.get("cuda_available"):
        return info
    import torch  # noqa: PLC0415

    for device in torch_info.get("devices", []):
        dev = torch.device("cuda", device["index"])
        entry: dict[str, Any] = {"index": device["index"]}
        try:
            choice, reasons = dispatch.auto_choice(dev)
            entry.update(auto=choice, reasons=reasons)
        except Exception as exc:  # noqa: BLE001
            entry.update(auto="reference", reasons=[f"auto_choice failed: {_error_text(exc)}"])
        try:
            entry["triton_reason"] = dispatch.unavailable_reason("triton", dev)
        except Exception as exc:  # noqa: BLE001
            entry["triton_reason"] = _error_text(exc)
        requested = info["requested"].strip().lower()
        if requested not in ("", "auto") and "requested_error" not in info:
            try:
                entry["requested_reason"] = dispatch.unavailable_reason(requested, dev)
            except Exception as exc:  # noqa: BLE001
                entry["requested_reason"] = _error_text(exc)
        info["devices"].append(entry)
    return info


def collect() -> dict:
    """All facts, from the probes above."""
    facts: dict[str, Any] = {}
    facts["flash_attn"] = probe_package()
    facts["python"] = probe_python()
    facts["torch"] = probe_torch()
    facts["driver"] = probe_driver()
    facts["op_library"] = probe_op_library()
    facts["aot_kernels"] = probe_kernels()
    facts["triton"] = probe_triton()
    facts["copies"] = probe_copies()
    facts["foreign_extensions"] = probe_foreign_extensions()
    facts["backends"] = probe_backends(facts["torch"]) if facts["torch"].get("installed") else {"devices": []}
    facts["gpus"] = _merge_gpus(facts)
    return facts


def _merge_gpus(facts: dict) -> list[dict]:
    """One row per GPU: PyTorch's view when it has one, else the driver's; plus the backend."""
    from flash_attn.aot_images import select_image  # noqa: PLC0415

    torch_devices = facts["torch"].get("devices") or []
    source = "torch" if torch_devices else "driver"
    devices = torch_devices or facts["driver"].get("devices") or []
    by_index = {d["index"]: d for d in facts["backends"].get("devices", [])}
    shipped = facts["aot_kernels"].get("archs") or []
    gpus = []
    for device in devices:
        gpu = dict(device, seen_by=source)
        cap = device.get("capability")
        if cap:
            gpu["arch"] = f"sm_{cap[0]}{cap[1]}"
            if shipped:
                choice = select_image((cap[0], cap[1]), shipped)
                gpu["image"] = {"kind": choice.kind, "arch": choice.arch.name if choice.arch else None, "reason": choice.reason}
        backend = by_index.get(device["index"])
        if backend is not None:
            gpu["auto"] = backend["auto"]
            gpu["why_not_aot"] = [] if backend["auto"] == "aot" else backend["reasons"]
            gpu["triton_reason"] = backend.get("triton_reason")
            if "requested_reason" in backend:
                gpu["requested_reason"] = backend["requested_reason"]
        else:
            gpu["auto"] = "reference"
            gpu["why_not_aot"] = [_why_torch_cannot_use_gpus(facts)]
        gpus.append(gpu)
    return gpus


def _why_torch_cannot_use_gpus(facts: dict) -> str:
    torch_info = facts["torch"]
    if not torch_info.get("installed"):
        return "PyTorch is not importable"
    if torch_info.get("build") == "CPU":
        return f"PyTorch {torch_info.get('version')} is a CPU build"
    if torch_info.get("build") == "ROCm":
        return "PyTorch is a ROCm build, which cannot drive NVIDIA GPUs"
    return "PyTorch cannot use CUDA: " + (torch_info.get("cuda_warning") or torch_info.get("cuda_error") or "torch.cuda.is_available() is False")


# =============================================================================================
# Diagnosis: facts -> findings.
# =============================================================================================


def _torch_install_fix(cuda_major: Optional[int]) -> str:
    variant = f"CUDA {cuda_major}" if cuda_major else "CUDA"
    return (
        f"install a {variant} build of PyTorch: with conda, `conda install -c conda-forge pytorch "
        f"'cuda-version={cuda_major or 12}.*'`; with pip, the torch wheel for {variant} (a `+cu{cuda_major or 12}x` "
        "build from PyTorch's CUDA wheel index) instead of the CPU one"
    )


def diagnose(facts: dict) -> list[Finding]:
    findings: list[Finding] = []
    add = findings.append
    pkg, torch_info, driver = facts["flash_attn"], facts["torch"], facts["driver"]
    op, kernels, triton = facts["op_library"], facts["aot_kernels"], facts["triton"]
    gpus = facts["gpus"]
    driver_gpus = driver.get("devices") or []
    driver_cuda = driver.get("cuda_version")
    driver_cuda_major = driver_cuda // 1000 if driver_cuda else None

    # --- this package and other copies -----------------------------------------------------------
    copies = facts["copies"]
    this = copies["this"]
    resolves = copies.get("import_resolves_to")
    others = [c for c in copies["copies"] if not c["is_this"]]
    if resolves and Path(resolves) != Path(this):
        other = next((c for c in others if c["path"] == resolves), {"path": resolves, "version": None, "kind": "an unknown flash_attn package"})
        add(Finding(
            "shadowed", "error",
            f"`import flash_attn` loads another copy: {other['path']} (version {other.get('version') or '?'})",
            f"That copy is {other['kind']}; it comes earlier on sys.path than this package ({this}), so every "
            "`import flash_attn` (transformers included) gets it instead of this one.",
            "remove the other copy: `pip uninstall flash-attn` (repeat until pip finds none; the upstream wheel "
            "and this package share the name), delete the folder if pip does not own it, or drop its directory "
            "from PYTHONPATH / run from another working directory; then reinstall this package "
            "(`conda install flash-attn` or `pip install --force-reinstall flash-attn`)",
        ))
    for other in others:
        if resolves and other["path"] == resolves:
            continue
        add(Finding(
            "other-copy", "warning",
            f"another flash_attn is on sys.path: {other['path']} (version {other.get('version') or '?'})",
            f"It is {other['kind']}. This package comes first now, but a different working directory or "
            "PYTHONPATH makes the other one win, and both claim the same distribution name.",
            f"delete {other['path']} (or `pip uninstall` the distribution that installed it)",
        ))
    dists = pkg.get("distributions") or []
    if len(dists) > 1:
        listing = "; ".join(f"{d['name']} {d['version']} at {d['location']}" for d in dists)
        add(Finding(
            "other-copy", "warning", f"{len(dists)} flash-attn distributions are installed",
            f"{listing}. Package metadata (what transformers reads to decide whether flash-attn is usable) may "
            "describe a different copy than the one imported.",
            "keep one: `pip uninstall flash-attn` until none is left, then reinstall this package",
        ))

    # --- foreign extensions ------------------------------------------------------------------------
    for ext in facts["foreign_extensions"]:
        if ext.get("imports"):
            add(Finding("foreign-extension", "info",
                        f"upstream flash-attn's {ext['module']} imports ({ext['path']})",
                        "This package does not use it; the benchmarks compare against it."))
            continue
        undefined = ext.get("undefined_symbol")
        if undefined:
            shown = undefined["demangled"] or undefined["name"] or undefined["symbol"]
            add(Finding(
                "foreign-extension", "warning",
                f"{ext['module']} ({ext['path']}) fails to import: undefined symbol {shown}",
                f"Mangled: {undefined['symbol']}. This is a C++ ABI / PyTorch version mismatch of that other "
                f"build: {undefined['explanation']}. This package does not need it, but anything that imports "
                "upstream flash-attn fails.",
                f"remove the leftover upstream build: `pip uninstall flash-attn` or delete {ext['path']}; "
                "this package needs no extension compiled against your torch",
            ))
        else:
            add(Finding(
                "foreign-extension", "warning",
                f"{ext['module']} ({ext['path']}) fails to import: {ext.get('error')}",
                "A leftover of an upstream flash-attn install.",
                f"remove it: `pip uninstall flash-attn` or delete {ext['path']}",
            ))

    # --- PyTorch vs driver vs GPUs -------------------------------------------------------------------
    torch_cuda_major = _major(torch_info.get("cuda"))
    if not torch_info.get("installed"):
        add(Finding("torch-missing", "error", "PyTorch cannot be imported", torch_info.get("error", ""),
                    "install PyTorch >= 2.10 (`conda install pytorch` or `pip install torch`)"))
    elif torch_info.get("build") == "CPU" and driver_gpus:
        names = ", ".join(d["name"] for d in driver_gpus)
        add(Finding(
            "torch-cpu-build", "error",
            f"PyTorch {torch_info['version']} is a CPU build, but the driver sees {len(driver_gpus)} GPU(s): {names}",
            "Every call runs on the CPU reference backend; the GPU is never used.",
            _torch_install_fix(min(driver_cuda_major, 13) if driver_cuda_major else None)
            + (f" (the driver supports up to CUDA {driver.get('cuda_version_text')})" if driver_cuda else ""),
        ))
    elif torch_info.get("build") == "ROCm":
        add(Finding("torch-rocm", "warning", "PyTorch is a ROCm build",
                    "The GPU kernels of this package target NVIDIA GPUs; AMD GPUs run the reference backend.",
                    "nothing to do for correctness; for speed use an NVIDIA GPU"))
    if torch_cuda_major and driver_cuda_major and driver_cuda_major < torch_cuda_major:
        release = driver.get("release")
        add(Finding(
            "driver-too-old", "error",
            f"the NVIDIA driver ({release or 'version unknown'}, CUDA {driver.get('cuda_version_text')}) is too old "
            f"for PyTorch built with CUDA {torch_info['cuda']}",
            f"CUDA {torch_cuda_major}.x needs a driver >= {MIN_DRIVER_FOR_CUDA_MAJOR.get(torch_cuda_major, '?')}; "
            "PyTorch cannot initialise CUDA and everything falls back to the CPU.",
            f"update the NVIDIA driver to >= {MIN_DRIVER_FOR_CUDA_MAJOR.get(torch_cuda_major, '?')}, or "
            + _torch_install_fix(driver_cuda_major),
        ))
    elif torch_cuda_major and driver_cuda and _version_tuple(driver.get("cuda_version_text")) < _version_tuple(torch_info.get("cuda")):
        add(Finding(
            "driver-too-old", "warning",
            f"the driver supports CUDA {driver.get('cuda_version_text')}, older than PyTorch's CUDA {torch_info['cuda']}",
            "Same major version, so CUDA's minor-version compatibility usually works, but PTX newer than the "
            "driver cannot be JIT-compiled.",
            "update the NVIDIA driver when convenient",
        ))
    runtime = (op.get("build_config") or {}).get("cuda_runtime") or ""
    runtime_major = _major(runtime)
    if runtime_major and driver_cuda_major and driver_cuda_major < runtime_major:
        add(Finding(
            "driver-too-old", "error",
            f"the op library's CUDA runtime {runtime} needs a newer driver (it has CUDA {driver.get('cuda_version_text')})",
            f"The ahead-of-time kernels cannot launch; CUDA {runtime_major}.x needs a driver >= "
            f"{MIN_DRIVER_FOR_CUDA_MAJOR.get(runtime_major, '?')}.",
            f"update the NVIDIA driver, or install the flash-attn build for CUDA {driver_cuda_major} "
            f"(conda: `conda install flash-attn 'cuda-version={driver_cuda_major}.*'`)",
        ))
    if (
        torch_info.get("build") == "CUDA" and driver_gpus and not torch_info.get("cuda_available")
        and not any(f.check == "driver-too-old" and f.severity == "error" for f in findings)
    ):
        add(Finding(
            "torch-cuda-unusable", "error",
            "PyTorch is a CUDA build but cannot use the GPUs the driver sees",
            torch_info.get("cuda_warning") or torch_info.get("cuda_error") or "torch.cuda.is_available() is False",
            "check CUDA_VISIBLE_DEVICES (currently "
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}), that the driver works (`nvidia-smi`), and "
            "that PyTorch's CUDA matches the driver",
        ))
    if driver.get("found") and driver.get("error") and not driver_gpus:
        add(Finding("driver-error", "warning", f"the NVIDIA driver is installed but reports: {driver['error']}",
                    "No GPU can be used.", "check `nvidia-smi`; reboot after a driver update; check CUDA_VISIBLE_DEVICES"))

    # --- op library and shipped kernels -----------------------------------------------------------
    gpu_machine = bool(gpus) and torch_info.get("cuda_available")
    if not op.get("loaded"):
        if op.get("installed"):
            add(Finding("op-library", "error", "the op library fails to load", op.get("reason", ""),
                        "reinstall flash-attn for this PyTorch (`conda install --force-reinstall flash-attn` or "
                        "`pip install --force-reinstall flash-attn`); the library needs torch >= 2.10"))
        elif op.get("path"):
            add(Finding("op-library", "error", "the op library set by FLASH_ATTN_AOT_LIBRARY does not exist",
                        op.get("reason", ""), "unset FLASH_ATTN_AOT_LIBRARY or point it at a built library"))
        else:
            from flash_attn._aot_library import is_cpu_only_build  # noqa: PLC0415

            cpu_only = is_cpu_only_build(op.get("build_config") or {})
            summary = ("this is the CPU-only build of flash-attn: no op library (ahead-of-time kernel launcher)"
                       if cpu_only else "the op library (ahead-of-time kernel launcher) is not installed")
            add(Finding("op-library", "warning" if gpu_machine else "info", summary, op.get("reason", ""),
                        "install the CUDA build of flash-attn" if gpus else "nothing to do on a machine without an NVIDIA GPU"))
    elif gpu_machine and not (op.get("build_config") or {}).get("cuda", True):
        add(Finding("op-library", "warning", "the op library was built without CUDA (FLASH_ATTN_CPU_ONLY)",
                    "The ahead-of-time kernels cannot launch on this GPU machine.",
                    "install the CUDA build of flash-attn"))
    if kernels.get("error"):
        add(Finding("aot-kernels", "error", "the kernel manifest cannot be read", kernels["error"],
                    "reinstall flash-attn"))
    elif not kernels.get("manifest"):
        add(Finding("aot-kernels", "warning" if gpu_machine else "info",
                    "this installation ships no ahead-of-time kernels (no manifest.json)",
                    "GPUs use the Triton backend (compiled on first use) or the reference backend.",
                    "install a CUDA build of flash-attn that ships kernels" if gpu_machine else ""))

    # --- per GPU --------------------------------------------------------------------------------
    requested = facts["backends"].get("requested", "auto")
    if facts["backends"].get("requested_error"):
        add(Finding("backend-env", "error", facts["backends"]["requested_error"], "",
                    "unset FLASH_ATTN_BACKEND or set it to auto|aot|triton|interpret|reference"))
    for gpu in gpus:
        label = f"GPU {gpu['index']} ({gpu.get('name')}, {gpu.get('arch', '?')})"
        cap = tuple(gpu.get("capability") or (0, 0))
        triton_covers = cap >= TRITON_MIN_CAPABILITY and triton.get("installed")
        image = gpu.get("image")
        # Below the kernels' minimum (8.0) no build could ship one: the `gpu-backend` check says so.
        if image and image["kind"] == "unsupported" and cap >= TRITON_MIN_CAPABILITY:
            cover = ("Triton compiles the kernels on first use (slower start, same results)" if triton_covers
                     else "only the exact but slow PyTorch reference backend covers it")
            add(Finding(
                "arch-not-shipped", "warning" if triton_covers else "error",
                f"{label}: no shipped kernel image for this architecture",
                f"{image['reason']}; {cover}.",
                "install a flash-attn build that includes this architecture, or build one: "
                f"FLASH_ATTN_CUDA_ARCHS='{cap[0]}{cap[1]}' pip install --no-build-isolation ."
                + ("" if triton_covers or cap < TRITON_MIN_CAPABILITY else "; or install Triton (`pip install triton`)"),
            ))
        elif image and image["kind"] == "ptx":
            add(Finding("arch-not-shipped", "info", f"{label}: runs shipped PTX ({image['arch']})",
                        f"{image['reason']} on first use (cached afterwards).", ""))
        if "auto" not in gpu or not torch_info.get("cuda_available"):
            continue
        if gpu["auto"] == "reference":
            needs_triton = cap >= TRITON_MIN_CAPABILITY and not triton.get("installed")
            if needs_triton:
                add(Finding(
                    "triton-missing", "error",
                    f"{label}: Triton is not installed, so this GPU runs the slow reference backend",
                    "No ahead-of-time kernel can run here (" + "; ".join(gpu["why_not_aot"]) + ").",
                    "`pip install triton` or `conda install triton` (or install a flash-attn build whose "
                    "kernels include this architecture)",
                ))
            else:
                add(Finding(
                    "gpu-backend", "error" if cap >= TRITON_MIN_CAPABILITY else "warning",
                    f"{label}: auto uses the reference backend",
                    "; ".join(gpu["why_not_aot"]) or "no GPU backend can run",
                    "see the other findings" if cap >= TRITON_MIN_CAPABILITY else
                    "the kernels need compute capability >= 8.0; this GPU gets exact results from the reference backend",
                ))
        elif gpu["auto"] == "triton":
            add(Finding("gpu-backend", "warning", f"{label}: auto uses Triton (JIT), not the ahead-of-time kernels",
                        "; ".join(gpu["why_not_aot"]),
                        "install a CUDA build of flash-attn whose kernels include this GPU's architecture"))
        if requested.strip().lower() not in ("", "auto") and gpu.get("requested_reason"):
            add(Finding("backend-env", "error",
                        f"FLASH_ATTN_BACKEND={requested} cannot run on {label}: calls on it raise",
                        gpu["requested_reason"], "unset FLASH_ATTN_BACKEND (auto picks what can run)"))
    if not triton.get("installed") and not any(f.check == "triton-missing" for f in findings):
        add(Finding("triton-missing", "info", f"Triton is {triton.get('error', 'not installed')}",
                    "Only needed for GPUs without shipped kernels and for FLASH_ATTN_BACKEND=interpret.", ""))
    if torch_info.get("installed") and not driver_gpus and not gpus:
        add(Finding("no-gpu", "info", "no NVIDIA GPU is visible",
                    "All calls use the exact PyTorch reference backend (O(n) memory, slower than a GPU).", ""))
    return findings


def run_checks() -> Report:
    facts = collect()
    return Report(facts, diagnose(facts))


# =============================================================================================
# Output.
# =============================================================================================


def _gib(n: Optional[int]) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n else "?"


def render_text(report: Report, strict: bool = False) -> str:
    f = report.facts
    pkg, py, torch_info, driver = f["flash_attn"], f["python"], f["torch"], f["driver"]
    op, kernels, triton = f["op_library"], f["aot_kernels"], f["triton"]
    install = pkg["install"]
    if install == "editable":
        install = f"editable install of {pkg.get('source')}"
    elif install == "conda" and pkg.get("conda"):
        c = pkg["conda"]
        install = f"conda: {c.get('channel') or '?'}::{c.get('name')}-{c.get('version')}-{c.get('build')}"
    lines = ["flash_attn doctor", ""]
    rows = [("flash_attn", f"{pkg['version']} at {pkg['location']} ({install})"),
            ("Python", f"{py['version']} ({py['executable']})")]
    if torch_info.get("installed"):
        build = torch_info["build"] + (f" {torch_info['cuda']}" if torch_info.get("cuda") else "")
        rows.append(("PyTorch", f"{torch_info['version']} ({build} build; CUDA usable: {'yes' if torch_info.get('cuda_available') else 'no'})"))
    else:
        rows.append(("PyTorch", f"not importable: {torch_info.get('error')}"))
    if driver.get("found"):
        rows.append(("NVIDIA driver", f"{driver.get('release') or '?'} (CUDA {driver.get('cuda_version_text') or '?'})"
                     + (f"; {driver['error']}" if driver.get("error") else "")))
    else:
        rows.append(("NVIDIA driver", "none found"))
    if op.get("loaded"):
        cfg = op.get("build_config") or {}
        rows.append(("op library", f"{op['path']} (CUDA runtime {cfg.get('cuda_runtime') or 'none'})"))
    else:
        rows.append(("op library", f"not loaded: {op.get('reason')}"))
    if kernels.get("manifest"):
        rows.append(("shipped kernels", f"{', '.join(kernels['archs']) or 'none'} ({kernels['manifest']})"))
    else:
        rows.append(("shipped kernels", "none (no manifest.json in the package)"))
    rows.append(("Triton", triton.get("version") if triton.get("installed") else triton.get("error")))
    rows.append(("FLASH_ATTN_BACKEND", f.get("backends", {}).get("requested", "auto")))
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += ["", "GPUs:"]
    if not f["gpus"]:
        lines.append("  none visible; CPU tensors use the reference backend")
    for gpu in f["gpus"]:
        lines.append(f"  [{gpu['index']}] {gpu.get('name')}  {gpu.get('arch', '?')}  {_gib(gpu.get('memory_bytes'))}"
                     f"  -> auto: {gpu.get('auto')}")
        if gpu.get("image"):
            lines.append(f"      image: {gpu['image']['reason']}")
        for reason in gpu.get("why_not_aot") or ():
            lines.append(f"      not aot: {reason}")
    lines += ["", "Findings:"]
    order = {s: i for i, s in enumerate(SEVERITIES)}
    shown = sorted(report.findings, key=lambda x: order[x.severity])
    if not shown:
        lines.append("  none")
    for finding in shown:
        lines.append(f"  [{finding.severity.upper()}] {finding.summary}  ({finding.check})")
        if finding.detail:
            lines.append(f"      why: {finding.detail}")
        if finding.fix:
            lines.append(f"      fix: {finding.fix}")
    lines.append("")
    n_err, n_warn = len(report.errors), len(report.warnings)
    verdict = "healthy" if report.exit_status(strict) == 0 else "problems found"
    lines.append(f"Result: {verdict} ({n_err} error(s), {n_warn} warning(s))")
    return "\n".join(lines)


# =============================================================================================
# Command line.
# =============================================================================================


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object (facts and findings)")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")


def run(args: argparse.Namespace) -> int:
    report = run_checks()
    if args.json:
        print(json.dumps(report.to_json(args.strict), indent=2, default=str))
    else:
        print(render_text(report, args.strict))
    return report.exit_status(args.strict)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``flash-attn-doctor`` console script."""
    parser = argparse.ArgumentParser(prog="flash-attn-doctor", description="check the flash_attn installation")
    add_arguments(parser)
    status = run(parser.parse_args(argv))
    if argv is None:
        sys.exit(status)
    return status


if __name__ == "__main__":
    main()
