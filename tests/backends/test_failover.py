"""Fail-over of the dispatcher (:mod:`flash_attn.dispatch`): a backend that fails on first use, a
downgrade from the shipped kernels, ``FLASH_ATTN_STRICT_BACKEND`` and ``last_backend()``.

Simulated without a GPU: the ``triton`` backend plans for an H100 and runs its plans on CPU
tensors, with Triton's JIT-and-launch call replaced by each test's stand-in. The stand-ins plant
each failure through Triton's own code where it runs on a CPU: its C-launcher build
(``triton.runtime.build._build``: no compiler, a compiler that fails), its cache manager
(``TRITON_CACHE_DIR`` on a read-only file system) and its compiler (``triton.compile`` of a kernel
that does not compile). What they cannot show: that these are the first things a real first launch
on a GPU does (Triton's launcher builds ``driver.c`` and compiles before it launches), and a failure
in Triton's GPU-side steps (ptxas, loading the module), which arrive as the same kinds of error.
The ``aot`` cases are in ``tests/aot/test_aot_fallback.py``; capture in ``tests/integration/test_no_host_sync.py``.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

from flash_attn import dispatch, flash_attn_func
from flash_attn.aot import manifest as aot_manifest
from flash_attn.backends import aot, reference, triton as triton_backend
from flash_attn.backends._execute import PlanCache
from flash_attn.params import AttentionParams
from flash_attn.planning import plan as P

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _broken(X):
    tl.store(X, undefined_name)  # noqa: F821  (the compile error the test plants)


@pytest.fixture(autouse=True)
def _fresh_dispatcher(monkeypatch):
    monkeypatch.setattr(dispatch, "_chains", {})
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_failed", {})
    monkeypatch.delenv(dispatch.STRICT_ENV, raising=False)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """``FLASH_ATTN_BACKEND=triton`` with the triton backend able to run (its plans for an H100,
    CPU tensors); ``use(stand_in)`` sets what each launch does. Returns ``(use, launches)``."""
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "triton")
    monkeypatch.setattr(triton_backend.BACKEND, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(triton_backend._backend, "target", lambda device: P.Target("sm90", 132))
    monkeypatch.setattr(triton_backend._backend, "plans", PlanCache())
    launches = []

    def use(stand_in):
        def run_launch(launch, tensors, device):
            launches.append(launch.kernel)
            stand_in()
        monkeypatch.setattr(triton_backend._backend, "run_launch", run_launch)

    return use, launches


def _qkv(seqlen=33, head_dim=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, seqlen, 4, head_dim, generator=g).to(dtype) for _ in range(3))


def _ours(caught) -> list[str]:
    """flash_attn's warnings among those caught (Triton warns about its own settings too)."""
    return [str(w.message) for w in caught if str(w.message).startswith("flash_attn:")]


def _exact(q, k, v):
    """What the reference backend computes for ``flash_attn_func(q, k, v)``."""
    out, _, _ = reference.forward(q, k, v, AttentionParams(q.shape[-1] ** -0.5, -1, -1))
    return out


# --- Triton's failures on first use ------------------------------------------------------------


def _no_c_compiler(monkeypatch, tmp_path):
    from triton.runtime import build

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    build._find_compiler.cache_clear()
    return lambda: build._build("cuda_utils", str(tmp_path / "driver.c"), str(tmp_path), [], [], [], [])


def _failing_c_compiler(monkeypatch, tmp_path):
    from triton.runtime import build

    (tmp_path / "driver.c").write_text("#include <Python.h>\n")
    monkeypatch.setenv("CC", "false")  # a compiler that fails, as gcc does without Python's headers
    build._find_compiler.cache_clear()
    return lambda: build._build("cuda_utils", str(tmp_path / "driver.c"), str(tmp_path), [], [], [], [])


def _read_only_cache(monkeypatch, tmp_path):
    from triton.runtime import cache

    if not Path("/sys").is_dir():
        pytest.skip("no /sys here (Linux: no folder can be made in it, not even by root)")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/sys/flash_attn_test_cache")
    return lambda: cache.get_cache_manager("0" * 64)


def _cache_through_a_file(monkeypatch, tmp_path):
    """A cache path with a file where a folder must be: ENOTDIR."""
    from triton.runtime import cache

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    return lambda: cache.get_cache_manager("0" * 64)


def _cache_through_a_dangling_link(monkeypatch, tmp_path):
    """A cache path through a link to nowhere: ENOENT."""
    from triton.runtime import cache

    (tmp_path / "gone").symlink_to(tmp_path / "nowhere" / "at-all")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "gone" / "cache"))
    return lambda: cache.get_cache_manager("0" * 64)


MACHINE_FAILURES = {  # what the warning must name: the cause, and the fix
    "no C compiler": (_no_c_compiler, "C compiler", "CC"),
    "a C compiler that fails": (_failing_c_compiler, "C compiler", "Python's headers"),
    "a read-only cache": (_read_only_cache, "cache directory", "TRITON_CACHE_DIR"),
    "a cache path through a file": (_cache_through_a_file, "cache directory", "TRITON_CACHE_DIR"),
    "a cache path through a dangling link": (_cache_through_a_dangling_link, "cache directory", "TRITON_CACHE_DIR"),
}


@pytest.fixture
def _forget_compiler():
    yield
    from triton.runtime import build

    build._find_compiler.cache_clear()  # the stand-ins changed what it finds


@pytest.mark.parametrize("case", list(MACHINE_FAILURES))
def test_a_machine_triton_cannot_use_falls_to_reference_once(triton_on_cpu, monkeypatch, tmp_path, _forget_compiler,
                                                             case):
    plant, cause, fix = MACHINE_FAILURES[case]
    use, launches = triton_on_cpu
    use(plant(monkeypatch, tmp_path))
    q, k, v = _qkv()
    with pytest.warns(UserWarning) as caught:
        out = flash_attn_func(q, k, v)
    assert torch.equal(out, _exact(q, k, v))
    assert len(_ours(caught)) == 1
    message = _ours(caught)[0]
    assert "triton backend failed on first use" in message and cause in message and fix in message
    assert "reference backend" in message and dispatch.last_backend() == "reference"
    # the machine will not change: later calls, other shapes too, go straight to the reference
    tried = len(launches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_func(*_qkv(seqlen=17, head_dim=32))
    assert len(launches) == tried


def _kernel_that_does_not_compile():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton.compile(ASTSource(_broken, {"X": "*fp32"}), target=GPUTarget("cuda", 90, 32))


def test_a_kernel_that_does_not_compile_moves_its_shape_only(triton_on_cpu, monkeypatch):
    use, launches = triton_on_cpu
    use(_kernel_that_does_not_compile)
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match="cannot compile this call's kernels .*undefined_name") as caught:
        out = flash_attn_func(q, k, v)
    assert torch.equal(out, _exact(q, k, v)) and len(_ours(caught)) == 1
    assert "doctor" in _ours(caught)[0]  # the fix
    tried = len(launches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_func(q, k, v)  # this shape is not compiled again, nor warned about again
    assert len(launches) == tried
    use(lambda: None)  # another shape's kernels compile
    flash_attn_func(*_qkv(seqlen=17, head_dim=32))
    assert len(launches) > tried and dispatch.last_backend() == "triton"


def test_a_ptxas_that_cannot_assemble_the_tma_path_gets_the_same_tiles_by_plain_loads(triton_on_cpu, monkeypatch):
    """Triton 3.6's PTX for the d256 forward's tensor descriptors crashes the ptxas of CUDA 12.8 and
    12.9 (`ptxas` failed with error code -11: the 2026-11-30 H200, reproduced here on its PTX).
    The call still runs on triton, strict mode and all: its launch again with TMA off, and later
    plans of that kernel are made without it. The stand-in raises Triton's own PTXASError where a
    launch asks for TMA; it cannot show that the plain-load kernel assembles (CUDA 12.9's ptxas
    assembles Triton 3.6's plain-load d256 forwards here, benchmarks/README.md)."""
    from triton.runtime.errors import PTXASError

    monkeypatch.setenv(dispatch.STRICT_ENV, "1")
    monkeypatch.setattr(triton_backend, "_tma_refused", set())
    asked = []

    def run_launch(launch, tensors, device):
        asked.append(launch.constexprs.get("TMA"))
        if launch.constexprs.get("TMA"):
            raise PTXASError("PTXAS error: `ptxas` failed with error code -11")

    monkeypatch.setattr(triton_backend._backend, "run_launch", run_launch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_func(*_qkv(head_dim=256))
        assert asked == [True, False] and dispatch.last_backend() == "triton"
        flash_attn_func(*_qkv(seqlen=47, head_dim=192))  # another plan of the kernel: planned without TMA
    assert asked == [True, False, False] and triton_backend._tma_refused == {"attn_fwd_kernel"}

    asked.clear()  # a failure of ptxas elsewhere is the plan's, as before
    monkeypatch.setattr(triton_backend, "_tma_refused", set())
    monkeypatch.setattr(triton_backend._backend, "run_launch", lambda *a: asked.append(1) or _raise(PTXASError("-11")))
    with pytest.raises(dispatch.BackendRefusedError, match="cannot compile this call.s kernels"):
        flash_attn_func(*_qkv(seqlen=21, head_dim=64))
    assert asked == [1] and not triton_backend._tma_refused


def _raise(exc):
    raise exc


def test_out_of_memory_is_the_calls_not_tritons(triton_on_cpu):
    """A guard: the next backend would need the memory too, so the error reaches the caller."""
    use, _ = triton_on_cpu

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    use(oom)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        flash_attn_func(*_qkv())


def test_a_backend_whose_check_raises_is_unavailable_with_the_reason(monkeypatch):
    def broken(device):
        raise ValueError("cannot read GPU architecture 'sm_9x'")

    monkeypatch.setattr(triton_backend.BACKEND, "unavailable_reason", broken)
    reason = dispatch.unavailable_reason("triton", torch.device("cuda", 0))
    assert "ValueError" in reason and "sm_9x" in reason


# --- a downgrade from the shipped kernels -----------------------------------------------------


@pytest.fixture
def gpu_with_images(monkeypatch):
    """``auto`` on cuda:0 of a machine whose op library loads and whose Triton can run; ``set_up(
    capability, driver, archs)`` picks the GPU, the driver's CUDA release and the shipped images."""
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "auto")
    monkeypatch.setattr(triton_backend.BACKEND, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(aot.op_library, "status", lambda: aot.op_library.LibraryStatus(True, "lib", ""))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def set_up(capability, driver, archs):
        entries = [{"arch": a, "key": "k", "name": "k", "image": "i", "signature": ["i32"], "num_warps": 4,
                    "shared": 0, "ptxas": "13.0", "ptx_isa": "9.0"} for a in archs]
        monkeypatch.setattr(aot, "manifest", lambda: (aot_manifest.Manifest("/x", {"kernels": entries}), ""))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(aot.op_library, "cuda_info", lambda: {"runtime_version": 13000, "driver_version": driver,
                                                                     "device_count": 1, "error": ""})
        return torch.device("cuda", 0)

    return set_up


@pytest.mark.parametrize("case,capability,driver,why", [
    ("driver too old for the images", (9, 0), 12080, "newer NVIDIA driver"),
    ("no image for the GPU", (12, 1), 13000, "no shipped image runs on compute capability 12.1"),
])
def test_a_downgrade_from_aot_warns_once_with_the_reason(gpu_with_images, case, capability, driver, why):
    device = gpu_with_images(capability, driver, ["sm_80", "sm_90a"])
    with pytest.warns(UserWarning) as caught:
        assert dispatch.chain(device) == ("triton", "reference")
    assert len(_ours(caught)) == 1
    message = _ours(caught)[0]
    assert why in message and "triton backend" in message
    dispatch._chains.clear()  # worked out again (another FLASH_ATTN_BACKEND spelling): no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.chain(device)


def test_no_downgrade_no_warning(gpu_with_images):
    """A guard for the test above: where the images load, ``auto`` says nothing."""
    device = gpu_with_images((9, 0), 13000, ["sm_80", "sm_90a"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.chain(device) == ("aot", "triton", "reference")


# --- FLASH_ATTN_STRICT_BACKEND and last_backend() ------------------------------------------------


def test_strict_mode_turns_a_refusal_into_an_error(triton_on_cpu, monkeypatch):
    use, launches = triton_on_cpu
    use(lambda: None)
    q, k, v = _qkv(dtype=torch.float32)  # the kernels take fp16/bf16
    with pytest.warns(UserWarning, match="cannot run this forward"):
        flash_attn_func(q, k, v)
    assert dispatch.last_backend() == "reference"
    monkeypatch.setenv(dispatch.STRICT_ENV, "1")
    with pytest.raises(dispatch.BackendRefusedError, match=r"FLASH_ATTN_BACKEND=triton\) refused this forward: "
                                                           r"torch.float32 inputs"):
        flash_attn_func(q, k, v)
    flash_attn_func(*_qkv())  # what it serves runs
    assert dispatch.last_backend() == "triton" and launches


def test_strict_mode_turns_a_first_use_failure_into_an_error(triton_on_cpu, monkeypatch, tmp_path, _forget_compiler):
    use, _ = triton_on_cpu
    use(_no_c_compiler(monkeypatch, tmp_path))
    monkeypatch.setenv(dispatch.STRICT_ENV, "1")
    with pytest.raises(dispatch.BackendRefusedError, match="triton backend .* failed on this forward: .*C compiler"):
        flash_attn_func(*_qkv())


def test_strict_mode_holds_aot_to_its_calls(monkeypatch):
    """``FLASH_ATTN_BACKEND=aot``: a call the images do not serve (``return_attn_probs``) raises."""
    from support.synthetic_images import synthetic_manifest

    images = aot._DeviceImages(synthetic_manifest(), "sm_90a", P.Target("sm90", 132, aot=True))
    monkeypatch.setattr(aot, "_device_images", lambda device: images)
    monkeypatch.setattr(dispatch, "chain", lambda device: ("aot", "triton", "reference"))
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "aot")
    monkeypatch.setenv(dispatch.STRICT_ENV, "1")
    q, k, v = _qkv()
    with pytest.raises(dispatch.BackendRefusedError, match=r"aot backend .* refused this forward: return_attn_probs"):
        dispatch.run("forward", q.device, q, k, v, AttentionParams(0.125, -1, -1), return_softmax=True)


def test_strict_mode_has_no_effect_under_auto(monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "auto")
    monkeypatch.setenv(dispatch.STRICT_ENV, "1")
    q, k, v = _qkv(dtype=torch.float32)
    flash_attn_func(q, k, v, return_attn_probs=True)
    assert dispatch.last_backend() == "cpu"  # auto's choice for CPU tensors


def test_a_bad_strict_value_is_refused(monkeypatch):
    monkeypatch.setenv(dispatch.STRICT_ENV, "maybe")
    with pytest.raises(ValueError, match="FLASH_ATTN_STRICT_BACKEND"):
        dispatch.strict()


def test_last_backend_is_per_thread(triton_on_cpu):
    use, _ = triton_on_cpu
    use(lambda: None)
    flash_attn_func(*_qkv())
    assert dispatch.last_backend() == "triton"
    seen = {}

    def other():
        seen["before"] = dispatch.last_backend()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flash_attn_func(*_qkv(dtype=torch.float32))  # refused by triton: the reference runs it
        seen["after"] = dispatch.last_backend()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == {"before": None, "after": "reference"}
    assert dispatch.last_backend() == "triton"
