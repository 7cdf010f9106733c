"""The op library builds against conda-forge's PyTorch layout, and links only what the recipe declares.

conda-forge splits PyTorch: ``libtorch`` puts the C++ headers in ``$PREFIX/include`` and the
libraries in ``$PREFIX/lib``; its ``pytorch`` package has no ``site-packages/torch/include``. The
recipe builds the CUDA variants with ``libtorch`` in host and recipe/build.sh points the build at
``$PREFIX``. Here CMake builds the real ``csrc/`` against such a prefix holding the recipe's floor,
PyTorch 2.10 (the headers and libtorch_cpu.so of PyPI's torch 2.10 wheel, fetched once into a cache
by ``packaging_helpers.torch_floor_dir``; ``lay_out_conda_forge_libtorch`` says what that stand-in
for conda-forge's ``libtorch 2.10.* cpu_*`` cannot show), with a Python that has no torch package
at all, and the library is then loaded by the newest PyTorch (this interpreter's, 2.13): the
stable-ABI promise the recipe's ``libtorch >=2.10`` / ``pytorch >=2.10`` run requirements make.
``find_torch.py``'s search order is checked on its own (no compile) for the other layouts it must
handle.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.packaging_helpers import (  # noqa: I001
    REPO, TORCH_FLOOR, cuda_toolkit, lay_out_conda_forge_libtorch, pip_torch_dir, render, torch_floor_dir)

FIND_TORCH = REPO / "csrc" / "cmake" / "find_torch.py"

# What the op library may link, and the conda package that provides it at run time: the recipe's
# run requirements, the compilers' run_exports (libgcc, libstdcxx) or the C library (sysroot,
# i.e. the system: __glibc). Anything else would be overlinking.
PROVIDERS = {
    "libtorch_cpu.so": "libtorch",
    "libstdc++.so.6": "libstdcxx",
    "libgcc_s.so.1": "libgcc",
    "libm.so.6": "__glibc", "libc.so.6": "__glibc", "libdl.so.2": "__glibc",
    "librt.so.1": "__glibc", "libpthread.so.0": "__glibc", "ld-linux-x86-64.so.2": "__glibc",
}


def _python_without_torch(tmp_path: Path) -> Path:
    """A bare venv: the interpreter CMake runs find_torch.py with, like a conda build's Python
    whose environment has libtorch but no torch package."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    python = tmp_path / "bare" / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('torch'))"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "None"
    return python


def _find_torch(python: Path, env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("FLASH_ATTN_TORCH_DIR", "CONDA_PREFIX", "VIRTUAL_ENV")}
    return subprocess.run([str(python), str(FIND_TORCH)], env={**clean, **env}, capture_output=True, text=True)


def _fields(out: str) -> dict:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.fixture(scope="module")
def floor_torch() -> Path:
    try:
        return torch_floor_dir()
    except RuntimeError as error:
        pytest.skip(f"PyTorch {TORCH_FLOOR}, the recipe's floor, is not available here: {error}")


@pytest.fixture(scope="module")
def conda_prefix(tmp_path_factory, floor_torch) -> Path:
    """A prefix shaped like one with conda-forge's libtorch 2.10."""
    return lay_out_conda_forge_libtorch(tmp_path_factory.mktemp("conda") / "prefix", floor_torch)


@pytest.fixture(scope="module")
def built_library(conda_prefix, tmp_path_factory) -> tuple[Path, str]:
    """CMakeLists.txt configured and built as recipe/build.sh does it for a CUDA variant
    (FLASH_ATTN_TORCH_DIR=$PREFIX), with no kernels (FLASH_ATTN_CUDA_ARCHS=none: the C++ library
    only) and a Python without torch."""
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    cuda_home = cuda_toolkit()
    if cuda_home is None:
        pytest.skip("no CUDA toolkit (set CUDA_HOME): the op library links its static runtime")
    work = tmp_path_factory.mktemp("build")
    python = _python_without_torch(work)
    env = {**os.environ, "FLASH_ATTN_TORCH_DIR": str(conda_prefix), "CUDA_HOME": str(cuda_home), "MAX_JOBS": "2"}
    env.pop("CONDA_PREFIX", None)
    build = work / "build"
    configure = subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(build), "-G", "Ninja", "-DFLASH_ATTN_CUDA_ARCHS=none",
         f"-DPython_EXECUTABLE={python}"], env=env, capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    compiled = subprocess.run(["cmake", "--build", str(build)], env=env, capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    return build / "libflash_attn_aot.so", configure.stdout


def test_build_records_the_recipes_build_targets(built_library):
    """An installed package has no recipe beside it: the build records the targets the recipe
    declares in build_config.json, where flash_attn/aot/archs.py takes its default from (here a
    build without kernels, FLASH_ATTN_CUDA_ARCHS=none, which is no list)."""
    import json

    import yaml

    library, _ = built_library
    config = json.loads((library.parent / "build_config.json").read_text())
    assert config["cuda_archs"] == "none"
    assert config["declared_cuda_archs"] == yaml.safe_load((REPO / "recipe" / "recipe.yaml").read_text())["context"]["cuda_archs"]


def test_op_library_builds_against_the_conda_prefix(built_library, conda_prefix):
    library, configure_log = built_library
    assert library.is_file()
    assert f"torch {TORCH_FLOOR}.0 headers from {conda_prefix / 'include'} (found via FLASH_ATTN_TORCH_DIR)" in configure_log
    assert not list(conda_prefix.rglob("site-packages")), "the prefix holds no torch package"
    # The include path the compiler was given is the prefix's, and nothing under a torch package.
    commands = (library.parent / "build.ninja").read_text()
    assert f"-isystem {conda_prefix / 'include'}" in commands
    assert "site-packages/torch/include" not in commands


def test_op_library_uses_no_python_c_api(built_library):
    """The recipe's abi3audit stand-in (recipe/check_no_python_c_api.py, run by its CUDA test step)
    on the real op library: no Python symbol imported, no libpython linked."""
    library, _ = built_library
    result = subprocess.run([sys.executable, str(REPO / "recipe" / "check_no_python_c_api.py"), str(library)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no Python C API" in result.stdout


def test_op_library_links_only_what_the_recipe_declares(built_library):
    """rattler-build's overlinking check in small: every library the op library needs is provided
    by a run requirement of the CUDA variants (libtorch), a compiler run_export or the C library;
    no RPATH points into the build prefix."""
    library, _ = built_library
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert "libtorch_cpu.so" in needed
    unknown = [name for name in needed if name not in PROVIDERS]
    assert not unknown, f"linked but provided by no declared package: {unknown}"
    assert "RPATH" not in dynamic and "RUNPATH" not in dynamic
    pytest.importorskip("rattler_build", reason="py-rattler-build is not installed")
    for variant in (v for v in render("linux-64") if v.cuda != "None"):
        run = [str(s).split()[0] for s in variant.recipe["requirements"]["run"]]
        assert "libtorch" in run, f"{variant.recipe['build']['string']}: links libtorch_cpu.so without libtorch in run"


def test_op_library_loads_with_torch(built_library, tmp_path):
    """Built against PyTorch 2.10's headers, it loads into the newest PyTorch here (2.13) and
    registers its ops (the stable ABI: libtorch_cpu.so is already loaded by `import torch`)."""
    library, _ = built_library
    import importlib.metadata

    running = importlib.metadata.version("torch")
    assert tuple(map(int, running.split("+")[0].split(".")[:2])) > tuple(map(int, TORCH_FLOOR.split("."))), running
    script = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
              "print(all(hasattr(torch.ops.flash_attn, op) for op in ('aot_register_kernel', 'aot_launch')))")
    result = subprocess.run([sys.executable, "-c", script, str(library)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "True"


# --- where find_torch.py looks (no compile) -----------------------------------------------------------


def test_find_torch_finds_libtorch_in_the_conda_prefix(conda_prefix, tmp_path):
    """A conda environment (CONDA_PREFIX) with conda-forge's libtorch and a Python without torch:
    the prefix itself is the torch root, its version read from the headers."""
    result = _find_torch(_python_without_torch(tmp_path), {"CONDA_PREFIX": str(conda_prefix)})
    assert result.returncode == 0, result.stderr
    fields = _fields(result.stdout)
    assert fields["include"] == str(conda_prefix / "include") and fields["lib"] == str(conda_prefix / "lib")
    assert fields["version"] == f"{TORCH_FLOOR}.0"  # the floor's headers, not this interpreter's torch
    assert fields["found_by"] == "the target environment's libtorch (CONDA_PREFIX)"


def test_find_torch_skips_conda_forges_pytorch_package(conda_prefix, floor_torch, tmp_path):
    """conda-forge's pytorch: site-packages/torch has version.py and lib/ (links into $PREFIX/lib)
    but no include/; the headers are the prefix's."""
    package = conda_prefix.parent / "with-pytorch"
    lay_out_conda_forge_libtorch(package)
    torch_pkg = package / "lib" / "python3.11" / "site-packages" / "torch"
    torch_pkg.mkdir(parents=True)
    shutil.copy(floor_torch / "version.py", torch_pkg / "version.py")
    (torch_pkg / "lib").symlink_to(package / "lib")
    result = _find_torch(_python_without_torch(tmp_path), {"CONDA_PREFIX": str(package)})
    assert result.returncode == 0, result.stderr
    assert _fields(result.stdout)["include"] == str(package / "include")


def test_find_torch_explains_headers_without_library(tmp_path):
    prefix = tmp_path / "headers-only"
    (prefix / "include").mkdir(parents=True)
    (prefix / "include" / "torch").symlink_to(pip_torch_dir() / "include" / "torch")
    result = _find_torch(Path(sys.executable), {"FLASH_ATTN_TORCH_DIR": str(prefix)})
    assert result.returncode == 1
    assert "lib/libtorch_cpu.so" in result.stderr and str(prefix / "include") in result.stderr


def test_find_torch_says_where_it_looked(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _find_torch(_python_without_torch(tmp_path), {"CONDA_PREFIX": str(empty)})
    assert result.returncode == 1
    assert str(empty) in result.stderr and "libtorch" in result.stderr
