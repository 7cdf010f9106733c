"""Test inputs: drawn on the CPU from seeded generators (the same values on every device), then
moved to the device under test (``--flash-device``)."""

from __future__ import annotations

import torch

from support.options import test_device


def gen(seed: int) -> torch.Generator:
    """A CPU generator: tests draw their inputs on the CPU (device-independent values) and then
    move them to the device under test."""
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, seed_or_gen, device=None, scale=1.0, requires_grad=False):
    g = gen(seed_or_gen) if isinstance(seed_or_gen, int) else seed_or_gen
    t = (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(dtype)
    t = t.to(test_device() if device is None else device)
    return t.requires_grad_(requires_grad)


def make_slopes(shape, seed=0, device=None) -> torch.Tensor:
    """ALiBi slopes in (0.05, 1): float32."""
    g = gen(seed)
    s = 0.05 + 0.95 * torch.rand(shape, generator=g, dtype=torch.float32)
    return s.to(test_device() if device is None else device)


def cu_from_lens(lens, device=None) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=test_device() if device is None else device)
