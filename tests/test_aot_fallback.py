"""The ``aot`` backend fails over instead of crashing when the driver cannot run its images.

Simulated here (no GPU): the driver's version as the op library reads it
(``_aot_library.cuda_info``), and the answers of image registration and loading, raised exactly
as the op library raises them (``flash_attn::<op>: <what>: <CUDA error name>: <CUDA's text>``).
What these stand-ins cannot show: that a real driver answers with these errors in these cases
(CUDA's documented behaviour; the GPU runner loads the real images).

* images built by a newer CUDA than the driver supports are never picked (cubins: the ptxas
  release's major; PTX: its ISA version), and the reason names the driver;
* a load the driver refuses (unsupported PTX, no image for the GPU, an invalid image, an old
  driver) refuses the call before anything runs, the dispatcher runs it elsewhere with one
  warning naming the driver's answer and the backend that ran it, and later calls on that device
  are refused at once (no retry per call).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from flash_attn import aot_images, dispatch
from flash_attn.backends import aot
from flash_attn.kernels import plan as P
from flash_attn.params import AttentionParams


def _manifest(entries: list[dict]) -> aot.Manifest:
    return aot.Manifest("/nonexistent", {"kernels": entries})


def _entry(arch: str, ptxas: str = "13.0", ptx_isa: str = "9.0", key: str = "k") -> dict:
    return {"arch": arch, "key": key, "ptxas": ptxas, "ptx_isa": ptx_isa}


@pytest.mark.parametrize("isa,release", [("8.0", (12, 0)), ("8.4", (12, 4)), ("8.7", (12, 8)), ("8.8", (12, 9)),
                                         ("9.0", (13, 0)), ("9.1", (13, 1)), ("9.4", (13, 4))])
def test_ptx_isa_to_cuda_release(isa, release):
    assert aot.ptx_isa_release(*map(int, isa.split("."))) == release


def test_cubins_need_the_driver_major_of_their_ptxas():
    m = _manifest([_entry("sm_90a", ptxas="13.0"), _entry("sm_80", ptxas="13.0"), _entry("compute_80", ptx_isa="9.0")])
    assert m.image_for((9, 0), driver=(13, 0)).arch.name == "sm_90a"
    assert m.image_for((9, 0), driver=(13, 2)).arch.name == "sm_90a"  # minor-version compatible
    refused = m.image_for((9, 0), driver=(12, 8))
    assert not refused.supported
    assert "newer NVIDIA driver" in refused.reason and "CUDA 12.8" in refused.reason and "13.0" in refused.reason
    assert m.image_for((9, 0), driver=None).arch.name == "sm_90a"  # unknown driver: no filter


def test_ptx_needs_a_driver_that_knows_its_isa():
    m = _manifest([_entry("compute_80", ptx_isa="8.7")])
    assert m.image_for((12, 1), driver=(12, 8)).kind == "ptx"
    assert not m.image_for((12, 1), driver=(12, 4)).supported
    # an older build's cubin still runs where the newer one cannot
    m = _manifest([_entry("sm_80", ptxas="12.9"), _entry("sm_90a", ptxas="13.0")])
    assert m.image_for((9, 0), driver=(12, 9)).supported is False
    assert m.image_for((8, 6), driver=(12, 9)).arch.name == "sm_80"


def test_unavailable_reason_names_the_old_driver(monkeypatch):
    monkeypatch.setattr(aot._aot_library, "status", lambda: aot._aot_library.LibraryStatus(True, "lib", ""))
    monkeypatch.setattr(aot, "manifest", lambda: (_manifest([_entry("sm_90a", ptxas="13.0")]), ""))
    monkeypatch.setattr(aot._aot_library, "cuda_info", lambda: {"runtime_version": 13000, "driver_version": 12040,
                                                                 "device_count": 1, "error": ""})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reason = aot.unavailable_reason(torch.device("cuda", 0))
    assert reason and "newer NVIDIA driver" in reason and "CUDA 12.4" in reason


# --- a load the driver refuses --------------------------------------------------------------------

# What the op library raises (csrc/launcher_cuda.cpp: "cannot load <kernel> on <device>: <name>: <text>")
DRIVER_ANSWERS = {
    "unsupported PTX": "cudaErrorUnsupportedPtxVersion: the provided PTX was compiled with an unsupported toolchain.",
    "no image for the GPU": "cudaErrorNoKernelImageForDevice: no kernel image is available for execution on the device",
    "invalid image": "cudaErrorInvalidKernelImage: device kernel image is invalid",
    "old driver": "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
}


@pytest.fixture
def fake_gpu(monkeypatch):
    """An H100 as the ``aot`` backend sees it, for CPU tensors: a synthesised sm_90a manifest
    (every shipped specialisation, signatures per the declarations), image registration recorded,
    the chain ``aot`` -> ``reference``."""
    from synthetic_images import synthetic_manifest

    images = aot._DeviceImages(synthetic_manifest(), "sm_90a", P.Target("sm90", 132, aot=True))
    monkeypatch.setattr(aot, "_device_images", lambda device: images)
    monkeypatch.setattr(aot._aot_library, "register_kernel", lambda image, entry: 0)
    monkeypatch.setattr(aot, "_registered", {})
    monkeypatch.setattr(aot, "_loaded", set())
    launched = []
    monkeypatch.setattr(aot, "_launch_op", lambda: lambda *args: launched.append(args))
    monkeypatch.setattr(dispatch, "chain", lambda device: ("aot", "reference"))
    monkeypatch.setattr(dispatch, "_warned", set())
    return images, launched


def _call():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 33, 4, 64, generator=g).half() for _ in range(3))
    params = AttentionParams(0.125, -1, 0)
    return dispatch.run("forward", q.device, q, k, v, params), (q, k, v, params)


@pytest.mark.parametrize("answer", list(DRIVER_ANSWERS))
def test_a_refused_load_fails_over_once(fake_gpu, monkeypatch, answer):
    images, launched = fake_gpu
    loads = []

    def refuse(kid, device):
        loads.append(kid)
        raise RuntimeError(f"flash_attn::aot_kernel_attributes: cannot load kernel 'attn_fwd_kernel' "
                           f"(images/sm_90a/x.cubin) on device 0 (NVIDIA H100 80GB HBM3, sm_90): {DRIVER_ANSWERS[answer]}")

    monkeypatch.setattr(aot, "_load", refuse)
    with pytest.warns(UserWarning) as caught:
        (out, lse, _), (q, k, v, params) = _call()
    assert launched == []  # nothing ran on the refused images
    message = str(caught[0].message)
    assert "aot" in message and DRIVER_ANSWERS[answer].split(":")[0] in message and "reference backend" in message
    from flash_attn.backends import reference

    want, want_lse, _ = reference.forward(q, k, v, params)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # later calls, other shapes too, are refused at once: no second load, no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call()
        g = torch.Generator().manual_seed(1)
        q2 = torch.randn(1, 9, 4, 128, generator=g).half()
        dispatch.run("forward", q2.device, q2, q2, q2, params)
    assert len(loads) == 1 and images.broken


def test_an_image_that_fails_to_register_fails_over(fake_gpu, monkeypatch):
    images, launched = fake_gpu

    def invalid(image, entry):
        raise RuntimeError(f"flash_attn::aot_register_kernel: image '{image}' cannot be read: Error -3 while "
                           f"decompressing data: invalid stored block lengths")

    monkeypatch.setattr(aot._aot_library, "register_kernel", invalid)
    with pytest.warns(UserWarning, match="cannot be read"):
        _call()
    assert launched == []


def test_the_images_run_when_the_driver_loads_them(fake_gpu, monkeypatch):
    images, launched = fake_gpu
    monkeypatch.setattr(aot, "_load", lambda kid, device: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        _call()
    assert len(launched) == 1 and images.broken is None


def test_selection_prefers_a_loadable_image_over_none():
    archs = ["sm_80", "sm_90a", "compute_80"]
    assert aot_images.select_image((9, 0), archs).arch.name == "sm_90a"
    assert aot_images.select_image((9, 0), ["sm_80", "compute_80"]).kind == "ptx"
