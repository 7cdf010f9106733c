"""``python -m flash_attn build-kernels``: compile the ahead-of-time kernels (no GPU needed).

Compiles every specialisation of :mod:`flash_attn.aot.specializations` for each architecture
of ``--archs`` / ``FLASH_ATTN_CUDA_ARCHS`` (default
:func:`~flash_attn.aot.archs.default_cuda_archs`, the recipe's; ``native``: the local GPU) with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))``, in ``--jobs`` worker
processes (``MAX_JOBS``, default: the CPU count). A family target (``sm_100f``, ``sm_110f``,
``sm_120f``) costs no compile of its own: ptxas assembles the PTX of the family's compile for it
(:func:`assemble`). Writes into the output folder (default ``flash_attn/_aot/`` of the package):

* ``images/<arch>/<spec>.cubin.zlib`` per architecture, plus ``images/compute_80/<spec>.ptx.zlib``:
  the sm_80 PTX of every kernel, which the driver compiles for GPUs newer than every cubin (all
  images zlib-compressed, inflated by :func:`flash_attn.aot.library.register_kernel`);
* ``manifest.json``: per image, the spec and everything the launcher needs, taken from Triton's
  metadata (:func:`flash_attn.aot.library.manifest_entry`);
* ``build-report.json``: per image, registers / spills (``STACK``/``LOCAL``) / shared bytes from
  ``cuobjdump --dump-resource-usage``, the MMA families of its PTX and of its SASS (``mma``: read
  from the SASS of kernels with a stack frame, else what the PTX's assemble to), compile seconds,
  and the static quality report of :mod:`flash_attn.kernel_build.kernel_report` (per product: MMA family,
  instruction N, replication; products per step, keys per dK/dV program, spills inside loops,
  CTAs per SM, TMA, wgmma waits); totals (kernel count, wall seconds, peak RSS of the build's
  process tree, bytes).

``TRITON_PTXAS_PATH`` pins ptxas (also for sm_90+ unless ``TRITON_PTXAS_BLACKWELL_PATH`` is set:
Triton 3.9 uses that second tool from sm_90 on); the ptxas used per architecture is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple, Optional

from flash_attn import limits
from flash_attn.aot import library as op_library, specializations as S
from flash_attn.aot.archs import Arch, default_cuda_archs, parse_arch, parse_arch_list
from flash_attn.kernel_build import kernel_report, pool
from flash_attn.kernel_build.pool import Progress
from flash_attn.planning import configs, declarations

ARCHS_ENV = "FLASH_ATTN_CUDA_ARCHS"
MANIFEST = "manifest.json"
REPORT = "build-report.json"
FORMAT = 1


def default_output_dir() -> Path:
    """The package's ``flash_attn/_aot/``, where :func:`flash_attn.aot.manifest.find_manifest_dir` looks."""
    return Path(__file__).resolve().parents[1] / "_aot"


# --- architectures --------------------------------------------------------------------------------


def resolve_archs(text: Optional[str]) -> tuple[list, list]:
    """``(cubin archs, ptx archs)`` (:class:`~flash_attn.aot.archs.Arch`) of ``FLASH_ATTN_CUDA_ARCHS``.

    Empty: the declared targets (:func:`~flash_attn.aot.archs.default_cuda_archs`, the recipe's),
    less the family targets this ptxas cannot assemble (an older toolkit); the same when the list
    given is the declared one (the recipe passes it to every CUDA build, 12.9's included).
    ``native`` is the local GPU. A bare number from
    sm_90 on means Triton's arch-specific target (``90`` -> ``sm_90a``). The lowest cubin
    architecture also gets PTX (driver JIT on future GPUs) unless PTX was asked for explicitly,
    when it is portable (below sm_90)."""
    text = (text or "").strip()
    declared = default_cuda_archs()
    default = not text or (bool(declared) and text.lower() != "native" and parse_arch_list(text) == parse_arch_list(declared))
    if text.lower() == "native":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise SystemExit(f"{ARCHS_ENV}=native needs a visible CUDA GPU (none here); name architectures, e.g. 80;90")
        major, minor = torch.cuda.get_device_capability()
        text = f"{major}{minor}"
    wanted = [a if a.suffix or a.ptx or a.major < 9 else Arch(a.major, a.minor, "a")
              for a in parse_arch_list(text or None)]
    for arch in wanted:
        if arch.capability < limits.MIN_CAPABILITY:
            raise SystemExit(f"architecture sm_{arch.major}{arch.minor} is below the kernels' minimum "
                             f"sm_{limits.MIN_CAPABILITY[0]}{limits.MIN_CAPABILITY[1]}")
    families = [a for a in wanted if a.suffix == "f" and not a.ptx]
    if families:
        missing = [a for a in families if a.name not in ptxas_targets(triton_capability(a))]
        if missing and not default:
            raise SystemExit(f"the ptxas this build uses cannot assemble {', '.join(a.name for a in missing)} "
                             f"(a newer CUDA toolkit can; or leave them out of {ARCHS_ENV})")
        wanted = [a for a in wanted if a not in missing]
    cubins = sorted({a for a in wanted if not a.ptx})
    ptxs = sorted({a for a in wanted if a.ptx})
    for arch in ptxs:
        if arch.major >= 9:
            # Triton's PTX from sm_90 on targets that exact GPU (wgmma, tcgen05): it is no portable PTX
            raise SystemExit(f"{arch.name}: only PTX of a portable target (below sm_90, e.g. compute_80) runs on later GPUs")
    if not ptxs and cubins and min(cubins).major < 9:
        low = min(cubins)
        ptxs = [Arch(low.major, low.minor, ptx=True)]
    return cubins, ptxs


def triton_capability(arch) -> int:
    """The target Triton compiles an image of ``arch`` from (``GPUTarget("cuda", cap)``): the arch
    itself, and for a family target (``sm_110f``) the capability whose launch configs the family's
    GPUs use (configs.arch_family), so that one PTX feeds every image of the family group."""
    if arch.suffix != "f":
        return arch.major * 10 + arch.minor
    major, minor = S.family_capability(configs.arch_family(arch.capability))
    return major * 10 + minor


_targets: dict[str, frozenset] = {}


def ptxas_targets(cap: int) -> frozenset:
    """The ``sm_*`` targets the ptxas Triton uses for ``cap`` knows (its ``--help`` lists them)."""
    path = ptxas_for(cap).get("path")
    if path not in _targets:
        try:
            text = subprocess.run([path, "--help"], capture_output=True, text=True, check=False).stdout
        except (OSError, TypeError):
            text = ""
        _targets[path] = frozenset(re.findall(r"\bsm_\d+[af]?\b", text))
    return _targets[path]


def ptxas_for(cap: int) -> dict:
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415

        tool = get_ptxas(cap)
        return {"path": tool.path, "version": tool.version}
    except Exception as exc:  # noqa: BLE001
        return {"path": None, "error": str(exc)}


def _pin_ptxas() -> None:
    pinned = os.environ.get("TRITON_PTXAS_PATH")
    if pinned and not os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"):
        os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = pinned
    # Triton 3.9 warns once per process that its FP-fusion default will change; state the value
    # the kernels were tuned with (fused multiply-adds on), which also silences the warning.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


# --- one compile job (runs in a worker process) ---------------------------------------------------

_MMA_SASS = (("UTC*MMA", re.compile(r"\bUTC\w*MMA")), ("HGMMA", re.compile(r"\bHGMMA\b")),
             ("HMMA", re.compile(r"\bHMMA\b")))
_MMA_PTX = (("tcgen05.mma", "tcgen05.mma"), ("wgmma", "wgmma.mma_async"), ("mma.sync", "mma.sync"))
# the SASS instructions each PTX family assembles to (ptxas refuses PTX a target cannot run)
_PTX_TO_SASS = {"tcgen05.mma": "UTC*MMA", "wgmma": "HGMMA", "mma.sync": "HMMA"}


def cuobjdump_path() -> Optional[str]:
    try:
        import triton  # noqa: PLC0415

        candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def resource_usage(cubin: Path, cuobjdump: Optional[str], disassemble: bool = True) -> dict:
    """Registers, spills and shared memory of a cubin's kernel; with ``disassemble`` also
    :func:`disassembly`'s fields (``sass_mma`` is ``None`` without)."""
    if cuobjdump is None:
        return {"error": "cuobjdump not found"}
    out: dict = {"sass_mma": None}
    text = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                          check=False).stdout
    for field_name in ("REG", "STACK", "SHARED", "LOCAL"):
        match = re.search(rf"\b{field_name}:(\d+)", text)
        if match:
            out[field_name.lower()] = int(match.group(1))
    if disassemble:
        out.update(disassembly(cubin, cuobjdump))
    return out


def disassembly(cubin: Path, cuobjdump: str) -> dict:
    """The SASS MMA families of a cubin's kernel and (key ``"_sass"``, not reported) the SASS
    itself. Costs ~0.4 s a cubin (the disassembler's start, whatever the kernel's size): a fifth
    of the default build's CPU when done for every image."""
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=False).stdout
    return {"sass_mma": [name for name, pattern in _MMA_SASS if pattern.search(sass)], "_sass": sass}


def static_report(spec, compiled, usage: dict, cap: int, products: list) -> dict:
    """:func:`flash_attn.kernel_build.kernel_report.analyse` of one image (its cubin's SASS and resources;
    ``products``: the compile's :func:`~flash_attn.kernel_build.kernel_report.dots`)."""
    decl = declarations.get(spec.kernel)
    family = configs.arch_family((cap // 10, cap % 10))
    return kernel_report.analyse(
        compiled.asm.get("ttgir", ""), compiled.asm.get("ptx", ""), usage.get("_sass", ""), kind=decl.config_kind,
        block_m=spec.block_m, block_n=spec.block_n, num_warps=int(compiled.metadata.num_warps),
        shared=int(compiled.metadata.shared), regs=usage.get("reg"), stack=usage.get("stack"),
        shared_limit=configs.SHARED_MEMORY_LIMIT[family], found=products)


def _write_image(path: Path, data: bytes) -> Path:
    """Stores an image compressed (``<path>.zlib``; the launcher inflates it when it registers the
    kernel): cubins and PTX shrink 4-6x, which keeps every variant of four architectures inside the
    package budget."""
    out = path.with_name(path.name + op_library.COMPRESSED_SUFFIX)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(op_library.compress_image(data))
    return out


def assemble(ptx: str, arch: str, cap: int, fp_fusion: bool = True) -> bytes:
    """``ptx`` (Triton's, for ``sm_<cap>``) assembled as a cubin for ``arch`` by the same ptxas
    with Triton's options (``fp_fusion``: the compile's ``enable_fp_fusion``, else
    ``--fmad=false``): how one compile serves a whole family (``sm_100f`` runs on 10.0 and
    10.3, ``sm_120f`` on 12.0 and 12.1). ptxas refuses PTX that uses an instruction the target
    lacks, so an image that assembles is one the target runs."""
    tool = ptxas_for(cap)["path"]
    retargeted = re.sub(r"^\.target\s+\w+", f".target {arch}", ptx, count=1, flags=re.M)
    line_info = ["-lineinfo", "-suppress-debug-info"] if os.environ.get("TRITON_DISABLE_LINE_INFO") == "1" else ["-lineinfo"]
    fmad = [] if fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(retargeted)
        result = subprocess.run([tool, *line_info, *fmad, "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src), "-o",
                                 str(out)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"ptxas could not assemble the sm_{cap} PTX for {arch}: {result.stderr.strip()[:400]}")
        return out.read_bytes()


@contextlib.contextmanager
def _triton_assembles_for(arch: Optional[str], cap: int):
    """Makes Triton's last stage (ptxas) assemble for ``arch``, a family target such as
    ``sm_100f``, rather than for its own ``sm_100a``, which the build would throw away: one ptxas
    run per image instead of two (ptxas is 15-20 % of a compile). Through Triton's pipeline hook
    (``knobs.runtime.add_stages_inspection_hook``). Yields a set that holds ``arch`` once
    Triton's cubin is for it; without the hook Triton assembles as usual."""
    from triton import knobs  # noqa: PLC0415

    assembled_for: set = set()
    runtime = getattr(knobs, "runtime", None)
    if arch is None or not arch.endswith("f") or not hasattr(runtime, "add_stages_inspection_hook"):
        yield assembled_for
        return

    def hook(*args):
        if not args:  # Triton 3.9 asks for a cache key: the target makes the cubin differ
            return f"flash_attn-cubin-{arch}", arch
        _backend, stages, options = args[:3]

        def family_cubin(ptx, metadata):
            cubin = assemble(ptx, arch, cap, options.enable_fp_fusion)
            assembled_for.add(arch)
            return cubin

        stages["cubin"] = family_cubin
        return None

    previous = runtime.add_stages_inspection_hook
    runtime.add_stages_inspection_hook = hook
    try:
        yield assembled_for
    finally:
        runtime.add_stages_inspection_hook = previous


def job_spec(spec: S.Spec) -> dict:
    """``spec`` as a compile job carries it to a worker process (plain lists and dicts);
    :func:`compile_job` makes the spec again."""
    from dataclasses import asdict  # noqa: PLC0415

    return {**asdict(spec), "flags": [list(x) for x in spec.flags]}


def compile_job(job: dict) -> dict:
    """Compile one spec for one target; write its images; return manifest and report rows."""
    _pin_ptxas()
    import resource  # noqa: PLC0415

    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415


    spec = S.Spec(**{**job["spec"], "flags": tuple(tuple(x) for x in job["spec"]["flags"])})
    cap = job["cap"]
    out_dir = Path(job["out"])
    fn = S.kernel_function(spec.kernel)
    sig, attrs = S.signature(spec)
    src = ASTSource(fn, sig, constexprs=spec.constexprs, attrs=attrs)
    start = time.perf_counter()
    try:
        with _triton_assembles_for(job["cubins"][0] if job["cubins"] else None, cap) as assembled_for:
            compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                                      options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"compiling {spec.key} for sm_{cap} failed: {type(exc).__name__}: {exc}") from None
    seconds = time.perf_counter() - start
    entry = op_library.manifest_entry(compiled, src)
    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    cubin_arch = next(iter(assembled_for), target.group(1) if target else f"sm_{cap}")  # Triton's cubin's
    ptx_mma = [name for name, needle in _MMA_PTX if needle in ptx]
    products = kernel_report.dots(compiled.asm.get("ttgir", ""))
    if any(d["family"] != "fma" for d in products) and not ptx_mma:
        # Triton emits an empty kernel when the tiles overflow tensor memory (sm100): it would run
        # and return zeros; a build must not ship it
        raise RuntimeError(f"compiling {spec.key} for sm_{cap}: tensor-core products in the TTGIR but "
                           f"none in the PTX (an empty kernel: tiles too large for tensor memory?)")
    isa = re.search(r"^\.version\s+(\d+\.\d+)", ptx, re.M)
    features = bool(dict(spec.flags).get("HAS_SOFTCAP"))  # the score-features variant
    rows = []
    # what a driver needs to load the images: a cubin the CUDA major release of the ptxas that
    # built it, PTX its ISA version (flash_attn.backends.aot never picks an image it cannot load)
    base = {"key": spec.key, "kernel": spec.kernel, "spec": job["spec"], "constexprs": spec.constexprs,
            "num_stages": spec.num_stages, "target": cap, "ptxas": ptxas_for(cap).get("version"),
            "ptx_isa": isa.group(1) if isa else None, **entry}
    common = {"key": spec.key, "kernel": spec.kernel, "ptx_mma": ptx_mma, "dtype": spec.dtype,
              "block_d": spec.block_d, "block_dv": int(dict(spec.flags).get("BLOCK_DV", spec.block_d)),
              "features": features}
    for arch in job["cubins"]:
        assembled = 0.0
        if arch == cubin_arch:
            cubin = compiled.asm["cubin"]
        else:  # another target of the same compile (sm_110f from sm_100's): Triton's PTX, assembled
            begin = time.perf_counter()
            cubin = assemble(ptx, arch, cap, compiled.metadata.enable_fp_fusion)
            assembled = time.perf_counter() - begin
        with tempfile.TemporaryDirectory() as tmp:  # cuobjdump reads a file
            raw = Path(tmp) / f"{spec.key}.cubin"
            raw.write_bytes(cubin)
            # the SASS says where a kernel spills: read where it has a stack frame (without one
            # there is no spill instruction to find)
            usage = resource_usage(raw, job.get("cuobjdump"), disassemble=False)
            if usage.get("stack") or usage.get("local"):
                usage.update(disassembly(raw, job["cuobjdump"]))
        # its tensor-core instructions: the SASS's where read, else those its PTX assembles to
        usage["mma"] = (usage["sass_mma"] if usage.get("sass_mma") is not None
                        else sorted({_PTX_TO_SASS[name] for name in ptx_mma}))
        usage.update(static_report(spec, compiled, usage, cap, products))
        usage.pop("_sass", None)
        path = _write_image(out_dir / "images" / arch / f"{spec.key}.cubin", cubin)
        rows.append(({**base, "arch": arch, "image": str(path.relative_to(out_dir))},
                     {**common, "arch": arch, "image": "cubin", "bytes": path.stat().st_size, "raw_bytes": len(cubin),
                      "compile_seconds": round(seconds + assembled, 2), **usage}))
        seconds = 0.0  # the Triton compile is counted once per spec
    for arch in job["ptx"]:
        path = _write_image(out_dir / "images" / arch / f"{spec.key}.ptx", ptx.encode())
        rows.append(({**base, "arch": arch, "image": str(path.relative_to(out_dir))},
                     {**common, "arch": arch, "image": "ptx", "bytes": path.stat().st_size,
                      "raw_bytes": len(ptx.encode()), "compile_seconds": round(seconds, 2)}))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return {"rows": rows, "worker_rss_mb": rss}


def report_row(spec: S.Spec, arch: str) -> dict:
    """The build-report row of ``spec``'s cubin for ``arch`` (``"sm_80"``, ``"sm_120f"``, ...),
    compiled into a scratch folder as the build compiles it: one candidate's static report
    without the whole build (sweeps, the static tests)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = compile_job({"spec": job_spec(spec), "cap": triton_capability(parse_arch(arch)), "out": tmp,
                              "cubins": [arch], "ptx": [], "cuobjdump": cuobjdump_path()})
    return result["rows"][0][1]


# --- the build ------------------------------------------------------------------------------------


def plan(cubins: list, ptxs: list, specs=None) -> list[dict]:
    """One job per specialisation and Triton target: every image built from that compile (the
    cubins of the archs it feeds, the PTX). ``specs``: capability -> specialisations (default:
    what the package ships, :func:`~flash_attn.aot.specializations.specs_for_capability`)."""
    groups: dict[int, dict] = {}
    for arch in cubins:
        groups.setdefault(triton_capability(arch), {"cubins": [], "ptx": []})["cubins"].append(arch.name)
    for arch in ptxs:
        groups.setdefault(triton_capability(arch), {"cubins": [], "ptx": []})["ptx"].append(arch.name)
    jobs = []
    for cap, images in sorted(groups.items()):
        for spec in (specs or S.specs_for_capability)((cap // 10, cap % 10)):
            jobs.append({"spec": job_spec(spec), "cap": cap, **images})
    return jobs


def _tree_rss_mb(root: int) -> float:
    """Resident memory (MB) of ``root`` and all its descendants, from /proc."""
    total = 0
    try:
        children: dict[int, list[int]] = {}
        rss: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry))
                rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        stack = [root]
        while stack:
            pid = stack.pop()
            total += rss.get(pid, 0)
            stack.extend(children.get(pid, []))
    except OSError:
        return 0.0
    return total / 2**20


def build(out_dir: Path, archs: Optional[str] = None, jobs: Optional[int] = None, quiet: bool = False,
          fresh_cache: bool = True, specs=None) -> dict:
    """Compile everything (or ``specs``, see :func:`plan`); returns the report (also written to
    ``out_dir``). Stages: resolve the architectures, plan the jobs (:func:`plan`), compile them
    (:func:`_compile_all`), write the manifest and the report (:func:`_manifest`, :func:`_report`)."""
    import triton  # noqa: PLC0415

    _pin_ptxas()
    cubins, ptxs = resolve_archs(archs if archs is not None else os.environ.get(ARCHS_ENV))
    jobs = int(jobs or os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
    out_dir = _clear_output(Path(out_dir))
    work = plan(cubins, ptxs, specs)
    cuobjdump = cuobjdump_path()
    for job in work:
        job["out"], job["cuobjdump"] = str(out_dir), cuobjdump
    compiled = _compile_all(work, jobs, quiet, fresh_cache)
    _write_json(out_dir / MANIFEST, _manifest(compiled, triton.__version__))
    report = _report(compiled, work, cubins, ptxs, cuobjdump, jobs, triton.__version__)
    _write_json(out_dir / REPORT, report)
    return report


def _clear_output(out_dir: Path) -> Path:
    """``out_dir``, made, without a previous build's manifest, report and images."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (out_dir / MANIFEST, out_dir / REPORT):
        stale.unlink(missing_ok=True)
    shutil.rmtree(out_dir / "images", ignore_errors=True)
    return out_dir


class _Compiled(NamedTuple):
    """What the compile jobs produced: manifest entries and report rows (sorted by arch and
    key), the build's wall seconds, the peak RSS of its process tree and of one worker (MB)."""

    manifest_rows: list
    report_rows: list
    wall: float
    peak_rss_mb: float
    worker_rss_mb: int

    @property
    def archs(self) -> list:
        return sorted({e["arch"] for e in self.manifest_rows})


@contextlib.contextmanager
def _fresh_triton_cache(fresh: bool):
    """With ``fresh``, Triton compiles into a new, empty cache (honest timings), removed after."""
    if not fresh:
        yield
        return
    tmp_cache = tempfile.mkdtemp(prefix="flash_attn_aot_cache_")
    os.environ["TRITON_CACHE_DIR"] = tmp_cache
    try:
        yield
    finally:
        shutil.rmtree(tmp_cache, ignore_errors=True)


@contextlib.contextmanager
def _peak_rss():
    """Samples the resident memory of this process tree every 0.5 s; yields a one-item list that
    holds the peak so far (MB)."""
    peak = [0.0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss_mb(os.getpid()))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


def _compile_all(work: list, jobs: int, quiet: bool, fresh_cache: bool) -> _Compiled:
    """Runs the compile jobs, timed and memory-sampled."""
    with _fresh_triton_cache(fresh_cache), _peak_rss() as peak:
        start = time.time()
        progress = Progress(len(work), quiet)
        try:
            manifest_rows, report_rows, worker_rss = _run_jobs(work, jobs, progress)
        finally:
            progress.close()
        wall = time.time() - start
    manifest_rows.sort(key=lambda e: (e["arch"], e["key"]))
    report_rows.sort(key=lambda e: (e["arch"], e["key"]))
    return _Compiled(manifest_rows, report_rows, wall, peak[0], worker_rss)


def _run_jobs(work: list, jobs: int, progress: Progress) -> tuple[list, list, int]:
    """:func:`compile_job` for each job in ``jobs`` spawned processes; the first failure cancels
    the rest and raises. Returns the manifest entries, the report rows and the largest worker RSS."""
    manifest_rows, report_rows, worker_rss = [], [], 0
    try:
        for _, result in pool.completed(compile_job, work, jobs, progress, _label):
            for entry, row in result["rows"]:
                manifest_rows.append(entry)
                report_rows.append(row)
            worker_rss = max(worker_rss, result["worker_rss_mb"])
    except pool.JobFailed as exc:
        raise RuntimeError(f"build-kernels: {exc}") from None
    return manifest_rows, report_rows, worker_rss


def _label(job: dict) -> str:
    return f"{job['spec']['kernel']} {job['spec']['dtype']} d{job['spec']['block_d']} sm_{job['cap']}"


def _manifest(compiled: _Compiled, triton_version: str) -> dict:
    return {"format": FORMAT, "triton": triton_version, "archs": compiled.archs, "kernels": compiled.manifest_rows}


def _report(compiled: _Compiled, work: list, cubins: list, ptxs: list, cuobjdump: Optional[str], jobs: int,
            triton_version: str) -> dict:
    rows, archs_built = compiled.report_rows, compiled.archs
    return {
        "format": FORMAT,
        "triton": triton_version,
        "archs": archs_built,
        "requested": {"cubin": [a.name for a in cubins], "ptx": [a.name for a in ptxs]},
        "ptxas": {f"sm_{cap}": ptxas_for(cap) for cap in sorted({job["cap"] for job in work})},
        "cuobjdump": cuobjdump,
        "jobs": jobs,
        "totals": {
            "kernels": len(rows),
            "specs_compiled": len(work),
            "wall_seconds": round(compiled.wall, 1),
            "compile_cpu_seconds": round(sum(r["compile_seconds"] for r in rows), 1),
            "peak_rss_mb": round(compiled.peak_rss_mb, 1),
            "max_worker_rss_mb": compiled.worker_rss_mb,
            "bytes": sum(r["bytes"] for r in rows),  # as stored (compressed)
            "raw_bytes": sum(r["raw_bytes"] for r in rows),  # the cubins/PTX themselves
            "bytes_by_arch": {a: sum(r["bytes"] for r in rows if r["arch"] == a) for a in archs_built},
        },
        "kernels": rows,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


# --- CLI (flash_attn.__main__ conventions) --------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--archs", default=None,
                        help=f"GPU architectures, e.g. '80;90' or 'native' (default: ${ARCHS_ENV} or "
                             f"{default_cuda_archs() or 'none declared here'})")
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile processes (default: $MAX_JOBS or CPUs)")
    parser.add_argument("--output", "-o", default=None, help="output folder (default: the package's flash_attn/_aot/)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    parser.add_argument("--use-triton-cache", action="store_true",
                        help="reuse Triton's compile cache (fast rebuilds; default: a fresh cache, honest timings)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.output) if args.output else default_output_dir()
    try:
        report = build(out, args.archs, args.jobs, args.quiet, fresh_cache=not args.use_triton_cache)
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    t = report["totals"]
    print(f"built {t['kernels']} images ({', '.join(report['archs'])}) into {out}: {t['bytes'] / 1e6:.1f} MB "
          f"({t['raw_bytes'] / 1e6:.1f} MB uncompressed), "
          f"{t['wall_seconds']:.0f} s wall, peak RSS {t['peak_rss_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m flash_attn.kernel_build.build")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
