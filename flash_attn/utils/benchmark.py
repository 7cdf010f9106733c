"""Timing, profiling and memory helpers with upstream's names (``flash_attn.utils.benchmark``).

The timers are ``torch.utils.benchmark.Timer`` objects; every ``benchmark_*`` timing function
returns ``(timer, measurement)`` (``benchmark_fwd_bwd`` and ``benchmark_all`` return a tuple of
those pairs), ``pytorch_profiler`` returns ``None`` and ``benchmark_memory`` returns the peak
memory in upstream's unit, MiB / 1000 (printed as "GB").

Device: upstream assumes CUDA. Here the device is the first tensor found in ``inputs`` /
``kwinputs`` (looking inside lists, tuples and dicts); with no tensor argument it is the current
CUDA device where CUDA is available and the CPU otherwise. That device picks the autocast device
type (``amp=True``), the profiler's activities and the memory counters, so each helper also works
on a machine without CUDA. ``Timer`` itself synchronizes the accelerator around each measurement.

With ``verbose=True`` (the default, as upstream) the results are printed to stdout: that is what
these helpers are for; pass ``verbose=False`` to keep them silent.
"""

from __future__ import annotations

import torch
from torch.utils import benchmark

__all__ = [
    "benchmark_forward",
    "benchmark_backward",
    "benchmark_combined",
    "benchmark_fwd_bwd",
    "benchmark_all",
    "pytorch_profiler",
    "benchmark_memory",
]

_UNIT = 2**20 * 1000  # upstream's "GB": MiB / 1000
_PROFILER_WARMUP = 30  # upstream's warm-up count before the profiled call


# --- helpers -------------------------------------------------------------------------------------


def _find_tensor(value, depth=0):
    if isinstance(value, torch.Tensor):
        return value
    if depth < 4:
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        for item in items:
            found = _find_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def _device_of(inputs, kwinputs) -> torch.device:
    """The device a benchmark runs on: the first tensor argument's, else CUDA if present, else CPU."""
    tensor = _find_tensor((inputs, kwinputs))
    if tensor is not None:
        return tensor.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _autocast(device: torch.device, amp: bool, amp_dtype: torch.dtype):
    # "meta" and similar have no autocast; amp is off for them anyway unless asked for.
    return torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=amp)


def _check_common(fn, repeats=None):
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1):
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")


def _output_for_backward(y, caller: str) -> torch.Tensor:
    """The tensor a backward pass starts from: ``fn``'s output, or its first element if a tuple
    or list; with a clear error where upstream would fail deep inside autograd."""
    if isinstance(y, (tuple, list)):
        if not y:
            raise TypeError(f"{caller}: fn returned an empty {type(y).__name__}; the backward pass "
                            "needs a tensor output (or a tuple whose first element is one)")
        y = y[0]
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{caller}: fn returned {type(y).__name__}; the backward pass needs a tensor "
                        "output (or a tuple whose first element is one)")
    if not y.requires_grad:
        raise RuntimeError(f"{caller}: fn's output does not require grad, so there is no backward pass "
                           "to time: give fn at least one input with requires_grad=True (or parameters "
                           "that require grad), and do not run it under torch.no_grad()/inference_mode()")
    return y


def _forward_output(fn, inputs, kwinputs, device, amp, amp_dtype, caller: str) -> torch.Tensor:
    """One forward call under the benchmark's autocast, as the tensor a backward pass starts from."""
    with _autocast(device, amp, amp_dtype):
        return _output_for_backward(fn(*inputs, **kwinputs), caller)


def _grad_for(y: torch.Tensor, grad, caller: str) -> torch.Tensor:
    if grad is None:
        return torch.randn_like(y)
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{caller}: grad must be a tensor or None, got {type(grad).__name__}")
    if grad.shape != y.shape:
        raise RuntimeError(f"{caller}: grad shape {tuple(grad.shape)} does not match output shape "
                           f"{tuple(y.shape)}")
    return grad


def _clear_grads(inputs) -> None:
    # .grad = None rather than zeroing it, so the timed pass does not include gradient accumulation.
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x.grad = None


def _time(stmt_fn, repeats: int, verbose: bool):
    timer = benchmark.Timer(stmt="run()", globals={"run": stmt_fn}, num_threads=torch.get_num_threads())
    measurement = timer.timeit(repeats)
    if verbose:
        print(measurement)
    return timer, measurement


# --- timing --------------------------------------------------------------------------------------


def benchmark_forward(
    fn, *inputs, repeats=10, desc="", verbose=True, amp=False, amp_dtype=torch.float16, **kwinputs
):
    """Time ``fn(*inputs, **kwinputs)`` with ``torch.utils.benchmark.Timer``.

    Args:
        fn: the callable to time; its output is discarded.
        inputs: positional arguments for ``fn``.
        repeats: how many calls the timed run makes (``Timer.timeit(repeats)``).
        desc: a label printed before the result.
        verbose: print the label and the ``Measurement``.
        amp: run ``fn`` under ``torch.autocast`` on the inputs' device (CPU included).
        amp_dtype: the autocast dtype.
        kwinputs: keyword arguments for ``fn``.

    Returns:
        ``(timer, measurement)``: the ``Timer`` and its ``Measurement`` (``.mean``, ``.median``,
        in seconds).
    """
    _check_common(fn, repeats)
    if verbose:
        print(desc, "- Forward pass")
    device = _device_of(inputs, kwinputs)

    def forward():
        with _autocast(device, amp, amp_dtype):
            fn(*inputs, **kwinputs)

    return _time(forward, repeats, verbose)


def benchmark_backward(
    fn,
    *inputs,
    grad=None,
    repeats=10,
    desc="",
    verbose=True,
    amp=False,
    amp_dtype=torch.float16,
    **kwinputs,
):
    """Time the backward pass of ``fn(*inputs, **kwinputs)`` alone.

    ``fn`` runs once (under autocast if ``amp``); each timed call clears the tensor inputs'
    ``.grad`` and runs ``y.backward(grad, retain_graph=True)``, so after it returns the inputs
    that require grad hold the gradients of the last call.

    Args:
        fn: the callable; its output (or the first element of a returned tuple or list) must be a
            tensor that requires grad, else ``TypeError`` / ``RuntimeError`` says so up front.
        inputs: positional arguments for ``fn``.
        grad: the output gradient; ``None`` draws ``torch.randn_like(output)``. A tensor of another
            shape raises ``RuntimeError`` (as upstream, with both shapes in the message).
        repeats: how many backward passes the timed run makes.
        desc: a label printed before the result.
        verbose: print the label and the ``Measurement``.
        amp: run the forward pass under ``torch.autocast`` on the inputs' device.
        amp_dtype: the autocast dtype.
        kwinputs: keyword arguments for ``fn``.

    Returns:
        ``(timer, measurement)``.
    """
    _check_common(fn, repeats)
    if verbose:
        print(desc, "- Backward pass")
    device = _device_of(inputs, kwinputs)
    y = _forward_output(fn, inputs, kwinputs, device, amp, amp_dtype, "benchmark_backward")
    grad = _grad_for(y, grad, "benchmark_backward")

    def backward():
        _clear_grads(inputs)
        y.backward(grad, retain_graph=True)

    return _time(backward, repeats, verbose)


def benchmark_combined(
    fn,
    *inputs,
    grad=None,
    repeats=10,
    desc="",
    verbose=True,
    amp=False,
    amp_dtype=torch.float16,
    **kwinputs,
):
    """Time a forward pass followed by its backward pass, as one statement.

    Args:
        fn: the callable; its output (or a returned tuple's first element) must require grad.
        inputs: positional arguments for ``fn``.
        grad: the output gradient; ``None`` draws ``torch.randn_like(output)`` once, from an
            untimed first call; a tensor of another shape raises ``RuntimeError``.
        repeats: how many forward+backward passes the timed run makes.
        desc: a label printed before the result.
        verbose: print the label and the ``Measurement``.
        amp: run the forward pass under ``torch.autocast`` on the inputs' device (the backward
            pass runs outside it, as autocast asks).
        amp_dtype: the autocast dtype.
        kwinputs: keyword arguments for ``fn``.

    Returns:
        ``(timer, measurement)``.
    """
    _check_common(fn, repeats)
    if verbose:
        print(desc, "- Forward + Backward pass")
    device = _device_of(inputs, kwinputs)
    grad = _grad_for(_forward_output(fn, inputs, kwinputs, device, amp, amp_dtype, "benchmark_combined"), grad,
                     "benchmark_combined")

    def forward_backward():
        _clear_grads(inputs)
        _forward_output(fn, inputs, kwinputs, device, amp, amp_dtype, "benchmark_combined").backward(
            grad, retain_graph=True)

    return _time(forward_backward, repeats, verbose)


def benchmark_fwd_bwd(
    fn,
    *inputs,
    grad=None,
    repeats=10,
    desc="",
    verbose=True,
    amp=False,
    amp_dtype=torch.float16,
    **kwinputs,
):
    """``benchmark_forward`` then ``benchmark_backward`` with the same arguments.

    Args:
        fn: the callable (see ``benchmark_backward`` for what its output must be).
        inputs: positional arguments for ``fn``.
        grad: the output gradient for the backward pass (``None``: random).
        repeats: calls per timed run.
        desc: a label printed before each result.
        verbose: print the labels and the measurements.
        amp: autocast the forward passes on the inputs' device.
        amp_dtype: the autocast dtype.
        kwinputs: keyword arguments for ``fn``.

    Returns:
        ``((timer, measurement) forward, (timer, measurement) backward)``.
    """
    options = dict(repeats=repeats, desc=desc, verbose=verbose, amp=amp, amp_dtype=amp_dtype)
    return (
        benchmark_forward(fn, *inputs, **options, **kwinputs),
        benchmark_backward(fn, *inputs, grad=grad, **options, **kwinputs),
    )


def benchmark_all(
    fn,
    *inputs,
    grad=None,
    repeats=10,
    desc="",
    verbose=True,
    amp=False,
    amp_dtype=torch.float16,
    **kwinputs,
):
    """``benchmark_forward``, ``benchmark_backward`` and ``benchmark_combined`` with the same
    arguments.

    Args:
        fn: the callable (see ``benchmark_backward`` for what its output must be).
        inputs: positional arguments for ``fn``.
        grad: the output gradient for the backward passes (``None``: random).
        repeats: calls per timed run.
        desc: a label printed before each result.
        verbose: print the labels and the measurements.
        amp: autocast the forward passes on the inputs' device.
        amp_dtype: the autocast dtype.
        kwinputs: keyword arguments for ``fn``.

    Returns:
        three ``(timer, measurement)`` pairs: forward, backward, forward+backward.
    """
    options = dict(repeats=repeats, desc=desc, verbose=verbose, amp=amp, amp_dtype=amp_dtype)
    return (
        benchmark_forward(fn, *inputs, **options, **kwinputs),
        benchmark_backward(fn, *inputs, grad=grad, **options, **kwinputs),
        benchmark_combined(fn, *inputs, grad=grad, **options, **kwinputs),
    )


# --- profiling -----------------------------------------------------------------------------------


def _device_activity(device: torch.device):
    """The profiler activity that records work on ``device``; ``None`` for the host."""
    name = {"cuda": "CUDA", "xpu": "XPU", "mtia": "MTIA"}.get(device.type)
    return getattr(torch.profiler.ProfilerActivity, name, None) if name else None


def _profiler_activities(device: torch.device, cpu: bool) -> list:
    device_activity = _device_activity(device)
    if device_activity is None:
        return [torch.profiler.ProfilerActivity.CPU]  # the work runs on the host: only CPU activity sees it
    return ([torch.profiler.ProfilerActivity.CPU] if cpu else []) + [device_activity]


def pytorch_profiler(
    fn,
    *inputs,
    trace_filename=None,
    backward=False,
    amp=False,
    amp_dtype=torch.float16,
    cpu=False,
    verbose=True,
    **kwinputs,
):
    """Profile one call of ``fn`` (and its backward pass) with ``torch.profiler``, after 30
    untimed warm-up calls.

    On CUDA the profiler records the CUDA activity, plus the host's if ``cpu``. On the CPU (or a
    device the profiler has no activity for) it records the CPU activity whatever ``cpu`` says:
    that is where the work runs.

    Args:
        fn: the callable to profile.
        inputs: positional arguments for ``fn``.
        trace_filename: where to write a Chrome trace (``None``: no trace).
        backward: also profile ``output.backward(g)`` with a random ``g``; the output (or a
            returned tuple's first element) must require grad.
        amp: run the forward pass under ``torch.autocast`` on the inputs' device.
        amp_dtype: the autocast dtype.
        cpu: also record host activity when profiling an accelerator.
        verbose: print the profiler's table (top 50 rows).
        kwinputs: keyword arguments for ``fn``.

    Returns:
        ``None``, as upstream; the results are the printed table and the trace file.
    """
    _check_common(fn)
    device = _device_of(inputs, kwinputs)
    g = None
    if backward:
        g = torch.randn_like(_forward_output(fn, inputs, kwinputs, device, amp, amp_dtype, "pytorch_profiler"))

    def step():
        if backward:
            _clear_grads(inputs)
        with _autocast(device, amp, amp_dtype):
            out = fn(*inputs, **kwinputs)
        if backward:  # outside autocast
            _output_for_backward(out, "pytorch_profiler").backward(g, retain_graph=True)

    for _ in range(_PROFILER_WARMUP):
        step()
    with torch.profiler.profile(
        activities=_profiler_activities(device, cpu), record_shapes=True, with_stack=True
    ) as prof:
        step()
    if verbose:
        # On the host, with_stack=True also records every Python frame: sort by self time so the
        # operators come first rather than the frames in the order they were entered.
        sort_by = "self_cpu_time_total" if _device_activity(device) is None else None
        print(prof.key_averages().table(sort_by=sort_by, row_limit=50))
    if trace_filename is not None:
        prof.export_chrome_trace(trace_filename)


# --- memory --------------------------------------------------------------------------------------


def _cpu_peak_bytes(fn, inputs, kwinputs) -> int:
    """The peak of the tensor memory ``fn`` holds on the CPU, above what was live when it started:
    the running total of the profiler's allocation and free events, in the order they happened."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*inputs, **kwinputs)
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise NotImplementedError("benchmark_memory on the CPU needs the profiler's memory events, which "
                                  f"this torch ({torch.__version__}) does not expose")
    events = [e for e in results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def benchmark_memory(fn, *inputs, desc="", verbose=True, **kwinputs):
    """Peak memory of one call ``fn(*inputs, **kwinputs)``, in upstream's unit: MiB / 1000
    (printed as "GB").

    On CUDA (the inputs' device, or the current one) this is upstream's measure: the caching
    allocator's cache is emptied, its peak statistics reset, and after the call
    ``torch.cuda.max_memory_allocated(device)`` is reported: all the tensor memory live on that
    device at the peak, the inputs and anything else already allocated included.

    On the CPU, where torch keeps no allocator statistics, the call runs under
    ``torch.profiler`` with ``profile_memory=True`` and the result is the peak of the tensor
    memory allocated during the call and not yet freed, i.e. the growth above what was live
    when ``fn`` started (the inputs are not counted). It is not the process's RSS: memory held
    outside torch tensors (Python objects, libraries' own buffers) is not seen. Another device
    type raises ``NotImplementedError``.

    Args:
        fn: the callable to measure; its output is discarded.
        inputs: positional arguments for ``fn``.
        desc: a label for the printed line.
        verbose: print ``"{desc} max memory: {mem}GB"``.
        kwinputs: keyword arguments for ``fn``.

    Returns:
        the peak memory as a float, in MiB / 1000.
    """
    _check_common(fn)
    device = _device_of(inputs, kwinputs)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
        fn(*inputs, **kwinputs)
        torch.cuda.synchronize(device)
        mem = torch.cuda.max_memory_allocated(device) / _UNIT
        torch.cuda.empty_cache()
    elif device.type == "cpu":
        mem = _cpu_peak_bytes(fn, inputs, kwinputs) / _UNIT
    else:
        raise NotImplementedError(f"benchmark_memory measures CUDA and CPU memory; the inputs are on "
                                  f"{device}")
    if verbose:
        print(f"{desc} max memory: {mem}GB")
    return mem
