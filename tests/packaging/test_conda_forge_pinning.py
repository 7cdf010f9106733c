"""The recipe composes with conda-forge's global pinning: a feedstock's matrix, computed as
conda-smithy computes it (tests/support/conda_forge_pinning.py: the pinning with ``CF_CUDA_ENABLED=True``,
the feedstock's recipe/conda_build_config.yaml merged by conda-build's rule or rattler-build's, the
CUDA 13 migration), renders to 3 builds per Linux platform and the noarch CPU build elsewhere, with
the pinning's compilers; as CI jobs that is the noarch CPU build once (linux-64) and the two CUDA
builds per Linux platform. The feedstock's own recipe/conda_build_config.yaml (its runner label) is
kept; the top-level conda_build_config.yaml is the local matrix only.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("rattler_build", reason="py-rattler-build is not installed (pip install py-rattler-build)")
pytest.importorskip("yaml")

from support import conda_forge_pinning as cf  # noqa: E402
from support.packaging_helpers import RECIPE, VARIANTS, render  # noqa: E402

# conda-forge.yml of the feedstock: `build_platform: {linux_aarch64: linux_64}` (cross-compiled).
BUILD_PLATFORM = {"linux-aarch64": "linux-64"}
EXPECTED_BUILDS = {"linux-64": 3, "linux-aarch64": 3, "osx-arm64": 1, "osx-64": 1, "win-64": 1}
MERGES = ["conda-build", "rattler-build"]
# A feedstock's overrides live in its recipe/conda_build_config.yaml: the flash-attn feedstock's
# holds its runner label and is kept; this repository's recipe/ ships none.
RECIPE_CBC = RECIPE.parent / "conda_build_config.yaml"
# CI jobs per platform: the noarch CPU build on linux-64 alone, the CUDA builds on Linux.
EXPECTED_JOBS = {"linux-64": ["cpu", "cuda129", "cuda130"], "linux-aarch64": ["cuda129", "cuda130"],
                 "osx-arm64": [], "osx-64": [], "win-64": []}


def _feedstock_variants(platform: str, merge: str, recipe_cbc=None):
    spec = cf.feedstock_spec(platform, recipe_cbc or cf.FEEDSTOCK_CBC, merge)
    return spec, render(platform, cf.variant_config(spec), BUILD_PLATFORM.get(platform))


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("platform", sorted(EXPECTED_BUILDS))
def test_feedstock_matrix_has_three_builds_per_linux_platform(platform, merge):
    _, variants = _feedstock_variants(platform, merge)
    strings = sorted(v.recipe["build"]["string"].split("_")[0] for v in variants)
    assert len(variants) == EXPECTED_BUILDS[platform], strings
    expected = ["cpu", "cuda129", "cuda130"] if platform.startswith("linux") else ["cpu"]
    assert strings == expected
    assert all(v.recipe["build"].get("noarch") == ("python" if v.cuda == "None" else None) for v in variants)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("platform", ["linux-64", "linux-aarch64"])
def test_feedstock_builds_use_the_pinnings_toolchains(platform, merge):
    """CUDA 12.9 with GCC 14 and sysroot 2.17 (the pinning), CUDA 13.0 with GCC 15 and sysroot 2.28
    (the migration); the CPU build compiles nothing and names no compiler."""
    arch = platform.split("-")[1]
    _, variants = _feedstock_variants(platform, merge)
    builds = {v.cuda: [str(s) for s in v.recipe["requirements"]["build"]] for v in variants}
    for cuda, gcc, glibc in (("12.9", "14", "2.17"), ("13.0", "15", "2.28")):
        assert f"gcc_linux-{arch} {gcc}.*" in builds[cuda] and f"gxx_linux-{arch} {gcc}.*" in builds[cuda]
        assert f"sysroot_linux-{arch} {glibc}.*" in builds[cuda]
        assert f"cuda-nvcc_linux-{arch} {cuda}.*" in builds[cuda]
    assert not any(s.startswith(("gcc", "gxx", "sysroot", "cuda-nvcc")) for s in builds["None"])


def _jobs(platform: str, recipe_path=RECIPE) -> list[str]:
    spec = cf.feedstock_spec(platform, cf.FEEDSTOCK_CBC)
    variants = render(platform, cf.variant_config(spec), BUILD_PLATFORM.get(platform), recipe_path=recipe_path)
    return sorted(v.recipe["build"]["string"].split("_")[0] for v in cf.feedstock_jobs(variants, platform))


@pytest.mark.parametrize("platform", sorted(EXPECTED_JOBS))
def test_feedstock_builds_the_noarch_cpu_build_once(platform, tmp_path):
    """conda-smithy keeps a noarch build on linux_64 only: the CPU build is one job and one file,
    the CUDA builds one job each per Linux platform, macOS and Windows none (the noarch file serves
    them). conda-smithy's own rerender of this recipe gave these five jobs (docs/conda-forge.md).
    The control: the same recipe with a platform-specific CPU build (no `noarch: python`, as before
    issue 46) has a CPU job on every platform."""
    assert _jobs(platform) == EXPECTED_JOBS[platform]
    text = RECIPE.read_text()
    # the CPU build's, then the FA3 interface's (its own output, tests/packaging/test_fa3_output.py)
    assert text.count("      noarch: python\n") == 2 and text.index("      noarch: python\n") < text.index("-fa3\n")
    per_platform = tmp_path / "recipe" / "recipe.yaml"
    per_platform.parent.mkdir()
    per_platform.write_text(text.replace("      noarch: python\n", "", 1))
    assert _jobs(platform, per_platform) == sorted(EXPECTED_JOBS[platform] + ([] if platform == "linux-64" else ["cpu"]))


@pytest.mark.parametrize("merge", MERGES)
def test_feedstocks_runner_label_is_kept(merge):
    """The feedstock's recipe/conda_build_config.yaml (github_actions_labels, Linux only) merges
    into the pinning under both rules and changes no build."""
    spec, variants = _feedstock_variants("linux-64", merge)
    assert spec["github_actions_labels"] == ["blacksmith-8vcpu-ubuntu-2404"]
    without = render("linux-64", cf.variant_config(cf.feedstock_spec("linux-64", None, merge)))
    assert sorted(v.recipe["build"]["string"] for v in variants) == sorted(v.recipe["build"]["string"] for v in without)
    assert "github_actions_labels" not in cf.feedstock_spec("osx-arm64", cf.FEEDSTOCK_CBC, merge)


def test_migration_adds_cuda_13_as_a_zipped_column():
    """conda-smithy's key_add on linux-64: 13.0 enters the compiler/stdlib/CUDA zip group with the
    migration's compilers and sysroot, ordered by the migration's ordering (None, 12.9, 13.0)."""
    spec = cf.feedstock_spec("linux-64")
    group = next(g for g in spec["zip_keys"] if "cuda_compiler_version" in g)
    columns = list(zip(*(spec[k] for k in ["cuda_compiler_version", "c_compiler_version", "c_stdlib_version"])))
    assert set(group) == {"c_compiler_version", "cxx_compiler_version", "fortran_compiler_version",
                          "c_stdlib_version", "cuda_compiler_version"}
    assert columns == [("None", "15", "2.17"), ("12.9", "14", "2.17"), ("13.0", "15", "2.28")]
    # macOS has no CUDA: the migration leaves it alone.
    assert cf.feedstock_spec("osx-arm64")["cuda_compiler_version"] == ["None"]


@pytest.mark.parametrize("platform", ["linux-64", "win-64"])
def test_feedstock_variants_use_only_keys_of_the_pinning(platform):
    """No stale keys: everything the rendered builds depend on comes from the pinning and its
    migration (nothing of ours is needed, nothing of ours could go stale)."""
    spec, variants = _feedstock_variants(platform, "conda-build")
    known = set(spec) | {"target_platform", "build_platform", "host_platform"}
    for v in variants:
        # rattler-build hashes virtual-package requirements (`__cuda >=12`) with the variant
        stale = {k for k in v.variant if not k.startswith("__")} - known
        assert not stale, stale
    assert not RECIPE_CBC.exists() and not (RECIPE.parent / "variants.yaml").exists()


def test_local_matrix_has_the_feedstocks_cuda_builds():
    """The local matrix (top-level conda_build_config.yaml, `pixi run build`) builds what the
    feedstock builds, per platform. (Its one compiler, GCC 14, and sysroot 2.28 serve every CUDA
    variant; the feedstock's come from the pinning.)"""
    for platform, count in EXPECTED_BUILDS.items():
        local = sorted(v.cuda for v in render(platform, build_platform=BUILD_PLATFORM.get(platform)))
        feedstock = sorted(v.cuda for v in _feedstock_variants(platform, "conda-build")[1])
        assert local == feedstock and len(local) == count, (platform, local, feedstock)


# --- what the merge rules reject (so the checks above can fail) ----------------------------------------

# The variant file this recipe had before (issue 10): a zip of cuda_compiler_version with
# cuda_compiler and compiler versions for one of the pinning's zipped columns.
OLD_MATRIX = textwrap.dedent("""\
    cuda_compiler_version:
      - 12.9                     # [linux]
      - 13.0                     # [linux]
      - None
    cuda_compiler:
      - cuda-nvcc                # [linux]
      - cuda-nvcc                # [linux]
      - None
    c_compiler_version:          # [linux]
      - 14                       # [linux]
    cxx_compiler_version:        # [linux]
      - 14                       # [linux]
    c_stdlib_version:            # [linux]
      - 2.28                     # [linux]
    zip_keys:
      - - cuda_compiler_version
        - cuda_compiler
    """)


@pytest.mark.parametrize("name", ["the old variant file", "the local matrix"])
def test_conda_builds_rule_rejects_a_partial_override(name, tmp_path):
    """A recipe/conda_build_config.yaml that overrides some keys of the pinning's zip group breaks
    conda-build's merge: the old variant file did (why the feedstock would have failed), and the
    local matrix would (why it stays at the top level, out of recipe/)."""
    cbc = tmp_path / "conda_build_config.yaml"
    cbc.write_text(OLD_MATRIX if name == "the old variant file" else VARIANTS.read_text())
    with pytest.raises(cf.VariantMergeError):
        cf.feedstock_spec("linux-64", recipe_cbc=cbc, merge="conda-build")


def test_zip_length_check_catches_a_mismatch():
    spec = {"a": ["1", "2"], "b": ["x"], "zip_keys": [["a", "b"]]}
    with pytest.raises(cf.VariantMergeError, match="not all the same length"):
        cf.check_zip_lengths(spec, "test")
