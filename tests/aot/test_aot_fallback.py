"""The ``aot`` backend fails over instead of crashing when the driver cannot run its images.

Simulated here (no GPU): the driver's version as the op library reads it
(``op_library.cuda_info``), and the answers of image registration and loading, raised exactly
as the op library raises them (``flash_attn::<op>: <what>: <CUDA error name>: <CUDA's text>``).
What these stand-ins cannot show: that a real driver answers with these errors in these cases
(CUDA's documented behaviour; the GPU runner loads the real images).

* images built by a newer CUDA than the driver supports are never picked (cubins: the ptxas
  release's major; PTX: its ISA version), and the reason names the driver;
* a load the driver refuses (unsupported PTX, no image for the GPU, an invalid image, an old
  driver) refuses the call before anything runs, the dispatcher runs it elsewhere with one
  warning naming the driver's answer and the backend that ran it; that image is never tried
  again, while shapes whose images loaded keep running on ``aot``;
* a refusal that may pass (out of memory, a load during CUDA-graph capture) refuses that call
  only: the next call of the shape loads the image again;
* a manifest that is valid JSON but malformed never raises from a call: the whole file (not an
  object, no ``kernels`` list, no usable entry) makes ``aot`` unavailable with the reason, a
  malformed entry is left out and the calls it would serve run elsewhere.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from flash_attn import dispatch
from flash_attn.aot import archs, manifest as aot_manifest
from flash_attn.backends import aot
from flash_attn.params import AttentionParams
from flash_attn.planning import plan as P
from support.aot_buffers import made_buffers


def _manifest(entries: list[dict]) -> aot_manifest.Manifest:
    return aot_manifest.Manifest("/nonexistent", {"kernels": entries})


def _entry(arch: str, ptxas: str = "13.0", ptx_isa: str = "9.0", key: str = "k") -> dict:
    """A well-formed entry (every field the schema requires; the image itself is never read here)."""
    return {"arch": arch, "key": key, "ptxas": ptxas, "ptx_isa": ptx_isa, "name": key, "image": f"images/{key}",
            "signature": ["*fp16:16", "i32"], "num_warps": 4, "shared": 0}


@pytest.mark.parametrize("isa,release", [("8.0", (12, 0)), ("8.4", (12, 4)), ("8.7", (12, 8)), ("8.8", (12, 9)),
                                         ("9.0", (13, 0)), ("9.1", (13, 1)), ("9.4", (13, 4))])
def test_ptx_isa_to_cuda_release(isa, release):
    assert aot_manifest.ptx_isa_release(*map(int, isa.split("."))) == release


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
    monkeypatch.setattr(aot.op_library, "status", lambda: aot.op_library.LibraryStatus(True, "lib", ""))
    monkeypatch.setattr(aot, "manifest", lambda: (_manifest([_entry("sm_90a", ptxas="13.0")]), ""))
    monkeypatch.setattr(aot.op_library, "cuda_info", lambda: {"runtime_version": 13000, "driver_version": 12040,
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
    from support.synthetic_images import synthetic_manifest

    images = aot._DeviceImages(synthetic_manifest(), "sm_90a", P.Target("sm90", 132, aot=True))
    monkeypatch.setattr(aot, "_device_images", lambda device: images)
    monkeypatch.setattr(aot.op_library, "register_kernel", lambda image, entry: 0)
    monkeypatch.setattr(aot, "_registered", {})
    monkeypatch.setattr(aot, "_loaded", set())
    launched = []
    monkeypatch.setattr(aot, "_launch", lambda launches, *call: launched.extend(launches.packed) or made_buffers(
        launches, *call))
    monkeypatch.setattr(dispatch, "chain", lambda device: ("aot", "reference"))
    monkeypatch.setattr(dispatch, "_warned", set())
    return images, launched


def _call():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 33, 4, 64, generator=g).half() for _ in range(3))
    params = AttentionParams(0.125, -1, 0)
    return dispatch.run("forward", q.device, q, k, v, params), (q, k, v, params)


def _call_d128():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 4, 128, generator=g).half()
    return dispatch.run("forward", q.device, q, q, q, AttentionParams(0.125, -1, 0))


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
    # the refused image is not tried again; another shape tries its own image once, and the same
    # answer is not warned about again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call()
        _call_d128()
        _call_d128()
    assert len(loads) == 2 and len(images.failed) == 2 and launched == []
    assert all(r.by == P.DRIVER and not r.retry for r in images.failed.values())


def test_a_refused_image_leaves_the_shapes_that_ran_on_aot(fake_gpu, monkeypatch):
    """One image the driver refuses disables that image, not the backend (it used to turn ``aot``
    off for the process, also for shapes that had run)."""
    images, launched = fake_gpu
    refused = {}

    def load(kid, device):
        if kid in refused:
            raise RuntimeError(f"flash_attn::aot_kernel_attributes: cannot load kernel: "
                               f"{DRIVER_ANSWERS['invalid image']}")

    kernel_ids = iter(range(100))
    monkeypatch.setattr(aot.op_library, "register_kernel", lambda image, entry: next(kernel_ids))
    monkeypatch.setattr(aot, "_load", load)
    _call()  # loads its image: kernel 0
    assert len(launched) == 1
    refused[1] = True  # the next image registered (another shape's) is refused
    with pytest.warns(UserWarning, match="cudaErrorInvalidKernelImage"):
        _call_d128()
    assert len(launched) == 1 and list(images.failed.values())
    _call()  # the shape that ran still runs on its image
    assert len(launched) == 2


@pytest.mark.parametrize("answer", [
    "cudaErrorMemoryAllocation: out of memory",
    "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
])
def test_a_transient_refusal_is_tried_again(fake_gpu, monkeypatch, answer):
    """Out of memory (PyTorch's allocator holding the rest) or a first load during capture: this call
    runs elsewhere, the next one loads the image and runs on ``aot``."""
    images, launched = fake_gpu
    answers = [RuntimeError(f"flash_attn::aot_kernel_attributes: cannot load kernel on device 0: {answer}")]

    def load(kid, device):
        if answers:
            raise answers.pop()

    monkeypatch.setattr(aot, "_load", load)
    with pytest.warns(UserWarning, match="tried again"):
        _call()
    assert launched == [] and not images.failed and len(images.plans) == 0  # the refusal is not kept
    _call()
    assert len(launched) == 1


def test_an_image_that_fails_to_register_fails_over(fake_gpu, monkeypatch):
    images, launched = fake_gpu

    def invalid(image, entry):
        raise RuntimeError(f"flash_attn::aot_register_kernel: image '{image}' cannot be read: Error -3 while "
                           f"decompressing data: invalid stored block lengths")

    monkeypatch.setattr(aot.op_library, "register_kernel", invalid)
    with pytest.warns(UserWarning, match="cannot be read"):
        _call()
    assert launched == []


def test_missing_image_files_are_one_warning_for_the_installation(fake_gpu, monkeypatch, tmp_path):
    """Every kernel's image file is gone: one warning, naming the installation once and the doctor
    (which lists them), not one ~400-character warning per kernel with its path twice."""
    images, launched = fake_gpu

    def missing(image, entry):
        return aot.op_library.read_image(tmp_path / "gone" / entry["image"])

    monkeypatch.setattr(aot.op_library, "register_kernel", missing)
    with pytest.warns(UserWarning) as caught:
        _call()
        _call_d128()
    ours = [str(w.message) for w in caught if "flash_attn" in str(w.message)]
    assert len(ours) == 1, ours
    assert "missing or damaged" in ours[0] and "doctor" in ours[0] and "reinstall" in ours[0]
    assert ours[0].count(str(tmp_path)) == 1 and launched == []
    assert len(images.failed) == 2


def test_the_images_run_when_the_driver_loads_them(fake_gpu, monkeypatch):
    images, launched = fake_gpu
    monkeypatch.setattr(aot, "_load", lambda kid, device: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        _call()
    assert len(launched) == 1 and not images.failed


def test_selection_prefers_a_loadable_image_over_none():
    shipped = ["sm_80", "sm_90a", "compute_80"]
    assert archs.select_image((9, 0), shipped).arch.name == "sm_90a"
    assert archs.select_image((9, 0), ["sm_80", "compute_80"]).kind == "ptx"


# --- a manifest that is valid JSON but malformed ----------------------------------------------------


def _write(tmp_path, monkeypatch, data) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    monkeypatch.setenv(aot_manifest.DIR_ENV, str(tmp_path))


@pytest.fixture
def h100(monkeypatch):
    """What ``aot.unavailable_reason`` asks about the machine, as on an H100 with a CUDA 13 driver
    (the op library loaded, a device of capability 9.0); the manifest is whatever a test writes."""
    monkeypatch.setattr(aot.op_library, "status", lambda: aot.op_library.LibraryStatus(True, "lib", ""))
    monkeypatch.setattr(aot.op_library, "cuda_info", lambda: {"runtime_version": 13000, "driver_version": 13000,
                                                                 "device_count": 1, "error": ""})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(aot_manifest, "_manifest_cache", {})
    monkeypatch.setattr(dispatch, "_chains", {})
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "auto")
    return torch.device("cuda", 0)


UNUSABLE = {  # the whole file: the reason aot is unavailable
    "a top-level list": ([_entry("sm_90a")], "must be a JSON object, got list"),
    "no kernels": ({"format": 1}, "'kernels' must be a list"),
    "a newer format": ({"format": 99, "kernels": [_entry("sm_90a")]}, "format 99"),
    "no entry with a key": ({"kernels": [{k: v for k, v in _entry("sm_90a").items() if k != "key"}]}, "no 'key'"),
}


@pytest.mark.parametrize("case", list(UNUSABLE))
def test_an_unusable_manifest_makes_aot_unavailable_with_the_reason(h100, tmp_path, monkeypatch, case):
    data, why = UNUSABLE[case]
    _write(tmp_path, monkeypatch, data)
    reason = aot.unavailable_reason(h100)
    assert reason and why in reason and str(tmp_path) in reason
    monkeypatch.setattr(dispatch, "unavailable_reason",
                        lambda name, device: None if name == "triton" else aot.unavailable_reason(device))
    with pytest.warns(UserWarning, match="cannot run on cuda:0"):
        assert dispatch.chain(h100) == ("triton", "reference")  # no exception in the call


BAD_ENTRIES = {  # one entry: left out, with the reason
    "ptxas a number": ({"ptxas": 13}, "'ptxas' must be a version string"),
    "an unreadable arch": ({"arch": "sm_9x"}, "cannot read GPU architecture 'sm_9x'"),
    "no signature": ({"signature": None}, "no 'signature'"),
    "no name": ({"name": None}, "no 'name'"),
    "no num_warps": ({"num_warps": None}, "no 'num_warps'"),
    "num_warps a string": ({"num_warps": "4"}, "'num_warps' must be a non-empty int"),
}


def _changed(entry: dict, changes: dict) -> dict:
    entry = {**entry, **changes}
    return {k: v for k, v in entry.items() if v is not None}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_a_malformed_entry_is_left_out(h100, tmp_path, monkeypatch, case):
    changes, why = BAD_ENTRIES[case]
    _write(tmp_path, monkeypatch, {"kernels": [_changed(_entry("sm_90a", key="bad"), changes),
                                               _entry("sm_90a", key="good")]})
    assert aot.unavailable_reason(h100) is None  # the other entry serves
    m, _ = aot_manifest.manifest()
    assert list(m.entries) == [("sm_90a", "good")]
    assert len(m.problems) == 1 and why in m.problems[0] and "bad" in m.problems[0]


@pytest.mark.parametrize("case", ["no signature", "no name", "no num_warps", "ptxas a number"])
def test_a_call_that_needs_a_malformed_entry_runs_elsewhere(fake_gpu, monkeypatch, case):
    """(These raised KeyError from the backend, outside its ``except RuntimeError``.)"""
    from support.synthetic_images import synthetic_manifest

    images, launched = fake_gpu
    good = synthetic_manifest()
    data = {"kernels": [_changed(e, BAD_ENTRIES[case][0]) if e["kernel"] == "attn_fwd_kernel" else e
                        for e in good.entries.values()]}
    images.manifest = aot_manifest.Manifest("/nonexistent", data)
    monkeypatch.setattr(aot, "_load", lambda kid, device: None)
    with pytest.warns(UserWarning, match="malformed"):
        (out, lse, _), (q, k, v, params) = _call()
    assert launched == []
