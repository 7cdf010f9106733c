"""``flash_attn_with_kvcache`` writes the new keys and values into the caches in place, and PyTorch
is told so as for its own in-place ops: each cache's version counter moves, so autograd refuses a
backward that would read a value saved from the cache before the write, and caches made under
``torch.inference_mode()`` (which have no counter) work there too. Eager calls go around the
dispatcher (``custom_ops.forward_kvcache`` bumps the counters itself); the op's registration does
it for the others. The ``cpu`` and ``reference`` backends write with PyTorch's own in-place ops,
which move the counters anyway; the ``interpret`` backend writes through the pointers, as the GPU
kernels do: its cases fail without the bump."""

import pytest
import torch

from flash_attn import dispatch, flash_attn_with_kvcache


@pytest.fixture(params=["auto", "cpu", "reference", "interpret"])
def backend(request, monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, request.param)
    return request.param


def _step():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 16, generator=g)
    k_cache, v_cache = torch.randn(2, 12, 2, 16, generator=g), torch.randn(2, 12, 2, 16, generator=g)
    k_new, v_new = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    return q, k_cache, v_cache, k_new, v_new, seqlens


def test_the_append_moves_each_caches_version_counter(backend):
    q, k_cache, v_cache, k_new, v_new, seqlens = _step()
    before = k_cache._version, v_cache._version
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)
    assert k_cache._version > before[0] and v_cache._version > before[1]
    for b, n in enumerate(seqlens.tolist()):  # the rows written are the new ones
        assert torch.equal(k_cache[b, n], k_new[b, 0]) and torch.equal(v_cache[b, n], v_new[b, 0])


def test_autograd_refuses_a_backward_through_a_value_saved_before_the_append(backend):
    q, k_cache, v_cache, k_new, v_new, seqlens = _step()
    w = torch.ones((), requires_grad=True)
    saved = k_cache * w  # saves k_cache for its backward
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_a_call_that_appends_nothing_leaves_the_counters_and_autograd_alone(backend):
    """Without new k/v nothing is written into the caches: their counters stay (a bump would make
    autograd refuse, wrongly, a backward through a value saved from the cache before the call)."""
    q, k_cache, v_cache, _, _, seqlens = _step()
    w = torch.ones((), requires_grad=True)
    saved = k_cache * w
    before = k_cache._version, v_cache._version
    for _ in range(3):  # the first call and the signature's held route
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
        flash_attn_with_kvcache(q, k_cache, v_cache)
    assert (k_cache._version, v_cache._version) == before
    saved.sum().backward()
    assert torch.equal(w.grad, k_cache.sum())


def test_caches_made_in_inference_mode_take_the_append(backend):
    with torch.inference_mode():
        q, k_cache, v_cache, k_new, v_new, seqlens = _step()
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert torch.equal(k_cache[0, 3], k_new[0, 0]) and torch.equal(v_cache[1, 7], v_new[1, 0])
