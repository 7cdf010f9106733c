"""Running launch plans (:mod:`flash_attn.planning.plan`): what the three kernel backends share.

A kernel backend is a :class:`KernelBackend`: a way to find the :class:`~flash_attn.planning.plan.
Target` of a device (or why it cannot run there) and a way to run one planned launch. For each
call it looks the plan up in a cache keyed by the call's shape and target (planning happens once
per shape), and returns either a closure that executes it or a
:class:`~flash_attn.planning.launches.Refusal` saying who refused the call and why; the dispatcher
(:mod:`flash_attn.dispatch`) decides what runs.

Executing a plan: the call's tensors are put into slots by name, the plan's preparations applied
(copies into the kernels' layout, only where the plan asks), its buffers allocated, its launches
run in order, its result slots returned. Nothing reads a tensor value on the host.
"""

from __future__ import annotations

import threading
from operator import itemgetter
from typing import Callable, NamedTuple, Optional, Union

import torch

from flash_attn import limits
from flash_attn.backends.contract import HELD_OPS, LANE_OPS, Backend, HeldLanes
from flash_attn.params import AttentionParams, KeyLengths, KVCacheInputs, own_key
from flash_attn.placeholders import placeholder
from flash_attn.planning import plan as P
from flash_attn.planning.plan import Refusal

__all__ = ["KernelBackend", "PlanCache", "execute", "forward_inputs", "backward_inputs", "kvcache_inputs"]


_MISSING = object()


class PlanCache:
    """``key -> value``, made once per key; the oldest entries go past ``limit`` (a plan holds no
    device memory, so forgetting one only costs planning it again)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._values: dict = {}
        self._lock = threading.Lock()
        self.generation = 0  # counts the clears (a lane made from an earlier generation runs no more)

    def get(self, key, make: Callable):
        value = self._values.get(key, _MISSING)  # (a new call signature misses: no exception raised for it)
        if value is not _MISSING:
            return value
        value = make()
        if self.keeps(value):
            with self._lock:
                while len(self._values) >= self.limit:
                    self._values.pop(next(iter(self._values)))
                self._values[key] = value
        return value

    def peek(self, key):
        """The value held for ``key``, or ``None`` (nothing made)."""
        return self._values.get(key)

    def keeps(self, value) -> bool:
        """Whether a value just made is remembered (every one here)."""
        return True

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.generation += 1

    def __len__(self) -> int:
        return len(self._values)

    def distinct(self) -> int:
        """How many values were made and are held (keys may share one: a call's signature and its shape)."""
        return len({id(value) for value in list(self._values.values())})


# ---------------------------------------------------------------------------------------------
# The call's tensors, by slot name


def forward_inputs(q, k, v, seed, varlen=None, alibi_slopes=None, sinks=None, qv=None) -> dict:
    inputs = dict(q=q, k=k, v=v, alibi=alibi_slopes, seed=seed, sinks=sinks, qv=qv)
    if varlen is not None:
        inputs.update(cu_q=varlen.cu_seqlens_q, cu_k=varlen.cu_seqlens_k, block_table=varlen.block_table)
    return inputs


def backward_inputs(dout, q, k, v, out, lse, seed, varlen=None, alibi_slopes=None, grads=None) -> dict:
    inputs = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi=alibi_slopes, seed=seed)
    if varlen is not None:
        inputs.update(cu_q=varlen.cu_seqlens_q, cu_k=varlen.cu_seqlens_k)
    if grads is not None:
        # the caller's gradients: the output slots where the plan writes them in place (a plan
        # that allocates its own replaces them in slots())
        inputs.update((name, g) for name, g in zip(("dq", "dk", "dv"), grads) if g is not None)
    return inputs


def kvcache_inputs(q, cache, alibi_slopes=None, sinks=None, qv=None) -> dict:
    # a literal: twice as fast as a dict made from KVCACHE_SLOTS (0.5 against 1.1 us), and on the
    # route of every KV-cache call the direct lane does not take
    return dict(q=q, k_cache=cache.k_cache, v_cache=cache.v_cache, k_new=cache.k_new, v_new=cache.v_new,
                seqlens=cache.cache_seqlens, leftpad=cache.cache_leftpad, batch_idx=cache.cache_batch_idx,
                block_table=cache.block_table, cos=cache.rotary_cos, sin=cache.rotary_sin, alibi=alibi_slopes,
                sinks=sinks, qv=qv)


# A KV-cache call's arguments in one flat tuple, ``(q, *cache, alibi_slopes, sinks, qv)``, and the
# slot of each (None: a field of KVCacheInputs that is not a tensor), as kvcache_inputs names them.
KVCACHE_SLOTS = ("q", "k_cache", "v_cache", "seqlens", "k_new", "v_new", "batch_idx", "leftpad", "block_table",
                 "cos", "sin", None, None, "alibi", "sinks", "qv")
_stand_ins = tuple(range(len(KVCACHE_SLOTS)))  # distinct values at each position
assert kvcache_inputs(_stand_ins[0], KVCacheInputs(*_stand_ins[1:-3]), *_stand_ins[-3:]) == {
    slot: at for slot, at in zip(KVCACHE_SLOTS, _stand_ins) if slot is not None}
# a lane's forward arguments, flat (a dense call's cu_seqlens and block table None), and a backward's
FORWARD_SLOTS = ("q", "k", "v", "alibi", "sinks", "qv", "cu_q", "cu_k", "block_table")
BACKWARD_SLOTS = ("dout", "q", "k", "v", "out", "lse", "alibi", "cu_q", "cu_k")


# The last call a direct lane (KernelBackend.direct_lane) with ``launches`` ran on this thread: (its
# op, its checked signature, the direct closure; none of its tensors: nothing is kept alive), for a
# backend's held lanes (HeldLanes.holdable).
_direct_ran = threading.local()


def last_direct_run() -> Optional[tuple]:
    """:data:`_direct_ran`'s call, forgotten as it is read (``None``: none since the last read)."""
    ran = getattr(_direct_ran, "call", None)
    _direct_ran.call = None
    return ran


def capturing(device) -> bool:
    """Whether ``device``'s current CUDA stream is capturing a graph (False off CUDA)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------------
# Preparations and buffers


def _aligned_empty(shape, dtype, device) -> torch.Tensor:
    """Fresh (so 16-byte aligned) storage whose strides but the last are multiples of 8
    elements: the last dimension padded, the tensor a view of its first ``shape[-1]`` columns."""
    return _allocator(P.Buffer("", tuple(shape), dtype, padded=True))(None, device)


_PREPARE = {
    "rows": lambda t: _aligned_empty(t.shape, t.dtype, t.device).copy_(t),
    "plain": lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t),
    "contiguous": lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t),
    "fp32": lambda t: torch.empty(t.shape, dtype=torch.float32, device=t.device).copy_(t),
    "column": lambda t: t.view(-1, 1),
}


def _allocator(buffer: P.Buffer):
    """``(tensors, device) -> tensor`` for ``buffer``, with its shapes worked out once (a per-call
    row count, :class:`~flash_attn.planning.plan.Rows`, is read from ``tensors``)."""
    if buffer.unused:
        return lambda tensors, device: placeholder(buffer.dtype, device)
    make, storage, dtype, columns = (torch.zeros if buffer.zeroed else torch.empty), buffer.storage, buffer.dtype, \
        buffer.shape[-1] if buffer.storage != buffer.shape else None
    if any(isinstance(n, P.Rows) for n in storage):
        def sized(tensors, device):
            return make(*[tensors[n] if isinstance(n, P.Rows) else n for n in storage], dtype=dtype, device=device)
        return sized if columns is None else lambda tensors, device: sized(tensors, device)[..., :columns]
    # sizes as separate arguments: PyTorch's argument parser takes them ~0.5 us faster than a tuple
    # (every planned buffer and prepared input has at least one dimension)
    if columns is None:
        return lambda tensors, device: make(*storage, dtype=dtype, device=device)
    return lambda tensors, device: make(*storage, dtype=dtype, device=device)[..., :columns]


class Ready(NamedTuple):
    """A plan made ready to run once per call shape: its buffers' allocators, and its launches in
    whatever form the backend runs them (the plan's own, or the ``aot`` backend's packed ones).
    ``fixed``: the plan reads no row count and no seed of the call and prepares no input (then a
    call's tensors are its inputs and the buffers)."""

    plan: P.Plan
    buffers: tuple  # (slot, device -> tensor)
    launches: tuple
    fixed: bool = False
    results: Callable[[dict], tuple] = None  # the call's tensors by slot -> the plan's results


def ready(plan: P.Plan, launches: Optional[tuple] = None) -> Ready:
    return Ready(plan, tuple((b.slot, _allocator(b)) for b in plan.buffers),
                 plan.launches if launches is None else launches,
                 not (plan.rows or plan.needs_seed or plan.prepare), picker(plan.results))


def picker(names: tuple) -> Callable[[dict], tuple]:
    """``mapping -> tuple`` of the values of ``names``, in order (one C call: ``itemgetter``)."""
    if len(names) == 1:
        one = itemgetter(names[0])
        return lambda mapping: (one(mapping),)
    return itemgetter(*names) if names else lambda mapping: ()


def slots(run: Ready, inputs: dict, device) -> dict:
    """The call's tensors by slot (``inputs`` is extended in place): the inputs, prepared where the
    plan asks, and the plan's buffers."""
    tensors = inputs
    if not run.fixed:
        _per_call(run.plan, tensors, device)
    for slot, make in run.buffers:
        tensors[slot] = make(tensors, device)
    return tensors


def _per_call(plan: P.Plan, tensors: dict, device) -> None:
    """What a plan works out per call before its buffers: row counts, the seed, prepared inputs."""
    for rows in plan.rows:  # packed row counts: sizes of this call, not of the plan
        tensors[rows] = tensors[rows.slot].shape[0]
    if plan.needs_seed and not isinstance(tensors.get("seed"), torch.Tensor):
        # a plain int seed from a direct backend call (the public API draws one on the device):
        # a fill on the device, no copy from the host
        tensors["seed"] = torch.full((1,), int(tensors.get("seed") or 0), dtype=torch.int64, device=device)
    for prep in plan.prepare:
        tensors[prep.slot] = _PREPARE[prep.how](tensors[prep.source or prep.slot])


def execute(run: Ready, inputs: dict, device, run_launch: Callable) -> tuple:
    """Run a plan for one call: ``run_launch(launch, tensors, device)`` per launch, in order."""
    tensors = slots(run, inputs, device)
    for launch in run.launches:
        run_launch(launch, tensors, device)
    return run.results(tensors)


def launch_kwargs(launch: P.Launch, tensors: dict) -> dict:
    """Every argument of ``launch`` by name, slots replaced by the call's tensors and row counts
    by the call's sizes (Triton takes keywords, so constexprs fixed in the middle of the signature
    need no placeholder)."""
    kwargs = {name: tensors[value] if isinstance(value, (P.Slot, P.Rows)) else value for name, value in launch.args}
    kwargs.update(launch.constexprs)
    return kwargs


class PerCall(NamedTuple):
    """What a backend holds for a class of calls whose plans differ only in numbers each call
    gives (:class:`~flash_attn.params.KeyLengths`: k and v's key length and strides): the
    :meth:`KernelBackend.executable` of their template plan, which each new signature's first
    call fills in from its tensors (:meth:`KernelBackend._class_member`)."""

    template: object


def shape_numbers(shape) -> Callable[[P.Extent], int]:
    """The numbers of a described call, by extent."""
    return lambda extent: extent.of(shape)


def tensor_numbers(tensors: dict) -> Callable[[P.Extent], int]:
    """The numbers of a call by extent, from its tensors by slot (each tensor's sizes and strides
    read once: a template has several extents per tensor)."""
    read: dict = {}

    def number(extent: P.Extent) -> int:
        sizes = read.get(extent.slot)
        if sizes is None:
            t = tensors[extent.slot]
            sizes = read[extent.slot] = (t.shape, t.stride())
        return extent.read(*sizes)

    return number


# ---------------------------------------------------------------------------------------------
# A kernel backend


TargetFn = Callable[[torch.device], Union[P.Target, Refusal]]


class KernelBackend:
    """The backend contract (``prepare_*`` for the dispatcher, and the plain functions) on top of
    the planner, for one way of running launches.

    ``target(device)``: the :class:`~flash_attn.planning.plan.Target` to plan for, or why the
    backend cannot run on ``device``. ``run_launch(launch, tensors, device)``: one launch.
    Subclasses may override :meth:`executable` to turn a plan into something faster to run.
    """

    def __init__(self, name: str, target: TargetFn, run_launch: Optional[Callable] = None):
        self.name = name
        self.target = target
        self.run_launch = run_launch
        self.plans = PlanCache()

    # what a plan becomes for this backend, once per call shape (the AOT backend packs arguments)
    def executable(self, plan: P.Plan, target: P.Target, device) -> Ready | Refusal:
        return ready(plan)

    def plan_cache(self, device) -> PlanCache:
        return self.plans

    def target_and_plans(self, device) -> tuple[P.Target, PlanCache] | Refusal:
        """``device``'s target and plan cache (one lookup per call on the hit path), or why the
        backend cannot run there."""
        target = self.target(device)
        return target if isinstance(target, Refusal) else (target, self.plan_cache(device))

    def forget_plans(self) -> None:
        """Drop every cached plan (after the launch configs changed: the tuning sweep)."""
        self.plans.clear()

    def run(self, executable, inputs: dict, device) -> tuple:
        return execute(executable, inputs, device, self.run_launch)

    def direct_lane(self, executable, flat_slots: tuple) -> Optional[Callable[[tuple], Optional[tuple]]]:
        """``executable`` run straight from a lane's flat arguments (``flat_slots``: the slot at each
        position): ``flat -> results``, ``None`` for a call whose tensors it cannot take as they
        are (a pointer not aligned); or ``None`` where the backend has no such path for it (then
        the lane runs it by slot, as the known route does)."""
        return None

    def _prepare(self, planner: Callable, shape, inputs: dict, device, call: Optional[tuple] = None,
                 tail: tuple = ()):
        """The runner of a call, or the refusal. ``call``: a key that decides ``shape`` (the public
        function's checked signature and what the layers below add to it, :func:`_plan_key`); then
        ``shape`` is a function that describes the call, run only when ``call`` is new. ``tail``:
        added to the runner's results (the forward's absent S_dmask)."""
        found = self.target_and_plans(device)
        if isinstance(found, Refusal):
            return found
        target, cache = found
        if call is None:
            executable = self._by_shape(cache, planner, shape, target, device)
        else:
            # one lookup per call signature; a new one is described and shares the shape's plan
            executable = cache.get((planner, call, target),
                                   lambda: self._by_shape(cache, planner, shape(), target, device))
        if isinstance(executable, Refusal):
            return executable
        run = self.run
        if tail:
            return lambda: run(executable, inputs, device) + tail
        return lambda: run(executable, inputs, device)

    def _by_shape(self, cache: PlanCache, planner, shape, target, device):
        # plans do not depend on the device (its target aside)
        return cache.get((planner, shape, target), lambda: self._make(cache, planner, shape, target, device))

    def _make(self, cache: PlanCache, planner, shape, target, device):
        """The executable of ``shape``: made from the template of its shared key where the planner
        has one (:data:`flash_attn.planning.plan.SHARED_KEYS`; a new key length is neither planned
        nor made ready again), else planned."""
        template = self._template_of(cache, planner, shape, target, device)
        if template is None:  # no shared key, or its plans are not shared: planned one by one
            plan = planner(shape, target)
            return plan if isinstance(plan, Refusal) else self.executable(plan, target, device)
        return template if isinstance(template, Refusal) else self.filled(template, shape_numbers(shape))

    def _template_of(self, cache: PlanCache, planner, shape, target, device):
        """The executable of the template plan ``shape`` shares (its shared key's, made once), its
        refusal, or ``None``: no shared key, or its plans are not shared."""
        shared = P.SHARED_KEYS.get(planner)
        key = None if shared is None else shared[0](shape)
        return None if key is None else cache.get(
            (planner, "template", key, target), lambda: self._template(planner, shape, target, device, shared[1]))

    def _template(self, planner, shape, target, device, extents: dict):
        plan = planner(shape, target)
        if isinstance(plan, Refusal):
            return plan
        template = P.template(plan, extents, shape)
        return None if template is None else self.executable(template, target, device)

    def filled(self, template, number: Callable[[P.Extent], int]):
        """The executable of a call from ``template``, the :meth:`executable` of a template plan,
        with ``number(extent)`` for each extent (:func:`flash_attn.planning.plan.filled`)."""
        return ready(P.filled(template.plan, number))


    # --- the contract ---------------------------------------------------------------------------

    def prepare_forward(self, q, k, v, params, *, varlen=None, alibi_slopes=None, return_softmax=False, sinks=None,
                        qv=None):
        inputs = forward_inputs(q, k, v, params.dropout_seed, varlen, alibi_slopes, sinks, qv)
        tail = () if return_softmax else (None,)  # the plan returns S_dmask only when asked for
        if params.call is None:
            shape = P.describe_forward(q, k, v, params, varlen, alibi_slopes, return_softmax, sinks, qv)
            return self._prepare(P.plan_forward, shape, inputs, q.device, tail=tail)
        # the call's signature holds every layout and option of the shape, but the pointers'
        return self._prepare(
            P.plan_forward,
            lambda: P.describe_forward(q, k, v, params, varlen, alibi_slopes, return_softmax, sinks, qv),
            inputs, q.device, _forward_key(own_key(params.call), q, k, v, alibi_slopes, sinks, qv, varlen,
                                           _key_seed(params)),
            tail)

    def prepare_backward(self, dout, q, k, v, out, lse, params, *, varlen=None, alibi_slopes=None,
                         deterministic=False, grads=None, return_delta=False, qv=None):
        # deterministic: the split kernels (no atomics) instead of the fused one; grads: the
        # caller's (dq, dk, dv), written in place where laid out as the kernels write; qv: refused
        inputs = backward_inputs(dout, q, k, v, out, lse, params.dropout_seed, varlen, alibi_slopes, grads)
        if params.call is None or grads is not None:
            shape = P.describe_backward(dout, q, k, v, out, lse, params, varlen, alibi_slopes, deterministic, grads,
                                        return_delta, qv)
            return self._prepare(P.plan_backward, shape, inputs, q.device)
        # the forward's signature holds q, k, v and the options, and so the layouts of out and lse
        # (the forward returns them contiguous) and the gradient's shape and dtype (autograd's
        # engine makes them out's); the gradient's strides are the caller's
        call = _backward_key(params.call, dout, q, k, v, out, lse, alibi_slopes, qv, deterministic, return_delta,
                             varlen, _key_seed(params))
        return self._prepare(
            P.plan_backward,
            lambda: P.describe_backward(dout, q, k, v, out, lse, params, varlen, alibi_slopes, deterministic, grads,
                                        return_delta, qv),
            inputs, q.device, call)

    def prepare_forward_kvcache(self, q, params, cache, *, alibi_slopes=None, sinks=None, qv=None):
        inputs = kvcache_inputs(q, cache, alibi_slopes, sinks, qv)
        if params.call is None:
            return self._prepare(P.plan_kvcache, P.describe_kvcache(q, params, cache, alibi_slopes, sinks, qv), inputs,
                                 q.device)
        return self._prepare(P.plan_kvcache, lambda: P.describe_kvcache(q, params, cache, alibi_slopes, sinks, qv),
                             inputs, q.device, _kvcache_key(params.call, inputs))

    # --- eager calls with a checked signature, without dropout: the plan held for the signature,
    # or on its first call the plan :meth:`_prepare` would find, described and remembered under the
    # same key; ``None`` where the backend refuses the call (the dispatcher's general route then
    # finds the refusal under that key, tells and moves on). ``scalars``: softmax_scale,
    # window_left, window_right, softcap (read only to describe a first call).

    def known_forward(self, device, call, q, k, v, alibi_slopes, sinks, qv, return_softmax, varlen, scalars):
        key = _forward_key(own_key(call), q, k, v, alibi_slopes, sinks, qv, varlen)
        inputs = forward_inputs(q, k, v, None, varlen, alibi_slopes, sinks, qv)
        executable = self._held(device, P.plan_forward, key)
        if executable is _MISSING:
            def shape():  # (made only for a signature's first call)
                return P.describe_forward(q, k, v, _eager_params(scalars, call), varlen, alibi_slopes,
                                          return_softmax, sinks, qv)

            if type(call) is KeyLengths:
                executable = self._class_member(device, P.plan_forward, call.shared, key, inputs, shape)
            else:
                executable = self._remember(device, P.plan_forward, key, shape())
        if executable is None:
            return None
        results = self.run(executable, inputs, device)
        return results if return_softmax else (*results, None)

    def known_backward(self, device, call, dout, q, k, v, out, lse, alibi_slopes, qv, deterministic, return_delta,
                       varlen, scalars):
        key = _backward_key(call, dout, q, k, v, out, lse, alibi_slopes, qv, deterministic, return_delta, varlen)
        executable = self._held(device, P.plan_backward, key)
        if executable is _MISSING:
            shape = P.describe_backward(dout, q, k, v, out, lse, _eager_params(scalars, call), varlen, alibi_slopes,
                                        deterministic, None, return_delta, qv)
            executable = self._remember(device, P.plan_backward, key, shape)
        if executable is None:
            return None
        return self.run(executable, backward_inputs(dout, q, k, v, out, lse, None, varlen, alibi_slopes), device)

    def known_forward_kvcache(self, device, call, q, cache, alibi_slopes, sinks, qv, scalars):
        inputs = kvcache_inputs(q, cache, alibi_slopes, sinks, qv)
        key = _kvcache_key(call, inputs)
        executable = self._held(device, P.plan_kvcache, key)
        if executable is _MISSING:
            shape = P.describe_kvcache(q, _eager_params(scalars, call), cache, alibi_slopes, sinks, qv)
            executable = self._remember(device, P.plan_kvcache, key, shape)
        return None if executable is None else self.run(executable, inputs, device)

    def _held(self, device, planner, key: tuple):
        """The executable :meth:`_prepare` holds for ``planner`` and the call ``key``; ``None`` where
        the backend refuses it; ``_MISSING``: nothing held yet."""
        found = self.target_and_plans(device)
        if isinstance(found, Refusal):
            return None
        target, cache = found
        executable = cache.peek((planner, key, target))
        if executable is None:
            return _MISSING
        return None if isinstance(executable, Refusal) else executable

    def _remember(self, device, planner, key: tuple, shape):
        """The executable of a new call ``key`` of ``shape`` (its shape's, planned if new), held
        under ``key`` as :meth:`_prepare` holds it; ``None`` where the backend refuses it."""
        target, cache = self.target_and_plans(device)
        executable = cache.get((planner, key, target), lambda: self._by_shape(cache, planner, shape, target, device))
        return None if isinstance(executable, Refusal) else executable

    def _class_member(self, device, planner, shared: int, key: tuple, inputs: dict, shape: Callable):
        """The executable of a signature that joined a :class:`~flash_attn.params.KeyLengths`
        class (``shared``: the class's key; ``key``: the call's plan key, of the signature's own),
        held under ``key``: filled in from the call's tensors with the class's template (held for the
        class as :class:`PerCall` from its first such call with these pointers' alignment, whose
        ``shape()`` is described), not described; where the class has no template (a pointer not
        aligned: the template reads k and v in place), made as any new call's. ``None`` where the
        backend refuses the call."""
        found = self.target_and_plans(device)
        if isinstance(found, Refusal):
            return None
        target, cache = found
        class_key = (planner, _class_plan_key(shared, key[1:]), target)  # the same alignment as the call's
        held = cache.peek(class_key)
        if held is None:
            described = shape()
            template = self._template_of(cache, planner, described, target, device)
            if template is None:
                return self._remember(device, planner, key, described)
            held = cache.get(class_key, lambda: template if isinstance(template, Refusal) else PerCall(template))
        if isinstance(held, Refusal):
            return None
        return cache.get((planner, key, target), lambda: self.filled(held.template, tensor_numbers(inputs)))

    def lane(self, op: str, device, call: int, *args) -> Optional[Callable[..., Optional[tuple]]]:
        """The lane of ``op``'s eager calls of checked signature ``call`` on ``device``
        (:func:`flash_attn.dispatch.run_lane`): ``(call, *the known route's arguments)`` -> its
        results, by the executable held for the signature with aligned pointers, nothing else looked up or
        described; ``None`` while none is held (the call has not run on the known route with
        aligned pointers). The lane gives ``None`` for a call whose pointers are not all aligned,
        for every call where the backend refuses the signature, and once the plans it came from
        are forgotten or replaced. ``args``: the known route's arguments of the call that asks for
        the lane; where the op's plan key adds to the signature (the backward's gradient strides
        and options), the lane holds what this call's adds and leaves the calls whose differ."""
        found = self.target_and_plans(device)
        if isinstance(found, Refusal):
            return None
        target, cache = found
        lane = _LANES[op]
        more = () if lane.more is None else lane.more(*args)
        executable = cache.peek((lane.planner, (own_key(call), more, True), target))  # _plan_key's aligned calls' key
        if executable is None:
            return None
        if isinstance(executable, Refusal):
            return _refused_lane
        runner = self._lane_runner(op, device, target, cache, executable)
        if lane.more is None:
            return runner
        more_of = lane.more

        def same_more(call, *args) -> Optional[tuple]:
            return runner(call, *args) if more_of(*args) == more else None

        return same_more

    def class_lane(self, op: str, device, shared: int) -> Optional[Callable[..., Optional[tuple]]]:
        """The lane of the signatures of :class:`~flash_attn.params.KeyLengths` class ``shared``
        (:func:`flash_attn.dispatch.run_lane`): ``(call, *the known route's arguments)`` -> its
        results, by the executable held for the call's signature, or where none is yet, filled in
        from the class's template with the call's tensors and held for it (what the known route
        does, :meth:`_class_member`), nothing described; ``None`` while the class holds no template
        for aligned pointers. It gives ``None`` where :meth:`lane` does."""
        if _LANES[op].more is not None:  # (its classes are the forward's; the backward has its own key)
            return None
        found = self.target_and_plans(device)
        if isinstance(found, Refusal):
            return None
        target, cache = found
        held = cache.peek((_LANES[op][0], _class_plan_key(shared, ((), True)), target))
        if held is None:
            return None
        if isinstance(held, Refusal):
            return _refused_lane
        return self._lane_runner(op, device, target, cache, held)

    def _lane_runner(self, op: str, device, target, cache: PlanCache, held) -> Callable[..., Optional[tuple]]:
        """``(call, *the known route's arguments) -> results`` of a lane: by ``held``, an executable,
        or where ``held`` is a :class:`PerCall`, by the executable held for the call's signature,
        filled in from ``held``'s template where none is yet."""
        planner, slots_of, flat_of, flat_slots, _ = _LANES[op]
        generation, plans_now, run, filled = cache.generation, self.target_and_plans, self.run, self.filled
        direct = self.direct_lane(held.template if type(held) is PerCall else held, flat_slots)
        # a direct run a held lane may be made from (HeldLanes.holdable)
        holdable = op in HELD_OPS and hasattr(direct, "launches")
        if direct is not None:
            def run_direct(call, *args) -> Optional[tuple]:
                now = plans_now(device)
                if type(now) is not tuple or now[1] is not cache or cache.generation != generation:
                    return None
                flat, no_s_dmask = flat_of(*args)
                results = direct(flat)
                if results is None:
                    return None
                if holdable:
                    _direct_ran.call = (op, call, direct)
                return (*results, None) if no_s_dmask else results

            return run_direct

        def run_lane(call, *args) -> Optional[tuple]:
            now = plans_now(device)
            if type(now) is not tuple or now[1] is not cache or cache.generation != generation:
                return None
            inputs, no_s_dmask = slots_of(*args)
            if not _all_aligned(inputs.values()):
                return None
            executable = held if type(held) is not PerCall else cache.get(
                (planner, (call.own, (), True), target), lambda: filled(held.template, tensor_numbers(inputs)))
            results = run(executable, inputs, device)
            return (*results, None) if no_s_dmask else results

        return run_lane

    def contract(self, unavailable_reason: Callable, failure: Optional[type] = None,
                 held: Optional[HeldLanes] = None) -> Backend:
        """This backend as the dispatcher sees it: its ``prepare_*`` per op, refusing the calls its
        plans or images do not serve (its plain ``forward``/``backward``/``forward_kvcache``
        raise :class:`KernelsCannotRun` for those instead), its ``known_*`` routes, its lanes."""
        return Backend(self.name, unavailable_reason,
                       {"forward": self.prepare_forward, "backward": self.prepare_backward,
                        "forward_kvcache": self.prepare_forward_kvcache}, failure=failure,
                       known={"forward": self.known_forward, "backward": self.known_backward,
                              "forward_kvcache": self.known_forward_kvcache}, lane=self.lane,
                       class_lane=self.class_lane, held=held)

    def forward(self, *args, **kwargs):
        return _run_or_raise(self.name, "forward", self.prepare_forward(*args, **kwargs))

    def backward(self, *args, **kwargs):
        return _run_or_raise(self.name, "backward", self.prepare_backward(*args, **kwargs))

    def forward_kvcache(self, *args, **kwargs):
        return _run_or_raise(self.name, "forward_kvcache", self.prepare_forward_kvcache(*args, **kwargs))


# The plan key of each op's calls (:func:`_plan_key`): the tensors whose alignment it holds, and
# what it adds to the checked signature (the backward: the gradient's strides, the options).

def _forward_key(call, q, k, v, alibi_slopes, sinks, qv, varlen=None, seed=None) -> tuple:
    return _plan_key(call, (q, k, v, alibi_slopes, sinks, qv, *_varlen_tensors(varlen)), (), seed)


def _backward_key(call, dout, q, k, v, out, lse, alibi_slopes, qv, deterministic, return_delta, varlen=None,
                  seed=None) -> tuple:
    return _plan_key(own_key(call), (dout, q, k, v, out, lse, alibi_slopes, qv, *_varlen_tensors(varlen)),
                     _backward_more(dout, deterministic, return_delta), seed)


def _backward_more(dout, deterministic, return_delta) -> tuple:
    """What the backward's plan key adds to the checked signature: the gradient's strides, the options."""
    return dout.stride(), bool(deterministic), bool(return_delta)


def _varlen_tensors(varlen) -> tuple:
    return () if varlen is None else (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.block_table)


def _kvcache_key(call, inputs: dict) -> tuple:
    return _plan_key(call, tuple(inputs.values()))


def _key_seed(params) -> Optional[torch.Tensor]:
    """The dropout seed a plan key holds the alignment of (its layout is fixed, only its pointer varies)."""
    return params.dropout_seed if params.dropout_p and isinstance(params.dropout_seed, torch.Tensor) else None


def _eager_params(scalars: tuple, call) -> AttentionParams:
    """The parameters of an eager call without dropout from its ``scalars`` (softmax_scale,
    window_left, window_right, softcap) and signature."""
    return AttentionParams(*scalars, call=call)


def _plan_key(call, tensors: tuple, more: tuple = (), seed: Optional[torch.Tensor] = None) -> tuple:
    """The plan key of a call with a checked signature (``call``): the signature, what the layers
    below add (``more``) and the data pointers' alignment, the one thing a plan reads that the
    signature does not hold: ``True`` when every tensor is aligned (one test), else each one's."""
    if _all_aligned(tensors) and (seed is None or seed.data_ptr() % limits.POINTER_ALIGNMENT == 0):
        return call, more, True
    aligned = tuple(t is None or t.data_ptr() % limits.POINTER_ALIGNMENT == 0 for t in (*tensors, seed))
    return call, more, aligned


def _class_plan_key(shared: int, rest: tuple) -> tuple:
    """The plan key under which a :class:`~flash_attn.params.KeyLengths` class's template is
    held (never a call's own), ``rest`` what a plan key holds after the call's key (alignment)."""
    return ("key lengths", shared, *rest)


def _all_aligned(tensors) -> bool:
    """Whether every tensor among ``tensors`` (``None`` skipped) starts at an aligned address (one
    test of all the pointers together)."""
    pointers = 0
    for t in tensors:
        if t is not None:
            pointers |= t.data_ptr()
    return pointers % limits.POINTER_ALIGNMENT == 0


def _refused_lane(*args) -> None:
    return None


# The lanes (:meth:`KernelBackend.lane`) of the ops that have them (the contract's ``LANE_OPS``:
# those whose plan key adds nothing to the checked signature but the pointers' alignment): their
# planner, and the known route's arguments -> the call's tensors by slot, and whether the results
# lack the S_dmask the plan makes only when asked for.
def _forward_slots(q, k, v, alibi_slopes, sinks, qv, return_softmax, varlen, scalars) -> tuple[dict, bool]:
    return forward_inputs(q, k, v, None, varlen, alibi_slopes, sinks, qv), not return_softmax


def _kvcache_slots(q, cache, alibi_slopes, sinks, qv, scalars) -> tuple[dict, bool]:
    return kvcache_inputs(q, cache, alibi_slopes, sinks, qv), False


def _backward_slots(dout, q, k, v, out, lse, alibi_slopes, qv, deterministic, return_delta, varlen,
                    scalars) -> tuple[dict, bool]:
    return backward_inputs(dout, q, k, v, out, lse, None, varlen, alibi_slopes), False


def _backward_lane_more(dout, q, k, v, out, lse, alibi_slopes, qv, deterministic, return_delta, varlen,
                        scalars) -> tuple:
    return _backward_more(dout, deterministic, return_delta)


# ... and the same flat (by position, the slots named by FORWARD_SLOTS or KVCACHE_SLOTS): what a
# backend's direct lane (KernelBackend.direct_lane) takes.
def _forward_flat(q, k, v, alibi_slopes, sinks, qv, return_softmax, varlen, scalars) -> tuple[tuple, bool]:
    if varlen is None:
        return (q, k, v, alibi_slopes, sinks, qv, None, None, None), not return_softmax
    return (q, k, v, alibi_slopes, sinks, qv, varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.block_table), \
        not return_softmax


def _kvcache_flat(q, cache, alibi_slopes, sinks, qv, scalars) -> tuple[tuple, bool]:
    return (q, *cache, alibi_slopes, sinks, qv), False


def _backward_flat(dout, q, k, v, out, lse, alibi_slopes, qv, deterministic, return_delta, varlen,
                   scalars) -> tuple[tuple, bool]:
    if varlen is None:
        return (dout, q, k, v, out, lse, alibi_slopes, None, None), False
    return (dout, q, k, v, out, lse, alibi_slopes, varlen.cu_seqlens_q, varlen.cu_seqlens_k), False


class _Lane(NamedTuple):
    planner: Callable
    slots: Callable  # the known route's arguments -> (the call's tensors by slot, no S_dmask in the results)
    flat: Callable  # ... -> (the arguments flat, by position, no S_dmask)
    flat_slots: tuple  # the slot at each position of the flat arguments
    more: Optional[Callable] = None  # ... -> what the op's plan key adds to the signature (None: nothing)


_LANES = {"forward": _Lane(P.plan_forward, _forward_slots, _forward_flat, FORWARD_SLOTS),
          "backward": _Lane(P.plan_backward, _backward_slots, _backward_flat, BACKWARD_SLOTS, _backward_lane_more),
          "forward_kvcache": _Lane(P.plan_kvcache, _kvcache_slots, _kvcache_flat, KVCACHE_SLOTS)}
assert set(_LANES) == set(LANE_OPS)


class KernelsCannotRun(RuntimeError):
    """A kernel backend was called directly with a call its kernels do not serve (the dispatcher
    would have chosen another backend)."""


def _run_or_raise(name: str, op: str, runner):
    if isinstance(runner, Refusal):
        raise KernelsCannotRun(f"the {name} backend cannot run this {op}: {runner}")
    return runner()
