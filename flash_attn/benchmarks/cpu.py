"""CPU benchmark: this package (the PyTorch reference backend) against naive eager attention and
``torch.nn.functional.scaled_dot_product_attention``, time and peak memory over sequence length.

Peak memory is the growth of the process's resident set while one call runs (Linux: the
high-water mark ``VmHWM`` after resetting it through ``/proc/self/clear_refs``), measured by
default in a fresh child process per case so that memory freed by an earlier case cannot hide a
later case's peak. Eager attention materialises ``batch * heads * seqlen^2`` scores, so its
memory grows quadratically; the reference backend works tile by tile and grows linearly.

Run as ``python -m flash_attn bench cpu``; a child runs ``python -m flash_attn.benchmarks.cpu SPEC``.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from flash_attn.benchmarks.common import attention_flops, available_memory_bytes, summarize

IMPLEMENTATIONS = {
    "flash_attn": "flash_attn (reference backend)",
    "eager": "eager (materialised softmax)",
    "sdpa": "torch SDPA (CPU)",
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# --- memory ------------------------------------------------------------------------------------


def _status_kib(field: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the resident-set high-water mark to the current size (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_kib() -> int:
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB elsewhere


# --- the implementations -------------------------------------------------------------------------


def _eager(q, k, v, causal: bool):
    import torch  # noqa: PLC0415

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qt, kt.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if causal:
        s_q, s_k = scores.shape[-2:]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu_(s_k - s_q + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), vt).transpose(1, 2)


def _sdpa(q, k, v, causal: bool):
    import torch.nn.functional as F  # noqa: PLC0415

    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def _ours(q, k, v, causal: bool):
    from flash_attn import flash_attn_func  # noqa: PLC0415

    return flash_attn_func(q, k, v, causal=causal)


_FUNCTIONS: dict[str, Callable] = {"flash_attn": _ours, "eager": _eager, "sdpa": _sdpa}


def predicted_eager_bytes(spec: dict) -> int:
    """What eager attention holds at its peak: the score matrix, its scaled copy / softmax, and
    (backward) their gradients."""
    itemsize = {"fp32": 4, "bf16": 2, "fp16": 2}[spec["dtype"]]
    scores = spec["batch"] * spec["heads"] * spec["seqlen"] ** 2 * itemsize
    return scores * (5 if spec.get("backward") else 3)


# --- one case ----------------------------------------------------------------------------------


def measure(spec: dict) -> dict:
    """Time and peak memory of one case, in this process."""
    import torch  # noqa: PLC0415

    os.environ["FLASH_ATTN_BACKEND"] = "reference"
    dtype = getattr(torch, DTYPES[spec["dtype"]])
    backward = bool(spec.get("backward"))
    fn = _FUNCTIONS[spec["impl"]]
    causal = bool(spec.get("causal"))

    def make_call(seqlen: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        shape = (spec["batch"], seqlen, spec["heads"], spec["headdim"])
        q, k, v = (torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).requires_grad_(backward) for _ in range(3))
        dout = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) if backward else None

        def call():
            if backward:
                fn(q, k, v, causal).backward(dout)
                q.grad = k.grad = v.grad = None
            else:
                with torch.no_grad():
                    fn(q, k, v, causal)
        return call

    # One tiny call first: lazy imports and one-time set-up must not count as the case's memory,
    # and a tiny call leaves no freed memory behind that the measured call could reuse unseen.
    make_call(16, 1)()
    call = make_call(spec["seqlen"], spec.get("seed", 0))
    gc.collect()
    base_kib = _status_kib("VmRSS") or 0
    exact_peak = _reset_peak()
    start = time.perf_counter()
    call()  # the first call: measures the peak, and warms up
    first_ms = (time.perf_counter() - start) * 1e3
    peak_kib = _peak_kib()
    for _ in range(max(0, spec.get("warmup", 1) - 1)):
        call()
    times = []
    deadline = time.perf_counter() + spec.get("max_seconds", 60.0)  # long cases: fewer repeats
    for _ in range(max(1, spec.get("repeats", 3))):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
        if time.perf_counter() > deadline:
            break
    result = summarize(times)
    result["first_call_ms"] = first_ms
    flops = attention_flops(spec["batch"], spec["heads"], spec["seqlen"], spec["seqlen"], spec["headdim"], causal, backward)
    result.update(
        gflops=flops / (result["time_ms"] * 1e-3) / 1e9,
        peak_mib=max(0, peak_kib - base_kib) / 1024,
        peak_exact=exact_peak,
        status="ok",
        threads=torch.get_num_threads(),
    )
    return result


def _run_child(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, FLASH_ATTN_BACKEND="reference")
    try:
        proc = subprocess.run([sys.executable, "-m", "flash_attn.benchmarks.cpu", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "note": f"over {timeout:.0f} s"}
    if proc.returncode != 0:
        if proc.returncode in (-9, 137):
            return {"status": "oom", "note": "killed (out of memory)"}
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        if "DefaultCPUAllocator: can't allocate memory" in proc.stderr or "MemoryError" in proc.stderr:
            return {"status": "oom", "note": tail[:200]}
        return {"status": "error", "note": f"exit {proc.returncode}: {tail[:200]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(config: dict, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Every (seqlen, implementation) case of ``config``; rows in order."""
    rows = []
    for seqlen in config["seqlens"]:
        for impl in config["impls"]:
            spec = {
                "impl": impl, "seqlen": seqlen, "batch": config["batch"], "heads": config["heads"],
                "headdim": config["headdim"], "dtype": config["dtype"], "causal": config["causal"],
                "backward": config["backward"], "repeats": config["repeats"], "warmup": config["warmup"],
                "max_seconds": config.get("max_seconds", 60.0),
            }
            row = {k: spec[k] for k in ("impl", "seqlen", "batch", "heads", "headdim", "dtype", "causal")}
            row["pass"] = "fwd_bwd" if spec["backward"] else "fwd"
            available = available_memory_bytes()
            need = predicted_eager_bytes(spec) if impl == "eager" else 0
            if need and available and need > 0.8 * available:
                row.update(status="skipped", note=f"needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available")
            elif config.get("isolate", True):
                row.update(_run_child(spec, timeout=config.get("timeout", 900.0)))
            else:
                try:
                    row.update(measure(spec))
                except (MemoryError, RuntimeError) as exc:
                    row.update(status="error", note=str(exc).splitlines()[0][:200])
            progress(_progress_line(row))
            rows.append(row)
    return rows


def _progress_line(row: dict) -> str:
    if row.get("status") != "ok":
        return f"  seqlen {row['seqlen']:>6}  {row['impl']:<11} {row.get('status')}: {row.get('note', '')}"
    return (f"  seqlen {row['seqlen']:>6}  {row['impl']:<11} {row['time_ms']:10.1f} ms  "
            f"{row['gflops']:7.1f} GFLOP/s  peak +{row['peak_mib']:8.1f} MiB")


def plot(rows: list[dict], path: Path, title: str) -> Optional[Path]:
    from flash_attn.benchmarks.common import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return None
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, label in IMPLEMENTATIONS.items():
        ok = [r for r in rows if r["impl"] == impl and r.get("status") == "ok"]
        if not ok:
            continue
        xs = [r["seqlen"] for r in ok]
        ax_time.plot(xs, [r["time_ms"] for r in ok], marker="o", label=label)
        ax_mem.plot(xs, [max(r["peak_mib"], 1e-1) for r in ok], marker="o", label=label)
        for r in rows:
            if r["impl"] == impl and r.get("status") in ("oom", "skipped"):
                ax_mem.annotate(r["status"], (r["seqlen"], ax_mem.get_ylim()[1] if ok else 1), fontsize=8)
    for ax, ylabel in ((ax_time, "time per call (ms, median)"), (ax_mem, "peak extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # a child of run(): one case, one JSON line
    print(json.dumps(measure(json.loads(sys.argv[1]))))
