"""CPU benchmark: this package (its cpu backend, what every CPU user gets) side by side with
PyTorch's ``scaled_dot_product_attention`` (and, on request, naive eager attention).

Two kinds of cases:

* **plain**: fp32/bf16, causal or not, forward or forward+backward, over sequence length;
* **features** SDPA can only express with an explicit, materialised mask (sliding window,
  ALiBi, varlen, paged KV: SDPA gets the equivalent mask, built before timing) or not at all
  (softcap: SDPA gets the causal mask as an explicit mask and computes no softcap, which is
  less work; the plain causal cases show SDPA's ``is_causal`` time for the same sizes).

On request (``--impls flash_attn,sdpa,flex``) PyTorch's ``flex_attention`` runs too: compiled by
inductor, it is PyTorch's own fused CPU kernel for what SDPA cannot express (each feature as a
block mask and a score modification, computing exactly what we compute, softcap included). A case
PyTorch refuses with ``NotImplementedError`` (in 2.13 every backward on the CPU) is reported as
unsupported, with PyTorch's reason.

Every case runs in a fresh child process, which measures all implementations: the first call of
each for peak memory (the growth of the resident set's high-water mark ``VmHWM`` over the call,
after ``/proc/self/clear_refs`` and ``malloc_trim``), then timed calls *alternating* between the
implementations, so that a busy spell of a shared machine slows them alike. The **ratio** is the
median over the repeats of SDPA's time over ours in the same repeat (paired ratios: a busy spell
slows both calls of a pair); above 1 we are faster. The times reported are each side's median.

Run as ``python -m flash_attn bench cpu``; a child runs ``python -m flash_attn.bench.cpu SPEC``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from flash_attn.bench.common import available_memory_bytes, summarize
from flash_attn.limits import cdiv

IMPLEMENTATIONS = {
    "flash_attn": "flash_attn (cpu backend)",
    "sdpa": "torch SDPA (CPU)",
    "eager": "eager (materialised softmax)",
    "flex": "torch flex_attention (compiled by inductor; forward only on the CPU)",
}
# The implementations our time is compared with, and the key of that ratio (their time / ours).
BASELINES = {"sdpa": "ratio", "flex": "ratio_flex"}
# Implementations compiled on their first call of a shape: that call is made before measuring.
COMPILED = ("flex",)
SOFTCAP = 30.0
DEFAULT_IMPLS = ("flash_attn", "sdpa")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FEATURES = {
    "window": "sliding window of seqlen/4 keys, causal (SDPA: boolean band mask)",
    "softcap": f"softcap {SOFTCAP:g}, causal (SDPA cannot softcap: boolean causal mask, no softcap, less work)",
    "alibi": "ALiBi, causal (SDPA: fp32 additive bias per head)",
    "varlen": "4 packed sequences (1/2, 1/4, 1/8, 1/8 of seqlen), causal (SDPA: block-diagonal mask)",
    "paged": "the varlen sequences with K/V in 256-row pages (SDPA: contiguous K/V, block-diagonal mask)",
}
PAGE_SIZE = 256


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


def _release_freed_memory() -> None:
    """Give memory freed by an earlier call back to the OS (glibc keeps it otherwise), so that
    the next call's growth is measured from a true baseline."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


# --- the problems --------------------------------------------------------------------------------


def _window_keys(seqlen: int) -> int:
    """The window case's width: each query sees itself and the ``seqlen/4 - 1`` keys before it."""
    return max(1, seqlen // 4)


def _lengths(seqlen: int) -> list[int]:
    """The varlen/paged cases' sequence lengths."""
    quarter, eighth = seqlen // 4, seqlen // 8
    return [seqlen - quarter - 2 * eighth, quarter, eighth, eighth]


def visible_pairs(spec: dict) -> int:
    """(query, key) pairs a case attends to, per batch entry and head."""
    s = spec["seqlen"]
    feature = spec.get("feature")
    if feature in ("varlen", "paged"):
        return sum(n * (n + 1) // 2 for n in _lengths(s))
    if feature == "window":
        w = _window_keys(s)
        return sum(min(i + 1, w) for i in range(s))
    if feature in ("softcap", "alibi") or spec.get("causal"):
        return s * (s + 1) // 2
    return s * s


def flops(spec: dict) -> float:
    """``4 * d`` flops per visible pair and head (two matmuls), x3.5 for forward+backward."""
    total = 4.0 * spec["batch"] * spec["heads"] * spec["headdim"] * visible_pairs(spec)
    return total * 3.5 if spec.get("backward") else total


def predicted_bytes(spec: dict, impl: str) -> int:
    """What an implementation holds beyond the inputs: eager's score matrices, SDPA's explicit
    mask (built as an input, plus the float copy SDPA makes of a boolean one)."""
    s, itemsize = spec["seqlen"], {"fp32": 4, "bf16": 2, "fp16": 2}[spec["dtype"]]
    if impl == "eager":
        return spec["batch"] * spec["heads"] * s * s * itemsize * (5 if spec.get("backward") else 3)
    if impl == "sdpa" and spec.get("feature") in ("window", "softcap", "varlen", "paged"):
        return s * s * (1 + itemsize)
    if impl == "sdpa" and spec.get("feature") == "alibi":
        return spec["heads"] * s * s * 4
    return 0


def _causal_mask(n: int, device=None):
    import torch  # noqa: PLC0415

    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def _sdpa_mask(spec: dict, slopes):
    """The explicit mask SDPA needs for a feature case (None: plain / is_causal)."""
    import torch  # noqa: PLC0415

    s = spec["seqlen"]
    feature = spec.get("feature")
    if feature == "window":
        return _causal_mask(s).triu_(-(_window_keys(s) - 1))
    if feature == "softcap":
        return _causal_mask(s)
    if feature == "alibi":
        i = torch.arange(s).view(s, 1)
        distance = (i - i.view(1, s)).abs_().to(torch.float32)
        bias = distance.mul_(-1.0) * slopes.view(-1, 1, 1)
        return bias.masked_fill_(~_causal_mask(s), float("-inf"))
    if feature in ("varlen", "paged"):
        mask = torch.zeros(s, s, dtype=torch.bool)
        start = 0
        for n in _lengths(s):
            mask[start:start + n, start:start + n] = _causal_mask(n)
            start += n
        return mask
    return None


def _calls(spec: dict, raw: bool = False) -> dict[str, Callable]:
    """One call of each implementation of the case, on the same inputs (``raw``: the bare
    functions, returning their outputs, without the backward)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from flash_attn import flash_attn_func  # noqa: PLC0415

    dtype = getattr(torch, DTYPES[spec["dtype"]])
    backward = bool(spec.get("backward"))
    feature = spec.get("feature")
    causal = bool(spec.get("causal")) or feature is not None
    b, s, h, d = spec["batch"], spec["seqlen"], spec["heads"], spec["headdim"]
    g = torch.Generator().manual_seed(spec.get("seed", 0))
    q, k, v, dout = (torch.randn((b, s, h, d), generator=g).to(dtype).requires_grad_(i < 3 and backward)
                     for i in range(4))
    slopes = torch.rand(h, generator=g) * 0.5 + 0.05
    inputs = [q, k, v]

    def run(fn):
        def call():
            with torch.set_grad_enabled(backward):
                out = fn()
                if backward:
                    out.backward(dout.reshape(out.shape))
                    for t in inputs:
                        t.grad = None
        return call

    if feature in ("varlen", "paged"):
        ours = _varlen_call(q, k, v, inputs, feature, s, g)
    else:
        kwargs = {"causal": causal}
        if feature == "window":
            kwargs["window_size"] = (_window_keys(s) - 1, 0)
        elif feature == "softcap":
            kwargs["softcap"] = SOFTCAP
        elif feature == "alibi":
            kwargs["alibi_slopes"] = slopes

        def ours():
            return flash_attn_func(q, k, v, **kwargs)

    mask = _sdpa_mask(spec, slopes)

    def sdpa():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if mask is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)

    def eager():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(qt, kt.transpose(-2, -1)) * (d ** -0.5)
        if feature == "softcap":
            scores = torch.tanh(scores / SOFTCAP) * SOFTCAP
        visible = mask if mask is not None and mask.dtype == torch.bool else (_causal_mask(s) if causal else None)
        if feature == "alibi":
            scores = scores + mask
        elif visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1), vt).transpose(1, 2)

    fns = {"flash_attn": ours, "sdpa": sdpa, "eager": eager}
    if "flex" in spec.get("impls", ("flex",)) and flex_unavailable() is None:
        fns["flex"] = _flex_call(spec, q, k, v, slopes)
    return fns if raw else {name: run(fn) for name, fn in fns.items()}


def flex_unavailable() -> Optional[str]:
    """Why ``flex_attention`` cannot run here at all (None: it can try). What PyTorch itself
    refuses (on the CPU in 2.13: any backward) is learnt by trying, in :func:`measure`."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401, PLC0415
    except ImportError:
        return "this PyTorch has no flex_attention"
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "c++"), "g++", "clang++")):
        return "no C++ compiler: torch.compile cannot build flex_attention's CPU kernel"
    return None


@functools.cache
def _compiled_flex():
    import torch  # noqa: PLC0415
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

    return torch.compile(flex_attention, dynamic=False)


def _flex_call(spec: dict, q, k, v, slopes) -> Callable:
    """``flex_attention`` computing what flash_attn computes in this case: causality, the window
    and the packed sequences as a block mask, softcap and ALiBi as a score modification (paged:
    contiguous K/V, as SDPA gets). The block mask is built here, before anything is timed."""
    import torch  # noqa: PLC0415
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

    s = spec["seqlen"]
    feature = spec.get("feature")
    mask_mod = score_mod = None
    if feature == "window":
        width = _window_keys(s)

        def mask_mod(b, h, i, j):
            return (i >= j) & (i - j < width)
    elif feature in ("varlen", "paged"):
        lengths = _lengths(s)
        sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

        def mask_mod(b, h, i, j):
            return (sequence[i] == sequence[j]) & (i >= j)
    elif spec.get("causal") or feature is not None:

        def mask_mod(b, h, i, j):
            return i >= j
    if feature == "softcap":

        def score_mod(score, b, h, i, j):
            return SOFTCAP * torch.tanh(score / SOFTCAP)
    elif feature == "alibi":

        def score_mod(score, b, h, i, j):
            return score - slopes[h] * (i - j)  # causal: |i - j| is i - j
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, s, s, device="cpu")
    flex = _compiled_flex()

    def flex_call():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return flex(qt, kt, vt, score_mod=score_mod, block_mask=block_mask).transpose(1, 2)

    return flex_call


def _varlen_call(q, k, v, inputs, feature, seqlen, generator):
    """``flash_attn_varlen_func`` over the packed sequences (paged: K/V moved into pages, and
    ``inputs`` pointed at the page pools so their gradients are reset between calls)."""
    import torch  # noqa: PLC0415

    from flash_attn import flash_attn_varlen_func  # noqa: PLC0415

    lengths = _lengths(seqlen)
    cu = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32)
    longest = max(lengths)
    if feature == "varlen":
        return lambda: flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, longest, longest, causal=True)
    k_pool, v_pool, table = _paged(k, v, lengths, generator)
    inputs[1:] = [k_pool, v_pool]
    return lambda: flash_attn_varlen_func(q[0], k_pool, v_pool, cu, cu, longest, longest, causal=True,
                                          block_table=table)


def _paged(k, v, lengths, generator):
    """The sequences' keys/values in shuffled pages of ``PAGE_SIZE`` rows, and the block table."""
    import torch  # noqa: PLC0415

    need = [cdiv(n, PAGE_SIZE) for n in lengths]
    order = torch.randperm(sum(need), generator=generator)
    shape = (sum(need), PAGE_SIZE) + tuple(k.shape[2:])
    k_pool, v_pool = k.new_zeros(shape), v.new_zeros(shape)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    start, used = 0, 0
    for b, n in enumerate(lengths):
        for p in range(need[b]):
            page = int(order[used])
            rows = slice(start + p * PAGE_SIZE, min(start + n, start + (p + 1) * PAGE_SIZE))
            count = rows.stop - rows.start
            with torch.no_grad():
                k_pool[page, :count], v_pool[page, :count] = k[0, rows], v[0, rows]
            table[b, p] = page
            used += 1
        start += n
    return k_pool.requires_grad_(k.requires_grad), v_pool.requires_grad_(v.requires_grad), table


# --- one case ----------------------------------------------------------------------------------


def measure(spec: dict) -> dict:
    """Peak memory and median time of every implementation of one case, in this process."""
    import torch  # noqa: PLC0415

    os.environ["FLASH_ATTN_BACKEND"] = spec.get("backend", "cpu")  # "reference": the tiled definition alone
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    impls = list(spec["impls"])
    # lazy imports and one-time set-up must not count as a case's memory (nor compilation: a
    # compiled implementation is called once at this case's shape)
    warm_impls = [impl for impl in impls if impl not in COMPILED]
    warm = _calls(dict(spec, seqlen=64 if spec.get("feature") == "paged" else 16, seed=1, impls=warm_impls))
    for impl in warm_impls:
        warm[impl]()
    if "flash_attn" in warm_impls:  # the cpu backend's one-time set-up, not a call's
        from flash_attn.backends import _onednn  # noqa: PLC0415

        _onednn.warm_up()
    calls = _calls(spec)
    results: dict[str, dict] = {}
    for impl in [impl for impl in impls if impl in COMPILED]:
        try:
            calls[impl]()
        except Exception as exc:  # noqa: BLE001  a failed compilation costs only its own row
            # NotImplementedError: PyTorch says it does not do this case (flex's CPU backward)
            status = "unsupported" if isinstance(exc, NotImplementedError) else "error"
            results[impl] = {"status": status, "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            impls.remove(impl)
    for impl in impls:
        _release_freed_memory()
        base_kib = _status_kib("VmRSS") or 0
        exact = _reset_peak()
        start = time.perf_counter()
        calls[impl]()  # the first call: its peak memory, and a warm-up
        first_ms = (time.perf_counter() - start) * 1e3
        results[impl] = {"peak_mib": max(0, _peak_kib() - base_kib) / 1024, "peak_exact": exact,
                         "first_call_ms": first_ms, "times": []}
    for _ in range(max(0, spec.get("warmup", 1) - 1)):
        for impl in impls:
            calls[impl]()
    deadline = time.perf_counter() + spec.get("max_seconds", 60.0)  # long cases: fewer repeats
    for repeat in range(max(1, spec.get("repeats", 3))):
        order = impls if repeat % 2 == 0 else impls[::-1]  # alternate, so neither always goes first
        for impl in order:
            start = time.perf_counter()
            calls[impl]()
            results[impl]["times"].append((time.perf_counter() - start) * 1e3)
        if time.perf_counter() > deadline:
            break
    work = flops(spec)
    for baseline, key in BASELINES.items():
        if "flash_attn" in impls and baseline in impls:
            # the ratio of calls made one right after the other: a busy spell of a shared machine
            # that slows one call of a pair mostly slows its neighbour too
            pairs = zip(results[baseline]["times"], results["flash_attn"]["times"])
            results["flash_attn"][key] = statistics.median(theirs / ours for theirs, ours in pairs)
    for impl in impls:
        result = results[impl]
        result.update(summarize(result.pop("times")))
        result.update(gflops=work / (result["time_ms"] * 1e-3) / 1e9, status="ok", threads=torch.get_num_threads())
    return results


def _run_child(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, FLASH_ATTN_BACKEND="cpu")
    try:
        proc = subprocess.run([sys.executable, "-m", "flash_attn.bench.cpu", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {impl: {"status": "timeout", "note": f"over {timeout:.0f} s"} for impl in spec["impls"]}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        if proc.returncode in (-9, 137) or "can't allocate memory" in proc.stderr or "MemoryError" in proc.stderr:
            status, note = "oom", "killed (out of memory)" if proc.returncode in (-9, 137) else tail[:200]
        else:
            status, note = "error", f"exit {proc.returncode}: {tail[:200]}"
        return {impl: {"status": status, "note": note} for impl in spec["impls"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cases(config: dict) -> list[dict]:
    """Every case of ``config``: plain ones over ``seqlens``, then features over ``feature_seqlens``."""
    common = {k: config[k] for k in ("batch", "heads", "headdim", "repeats", "warmup")}
    common.update(max_seconds=config.get("max_seconds", 60.0), threads=config.get("threads"))
    out = []
    for dtype in config["dtypes"]:
        for causal in config["causal"]:
            for backward in config["backward"]:
                for seqlen in config["seqlens"]:
                    out.append(dict(common, dtype=dtype, causal=causal, backward=backward, seqlen=seqlen, feature=None))
    for feature in config.get("features", []):
        for dtype in config["dtypes"]:
            for backward in config["backward"]:
                for seqlen in config.get("feature_seqlens", config["seqlens"]):
                    out.append(dict(common, dtype=dtype, causal=True, backward=backward, seqlen=seqlen, feature=feature))
    return out


def run(config: dict, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Rows ``(case, impl)`` in order; ours carry ``ratio`` (the median of the paired ratios SDPA's
    time over ours)."""
    rows = []
    available = available_memory_bytes()
    for spec in cases(config):
        impls, skipped = [], {}
        for impl in config["impls"]:
            need = predicted_bytes(spec, impl)
            unsupported = flex_unavailable() if impl == "flex" else None
            if unsupported:
                skipped[impl] = {"status": "unsupported", "note": unsupported}
            elif need and available and need > 0.6 * available:
                skipped[impl] = {"status": "skipped",
                                 "note": f"needs ~{need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"}
            else:
                impls.append(impl)
        spec = dict(spec, impls=impls)
        results = dict(skipped)
        if impls:
            if config.get("isolate", True):
                results.update(_run_child(spec, timeout=config.get("timeout", 1800.0)))
            else:
                try:
                    results.update(measure(spec))
                except (MemoryError, RuntimeError) as exc:
                    results.update({i: {"status": "error", "note": str(exc).splitlines()[0][:200]} for i in impls})
        case_rows = []
        for impl in config["impls"]:
            row = {k: spec[k] for k in ("seqlen", "batch", "heads", "headdim", "dtype", "causal")}
            row.update(impl=impl, case=spec["feature"] or ("causal" if spec["causal"] else "full"),
                       pass_="fwd_bwd" if spec["backward"] else "fwd")
            row["pass"] = row.pop("pass_")
            row.update(results.get(impl, {"status": "error", "note": "no result"}))
            case_rows.append(row)
        _add_ratio(case_rows)
        for row in case_rows:
            progress(_progress_line(row))
        rows.extend(case_rows)
    return rows


def _add_ratio(case_rows: list[dict]) -> None:
    """Keep each ratio (the median of per-repeat ratios) only where both sides ran."""
    by_impl = {r["impl"]: r for r in case_rows}
    ours = by_impl.get("flash_attn")
    for baseline, key in BASELINES.items():
        theirs = by_impl.get(baseline)
        if ours and not (theirs and ours.get("status") == "ok" and theirs.get("status") == "ok"):
            ours.pop(key, None)


def _progress_line(row: dict) -> str:
    head = f"  {row['dtype']} {row['case']:<8} {row['pass']:<7} seqlen {row['seqlen']:>6}  {row['impl']:<11}"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')}: {row.get('note', '')}"
    ratio = "".join(f"  x{row[key]:.2f} vs {baseline}" for baseline, key in BASELINES.items() if key in row)
    return f"{head} {row['time_ms']:10.1f} ms  {row['gflops']:7.1f} GFLOP/s  peak +{row['peak_mib']:8.1f} MiB{ratio}"


def summary_rows(rows: list[dict]) -> list[dict]:
    """One row per case: each implementation's time and peak memory, and the ratio."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["case"], r["dtype"], r["pass"], r["seqlen"])
        entry = out.setdefault(key, {"case": r["case"], "dtype": r["dtype"], "pass": r["pass"], "seqlen": r["seqlen"]})
        value = r["time_ms"] if r.get("status") == "ok" else r.get("status")
        entry[f"{r['impl']}_ms"] = value
        entry[f"{r['impl']}_mib"] = r.get("peak_mib") if r.get("status") == "ok" else None
        entry.update({key: r[key] for key in BASELINES.values() if key in r})
    return list(out.values())


def plot(rows: list[dict], path: Path, title: str) -> Optional[Path]:
    """The ratio to SDPA over sequence length, one line per case (dtype, case, pass)."""
    from flash_attn.bench.common import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, pass_ in zip(axes, ("fwd", "fwd_bwd")):
        lines: dict[str, list] = {}
        for r in rows:
            if r["impl"] == "flash_attn" and r["pass"] == pass_ and "ratio" in r:
                lines.setdefault(f"{r['dtype']} {r['case']}", []).append((r["seqlen"], r["ratio"]))
        for label, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title("forward" if pass_ == "fwd" else "forward + backward", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if lines:  # a run without this pass has nothing to label
            ax.legend(fontsize=7, ncol=2)
    axes[0].set_ylabel("speed vs SDPA (SDPA time / ours; > 1: faster)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # a child of run(): one case, one JSON line
    print(json.dumps(measure(json.loads(sys.argv[1]))))
