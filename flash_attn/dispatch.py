"""Which backend runs a call: ``FLASH_ATTN_BACKEND`` and the device decide.

``FLASH_ATTN_BACKEND`` is read on every call (so tests and users can switch it at run time):

* ``auto`` (default): CUDA tensors try ``aot``, then ``triton``, then fall back to
  ``reference`` with a one-time warning naming the reason; every other device uses ``reference``.
* ``aot`` | ``triton`` | ``interpret`` | ``reference``: exactly that backend, or a clear error
  naming what is missing.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch

BACKEND_ENV = "FLASH_ATTN_BACKEND"
BACKEND_NAMES = ("auto", "aot", "triton", "interpret", "reference")
# Preference order of ``auto`` on a CUDA device.
_CUDA_PREFERENCE = ("aot", "triton")

_MODULES = {
    "aot": "flash_attn.backends.aot",
    "triton": "flash_attn.backends.triton",
    "interpret": "flash_attn.backends.interpret",
    "reference": "flash_attn.backends.reference",
}
_warned: set[str] = set()


class BackendUnavailableError(RuntimeError):
    """The backend named by ``FLASH_ATTN_BACKEND`` cannot run here."""


def requested_backend() -> str:
    name = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"{BACKEND_ENV}={name!r} is not a backend; expected one of {', '.join(BACKEND_NAMES)}"
        )
    return name


def _load(name: str) -> tuple[ModuleType | None, str | None]:
    """The backend module, or ``(None, reason)`` when it is not part of this installation."""
    try:
        return importlib.import_module(_MODULES[name]), None
    except ImportError as exc:
        return None, f"the {name!r} backend is not installed ({exc})"


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device``, or ``None`` if it can."""
    module, reason = _load(name)
    if module is None:
        return reason
    return module.unavailable_reason(device)


def warn_once(key: str, message: str) -> None:
    """Emit a ``UserWarning`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def select_backend(device: torch.device) -> ModuleType:
    """The backend module that runs tensors on ``device`` under the current setting."""
    name = requested_backend()
    if name != "auto":
        reason = unavailable_reason(name, device)
        if reason is not None:
            raise BackendUnavailableError(f"{BACKEND_ENV}={name} cannot run on {device}: {reason}")
        return _load(name)[0]
    if device.type == "cuda":
        reasons = []
        for candidate in _CUDA_PREFERENCE:
            reason = unavailable_reason(candidate, device)
            if reason is None:
                return _load(candidate)[0]
            reasons.append(f"{candidate}: {reason}")
        warn_once(
            f"fallback:{device}",
            f"flash_attn: no GPU kernel backend can run on {device} "
            f"({'; '.join(reasons)}); using the exact but slower PyTorch reference backend.",
        )
    return _load("reference")[0]


def auto_choice(device: torch.device) -> tuple[str, list[str]]:
    """What ``auto`` picks on ``device`` and why each better backend was passed over."""
    if device.type != "cuda":
        return "reference", [f"{device.type} tensors always use the reference backend"]
    reasons = []
    for candidate in _CUDA_PREFERENCE:
        reason = unavailable_reason(candidate, device)
        if reason is None:
            return candidate, reasons
        reasons.append(f"{candidate}: {reason}")
    return "reference", reasons
