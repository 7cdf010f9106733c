"""The recipe composes with conda-forge's global pinning: a feedstock's matrix, computed as
conda-smithy computes it (tests/support/conda_forge_pinning.py: the pinning with ``CF_CUDA_ENABLED=True``,
the feedstock's recipe/conda_build_config.yaml merged by conda-build's rule or rattler-build's, the
CUDA 13 migration), renders to 3 builds per Linux platform and 1 on osx-arm64, osx-64 and win-64,
with the pinning's compilers. The top-level conda_build_config.yaml is the local matrix only.
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
# A feedstock's overrides live here; this recipe has none, so the pinning alone decides.
RECIPE_CBC = RECIPE.parent / "conda_build_config.yaml"


def _feedstock_variants(platform: str, merge: str, recipe_cbc=None):
    spec = cf.feedstock_spec(platform, recipe_cbc or (RECIPE_CBC if RECIPE_CBC.exists() else None), merge)
    return spec, render(platform, cf.variant_config(spec), BUILD_PLATFORM.get(platform))


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("platform", sorted(EXPECTED_BUILDS))
def test_feedstock_matrix_has_three_builds_per_linux_platform(platform, merge):
    _, variants = _feedstock_variants(platform, merge)
    strings = sorted(v.recipe["build"]["string"].split("_")[0] for v in variants)
    assert len(variants) == EXPECTED_BUILDS[platform], strings
    expected = ["cpu", "cuda129", "cuda130"] if platform.startswith("linux") else ["cpu"]
    assert strings == expected


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
