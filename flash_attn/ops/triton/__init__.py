"""Upstream's ``flash_attn.ops.triton``: ops whose CUDA path is a Triton kernel (JIT-compiled by
Triton on first use) and whose path on other devices is plain PyTorch."""

import importlib.util


def triton_available() -> bool:
    """Whether Triton can be imported: without it every op here runs its PyTorch path, CUDA too."""
    return importlib.util.find_spec("triton") is not None
