"""The conda packaging, checked offline: recipe/recipe.yaml, conda_build_config.yaml, pixi.toml.

* the manifests validate against the pixi and rattler-build schemas in ../shared/schemas;
* py-rattler-build renders the recipe with the variant matrix: exactly the expected variants per
  platform (osx-arm64 and win-64: the CPU variant alone), the CPU build `noarch: python` (one file
  for every platform), build strings naming the CUDA version and CUDA build numbers +200, the
  declared dependencies (libtorch in host and run), CEP-20 version independence of the CUDA builds
  and the entry point, no exact pin of Python or PyTorch, linux-aarch64 cross-compiled from
  linux-64 with cross-python, the Triton bounds, the test steps' selections;
* the build scripts: build.sh on Linux/macOS (portable to macOS's bash 3.2 and BSD sed),
  build.bat on Windows, and that the recipe lets rattler-build pick the right one;
* one recipe for the checkout, pixi-build and the feedstock (its source per context), the build
  number conda-forge's bot bumps, the linter's hints (its rules: tests/packaging/test_conda_forge_review.py),
  the Python C API check of the op library;
* `pixi run build`'s test half (recipe/test_built_packages.sh) with stand-ins for rattler-build and
  nvidia-smi;
* (slow) the CPU-only build through build.sh, from pixi-build's sources: no compiler, no torch,
  no compiled file;
* (slow) a local package build: recipe/build.sh with this machine's toolchain, from pixi-build's
  sources (no tests, no README), into a staging prefix laid out like conda-forge's libtorch 2.10
  (the recipe's floor: PyPI's torch 2.10 headers and libtorch_cpu.so; no torch package in the
  build environment), a ``.conda`` assembled from it with the depends rattler-build attaches,
  inspected, then installed into a fresh venv with torch 2.13.0 where the op library loads and the
  import and a CPU test subset run.
pixi.toml is checked in tests/packaging/test_pixi_workspace.py, the solver's choice in test_conda_solver.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from support.packaging_helpers import (  # noqa: I001  (tests/ is on sys.path: pyproject.toml's pytest pythonpath)
    BUILD_BAT, BUILD_SCRIPT, PIXI, RECIPE, REPO, SCHEMAS, VARIANTS, assemble, compiled_files, copy_recipe_sources,
    extract_into_venv, lay_out_conda_forge_libtorch, make_venv, open_conda, render, run_build_script,
    run_from_site, run_test_built_packages, staged_site_packages, torch_floor_dir, triton_requirement,
)

yaml = pytest.importorskip("yaml")
NO_RATTLER = "py-rattler-build is not installed (pip install py-rattler-build): cannot render or assemble"

LINUX = ["linux-64", "linux-aarch64"]
CPU_ONLY_PLATFORMS = ["osx-arm64", "win-64"]  # no CUDA variant outside Linux
CUDA_VARIANTS = {"12.9": "cuda129", "13.0": "cuda130", "None": "cpu"}
# The CPU build is `noarch: python`: rendered for any platform, it targets `noarch`.
BUILD_NUMBERS = {"12.9": 200, "13.0": 200, "None": 0}  # conda-forge's +200 for CUDA builds
TORCH_MIN = "2.10"
PYTHON_MIN = "3.10"


def _version() -> str:
    text = (REPO / "flash_attn" / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def _schema(name: str) -> dict:
    path = SCHEMAS / name
    if not path.exists():
        pytest.skip(f"{path} is absent: the schemas live in shared/ beside the repository "
                    "(this workplace and CI); a checkout elsewhere cannot validate offline")
    return json.loads(path.read_text())


def _validate(schema: dict, document: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(document)]


def _specs(rendered, section: str) -> list[str]:
    return [str(s) for s in rendered.recipe["requirements"].get(section, [])]


def _names(specs: list[str]) -> list[str]:
    return [s.split()[0] for s in specs]


# --- the manifests ----------------------------------------------------------------------------------


def test_recipe_matches_the_schema():
    schema = _schema("rattler-recipe.schema.json")
    recipe = yaml.safe_load(RECIPE.read_text())
    errors = _validate(schema, recipe)
    assert not errors, "\n".join(errors)
    # The schema is strict enough to notice a misspelt key (else this test would prove nothing).
    main, *others = recipe["outputs"]
    misspelt = {**main, "build": {**main["build"], "scirpt": "x"}}
    assert _validate(schema, {**recipe, "outputs": [misspelt, *others]})


def test_recipe_version_is_the_package_version():
    assert str(yaml.safe_load(RECIPE.read_text())["context"]["version"]) == _version()
    assert tomllib.loads(PIXI.read_text())["workspace"]["version"] == _version()


# --- rendering ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=LINUX)
def rendered(request):
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    start = time.monotonic()
    variants = render(request.param)
    print(f"\nrender {request.param}: {len(variants)} variants in {time.monotonic() - start:.3f} s")
    return request.param, variants


def test_render_gives_exactly_the_matrix(rendered):
    platform, variants = rendered
    assert len(variants) <= 3
    assert sorted(v.cuda for v in variants) == ["12.9", "13.0", "None"]
    for v in variants:
        assert v.variant["target_platform"] == (platform if v.cuda != "None" else "noarch")
        assert "python" not in v.variant and "pytorch" not in v.variant  # not variant keys
        number = BUILD_NUMBERS[v.cuda]
        assert v.recipe["build"]["number"] == number
        assert re.fullmatch(rf"{CUDA_VARIANTS[v.cuda]}_h[0-9a-f]{{7}}_{number}", v.recipe["build"]["string"])
        assert v.recipe["package"] == {"name": "flash-attn", "version": _version()}


def _check_cpu_variant(v):
    """The CPU variant compiles nothing (no op library): cmake and ninja run the empty CMake
    project; no compiler, no CUDA, no torch headers at build time. It is `noarch: python`: the
    same file for every platform, so nothing in it may depend on the platform."""
    build, host, run = _specs(v, "build"), _specs(v, "host"), _specs(v, "run")
    constraints = _specs(v, "run_constraints")
    assert v.recipe["build"]["noarch"] == "python" and v.variant["target_platform"] == "noarch"
    assert "version_independent" not in v.recipe["build"].get("python", {})  # noarch already is
    assert build == ["cmake >=3.24", "ninja"], build
    assert host == [f"python {PYTHON_MIN}.*", "pip", "scikit-build-core >=0.11"], host
    assert run == [f"python >={PYTHON_MIN}", f"pytorch >={TORCH_MIN}"] and not constraints
    assert not any("cuda" in s for s in build + host + run), (build, host, run)
    assert re.fullmatch(r"cpu_h[0-9a-f]{7}_0", v.recipe["build"]["string"])


def test_render_requirements(rendered):
    platform, variants = rendered
    for v in variants:
        build, host, run = _specs(v, "build"), _specs(v, "host"), _specs(v, "run")
        arch = platform.replace("linux-", "")
        assert {"cmake", "ninja"} <= set(_names(build))
        # no Python extension module, so no abi3 (conda-smithy's abi3audit hint asked for one)
        assert "python-abi3" not in _names(host)
        assert f"pytorch >={TORCH_MIN}" in run and f"python >={PYTHON_MIN}" in run
        constraints = _specs(v, "run_constraints")
        if v.cuda == "None":
            _check_cpu_variant(v)
        else:
            assert f"gcc_linux-{arch} 14.*" in build and f"gxx_linux-{arch} 14.*" in build
            assert f"sysroot_linux-{arch} 2.28.*" in build
            # conda-forge's split PyTorch: the headers and libtorch_cpu.so come from libtorch (its
            # CPU build: the same stable-ABI headers without the CUDA libraries)
            assert f"libtorch {TORCH_MIN}.* cpu_*" in host and "pytorch" not in _names(host)
            assert f"cuda-nvcc_linux-{arch} {v.cuda}.*" in build
            assert "triton" in _names(build) and "python" in _names(build)  # kernel build only
            assert f"cuda-version {v.cuda}.*" in host
            assert {"cuda-cudart-dev", "cuda-cudart-static"} <= set(_names(host))
            # the op library links libtorch_cpu.so: libtorch in run, or rattler-build calls it overlinking
            assert f"libtorch >={TORCH_MIN}" in run
            # a driver; its major is held by cuda-version (nvcc's run_export), as pytorch does
            assert "pytorch * cuda*" in run and "__cuda" in run and not constraints
        assert "triton" not in _names(run)


def test_render_is_python_and_torch_version_independent(rendered):
    _, variants = rendered
    for v in variants:
        ignored = v.recipe["requirements"]["ignore_run_exports"]
        # python: pixi-build's lock applies only what is written (tests/packaging/test_pixi_workspace.py)
        if v.cuda == "None":
            assert v.recipe["build"]["noarch"] == "python"
            assert set(ignored["from_package"]) == {"python"}
        else:
            assert v.recipe["build"]["python"]["version_independent"] is True
            assert set(ignored["from_package"]) == {"python", "libtorch", "cuda-cudart-dev"}
        assert ignored["by_name"] == ["python_abi"]
        for spec in _specs(v, "run") + _specs(v, "run_constraints"):
            name, *rest = spec.split()
            if name in {"python", "pytorch", "libtorch"}:
                version = rest[0] if rest else "*"
                # a lower bound or a build selector only: never ==, a pinned x.y.*, or an upper bound
                assert version == "*" or re.fullmatch(r">=[\d.]+", version), spec


def test_render_declares_tests_and_about(rendered):
    _, variants = rendered
    for v in variants:
        about = v.recipe["about"]
        assert about["license"] == "BSD-3-Clause"
        for key in ("summary", "description", "homepage", "repository", "documentation"):
            assert about.get(key), key
        text = json.dumps(v.recipe.get("tests", []))
        assert "flash_attn" in text and "doctor" in text and "pytest" in text
        assert ("cuda.is_available" in text) == (v.cuda != "None")


@pytest.mark.parametrize("platform", CPU_ONLY_PLATFORMS)
def test_render_other_platforms_give_the_cpu_variant_only(platform):
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    variants = render(platform)
    assert [v.cuda for v in variants] == ["None"], [v.recipe["build"]["string"] for v in variants]
    [v] = variants
    assert v.recipe["package"] == {"name": "flash-attn", "version": _version()}
    _check_cpu_variant(v)
    # the one noarch file: the same build string whichever platform renders it
    [linux_cpu] = [c for c in render("linux-64") if c.cuda == "None"]
    assert v.recipe["build"]["string"] == linux_cpu.recipe["build"]["string"]
    text = json.dumps(v.recipe.get("tests", []))
    assert "cuda.is_available" not in text and "libflash_attn_aot" not in text


# --- one recipe: the checkout, pixi-build and the feedstock ------------------------------------------------


def _with(platform: str, **values):
    from rattler_build import JinjaConfig, PlatformConfig, VariantConfig

    config = VariantConfig.from_conda_build_config(VARIANTS, JinjaConfig(PlatformConfig(target_platform=platform)))
    return VariantConfig({**config.to_dict(), **values}, zip_keys=config.zip_keys or None)


CHECKOUT_SOURCES = [{"path": "../flash_attn", "target_directory": "flash_attn"}, {"path": "../csrc", "target_directory": "csrc"},
                    {"path": "../CMakeLists.txt"}, {"path": "../pyproject.toml"}, {"path": "../LICENSE"},
                    {"path": "../fa3_interface", "target_directory": "fa3_interface"}]


def test_recipe_source_follows_where_it_is_built():
    """`pixi run build` / CI (conda_build_config.yaml: checkout): the build's inputs plus the test
    files; pixi-build (pixi.toml: pixi): the build's inputs only; a feedstock (conda-forge's
    pinning, which has no such key): the release tarball, url + sha256, and nothing else."""
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    from support import conda_forge_pinning as cf

    for v in render("linux-64"):
        assert v.recipe["source"] == [*CHECKOUT_SOURCES, {"path": "../tests", "target_directory": "tests"},
                                      {"path": "../README.md"}]
    for v in render("linux-64", _with("linux-64", flash_attn_source=["pixi"])):
        assert v.recipe["source"] == CHECKOUT_SOURCES
    for platform in ("linux-64", "osx-arm64", "win-64"):
        for v in render(platform, cf.variant_config(cf.feedstock_spec(platform))):
            [source] = v.recipe["source"]
            assert sorted(source) == ["sha256", "url"]
            assert re.fullmatch(r"[0-9a-f]{64}", source["sha256"])
            assert source["url"].endswith(f"/v{_version()}.tar.gz")
    # every path exists (rattler-build fails on a missing one)
    for source in CHECKOUT_SOURCES:
        assert (RECIPE.parent / source["path"]).resolve().exists(), source


def test_build_number_is_the_one_the_bot_bumps(tmp_path):
    """conda-forge's bot bumps a context variable named `build_number` (or an integer build.number):
    bumping it moves every build, the CUDA ones keeping their +200."""
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    recipe = yaml.safe_load(RECIPE.read_text())
    assert recipe["context"]["build_number"] == 0 and "build_base" not in recipe["context"]
    text = RECIPE.read_text()
    assert text.count("  build_number: 0\n") == 1
    bumped = tmp_path / "recipe" / "recipe.yaml"
    bumped.parent.mkdir()
    bumped.write_text(text.replace("  build_number: 0\n", "  build_number: 3\n"))
    numbers = {v.cuda: (v.recipe["build"]["number"], v.recipe["build"]["string"]) for v in
               render("linux-64", _with("linux-64"), recipe_path=bumped)}
    assert {cuda: number for cuda, (number, _) in numbers.items()} == {"12.9": 203, "13.0": 203, "None": 3}
    assert all(string.endswith(f"_{number}") for number, string in numbers.values())


def test_recipe_answers_the_linters_hints():
    """conda-smithy's hints for v1 recipes (conda_smithy/linter/hints.py, 081ec6b): every python test
    also tests the newest Python (`"*"`), beside python_min; pip's check is not switched off without
    a reason (here: not switched off); the maintainers and addresses a person must fill say TODO.
    Its rules on python-abi3, conda-forge.yml's linter section and the context are restated in
    tests/packaging/test_conda_forge_review.py."""
    recipe = yaml.safe_load(RECIPE.read_text())
    python_tests = [t["python"] for output in recipe["outputs"] for t in output["tests"] if "python" in t]
    assert len(python_tests) == len(recipe["outputs"])
    for test in python_tests:
        assert test["python_version"] == ["${{ python_min }}.*", "*"]
        assert test.get("pip_check", True) is True
    assert all("TODO" in recipe["about"][key] for key in ("homepage", "repository", "documentation"))
    assert recipe["extra"]["recipe-maintainers"] == ["TODO_github_handle"]
    forge = yaml.safe_load((RECIPE.parent / "feedstock-conda-forge.yml").read_text())
    assert forge["conda_build_tool"] == "rattler-build"
    assert forge["build_platform"] == {"linux_aarch64": "linux_64"}
    assert "linter" not in forge  # nothing to skip
    [cuda] = [o for o in recipe["outputs"] if "noarch" not in o["build"]]
    assert "python check_no_python_c_api.py" in json.dumps(cuda["tests"])


def _shared_library(tmp_path: Path, name: str, code: str) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc)")
    source = tmp_path / f"{name}.c"
    source.write_text(code)
    library = tmp_path / f"lib{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def _check_c_api(*libraries: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RECIPE.parent / "check_no_python_c_api.py"), *map(str, libraries)],
                          capture_output=True, text=True)


def test_check_no_python_c_api_flags_what_abi3audit_lets_through(tmp_path):
    """The recipe's Python C API check on two small libraries: one that imports a limited-API and a
    private CPython symbol is refused, one without is accepted. (abi3audit 0.0.x, run on such a
    library, reports no violation at all: it audits extension modules, which the op library is
    not; tests/packaging/test_conda_prefix_build.py runs the check on the real op library.)"""
    uses = _shared_library(tmp_path, "uses", "int Py_IsInitialized(void); int _PyObject_GC_New(void);\n"
                                           "int f(void) { return Py_IsInitialized() + _PyObject_GC_New(); }\n")
    clean = _shared_library(tmp_path, "clean", "int g(void) { return 1; }\n")
    refused = _check_c_api(uses)
    assert refused.returncode == 1 and "Py_IsInitialized" in refused.stdout and "_PyObject_GC_New" in refused.stdout
    accepted = _check_c_api(clean)
    assert accepted.returncode == 0 and "no Python C API" in accepted.stdout
    assert _check_c_api(clean, uses).returncode == 1


# --- `pixi run build`: built, then tested as far as the machine can -----------------------------------------


# What `pixi run build` writes: the CUDA builds into output/<subdir>, the CPU build into output/noarch.
PACKAGES = {"linux-64": ["flash-attn-2.8.3.1-cuda129_h1111111_200.conda", "flash-attn-2.8.3.1-cuda130_h2222222_200.conda"],
            "noarch": ["flash-attn-2.8.3.1-cpu_h3333333_0.conda"]}


@pytest.mark.parametrize("driver,expected", [
    (None, {"cuda129": "12.0", "cuda130": "13.0", "cpu": ""}),     # no driver: both CUDA builds with the override
    ("12.8", {"cuda129": "", "cuda130": "13.0", "cpu": ""}),       # CUDA 12 driver: the 13.0 build with it
    ("13.0", {"cuda129": "", "cuda130": "", "cpu": ""}),           # CUDA 13 driver: every build as it is
])
def test_built_packages_are_tested_as_far_as_the_machine_can(driver, expected, tmp_path):
    """recipe/test_built_packages.sh (the second half of `pixi run build`) with stand-ins for
    rattler-build and nvidia-smi, in the environment the task gives it (pixi.toml's CONDA_OVERRIDE_CUDA
    for the build's solves): each package is tested, a CUDA build this machine has no driver for
    with CONDA_OVERRIDE_CUDA set to its major (its import, doctor and CPU tests run, its GPU step
    reports the GPU tests as not run), every other one without the override, with the machine's own
    driver; it says so per package. What it cannot show: rattler-build installing the test
    environments (tests/packaging/test_pixi_workspace.py solves them)."""
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("the stand-in packages are linux-64's")
    task_env = tomllib.loads(PIXI.read_text())["tasks"]["build"].get("env", {})
    result, calls = run_test_built_packages(tmp_path, PACKAGES, driver, task_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {name.split("-")[3].split("_")[0]: override for name, override in calls.items()} == expected
    assert sorted(calls) == sorted(n for names in PACKAGES.values() for n in names)
    for kind, override in expected.items():
        if override:
            assert f"no driver for CUDA {override.split('.')[0]} here" in result.stdout and "GPU tests not run" in result.stdout
    assert not (tmp_path / "output" / "broken").exists()


def test_built_packages_fail_the_task_when_a_test_fails(tmp_path):
    result, calls = run_test_built_packages(tmp_path / "failing", PACKAGES, None, {}, failing="cpu_")
    assert result.returncode == 1
    assert len(calls) == 3  # the others were still tested
    result, calls = run_test_built_packages(tmp_path / "empty", {}, None, {})
    assert result.returncode == 1 and "no flash-attn package" in result.stderr and not calls


# What rattler-build does with `build: script: file:` (rattler_build_script's Script::find_file and
# platform_script_extensions): a name without an extension gets the platform's script extensions
# in order (Windows: bat, then ps1; elsewhere: sh), and the extension picks the interpreter. A name
# with an extension is taken as is on every platform (build.sh would be run with bash on Windows).
SCRIPT_EXTENSIONS = {"win": ("bat", "ps1"), "unix": ("sh",)}


def _resolve_build_script(file: str, platform: str) -> Path | None:
    path = RECIPE.parent / file
    if path.suffix:
        return path if path.is_file() else None
    family = "win" if platform.startswith("win") else "unix"
    return next((c for c in (path.with_suffix(f".{e}") for e in SCRIPT_EXTENSIONS[family]) if c.is_file()), None)


@pytest.mark.parametrize("platform", LINUX + CPU_ONLY_PLATFORMS)
def test_build_script_resolves_per_platform(platform):
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    expected = BUILD_BAT if platform.startswith("win") else BUILD_SCRIPT
    for v in render(platform):
        script = v.recipe["build"]["script"]
        # No interpreter pinned (it would apply on every platform): the file's extension decides.
        assert "interpreter" not in script, script
        assert _resolve_build_script(script["file"], platform) == expected, script


def test_build_sh_is_portable_to_macos():
    """macOS runs build.sh with /bin/bash 3.2 and BSD userland; the GNU-only constructs this script
    once had must not come back."""
    script = BUILD_SCRIPT.read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert script.startswith("#!/usr/bin/env bash\n")
    assert not re.search(r"\bsed\s+(-\w+\s+)*-\w*i\b", code), "sed -i: BSD sed needs a suffix argument"
    # bash < 4.4 with `set -u` calls an empty "$@" unbound; ${1+"$@"} expands to nothing instead.
    assert '"$@"' not in code.replace('${1+"$@"}', ""), 'a bare "$@" (use ${1+"$@"})'


def test_entry_point_is_declared_for_the_installer():
    """CEP-20 packages get their console scripts from the installer (info/link.json), so the
    recipe declares what pyproject.toml's [project.scripts] does; rattler-build then drops pip's
    bin/ script, whose shebang names the build machine's Python."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    declared = [f"{name} = {target}" for name, target in scripts.items()]
    for platform in LINUX + CPU_ONLY_PLATFORMS:
        for v in render(platform):
            assert v.recipe["build"]["python"]["entry_points"] == declared


def test_linux_aarch64_cross_compiles_from_linux_64():
    """conda-forge builds linux-aarch64 on linux-64 (conda-forge.yml `build_platform`): every CUDA
    variant then has cross-python for the target, so $PYTHON (pip) runs here and installs for
    aarch64; the kernel build runs with the build machine's own Python. The noarch CPU build is
    the same file wherever it is built: nothing to cross-compile."""
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    cross = render("linux-aarch64", build_platform="linux-64")
    native = render("linux-aarch64")
    assert sorted(v.cuda for v in cross) == sorted(v.cuda for v in native) == ["12.9", "13.0", "None"]
    for v in cross:
        build = _specs(v, "build")
        if v.cuda == "None":
            assert build == ["cmake >=3.24", "ninja"], build
            continue
        assert "cross-python_linux-aarch64" in build and f"python {PYTHON_MIN}.*" in build
        assert v.recipe["build"]["script"]["env"]["PYTHON_MIN"] == PYTHON_MIN
    for v in native:
        assert not any(s.startswith("cross-python") for s in _specs(v, "build"))


def _fake_python(path: Path, log: Path) -> Path:
    """A stand-in interpreter that records how build.sh called it (arguments and the variables the
    build reads) and succeeds."""
    path.write_text("#!/usr/bin/env bash\n"
                    f'{{ echo "$0 $*"; echo "TORCH_DIR=$FLASH_ATTN_TORCH_DIR"; }} >> "{log}"\n')
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("cuda", ["12.9", "None"])
def test_build_sh_uses_the_build_machines_python_and_the_prefix_torch(cuda, tmp_path):
    """recipe/build.sh, run as in a cross build: bin/python of the build prefix is cross-python's
    shim (it would pretend to be aarch64), bin/python<python_min> the real interpreter. The kernel
    build (CMake's Python) must be the latter, PyTorch must come from $PREFIX (conda-forge's
    libtorch layout), and pip runs through $PYTHON."""
    build_prefix, prefix, log = tmp_path / "build_env", tmp_path / "host_env", tmp_path / "calls.log"
    (build_prefix / "bin").mkdir(parents=True)
    (prefix / "bin").mkdir(parents=True)
    _fake_python(build_prefix / "bin" / "python", log)  # the cross-python shim
    real = _fake_python(build_prefix / "bin" / f"python{PYTHON_MIN}", log)
    host_python = _fake_python(prefix / "bin" / "python", log)
    env = {**os.environ, "PREFIX": str(prefix), "BUILD_PREFIX": str(build_prefix), "PYTHON": str(host_python),
           "SRC_DIR": str(tmp_path), "PYTHON_MIN": PYTHON_MIN, "cuda_compiler_version": cuda}
    env.pop("FLASH_ATTN_TORCH_DIR", None)
    env.pop("KERNEL_PYTHON", None)
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = log.read_text().splitlines()
    assert calls[0].startswith(f"{host_python} -m pip install . ") and len(calls) == 2, calls
    if cuda == "None":
        assert "Python_EXECUTABLE" not in calls[0]
    else:
        assert calls[0].endswith(f"-Ccmake.define.Python_EXECUTABLE={real}"), calls[0]
        assert calls[1] == f"TORCH_DIR={prefix}"


def _pytest_steps(v) -> list[tuple[str, list[str]]]:
    """(pytest command, files the step copies) of each script test of a rendered variant."""
    steps = []
    for test in v.recipe.get("tests", []):
        script = test.get("script")
        script = " ".join(script) if isinstance(script, list) else script or ""
        for command in re.findall(r"python -m pytest [^;]+", script):
            steps.append((command.strip(), test.get("files", {}).get("source", [])))
    return steps


def test_recipe_test_steps_run_from_the_copied_files(tmp_path):
    """rattler-build runs each test step in a folder holding only the files the step copies. There,
    each pytest selection must collect without error (no test module reads a file left behind,
    e.g. the README) and select something; the CUDA variants' GPU step selects the gpu-marked tests
    and never the full kernel matrix (pyproject.toml's addopts are not what decides it). The CPU
    variant's one step is the CUDA variants' first."""
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    variants = {v.cuda: v for v in render("linux-64")}
    steps = _pytest_steps(variants["12.9"])
    assert len(steps) == 2 and _pytest_steps(variants["None"]) == steps[:1], steps
    assert '-m "gpu and not full_matrix" tests/' in steps[1][0]
    for index, (command, files) in enumerate(steps):
        folder = tmp_path / f"step{index}"
        for name in files:
            source, target = REPO / name.rstrip("/"), folder / name.rstrip("/")
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
        args = _shell_words(command.split(maxsplit=3)[3])  # after `python -m pytest`
        result = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only"],
                                cwd=folder, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        selected = re.search(r"^(\d+)(?:/\d+)? tests? collected", result.stdout, re.M)
        assert selected and int(selected.group(1)) > 0, result.stdout[-1000:]


def _shell_words(text: str) -> list[str]:
    """The arguments as the shell splits them (the -m expression is one quoted word)."""
    import shlex

    return shlex.split(text)


# --- the CPU-only build ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_cpu_only_build_compiles_nothing(scratch):
    """recipe/build.sh for the CPU variant (what osx-arm64 and linux run; build.bat does the same
    pip install on Windows) with a Python that has scikit-build-core and nothing else: no torch, no
    triton, and a C/C++ compiler that does not exist. The staged package has no compiled file,
    imports, and says why it has no `aot` backend."""
    build_python = make_venv(scratch / "build-venv", "scikit-build-core>=0.11")
    # pixi-build's work directory: the build's inputs only (build.sh writes README.md's stand-in)
    [cpu] = [v for v in render("linux-64", _with("linux-64", flash_attn_source=["pixi"])) if v.cuda == "None"]
    src = copy_recipe_sources(cpu, scratch / "src")
    assert sorted(p.name for p in src.iterdir()) == ["CMakeLists.txt", "LICENSE", "csrc", "fa3_interface", "flash_attn",
                                                     "pyproject.toml"]
    prefix = scratch / "prefix"
    run = run_build_script(src, prefix, build_python, {
        "cuda_compiler_version": "None", "CC": "/nonexistent/cc", "CXX": "/nonexistent/c++",
    })
    assert "CPU-only build" in run.log
    site = staged_site_packages(prefix)
    assert compiled_files(prefix) == []
    assert [p.name for p in (site / "flash_attn" / "_C").iterdir()] == ["build_config.json"]
    assert not (site / "flash_attn" / "_aot").exists()
    [dist_info] = site.glob("flash_attn-*.dist-info")
    assert not (dist_info / "direct_url.json").exists()
    assert "Tag: py3-none-any" in (dist_info / "WHEEL").read_text()  # a pure wheel, no platform
    probe = run_from_site(site, "-c", "import flash_attn, json; from flash_attn.aot import library as a; "
                          "s = a.status(); print(json.dumps([flash_attn.__file__, s.loaded, s.reason]))", cwd=scratch)
    assert probe.returncode == 0, probe.stderr
    location, loaded, reason = json.loads(probe.stdout)
    assert Path(location).is_relative_to(site)
    assert not loaded and reason.startswith("this is a CPU-only build of flash_attn")
    print(f"\nCPU-only build.sh: {run.seconds:.1f} s")


@pytest.mark.slow
def test_release_tarball_builds_the_cpu_variant(scratch):
    """The feedstock's source: a release tarball, i.e. `git archive` of the tagged commit (what
    GitHub serves under /archive/refs/tags/). Here the archive of HEAD: it holds every file the
    build reads, and build.sh builds the CPU variant from it (the CUDA variants read the same
    files, tests/packaging/test_packaging.py's local package build)."""
    import tarfile

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    archive = scratch / "release.tar"
    subprocess.run(["git", "archive", "--format=tar", "--prefix=flash-attn/", "-o", str(archive), "HEAD"], cwd=REPO, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(scratch, filter="data")
    src = scratch / "flash-attn"
    for source in CHECKOUT_SOURCES:
        assert (src / source["path"].removeprefix("../")).exists(), source
    build_python = make_venv(scratch / "build-venv", "scikit-build-core>=0.11")
    prefix = scratch / "prefix"
    run = run_build_script(src, prefix, build_python, {"cuda_compiler_version": "None"})
    assert "CPU-only build" in run.log
    assert list(staged_site_packages(prefix).glob("flash_attn-*.dist-info"))


# --- a local package build ------------------------------------------------------------------------------

# One architecture keeps the CI run short on 2 cores; "80;90" measured 4 min 37 s (build.sh 229 s).
BUILD_ARCHS = os.environ.get("FLASH_ATTN_PACKAGING_ARCHS", "80")
# The size budget of a full release build (the default archs + sm_80 PTX); this build has fewer archs.
SIZE_BUDGET_MIB = 100


def _local_cuda() -> tuple[Path, str] | None:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    return (home, match.group(1)) if match and (home / "bin" / "ptxas").exists() else None


@pytest.fixture(scope="module")
def local_package(tmp_path_factory):
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    cuda = _local_cuda()
    if cuda is None:
        pytest.skip("no CUDA toolkit (nvcc, ptxas) on this machine: the local CUDA package build needs one")
    cuda_home, cuda_version = cuda
    [variant] = [v for v in render("linux-64") if v.cuda == cuda_version] or [None]
    if variant is None:
        pytest.skip(f"this machine's CUDA {cuda_version} is not a variant of conda_build_config.yaml")
    work = tmp_path_factory.mktemp("package")
    # The build venv plays the conda build prefix: python and triton, no torch (as in the recipe).
    build_python = make_venv(work / "build-venv", triton_requirement(), "scikit-build-core>=0.11")
    # The work directory pixi-build makes: the pixi variant's sources only (no tests, no README).
    [pixi_variant] = [v for v in render("linux-64", _with("linux-64", flash_attn_source=["pixi"])) if v.cuda == cuda_version]
    src = copy_recipe_sources(pixi_variant, work / "src")
    assert not (src / "tests").exists() and not (src / "README.md").exists()
    # The staging prefix plays the host prefix: conda-forge's libtorch layout, of the recipe's
    # floor (PyTorch 2.10: libtorch 2.10.* in host); the package is then run with torch 2.13.
    try:
        floor = torch_floor_dir()
    except RuntimeError as error:
        pytest.skip(f"PyTorch 2.10, the recipe's floor, is not available here: {error}")
    prefix = lay_out_conda_forge_libtorch(work / "prefix", floor)
    run = run_build_script(src, prefix, build_python, {
        # ptxas is the local toolkit's; build.sh points the build at $PREFIX for torch.
        "cuda_compiler_version": cuda_version, "CUDA_HOME": str(cuda_home),
        "BUILD_PREFIX": str(build_python.parents[1]), "KERNEL_PYTHON": str(build_python),
        "TRITON_PTXAS_PATH": str(cuda_home / "bin" / "ptxas"), "FLASH_ATTN_CUDA_ARCHS": BUILD_ARCHS, "MAX_JOBS": "2",
    })
    # index.json's depends: what rattler-build itself attaches for this variant (its solve of build
    # and host over conda-forge-shaped packages with their run_exports, tests/support/conda_channel.py).
    from support import conda_channel

    channel = conda_channel.write_package_channel(work / "channel", conda_channel.conda_forge_records("linux-64"))
    [attached] = [r for r in conda_channel.rattler_build_records(RECIPE, "linux-64", channel, [VARIANTS],
                                                                 {"cuda_compiler_version": [cuda_version]})]
    start = time.monotonic()
    path = assemble(variant, prefix, work / "output", "linux-64", depends=attached["depends"])
    assemble_s = time.monotonic() - start
    print(f"\nlocal build (CUDA {cuda_version}, archs {BUILD_ARCHS}): {run.seconds:.0f} s, "
          f"peak RSS {run.peak_rss_mib:.0f} MiB; assemble {assemble_s:.1f} s; "
          f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB")
    yield variant, path, open_conda(path), {"work": work, "src": src, "prefix": prefix, "run": run}
    shutil.rmtree(work, ignore_errors=True)  # the build venv and the build (GBs): see conftest's scratch


@pytest.mark.slow
def test_package_index(local_package):
    variant, path, archive, _ = local_package
    index = archive.index
    assert path.name == f"flash-attn-{_version()}-{index['build']}.conda"
    assert index["name"] == "flash-attn" and index["version"] == _version()
    assert index["build"] == variant.recipe["build"]["string"]
    assert index["subdir"] == "linux-64" and index["noarch"] == "python"  # CEP-20
    assert index["build_number"] == 200
    # the recipe's run requirements, and what rattler-build attached from build and host: the
    # compilers' and sysroot's, nvcc's cuda-version; not python_abi (python's, dropped for a
    # version-independent package), not libtorch's exact pin, not cuda-cudart (ignored), and no
    # python-abi3 (no extension module: any Python >= python_min, free-threaded ones too)
    major = variant.cuda.split(".")[0]
    assert set(_specs(variant, "run")) < set(index["depends"])
    assert {"libgcc >=14", "libstdcxx >=14", "__glibc >=2.28,<3.0.a0",
            f"cuda-version >={variant.cuda},<{int(major) + 1}"} <= set(index["depends"]), index["depends"]
    assert not [d for d in index["depends"] if d.startswith(("python_abi ", "cuda-cudart", "libtorch >=2.10.0,<",
                                                             "cpython", "_python_abi3_support"))]
    assert sorted(index.get("constrains", [])) == sorted(_specs(variant, "run_constraints"))
    assert index["license"] == "BSD-3-Clause"


@pytest.mark.slow
def test_package_was_built_against_the_torch_floor(local_package):
    """The op library in the package was compiled against PyTorch 2.10's headers (the recipe's
    libtorch 2.10.* in host) and uses no Python C API; test_package_installs_and_runs_in_a_fresh_venv
    then loads it into torch 2.13."""
    _, _, archive, dirs = local_package
    assert "torch 2.10.0 headers from" in dirs["run"].log
    library = dirs["work"] / "libflash_attn_aot.so"
    library.write_bytes(archive.files["site-packages/flash_attn/_C/libflash_attn_aot.so"])
    result = subprocess.run([sys.executable, str(RECIPE.parent / "check_no_python_c_api.py"), str(library)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.slow
def test_package_files(local_package):
    _, path, archive, _ = local_package
    names = set(archive.files)
    site = "site-packages/flash_attn"
    assert f"{site}/__init__.py" in names and f"{site}/_version.py" in names
    assert f"{site}/_C/libflash_attn_aot.so" in names and f"{site}/_C/build_config.json" in names
    assert any(n.startswith("site-packages/flash_attn-") and n.endswith(".dist-info/METADATA") for n in names)
    assert not any(n.startswith("lib/python") for n in names), "CEP-20: no lib/pythonX.Y paths"
    assert any(n.startswith("info/licenses/") for n in names), "the license travels with the package"
    config = json.loads(archive.files[f"{site}/_C/build_config.json"])
    assert config["cuda"] is True
    manifest_name = f"{site}/_aot/manifest.json"
    assert manifest_name in names, "the CUDA variant ships the AOT kernels"
    for arch in BUILD_ARCHS.split(";"):
        # sm_90 and newer are built as their arch-specific "a" targets (sm_90a) where the kernels need it
        # (images may be stored zlib-compressed: <name>.cubin.zlib, flash_attn/aot/library.py)
        cubins = [n for n in names if re.match(rf"{site}/_aot/images/sm_{arch}a?/.+\.cubin(\.zlib)?$", n)]
        assert cubins, f"no cubins for sm_{arch}"
    assert any(re.match(rf"{site}/_aot/images/compute_80/.+\.ptx(\.zlib)?$", n) for n in names)
    assert path.stat().st_size <= SIZE_BUDGET_MIB * 2**20


@pytest.mark.slow
def test_package_has_no_build_paths(local_package):
    _, _, archive, dirs = local_package
    needles = {str(REPO).encode(), str(dirs["work"]).encode(), str(dirs["src"]).encode(), str(dirs["prefix"]).encode()}
    offenders = []
    for name, data in archive.files.items():
        if name.startswith("info/") or b"\0" in data[:8192]:
            continue  # binary files are not text; info/ holds the recipe and metadata
        offenders += [f"{name}: {n.decode()}" for n in needles if n in data]
    assert not offenders, offenders


@pytest.mark.slow
def test_package_installs_and_runs_in_a_fresh_venv(local_package, scratch):
    _, _, archive, _ = local_package
    python = make_venv(scratch / "venv", "torch==2.13.0", "pytest>=8", "hypothesis>=6")
    site = extract_into_venv(archive, python)
    probe = subprocess.run([str(python), "-c", "import flash_attn, json; print(flash_attn.__file__)"],
                           cwd=scratch, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(site), probe.stdout
    # the op library, compiled against torch 2.10's headers, loads into torch 2.13 and registers its ops
    load = subprocess.run([str(python), "-c", "import sys, torch; torch.ops.load_library(sys.argv[1]); "
                           "print(torch.__version__, hasattr(torch.ops.flash_attn, 'aot_launch'))",
                           str(site / "flash_attn" / "_C" / "libflash_attn_aot.so")], cwd=scratch, capture_output=True, text=True)
    assert load.returncode == 0, load.stderr[-3000:]
    assert load.stdout.startswith("2.13") and load.stdout.split()[1] == "True", load.stdout
    doctor = subprocess.run([str(python), "-m", "flash_attn", "doctor"], cwd=scratch, capture_output=True, text=True)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    # The CPU subset, from a folder outside the source tree so flash_attn comes from the venv.
    tests = [str(REPO / "tests" / name) for name in ("backends/test_reference_backend.py", "api/test_bad_input.py")]
    result = subprocess.run([str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                            cwd=scratch, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


def test_built_packages_leave_the_fa3_interface_untested_and_say_so(tmp_path):
    """flash-attn-fa3 (noarch) is not tested by test_built_packages.sh: its test environment needs
    the flash-attn just built, which is not on a channel (docs/conda-forge.md); the script says so
    and still tests flash-attn's packages."""
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("the stand-in packages are linux-64's")
    fa3 = "flash-attn-fa3-2.8.3.1-pyh4444444_0.conda"
    packages = {**PACKAGES, "noarch": [*PACKAGES["noarch"], fa3]}
    result, calls = run_test_built_packages(tmp_path, packages, None, {})
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(calls) == sorted(n for names in PACKAGES.values() for n in names)
    assert f"{fa3}: not tested here" in result.stdout
