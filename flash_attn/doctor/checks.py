"""From facts to findings: one function per check id (the table in :mod:`flash_attn.doctor`), each
taking the facts of :func:`flash_attn.doctor.facts.collect` and returning its findings, in the
order :data:`CHECKS` lists them."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Optional

from flash_attn import dispatch, limits
from flash_attn.aot import forced
from flash_attn.aot.library import LIBRARY_ENV, LIBRARY_NAME, is_cpu_only_build
from flash_attn.aot.manifest import DIR_ENV
from flash_attn.doctor.facts import collect
from flash_attn.doctor.report import Finding, Report
from flash_attn.planning.families import FAMILIES, arch_family

# Oldest Linux driver of each CUDA major version (NVIDIA's CUDA compatibility tables).
MIN_DRIVER_FOR_CUDA_MAJOR = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
MIN_CAPABILITY = limits.MIN_CAPABILITY
MIN_CAPABILITY_TEXT = f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"


def _major(version: Optional[str]) -> Optional[int]:
    if not version:
        return None
    match = re.match(r"(\d+)", str(version))
    return int(match.group(1)) if match else None


def _version_tuple(version: Optional[str]) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version or "")[:2])


def _driver_cuda_major(facts: dict) -> Optional[int]:
    cuda = facts["driver"].get("cuda_version")
    return cuda // 1000 if cuda else None


def _min_driver(cuda_major: int) -> str:
    return MIN_DRIVER_FOR_CUDA_MAJOR.get(cuda_major, "?")


def _label(gpu: dict) -> str:
    return f"GPU {gpu['index']} ({gpu.get('name')}, {gpu.get('arch', '?')})"


def _capability(gpu: dict) -> tuple[int, ...]:
    return tuple(gpu.get("capability") or (0, 0))


def _gpus_torch_uses(facts: dict) -> list[dict]:
    """The GPUs with a backend choice: those a CUDA PyTorch can use."""
    return [g for g in facts["gpus"] if "auto" in g and facts["torch"].get("cuda_available")]


def _gpu_machine(facts: dict) -> bool:
    return bool(facts["gpus"]) and bool(facts["torch"].get("cuda_available"))


def _torch_install_fix(cuda_major: Optional[int]) -> str:
    variant = f"CUDA {cuda_major}" if cuda_major else "CUDA"
    return (
        f"install a {variant} build of PyTorch: with conda, `conda install -c conda-forge pytorch "
        f"'cuda-version={cuda_major or 12}.*'`; with pip, the torch wheel for {variant} (a `+cu{cuda_major or 12}x` "
        "build from PyTorch's CUDA wheel index) instead of the CPU one"
    )


# --- this package and other copies ---------------------------------------------------------------


def shadowed(facts: dict) -> list[Finding]:
    """Another ``flash_attn`` is what ``import flash_attn`` loads."""
    copies = facts["copies"]
    this, resolves = copies["this"], copies.get("import_resolves_to")
    if not resolves or Path(resolves) == Path(this):
        return []
    unknown = {"path": resolves, "version": None, "kind": "an unknown flash_attn package"}
    other = next((c for c in copies["copies"] if not c["is_this"] and c["path"] == resolves), unknown)
    return [Finding(
        "shadowed", "error",
        f"`import flash_attn` loads another copy: {other['path']} (version {other.get('version') or '?'})",
        f"That copy is {other['kind']}; it comes earlier on sys.path than this package ({this}), so every "
        "`import flash_attn` (transformers included) gets it instead of this one.",
        "remove the other copy: `pip uninstall flash-attn` (repeat until pip finds none; the upstream wheel "
        "and this package share the name), delete the folder if pip does not own it, or drop its directory "
        "from PYTHONPATH / run from another working directory; then reinstall this package "
        "(`conda install flash-attn` or `pip install --force-reinstall flash-attn`)",
    )]


def other_copy(facts: dict) -> list[Finding]:
    """Another ``flash_attn`` later on ``sys.path``, or more than one flash-attn distribution."""
    resolves = facts["copies"].get("import_resolves_to")
    findings = [Finding(
        "other-copy", "warning",
        f"another flash_attn is on sys.path: {other['path']} (version {other.get('version') or '?'})",
        f"It is {other['kind']}. This package comes first now, but a different working directory or "
        "PYTHONPATH makes the other one win, and both claim the same distribution name.",
        f"delete {other['path']} (or `pip uninstall` the distribution that installed it)",
    ) for other in facts["copies"]["copies"] if not other["is_this"] and not (resolves and other["path"] == resolves)]
    dists = facts["flash_attn"].get("distributions") or []
    if len(dists) > 1:
        listing = "; ".join(f"{d['name']} {d['version']} at {d['location']}" for d in dists)
        findings.append(Finding(
            "other-copy", "warning", f"{len(dists)} flash-attn distributions are installed",
            f"{listing}. Package metadata (what transformers reads to decide whether flash-attn is usable) may "
            "describe a different copy than the one imported.",
            "keep one: `pip uninstall flash-attn` until none is left, then reinstall this package",
        ))
    return findings


def _foreign_extension_finding(ext: dict) -> Finding:
    if ext.get("imports"):
        return Finding("foreign-extension", "info", f"upstream flash-attn's {ext['module']} imports ({ext['path']})",
                       "This package does not use it; the benchmarks compare against it.")
    undefined = ext.get("undefined_symbol")
    if not undefined:
        return Finding("foreign-extension", "warning", f"{ext['module']} ({ext['path']}) fails to import: {ext.get('error')}",
                       "A leftover of an upstream flash-attn install.",
                       f"remove it: `pip uninstall flash-attn` or delete {ext['path']}")
    shown = undefined["demangled"] or undefined["name"] or undefined["symbol"]
    return Finding(
        "foreign-extension", "warning",
        f"{ext['module']} ({ext['path']}) fails to import: undefined symbol {shown}",
        f"Mangled: {undefined['symbol']}. This is a C++ ABI / PyTorch version mismatch of that other "
        f"build: {undefined['explanation']}. This package does not need it, but anything that imports "
        "upstream flash-attn fails.",
        f"remove the leftover upstream build: `pip uninstall flash-attn` or delete {ext['path']}; "
        "this package needs no extension compiled against your torch",
    )


def foreign_extension(facts: dict) -> list[Finding]:
    """Upstream's compiled ``flash_attn_2_cuda``: imports, or why not (undefined symbols explained)."""
    return [_foreign_extension_finding(ext) for ext in facts["foreign_extensions"]]


# --- PyTorch, driver and GPUs --------------------------------------------------------------------


def torch_missing(facts: dict) -> list[Finding]:
    torch_info = facts["torch"]
    if torch_info.get("installed"):
        return []
    return [Finding("torch-missing", "error", "PyTorch cannot be imported", torch_info.get("error", ""),
                    "install PyTorch >= 2.10 (`conda install pytorch` or `pip install torch`)")]


def torch_cpu_build(facts: dict) -> list[Finding]:
    """A CPU build of PyTorch on a machine whose driver sees NVIDIA GPUs."""
    torch_info, driver = facts["torch"], facts["driver"]
    driver_gpus = driver.get("devices") or []
    if not (torch_info.get("installed") and torch_info.get("build") == "CPU" and driver_gpus):
        return []
    driver_cuda_major = _driver_cuda_major(facts)
    names = ", ".join(d["name"] for d in driver_gpus)
    return [Finding(
        "torch-cpu-build", "error",
        f"PyTorch {torch_info['version']} is a CPU build, but the driver sees {len(driver_gpus)} GPU(s): {names}",
        "Every call runs on the CPU (the cpu backend); the GPU is never used.",
        _torch_install_fix(min(driver_cuda_major, 13) if driver_cuda_major else None)
        + (f" (the driver supports up to CUDA {driver.get('cuda_version_text')})" if driver.get("cuda_version") else ""),
    )]


def _rocm(facts: dict) -> bool:
    return bool(facts["torch"].get("installed") and facts["torch"].get("build") == "ROCm")


def _amd_families_text() -> str:
    """The AMD families with launch tables and their processors, for the reader."""
    return "; ".join(f"{f.name}: {', '.join(f.devices.names)} ({f.gpus})" for f in FAMILIES.values()
                     if f.vendor == "amd")


ROCM_TRITON_FIX = ("install the Triton of your ROCm PyTorch (`pip install pytorch-triton-rocm` from the same ROCm "
                   "wheel index as torch; these kernels need Triton 3.7 to 3.9)")


def torch_rocm(facts: dict) -> list[Finding]:
    """A ROCm build of PyTorch: what runs on its AMD GPUs."""
    if not _rocm(facts):
        return []
    triton = facts["triton"]
    detail = (f"PyTorch {facts['torch'].get('version')} (HIP {facts['torch'].get('hip')}). AMD GPUs of these families run "
              f"this package's Triton kernels (forward, backward, varlen, paged and KV-cache attention, the fused ops), "
              f"compiled on first use with the family's launch tables: {_amd_families_text()}. Other AMD GPUs run the "
              "exact PyTorch reference backend. The ahead-of-time kernels are NVIDIA images and are not used. "
              "Unmeasured: no AMD GPU has run these kernels for this project; their results are checked in Triton's "
              "interpreter and their compiled code statically (`python -m flash_attn amd-kernels`), their speed is "
              "not known.")
    if not triton.get("installed"):
        return [Finding("torch-rocm", "warning", "PyTorch is a ROCm build, without Triton", detail, ROCM_TRITON_FIX)]
    return [Finding("torch-rocm", "info", "PyTorch is a ROCm build", detail, "")]


def _driver_too_old_for_torch(facts: dict) -> list[Finding]:
    torch_info, driver = facts["torch"], facts["driver"]
    torch_major, driver_major = _major(torch_info.get("cuda")), _driver_cuda_major(facts)
    if not (torch_major and driver_major):
        return []
    if driver_major < torch_major:
        return [Finding(
            "driver-too-old", "error",
            f"the NVIDIA driver ({driver.get('release') or 'version unknown'}, CUDA {driver.get('cuda_version_text')}) "
            f"is too old for PyTorch built with CUDA {torch_info['cuda']}",
            f"CUDA {torch_major}.x needs a driver >= {_min_driver(torch_major)}; "
            "PyTorch cannot initialise CUDA and everything falls back to the CPU.",
            f"update the NVIDIA driver to >= {_min_driver(torch_major)}, or " + _torch_install_fix(driver_major),
        )]
    if _version_tuple(driver.get("cuda_version_text")) < _version_tuple(torch_info.get("cuda")):
        return [Finding(
            "driver-too-old", "warning",
            f"the driver supports CUDA {driver.get('cuda_version_text')}, older than PyTorch's CUDA {torch_info['cuda']}",
            "Same major version, so CUDA's minor-version compatibility usually works, but PTX newer than the "
            "driver cannot be JIT-compiled.",
            "update the NVIDIA driver when convenient",
        )]
    return []


def _driver_too_old_for_op_library(facts: dict) -> list[Finding]:
    runtime = (facts["op_library"].get("build_config") or {}).get("cuda_runtime") or ""
    runtime_major, driver_major = _major(runtime), _driver_cuda_major(facts)
    if not (runtime_major and driver_major and driver_major < runtime_major):
        return []
    return [Finding(
        "driver-too-old", "error",
        f"the op library's CUDA runtime {runtime} needs a newer driver (it has CUDA "
        f"{facts['driver'].get('cuda_version_text')})",
        f"The ahead-of-time kernels cannot launch; CUDA {runtime_major}.x needs a driver >= {_min_driver(runtime_major)}.",
        f"update the NVIDIA driver, or install the flash-attn build for CUDA {driver_major} "
        f"(conda: `conda install flash-attn 'cuda-version={driver_major}.*'`)",
    )]


def driver_too_old(facts: dict) -> list[Finding]:
    """The driver's CUDA is older than PyTorch's or the op library's CUDA runtime."""
    return _driver_too_old_for_torch(facts) + _driver_too_old_for_op_library(facts)


def torch_cuda_unusable(facts: dict) -> list[Finding]:
    """A CUDA PyTorch that cannot use the GPUs the driver sees (unless an old driver explains it)."""
    torch_info = facts["torch"]
    if not (torch_info.get("build") == "CUDA" and facts["driver"].get("devices") and not torch_info.get("cuda_available")):
        return []
    if any(f.severity == "error" for f in driver_too_old(facts)):
        return []  # one cause, explained once
    return [Finding(
        "torch-cuda-unusable", "error",
        "PyTorch is a CUDA build but cannot use the GPUs the driver sees",
        torch_info.get("cuda_warning") or torch_info.get("cuda_error") or "torch.cuda.is_available() is False",
        "check CUDA_VISIBLE_DEVICES (currently "
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}), that the driver works (`nvidia-smi`), and "
        "that PyTorch's CUDA matches the driver",
    )]


def driver_error(facts: dict) -> list[Finding]:
    driver = facts["driver"]
    if not (driver.get("found") and driver.get("error") and not driver.get("devices")):
        return []
    return [Finding("driver-error", "warning", f"the NVIDIA driver is installed but reports: {driver['error']}",
                    "No GPU can be used.", "check `nvidia-smi`; reboot after a driver update; check CUDA_VISIBLE_DEVICES")]


# --- op library and shipped kernels --------------------------------------------------------------


def op_library(facts: dict) -> list[Finding]:
    """The op library fails to load, is missing where a GPU needs it, or was built without CUDA."""
    op, gpu_machine = facts["op_library"], _gpu_machine(facts)
    config = op.get("build_config") or {}
    if op.get("loaded"):
        if gpu_machine and not config.get("cuda", True):
            return [Finding("op-library", "warning", "the op library was built without CUDA (FLASH_ATTN_CPU_ONLY)",
                            "The ahead-of-time kernels cannot launch on this GPU machine.",
                            "install the CUDA build of flash-attn")]
        return []
    env_fix = f"unset {LIBRARY_ENV}, or point it at a library file built for this PyTorch (flash_attn/_C/{LIBRARY_NAME})"
    if op.get("installed"):
        fix = env_fix if op.get("from_env") else (
            "reinstall flash-attn for this PyTorch (`conda install --force-reinstall flash-attn` or "
            "`pip install --force-reinstall flash-attn`); the library needs torch >= 2.10")
        where = f" set by {LIBRARY_ENV}" if op.get("from_env") else ""
        return [Finding("op-library", "error", f"the op library{where} fails to load", op.get("reason", ""), fix)]
    if op.get("path"):
        what = "is a folder" if Path(op["path"]).is_dir() else "does not exist"
        return [Finding("op-library", "error", f"the op library set by {LIBRARY_ENV} {what}",
                        op.get("reason", ""), env_fix)]
    summary = ("this is the CPU-only build of flash-attn: no op library (ahead-of-time kernel launcher)"
               if is_cpu_only_build(config) else "the op library (ahead-of-time kernel launcher) is not installed")
    return [Finding("op-library", "warning" if gpu_machine else "info", summary, op.get("reason", ""),
                    "install the CUDA build of flash-attn" if facts["gpus"] else
                    "nothing to do on a machine without an NVIDIA GPU")]


def aot_kernels(facts: dict) -> list[Finding]:
    """The kernel manifest cannot be read, or the installation ships no ahead-of-time kernels."""
    kernels, gpu_machine = facts["aot_kernels"], _gpu_machine(facts)
    if kernels.get("error"):
        fix = (f"point {DIR_ENV} at a folder built by `python -m flash_attn build-kernels`, or unset it"
               if kernels.get("from_env") else "reinstall flash-attn")
        return [Finding("aot-kernels", "error", "the kernel manifest cannot be read", kernels["error"], fix)]
    if not kernels.get("manifest"):
        nvidia_gpus = gpu_machine and not _rocm(facts)  # AMD GPUs run Triton's JIT: no images are for them
        return [Finding("aot-kernels", "warning" if nvidia_gpus else "info",
                        "this installation ships no ahead-of-time kernels (no manifest.json)",
                        "GPUs use the Triton backend (compiled on first use) or the reference backend.",
                        "install a CUDA build of flash-attn that ships kernels" if nvidia_gpus else "")]
    unusable = kernels.get("unusable_images")
    if unusable:
        shown = unusable[:20] + ([f"... and {len(unusable) - 20} more"] if len(unusable) > 20 else [])
        return [Finding("aot-kernels", "error" if gpu_machine else "warning",
                        f"{len(unusable)} of the {kernels.get('kernel_count')} kernel images listed in "
                        f"{kernels['manifest']} are missing or damaged",
                        "; ".join(shown) + ". Calls that need them run on the next backend.",
                        "reinstall flash-attn (or rebuild the kernels: `python -m flash_attn build-kernels`)")]
    invalid = kernels.get("invalid_entries")
    if invalid:
        return [Finding("aot-kernels", "warning",
                        f"{invalid['count']} entries of the kernel manifest are malformed: their images are never used",
                        "; ".join(invalid["first"]) + (" ..." if invalid["count"] > len(invalid["first"]) else ""),
                        "rebuild the kernels (`python -m flash_attn build-kernels`) or reinstall flash-attn; calls "
                        "they would serve run on the next backend")]
    return []


# --- per GPU --------------------------------------------------------------------------------------


def _arch_not_shipped_finding(gpu: dict, triton_installed: bool) -> Optional[Finding]:
    cap, image = _capability(gpu), gpu.get("image")
    # Below the kernels' minimum no build could ship one: the `gpu-backend` check says so.
    if image and image["kind"] == "unsupported" and cap >= MIN_CAPABILITY:
        cover = ("Triton compiles the kernels on first use (slower start, same results)" if triton_installed
                 else "only the exact but slow PyTorch reference backend covers it")
        return Finding(
            "arch-not-shipped", "warning" if triton_installed else "error",
            f"{_label(gpu)}: no shipped kernel image for this architecture",
            f"{image['reason']}; {cover}.",
            "install a flash-attn build that includes this architecture, or build one: "
            f"FLASH_ATTN_CUDA_ARCHS='{cap[0]}{cap[1]}' pip install --no-build-isolation ."
            + ("" if triton_installed else "; or install Triton (`pip install triton`)"),
        )
    if image and image["kind"] == "ptx":
        return Finding("arch-not-shipped", "info", f"{_label(gpu)}: runs shipped PTX ({image['arch']})",
                       f"{image['reason']} on first use (cached afterwards).", "")
    return None


def arch_not_shipped(facts: dict) -> list[Finding]:
    """A GPU whose architecture has no shipped kernel image, and what covers it instead."""
    triton_installed = bool(facts["triton"].get("installed"))
    found = (_arch_not_shipped_finding(gpu, triton_installed) for gpu in facts["gpus"])
    return [f for f in found if f is not None]


def _needs_triton(gpu: dict, facts: dict) -> bool:
    if gpu.get("gcn_arch"):  # AMD: what needs Triton is a GPU of a family with launch tables
        return gpu["auto"] == "reference" and not facts["triton"].get("installed") and _amd_family(gpu) is not None
    return gpu["auto"] == "reference" and _capability(gpu) >= MIN_CAPABILITY and not facts["triton"].get("installed")


def _amd_family(gpu: dict) -> Optional[str]:
    try:
        return arch_family(gpu["gcn_arch"])
    except (ValueError, TypeError):
        return None


def triton_missing(facts: dict) -> list[Finding]:
    """Triton is missing where a GPU needs it (an error), or missing at all (information)."""
    findings = [Finding(
        "triton-missing", "error",
        f"{_label(gpu)}: Triton is not installed, so this GPU runs the slow reference backend",
        "No ahead-of-time kernel can run here (" + "; ".join(gpu["why_not_aot"]) + ").",
        ROCM_TRITON_FIX if gpu.get("gcn_arch") else
        "`pip install triton` or `conda install triton` (or install a flash-attn build whose "
        "kernels include this architecture)",
    ) for gpu in _gpus_torch_uses(facts) if _needs_triton(gpu, facts)]
    triton = facts["triton"]
    if not triton.get("installed") and not findings:
        findings.append(Finding("triton-missing", "info", f"Triton is {triton.get('error', 'not installed')}",
                                "Only needed for GPUs without shipped kernels and for FLASH_ATTN_BACKEND=interpret.", ""))
    return findings


def _amd_gpu_backend_finding(gpu: dict) -> Optional[Finding]:
    if gpu["auto"] == "triton":
        family = arch_family(gpu["gcn_arch"])
        return Finding("gpu-backend", "info", f"{_label(gpu)}: auto runs the Triton kernels with the {family} tables",
                       "compiled on first use (seconds per kernel variant); unmeasured on AMD GPUs",  "")
    if gpu["auto"] != "reference":
        return None
    return Finding("gpu-backend", "warning", f"{_label(gpu)}: auto uses the reference backend",
                   "; ".join(gpu["why_not_aot"]) or "no GPU backend can run",
                   f"the Triton kernels have launch tables for {_amd_families_text()}; this GPU gets exact results "
                   "from the reference backend")


def _gpu_backend_finding(gpu: dict) -> Optional[Finding]:
    if gpu.get("gcn_arch"):
        return _amd_gpu_backend_finding(gpu)
    if gpu["auto"] == "triton":
        return Finding("gpu-backend", "warning", f"{_label(gpu)}: auto uses Triton (JIT), not the ahead-of-time kernels",
                       "; ".join(gpu["why_not_aot"]),
                       "install a CUDA build of flash-attn whose kernels include this GPU's architecture")
    if gpu["auto"] != "reference":
        return None
    supported = _capability(gpu) >= MIN_CAPABILITY
    return Finding(
        "gpu-backend", "error" if supported else "warning",
        f"{_label(gpu)}: auto uses the reference backend",
        "; ".join(gpu["why_not_aot"]) or "no GPU backend can run",
        "see the other findings" if supported else
        f"the kernels need compute capability >= {MIN_CAPABILITY_TEXT}; this GPU gets exact results from the "
        "reference backend",
    )


def gpu_backend(facts: dict) -> list[Finding]:
    """A GPU that runs on Triton or on the reference backend instead of the shipped kernels (a GPU
    that only lacks Triton is the `triton-missing` check's)."""
    found = (_gpu_backend_finding(gpu) for gpu in _gpus_torch_uses(facts) if not _needs_triton(gpu, facts))
    return [f for f in found if f is not None]


def forced_family(facts: dict) -> list[Finding]:
    """``FLASH_ATTN_FORCE_FAMILY`` is set: an NVIDIA GPU's calls are planned with another family's
    launch configs (a measuring aid, :mod:`flash_attn.aot.forced`), or the aot backend refuses it."""
    findings = []
    for gpu in _gpus_torch_uses(facts):
        name = gpu.get("forced_family")
        if not name:
            continue
        if gpu.get("auto") == "aot":
            detail = (f"the aot backend plans this GPU's calls with the {name} family's launch configs, from the "
                      "installed image that carries them: the results are right, the speed is that of another GPU's "
                      "tables on this one")
        else:
            detail = "the aot backend does not run here: " + ("; ".join(gpu.get("why_not_aot") or []) or "see above")
        findings.append(Finding("forced-family", "warning", f"{_label(gpu)}: {forced.FORCE_ENV}={name} is set",
                                detail, f"unset {forced.FORCE_ENV} outside such measurements"))
    return findings


def _settings_fix(error: str) -> str:
    if "cannot run on" in error:
        return f"unset {dispatch.BACKEND_ENV} (auto runs what can run on each device), or name a backend that runs there"
    named = re.search(r"FLASH_ATTN_\w+", error)
    variable = named.group(0) if named else "the variable"
    return f"set {variable} to one of the values the message names, or unset it"


def backend_env(facts: dict) -> list[Finding]:
    """Every call on a device raises with the environment as set (an invalid ``FLASH_ATTN_BACKEND``,
    ``FLASH_ATTN_STRICT_BACKEND`` or ``FLASH_ATTN_CPU_ONEDNN``, or a named backend that cannot run
    there): the dispatcher's own decision (:func:`flash_attn.dispatch.route`), one finding per cause."""
    devices_by_error: dict[str, list[str]] = {}
    for route in facts["backends"].get("routes", []):
        if route.get("error"):
            devices_by_error.setdefault(route["error"], []).append(route["device"])
    findings = []
    for error, devices in devices_by_error.items():
        summary, _, reason = error.partition(": ") if "cannot run on" in error else (error, "", "")
        findings.append(Finding(
            "backend-env", "error", f"every call on {', '.join(devices)} raises: {summary}",
            (f"{reason}. " if reason else "") + "This is what the dispatcher decides with the environment as set.",
            _settings_fix(error),
        ))
    return findings


def fused_ops(facts: dict) -> list[Finding]:
    """What upstream's fused ops (``flash_attn.ops.triton``: norms, loss, rotary) run on each GPU:
    Triton kernels, JIT-compiled on first use (none are shipped ahead of time), or without Triton
    their PyTorch path."""
    gpus = [gpu for gpu in _gpus_torch_uses(facts) if _capability(gpu) >= MIN_CAPABILITY]
    if not gpus:
        return []
    names = ", ".join(_label(gpu) for gpu in gpus)
    if facts["triton"].get("installed"):
        return [Finding("fused-ops", "info", f"{names}: the fused norms, loss and rotary run Triton kernels",
                        "flash_attn.ops.triton compiles them with Triton on first use (a few seconds per shape "
                        "family); nothing of them is shipped ahead of time.", "")]
    return [Finding("fused-ops", "warning", f"{names}: the fused norms, loss and rotary run their PyTorch path",
                    "Triton is not installed: flash_attn.ops.triton's CUDA kernels need it (exact results either "
                    "way, slower and with more memory without it).",
                    "`pip install triton` or `conda install triton`")]


# What was found of Triton's Intel backend (issue 47; benchmarks/README.md, "AMD and Intel GPUs").
XPU_WHY = ("Triton's Intel backend (`triton-xpu` on PyPI) was tried without an Intel GPU on 2026-11-29: its newest "
           "release, 3.3.0b1, installs and compiles small kernels to SPIR-V (after Level Zero's and SYCL's libraries), "
           "but it is older than the Triton 3.7 these kernels need (it has no tensor descriptors, so the forward "
           "and backward do not compile) and its native code needs Intel's offline compiler, so nothing of the "
           "kernels could be shown for Intel GPUs")


def other_gpus(facts: dict) -> list[Finding]:
    """GPUs of other kinds PyTorch can use (Apple's MPS, Intel's XPU): the reference backend, and why."""
    torch_info = facts["torch"]
    findings = []
    if torch_info.get("xpu_available"):
        findings.append(Finding("other-gpus", "info", "Intel GPU (xpu) tensors run the exact reference backend",
                                XPU_WHY + ".", ""))
    if torch_info.get("mps_available"):
        findings.append(Finding("other-gpus", "info", "Apple GPU (mps) tensors run the exact reference backend",
                                "No kernel of this package targets Apple GPUs; a fast path there waits until one "
                                "can be measured.", ""))
    return findings


def no_gpu(facts: dict) -> list[Finding]:
    if not facts["torch"].get("installed") or facts["driver"].get("devices") or facts["gpus"]:
        return []
    cpu = next((r for r in facts["backends"].get("routes", []) if r["device"] == "cpu"), None)
    if cpu is None or not cpu["backends"]:
        return [Finding("no-gpu", "info", "no NVIDIA GPU is visible", "", "")]
    return [Finding("no-gpu", "info", "no NVIDIA GPU is visible",
                    f"CPU tensors run on the {cpu['backends'][0]} backend ({_BACKEND_WORDS.get(cpu['backends'][0], '')}).",
                    "")]


# What each backend is, in a few words (the doctor's sentences about where calls run).
_BACKEND_WORDS = {
    "cpu": "PyTorch's fused CPU kernels where they are exact, else the tiled engine; O(n) memory",
    "reference": "the exact tiled definition in PyTorch, slower",
    "aot": "the kernels shipped ahead of time",
    "triton": "the kernels compiled by Triton on first use",
    "interpret": "the kernels in Triton's CPU interpreter, for development: very slow",
}


# Every check id and its function, in the order findings are listed.
CHECKS: dict[str, Callable[[dict], list[Finding]]] = {
    "shadowed": shadowed,
    "other-copy": other_copy,
    "foreign-extension": foreign_extension,
    "torch-missing": torch_missing,
    "torch-cpu-build": torch_cpu_build,
    "torch-rocm": torch_rocm,
    "driver-too-old": driver_too_old,
    "torch-cuda-unusable": torch_cuda_unusable,
    "driver-error": driver_error,
    "op-library": op_library,
    "aot-kernels": aot_kernels,
    "arch-not-shipped": arch_not_shipped,
    "triton-missing": triton_missing,
    "gpu-backend": gpu_backend,
    "forced-family": forced_family,
    "backend-env": backend_env,
    "fused-ops": fused_ops,
    "other-gpus": other_gpus,
    "no-gpu": no_gpu,
}


def diagnose(facts: dict) -> list[Finding]:
    """Every check's findings, in the order of :data:`CHECKS`."""
    return [finding for check in CHECKS.values() for finding in check(facts)]


def run_checks() -> Report:
    """Collect the facts and diagnose them."""
    facts = collect()
    return Report(facts, diagnose(facts))
