"""The ``triton`` backend: our Triton kernels compiled just in time for the GPU at hand.

Used by ``auto`` on CUDA devices when the ahead-of-time kernels (``aot``) are not installed or do
not serve a call, or explicitly with ``FLASH_ATTN_BACKEND=triton``. The first call of each kernel
variant compiles it (seconds); launch configurations come from :mod:`flash_attn.kernels.configs`
for the device's architecture. The launches are those of :mod:`flash_attn.kernels.plan`; calls it
refuses (fp32 inputs, the backward of paged K/V) run elsewhere (:mod:`flash_attn.dispatch`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from flash_attn import limits
from flash_attn.backends._execute import KernelBackend, launch_kwargs
from flash_attn.kernels import configs, registry
from flash_attn.kernels.plan import Target

__all__ = ["unavailable_reason", "forward", "backward", "forward_kvcache", "prepare_forward", "prepare_backward",
           "prepare_forward_kvcache"]

_NAME = "triton"


def unavailable_reason(device: torch.device) -> Optional[str]:
    device = torch.device(device)
    if device.type != "cuda":
        return f"it compiles GPU kernels and needs CUDA tensors, not {device.type}"
    if getattr(torch.version, "hip", None):
        return "its launch tables are for NVIDIA GPUs, not ROCm"
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    capability = torch.cuda.get_device_capability(device)
    if capability < limits.MIN_CAPABILITY:
        return (f"compute capability {capability[0]}.{capability[1]} is below the kernels' minimum "
                f"{limits.MIN_CAPABILITY[0]}.{limits.MIN_CAPABILITY[1]}")
    return None


@functools.lru_cache(maxsize=None)
def _device_target(index: int) -> Target:
    family = configs.arch_family(torch.cuda.get_device_capability(index))
    return Target(family, torch.cuda.get_device_properties(index).multi_processor_count)


def _target(device) -> Target:
    device = torch.device(device)
    return _device_target(device.index if device.index is not None else torch.cuda.current_device())


def _run_launch(launch, tensors: dict, device) -> None:
    if 0 in launch.grid:
        return
    with torch.cuda.device(device):
        registry.jit_function(launch.kernel)[launch.grid](
            **launch_kwargs(launch, tensors), num_warps=launch.config.num_warps, num_stages=launch.config.num_stages)


_backend = KernelBackend(_NAME, _target, _run_launch)
prepare_forward, prepare_backward, prepare_forward_kvcache, forward, backward, forward_kvcache = _backend.contract()
