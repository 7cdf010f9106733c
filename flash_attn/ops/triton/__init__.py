"""Upstream's ``flash_attn.ops.triton``: ops whose CUDA path is a Triton kernel (JIT-compiled by
Triton on first use) and whose path on other devices is plain PyTorch."""

import functools
import importlib.util

import torch


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported: without it every op here runs its PyTorch path, CUDA too."""
    return importlib.util.find_spec("triton") is not None


def cuda_launch(kernel, grid, **kwargs) -> None:
    """Launch on the GPU that holds the tensors (Triton launches on the current device);
    ``wrap_triton`` lets ``torch.compile`` trace the launch."""
    device = next(v.device for v in kwargs.values() if isinstance(v, torch.Tensor))
    if device.index is None or device.index == torch.cuda.current_device():
        torch.library.wrap_triton(kernel)[grid](**kwargs)
        return
    with torch.cuda.device(device):
        torch.library.wrap_triton(kernel)[grid](**kwargs)
