"""Host overhead per call: what the Python side of an attention call costs.

Two modes (``python -m flash_attn bench overhead [--device cuda]``):

* ``stubbed`` (the default; any machine): the public functions on the ``aot`` path as an H100
  runs it (the sm_90a images of this installation, or the newest shipped), with CPU tensors
  standing in for GPU memory and only the CUDA launch left out: the op library takes the CPU
  tensors through its checks, its packing and its scratch allocation and counts the launch
  (``flash_attn::aot_count_cpu_launches``). What remains is this package's own work per call:
  validation, the custom op, dispatch, the plan lookup, the op library's call (its buffers made there).
  What it cannot show: ``cudaLaunchKernelExC`` and the current stream's lookup (a few
  microseconds per launch), and the CUDA caching allocator (CPU allocations stand in for it; CPU
  placeholders are kept, CUDA ones made per call). The host value checks run as for device
  tensors: only with ``FLASH_ATTN_DEBUG=1`` (a GPU call never reads its tensors' values).
  ``--profile`` adds, per case, cProfile's view and a per-stage breakdown
  (:func:`stage_breakdown`: each stage replayed alone).
* ``device`` (a CUDA GPU): the same calls for real, and PyTorch SDPA's flash and cuDNN backends
  on the same shapes (:func:`_sdpa_calls`), interleaved, every row with the host's CPU time per
  call (the process's, and the calling thread's), the GPU's time per call (the calls queued
  behind a sleep kernel, timed by events: :func:`flash_attn.bench.common.cuda_gpu_span`), the wall clock, and whether the
  host is the bound. More rows split a call's cost: one launch through the op library alone
  (an empty kernel, :data:`EMPTY_KERNEL_PTX`: the stable-ABI call, the library's checks, the CUDA
  launch; then a forward's kernel with the arguments its call packed), the same making its buffers,
  one PyTorch kernel launch, the library's op without arguments (the stable-ABI call alone) and
  the forward's buffers made by ``torch.empty`` (:data:`PART_CASES`). Our calls run twice: each
  launch by the CUDA runtime (the op library's default) and by the driver (:data:`DRIVER_ROUTE`).

Each figure is the median of ``repeats`` runs of ``calls`` calls, in microseconds per call: CPU
time of this process in ``stubbed`` mode (other processes on a shared machine do not inflate it;
nothing waits for a device). ``plans_per_call`` (stubbed mode, in the JSON): launch plans made
per timed call (plans the cache holds under a call's signature and under its shape count once), 0
when every call finds its plan in the cache.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import itertools
import pstats
import statistics
import time
from typing import Callable, Optional

import torch

from flash_attn import custom_ops, dispatch, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, validation
from flash_attn.aot import archs, manifest as aot_manifest
from flash_attn.bench.common import cuda_gpu_span, host_and_gpu
from flash_attn.backends import aot
from flash_attn.layers.rotary import apply_rotary_emb
from flash_attn.planning import configs
from flash_attn.planning.plan import Target

CASES = ("forward", "forward+backward", "packed training", "packed training, later layer", "decode step",
         "plain decode", "growing cache decode", "rotary step")
# cases whose every call has a new signature: no stage breakdown (it replays one recorded call)
NEW_EVERY_CALL = ("growing cache decode",)
# the growing cache's first length and how many lengths follow (then they repeat): more than the
# warm-up, timed and profiled calls of the defaults (20 + 5 x 200 + 200)
GROWING_FROM, GROWING_LENGTHS = 2000, 2048
LAUNCH_CASES = ("one aot launch, an empty kernel", "one aot launch", "one aot launch, its buffers made",
                "one PyTorch launch")  # device mode only
# The empty kernel's image: PTX (the driver compiles it at the first launch) of one pointer
# parameter and one warp that returns at once: a launch through the op library that gives the GPU
# nothing to do, so its row is the host's cost of a launch alone.
EMPTY_KERNEL = ("flash_attn_empty", "*fp32:16", 1)  # (entry, signature, num_warps)
EMPTY_KERNEL_PTX = """\
.version 7.0
.target sm_80
.address_size 64

.visible .entry {0}(
\t.param .u64 {0}_param_0
)
.reqntid {1}
{{
\tret;
}}
""".format(EMPTY_KERNEL[0], 32 * EMPTY_KERNEL[2])
# ... and what a forward's op call is made of besides its launch: the op library's call itself, and
# out and lse allocated by PyTorch (against "its buffers made": the library's allocation of the same)
PART_CASES = ("an empty op of the op library", "out and lse by torch.empty")
# stubbed mode only: what forward + backward costs PyTorch's autograd itself (:func:`_floor_calls`)
FLOOR_CASES = ("floor: a Python autograd Function", "floor: a C++ autograd node")

# packed batches: distinct totals, so that no two calls of a timing run have the same lengths
# (more than the warm-up and timed calls of the defaults: 20 + 5 x 200); their signatures hold the
# longest lengths' buckets, not the totals: ~10 signatures, all met in the warm-up
PACKED_BATCHES = 1100


def _packed_batches(n: int, sequences: int, device) -> list[tuple[torch.Tensor, int, int]]:
    """``n`` packed batches ``(cu_seqlens, max_seqlen, total)`` as padding-free training makes
    them: ``sequences`` sequences whose lengths change from batch to batch, batch ``i`` holding
    ``200 + i`` tokens (so every total, and most longest lengths, differ between calls)."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(n):
        total = 200 + i
        cuts = torch.randperm(total - 1, generator=g)[: sequences - 1].add_(1).sort().values.tolist()
        bounds = [0, *cuts, total]
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        batches.append((cu, max(lengths), total))
    return batches


def _calls(device) -> dict[str, Callable[[], object]]:
    """The measured calls: a short forward (inference), a training step's attention (forward and
    backward through autograd), the same for packed sequences whose lengths change every call
    (padding-free training: ``flash_attn_varlen_func``; a model's first layer of a step: a new batch,
    in the class of the earlier batches with as many sequences and longest lengths in the same
    buckets) and for one packed batch again and again (its later layers: the same lengths), one
    decode step with a KV cache (append + attend), one query of batch 1 over a whole 4k cache (``bench
    gpu``'s decode row: no cache_seqlens, nothing appended), one decode step over a cache kept as growing
    tensors (Hugging Face's ``generate()``: ``flash_attn_func`` over its ``(b, hk, s, d)`` cache
    transposed, one key more every call, so every call has a new signature; in a model only the
    first layer's call of a step is new), and a decode step's rotary (a model's q rotated in place
    at each sequence's own position: its argument checks, including the offsets' values, on the
    device for device tensors; in stubbed mode its PyTorch path, checked on the host)."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    q, k, v = rnd(1, 128, 16, 128), rnd(1, 128, 16, 128), rnd(1, 128, 16, 128)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = rnd(1, 128, 16, 128)
    batch, heads, heads_k = 8, 32, 8
    k_cache, v_cache = rnd(batch, 4096, heads_k, 128), rnd(batch, 4096, heads_k, 128)
    step_q, step_k, step_v = rnd(batch, 1, heads, 128), rnd(batch, 1, heads_k, 128), rnd(batch, 1, heads_k, 128)
    seqlens = torch.full((batch,), 2000, dtype=torch.int32, device=device)
    cos, sin = rnd(4096, 64), rnd(4096, 64)
    one_q, one_k_cache, one_v_cache = rnd(1, 1, heads, 128), rnd(1, 4096, heads_k, 128), rnd(1, 4096, heads_k, 128)

    def training():
        for t in (qg, kg, vg):
            t.grad = None  # the step's gradients are fresh tensors (no accumulation)
        flash_attn_func(qg, kg, vg, causal=True).backward(dout)

    batches = itertools.cycle(_packed_batches(PACKED_BATCHES, 4, device))
    rows = 200 + PACKED_BATCHES
    # few heads: the CPU stand-in zero-fills the backward's fp32 dQ buffer, which a GPU does on the side
    packed_q, packed_k, packed_v, packed_dout = (rnd(rows, 4, 64) for _ in range(4))

    def packed_training():
        cu, longest, total = next(batches)
        q, k, v = (t[:total].requires_grad_() for t in (packed_q, packed_k, packed_v))
        flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True).backward(packed_dout[:total])

    layer_cu, layer_longest, layer_total = _packed_batches(1, 4, device)[0]

    def packed_later_layer():
        q, k, v = (t[:layer_total].requires_grad_() for t in (packed_q, packed_k, packed_v))
        flash_attn_varlen_func(q, k, v, layer_cu, layer_cu, layer_longest, layer_longest,
                               causal=True).backward(packed_dout[:layer_total])

    growing_step = _growing_cache_step(rnd, heads, heads_k, functools.partial(flash_attn_func, causal=True))

    return {
        "forward": lambda: flash_attn_func(q, k, v, causal=True),
        "forward+backward": training,
        "packed training": packed_training,
        "packed training, later layer": packed_later_layer,
        "decode step": lambda: flash_attn_with_kvcache(step_q, k_cache, v_cache, step_k, step_v,
                                                       cache_seqlens=seqlens, causal=True),
        "plain decode": lambda: flash_attn_with_kvcache(one_q, one_k_cache, one_v_cache),
        "growing cache decode": growing_step,
        "rotary step": lambda: apply_rotary_emb(step_q, cos, sin, inplace=True, seqlen_offsets=seqlens),
    }


class _EmptyFunction(torch.autograd.Function):
    """An autograd Function that computes nothing: three inputs saved, an empty output, three
    empty gradients (the shape of our forward + backward's Function)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _floor_calls() -> dict[str, Callable[[], object]]:
    """Forward + backward through autograd with no work of ours, on 16 numbers: a Python
    ``torch.autograd.Function`` (our training call's structure) and one of PyTorch's C++ autograd
    nodes (``x * 2``: SDPA's structure). The same run's floors for the forward + backward row: what
    no change of ours can take off it, and what a C++ node would."""
    q, k, v = (torch.randn(16).requires_grad_() for _ in range(3))
    dout = torch.randn(16)

    def python_function():
        for t in (q, k, v):
            t.grad = None
        _EmptyFunction.apply(q, k, v).backward(dout)

    def cpp_node():
        q.grad = None
        (q * 2.0).backward(dout)

    return dict(zip(FLOOR_CASES, (python_function, cpp_node)))


def _growing_cache_step(rnd: Callable, heads: int, heads_k: int, attend: Callable) -> Callable[[], object]:
    """A decode step over a cache kept as growing tensors, as Hugging Face's ``generate()`` passes
    it: ``attend(q, k, v)`` with one query token and k, v views ``(1, n, heads_k, 128)`` of a
    ``(1, heads_k, s, 128)`` cache (transposed), n one more every call (from :data:`GROWING_FROM`,
    repeating after :data:`GROWING_LENGTHS`)."""
    q = rnd(1, 1, heads, 128)
    k, v = (rnd(1, heads_k, GROWING_FROM + GROWING_LENGTHS, 128) for _ in range(2))
    lengths = itertools.cycle(range(GROWING_FROM, GROWING_FROM + GROWING_LENGTHS))

    def step():
        n = next(lengths)
        return attend(q, k[:, :, :n].transpose(1, 2), v[:, :, :n].transpose(1, 2))

    return step


def _captured_launch(call: Callable[[], object], made: bool = False) -> tuple[Callable, tuple]:
    """``(launch, args)``: the op library's ``aot_run`` and the arguments of the last one ``call``
    made (on the ``aot`` backend), to repeat those launches alone: the buffers that call made
    passed in as tensors (a plan written without buffers), so that a repeat makes none; with
    ``made``, the arguments as the call gave them (its plan making its buffers every time)."""
    captured = []
    saved = aot._launch

    def recording(launches, passed, rows):
        buffers = saved(launches, passed, rows)
        if made:
            captured.append((launches.plan, list(passed), list(rows)))
            return buffers
        everything = {**dict(zip(launches.names, passed)), **dict(zip(launches.rows, rows)),
                      **dict(zip(launches.made, buffers))}
        given = {*launches.names, *launches.made}
        unused = frozenset(s for p in launches.packed for s in p.slots if s not in given)
        alone = aot._launches(launches.packed, unused)
        captured.append((alone.plan, list(alone.tensors(everything)), list(alone.row_counts(everything))))
        return buffers

    aot._launch = recording
    try:
        call()
    finally:
        aot._launch = saved
    if not captured:
        raise RuntimeError("the call launched nothing through the aot backend's op library (FLASH_ATTN_BACKEND=aot?)")
    return aot._run_op(), captured[-1]


def _launch_calls(device) -> dict[str, Callable[[], object]]:
    """An empty kernel launched through the op library (:func:`empty_kernel`: the host's cost of a
    launch), one forward kernel launched again through it, its buffers passed in and made as the
    forward makes them (out and lse: the difference is the library's allocation), and one PyTorch
    kernel launch (an in-place add on 16 numbers); then the parts (:data:`PART_CASES`): the
    library's op without arguments (the call into it through PyTorch's dispatcher and the stable
    ABI, nothing done) and the forward's out and lse made by ``torch.empty``."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 128, 16, 128, generator=g).to(torch.bfloat16).to(device)
    forward = lambda: flash_attn_func(q, q, q, causal=True)  # noqa: E731
    launch, args = _captured_launch(forward)
    _, own = _captured_launch(forward, made=True)
    x = torch.zeros(16, device=device)
    empty_op = aot.op_builtin("aot_counted_launches")  # called as the forward's aot_run is
    launch_op, empty = aot.op_builtin("aot_launch"), empty_kernel()
    return {"one aot launch, an empty kernel": lambda: launch_op(empty, [1], [x], [], []),
            "one aot launch": lambda: launch(*args), "one aot launch, its buffers made": lambda: launch(*own),
            "one PyTorch launch": lambda: x.add_(1.0), PART_CASES[0]: empty_op,
            PART_CASES[1]: lambda: (torch.empty(q.shape, dtype=q.dtype, device=device),
                                    torch.empty(1, 16, 128, dtype=torch.float32, device=device))}


def empty_kernel() -> int:
    """The op library's kernel id of :data:`EMPTY_KERNEL_PTX` (registered once: the same image
    again gives the same id)."""
    name, signature, num_warps = EMPTY_KERNEL
    image = torch.frombuffer(bytearray(EMPTY_KERNEL_PTX.encode()), dtype=torch.uint8)
    return aot.op_library.ops().aot_register_kernel(f"{name}.ptx", name, signature, num_warps, 1, 0, image=image)


@contextlib.contextmanager
def stubbed_aot():
    """The ``aot`` backend of an H100 for CPU tensors, launches counted instead of run (by the op
    library, after its checks); yields a function that returns the launches counted so far."""
    manifest, why = aot_manifest.manifest()
    if manifest is None or not aot.op_library.status().loaded:
        raise RuntimeError(f"the stubbed benchmark runs the installed aot backend: {why or aot.op_library.status().reason}")
    capability = (9, 0)
    choice = manifest.image_for(capability)
    if not choice.supported:
        capability = max(aot.archs.parse_arch(a).capability for a in manifest.archs)
        choice = manifest.image_for(capability)
    family = configs.arch_family(archs.config_capability(capability, choice))
    images = aot._DeviceImages(manifest, choice.arch.name, Target(family, 132, aot=True))
    ops = aot.op_library.ops()
    # the dispatcher's own chain lookup runs (settings read, cache hit), deciding "aot" for the CPU
    saved = (dispatch.route, dispatch._chains, aot._device_images, custom_ops._checks_values)
    dispatch.route = lambda device: dispatch.Route(torch.device(device), ("aot",))
    dispatch._chains = {}
    aot._device_images = lambda device: images
    custom_ops._checks_values = lambda t: validation.debug_checks()  # the rule for device tensors
    ops.aot_count_cpu_launches(True)
    try:
        yield ops.aot_counted_launches
    finally:
        ops.aot_count_cpu_launches(False)
        ops.aot_lanes_clear()  # the lanes held for CPU tensors go with the stub's chains
        dispatch.route, dispatch._chains, aot._device_images, custom_ops._checks_values = saved


def _time(fn: Callable, calls: int, repeats: int, sync: Callable[[], None], clock=time.perf_counter) -> list[float]:
    for _ in range(max(3, calls // 10)):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        sync()
        out.append((clock() - start) / calls * 1e6)
    return out


def profile_text(fn: Callable, calls: int, sync: Callable[[], None], rows: int = 30) -> str:
    """Where ``calls`` calls of ``fn`` spend host time (cProfile): the functions with the most own
    time, then the most cumulative time, in microseconds per call of ``fn``. On a GPU the op
    library's launch is one builtin (its C++ checks and packing, and the CUDA launch)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    sync()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, own s, cumulative s, callers)
    lines = [f"{calls} calls; microseconds per call (own / cumulative) and the function's calls per call"]
    for title, key in (("by own time", 2), ("by cumulative time", 3)):
        lines += ["", title, f"{'own us':>9} {'cum us':>9} {'calls':>7}  function"]
        for (path, line, name), entry in sorted(stats.items(), key=lambda kv: -kv[1][key])[:rows]:
            where = f"{name}" if path == "~" else f"{name} ({'/'.join(path.split('/')[-2:])}:{line})"
            lines.append(f"{entry[2] / calls * 1e6:9.2f} {entry[3] / calls * 1e6:9.2f} {entry[1] / calls:7.1f}  {where}")
    return "\n".join(lines) + "\n"


# The stages of a call that the breakdown times on their own: (label, module, function name). Each
# is replayed with the arguments of the call's first use of it, so each stage's figure is what a
# steady-state call pays for it (the plan found in the cache, the checks' signature known).
# Functions a version of the package lacks are left out (the breakdown also runs on older trees,
# for before/after figures: there the checks ran as check_dense_qkv, check_options, ...).
def _stage_functions() -> list[tuple]:
    from flash_attn import custom_ops, kvcache, validation  # noqa: PLC0415

    stages = [
        ("metadata checks", validation, "checked_call"),
        ("metadata checks", validation, "checked"),
        ("metadata checks: q, k, v", validation, "check_dense_qkv"),
        ("metadata checks: options", validation, "check_options"),
        ("metadata checks: the kv cache", kvcache, "_check_kvcache"),
        ("custom op entry", custom_ops, "forward"),
        ("custom op entry (kv cache)", custom_ops, "forward_kvcache"),
        ("backward op body", custom_ops, "_backward_run"),
        ("backward op body", custom_ops, "_backward_body"),
        ("host value checks (CPU tensors)", custom_ops, "_check_varlen_values"),
        ("host value checks (CPU tensors)", custom_ops, "_check_kvcache_values"),
        ("dispatch, a held lane: the op library's call (metadata compared, buffers made, launches checked)",
         dispatch, "run_held"),
        ("dispatch, a lane held for the next calls", dispatch, "hold_held"),
        ("dispatch, the training call's held lanes looked up", dispatch, "held_training"),
        ("custom op entry, the training call's held lanes (its autograd record)", custom_ops, "held_training"),
        ("custom op entry, the training call's held lanes (its autograd record)", custom_ops, "held_packed_training"),
        ("the held forward's op library call (metadata compared, buffers made, launches checked)",
         getattr(dispatch, "HeldTraining", None), "forward"),
        ("the held backward's op library call (metadata compared, buffers made, launches checked)",
         getattr(dispatch, "HeldTraining", None), "backward"),
        ("dispatch", dispatch, "run"),
        ("dispatch, the plan held for the signature", dispatch, "run_known"),
        ("dispatch, the signature's lane", dispatch, "run_lane"),
        ("inputs prepared (the buffers too, before the op library made them)", aot, "slots"),
        ("the op library's call: buffers made, launches checked (the CUDA launch stubbed)", aot, "_launch"),
    ]
    return [(label, module, name) for label, module, name in stages if module is not None and hasattr(module, name)]


class _Stage:
    __slots__ = ("label", "fn", "args", "kwargs", "parent", "count", "children")

    def __init__(self, label, fn, args, kwargs, parent):
        self.label, self.fn, self.args, self.kwargs, self.parent = label, fn, args, kwargs, parent
        self.count, self.children = 0, []


def _record_stages(fn: Callable) -> list[_Stage]:
    """One call of ``fn`` with the stage functions wrapped: each stage's first arguments, how
    often it runs per call, and the stage it runs inside. ``dispatch.run`` adds two stages of its
    own per op: the backend's plan lookup (describe the call, find its plan) and the execution
    (``dispatch.run_known``, the route of a held plan, and ``dispatch.run_lane``, a signature's
    lane, are one stage each: their own time is the lookup)."""
    stages: dict[tuple, _Stage] = {}
    stack: list[_Stage] = []
    saved = []

    def wrap(label, module, name, original):
        is_dispatch = module is dispatch and name in ("run", "run_known", "run_lane")
        def recording(*args, **kwargs):
            op = f" ({args[0]})" if is_dispatch else ""
            key = (label + op, stack[-1].label if stack else None)
            stage = stages.get(key)
            if stage is None:
                stage = stages[key] = _Stage(label + op, original, args, kwargs, stack[-1] if stack else None)
                if stack:
                    stack[-1].children.append(stage)
            stage.count += 1
            stack.append(stage)
            try:
                return original(*args, **kwargs)
            finally:
                stack.pop()
        return recording

    for label, module, name in _stage_functions():
        original = getattr(module, name)
        saved.append((module, name, original))
        setattr(module, name, wrap(label, module, name, original))
    try:
        fn()
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
    for stage in list(stages.values()):
        if stage.fn is dispatch.run:
            op, device, *args = stage.args
            prepare = dispatch._load(dispatch.chain(device)[0])[0].prepare[op]
            plan = _Stage(f"plan lookup ({op}: describe the call, find its plan)", prepare, tuple(args),
                          stage.kwargs, stage)
            runner = prepare(*args, **stage.kwargs)
            run = _Stage(f"execution ({op}: buffers, argument lists, launches)", runner, (), {}, stage)
            plan.count = run.count = 1
            # what the execution runs (allocation, launches) moves under it
            run.children, stage.children = stage.children, [plan, run]
    return [s for s in stages.values() if s.parent is None]


def stage_breakdown(fn: Callable, calls: int, repeats: int = 3) -> list[dict]:
    """Where one call of ``fn`` spends host time, by stage: each stage of :func:`_stage_functions`
    that the call runs, replayed alone (CPU time, median of ``repeats`` runs of ``calls``), its
    own time (what its sub-stages do not account for) and its runs per call. The first row is
    the whole call; its own time is what no listed stage covers (the public function's glue, and
    in training the autograd engine and the forward's autograd record)."""
    roots = _record_stages(fn)
    whole = statistics.median(_time(fn, calls, repeats, lambda: None, clock=time.process_time))
    rows = [{"stage": "the whole call", "depth": 0, "us": whole, "count": 1,
             "own_us": whole - sum(_inclusive(s, calls, repeats) * s.count for s in roots)}]

    def visit(stage, depth):
        us = _inclusive(stage, calls, repeats)
        own = us - sum(_inclusive(c, calls, repeats) * c.count / max(stage.count, 1) for c in stage.children)
        rows.append({"stage": stage.label, "depth": depth, "us": us, "count": stage.count, "own_us": own})
        for child in stage.children:
            visit(child, depth + 1)

    for root in roots:
        visit(root, 1)
    return rows


_timed: dict = {}


def _inclusive(stage: _Stage, calls: int, repeats: int) -> float:
    if id(stage) not in _timed:
        call = (lambda: stage.fn(*stage.args, **stage.kwargs)) if stage.args or stage.kwargs else stage.fn
        _timed[id(stage)] = (stage, statistics.median(_time(call, calls, repeats, lambda: None, clock=time.process_time)))
    return _timed[id(stage)][1]


def stages_text(rows: list[dict]) -> str:
    lines = [f"{'us':>8} {'own us':>8} {'runs':>5}  stage (replayed alone, CPU time per run; nested stages indented)"]
    for r in rows:
        lines.append(f"{r['us']:8.2f} {r['own_us']:8.2f} {r['count']:5d}  {'  ' * r['depth']}{r['stage']}")
    return "\n".join(lines) + "\n"


# --- device mode: host and GPU apart, ours beside SDPA's ---------------------------------------

# SDPA's backends timed on the same calls in device mode (label -> torch.nn.attention.SDPBackend)
SDPA_BACKENDS = {"sdpa[flash]": "FLASH_ATTENTION", "sdpa[cudnn]": "CUDNN_ATTENTION"}
# our calls again, every launch by the driver's cuLaunchKernelEx (the op library's other route,
# ``aot_use_driver_launch``): which launch API costs the host less, in the same run
DRIVER_ROUTE = "flash_attn[driver launch]"
IMPLS = ("flash_attn", DRIVER_ROUTE, *SDPA_BACKENDS)
# (impl, case) not timed in device mode, and why (a row says so): cuDNN builds an execution graph
# for every new key length, 43 ms a call on the H200 (2026-11-30), so its growing cache's calls
# and their sleep-covered GPU span took most of a minute and measured the graph build
NOT_TIMED = {("sdpa[cudnn]", "growing cache decode"): "not timed: cuDNN builds a graph for every new key length "
             "(43 ms a call on an H200)"}
DEVICE_COLUMNS = ("mode", "case", "impl", "us_per_call", "us_min", "us_max", "host_us", "host_min", "host_max",
                  "thread_us", "thread_min", "thread_max", "gpu_us", "gpu_min", "gpu_max", "host_bound", "gpu_covered", "launches_per_call", "status", "note")


def _sdpa_calls(device) -> dict[str, Callable[[], object]]:
    """SDPA on the calls of :func:`_calls` that it has (no packed sequences, no rotary): the same
    shapes, its own ``(batch, heads, seqlen, headdim)`` layout; the decode step appends the new
    token's k/v to the cache (two copies) and attends over the filled rows, the growing cache's
    step over the same views as ours (:func:`flash_attn.bench.gpu.sdpa_decode`: query heads
    grouped by their KV head)."""
    import torch.nn.functional as F  # noqa: PLC0415

    from flash_attn.bench.gpu import sdpa_decode  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    q, k, v = rnd(1, 16, 128, 128), rnd(1, 16, 128, 128), rnd(1, 16, 128, 128)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = rnd(1, 16, 128, 128)
    batch, heads, heads_k, filled = 8, 32, 8, 2000
    k_cache, v_cache = rnd(batch, 4096, heads_k, 128), rnd(batch, 4096, heads_k, 128)
    step_q, step_k, step_v = rnd(batch, 1, heads, 128), rnd(batch, 1, heads_k, 128), rnd(batch, 1, heads_k, 128)
    one_q, one_k_cache, one_v_cache = rnd(1, 1, heads, 128), rnd(1, 4096, heads_k, 128), rnd(1, 4096, heads_k, 128)

    def training():
        for t in (qg, kg, vg):
            t.grad = None
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(dout)

    def decode_step():
        k_cache[:, filled:filled + 1] = step_k
        v_cache[:, filled:filled + 1] = step_v
        return sdpa_decode(step_q, k_cache[:, :filled + 1], v_cache[:, :filled + 1])

    growing_step = _growing_cache_step(rnd, heads, heads_k, sdpa_decode)

    return {
        "forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "forward+backward": training,
        "decode step": decode_step,
        "plain decode": lambda: sdpa_decode(one_q, one_k_cache, one_v_cache),
        "growing cache decode": growing_step,
    }


def _sdpa_context(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    return sdpa_kernel(getattr(SDPBackend, backend))


def device_impls(ours: dict, sdpa_calls: Callable[[], dict]) -> tuple[dict, dict]:
    """Device mode's ``(calls_by_impl, contexts)`` (:func:`device_rows`): our calls, the same
    again on the driver's launch route (those that launch through the op library), and SDPA's
    backends on theirs (``sdpa_calls()``: a fresh set each), each in its context."""
    not_ours = ("one PyTorch launch", *PART_CASES)
    calls_by_impl = {"flash_attn": ours, DRIVER_ROUTE: {c: fn for c, fn in ours.items() if c not in not_ours},
                     **{impl: sdpa_calls() for impl in SDPA_BACKENDS}}
    for impl, case in NOT_TIMED:
        del calls_by_impl[impl][case]
    contexts = {impl: (lambda b=b: _sdpa_context(b)) for impl, b in SDPA_BACKENDS.items()}
    contexts[DRIVER_ROUTE] = _driver_route
    return calls_by_impl, contexts


@contextlib.contextmanager
def _driver_route():
    ops = aot.op_library.ops()
    previous = ops.aot_use_driver_launch(True)
    try:
        yield
    finally:
        ops.aot_use_driver_launch(previous)


def device_rows(calls_by_impl: dict, calls: int, repeats: int, sync: Callable[[], None], gpu_span=None,
                contexts: Optional[dict] = None, launches: Optional[dict] = None) -> list[dict]:
    """Rows of device mode: for each case and implementation (``calls_by_impl``: impl -> case ->
    call), the median and spread over ``repeats`` runs of :func:`host_and_gpu`, the runs
    interleaved (every case and implementation once, then again), each inside its ``contexts[impl]``
    (SDPA's backend choice). A call that raises is a row with ``status`` error and the message.
    ``host_bound``: the host's CPU time per call exceeds the GPU's (the GPU waits for the host)."""
    runs: dict = {}
    failed: dict = {}
    cases = list(dict.fromkeys(case for by_case in calls_by_impl.values() for case in by_case))
    for _ in range(repeats):
        for case in cases:
            for impl, by_case in calls_by_impl.items():
                if case not in by_case or (case, impl) in failed:
                    continue
                with (contexts or {}).get(impl, contextlib.nullcontext)():
                    try:
                        for _ in range(max(3, calls // 10)):  # warm-up (plans, autotuning, allocator)
                            by_case[case]()
                        runs.setdefault((case, impl), []).append(host_and_gpu(by_case[case], calls, sync, gpu_span))
                    except Exception as exc:  # noqa: BLE001  (SDPA's backends refuse some calls)
                        failed[case, impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    rows = []
    for case in cases:
        for impl in calls_by_impl:
            if case not in calls_by_impl[impl]:
                continue
            row = {**dict.fromkeys(DEVICE_COLUMNS), "mode": "device", "case": case, "impl": impl,
                   "launches_per_call": (launches or {}).get(case)}
            if (case, impl) in failed:
                rows.append({**row, "status": "error", "note": failed[case, impl]})
                continue
            got = runs[case, impl]
            for key, name in (("wall_us", "us"), ("host_us", "host"), ("thread_us", "thread"), ("gpu_us", "gpu")):
                values = [r[key] for r in got if r[key] is not None]
                if values:
                    prefix = "us_per_call" if name == "us" else f"{name}_us"
                    row.update({prefix: statistics.median(values), f"{name}_min": min(values),
                                f"{name}_max": max(values)})
            if row.get("gpu_us") is not None:
                row["host_bound"] = row["host_us"] > row["gpu_us"]
                row["gpu_covered"] = all(r["gpu_covered"] for r in got)
            rows.append({**row, "status": "ok"})
    return rows


def run(mode: str = "stubbed", calls: int = 200, repeats: int = 5, profiles: Optional[dict] = None) -> list[dict]:
    """One row per case: ``us_per_call`` (median), min and max over ``repeats``, launches per call,
    plans made per timed call (stubbed mode). ``profiles``: a dict that receives each case's
    :func:`profile_text`. Device mode: one row per case and implementation (:func:`device_rows`)."""
    rows = []
    if mode == "device":
        if not torch.cuda.is_available():
            raise RuntimeError("device mode needs a CUDA GPU")
        device = torch.device("cuda")
        ours = {**_calls(device), **_launch_calls(device)}
        calls_by_impl, contexts = device_impls(ours, lambda: _sdpa_calls(device))
        rows = device_rows(calls_by_impl, calls, repeats, torch.cuda.synchronize, cuda_gpu_span, contexts,
                           launches={**{name: 1 for name in LAUNCH_CASES}, **dict.fromkeys(PART_CASES, 0)})
        rows += [{**dict.fromkeys(DEVICE_COLUMNS), "mode": "device", "case": case, "impl": impl,
                  "status": "not timed", "note": why} for (impl, case), why in NOT_TIMED.items()]
        if profiles is not None:
            for name, fn in ours.items():
                profiles[name] = profile_text(fn, calls, torch.cuda.synchronize)
        return rows
    with stubbed_aot() as launches:
        plans = aot._device_images(torch.device("cpu")).plans
        for name, fn in _calls(torch.device("cpu")).items():
            fn()
            before = launches()
            fn()
            per_call = launches() - before
            planned = plans.distinct()
            times = _time(fn, calls, repeats, lambda: None, clock=time.process_time)
            rows.append({"mode": mode, "case": name, "us_per_call": statistics.median(times),
                         "us_min": min(times), "us_max": max(times), "launches_per_call": per_call,
                         "plans_per_call": (plans.distinct() - planned) / (calls * repeats + max(3, calls // 10))})
            if profiles is not None:
                stages = "" if name in NEW_EVERY_CALL else "\nby stage\n" + stages_text(stage_breakdown(fn, calls))
                profiles[name] = profile_text(fn, calls, lambda: None) + stages
    for name, fn in _floor_calls().items():
        times = _time(fn, calls, repeats, lambda: None, clock=time.process_time)
        rows.append({"mode": mode, "case": name, "us_per_call": statistics.median(times), "us_min": min(times),
                     "us_max": max(times), "launches_per_call": 0, "plans_per_call": 0})
    return rows
