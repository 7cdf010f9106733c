"""The GPU families (:mod:`flash_attn.planning.families`): one record each, and everything that
depends on a family derived from the records.

The central check adds a made-up family record (a Jetson-Orin-like sm87: A100-sized shared
memory, taking sm80's tables) to the registry and nothing else, and finds it wherever a family
matters: the device's family, what its image carries, the shared-memory limits, the launch and
decode configs, the specialisation set and the planner. The oracle is stated in the test (the
record's own fields, and sm80's answers it must inherit), not computed by the code under test.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from flash_attn import limits
from flash_attn.aot import archs, specializations as S
from flash_attn.params import AttentionParams
from flash_attn.planning import configs, decode_configs as dc, families, plan as P

KB = 1024
SM87 = families.Family("sm87", "nvidia", families.Capabilities((8, 7), (8, 8)), 163 * KB, "mma.sync", (8, 7),
                       config_parent="sm80", gpus="made up for the test")


@pytest.fixture
def sm87(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, "sm87", SM87)
    return SM87


def test_a_new_family_record_is_found_everywhere(sm87):
    # the device's family: 8.7 now sm87 (its range starts after sm86's), 8.6 and 8.9 still sm86
    assert [families.arch_family(c) for c in ((8, 6), (8, 7), (8, 9))] == ["sm86", "sm87", "sm86"]
    assert configs.arch_family((8, 7)) == "sm87"
    assert S.families_for((8, 7)) == ("sm87",) and S.family_capability("sm87") == (8, 7)
    # the per-family columns and the decode families
    assert configs.SHARED_MEMORY_LIMIT["sm87"] == 163 * KB and configs.FAMILY_CAPABILITY["sm87"] == (8, 7)
    assert "sm87" in dc.FAMILIES and "sm87" in list(dc.FAMILIES)
    # its tables are sm80's (its config parent)
    for kind in configs.KINDS:
        for head_dim in (16, 32, 64, 96, 128, 256):
            assert configs.pick(kind, head_dim, "sm87") == configs.pick(kind, head_dim, "sm80"), (kind, head_dim)
            assert configs.pick(kind, head_dim, "sm87", features=True) == configs.pick(kind, head_dim, "sm80",
                                                                                        features=True)
            assert configs.pick(kind, head_dim, "sm87", exact=True) == configs.pick(kind, head_dim, "sm80", exact=True)
    for bucket in dc.HEADDIM_BUCKETS:
        assert dc.bucket_configs("sm87", bucket) == dc.DECODE_CONFIGS[("sm80", bucket)]
    assert dc.aot_variants("sm87") == dc.aot_variants("sm80")
    # an image compiled for 8.7 carries exactly sm80's specialisations (no sm86 ones: nothing else runs it)
    sm80_only = {spec for dtype in S.DTYPES for spec in (*S.attention_specs("sm80", dtype), *S.decode_specs("sm80", dtype))}
    assert set(S.specs_for_capability((8, 7))) == sm80_only
    # the sm_80 PTX on this device: its shared memory holds sm80's tiles
    ptx = archs.ImageChoice("ptx", archs.parse_arch("compute_80"), "")
    assert archs.config_capability((8, 7), ptx) == (8, 0)
    # and the planner plans for it, onto images its image ships
    q = torch.empty(2, 64, 4, 128, dtype=torch.bfloat16, device="meta")
    plan = P.plan_forward(P.describe_forward(q, q, q, AttentionParams(0.125, -1, 0)), P.Target("sm87", 16, aot=True))
    spec = S.Spec.of(plan.launches[0].kernel, "bf16", plan.launches[0].constexprs, plan.launches[0].config)
    assert spec in sm80_only


def test_the_records_are_consistent():
    names = list(families.FAMILIES)
    for family in families.FAMILIES.values():
        assert family.mma in families.MMA_KINDS and family.shared_memory > 0
        if family.vendor == "nvidia":
            assert families.arch_family(family.image_capability) == family.name  # its images are for its own devices
        else:  # AMD: Triton's JIT only, no images; each of its processors is its own
            assert family.image_capability is None and not family.image_carries
            assert all(families.arch_family(f"{n}:sramecc+:xnack-") == family.name for n in family.devices.names)
        assert family.config_parent is None or family.config_parent in names
        assert family.config_parent is None or families.get(family.config_parent).vendor == family.vendor
        assert all(name in names for name in family.image_carries)
        assert families.lineage(family.name)[-1] in names
    # the oldest family starts at the kernels' minimum; below it there is no family
    nvidia = [f for f in families.FAMILIES.values() if f.vendor == "nvidia"]
    assert min(f.devices.low for f in nvidia) == limits.MIN_CAPABILITY
    with pytest.raises(ValueError, match="7.5 is in no GPU family"):
        families.arch_family((7, 5))


@pytest.mark.parametrize("capability,family", [((8, 0), "sm80"), ((8, 6), "sm86"), ((8, 9), "sm86"), ((9, 0), "sm90"),
                                               ((10, 0), "sm100"), ((10, 3), "sm100"), ((11, 0), "sm100"),
                                               ((12, 0), "sm120"), ((12, 1), "sm120"), ((13, 0), "sm120")])
def test_devices_map_to_their_family(capability, family):
    assert families.arch_family(capability) == family


def test_every_family_has_every_config():
    """Each family finds a launch config for every kind and head-dim bucket it does not refuse
    (``configs.refusal``: none refused today), and decode configs for every such decode bucket
    (its own rows or its parent's)."""
    for family in families.FAMILIES:
        for kind in configs.KINDS:
            for bucket in configs.HEADDIM_BUCKETS:
                if configs.refusal(bucket, family):
                    continue
                config = configs.pick(kind, bucket, family)
                assert isinstance(config, configs.Config) or (kind == "bwd_fused" and config is None), (family, kind)
        for bucket in dc.HEADDIM_BUCKETS:
            if configs.refusal(bucket, family):
                continue
            small, large = dc.bucket_configs(family, bucket)
            assert small.block_m <= large.block_m


def test_a_cycle_of_config_parents_is_an_error(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, "sm90", families.FAMILIES["sm90"].__class__(
        **{**families.FAMILIES["sm90"].__dict__, "config_parent": "sm100"}))
    with pytest.raises(ValueError, match="cycle"):
        families.lineage("sm100")


def test_a_head_dim_bucket_added_without_its_entries_fails_loudly(monkeypatch):
    """A bucket (1024) added to the declaration alone: the config tables do not shift their entries
    onto other buckets, they refuse to load until every row has its sixth entry (as bucket 512
    did until its entries were read from the compiler)."""
    monkeypatch.setattr(limits, "HEADDIM_BUCKETS", (*limits.HEADDIM_BUCKETS, 1024))
    with pytest.raises(ValueError, match="one per head-dim bucket"):
        runpy.run_path(str(Path(configs.__file__)), run_name="configs_copy")


def test_the_unknown_mma_kind_is_refused():
    with pytest.raises(ValueError, match="MMA kind"):
        families.Family("gfx942", "amd", families.Capabilities((99, 0)), 64 * KB, "mfma-typo", (99, 0))
