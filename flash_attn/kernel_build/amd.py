"""``python -m flash_attn amd-kernels``: every kernel compiled for the AMD families' GPUs, on this
machine, without one (compile only), and the static report of what came out.

On ROCm PyTorch the ``triton`` backend compiles the kernels on first use (nothing ships ahead of
time for AMD). This command compiles, for each AMD family of :mod:`flash_attn.planning.families`
(its first ``gcnArchName`` processor, ``GPUTarget("hip", "gfx942", 64)`` and so on), what the
JIT would compile there:

* every attention kernel x dtype x head-dim bucket the family runs (q, k and v of one head dim,
  head dim 512 too, which the CUDA images ship for some families only), lean and with the score
  features, in the family's launch config (:func:`flash_attn.aot.specializations.attention_launches`
  with ``jit``: the folded flags, a superset of what one call compiles), and the
  ``return_attn_probs`` kernel;
* every KV-cache kernel's superset variants at every head-dim bucket
  (:func:`flash_attn.planning.decode_configs.aot_variants`);
* the ``flash_attn.ops.triton`` kernels (norms, loss, rotary, fused linear), each through its own
  launch code on a representative call (:func:`ops_launches`), compiled the way Triton's JIT
  compiles that call on the target (:func:`compile_launch`).

Each compile's ``amdgcn`` and TTGIR are read by :mod:`flash_attn.kernel_build.amd_report`; the
report (``amd-report.json``) has one row per compile in the build report's style and a summary per
family, with the targets each row misses (:func:`flash_attn.kernel_build.amd_report.target_misses`).
Each row names its launch (``key``) and the kernel source it was compiled from
(``source_digest``): ``--reuse`` keeps an earlier report's row only where both are unchanged.
``--subset`` compiles each kernel once per family (bf16, head dim 128): what ``.ci/run`` runs
(``tests/kernel_build/test_amd_kernels.py``). No AMD GPU has run these kernels; this is what can be
shown without one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from flash_attn.aot import specializations as S
from flash_attn.kernel_build import amd_report, pool
from flash_attn.planning import configs, declarations, decode_configs, families

__all__ = ["AMD_FAMILIES", "jobs_for", "source_digest", "compile_spec", "compile_launch", "ops_launches", "run_job",
           "reusable", "build", "summary", "REPORT"]

AMD_FAMILIES = families.of_vendor("amd")
REPORT = "amd-report.json"
FORMAT = 1
SUBSET_DTYPE, SUBSET_BLOCK_D = "bf16", 128
# The return_attn_probs kernel: JIT only (a testing feature), sized by the forward's config.
PROBS_KERNEL = "attn_probs_kernel"


# --- what is compiled ---------------------------------------------------------------------------


# the AMD knobs of a config as they appear in a job's key, where they differ from Triton's defaults
_KNOB_KEYS = (("waves_per_eu", "wpe", 0), ("matrix_instr_nonkdim", "nonk", 0), ("kpack", "kp", 1))


def _spec_job(family: str, spec: S.Spec, config: configs.Config) -> dict:
    from dataclasses import asdict  # noqa: PLC0415

    knobs = "".join(f".{short}{getattr(config, name)}" for name, short, default in _KNOB_KEYS
                    if getattr(config, name) != default)
    return {"family": family, "source": "spec", "kernel": spec.kernel, "dtype": spec.dtype, "block_d": spec.block_d,
            "features": declarations.get(spec.kernel).has_features and bool(dict(spec.flags).get("HAS_SOFTCAP")),
            "key": spec.key + knobs, "source_digest": source_digest(S.kernel_function(spec.kernel)),
            "spec": {**asdict(spec), "flags": [list(x) for x in spec.flags]}, "config": list(config)}


def _probs_launch(family: str, dtype: str, block_d: int) -> tuple[S.Spec, configs.Config]:
    """The ``return_attn_probs`` kernel as the JIT compiles it for a plain call of ``block_d``."""
    config = configs.pick("fwd", block_d, family)
    decl = declarations.get(PROBS_KERNEL)
    flags = dict(IS_LOCAL=False, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, IS_PAGED=False,
                 PAD_HEADDIM=False, AlibiSlopes=None, DropoutSeed=None, BlockTable=None)
    return S.Spec.of(PROBS_KERNEL, dtype, {**flags, **decl.tile_constexprs(block_d, config, family)}, config), config


def jobs_for(family: str, dtypes=S.DTYPES, subset: bool = False) -> list[dict]:
    """The compile jobs of ``family``: every kernel x dtype x head-dim bucket (``subset``: each
    kernel once, bf16, head dim 128, lean)."""
    jobs = []
    for dtype in dtypes:
        launches = S.attention_launches(family, dtype, jit=True)
        launches += [_probs_launch(family, dtype, d) for d in configs.HEADDIM_BUCKETS
                     if configs.refusal(d, family) is None]
        decode = decode_configs.aot_variants(family, decode_configs.HEADDIM_BUCKETS)
        launches += [(S.Spec.of(kernel, dtype, constexprs, config), config) for kernel, constexprs, config in decode
                     if configs.refusal(constexprs["BLOCK_D"], family) is None]
        jobs += [_spec_job(family, spec, config) for spec, config in launches]
        jobs += [{"family": family, "source": "ops", "kernel": name, "dtype": dtype, "block_d": None,
                  "features": False, "key": f"{name}.{dtype}.{_launch_digest(kwargs)}",
                  "source_digest": source_digest(kernel)}
                 for name, (kernel, kwargs) in ops_launches(dtype).items()]
    if subset:
        jobs = _subset(jobs)
    return jobs


def _subset(jobs: list[dict]) -> list[dict]:
    """Each kernel once: the first lean bf16 job of head dim 128 (the ops kernels: their bf16 one)."""
    chosen: dict = {}
    for job in jobs:
        if job["dtype"] != SUBSET_DTYPE or job["features"] or job["block_d"] not in (None, SUBSET_BLOCK_D):
            continue
        chosen.setdefault(job["kernel"], job)
    return list(chosen.values())


# --- the ops.triton kernels: one representative call each, recorded from their launch code ----------


def _recorded(module, call: Callable) -> list:
    """``(kernel, kwargs)`` of every launch ``call`` makes through ``module._launch`` (not run)."""
    launches = []

    def record(kernel, grid, *device, **kwargs):
        launches.append((kernel, kwargs))

    saved = module._launch
    module._launch = record
    try:
        call()
    finally:
        module._launch = saved
    return launches


def _norm_launches(dtype):
    import torch  # noqa: PLC0415

    from flash_attn.ops.triton import layer_norm as ln  # noqa: PLC0415

    m, n = 64, 1024
    x, residual, dy = (torch.randn(m, n, dtype=dtype) for _ in range(3))
    weight, bias = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
    # LayerNorm with a residual, bias and dropout (its mask stored): every branch a training step takes
    forward = _recorded(ln, lambda: ln._fused_norm_forward._init_fn(
        x, weight, bias, residual, None, None, None, None, 1e-5, 0.1, False, False, True, dtype, dtype))
    mean, rstd = torch.zeros(m), torch.ones(m)
    seeds = torch.zeros(m, dtype=torch.int64)
    backward = _recorded(ln, lambda: ln._fused_norm_backward._init_fn(
        dy, None, dy, x, weight, bias, None, None, mean, rstd, None, seeds, 0.1, True, False, False, False, dtype))
    return {"norm_forward_kernel": forward[0], "norm_backward_kernel": backward[0]}


def _loss_launches(dtype):
    import torch  # noqa: PLC0415

    from flash_attn.ops.triton import cross_entropy as ce  # noqa: PLC0415

    logits, labels = torch.randn(16, 8192, dtype=dtype), torch.zeros(16, dtype=torch.int64)
    lse, row_grad = torch.zeros(16), torch.ones(16)
    stats = _recorded(ce, lambda: ce._row_stats_triton(logits, labels, 0, 1.0, True, True))
    grad = _recorded(ce, lambda: ce._grad_triton(torch.empty_like(logits), logits, labels, lse, row_grad, 0, 1.0,
                                                 1e-4, 0.1, 8192))
    return {"_row_stats_kernel": stats[0], "_grad_kernel": grad[0]}


def _rotary_launches(dtype):
    import torch  # noqa: PLC0415

    from flash_attn.ops.triton import rotary  # noqa: PLC0415

    x = torch.randn(2, 256, 8, 128, dtype=dtype)
    cos, sin = torch.randn(256, 64, dtype=dtype), torch.randn(256, 64, dtype=dtype)
    launches = _recorded(rotary, lambda: rotary._rotate_triton(x, cos, sin, 0, None, 256, False, False, False))
    return {"_rotary_kernel": launches[0]}


def _linear_launches(dtype):
    import torch  # noqa: PLC0415

    from flash_attn.ops.triton import linear  # noqa: PLC0415

    x, weight, bias = torch.randn(256, 512, dtype=dtype), torch.randn(1024, 512, dtype=dtype), torch.randn(1024, dtype=dtype)
    act = _recorded(linear, lambda: linear._linear_act_triton(x, weight, bias, "gelu_approx", True))
    g = torch.randn(256, 1024, dtype=dtype)
    dgrad = _recorded(linear, lambda: linear._dgrad_act_triton(g, weight, "gelu_approx", g))
    return {"_linear_act_kernel": act[0], "_dgrad_act_kernel": dgrad[0]}


_OPS_GROUPS = (_norm_launches, _loss_launches, _rotary_launches, _linear_launches)


def source_digest(kernel) -> str:
    """A digest of what a jitted kernel is compiled from: its source, the source of every jitted
    function it calls and the constexpr globals it reads (Triton's own cache key of the function,
    which also names its first line). A job's key names the launch; this names the code, so that
    ``--reuse`` compiles a changed kernel again."""
    while not hasattr(kernel, "cache_key") and hasattr(kernel, "fn"):  # autotuner / heuristics wrappers
        kernel = kernel.fn
    return kernel.cache_key[:16]


def _launch_digest(kwargs: dict) -> str:
    """A short digest of what a recorded launch compiles from: its tensors' dtypes and every other
    argument's value (the sizes and strides among them: Triton specialises on their divisibility),
    so that a changed launch is a new job."""
    import torch  # noqa: PLC0415

    described = sorted((name, str(value.dtype) if isinstance(value, torch.Tensor) else repr(value))
                       for name, value in kwargs.items())
    return hashlib.sha1(json.dumps(described).encode()).hexdigest()[:6]


def ops_launches(dtype: str) -> dict:
    """``name -> (kernel, kwargs)``: the launch each ``flash_attn.ops.triton`` kernel gets from its
    own launch code for a representative ``dtype`` call (recorded, not run; CPU tensors)."""
    import torch  # noqa: PLC0415

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    out = {}
    for group in _OPS_GROUPS:
        out.update(group(torch_dtype))
    return out


# --- compiling -----------------------------------------------------------------------------------------


def _target(family: str):
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    return GPUTarget(*families.triton_target(family))


def compile_spec(spec: S.Spec, config: configs.Config, family: str):
    """``spec`` compiled for ``family``'s GPU with ``config``'s compiler options (the declared
    argument types and divisibility, as the ahead-of-time build compiles)."""
    import triton  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    sig, attrs = S.signature(spec)
    src = ASTSource(S.kernel_function(spec.kernel), sig, constexprs=spec.constexprs, attrs=attrs)
    return triton.compile(src, target=_target(family), options=configs.compiler_options(config, family))


def compile_launch(kernel, kwargs: dict, family: str):
    """The launch ``kernel[grid](**kwargs)`` compiled the way Triton's JIT compiles it on a GPU of
    ``family`` (its argument specialisation for these values, its options from ``kwargs``), without
    the GPU: the JIT's binder for the target's backend, then ``triton.compile`` for the target."""
    import triton  # noqa: PLC0415
    from triton.compiler import ASTSource, make_backend  # noqa: PLC0415
    from triton.runtime.jit import create_function_from_signature  # noqa: PLC0415

    target = _target(family)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)  # what JITFunction.run adds when debugging is off
    bound, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


# what a report row repeats of its job
_JOB_FIELDS = ("family", "kernel", "dtype", "block_d", "features", "key", "source", "source_digest")


def _row(job: dict, compiled, seconds: float) -> dict:
    family = families.get(job["family"])
    kind = declarations.KERNELS[job["kernel"]].config_kind if job["kernel"] in declarations.KERNELS else None
    block_n = job["spec"]["block_n"] if job["source"] == "spec" else 0
    row = {k: job[k] for k in _JOB_FIELDS}
    row.update(arch=families.triton_target(job["family"])[1], compile_seconds=round(seconds, 2),
               num_warps=int(compiled.metadata.num_warps), num_stages=int(compiled.metadata.num_stages))
    row["config"] = _config(job)
    row.update(amd_report.analyse(compiled.asm.get("ttgir", ""), compiled.asm.get("amdgcn", ""), kind=kind,
                                  block_n=block_n, num_warps=int(compiled.metadata.num_warps),
                                  wave_size=family.wave_size, lds=int(compiled.metadata.shared),
                                  lds_limit=family.shared_memory))
    row["misses"] = amd_report.target_misses(row)
    return row


def _config(job: dict) -> Optional[dict]:
    """The launch config of a spec job as its report row records it (``None`` for the ops)."""
    if job["source"] != "spec":
        return None
    config = configs.Config(*job["config"])
    return {name: getattr(config, name) for name in ("block_m", "block_n", "waves_per_eu", "matrix_instr_nonkdim",
                                                     "kpack")}


def run_job(job: dict) -> dict:
    """Compile one job; its report row (a failed compile is a row with ``error`` and a miss)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the value the kernels are tuned with
    start = time.perf_counter()
    try:
        if job["source"] == "spec":
            spec = S.Spec(**{**job["spec"], "flags": tuple(tuple(x) for x in job["spec"]["flags"])})
            compiled = compile_spec(spec, configs.Config(*job["config"]), job["family"])
        else:
            kernel, kwargs = ops_launches(job["dtype"])[job["kernel"]]
            compiled = compile_launch(kernel, kwargs, job["family"])
    except Exception as exc:  # noqa: BLE001
        row = {k: job[k] for k in _JOB_FIELDS}
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        return {**row, "error": message[:500], "misses": [f"does not compile: {message[:300]}"]}
    return _row(job, compiled, time.perf_counter() - start)


# --- the build -----------------------------------------------------------------------------------------


def build(family_names=AMD_FAMILIES, dtypes=S.DTYPES, subset: bool = False, jobs: Optional[int] = None,
          quiet: bool = False, fresh_cache: bool = True, reuse: Optional[dict] = None) -> dict:
    """Compile every job of ``family_names`` in ``jobs`` processes; the report (rows and summary).
    ``reuse``: an earlier report of the same Triton, whose rows of the same jobs (family, key and
    kernel source: :func:`reusable`) are kept instead of compiled again."""
    import triton  # noqa: PLC0415

    from flash_attn.kernel_build.build import _fresh_triton_cache  # noqa: PLC0415

    work = [job for family in family_names for job in jobs_for(family, dtypes, subset)]
    kept = reusable(work, reuse, triton.__version__) if reuse is not None else {}
    work = [j for j in work if (j["family"], j["key"]) not in kept]
    workers = int(jobs or os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
    start = time.time()
    with _fresh_triton_cache(fresh_cache):
        progress = pool.Progress(len(work), quiet, desc="amd-kernels")
        try:
            rows = _run(work, workers, progress)
        finally:
            progress.close()
    rows += list(kept.values())
    rows.sort(key=lambda r: (r["family"], r["kernel"], r["dtype"], r["block_d"] or 0, r["features"], r["key"]))
    return {"format": FORMAT, "triton": triton.__version__, "subset": subset, "jobs": workers, "reused": len(kept),
            "wall_seconds": round(time.time() - start, 1), "families": summary(rows), "kernels": rows}


def reusable(work: list, earlier: dict, triton_version: str) -> dict:
    """``(family, key) -> row`` of the rows of ``earlier`` (a report) that ``work``'s jobs may keep
    instead of compiling again: compiled without error by the same Triton, for the same launch (key
    and config) of the same kernel source (:func:`source_digest`)."""
    if earlier.get("triton") != triton_version:
        return {}
    rows = {(r["family"], r["key"]): r for r in earlier["kernels"] if "error" not in r}
    kept = {}
    for job in work:
        row = rows.get((job["family"], job["key"]))
        if row is not None and row.get("config") == _config(job) and row.get("source_digest") == job["source_digest"]:
            kept[(job["family"], job["key"])] = row
    return kept


def _run(work: list, workers: int, progress: pool.Progress) -> list:
    return [row for _, row in pool.completed(run_job, work, workers, progress, _label, in_process=True)]


def _label(job: dict) -> str:
    return f"{job['kernel']} {job['dtype']} d{job['block_d']} {job['family']}"


def summary(rows: list) -> dict:
    """Per family: its target, the images, how many meet the targets, and the numbers the targets
    are about (matrix instructions, LDS, scratch by head dim, occupancy, float atomics)."""
    out = {}
    for name in dict.fromkeys(r["family"] for r in rows):
        family = families.get(name)
        mine = [r for r in rows if r["family"] == name]
        built = [r for r in mine if "error" not in r]
        with_products = [r for r in built if r["dots"]]
        scratch = [r for r in built if r.get("spill_bytes")]
        out[name] = {
            "arch": families.triton_target(name)[1],
            "wave_size": family.wave_size,
            "mma": family.mma,
            "lds_limit": family.shared_memory,
            "images": len(mine),
            "failed": len(mine) - len(built),
            "meeting_targets": sum(1 for r in mine if not r["misses"]),
            "with_products": len(with_products),
            "products_on_matrix_cores": sum(1 for r in with_products if r["mma_families"] == [family.mma]),
            "max_lds": max((r["dynamic_shared"] for r in built), default=0),
            "with_scratch": len(scratch),
            "max_scratch_by_block_d": {str(d): max((r["spill_bytes"] or 0 for r in built if r["block_d"] == d),
                                                   default=0)
                                       for d in sorted({r["block_d"] for r in built if r["block_d"]})},
            "min_occupancy": min((r["occupancy"] for r in built if r.get("occupancy")), default=None),
            "fp32_atomics": sorted({r["fp32_atomics"] for r in built if r.get("fp32_atomics")}),
            "compile_seconds": round(sum(r.get("compile_seconds", 0) for r in built), 1),
        }
    return out


def render(report: dict) -> str:
    """The summary as text: one block per family, then every row that misses a target."""
    lines = []
    for name, s in report["families"].items():
        scratch = ", ".join(f"d{d} {b} B" for d, b in s["max_scratch_by_block_d"].items())
        lines.append(f"{name} ({s['arch']}, wave{s['wave_size']}, {s['mma']}, LDS {s['lds_limit'] // 1024} KB): "
                     f"{s['images']} images, {s['meeting_targets']} meet the targets, {s['failed']} failed")
        lines.append(f"  products on {s['mma']}: {s['products_on_matrix_cores']} of {s['with_products']} images; "
                     f"LDS at most {s['max_lds']} B; most scratch per head dim: {scratch}; "
                     f"{s['with_scratch']} images with scratch; least occupancy {s['min_occupancy']} waves/SIMD; "
                     f"fp32 atomics {', '.join(s['fp32_atomics']) or 'none'}")
    for row in report["kernels"]:
        if row["misses"]:
            lines.append(f"MISS {row['family']} {row['key']}: {'; '.join(row['misses'])}")
    return "\n".join(lines)


# --- CLI (flash_attn.__main__ conventions) --------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--families", default=",".join(AMD_FAMILIES),
                        help=f"AMD families, comma-separated (default: all: {', '.join(AMD_FAMILIES)})")
    parser.add_argument("--dtypes", default=",".join(S.DTYPES), help="fp16,bf16 (default: both)")
    parser.add_argument("--subset", action="store_true",
                        help=f"each kernel once per family ({SUBSET_DTYPE}, head dim {SUBSET_BLOCK_D}): what CI runs")
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile processes (default: CPUs)")
    parser.add_argument("--output", "-o", default=REPORT, help=f"the report (default: ./{REPORT})")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    parser.add_argument("--reuse", default=None,
                        help="an earlier report: its rows of unchanged jobs are kept, the rest compiled")


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in AMD_FAMILIES]
    if unknown:
        print(f"unknown AMD families {unknown}; known: {', '.join(AMD_FAMILIES)}", file=sys.stderr)
        return 2
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    reuse = json.loads(Path(args.reuse).read_text()) if args.reuse else None
    report = build(names, dtypes, args.subset, args.jobs, args.quiet, reuse=reuse)
    Path(args.output).write_text(json.dumps(report, indent=1, sort_keys=True))
    print(render(report))
    print(f"{sum(s['images'] for s in report['families'].values())} images in {report['wall_seconds']:.0f} s "
          f"({report['jobs']} processes); report: {args.output}")
    return 1 if any(row["misses"] for row in report["kernels"]) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m flash_attn.kernel_build.amd")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
