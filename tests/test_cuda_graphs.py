"""The GPU kernel backends inside CUDA graphs: capture, replay, compare with eager calls.

How vLLM, SGLang and ``generate`` with static caches decode: the whole step is captured once in
``torch.cuda.graph`` and replayed with new values in the same tensors. That needs calls that read
nothing on the host, allocate only through PyTorch (the graph's pool) and create no state a
replay would miss. Checked for each GPU kernel backend (``aot``, ``triton``): a forward, a training
step (forward + backward through autograd) and a KV-cache decode step, replayed after changing
the inputs in place, against the same calls made eagerly; and dropout, where every replay draws a
new mask from the device's generator (read back from the replayed ``rng_state``) that the
reference backend reproduces. GPU only (skipped here).
"""

from __future__ import annotations

import pytest
import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_with_kvcache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = ["aot", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    reason = dispatch.unavailable_reason(request.param, torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", request.param)
    return request.param


def capture(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a graph, after warm-up calls on a side stream (what PyTorch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def rand_(t: torch.Tensor) -> torch.Tensor:
    """New values in place (the graph keeps the tensor's address)."""
    return t.copy_(torch.randn(t.shape, device=t.device, dtype=torch.float32))


def test_forward_replays_like_eager(backend):
    q, k, v = (torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    static = {}

    def step():
        static["out"] = flash_attn_func(q, k, v, causal=True)

    graph = capture(step)
    for _ in range(3):
        for t in (q, k, v):
            rand_(t)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static["out"], flash_attn_func(q, k, v, causal=True))


def test_training_step_replays_like_eager(backend):
    q, k, v = (torch.randn(2, 200, 8, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 200, 8, 64, device="cuda", dtype=torch.float16)
    slopes = torch.rand(8, device="cuda")

    def step():
        for t in (q, k, v):
            t.grad = None
        flash_attn_func(q, k, v, causal=True, softcap=20.0, alibi_slopes=slopes).backward(dout)

    graph = capture(step)
    # the gradients the graph writes: an eager step() below rebinds .grad to new tensors
    graph_grads = [t.grad for t in (q, k, v)]
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, dout):
                rand_(t)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [g.clone() for g in graph_grads]
        step()
        for got, want in zip(replayed, (q.grad, k.grad, v.grad)):
            assert torch.equal(got, want)


def test_decode_step_replays_like_eager(backend):
    b, h, hk, d, capacity = 4, 16, 4, 128, 1024
    k_cache, v_cache = (torch.randn(b, capacity, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([10, 300, 700, 1000], dtype=torch.int32, device="cuda")
    cos, sin = (torch.randn(capacity, d // 2, device="cuda") for _ in range(2))
    static = {}

    def step():
        static["out"] = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                                cache_seqlens=seqlens, causal=True)

    graph = capture(step)
    for lengths in ([11, 301, 701, 1001], [0, 5, 1000, 17]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        for t in (q, k_new, v_new):
            rand_(t)
        saved = (k_cache.clone(), v_cache.clone())
        graph.replay()
        torch.cuda.synchronize()
        replayed = (static["out"].clone(), k_cache.clone(), v_cache.clone())
        k_cache.copy_(saved[0])
        v_cache.copy_(saved[1])
        eager = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                        cache_seqlens=seqlens, causal=True)
        assert torch.equal(replayed[0], eager)
        assert torch.equal(replayed[1], k_cache) and torch.equal(replayed[2], v_cache)


def test_dropout_draws_a_new_mask_per_replay(backend):
    """The seed comes from the device's generator inside the graph: each replay a new one, and
    the output is exactly the attention with that seed's mask (the reference backend's)."""
    from flash_attn.backends import reference
    from flash_attn.ops import attention_forward
    from flash_attn.params import AttentionParams

    q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    static = {}

    def step():
        static["out"], static["lse"], _, static["rng_state"] = attention_forward(
            q, k, v, None, None, None, None, 128, 128, 0.125, -1, 0, 0.0, 0.3, False, False)

    graph = capture(step)
    seeds, outs = [], []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        seeds.append(static["rng_state"].clone())
        outs.append(static["out"].clone())
        params = AttentionParams(0.125, -1, 0, 0.0, 0.3, seeds[-1])
        want, _, _ = reference.forward(q.float(), k.float(), v.float(), params)
        torch.testing.assert_close(outs[-1].float(), want, atol=2e-3, rtol=2e-3)
    assert len({int(s.item()) for s in seeds}) == 3
    assert not torch.equal(outs[0], outs[1])
