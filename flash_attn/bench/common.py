"""What every benchmark mode shares: the FLOP count, timing statistics, the machine description,
and writing results as JSON, CSV, a Markdown table and a PNG plot."""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, headdim: int, causal: bool,
                    backward: bool = False) -> float:
    """The standard count: ``4 * b * h * sq * sk * d`` for the forward (two matmuls, 2 flops per
    multiply-add), halved for causal; forward + backward counts 3.5x the forward (the backward
    does five matmuls to the forward's two)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * headdim
    if causal:
        flops /= 2
    return flops * 3.5 if backward else flops


def summarize(times_ms: Sequence[float]) -> dict:
    return {
        "time_ms": statistics.median(times_ms),
        "time_ms_min": min(times_ms),
        "time_ms_max": max(times_ms),
        "repeats": len(times_ms),
    }


SLEEP_MARGIN = 4  # the GPU's head start in cuda_gpu_span: this many times the host's time to queue the calls


def cuda_gpu_span(fn: Callable, calls: int, host_s: float) -> tuple[float, bool]:
    """``(milliseconds, covered)``: the GPU time of ``calls`` back-to-back calls of ``fn``, the
    GPU alone. A sleep kernel first holds the stream while the host queues every call, so the two
    events around the calls time their kernels back to back, without the host's gaps between
    them; ``covered``: the sleep outlasted the queuing (else the span includes host time).
    ``host_s``: about how long the host takes to queue the calls (it sizes the sleep)."""
    import torch  # noqa: PLC0415

    cycles = int(max(host_s, 1e-3) * SLEEP_MARGIN * 2e9)  # ~2 GHz: a few ms too long costs nothing
    before, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    before.record()
    torch.cuda._sleep(cycles)
    start.record()
    queued = time.perf_counter()
    for _ in range(calls):
        fn()
    end.record()
    queued = time.perf_counter() - queued
    end.synchronize()
    return start.elapsed_time(end), before.elapsed_time(start) >= queued * 1e3


def host_and_gpu(fn: Callable, calls: int, sync: Callable[[], None], gpu_span=None) -> dict:
    """One timed run of ``calls`` calls, per call: ``thread_us`` the calling thread's CPU time
    (``time.thread_time``: no waiting counted), ``host_us`` the process's CPU time (every thread:
    a CUDA backward runs in the autograd engine's device thread while the caller waits),
    ``wall_us`` up to a device synchronisation after the last call, and ``gpu_us`` from
    ``gpu_span(fn, calls, host_s)`` (:func:`cuda_gpu_span`; ``None`` without one) with its
    ``gpu_covered``. The synchronisation (a spin) is outside the CPU-time windows."""
    sync()
    wall, host, thread = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(calls):
        fn()
    thread, host = time.thread_time() - thread, time.process_time() - host
    sync()
    wall = time.perf_counter() - wall
    run = {"host_us": host / calls * 1e6, "thread_us": thread / calls * 1e6, "wall_us": wall / calls * 1e6,
           "gpu_us": None, "gpu_covered": None}
    if gpu_span is not None:
        ms, covered = gpu_span(fn, calls, host)
        run.update(gpu_us=ms * 1e3 / calls, gpu_covered=covered)
    return run


def machine() -> dict:
    """What the numbers were measured on."""
    import torch  # noqa: PLC0415

    from flash_attn import __version__  # noqa: PLC0415

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flash_attn": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _memory_gib(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def available_memory_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


# --- output ------------------------------------------------------------------------------------


def write_results(out_dir: Path, name: str, meta: dict, rows: list[dict], columns: Sequence[str]) -> dict[str, Path]:
    """``<name>.json`` (everything) and ``<name>.csv`` (the rows); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "csv": out_dir / f"{name}.csv"}
    paths["json"].write_text(json.dumps({"meta": meta, "results": rows}, indent=2, default=str) + "\n")
    with paths["csv"].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return paths


def markdown_table(rows: Iterable[dict], columns: Sequence[tuple[str, str]]) -> str:
    """``columns``: ``(key, header)``; floats get 3 significant-ish decimals."""
    def cell(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    return plt
