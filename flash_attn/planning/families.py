"""Where the GPU architecture is chosen: the GPU families the kernels are tuned and compiled for,
one record each (:data:`FAMILIES`).

A family is what one set of launch configs serves: which devices belong to it, the shared memory
one block may use there, its tensor-core instructions, whose config tables it takes where it has
none of its own (:attr:`Family.config_parent`), the compute capability its ahead-of-time images
are compiled for, and which other families' devices run those images. Everything else that
depends on the family reads it here: the config tables' inheritance (:func:`lineage`), the device's
family (:func:`arch_family`), what an image carries (:func:`families_for`), whose configs a GPU
runs from another family's PTX (:func:`configs_from_image`), and the per-family columns
(:func:`column`). Adding a family is adding its record (and its table rows, unless it inherits
them).

Two vendors: NVIDIA GPUs are matched by their CUDA compute capability (:class:`Capabilities`),
AMD GPUs by the processor of PyTorch's ``gcnArchName`` (:class:`GcnArchs`: ``"gfx942:sramecc+:
xnack-"`` is a ``gfx942``). A device is named by either (:data:`Device`): a ``(major, minor)``
tuple or a ``gcnArchName`` string. AMD families run Triton's JIT only (no ahead-of-time images:
``image_capability`` is ``None``); their records say what their launch configs must respect: the
LDS one workgroup may use (``shared_memory``) and the wave size (``wave_size``: a program of
``num_warps`` runs ``num_warps * wave_size`` threads, so ``num_warps=4`` on wave64 CDNA is the
256 threads of 8 NVIDIA warps).

The Triton interpreter's target, ``"interpret"``, is no family: its tables are its own
(:mod:`flash_attn.planning.configs`, :mod:`flash_attn.planning.decode_configs`).

Pure Python (no torch, no triton).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterator, Optional, Union

from flash_attn import limits

__all__ = ["Capabilities", "Device", "Family", "FAMILIES", "GcnArchs", "MMA_KINDS", "VENDORS", "arch_family", "column",
           "configs_from_image", "families_for", "gcn_processor", "get", "lineage", "mma", "of_vendor",
           "triton_target"]

# The matrix instructions a family's kernels compile to (Triton picks them per target): NVIDIA's
# tensor cores, AMD's matrix cores (CDNA's MFMA, RDNA's WMMA).
MMA_KINDS = ("mma.sync", "wgmma", "tcgen05", "mfma", "wmma")
VENDORS = ("nvidia", "amd")
# How a device is named: a CUDA compute capability (major, minor), or an AMD gcnArchName.
Device = Union[tuple, str]


@dataclass(frozen=True)
class Capabilities:
    """CUDA compute capabilities from ``low`` up to, not including, ``high`` (``None``: no end)."""

    low: tuple[int, int]
    high: Optional[tuple[int, int]] = None

    def matches(self, capability: Device) -> bool:
        if isinstance(capability, str):
            return False
        return self.low <= tuple(capability) and (self.high is None or tuple(capability) < self.high)


def gcn_processor(gcn_arch_name: str) -> str:
    """The processor of an AMD ``gcnArchName``: ``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"``."""
    return gcn_arch_name.split(":", 1)[0].strip().lower()


@dataclass(frozen=True)
class GcnArchs:
    """AMD GPUs whose ``gcnArchName`` names one of ``names`` (processors such as ``"gfx942"``); the
    first is the one the family's kernels are compiled for in the static proof
    (:mod:`flash_attn.kernel_build.amd`)."""

    names: tuple[str, ...]

    def matches(self, device: Device) -> bool:
        return isinstance(device, str) and gcn_processor(device) in self.names


@dataclass(frozen=True)
class Family:
    name: str
    vendor: str  # one of VENDORS
    devices: Union[Capabilities, GcnArchs]  # the devices of this family
    # bytes of shared memory one block may use (the opt-in maximum; AMD: the LDS of one workgroup)
    shared_memory: int
    mma: str  # one of MMA_KINDS
    # what its ahead-of-time images are compiled for (None: no images, Triton's JIT only)
    image_capability: Optional[tuple[int, int]]
    # whose launch configs (attention and decode tables) it takes where it has no row of its own
    config_parent: Optional[str] = None
    # other families whose devices run its images, so the images carry their configs too
    image_carries: tuple[str, ...] = ()
    gpus: str = ""  # for the reader
    # threads of one warp (AMD: one wavefront): a program runs num_warps * wave_size threads
    wave_size: int = 32
    # fp32 products on the matrix instructions in TF32 (AMD: CDNA3's XF32, the only AMD target
    # for which Triton takes input_precision="tf32")
    tf32: bool = True

    def __post_init__(self):
        if self.mma not in MMA_KINDS:
            raise ValueError(f"family {self.name}: unknown MMA kind {self.mma!r}; expected one of {MMA_KINDS}")
        if self.vendor not in VENDORS:
            raise ValueError(f"family {self.name}: unknown vendor {self.vendor!r}; expected one of {VENDORS}")
        matcher = {"nvidia": Capabilities, "amd": GcnArchs}[self.vendor]
        if not isinstance(self.devices, matcher):
            raise ValueError(f"family {self.name}: {self.vendor} devices are matched by {matcher.__name__}")


KB = 1024

# The registry, oldest first. A device belongs to the family whose capabilities hold it; where
# several do, to the one whose range starts last (a family carved out of a broader one).
FAMILIES: dict[str, Family] = {f.name: f for f in (
    # the sm_80 image runs on sm86's devices too, so it carries their configs (smaller shared memory)
    Family("sm80", "nvidia", Capabilities(limits.MIN_CAPABILITY, (8, 1)), 163 * KB, "mma.sync", (8, 0),
           image_carries=("sm86",), gpus="A100"),
    Family("sm86", "nvidia", Capabilities((8, 1), (9, 0)), 99 * KB, "mma.sync", (8, 6),
           gpus="RTX 30xx / A10 / A40 (8.6), Jetson Orin (8.7), L4 / RTX 40xx (8.9)"),
    Family("sm90", "nvidia", Capabilities((9, 0), (10, 0)), 227 * KB, "wgmma", (9, 0), gpus="H100 / H200"),
    # Hopper's measured tables until a Blackwell GPU measures its own
    Family("sm100", "nvidia", Capabilities((10, 0), (12, 0)), 227 * KB, "tcgen05", (10, 0), config_parent="sm90",
           gpus="B200 / GB200 (10.0), B300 / GB300 (10.3), Thor (11.0)"),
    # the same shared memory and instructions as consumer Ampere: a GPU running the sm_80 PTX finds
    # the same configs
    Family("sm120", "nvidia", Capabilities((12, 0)), 99 * KB, "mma.sync", (12, 0), config_parent="sm86",
           gpus="RTX 50xx (12.0), DGX Spark (12.1)"),
    # AMD, through ROCm PyTorch and Triton's JIT (no images). Instinct (CDNA) runs 64-thread waves.
    Family("cdna3", "amd", GcnArchs(("gfx942",)), 64 * KB, "mfma", None, wave_size=64,
           gpus="Instinct MI300X / MI300A / MI325X"),
    # 160 KB of LDS and MFMA with twice the K of CDNA3's: its own rows where that changes the choice
    Family("cdna4", "amd", GcnArchs(("gfx950",)), 160 * KB, "mfma", None, wave_size=64, config_parent="cdna3",
           gpus="Instinct MI350X / MI355X", tf32=False),
    # Radeon (RDNA) runs 32-thread waves and WMMA
    Family("rdna3", "amd", GcnArchs(("gfx1100", "gfx1101")), 64 * KB, "wmma", None, wave_size=32, tf32=False,
           gpus="RX 7900 XTX / XT / GRE, PRO W7900 / W7800 (gfx1100), RX 7800 XT / 7700 XT, PRO W7700 (gfx1101)"),
    # WMMA whose operands take half RDNA3's registers: its own tiles; RDNA3's decode rows
    Family("rdna4", "amd", GcnArchs(("gfx1201", "gfx1200")), 64 * KB, "wmma", None, wave_size=32, tf32=False,
           config_parent="rdna3", gpus="RX 9070 XT / 9070, AI PRO R9700 (gfx1201), RX 9060 XT (gfx1200)"),
)}


def get(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown GPU family {name!r}; known: {', '.join(FAMILIES)}") from None


def arch_family(device: Device) -> str:
    """The family of a device: of CUDA compute capability ``(major, minor)``, or of AMD
    ``gcnArchName`` ``device`` (a string such as ``"gfx942:sramecc+:xnack-"``)."""
    matching = [f for f in FAMILIES.values() if f.devices.matches(device)]
    if isinstance(device, str):
        if not matching:
            served = ", ".join(n for f in FAMILIES.values() if f.vendor == "amd" for n in f.devices.names)
            raise ValueError(f"AMD GPU {gcn_processor(device)} is in no GPU family of the kernels (their launch "
                             f"tables are for {served})")
        return matching[0].name
    if not matching:
        major, minor = device
        raise ValueError(f"compute capability {major}.{minor} is in no GPU family of the kernels "
                         f"(the oldest they run on: {limits.MIN_CAPABILITY[0]}.{limits.MIN_CAPABILITY[1]})")
    return max(matching, key=lambda f: f.devices.low).name


def of_vendor(vendor: str) -> tuple[str, ...]:
    """The names of ``vendor``'s families, in registry order."""
    if vendor not in VENDORS:
        raise ValueError(f"unknown vendor {vendor!r}; expected one of {VENDORS}")
    return tuple(f.name for f in FAMILIES.values() if f.vendor == vendor)


def triton_target(name: str) -> tuple:
    """``(backend, arch, warp size)`` of Triton's ``GPUTarget`` that family ``name``'s kernels are
    compiled for without its GPU: its image capability (NVIDIA), its first processor (AMD)."""
    family = get(name)
    if family.vendor == "amd":
        return "hip", family.devices.names[0], family.wave_size
    major, minor = family.image_capability
    return "cuda", major * 10 + minor, family.wave_size


def lineage(name: str) -> tuple[str, ...]:
    """``name`` and its config parents, nearest first: where its config rows are looked up (a
    name that is no family, such as ``"interpret"``, has only its own)."""
    out = [name]
    family = FAMILIES.get(name)
    while family is not None and family.config_parent is not None:
        if family.config_parent in out:
            raise ValueError(f"GPU family {name}: its config parents form a cycle ({' -> '.join(out)})")
        out.append(family.config_parent)
        family = FAMILIES.get(family.config_parent)
    return tuple(out)


def families_for(capability: tuple[int, int]) -> tuple[str, ...]:
    """The families whose configs an image compiled for ``capability`` carries: its own family,
    and those whose devices run it too (:attr:`Family.image_carries`)."""
    family = get(arch_family(capability))
    return (family.name, *family.image_carries)


def configs_from_image(device_family: str, image_capability: tuple[int, int]) -> str:
    """Whose configs a device of ``device_family`` runs from an image compiled for another family
    (the PTX the driver compiles for a GPU newer than every cubin): among the families that image
    carries, the one with the most shared memory the device has (its tiles fit there); the least
    demanding one where none fits."""
    carried = [get(name) for name in families_for(image_capability)]
    own = get(device_family).shared_memory
    fitting = [f for f in carried if f.shared_memory <= own]
    if fitting:
        return max(fitting, key=lambda f: f.shared_memory).name
    return min(carried, key=lambda f: f.shared_memory).name


def mma(name: str) -> Optional[str]:
    """The tensor-core instructions of family ``name`` (``None`` for a target that is no family)."""
    family = FAMILIES.get(name)
    return None if family is None else family.mma


class _Column(Mapping):
    """family name -> one field of its record, read from :data:`FAMILIES` when asked."""

    def __init__(self, field: str):
        self._field = field

    def __getitem__(self, name: str):
        return getattr(FAMILIES[name], self._field)

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)

    def __repr__(self) -> str:
        return repr(dict(self))


def column(field: str) -> Mapping:
    """A read-only mapping family name -> the record's ``field`` (e.g. ``"shared_memory"``)."""
    if field not in Family.__dataclass_fields__:
        raise ValueError(f"a GPU family has no field {field!r}")
    return _Column(field)
