"""The ``triton`` backend: our Triton kernels compiled just in time for the GPU at hand.

Used by ``auto`` on CUDA devices when the ahead-of-time kernels (``aot``) are not installed, or
explicitly with ``FLASH_ATTN_BACKEND=triton``. The first call of each kernel variant compiles it
(seconds); launch configurations come from :mod:`flash_attn.kernels.configs` for the device's
compute capability. Calls the kernels do not cover (fp32 inputs, the backward of paged K/V) run
on the reference backend after a one-time warning; see :func:`flash_attn.kernels.launch.supported`.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_attn.backends._kernel_launchers import kernel_backend

__all__ = ["unavailable_reason", "forward", "backward", "forward_kvcache"]

_NAME = "triton"
MIN_CAPABILITY = (8, 0)


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
    if capability < MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} is below the kernels' minimum 8.0"
    return None


forward, backward, forward_kvcache = kernel_backend(_NAME, interpret=False)
