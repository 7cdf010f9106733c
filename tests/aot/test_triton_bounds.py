"""Triton is bounded to the releases the kernels were built and tested with, in one range everywhere
(the recipe's build requirement, pyproject.toml's build requirement and `triton` extra), and the
ahead-of-time build test runs at both ends of it: the newest allowed is what pip installs for the
suite itself (``pip install -e ".[test,triton]"``), the oldest allowed is installed into a venv of
its own by the slow test below, which runs tests/aot/test_aot_build.py there.

``MEASURED`` is the evidence (tests/aot/test_aot_build.py, a fresh sm_80 + sm_90 build, on this
2-core machine; docs/install-and-build.md, "Triton versions"); the range must admit exactly the
releases that passed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from support.packaging_helpers import RECIPE, REPO, copy_source, cuda_toolkit, make_venv, triton_requirement  # noqa: I001


# Triton release -> what tests/aot/test_aot_build.py said with it.
MEASURED = {
    "3.4.0": "fails: its kernel metadata has no profile_scratch_size, which the manifest records",
    "3.5.1": "fails: the sm_80 head-dim-128 dK/dV kernels spill (8 bytes of stack)",
    "3.6.0": "fails since the launch planner's kernels (run-time dense/varlen and ALiBi switches, flattened "
             "grids): the sm_80 head-dim-128 dK/dV kernels spill (8 bytes of stack); its interpreter also "
             "mis-runs the decode kernels",
    "3.7.0": "passes",
    "3.7.1": "passes",
    "3.8.0": "fails: sm_90a bf16 head-dim-64 forward and head-dim-128 split-KV kernels spill (48 and 8 bytes)",
    "3.9.0": "passes (the suite's own Triton)",
}


def _recipe_triton() -> str:
    """The Triton range of the recipe's CUDA builds (the output that compiles kernels)."""
    yaml = pytest.importorskip("yaml")
    recipe = yaml.safe_load(RECIPE.read_text())
    text = yaml.safe_dump([output.get("requirements", {}).get("build", []) for output in recipe.get("outputs", [recipe])])
    [found] = re.findall(r"triton (\S+)", text)
    return found


def _specifier():
    return Requirement(triton_requirement()).specifier


def oldest_allowed() -> str:
    [lower] = [s.version for s in _specifier() if s.operator == ">="]
    return lower


def test_one_triton_range_everywhere():
    extra = triton_requirement()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    build_system = [r for r in pyproject["build-system"]["requires"] if r.startswith("triton")]
    assert [Requirement(r).specifier for r in build_system] == [Requirement(extra).specifier]
    assert Requirement(f"triton {_recipe_triton()}".replace(" ", "")).specifier == Requirement(extra).specifier
    assert {s.operator for s in _specifier()} >= {"<", ">="}, "a lower and an upper bound"


def test_range_admits_exactly_the_releases_that_passed():
    admitted = {v for v in MEASURED if Version(v) in _specifier()}
    assert admitted == {v for v, result in MEASURED.items() if result.startswith("passes")}
    # nothing newer than the newest release measured
    newest = max(MEASURED, key=Version)
    assert all(Version(v) not in _specifier() for v in ("3.10.0", "4.0.0")) and Version(newest) in _specifier()


def test_suite_runs_with_an_allowed_triton():
    """The suite's own Triton (CI: the newest pip finds within the range) is inside the range, so
    tests/aot/test_aot_build.py in this run checks a release the package allows."""
    triton = pytest.importorskip("triton")
    assert Version(triton.__version__) in _specifier()


@pytest.mark.slow
def test_aot_build_with_the_oldest_allowed_triton(scratch):
    """tests/aot/test_aot_build.py (a fresh ahead-of-time build for sm_80 and sm_90 and every check on
    it) in a venv with the oldest Triton the range allows, flash_attn installed there from this
    checkout (op library only: FLASH_ATTN_CUDA_ARCHS=none, the test builds the kernels itself)."""
    if cuda_toolkit() is None:
        pytest.skip("no CUDA toolkit (set CUDA_HOME): the op library links its static runtime")
    oldest = oldest_allowed()
    python = make_venv(scratch / "venv", "torch==2.13.0", f"triton=={oldest}", "numpy", "pytest>=8", "hypothesis>=6",
                       "scikit-build-core>=0.11")
    src = copy_source(scratch / "src")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         f"-Cbuild-dir={scratch / 'build'}", str(src)],
        env={**os.environ, "FLASH_ATTN_CUDA_ARCHS": "none", "MAX_JOBS": "2"}, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    version = subprocess.run([str(python), "-c", "import triton; print(triton.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert Version(version) == Version(oldest)
    # From outside the source tree, so flash_attn is the venv's installed copy; its build in scratch.
    result = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"--basetemp={scratch / 'pytest'}", str(src / "tests" / "aot" / "test_aot_build.py")],
                            cwd=scratch, env={**os.environ, "MAX_JOBS": "2", "FLASH_ATTN_TEST_REBUILD": "1"},
                            capture_output=True, text=True)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"\ntriton {version}: {summary}")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary
