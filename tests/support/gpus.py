"""The skip of tests that need two CUDA devices: on a machine with one GPU its reason names "a
second GPU is absent", which conftest's ``--flash-no-skip`` lets pass; without any GPU it does not."""

from __future__ import annotations

import torch


def two_devices_skip_reason() -> str:
    """Why a two-device test cannot run here; "" where it can."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return ""
    if count == 1:
        return "needs 2 CUDA devices: a second GPU is absent (1 CUDA device)"
    return "needs 2 CUDA devices: no CUDA device is available"
