"""``bench ops``: the fused loss and norms against PyTorch's own ops, forward + backward.

* loss: :func:`flash_attn.ops.triton.cross_entropy.cross_entropy_loss` (mean over the tokens) vs
  ``F.cross_entropy`` and ``torch.compile`` of it, on ``(tokens, vocab)`` logits, with peak memory
  (the point of the fused loss: no fp32 copy of the logits);
* norms: ``rms_norm_fn`` / ``layer_norm_fn`` of :mod:`flash_attn.ops.triton.layer_norm` vs
  ``F.rms_norm`` / ``F.layer_norm`` and ``torch.compile`` of them, on ``(tokens, hidden)``.

On the CPU (PyTorch paths) and on CUDA when present (Triton kernels). Each row also records the
largest difference of the implementation's output from PyTorch eager's, a check that the rows
time the same computation. Peak memory: the growth of the resident set's high-water mark on the
CPU (measured in this process, so less exact than ``bench cpu``'s child processes), the CUDA
allocator's peak on a GPU; both over the first (untimed, warm) call.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
IMPLEMENTATIONS = ("flash_attn", "torch", "torch.compile")
OPS = ("loss", "rms_norm", "layer_norm")


def _problem(op: str, spec: dict):
    """``{impl: fn}`` where ``fn()`` runs forward + backward and returns the forward's output."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: PLC0415
    from flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn  # noqa: PLC0415

    device, dtype = torch.device(spec["device"]), getattr(torch, DTYPES[spec["dtype"]])
    gen = torch.Generator().manual_seed(0)
    if op == "loss":
        logits = torch.randn(spec["tokens"], spec["vocab"], generator=gen).to(device=device, dtype=dtype)
        labels = torch.randint(0, spec["vocab"], (spec["tokens"],), generator=gen).to(device)

        def ours(x, y):
            return cross_entropy_loss(x, y)[0].mean()

        eager = F.cross_entropy
        inputs = (logits, labels)
    else:
        hidden = spec["hidden"]
        x = torch.randn(spec["tokens"], hidden, generator=gen).to(device=device, dtype=dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
        bias = (0.1 * torch.randn(hidden, generator=gen)).to(device=device, dtype=dtype)
        if op == "rms_norm":
            def ours(x, w, b):
                return rms_norm_fn(x, w, None, eps=1e-6)

            def eager(x, w, b):
                return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
        else:
            def ours(x, w, b):
                return layer_norm_fn(x, w, b, eps=1e-6)

            def eager(x, w, b):
                return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-6)
        inputs = (x, weight, bias)
    fns = {"flash_attn": ours, "torch": eager}
    if "torch.compile" in spec["impls"]:
        fns["torch.compile"] = torch.compile(eager)

    def training_step(fn):
        def call():
            first = inputs[0].detach().requires_grad_()  # a fresh leaf on the same memory
            out = fn(first, *inputs[1:])
            out.float().square().mean().backward() if out.ndim else out.backward()
            return out.detach()
        return call

    return {impl: training_step(fns[impl]) for impl in spec["impls"]}


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()


def _peak_mib(call: Callable, device: str) -> tuple[Optional[float], object]:
    """Peak memory growth (MiB) over ``call()`` and its result."""
    import torch  # noqa: PLC0415

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = call()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20, result
    from flash_attn.bench import cpu  # noqa: PLC0415  (its resident-set helpers)

    cpu._release_freed_memory()
    base = cpu._status_kib("VmRSS")
    exact = cpu._reset_peak()
    result = call()
    if base is None or not exact:
        return None, result
    return max(0, cpu._peak_kib() - base) / 1024, result


def measure(op: str, spec: dict) -> list[dict]:
    """One row per implementation: median time of forward + backward, peak memory, max |diff|."""
    from flash_attn.bench import common  # noqa: PLC0415

    calls = _problem(op, spec)
    base = {"op": op, "device": spec["device"], "dtype": spec["dtype"], "tokens": spec["tokens"],
            "width": spec["vocab"] if op == "loss" else spec["hidden"], "pass": "fwd+bwd"}
    rows, outputs, times = [], {}, {}
    for impl, call in calls.items():
        try:
            call()  # warm-up: compilation and one-time set-up are not a call's memory or time
            peak, outputs[impl] = _peak_mib(call, spec["device"])
        except Exception as exc:  # noqa: BLE001  a failing implementation costs only its own row
            status = "unsupported" if isinstance(exc, NotImplementedError) else "error"
            rows.append(dict(base, impl=impl, status=status, note=f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        samples = []
        for _ in range(max(1, spec["repeats"])):
            _synchronize(spec["device"])
            start = time.perf_counter()
            call()
            _synchronize(spec["device"])
            samples.append((time.perf_counter() - start) * 1e3)
        times[impl] = common.summarize(samples)
        rows.append(dict(base, impl=impl, status="ok", peak_mib=peak, **times[impl]))
    reference = outputs.get("torch")
    for row in rows:
        if row["status"] == "ok" and reference is not None:
            diff = (outputs[row["impl"]].double() - reference.double()).abs().max().item()
            row["max_diff_vs_torch"] = diff
        if row["status"] == "ok" and "torch" in times and "flash_attn" in times:
            # > 1: ours is faster than PyTorch eager
            row["speedup_vs_torch"] = times["torch"]["time_ms"] / row["time_ms"] if row["impl"] == "flash_attn" else None
    return rows


def run(config: dict, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    rows = []
    for device in config["devices"]:
        for dtype in config["dtypes"]:
            for op in config["ops"]:
                spec = dict(config, device=device, dtype=dtype)
                progress(f"bench ops: {op} {device} {dtype} tokens={config['tokens']} "
                         f"{'vocab' if op == 'loss' else 'hidden'}={config['vocab' if op == 'loss' else 'hidden']}")
                for row in measure(op, spec):
                    rows.append(row)
                    if row["status"] == "ok":
                        peak = "" if row["peak_mib"] is None else f", peak +{row['peak_mib']:.0f} MiB"
                        progress(f"  {row['impl']:>14}: {row['time_ms']:9.2f} ms{peak}")
                    else:
                        progress(f"  {row['impl']:>14}: {row['status']} ({row.get('note', '')})")
    return rows
