"""The ``aot`` backend: the kernels compiled ahead of time (``python -m flash_attn build-kernels``),
launched by the op library (``flash_attn/_C/libflash_attn_aot.so``) without Triton at run time.

A call is planned for the device's image (``Target(aot=True)``: only the shipped specialisations,
:mod:`flash_attn.planning.plan`); the first call of each shape then turns the plan into packed
launches: for each, the manifest entry of its specialisation, the kernel registered and loaded on
the device, the integer and float arguments checked against the image's signature and stored.
Every later call of that shape fills in its tensors and calls ``torch.ops.flash_attn.aot_run`` once
with all of the call's launches; the op library makes the buffers they write and returns them.
All of it happens before the first launch of the call, so a call the images cannot serve (no
such specialisation, a value outside int32, an image the driver refuses) is refused before
anything runs or is written, and the dispatcher runs it elsewhere.

Images the installed driver cannot load are never picked: each manifest entry records the CUDA
release of the ptxas that built it (cubins need a driver of that major version) and the PTX ISA
of PTX images (the driver's JIT must know it). The manifest is checked when it is read
(:mod:`flash_attn.aot.manifest`): a malformed entry is never used. If the driver still refuses an
image, that image is disabled on that device and the calls that need it are refused with the
driver's answer (one warning per answer, from the dispatcher); shapes whose images loaded keep
running. A refusal that may pass (out of memory, a first load during CUDA-graph capture) disables
nothing: the call is refused and the image tried again on a later call.
"""

from __future__ import annotations

import array
import re
import struct
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Optional

import torch

from flash_attn import limits
from flash_attn.aot import forced, library as op_library, specializations as S
from flash_attn.aot.manifest import Manifest, driver_release, manifest
from flash_attn.backends._execute import (KernelBackend, PlanCache, Ready, _all_aligned, capturing, last_direct_run,
                                         picker, ready, slots)
from flash_attn.backends.contract import HeldLanes, nvidia_cuda_reason
from flash_attn.planning import plan as P
from flash_attn.planning.plan import DRIVER, IMAGES, Refusal

__all__ = ["BACKEND", "unavailable_reason", "device_image", "forward", "backward", "forward_kvcache"]

_NAME = "aot"


def unavailable_reason(device: torch.device) -> Optional[str]:
    device = torch.device(device)
    reason = nvidia_cuda_reason(device, "launches precompiled GPU kernels", "its kernels are NVIDIA cubins/PTX")
    if reason is not None:
        return reason
    status = op_library.status()
    if not status.loaded:
        return status.reason
    m, why = manifest()
    if m is None:
        return why
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    chosen = forced.choose(m, torch.cuda.get_device_capability(device), driver_release(), forced.forced_family())
    return chosen if isinstance(chosen, str) else None


# --- the device's images --------------------------------------------------------------------------


class _Plans(PlanCache):
    """The plan cache of one device, which forgets a refusal that may pass (``Refusal.retry``)."""

    def keeps(self, value) -> bool:
        return not (isinstance(value, Refusal) and value.retry)


@dataclass
class _DeviceImages:
    """What one device runs: the manifest, the image architecture, the planner's target, and the
    images the driver refused on it (spec key -> its refusal; those images are never tried again)."""

    manifest: Manifest
    arch: str
    target: P.Target
    failed: dict = field(default_factory=dict)
    plans: PlanCache = field(default_factory=_Plans)  # call shape -> packed launches or refusal
    damaged: Optional[Refusal] = None  # the one refusal of every image file that cannot be used


_devices: dict[torch.device, _DeviceImages | Refusal] = {}


def _device_images(device: torch.device) -> _DeviceImages | Refusal:
    """The images of ``device`` (worked out on its first call; ``FLASH_ATTN_AOT_DIR`` is read then)."""
    found = _devices.get(device)
    if found is None:
        found = _devices[device] = _make_device_images(
            device.index if device.index is not None else torch.cuda.current_device())
    return found


def _make_device_images(index: int) -> _DeviceImages | Refusal:
    m, why = manifest()
    if m is None:
        return Refusal(why, IMAGES)
    # the image and whose configs it runs: the device's own, or FLASH_ATTN_FORCE_FAMILY's (a diagnostic)
    chosen = forced.choose(m, torch.cuda.get_device_capability(index), driver_release(), forced.forced_family())
    if isinstance(chosen, str):
        return Refusal(chosen, IMAGES)
    choice, family = chosen
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return _DeviceImages(m, choice.arch.name, P.Target(family, sms, aot=True))


def device_image(device) -> tuple[str, str] | str:
    """``(image architecture, family whose configs it runs)`` on CUDA ``device``, or why it has none."""
    images = _device_images(torch.device(device))
    return images.reason if isinstance(images, Refusal) else (images.arch, images.target.family)


def _target(device: torch.device) -> P.Target | Refusal:
    images = _device_images(device)
    return images if isinstance(images, Refusal) else images.target


# --- plans as packed launches ---------------------------------------------------------------------


class _Packed(NamedTuple):
    """One launch's arguments in the image's signature order: tensors by slot name, the ints (a
    :class:`~flash_attn.planning.plan.Rows` where the call's row count goes) and the floats."""

    kernel: int
    grid: list
    slots: list  # tensor arguments, by slot, in signature order
    ints: list
    floats: list


class _Launches(NamedTuple):
    """A plan's launches as the op library runs them, in one ``aot_run`` call per attention call:
    ``plan`` (int64, the layout csrc/aot_ops.cpp's ``run_plan`` reads: the buffers the library
    makes, then the launches), the slots whose tensors the call passes, in the order ``plan``
    indexes them (a pointer no kernel reads is passed null: no tensor), the slots of the buffers
    the library returns, in order, and the row counts it reads per call."""

    plan: torch.Tensor
    names: tuple
    rows: tuple
    packed: tuple  # the _Packed launches ``plan`` was written from
    tensors: Callable[[dict], tuple]  # the call's tensors by slot -> the ones ``plan`` indexes, in order
    row_counts: Callable[[dict], tuple]  # ... -> the row counts
    buffers: tuple = ()  # the plan's buffers the library makes (:class:`~flash_attn.planning.layouts.Buffer`)
    made: tuple = ()  # their slots
    results: Optional[Callable[[list], tuple]] = None  # the buffers made -> the call's results, where all are buffers
    returned: tuple = ()  # the slots of the call's results (the other buffers: the call's scratch)


class _Template(NamedTuple):
    """A template plan's launches (:mod:`flash_attn.planning.extents`): ``plan`` as a list, 0 where
    each extent goes (``extents``: its index in ``plan``, its launch, its place among the ints),
    and ``per_call``: the same launches with each extent a row count the call passes (read from
    its tensors: what a class's direct lane runs, no plan written per key length)."""

    launches: _Launches  # its plan tensor written per call shape (AotBackend.filled)
    plan: list
    extents: tuple
    per_call: _Launches


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _launches(packed: tuple, unused: frozenset = frozenset(), buffers: tuple = (),
              results: tuple = (), extents_per_call: bool = False, inputs: tuple = ()) -> _Launches | _Template:
    """``packed`` written as a plan, with ``buffers`` (the plan's buffers no launch leaves unused)
    made by the library; the slots in ``unused`` (pointers no kernel reads) passed null; ``results``:
    the slots the call returns (where given, the other buffers are the call's scratch, which the
    library makes in one allocation). A template's (extents among its ints) is written once they are known,
    or with ``extents_per_call`` its extents are row counts the call passes. ``inputs``: the call's
    tensors in this order (a slot no launch takes may be among them), else in the launches' order."""
    made = {b.slot for b in buffers}
    names = dict(zip(inputs, range(len(inputs))))  # the call's tensors, then the buffers: the indices the launches take
    for p in packed:
        for name in p.slots:
            if name not in unused and name not in made:
                names.setdefault(name, len(names))
    inputs = tuple(names)
    rows, plan, extents = {}, [len(buffers)], []
    for b in buffers:
        names[b.slot] = len(names)
        scratch = bool(results) and b.slot not in results
        plan += [int(b.zeroed) | _SCRATCH * scratch, len(b.storage), *[_buffer_size(n, rows) for n in b.storage]]
        plan.append(b.shape[-1] if b.storage[-1] != b.shape[-1] else -1)
    plan.append(len(packed))
    for n, p in enumerate(packed):
        plan += [p.kernel, *p.grid, *[1] * (3 - len(p.grid)), len(p.slots)]
        plan += [-1 if name in unused else names[name] for name in p.slots]
        per_call = [(i, rows.setdefault(v, len(rows))) for i, v in enumerate(p.ints)
                    if isinstance(v, P.Rows) or (extents_per_call and isinstance(v, P.Extent))]
        plan.append(len(p.ints))
        if not extents_per_call:
            extents += [(len(plan) + i, n, i, v) for i, v in enumerate(p.ints) if isinstance(v, P.Extent)]
        plan += [0 if isinstance(v, (P.Rows, P.Extent)) else v for v in p.ints]
        plan += [len(per_call), *[n for pair in per_call for n in pair]]
        plan += [len(p.floats), *map(_float_bits, p.floats)]
    # on the CPU whatever the caller's default device (torch.set_default_device): the library reads it on the host
    made_slots = tuple(b.slot for b in buffers)
    from_made = picker(tuple(made_slots.index(r) for r in results)) if set(results) <= set(made_slots) else None
    launches = _Launches(None if extents else _plan_tensor(plan), inputs, tuple(rows), packed,
                         picker(inputs), picker(tuple(rows)), tuple(buffers), made_slots, from_made, tuple(results))
    if not extents:
        return launches
    # (per_call's extents are read from a lane's flat arguments, _flat_extents: its row_counts is never asked)
    return _Template(launches, plan, tuple(extents), _launches(packed, unused, buffers, results, extents_per_call=True))


_SCRATCH = 2  # a buffer's flag in the plan: part of the call's scratch (its bit 0: zero-filled)


def _buffer_size(n, rows: dict) -> int:
    """A buffer's size as the plan holds it: a number, or ``-(r + 1)`` for the call's row count ``rows[r]``."""
    if isinstance(n, P.Rows):
        return -1 - rows.setdefault(n, len(rows))
    if type(n) is not int:
        raise TypeError(f"a buffer's size must be a number or a call's row count, not {n!r}")
    return n


def _plan_tensor(plan: list) -> torch.Tensor:
    # through an int64 array: ~3x faster than torch.tensor(list) (a new key length's plan, every call)
    return torch.frombuffer(array.array("q", plan), dtype=torch.int64)


_registered: dict[tuple, int] = {}


def _register(m: Manifest, entry: dict) -> int:
    key = (str(m.folder), entry["arch"], entry["key"])
    kid = _registered.get(key)
    if kid is None:
        kid = _registered[key] = op_library.register_kernel(m.folder / entry["image"], entry)
    return kid


def pack(launch: P.Launch, entry: dict) -> _Packed | Refusal:
    """``launch``'s arguments in the order and types of the image's signature, or why they do not
    fit it (an integer outside int32)."""
    tokens = [t for t in entry["signature"] if t not in op_library.HIDDEN_ARGS]
    mismatch = Refusal(f"the installed image {entry['key']} does not fit this flash_attn's kernels (built from "
                       f"other sources? rebuild with `python -m flash_attn build-kernels`)", IMAGES)
    if len(tokens) != len(launch.args):
        return mismatch
    names, ints, floats = [], [], []
    for (name, value), token in zip(launch.args, tokens):
        kind = token.split(":")[0]
        if kind.startswith("*"):
            if not isinstance(value, P.Slot):
                return mismatch
            names.append(str(value))
        elif kind.startswith("fp"):
            floats.append(float(value))
        elif isinstance(value, (P.Rows, P.Extent)):  # known per call (the planner keeps it within int32)
            ints.append(value)
        else:
            value = int(value)
            if kind == "i32" and not -limits.INT32_MAX - 1 <= value <= limits.INT32_MAX:
                return Refusal(f"argument {name} = {value} does not fit the kernels' int32", IMAGES)
            ints.append(value)
    return _Packed(0, list(launch.grid), names, ints, floats)


class _AotBackend(KernelBackend):
    def plan_cache(self, device) -> PlanCache:
        return _device_images(device).plans

    def target_and_plans(self, device):
        images = _device_images(device)
        return images if isinstance(images, Refusal) else (images.target, images.plans)

    def forget_plans(self) -> None:
        for images in list(_devices.values()):
            if not isinstance(images, Refusal):
                images.plans.clear()
        clear_held()

    def executable(self, plan: P.Plan, target: P.Target, device):
        images = _device_images(device)
        dtype = S.dtype_name(plan.dtype)
        packed = []
        for launch in plan.launches:
            spec = S.Spec.of(launch.kernel, dtype, launch.constexprs, launch.config)
            entry = images.manifest.lookup(images.arch, spec.key)
            if entry is None:
                return Refusal(images.manifest.why_missing(images.arch, spec.key), IMAGES)
            p = pack(launch, entry)
            if isinstance(p, Refusal):
                return p
            kid = _image(images, entry, device)
            if isinstance(kid, Refusal):
                return kid
            packed.append(p._replace(kernel=kid))
        unused = frozenset(b.slot for b in plan.buffers if b.unused)
        passed = {name for p in packed for name in p.slots}
        # the library makes a buffer in the dtype of a kernel parameter it is passed to; one that no
        # launch takes (an empty query's output beside a cache append) is made here
        made = tuple(b for b in plan.buffers if not b.unused and b.slot in passed)
        written = _launches(tuple(packed), unused, made, plan.results)
        run = ready(plan, written)
        return run._replace(buffers=tuple((slot, make) for slot, make in run.buffers
                                          if slot not in passed and slot not in unused))

    def filled(self, template: Ready, number) -> Ready:
        written = template.launches
        if not isinstance(written, _Template):  # no extent among its arguments: it serves as it is
            return template
        launches, plan = written.launches, list(written.plan)
        packed = [_Packed(p.kernel, p.grid, p.slots, list(p.ints), p.floats) for p in launches.packed]
        for at, launch, arg, extent in written.extents:
            plan[at] = packed[launch].ints[arg] = number(extent)
        # built field by field: a named tuple's _replace costs ~1 us, and a new key length pays this every call
        launches = _Launches(plan=_plan_tensor(plan), names=launches.names, rows=launches.rows, packed=tuple(packed),
                             tensors=launches.tensors, row_counts=launches.row_counts, buffers=launches.buffers,
                             made=launches.made, results=launches.results, returned=launches.returned)
        return Ready(plan=template.plan, buffers=template.buffers, launches=launches, fixed=template.fixed,
                     results=template.results)

    def run(self, run: Ready, inputs: dict, device) -> tuple:
        tensors = slots(run, inputs, device)
        launches = run.launches
        made = _launch(launches, launches.tensors(tensors), launches.row_counts(tensors))
        if launches.results is not None:
            return launches.results(made)
        tensors.update(zip(launches.made, made))
        return run.results(tensors)

    def direct_lane(self, run: Ready, flat_slots: tuple) -> Optional[Callable[[tuple], Optional[tuple]]]:
        """A plan that prepares nothing, draws no seed and returns only buffers, whose tensors are
        all among the lane's arguments: the call's tensors picked by position and passed to the op
        library as they are (after one test of their pointers' alignment), its packed row counts
        (a varlen call's) read from them. A template (a class's:
        :class:`~flash_attn.backends._execute.PerCall`) runs as it is, each call's extents read
        from its tensors and passed as row counts."""
        launches = run.launches
        if type(launches) is _Template:
            launches = launches.per_call
        if run.plan.prepare or run.plan.needs_seed or launches.results is None or \
                not set(launches.names) <= set(flat_slots):
            return None
        pick, results = picker(tuple(flat_slots.index(n) for n in launches.names)), launches.results
        if not launches.rows:
            def direct(flat: tuple) -> Optional[tuple]:
                passed = pick(flat)
                return results(_launch(launches, passed, ())) if _all_aligned(passed) else None

            direct.launches = launches  # what a held lane is made from (_holdable)
            return direct
        numbers = _flat_extents(launches.rows, flat_slots)
        if numbers is None:
            return None

        def direct_with_extents(flat: tuple) -> Optional[tuple]:
            passed = pick(flat)
            return results(_launch(launches, passed, numbers(flat))) if _all_aligned(passed) else None

        if all(isinstance(r, P.Rows) for r in launches.rows):  # a varlen call's: held with its row counts in place
            direct_with_extents.launches = launches
        return direct_with_extents


def _flat_extents(rows: tuple, flat_slots: tuple) -> Optional[Callable[[tuple], tuple]]:
    """``flat -> the numbers of rows`` where every one of ``rows`` is an extent of a tensor among a
    lane's flat arguments (``flat_slots``: the slot at each position) or its packed row count (its
    dim 0), else ``None``."""
    rows = tuple(P.Extent(r.slot, 0) if isinstance(r, P.Rows) else r for r in rows)
    if not all(isinstance(r, P.Extent) and r.slot in flat_slots for r in rows):
        return None
    positions = tuple(dict.fromkeys(flat_slots.index(r.slot) for r in rows))  # each tensor read once
    read = P.extent_reader(tuple((positions.index(flat_slots.index(r.slot)), r) for r in rows))
    return lambda flat: read([(flat[at].shape, flat[at].stride()) for at in positions])


def _holdable(op: str, call, slots: tuple, results: tuple):
    """:class:`~flash_attn.backends.contract.HeldLanes`'s ``holdable``: the plan of the last direct
    lane run on this thread (``op``'s, for ``call``: its signature and the pointers' alignment decide
    it; every tensor it passes among ``slots``, ``results`` among its buffers, none a view of wider
    storage: the op library returns them as they are), written for tensors in the order of
    ``slots`` and to make ``results`` first, the other buffers its scratch (a lane returns
    ``results`` alone), or ``None``. A plan reading packed row counts (a varlen call's) is written
    when held, the held call's row counts in place (:class:`_RowsInPlace`: a held lane's tensors
    have the held call's shapes)."""
    ran = last_direct_run()
    if ran is None or ran[0] != op or ran[1] != call:
        return None
    launches = ran[2].launches
    if not set(launches.names) <= set(slots) or not all(r.slot in slots for r in launches.rows):
        return None
    buffers = {b.slot: b for b in launches.buffers}
    if not set(results) <= buffers.keys() or any(buffers[r].storage != buffers[r].shape for r in results):
        return None
    if not launches.rows and launches.names == slots and launches.made[:len(results)] == results and \
            launches.returned == results:
        return launches.plan
    ordered = (*(buffers[r] for r in results), *(b for b in launches.buffers if b.slot not in results))
    unused = frozenset(s for p in launches.packed for s in p.slots) - set(launches.names) - set(launches.made)
    if not launches.rows:
        return _launches(launches.packed, unused, ordered, results, inputs=slots).plan
    return _RowsInPlace(launches.packed, unused, ordered, results, slots,
                        tuple((r, slots.index(r.slot)) for r in launches.rows))


class _RowsInPlace(NamedTuple):
    """A held plan that reads packed row counts, written by :func:`_hold` with the held call's
    (the dim 0 of its tensor at position ``at`` for each row count) in place of each."""

    packed: tuple
    unused: frozenset
    buffers: tuple
    results: tuple
    slots: tuple
    rows: tuple  # (P.Rows, its tensor's position among ``slots``)

    def written(self, tensors: tuple) -> torch.Tensor:
        numbers = {r: tensors[at].shape[0] for r, at in self.rows}
        number = lambda v: numbers[v] if isinstance(v, P.Rows) else v  # noqa: E731
        packed = tuple(p._replace(ints=[number(v) for v in p.ints]) for p in self.packed)
        buffers = tuple(replace(b, shape=tuple(map(number, b.shape))) for b in self.buffers)
        return _launches(packed, self.unused, buffers, self.results, inputs=self.slots).plan


def _hold(key: int, plan, tensors: tuple) -> None:
    """:class:`~flash_attn.backends.contract.HeldLanes`'s ``hold``: ``aot_lane_hold`` (a plan
    :func:`_holdable` left to write, written for ``tensors`` first)."""
    if type(plan) is _RowsInPlace:
        plan = plan.written(tensors)
    _lane_ops()[0](key, plan, list(tensors))


def _held_runner() -> Callable[[int, list], list]:
    """:class:`~flash_attn.backends.contract.HeldLanes`'s ``runner``: ``aot_lane_run`` itself."""
    return _lane_ops()[1]


def clear_held() -> None:
    """Forget the lanes the op library holds (their plans were forgotten), where it is loaded."""
    if op_library.status().loaded:
        op_library.ops().aot_lanes_clear()


_lane_op_builtins = None


def _lane_ops() -> tuple:
    """``aot_lane_hold`` and ``aot_lane_run`` (:func:`op_builtin`)."""
    global _lane_op_builtins
    if _lane_op_builtins is None:
        _lane_op_builtins = (op_builtin("aot_lane_hold"), op_builtin("aot_lane_run"))
    return _lane_op_builtins


def _launch(launches: _Launches, passed: tuple, rows: tuple) -> list:
    """Every launch of a call: one op call (the buffers made, then each launch's checks and the
    launch on the current stream), ``passed`` the tensors of ``launches.names``, ``rows`` the row
    counts of ``launches.rows``; the buffers, in the order of ``launches.buffers``."""
    return (_op or _run_op())(launches.plan, passed, rows)


def _image(images: _DeviceImages, entry: dict, device) -> int | Refusal:
    """The kernel id of ``entry``'s image, registered and loaded on ``device``, or why it cannot
    be used: an image that failed for good is refused at once; one that failed for a reason that
    may pass (:func:`_transient`) is refused for this call only."""
    failed = images.failed.get(entry["key"])
    if failed is not None:
        return failed
    try:
        kid = _register(images.manifest, entry)
    except Exception as exc:  # noqa: BLE001  (the file: missing, unreadable, damaged)
        images.failed[entry["key"]] = _damaged(images, entry, exc)
        return images.failed[entry["key"]]
    try:
        _load(kid, device)
        return kid
    except Exception as exc:  # noqa: BLE001  (whatever the answer, this image cannot run now)
        why = _refused_image(images.arch, entry["key"], exc)
        if _transient(exc, device):
            return Refusal(f"{why}; tried again on a later call", DRIVER, retry=True)
        refusal = images.failed[entry["key"]] = Refusal(why, DRIVER)
        return refusal


def _damaged(images: _DeviceImages, entry: dict, exc: Exception) -> Refusal:
    """The refusal of an image file that cannot be registered (missing, unreadable, not an image):
    one for the whole installation, worded after the first such file, so that the dispatcher warns
    once, however many kernels there are; the doctor lists every one."""
    if images.damaged is None:
        images.damaged = Refusal(
            f"the installed {images.arch} kernel images in {images.manifest.folder} are missing or damaged (the first "
            f"found: {_first_line(exc)}); reinstall flash-attn (`python -m flash_attn doctor` lists them)", IMAGES)
    return images.damaged


# CUDA's answers that do not say anything about the image: memory, or a load during graph capture.
_TRANSIENT = re.compile(r"out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|StreamCapture|"
                        r"STREAM_CAPTURE|stream is capturing", re.IGNORECASE)
_CUDA_ANSWER = re.compile(r"\b(cudaError\w+|CUDA_ERROR_\w+)\b.*")


def _transient(exc: Exception, device) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or bool(_TRANSIENT.search(str(exc))) or capturing(device)


def _refused_image(arch: str, key: str, exc: Exception) -> str:
    """The refusal of an image: the driver's answer when there is one (the same text for every image
    it refuses alike, so the dispatcher warns once per answer), else the error naming the image."""
    text = _first_line(exc)
    answer = _CUDA_ANSWER.search(text)
    if answer:
        return f"the driver cannot load the {arch} images: {answer.group(0)}"
    kind = "" if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: "
    return f"the {arch} image {key} cannot be used: {kind}{text}"


_loaded: set = set()


def _load(kid: int, device) -> None:
    """Load the image on ``device`` now (the driver's answer comes before anything runs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return  # meta tensors (tracing, tests): nothing to load
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (kid, index) not in _loaded:
        op_library.ops().aot_kernel_attributes(kid, index)
        _loaded.add((kid, index))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return re.sub(r"\s+", " ", text.splitlines()[0] if text else type(exc).__name__)


_op = None


def op_builtin(name: str):
    """The op library's ``flash_attn::<name>``: the overload's builtin itself where torch exposes
    it (``_op``; its Python ``__call__`` only forwards to it, ~0.2 us a call)."""
    overload = getattr(op_library.ops(), name).default
    return getattr(overload, "_op", overload)


def _run_op():
    """``flash_attn::aot_run`` (:func:`op_builtin`), looked up once."""
    global _op
    if _op is None:
        _op = op_builtin("aot_run")
    return _op


_backend = _AotBackend(_NAME, _target)
BACKEND = _backend.contract(unavailable_reason,
                            held=HeldLanes(_held_runner, _holdable, _hold, clear_held, last_direct_run))
forward, backward, forward_kvcache = _backend.forward, _backend.backward, _backend.forward_kvcache
