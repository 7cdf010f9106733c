"""A diagnostic override of the GPU family the ``aot`` backend plans for: ``FLASH_ATTN_FORCE_FAMILY``.

Without it a device runs the image :meth:`~flash_attn.aot.manifest.Manifest.image_for` picks and
the configs that image carries for it (:func:`~flash_attn.aot.archs.config_capability`). With it
(``sm80`` or ``sm86``; any NVIDIA family whose images exist) the device runs the launch configs of
that family, from an installed image that carries them and runs on the device: how the mma.sync
tables of A100 (``sm80``) and RTX 30xx/40xx/L4 (``sm86``) are measured on an H200, where the
portable ``compute_80`` PTX (Triton's sm_80 code: mma.sync, cp.async) is compiled by the driver
(``.ci/gpu-window prepare-proxy``; ``bench gpu --family``; what such a proxy can and cannot say:
``benchmarks/README.md``, "The mma.sync proxy on the H200").

A forced family is refused, with the reason, when it is no NVIDIA family with images, when its
tiles need more shared memory than the device's own family has (sm80's 163 KB on a 99 KB sm86
GPU), or when no installed image carries its configs and runs on the device (an H200 with only
the ``sm_90a`` cubins). The triton backend ignores it: its JIT compiles for the device's own
instructions, which would not be the forced family's code.

Pure Python (no torch), so it is unit-tested on any machine.
"""

from __future__ import annotations

import os
from typing import Optional, Union

from flash_attn.aot import archs
from flash_attn.planning import families

FORCE_ENV = "FLASH_ATTN_FORCE_FAMILY"


def forced_family() -> Optional[str]:
    """The family named by ``FLASH_ATTN_FORCE_FAMILY`` (``None``: unset or empty), as written."""
    return os.environ.get(FORCE_ENV, "").strip() or None


def family_reason(name: str, capability: tuple[int, int]) -> Optional[str]:
    """Why a device of ``capability`` cannot run family ``name``'s configs at all (``None``: it can)."""
    known = [f.name for f in families.FAMILIES.values() if f.image_capability is not None]
    family = families.FAMILIES.get(name)
    if family is None or family.image_capability is None:
        return f"{FORCE_ENV}={name!r} is no NVIDIA GPU family with images (known: {', '.join(known)})"
    own = families.get(families.arch_family(capability))
    if family.shared_memory > own.shared_memory:
        return (f"{FORCE_ENV}={name}: its tiles may use {family.shared_memory // 1024} KB of shared memory per "
                f"block; this GPU ({own.name}, compute capability {capability[0]}.{capability[1]}) has "
                f"{own.shared_memory // 1024} KB")
    return None


def carrying(available, name: str) -> list[str]:
    """The image architectures among ``available`` whose images carry family ``name``'s configs."""
    return [a for a in available if name in families.families_for(archs.parse_arch(a).capability)]


def choose(manifest, capability: tuple[int, int], driver: Optional[tuple[int, int]],
           name: Optional[str]) -> Union[tuple[archs.ImageChoice, str], str]:
    """``(image, family whose configs it runs)`` for a device of ``capability``: the usual pick
    without ``name``; with ``name``, an image among those carrying that family's configs. A string:
    why no image serves (the refusal)."""
    if name is None:
        choice = manifest.image_for(capability, driver)
        if not choice.supported:
            return choice.reason
        return choice, families.arch_family(archs.config_capability(capability, choice))
    why = family_reason(name, capability)
    if why is not None:
        return why
    candidates = carrying(manifest.archs, name)
    choice = manifest.image_for(capability, driver, among=candidates) if candidates else None
    if choice is None or not choice.supported:
        installed = ", ".join(f"{a} ({'/'.join(families.families_for(archs.parse_arch(a).capability))})"
                              for a in manifest.archs) or "none"
        detail = f": {choice.reason}" if choice is not None else ""
        return (f"{FORCE_ENV}={name}: no installed image carries the {name} configs and runs on compute capability "
                f"{capability[0]}.{capability[1]}{detail} (installed in {manifest.folder}: {installed}); build "
                f"them with `.ci/gpu-window prepare-proxy` or `python -m flash_attn build-kernels --archs compute_80`")
    return choice, name
