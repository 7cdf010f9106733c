"""GPU benchmark: forward and forward+backward TFLOPs of this package's ``aot`` and ``triton``
backends against every SDPA backend PyTorch has (flash, efficient, cudnn) and upstream
flash-attn's ``flash_attn_2_cuda`` when it imports.

Shapes follow the usual FlashAttention benchmark: ``batch * seqlen = total_tokens`` (16k) and
``heads * headdim = hidden`` (2048), so every sequence length does the same number of tokens.
Timing: CUDA events around each call after warm-up, the median of the repeats. TFLOPs use
:func:`flash_attn.bench.common.attention_flops` (``4*b*h*sq*sk*d``, halved for causal;
x3.5 for forward+backward).

Rows are written as they are measured (``bench-gpu.jsonl`` and ``bench-gpu.csv``), so a run cut
short keeps what it measured. A row of this package's backends that crashed, or that another
backend ran (:func:`flash_attn.dispatch.last_backend`), is an ``error`` and makes the command exit
1; so is one whose backend is unavailable under ``FLASH_ATTN_STRICT_BACKEND=1``. Other
implementations' exceptions are ``unsupported`` (their kernels reject some shapes).

Beyond FlashAttention-2 (on by default, issue 44's targets): head dim 512 and 192/128 (v's own head
dim) training against cuDNN and the others where they run the shape, and attention sinks
(``learnable_sink``) at d64/d128 against the same call without them (the table's own d64/d128
rows: the same shapes); FLOPs count q.k and p.v at their own widths.

Decode (on by default): ``flash_attn_with_kvcache`` with one new query token over a full KV cache
(batch 1-64, cache 4k-128k, 32 query / 8 KV heads, d=128, bf16) against SDPA on the same cache.
Decode is memory-bound, so its rows report GB/s (bytes of the K and V cache read, plus q read and
out written, over the time) and that as a percentage of the memory bandwidth measured in the same
process by a large device-to-device copy (bytes read + written over its time) and of the nominal
figure of the device (:data:`NOMINAL_BANDWIDTH`). A size that does not fit in the free GPU memory
is a ``skipped`` row, not an error.

The timer, the device and the free-memory probe are parameters, so the plumbing runs on a CPU in
the tests.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Optional

from flash_attn.bench import common
from flash_attn.bench.common import attention_flops, summarize

DEFAULT_IMPLS = ("flash_attn[aot]", "flash_attn[triton]", "sdpa[flash]", "sdpa[efficient]", "sdpa[cudnn]", "upstream")
Timer = Callable[[Callable[[], None], int, int], list]

# The rows beyond FlashAttention-2: head dims (v's where it differs) and attention sinks
BEYOND_CASES = ({"headdim": 512}, {"headdim": 192, "headdim_v": 128}, {"headdim": 64, "sinks": True},
                {"headdim": 128, "sinks": True})
DECODE_BATCHES = (1, 4, 16, 64)
DECODE_CACHELENS = (4096, 16384, 65536, 131072)
# a Llama-3-8B-like layer: 32 query heads sharing 8 KV heads
DECODE_SHAPE = {"heads": 32, "kv_heads": 8, "headdim": 128, "dtype": "bf16"}
# a decode call captured in a CUDA graph is timed over this many back-to-back replays: one replay's
# host cost (a few us) then overlaps the GPU's work, as in a server's decode loop
GRAPH_REPLAYS = 20
DECODE_PASSES = ("decode", "decode_graph")  # the rows of an eager decode call, and of one in a CUDA graph
COPY_BYTES = 2 << 30  # the bandwidth probe copies 2 GiB (4 GiB moved): long enough to hide launch cost
# left free beside a decode case's tensors: split-KV partial results, SDPA's workspace, allocator rounding
DECODE_HEADROOM = 1 << 30
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
# Nominal memory bandwidth (bytes/s) from NVIDIA's data sheets, by device name: the first
# (substring, label) that the name contains wins, so the H100 variants come before plain "H100".
NOMINAL_BANDWIDTH = (
    ("H200", "H200", 4.8e12),
    ("H100 NVL", "H100 NVL", 3.9e12),
    ("H100 PCIe", "H100 PCIe", 2.0e12),
    ("H100", "H100 SXM", 3.35e12),
)


@dataclass
class Implementation:
    name: str
    # why it cannot run on the device at all (None: it can); checked once
    unavailable: Callable[[object], Optional[str]]
    # run(q, k, v, dout, causal, sinks): forward, and backward when dout is given; sinks: fp32 (heads,)
    # attention sinks or None (raises NotImplementedError where the implementation has none)
    run: Callable
    context: Callable[[], ContextManager] = contextlib.nullcontext
    backend: Optional[str] = None  # this package's backend that must run the calls (None: not ours)
    # decode(q, k_cache, v_cache) -> out: one query token over the whole cache (None: no such call)
    decode: Optional[Callable] = None


@contextlib.contextmanager
def _backend_env(name: str):
    old = os.environ.get("FLASH_ATTN_BACKEND")
    os.environ["FLASH_ATTN_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLASH_ATTN_BACKEND", None)
        else:
            os.environ["FLASH_ATTN_BACKEND"] = old


def _autograd_run(forward: Callable) -> Callable:
    """``run`` of :class:`Implementation` from ``forward(q, k, v, causal, sinks)``."""
    def run(q, k, v, dout, causal, sinks=None):
        out = forward(q, k, v, causal, sinks)
        if dout is not None:
            out.backward(dout)
            q.grad = k.grad = v.grad = None
            if sinks is not None:
                sinks.grad = None
    return run


def _ours(backend: str) -> Implementation:
    from flash_attn import dispatch, flash_attn_func, flash_attn_with_kvcache  # noqa: PLC0415

    return Implementation(
        f"flash_attn[{backend}]",
        lambda device: dispatch.unavailable_reason(backend, device),
        _autograd_run(lambda q, k, v, causal, sinks: flash_attn_func(q, k, v, causal=causal, learnable_sink=sinks)),
        lambda: _backend_env(backend),
        backend,
        decode=lambda q, k_cache, v_cache: flash_attn_with_kvcache(q, k_cache, v_cache),
    )


def sdpa_forward(q, k, v, causal: bool, sinks=None):
    """PyTorch's SDPA on our ``(batch, seqlen, heads, headdim)`` layout (whichever SDPA backend the
    caller's ``sdpa_kernel`` context allows); it has no attention sinks."""
    import torch.nn.functional as F  # noqa: PLC0415

    if sinks is not None:
        raise NotImplementedError("SDPA has no attention sinks")
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)  # back to (batch, seqlen, heads, headdim), like dout


def _sdpa(label: str, backend_name: str) -> Implementation:
    def unavailable(device):
        try:
            from torch.nn.attention import SDPBackend  # noqa: PLC0415
        except ImportError as exc:
            return f"torch.nn.attention is missing ({exc})"
        if not hasattr(SDPBackend, backend_name):
            return f"this PyTorch has no SDPA backend {backend_name}"
        return None

    def context():
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        return sdpa_kernel(getattr(SDPBackend, backend_name))

    return Implementation(f"sdpa[{label}]", unavailable, _autograd_run(sdpa_forward), context, decode=sdpa_decode)


def sdpa_decode(q, k_cache, v_cache):
    """One query token with grouped KV heads through SDPA without copying the cache: the query
    heads that share a KV head become rows of one query block (as FA2's decode does), which every
    SDPA backend takes, non-causal, since the one token sees the whole cache. ``enable_gqa`` would
    say the same but not every backend takes it, and repeating K/V would read 4x the bytes."""
    import torch.nn.functional as F  # noqa: PLC0415

    batch, _, heads, headdim = q.shape
    kv_heads = k_cache.shape[2]
    # query head h uses KV head h // (heads / kv_heads): group the query heads by KV head
    q_rows = q.reshape(batch, kv_heads, heads // kv_heads, headdim)
    out = F.scaled_dot_product_attention(q_rows, k_cache.transpose(1, 2), v_cache.transpose(1, 2))
    return out.reshape(batch, 1, heads, headdim)


def _upstream() -> Implementation:
    """Upstream flash-attn 2.6+'s extension, called directly (its Python package is also named
    ``flash_attn``, so only the extension can live next to this package)."""
    state: dict = {}

    def unavailable(device):
        if getattr(device, "type", device) != "cuda":
            return "upstream flash-attn runs on CUDA only"
        try:
            import torch  # noqa: F401, PLC0415

            import flash_attn_2_cuda  # noqa: PLC0415
        except Exception as exc:  # noqa: BLE001  (undefined symbols and the like)
            return f"flash_attn_2_cuda does not import ({type(exc).__name__}: {exc})"
        state["ext"] = flash_attn_2_cuda
        return None

    def run(q, k, v, dout, causal, sinks=None):
        if sinks is not None:
            raise NotImplementedError("flash-attn 2 has no attention sinks")
        ext = state["ext"]
        scale = q.shape[-1] ** -0.5
        out, lse, _, rng = ext.fwd(q, k, v, None, None, 0.0, scale, causal, -1, -1, 0.0, False, None)[:4]
        if dout is not None:
            ext.bwd(dout, q, k, v, out, lse, None, None, None, None, 0.0, scale, causal, -1, -1, 0.0, False, None, rng)

    def decode(q, k_cache, v_cache):
        # flash-attn 2.6+: no new k/v, seqlens_k None (the whole cache), no rotary/paging/alibi
        ext = state["ext"]
        return ext.fwd_kvcache(q, k_cache, v_cache, None, None, None, None, None, None, None, None, None, None,
                               q.shape[-1] ** -0.5, False, -1, -1, 0.0, True, 0)[0]

    return Implementation("upstream", unavailable, run, decode=decode)


def implementations(names) -> list[Implementation]:
    makers = {
        "flash_attn[aot]": lambda: _ours("aot"),
        "flash_attn[triton]": lambda: _ours("triton"),
        "flash_attn[reference]": lambda: _ours("reference"),
        "sdpa[flash]": lambda: _sdpa("flash", "FLASH_ATTENTION"),
        "sdpa[efficient]": lambda: _sdpa("efficient", "EFFICIENT_ATTENTION"),
        "sdpa[cudnn]": lambda: _sdpa("cudnn", "CUDNN_ATTENTION"),
        "sdpa[math]": lambda: _sdpa("math", "MATH"),
        "upstream": _upstream,
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {', '.join(makers)}")
    return [makers[n]() for n in names]


def cuda_event_timer(fn: Callable[[], None], warmup: int, repeats: int) -> list:
    import torch  # noqa: PLC0415

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def wall_timer(fn: Callable[[], None], warmup: int, repeats: int) -> list:
    import time  # noqa: PLC0415

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def cases(config: dict) -> list[dict]:
    """The training rows: every head dim of the table, then those beyond FlashAttention-2
    (``config["beyond"]``: :data:`BEYOND_CASES`), at every dtype, mask, length and pass."""
    shapes = [{"headdim": d} for d in config["headdims"]] + list(config.get("beyond") or ())
    out = []
    for dtype in config["dtypes"]:
        for shape in shapes:
            headdim = shape["headdim"]
            for causal in config["causal"]:
                for seqlen in config["seqlens"]:
                    for backward in config["backward"]:
                        out.append({
                            **shape, "dtype": dtype, "headdim": headdim, "causal": causal, "seqlen": seqlen,
                            "batch": max(1, config["total_tokens"] // seqlen), "heads": max(1, config["hidden"] // headdim),
                            "pass": "fwd_bwd" if backward else "fwd",
                        })
    return out


def decode_cases(config: dict) -> list[dict]:
    """One row per (batch, cache length) of ``config["decode"]``; the cache is full, one new token."""
    d = config["decode"]
    return [{"dtype": d["dtype"], "headdim": d["headdim"], "causal": False, "pass": "decode", "seqlen": 1,
             "cachelen": cachelen, "batch": batch, "heads": d["heads"], "kv_heads": d["kv_heads"]}
            for batch in d["batches"] for cachelen in d["cachelens"]]


def decode_bytes(case: dict) -> int:
    """Bytes a decode call must move at least: the K and V cache read once, q read, out written."""
    elt = DTYPE_BYTES[case["dtype"]]
    cache = 2 * case["batch"] * case["cachelen"] * case["kv_heads"] * case["headdim"] * elt
    q_and_out = 2 * case["batch"] * case["seqlen"] * case["heads"] * case["headdim"] * elt
    return cache + q_and_out


def skip_reason(needed: int, free: Optional[int]) -> Optional[str]:
    """Why a case that allocates ``needed`` bytes is skipped (None: it runs): it needs more than
    the free memory less :data:`DECODE_HEADROOM`. ``free`` None (unknown): never skipped."""
    if free is None or needed + DECODE_HEADROOM <= free:
        return None
    return (f"skipped: would need {(needed + DECODE_HEADROOM) / 2**30:.1f} GiB "
            f"({needed / 2**30:.1f} GiB of tensors + {DECODE_HEADROOM / 2**30:.0f} GiB headroom), "
            f"the GPU has {free / 2**30:.1f} GiB free")


def nominal_bandwidth(device_name: Optional[str]) -> Optional[tuple[str, float]]:
    """``(label, bytes/s)`` of :data:`NOMINAL_BANDWIDTH` for a device name, None if not listed."""
    for needle, label, value in NOMINAL_BANDWIDTH:
        if device_name and needle in device_name:
            return label, value
    return None


def run(config: dict, device=None, timer: Optional[Timer] = None, progress=lambda s: None,
        on_row: Callable[[dict], None] = lambda row: None,
        free_memory: Optional[Callable[[], Optional[int]]] = None,
        capture: Optional[Callable[[Callable[[], None]], Callable[[], None]]] = None) -> list[dict]:
    """Measure every case with every implementation, then (``config["decode"]``) the memory
    bandwidth and the decode cases; ``on_row(row)`` as each row is done. ``free_memory()``: free
    bytes on the device (default: CUDA's count, or the host's available memory on a CPU).
    ``capture(call)``: ``call`` captured, as a callable that replays it (default: a CUDA graph;
    for the ``decode_graph`` rows of ``config["decode"]["graphs"]``)."""
    import torch  # noqa: PLC0415

    device = torch.device(device or "cuda")
    timer = timer or (cuda_event_timer if device.type == "cuda" else wall_timer)
    impls = implementations(config["impls"])
    reasons = {}
    for impl in impls:
        try:
            reasons[impl.name] = impl.unavailable(device)
        except Exception as exc:  # noqa: BLE001
            reasons[impl.name] = f"{type(exc).__name__}: {exc}"
    rows = []

    def emit(row):
        progress(_progress_line(row))
        on_row(row)
        rows.append(row)

    _run_training(config, device, timer, impls, reasons, emit)
    if config.get("decode"):
        _run_decode(config, device, timer, impls, reasons, emit, free_memory or _free_memory_probe(device),
                    capture or (cuda_graph if device.type == "cuda" else None))
    return rows


def _run_training(config, device, timer, impls, reasons, emit) -> None:
    import torch  # noqa: PLC0415

    for case in cases(config):
        dtype = _torch_dtype(case["dtype"])
        backward = case["pass"] == "fwd_bwd"
        shape = (case["batch"], case["seqlen"], case["heads"], case["headdim"])
        shape_v = (*shape[:-1], case.get("headdim_v", case["headdim"]))
        g = torch.Generator(device=device).manual_seed(0)
        q, k = (torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_(backward) for _ in range(2))
        v = torch.randn(shape_v, device=device, dtype=dtype, generator=g).requires_grad_(backward)
        dout = torch.randn(shape_v, device=device, dtype=dtype, generator=g) if backward else None
        sinks = None
        if case.get("sinks"):
            sinks = torch.randn(case["heads"], device=device, generator=g).requires_grad_(backward)
        # q.k at q's head dim and p.v at v's: the mean of the two in the 4*b*h*sq*sk*d count
        flops = attention_flops(case["batch"], case["heads"], case["seqlen"], case["seqlen"],
                                (case["headdim"] + shape_v[-1]) / 2, case["causal"], backward)
        for impl in impls:
            row = dict(case, impl=impl.name)
            _measure(row, impl, reasons[impl.name], lambda: impl.run(q, k, v, dout, case["causal"], sinks), config,
                     timer, device)
            if "time_ms" in row:
                row["tflops"] = flops / (row["time_ms"] * 1e-3) / 1e12
            emit(row)


def _run_decode(config, device, timer, impls, reasons, emit, free_memory, capture) -> None:
    import torch  # noqa: PLC0415

    bandwidth = measure_bandwidth(config, device, timer, free_memory)
    emit(bandwidth)
    measured = bandwidth.get("gbps") if bandwidth["status"] == "ok" else None
    nominal = bandwidth.get("nominal_gbps")
    d = config["decode"]
    for case in decode_cases(config):
        needed = decode_bytes(case)
        skipped = skip_reason(needed, free_memory())
        tensors = ()
        if skipped is None:
            dtype = _torch_dtype(case["dtype"])
            g = torch.Generator(device=device).manual_seed(0)
            cache_shape = (case["batch"], case["cachelen"], case["kv_heads"], case["headdim"])
            q = torch.randn((case["batch"], 1, case["heads"], case["headdim"]), device=device, dtype=dtype, generator=g)
            tensors = (q, *(torch.randn(cache_shape, device=device, dtype=dtype, generator=g) for _ in range(2)))
        for impl, graphed in itertools.product(impls, (False, True) if d.get("graphs") else (False,)):
            row = dict(case, impl=impl.name, gbytes=needed / 1e9, **({"pass": "decode_graph"} if graphed else {}))
            if skipped is not None:
                row.update(status="skipped", note=skipped)
            elif impl.decode is None:
                row.update(status="unsupported", note=f"{impl.name} has no decode call here")
            elif graphed and capture is None:
                row.update(status="unsupported", note="CUDA graphs need a CUDA device")
            elif graphed:
                call = _Replayed(lambda: impl.decode(*tensors), capture)
                _measure(row, impl, reasons[impl.name], call, config, call.per_replay(timer), device)
            else:
                _measure(row, impl, reasons[impl.name], lambda: impl.decode(*tensors), config, timer, device)
            if "time_ms" in row:
                row["gbps"] = needed / (row["time_ms"] * 1e-3) / 1e9
                row["bw_pct"] = 100 * row["gbps"] / measured if measured else None
                row["nominal_pct"] = 100 * row["gbps"] / nominal if nominal else None
            emit(row)
        del tensors  # before the next case allocates its cache (and counts free memory)
        _empty_cache(device)


def cuda_graph(call: Callable[[], None]) -> Callable[[], None]:
    """``call`` captured in a CUDA graph (after a warm-up call on a side stream, which compiles
    and allocates); returns the graph's ``replay``."""
    import torch  # noqa: PLC0415

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


class _Replayed:
    """A decode call as a server runs it: captured once (on the first call, inside the
    implementation's context), then :data:`GRAPH_REPLAYS` replays back to back per call;
    :meth:`per_replay` turns a timer's per-call times into per-replay ones."""

    def __init__(self, call: Callable[[], None], capture):
        self.call, self.capture, self.replay = call, capture, None

    def __call__(self) -> None:
        if self.replay is None:
            self.replay = self.capture(self.call)
        for _ in range(GRAPH_REPLAYS):
            self.replay()

    def per_replay(self, timer: Timer) -> Timer:
        def timed(fn, warmup, repeats):
            self()  # the capture, untimed whatever the warm-up count
            return [t / GRAPH_REPLAYS for t in timer(fn, warmup, repeats)]
        return timed


def measure_bandwidth(config: dict, device, timer: Timer, free_memory) -> dict:
    """The device's memory bandwidth as a copy sees it: ``copy_bytes`` read plus as many
    written, over the median time of ``dst.copy_(src)``; with the nominal figure where known."""
    import torch  # noqa: PLC0415

    size = config["decode"].get("copy_bytes", COPY_BYTES)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    row = {"pass": "copy", "impl": "device copy", "gbytes": 2 * size / 1e9, "device": name}
    nominal = nominal_bandwidth(name)
    if nominal:
        row.update(nominal_label=nominal[0], nominal_gbps=nominal[1] / 1e9)
    skipped = skip_reason(2 * size, free_memory())
    if skipped:
        row.update(status="skipped", note=skipped)
        return row
    try:
        src = torch.ones(size, dtype=torch.uint8, device=device)  # written once, so no page is fresh when timed
        dst = torch.empty_like(src)
        times = timer(lambda: dst.copy_(src), config["warmup"], config["repeats"])
        row.update(summarize(times), status="ok")
        row["gbps"] = 2 * size / (row["time_ms"] * 1e-3) / 1e9
        if nominal:
            row["nominal_pct"] = 100 * row["gbps"] / row["nominal_gbps"]
    except Exception as exc:  # noqa: BLE001  (without it no decode row has a % of the bandwidth)
        row.update(status="error", note=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
    finally:
        src = dst = None
        _empty_cache(device)
    return row


def _measure(row: dict, impl: Implementation, reason: Optional[str], call, config, timer, device) -> None:
    """Time ``call`` under ``impl``'s context into ``row`` (status, times or note)."""
    import torch  # noqa: PLC0415

    from flash_attn import dispatch  # noqa: PLC0415

    if reason is not None:
        # under strict mode this package's backends must run: unavailable is an error
        ours_required = impl.backend is not None and dispatch.strict()
        row.update(status="error" if ours_required else "unavailable", note=reason)
        return
    try:
        with impl.context():
            times = timer(call, config["warmup"], config["repeats"])
        row.update(summarize(times), status="ok")
        elsewhere = _ran_elsewhere(impl, device.type)
        if elsewhere:
            row.update(status="error", note=elsewhere)
    except Exception as exc:  # noqa: BLE001  (an SDPA backend that rejects a shape, OOM...)
        note = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
        row.update(status="error" if impl.backend is not None else "unsupported", note=note)
        row.pop("time_ms", None)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _torch_dtype(name: str):
    import torch  # noqa: PLC0415

    return getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[name])


def _empty_cache(device) -> None:
    import torch  # noqa: PLC0415

    if device.type == "cuda":
        torch.cuda.empty_cache()


def _free_memory_probe(device) -> Callable[[], Optional[int]]:
    import torch  # noqa: PLC0415

    if device.type != "cuda":
        return common.available_memory_bytes

    def free() -> int:
        torch.cuda.empty_cache()  # blocks the caching allocator holds count as free
        return torch.cuda.mem_get_info(device)[0]
    return free


def _ran_elsewhere(impl: Implementation, device_type: str) -> Optional[str]:
    """Why a row of this package's ``impl`` does not count: its last call ran on another backend.
    Checked on GPUs only (on the CPU a plain dense call skips the dispatcher, which then does not
    record it)."""
    from flash_attn import dispatch  # noqa: PLC0415

    if impl.backend is None or device_type == "cpu":
        return None
    ran = dispatch.last_backend()
    return None if ran == impl.backend else f"the {ran} backend ran it, not {impl.backend}"


def _progress_line(row: dict) -> str:
    if row["pass"] == "copy":
        nominal = ""
        if row.get("nominal_pct"):
            nominal = f" ({row['nominal_pct']:.0f} % of the {row['nominal_label']}'s nominal)"
        if row.get("status") != "ok":
            return f"  memory bandwidth (device copy): {row['status']}: {row.get('note', '')}"
        return f"  memory bandwidth (device copy of {row['gbytes'] / 2:.1f} GB): {row['gbps']:.0f} GB/s{nominal}"
    if row["pass"] in DECODE_PASSES:
        call = "graph " if row["pass"] == "decode_graph" else "decode"
        head = f"  {row['dtype']} {call} b={row['batch']:<3} cache={row['cachelen']:<7} {row['impl']:<20}"
        if row.get("status") != "ok":
            return f"{head} {row['status']}: {row.get('note', '')}"
        pct = f" ({row['bw_pct']:.0f} % of measured)" if row.get("bw_pct") is not None else ""
        return f"{head} {row['time_ms']:9.3f} ms {row['gbps']:7.0f} GB/s{pct}"
    dims = f"{row['headdim']}/{row['headdim_v']}" if row.get("headdim_v") else f"{row['headdim']}"
    dims += "+sinks" if row.get("sinks") else ""
    head = (f"  {row['dtype']} d={dims:<3} {'causal' if row['causal'] else 'full':<6} {row['pass']:<7} "
            f"s={row['seqlen']:<6} {row['impl']:<20}")
    if row.get("status") != "ok":
        return f"{head} {row['status']}: {row.get('note', '')}"
    return f"{head} {row['time_ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s"


def plot(rows: list[dict], out_dir: Path, stem: str, title: str) -> list[Path]:
    """One PNG per dtype: rows of panels per head dim, columns per (pass, causal)."""
    from flash_attn.bench.common import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return []
    rows = [r for r in rows if r["pass"] in ("fwd", "fwd_bwd")]  # decode and the copy are in GB/s, not plotted

    def dims(r):  # a panel per head dim, v's too where it differs
        return f"{r['headdim']}/{r['headdim_v']}" if r.get("headdim_v") else str(r["headdim"])

    def label(r):  # a line per implementation, with sinks apart
        return r["impl"] + (" +sinks" if r.get("sinks") else "")

    written = []
    for dtype in sorted({r["dtype"] for r in rows}):
        subset = [r for r in rows if r["dtype"] == dtype]
        headdims = sorted({dims(r) for r in subset}, key=lambda text: [int(x) for x in text.split("/")])
        columns = sorted({(r["pass"], r["causal"]) for r in subset})
        fig, axes = plt.subplots(len(headdims), len(columns), figsize=(3.6 * len(columns), 2.8 * len(headdims)),
                                 squeeze=False, sharex=True)
        for i, headdim in enumerate(headdims):
            for j, (pass_, causal) in enumerate(columns):
                ax = axes[i][j]
                for name in dict.fromkeys(label(r) for r in subset):
                    pts = [r for r in subset if label(r) == name and dims(r) == headdim and r["pass"] == pass_
                           and r["causal"] == causal and r.get("status") == "ok"]
                    if pts:
                        ax.plot([r["seqlen"] for r in pts], [r["tflops"] for r in pts], marker="o", label=name)
                ax.set_xscale("log", base=2)
                ax.set_title(f"d={headdim} {pass_} {'causal' if causal else 'non-causal'}", fontsize=9)
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=7)
        for ax in axes[-1]:
            ax.set_xlabel("sequence length")
        fig.suptitle(f"{title} ({dtype})", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{stem}-{dtype}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


COLUMNS = ("impl", "dtype", "headdim", "headdim_v", "sinks", "causal", "pass", "seqlen", "cachelen", "batch", "heads", "kv_heads", "time_ms",
           "time_ms_min", "repeats", "tflops", "gbytes", "gbps", "bw_pct", "nominal_pct", "status", "note")


class RowWriter:
    """Rows written as they come: ``<stem>.jsonl`` (the meta line first) and ``<stem>.csv``,
    flushed after each row."""

    def __init__(self, out_dir: Path, stem: str, meta: dict):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {"jsonl": out_dir / f"{stem}.jsonl", "csv": out_dir / f"{stem}.csv"}
        self._jsonl = self.paths["jsonl"].open("w")
        self._csv_file = self.paths["csv"].open("w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=list(COLUMNS), extrasaction="ignore")
        self._csv.writeheader()
        self._write_json({"meta": meta})

    def _write_json(self, obj: dict) -> None:
        self._jsonl.write(json.dumps(obj, default=str) + "\n")
        self._jsonl.flush()

    def __call__(self, row: dict) -> None:
        self._write_json(row)
        self._csv.writerow(row)
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


def config_from_args(args, default_seqlens=()) -> dict:
    """The run's configuration from the command line (``default_seqlens`` unless ``--seqlens``)."""
    config = {
        "seqlens": args.seqlens or list(default_seqlens),
        "headdims": [64] if args.quick else args.headdims, "dtypes": ["bf16"] if args.quick else args.dtypes or ["fp16", "bf16"],
        "causal": [False, True], "backward": [False, True], "impls": args.impls or list(DEFAULT_IMPLS),
        "total_tokens": args.total_tokens, "hidden": args.hidden,
        "repeats": args.repeats or (3 if args.quick else 30), "warmup": args.warmup or (1 if args.quick else 5),
        "decode": None, "beyond": list(BEYOND_CASES) if args.beyond and not args.quick else [],
    }
    if args.decode:
        config["decode"] = dict(DECODE_SHAPE, copy_bytes=COPY_BYTES,
                                batches=args.decode_batches or ([1, 4] if args.quick else list(DECODE_BATCHES)),
                                cachelens=args.decode_cachelens or ([4096] if args.quick else list(DECODE_CACHELENS)),
                                graphs=args.decode_graphs)
    return config


def main(args, default_seqlens=(), device=None, timer: Optional[Timer] = None,
         free_memory: Optional[Callable[[], Optional[int]]] = None) -> int:
    """``python -m flash_attn bench gpu``: 0 when every row of this package's backends ran (on
    them), 1 when one is an ``error``, 2 without a CUDA device (``device``/``timer``/
    ``free_memory``: for tests)."""
    import torch  # noqa: PLC0415

    if device is None and not torch.cuda.is_available():
        print("gpu mode needs a CUDA device (this PyTorch sees none); `python -m flash_attn bench cpu` runs here",
              file=sys.stderr)
        return 2
    config = config_from_args(args, default_seqlens)
    meta = {"mode": "gpu", "config": config, "machine": common.machine()}
    writer = RowWriter(args.out, "bench-gpu", meta)
    try:
        rows = run(config, device=device, timer=timer, progress=lambda line: print(line, file=sys.stderr, flush=True),
                   on_row=writer, free_memory=free_memory)
    finally:
        writer.close()
    paths = {"jsonl": writer.paths["jsonl"], **common.write_results(args.out, "bench-gpu", meta, rows, COLUMNS)}
    if not args.no_plot:
        pngs = plot(rows, args.out, "bench-gpu", f"{meta['machine'].get('gpu')}, torch {meta['machine']['torch']}")
        paths["png"] = ", ".join(map(str, pngs)) or "(not written: matplotlib is not installed)"
    ok = [r for r in rows if r.get("status") == "ok" and r["pass"] in ("fwd", "fwd_bwd")]
    print(common.markdown_table(ok, [("dtype", "dtype"), ("headdim", "d"), ("headdim_v", "d_v"), ("sinks", "sinks"),
                                     ("causal", "causal"), ("pass", "pass"),
                                     ("seqlen", "seqlen"), ("impl", "implementation"), ("time_ms", "ms"),
                                     ("tflops", "TFLOP/s")]))
    if config["decode"]:
        print("\n" + decode_markdown(rows, config["decode"]))
    print("\n" + "\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    errors = [r for r in rows if r.get("status") == "error"]
    for r in errors:
        print(f"error: {_progress_line(r).strip()}", file=sys.stderr)
    return 1 if errors else 0


def decode_markdown(rows: list[dict], decode: dict) -> str:
    """The decode section: the measured bandwidth (and the nominal one), then GB/s per row."""
    copy = next((r for r in rows if r["pass"] == "copy"), {})
    title = (f"### Decode: flash_attn_with_kvcache, 1 new token, {decode['heads']} query / "
             f"{decode['kv_heads']} KV heads, d={decode['headdim']}, {decode['dtype']}")
    if copy.get("status") == "ok":
        bandwidth = f"Memory bandwidth measured by a device-to-device copy in this run: {copy['gbps']:.0f} GB/s"
    else:
        bandwidth = f"Memory bandwidth: not measured ({copy.get('status')}: {copy.get('note', '')})"
    if copy.get("nominal_gbps"):
        bandwidth += f"; nominal {copy['nominal_gbps']:.0f} GB/s ({copy['nominal_label']}, {copy['device']})"
    shown = [r for r in rows if r["pass"] in DECODE_PASSES and r.get("status") in ("ok", "skipped")]
    table = common.markdown_table(shown, [("batch", "batch"), ("cachelen", "cache"), ("impl", "implementation"),
                                          ("pass", "call"),
                                          ("gbytes", "GB moved"), ("time_ms", "ms"), ("gbps", "GB/s"),
                                          ("bw_pct", "% of measured"), ("nominal_pct", "% of nominal"),
                                          ("note", "note")])
    return f"{title}\n\n{bandwidth}\n\n{table}"
