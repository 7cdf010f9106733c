"""The GPU kernel backends inside CUDA graphs: capture, replay, compare with eager calls.

How vLLM, SGLang and ``generate`` with static caches decode: the whole step is captured once in
``torch.cuda.graph`` and replayed with new values in the same tensors. That needs calls that read
nothing on the host, allocate only through PyTorch (the graph's pool) and create no state a
replay would miss. Checked for each GPU kernel backend (``aot``, ``triton``): a forward, a training
step (forward + backward through autograd) and a KV-cache decode step, replayed after changing
the inputs in place, against the same calls made eagerly; and dropout, where every replay draws a
new mask from the device's generator (read back from the replayed ``rng_state``) that the
reference backend reproduces. Varlen and paged decode steps too, and the same calls under
``torch.compile(mode="reduce-overhead")`` (cudagraph trees), which must really use graphs (no
cudagraph skip). Every test checks that the backend it names ran the calls
(:func:`flash_attn.dispatch.last_backend`). GPU only (skipped here), but for one CPU stand-in at
the end: no tensor made outside a capture is kept and reused inside one.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


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



def assert_same_grads(got, want) -> None:
    """dq, dk, dv of two runs of the same backward: dK/dV bit for bit; dQ up to the order of the
    fused kernel's atomic fp32 additions (deterministic=False, the default), one rounding step of
    the output dtype."""
    dq, dk, dv = got
    torch.testing.assert_close(dq, want[0], rtol=1e-2, atol=1e-3)
    assert torch.equal(dk, want[1]) and torch.equal(dv, want[2])

@gpu
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
        assert dispatch.last_backend() == backend


@gpu
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
        assert dispatch.last_backend() == backend  # of the backward, the step's last call
        assert_same_grads(replayed, (q.grad, k.grad, v.grad))


@gpu
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
        assert dispatch.last_backend() == backend
        assert torch.equal(replayed[0], eager)
        assert torch.equal(replayed[1], k_cache) and torch.equal(replayed[2], v_cache)


@gpu
def test_dropout_draws_a_new_mask_per_replay(backend):
    """The seed comes from the device's generator inside the graph: each replay a new one, and
    the output is exactly the attention with that seed's mask (the reference backend's)."""
    from flash_attn.backends import reference
    from flash_attn.custom_ops import attention_forward
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


# ---------------------------------------------------------------------------------------------
# Varlen and paged decode under torch.cuda.graph


def _varlen_inputs(lengths=(100, 37, 250), h=8, hk=2, d=64, dtype=torch.bfloat16, grad=False):
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(total, h, d, device="cuda", dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(total, hk, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(2))
    return q, k, v, cu, max(lengths)


@gpu
def test_varlen_training_step_replays_like_eager(backend):
    q, k, v, cu, max_len = _varlen_inputs(grad=True)
    dout = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, window_size=(64, 0))
        out.backward(dout)
        return out

    static = {}
    graph = capture(lambda: static.update(out=step()))
    graph_grads = [t.grad for t in (q, k, v)]
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, dout):
                rand_(t)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static["out"].clone()] + [g.clone() for g in graph_grads]
        out = step()
        assert dispatch.last_backend() == backend
        assert torch.equal(replayed[0], out)
        assert_same_grads(replayed[1:], (q.grad, k.grad, v.grad))


def _paged_cache(b=3, page=256, pages_per_seq=3, hk=2, d=128, dtype=torch.float16):
    """A shuffled page pool and its block table (one spare page)."""
    num_blocks = b * pages_per_seq + 1
    k_cache, v_cache = (torch.randn(num_blocks, page, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[: b * pages_per_seq]
    block_table = perm.view(b, pages_per_seq).to(device="cuda", dtype=torch.int32)
    return k_cache, v_cache, block_table


@gpu
def test_paged_decode_step_replays_like_eager(backend):
    k_cache, v_cache, block_table = _paged_cache()
    b, h, d = block_table.shape[0], 8, k_cache.shape[-1]
    q = torch.randn(b, 1, h, d, device="cuda", dtype=k_cache.dtype)
    k_new, v_new = (torch.randn(b, 1, k_cache.shape[2], d, device="cuda", dtype=k_cache.dtype) for _ in range(2))
    seqlens = torch.tensor([5, 300, 700], dtype=torch.int32, device="cuda")
    static = {}

    def step():
        static["out"] = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                block_table=block_table, causal=True)

    graph = capture(step, warmup=1)
    for lengths in ([6, 301, 701], [0, 511, 767]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        for t in (q, k_new, v_new):
            rand_(t)
        saved = (k_cache.clone(), v_cache.clone())
        graph.replay()
        torch.cuda.synchronize()
        replayed = (static["out"].clone(), k_cache.clone(), v_cache.clone())
        k_cache.copy_(saved[0])
        v_cache.copy_(saved[1])
        eager = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                        block_table=block_table, causal=True)
        assert dispatch.last_backend() == backend
        assert torch.equal(replayed[0], eager)
        assert torch.equal(replayed[1], k_cache) and torch.equal(replayed[2], v_cache)


# ---------------------------------------------------------------------------------------------
# torch.compile(mode="reduce-overhead"): cudagraph trees record the calls and replay them


@pytest.fixture
def reduce_overhead():
    """``fn -> compiled fn``; the test fails if inductor skipped cudagraphs for any graph (then
    the calls would run eagerly and prove nothing about graphs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield lambda fn: torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor skipped cudagraphs"
    torch._dynamo.reset()


@gpu
def test_reduce_overhead_training_step_matches_eager(backend, reduce_overhead):
    def block(q, k, v):
        return flash_attn_func(q, k, v, causal=True, softcap=20.0) * 2.0

    compiled = reduce_overhead(block)
    for step in range(4):  # warm-up, recording, then replays
        q, k, v = (torch.randn(2, 200, 8, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        dout = torch.randn(2, 200, 8, 64, device="cuda", dtype=torch.float16)
        out = compiled(q, k, v)
        if step == 0:
            assert dispatch.last_backend() == backend
        grads = torch.autograd.grad(out, (q, k, v), dout)
        want = block(q, k, v)
        assert dispatch.last_backend() == backend
        assert torch.equal(out, want)
        assert_same_grads(grads, torch.autograd.grad(want, (q, k, v), dout))


@gpu
def test_reduce_overhead_varlen_forward_matches_eager(backend, reduce_overhead):
    def block(q, k, v, cu, max_len: int):
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)

    compiled = reduce_overhead(block)
    for step in range(4):
        q, k, v, cu, max_len = _varlen_inputs()
        with torch.no_grad():
            out = compiled(q, k, v, cu, max_len)
            if step == 0:
                assert dispatch.last_backend() == backend
            assert torch.equal(out, block(q, k, v, cu, max_len))
        assert dispatch.last_backend() == backend


@gpu
def test_reduce_overhead_paged_decode_matches_eager(backend, reduce_overhead):
    """A decode step with static caches (their addresses marked static, as ``generate`` does)."""
    k_cache, v_cache, block_table = _paged_cache()
    for cache in (k_cache, v_cache):
        torch._dynamo.mark_static_address(cache)
    b, h, d = block_table.shape[0], 8, k_cache.shape[-1]

    def decode(q, k_new, v_new, seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=block_table, causal=True)

    compiled = reduce_overhead(decode)
    for step, lengths in enumerate(([5, 300, 700], [6, 301, 701], [0, 511, 767], [7, 302, 702])):
        q = torch.randn(b, 1, h, d, device="cuda", dtype=k_cache.dtype)
        k_new, v_new = (torch.randn(b, 1, k_cache.shape[2], d, device="cuda", dtype=k_cache.dtype) for _ in range(2))
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        saved = (k_cache.clone(), v_cache.clone())
        out = compiled(q, k_new, v_new, seqlens).clone()
        if step == 0:
            assert dispatch.last_backend() == backend
        appended = (k_cache.clone(), v_cache.clone())
        k_cache.copy_(saved[0])
        v_cache.copy_(saved[1])
        assert torch.equal(out, decode(q, k_new, v_new, seqlens))
        assert dispatch.last_backend() == backend
        assert torch.equal(appended[0], k_cache) and torch.equal(appended[1], v_cache)


@gpu
def test_reduce_overhead_dropout_draws_new_masks(backend, reduce_overhead):
    """Two identical dropout calls in one recorded graph draw two masks, and every replay new ones.
    The mask is read from the output: v holds one unit vector per key, so out[.., i, h, j] =
    P[i, j] * keep[i, j] / (1 - p), nonzero where kept (every P > 0 without a causal mask)."""
    def twice(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.5), flash_attn_func(q, k, v, dropout_p=0.5)

    compiled = reduce_overhead(twice)
    q, k = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    v = torch.eye(64, device="cuda", dtype=torch.float16).view(1, 64, 1, 64).expand(1, 64, 2, 64).contiguous()
    masks = []
    for step in range(4):
        first, second = (out != 0 for out in compiled(q, k, v))
        if step == 0:
            assert dispatch.last_backend() == backend
        assert 0.4 < first.float().mean().item() < 0.6
        assert (first != second).float().mean().item() > 0.3
        masks.append(first.clone())
    assert all((a != b).float().mean().item() > 0.3 for a, b in zip(masks, masks[1:]))


# ---------------------------------------------------------------------------------------------
# No tensor made outside a capture is kept and used inside it


@gpu
def test_placeholders_made_inside_a_capture_are_new():
    from flash_attn.placeholders import placeholder

    device = torch.device("cuda")
    before = (placeholder(torch.int32, device), placeholder(torch.int64, device, (1,)))
    inside = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside += [placeholder(torch.int32, device), placeholder(torch.int64, device, (1,))]
    for outside, made_inside in zip(before, inside):
        assert made_inside is not outside and made_inside.data_ptr() != outside.data_ptr()


def test_no_placeholder_is_kept_for_a_gpu_stand_in(monkeypatch):
    """CPU stand-in: a "cuda" device whose tensors are CPU tensors, and a capture that is said to
    be in progress (monkeypatched). A placeholder asked for outside the "capture" must not be
    handed out inside it, and none is kept for a device other than the CPU (cudagraph trees also
    allocate warm-up calls, which are no capture, from the graphs' pool). What the stand-in cannot
    show: the CUDA allocator's pools themselves (test_placeholders_made_inside_a_capture_are_new,
    on a GPU, and the reduce-overhead tests do)."""
    from flash_attn import placeholders
    from flash_attn.placeholders import placeholder

    real_empty = torch.empty

    def empty(*size, device=None, **kwargs):  # tensors of the "cuda" stand-in live on the CPU
        return real_empty(*size, **kwargs)

    capturing = {"now": False}
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    monkeypatch.setattr(placeholders, "_kept", {})
    cuda = torch.device("cuda")
    made = {"outside": [], "inside": []}
    for phase in ("outside", "inside"):
        capturing["now"] = phase == "inside"
        made[phase] = [placeholder(torch.int32, cuda), placeholder(torch.int64, cuda, (1,)),
                       placeholder(torch.float32, cuda, (0,))]
    for outside, inside in zip(made["outside"], made["inside"]):
        assert inside is not outside
    assert not placeholders._kept
    # the CPU keeps sharing one (no capture there; it saves an allocation per call)
    cpu = torch.device("cpu")
    assert placeholder(torch.int32, cpu) is placeholder(torch.int32, cpu)
    assert placeholder(torch.int64, cpu, (1,)) is placeholder(torch.int64, cpu, (1,))
