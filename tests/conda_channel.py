"""A local conda channel to solve over: this recipe's builds as repodata records, beside records
shaped like conda-forge's Python, PyTorch (``libtorch`` + ``pytorch``), Triton, CUDA and compiler
runtime packages, written as ``<folder>/<subdir>/repodata.json`` for py-rattler (pixi's solver).

Our records: each rendered variant becomes what rattler-build would write into ``index.json``:
its run requirements plus the run_exports of its build and host packages (``RUN_EXPORTS``, read
from those packages' conda-forge recipes), minus ``ignore_run_exports``.

Stand-ins, not conda-forge's repodata (unreachable here): the PyTorch records follow
pytorch-cpu-feedstock's recipe (CUDA builds +200 and ``__cuda``, ``cuda-version`` from nvcc's
run_export, ``libtorch`` pinned exactly, ``triton`` pinned for CUDA on Linux, builds per Python),
with made-up hashes and a reduced set of dependencies (no BLAS, no CUDA libraries). What they can
show: which of our builds a solver picks given those dependency shapes. What they cannot: that
conda-forge's current repodata has no other conflict (a missing build, a newer pin).
"""

from __future__ import annotations

import hashlib
import json
import re
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

# Packages the pixi environments name that play no part in the CUDA/CPU choice: one noarch record
# each, depending on Python only.
TOOLS = {"pytest": "9.0.1", "hypothesis": "6.140.0", "transformers": "5.1.0", "tqdm": "4.67.1",
         "matplotlib-base": "3.10.7", "rattler-build": "0.55.0"}


# --- run_exports of the packages our recipe puts in build and host ------------------------------------


def _major(version: str) -> int:
    return int(version.split(".")[0])


def run_exports(spec: str, python_min: str) -> list[str]:
    """What a build/host requirement adds to ``run``, per the package's conda-forge recipe:
    ctng-compiler-activation (gcc/gxx: libgcc, libstdcxx >= the GCC major), linux-sysroot
    (``__glibc``), cuda-nvcc (``cuda-version`` within the CUDA major), python-abi3 (``cpython``,
    ``_python_abi3_support``), libtorch (pin_subpackage x.x), cuda-cudart-dev (cuda-cudart)."""
    name, _, version = spec.partition(" ")
    version = version.split(" ")[0].rstrip(".*")
    if re.fullmatch(r"gcc_linux-\w+", name):
        return [f"libgcc >={_major(version)}"]
    if re.fullmatch(r"gxx_linux-\w+", name):
        return [f"libstdcxx >={_major(version)}", f"libgcc >={_major(version)}"]
    if re.fullmatch(r"sysroot_linux-\w+", name):
        return [f"__glibc >={version},<3.0.a0"]
    if re.fullmatch(r"cuda-nvcc_linux-\w+", name):
        return [f"cuda-version >={version},<{_major(version) + 1}"]
    if name == "python-abi3":
        return [f"cpython >={python_min}", "_python_abi3_support 1.*"]
    if name == "libtorch":
        major_minor = ".".join(version.split(".")[:2])
        return [f"libtorch >={major_minor},<{major_minor.split('.')[0]}.{int(major_minor.split('.')[1]) + 1}"]
    if name == "cuda-cudart-dev":
        return [f"cuda-cudart >={version or '0'}"]
    return []


def recipe_record(rendered, platform: str) -> dict:
    """A rendered variant as its ``index.json``: run requirements plus the run_exports of build
    and host requirements (weak and strong alike: build/host are both resolved), without
    the ignored ones (and nothing from ``python``: CEP-20 packages ignore it)."""
    recipe = rendered.recipe
    requirements = recipe["requirements"]
    ignored = set(requirements.get("ignore_run_exports", {}).get("from_package", [])) | {"python"}
    python_min = str(rendered.variant.get("python_min", "3.10"))
    depends = [str(s) for s in requirements.get("run", [])]
    for section in ("build", "host"):
        for spec in map(str, requirements.get(section, [])):
            if spec.split()[0] not in ignored:
                depends += [d for d in run_exports(spec, python_min) if d not in depends]
    return _record(recipe["package"]["name"], str(recipe["package"]["version"]), recipe["build"]["string"],
                   int(recipe["build"]["number"]), depends, [str(s) for s in requirements.get("run_constraints", [])],
                   platform, noarch="python" if recipe["build"].get("python", {}).get("version_independent") else None)


# --- conda-forge-shaped records -----------------------------------------------------------------------


def _hash(*parts: str) -> str:
    return "h" + hashlib.sha256("/".join(parts).encode()).hexdigest()[:7]


def _record(name, version, build, build_number, depends, constrains, subdir, noarch=None) -> dict:
    record = {"name": name, "version": version, "build": build, "build_number": build_number,
              "depends": depends, "constrains": constrains, "subdir": subdir, "timestamp": 1767225600000,
              "fn": f"{name}-{version}-{build}.conda"}
    if noarch:
        record["noarch"] = noarch
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
            _record("python", f"{py}.1", f"{_hash(platform, py)}_0_{tag}", 0,
                    (["__glibc >=2.17,<3.0.a0"] if platform.startswith("linux") else []), [], platform),
            _record("python_abi", py, f"8_{cp}", 8, [], [f"python {py}.* *_{tag}"], platform),
            _record("cpython", f"{py}.1", "py_0", 0, [f"python {py}.1.*", f"python_abi * *_{cp}"], [], "noarch", "generic"),
            _record("python-gil", f"{py}.1", "h_0", 0, [f"cpython {py}.1.*"], [], "noarch", "generic"),
        ]
    records.append(_record("_python_abi3_support", "1.0", "hd8ed1ab_2", 2, ["cpython", "python-gil"], [], "noarch", "generic"))
    return records


def runtime_records(platform: str) -> list[dict]:
    records = [_record("cuda-version", v, "h_3", 3, [], [f"__cuda >={_major(v)}", f"cudatoolkit {v}|{v}.*"], "noarch", "generic")
               for v in ("12.8", "12.9", "13.0")]
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
                records.append(_record("libtorch", version, lib_build, number,
                                       _linux_runtime(platform, glibc) + [d for d in cuda_deps if d != "__cuda"],
                                       [f"pytorch {version} {kind}_{impl}_*_{number}"], platform))
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


def conda_forge_records(platform: str) -> list[dict]:
    return python_records(platform) + runtime_records(platform) + torch_records(platform)


def write_channel(folder: Path, records: list[dict]) -> str:
    """``records`` as a channel in ``folder`` (one repodata.json per subdir, noarch always present);
    returns its file:// URL."""
    by_subdir: dict[str, dict] = {"noarch": {}}
    for record in records:
        by_subdir.setdefault(record["subdir"], {})[record["fn"]] = record
    for subdir, packages in by_subdir.items():
        (folder / subdir).mkdir(parents=True, exist_ok=True)
        (folder / subdir / "repodata.json").write_text(json.dumps(
            {"info": {"subdir": subdir}, "packages": {}, "packages.conda": packages, "repodata_version": 1}))
    return folder.resolve().as_uri()
