"""A local conda channel to solve over: conda-forge-shaped records of Python, PyTorch (``libtorch`` +
``pytorch``), Triton, CUDA, the compilers and the other build tools of the recipe, each with the
``run_exports`` its conda-forge recipe declares, written as ``<folder>/<subdir>/repodata.json`` for
py-rattler (pixi's solver), or as real (empty) packages that rattler-build itself can solve,
download and read ``info/run_exports.json`` from (``write_package_channel``).

Our own records are not written by hand: ``rattler_build_records`` runs rattler-build's own
``--render-only --with-solve`` over the package channel, which solves the build and host
environments of each variant and attaches the run_exports of what it solved (minus the recipe's
``ignore_run_exports`` and, for a ``version_independent`` package, python's), exactly the
``depends`` it would write into ``index.json``.

Stand-ins, not conda-forge's repodata (unreachable here): the records follow the feedstocks'
recipes (pytorch-cpu-feedstock: CUDA builds +200 and ``__cuda``, ``cuda-version`` from nvcc's
run_export, ``libtorch`` pinned exactly, ``triton`` for CUDA on Linux, builds per Python;
cuda-version's ``__cuda`` constraint; nvcc -> cuda-cudart-dev_<platform> -> cuda-version; the
compilers', sysroot's, python's and python-abi3's run_exports), with made-up hashes and a reduced
set of dependencies (no BLAS, no CUDA libraries, no compiler implementation packages). What they
can show: which builds solve and which a solver picks given those dependency shapes. What they
cannot: that conda-forge's current repodata has no other conflict (a missing build, a newer pin).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

PYTHONS = ["3.10", "3.11", "3.12", "3.13", "3.14"]
# PyTorch releases in the channel, with the Triton each CUDA build requires (2.13.0 -> 3.7.1 is
# pytorch-cpu-feedstock's pin; the older pairs are stand-ins).
TORCH_TRITON = {"2.10.0": "3.6.0", "2.12.0": "3.7.1", "2.13.0": "3.7.1"}
# CUDA builds of PyTorch per platform (pytorch-cpu-feedstock .ci_support: linux 12.9 and 13.0,
# win-64 12.8 and 13.0, none on macOS).
TORCH_CUDA = {"linux-64": ["12.9", "13.0"], "linux-aarch64": ["12.9", "13.0"], "win-64": ["12.8", "13.0"],
              "osx-arm64": [], "osx-64": []}
TORCH_BUILD = 2  # the feedstock's base build number; +200 for CUDA builds
GLIBC = ">=2.17,<3.0.a0"
# CUDA toolkits in the channel: version of cuda-nvcc / cuda-cudart (conda-forge's 12.9 and 13.0).
CUDA_TOOLKITS = {"12.8": "12.8.93", "12.9": "12.9.86", "13.0": "13.0.88"}
GCC = {"14": "14.3.0", "15": "15.2.0"}
SYSROOTS = ["2.17", "2.28"]

# Packages the pixi environments name that play no part in the CUDA/CPU choice: one noarch record
# each, depending on Python only.
TOOLS = {"pytest": "9.0.1", "pytest-xdist": "3.8.0", "hypothesis": "6.140.0", "transformers": "5.1.0", "tqdm": "4.67.1",
         "matplotlib-base": "3.10.7", "rattler-build": "0.55.0"}


def _major(version: str) -> int:
    return int(version.split(".")[0])


def _next_minor_pin(version: str) -> str:
    """``12.9`` -> ``12.10.0a0``: the upper bound of ``x.y.*``."""
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}.0a0"


def record_from_rendered(output: dict, platform: str) -> dict:
    """One entry of rattler-build's ``--render-only --with-solve`` output as its ``index.json``:
    the finalized run requirements (the recipe's ``run`` plus the run_exports rattler-build
    attached from the solved build and host environments)."""
    recipe = output["recipe"]
    run = output["finalized_dependencies"]["run"]
    depends = []
    for entry in run["depends"]:
        spec = entry.get("source") or entry.get("spec")
        if spec not in depends:
            depends.append(spec)
    constrains = [entry.get("source") or entry.get("spec") for entry in run.get("constraints", [])]
    return _record(recipe["package"]["name"], str(recipe["package"]["version"]), recipe["build"]["string"],
                   int(recipe["build"]["number"]), depends, constrains, *package_subdir(recipe["build"], platform))


def package_subdir(build: dict, platform: str) -> tuple[str, str | None]:
    """(subdir, noarch) of a rendered build: `noarch: python` is the noarch subdir; a CEP-20
    version-independent package is its platform's subdir with `noarch: python` in index.json."""
    if build.get("noarch"):
        return "noarch", build["noarch"]
    return platform, "python" if build.get("python", {}).get("version_independent") else None


def rattler_build_records(recipe: Path, platform: str, channel_url: str, variant_files: list[Path],
                          variant_overrides: dict | None = None, env: dict | None = None) -> list[dict]:
    """The recipe's builds for ``platform`` as rattler-build renders and solves them over the
    channel (each a ``record_from_rendered``), in a subprocess: rattler-build prints the rendered
    outputs as JSON on stdout. ``env`` adds variables (e.g. ``CONDA_OVERRIDE_CUDA``)."""
    script = (
        "import json, sys\n"
        "from rattler_build import build_recipes\n"
        "args = json.loads(sys.argv[1])\n"
        "build_recipes([args['recipe']], target_platform=args['platform'], build_platform=args['platform'],\n"
        "              host_platform=args['platform'], channel=[args['channel']], variant_config=args['variants'],\n"
        "              variant_overrides=args['overrides'] or None, render_only=True, with_solve=True,\n"
        "              output_dir=args['output'])\n")
    args = {"recipe": str(recipe), "platform": platform, "channel": channel_url,
            "variants": [str(v) for v in variant_files], "overrides": variant_overrides or {},
            "output": str(Path(channel_url.removeprefix("file://")).parent / "rattler-build-output")}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script, json.dumps(args)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"rattler-build --render-only --with-solve failed for {platform}:\n{proc.stderr[-4000:]}")
    outputs = json.loads(proc.stdout[proc.stdout.index("["):])
    return [record_from_rendered(o, platform) for o in outputs]


# --- conda-forge-shaped records -----------------------------------------------------------------------


def _hash(*parts: str) -> str:
    return "h" + hashlib.sha256("/".join(parts).encode()).hexdigest()[:7]


def _record(name, version, build, build_number, depends, constrains, subdir, noarch=None, run_exports=None) -> dict:
    """A repodata record; ``run_exports`` (weak/strong/...) is the package's ``info/run_exports.json``
    (not part of repodata: ``write_package_channel`` puts it into the package, solvers' callers
    read it from ``run_exports_of``)."""
    record = {"name": name, "version": version, "build": build, "build_number": build_number,
              "depends": depends, "constrains": constrains, "subdir": subdir, "timestamp": 1767225600000,
              "fn": f"{name}-{version}-{build}.conda"}
    if noarch:
        record["noarch"] = noarch
    if run_exports:
        record["run_exports"] = run_exports
    return record


def _cp(python: str) -> str:
    return "cp" + python.replace(".", "")


def _linux_runtime(platform: str, glibc: str = GLIBC) -> list[str]:
    return [f"__glibc {glibc}", "libgcc >=14", "libstdcxx >=14"] if platform.startswith("linux") else []


def python_records(platform: str) -> list[dict]:
    records = []
    for py in PYTHONS:
        cp = _cp(py)
        tag = "cpython" if py in ("3.10", "3.11", "3.12") else cp  # conda-forge's build-string suffixes
        records += [
            # python-feedstock: run_exports weak python_abi of its version, noarch python
            _record("python", f"{py}.1", f"{_hash(platform, py)}_0_{tag}", 0,
                    (["__glibc >=2.17,<3.0.a0"] if platform.startswith("linux") else []), [], platform,
                    run_exports={"weak": [f"python_abi {py}.* *_{cp}"], "noarch": ["python"]}),
            _record("python_abi", py, f"8_{cp}", 8, [], [f"python {py}.* *_{tag}"], platform),
            _record("cpython", f"{py}.1", "py_0", 0, [f"python {py}.1.*", f"python_abi * *_{cp}"], [], "noarch", "generic"),
            _record("python-gil", f"{py}.1", "h_0", 0, [f"cpython {py}.1.*"], [], "noarch", "generic"),
        ]
    records.append(_record("_python_abi3_support", "1.0", "hd8ed1ab_2", 2, ["cpython", "python-gil"], [], "noarch", "generic"))
    # python-abi3-feedstock: one build per minimum Python, exporting that minimum (CEP-20)
    for py in PYTHONS:
        records.append(_record("python-abi3", py, "hd_0", 0, [f"cpython {py}.*", "python-gil"], [], "noarch", "generic",
                               run_exports={"weak": [f"cpython >={py}", "_python_abi3_support 1.*"]}))
    return records


def runtime_records(platform: str) -> list[dict]:
    # cuda-version-feedstock: constrains the driver (__cuda >= the major) and the old cudatoolkit
    records = [_record("cuda-version", v, "h_3", 3, [], [f"__cuda >={_major(v)}", f"cudatoolkit {v}|{v}.*"], "noarch", "generic")
               for v in CUDA_TOOLKITS]
    if platform.startswith("linux"):
        records += [_record("libgcc", "15.2.0", "h_7", 7, ["__glibc >=2.17,<3.0.a0"], [], platform),
                    _record("libstdcxx", "15.2.0", "h_7", 7, ["libgcc 15.2.0 h_7"], [], platform)]
    records += [_record(tool, version, "pyh_0", 0, ["python >=3.10"], [], "noarch", "python") for tool, version in TOOLS.items()]
    return records


def torch_records(platform: str) -> list[dict]:
    """libtorch, pytorch and (Linux CUDA) triton as pytorch-cpu-feedstock builds them: a CPU build
    and one build per CUDA version, pytorch per Python, both with build number +200 for CUDA."""
    records = []
    blas = ["mkl", "generic"] if platform == "linux-64" else ["generic"]  # mkl only on x86_64 (+100)
    for version, triton in TORCH_TRITON.items():
        for cuda in [None, *TORCH_CUDA[platform]]:
            for impl in blas:
                number = TORCH_BUILD + (200 if cuda else 0) + (100 if impl == "mkl" else 0)
                kind = f"cuda{cuda.replace('.', '')}" if cuda else "cpu"
                cuda_deps = ["__cuda", f"cuda-version >={cuda},<{_major(cuda) + 1}"] if cuda else []
                glibc = ">=2.28,<3.0.a0" if cuda and _major(cuda) >= 13 else GLIBC
                lib_build = f"{kind}_{impl}_{_hash(platform, version, kind, impl)}_{number}"
                # run_exports: pin_subpackage('libtorch', max_pin='x.x')
                minor = ".".join(version.split(".")[:2])
                records.append(_record("libtorch", version, lib_build, number,
                                       _linux_runtime(platform, glibc) + [d for d in cuda_deps if d != "__cuda"],
                                       [f"pytorch {version} {kind}_{impl}_*_{number}"], platform,
                                       run_exports={"weak": [f"libtorch >={version},<{_next_minor_pin(minor)}"]}))
                for py in PYTHONS:
                    cp = _cp(py)
                    uses_triton = cuda and platform.startswith("linux")
                    depends = [f"libtorch {version} {lib_build}", f"python >={py},<{_next_minor(py)}.0a0",
                               f"python_abi {py}.* *_{cp}", *_linux_runtime(platform, glibc), *cuda_deps,
                               *([f"triton =={triton}"] if uses_triton else [])]
                    records.append(_record("pytorch", version, f"{kind}_{impl}_py{cp[2:]}_{_hash(platform, version, kind, impl, py)}_{number}",
                                           number, depends, [], platform))
    if platform.startswith("linux"):
        for triton in sorted(set(TORCH_TRITON.values())):
            for cuda in TORCH_CUDA[platform]:
                for py in PYTHONS:
                    records.append(_record("triton", triton, f"cuda{cuda.replace('.', '')}py{_cp(py)[2:]}{_hash(platform, triton, cuda, py)}_0", 0,
                                           [f"python >={py},<{_next_minor(py)}.0a0", f"python_abi {py}.* *_{_cp(py)}",
                                            f"cuda-version >={cuda},<{_major(cuda) + 1}", *_linux_runtime(platform)], [], platform))
    return records


def _next_minor(py: str) -> str:
    major, minor = py.split(".")
    return f"{major}.{int(minor) + 1}"


def build_tool_records(platform: str) -> list[dict]:
    """The packages of the recipe's build and host requirements, with their feedstocks' run_exports:
    ctng-compiler-activation (gcc/gxx_<platform>: strong libgcc/libstdcxx >= the GCC major),
    linux-sysroot (strong __glibc), cuda-nvcc (cuda-nvcc_<platform> depends on
    cuda-cudart-dev_<platform> of its version, which pins cuda-version to that minor; strong
    cuda-version within the major), cuda-cudart (cuda-cudart-dev: weak cuda-cudart of the major;
    cuda-cudart-static: none), and the Python build tools (none)."""
    records = [_record("cmake", "4.1.2", "h_0", 0, [], [], platform), _record("ninja", "1.13.1", "h_0", 0, [], [], platform),
               _record("pip", "25.3", "pyh_0", 0, ["python >=3.10"], [], "noarch", "python"),
               _record("setuptools", "80.9.0", "pyh_0", 0, ["python >=3.9"], [], "noarch", "python"),
               _record("scikit-build-core", "0.11.6", "pyh_0", 0, ["python >=3.10", "packaging", "pathspec"], [], "noarch", "python"),
               _record("packaging", "25.0", "pyh_0", 0, ["python >=3.8"], [], "noarch", "python"),
               _record("pathspec", "0.12.1", "pyh_0", 0, ["python >=3.8"], [], "noarch", "python")]
    if not platform.startswith("linux"):
        return records
    for major, version in GCC.items():
        records += [_record(f"gcc_{platform}", version, f"h{major}_1", 1, [f"sysroot_{platform}"], [], platform,
                            run_exports={"strong": [f"libgcc >={major}"]}),
                    _record(f"gxx_{platform}", version, f"h{major}_1", 1, [f"gcc_{platform} {version}.*"], [], platform,
                            run_exports={"strong": [f"libstdcxx >={major}", f"libgcc >={major}"]})]
    for glibc in SYSROOTS:
        records.append(_record(f"sysroot_{platform}", glibc, "h_1", 1, [], [], "noarch", "generic",
                               run_exports={"strong": [f"__glibc >={glibc},<3.0.a0"]}))
    for cuda, version in CUDA_TOOLKITS.items():
        pin = f"cuda-version >={cuda},<{_next_minor_pin(cuda)}"
        records += [
            _record(f"cuda-nvcc_{platform}", version, "h_1", 1, [f"cuda-cudart-dev_{platform} {cuda}.*", pin], [], platform,
                    run_exports={"strong": [f"cuda-version >={cuda},<{_major(cuda) + 1}"]}),
            _record(f"cuda-cudart-dev_{platform}", version, "h_1", 1, [pin], [], "noarch", "generic"),
            _record("cuda-cudart", version, "h_1", 1, [pin, *_linux_runtime(platform)], [], platform),
            _record("cuda-cudart-dev", version, "h_1", 1, [f"cuda-cudart {version} h_1", f"cuda-cudart-dev_{platform} {version}", pin],
                    [], platform, run_exports={"weak": [f"cuda-cudart >={version},<{_major(cuda) + 1}.0a0"]}),
            _record("cuda-cudart-static", version, "h_1", 1, [f"cuda-cudart-static_{platform} {version}", pin], [], platform),
            _record(f"cuda-cudart-static_{platform}", version, "h_1", 1, [pin], [], "noarch", "generic"),
        ]
    return records


def conda_forge_records(platform: str) -> list[dict]:
    return python_records(platform) + runtime_records(platform) + torch_records(platform) + build_tool_records(platform)


def run_exports_of(records: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(name, version, build) -> the package's run_exports.json (what a solver's caller reads from
    the channel or the package after a solve; py-rattler's records do not carry it)."""
    return {(r["name"], r["version"], r["build"]): r.get("run_exports", {}) for r in records}


def write_package_channel(folder: Path, records: list[dict]) -> str:
    """``records`` as a channel of real, empty ``.tar.bz2`` packages (``info/index.json``,
    ``info/paths.json`` and the ``info/run_exports.json`` of those that have one), with their
    sha256/md5/size in ``repodata.json``: what rattler-build downloads and reads run_exports from.
    Returns its file:// URL."""
    by_subdir: dict[str, dict] = {"noarch": {}}
    for record in records:
        record = {**record, "fn": record["fn"].removesuffix(".conda") + ".tar.bz2"}
        run_exports = record.pop("run_exports", None)
        members = {"info/index.json": json.dumps({k: v for k, v in record.items() if k != "fn"}).encode(),
                   "info/paths.json": b'{"paths": [], "paths_version": 1}'}
        if run_exports:
            members["info/run_exports.json"] = json.dumps(run_exports).encode()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:bz2") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1767225600
                tar.addfile(info, io.BytesIO(data))
        data = buffer.getvalue()
        (folder / record["subdir"]).mkdir(parents=True, exist_ok=True)
        (folder / record["subdir"] / record["fn"]).write_bytes(data)
        record.update(sha256=hashlib.sha256(data).hexdigest(), md5=hashlib.md5(data).hexdigest(), size=len(data))
        by_subdir.setdefault(record["subdir"], {})[record["fn"]] = record
    for subdir, packages in by_subdir.items():
        (folder / subdir).mkdir(parents=True, exist_ok=True)
        (folder / subdir / "repodata.json").write_text(json.dumps(
            {"info": {"subdir": subdir}, "packages": packages, "packages.conda": {}, "repodata_version": 1}))
    return folder.resolve().as_uri()


def write_channel(folder: Path, records: list[dict]) -> str:
    """``records`` as a channel in ``folder`` (one repodata.json per subdir, noarch always present);
    returns its file:// URL."""
    by_subdir: dict[str, dict] = {"noarch": {}}
    for record in records:
        by_subdir.setdefault(record["subdir"], {})[record["fn"]] = {k: v for k, v in record.items() if k != "run_exports"}
    for subdir, packages in by_subdir.items():
        (folder / subdir).mkdir(parents=True, exist_ok=True)
        (folder / subdir / "repodata.json").write_text(json.dumps(
            {"info": {"subdir": subdir}, "packages": {}, "packages.conda": packages, "repodata_version": 1}))
    return folder.resolve().as_uri()
