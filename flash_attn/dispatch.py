"""Which backend runs a call: ``FLASH_ATTN_BACKEND``, the device and the call decide.

``FLASH_ATTN_BACKEND`` is read on every call (so tests and users can switch it at run time):

* ``auto`` (default): CUDA tensors go to ``aot``, else ``triton`` (whichever can run on the
  device), CPU tensors to ``cpu`` (PyTorch's fused CPU kernels where they are exact, else the
  reference's tiled engine), every other device to ``reference``. When ``aot`` cannot run on a
  GPU, one warning per device names why (a driver too old for the images, no image for the GPU,
  ...) and the backend used instead;
* ``aot`` | ``triton`` | ``interpret`` | ``cpu`` | ``reference``: that backend, or a clear error
  naming what is missing when it cannot run on the device at all (``reference`` is the exact
  tiled definition alone, on any device).

A backend may still refuse one call (a head dim it was not built for, fp32 inputs, ...): it
answers why, before anything runs, and the call runs on the next backend of the chain (``aot`` ->
``triton`` -> ``reference``; the exact PyTorch reference runs everything, as does ``cpu``), with a
one-time warning naming the reason. A backend may also fail on first use (Triton without a C compiler for
its launcher, an unwritable Triton cache, a kernel that does not compile: the backend raises its
``BackendFailed``): the call runs on the next backend, with one warning naming the cause and the
fix; a failure of the machine (compiler, cache) moves every later call too.

``FLASH_ATTN_STRICT_BACKEND=1`` turns those fallbacks into errors for the backend that
``FLASH_ATTN_BACKEND`` names (``aot``, ``triton`` or ``interpret``): a call it refuses, or a
failure on first use, raises :class:`BackendRefusedError` naming the backend and the reason (no
effect under ``auto``, ``cpu`` or ``reference``). :func:`last_backend` names the backend that ran
this thread's last call (for tests that must know; calls with nothing to compute do not reach a
backend and leave it unchanged).

Eager calls (:func:`flash_attn.custom_ops.eager_call`) may first take the chosen backend's own
route around the op and the general plan (:func:`run_direct`; the ``cpu`` backend's plain calls):
the backend decides which calls it takes. An eager call with a checked signature (dense or packed,
without dropout) runs the plan the first backend holds for the signature, made and held on the
signature's first call (:func:`run_known`), without the general route's preparation; a refusal or
a failure there goes to the general route, which tells and fails over as always.

CUDA-graph capture: the reference backend reads tensor values on the host, which capture
forbids. A CUDA call that would run on it while the stream is capturing raises
:class:`GraphCaptureError` instead, before anything runs, naming why the kernels did not take it.

This module is the only place that decides and warns.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from flash_attn import environ, validation
from flash_attn.backends.contract import LANE_OPS, Backend
from flash_attn.planning.plan import Refusal
from flash_attn.params import KeyLengths
from flash_attn.validation import CHECKED_LIMIT

BACKEND_ENV = "FLASH_ATTN_BACKEND"
STRICT_ENV = "FLASH_ATTN_STRICT_BACKEND"
BACKEND_NAMES = ("auto", "aot", "triton", "interpret", "cpu", "reference")
# The backends FLASH_ATTN_STRICT_BACKEND holds to their calls.
KERNEL_BACKENDS = ("aot", "triton", "interpret")
# Preference order of ``auto`` on a CUDA device.
_CUDA_PREFERENCE = ("aot", "triton")
# Where a refused call goes next.
_NEXT = {"aot": ("triton", "reference"), "triton": ("reference",), "interpret": ("reference",), "cpu": (),
         "reference": ()}
# Device types whose calls ``auto`` gives to the GPU kernel backends (tests add "meta" to stand
# in for a GPU).
GPU_DEVICE_TYPES = ("cuda",)



# Each backend imported only when first asked for (aot and triton import the planner, the op
# library and Triton), by a plain import that readers and the import-graph test can follow.
def _import_aot() -> Backend:
    from flash_attn.backends import aot  # noqa: PLC0415

    return aot.BACKEND


def _import_triton() -> Backend:
    from flash_attn.backends import triton  # noqa: PLC0415

    return triton.BACKEND


def _import_interpret() -> Backend:
    from flash_attn.backends import interpret  # noqa: PLC0415

    return interpret.BACKEND


def _import_cpu() -> Backend:
    from flash_attn.backends import cpu  # noqa: PLC0415

    return cpu.BACKEND


def _import_reference() -> Backend:
    from flash_attn.backends import reference  # noqa: PLC0415

    return reference.BACKEND


_IMPORTERS: dict[str, Callable[[], Backend]] = {
    "aot": _import_aot, "triton": _import_triton, "interpret": _import_interpret, "cpu": _import_cpu,
    "reference": _import_reference,
}
_warned: set[str] = set()
# settings and device -> the chain; with a route kind and op -> _first_route's; settings and "lanes" ->
# the signatures' lanes (_hold_lane)
_chains: dict[tuple, tuple | dict] = {}
_failed: dict[str, "_Skip"] = {}  # backend -> how it failed for good on this machine (first use)
_thread = threading.local()


class BackendUnavailableError(RuntimeError):
    """The backend named by ``FLASH_ATTN_BACKEND`` cannot run here."""


class BackendRefusedError(RuntimeError):
    """Under ``FLASH_ATTN_STRICT_BACKEND=1``: the named backend refused a call, or failed on it."""


class GraphCaptureError(RuntimeError):
    """A call no GPU kernel takes, made during CUDA-graph capture (the reference backend cannot
    run there)."""


def requested_backend() -> str:
    name = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"{BACKEND_ENV}={name!r} is not a backend; expected one of {', '.join(BACKEND_NAMES)}"
        )
    return name


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def strict() -> bool:
    """Whether ``FLASH_ATTN_STRICT_BACKEND`` is set (``1``/``true``/``yes``/``on``)."""
    value = os.environ.get(STRICT_ENV, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{STRICT_ENV}={value!r}: expected 1 or 0")
    return value in _TRUE


def last_backend() -> Optional[str]:
    """The backend that ran this thread's last call (``None`` before the first)."""
    return getattr(_thread, "backend", None)


_loaded: dict[str, tuple] = {}


def _load(name: str) -> tuple[Backend | None, str | None]:
    """The backend, or ``(None, reason)`` when it is not part of this installation."""
    found = _loaded.get(name)
    if found is None:
        try:
            found = _IMPORTERS[name](), None
        except ImportError as exc:
            found = None, f"the {name!r} backend is not installed ({exc})"
        except Exception as exc:  # noqa: BLE001  (a broken dependency, e.g. a Triton whose import fails otherwise)
            found = None, f"the {name!r} backend cannot be imported ({type(exc).__name__}: {exc})"
        _loaded[name] = found
    return found


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device``, or ``None`` if it can."""
    backend, reason = _load(name)
    if backend is None:
        return reason
    try:
        return backend.unavailable_reason(device)
    except Exception as exc:  # noqa: BLE001  (a backend that cannot tell is not used: the reason says why)
        return f"its check of the device failed ({type(exc).__name__}: {exc})"


def warn_once(key: str, message: str) -> None:
    """Emit a ``UserWarning`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=4)


def auto_choice(device: torch.device) -> tuple[str, list[str]]:
    """What ``auto`` picks on ``device`` and why each better backend was passed over."""
    if device.type == "cpu":
        return "cpu", []
    if device.type not in GPU_DEVICE_TYPES:
        return "reference", [f"{device.type} tensors always use the reference backend"]
    reasons = []
    for candidate in _CUDA_PREFERENCE:
        reason = unavailable_reason(candidate, device)
        if reason is None:
            return candidate, reasons
        reasons.append(f"{candidate}: {reason}")
    return "reference", reasons


def _warn_downgrade(first: str, reasons: list[str], device: torch.device) -> None:
    """One warning per GPU where ``auto`` cannot use the shipped kernels, with the reasons."""
    if device.type not in GPU_DEVICE_TYPES or first == "aot":
        return
    if first == "reference":
        warn_once(f"fallback:{device}",
                  f"flash_attn: no GPU kernel backend can run on {device} ({'; '.join(reasons)}); "
                  f"using the exact but slower PyTorch reference backend.")
    else:
        warn_once(f"downgrade:{device}",
                  f"flash_attn: the shipped kernels (aot) cannot run on {device} ({'; '.join(reasons)}); using the "
                  f"{first} backend (kernels compiled on first use: slower to start, same results).")


@dataclass(frozen=True)
class Route:
    """What a call on ``device`` does with the environment as set (:func:`route`): it runs on
    ``backends`` (the first that serves it; empty when every call raises ``error`` instead).
    ``passed_over``: why ``auto`` did not pick a better backend."""

    device: torch.device
    backends: tuple[str, ...]
    error: Optional[Exception] = None
    passed_over: tuple[str, ...] = ()


def route(device: torch.device) -> Route:
    """What a call on ``device`` does, with the environment as it is set now: the one decision the
    dispatcher acts on (:func:`chain`) and the doctor reports. An invalid setting
    (``FLASH_ATTN_BACKEND``, ``FLASH_ATTN_STRICT_BACKEND``, a backend's own, such as
    ``FLASH_ATTN_CPU_ONEDNN``), or a named backend that cannot run on the device, makes every call
    raise."""
    device = torch.device(device)
    try:
        strict()
        name = requested_backend()
    except ValueError as exc:
        return Route(device, (), exc)
    if name == "auto":
        first, reasons = auto_choice(device)
    else:
        reason = unavailable_reason(name, device)
        if reason is not None:
            return Route(device, (), BackendUnavailableError(f"{BACKEND_ENV}={name} cannot run on {device}: {reason}"))
        first, reasons = name, []
    later = tuple(b for b in _NEXT[first] if b == "reference" or unavailable_reason(b, device) is None)
    backends = (first, *later)
    for backend in backends:
        error = _load(backend)[0].settings_error()
        if error is not None:
            return Route(device, (), ValueError(error))
    return Route(device, backends, passed_over=tuple(reasons))


def chain(device: torch.device) -> tuple[str, ...]:
    """The backends a call on ``device`` may run on, in order (:func:`route`, worked out once
    per process and setting)."""
    key = (_backend_setting(), _strict_setting(), device)  # the raw settings (read as settings on a miss)
    found = _chains.get(key)
    if found is None:
        decided = route(device)
        if decided.error is not None:
            raise decided.error
        _warn_downgrade(decided.backends[0], list(decided.passed_over), device)
        found = _chains[key] = decided.backends
    return found


_backend_setting, _strict_setting = environ.raw_getter(BACKEND_ENV), environ.raw_getter(STRICT_ENV)


def reset() -> None:
    """Forget the chains, failures and warnings worked out so far (tests that change what is
    installed)."""
    _chains.clear()
    _warned.clear()
    _failed.clear()
    _routes.clear()
    for backend, _ in _loaded.values():
        if backend is not None and backend.held is not None:
            backend.held.clear()


_routes: dict[tuple[str, str, str], Optional[Callable]] = {}


def _route(name: str, kind: str, op: str) -> Optional[Callable]:
    """Backend ``name``'s ``direct`` or ``known`` route of ``op`` (``None``: it has none)."""
    route = _routes.get((name, kind, op), _routes)
    if route is _routes:
        route = _routes[name, kind, op] = getattr(_load(name)[0], kind).get(op)
    return route


def _first_route(device: torch.device, kind: str, op: str) -> tuple[str, Optional[Callable]]:
    """The first backend of ``device``'s chain and its ``kind`` route of ``op`` (:func:`_route`),
    held beside the chain, under the same settings (one lookup per eager call)."""
    key = (_backend_setting(), _strict_setting(), device, kind, op)
    found = _chains.get(key)
    if found is None:
        name = chain(device)[0]
        found = _chains[key] = (name, _route(name, kind, op))
    return found


def run_direct(op: str, device: torch.device, tensors: tuple, scalars: tuple):
    """The result of the first backend of ``device``'s chain on its own route for an eager call
    of ``op`` (its ``Backend.direct[op]``, given the op's arguments: its ``tensors``, then its
    ``scalars``), or ``None`` when it has no such route or its route does not take this call (then
    the caller runs the op). Callers make sure the call is eager (nothing traces it); the backend
    decides everything else."""
    name, route = _first_route(device, "direct", op)
    if route is None or name in _failed:
        return None
    result = route(*tensors, *scalars)
    if result is not None:
        _thread.backend = name
    return result


def run_known(op: str, device: torch.device, call: int, *args):
    """``op``'s results from the first backend of ``device``'s chain by the call's checked signature
    ``call`` (its ``Backend.known[op]``, the kernel backends': the plan held for the signature and
    the pointers' alignment, made and held on its first call), or ``None``: the backend has no such
    route or refuses the call; then the caller takes :func:`run`, which also tells and fails over
    when the backend fails on the call (a failure here is left to it). The signature's lane runs
    the call where it has one (:func:`run_lane`); after the known route, the lane is held. Only
    for eager calls without dropout; ``args`` per op (``varlen``: the packed call's
    :class:`~flash_attn.params.VarlenLayout` or ``None``; ``scalars``: softmax_scale, window_left,
    window_right, softcap):

    - ``forward``: q, k, v, alibi_slopes, sinks, qv, return_softmax, varlen, scalars -> (out, lse, s_dmask);
    - ``backward``: dout, q, k, v, out, lse, alibi_slopes, qv, deterministic, return_delta, varlen, scalars;
    - ``forward_kvcache``: q, cache (:class:`~flash_attn.params.KVCacheInputs`), alibi_slopes, sinks, qv,
      scalars.
    """
    laned = op in LANE_OPS
    if laned:
        result = run_lane(op, call, *args)
        if result is not None:
            return result
    name, route = _first_route(device, "known", op)
    if route is None or name in _failed:
        return None
    result = _ran_on(name, route, device, call, *args)
    if laned:
        _hold_lane(op, device, call, name, args)
    return result


def run_lane(op: str, call: int, *args):
    """``op``'s results by the lane of checked signature ``call``, as :func:`run_known` gives them
    (same ``args``), or ``None``: no lane under the current settings and chain, or the lane does not
    take the call (pointers not aligned, the backend refuses the signature, its plans forgotten).
    A lane (``Backend.lane``, the kernel backends') is the known route's hit path held for one
    signature: the call's tensors to the held plan's launches, nothing looked up or described. It
    is held once the known route has run the signature with aligned pointers
    (:func:`run_known`). The caller makes sure what :func:`run_known` asks: an eager call without
    dropout, its values checked where they are. A backend failure is left to the usual route.
    A signature of a :class:`~flash_attn.params.KeyLengths` class without a lane of its own
    takes the class's (``Backend.class_lane``, held from the class's second signature on the known
    route): its plan filled in from the class's template, nothing described."""
    lanes = _chains.get((_backend_setting(), _strict_setting(), "lanes"))
    if lanes is None:
        return None
    lane = lanes.get((op, call))
    if lane is None:
        lane = lanes.get((op, _CLASS, call.shared)) if type(call) is KeyLengths else None
        if lane is None:
            return None
    name, run = lane
    return None if name in _failed else _ran_on(name, run, call, *args)


def _ran_on(name: str, run: Callable, *args):
    """``run(*args)``, a route of backend ``name``: its result (the thread's last backend, where it
    gave one), or ``None`` where the backend failed on the call (its own failure, which the general
    route tells and fails over from; any other error is raised)."""
    try:
        result = run(*args)
    except Exception as exc:
        if _backend_failure(name, exc) is None:
            raise
        return None
    if result is not None:
        _thread.backend = name
    return result


def _hold_lane(op: str, device: torch.device, call: int, name: str, args: tuple) -> None:
    """After the known route of backend ``name`` ran a call of ``op``'s signature ``call`` (so its
    lane, if any, did not take it): from the signature's second such call, hold the backend's lane
    of it, made anew from the plans it holds now, or forget the lane while it holds none for aligned
    pointers (the next call asks again). A signature met once (a growing cache's new key length in
    a model's first layer) makes none; the signatures of a :class:`~flash_attn.params.KeyLengths`
    class, from the class's second on the known route, hold the class's lane. ``args``: the call's
    known-route arguments, from which a lane takes what its op's plan key adds to the signature (the
    backward's gradient strides and options). Lanes are held beside the chain, under the same
    settings (:func:`reset` and a new chain forget them), at most
    :data:`~flash_attn.validation.CHECKED_LIMIT` of them (then forgotten all at once)."""
    backend = _load(name)[0]
    if backend.lane is None:
        return
    key = (_backend_setting(), _strict_setting(), "lanes")
    lanes = _chains.get(key)
    if lanes is None:
        lanes = _chains[key] = {}
    if len(lanes) >= CHECKED_LIMIT:
        lanes.clear()
    _hold(lanes, (op, call), name, lambda: backend.lane(op, device, call, *args))
    if type(call) is KeyLengths and backend.class_lane is not None:
        _hold(lanes, (op, _CLASS, call.shared), name, lambda: backend.class_lane(op, device, call.shared))


_CLASS = "class"  # (op, _CLASS, the class's key): a class's lane among the signatures' (op, key)


# ---------------------------------------------------------------------------------------------
# Held lanes: a public call's whole route held outside Python by the backend that runs it
# (Backend.held: the aot backend's op library), found by the public function's own scalars.


def run_held(tag: str, tensors: tuple, scalars: tuple, shapes: tuple, remember: bool = False):
    """The results of the lane a backend holds for an eager call of public function ``tag``
    with these ``scalars`` (values and types) and ``tensors`` (the ones given, plain tensors, none
    with a graph to record: the caller's test, made before it reads the shapes) of ``shapes``
    (each argument's or ``None``: calls whose shapes change every call ask the backend nothing),
    or ``None``: none is held under the current settings, the call is traced, or no held lane fits
    the tensors (the backend compares their sizes, strides, dtypes, devices and pointers'
    alignment with the call it held). Held by :func:`hold_held`, only for signatures whose checks
    passed: a call it takes is one the public function's checks pass. A backend failure is left to
    the usual route. With ``remember``, arguments met for the first time give :data:`FIRST_MET`
    (:func:`_held_entry`)."""
    found = _held_entry(tag, scalars, shapes, remember)
    return found if found is None or found is FIRST_MET else _held_made(found[0], found[1], found[2], tensors)


def _held_entry(tag: str, scalars: tuple, shapes: tuple, remember: bool = False):
    """What :func:`hold_held` or :func:`hold_training` held for these arguments under the current
    settings, or ``None`` (none, the backend failed before, or the call is traced). With
    ``remember`` (a public function whose arguments are held only once met again: a packed
    batch's, in a model's later layers), arguments met for the first time are remembered and give
    :data:`FIRST_MET` (the caller then holds nothing for them)."""
    held = _chains.get((_backend_setting(), _strict_setting(), _HELD))
    if (held is None and not remember) or _failed:
        return None
    try:
        signature = (tag, scalars, _types(scalars), shapes)
        found = None if held is None else held.get(signature)
    except TypeError:  # an unhashable scalar (a list): no held lane
        return None
    if found is None:
        return _first_met(signature) if remember else None
    return None if _traced() else found


def _first_met(signature: tuple):
    """:data:`FIRST_MET` where ``signature`` is met for the first time (then remembered, beside the
    chains: at most :data:`HELD_LIMIT`, then forgotten all at once), else ``None``."""
    seen = _chains.get(_MET)
    if seen is None:
        seen = _chains[_MET] = set()
    if signature in seen:
        return None
    if len(seen) >= HELD_LIMIT:
        seen.clear()
    seen.add(signature)
    return FIRST_MET


FIRST_MET = ("first met",)  # _held_entry's answer for arguments met for the first time
_MET = (None, None, "met")  # (beside the chains, forgotten with them) the arguments _first_met has met


def _held_made(name: str, run: Callable, key: int, tensors) -> Optional[list]:
    """``run(key, tensors)``, a held lane of backend ``name``: the results it made, or ``None``
    where no lane fits the tensors or the backend failed on them (left to the usual route)."""
    try:
        made = run(key, tensors)
    except Exception as exc:
        if _backend_failure(name, exc) is None:
            raise
        return None
    if not made:
        return None
    _thread.backend = name
    return made


def hold_held(tag: str, op: str, call, tensors: tuple, slots: tuple, scalars: tuple, shapes: tuple,
              results: tuple) -> None:
    """After an eager call of public function ``tag`` with checked signature ``call``, nothing
    recorded: where the backend that ran it holds lanes (``Backend.held``) and its direct lane ran
    the call's ``op``, have it hold that plan for the later calls of ``tag`` with these ``scalars``
    and tensors like ``tensors`` (the slot of each: ``slots``) of ``shapes`` (:func:`run_held`),
    whose results are ``results`` (slot names: the lane returns these alone)."""
    found = _held_plan(op, call, slots, results)
    if found is not None:
        _keep_held(tag, scalars, shapes, found, tensors, lambda key, _: (found[0], found[1].runner(), key))


def _held_plan(op: str, call, slots: tuple, results: tuple):
    """``(backend name, its HeldLanes, the plan to hold)`` of the direct lane of ``op`` that last
    ran ``call`` on this thread, or ``None`` (its backend holds no lanes, or not that plan)."""
    name = getattr(_thread, "backend", None)
    backend = None if name is None else _load(name)[0]
    if backend is None or backend.held is None:
        return None
    plan = backend.held.holdable(op, call, slots, results)
    return None if plan is None else (name, backend.held, plan)


def _keep_held(tag: str, scalars: tuple, shapes: tuple, found: tuple, tensors: tuple, entry: Callable) -> None:
    """Have ``found``'s backend hold its plan (:func:`_held_plan`) for tensors like ``tensors``
    under a key, and keep ``entry(key, before)`` for :func:`_held_entry` of these arguments: the
    key of what is kept for them (``before``) where the same backend holds it, else a new one; past
    :data:`HELD_LIMIT` signatures, all are forgotten."""
    name, held, plan = found
    try:
        signature = (tag, scalars, _types(scalars), shapes)
        setting = (_backend_setting(), _strict_setting(), _HELD)
        kept = _chains.get(setting)
        if kept is None:
            kept = _chains[setting] = {}
        before = kept.get(signature)
    except TypeError:
        return
    if before is None or before[0] != name:
        before = None
    key = next(_held_keys) if before is None else before[2]
    if len(kept) >= HELD_LIMIT:  # (then forgotten all at once, on both sides)
        kept.clear()
        held.clear()
    held.hold(key, plan, tensors)
    kept[signature] = entry(key, before)


class HeldTraining(NamedTuple):
    """A training call's lanes held by backend ``name`` (run by its ``Backend.held.runner()``: ``run``):
    the forward's under ``key``, returning out and lse, and once a backward ran its direct lane,
    the backward's (under ``backward_keys[0]``; it returns dq, dk, dv); with the call's checked
    signature ``call``, ``scalars``, the forward op's scalars after its tensors up to dropout_p, and
    ``deterministic`` (what the general backward route takes), and ``backward_slots``, the slots of
    the backward's tensors (:data:`TRAINING_BACKWARD_SLOTS`, then a varlen call's cu_seqlens)."""

    name: str
    run: Callable
    key: int
    call: object
    scalars: tuple
    deterministic: bool
    backward_keys: list
    backward_slots: tuple

    def forward(self, tensors: tuple) -> Optional[list]:
        """The forward's results (out, lse) for ``tensors`` (q, k, v, a varlen call's cu_seqlens), or
        ``None`` (left to the usual route)."""
        return _held_made(self.name, self.run, self.key, tensors)

    def backward(self, tensors: tuple) -> Optional[list]:
        """The backward's results (dq, dk, dv) for ``tensors`` (by :attr:`backward_slots`), or ``None``."""
        keys = self.backward_keys
        return None if not keys or _failed else _held_made(self.name, self.run, keys[0], tensors)

    def general_backward(self, gradients: Callable[[], tuple], tensors: tuple) -> tuple:
        """``gradients()``, the general backward route of this call with gradient and saved tensors
        ``tensors`` (by :attr:`backward_slots`); where it ran its backend's direct lane, that plan is
        held for later gradients like these (:meth:`backward`)."""
        held = _load(self.name)[0].held
        held.forget_run()  # (a run of another call's backward is not this one's)
        result = gradients()
        plan = held.holdable("backward", self.call, self.backward_slots, ("dq", "dk", "dv"))
        if plan is not None and getattr(_thread, "backend", None) == self.name:
            keys = self.backward_keys
            if not keys:
                keys.append(next(_held_keys))
            held.hold(keys[0], plan, tensors)
        return result


# the order of HeldTraining.backward's tensors (a varlen call's cu_seqlens after them)
TRAINING_BACKWARD_SLOTS = ("dout", "q", "k", "v", "out", "lse")


def held_training(tag: str, scalars: tuple, shapes: tuple, remember: bool = False):
    """The lanes held by :func:`hold_training` for a training call of public function ``tag`` with
    these ``scalars`` and tensors of ``shapes`` under the current settings, or ``None``; with
    ``remember``, :data:`FIRST_MET` for arguments met for the first time (:func:`_held_entry`)."""
    found = _held_entry(tag, scalars, shapes, remember)
    return found if type(found) is HeldTraining or found is FIRST_MET else None


def hold_training(tag: str, call, tensors: tuple, slots: tuple, scalars: tuple, shapes: tuple, op_scalars: tuple,
                  deterministic: bool) -> None:
    """:func:`hold_held` for a training call (an eager call without dropout whose forward autograd
    recorded): the forward's plan returning out and lse, kept as a :class:`HeldTraining` with
    ``op_scalars`` (the forward op's scalars after the tensors, up to dropout_p) and ``deterministic``."""
    found = _held_plan("forward", call, slots, ("out", "lse"))
    if found is not None:
        _keep_held(tag, scalars, shapes, found, tensors, lambda key, before: HeldTraining(
            found[0], found[1].runner(), key, call, op_scalars, deterministic,
            before.backward_keys if type(before) is HeldTraining else [], (*TRAINING_BACKWARD_SLOTS, *slots[3:])))


def _types(scalars: tuple) -> tuple:
    """The scalars' types, a tuple's its elements' (``True``, ``1`` and ``1.0`` are equal and hash
    alike, but a public function's checks tell them apart: ``window_size=(True, -1)`` is refused)."""
    return tuple([tuple(map(type, s)) if type(s) is tuple else type(s) for s in scalars])


_HELD = "held"  # (settings, _HELD): the held lanes' keys beside the chains
HELD_LIMIT = CHECKED_LIMIT  # held signatures per settings (then all forgotten)
_held_keys = itertools.count()  # never reused: a forgotten key's lanes are never run
_traced = validation.traced


def _hold(lanes: dict, key: tuple, name: str, make: Callable) -> None:
    """The second time ``key`` is met, and after, hold the lane ``make()`` gives (forgotten while
    it gives none); the first time, remember that it was met."""
    if key not in lanes:
        lanes[key] = None  # met once
        return
    run = make()
    if run is None:
        lanes.pop(key, None)
        return
    lanes[key] = (name, run)


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (asked only before the reference runs)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Skip:
    """A backend the call did not run on: it refused the call (``failure`` False: answered before
    anything ran) or failed on it (the cause and fix, from its ``BackendFailed``)."""

    __slots__ = ("name", "why", "failure")

    def __init__(self, name: str, why: str, failure: bool = False):
        self.name, self.why, self.failure = name, why, failure


def _backend_failure(name: str, exc: Exception) -> Optional[_Skip]:
    """The backend's own failure (its ``BackendFailed``), or ``None`` for any other error."""
    failed = _load(name)[0].failure
    if failed is None or not isinstance(exc, failed):
        return None
    skip = _Skip(name, str(exc), failure=True)
    if exc.scope == "backend":  # the machine, not the call: every later call goes elsewhere
        _failed[name] = skip
    return skip


def _check_strict(skip: _Skip, op: str) -> None:
    if skip.name in KERNEL_BACKENDS and strict() and requested_backend() == skip.name:
        what = "failed on" if skip.failure else "refused"
        raise BackendRefusedError(f"{STRICT_ENV}=1: the {skip.name} backend ({BACKEND_ENV}={skip.name}) {what} this "
                                  f"{op}: {skip.why}")


def _capture_error(op: str, device: torch.device, skipped: list[_Skip]) -> GraphCaptureError:
    if skipped:
        why = "; ".join(f"the {s.name} backend {'failed' if s.failure else 'refused it'}: {s.why}" for s in skipped)
    elif requested_backend() == "reference":
        why = f"{BACKEND_ENV}=reference"
    else:
        why = f"no GPU kernel backend can run on {device} ({'; '.join(auto_choice(device)[1])})"
    return GraphCaptureError(
        f"flash_attn: this {op} cannot run during CUDA-graph capture: {why}. The only backend left, the PyTorch "
        f"reference, reads tensor values on the host, which capture forbids; nothing was run. Make this call "
        f"outside the captured region, or one the kernels take (e.g. fp16/bf16 instead of fp32).")


def _tell(op: str, skipped: list[_Skip], ran: str) -> None:
    """One warning per reason a call did not run where it was meant to."""
    for s in skipped:
        if s.failure:
            warn_once(f"failed:{s.name}:{s.why}",
                      f"flash_attn: the {s.name} backend failed on first use: {s.why}. Running on the {ran} backend.")
        else:
            warn_once(f"{s.name}:{op}:{s.why}",
                      f"flash_attn: the {s.name} backend cannot run this {op} ({s.why}); running it on the {ran} "
                      f"backend.")


def run(op: str, device: torch.device, *args, **kwargs):
    """Run ``op`` (``"forward"``, ``"backward"`` or ``"forward_kvcache"`` of the backend contract,
    :mod:`flash_attn.backends.contract`) on the first backend of the chain that serves the call."""
    skipped: list[_Skip] = []
    for name in chain(device):
        if name == "reference" and _capturing(device):
            raise _capture_error(op, device, skipped)
        skip = _failed.get(name)
        if skip is None:
            runner = _load(name)[0].prepare[op](*args, **kwargs)
            if isinstance(runner, Refusal):
                skip = _Skip(name, runner.reason)
            else:
                _thread.backend = name
                try:
                    result = runner()
                except Exception as exc:
                    skip = _backend_failure(name, exc)
                    if skip is None:
                        raise
                else:
                    if skipped:
                        _tell(op, skipped, name)
                    return result
        _check_strict(skip, op)
        skipped.append(skip)
    raise RuntimeError(f"no backend ran the {op}: {skipped[0].why if skipped else ''}")  # cpu/reference run every call
