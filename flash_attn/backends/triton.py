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


def _launch():
    from flash_attn.kernels import launch  # noqa: PLC0415

    return launch


def forward(q, k, v, params, *, varlen=None, alibi_slopes=None, return_softmax=False):
    return _launch().contract_forward(_NAME, False, q, k, v, params, varlen=varlen, alibi_slopes=alibi_slopes,
                                      return_softmax=return_softmax)


def backward(dout, q, k, v, out, lse, params, *, varlen=None, alibi_slopes=None, deterministic=False):
    return _launch().contract_backward(_NAME, False, dout, q, k, v, out, lse, params, varlen=varlen,
                                       alibi_slopes=alibi_slopes, deterministic=deterministic)


def forward_kvcache(q, params, cache, *, alibi_slopes=None):
    return _launch().contract_forward_kvcache(_NAME, False, q, params, cache, alibi_slopes=alibi_slopes)
