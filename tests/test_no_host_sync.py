"""No call of the public API reads a tensor value on the host on the GPU kernel paths.

Reading a CUDA tensor on the host (``.item()``, ``.tolist()``, ``bool()``, a copy to the CPU)
waits for the device and breaks CUDA-graph capture ("operation not permitted when stream is
capturing"). Checked here without a GPU: every public function runs with **meta tensors**, which
have shapes, strides and data pointers but no values (any host read raises), through the real
code of the ``aot`` and ``triton`` paths:

* the public wrappers (validation, defaults) and the body of each ``flash_attn::*`` custom op,
  called directly as in eager calls (for meta tensors the op would run its fake implementation);
* the dispatcher, the backend, the planner and the plan's execution (preparations, buffers,
  the dropout seed drawn on the device);
* the launches: ``aot`` through the op library's real ``aot_launch`` (its meta kernel checks
  every argument and launches nothing), ``triton`` through a recorder standing in for Triton's
  launcher (what it cannot show: Triton's own launch code, which reads no tensor value either).

Calls go to the backend under test only: a refusal (a fallback to the reference backend, which
may read values) fails the test.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn import dispatch, ops
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


@pytest.fixture
def only(monkeypatch):
    def use(name: str):
        monkeypatch.setattr(dispatch, "chain", lambda device: (name,))
    return use


@pytest.fixture
def aot_on_meta(monkeypatch, only):
    """The ``aot`` backend as it runs on an H100 (sm_90a images of this installation)."""
    status = aot.op_library.status()
    if not status.loaded:
        pytest.skip(status.reason)
    manifest, why = aot_manifest.manifest()
    if manifest is None:
        pytest.skip(why)
    choice = manifest.image_for((9, 0))
    if not choice.supported:
        pytest.skip(choice.reason)
    images = aot._DeviceImages(manifest, choice.arch.name,
                               P.Target(configs.arch_family(archs.config_capability((9, 0), choice)), 132, aot=True))
    monkeypatch.setattr(aot, "_device_images", lambda device: images)
    launched = []
    real = aot._launch_op()
    monkeypatch.setattr(aot, "_launch_op", lambda: lambda kid, grid, *a: (real(kid, grid, *a), launched.append(kid)))
    only("aot")
    return launched


@pytest.fixture
def triton_on_meta(monkeypatch, only):
    """The ``triton`` backend's plans for an H100, with Triton's launcher replaced by a recorder."""
    launched = []
    monkeypatch.setattr(triton_backend._backend, "target", lambda device: P.Target("sm90", 132))
    monkeypatch.setattr(triton_backend._backend, "run_launch", lambda launch, tensors, device: launched.append(
        (launch.kernel, [tensors[v] for _, v in launch.args if isinstance(v, P.Slot)])))
    monkeypatch.setattr(triton_backend._backend, "plans", type(triton_backend._backend.plans)())
    only("triton")
    return launched


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
# dispatcher runs them on triton (whose path the triton test below checks). seqused_k is addressed
# as a paged varlen forward, which no image compiles.
NOT_SHIPPED = {"_flash_attn_varlen_forward seqused_k": "paged K/V in the varlen forward"}


@pytest.mark.parametrize("name,call", ALL_CALLS, ids=[name for name, _ in ALL_CALLS])
def test_aot_path_reads_nothing_on_the_host(custom_op_bodies, aot_on_meta, name, call):
    if name in NOT_SHIPPED:
        with pytest.raises(RuntimeError, match=NOT_SHIPPED[name]):  # only aot in the chain here
            call()
        assert not aot_on_meta, f"{name}: launched although refused"
        return
    result = call()
    assert aot_on_meta, f"{name}: nothing was launched"
    assert all(t.device == META for t in (result if isinstance(result, tuple) else (result,)) if t is not None)


@pytest.mark.parametrize("name,call", ALL_CALLS, ids=[name for name, _ in ALL_CALLS])
def test_triton_path_reads_nothing_on_the_host(custom_op_bodies, triton_on_meta, name, call):
    result = call()
    assert triton_on_meta, f"{name}: nothing was launched"
    assert all(t.device == META for t in (result if isinstance(result, tuple) else (result,)) if t is not None)
    for kernel, tensors in triton_on_meta:
        assert all(t is None or t.device == META for t in tensors), kernel


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
