"""ROCm runs, simulated: no AMD GPU is available to this project.

A ROCm PyTorch with one AMD GPU of each family is simulated (tests/support/rocm.py); the ``triton``
backend finds the device's family and plans the call with that family's tables. Each planned launch
is then

1. compiled for the family's GPU, the way Triton's JIT compiles that launch there
   (:func:`flash_attn.kernel_build.amd.compile_launch`: its argument specialisation and the
   family's compiler options, ``waves_per_eu`` and co.), and its ``amdgcn`` read: the products on
   MFMA (CDNA) or WMMA (RDNA), the LDS within the workgroup's limit;
2. run in Triton's interpreter on CPU tensors, with the same tiles;

and the call's results are compared with the float64 oracle. What this cannot show: the AMD
hardware running the compiled code (its scheduling, its atomics' ordering, its speed). The
interpreter's arithmetic is the same for every target, which is why its results stand for the
kernels' (fp16 here: the interpreter computes bf16 arithmetic on raw bits).
"""

from __future__ import annotations

import re

import pytest
import torch

from flash_attn.backends import interpret
from flash_attn.backends._execute import KernelBackend, launch_kwargs
from flash_attn.params import AttentionParams, KVCacheInputs
from flash_attn.planning import configs, families, registry
from support import oracle, rocm
from support.inputs import gen, randn
from support.options import skip_unless_the_interpreter_runs
from support.tolerance import backward_floor, check_close

F16 = torch.float16


@pytest.fixture
def simulated(monkeypatch):
    """``simulated(family)``: a kernel backend planning for the simulated ROCm device of
    ``family`` (what the ``triton`` backend finds there), whose launches are compiled for the
    device and run in the interpreter; ``.compiled``: ``(kernel, CompiledKernel)`` per launch."""
    skip_unless_the_interpreter_runs()
    from flash_attn.backends import triton as triton_backend
    from flash_attn.kernel_build import amd

    def make(family: str):
        target = rocm.simulate(monkeypatch, rocm.BY_FAMILY[family])._target(torch.device("cuda", 0))
        assert target.family == family
        compiled = []

        def run_launch(launch, tensors, device):
            if 0 not in launch.grid:
                kwargs = {**launch_kwargs(launch, tensors), **configs.compiler_options(launch.config, family)}
                compiled.append((launch.kernel, amd.compile_launch(registry.jit_function(launch.kernel), kwargs,
                                                                   family)))
            interpret.run_launch(launch, tensors, device)

        backend = KernelBackend(f"simulated-{family}", lambda device: target, run_launch)
        backend.compiled = compiled
        return backend

    yield make
    triton_backend._device_target.cache_clear()


def _check_compiled(compiled, family: str) -> None:
    record = families.get(family)
    for kernel, kernel_image in compiled:
        amdgcn = kernel_image.asm["amdgcn"]
        assert kernel_image.metadata.shared <= record.shared_memory, (kernel, kernel_image.metadata.shared)
        if "tt.dot" in kernel_image.asm["ttgir"]:
            assert re.search(rf"\bv_{record.mma}_", amdgcn), f"{kernel}: no {record.mma} instruction on {family}"
        other = "wmma" if record.mma == "mfma" else "mfma"
        assert not re.search(rf"\bv_{other}_", amdgcn), f"{kernel}: {other} instructions on {family}"
        assert int(kernel_image.metadata.warp_size) == record.wave_size


@pytest.mark.parametrize("family", families.of_vendor("amd"))
def test_attention_forward_and_backward_on_a_simulated_amd_gpu(simulated, family):
    """Causal GQA attention, forward and backward (the family's fused backward where its table has
    one, else the split kernels), head dim 64 on CDNA and 128 on RDNA; 150 queries and keys, so
    the family's tiles (up to 128 rows) cross block boundaries."""
    backend = simulated(family)
    d = 64 if family.startswith("cdna") else 128
    g = gen(47)
    q, k, v = randn((2, 150, 4, d), F16, g), randn((2, 150, 2, d), F16, g), randn((2, 150, 2, d), F16, g)
    dout = randn((2, 150, 4, d), F16, g)
    params = AttentionParams(d ** -0.5, -1, 0)
    out, lse, _ = backend.forward(q, k, v, params)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, params)
    kernels = [name for name, _ in backend.compiled]
    fused = configs.fused_backward(d, family) is not None
    assert "attn_fwd_kernel" in kernels and ("attn_bwd_kernel" in kernels) == fused
    assert ("attn_bwd_dkdv_kernel" in kernels) != fused
    _check_compiled(backend.compiled, family)

    ref, ref_grads, naive, naive_grads = oracle.oracle_pair(oracle.attention_ref, (q, k, v), dout,
                                                           softmax_scale=d ** -0.5, causal=True)
    check_close(out, ref.out, naive.out, F16, "out")
    floor = backward_floor(q, k, v, dout, d ** -0.5)
    for name, ours, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, naive_grads):
        check_close(ours, r, n, F16, name, grad=True, floor=floor)


@pytest.mark.parametrize("family", families.of_vendor("amd"))
def test_kv_cache_step_on_a_simulated_amd_gpu(simulated, family):
    """One decoding step with GPT-NeoX rotary into a cache (append, rotary q, split-KV attention,
    combine), head dim 128."""
    backend = simulated(family)
    g = gen(470)
    b, d, capacity = 2, 128, 600
    q = randn((b, 1, 8, d), F16, g)
    k_cache, v_cache = randn((b, capacity, 2, d), F16, g), randn((b, capacity, 2, d), F16, g)
    k_new, v_new = randn((b, 1, 2, d), F16, g), randn((b, 1, 2, d), F16, g)
    angles = torch.rand(capacity, d // 2, generator=g) * 6.28
    cos, sin = angles.cos().to(F16), angles.sin().to(F16)
    seqlens = torch.tensor([517, 33], dtype=torch.int32)
    params = AttentionParams(d ** -0.5, -1, 0)  # causal
    cache = KVCacheInputs(k_cache.clone(), v_cache.clone(), seqlens, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                          rotary_interleaved=False)
    out, lse = backend.forward_kvcache(q, params, cache)
    _check_compiled(backend.compiled, family)
    assert {"append_kv_kernel", "split_kv_kernel"} <= {name for name, _ in backend.compiled}

    ref = oracle.kvcache_ref(q.double(), k_cache.double(), v_cache.double(), k_new.double(), v_new.double(),
                             rotary_cos=cos.double(), rotary_sin=sin.double(), cache_seqlens=seqlens,
                             softmax_scale=d ** -0.5, causal=True, rotary_interleaved=False)
    naive = oracle.kvcache_ref(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                               cache_seqlens=seqlens, softmax_scale=d ** -0.5, causal=True,
                               rotary_interleaved=False, compute_dtype=None)
    check_close(out, ref.out, naive.out, F16, "out")
    check_close(cache.k_cache, ref.k_cache, naive.k_cache, F16, "k_cache")
