"""Host overhead per call: what the Python side of an attention call costs.

Two modes (``python -m flash_attn bench overhead [--device cuda]``):

* ``stubbed`` (the default; any machine): the public functions on the ``aot`` path as an H100
  runs it (the sm_90a images of this installation, or the newest shipped), with CPU tensors
  standing in for GPU memory and the op library's launch replaced by a no-op that only counts.
  What remains is this package's own work per call: validation, the custom op, dispatch, the
  plan lookup, buffer allocation, the argument lists. What it cannot show: the op library's
  argument checks and ``cuLaunchKernel`` (a few microseconds per launch), and the CUDA caching
  allocator (CPU allocations stand in for it).
* ``device`` (a CUDA GPU): the same calls for real; small shapes, so the time per call is what a
  host-bound loop (decoding) pays: wall clock over many calls, the device synchronised once. Two
  more rows split a call's cost: one launch through the op library alone (a forward's kernel with
  the arguments its call packed: the library's checks, the stable-ABI call, ``cudaLaunchKernelExC``)
  and, for scale, one PyTorch kernel launch.

Each figure is the median of ``repeats`` runs of ``calls`` calls, in microseconds per call: CPU
time of this process in ``stubbed`` mode (other processes on a shared machine do not inflate it;
nothing waits for a device), wall clock in ``device`` mode. ``plans_per_call`` (stubbed mode, in
the JSON): launch plans made per timed call, 0 when every call finds its plan in the cache.
"""

from __future__ import annotations

import contextlib
import cProfile
import itertools
import pstats
import statistics
import time
from typing import Callable, Optional

import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn.aot import archs, manifest as aot_manifest
from flash_attn.backends import aot
from flash_attn.layers.rotary import apply_rotary_emb
from flash_attn.planning import configs
from flash_attn.planning.plan import Target

CASES = ("forward", "forward+backward", "packed training", "decode step", "rotary step")
LAUNCH_CASES = ("one aot launch", "one PyTorch launch")  # device mode only

# packed batches: distinct totals, so that no two calls of a timing run have the same lengths
# (more than the warm-up and timed calls of the defaults: 20 + 5 x 200)
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
    (padding-free training: ``flash_attn_varlen_func``), one decode step with a KV cache (append +
    attend), and a decode step's rotary (a model's q rotated in place at each sequence's own
    position: its argument checks, including the offsets' values, on the device for device
    tensors; in stubbed mode its PyTorch path, checked on the host)."""
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

    return {
        "forward": lambda: flash_attn_func(q, k, v, causal=True),
        "forward+backward": training,
        "packed training": packed_training,
        "decode step": lambda: flash_attn_with_kvcache(step_q, k_cache, v_cache, step_k, step_v,
                                                       cache_seqlens=seqlens, causal=True),
        "rotary step": lambda: apply_rotary_emb(step_q, cos, sin, inplace=True, seqlen_offsets=seqlens),
    }


def _captured_launch(call: Callable[[], object]) -> tuple[Callable, tuple]:
    """``(launch, args)``: the op library's launch and the arguments of the last launch ``call``
    made through it (on the ``aot`` backend), to repeat that launch alone."""
    launch = aot._launch_op()
    captured = []

    def recording(*args):
        captured.append(args)
        return launch(*args)

    saved = aot._launch_op
    aot._launch_op = lambda: recording
    try:
        call()
    finally:
        aot._launch_op = saved
    if not captured:
        raise RuntimeError("the call launched nothing through the aot backend's op library (FLASH_ATTN_BACKEND=aot?)")
    return launch, captured[-1]


def _launch_calls(device) -> dict[str, Callable[[], object]]:
    """One forward kernel launched again through the op library, and one PyTorch kernel launch
    (an in-place add on 16 numbers)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 128, 16, 128, generator=g).to(torch.bfloat16).to(device)
    launch, args = _captured_launch(lambda: flash_attn_func(q, q, q, causal=True))
    x = torch.zeros(16, device=device)
    return {"one aot launch": lambda: launch(*args), "one PyTorch launch": lambda: x.add_(1.0)}


@contextlib.contextmanager
def stubbed_aot():
    """The ``aot`` backend of an H100 for CPU tensors, launches counted instead of run."""
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
    launches = [0]

    def no_launch(*args):
        launches[0] += 1

    saved = (dispatch.chain, aot._device_images, aot._launch_op)
    dispatch.chain = lambda device: ("aot",)
    aot._device_images = lambda device: images
    aot._launch_op = lambda: no_launch
    try:
        yield launches
    finally:
        dispatch.chain, aot._device_images, aot._launch_op = saved


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


def run(mode: str = "stubbed", calls: int = 200, repeats: int = 5, profiles: Optional[dict] = None) -> list[dict]:
    """One row per case: ``us_per_call`` (median), min and max over ``repeats``, launches per call,
    plans made per timed call (stubbed mode). ``profiles``: a dict that receives each case's
    :func:`profile_text`."""
    rows = []
    if mode == "device":
        if not torch.cuda.is_available():
            raise RuntimeError("device mode needs a CUDA GPU")
        device = torch.device("cuda")
        for name, fn in {**_calls(device), **_launch_calls(device)}.items():
            times = _time(fn, calls, repeats, torch.cuda.synchronize)
            rows.append({"mode": mode, "case": name, "us_per_call": statistics.median(times),
                         "us_min": min(times), "us_max": max(times),
                         "launches_per_call": 1 if name in LAUNCH_CASES else None})
            if profiles is not None:
                profiles[name] = profile_text(fn, calls, torch.cuda.synchronize)
        return rows
    with stubbed_aot() as launches:
        plans = aot._device_images(torch.device("cpu")).plans
        for name, fn in _calls(torch.device("cpu")).items():
            fn()
            before = launches[0]
            fn()
            per_call = launches[0] - before
            planned = len(plans)
            times = _time(fn, calls, repeats, lambda: None, clock=time.process_time)
            rows.append({"mode": mode, "case": name, "us_per_call": statistics.median(times),
                         "us_min": min(times), "us_max": max(times), "launches_per_call": per_call,
                         "plans_per_call": (len(plans) - planned) / (calls * repeats + max(3, calls // 10))})
            if profiles is not None:
                profiles[name] = profile_text(fn, calls, lambda: None)
    return rows
