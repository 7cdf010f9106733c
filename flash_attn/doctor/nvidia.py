"""The NVIDIA driver and its GPUs as the driver itself reports them (the driver API in ``libcuda``,
else ``nvidia-smi``), so they are seen even by a CPU build of PyTorch. Each function fills or
returns plain data; :func:`flash_attn.doctor.probes.probe_driver` catches what they raise."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

# Driver API device attributes.
COMPUTE_CAPABILITY_MAJOR, COMPUTE_CAPABILITY_MINOR = 75, 76


def cuda_version_text(encoded: Optional[int]) -> Optional[str]:
    """12040 -> "12.4" (the driver API's encoding)."""
    if not encoded:
        return None
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def kernel_module_release() -> Optional[str]:
    """The NVIDIA kernel module's version (e.g. "550.54.14"), Linux only."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return match.group(1) if match else None


def _library_names() -> list[str]:
    if sys.platform.startswith("win"):
        return ["nvcuda.dll"]
    if sys.platform == "darwin":
        return []
    names = ["libcuda.so.1", "libcuda.so"]
    found = ctypes.util.find_library("cuda")
    if found and found not in names:
        names.append(found)
    return names


def _open_libcuda(info: dict) -> Optional[ctypes.CDLL]:
    errors = []
    for name in _library_names():
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
            continue
        info["library"] = name
        return lib
    info["error"] = "no NVIDIA driver library (" + ("; ".join(errors) or "not a Linux/Windows system") + ")"
    return None


def _error_name(lib: ctypes.CDLL, code: int) -> str:
    text = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value:
            return f"{text.value.decode()} ({code})"
    except Exception:  # noqa: BLE001
        pass
    return str(code)


def _libcuda_device(lib: ctypes.CDLL, index: int) -> Optional[dict[str, Any]]:
    device = ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(device), index) != 0:
        return None
    name = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(name, 256, device)
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    lib.cuDeviceGetAttribute(ctypes.byref(major), COMPUTE_CAPABILITY_MAJOR, device)
    lib.cuDeviceGetAttribute(ctypes.byref(minor), COMPUTE_CAPABILITY_MINOR, device)
    memory = ctypes.c_size_t(0)
    total_mem = getattr(lib, "cuDeviceTotalMem_v2", None) or lib.cuDeviceTotalMem
    total_mem(ctypes.byref(memory), device)
    return {
        "index": index,
        "name": name.value.decode(errors="replace"),
        "capability": [major.value, minor.value],
        "memory_bytes": int(memory.value),
    }


def read_libcuda(info: dict) -> bool:
    """Fill ``info`` from the driver API; False when no driver library could be opened."""
    lib = _open_libcuda(info)
    if lib is None:
        return False
    info["found"] = True
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
        info["cuda_version"] = version.value
    rc = lib.cuInit(0)
    if rc != 0:
        info["error"] = f"cuInit failed: {_error_name(lib, rc)}"
        return True
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        info["error"] = f"cuDeviceGetCount failed: {_error_name(lib, rc)}"
        return True
    devices = (_libcuda_device(lib, index) for index in range(count.value))
    info["devices"].extend(d for d in devices if d is not None)
    return True


def read_nvidia_smi(info: dict) -> None:
    """Fill ``info`` from ``nvidia-smi`` (where no driver library could be opened)."""
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
