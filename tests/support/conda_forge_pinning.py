"""A feedstock's variant matrix, computed the way conda-forge computes it, for tests.

conda-smithy (conda_smithy/configure_feedstock.py) takes conda-forge's global pinning, merges the
feedstock's ``recipe/conda_build_config.yaml`` into it with conda-build's rules, applies the open
migrations (CFEP-9 variant algebra) and renders the recipe with the result; ``CF_CUDA_ENABLED=True``
is set because the recipe uses ``compiler('cuda')``. The pinning and the CUDA 13 migration are
trimmed snapshots in ``tests/data/conda-forge-pinning/`` (README there).

Stand-ins: conda-build and conda-smithy are not on PyPI, so the two rules they apply are written
out here from their sources (conda_build/variants.py ``_combine_spec_dictionaries`` and the zip
length check; conda_smithy/variant_algebra.py ``op_variant_key_add``), only as far as these
matrices need them (no ``extend_keys``, no ``key_remove``, no ``additional_zip_keys``). Selectors
are evaluated by py-rattler-build's conda_build_config.yaml reader, which is what rattler-build uses.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml

from support import TESTS

DATA = TESTS / "data" / "conda-forge-pinning"
PINNING = DATA / "conda_build_config.yaml"
CUDA130_MIGRATION = DATA / "cuda130.yaml"
# The flash-attn feedstock's own recipe/conda_build_config.yaml (its runner label), which it keeps.
FEEDSTOCK_CBC = TESTS / "data" / "flash-attn-feedstock" / "conda_build_config.yaml"

Spec = dict  # key -> list of str values, plus "zip_keys": list of lists of keys


@contextmanager
def _environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_cbc(path: Path, platform: str, cuda_enabled: bool = True) -> Spec:
    """A conda_build_config.yaml with its selectors evaluated for ``platform`` (and
    ``CF_CUDA_ENABLED``, read by the pinning's selectors from the environment)."""
    from rattler_build import JinjaConfig, PlatformConfig, VariantConfig

    with tempfile.TemporaryDirectory() as tmp:
        # The reader takes `# [selector]` lines only from files named conda_build_config.yaml.
        copy = Path(tmp) / "conda_build_config.yaml"
        shutil.copy(path, copy)
        with _environ(CF_CUDA_ENABLED=str(cuda_enabled)):
            config = VariantConfig.from_conda_build_config(copy, JinjaConfig(PlatformConfig(target_platform=platform)))
    spec = {k: [str(v) for v in values] for k, values in config.to_dict().items()}
    if config.zip_keys:
        spec["zip_keys"] = [list(group) for group in config.zip_keys]
    return spec


def read_migration(path: Path, platform: str, cuda_enabled: bool = True) -> Spec:
    """A migration file: its ``__migrator`` block (plain YAML) and its variant keys (with selectors)."""
    text = path.read_text()
    head = yaml.safe_load(text)
    body = "\n".join(line for line in _without_block(text, ("__migrator", "migrator_ts")))
    with tempfile.TemporaryDirectory() as tmp:
        body_file = Path(tmp) / "migration.yaml"
        body_file.write_text(body)
        spec = read_cbc(body_file, platform, cuda_enabled)
    spec["__migrator"] = head["__migrator"]
    return spec


def _without_block(text: str, keys: tuple[str, ...]):
    skipping = False
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            skipping = line.split(":")[0] in keys
        if not skipping:
            yield line


# --- conda-build: merging a feedstock's conda_build_config.yaml into the pinning ---------------------


class VariantMergeError(ValueError):
    pass


def check_zip_lengths(spec: Spec, source: str) -> None:
    """conda-build's rule: the keys of a zip group present in a spec have one length; a key is in
    at most one group."""
    seen: set[str] = set()
    for group in spec.get("zip_keys", []):
        lengths = {len(spec[k]) for k in group if k in spec}
        if len(lengths) > 1:
            raise VariantMergeError(f"{source}: zip fields in zip_key group {group} are not all the same length")
        duplicates = seen & set(group)
        if duplicates:
            raise VariantMergeError(f"{source}: zip_key entries {sorted(duplicates)} occur in more than one group")
        seen |= set(group)


def conda_build_merge(base: Spec, override: Spec, source: str = "recipe/conda_build_config.yaml") -> Spec:
    """``override`` merged into ``base`` as conda-build merges variant files: zip groups are the
    union of both files' groups; a key of a zip group replaces the base's value only when the file
    sets every key of the group (with equal lengths), or the new list has the group's length; a
    value the base does not have, set without its group, is ambiguous. Then the lengths must agree."""
    check_zip_lengths(base, "global pinning")
    check_zip_lengths(override, source)
    # (conda-build collects the groups in a set; here in a stable order, so a run is repeatable)
    zip_keys = [list(g) for g in dict.fromkeys(tuple(g) for g in base.get("zip_keys", []) + override.get("zip_keys", []))]
    merged = {k: list(v) for k, v in base.items() if k != "zip_keys"}
    for key, values in override.items():
        if key == "zip_keys":
            continue
        group = next((g for g in zip_keys if key in g), [key])
        if all(k in override for k in group):
            for k in group:
                if len(override[k]) != len(values):
                    raise VariantMergeError(f"{source}: {key} and {k} are zipped but have different lengths")
                merged[k] = list(override[k])
        elif key in merged:
            lengths = [len(override[k]) if k in override else len(merged[k]) for k in group if k in override or k in merged]
            if all(n == len(values) for n in lengths):
                merged[key] = list(values)
            missing = [v for v in values if v not in merged[key]]
            if missing:
                raise VariantMergeError(
                    f"{source} is ambiguous: it sets {key} without the keys zipped with it "
                    f"({[k for k in group if k not in override]}) and {missing} are not in the pinning's {merged[key]}")
    merged["zip_keys"] = zip_keys
    check_zip_lengths(merged, "the merged matrix")
    return merged


# --- rattler-build: merging variant files -------------------------------------------------------------


def rattler_build_merge(base: Spec, override: Spec) -> Spec:
    """``VariantConfig.merge``: the override's keys replace the base's; its zip_keys, if any,
    replace the base's."""
    from rattler_build import VariantConfig

    def config(spec):
        return VariantConfig({k: v for k, v in spec.items() if k not in ("zip_keys", "__migrator")},
                             zip_keys=spec.get("zip_keys"))

    merged = config(base).merge(config(override))
    spec = {k: [str(v) for v in values] for k, values in merged.to_dict().items()}
    if merged.zip_keys:
        spec["zip_keys"] = [list(g) for g in merged.zip_keys]
    return spec


# --- conda-smithy: applying a migration ----------------------------------------------------------------


def apply_key_add_migration(spec: Spec, migration: Spec) -> Spec:
    """CFEP-9 ``key_add``: each value of the migration's primary key is added, together with the
    migration's values for the keys zipped with it, as a new column of the zip group; the columns
    are then sorted by the migration's ordering of the primary key. A platform where the migration
    sets no primary key is left as it is."""
    migrator = migration["__migrator"]
    assert migrator["operation"] == "key_add" and not migrator.get("additional_zip_keys")
    primary = migrator["primary_key"]
    if primary not in migration:
        return spec
    ordering = [str(v) for v in migrator.get("ordering", {}).get(primary, [])]
    group = next((g for g in spec.get("zip_keys", []) if primary in g), [primary])
    result = {k: list(v) for k, v in spec.items()}
    for i, value in enumerate(migration[primary]):
        missing = [k for k in group if k not in migration]
        if missing:
            raise VariantMergeError(f"the migration does not set {missing}, zipped with {primary}")
        columns = list(zip(*(result[k] for k in group)))
        new = tuple(migration[k][i] for k in group)
        if new not in columns:
            columns.append(new)
        position = group.index(primary)
        columns.sort(key=lambda c: ordering.index(c[position]) if c[position] in ordering else len(ordering))
        for j, key in enumerate(group):
            result[key] = [c[j] for c in columns]
    return result


# --- the feedstock's matrix ------------------------------------------------------------------------------


def feedstock_spec(platform: str, recipe_cbc: Path | None = None, merge: str = "conda-build") -> Spec:
    """The matrix conda-smithy renders for ``platform``: the pinning, the feedstock's
    recipe/conda_build_config.yaml (if any) merged by ``merge`` ("conda-build" or
    "rattler-build"), then the CUDA 13 migration."""
    spec = read_cbc(PINNING, platform)
    if recipe_cbc is not None:
        override = read_cbc(recipe_cbc, platform)
        spec = conda_build_merge(spec, override) if merge == "conda-build" else rattler_build_merge(spec, override)
    return apply_key_add_migration(spec, read_migration(CUDA130_MIGRATION, platform))


def variant_config(spec: Spec):
    from rattler_build import VariantConfig

    return VariantConfig({k: v for k, v in spec.items() if k not in ("zip_keys", "__migrator")},
                         zip_keys=spec.get("zip_keys"))


# --- conda-smithy: which rendered builds become CI jobs ----------------------------------------------


def feedstock_jobs(rendered: list, platform: str, noarch_platforms=("linux_64",)) -> list:
    """The rendered builds of ``platform`` that get a CI job: conda-smithy drops a noarch build on
    every platform outside conda-forge.yml's ``noarch_platforms`` (default linux_64), so a noarch
    build is built once (conda_smithy/configure_feedstock.py ``_render_ci_provider``, keep_noarch)."""
    keep_noarch = platform.replace("-", "_") in noarch_platforms
    return [r for r in rendered if keep_noarch or not r.recipe["build"].get("noarch")]
