"""A ROCm PyTorch with one AMD GPU, simulated: no AMD GPU is available to this project.

:func:`simulate` stubs what the package reads of PyTorch on ROCm: ``torch.version.hip``,
``torch.cuda.is_available``, ``get_device_properties`` (a ``gcnArchName`` and a CU count) and the
stand-in compute capability ROCm reports. It stands in for ROCm PyTorch's own answers on an
MI300X, MI355X, RX 7900 XTX or RX 9070 XT; it cannot show that anything runs on one.
"""

from __future__ import annotations

import types

import torch

# gcnArchName as ROCm PyTorch reports it -> (family, compute units)
DEVICES = {
    "gfx942:sramecc+:xnack-": ("cdna3", 304),   # MI300X
    "gfx950:sramecc+:xnack-": ("cdna4", 256),   # MI355X
    "gfx1100": ("rdna3", 96),                    # RX 7900 XTX
    "gfx1101": ("rdna3", 60),                    # RX 7800 XT
    "gfx1201": ("rdna4", 64),                    # RX 9070 XT
    "gfx1200": ("rdna4", 32),                    # RX 9060 XT
}
# one device per family: the processor its kernels are compiled for
BY_FAMILY = {"cdna3": "gfx942:sramecc+:xnack-", "cdna4": "gfx950:sramecc+:xnack-", "rdna3": "gfx1100",
             "rdna4": "gfx1201"}


def simulate(monkeypatch, gcn_arch: str, compute_units: int = 104):
    """PyTorch answers as ROCm with one AMD GPU ``gcn_arch``; returns the triton backend module
    (its per-device targets forgotten, so that it asks again)."""
    from flash_attn.backends import triton as triton_backend

    family = DEVICES.get(gcn_arch, ("", compute_units))[0]
    props = types.SimpleNamespace(gcnArchName=gcn_arch, multi_processor_count=DEVICES.get(gcn_arch, (0, compute_units))[1],
                                  name=f"AMD {gcn_arch}", warp_size=64 if family.startswith("cdna") else 32)
    monkeypatch.setattr(torch.version, "hip", "7.1.25424", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    # ROCm's stand-in capability (9.4 on gfx942): the family is never read from it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    triton_backend._device_target.cache_clear()  # the caller clears it again when done
    return triton_backend
