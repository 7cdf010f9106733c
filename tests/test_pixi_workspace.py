"""pixi.toml: `pixi run build` and `pixi run test` on a fresh clone (no ./output, no lock file),
`pixi run test` on this machine's variant, without a prompt.

pixi cannot run here (it needs conda-forge), so the manifest is checked against pixi's schema
(../shared/schemas, pixi 0.77) and pixi's rules are replayed on it, each written from pixi's
source (prefix-dev/pixi, August 2026):

* which environment runs a task (pixi_task/src/task_environment.rs ``find_task``): the default
  environment's task if no other environment defines one, else the one environment defining it,
  else pixi asks;
* which platform an environment is installed for (pixi_manifest/src/workspace.rs
  ``possible_pixi_platforms``): the first declared platform of this machine's subdir whose declared
  virtual packages the machine has (same name, version at least the declared one);
* every environment x platform must solve: py-rattler (pixi's solver) over the local channel of
  tests/conda_channel.py with the platform's declared virtual packages, flash-attn being the
  builds pixi-build renders from the recipe with ``build-variants-files``.
What this cannot show: pixi itself running (its lock file format, the rattler-build backend's
download, a real conda-forge solve).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
import tomllib
from pathlib import Path

import pytest

from packaging_helpers import PIXI, RECIPE, REPO, SCHEMAS, VARIANTS, render  # noqa: I001

if not PIXI.is_file():  # e.g. the recipe's test steps copy tests/ without the workspace
    pytest.skip(f"{PIXI} is absent", allow_module_level=True)
MANIFEST = tomllib.loads(PIXI.read_text())
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


# --- every environment solves on every platform --------------------------------------------------------


def requirements(env: str, platform_name: str) -> list[str]:
    """The match specs an environment asks for on a platform (features' dependencies, their
    targets matching the platform's name or subdir, wildcards included)."""
    subdir = next(s for n, s, _ in platforms() if n == platform_name)
    deps: dict = {}
    for feature in environments()[env]:
        section = _feature(feature)
        deps.update(section.get("dependencies", {}))
        for selector, target in section.get("target", {}).items():
            if fnmatch.fnmatchcase(platform_name, selector) or selector in (subdir, subdir.split("-")[0]):
                deps.update(target.get("dependencies", {}))
    specs = []
    for name, value in deps.items():
        if isinstance(value, dict) and "path" in value:
            specs.append(name)  # a source package: whichever of its builds the solver picks
        elif isinstance(value, dict):
            specs.append(f"{name} {value.get('version', '*')} {value.get('build', '*')}".strip())
        else:
            specs.append(f"{name} {value}")
    return specs


@pytest.fixture(scope="module")
def pixi_channel(tmp_path_factory):
    """The local channel with flash-attn as pixi-build offers it on each subdir: the recipe
    rendered with the build-variants file, c_stdlib_version as pixi derives it (__glibc 2.28)."""
    pytest.importorskip("rattler", reason="py-rattler is not installed (pip install py-rattler)")
    pytest.importorskip("rattler_build", reason="py-rattler-build is not installed")
    import conda_channel

    subdirs = sorted({s for _, s, _ in platforms()})
    records, ours = [], {}
    for subdir in subdirs:
        records += conda_channel.conda_forge_records(subdir)
        ours[subdir] = {v.recipe["build"]["string"].split("_")[0]: conda_channel.recipe_record(v, subdir)
                        for v in render(subdir)}
        records += ours[subdir].values()
    folder = tmp_path_factory.mktemp("pixi")
    return conda_channel.write_channel(folder / "channel", records), folder / "cache", ours


EXPECTED_FLASH_ATTN = {"linux-64-cuda13": "cuda130", "linux-64-cuda12": "cuda129", "linux-64": "cpu",
                       "linux-aarch64-cuda13": "cuda130", "linux-aarch64-cuda12": "cuda129", "linux-aarch64": "cpu",
                       "osx-arm64": "cpu"}


@pytest.mark.parametrize("env", list(environments()))
@pytest.mark.parametrize("platform_name", [n for n, _, _ in platforms()])
def test_environment_solves_on_platform(env, platform_name, pixi_channel):
    import rattler

    url, cache, ours = pixi_channel
    subdir, declared = next((s, d) for n, s, d in platforms() if n == platform_name)
    virtual = {**SUBDIR_DEFAULTS[subdir.split("-")[0]], **declared}
    solved = asyncio.run(rattler.solve(
        [url], requirements(env, platform_name), gateway=rattler.Gateway(cache_dir=str(cache)),
        platforms=[subdir, "noarch"],
        virtual_packages=[rattler.GenericVirtualPackage(rattler.PackageName(k), rattler.Version(v), rattler.BuildString("0"))
                          for k, v in virtual.items()]))
    names = {r.name.normalized: r for r in solved}
    if env == "test":
        expected = ours[subdir][EXPECTED_FLASH_ATTN[platform_name]]["build"]
        assert str(names["flash-attn"].build) == expected
        kind = EXPECTED_FLASH_ATTN[platform_name]
        assert str(names["pytorch"].build).startswith(kind if kind != "cpu" else "cpu")
    else:
        assert "rattler-build" in names and "flash-attn" not in names


def test_pixi_build_variants_render_the_local_matrix():
    """What the rattler-build backend offers per subdir (build-variants file, plus pixi's derived
    c_stdlib / c_stdlib_version, which the file already has): 3 builds on Linux, 1 on macOS."""
    for subdir in sorted({s for _, s, _ in platforms()}):
        kinds = sorted(v.recipe["build"]["string"].split("_")[0] for v in render(subdir))
        assert kinds == (["cpu", "cuda129", "cuda130"] if subdir.startswith("linux") else ["cpu"])
        for v in render(subdir):
            if v.cuda != "None":
                assert v.variant["c_stdlib"] == "sysroot" and v.variant["c_stdlib_version"] == "2.28"


# --- the build tasks ---------------------------------------------------------------------------------------


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
    assert [v.recipe["build"]["string"].split("_")[0] for v in variants] == ["cpu"]


def test_build_task_builds_the_local_matrix_into_output():
    build = MANIFEST["tasks"]["build"]["cmd"]
    assert build.startswith("rattler-build build --recipe recipe/recipe.yaml")
    assert "--variant-config conda_build_config.yaml" in build and "--output-dir output" in build
    lint = MANIFEST["tasks"]["lint"]["cmd"]
    linted = set(re.findall(r"--target-platform (\S+)", lint))
    assert linted == {s for _, s, _ in platforms()} | {"win-64"}
