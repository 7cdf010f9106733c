"""FlashAttention-3's interface as its own package: the recipe's output flash-attn-fa3 and the pip
distribution flash_attn_3 (fa3_interface/), and what code that looks for FA3 finds once it is installed.

flash-attn's own wheel and package never ship ``flash_attn_interface`` or ``flash_attn_3``: only
this opt-in output does, so a real FlashAttention-3 is never shadowed unless asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

from support import REPO
from support.fa3 import FA3_SOURCE
from support.packaging_helpers import FA3_OUTPUT, MAIN_OUTPUT, render

NO_RATTLER = "py-rattler-build is not installed (pip install py-rattler-build)"


def _version() -> str:
    namespace: dict = {}
    exec((REPO / "flash_attn" / "_version.py").read_text(), namespace)
    return namespace["__version__"]


def test_versions_are_flash_attns():
    """The flash_attn_3 distribution is this flash-attn's interface: its version and its pin are
    flash-attn's (lower than any FA3 release, which replaces it as an upgrade), read from
    flash_attn/_version.py by fa3_interface/setup.py, never restated (the built wheel's metadata:
    test_wheel_holds_the_module_and_the_metadata)."""
    project = tomllib.loads((FA3_SOURCE / "pyproject.toml").read_text())["project"]
    assert project["name"] == "flash_attn_3"
    assert sorted(project["dynamic"]) == ["dependencies", "version"] and "dependencies" not in project
    assert "flash_attn/_version.py" in (FA3_SOURCE / "setup.py").read_text()
    sources = [p for p in FA3_SOURCE.rglob("*") if p.is_file() and "build" not in p.parts and "egg-info" not in str(p)]
    assert not [p for p in sources if _version() in p.read_text()]


def test_flash_attns_wheel_does_not_ship_the_fa3_names():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["scikit-build"]
    assert config["wheel"]["packages"] == ["flash_attn"]
    assert not (REPO / "flash_attn_interface.py").exists() and not (REPO / "flash_attn_3").exists()


@pytest.mark.parametrize("platform", ["linux-64", "linux-aarch64", "osx-arm64", "win-64"])
def test_render_gives_one_noarch_package(platform):
    """One noarch: python package, rendered by the CPU variant alone (no copy per CUDA variant) and
    the same file whichever platform renders it, like the CPU build (conda-smithy builds noarch
    outputs on linux_64 only), running on any build of the same flash-attn version."""
    pytest.importorskip("rattler_build", reason=NO_RATTLER)
    [v] = render(platform, output=FA3_OUTPUT)
    [linux] = render("linux-64", output=FA3_OUTPUT)
    assert v.recipe["build"]["string"] == linux.recipe["build"]["string"]
    assert v.recipe["package"] == {"name": FA3_OUTPUT, "version": _version()}
    assert v.recipe["build"]["noarch"] == "python"
    assert [str(s) for s in v.recipe["requirements"]["run"]] == ["python >=3.10", f"{MAIN_OUTPUT} =={_version()}"]
    assert "fa3_interface" in json.dumps(v.recipe["build"]["script"])
    tests = json.dumps(v.recipe["tests"])
    assert "flash_attn_interface" in tests and "flash_attn_3" in tests
    # flash-attn itself neither depends on it nor installs its names
    for main in render(platform):
        assert FA3_OUTPUT not in json.dumps(main.recipe["requirements"])


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """fa3_interface/ built into a wheel (offline, this interpreter's setuptools) and installed into
    a folder of its own: the wheel's files and the folder."""
    pytest.importorskip("setuptools", reason="fa3_interface/ builds with setuptools (the `test` extra has it; pixi's test environment does not)")
    folder = tmp_path_factory.mktemp("fa3")
    wheels = folder / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(FA3_SOURCE)], check=True, capture_output=True, cwd=folder)
    [wheel] = wheels.glob("*.whl")
    target = folder / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    return zipfile.ZipFile(wheel).namelist(), target


def test_wheel_holds_the_module_and_the_metadata(installed):
    names, target = installed
    top = {n.split("/")[0] for n in names}
    assert "flash_attn_interface.py" in top and "flash_attn_3" in top and "flash_attn" not in top
    dist_info = next(n for n in top if n.endswith(".dist-info"))
    assert dist_info.startswith(f"flash_attn_3-{_version()}")
    metadata = (target / dist_info / "METADATA").read_text().splitlines()
    assert f"Version: {_version()}" in metadata and f"Requires-Dist: flash-attn=={_version()}" in metadata


def test_transformers_finds_fa3(installed):
    """Hugging Face Transformers' detection (utils/import_utils.py): ``find_spec("flash_attn_3")``
    and the distribution's version through ``importlib.metadata``; then its FA3 path imports
    ``flash_attn_func``/``flash_attn_varlen_func`` from ``flash_attn_interface``, which run here.
    (``is_flash_attn_3_available`` also asks for a CUDA device: not part of this CPU check.)"""
    pytest.importorskip("transformers")
    _, target = installed
    code = (
        "import importlib.util, importlib.metadata, json, torch\n"
        "from transformers.utils import import_utils\n"
        "found, version = import_utils._is_package_available('flash_attn_3', return_version=True)\n"
        "from flash_attn_interface import flash_attn_func, flash_attn_varlen_func\n"
        "q = torch.randn(1, 4, 2, 16)\n"
        "out = flash_attn_func(q, q, q, causal=True)\n"
        "print(json.dumps([found, version, importlib.metadata.version('flash_attn_3'), list(out.shape),\n"
        "                  importlib.util.find_spec('flash_attn_interface').origin]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(target)})
    assert result.returncode == 0, result.stderr[-3000:]
    found, version, metadata_version, shape, origin = json.loads(result.stdout.strip().splitlines()[-1])
    assert found is True and version == metadata_version == _version()
    assert shape == [1, 4, 2, 16] and origin.startswith(str(target))
