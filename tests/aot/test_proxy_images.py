"""The mma.sync proxy's images (:mod:`flash_attn.kernel_build.proxy`): derived from the sm80/sm86
tables, enough for every call ``bench gpu --family`` makes, compiled (here, without a GPU) as
``compute_80`` PTX that holds mma.sync and no instruction of a later GPU; and the ``aot`` backend
choosing them on an H200 under ``FLASH_ATTN_FORCE_FAMILY`` (the device answered by stand-ins: what
they stand for is the CUDA device query; what they cannot show is a launch)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from flash_attn.aot import forced, specializations as S
from flash_attn.aot.manifest import Manifest
from flash_attn.backends import aot
from flash_attn.kernel_build import proxy
from flash_attn.params import AttentionParams
from flash_attn.planning import configs, plan as P

from support.calls import attention_calls

H200_SMS = 132


def _planned(op, args, kwargs, target):
    describe, planner = {"forward": (P.describe_forward, P.plan_forward),
                         "backward": (P.describe_backward, P.plan_backward)}[op]
    planned = planner(describe(*args, **kwargs), target)
    assert not isinstance(planned, P.Refusal), planned
    return [S.Spec.of(launch.kernel, S.dtype_name(planned.dtype), launch.constexprs, launch.config)
            for launch in planned.launches]


def _bench_calls(head_dim):
    """The calls of ``bench gpu --family``'s cases (16k tokens, hidden 2048) and its held-out GQA shape."""
    for seqlen, heads, kv_heads in ((4096, 2048 // head_dim, 2048 // head_dim), (16384, 2048 // head_dim, 2048 // head_dim),
                                    (3001, 32, 4)):
        q = torch.empty(16384 // seqlen or 1, seqlen, heads, head_dim, dtype=torch.bfloat16, device="meta")
        k = torch.empty(q.shape[0], seqlen, kv_heads, head_dim, dtype=torch.bfloat16, device="meta")
        lse = torch.empty(q.shape[0], heads, seqlen, dtype=torch.float32, device="meta")
        for causal in (False, True):
            params = AttentionParams(head_dim ** -0.5, -1, 0 if causal else -1, 0.0, 0.0, 0)
            yield "forward", (q, k, torch.empty_like(k), params), {}
            yield "backward", (torch.empty_like(q), q, k, torch.empty_like(k), torch.empty_like(q), lse, params), {}


@pytest.mark.parametrize("family", proxy.proxy_families())
def test_the_proxy_images_hold_every_launch_the_benchmark_plans(family):
    """Planned for an H200 with the family forced (its tables, 132 SMs), every bench call and every
    plain call (each mask, dense and varlen) launches only proxy specialisations."""
    shipped = set(proxy.specs())
    target = P.Target(family, H200_SMS, aot=True)
    for head_dim in proxy.HEAD_DIMS:
        calls = list(_bench_calls(head_dim)) + [(op, args, kwargs) for name, op, args, kwargs in
                                                attention_calls(torch.bfloat16, head_dim) if "-none-" in name]
        for op, args, kwargs in calls:
            missing = [s.key for s in _planned(op, args, kwargs, target) if s not in shipped]
            assert not missing, (family, head_dim, op, missing)


def test_the_proxy_set_follows_the_tables():
    """Derived from the tables: each family's forward config at each head dim is in the set (a
    changed table changes the set), and both families are carried by the compute_80 image."""
    assert proxy.proxy_families() == ("sm80", "sm86")
    keys = {s.key for s in proxy.specs()}
    for family in proxy.proxy_families():
        for head_dim in proxy.HEAD_DIMS:
            config = configs.pick("fwd", head_dim, family)
            assert S.attention_spec("attn_fwd_kernel", "bf16", head_dim, config, family).key in keys
    assert all(s.dtype == "bf16" for s in proxy.specs())


def test_image_facts_flag_what_ampere_cannot_run():
    ampere = ".version 8.7\n.target sm_80\n mma.sync.aligned.m16n8k16 cp.async.ca.shared.global"
    assert proxy.image_facts(ampere) == {"target": "sm_80", "mma_sync": True, "cp_async": True, "later": []}
    hopper = ".target sm_90a\n wgmma.mma_async.sync.aligned setmaxnreg.inc"
    facts = proxy.image_facts(hopper)
    assert facts["target"] == "sm_90a" and facts["later"] == ["wgmma", "setmaxnreg"] and not facts["mma_sync"]


def test_built_proxy_images_are_sm80_ptx_with_mma_sync(tmp_path):
    """Two proxy images compiled here (the sm86 d64 forward and its preprocess: ~10 s) and read
    back by :func:`proxy.verify`: compute_80 PTX, ``.target sm_80``, mma.sync in the forward, no
    wgmma/TMA, HMMA in its SASS for sm_80 and sm_90; every other image of the set is reported missing."""
    pytest.importorskip("triton")
    from flash_attn.kernel_build import build

    sm86 = {x.key for x in S.attention_specs("sm86", "bf16", (64,), with_features=False)}
    # the lean forward (not its exact-call image) and the preprocess
    wanted = [next(s for s in proxy.specs() if s.block_d == 64 and s.kernel == kernel and s.key in sm86
                   and dict(s.flags).get("IS_LOCAL", True))
              for kernel in ("attn_fwd_kernel", "attn_bwd_preprocess_kernel")]
    build.build(tmp_path, proxy.ARCH, jobs=1, quiet=True, specs=lambda cap: wanted)
    summary, problems = proxy.verify(tmp_path, sass=True)
    # assembled as the H200 runs it (sm_90) and as A100 users do (sm_80): mma.sync's HMMA, no wgmma
    (forward,) = [k for k in summary["assembled"] if k.startswith("attn_fwd_kernel")]
    for arch in ("sm_80", "sm_90"):
        assert summary["assembled"][forward][arch]["sass_mma"] == ["HMMA"]
        assert 0 < summary["assembled"][forward][arch]["reg"] <= 255
    assert summary["images"] == 2 and summary["families"] == ["sm80", "sm86"]
    assert summary["kernels"]["attn_fwd_kernel"]["mma.sync"] == 1
    assert all(p.endswith("is missing (rebuild: the tables changed since)") for p in problems), problems
    missing = {p.split(": ")[1].split(" is missing")[0] for p in problems}
    assert missing == {s.key for s in proxy.specs()} - {w.key for w in wanted}
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {e["arch"] for e in manifest["kernels"]} == {"compute_80"}


def _h200(monkeypatch, manifest):
    monkeypatch.setattr(aot, "manifest", lambda: (manifest, ""))
    monkeypatch.setattr(aot, "driver_release", lambda: (13, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=None: types.SimpleNamespace(multi_processor_count=H200_SMS))


def _manifest(*arches):
    kernels = [{"arch": a, "key": "k", "image": f"images/{a}/k", "name": "k", "signature": ["i32"], "num_warps": 4,
                "shared": 0} for a in arches]
    return Manifest(Path("/nowhere"), {"format": 1, "kernels": kernels})


@pytest.mark.parametrize("family", ["sm80", "sm86"])
def test_the_aot_backend_plans_the_forced_family_on_an_h200(monkeypatch, family):
    _h200(monkeypatch, _manifest("sm_90a", "compute_80"))
    assert aot._make_device_images(0).target.family == "sm90"  # without the variable: Hopper's own
    monkeypatch.setenv(forced.FORCE_ENV, family)
    images = aot._make_device_images(0)
    assert (images.arch, images.target.family, images.target.aot) == ("compute_80", family, True)


def test_the_aot_backend_refuses_a_forced_family_without_images(monkeypatch):
    _h200(monkeypatch, _manifest("sm_90a"))
    monkeypatch.setenv(forced.FORCE_ENV, "sm86")
    refusal = aot._make_device_images(0)
    assert isinstance(refusal, P.Refusal) and refusal.by == P.IMAGES
    assert "no installed image carries the sm86 configs" in refusal.reason
