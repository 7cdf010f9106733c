"""Which ahead-of-time image runs on a given device (the GPU families whose configs the images
carry: :mod:`flash_attn.planning.families`).

The package ships, per kernel, one cubin per architecture it was compiled for plus PTX for the
oldest one (see ``FLASH_ATTN_CUDA_ARCHS``). For a device of compute capability ``major.minor``:

1. the cubin with the same major and the highest minor not above the device's, among those that
   run there: a plain ``sm_XY`` cubin runs on ``X.Y`` and every later ``X.*``; an arch-specific
   ``sm_XYa`` cubin (what Triton emits for 9.0 and up, using wgmma/tcgen05) runs on ``X.Y`` only;
   a family ``sm_XYf`` cubin runs on ``X.Y`` and later minors of the same family;
2. else the newest PTX not above the device (the driver compiles it on first use; a device newer
   than every cubin, e.g. a future 13.0, or a 12.1 when only ``sm_120a`` is shipped);
3. else nothing: the dispatcher falls back to Triton or the reference backend (e.g. 7.5).

Pure Python and no torch (its one import, the GPU families, neither), so it is unit-tested on any machine.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from flash_attn.planning import families

# The default of FLASH_ATTN_CUDA_ARCHS is declared once, as the build targets of the conda recipe
# (recipe/recipe.yaml's context `cuda_archs`, which passes them to its builds): Ampere/Ada cubins
# (sm_80 runs on every 8.x), Hopper's arch-specific cubin (wgmma), family cubins for datacenter
# Blackwell (sm_100f: B200/GB200 10.0 and B300/GB300 10.3), Thor (sm_110f) and consumer Blackwell
# (sm_120f: RTX 50xx 12.0, DGX Spark 12.1), and sm_80 PTX for anything newer.
_SOURCE_ROOT = Path(__file__).resolve().parents[2]
_RECIPE_ARCHS = re.compile(r'^  cuda_archs: "([^"]+)"$', re.M)


@functools.cache
def default_cuda_archs() -> str:
    """The declared build targets: the recipe's beside a source tree (a checkout, an sdist, a release
    tarball); for an installed package, what its build recorded in ``_C/build_config.json`` (the
    recipe's list, else the list it was built for); else "" (none known: callers ask for a list)."""
    recipe = _SOURCE_ROOT / "recipe" / "recipe.yaml"
    if (_SOURCE_ROOT / "pyproject.toml").is_file() and recipe.is_file():
        match = _RECIPE_ARCHS.search(recipe.read_text())
        if match:
            return match.group(1)
    try:
        config = json.loads((Path(__file__).resolve().parents[1] / "_C" / "build_config.json").read_text())
    except (OSError, ValueError):
        return ""
    for key in ("declared_cuda_archs", "cuda_archs"):
        value = str(config.get(key) or "").strip()
        if value and value.lower() not in ("none", "native"):
            return value
    return ""


def __getattr__(name: str):
    # DEFAULT_CUDA_ARCHS on first use: the run-time imports of this module read no file.
    if name == "DEFAULT_CUDA_ARCHS":
        return default_cuda_archs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True, order=True)
class Arch:
    """One image architecture: ``sm_80`` (cubin), ``sm_90a`` (arch-specific cubin), ``compute_80`` (PTX)."""

    major: int
    minor: int
    suffix: str = ""  # "" (portable), "a" (this exact arch only), "f" (this family)
    ptx: bool = False

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)

    @property
    def name(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.major}{self.minor}{self.suffix}"

    def __str__(self) -> str:
        return self.name

    def runs_on(self, major: int, minor: int) -> bool:
        """Whether a device of capability ``major.minor`` can run this image."""
        if self.suffix == "a":
            return (major, minor) == (self.major, self.minor)
        if self.ptx:
            # Portable PTX is compiled by the driver for any later device; family PTX within its major.
            if self.suffix == "f":
                return major == self.major and minor >= self.minor
            return (major, minor) >= (self.major, self.minor)
        return major == self.major and minor >= self.minor


_ARCH_RE = re.compile(r"^(sm_?|compute_?)?(\d+)(?:\.(\d))?([af]?)$")


def parse_arch(text: str) -> Arch:
    """``"sm_80"``, ``"sm80"``, ``"80"``, ``"8.0"``, ``"sm_90a"``, ``"90a"``, ``"compute_80"`` -> Arch."""
    raw = text.strip()
    match = _ARCH_RE.match(raw.lower())
    if not match:
        raise ValueError(f"cannot read GPU architecture {text!r}: expected e.g. 'sm_80', '90a', '8.6' or 'compute_80'")
    prefix, digits, dotted_minor, suffix = match.groups()
    if dotted_minor is not None:
        major, minor = int(digits), int(dotted_minor)
    else:
        if len(digits) < 2:
            raise ValueError(f"cannot read GPU architecture {text!r}: give major and minor, e.g. '80' or '8.0'")
        major, minor = int(digits[:-1]), int(digits[-1])
    return Arch(major, minor, suffix, ptx=bool(prefix and prefix.startswith("compute")))


def parse_arch_list(text: Optional[str]) -> list[Arch]:
    """The ``FLASH_ATTN_CUDA_ARCHS`` format: entries separated by ``;``, ``,`` or spaces; ``80+PTX``
    adds ``compute_80`` to ``sm_80``; ``compute_80`` alone ships PTX only. Empty: the default."""
    if text is None or not text.strip():
        text = default_cuda_archs()
        if not text:
            raise ValueError("no default GPU architectures here (no recipe/recipe.yaml beside this flash_attn, no "
                             "recorded build targets): name them, e.g. FLASH_ATTN_CUDA_ARCHS='80;90'")
    out: list[Arch] = []
    for entry in re.split(r"[;,\s]+", text.strip()):
        if not entry:
            continue
        with_ptx = entry.upper().endswith("+PTX")
        arch = parse_arch(entry[:-4] if with_ptx else entry)
        if with_ptx and arch.suffix == "a":
            raise ValueError(f"{entry!r}: PTX of an arch-specific target only runs on that exact GPU; ship PTX of a portable arch")
        candidates = [arch] if not with_ptx or arch.ptx else [arch, Arch(arch.major, arch.minor, arch.suffix, ptx=True)]
        for a in candidates:
            if a not in out:
                out.append(a)
    if not out:
        raise ValueError(f"FLASH_ATTN_CUDA_ARCHS={text!r} names no architecture")
    return out


@dataclass(frozen=True)
class ImageChoice:
    """What :func:`select_image` picked: ``kind`` is ``"cubin"``, ``"ptx"`` or ``"unsupported"``."""

    kind: str
    arch: Optional[Arch]
    reason: str

    @property
    def supported(self) -> bool:
        return self.kind != "unsupported"


def select_image(capability: tuple[int, int], available: Iterable[Arch | str]) -> ImageChoice:
    """Pick the image for a device of compute capability ``capability`` from the shipped ``available``."""
    major, minor = capability
    archs = [a if isinstance(a, Arch) else parse_arch(a) for a in available]
    device = f"compute capability {major}.{minor}"
    # Among runnable cubins: highest minor; at equal capability prefer the most specific build
    # ("a" over "f" over portable), which is the one compiled for exactly this chip.
    specificity = {"a": 2, "f": 1, "": 0}
    cubins = [a for a in archs if not a.ptx and a.runs_on(major, minor)]
    if cubins:
        best = max(cubins, key=lambda a: (a.capability, specificity[a.suffix]))
        return ImageChoice("cubin", best, f"{best.name} cubin runs on {device}")
    ptxs = [a for a in archs if a.ptx and a.runs_on(major, minor)]
    if ptxs:
        best = max(ptxs, key=lambda a: (a.capability, specificity[a.suffix]))
        return ImageChoice("ptx", best, f"no shipped cubin runs on {device}; the driver compiles {best.name} PTX")
    shipped = ", ".join(a.name for a in sorted(archs)) or "none"
    return ImageChoice("unsupported", None, f"no shipped image runs on {device} (shipped: {shipped})")


def config_capability(capability: tuple[int, int], choice: ImageChoice) -> tuple[int, int]:
    """Whose launch configs a device runs: its own on a cubin (compiled for its family), and on
    PTX (the sm_80 PTX on a GPU newer than every cubin) those of a family that PTX was built with
    whose tiles fit the device's shared memory (:func:`~flash_attn.planning.families.configs_from_image`:
    sm80's where the device has A100-sized shared memory, else sm86's)."""
    if choice.kind != "ptx":
        return capability
    family = families.configs_from_image(families.arch_family(capability), choice.arch.capability)
    return families.get(family).image_capability
