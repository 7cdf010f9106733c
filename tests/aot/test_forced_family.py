"""``FLASH_ATTN_FORCE_FAMILY`` (:mod:`flash_attn.aot.forced`): which installed image and whose
launch configs a device runs when the family is forced (the H200 proxy of the mma.sync families),
and the refusals, on manifests that name architectures only (no image is read or launched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flash_attn.aot import forced
from flash_attn.aot.manifest import Manifest

H200 = (9, 0)


def _manifest(*arches: str) -> Manifest:
    kernels = [{"arch": a, "key": "k", "image": f"images/{a}/k", "name": "k", "signature": ["i32"], "num_warps": 4,
                "shared": 0} for a in arches]
    return Manifest(Path("/nowhere"), {"format": 1, "kernels": kernels})


DEFAULT_BUILD = _manifest("sm_80", "sm_90a", "compute_80")


def test_without_the_variable_the_device_runs_its_own_image_and_family():
    choice, family = forced.choose(DEFAULT_BUILD, H200, None, None)
    assert (choice.arch.name, family) == ("sm_90a", "sm90")
    choice, family = forced.choose(DEFAULT_BUILD, (8, 6), None, None)
    assert (choice.arch.name, family) == ("sm_80", "sm86")


@pytest.mark.parametrize("family", ["sm80", "sm86"])
def test_forced_mma_sync_family_runs_the_portable_ptx_on_hopper(family):
    choice, chosen = forced.choose(DEFAULT_BUILD, H200, None, family)
    assert (choice.kind, choice.arch.name, chosen) == ("ptx", "compute_80", family)
    # the proxy's own folder holds the PTX only
    choice, chosen = forced.choose(_manifest("compute_80"), H200, None, family)
    assert (choice.arch.name, chosen) == ("compute_80", family)


def test_forced_sm86_on_an_a100_runs_the_sm80_cubin_with_the_consumer_tables():
    choice, chosen = forced.choose(DEFAULT_BUILD, (8, 0), None, "sm86")
    assert (choice.kind, choice.arch.name, chosen) == ("cubin", "sm_80", "sm86")


def test_refused_without_an_image_that_carries_the_family():
    why = forced.choose(_manifest("sm_90a"), H200, None, "sm80")
    assert isinstance(why, str)
    assert "no installed image carries the sm80 configs" in why and "sm_90a (sm90)" in why
    assert "prepare-proxy" in why


def test_refused_when_the_driver_cannot_compile_the_ptx():
    m = Manifest(Path("/nowhere"), {"format": 1, "kernels": [
        {"arch": "compute_80", "key": "k", "image": "i", "name": "k", "signature": ["i32"], "num_warps": 4,
         "shared": 0, "ptx_isa": "9.0"}]})
    why = forced.choose(m, H200, (12, 4), "sm80")
    assert isinstance(why, str) and "newer NVIDIA driver" in why
    assert forced.choose(m, H200, (13, 0), "sm80")[1] == "sm80"


def test_refused_where_the_tiles_need_more_shared_memory_than_the_gpu_has():
    why = forced.choose(DEFAULT_BUILD, (8, 6), None, "sm80")
    assert isinstance(why, str) and "163 KB" in why and "99 KB" in why


@pytest.mark.parametrize("name", ["sm75", "cdna3", "SM80"])
def test_refused_names(name):
    why = forced.choose(DEFAULT_BUILD, H200, None, name)
    assert isinstance(why, str) and "is no NVIDIA GPU family with images" in why and "sm86" in why


def test_the_variable(monkeypatch):
    monkeypatch.delenv(forced.FORCE_ENV, raising=False)
    assert forced.forced_family() is None
    monkeypatch.setenv(forced.FORCE_ENV, " sm86 ")
    assert forced.forced_family() == "sm86"
    monkeypatch.setenv(forced.FORCE_ENV, "")
    assert forced.forced_family() is None
