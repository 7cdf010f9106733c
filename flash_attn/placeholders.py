"""Tensors nothing reads: the stand-ins for a kernel's unused pointers and an op's unused results.

Pure torch (the core layer): the custom ops and the kernel backends both take theirs here.
"""

from __future__ import annotations

import torch

__all__ = ["placeholder"]

_kept: dict[tuple, torch.Tensor] = {}


def placeholder(dtype, device: torch.device, shape: tuple = (16,)) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` that nothing reads or writes: one per ``(dtype, shape)``
    on the CPU (it saves an allocation per call), made per call elsewhere. A kept CUDA tensor would
    cross capture boundaries: one made outside a CUDA graph and used inside it, or one made during
    a cudagraph-trees warm-up (not a capture, but its memory comes from the graphs' private pool)
    that the pool may hand out again while it is kept here."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    key = (dtype, device, shape)
    found = _kept.get(key)
    if found is None:
        found = _kept[key] = torch.empty(shape, dtype=dtype, device=device)
    return found
