"""Lanes held by the op library (:func:`flash_attn.dispatch.run_held`, csrc/aot_ops.cpp's
``aot_lane_run``): once a ``flash_attn_func`` signature runs on the ``aot`` backend's direct lane,
the library holds its plan with its tensors' metadata, and a later call with the same scalars and
tensors like those runs in one op call, no Python route below the public function. Every other
call takes the Python route: other scalars, tensors of another shape, stride, dtype or device, a
misaligned pointer, a graph to record, tracing, a backend failure; and the held lanes are
forgotten with the plans, the chains and the settings they were held under.

On the benchmark's stub (support.aot_stub): which route and which plan run, not the numbers."""

from __future__ import annotations

import pytest
import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_varlen_func, validation
from flash_attn.aot import library as op_library
from flash_attn.backends import aot
from support.aot_buffers import read_plan
from support.aot_stub import bf16, misaligned, stub  # noqa: F401  (stub: a fixture)


@pytest.fixture
def held(stub, monkeypatch):
    """The stub, the op library's lanes forgotten first, and the plans it is asked to hold recorded."""
    op_library.ops().aot_lanes_clear()
    holds = []
    hold, run = aot._lane_ops()
    monkeypatch.setattr(aot, "_lane_op_builtins", (lambda key, plan, tensors: holds.append((key, plan)) or hold(
        key, plan, tensors), run))
    yield (*stub, holds)
    op_library.ops().aot_lanes_clear()


def test_a_signatures_later_calls_run_on_the_lane_the_op_library_holds(held):
    calls, counted, holds = held
    q, k, v = bf16(2, 40, 4, 64), bf16(2, 40, 4, 64, seed=1), bf16(2, 40, 4, 64, seed=2)
    before = counted()
    outs = [flash_attn_func(q, k, v, causal=True) for _ in range(6)]
    # planned, the known route again, the Python lane (then held), then three on the held lane
    assert len(calls) == 3 and counted() == before + 6 and len(holds) == 1
    assert _as_held(calls[-1][0], returned=1) == read_plan(holds[0][1], with_buffers=True)  # the Python lane's plan
    assert all(o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous() for o in outs)
    assert len({o.data_ptr() for o in outs}) == 6  # fresh buffers every call
    assert dispatch.last_backend() == "aot" and op_library.ops().aot_lanes_held() == 1
    # new tensors like those (other values, other storage): the same held lane
    flash_attn_func(bf16(2, 40, 4, 64, seed=3), bf16(2, 40, 4, 64, seed=4), bf16(2, 40, 4, 64, seed=5), causal=True)
    assert len(calls) == 3 and counted() == before + 7


def test_a_held_lane_is_the_plan_of_its_own_scalars(held):
    """A call of other scalars with the very tensors of a call the direct lane just ran (so the
    thread's last direct run is that call's) holds nothing of it: each held plan is its own
    signature's (a causal call never runs a non-causal plan)."""
    calls, counted, holds = held
    q = bf16(1, 64, 2, 64)
    for _ in range(3):
        flash_attn_func(q, q, q, causal=False)
    assert len(holds) == 1
    not_causal = calls[-1][0]
    first = len(calls)
    for _ in range(5):
        flash_attn_func(q, q, q, causal=True)
    assert len(holds) == 2 and holds[1][0] != holds[0][0]
    assert read_plan(holds[1][1], with_buffers=True) == _as_held(calls[first + 2][0], returned=1)
    assert read_plan(holds[1][1]) != read_plan(not_causal) and len(calls) == first + 3


def _as_held(plan: torch.Tensor, returned: int):
    """``plan``'s buffers and launches as a lane holds it for a call returning its first
    ``returned`` buffers: the others flagged the call's scratch (a lane returns its results alone)."""
    buffers, launches = read_plan(plan, with_buffers=True)
    return [dict(b, flags=b["flags"] & 1 | (2 if n >= returned else 0)) for n, b in enumerate(buffers)], launches


class _Passthrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _python_route(calls, call) -> bool:
    """Whether ``call()`` ran on the Python route (its op library call recorded by the stub)."""
    before = len(calls)
    call()
    return len(calls) > before


def test_calls_a_held_lane_does_not_take(held, monkeypatch):
    calls, counted, holds = held
    q, k, v = bf16(2, 40, 4, 64), bf16(2, 40, 4, 64, seed=1), bf16(2, 40, 4, 64, seed=2)
    for _ in range(4):
        flash_attn_func(q, k, v, causal=True)
    assert not _python_route(calls, lambda: flash_attn_func(q, k, v, causal=True))
    others = {
        "other scalars": lambda: flash_attn_func(q, k, v, causal=True, softmax_scale=0.5),
        "causal as an int": lambda: flash_attn_func(q, k, v, causal=1),
        "another shape": lambda: flash_attn_func(q[:, :20], k, v, causal=True),
        "other strides": lambda: flash_attn_func(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, causal=True),
        "another dtype": lambda: flash_attn_func(q.half(), k.half(), v.half(), causal=True),
        "a misaligned pointer": lambda: flash_attn_func(misaligned(q), k, v, causal=True),
        "alibi slopes": lambda: flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.ones(4)),
        "a graph to record": lambda: flash_attn_func(q.clone().requires_grad_(), k, v, causal=True),
    }
    for what, call in others.items():
        assert _python_route(calls, call), what
    with pytest.raises(TypeError, match="window_size"):  # refused as ever, though equal to the held (-1, -1)
        flash_attn_func(q, k, v, causal=True, window_size=(-1.0, -1))
    with _Passthrough():  # a __torch_function__ mode: the custom op sees the call
        assert _python_route(calls, lambda: flash_attn_func(q, k, v, causal=True))
    with torch.no_grad():  # nothing to record: the held lane
        assert not _python_route(calls, lambda: flash_attn_func(q.clone().requires_grad_(), k, v, causal=True))
    assert not _python_route(calls, lambda: flash_attn_func(q, k, v, causal=True))
    monkeypatch.setitem(dispatch._failed, "triton", object())  # a backend failed: every call takes the Python route
    assert _python_route(calls, lambda: flash_attn_func(q, k, v, causal=True))


def test_held_lanes_are_forgotten_with_the_plans_the_chains_and_the_settings(held, monkeypatch):
    calls, counted, holds = held
    q = bf16(1, 64, 2, 64)

    def warm():
        for _ in range(4):
            flash_attn_func(q, q, q, causal=True)
        assert not _python_route(calls, lambda: flash_attn_func(q, q, q, causal=True))

    warm()
    aot._backend.forget_plans()  # (the tuning sweep's step): the library forgets them too
    assert op_library.ops().aot_lanes_held() == 0
    assert _python_route(calls, lambda: flash_attn_func(q, q, q, causal=True))
    warm()
    dispatch._chains.clear()  # the chains forgotten (dispatch.reset; the stub's own, which it puts back after)
    assert _python_route(calls, lambda: flash_attn_func(q, q, q, causal=True))
    warm()
    monkeypatch.setenv(dispatch.STRICT_ENV, "1")  # other settings: their own lanes
    assert _python_route(calls, lambda: flash_attn_func(q, q, q, causal=True))


def test_held_lanes_are_bounded_on_both_sides(held, monkeypatch):
    """Past :data:`~flash_attn.dispatch.HELD_LIMIT` held signatures, the dispatcher's keys and
    the op library's lanes are forgotten together (a key is never reused: none is left behind)."""
    calls, counted, holds = held
    monkeypatch.setattr(dispatch, "HELD_LIMIT", 2)
    q = bf16(1, 64, 2, 64)
    for scale in (0.1, 0.2, 0.3):
        for _ in range(3):
            flash_attn_func(q, q, q, softmax_scale=scale)
    assert len(holds) == 3 and op_library.ops().aot_lanes_held() == 1
    assert _python_route(calls, lambda: flash_attn_func(q, q, q, softmax_scale=0.1))
    assert not _python_route(calls, lambda: flash_attn_func(q, q, q, softmax_scale=0.3))


def _slots_of_launches(plan: torch.Tensor, inputs: tuple) -> list:
    """Each launch's tensors as ``inputs``' names (the call's tensors, then any of its buffers';
    indices past them: the other buffers, by number)."""

    return [[inputs[i] if 0 <= i < len(inputs) else ("buffer", i - len(inputs)) if i >= 0 else None
             for i in launch["tensors"]] for launch in read_plan(plan)]


def test_a_decode_steps_later_calls_run_on_the_held_lane(held):
    """``flash_attn_with_kvcache`` appending a step's k/v (cache_seqlens a tensor): from the held
    lane on, one op call per step, the caches' version counters bumped as the Python route does,
    and the held plan the Python route's with its tensors in the public function's order."""
    from flash_attn import flash_attn_with_kvcache  # noqa: PLC0415

    calls, counted, holds = held
    q, k_new, v_new = bf16(2, 1, 8, 64), bf16(2, 1, 2, 64, seed=1), bf16(2, 1, 2, 64, seed=2)
    k_cache, v_cache = bf16(2, 256, 2, 64, seed=3), bf16(2, 256, 2, 64, seed=4)
    seqlens = torch.tensor([10, 200], dtype=torch.int32)
    launched = []
    for step in range(6):
        versions, before = (k_cache._version, v_cache._version), counted()
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                           return_softmax_lse=True)
        launched.append(counted() - before)
        assert (k_cache._version, v_cache._version) == (versions[0] + 1, versions[1] + 1)
        assert out.shape == q.shape and lse.shape == (2, 8, 1) and lse.dtype == torch.float32
    assert len(calls) == 3 and len(holds) == 1 and launched == [launched[0]] * 6 and launched[0] >= 1
    # the Python route's plan and the held one launch the same tensors, each by its slot
    public = (q, k_cache, v_cache, k_new, v_new, seqlens)
    names = ("q", "k_cache", "v_cache", "k_new", "v_new", "seqlens")
    python_plan, passed, _ = calls[-1]
    passed_names = tuple(names[next(i for i, t in enumerate(public) if t is p)] for p in passed)
    assert _slots_of_launches(holds[0][1], names) == _slots_of_launches(python_plan, passed_names)
    assert passed_names != names  # (the library's order is not the public function's: the plan was rewritten)


def test_kv_cache_calls_a_held_lane_does_not_take(held, monkeypatch):
    from flash_attn import flash_attn_with_kvcache  # noqa: PLC0415

    calls, counted, holds = held
    q, k_cache, v_cache = bf16(1, 1, 8, 64), bf16(1, 128, 2, 64, seed=1), bf16(1, 128, 2, 64, seed=2)
    plain = lambda: flash_attn_with_kvcache(q, k_cache, v_cache)  # noqa: E731  (every sequence's whole cache)
    for _ in range(4):
        plain()
    assert len(holds) == 1 and not _python_route(calls, plain)
    assert _python_route(calls, lambda: flash_attn_with_kvcache(q, k_cache[:, :64], v_cache[:, :64]))  # another shape
    never = {  # however often
        "lengths as an int (a tensor of them made per call)": lambda: flash_attn_with_kvcache(q, k_cache, v_cache,
                                                                                             cache_seqlens=100),
        "a misaligned query": lambda: flash_attn_with_kvcache(misaligned(q), k_cache, v_cache),
    }
    for what, call in never.items():
        for _ in range(4):
            assert _python_route(calls, call), what
    monkeypatch.setenv("FLASH_ATTN_DEBUG", "1")  # values checked on the host: the Python route
    assert _python_route(calls, plain)


def test_a_backward_run_on_its_lane_is_never_held_for_the_forward(held):
    """A training step's backward runs on its direct lane under the forward's signature: a later
    forward of that signature that does not run on its own direct lane (a misaligned pointer: the
    known route) holds at most the forward's plan of aligned pointers (its training calls' direct
    lane), never the backward's."""
    calls, counted, holds = held
    q, k, v = (bf16(1, 64, 2, 64, seed=s).requires_grad_() for s in range(3))
    dout = bf16(1, 64, 2, 64, seed=3)
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True).backward(dout)
    forward_plan = next(plan for plan, passed, _ in reversed(calls) if len(passed) == 3)  # q, k, v
    assert any(len(passed) > 3 for _, passed, _ in calls)  # the backward's (dout, q, k, v, out, lse)
    with torch.no_grad():
        flash_attn_func(misaligned(q.detach()), k, v, causal=True)
    assert all(torch.equal(plan, forward_plan) for _, plan in holds)


# --- training calls: the forward's and the backward's held lanes ----------------------------------


def _training_step(q, k, v, dout, **kwargs):
    """One training step's attention: fresh leaves of q, k, v (their storage), forward and backward;
    returns ``(out, (dq, dk, dv))``."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, **kwargs)
    out.backward(dout)
    return out, tuple(t.grad for t in leaves)


def _held_training_signature(shape=(1, 64, 2, 64), **kwargs) -> tuple:
    """q, k, v and a gradient of ``shape`` whose training signature's lanes are held, forward and
    backward (five steps)."""
    q, k, v, dout = (bf16(*shape, seed=s) for s in range(4))
    for _ in range(5):
        _training_step(q, k, v, dout, **kwargs)
    return q, k, v, dout


def _route_of_step(calls, q, k, v, dout, **kwargs) -> tuple:
    """``(record, Python forward, Python backward)`` of one step: its autograd record's class
    name, and whether the forward and the backward called the op library through the Python route."""
    before = len(calls)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, **kwargs)
    forward = len(calls) > before
    before = len(calls)
    out.backward(dout)
    return type(out.grad_fn).__name__, forward, len(calls) > before


def test_a_training_signatures_later_steps_run_forward_and_backward_on_held_lanes(held):
    """From the signature's fourth training step, the forward is one op library call on a held
    lane (recorded by ``_HeldAttention``), and once one backward ran on its direct lane, the
    backward is one too; each held plan launches what the Python route's plan launched, its
    tensors by slot, and the gradients are the buffers it made, fresh every step."""
    calls, counted, holds = held
    q, k, v = (bf16(2, 40, 4, 64, seed=s) for s in range(3))
    dout = bf16(2, 40, 4, 64, seed=3)
    routes = [_route_of_step(calls, q, k, v, dout, causal=True) for _ in range(3)]
    assert routes == [("_AttentionBackward", True, True)] * 3
    python_forward = next(plan for plan, passed, _ in reversed(calls) if len(passed) == 3)
    python_backward, passed, _ = calls[-1]
    assert len(holds) == 1 and torch.equal(holds[0][1], python_forward)  # the training forward's plan
    assert _route_of_step(calls, q, k, v, dout, causal=True) == ("_HeldAttentionBackward", False, True)
    assert len(holds) == 2  # ... and the backward's, after it ran on its direct lane
    names = ("dout", "q", "k", "v", "out", "lse")
    # the Python route's tensors of the backward, named by what they are (shapes tell dout from out: no)
    plan, passed, _ = calls[-1]
    assert len(passed) == 6 and torch.equal(plan, python_backward)
    for _ in range(3):
        before, launched = len(calls), counted()
        out, grads = _training_step(q, k, v, dout, causal=True)
        assert len(calls) == before and counted() == launched + sum(
            len(_slots_of_launches(h[1], names)) for h in holds)
        assert type(out.grad_fn).__name__ == "_HeldAttentionBackward" and dispatch.last_backend() == "aot"
        assert all(g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous() for g, t in zip(grads, (q, k, v)))
    assert len({g.data_ptr() for g in grads}) == 3 and op_library.ops().aot_lanes_held() == 2


def test_a_held_backwards_plan_launches_the_python_routes_tensors_by_slot(held, monkeypatch):
    """The held backward's plan, written for (dout, q, k, v, out, lse), launches each kernel with
    the tensors the Python route's plan launched it with (its own order: dout is not first)."""
    calls, counted, holds = held
    q, k, v = (bf16(1, 64, 2, 64, seed=s) for s in range(3))
    dout = bf16(1, 64, 2, 64, seed=3)
    seen = []
    real = aot._launch

    def naming(launches, passed, rows):
        seen.append((launches.plan, tuple(launches.names), tuple(launches.made)))
        return real(launches, passed, rows)

    monkeypatch.setattr(aot, "_launch", naming)
    for _ in range(4):
        _training_step(q, k, v, dout)
    python_plan, python_names, made = seen[-1]
    assert set(python_names) == {"dout", "q", "k", "v", "out", "lse"} and python_names[0] != "dout"
    assert made[:3] != ("dq", "dk", "dv")  # (the held plan makes the gradients first: rewritten)
    held_plan = holds[-1][1]
    names = ("dout", "q", "k", "v", "out", "lse")
    held_made = ("dq", "dk", "dv", *(m for m in made if m not in ("dq", "dk", "dv")))
    assert _slots_of_launches(held_plan, names + held_made) == _slots_of_launches(python_plan, python_names + made)

    assert [launch["ints"] for launch in read_plan(held_plan)] == [launch["ints"] for launch in read_plan(python_plan)]


def test_training_calls_the_held_lanes_do_not_take(held, monkeypatch):
    calls, counted, holds = held
    q, k, v, dout = _held_training_signature((2, 40, 4, 64), causal=True)
    assert _route_of_step(calls, q, k, v, dout, causal=True) == ("_HeldAttentionBackward", False, False)
    general = ("_AttentionBackward", True, True)
    assert _route_of_step(calls, misaligned(q), k, v, dout, causal=True) == general  # the forward's lane refuses
    assert _route_of_step(calls, q, k, v, dout, causal=False) == general  # other scalars
    assert _route_of_step(calls, q.half(), k.half(), v.half(), dout.half(), causal=True) == general
    for _ in range(5):  # never held: dropout (the probabilities asked for, too: not compiled ahead of time)
        assert _route_of_step(calls, q, k, v, dout, causal=True, dropout_p=0.1) == general
    with _Passthrough():  # a __torch_function__ mode: the custom op sees the call
        out = flash_attn_func(*[t.clone().requires_grad_() for t in (q, k, v)], causal=True)
        assert type(out.grad_fn).__name__ != "_HeldAttentionBackward"
    # a graph of the backward to record: the held forward, the op's backward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=True)
    assert type(out.grad_fn).__name__ == "_HeldAttentionBackward"
    before = len(calls)
    (grad_q,) = torch.autograd.grad(out, leaves[0], dout, create_graph=True)
    assert len(calls) > before and grad_q.requires_grad
    assert _route_of_step(calls, q, k, v, dout, causal=True) == ("_HeldAttentionBackward", False, False)
    monkeypatch.setitem(dispatch._failed, "triton", object())  # a backend failed: every call takes the Python route
    assert _route_of_step(calls, q, k, v, dout, causal=True) == general


def test_a_gradient_of_other_strides_never_takes_another_gradients_plan(held):
    """A training signature's gradient with other strides than its earlier steps' (a transposed
    ``dout``): its backward takes the general route, and the backward lane held from it is the
    plan of its own strides (never a plan an earlier gradient's backward ran on its direct lane)."""

    calls, counted, holds = held
    q, k, v = (bf16(1, 64, 2, 64, seed=s) for s in range(3))
    dout = bf16(1, 64, 2, 64, seed=3)
    transposed = dout.transpose(1, 2).contiguous().transpose(1, 2)
    for _ in range(3):  # (the third's backward runs on its direct lane: the thread's last direct run)
        _training_step(q, k, v, dout)
    assert len(holds) == 1  # the forward's
    for step in range(5):
        before = len(calls)
        _training_step(q, k, v, transposed)
        if len(calls) > before:
            plan, passed, _ = calls[-1]
            if len(passed) == 6:
                transposed_plan = plan
    backward_holds = holds[1:]
    assert backward_holds, "the transposed gradient's backward is held once it ran on its direct lane"
    ints = [launch["ints"] for launch in read_plan(transposed_plan)]
    for _, plan in backward_holds:
        assert [launch["ints"] for launch in read_plan(plan)] == ints
    assert _route_of_step(calls, q, k, v, transposed)[1:] == (False, False)


def test_held_training_records_serve_what_training_code_does_with_them(held):
    """A held record's backward twice (``retain_graph``: its saved tensors are not bumped by the op
    library's calls), under activation checkpointing (the forward run again in the backward), and
    through ``flash_attn_qkvpacked_func`` (q, k, v views of one tensor, their gradients summed into
    it): each on the held lanes, each gradient the shape and dtype of its input."""
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

    from flash_attn import flash_attn_qkvpacked_func  # noqa: PLC0415

    calls, counted, holds = held
    q, k, v, dout = _held_training_signature()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    before = len(calls)
    out = flash_attn_func(*leaves)
    out.backward(dout, retain_graph=True)
    out.backward(dout)  # (accumulated into the first's gradients)
    assert type(out.grad_fn).__name__ == "_HeldAttentionBackward" and len(calls) == before
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = checkpoint(flash_attn_func, *leaves, use_reentrant=False)
    out.backward(dout)
    assert len(calls) == before and all(t.grad.shape == t.shape and t.grad.dtype == t.dtype for t in leaves)

    qkv = torch.stack((q, k, v), dim=2).requires_grad_()  # (batch, seqlen, 3, heads, dim)
    for _ in range(5):
        out = flash_attn_qkvpacked_func(qkv)
        out.backward(dout)
    assert type(out.grad_fn).__name__ == "_HeldAttentionBackward"
    assert qkv.grad.shape == qkv.shape and qkv.grad.dtype == qkv.dtype


def test_held_training_lanes_are_forgotten_with_the_plans(held):
    calls, counted, holds = held
    q, k, v, dout = _held_training_signature()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves)  # recorded on the held lanes ...
    assert type(out.grad_fn).__name__ == "_HeldAttentionBackward"
    aot._backend.forget_plans()  # ... which are forgotten before its backward
    assert op_library.ops().aot_lanes_held() == 0
    before = len(calls)
    out.backward(dout)  # the general backward route
    assert len(calls) == before + 1 and all(t.grad is not None for t in leaves)
    assert _route_of_step(calls, q, k, v, dout) == ("_AttentionBackward", True, True)


def _packed_batch(total_q=50, total_k=70, seed=0, requires_grad=False):
    """A packed batch of two sequences: q, k, v, cu_seqlens_q and _k, its longest lengths, a gradient."""
    cu_q = torch.tensor([0, 20, total_q], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, total_k], dtype=torch.int32)
    q = bf16(total_q, 4, 64, seed=seed)
    k, v = bf16(total_k, 2, 64, seed=seed + 1), bf16(total_k, 2, 64, seed=seed + 2)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, cu_q, cu_k, 30, 40, bf16(total_q, 4, 64, seed=seed + 3)


def test_a_packed_batchs_later_calls_run_on_a_lane_held_with_its_row_counts(held, monkeypatch):
    """A packed batch met again (a model's later layers) runs on a held lane: its plan is the
    Python lane's with the batch's row counts in place (a held lane's tensors have the held
    call's shapes), read once by the op library; a batch met once holds nothing (most batches:
    a model's first layer); other cu_seqlens values of the same shapes run on the same lane (the
    kernels read them on the device); other totals, another longest length or a 0-d tensor for
    the longest length take the Python route, and so does every call while
    ``FLASH_ATTN_DEBUG`` has the values checked on the host."""
    from support.aot_buffers import launched_as  # noqa: PLC0415

    calls, counted, holds = held
    monkeypatch.setattr(validation, "_checked", {})  # (the signature's checks not met before)
    q, k, v, cu_q, cu_k, max_q, max_k, _ = _packed_batch()
    outs = [flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True) for _ in range(5)]
    assert len(holds) == 1 and len(calls) == 3  # held at the third call (met before; on the direct lane)
    buffers, launches = launched_as(calls[-1][0], (50,))  # the Python lane's plan as run for these rows
    held_buffers, held_launches = read_plan(holds[0][1], with_buffers=True)
    assert held_launches == [dict(launch, rows=[]) for launch in launches]  # no row count read per call
    assert [b["sizes"] for b in held_buffers] == [b["sizes"] for b in buffers] == [[50, 4, 64], [4, 50]]
    assert [b["flags"] for b in held_buffers] == [0, 2]  # out returned, lse the call's scratch
    assert all(o.shape == q.shape for o in outs) and len({o.data_ptr() for o in outs}) == 5
    other_values = (torch.tensor([0, 7, 50], dtype=torch.int32), torch.tensor([0, 60, 70], dtype=torch.int32))
    assert not _python_route(calls, lambda: flash_attn_varlen_func(q, k, v, *other_values, max_q, max_k,
                                                                   causal=True))
    for batch in (_packed_batch(total_q=51), _packed_batch(total_k=71)):
        assert _python_route(calls, lambda: flash_attn_varlen_func(*batch[:7], causal=True))
    assert _python_route(calls, lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, 41, causal=True))
    assert _python_route(calls, lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(max_q), max_k,
                                                               causal=True))
    with pytest.MonkeyPatch.context() as debug:  # the values checked on the host: every call
        debug.setenv(validation.DEBUG_ENV, "1")
        assert _python_route(calls, lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True))
    before = len(holds)
    for seed in range(4):  # new batches, each met once: nothing held for them
        batch = _packed_batch(total_q=60 + seed, seed=seed)
        flash_attn_varlen_func(*batch[:7], causal=True)
    assert len(holds) == before


def test_a_packed_batchs_later_training_steps_run_on_held_lanes(held, monkeypatch):
    """A packed batch's training steps, as a dense signature's: from its fourth step the forward on
    a held lane (recorded by ``_HeldPackedAttention``, cu_seqlens saved beside q, k, v, out and lse),
    from the fifth the backward too (the general route's direct run held, the row counts in
    place); the gradients of q's, k's and v's shapes."""
    calls, counted, holds = held
    monkeypatch.setattr(validation, "_checked", {})  # (the signature's checks not met before)
    q, k, v, cu_q, cu_k, max_q, max_k, dout = _packed_batch()
    routes = []
    for _ in range(5):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        before = len(calls)
        out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=True)
        forward = len(calls) > before
        before = len(calls)
        grads = torch.autograd.grad(out, leaves, dout)
        routes.append((type(out.grad_fn).__name__, forward, len(calls) > before))
        assert [g.shape for g in grads] == [t.shape for t in leaves]
    assert routes == [("_AttentionBackward", True, True)] * 3 + [("_HeldPackedAttentionBackward", False, True),
                                                                 ("_HeldPackedAttentionBackward", False, False)]
    assert len(holds) == 2
    for plan in (holds[0][1], holds[1][1]):
        assert all(launch["rows"] == [] for launch in read_plan(plan))


# --- on a GPU: the held lanes compute what the oracle does ----------------------------------------


def _gpu_aot_or_skip(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    reason = aot.unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "aot")
    op_library.ops().aot_lanes_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal, heads_k, head_dim", [(False, 4, 64), (True, 1, 128), (True, 4, 96)])
def test_held_forwards_compute_what_the_oracle_does_on_gpu(monkeypatch, dtype, causal, heads_k, head_dim):
    """Six calls of one signature, fresh values every call: the later ones on the held lane (the
    Python route's launches not called), each output against the float64 oracle."""
    from support.oracle import attention_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import check_close  # noqa: PLC0415

    _gpu_aot_or_skip(monkeypatch)
    python_route = []
    real = aot._launch
    monkeypatch.setattr(aot, "_launch", lambda *a: python_route.append(1) or real(*a))
    g = torch.Generator(device="cuda").manual_seed(0)
    for step in range(6):
        q = torch.randn(2, 150, 4, head_dim, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(2, 190, heads_k, head_dim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        out = flash_attn_func(q, k, v, causal=causal)
        ref, _, naive, _ = oracle_pair(attention_ref, (q, k, v), causal=causal)
        check_close(out, ref.out, naive.out, dtype, f"out, call {step}")
    assert len(python_route) == 3 and op_library.ops().aot_lanes_held() >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_held_decode_steps_compute_what_the_oracle_does_on_gpu(monkeypatch, paged):
    """Eight decode steps appending one token to each sequence (lengths as a tensor), the later
    ones on the held lane: each step's output and the caches' new rows against the oracle; then a
    plain decode over every sequence's whole cache, repeated."""
    from flash_attn import flash_attn_with_kvcache  # noqa: PLC0415
    from support.oracle import kvcache_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import check_close  # noqa: PLC0415

    _gpu_aot_or_skip(monkeypatch)
    python_route = []
    real = aot._launch
    monkeypatch.setattr(aot, "_launch", lambda *a: python_route.append(1) or real(*a))
    dtype, batch, heads, heads_k, d, page = torch.bfloat16, 3, 8, 2, 128, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    if paged:
        k_cache, v_cache = rnd(batch * 4, page, heads_k, d), rnd(batch * 4, page, heads_k, d)
        block_table = torch.randperm(batch * 4, device="cuda", generator=g).to(torch.int32).view(batch, 4)
    else:
        k_cache, v_cache, block_table = rnd(batch, 4 * page, heads_k, d), rnd(batch, 4 * page, heads_k, d), None
    seqlens = torch.tensor([5, 100, 200], dtype=torch.int32, device="cuda")
    for step in range(8):
        q, k, v = rnd(batch, 1, heads, d), rnd(batch, 1, heads_k, d), rnd(batch, 1, heads_k, d)
        ref, _, naive, _ = oracle_pair(kvcache_ref, (q, k_cache, v_cache, k, v), cache_seqlens=seqlens,
                                       block_table=block_table, causal=True)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=block_table,
                                      causal=True)
        check_close(out, ref.out, naive.out, dtype, f"out, step {step}")
        assert torch.equal(k_cache[ref.written], ref.k_cache[ref.written].to(dtype)), f"k appended, step {step}"
        assert torch.equal(v_cache[ref.written], ref.v_cache[ref.written].to(dtype)), f"v appended, step {step}"
        seqlens = seqlens + 1
    assert len(python_route) == 3
    if not paged:
        python_route.clear()
        for step in range(5):
            q = rnd(batch, 1, heads, d)
            ref, _, naive, _ = oracle_pair(kvcache_ref, (q, k_cache, v_cache))
            check_close(flash_attn_with_kvcache(q, k_cache, v_cache), ref.out, naive.out, dtype, f"whole cache, {step}")
        assert len(python_route) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal, heads_k, head_dim", [(False, 4, 64), (True, 1, 128), (True, 2, 96)])
def test_held_training_steps_compute_what_the_oracle_does_on_gpu(monkeypatch, dtype, causal, heads_k, head_dim):
    """Eight training steps of one signature, fresh values every step, the last two with a
    transposed gradient: from the fourth on, the forward on its held lane, and the backward on its
    own from the fifth (and again once the transposed gradient's is held); each step's out and dq,
    dk, dv against the float64 oracle."""
    from support.oracle import attention_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import backward_floor, check_close  # noqa: PLC0415

    _gpu_aot_or_skip(monkeypatch)
    python_route = []
    real = aot._launch
    monkeypatch.setattr(aot, "_launch", lambda *a: python_route.append(1) or real(*a))
    g = torch.Generator(device="cuda").manual_seed(2)
    records, routes = [], []
    for step in range(8):
        q = torch.randn(2, 150, 4, head_dim, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(2, 190, heads_k, head_dim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        dout = torch.randn(2, 150, 4, head_dim, device="cuda", dtype=dtype, generator=g)
        if step >= 6:
            dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        before = len(python_route)
        out = flash_attn_func(*leaves, causal=causal)
        out.backward(dout)
        records.append(type(out.grad_fn).__name__)
        routes.append(len(python_route) - before)
        ref, ref_grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, causal=causal)
        floor = backward_floor(q, k, v, dout, probs=ref.probs)
        check_close(out, ref.out, naive.out, dtype, f"out, step {step}")
        for t, want, approx, name in zip(leaves, ref_grads, naive_grads, ("dq", "dk", "dv")):
            check_close(t.grad, want, approx, dtype, f"{name}, step {step}", grad=True, floor=floor)
    assert records[3:] == ["_HeldAttentionBackward"] * 5 and routes[4:6] == [0, 0] and routes[3] == 1


@pytest.mark.gpu
def test_held_qkvpacked_training_steps_compute_what_the_oracle_does_on_gpu(monkeypatch):
    """``flash_attn_qkvpacked_func`` training steps (q, k, v strided views of one tensor), the later
    ones on the held lanes: out and the packed gradient against the float64 oracle's dq, dk, dv."""
    from flash_attn import flash_attn_qkvpacked_func  # noqa: PLC0415
    from support.oracle import attention_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import backward_floor, check_close  # noqa: PLC0415

    _gpu_aot_or_skip(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(3)
    dtype = torch.bfloat16
    records = []
    for step in range(6):
        qkv = torch.randn(2, 130, 3, 4, 64, device="cuda", dtype=dtype, generator=g)
        dout = torch.randn(2, 130, 4, 64, device="cuda", dtype=dtype, generator=g)
        leaf = qkv.clone().requires_grad_()
        out = flash_attn_qkvpacked_func(leaf, causal=True)
        out.backward(dout)
        records.append(type(out.grad_fn).__name__)
        q, k, v = qkv.unbind(dim=2)
        ref, ref_grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, causal=True)
        floor = backward_floor(q, k, v, dout, probs=ref.probs)
        check_close(out, ref.out, naive.out, dtype, f"out, step {step}")
        for i, name in enumerate(("dq", "dk", "dv")):
            check_close(leaf.grad[:, :, i], ref_grads[i], naive_grads[i], dtype, f"{name}, step {step}", grad=True,
                        floor=floor)
    assert records[3:] == ["_HeldAttentionBackward"] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_held_packed_training_steps_compute_what_the_oracle_does_on_gpu(monkeypatch, dtype):
    """A packed batch's training steps (a model's layers: one batch, fresh values every step),
    then the same shapes with other sequence bounds: from the fourth step on held lanes (the row
    counts in the held plans, cu_seqlens read by the kernels); each step's out and dq, dk, dv
    against the float64 oracle."""
    from support.oracle import attention_varlen_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import backward_floor, check_close  # noqa: PLC0415

    _gpu_aot_or_skip(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(4)
    records = []
    for step, bounds in enumerate([[0, 70, 130, 200]] * 6 + [[0, 10, 150, 200], [0, 100, 101, 200]]):
        cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
        q = torch.randn(200, 4, 64, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(200, 2, 64, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        dout = torch.randn(200, 4, 64, device="cuda", dtype=dtype, generator=g)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_varlen_func(*leaves, cu, cu, 140, 140, causal=True)  # one longest length bounds all
        out.backward(dout)
        records.append(type(out.grad_fn).__name__)
        ref, ref_grads, naive, naive_grads = oracle_pair(attention_varlen_ref, [q, k, v], dout, cu_q=bounds,
                                                         cu_k=bounds, causal=True)
        floor = backward_floor(q, k, v, dout)
        check_close(out, ref.out, naive.out, dtype, f"out, step {step}")
        for t, want, approx, name in zip(leaves, ref_grads, naive_grads, ("dq", "dk", "dv")):
            check_close(t.grad, want, approx, dtype, f"{name}, step {step}", grad=True, floor=floor)
    assert records[3:] == ["_HeldPackedAttentionBackward"] * 5


@pytest.mark.gpu
def test_calls_on_the_driver_launch_route_compute_what_the_oracle_does_on_gpu(monkeypatch):
    """The op library's other launch route (the driver's ``cuLaunchKernelEx``, timed against the
    runtime's by ``bench overhead --device cuda``): training steps (forward and backward, the later
    ones on held lanes) and decode steps over a cache (split and combine) launched by it, each
    against the float64 oracle."""
    from flash_attn import flash_attn_with_kvcache  # noqa: PLC0415
    from support.oracle import attention_ref, kvcache_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import backward_floor, check_close  # noqa: PLC0415

    _gpu_aot_or_skip(monkeypatch)
    ops = op_library.ops()
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(5)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    previous = ops.aot_use_driver_launch(True)
    try:
        for step in range(5):
            q, k, v, dout = rnd(2, 150, 4, 128), rnd(2, 190, 2, 128), rnd(2, 190, 2, 128), rnd(2, 150, 4, 128)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = flash_attn_func(*leaves, causal=True)
            out.backward(dout)
            ref, ref_grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, causal=True)
            floor = backward_floor(q, k, v, dout, probs=ref.probs)
            check_close(out, ref.out, naive.out, dtype, f"out, step {step}")
            for t, want, approx, name in zip(leaves, ref_grads, naive_grads, ("dq", "dk", "dv")):
                check_close(t.grad, want, approx, dtype, f"{name}, step {step}", grad=True, floor=floor)
        k_cache, v_cache = rnd(2, 4096, 2, 128), rnd(2, 4096, 2, 128)
        for step in range(5):
            q = rnd(2, 1, 8, 128)
            ref, _, naive, _ = oracle_pair(kvcache_ref, (q, k_cache, v_cache))
            check_close(flash_attn_with_kvcache(q, k_cache, v_cache), ref.out, naive.out, dtype, f"decode, {step}")
    finally:
        ops.aot_use_driver_launch(previous)
