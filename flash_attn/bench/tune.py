"""``python -m flash_attn bench tune``: turn one short GPU window into launch configs.

GPU time comes in windows of about 15 minutes, so the sweep is three steps, two on the CPU:

1. ``--tune-step prepare`` (CPU, no GPU needed): compile every candidate config of
   :data:`CANDIDATES` for the architecture (and the kernels a backward needs beside it) into
   ``--out`` as ahead-of-time images with their manifest and build report: a folder of a few MB to
   carry to the GPU with the op library.
2. ``--tune-step run`` (GPU): with those images (``FLASH_ATTN_AOT_DIR``), time every candidate
   through the real planner and the ``aot`` backend (strict: no silent fallback) next to
   ``sdpa[flash]`` and ``sdpa[cudnn]`` in the same process; check each candidate's output and
   gradients against SDPA's; append one JSON row per measurement to ``tune-results.jsonl`` as it
   goes (a cut-off run keeps its rows; a candidate announced but never measured, its process hung
   or killed, counts as failed) and stop before ``--budget-s``. ``--tune-ws`` picks the
   warp-specialised candidates in or out, so that a window can time them in processes of their own.
3. ``--tune-step fold`` (CPU): per kernel kind and head dim, the candidate with the lowest
   geometric-mean time over the measured shapes (correct everywhere, >= 3 % faster than the
   current entry) replaces the entry of the launch-config table in
   :mod:`flash_attn.planning.configs` (the one place configs live); a Markdown summary is written.

Candidates are timed in bf16 (the configs do not depend on the dtype), lean variant (no softcap,
ALiBi, dropout), at ``batch x seqlen = 16k`` tokens and ``heads x head dim = 2048``; those of the
split backward (:data:`~flash_attn.planning.configs.SPLIT_BACKWARD_KINDS`, which Hopper runs for
``deterministic=True`` only, where the fused kernel's splits cannot keep its SMs busy) in calls
that ask for it, with the fused kernel's deterministic path switched off. After each shape's
candidates one row (``flash_attn[deterministic]``) times ``deterministic=True`` as planned.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from flash_attn.planning import configs

C = configs.Config
SPLIT = None  # a "bwd_fused" candidate: the split dK/dV + dQ kernels (configs.fused_backward)
RESULTS = "tune-results.jsonl"
CANDIDATES_FILE = "candidates.json"
MIN_GAIN = 0.03  # a new entry must be this much faster than the current one (run-to-run noise)

# (kind, family) -> head dim -> candidates (the table's current entry is always timed too).
CANDIDATES: dict = {
    ("fwd", "sm90"): {
        # d64 causal at 4k (0.93-0.97x FA2 on the H100): deeper pipelines, and one warpgroup on
        # 64-row tiles (half the diagonal tile's masked work, two programs per SM). "-tma"
        # (tma=True): K and V through tensor descriptors (d128 exact: 154 registers instead of 221).
        # "-ws" (ws=True): Triton's warp specialisation, FlashAttention-3's layout: one producer
        # warpgroup (TMA) and two consumer warpgroups of 64 rows each (4 + 8 warps, no spill)
        64: [C(128, 128, 8, 3), C(128, 128, 8, 2), C(128, 64, 8, 3), C(128, 128, 8, 4), C(128, 64, 8, 4),
             C(64, 128, 4, 3), C(128, 64, 8, 3, tma=True), C(128, 128, 4, 2, ws=True), C(128, 128, 4, 3, ws=True)],
        128: [C(128, 64, 8, 2), C(128, 128, 8, 2), C(128, 64, 8, 3), C(128, 32, 8, 2), C(128, 64, 8, 3, tma=True),
              C(128, 128, 4, 2, ws=True), C(128, 64, 4, 3, ws=True)],
        256: [C(128, 64, 8, 2), C(128, 32, 8, 2), C(64, 64, 4, 2), C(128, 64, 8, 2, tma=True),
              C(128, 64, 4, 2, ws=True), C(128, 32, 4, 2, ws=True)],
    },
    # Blackwell's forward warp-specialised (no Blackwell GPU has run any of this yet): Triton splits
    # it into the softmax (num_warps), the output correction (8 warps), one warp issuing the
    # tcgen05 MMAs and two the TMA loads; with 8 warps d128 does not spill, with 4 it does (336 B);
    # d256 keeps ~0.4 KB of stack
    ("fwd", "sm100"): {
        64: [C(128, 128, 4, 2, ws=True)],
        128: [C(128, 128, 8, 2, ws=True), C(128, 64, 8, 2, ws=True)],
        256: [C(128, 64, 8, 2, ws=True)],
    },
    # Blackwell (the table's entry first). Tensor memory holds 512 fp32 columns: dK, dV (128 x d
    # each), S and dP (64 each) and dQ (d) overflow it at head dim 128 with 64 queries a step and
    # two stages (Triton 3.9 then emits an empty kernel, which the build refuses); d256 splits its
    # gradient columns over two programs (128 each), as on Hopper.
    ("bwd_fused", "sm100"): {
        64: [C(64, 128, 8, 2), C(32, 128, 8, 2), SPLIT],
        128: [C(32, 128, 8, 2), C(64, 128, 8, 1), SPLIT],
        256: [C(32, 128, 8, 2), C(16, 128, 8, 3), C(32, 128, 8, 1), SPLIT],
    },
    # "-ptr" (tma=False): the table's tile with pointer loads instead of tensor descriptors (the
    # static report says TMA halves the loop's spills; this measures what that is worth). "-red"
    # (dq_tma=True): dQ by TMA bulk reductions instead of per-element atomics (FA3's way; d128 exact
    # 62 -> 12 spill instructions in the loop, d64 38 -> 3)
    ("bwd_fused", "sm90"): {
        64: [C(64, 128, 8, 2), C(64, 128, 8, 1), C(128, 128, 8, 2), C(128, 128, 8, 2, tma=False), SPLIT,
             C(128, 128, 8, 2, dq_tma=True), C(64, 128, 8, 2, dq_tma=True)],
        128: [C(64, 128, 8, 2), C(64, 128, 8, 3), C(64, 128, 8, 1), C(32, 128, 8, 2), C(32, 128, 8, 1),
              C(64, 128, 8, 2, tma=False), SPLIT, C(64, 128, 8, 2, dq_tma=True)],
        # d256 (the head dim split): 64x64 tiles measured 4x slower than 32x128 (replicated,
        # spilled); 16x128 s3 is the tile without a spill in its loop, 64x128 s1 the widest
        256: [C(32, 128, 8, 2), C(32, 128, 8, 1), C(16, 128, 8, 3), C(64, 128, 8, 1), C(32, 128, 8, 2, tma=False),
              SPLIT, C(32, 128, 8, 2, dq_tma=True)],
    },
    # deterministic=True (timed as such: the dK/dV kernel and the dQ kernel, the other at its entry).
    # The dK/dV kernel walks the fused backward's tiles now (64x128 at d64/d128: 24 / 176 B of
    # stack); 32x128 keeps none at d128 but has wgmma N 32; the old 16x64 tiles replicated S
    ("bwd_dkdv", "sm90"): {
        64: [C(32, 128, 8, 2), C(128, 128, 8, 2), C(64, 128, 8, 2, tma=False)],
        128: [C(32, 128, 8, 2), C(64, 128, 8, 1), C(64, 128, 8, 2, tma=False)],
        256: [C(32, 128, 8, 1), C(16, 128, 8, 2)],
    },
    ("bwd_dq", "sm90"): {
        128: [C(128, 32, 8, 2)],
        256: [C(64, 32, 4, 2), C(64, 16, 8, 2)],
    },
}


# which candidates a run times, by warp specialisation (never run on a GPU before the first sweep
# that has it: a deadlocking image hangs its process, so the GPU window times them in runs of their
# own, after the rest). The table's entries are timed in every selection that times their kind.
WS_SELECTIONS = ("include", "exclude", "only")


def candidates(family: str, headdims: Iterable[int] = (64, 128, 256),
               ws: str = "include") -> list[tuple[str, int, Optional[configs.Config]]]:
    """``(kind, head dim, config)`` to time on ``family``: the table's entries first (the lean one,
    then the exact-call image's where it differs), then the others. ``ws``: ``"exclude"`` leaves
    out the warp-specialised candidates, ``"only"`` times just those (beside the table's entries
    of their kind and head dim)."""
    if ws not in WS_SELECTIONS:
        raise ValueError(f"ws must be one of {WS_SELECTIONS}, not {ws!r}")
    out = []
    for (kind, fam), by_headdim in CANDIDATES.items():
        if fam != family:
            continue
        for d in headdims:
            entries = [configs.pick(kind, d, family), configs.pick(kind, d, family, exact=True)]
            others = [c for c in by_headdim.get(d, []) if c not in entries]
            specialised = [c for c in others if c is not None and c.ws]
            others = {"include": others, "exclude": [c for c in others if c not in specialised],
                      "only": specialised}[ws]
            if ws == "only" and not specialised:
                continue
            out.extend((kind, d, c) for c in dict.fromkeys([*entries, *others]))
    return out


# the variants the sweep tunes, and the table of configs.py each one's entries live in
_TABLE_NAMES = {"lean": "_TABLE", "exact": "_EXACT_TABLE"}


def _overrides(kind: str, family: str, d: int, config: Optional[configs.Config]) -> dict:
    """A candidate in the place of the lean entry and of the exact-call image's (the variants a
    lean call of either mask runs; the full-attention rows time the exact-call image). The split
    kernels' candidates run with the fused kernel's deterministic path switched off."""
    bucket = configs.HEADDIM_BUCKETS[configs._bucket(d)]
    out = {(kind, family, bucket, variant): config for variant in _TABLE_NAMES}
    if kind in configs.SPLIT_BACKWARD_KINDS:
        out[("deterministic_splits", family)] = 0
    return out


def _kernel_of(kind: str) -> Optional[str]:
    """The kernel with an exact-call image that the config kind sizes (forward, fused backward),
    or ``None`` (the deterministic kernels have none)."""
    from flash_attn.planning import declarations  # noqa: PLC0415

    return next((k.name for k in declarations.KERNELS.values() if k.config_kind == kind and k.exact), None)


# a config's loads and warps as its text's suffix: Config.tma (descriptors, pointer loads, the
# default) and Config.ws (warp specialised, which streams through descriptors whatever tma says);
# then "-red" for Config.dq_tma (dQ by TMA reductions)
_SUFFIXES = {(True, False): "-tma", (False, False): "-ptr", (None, False): "", (None, True): "-ws"}
_DQ_TMA_SUFFIX = "-red"


def _config_text(config: Optional[configs.Config]) -> str:
    if config is None:
        return "split"
    suffix = _SUFFIXES[(None if config.ws else config.tma, config.ws)] + (_DQ_TMA_SUFFIX if config.dq_tma else "")
    return f"{config.block_m}x{config.block_n}w{config.num_warps}s{config.num_stages}{suffix}"


# --- 1. prepare (CPU) --------------------------------------------------------------------------------


def prepare_specs(family: str, headdims: Iterable[int], dtype: str = "bf16") -> Callable:
    """``capability -> specs`` for :func:`flash_attn.kernel_build.build.build`: for the table and for each
    candidate put in its place, every lean image a call of that head dim needs (the planner's own
    choice: exact-call and folded images, the preprocess and convert kernels that follow the
    forward's config, the split kernels)."""
    from flash_attn.aot import specializations as S  # noqa: PLC0415

    def specs(_capability) -> list:
        out: dict = {}
        for d in headdims:
            block_ds = (configs.padded_headdim(d),)
            for kind, _, config in candidates(family, [d]):
                with configs.overridden(_overrides(kind, family, d, config)):
                    out.update(dict.fromkeys(S.attention_specs(family, dtype, block_ds, with_features=False)))
        return list(out)

    return specs


def prepare(out: Path, arch: str = "90", headdims: Iterable[int] = (64, 128, 256), jobs: Optional[int] = None,
            quiet: bool = False) -> dict:
    """Compile the candidates for ``arch`` (``FLASH_ATTN_CUDA_ARCHS`` syntax) into ``out``."""
    from flash_attn.kernel_build import build as aot_build  # noqa: PLC0415

    cubins, _ = aot_build.resolve_archs(arch)
    family = configs.arch_family(cubins[0].capability)
    headdims = list(headdims)
    report = aot_build.build(out, arch, jobs=jobs, quiet=quiet, specs=prepare_specs(family, headdims))
    listed = [{"kind": k, "head_dim": d, "config": None if c is None else list(c)} for k, d, c in
              candidates(family, headdims)]
    (Path(out) / CANDIDATES_FILE).write_text(json.dumps({"family": family, "arch": arch, "candidates": listed}, indent=1))
    return report


# --- 2. run (GPU) ------------------------------------------------------------------------------------


def _forget_plans(backend: str) -> None:
    importlib.import_module(f"flash_attn.backends.{backend}")._backend.forget_plans()


def _rel_error(ours, ref) -> float:
    ours, ref = ours.detach().float(), ref.detach().float()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-12))


def cuda_timer(fn: Callable, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (``bench gpu``'s event timer)."""
    from flash_attn.bench import gpu  # noqa: PLC0415

    return statistics.median(gpu.cuda_event_timer(fn, warmup, repeats))


def _sdpa(q, k, v, causal: bool, backend_name: str):
    """SDPA with one backend: ``"flash"`` (FA2), ``"cudnn"`` or ``"math"`` (the reference on a CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    from flash_attn.bench import gpu  # noqa: PLC0415

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "math": SDPBackend.MATH}[backend_name]
    with sdpa_kernel(backend):
        return gpu.sdpa_forward(q, k, v, causal)


def run(out: Path, *, device: str = "cuda", backend: str = "aot", family: Optional[str] = None,
        headdims: Iterable[int] = (64, 128, 256), seqlens: Iterable[int] = (4096, 16384), total_tokens: int = 16384,
        hidden: int = 2048, budget_s: float = 420.0, timer: Callable = cuda_timer, reference: str = "flash",
        baselines: Iterable[str] = ("flash", "cudnn"), tolerance: float = 3e-2, ws: str = "include") -> Path:
    """Time every candidate (``ws``: which, see :func:`candidates`); rows go to
    ``out/tune-results.jsonl`` as they are measured, each candidate's announced before it runs
    (so that one which never finishes, hung or crashed with its process, is known: :func:`winners`)."""
    import torch  # noqa: PLC0415

    from flash_attn import dispatch, flash_attn_func  # noqa: PLC0415
    from flash_attn.bench import common  # noqa: PLC0415

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if family is None:
        family = configs.arch_family(torch.cuda.get_device_capability())
    deadline = time.monotonic() + budget_s
    path = out / RESULTS
    env = {"FLASH_ATTN_BACKEND": backend, "FLASH_ATTN_STRICT_BACKEND": "1"}
    saved_env = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with path.open("a") as sink:
            def write(row: dict) -> None:
                sink.write(json.dumps(row) + "\n")
                sink.flush()

            write({"event": "start", "family": family, "backend": backend, "machine": common.machine(), "ws": ws})
            for d in headdims:
                for seqlen in seqlens:
                    for causal in (False, True):
                        if time.monotonic() > deadline:
                            write({"event": "stopped", "reason": f"budget of {budget_s:.0f} s spent"})
                            return path
                        _one_shape(write, family, backend, d, seqlen, total_tokens, hidden, causal, timer,
                                   reference, baselines, tolerance, device, flash_attn_func, dispatch, ws)
            write({"event": "done"})
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _forget_plans(backend)
    return path


def _one_shape(write, family, backend, d, seqlen, total_tokens, hidden, causal, timer, reference, baselines,
               tolerance, device, flash_attn_func, dispatch, ws) -> None:
    import torch  # noqa: PLC0415

    from flash_attn.bench import common  # noqa: PLC0415

    batch, heads = max(1, total_tokens // seqlen), max(1, hidden // d)
    shape = {"head_dim": d, "seqlen": seqlen, "batch": batch, "heads": heads, "causal": causal, "dtype": "bf16"}
    gen = torch.Generator(device=device).manual_seed(seqlen * 1000 + d)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, d, generator=gen, device=device, dtype=torch.bfloat16)
                     for _ in range(4))
    fwd_flops = common.attention_flops(batch, heads, seqlen, seqlen, d, causal)
    bwd_flops = fwd_flops * 2.5

    def grads(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        return o, torch.autograd.grad(o, leaves, dout)

    ref_out, ref_grads = grads(lambda a, b, c: _sdpa(a, b, c, causal, reference))
    for name in baselines:
        try:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            o = _sdpa(*leaves, causal, name)
            fwd_ms = timer(lambda: _sdpa(q, k, v, causal, name))
            bwd_ms = timer(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True))
            write({**shape, "impl": f"sdpa[{name}]", "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
                   "fwd_tflops": fwd_flops / fwd_ms / 1e9, "bwd_tflops": bwd_flops / bwd_ms / 1e9})
        except Exception as exc:  # noqa: BLE001  (a baseline this PyTorch cannot run: say so, go on)
            write({**shape, "impl": f"sdpa[{name}]", "error": f"{type(exc).__name__}: {exc}"[:300]})

    def measure(row: dict, overrides: dict, deterministic: bool, forward: bool) -> None:
        """Check one call of ours against the reference and time it (its forward, or its
        backward), within ``overrides``; the row, with the answer or the error, is written."""
        try:
            with configs.overridden(overrides):
                _forget_plans(backend)
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                o = flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
                g = torch.autograd.grad(o, leaves, dout, retain_graph=True)
                errors = [_rel_error(o, ref_out)] + [_rel_error(a, b) for a, b in zip(g, ref_grads)]
                row.update(backend_ran=dispatch.last_backend(), max_rel_error=max(errors),
                           ok=all(e < tolerance for e in errors))
                if forward:
                    ms = timer(lambda: flash_attn_func(q, k, v, causal=causal))
                    row.update(ms=ms, tflops=fwd_flops / ms / 1e9)
                else:
                    ms = timer(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True))
                    row.update(ms=ms, tflops=bwd_flops / ms / 1e9)
        except Exception as exc:  # noqa: BLE001  (a crashed candidate is a row, not the end of the sweep)
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            _forget_plans(backend)
        write(row)

    for kind, _, config in candidates(family, [d], ws):
        row = {**shape, "impl": "flash_attn", "kind": kind, "config": _config_text(config)}
        write({**shape, "event": "begin", "kind": kind, "config": row["config"]})
        deterministic = kind in configs.SPLIT_BACKWARD_KINDS
        if deterministic:
            row["deterministic"] = True
        measure(row, _overrides(kind, family, d, config), deterministic, kind == "fwd")

    if ws != "only":  # once per shape, after its candidates: deterministic=True as planned (its backward)
        measure({**shape, "impl": "flash_attn[deterministic]"}, {}, True, False)


# --- 3. fold (CPU) ------------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a run cut off mid-line: the rows before it stand
    return rows


def winners(rows: list[dict], pick: Callable = configs.pick) -> list[dict]:
    """Per ``(kind, head dim)``: every candidate's geometric-mean time over the shapes all of them
    were measured on, whether it was correct everywhere, and the winner: for the lean entry over
    every shape; for the exact-call image's entry (bf16, the sweep's dtype; fp16's image takes the
    same tile) over the full-attention shapes, which are the calls that image runs. ``pick``: the
    table's current entries (:func:`configs.pick` of the table folded), which a winner within
    noise does not displace, nor a candidate slower than them on any shape by more than noise
    (one entry serves every length: a sweep at 1k, 4k and 16k changes it only where no length
    loses)."""
    from flash_attn.planning import declarations  # noqa: PLC0415

    start = next((r for r in rows if r.get("event") == "start"), {})
    family = start.get("family")
    groups: dict = {}
    for r in _with_unfinished(rows):
        if r.get("impl") == "flash_attn" and "kind" in r:
            groups.setdefault((r["kind"], r["head_dim"]), []).append(r)
    out = []
    for (kind, d), group in sorted(groups.items()):
        out.append(_winner(kind, family, d, "lean", group, pick))
        kernel = _kernel_of(kind)
        if family and kernel and declarations.get(kernel).ships_exact_image(family, configs.padded_headdim(d), "bf16"):
            out.append(_winner(kind, family, d, "exact", [r for r in group if not r["causal"]], pick))
    return out


def _with_unfinished(rows: list[dict]) -> list[dict]:
    """The measurement rows, and a failed row for each candidate announced (``"begin"``) whose
    measurement never came: its process hung or died there (the window's timeout killed it)."""
    key = lambda r: tuple(r.get(k) for k in ("kind", "head_dim", "config", "seqlen", "causal", "dtype"))  # noqa: E731
    measured, begun = [], {}
    for r in rows:
        if r.get("event") == "begin":
            begun[key(r)] = r
        elif r.get("impl") == "flash_attn" and "kind" in r:
            begun.pop(key(r), None)
            measured.append(r)
    unfinished = [{k: v for k, v in r.items() if k != "event"} | {
        "impl": "flash_attn", "ok": False, "error": "no result: the run ended while this candidate ran (a hang or a crash)"}
        for r in begun.values()]
    return measured + unfinished


def _winner(kind: str, family: Optional[str], d: int, variant: str, group: list[dict], pick: Callable) -> dict:
    shapes_by_config: dict = {}
    for r in group:
        shapes_by_config.setdefault(r["config"], {})[(r["seqlen"], r["causal"])] = r
    common_shapes = set.intersection(*(set(s) for s in shapes_by_config.values())) if shapes_by_config else set()
    scored = []
    for config, by_shape in shapes_by_config.items():
        measured = [by_shape[s] for s in common_shapes]
        # wrong, crashed or hung on any shape (not only the common ones) rules a config out
        ok = bool(measured) and all(r.get("ok") and r.get("ms") for r in measured) and all(
            r.get("ok") for r in by_shape.values())
        mean = math.exp(sum(math.log(r["ms"]) for r in measured) / len(measured)) if ok else None
        scored.append({"config": config, "ok": ok, "geomean_ms": mean, "shapes": len(measured)})
    current = _config_text(pick(kind, d, family, exact=variant == "exact")) if family else None
    base = next((s for s in scored if s["config"] == current and s["ok"]), None)
    if base is not None:  # each candidate's slowest shape against the current entry
        for s in scored:
            s["slowest"] = _slowest_shape(shapes_by_config[s["config"]], shapes_by_config[current], common_shapes)
    # the table serves every length: a candidate slower than the current entry on any shape (beyond
    # noise) does not replace it, however much it gains elsewhere
    good = [s for s in scored if s["ok"] and (s is base or not _slower(s))]
    best = min(good, key=lambda s: s["geomean_ms"]) if good else None
    choose = best
    if best and base and best["geomean_ms"] > base["geomean_ms"] * (1 - MIN_GAIN):
        choose = base  # within noise of the current entry: keep it
    return {"kind": kind, "family": family, "head_dim": d, "variant": variant, "current": current,
            "winner": choose["config"] if choose else None, "candidates": scored}


def _slowest_shape(by_shape: dict, base: dict, shapes: set) -> Optional[tuple]:
    """``(time / the current entry's time, seqlen, causal)`` on the shape where a candidate loses
    most to the current entry (None where it was not measured correctly on them)."""
    ratios = [(by_shape[s]["ms"] / base[s]["ms"], *s) for s in sorted(shapes)
              if by_shape[s].get("ok") and by_shape[s].get("ms") and base[s].get("ms")]
    return max(ratios) if ratios else None


def _slower(scored: dict) -> bool:
    """Whether a candidate is slower than the current entry on some shape beyond noise."""
    slowest = scored.get("slowest")
    return slowest is not None and slowest[0] > 1 + MIN_GAIN


def _parse_config(text: str) -> Optional[configs.Config]:
    if text == "split":
        return None
    m, n, w, s, suffix, red = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(-tma|-ptr|-ws)?(%s)?" % _DQ_TMA_SUFFIX,
                                           text).groups()
    tma, ws = {text: flags for flags, text in _SUFFIXES.items()}[suffix or ""]
    return configs.Config(int(m), int(n), int(w), int(s), tma, ws, bool(red))


def _entry_text(config: Optional[configs.Config]) -> str:
    if config is None:
        return "None"
    tma = "" if config.tma is None else f", tma={config.tma}"
    ws = ", ws=True" if config.ws else ""
    dq_tma = ", dq_tma=True" if config.dq_tma else ""
    return f"_C({config.block_m}, {config.block_n}, {config.num_warps}, {config.num_stages}{tma}{ws}{dq_tma})"


def fold(results: Path, configs_path: Optional[Path] = None, write: bool = True,
         pick: Callable = configs.pick) -> list[dict]:
    """Rewrite the table entries of ``configs_path`` (default: the package's configs module) whose
    winner differs from the current entry (``pick``'s: that table's entries); returns
    :func:`winners`' rows with ``changed`` set. An exact-call entry that equals its lean entry
    (after the fold) is written ``None``."""
    path = Path(configs_path or configs.__file__)
    source = path.read_text()
    rows = winners(read_rows(results), pick)
    lean = {(r["kind"], r["head_dim"]): r["winner"] or r["current"] for r in rows if r["variant"] == "lean"}
    for row in rows:
        row["changed"] = False
        if row["winner"] is None or row["family"] is None:
            continue
        table = _TABLE_NAMES[row["variant"]]
        begin = re.search(rf"^{table}\b.*$", source, re.M)
        pattern = re.compile(r'^(\s*(?:%s\[)?\("%s", "%s"\)\]?(?::| =) \()(.*)(\),?)$'
                             % (table, row["kind"], row["family"]), re.M)
        match = pattern.search(source, begin.start() if begin else len(source))
        if match is None:
            if row["winner"] != row["current"]:
                row["note"] = f"no literal {table} entry to rewrite"
            continue
        entries = _split_entries(match.group(2))
        bucket = configs._bucket(row["head_dim"])
        inherited = row["variant"] == "exact" and row["winner"] == lean.get((row["kind"], row["head_dim"]))
        text = "None" if inherited else _entry_text(_parse_config(row["winner"]))
        if text == entries[bucket]:
            continue
        entries[bucket] = text
        source = source[:match.start(2)] + ", ".join(entries) + source[match.end(2):]
        row["changed"] = True
    if write:
        path.write_text(source)
    return rows


def _split_entries(text: str) -> list[str]:
    """The four comma-separated entries of a table row (commas inside ``_C(...)`` kept)."""
    out, depth, current = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        current += ch
    if current.strip():
        out.append(current.strip())
    return out


def summary(rows: list[dict]) -> str:
    lines = ["| kind | d | image | current | winner | changed | candidates (geomean ms; x: wrong or failed; kept "
             "out: slower than the current entry on a shape) |",
             "| --- | ---: | --- | --- | --- | --- | --- |"]
    for r in rows:
        cands = ", ".join(f"{c['config']} {c['geomean_ms']:.3f}{_slower_text(c)}" if c["ok"] else f"{c['config']} x"
                          for c in r["candidates"])
        image = "exact-call (full attention)" if r["variant"] == "exact" else "lean"
        lines.append(f"| {r['kind']} | {r['head_dim']} | {image} | {r['current']} | {r['winner']} | {r.get('changed')} "
                     f"| {cands} |")
    return "\n".join(lines)


def _slower_text(scored: dict) -> str:
    if not _slower(scored):
        return ""
    ratio, seqlen, causal = scored["slowest"]
    return f" (+{(ratio - 1) * 100:.0f} % at {seqlen} {'causal' if causal else 'full'}: kept out)"


def main(args) -> int:
    step = args.tune_step
    out = Path(args.out)
    headdims = args.headdims or [64, 128, 256]
    if step == "prepare":
        report = prepare(out, args.archs or "90", headdims)
        print(f"compiled {report['totals']['kernels']} images into {out} in {report['totals']['wall_seconds']} s")
        return 0
    if step == "run":
        os.environ.setdefault("FLASH_ATTN_AOT_DIR", str(out.resolve()))
        path = run(out, headdims=headdims, seqlens=args.seqlens or (4096, 16384), budget_s=args.budget_s,
                   ws=args.tune_ws, baselines=() if args.tune_ws == "only" else ("flash", "cudnn"))
        rows = read_rows(path)
        crashed = [r for r in _with_unfinished(rows) if r.get("impl") == "flash_attn" and not r.get("ok")]
        print(summary(winners(rows)))
        return 1 if crashed else 0
    rows = fold(out / RESULTS if out.is_dir() else out, write=not args.dry_run)
    text = summary(rows)
    print(text)
    (out if out.is_dir() else out.parent).joinpath("tune-summary.md").write_text(text + "\n")
    return 0
