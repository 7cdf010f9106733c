"""Which GPU family of :mod:`flash_attn.planning.families` a CUDA device of this PyTorch is.

A CUDA build of PyTorch names its GPUs by compute capability; a ROCm build (``torch.version.hip``)
exposes AMD GPUs as ``cuda`` devices too, named by ``gcnArchName`` (``"gfx942:sramecc+:xnack-"``:
an MI300X), whose compute capability is only a stand-in (9.4 for gfx942). The ``triton`` backend,
the fused ops and the doctor ask here, so that both vendors are told apart in one place.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_attn import limits
from flash_attn.planning import families

__all__ = ["is_rocm", "device_name", "family", "family_reason", "takes_tf32"]


def is_rocm() -> bool:
    """Whether this PyTorch is a ROCm build (its ``cuda`` devices are AMD GPUs)."""
    return bool(getattr(torch.version, "hip", None))


def device_name(device: torch.device) -> families.Device:
    """How :func:`flash_attn.planning.families.arch_family` names CUDA ``device``: its
    ``gcnArchName`` under ROCm, else its compute capability."""
    if is_rocm():
        return torch.cuda.get_device_properties(device).gcnArchName
    return tuple(torch.cuda.get_device_capability(device))


def family_reason(device: torch.device) -> Optional[str]:
    """Why the kernels have no family for CUDA ``device`` (``None``: they have one)."""
    name = device_name(device)
    if not isinstance(name, str) and name < limits.MIN_CAPABILITY:
        return (f"compute capability {name[0]}.{name[1]} is below the kernels' minimum "
                f"{limits.MIN_CAPABILITY[0]}.{limits.MIN_CAPABILITY[1]}")
    try:
        families.arch_family(name)
    except ValueError as exc:
        return str(exc)
    return None


def family(device: torch.device) -> str:
    """The family of CUDA ``device`` (``ValueError``: none, :func:`family_reason` says why)."""
    return families.arch_family(device_name(device))


def takes_tf32(device: torch.device) -> bool:
    """Whether Triton compiles fp32 products in TF32 for CUDA ``device``: every NVIDIA GPU the
    kernels run on; on AMD only the families that have it (CDNA3's XF32), none of no family."""
    if not is_rocm():
        return True
    try:
        return families.get(family(device)).tf32
    except ValueError:
        return False
