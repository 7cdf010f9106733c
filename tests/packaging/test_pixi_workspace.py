"""pixi.toml: `pixi run build` and `pixi run test` on a fresh clone (no ./output, no lock file),
`pixi run test` on this machine's variant, without a prompt.

pixi cannot run here (it needs conda-forge), so the manifest is checked against pixi's schema
(../shared/schemas, pixi 0.77) and pixi's rules are replayed on it, each written from pixi's
source (prefix-dev/pixi 2b25fc76, August 2026; pixi-build-rattler-build 0.4.6 is in that tree):

* which environment runs a task (pixi_task/src/task_environment.rs ``find_task``): the default
  environment's task if no other environment defines one, else the one environment defining it,
  else pixi asks; which definition of a task a platform gets (its targets, pixi_manifest
  target.rs ``Targets::resolve``: every matching selector, the later one first);
* which platform an environment is installed for (pixi_manifest/src/workspace.rs
  ``possible_pixi_platforms``): the first declared platform of this machine's subdir whose declared
  virtual packages the machine has (same name, version at least the declared one);
* **the lock** (pixi_command_dispatcher keys/resolve_source_record.rs, build/dependencies.rs):
  before any task, pixi locks every environment for every platform. For the path dependency it
  asks the rattler-build backend for every build of the platform's variants (pixi_core
  workspace/mod.rs ``variants``: ``[workspace.build-variants]`` and the platform's targets, the
  later target first, plus ``c_stdlib``/``c_stdlib_version`` derived from the platform's
  ``__glibc``; the backend, pixi_build_rattler_build protocol.rs, lets each of these replace the
  variants file's key), and for each build solves its *build* environment, then its *host*
  environment with the build's strong run_exports, with the platform's virtual packages; the
  build's record is its run requirements plus the strong run_exports of build and host and the
  weak ones of host, of the directly requested packages only, less ``ignore_run_exports`` (as
  written: pixi does not add rattler-build's rule for ``version_independent`` packages). Any
  failed solve fails the lock, and with it every ``pixi run``. Then each environment is solved.

The solves run on py-rattler (pixi's solver) over conda-forge-shaped records with the
run_exports their feedstocks declare (tests/support/conda_channel.py says what they stand in for);
``test_replay_attaches_what_rattler_build_attaches`` checks the replay's run requirements against
what rattler-build itself attaches over the same packages. What this cannot show: pixi itself
running (its lock file, the backend's download, a real conda-forge solve).

``FLASH_ATTN_PIXI_MANIFEST=<path>`` runs these tests against another manifest (e.g.
``git show HEAD~1:pixi.toml``), to show what they catch.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

from support.packaging_helpers import PIXI, RECIPE, REPO, SCHEMAS, VARIANTS, render  # noqa: I001

MANIFEST_PATH = Path(os.environ.get("FLASH_ATTN_PIXI_MANIFEST") or PIXI)
if not MANIFEST_PATH.is_file():  # e.g. the recipe's test steps copy tests/ without the workspace
    pytest.skip(f"{MANIFEST_PATH} is absent", allow_module_level=True)
MANIFEST = tomllib.loads(MANIFEST_PATH.read_text())
# pixi's defaults for a platform given as a bare subdir (docs/workspace/system_requirements.md)
SUBDIR_DEFAULTS = {"linux": {"__unix": "0", "__linux": "4.18", "__glibc": "2.28"}, "osx": {"__unix": "0", "__osx": "13.0"},
                   "win": {"__win": "0"}}
FRIENDLY = {"cuda": "__cuda", "glibc": "__glibc", "macos": "__osx", "osx": "__osx", "linux": "__linux"}


def _validate(schema_name: str, document: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    path = SCHEMAS / schema_name
    if not path.exists():
        pytest.skip(f"{path} is absent: the schemas live in shared/ beside the repository")
    schema = json.loads(path.read_text())
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(document)]


# --- the manifest's shape ---------------------------------------------------------------------------------


def test_pixi_manifest_matches_the_schema():
    errors = _validate("pixi-manifest.schema.json", MANIFEST)
    assert not errors, "\n".join(errors)
    # strict enough to notice a misspelt key
    assert _validate("pixi-manifest.schema.json", {**MANIFEST, "workspace": {**MANIFEST["workspace"], "platfroms": []}})


def test_package_is_the_recipe_built_by_pixi_build():
    yaml = pytest.importorskip("yaml")
    recipe = yaml.safe_load(RECIPE.read_text())["context"]
    assert "pixi-build" in MANIFEST["workspace"]["preview"]
    assert MANIFEST["package"]["name"] == recipe["name"] == "flash-attn"
    assert MANIFEST["package"]["version"] == MANIFEST["workspace"]["version"] == str(recipe["version"])
    assert MANIFEST["package"]["build"]["backend"]["name"] == "pixi-build-rattler-build"
    assert "build-number" not in MANIFEST["package"]["build"]  # it would override the recipe's +200
    assert MANIFEST["workspace"]["build-variants-files"] == [VARIANTS.name]
    # the backend finds recipe/recipe.yaml by itself (pixi-build-rattler-build's search order)
    assert RECIPE.relative_to(REPO) == Path("recipe/recipe.yaml")


def test_nothing_needs_an_earlier_build():
    """`pixi run` locks every environment before it runs a task; with a channel or dependency in
    ./output the first command on a fresh clone failed before rattler-build started."""
    def walk(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, k)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v, key)
        else:
            yield key, str(node)

    channels_and_paths = [value for key, value in walk(MANIFEST) if key in ("channels", "channel", "path", "url")]
    assert not [v for v in channels_and_paths if "output" in v], channels_and_paths
    assert MANIFEST["feature"]["test"]["dependencies"]["flash-attn"] == {"path": "."}
    gitignore = (REPO / ".gitignore").read_text().split()
    # rattler-build copies the source with .gitignore applied: not the environments, not the packages
    assert ".pixi/" in gitignore and "output/" in gitignore


# --- which environment runs a task --------------------------------------------------------------------


def environments() -> dict[str, list[str]]:
    """Environment name -> its features (the default feature unless excluded)."""
    envs = {"default": ["default"]}
    for name, env in MANIFEST.get("environments", {}).items():
        features = env if isinstance(env, list) else env["features"]
        no_default = isinstance(env, dict) and env.get("no-default-feature", False)
        envs[name] = list(features) + ([] if no_default else ["default"])
    return envs


def _feature(name: str) -> dict:
    return MANIFEST if name == "default" else MANIFEST["feature"][name]


def tasks_of(env: str) -> dict:
    tasks = {}
    for feature in environments()[env]:
        tasks.update(_feature(feature).get("tasks", {}))
    return tasks


def environment_for_task(task: str) -> str:
    """pixi's choice for `pixi run <task>` with no -e."""
    envs = environments()
    default_has = task in tasks_of("default")
    others = [e for e in envs if e != "default" and task in tasks_of(e)]
    if default_has and all(tasks_of(e)[task] == tasks_of("default")[task] for e in others):
        return "default"
    if not default_has and len(others) == 1:
        return others[0]
    raise LookupError(f"`pixi run {task}` is ambiguous or missing: default={default_has}, others={others}")


@pytest.mark.parametrize("task,env", [("build", "default"), ("build-cpu", "default"), ("lint", "default"),
                                      ("test", "test"), ("doctor", "test"), ("bench", "test")])
def test_each_task_runs_in_one_environment_without_a_prompt(task, env):
    assert environment_for_task(task) == env


def test_tests_run_against_the_installed_package():
    assert MANIFEST["feature"]["test"]["tasks"]["test"]["cmd"].split()[0] == "pytest"
    assert "pypi-dependencies" not in json.dumps(MANIFEST)  # no editable/pypi copy anywhere


# --- which platform this machine gets ------------------------------------------------------------------


def platforms() -> list[tuple[str, str, dict]]:
    """(name, subdir, declared virtual packages) in manifest order."""
    out = []
    for entry in MANIFEST["workspace"]["platforms"]:
        if isinstance(entry, str):
            out.append((entry, entry, {}))
        else:
            declared = {FRIENDLY.get(k, k): str(v) for k, v in entry.items() if k not in ("name", "platform")}
            out.append((entry.get("name", entry["platform"]), entry["platform"], declared))
    return out


def selected_platform(subdir: str, machine: dict) -> str:
    """pixi's choice of platform to install for on a machine (its virtual packages)."""
    from rattler import Version

    for name, platform_subdir, declared in platforms():
        if platform_subdir == subdir and all(k in machine and Version(machine[k]) >= Version(v)
                                             for k, v in declared.items()):
            return name
    raise LookupError(f"no platform for {subdir} {machine}")


@pytest.mark.parametrize("subdir,machine,expected", [
    ("linux-64", {"__glibc": "2.35"}, "linux-64"),
    ("linux-64", {"__glibc": "2.35", "__cuda": "12.8"}, "linux-64-cuda12"),
    ("linux-64", {"__glibc": "2.35", "__cuda": "13.0"}, "linux-64-cuda13"),
    ("linux-64", {"__glibc": "2.35", "__cuda": "11.8"}, "linux-64"),  # too old for both CUDA builds
    ("linux-aarch64", {"__glibc": "2.35", "__cuda": "13.1"}, "linux-aarch64-cuda13"),
    ("linux-aarch64", {"__glibc": "2.35"}, "linux-aarch64"),
    ("osx-arm64", {"__osx": "15.5"}, "osx-arm64"),
])
def test_machine_selects_its_platform(subdir, machine, expected):
    pytest.importorskip("rattler", reason="py-rattler is not installed (pip install py-rattler)")
    assert selected_platform(subdir, machine) == expected


# --- pixi's target selectors ---------------------------------------------------------------------------


FAMILIES = {"linux": lambda subdir: subdir.startswith("linux"), "unix": lambda subdir: not subdir.startswith("win"),
            "win": lambda subdir: subdir.startswith("win"), "osx": lambda subdir: subdir.startswith("osx"),
            "macos": lambda subdir: subdir.startswith("osx")}


def selector_matches(selector: str, name: str, subdir: str) -> bool:
    """pixi_manifest target.rs ``TargetSelector``: a family (linux, unix, win, osx/macos), a conda
    subdir (matches every platform of that subdir, named or not), a glob over platform *names*,
    else one platform's name."""
    from rattler import Subdir

    if selector in FAMILIES:
        return FAMILIES[selector](subdir)
    try:
        return str(Subdir(selector)) == subdir
    except Exception:  # not a subdir
        pass
    if any(c in selector for c in "*?["):
        return fnmatch.fnmatchcase(name, selector)
    return selector == name


def resolved(section: dict, key: str, name: str, subdir: str) -> list[dict]:
    """``Targets::resolve``: the matching targets' ``key`` tables, the later-declared first, then
    the section's own; callers take the first value of each entry."""
    matching = [t.get(key, {}) for sel, t in section.get("target", {}).items() if selector_matches(sel, name, subdir)]
    return [*reversed(matching), section.get(key, {})]


def platform_entry(platform_name: str) -> tuple[str, dict]:
    subdir, declared = next((s, d) for n, s, d in platforms() if n == platform_name)
    return subdir, {**SUBDIR_DEFAULTS[subdir.split("-")[0]], **declared}


def task_for(env: str, task: str, platform_name: str) -> dict:
    """The definition of a task an environment runs on a platform."""
    subdir, _ = platform_entry(platform_name)
    for feature in environments()[env]:
        for tasks in resolved(_feature(feature), "tasks", platform_name, subdir):
            if task in tasks:
                value = tasks[task]
                return value if isinstance(value, dict) else {"cmd": value}
    raise LookupError(task)


# --- what pixi-build offers each platform ---------------------------------------------------------------


def offered_variants(platform_name: str, manifest: dict | None = None):
    """The variant configuration pixi hands the rattler-build backend for a platform: the
    variants file, each key of which is replaced by the workspace's build-variants resolved for the
    platform (its matching targets, the later one first, then ``[workspace.build-variants]``) and
    by c_stdlib/c_stdlib_version derived from its ``__glibc`` (conda-forge channels only)."""
    from rattler_build import JinjaConfig, PlatformConfig, VariantConfig

    manifest = manifest or MANIFEST
    subdir, virtual = platform_entry(platform_name)
    inline: dict[str, list[str]] = {}
    for layer in resolved(manifest["workspace"], "build-variants", platform_name, subdir):
        for key, values in layer.items():
            inline.setdefault(key, [str(v) for v in values])
    if "conda-forge" in manifest["workspace"]["channels"] and subdir.startswith(("linux", "osx")):
        provider, package = ("sysroot", "__glibc") if subdir.startswith("linux") else ("macosx_deployment_target", "__osx")
        if package in virtual:
            inline.setdefault("c_stdlib", [provider])
            inline.setdefault("c_stdlib_version", [".".join(virtual[package].split(".")[:2])])
    files = [REPO / f for f in manifest["workspace"].get("build-variants-files", [])]
    assert len(files) <= 1, "the replay reads one variants file (pixi merges several, later ones winning)"
    config = VariantConfig.from_conda_build_config(files[0], JinjaConfig(PlatformConfig(target_platform=subdir))) \
        if files else VariantConfig({})
    values = {**config.to_dict(), **inline}
    return VariantConfig(values, zip_keys=config.zip_keys or None)


def offered_builds(platform_name: str, manifest: dict | None = None) -> list:
    subdir, _ = platform_entry(platform_name)
    return render(subdir, offered_variants(platform_name, manifest))


def kind(rendered) -> str:
    return rendered.recipe["build"]["string"].split("_")[0]


# --- the lock ------------------------------------------------------------------------------------------


class LockError(AssertionError):
    pass


def _virtual(platform_name: str, machine: dict | None = None):
    """The virtual packages of a platform (its declared ones), or of a ``machine`` (name -> version)."""
    import rattler

    virtual = machine if machine is not None else platform_entry(platform_name)[1]
    return [rattler.GenericVirtualPackage(rattler.PackageName(k), rattler.Version(v), rattler.BuildString("0"))
            for k, v in virtual.items()]


def _solve(channel, platform_name: str, specs: list[str], machine: dict | None = None) -> list:
    import rattler

    url, cache, _ = channel
    subdir, _ = platform_entry(platform_name)
    return asyncio.run(rattler.solve([url], specs, gateway=rattler.Gateway(cache_dir=str(cache)),
                                     platforms=[subdir, "noarch"], virtual_packages=_virtual(platform_name, machine)))


def _name(spec: str) -> str:
    return re.split(r"[\s=<>!~]", spec.strip(), maxsplit=1)[0]


def _run_exports(records, declared: set[str], ignore: dict, exports_table: dict) -> dict[str, list[str]]:
    """build/dependencies.rs ``extract_run_exports``: of the directly requested packages only, less
    ``ignore_run_exports`` (from_package: all of a package's; by_name: those naming a package)."""
    out: dict[str, list[str]] = {"weak": [], "strong": [], "weak_constrains": [], "strong_constrains": []}
    for record in records:
        name = record.name.normalized
        if name not in declared or name in ignore.get("from_package", []):
            continue
        exports = exports_table.get((name, str(record.version), str(record.build)), {})
        for key in out:
            out[key] += [s for s in exports.get(key, []) if _name(s) not in ignore.get("by_name", [])]
    return out


def lock_build(channel, platform_name: str, rendered, machine: dict | None = None) -> dict:
    """One offered build as pixi locks it (resolve_source_record.rs): its build environment, its host
    environment with the build's strong run_exports, its record. LockError if a solve fails.
    ``machine``: solve with these virtual packages instead of the platform's (rattler-build's own
    solves of `pixi run build`, which use the machine's, and rattler-build's rule for run_exports
    is the same: test_replay_attaches_what_rattler_build_attaches)."""
    from support import conda_channel

    _, _, exports_table = channel
    requirements = rendered.recipe["requirements"]
    ignore = requirements.get("ignore_run_exports", {})
    build_specs = [str(s) for s in requirements.get("build", [])]
    host_specs = [str(s) for s in requirements.get("host", [])]
    try:
        build = _solve(channel, platform_name, build_specs, machine) if build_specs else []
    except Exception as error:
        raise LockError(f"{platform_name}: the build environment of {kind(rendered)} does not solve: {error}") from error
    from_build = _run_exports(build, {_name(s) for s in build_specs}, ignore, exports_table)
    try:
        host = _solve(channel, platform_name, host_specs + from_build["strong"], machine)
    except Exception as error:
        raise LockError(f"{platform_name}: the host environment of {kind(rendered)} does not solve: {error}") from error
    from_host = _run_exports(host, {_name(s) for s in host_specs}, ignore, exports_table)
    depends: list[str] = []
    for spec in [*map(str, requirements.get("run", [])), *from_host["strong"], *from_build["strong"], *from_host["weak"]]:
        if spec not in depends:
            depends.append(spec)
    constrains = [*map(str, requirements.get("run_constraints", [])), *from_host["strong_constrains"],
                  *from_build["strong_constrains"], *from_host["weak_constrains"]]
    subdir, _ = platform_entry(platform_name)
    return conda_channel._record(rendered.recipe["package"]["name"], str(rendered.recipe["package"]["version"]),
                                 rendered.recipe["build"]["string"], int(rendered.recipe["build"]["number"]),
                                 depends, constrains, *conda_channel.package_subdir(rendered.recipe["build"], subdir))


def lock_source_package(channel, platform_name: str, manifest: dict | None = None) -> dict[str, dict]:
    """Every build the backend offers the platform, locked: kind -> record."""
    return {kind(v): lock_build(channel, platform_name, v) for v in offered_builds(platform_name, manifest)}


@pytest.fixture(scope="module")
def base_channel(tmp_path_factory):
    """conda-forge-shaped records (tests/support/conda_channel.py) of every subdir of the workspace, as
    repodata for py-rattler, and the run_exports of each package."""
    pytest.importorskip("rattler", reason="py-rattler is not installed (pip install py-rattler)")
    pytest.importorskip("rattler_build", reason="py-rattler-build is not installed")
    from support import conda_channel

    records = [r for subdir in sorted({s for _, s, _ in platforms()}) for r in conda_channel.conda_forge_records(subdir)]
    folder = tmp_path_factory.mktemp("pixi")
    return (conda_channel.write_channel(folder / "channel", records), folder / "cache",
            conda_channel.run_exports_of(records), records, folder)


@pytest.fixture(scope="module")
def locked(base_channel):
    """platform -> (its offered builds locked, or the LockError)."""
    url, cache, exports, _, _ = base_channel
    out = {}
    for name, _, _ in platforms():
        try:
            out[name] = lock_source_package((url, cache, exports), name)
        except LockError as error:
            out[name] = error
    return out


EXPECTED_BUILDS = {"linux-64-cuda13": ["cuda130"], "linux-64-cuda12": ["cuda129"], "linux-64": ["cpu"],
                   "linux-aarch64-cuda13": ["cuda130"], "linux-aarch64-cuda12": ["cuda129"], "linux-aarch64": ["cpu"],
                   "osx-arm64": ["cpu"]}


@pytest.mark.parametrize("platform_name", [n for n, _, _ in platforms()])
def test_lock_solves_every_offered_build_on_platform(platform_name, locked):
    """pixi's lock: every build the backend offers the platform, its build and host environments
    solved with the platform's virtual packages. Each platform is offered the build it can lock."""
    result = locked[platform_name]
    if isinstance(result, LockError):
        raise result
    assert sorted(result) == EXPECTED_BUILDS[platform_name]


def test_without_the_platform_targets_a_cuda12_platform_cannot_lock(base_channel):
    """The control: the manifest without its `[workspace.target]` build-variants (pixi.toml before
    issue 26) offers every platform the whole matrix, and on a CUDA 12 platform the CUDA 13.0
    build's build environment cannot be solved: nvcc 13.0 -> cuda-cudart-dev_linux-64 13.0 ->
    cuda-version 13.0, which requires __cuda >=13."""
    url, cache, exports, _, _ = base_channel
    manifest = {**MANIFEST, "workspace": {k: v for k, v in MANIFEST["workspace"].items() if k != "target"}}
    assert sorted(kind(v) for v in offered_builds("linux-64-cuda12", manifest)) == ["cpu", "cuda129", "cuda130"]
    with pytest.raises(LockError, match=r"build environment of cuda130 does not solve(.|\n)*__cuda"):
        lock_source_package((url, cache, exports), "linux-64-cuda12", manifest)
    # the plain platform (no __cuda) locks all three: cuda-version's constraint needs no driver
    assert sorted(lock_source_package((url, cache, exports), "linux-64", manifest)) == ["cpu", "cuda129", "cuda130"]


def test_replay_attaches_what_rattler_build_attaches(base_channel):
    """The replay's run requirements of each Linux build equal what rattler-build itself attaches
    (``--render-only --with-solve`` over the same packages, as real packages with their
    run_exports.json; CONDA_OVERRIDE_CUDA=13 so that no build is refused for want of a driver).
    Same set, not the same order."""
    from support import conda_channel

    url, cache, exports, records, folder = base_channel
    packages = conda_channel.write_package_channel(folder / "packages", [r for r in records if r["subdir"] in ("linux-64", "noarch")])
    ours = {kind(build): lock_build((url, cache, exports), name, build)
            for name in ("linux-64", "linux-64-cuda12", "linux-64-cuda13") for build in offered_builds(name)}
    theirs = {r["build"].split("_")[0]: r for r in conda_channel.rattler_build_records(
        RECIPE, "linux-64", packages, [VARIANTS], {"flash_attn_source": ["pixi"]}, env={"CONDA_OVERRIDE_CUDA": "13.0"})
        if r["name"] == "flash-attn"}  # not the FA3 interface output (tests/packaging/test_fa3_output.py)
    assert sorted(theirs) == ["cpu", "cuda129", "cuda130"]
    for build_kind, record in ours.items():
        assert set(record["depends"]) == set(theirs[build_kind]["depends"]), build_kind


# --- every environment solves on every platform --------------------------------------------------------


def requirements(env: str, platform_name: str) -> list[str]:
    """The match specs an environment asks for on a platform (its features' dependencies and those
    of the targets matching the platform, the later target first)."""
    subdir, _ = platform_entry(platform_name)
    deps: dict = {}
    for feature in environments()[env]:
        for layer in resolved(_feature(feature), "dependencies", platform_name, subdir):
            for name, value in layer.items():
                deps.setdefault(name, value)
    specs = []
    for name, value in deps.items():
        if isinstance(value, dict) and "path" in value:
            specs.append(name)  # a source package: whichever of its locked builds the solver picks
        elif isinstance(value, dict):
            specs.append(f"{name} {value.get('version', '*')} {value.get('build', '*')}".strip())
        else:
            specs.append(f"{name} {value}")
    return specs


def solve_environment(base_channel, locked, env: str, platform_name: str, folder: Path) -> dict:
    from support import conda_channel

    _, _, exports, records, _ = base_channel
    ours = locked[platform_name]
    if isinstance(ours, LockError):
        raise ours
    subdir, _ = platform_entry(platform_name)
    url = conda_channel.write_channel(folder / "channel", [*records, *ours.values()])
    solved = _solve((url, folder / "cache", exports), platform_name, requirements(env, platform_name))
    return {r.name.normalized: r for r in solved}


EXPECTED_FLASH_ATTN = {name: builds[0] for name, builds in EXPECTED_BUILDS.items()}


@pytest.mark.parametrize("env", list(environments()))
@pytest.mark.parametrize("platform_name", [n for n, _, _ in platforms()])
def test_environment_solves_on_platform(env, platform_name, base_channel, locked, tmp_path):
    from support import conda_channel

    names = solve_environment(base_channel, locked, env, platform_name, tmp_path)
    if env == "test":
        expected = locked[platform_name][EXPECTED_FLASH_ATTN[platform_name]]["build"]
        assert str(names["flash-attn"].build) == expected
        assert str(names["pytorch"].build).startswith(EXPECTED_FLASH_ATTN[platform_name])
        # the environment's Python (the newest the others allow), not the Python the package was built with
        newest = max(conda_channel.PYTHONS, key=lambda v: tuple(map(int, v.split("."))))
        assert str(names["python"].version).startswith(newest + "."), names["python"].version
        assert not [d for d in locked[platform_name][EXPECTED_FLASH_ATTN[platform_name]]["depends"] if d.startswith("python_abi ")]
    else:
        assert "rattler-build" in names and "flash-attn" not in names


def test_python_of_the_build_would_be_locked_without_ignoring_its_run_export(base_channel, locked, tmp_path):
    """The control: pixi applies ``ignore_run_exports`` as written. Without `python` there (the
    recipe before issue 26) the host's python 3.10 exports ``python_abi 3.10.* *_cp310`` into the
    record, and the test environment gets Python 3.10."""
    url, cache, exports, records, _ = base_channel
    [build] = offered_builds("linux-64")
    ignore = build.recipe["requirements"]["ignore_run_exports"]
    assert "python" in ignore["from_package"]
    ignore["from_package"] = [n for n in ignore["from_package"] if n != "python"]
    ignore["by_name"] = [n for n in ignore.get("by_name", []) if n != "python_abi"]
    record = lock_build((url, cache, exports), "linux-64", build)
    assert "python_abi 3.10.* *_cp310" in record["depends"]
    names = solve_environment(base_channel, {"linux-64": {"cpu": record}}, "test", "linux-64", tmp_path)
    assert str(names["python"].version).startswith("3.10.")


# --- `pixi run build` on a machine with a CUDA 13 driver, a CUDA 12 driver, none ---------------------------
#
# The build task is rattler-build itself (no pixi-build): it renders the variants file for this
# platform, solves each variant's build and host environments with the *machine's* virtual
# packages (rattler's detection; CONDA_OVERRIDE_CUDA replaces __cuda), builds, then
# recipe/test_built_packages.sh tests each package. Replayed for linux-64 machines.

BUILD_MACHINES = {"CUDA 13 driver": "13.0", "CUDA 12 driver": "12.8", "no driver": None}  # nvidia-smi's "CUDA Version"
README_BUILDS = ["cpu", "cuda129", "cuda130"]  # docs/install-and-build.md: on Linux the CUDA 12.9, CUDA 13.0 and CPU builds


def machine_virtual_packages(driver: str | None, environ: dict) -> dict:
    """What rattler-build detects on a linux-64 machine with this driver, given the variables the
    task exports: CONDA_OVERRIDE_CUDA replaces (or supplies) __cuda."""
    virtual = {**SUBDIR_DEFAULTS["linux"], "__glibc": "2.35", **({"__cuda": driver} if driver else {})}
    if environ.get("CONDA_OVERRIDE_CUDA"):
        virtual["__cuda"] = environ["CONDA_OVERRIDE_CUDA"]
    return virtual


def build_task_builds(channel, driver: str | None, task: dict) -> dict:
    """`pixi run build`'s first half on linux-64: every variant of the variants file, its build and
    host environments solved as rattler-build solves them: kind -> record, or the LockError."""
    assert "--variant-config conda_build_config.yaml" in task["cmd"] and "--variant " not in task["cmd"]
    machine = machine_virtual_packages(driver, task.get("env", {}))
    out = {}
    for build in render("linux-64"):
        try:
            out[kind(build)] = lock_build(channel, "linux-64", build, machine)
        except LockError as error:
            out[kind(build)] = error
    return out


@pytest.mark.parametrize("machine", list(BUILD_MACHINES))
def test_build_task_builds_the_whole_matrix_on(machine, base_channel):
    """Every build the docs promise for Linux, on every machine: the task's CONDA_OVERRIDE_CUDA
    (pixi.toml) lets a CUDA 12 driver solve the CUDA 13.0 build's environments, which nothing
    of the build runs on a GPU."""
    url, cache, exports, _, _ = base_channel
    builds = build_task_builds((url, cache, exports), BUILD_MACHINES[machine], MANIFEST["tasks"]["build"])
    failed = [str(b) for b in builds.values() if isinstance(b, LockError)]
    assert not failed, "\n".join(failed)
    assert sorted(builds) == README_BUILDS
    assert builds["cpu"]["subdir"] == "noarch" and {builds[k]["subdir"] for k in ("cuda129", "cuda130")} == {"linux-64"}


def test_build_task_without_the_override_fails_on_a_cuda12_driver(base_channel):
    """The control (pixi.toml before issue 46: no `env`): on a CUDA 12 driver the CUDA 13.0 build's
    build environment does not solve (nvcc 13.0 -> cuda-version 13.0 -> __cuda >=13); with a CUDA
    13 driver, or none (no __cuda: cuda-version's constraint has nothing to bind), it does."""
    url, cache, exports, _, _ = base_channel
    task = {k: v for k, v in MANIFEST["tasks"]["build"].items() if k != "env"}
    broken = build_task_builds((url, cache, exports), BUILD_MACHINES["CUDA 12 driver"], task)
    assert isinstance(broken["cuda130"], LockError) and "__cuda" in str(broken["cuda130"])
    assert not isinstance(broken["cuda129"], LockError) and not isinstance(broken["cpu"], LockError)
    for machine in ("CUDA 13 driver", "no driver"):
        builds = build_task_builds((url, cache, exports), BUILD_MACHINES[machine], task)
        assert not any(isinstance(b, LockError) for b in builds.values()), machine


def test_build_task_overrides_the_newest_cuda_of_the_matrix():
    """The override is the newest CUDA the variants file builds (a lower one would fail that
    build's solve on every machine without a newer driver)."""
    newest = max((v.cuda for v in render("linux-64") if v.cuda != "None"), key=lambda c: tuple(map(int, c.split("."))))
    assert MANIFEST["tasks"]["build"]["env"] == {"CONDA_OVERRIDE_CUDA": newest}


# What each built package's tests are run with, per machine (recipe/test_built_packages.sh): the
# machine's own driver, or, for a CUDA build it has no driver for, that build's CUDA major.
EXPECTED_TEST_CUDA = {"CUDA 13 driver": {"cpu": "13.0", "cuda129": "13.0", "cuda130": "13.0"},
                      "CUDA 12 driver": {"cpu": "12.8", "cuda129": "12.8", "cuda130": "13.0"},
                      "no driver": {"cpu": None, "cuda129": "12.0", "cuda130": "13.0"}}


@pytest.mark.parametrize("machine", list(BUILD_MACHINES))
def test_build_task_tests_every_package_on(machine, base_channel, tmp_path):
    """`pixi run build`'s second half: recipe/test_built_packages.sh, run (with stand-ins for
    rattler-build and nvidia-smi) in the task's environment over the packages the first half
    built, decides how each is tested; the test environment rattler-build then installs (the package,
    pytest, hypothesis) is solved with the virtual packages that gives: every package's solves, and
    each CUDA build comes with a CUDA PyTorch of its own CUDA major."""
    from support import conda_channel
    from support.packaging_helpers import run_test_built_packages

    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("the replayed machine is a linux-64 one")
    url, cache, exports, records, _ = base_channel
    task = MANIFEST["tasks"]["build"]
    driver = BUILD_MACHINES[machine]
    built = build_task_builds((url, cache, exports), driver, task)
    files = {}
    for build_kind, record in built.items():
        files.setdefault(record["subdir"], []).append(record["fn"])
    result, calls = run_test_built_packages(tmp_path / "run", files, driver, task.get("env", {}))
    assert result.returncode == 0, result.stdout + result.stderr
    channel = (conda_channel.write_channel(tmp_path / "channel", [*records, *built.values()]), tmp_path / "cache", exports)
    for build_kind, record in built.items():
        override = calls[record["fn"]]
        virtual = machine_virtual_packages(driver, {"CONDA_OVERRIDE_CUDA": override})
        assert virtual.get("__cuda") == EXPECTED_TEST_CUDA[machine][build_kind], (build_kind, virtual)
        solved = {r.name.normalized: r for r in _solve(channel, "linux-64", [
            f"{record['name']} =={record['version']} {record['build']}", "pytest >=8", "hypothesis >=6"], virtual)}
        assert str(solved["flash-attn"].build) == record["build"]
        if build_kind != "cpu":
            assert str(solved["pytorch"].build).startswith(build_kind), (build_kind, solved["pytorch"].build)


# --- the tasks ----------------------------------------------------------------------------------------------


def _variant_overrides(cmd: str) -> dict:
    return dict(v.split("=", 1) for v in re.findall(r"--variant (\S+)", cmd))


@pytest.mark.parametrize("subdir", ["linux-64", "osx-arm64"])
def test_build_cpu_task_renders_one_cpu_build(subdir):
    """rattler-build's `--variant key=value` replaces that key of the variant file (src/lib.rs);
    with the local matrix that must leave one build, the CPU one (with zipped keys it failed)."""
    pytest.importorskip("rattler_build", reason="py-rattler-build is not installed")
    from rattler_build import JinjaConfig, PlatformConfig, VariantConfig

    cmd = MANIFEST["tasks"]["build-cpu"]["cmd"]
    assert "--variant-config conda_build_config.yaml" in cmd
    config = VariantConfig.from_conda_build_config(VARIANTS, JinjaConfig(PlatformConfig(target_platform=subdir)))
    values = config.to_dict()
    for key, value in _variant_overrides(cmd).items():
        values[key] = [value]
    variants = render(subdir, VariantConfig(values, zip_keys=config.zip_keys or None))
    assert [kind(v) for v in variants] == ["cpu"]


def test_build_task_builds_then_tests_without_output_broken():
    """`pixi run build`: rattler-build builds the matrix without testing (`--test native` moved a
    CUDA build to output/broken on a machine without a driver for it), then
    recipe/test_built_packages.sh tests each package as far as the machine can
    (tests/packaging/test_packaging.py runs that script); the task declares its outputs, so that pixi runs it
    again once ./output is gone."""
    build = MANIFEST["tasks"]["build"]
    first, _, second = build["cmd"].partition(" && ")
    assert first.startswith("rattler-build build --recipe recipe/recipe.yaml")
    assert "--variant-config conda_build_config.yaml" in first and "--output-dir output" in first
    assert "--test skip" in first and "--test native" not in build["cmd"]
    assert second == "bash recipe/test_built_packages.sh output"
    assert (REPO / "recipe" / "test_built_packages.sh").is_file()
    # what rattler-build writes: output/<subdir>/<name>-<version>-<build>.conda, the CPU build in output/noarch
    for written in ("output/linux-64/flash-attn-2.8.3.1-cuda129_habcdef0_200.conda", "output/noarch/flash-attn-2.8.3.1-cpu_habcdef0_0.conda"):
        assert any(fnmatch.fnmatch(written, o) for o in build["outputs"]), written
    for path in ("recipe/recipe.yaml", "conda_build_config.yaml", "flash_attn/__init__.py", "csrc/x.cu", "CMakeLists.txt",
                 "pyproject.toml"):
        assert any(fnmatch.fnmatch(path, i) for i in build["inputs"]), path
    lint = MANIFEST["tasks"]["lint"]["cmd"]
    linted = set(re.findall(r"--target-platform (\S+)", lint))
    assert linted == {s for _, s, _ in platforms()} | {"win-64"}


@pytest.mark.parametrize("platform_name", [n for n, _, _ in platforms()])
def test_test_task_runs_the_gpu_tests_on_a_gpu_platform(platform_name):
    """`pixi run test` on a CUDA platform (a driver: a GPU runner) runs the `gpu` tests on the GPU
    with the package's ahead-of-time kernels, then with Triton, then the CPU suite; elsewhere the
    CPU suite. The options are the ones tests/conftest.py defines."""
    cmd = task_for("test", "test", platform_name)["cmd"]
    steps = cmd.split(" && ")
    assert steps[-1] == "pytest -q tests/"
    if "cuda" in platform_name:
        assert steps[:2] == [f"pytest -q -m 'gpu and not full_matrix' tests/ --flash-device cuda --flash-backend {b}"
                             for b in ("aot", "triton")]
        conftest = (REPO / "tests" / "conftest.py").read_text()
        assert all(option in conftest for option in ("--flash-device", "--flash-backend"))
        markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
        assert any(m.startswith(("gpu:", "gpu ")) for m in markers) and any(m.startswith("full_matrix") for m in markers)
    else:
        assert steps == ["pytest -q tests/"]


# --- no needless rebuilds --------------------------------------------------------------------------------


def watched_globs(rendered) -> list[str]:
    """pixi_build_rattler_build protocol.rs ``build_input_globs``: the recipe's folder and each
    path source (a folder as `<path>/**`, a file as itself), relative to the workspace; pixi-build
    rebuilds the package when a file matching one of them changes."""
    globs = ["recipe/**"]
    for source in rendered.recipe.get("source", []):
        if "path" in source:
            path = (RECIPE.parent / source["path"]).resolve().relative_to(REPO)
            globs.append(f"{path}/**" if (REPO / path).is_dir() else str(path))
    return globs


def test_pixi_build_watches_only_what_the_build_reads():
    """Editing tests or docs does not rebuild the kernels under pixi-build: the pixi variant's
    sources are the build's inputs, each the path of a file or folder the build reads, and no
    test or doc file matches. (tests/packaging/test_packaging.py builds from exactly these files.)"""
    for name, _, _ in platforms():
        for build in offered_builds(name):
            assert build.variant["flash_attn_source"] == "pixi"
            globs = watched_globs(build)
            assert sorted(globs) == sorted(["recipe/**", "flash_attn/**", "csrc/**", "CMakeLists.txt", "pyproject.toml",
                                            "LICENSE", "fa3_interface/**"]), globs
            for path in ("tests/packaging/test_pixi_workspace.py", "README.md", "benchmarks/x.py", ".ci/run"):
                assert not any(fnmatch.fnmatch(path, g) for g in globs), path


def test_backend_is_pinned_to_the_version_read():
    """The backend replayed here is pixi-build-rattler-build 0.4.6 (prefix-dev/pixi 2b25fc76):
    the manifest allows that version and no other minor."""
    from rattler import Version, VersionSpec

    backend = MANIFEST["package"]["build"]["backend"]
    allowed = VersionSpec(backend["version"])
    assert allowed.matches(Version("0.4.6")) and not allowed.matches(Version("0.5.0")) and not allowed.matches(Version("0.3.9"))
