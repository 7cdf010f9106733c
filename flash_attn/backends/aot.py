"""The ``aot`` backend: the kernels compiled ahead of time (``python -m flash_attn build-kernels``),
launched by the op library (``flash_attn/_C/libflash_attn_aot.so``) without Triton at run time.

A call is planned for the device's image (``Target(aot=True)``: only the shipped specialisations,
:mod:`flash_attn.kernels.plan`); the first call of each shape then turns the plan into packed
launches: for each, the manifest entry of its specialisation, the kernel registered and loaded on
the device, the integer and float arguments checked against the image's signature and stored.
Every later call of that shape fills in its tensors and calls ``torch.ops.flash_attn.aot_launch``.
All of it happens before the first launch of the call, so a call the images cannot serve (no
such specialisation, a value outside int32, an image the driver refuses) is refused before
anything runs or is written, and the dispatcher runs it elsewhere.

Images the installed driver cannot load are never picked: each manifest entry records the CUDA
release of the ptxas that built it (cubins need a driver of that major version) and the PTX ISA
of PTX images (the driver's JIT must know it). If the driver still refuses an image, every later
call on that device is refused with its answer (one warning, from the dispatcher).
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from flash_attn import _aot_library, aot_images, limits
from flash_attn.backends._execute import KernelBackend, PlanCache, Ready, ready, slots
from flash_attn.kernels import configs
from flash_attn.kernels import plan as P
from flash_attn.kernels import specializations as S

__all__ = ["unavailable_reason", "forward", "backward", "forward_kvcache", "prepare_forward", "prepare_backward",
           "prepare_forward_kvcache", "Manifest", "manifest"]

_NAME = "aot"
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

    def image_for(self, capability: tuple[int, int], driver: Optional[tuple[int, int]] = None) -> aot_images.ImageChoice:
        """The image a device of ``capability`` runs, among those a driver of release ``driver``
        (``None``: unknown) can load."""
        loadable, refused = [], []
        for arch in self.archs:
            need = self.requirement(arch)
            if driver is not None and need is not None and not _driver_loads(driver, need, arch):
                refused.append(f"{arch} needs a driver for CUDA >= {need[0]}.{need[1]}")
            else:
                loadable.append(arch)
        choice = aot_images.select_image(capability, loadable)
        if not choice.supported and refused:
            runnable = [a for a in self.archs if aot_images.parse_arch(a).runs_on(*capability)]
            if runnable:
                why = "; ".join(r for r in refused if r.split()[0] in runnable)
                return aot_images.ImageChoice(
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
    import flash_attn  # noqa: PLC0415

    key = (os.environ.get(DIR_ENV), tuple(flash_attn.__path__))
    if key not in _dirs:
        _dirs[key] = Path(key[0]) if key[0] else next(
            (Path(f) / "_aot" for f in key[1] if (Path(f) / "_aot" / "manifest.json").is_file()), None)
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
    version = _aot_library.cuda_info()["driver_version"]
    return (version // 1000, version % 1000 // 10) if version > 0 else None


def config_capability(capability: tuple[int, int], choice: aot_images.ImageChoice) -> tuple[int, int]:
    """Whose launch configs a device runs: its own on a cubin (compiled for its family), and on
    the sm_80 PTX (a GPU newer than every cubin) the configs that PTX was built with: the sm80
    ones where the device has A100-sized shared memory, else sm86's."""
    if choice.kind != "ptx":
        return capability
    shared = configs.SHARED_MEMORY_LIMIT[configs.arch_family(capability)]
    return (8, 0) if shared >= configs.SHARED_MEMORY_LIMIT["sm80"] else (8, 6)


def unavailable_reason(device: torch.device) -> Optional[str]:
    device = torch.device(device)
    if device.type != "cuda":
        return f"it launches precompiled GPU kernels and needs CUDA tensors, not {device.type}"
    if getattr(torch.version, "hip", None):
        return "its kernels are NVIDIA cubins/PTX, not ROCm"
    status = _aot_library.status()
    if not status.loaded:
        return status.reason
    m, why = manifest()
    if m is None:
        return why
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    choice = m.image_for(torch.cuda.get_device_capability(device), driver_release())
    if not choice.supported:
        return choice.reason
    return None


# --- the device's images --------------------------------------------------------------------------


@dataclass
class _DeviceImages:
    """What one device runs: the manifest, the image architecture, the planner's target, and, once
    the driver refused an image, its answer (every later call is refused with it)."""

    manifest: Manifest
    arch: str
    target: P.Target
    broken: Optional[str] = None
    plans: PlanCache = field(default_factory=PlanCache)  # call shape -> packed launches or refusal


_devices: dict[torch.device, _DeviceImages | str] = {}


def _device_images(device: torch.device) -> _DeviceImages | str:
    """The images of ``device`` (worked out on its first call; ``FLASH_ATTN_AOT_DIR`` is read then)."""
    found = _devices.get(device)
    if found is None:
        found = _devices[device] = _make_device_images(
            device.index if device.index is not None else torch.cuda.current_device())
    return found


def _make_device_images(index: int) -> _DeviceImages | str:
    m, why = manifest()
    if m is None:
        return why
    capability = torch.cuda.get_device_capability(index)
    choice = m.image_for(capability, driver_release())
    if not choice.supported:
        return choice.reason
    family = configs.arch_family(config_capability(capability, choice))
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return _DeviceImages(m, choice.arch.name, P.Target(family, sms, aot=True))


def _target(device: torch.device) -> P.Target | str:
    images = _device_images(device)
    if isinstance(images, str):
        return images
    return images.broken or images.target


# --- plans as packed launches ---------------------------------------------------------------------


class _Packed(NamedTuple):
    kernel: int
    grid: list
    slots: list  # tensor arguments, by slot, in signature order
    ints: list
    floats: list


_registered: dict[tuple, int] = {}


def _register(m: Manifest, entry: dict) -> int:
    key = (str(m.folder), entry["arch"], entry["key"])
    kid = _registered.get(key)
    if kid is None:
        kid = _registered[key] = _aot_library.register_kernel(m.folder / entry["image"], entry)
    return kid


def pack(launch: P.Launch, entry: dict) -> _Packed | str:
    """``launch``'s arguments in the order and types of the image's signature, or why they do not
    fit it (an integer outside int32)."""
    tokens = [t for t in entry["signature"] if t not in _aot_library.HIDDEN_ARGS]
    mismatch = (f"the installed image {entry['key']} does not fit this flash_attn's kernels (built from other "
                f"sources? rebuild with `python -m flash_attn build-kernels`)")
    if len(tokens) != len(launch.args):
        return mismatch
    names, ints, floats = [], [], []
    for (name, value), token in zip(launch.args, tokens):
        kind = token.split(":")[0]
        if kind.startswith("*"):
            if not isinstance(value, P.Slot):
                return mismatch
            names.append(str(value))
        elif kind.startswith("fp"):
            floats.append(float(value))
        else:
            value = int(value)
            if kind == "i32" and not -limits.INT32_MAX - 1 <= value <= limits.INT32_MAX:
                return f"argument {name} = {value} does not fit the kernels' int32"
            ints.append(value)
    return _Packed(0, list(launch.grid), names, ints, floats)


class _AotBackend(KernelBackend):
    def plan_cache(self, device) -> PlanCache:
        return _device_images(device).plans

    def executable(self, plan: P.Plan, target: P.Target, device):
        images = _device_images(device)
        dtype = S.dtype_name(plan.dtype)
        packed = []
        for launch in plan.launches:
            spec = S.Spec.of(launch.kernel, dtype, launch.constexprs, launch.config)
            entry = images.manifest.lookup(images.arch, spec.key)
            if entry is None:
                return f"{spec.key} is not in the {images.arch} image set of this installation"
            p = pack(launch, entry)
            if isinstance(p, str):
                return p
            try:
                kid = _register(images.manifest, entry)
                _load(kid, device)
            except RuntimeError as exc:
                images.broken = f"the driver cannot load the {images.arch} images: {_first_line(exc)}"
                return images.broken
            packed.append(p._replace(kernel=kid))
        return ready(plan, tuple(packed))

    def run(self, run: Ready, inputs: dict, device) -> tuple:
        tensors = slots(run, inputs, device)
        launch = _launch_op()
        for p in run.launches:
            launch(p.kernel, p.grid, [tensors[name] for name in p.slots], p.ints, p.floats)
        return tuple(tensors[slot] for slot in run.plan.results)


_loaded: set = set()


def _load(kid: int, device) -> None:
    """Load the image on ``device`` now (the driver's answer comes before anything runs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return  # meta tensors (tracing, tests): nothing to load
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (kid, index) not in _loaded:
        _aot_library.ops().aot_kernel_attributes(kid, index)
        _loaded.add((kid, index))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return re.sub(r"\s+", " ", text.splitlines()[0] if text else type(exc).__name__)


_op = None


def _launch_op():
    global _op
    if _op is None:
        _op = _aot_library.ops().aot_launch.default
    return _op


_backend = _AotBackend(_NAME, _target)
prepare_forward, prepare_backward, prepare_forward_kvcache, forward, backward, forward_kvcache = _backend.contract()
