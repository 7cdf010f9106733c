"""Which flash-attn build a user gets, decided by a real solver.

py-rattler (the solver pixi is built on) solves over a local channel (tests/support/conda_channel.py):
the builds conda-forge's feedstock would publish (this recipe rendered with the pinning and the CUDA
13 migration, tests/support/conda_forge_pinning.py), each as rattler-build itself solves its build and host
environments and attaches their run_exports (``--render-only --with-solve`` over a channel of real,
empty packages carrying their feedstocks' run_exports.json), beside
conda-forge-shaped Python, PyTorch, Triton and CUDA records. The CPU build is `noarch: python`:
the feedstock builds it once, on linux-64 (conda-smithy drops a noarch build on every other
platform), and that one file is what macOS, Windows and a Linux machine without a driver get. Each
scenario is a machine (its virtual packages: a CUDA 12 or 13 driver, none, macOS, Windows) and what
the user asks for, and asserts the exact flash-attn build picked.

The CPU build is given a *newer* timestamp than the CUDA builds (a rebuild, or a CI job that
finished later): with equal build numbers that alone makes solvers prefer it
(``test_without_the_build_number_offset_gpu_machines_get_the_cpu_build`` shows it), so the CUDA
builds win only by the recipe's +200 build-number offset.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

rattler = pytest.importorskip("rattler", reason="py-rattler is not installed (pip install py-rattler)")
pytest.importorskip("rattler_build", reason="py-rattler-build is not installed (pip install py-rattler-build)")

from support import conda_channel, conda_forge_pinning as cf  # noqa: E402
from support.packaging_helpers import FA3_OUTPUT, MAIN_OUTPUT, RECIPE, render  # noqa: E402

PLATFORMS = ["linux-64", "linux-aarch64", "osx-arm64", "win-64"]
# The noarch outputs: the CPU build and FlashAttention-3's interface, one file each for every platform.
NOARCH = ("cpu", "fa3")


def virtual(name: str, version: str, build: str = "0"):
    return rattler.GenericVirtualPackage(rattler.PackageName(name), rattler.Version(version), rattler.BuildString(build))


LINUX = [virtual("__unix", "0"), virtual("__linux", "6.8"), virtual("__glibc", "2.35"), virtual("__archspec", "1", "x86_64_v3")]
ARM = [virtual("__unix", "0"), virtual("__linux", "6.8"), virtual("__glibc", "2.35"), virtual("__archspec", "1", "aarch64")]
MACHINES = {
    "linux, no GPU": ("linux-64", LINUX),
    "linux, CUDA 12 driver": ("linux-64", [*LINUX, virtual("__cuda", "12.8")]),  # e.g. driver 570
    "linux, CUDA 13 driver": ("linux-64", [*LINUX, virtual("__cuda", "13.0")]),  # e.g. driver 580
    "macOS": ("osx-arm64", [virtual("__unix", "0"), virtual("__osx", "15.5"), virtual("__archspec", "1", "m1")]),
    "windows, CUDA 13 driver": ("win-64", [virtual("__win", "0"), virtual("__cuda", "13.0")]),
    "linux-aarch64, no GPU": ("linux-aarch64", ARM),  # e.g. a Graviton server
    "linux-aarch64, CUDA 13 driver": ("linux-aarch64", [*ARM, virtual("__cuda", "13.0")]),  # e.g. GH200, Thor
}


@dataclass
class Scenario:
    machine: str
    specs: list[str]
    flash_attn: str  # cuda129 | cuda130 | cpu: which of our builds
    pytorch: str = ""  # a prefix of the PyTorch build string, when the scenario is about it
    python: str = ""  # the Python minor version, when the scenario is about it
    torch_version: str = ""
    installed: list[str] = field(default_factory=list)  # specs of an environment solved first, then locked


SCENARIOS = {
    "CUDA 12 driver": Scenario("linux, CUDA 12 driver", ["flash-attn"], "cuda129", pytorch="cuda129"),
    "CUDA 13 driver": Scenario("linux, CUDA 13 driver", ["flash-attn"], "cuda130", pytorch="cuda130"),
    "CUDA PyTorch requested": Scenario("linux, CUDA 12 driver", ["flash-attn", "pytorch * cuda*"], "cuda129", pytorch="cuda129"),
    "CPU PyTorch pinned on a GPU machine": Scenario("linux, CUDA 13 driver", ["flash-attn", "pytorch * cpu*"], "cpu", pytorch="cpu"),
    "no GPU": Scenario("linux, no GPU", ["flash-attn"], "cpu", pytorch="cpu"),
    "macOS": Scenario("macOS", ["flash-attn"], "cpu", pytorch="cpu"),
    "Windows with a CUDA driver": Scenario("windows, CUDA 13 driver", ["flash-attn"], "cpu"),
    "Python 3.10": Scenario("linux, CUDA 12 driver", ["flash-attn", "python 3.10.*"], "cuda129", python="3.10"),
    "Python 3.14": Scenario("linux, CUDA 13 driver", ["flash-attn", "python 3.14.*"], "cuda130", python="3.14"),
    "PyTorch 2.10 kept": Scenario("linux, CUDA 12 driver", ["python", "pytorch", "flash-attn"], "cuda129",
                                  pytorch="cuda129", torch_version="2.10.0",
                                  installed=["python 3.12.*", "pytorch 2.10.* cuda129*"]),
    "env with a CUDA 12.9 PyTorch, CUDA 13 driver": Scenario(
        "linux, CUDA 13 driver", ["python", "pytorch", "flash-attn"], "cuda129", pytorch="cuda129",
        torch_version="2.13.0", python="3.12", installed=["python 3.12.*", "pytorch * cuda129*"]),
    "CPU build asked for on a GPU machine": Scenario("linux, CUDA 13 driver", ["flash-attn * cpu*"], "cpu"),
    "linux-aarch64 without a GPU": Scenario("linux-aarch64, no GPU", ["flash-attn"], "cpu", pytorch="cpu"),
    "linux-aarch64 with a CUDA 13 driver": Scenario("linux-aarch64, CUDA 13 driver", ["flash-attn"], "cuda130", pytorch="cuda130"),
    # FlashAttention-3's interface brings flash-attn, and the same build flash-attn alone would get
    "FA3 interface, CUDA 13 driver": Scenario("linux, CUDA 13 driver", ["flash-attn-fa3"], "cuda130", pytorch="cuda130"),
    "FA3 interface, macOS": Scenario("macOS", ["flash-attn-fa3"], "cpu", pytorch="cpu"),
    "FA3 interface, Windows": Scenario("windows, CUDA 13 driver", ["flash-attn-fa3"], "cpu"),
}


def write_variant_file(config, path: Path) -> Path:
    """A py-rattler-build VariantConfig as the variants file rattler-build reads (zip_keys kept)."""
    import yaml

    path.write_text(yaml.safe_dump({**config.to_dict(), **({"zip_keys": config.zip_keys} if config.zip_keys else {})}))
    return path


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict:
    """The feedstock's builds: platform -> kind (cuda129/cuda130/cpu) -> repodata record, as
    rattler-build itself renders and solves them (``--render-only --with-solve``) over a channel
    of real packages: their ``depends`` are the recipe's run requirements plus the run_exports
    rattler-build attached from the solved build and host environments. Every platform's "cpu" and
    "fa3" are the noarch records the feedstock publishes (built on linux-64)."""
    folder = tmp_path_factory.mktemp("rattler-build")
    url = conda_channel.write_package_channel(folder / "channel", [r for p in PLATFORMS for r in conda_channel.conda_forge_records(p)])
    builds = {}
    for platform in PLATFORMS:
        variants = write_variant_file(cf.variant_config(cf.feedstock_spec(platform)), folder / f"{platform}.yaml")
        records = conda_channel.rattler_build_records(RECIPE, platform, url, [variants])
        builds[platform] = {r["build"].split("_")[0]: r for r in records if r["name"] == MAIN_OUTPUT}
        # every build the feedstock renders (skipped ones left out) was solved
        assert sorted(builds[platform]) == sorted(v.recipe["build"]["string"].split("_")[0]
                                                  for v in render(platform, cf.variant_config(cf.feedstock_spec(platform))))
        # FlashAttention-3's interface: one noarch package, rendered with the CPU variant
        [builds[platform]["fa3"]] = [r for r in records if r["name"] == FA3_OUTPUT]
        assert len(records) == len(builds[platform]), records
    for kind in NOARCH:
        noarch = builds["linux-64"][kind]
        assert noarch["subdir"] == "noarch" and noarch["noarch"] == "python"
        for platform in PLATFORMS:
            # rendered anywhere, a noarch output is the same file; conda-smithy builds it on linux-64 only
            assert builds[platform][kind]["fn"] == noarch["fn"] and builds[platform][kind]["depends"] == noarch["depends"]
            builds[platform][kind] = noarch
    builds["linux-64"]["cpu"]["timestamp"] += 3_600_000  # the CPU build is the newest (see the docstring)
    return builds


def _channel(folder: Path, ours: dict) -> str:
    records = [r for p in PLATFORMS for r in conda_channel.conda_forge_records(p)]
    records += [r for p in PLATFORMS for kind, r in ours[p].items() if kind not in NOARCH]
    records += [ours["linux-64"][kind] for kind in NOARCH]
    return conda_channel.write_channel(folder, records)


@pytest.fixture(scope="module")
def channel(tmp_path_factory, ours) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp("channel")
    return _channel(folder / "channel", ours), folder / "cache"


def solve(channel: tuple[str, Path], machine: str, specs: list[str], locked=()) -> dict:
    """The environment py-rattler solves: package name -> its record."""
    url, cache = channel
    platform, virtual_packages = MACHINES[machine]
    records = asyncio.run(rattler.solve(
        [url], specs, gateway=rattler.Gateway(cache_dir=str(cache)), platforms=[platform, "noarch"],
        virtual_packages=virtual_packages, locked_packages=list(locked)))
    return {r.name.normalized: r for r in records}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_solver_picks_the_right_build(name, channel, ours):
    scenario = SCENARIOS[name]
    platform = MACHINES[scenario.machine][0]
    locked = solve(channel, scenario.machine, scenario.installed).values() if scenario.installed else ()
    env = solve(channel, scenario.machine, scenario.specs, locked)
    flash_attn, pytorch = str(env["flash-attn"].build), str(env["pytorch"].build)
    assert ("flash-attn-fa3" in env) == ("flash-attn-fa3" in scenario.specs)  # never without asking
    assert flash_attn == ours[platform][scenario.flash_attn]["build"], f"{name}: got {flash_attn} with pytorch {pytorch}"
    assert pytorch.startswith(scenario.pytorch), pytorch
    if scenario.flash_attn != "cpu":
        assert pytorch.startswith("cuda")  # a CUDA build of flash-attn only with a CUDA PyTorch
    if scenario.python:
        assert str(env["python"].version).startswith(scenario.python + "."), env["python"].version
    if scenario.torch_version:
        assert str(env["pytorch"].version) == scenario.torch_version
    if scenario.installed:
        # adding flash-attn changed nothing that was installed
        before = {r.name.normalized: str(r.build) for r in locked}
        assert {n: str(r.build) for n, r in env.items() if n in before} == before


def test_without_the_build_number_offset_gpu_machines_get_the_cpu_build(tmp_path, ours):
    """The control: the same builds with build number 0 everywhere (the recipe before issue 10)
    give a GPU machine the CPU build beside a CUDA PyTorch, the defect the offset fixes."""
    flat = {p: {kind: {**r, "build_number": 0} for kind, r in builds.items()} for p, builds in ours.items()}
    for builds in flat.values():
        builds["cpu"] = flat["linux-64"]["cpu"]
    channel = (_channel(tmp_path / "channel", flat), tmp_path / "cache")
    for machine in ("linux, CUDA 12 driver", "linux, CUDA 13 driver"):
        env = solve(channel, machine, ["flash-attn"])
        assert str(env["flash-attn"].build) == ours["linux-64"]["cpu"]["build"]
        assert str(env["pytorch"].build).startswith("cuda")


@pytest.mark.parametrize("machine", list(MACHINES))
def test_cpu_build_installs_everywhere(machine, channel, ours):
    env = solve(channel, machine, ["flash-attn * cpu*"])
    assert str(env["flash-attn"].build) == ours[MACHINES[machine][0]]["cpu"]["build"]


def test_records_carry_the_run_exports(ours):
    """What rattler-build writes into index.json (it solved build and host and attached the
    run_exports): run requirements plus the compilers', sysroot's and nvcc's run_exports; libtorch's
    pin, cuda-cudart and python's python_abi are ignored; no python-abi3 (the package has no
    extension module), so nothing restricts the Python beyond `python >=3.10`."""
    cuda129, cuda130, cpu = (set(ours["linux-64"][k]["depends"]) for k in ("cuda129", "cuda130", "cpu"))
    assert {"python >=3.10", "pytorch >=2.10", "libtorch >=2.10", "pytorch * cuda*", "__cuda",
            "cuda-version >=12.9,<13", "libgcc >=14", "libstdcxx >=14", "__glibc >=2.17,<3.0.a0"} <= cuda129
    assert {"__cuda", "cuda-version >=13.0,<14", "libstdcxx >=15", "__glibc >=2.28,<3.0.a0"} <= cuda130
    assert cpu == {"python >=3.10", "pytorch >=2.10"}
    for depends in (cuda129, cuda130, cpu):
        assert not any(d.startswith(("python_abi", "cuda-cudart", "libtorch >=2.10,<", "cpython", "_python_abi3"))
                       for d in depends)
    assert ours["linux-64"]["cuda129"]["build_number"] == ours["linux-64"]["cuda130"]["build_number"] == 200
    assert ours["linux-64"]["cpu"]["build_number"] == 0
    # the CUDA builds: CEP-20 (their platform's subdir, noarch python in index.json); the CPU build
    # and the FA3 interface: noarch
    assert all(r["noarch"] == "python" for builds in ours.values() for r in builds.values())
    assert {r["subdir"] for builds in ours.values() for k, r in builds.items() if k not in NOARCH} == {"linux-64", "linux-aarch64"}
    assert ours["osx-arm64"]["cpu"]["subdir"] == "noarch"
    fa3 = ours["osx-arm64"]["fa3"]
    assert fa3["subdir"] == "noarch" and fa3["build_number"] == 0
    # python's run_export to a noarch package is `python` itself, beside the recipe's floor
    assert set(fa3["depends"]) == {"python", "python >=3.10", f"flash-attn =={fa3['version']}"}, fa3["depends"]
