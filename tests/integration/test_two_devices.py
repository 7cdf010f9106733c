"""Two CUDA devices: a call runs on the device of its tensors, not on the current device.

Forward + backward (``flash_attn_func``) and a KV-cache append + decode (``flash_attn_with_kvcache``)
with every tensor on ``cuda:1``, once with ``cuda:1`` the current device and once with the current
device left at ``cuda:0``; checked against the float64 oracle (the tolerance rule of support/tolerance.py), for the
device of each result, for nothing left on ``cuda:0``, and for ``dispatch.last_backend()`` being the
backend ``--flash-backend`` names (under ``.ci/gpu-check``'s ``FLASH_ATTN_STRICT_BACKEND=1`` a
fallback would raise anyway).

Skipped without two CUDA devices; on a machine with one GPU that skip is expected (the reason
names "a second GPU is absent", which ``--flash-no-skip`` lets pass), without any it is not.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_with_kvcache

from support.gpus import two_devices_skip_reason
from support.inputs import gen, randn
from support.options import backend_name
from support.oracle import attention_ref, kvcache_ref, oracle_pair
from support.tolerance import backward_floor, check_close

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

_SKIP = two_devices_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "-")]

CURRENT = pytest.mark.parametrize("current", [1, 0], ids=["current-cuda1", "current-cuda0"])
DEVICE = "cuda:1"


def _check_backend(what: str) -> None:
    requested = backend_name()
    ran = dispatch.last_backend()
    if requested == "auto":
        assert ran is not None, what
    else:
        assert ran == requested, f"{what} ran on {ran}, not on the requested {requested}"


@CURRENT
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_forward_and_backward_on_the_second_device(current, dtype):
    dev = torch.device(DEVICE)
    g = gen(31)
    b, sq, sk, h, hk, d, scale = 2, 70, 90, 4, 2, 64, 0.11
    q, dout = randn((b, sq, h, d), dtype, g, device=dev), randn((b, sq, h, d), dtype, g, device=dev)
    k, v = randn((b, sk, hk, d), dtype, g, device=dev), randn((b, sk, hk, d), dtype, g, device=dev)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.cuda.device(current):
        torch.cuda.synchronize(0)
        on_first = torch.cuda.memory_allocated(0)
        out = flash_attn_func(*leaves, softmax_scale=scale, causal=True)
        _check_backend("the forward")
        out.backward(dout)
        _check_backend("the backward")
        torch.cuda.synchronize(dev)
        assert torch.cuda.current_device() == current
        assert torch.cuda.memory_allocated(0) == on_first, "the call left tensors on cuda:0"
    assert out.device == dev and all(t.grad.device == dev for t in leaves)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, softmax_scale=scale, causal=True)
    check_close(out, ref.out, naive.out, dtype, "out")
    floor = backward_floor(q, k, v, dout, scale, ref.probs)
    for leaf, want, approx, name in zip(leaves, rg, ng, ("dq", "dk", "dv")):
        check_close(leaf.grad, want, approx, dtype, name, grad=True, floor=floor)


@CURRENT
def test_kvcache_on_the_second_device(current):
    dev = torch.device(DEVICE)
    g = gen(32)
    b, h, hk, d, cap, new, scale = 3, 8, 2, 128, 96, 2, 0.09
    q = randn((b, new, h, d), BF16, g, device=dev)
    k_cache, v_cache = randn((b, cap, hk, d), BF16, g, device=dev), randn((b, cap, hk, d), BF16, g, device=dev)
    k_new, v_new = randn((b, new, hk, d), BF16, g, device=dev), randn((b, new, hk, d), BF16, g, device=dev)
    seqlens = torch.tensor([0, 37, cap - new], dtype=torch.int32, device=dev)
    oracle = dict(cache_seqlens=seqlens, softmax_scale=scale, causal=True)
    expected = kvcache_ref(q, k_cache, v_cache, k_new, v_new, **oracle)
    naive = kvcache_ref(q, k_cache, v_cache, k_new, v_new, **oracle, compute_dtype=None)
    with torch.cuda.device(current):
        torch.cuda.synchronize(0)
        on_first = torch.cuda.memory_allocated(0)
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                           softmax_scale=scale, causal=True, return_softmax_lse=True)
        _check_backend("the kvcache call")
        torch.cuda.synchronize(dev)
        assert torch.cuda.current_device() == current
        assert torch.cuda.memory_allocated(0) == on_first, "the call left tensors on cuda:0"
    assert out.device == dev and lse.device == dev
    check_close(out, expected.out, naive.out, BF16, "out")
    check_close(lse, expected.lse, naive.lse, FP32, "lse")
    check_close(k_cache, expected.k_cache, expected.k_cache, BF16, "k_cache (appended in place)")
    check_close(v_cache, expected.v_cache, expected.v_cache, BF16, "v_cache (appended in place)")
