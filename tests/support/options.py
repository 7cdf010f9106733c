"""The backend and device this run tests, as conftest's ``--flash-backend`` and ``--flash-device``
set them (:func:`configure`, from ``pytest_configure``), for tests and helpers that need them
outside a fixture (e.g. at collection, in ``pytest.mark.skipif``)."""

from __future__ import annotations

import pytest
import torch

_STATE = {"backend": "cpu", "device": "cpu"}


def configure(backend: str | None, device: str) -> str:
    """Record the options; returns the backend (default: ``cpu`` on the CPU, else ``reference``)."""
    _STATE["device"] = device
    _STATE["backend"] = backend or ("cpu" if device == "cpu" else "reference")
    return _STATE["backend"]


def backend_name() -> str:
    return _STATE["backend"]


def test_device() -> torch.device:
    return torch.device(_STATE["device"])


test_device.__test__ = False  # not a test


def skip_unless_the_interpreter_runs() -> None:
    """Skip a test that runs Triton kernels in Triton's interpreter where that interpreter is too
    old for them (a GPU runner's Triton is PyTorch's, e.g. 3.6; the same kernels run compiled in
    its CUDA tests)."""
    from flash_attn.backends import interpret  # noqa: PLC0415

    reason = interpret.unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def backends_here() -> list[str]:
    """Every backend that can run on the test device here (``auto`` is one of them, under its own
    name): the property tests run each of them."""
    from flash_attn import dispatch  # noqa: PLC0415

    device = test_device()
    return [name for name in dispatch.BACKEND_NAMES if name != "auto" and dispatch.unavailable_reason(name, device) is None]
