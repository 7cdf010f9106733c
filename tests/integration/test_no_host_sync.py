"""No call of the public API reads a tensor value on the host on a CUDA path, fallbacks included.

Reading a CUDA tensor on the host (``.item()``, ``.tolist()``, ``bool()``, a copy to the CPU)
waits for the device and breaks CUDA-graph capture ("operation not permitted when stream is
capturing"). Checked here without a GPU: every public function runs with **meta tensors**, which
have shapes, strides and data pointers but no values (any host read raises), through the real
code of the default chain (``FLASH_ATTN_BACKEND=auto``: ``aot`` -> ``triton`` -> ``reference``),
with the meta device standing in for an H100 (``dispatch.GPU_DEVICE_TYPES``):

* the public wrappers (validation, defaults) and the body of each ``flash_attn::*`` custom op,
  called directly as in eager calls (for meta tensors the op would run its fake implementation);
* the dispatcher, the backends, the planner and the plan's execution (preparations, buffers,
  the dropout seed drawn on the device);
* the launches: ``aot`` through the op library's real ``aot_launch`` (its meta kernel checks
  every argument and launches nothing), ``triton`` through a recorder standing in for Triton's
  launcher (what it cannot show: Triton's own launch code, which reads no tensor value either).

Every call is made as if during CUDA-graph capture (``dispatch._capturing``; what the stand-in
cannot show: ``torch.cuda.is_current_stream_capturing()`` itself). A call the kernels take must
run on them; a call they all refuse (fp32, the paged varlen backward, a grid too large, a GPU no
kernel backend runs on, Triton failing on first use) would run on the reference backend, which
reads values: it must raise :class:`~flash_attn.dispatch.GraphCaptureError` naming why, before
any work (a host read before it would raise another error on meta tensors).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from flash_attn import custom_ops as ops, dispatch, validation
from flash_attn.aot import manifest as aot_manifest, archs
from flash_attn.backends import aot, triton as triton_backend
from flash_attn.planning import configs, plan as P

META = torch.device("meta")


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device=META)


@pytest.fixture
def custom_op_bodies(monkeypatch):
    """The public functions call the custom ops' Python bodies (what the CUDA dispatch runs, and
    what an eager call runs directly), for meta tensors too."""
    monkeypatch.setattr(ops, "eager_call", lambda tensors: False)
    monkeypatch.delenv("FLASH_ATTN_DEBUG", raising=False)


def _images_for_h100():
    """The installed sm_90a images as the ``aot`` backend uses them on an H100 (or why not here)."""
    status = aot.op_library.status()
    if not status.loaded:
        pytest.skip(status.reason)
    manifest, why = aot_manifest.manifest()
    if manifest is None:
        pytest.skip(why)
    choice = manifest.image_for((9, 0))
    if not choice.supported:
        pytest.skip(choice.reason)
    return aot._DeviceImages(manifest, choice.arch.name,
                             P.Target(configs.arch_family(archs.config_capability((9, 0), choice)), 132, aot=True))


@pytest.fixture
def gpu_on_meta(monkeypatch, custom_op_bodies):
    """The default chain on an H100 for meta tensors, every call made during capture. Returns the
    launches by backend (``{"aot": [kernel ids], "triton": [(kernel, tensors)]}``)."""
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "auto")
    monkeypatch.setattr(dispatch, "GPU_DEVICE_TYPES", ("cuda", "meta"))
    monkeypatch.setattr(dispatch, "_capturing", lambda device: True)
    monkeypatch.setattr(dispatch, "_chains", {})
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_failed", {})
    launched = {"aot": [], "triton": []}
    images = _images_for_h100()
    monkeypatch.setattr(aot.BACKEND, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(aot, "_device_images", lambda device: images)
    real = aot._launch

    def launch(launches, *call):
        launched["aot"].extend(p.kernel for p in launches.packed)
        return real(launches, *call)

    monkeypatch.setattr(aot, "_launch", launch)
    monkeypatch.setattr(triton_backend.BACKEND, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(triton_backend._backend, "target", lambda device: P.Target("sm90", 132))
    monkeypatch.setattr(triton_backend._backend, "run_launch", lambda launch, tensors, device: launched[
        "triton"].append((launch.kernel, [tensors[v] for _, v in launch.args if isinstance(v, P.Slot)])))
    monkeypatch.setattr(triton_backend._backend, "plans", type(triton_backend._backend.plans)())
    with warnings.catch_warnings(record=True) as notes:  # the refusals' warnings, for failure messages
        warnings.simplefilter("always")
        launched["notes"] = notes
        yield launched


def public_calls():
    """``(name, call)``: every public function, with the features that take their own paths."""
    b, s, h, hk, d = 2, 200, 8, 2, 128
    q, k, v = meta(b, s, h, d), meta(b, s, hk, d), meta(b, s, hk, d)
    cu = meta(b + 1, dtype=torch.int32)
    packed_q, packed_k = meta(2 * s, h, d), meta(2 * s, hk, d)
    slopes = meta(h, dtype=torch.float32)
    from flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                            flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                            flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

    yield "func", lambda: flash_attn_func(q, k, v, causal=True)
    yield "func features", lambda: flash_attn_func(q, k, v, dropout_p=0.1, softcap=30.0, alibi_slopes=slopes,
                                                   window_size=(64, 0))
    yield "qkvpacked", lambda: flash_attn_qkvpacked_func(meta(b, s, 3, h, d), causal=True)
    yield "kvpacked", lambda: flash_attn_kvpacked_func(q, meta(b, s, 2, hk, d))
    yield "varlen", lambda: flash_attn_varlen_func(packed_q, packed_k, packed_k, cu, cu, s, s, causal=True)
    yield "varlen features", lambda: flash_attn_varlen_func(packed_q, packed_k, packed_k, cu, cu, s, s,
                                                            dropout_p=0.2, alibi_slopes=slopes)
    yield "varlen qkvpacked", lambda: flash_attn_varlen_qkvpacked_func(meta(2 * s, 3, h, d), cu, s)
    yield "varlen kvpacked", lambda: flash_attn_varlen_kvpacked_func(packed_q, meta(2 * s, 2, hk, d), cu, cu, s, s)
    # packed sequences as transformers passes them: max_seqlen a 0-d tensor on the device
    from flash_attn.integrations.transformers import _varlen_with_int_lengths

    scalar = meta(dtype=torch.int64)
    yield "varlen 0-d max_seqlen", lambda: flash_attn_varlen_func(packed_q, packed_k, packed_k, cu, cu, scalar, scalar,
                                                                  causal=True)
    yield "transformers varlen", lambda: _varlen_with_int_lengths(packed_q, packed_k, packed_k, cu, cu, scalar, scalar,
                                                                  causal=True)
    cache = lambda n=64: (meta(b, 1024, hk, d), meta(b, 1024, hk, d))  # noqa: E731
    seqlens = meta(b, dtype=torch.int32)
    yield "kvcache decode", lambda: flash_attn_with_kvcache(meta(b, 1, h, d), *cache(), meta(b, 1, hk, d),
                                                            meta(b, 1, hk, d), cache_seqlens=seqlens, causal=True)
    yield "kvcache rotary leftpad alibi", lambda: flash_attn_with_kvcache(
        meta(b, 4, h, d), *cache(), meta(b, 4, hk, d), meta(b, 4, hk, d), rotary_cos=meta(1024, 32, dtype=torch.float32),
        rotary_sin=meta(1024, 32, dtype=torch.float32), cache_seqlens=seqlens, cache_leftpad=meta(b, dtype=torch.int32),
        alibi_slopes=slopes, causal=True, softcap=20.0, num_splits=4)
    yield "kvcache paged", lambda: flash_attn_with_kvcache(
        meta(b, 1, h, d), meta(64, 16, hk, d), meta(64, 16, hk, d), cache_seqlens=seqlens,
        block_table=meta(b, 32, dtype=torch.int32))
    yield "kvcache int seqlens batch_idx", lambda: flash_attn_with_kvcache(
        meta(b, 1, h, d), meta(b + 2, 1024, hk, d), meta(b + 2, 1024, hk, d), cache_seqlens=300,
        cache_batch_idx=meta(b, dtype=torch.int32))


def backward_calls():
    """The backward op body (what autograd runs) on the forward's outputs."""
    b, s, h, hk, d = 2, 200, 8, 2, 128
    q, k, v = meta(b, s, h, d), meta(b, s, hk, d), meta(b, s, hk, d)
    lse, seed = meta(b, h, s, dtype=torch.float32), meta(1, dtype=torch.int64)
    slopes = meta(h, dtype=torch.float32)
    body = ops._backward_body
    yield "backward", lambda: body(q, q, k, v, q, lse, None, None, None, None, s, s, 0.1, -1, 0, 0.0, 0.0, seed, False)
    yield "backward features", lambda: body(q, q, k, v, q, lse, None, None, None, slopes, s, s, 0.1, 64, 0, 30.0,
                                            0.1, seed, False)
    cu = meta(b + 1, dtype=torch.int32)
    pq, pk = meta(2 * s, h, d), meta(2 * s, hk, d)
    yield "varlen backward", lambda: body(pq, pq, pk, pk, pq, meta(h, 2 * s, dtype=torch.float32), cu, cu, None,
                                          None, s, s, 0.1, -1, 0, 0.0, 0.0, seed, True)


def lowlevel_calls():
    """Upstream's low-level functions (the custom ops' bodies, ``._init_fn``), forward and backward,
    as context-parallel code calls them; the rng_state they hand on stays on the device."""
    from flash_attn.flash_attn_interface import (_flash_attn_backward, _flash_attn_forward,
                                                 _flash_attn_varlen_backward, _flash_attn_varlen_forward)

    b, s, h, hk, d = 2, 200, 8, 2, 128
    q, k, v = meta(b, s, h, d), meta(b, s, hk, d), meta(b, s, hk, d)
    lse, seed = meta(b, h, s, dtype=torch.float32), meta(1, dtype=torch.int64)
    cu, lens = meta(b + 1, dtype=torch.int32), meta(b, dtype=torch.int32)
    pq, pk = meta(2 * s, h, d), meta(2 * s, hk, d)
    plse = meta(h, 2 * s, dtype=torch.float32)
    yield "_flash_attn_forward", lambda: _flash_attn_forward._init_fn(q, k, v, 0.1, 0.1, True, -1, -1, 0.0, None,
                                                                      False)
    yield "_flash_attn_varlen_forward seqused_k", lambda: _flash_attn_varlen_forward._init_fn(
        pq, pk, pk, cu, cu, s, s, 0.0, 0.1, True, seqused_k=lens)
    yield "_flash_attn_backward", lambda: _flash_attn_backward._init_fn(
        q, q, k, v, q, lse, meta(b, s, h, d), None, None, 0.1, 0.1, True, -1, -1, 0.0, None, False, seed)
    yield "_flash_attn_varlen_backward", lambda: _flash_attn_varlen_backward._init_fn(
        pq, pq, pk, pk, pq, plse, None, None, None, cu, cu, s, s, 0.0, 0.1, True, -1, -1, 0.0, None, False)


ALL_CALLS = [*public_calls(), *backward_calls(), *lowlevel_calls()]


# Calls the shipped images do not serve: the aot backend refuses them before anything runs and the
# dispatcher runs them on triton. seqused_k is addressed as a paged varlen forward, which no image compiles.
NOT_SHIPPED = {"_flash_attn_varlen_forward seqused_k": "paged K/V in the varlen forward"}


def _results(result) -> tuple:
    return tuple(t for t in (result if isinstance(result, tuple) else (result,)) if t is not None)


def _ran_on_kernels(name: str, result, launched: dict, want: str) -> None:
    ran = dispatch.last_backend()
    assert ran == want, f"{name}: ran on {ran}, not {want}: {[str(w.message) for w in launched['notes']]}"
    assert launched[ran], f"{name}: nothing was launched"
    assert all(t.device == META for t in _results(result))
    for kernel, tensors in launched["triton"]:
        assert all(t is None or t.device == META for t in tensors), kernel


@pytest.mark.parametrize("name,call", ALL_CALLS, ids=[name for name, _ in ALL_CALLS])
def test_the_default_chain_reads_nothing_on_the_host(gpu_on_meta, name, call):
    result = call()
    # Where the installed images lag the kernel sources (rebuild them), aot refuses what they lack.
    _ran_on_kernels(name, result, gpu_on_meta, "triton" if name in NOT_SHIPPED else "aot")


def refused_calls():
    """``(name, call, where)``: calls a kernel backend refuses, one per reason; ``where`` is the
    backend that still takes it, or the reason in the :class:`GraphCaptureError` when none does."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    b, s, h, hk, d = 2, 200, 8, 2, 128
    f32 = lambda *shape: meta(*shape, dtype=torch.float32)  # noqa: E731
    cu = meta(b + 1, dtype=torch.int32)
    pq, pk = meta(2 * s, h, d), meta(2 * s, hk, d)
    seed = meta(1, dtype=torch.int64)
    body = ops._backward_body
    fp32 = "torch.float32 inputs"
    yield "fp32", lambda: flash_attn_func(f32(b, s, h, d), f32(b, s, hk, d), f32(b, s, hk, d)), fp32
    yield "fp32 varlen", lambda: flash_attn_varlen_func(f32(2 * s, h, d), f32(2 * s, hk, d), f32(2 * s, hk, d), cu,
                                                        cu, s, s), fp32
    yield "fp32 backward", lambda: body(f32(b, s, h, d), f32(b, s, h, d), f32(b, s, hk, d), f32(b, s, hk, d),
                                        f32(b, s, h, d), f32(b, h, s), None, None, None, None, s, s, 0.1, -1, 0, 0.0,
                                        0.0, seed, False), fp32
    pages = meta(64, 16, hk, d)
    yield "paged varlen backward", lambda: body(pq, pq, pages, pages, pq, meta(h, 2 * s, dtype=torch.float32), cu, cu,
                                                meta(b, 32, dtype=torch.int32), None, s, s, 0.1, -1, 0, 0.0, 0.0, seed,
                                                False), "the backward of paged K/V"
    many = 65536  # heads on the grid's second axis, which CUDA caps at 65535
    yield "grid too large", lambda: flash_attn_func(meta(1, 16, many, 8), meta(1, 16, 1, 8), meta(1, 16, 1, 8)), \
        "programs on grid axis 1"
    # refused by aot only: triton takes them
    yield "fp32 kvcache", lambda: flash_attn_with_kvcache(f32(b, 1, h, d), f32(b, 1024, hk, d), f32(b, 1024, hk, d),
                                                         cache_seqlens=meta(b, dtype=torch.int32)), "triton"
    yield "head dim 60", lambda: flash_attn_func(meta(b, s, h, 60), meta(b, s, hk, 60), meta(b, s, hk, 60)), "triton"
    yield "return_attn_probs", lambda: flash_attn_func(meta(b, s, h, d), meta(b, s, hk, d), meta(b, s, hk, d),
                                                       return_attn_probs=True), "triton"
    yield "paged varlen forward", lambda: flash_attn_varlen_func(pq, pages, pages, cu, cu, s, s,
                                                                 block_table=meta(b, 32, dtype=torch.int32)), "triton"
    wide = meta(b, 1024, hk, d + 4)[..., :d]  # rows 132 elements apart: not the images' layout
    yield "kv cache layout", lambda: flash_attn_with_kvcache(meta(b, 1, h, d), wide, wide,
                                                             cache_seqlens=meta(b, dtype=torch.int32)), "triton"
    long = 1 << 22  # a batch stride of 2^32 elements: past the images' int32 arguments
    yield "int32 overflow", lambda: flash_attn_func(meta(2, long, 8, d), meta(2, long, 8, d), meta(2, long, 8, d)), \
        "triton"


REFUSED = list(refused_calls())


@pytest.mark.parametrize("name,call,where", REFUSED, ids=[name for name, _, _ in REFUSED])
def test_a_refused_call_reads_nothing_on_the_host(gpu_on_meta, name, call, where):
    if where in ("aot", "triton"):
        _ran_on_kernels(name, call(), gpu_on_meta, where)
        return
    with pytest.raises(dispatch.GraphCaptureError, match=where):
        call()
    assert not gpu_on_meta["aot"] and not gpu_on_meta["triton"]


@pytest.mark.parametrize("why", ["compute capability 7.5 is below the kernels' minimum 8.0",
                                 "AMD GPU gfx90a is in no GPU family of the kernels"])
@pytest.mark.parametrize("name,call", ALL_CALLS, ids=[name for name, _ in ALL_CALLS])
def test_a_gpu_no_kernel_backend_runs_on_raises_under_capture(gpu_on_meta, monkeypatch, name, call, why):
    monkeypatch.setattr(aot.BACKEND, "unavailable_reason", lambda device: "no shipped image runs on compute capability 7.5")
    monkeypatch.setattr(triton_backend.BACKEND, "unavailable_reason", lambda device: why)
    with pytest.raises(dispatch.GraphCaptureError, match="no GPU kernel backend can run on meta") as raised:
        call()
    assert why in str(raised.value)


def test_a_triton_failure_under_capture_raises_naming_it(gpu_on_meta, monkeypatch):
    """aot refuses (head dim 60), Triton fails on its first run: the reference is not tried."""
    from flash_attn import flash_attn_func

    def jit_error(launch, tensors, device):
        raise RuntimeError("PTXASError: ptxas fatal: Unresolved extern function")

    monkeypatch.setattr(triton_backend._backend, "run_launch", jit_error)
    with pytest.raises(dispatch.GraphCaptureError, match="aot backend refused it: head dimension 60.*triton backend "
                                                         "failed: .*ptxas fatal"):
        flash_attn_func(meta(2, 64, 4, 60), meta(2, 64, 4, 60), meta(2, 64, 4, 60))


def test_max_seqlen_as_a_device_scalar_is_bounded_not_read():
    """transformers passes max_seqlen as a 0-d tensor for packed sequences: on a GPU it is bounded
    from the shapes (no sync), unless it sizes an output (return_attn_probs)."""
    q, k = meta(300, 4, 64), meta(500, 2, 64)
    scalar = meta(dtype=torch.int64)
    assert validation.varlen_max_seqlens(q, k, None, scalar, scalar) == (300, 500)
    pages = meta(64, 16, 2, 64)
    assert validation.varlen_max_seqlens(q, pages, meta(2, 8, dtype=torch.int32), 7, scalar) == (7, 8 * 16)
    with pytest.raises((RuntimeError, NotImplementedError)):  # exact: read (meta tensors refuse)
        validation.varlen_max_seqlens(q, k, None, scalar, scalar, exact=True)
    cpu = torch.tensor(120)
    assert validation.varlen_max_seqlens(q, k, None, cpu, cpu) == (120, 120)  # a CPU value costs nothing to read


def test_a_bound_gives_the_exact_results(monkeypatch):
    """What the bound relies on: the kernels take each sequence's length from cu_seqlens, so a
    larger max_seqlen only adds programs that return at once (Triton's interpreter, CPU tensors)."""
    from flash_attn import flash_attn_varlen_func
    from flash_attn.backends import interpret

    if interpret.unavailable_reason(torch.device("cpu")):
        pytest.skip(interpret.unavailable_reason(torch.device("cpu")))
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "interpret")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, 2, 16, generator=g).half() for _ in range(3))
    cu = torch.tensor([0, 7, 25, 40], dtype=torch.int32)
    exact = flash_attn_varlen_func(q, k, v, cu, cu, 18, 18, causal=True)
    bounded = flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True)
    assert torch.equal(exact, bounded)


def test_meta_tensors_do_refuse_host_reads():
    """What the two tests above rely on."""
    t = meta(3, dtype=torch.int32)
    for read in (lambda: t.tolist(), lambda: t.max().item(), lambda: bool(t[0]), lambda: t.cpu()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


def test_value_checks_run_for_cpu_tensors_and_in_debug_mode(monkeypatch):
    """The checks of argument values stay where they cost nothing (CPU tensors) and come back
    for GPU tensors with FLASH_ATTN_DEBUG=1."""
    cpu = torch.zeros(1)
    assert ops._checks_values(cpu)
    monkeypatch.delenv("FLASH_ATTN_DEBUG", raising=False)
    assert not ops._checks_values(meta(1))
    monkeypatch.setenv("FLASH_ATTN_DEBUG", "1")
    assert ops._checks_values(meta(1))
    from flash_attn import flash_attn_varlen_func

    q = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_attn_varlen_func(q, q, q, torch.tensor([0, 7, 5], dtype=torch.int32),
                               torch.tensor([0, 5, 10], dtype=torch.int32), 7, 5)
