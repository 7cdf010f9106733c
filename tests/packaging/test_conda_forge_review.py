"""The recipe through a conda-forge review (issue 46): conda-smithy's linter rules restated, the
feedstock's files, the build targets declared once, the two naming routes and the version scheme.

conda-smithy's linter itself cannot run in CI (its PyPI name is a placeholder; it needs conda and
conda-build, which PyPI does not have): docs/conda-forge.md records its output, run once from its
source. The rules below are restated from that source (conda-forge/conda-smithy 081ec6b, August
2026), each with a control that shows it can fail; conda-forge.yml is checked against conda-smithy's
own schema (tests/data/conda-smithy/).
"""

from __future__ import annotations

import asyncio
import json
import re
import tomllib
from pathlib import Path

import pytest

from support import TESTS
from support.packaging_helpers import PIXI, RECIPE, REPO, render  # noqa: I001

yaml = pytest.importorskip("yaml")
if not RECIPE.is_file():  # the recipe's test steps copy tests/ without the recipe
    pytest.skip(f"{RECIPE} is absent", allow_module_level=True)
RECIPE_YAML = yaml.safe_load(RECIPE.read_text())
FORGE_YML = RECIPE.parent / "feedstock-conda-forge.yml"
FORGE_SCHEMA = TESTS / "data" / "conda-smithy" / "conda-forge.schema.json"
DOCS = REPO / "docs" / "conda-forge.md"


def _flatten(items) -> list:
    """A v1 requirement list with its if/then/else items flattened (conda-smithy's flatten_v1_if_else)."""
    out = []
    for item in items or []:
        if isinstance(item, dict) and "if" in item:
            for branch in ("then", "else"):
                value = item.get(branch, [])
                out += _flatten(value if isinstance(value, list) else [value])
        else:
            out.append(item)
    return out


def _outputs(recipe: dict) -> list[dict]:
    return recipe.get("outputs") or [recipe]


# --- the linter's rules ----------------------------------------------------------------------------

GITHUB_LOGIN = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9]|-(?=[A-Za-z0-9])){0,38}$")


def test_maintainer_placeholder_is_obvious_and_cannot_be_an_account():
    """The linter asks GitHub whether each maintainer exists (lint_recipe.py ``_maintainer_exists``);
    until a person fills them in, the placeholder must fail that check for sure: it names the TODO
    and cannot be a GitHub login (letters, digits and single inner hyphens), so nobody is pinged.
    (The placeholder before issue 46, `TODO-github-handle`, was a valid login.)"""
    maintainers = RECIPE_YAML["extra"]["recipe-maintainers"]
    placeholders = [m for m in maintainers if "TODO" in m]
    assert placeholders, "a person must fill in the maintainers: keep the placeholder until then"
    for entry in placeholders:
        assert not GITHUB_LOGIN.match(entry), entry
    for entry in maintainers:
        assert entry in placeholders or all(GITHUB_LOGIN.match(part) for part in entry.split("/")), entry
    assert GITHUB_LOGIN.match("TODO-github-handle")  # the old placeholder: a login someone could own


def _schema_errors(document: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(FORGE_SCHEMA.read_text())
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(document)]


def test_feedstock_conda_forge_yml_is_valid_for_conda_smithy():
    """conda-smithy validates conda-forge.yml against its schema and reports every error as a lint
    (validate_schema.py). `linter.skip` takes only lint_noarch_selectors, lint_stdlib,
    hint_os_version, hint_pip_no_build_backend and hint_python_min: the file before issue 46
    skipped hint_abi3_missing_abi3audit, which is not one of them."""
    forge = yaml.safe_load(FORGE_YML.read_text())
    assert _schema_errors(forge) == []
    assert _schema_errors({**forge, "linter": {"skip": ["hint_abi3_missing_abi3audit"]}})
    assert _schema_errors({**forge, "linter": {"skip": ["lint_noarch_selectors"]}}) == []


def abi3_audit_hint(recipe: dict) -> bool:
    """conda_smithy/linter/hints.py ``hint_abi3_missing_abi3audit``: an output that is not
    `noarch: python`, is `python.version_independent` and has `python-abi3` in host, without a test
    that mentions abi3audit."""
    for output in _outputs(recipe):
        build = output.get("build", {})
        if build.get("noarch") == "python" or not build.get("python", {}).get("version_independent"):
            continue
        host = [str(s).split()[0] for s in _flatten(output.get("requirements", {}).get("host"))]
        if "python-abi3" in host and "abi3audit" not in json.dumps(output.get("tests", [])):
            return True
    return False


def test_no_python_abi3_without_an_extension_module():
    """python-abi3 describes Python extension modules built on the limited API; the op library is a
    plain shared library that torch.ops.load_library loads (CMakeLists.txt builds it with no Python
    headers; recipe/check_no_python_c_api.py, a test of every CUDA build, finds no Python symbol in
    it). So no output has python-abi3 in host and the linter's abi3audit hint has nothing to ask;
    the control puts it back into the CUDA output, as before issue 46."""
    assert not any("python-abi3" in str(s) for o in _outputs(RECIPE_YAML)
                   for s in _flatten(o.get("requirements", {}).get("host")))
    assert not abi3_audit_hint(RECIPE_YAML)
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert "add_library(flash_attn_aot SHARED" in cmake and "Python3_add_library" not in cmake and "Development" not in cmake
    control = json.loads(json.dumps(RECIPE_YAML))
    [cuda] = [o for o in control["outputs"] if "noarch" not in o["build"]]
    cuda["requirements"]["host"].append("python-abi3")
    assert abi3_audit_hint(control)


def _render_context(context: dict) -> dict:
    """The recipe's context as conda-smithy's linter renders it (rattler-build-conda-compat's
    ``render_recipe_with_context``: each value a template over the values before it, no variant,
    linux-64), with StrictUndefined, which is stricter than the linter: any use of an undefined
    name but ``default`` fails."""
    import jinja2

    env = jinja2.Environment(variable_start_string="${{", variable_end_string="}}", undefined=jinja2.StrictUndefined)
    env.filters["split"] = lambda value, sep=None: value.split(sep)
    names = {"target_platform": "linux-64", "build_platform": "linux-64", "linux": True, "x86_64": True, "unix": True}
    for key, value in context.items():
        names[key] = env.from_string(str(value)).render(**names) if isinstance(value, str) else value
    return names


def test_context_renders_without_cuda_compiler_version():
    """The linter renders the context with no variant, where cuda_compiler_version is undefined;
    the recipe before issue 46 stopped it there (`UndefinedError: 'cuda_compiler_version' is
    undefined`, from cuda_major's `split`), and conda-smithy's rerender with it."""
    import jinja2

    names = _render_context(RECIPE_YAML["context"])
    assert names["is_cuda"] == "False" and names["source_from"] == "tarball" and names["name"] == "flash-attn"
    old = {**RECIPE_YAML["context"], "cuda_major": '${{ (cuda_compiler_version | split("."))[0] }}'}
    with pytest.raises(jinja2.UndefinedError, match="cuda_compiler_version"):
        _render_context(old)


def test_noarch_values_are_literals_and_the_noarch_output_is_platform_free():
    """conda-smithy lints a `build.noarch` that is not literally `python` or `generic` (R-020), so a
    CPU build that is noarch and CUDA builds that are not must be two outputs, not one output with
    a templated noarch. The noarch output is one file for every platform: none of its requirements
    may depend on the platform (a noarch package's selectors are evaluated once, on linux-64). The
    same holds for the third output, FlashAttention-3's interface (flash-attn-fa3), noarch too."""
    platform_names = {"linux", "osx", "win", "unix", "x86_64", "aarch64", "arm64", "target_platform",
                      "build_platform", "host_platform"}
    assert "noarch" not in RECIPE_YAML["build"]
    noarch = [o for o in RECIPE_YAML["outputs"] if "noarch" in o["build"]]
    assert [(o["package"]["name"], o["build"]["noarch"]) for o in noarch] == [("${{ name }}", "python"),
                                                                             ("${{ name }}-fa3", "python")]
    for output in noarch:
        conditions = [item["if"] for items in output["requirements"].values() if isinstance(items, list)
                      for item in items if isinstance(item, dict) and "if" in item]
        for condition in conditions:
            assert not platform_names & set(re.findall(r"\w+", condition)), condition
        assert output["build"]["skip"] == ["is_cuda"]


# --- the feedstock's files -----------------------------------------------------------------------------

def test_what_replaces_the_feedstocks_files():
    """The flash-attn feedstock today has recipe/setup.py and recipe/pyproject.toml (its own build of
    upstream's CUDA extension), LICENSE_CUTLASS.txt (upstream vendors CUTLASS) and the outputs
    flash-attn-fused-dense and flash-attn-layer-norm. Here: pyproject.toml's scikit-build-core
    build, no CUTLASS code (one license file), and one package name for flash-attn (the two
    extension modules' APIs are part of it, each naming the package it replaces; the old packages
    stay on their upstream flash-attn through their exact pin, docs/conda-forge.md step 7), beside
    the FA3 interface's output."""
    backend = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["build-backend"]
    assert backend == "scikit_build_core.build" and not (REPO / "setup.py").exists()
    assert RECIPE_YAML["about"]["license_file"] == "LICENSE"
    sources = [p for folder in ("flash_attn", "csrc") for p in (REPO / folder).rglob("*") if p.is_file()]
    assert not [p for p in sources if p.suffix in (".py", ".cpp", ".h", ".cu", ".txt") and "cutlass" in p.read_text().lower()]
    # flash-attn's two outputs, and FlashAttention-3's interface (tests/packaging/test_fa3_output.py)
    assert {o["package"]["name"] for o in RECIPE_YAML["outputs"]} == {"${{ name }}", "${{ name }}-fa3"}
    for module, package in (("fused_dense", "flash-attn-fused-dense"), ("layer_norm", "flash-attn-layer-norm")):
        assert package in (REPO / "flash_attn" / "ops" / f"{module}.py").read_text()


# --- the build targets, declared once ------------------------------------------------------------------

def test_build_targets_are_declared_once_in_the_recipe(monkeypatch):
    """The recipe states the kernels' GPU targets (context `cuda_archs`) and passes them to every
    CUDA build; the code's default is the same list, read from the recipe; no other source file
    spells the list."""
    from flash_attn.aot import archs

    monkeypatch.delenv("FLASH_ATTN_CUDA_ARCHS", raising=False)
    declared = RECIPE_YAML["context"]["cuda_archs"]
    assert archs.DEFAULT_CUDA_ARCHS == declared
    builds = [v for v in render("linux-64") if v.cuda != "None"]
    assert builds and all(v.recipe["build"]["script"]["env"]["FLASH_ATTN_CUDA_ARCHS"] == declared for v in builds)
    files = [p for folder in ("flash_attn", "csrc", "recipe") for p in (REPO / folder).rglob("*")
             if p.is_file() and p.suffix in (".py", ".yaml", ".sh", ".cpp", ".h", ".txt")]
    files += [REPO / "CMakeLists.txt", REPO / "pyproject.toml", PIXI, REPO / "conda_build_config.yaml"]
    assert [p.relative_to(REPO).as_posix() for p in files if declared in p.read_text()] == ["recipe/recipe.yaml"]


def test_declared_targets_drop_what_an_older_ptxas_cannot_assemble(monkeypatch):
    """The recipe passes the declared list to its CUDA 12.9 build too, whose ptxas cannot assemble
    Thor's sm_110f: the declared list is the default set, less such family targets; another list
    naming one is an error, as before."""
    from flash_attn.aot.archs import default_cuda_archs
    from flash_attn.kernel_build import build as kernel_build

    real = kernel_build.ptxas_targets
    monkeypatch.setattr(kernel_build, "ptxas_targets", lambda cap: real(cap) - {"sm_110f"})
    cubins, ptxs = kernel_build.resolve_archs(default_cuda_archs())
    assert "sm_110f" not in [a.name for a in cubins] and "sm_80" in [a.name for a in cubins]
    assert (cubins, ptxs) == kernel_build.resolve_archs("")
    with pytest.raises(SystemExit, match="sm_110f"):
        kernel_build.resolve_archs("80;110f")


def test_default_targets_away_from_a_source_tree(monkeypatch, tmp_path):
    """An installed package has no recipe beside it: its default is what its build recorded in
    _C/build_config.json (CMakeLists.txt: the recipe's list when the source had the recipe, and the
    list it was built for), else there is none and asking for it says what to do."""
    from flash_attn.aot import archs

    package = tmp_path / "site-packages" / "flash_attn"
    (package / "aot").mkdir(parents=True)
    (package / "_C").mkdir()
    monkeypatch.setattr(archs, "_SOURCE_ROOT", tmp_path / "site-packages")
    monkeypatch.setattr(archs, "__file__", str(package / "aot" / "archs.py"))
    archs.default_cuda_archs.cache_clear()
    try:
        assert archs.default_cuda_archs() == ""
        with pytest.raises(ValueError, match="name them"):
            archs.parse_arch_list(None)
        for recorded, default in (({"cuda_archs": "none"}, ""), ({"cuda_archs": "80;90a"}, "80;90a"),
                                  ({"cuda_archs": "none", "declared_cuda_archs": "80;120f"}, "80;120f")):
            archs.default_cuda_archs.cache_clear()
            (package / "_C" / "build_config.json").write_text(json.dumps(recorded))
            assert archs.default_cuda_archs() == default, recorded
    finally:
        monkeypatch.undo()
        archs.default_cuda_archs.cache_clear()
    assert archs.default_cuda_archs() == RECIPE_YAML["context"]["cuda_archs"]


# --- the name: two routes, one variable ---------------------------------------------------------------

def _recipe_named(tmp_path: Path, name: str) -> Path:
    text = RECIPE.read_text()
    assert text.count("\n  name: flash-attn\n") == 1
    path = tmp_path / name / "recipe" / "recipe.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(text.replace("\n  name: flash-attn\n", f"\n  name: {name}\n"))
    return path


@pytest.mark.parametrize("name", ["flash-attn", "flash-attn-triton"])
def test_recipe_renders_either_route_from_one_variable(name, tmp_path):
    """Route A (the flash-attn feedstock, upstream agreeing): `flash-attn`. Route B (a feedstock
    of its own): another name, and every build excludes upstream's `flash-attn`, since both install
    site-packages/flash_attn and conda has no "provides". Only the context's `name` changes."""
    for platform in ("linux-64", "osx-arm64"):
        for v in render(platform, recipe_path=_recipe_named(tmp_path / platform, name)):
            assert v.recipe["package"]["name"] == name
            constraints = [str(c) for c in v.recipe["requirements"].get("run_constraints", [])]
            assert constraints == ([] if name == "flash-attn" else ["flash-attn <0.0.0a0"])
    # the Python distribution stays `flash-attn` either way: what transformers looks for beside the
    # `flash_attn` import (is_flash_attn_2_available maps the import to its distributions)
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"] == "flash-attn"


def _records(recipe_path: Path, platform: str) -> list[dict]:
    from support import conda_channel

    return [conda_channel._record(v.recipe["package"]["name"], str(v.recipe["package"]["version"]),
                                  v.recipe["build"]["string"], int(v.recipe["build"]["number"]),
                                  [str(s) for s in v.recipe["requirements"].get("run", [])],
                                  [str(s) for s in v.recipe["requirements"].get("run_constraints", [])],
                                  *conda_channel.package_subdir(v.recipe["build"], platform))
            for v in render(platform, recipe_path=recipe_path)]


def test_each_route_with_upstreams_package_beside_it(tmp_path):
    """With upstream's flash-attn 2.8.3 (the feedstock's build today) in the channel, on a CUDA 13
    machine: route A's `conda install flash-attn` gets this package (2.8.3.1 sorts above 2.8.3);
    route B's `flash-attn-triton` installs without upstream's package and cannot be installed
    beside it."""
    rattler = pytest.importorskip("rattler", reason="py-rattler is not installed")
    from support import conda_channel

    upstream = conda_channel._record("flash-attn", "2.8.3", "cuda130_py312_h0000000_7", 7,
                                     ["python >=3.12,<3.13.0a0", "pytorch * cuda*", "einops", "cuda-version >=13.0,<14"],
                                     [], "linux-64")
    einops = conda_channel._record("einops", "0.8.1", "pyh_0", 0, ["python >=3.9"], [], "noarch", "python")
    base = conda_channel.conda_forge_records("linux-64") + [upstream, einops]
    machine = [rattler.GenericVirtualPackage(rattler.PackageName(k), rattler.Version(v), rattler.BuildString("0"))
               for k, v in {"__unix": "0", "__linux": "6.8", "__glibc": "2.35", "__cuda": "13.0"}.items()]

    channels = {name: conda_channel.write_channel(tmp_path / "channel" / name,
                                                  base + _records(_recipe_named(tmp_path / "recipes", name), "linux-64"))
                for name in ("flash-attn", "flash-attn-triton")}

    def solve(route: str, specs: list[str]) -> dict:
        records = asyncio.run(rattler.solve([channels[route]], specs, gateway=rattler.Gateway(cache_dir=str(tmp_path / route)),
                                            platforms=["linux-64", "noarch"], virtual_packages=machine))
        return {r.name.normalized: r for r in records}

    route_a = solve("flash-attn", ["flash-attn"])
    assert str(route_a["flash-attn"].version) == RECIPE_YAML["context"]["version"]
    assert str(route_a["flash-attn"].build).startswith("cuda130")
    route_b = solve("flash-attn-triton", ["flash-attn-triton"])
    assert str(route_b["flash-attn-triton"].build).startswith("cuda130") and "flash-attn" not in route_b
    with pytest.raises(Exception):
        solve("flash-attn-triton", ["flash-attn-triton", "flash-attn"])


# --- the version -----------------------------------------------------------------------------------

# Upstream's releases on PyPI (pip index versions flash-attn, 2026-11): three numeric components,
# sometimes a .postN wheel rebuild; never a fourth numeric component.
UPSTREAM_RELEASES = """2.8.3.post2 2.8.3.post1 2.8.3 2.8.2 2.8.1 2.8.0.post2 2.7.4.post1 2.7.3 2.7.2.post1 2.7.1.post4
2.7.0.post2 2.6.3 2.6.2 2.6.1 2.6.0.post1 2.5.9.post1 2.5.8 2.5.7 2.5.6 2.5.5 2.5.4 2.5.3 2.5.2 2.5.1.post1 2.5.0
2.4.3.post1 2.4.2 2.4.1 2.4.0.post1 2.3.6 2.3.5 2.3.4 2.3.3 2.3.2 2.3.1.post1 2.3.0 2.2.5 2.2.4.post1 2.2.4
2.2.3.post2 2.2.2 2.2.1 2.2.0 2.1.2.post3 2.1.1 2.1.0 2.0.9 2.0.8 2.0.7 2.0.6.post2 2.0.6 2.0.5 2.0.4 2.0.3 2.0.2
2.0.1 2.0.0.post1""".split()
# What clients compare flash_attn's version with: transformers (is_flash_attn_greater_or_equal,
# is_flash_attn_2_available's 2.3.3 floor) and diffusers, from 2.1.0 to 2.6.3.
CLIENT_GATES = ["2.1.0", "2.3.3", "2.6.3"]


def test_version_cannot_be_an_upstream_release_and_passes_the_gates():
    """The version is the flash-attn API level it implements (2.8.3) plus this project's release
    number as a fourth numeric component, from 1 (2.8.3.0 would equal 2.8.3). Upstream never used a
    fourth numeric component, so no upstream release can equal it; it sorts above 2.8.3 (and its
    .postN rebuilds) and below any later upstream release, in conda's ordering and in PEP 440's
    alike; it passes every client gate and stays a 2.x version. The version before issue 46, 2.9.0,
    was upstream's likely next release."""
    from packaging.version import Version
    from rattler import Version as CondaVersion

    version = RECIPE_YAML["context"]["version"]
    assert re.fullmatch(r"2\.\d+\.\d+\.[1-9]\d*", version), version
    ours, api_level = Version(version), Version(".".join(version.split(".")[:3]))
    assert all(re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", r) for r in UPSTREAM_RELEASES)
    for release in UPSTREAM_RELEASES:
        assert Version(release) != ours
        assert (Version(release) < ours) == (CondaVersion(release) < CondaVersion(version))
    assert all(Version(r) < ours for r in UPSTREAM_RELEASES if Version(r).release[:3] <= api_level.release)
    next_patch = f"{api_level.major}.{api_level.minor}.{api_level.micro + 1}"
    assert ours < Version(next_patch) and CondaVersion(version) < CondaVersion(next_patch)
    assert all(ours >= Version(gate) for gate in CLIENT_GATES) and ours.major == 2
    assert re.fullmatch(r"2\.\d+\.\d+", "2.9.0")  # the old version had upstream's own form


# --- the checklist ---------------------------------------------------------------------------------

def test_checklist_names_what_only_a_person_can_do():
    """docs/conda-forge.md's maintainers' checklist has an item for each placeholder of the recipe
    (the release address and its sha256, the project's addresses, the maintainers) and for the
    naming agreement, and records the linter's run."""
    text = DOCS.read_text()
    checklist = text[text.index("## The maintainers' checklist"):]
    checklist = checklist[:checklist.index("\n## ", 1)]
    todo_lines = [line for line in RECIPE.read_text().splitlines() if "TODO" in line and not line.lstrip().startswith("#")]
    assert todo_lines
    for needle in ("`source`", "sha256", "about.homepage", "recipe-maintainers", "TODO_github_handle", "`name`",
                   "route A", "route B", "conda_build_config.yaml", "feedstock-conda-forge.yml"):
        assert needle in checklist, needle
    assert "conda-smithy" in text and "081ec6b" in text
