"""GPU benchmark: forward and forward+backward TFLOPs of this package's ``aot`` and ``triton``
backends against every SDPA backend PyTorch has (flash, efficient, cudnn) and upstream
flash-attn's ``flash_attn_2_cuda`` when it imports.

Shapes follow the usual FlashAttention benchmark: ``batch * seqlen = total_tokens`` (16k) and
``heads * headdim = hidden`` (2048), so every sequence length does the same number of tokens.
Timing: CUDA events around each call after warm-up, the median of the repeats. TFLOPs use
:func:`flash_attn.benchmarks.common.attention_flops` (``4*b*h*sq*sk*d``, halved for causal;
x3.5 for forward+backward).

Rows are written as they are measured (``bench-gpu.jsonl`` and ``bench-gpu.csv``), so a run cut
short keeps what it measured. A row of this package's backends that crashed, or that another
backend ran (:func:`flash_attn.dispatch.last_backend`), is an ``error`` and makes the command exit
1; so is one whose backend is unavailable under ``FLASH_ATTN_STRICT_BACKEND=1``. Other
implementations' exceptions are ``unsupported`` (their kernels reject some shapes).

The timer and the device are parameters, so the plumbing runs on a CPU in the tests.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Optional

from flash_attn.benchmarks import common
from flash_attn.benchmarks.common import attention_flops, summarize

DEFAULT_IMPLS = ("flash_attn[aot]", "flash_attn[triton]", "sdpa[flash]", "sdpa[efficient]", "sdpa[cudnn]", "upstream")
Timer = Callable[[Callable[[], None], int, int], list]


@dataclass
class Implementation:
    name: str
    # why it cannot run on the device at all (None: it can); checked once
    unavailable: Callable[[object], Optional[str]]
    # run(q, k, v, dout, causal): forward, and backward when dout is given
    run: Callable
    context: Callable[[], ContextManager] = contextlib.nullcontext
    backend: Optional[str] = None  # this package's backend that must run the calls (None: not ours)


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
    def run(q, k, v, dout, causal):
        out = forward(q, k, v, causal)
        if dout is not None:
            out.backward(dout)
            q.grad = k.grad = v.grad = None
    return run


def _ours(backend: str) -> Implementation:
    from flash_attn import dispatch, flash_attn_func  # noqa: PLC0415

    return Implementation(
        f"flash_attn[{backend}]",
        lambda device: dispatch.unavailable_reason(backend, device),
        _autograd_run(lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)),
        lambda: _backend_env(backend),
        backend,
    )


def _sdpa(label: str, backend_name: str) -> Implementation:
    import torch.nn.functional as F  # noqa: PLC0415

    def forward(q, k, v, causal):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)  # back to (batch, seqlen, heads, headdim), like dout

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

    return Implementation(f"sdpa[{label}]", unavailable, _autograd_run(forward), context)


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

    def run(q, k, v, dout, causal):
        ext = state["ext"]
        scale = q.shape[-1] ** -0.5
        out, lse, _, rng = ext.fwd(q, k, v, None, None, 0.0, scale, causal, -1, -1, 0.0, False, None)[:4]
        if dout is not None:
            ext.bwd(dout, q, k, v, out, lse, None, None, None, None, 0.0, scale, causal, -1, -1, 0.0, False, None, rng)

    return Implementation("upstream", unavailable, run)


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
    out = []
    for dtype in config["dtypes"]:
        for headdim in config["headdims"]:
            for causal in config["causal"]:
                for seqlen in config["seqlens"]:
                    for backward in config["backward"]:
                        out.append({
                            "dtype": dtype, "headdim": headdim, "causal": causal, "seqlen": seqlen,
                            "batch": max(1, config["total_tokens"] // seqlen), "heads": max(1, config["hidden"] // headdim),
                            "pass": "fwd_bwd" if backward else "fwd",
                        })
    return out


def run(config: dict, device=None, timer: Optional[Timer] = None, progress=lambda s: None,
        on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Measure every case with every implementation; ``on_row(row)`` as each row is done."""
    import torch  # noqa: PLC0415

    from flash_attn import dispatch  # noqa: PLC0415

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
    for case in cases(config):
        dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[case["dtype"]])
        backward = case["pass"] == "fwd_bwd"
        shape = (case["batch"], case["seqlen"], case["heads"], case["headdim"])
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_(backward) for _ in range(3))
        dout = torch.randn(shape, device=device, dtype=dtype, generator=g) if backward else None
        flops = attention_flops(case["batch"], case["heads"], case["seqlen"], case["seqlen"], case["headdim"],
                                case["causal"], backward)
        for impl in impls:
            row = dict(case, impl=impl.name)
            if reasons[impl.name] is not None:
                # under strict mode this package's backends must run: unavailable is an error
                ours_required = impl.backend is not None and dispatch.strict()
                row.update(status="error" if ours_required else "unavailable", note=reasons[impl.name])
            else:
                try:
                    with impl.context():
                        times = timer(lambda: impl.run(q, k, v, dout, case["causal"]), config["warmup"], config["repeats"])
                    row.update(summarize(times), status="ok")
                    row["tflops"] = flops / (row["time_ms"] * 1e-3) / 1e12
                    elsewhere = _ran_elsewhere(impl, device.type)
                    if elsewhere:
                        row.update(status="error", note=elsewhere)
                except Exception as exc:  # noqa: BLE001  (an SDPA backend that rejects a shape, OOM...)
                    note = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
                    row.update(status="error" if impl.backend is not None else "unsupported", note=note)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            progress(_progress_line(row))
            on_row(row)
            rows.append(row)
    return rows


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
    head = (f"  {row['dtype']} d={row['headdim']:<3} {'causal' if row['causal'] else 'full':<6} {row['pass']:<7} "
            f"s={row['seqlen']:<6} {row['impl']:<20}")
    if row.get("status") != "ok":
        return f"{head} {row['status']}: {row.get('note', '')}"
    return f"{head} {row['time_ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s"


def plot(rows: list[dict], out_dir: Path, stem: str, title: str) -> list[Path]:
    """One PNG per dtype: rows of panels per head dim, columns per (pass, causal)."""
    from flash_attn.benchmarks.common import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return []
    written = []
    for dtype in sorted({r["dtype"] for r in rows}):
        subset = [r for r in rows if r["dtype"] == dtype]
        headdims = sorted({r["headdim"] for r in subset})
        columns = sorted({(r["pass"], r["causal"]) for r in subset})
        fig, axes = plt.subplots(len(headdims), len(columns), figsize=(3.6 * len(columns), 2.8 * len(headdims)),
                                 squeeze=False, sharex=True)
        for i, headdim in enumerate(headdims):
            for j, (pass_, causal) in enumerate(columns):
                ax = axes[i][j]
                for impl in dict.fromkeys(r["impl"] for r in subset):
                    pts = [r for r in subset if r["impl"] == impl and r["headdim"] == headdim and r["pass"] == pass_
                           and r["causal"] == causal and r.get("status") == "ok"]
                    if pts:
                        ax.plot([r["seqlen"] for r in pts], [r["tflops"] for r in pts], marker="o", label=impl)
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


COLUMNS = ("impl", "dtype", "headdim", "causal", "pass", "seqlen", "batch", "heads", "time_ms", "time_ms_min",
           "repeats", "tflops", "status", "note")


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


def main(args, default_seqlens=(), device=None, timer: Optional[Timer] = None) -> int:
    """``python -m flash_attn bench gpu``: 0 when every row of this package's backends ran (on
    them), 1 when one is an ``error``, 2 without a CUDA device (``device``/``timer``: for tests)."""
    import torch  # noqa: PLC0415

    if device is None and not torch.cuda.is_available():
        print("gpu mode needs a CUDA device (this PyTorch sees none); `python -m flash_attn bench cpu` runs here",
              file=sys.stderr)
        return 2
    config = {
        "seqlens": args.seqlens or list(default_seqlens),
        "headdims": [64] if args.quick else args.headdims, "dtypes": ["bf16"] if args.quick else args.dtypes or ["fp16", "bf16"],
        "causal": [False, True], "backward": [False, True], "impls": args.impls or list(DEFAULT_IMPLS),
        "total_tokens": args.total_tokens, "hidden": args.hidden,
        "repeats": args.repeats or (3 if args.quick else 30), "warmup": args.warmup or (1 if args.quick else 5),
    }
    meta = {"mode": "gpu", "config": config, "machine": common.machine()}
    writer = RowWriter(args.out, "bench-gpu", meta)
    try:
        rows = run(config, device=device, timer=timer, progress=lambda line: print(line, file=sys.stderr, flush=True),
                   on_row=writer)
    finally:
        writer.close()
    paths = {"jsonl": writer.paths["jsonl"], **common.write_results(args.out, "bench-gpu", meta, rows, COLUMNS)}
    if not args.no_plot:
        pngs = plot(rows, args.out, "bench-gpu", f"{meta['machine'].get('gpu')}, torch {meta['machine']['torch']}")
        paths["png"] = ", ".join(map(str, pngs)) or "(not written: matplotlib is not installed)"
    ok = [r for r in rows if r.get("status") == "ok"]
    print(common.markdown_table(ok, [("dtype", "dtype"), ("headdim", "d"), ("causal", "causal"), ("pass", "pass"),
                                     ("seqlen", "seqlen"), ("impl", "implementation"), ("time_ms", "ms"),
                                     ("tflops", "TFLOP/s")]))
    print("\n" + "\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    errors = [r for r in rows if r.get("status") == "error"]
    for r in errors:
        print(f"error: {_progress_line(r).strip()}", file=sys.stderr)
    return 1 if errors else 0
