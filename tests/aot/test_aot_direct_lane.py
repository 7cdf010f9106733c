"""The ``aot`` backend's direct lane (:meth:`flash_attn.backends.aot._AotBackend.direct_lane`): a
signature's later eager calls pass their own tensors to the op library, picked by position, and get
the buffers it makes back as their results; a call whose pointers are not all aligned leaves the
lane for the known route, which copies what it must.

On the benchmark's stub (:func:`flash_attn.bench.overhead.stubbed_aot`: the installed sm_90a images,
the real op library checking CPU tensors and counting the launches instead of running them): what
is checked is which tensors reach the library and which plan runs, not the kernels' numbers (the
GPU acceptance run computes those against the oracle through the same lane)."""

from __future__ import annotations

import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn.backends import aot
from support.aot_stub import bf16 as _bf16, misaligned as _misaligned, stub  # noqa: F401  (stub: a fixture)


def _lane_ran(op: str) -> bool:
    lanes = next((v for k, v in dispatch._chains.items() if k[-1] == "lanes"), {})
    return any(key[0] == op for key in lanes)


def test_a_forwards_later_calls_pass_their_own_tensors_and_get_the_buffers(stub, monkeypatch):
    calls, counted = stub
    by_slot = []  # the calls run by slot (the known route), not by position
    real_slots = aot.slots
    monkeypatch.setattr(aot, "slots", lambda *a: by_slot.append(1) or real_slots(*a))
    q, k, v = _bf16(2, 40, 4, 64), _bf16(2, 40, 4, 64, seed=1), _bf16(2, 40, 4, 64, seed=2)
    before = counted()
    results = [flash_attn_func(q, k, v, causal=True, return_attn_probs=False) for _ in range(3)]
    assert _lane_ran("forward") and counted() == before + 3 and len(by_slot) == 2  # the third: the direct lane
    known, direct = calls[0], calls[-1]
    assert torch.equal(known[0], direct[0])  # the plan the known route ran
    assert [t is u for t, u in zip(direct[1], (q, k, v))] == [True] * 3  # q, k, v themselves
    out, lse = direct[2]
    assert results[-1] is out and out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    assert results[-1].data_ptr() != results[-2].data_ptr()  # fresh buffers every call


def test_a_training_steps_backward_passes_its_own_tensors_and_gets_the_buffers(stub, monkeypatch):
    """The backward's lane (from the third step) is direct too: dout, q, k, v, out and lse
    themselves to the op library, by position, and dq, dk, dv its buffers."""
    calls, _ = stub
    by_slot = []
    real_slots = aot.slots
    monkeypatch.setattr(aot, "slots", lambda *a: by_slot.append(1) or real_slots(*a))
    q, k, v = (_bf16(1, 40, 4, 64, seed=s).requires_grad_() for s in range(3))
    dout = _bf16(1, 40, 4, 64, seed=3)
    for _ in range(3):
        by_slot.clear()
        out = flash_attn_func(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert _lane_ran("backward") and by_slot == []  # the third step: both on their direct lanes
    plan, passed, made = calls[-1]
    assert [any(p is t for p in passed) for t in (dout, q, k, v)] == [True] * 4
    assert any(p.data_ptr() == out.data_ptr() for p in passed)  # out as saved (a new handle on its memory)
    assert [any(g is m for m in made) for g in grads] == [True] * 3 and [g.shape for g in grads] == [q.shape] * 3


def test_a_packed_steps_later_calls_pass_their_own_tensors_and_row_counts(stub, monkeypatch):
    """A varlen call's plan reads its packed row counts (total q and k rows): its direct lane reads
    them from the call's tensors (their dim 0), passing cu_seqlens and the rest by position; a
    batch of other totals is another signature (the known route, then its own lane). (No held
    lanes here: they would take the later steps, test_aot_held_lanes.py's subject.)"""
    calls, _ = stub
    monkeypatch.setattr(dispatch._load("aot")[0], "held", None)
    rows = []
    real_launch = aot._launch
    monkeypatch.setattr(aot, "_launch", lambda launches, passed, r: rows.append(tuple(r)) or real_launch(
        launches, passed, r))
    by_slot = []
    real_slots = aot.slots
    monkeypatch.setattr(aot, "slots", lambda *a: by_slot.append(1) or real_slots(*a))
    for total_q, total_k in ((50, 70), (33, 41)):
        cu_q = torch.tensor([0, 20, total_q], dtype=torch.int32)
        cu_k = torch.tensor([0, 30, total_k], dtype=torch.int32)
        q = _bf16(total_q, 4, 64).requires_grad_()
        k, v = (_bf16(total_k, 2, 64, seed=s).requires_grad_() for s in (1, 2))
        dout = _bf16(total_q, 4, 64, seed=3)
        for _ in range(3):
            by_slot.clear()
            out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 40, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        assert by_slot == []  # the third step: forward and backward on their direct lanes
        assert rows[-2] == (total_q,) and rows[-1] == (total_q, total_k)  # read from q's and k's dim 0
        forward, backward = calls[-2:]
        assert [any(p is t for p in forward[1]) for t in (q, k, v, cu_q, cu_k)] == [True] * 5
        assert [any(p is t for p in backward[1]) for t in (dout, q, k, v, cu_q, cu_k)] == [True] * 6
        assert forward[2][0] is out and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert [any(g is m for m in backward[2]) for g in grads] == [True] * 3


def test_a_misaligned_call_of_the_same_signature_leaves_the_lane(stub):
    calls, counted = stub
    q, k, v = _bf16(1, 24, 2, 64), _bf16(1, 24, 2, 64, seed=1), _bf16(1, 24, 2, 64, seed=2)
    for _ in range(3):
        flash_attn_func(q, k, v)
    before = counted()
    odd = _misaligned(q)
    flash_attn_func(odd, k, v)  # the lane declines it: the op library would refuse the pointer
    assert counted() == before + 1
    passed = calls[-1][1]
    assert not any(t is odd for t in passed) and all(t.data_ptr() % 16 == 0 for t in passed)
    assert torch.equal(passed[0], odd)  # its own plan's aligned copy of q


def test_a_decode_steps_later_calls_pass_the_cache_itself(stub):
    calls, counted = stub
    batch, heads, heads_k = 2, 8, 2
    k_cache, v_cache = _bf16(batch, 256, heads_k, 64), _bf16(batch, 256, heads_k, 64, seed=1)
    q, k, v = _bf16(batch, 1, heads, 64, seed=2), _bf16(batch, 1, heads_k, 64, seed=3), _bf16(batch, 1, heads_k, 64,
                                                                                              seed=4)
    seqlens = torch.tensor([5, 100], dtype=torch.int32)
    before = counted()
    for _ in range(3):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)
    assert _lane_ran("forward_kvcache") and counted() > before
    plan, passed, made = calls[-1]
    assert torch.equal(plan, calls[0][0])
    for t in (q, k_cache, v_cache, k, v, seqlens):
        assert any(p is t for p in passed)
    assert out.shape == q.shape and out is made[0]


def test_an_empty_query_that_appends_gets_the_outputs_no_launch_takes(stub):
    """seqlen_q 0 beside new k/v: the plan's one launch is the append, and out and lse are passed
    to no kernel. The library takes a buffer's dtype from a kernel parameter it is passed to, so it
    refuses to make them (the 2026-11-30 H200 run failed here: ``buffer 0 of the plan is passed to
    no kernel parameter``); the backend makes them itself, empty, in q's dtype and fp32."""
    calls, _ = stub
    q = _bf16(2, 0, 4, 32)
    k_cache, v_cache = _bf16(2, 8, 2, 32, seed=1), _bf16(2, 8, 2, 32, seed=2)
    k, v = _bf16(2, 1, 2, 32, seed=3), _bf16(2, 1, 2, 32, seed=4)
    for _ in range(2):  # the first call and the signature's held plan
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, return_softmax_lse=True)
        assert dispatch.last_backend() == "aot"
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((2, 0, 4, 32), torch.bfloat16, (2, 4, 0), torch.float32)
    plan, passed, made = calls[-1]
    assert len(calls) == 2 and not any(m is out for m in made) and any(p is k_cache for p in passed)


def test_a_recorded_call_unwraps_a_dead_functorch_wrapper(stub):
    """A training call records through ``_Attention``'s C ``apply`` (without ``Function.apply``'s
    Python wrapper), so the unwrapping of functorch's dead wrappers that the wrapper did is done
    before it: a tensor that escaped ``torch.func.grad`` still trains (without the unwrap, its
    data pointer is read and raises)."""
    leaked = []

    def escape(t):
        leaked.append(t)
        return t.float().sum()

    torch.func.grad(escape)(_bf16(1, 8, 2, 64))
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    k = _bf16(1, 8, 2, 64, seed=1).requires_grad_()
    out = flash_attn_func(leaked[0], k, k)
    assert type(out.grad_fn).__name__ == "_AttentionBackward" and dispatch.last_backend() == "aot"
    out.float().sum().backward()
    assert k.grad is not None and k.grad.shape == k.shape

