"""Which backend runs a call: ``FLASH_ATTN_BACKEND``, the device and the call decide.

``FLASH_ATTN_BACKEND`` is read on every call (so tests and users can switch it at run time):

* ``auto`` (default): CUDA tensors go to ``aot``, else ``triton`` (whichever can run on the
  device; with neither, a one-time warning names why), every other device to ``reference``;
* ``aot`` | ``triton`` | ``interpret`` | ``reference``: that backend, or a clear error naming
  what is missing when it cannot run on the device at all.

A backend may still refuse one call (a head dim it was not built for, fp32 inputs, ...): it
answers why, and the call runs on the next backend of the chain (``aot`` -> ``triton`` ->
``reference``; the exact PyTorch reference runs everything), with a one-time warning naming the
reason. This module is the only place that decides and warns.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType
from typing import Callable

import torch

BACKEND_ENV = "FLASH_ATTN_BACKEND"
BACKEND_NAMES = ("auto", "aot", "triton", "interpret", "reference")
# Preference order of ``auto`` on a CUDA device.
_CUDA_PREFERENCE = ("aot", "triton")
# Where a refused call goes next.
_NEXT = {"aot": ("triton", "reference"), "triton": ("reference",), "interpret": ("reference",), "reference": ()}

_MODULES = {
    "aot": "flash_attn.backends.aot",
    "triton": "flash_attn.backends.triton",
    "interpret": "flash_attn.backends.interpret",
    "reference": "flash_attn.backends.reference",
}
_warned: set[str] = set()
_chains: dict[tuple, tuple] = {}


class BackendUnavailableError(RuntimeError):
    """The backend named by ``FLASH_ATTN_BACKEND`` cannot run here."""


def requested_backend() -> str:
    name = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"{BACKEND_ENV}={name!r} is not a backend; expected one of {', '.join(BACKEND_NAMES)}"
        )
    return name


_loaded: dict[str, tuple] = {}


def _load(name: str) -> tuple[ModuleType | None, str | None]:
    """The backend module, or ``(None, reason)`` when it is not part of this installation."""
    module = _MODULES[name]
    found = _loaded.get(module)
    if found is None:
        try:
            found = importlib.import_module(module), None
        except ImportError as exc:
            found = None, f"the {name!r} backend is not installed ({exc})"
        _loaded[module] = found
    return found


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
        warnings.warn(message, UserWarning, stacklevel=4)


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


def _make_chain(name: str, device: torch.device) -> tuple[str, ...]:
    if name == "auto":
        first, reasons = auto_choice(device)
        if first == "reference" and device.type == "cuda":
            warn_once(f"fallback:{device}",
                      f"flash_attn: no GPU kernel backend can run on {device} ({'; '.join(reasons)}); "
                      f"using the exact but slower PyTorch reference backend.")
    else:
        reason = unavailable_reason(name, device)
        if reason is not None:
            raise BackendUnavailableError(f"{BACKEND_ENV}={name} cannot run on {device}: {reason}")
        first = name
    later = tuple(b for b in _NEXT[first] if b == "reference" or unavailable_reason(b, device) is None)
    return (first, *later)


def chain(device: torch.device) -> tuple[str, ...]:
    """The backends a call on ``device`` may run on, in order (what each can run on the device
    is worked out once per process)."""
    key = (requested_backend(), device)
    found = _chains.get(key)
    if found is None:
        found = _chains[key] = _make_chain(*key)
    return found


def reset() -> None:
    """Forget the chains and warnings worked out so far (tests that change what is installed)."""
    _chains.clear()
    _warned.clear()


def select_backend(device: torch.device) -> ModuleType:
    """The first backend module of the chain for ``device`` (what the doctor reports)."""
    return _load(chain(torch.device(device))[0])[0]


def _runner(module: ModuleType, op: str, args, kwargs) -> Callable | str:
    prepare = getattr(module, "prepare_" + op, None)
    if prepare is None:  # a backend that runs every call (the reference)
        return lambda: getattr(module, op)(*args, **kwargs)
    return prepare(*args, **kwargs)


def run(op: str, device: torch.device, *args, **kwargs):
    """Run ``op`` (``"forward"``, ``"backward"`` or ``"forward_kvcache"`` of the backend contract,
    :mod:`flash_attn.backends`) on the first backend of the chain that serves the call."""
    names = chain(device)
    refused = None
    for name in names:
        runner = _runner(_load(name)[0], op, args, kwargs)
        if isinstance(runner, str):
            refused = refused or (name, runner)
            continue
        if refused is not None:
            first, why = refused
            warn_once(f"{first}:{op}:{why}",
                      f"flash_attn: the {first} backend cannot run this {op} ({why}); running it on the {name} backend.")
        return runner()
    raise RuntimeError(f"no backend ran the {op}: {refused}")  # the reference runs every call
