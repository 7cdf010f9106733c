"""The kernel backends find a public call's plan by its checked signature
(:attr:`flash_attn.params.AttentionParams.call`), describing the call only the first time: every
call must still run the very plan that describing it afresh gives (the planner's own answer, the
oracle here), and an input the signature cannot see (a pointer's alignment, the gradient's
layout) or a changed setting gets its own plan or backend.

The triton backend plans for an H100 with CPU tensors and records its launches instead of running
them: what is checked is which launches a call makes, not their results (the kernels' numbers are
tested elsewhere)."""

from __future__ import annotations

import pytest
import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, params, validation
from flash_attn.backends import triton as triton_backend
from flash_attn.backends._execute import PlanCache
from flash_attn.planning import plan as P

H100 = P.Target("sm90", 132)


@pytest.fixture
def launches(monkeypatch):
    """``FLASH_ATTN_BACKEND=triton`` planning for an H100 on CPU tensors; the launches of each call."""
    monkeypatch.setattr(dispatch, "_chains", {})
    monkeypatch.setattr(dispatch, "_failed", {})
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "triton")
    monkeypatch.delenv(dispatch.STRICT_ENV, raising=False)
    monkeypatch.setattr(triton_backend.BACKEND, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(triton_backend._backend, "target", lambda device: H100)
    monkeypatch.setattr(triton_backend._backend, "plans", PlanCache())
    monkeypatch.setattr(validation, "_checked", {})
    made: list = []

    def run_launch(launch, tensors, device):
        # a plan copies a misaligned input before its launches: a wrong plan would pass it on
        pointers = [tensors[value] for _, value in launch.args if isinstance(value, P.Slot)]
        assert all(t.data_ptr() % 16 == 0 for t in pointers if isinstance(t, torch.Tensor)), launch.kernel
        made.append(launch)

    monkeypatch.setattr(triton_backend._backend, "run_launch", run_launch)
    return made


def _described(monkeypatch) -> list:
    """The call shapes described from now on (the signature's lookup describes none)."""
    seen: list = []
    for name in ("describe_forward", "describe_backward", "describe_kvcache"):
        real = getattr(P, name)
        monkeypatch.setattr(P, name, lambda *a, _real=real, **kw: seen.append(1) or _real(*a, **kw))
    return seen


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor of the same shape, strides and dtype whose data starts 2 bytes
    past a 16-byte boundary: the same signature, another alignment."""
    base = torch.empty(t.numel() + 8, dtype=t.dtype)
    view = base[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.stride() == t.stride() and view.data_ptr() % 16 != 0
    return view


def _qkv(*shape):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).half() for _ in range(3)]


def _plain_attention(q, k, v):
    """Softmax attention in float64, ``(b, s, h, d)`` in and out: the oracle of the calls another
    backend runs here (no mask, the default scale)."""
    scores = q.double().transpose(1, 2) @ k.double().permute(0, 2, 3, 1) / q.shape[-1] ** 0.5
    return (torch.softmax(scores, -1) @ v.double().transpose(1, 2)).transpose(1, 2)


def _forward_plan(q, k, v, causal=True):
    from flash_attn.params import AttentionParams  # noqa: PLC0415

    params = AttentionParams(q.shape[-1] ** -0.5, -1, 0 if causal else -1)
    return P.plan_forward(P.describe_forward(q, k, v, params), H100)


def test_a_repeated_call_describes_nothing_and_runs_the_described_plan(launches, monkeypatch):
    q, k, v = _qkv(2, 64, 4, 64)
    flash_attn_func(q, k, v, causal=True)
    first = list(launches)
    assert first == list(_forward_plan(q, k, v).launches)
    described = _described(monkeypatch)
    launches.clear()
    flash_attn_func(q, k, v, causal=True)
    assert described == [] and launches == first


def test_a_misaligned_pointer_with_the_same_signature_gets_its_own_plan(launches):
    q, k, v = _qkv(2, 64, 4, 64)
    flash_attn_func(q, k, v, causal=True)
    aligned = list(launches)
    bad_q = _misaligned(q)
    assert validation.signature((bad_q,), ()) == validation.signature((q,), ())
    expected = _forward_plan(bad_q, k, v)
    assert expected != _forward_plan(q, k, v)  # the planner tells them apart: so must the lookup
    for _ in range(2):
        launches.clear()
        flash_attn_func(bad_q, k, v, causal=True)
        assert launches == list(expected.launches)
    launches.clear()
    flash_attn_func(q, k, v, causal=True)  # and the aligned call keeps its own
    assert launches == aligned


def test_the_backward_follows_the_gradients_layout(launches):
    q, k, v = (t.requires_grad_() for t in _qkv(2, 64, 4, 64))
    out = flash_attn_func(q, k, v, causal=True)
    lse = torch.empty(2, 4, 64, dtype=torch.float32)
    from flash_attn.params import AttentionParams  # noqa: PLC0415

    params = AttentionParams(64 ** -0.5, -1, 0)

    def backward_plan(dout):
        return list(P.plan_backward(P.describe_backward(dout, q, k, v, out.detach(), lse, params), H100).launches)

    plain = torch.randn(2, 64, 4, 64).half()
    strided = torch.randn(2, 4, 64, 64).half().transpose(1, 2)  # same shape, other strides: another plan
    assert backward_plan(plain) != backward_plan(strided)
    for dout in (plain, strided, plain, _misaligned(plain)):
        for t in (q, k, v):
            t.grad = None
        out = flash_attn_func(q, k, v, causal=True)
        launches.clear()
        out.backward(dout)
        assert launches == backward_plan(dout)


def test_a_decode_step_with_a_misaligned_input_gets_its_own_plan(launches):
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=g).half() for _ in range(2))
    q = torch.randn(2, 1, 4, 64, generator=g).half()
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    from flash_attn.params import AttentionParams, KVCacheInputs  # noqa: PLC0415

    def plan(q):
        cache = KVCacheInputs(k_cache, v_cache, seqlens, None, None, None, None, None, None, None, False, 0)
        return P.plan_kvcache(P.describe_kvcache(q, AttentionParams(64 ** -0.5, -1, 0), cache), H100)

    assert plan(q).prepare == () and plan(_misaligned(q)).prepare  # a misaligned q is copied first
    for step_q in (q, q, _misaligned(q), _misaligned(q), q):
        launches.clear()
        flash_attn_with_kvcache(step_q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
        assert launches == list(plan(step_q).launches)  # and the launches see it aligned (the fixture)


def test_a_changed_backend_setting_is_read_on_every_call(launches, monkeypatch):
    q, k, v = _qkv(1, 32, 2, 64)
    flash_attn_func(q, k, v)
    assert launches
    launches.clear()
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    out = flash_attn_func(q, k, v)
    assert launches == []  # the reference backend ran it
    torch.testing.assert_close(out.double(), _plain_attention(q, k, v), rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# The signature's route (dispatch.run_known): an eager call with a checked signature runs the plan
# the first backend holds for it (made and held on its first call) without the dispatcher's general
# route; dropout and the calls the backend refuses take that route.


@pytest.fixture
def general_route(monkeypatch) -> list:
    """The ops that took the dispatcher's general route (``dispatch.run``) from now on."""
    taken: list = []
    real = dispatch.run
    monkeypatch.setattr(dispatch, "run", lambda op, *a, **kw: taken.append(op) or real(op, *a, **kw))
    return taken


@pytest.fixture
def interpreter(monkeypatch):
    """``FLASH_ATTN_BACKEND=interpret``: the Triton kernels in Triton's interpreter, computing."""
    reason = dispatch.unavailable_reason("interpret", torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"interpret backend unavailable: {reason}")
    monkeypatch.setattr(dispatch, "_chains", {})
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "interpret")


def _decode_step(g):
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=g).half() for _ in range(2))
    q = torch.randn(2, 1, 4, 64, generator=g).half()
    return q, k_cache, v_cache, torch.tensor([5, 9], dtype=torch.int32)


def test_a_signature_is_described_once_and_its_plan_held(launches, general_route, monkeypatch):
    """A signature's first call (forward, its backward, a decode step) is described and planned on
    the signature's route, its second runs the held plan: the very launches of the first (the
    described plan's, checked above); neither takes the general route."""
    q, k, v = (t.requires_grad_() for t in _qkv(2, 64, 4, 64))
    dout = torch.randn(2, 64, 4, 64).half()
    step = _decode_step(torch.Generator().manual_seed(2))
    described = _described(monkeypatch)
    made = []
    for _ in range(2):
        launches.clear()
        flash_attn_func(q, k, v, causal=True).backward(dout)
        flash_attn_with_kvcache(step[0], step[1], step[2], cache_seqlens=step[3], causal=True)
        made.append(list(launches))
        assert dispatch.last_backend() == "triton"
    assert described == [1, 1, 1] and general_route == []  # the first calls described, nothing else
    assert made[0] == made[1] and made[0]


def test_a_refused_call_takes_the_general_route_to_the_next_backend(launches, general_route, monkeypatch):
    """fp32 inputs (the kernels take fp16/bf16): the signature's route finds the refusal, the
    general route tells (once) and runs the call on the next backend, every time."""
    monkeypatch.setattr(dispatch, "_warned", set())
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 32, 2, 64, generator=g) for _ in range(3))
    with pytest.warns(UserWarning, match=r"triton backend cannot run this forward \(torch.float32 inputs"):
        flash_attn_func(q, k, v)
    for _ in range(2):
        out = flash_attn_func(q, k, v)
        assert dispatch.last_backend() == "reference" and launches == []
    assert general_route == ["forward"] * 3
    torch.testing.assert_close(out.double(), _plain_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_forgotten_plans_are_made_again(launches, general_route, monkeypatch):
    q, k, v = _qkv(2, 64, 4, 64)
    flash_attn_func(q, k, v, causal=True)
    triton_backend._backend.forget_plans()  # the tuning sweep's: the launch configs changed
    described = _described(monkeypatch)
    flash_attn_func(q, k, v, causal=True)
    assert general_route == [] and described == [1]


def test_dropout_calls_take_the_general_route(launches, general_route):
    q, k, v = _qkv(2, 64, 4, 64)
    cu = torch.tensor([0, 50, 128], dtype=torch.int32)
    packed = [t.reshape(128, 4, 64) for t in (q, k, v)]
    for _ in range(2):
        flash_attn_func(q, k, v, dropout_p=0.1)  # the seed is drawn per call
        flash_attn_varlen_func(*packed, cu, cu, 78, 78, dropout_p=0.1)
    assert general_route == ["forward"] * 4


# Packed batches (padding-free training): a batch's signature holds what its plan does: the
# longest lengths' buckets and whether the row counts are taken per call, not the totals nor
# cu_seqlens' values; every layer of a step repeats it, and so does a new batch of the same buckets.

def _packed(total: int, cuts: list, g, grad: bool = False) -> tuple:
    """q, k, v of ``total`` packed rows (2 query heads, 1 kv head) and cu_seqlens cut at ``cuts``."""
    q, k, v = (torch.randn(total, heads, 32, generator=g).half().requires_grad_(grad) for heads in (2, 1, 1))
    bounds = [0, *cuts, total]
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return q, k, v, torch.tensor(bounds, dtype=torch.int32), longest


def _packed_plans(q, k, v, cu, longest, dout=None):
    """The planner's launches of a packed call's forward (and backward): the oracle of which launches run."""
    from flash_attn.params import AttentionParams, VarlenLayout  # noqa: PLC0415

    params, varlen = AttentionParams(32 ** -0.5, -1, 0), VarlenLayout(cu, cu, longest, longest)
    launches = list(P.plan_forward(P.describe_forward(q, k, v, params, varlen), H100).launches)
    if dout is not None:
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        out = torch.empty_like(q)
        launches += P.plan_backward(P.describe_backward(dout, q, k, v, out, lse, params, varlen), H100).launches
    return launches


def test_a_packed_batch_in_every_layer_runs_its_held_plan(launches, general_route, monkeypatch):
    """The same packed batch again (the next layer of a step): the held forward and backward, the
    very launches the planner gives; then other sequence bounds with the same totals and longest
    length (the same signature: the kernels read cu_seqlens per call) are held too."""
    g = torch.Generator().manual_seed(6)
    q, k, v, cu, longest = _packed(96, [40, 70], g, grad=True)
    dout = torch.randn(96, 2, 32, generator=g).half()
    expected = _packed_plans(q, k, v, cu, longest, dout)
    made = []
    for _ in range(2):
        launches.clear()
        flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True).backward(dout)
        made.append(list(launches))
    assert made == [expected, expected] and general_route == []
    described = _described(monkeypatch)
    other_cu = torch.tensor([0, 30, 70, 96], dtype=torch.int32)  # longest 40 too
    launches.clear()
    flash_attn_varlen_func(q, k, v, other_cu, other_cu, longest, longest, causal=True).backward(dout)
    assert described == [] and launches == expected


def test_a_new_packed_batch_of_the_same_buckets_runs_the_held_plan(launches, general_route, monkeypatch):
    """Batches with new totals and longest lengths in the same bucket share the first batch's
    signature: neither described nor planned again, and each runs the launches the planner gives
    it (the row counts are the call's); a batch whose longest length is in the next bucket is a new
    signature and a new plan."""
    g = torch.Generator().manual_seed(7)
    batches = [_packed(total, cuts, g) for total, cuts in ((96, [40, 70]), (101, [30, 70]), (90, [20, 45]),
                                                            (300, [200]))]
    assert [b[-1] for b in batches] == [40, 40, 45, 200]  # buckets: 128 three times, then 256
    expected = [_packed_plans(*batch) for batch in batches]
    described = _described(monkeypatch)
    planned = []
    real = P.plan_forward
    monkeypatch.setattr(P, "plan_forward", lambda *a: planned.append(1) or real(*a))
    for (q, k, v, cu, longest), want in zip(batches, expected):
        launches.clear()
        flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)
        assert launches == want
    assert general_route == [] and described == [1, 1] and planned == [1, 1]


def test_a_packed_batch_class_holds_the_row_counts_class_and_the_longest_lengths_bucket():
    """What the signature a packed batch shares with its class holds of its row counts
    (:func:`validation.packed_rows`) and longest lengths: their classes where the planner's own
    description of the calls is equal (the row counts left to the call, the longest lengths
    bucketed), not where it differs; ``None`` where the row counts the checks compare differ."""
    from flash_attn.flash_attn_interface import _batch_signature  # noqa: PLC0415
    from flash_attn.limits import INT32_MAX  # noqa: PLC0415

    assert [validation.packed_rows(n) for n in (0, 1, 4096, INT32_MAX, INT32_MAX + 1)] == [0, -1, -1, -1, INT32_MAX + 1]
    rows = torch.empty(300, 2, 32).half()
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    options = (0.0, None, True, (-1, -1), 0.0, False, False)

    def shared(total, longest, total_v=None, qv=None, block_table=None, kv=None):
        k, v = kv or (rows[:total], rows[:total if total_v is None else total_v])
        return _batch_signature((rows[:total], qv, k, v, cu, cu, block_table, None, None), (longest, longest, *options))

    def described(total, longest):
        from flash_attn.params import AttentionParams, VarlenLayout  # noqa: PLC0415

        q = rows[:total]
        return P.describe_forward(q, q, q, AttentionParams(32 ** -0.5, -1, 0), VarlenLayout(cu, cu, longest, longest))

    same = [(9, 5), (96, 40), (300, 128)]  # one bucket (128), other totals
    assert len({shared(*c) for c in same}) == 1 and len({described(*c) for c in same}) == 1
    assert shared(300, 129) != shared(9, 5) and described(300, 129) != described(9, 5)  # the next bucket
    assert shared(0, 5) != shared(9, 5)  # no rows: the checks skip an empty tensor's layout
    assert shared(96, 40, total_v=95) is None and shared(96, 40, qv=rows[:95]) is None
    assert shared(96, 40, qv=rows[:96]) == shared(9, 5, qv=rows[:9])
    pages = [torch.empty(n, 16, 2, 32).half() for n in (4, 5)]  # paged: the page pools' shapes are held
    table = torch.zeros(2, 2, dtype=torch.int32)
    assert shared(9, 5, block_table=table, kv=(pages[0], pages[0])) == shared(96, 40, block_table=table,
                                                                              kv=(pages[0], pages[0]))
    assert shared(9, 5, block_table=table, kv=(pages[0], pages[0])) != shared(9, 5, block_table=table,
                                                                              kv=(pages[1], pages[1]))


def test_a_misaligned_cu_seqlens_with_the_same_signature_gets_its_own_key(launches):
    g = torch.Generator().manual_seed(8)
    q, k, v, cu, longest = _packed(96, [40, 70], g)
    bad_cu = _misaligned(cu)
    assert validation.signature((bad_cu,), ()) == validation.signature((cu,), ())
    for c in (cu, bad_cu, bad_cu, cu):
        launches.clear()
        flash_attn_varlen_func(q, k, v, c, c, longest, longest, causal=True)
        assert launches == _packed_plans(q, k, v, c, longest)


def test_a_backend_failure_on_the_known_route_fails_over_as_the_general_route_does(launches, monkeypatch):
    """A backend that fails on a later call of a held plan: the call is run by the next backend
    with the same warning as on the general route, and later calls go there."""
    q, k, v = _qkv(1, 32, 2, 64)
    flash_attn_func(q, k, v)
    assert launches

    def broken(launch, tensors, device):
        raise triton_backend.BackendFailed("Triton cannot write its cache directory (read-only)", "set TRITON_CACHE_DIR",
                                           "backend")

    monkeypatch.setattr(triton_backend._backend, "run_launch", broken)
    with pytest.warns(UserWarning, match="the triton backend failed on first use: Triton cannot write its cache"):
        out = flash_attn_func(q, k, v)
    assert dispatch.last_backend() == "reference"
    torch.testing.assert_close(out.double(), _plain_attention(q, k, v), rtol=2e-3, atol=2e-3)
    flash_attn_func(q, k, v)
    assert dispatch.last_backend() == "reference"


def test_an_error_that_is_not_a_backend_failure_is_raised_from_the_known_route(launches, monkeypatch):
    q, k, v = _qkv(1, 32, 2, 64)
    flash_attn_func(q, k, v)

    def broken(launch, tensors, device):
        raise MemoryError("no memory for the launch")

    monkeypatch.setattr(triton_backend._backend, "run_launch", broken)
    with pytest.raises(MemoryError, match="no memory for the launch"):
        flash_attn_func(q, k, v)


def test_the_known_route_computes_what_the_oracle_does(general_route, interpreter):
    """The Triton kernels in Triton's interpreter: the second forward + backward and decode step of
    a signature (the known route) against the float64 oracle."""
    from support.oracle import attention_ref, kvcache_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import backward_floor, check_close  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 24, 2, 32, generator=g).half() for _ in range(4))
    ref, ref_grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, causal=True)
    floor = backward_floor(q, k, v, dout, probs=ref.probs)
    step_q, k_cache, v_cache = (torch.randn(2, 1, 2, 32, generator=g).half(),
                                *(torch.randn(2, 40, 1, 32, generator=g).half() for _ in range(2)))
    seqlens = torch.tensor([7, 33], dtype=torch.int32)
    step_ref = kvcache_ref(step_q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    step_naive = kvcache_ref(step_q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, compute_dtype=None)
    for _ in range(2):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qg, kg, vg, causal=True)
        out.backward(dout)
        check_close(out, ref.out, naive.out, torch.float16, "out")
        for t, want, approx, name in zip((qg, kg, vg), ref_grads, naive_grads, ("dq", "dk", "dv")):
            check_close(t.grad, want, approx, torch.float16, name, grad=True, floor=floor)
        step_out = flash_attn_with_kvcache(step_q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
        check_close(step_out, step_ref.out, step_naive.out, torch.float16, "decode out")
        assert dispatch.last_backend() == "interpret"
    assert general_route == []


def test_a_held_packed_signature_still_checks_each_calls_bounds(launches, general_route):
    """cu_seqlens' values are no part of a signature: a later call of a held one whose bounds do
    not fit its longest length is refused as the first call would be (CPU tensors: read on the host)."""
    g = torch.Generator().manual_seed(10)
    q, k, v, cu, longest = _packed(96, [40, 70], g)
    flash_attn_varlen_func(q, k, v, cu, cu, longest, longest)
    too_long = torch.tensor([0, 41, 70, 96], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(40\) is smaller than the longest sequence"):
        flash_attn_varlen_func(q, k, v, too_long, too_long, longest, longest)
    assert general_route == []


def test_held_packed_batches_compute_what_the_oracle_does(general_route, interpreter, monkeypatch):
    """Through Triton's interpreter: a packed batch's forward + backward in two layers, then other
    sequence bounds and another total under the same signature (the held plan with other
    cu_seqlens and row counts), against the float64 oracle."""
    monkeypatch.setattr(validation, "_checked", {})
    from support.oracle import attention_varlen_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import backward_floor, check_close  # noqa: PLC0415

    g = torch.Generator().manual_seed(9)
    q_all, k_all, v_all, _, _ = _packed(40, [17, 30], g)
    dout_all = torch.randn(40, 2, 32, generator=g).half()
    # the same signature every time: the longest lengths (17, 17, 17, 12) in one bucket; the last
    # batch has another total (the held plan takes the row counts per call)
    for bounds in ([0, 17, 30, 40], [0, 17, 30, 40], [0, 6, 23, 40], [0, 12, 21, 33]):
        total, longest = bounds[-1], max(b - a for a, b in zip(bounds, bounds[1:]))
        q, k, v, dout = (t[:total] for t in (q_all, k_all, v_all, dout_all))
        ref, ref_grads, naive, naive_grads = oracle_pair(attention_varlen_ref, [q, k, v], dout, cu_q=bounds,
                                                         cu_k=bounds, causal=True)
        floor = backward_floor(q, k, v, dout)
        cu = torch.tensor(bounds, dtype=torch.int32)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = flash_attn_varlen_func(qg, kg, vg, cu, cu, longest, longest, causal=True)
        out.backward(dout)
        assert dispatch.last_backend() == "interpret"
        check_close(out, ref.out, naive.out, torch.float16, f"out {bounds}")
        for t, want, approx, name in zip((qg, kg, vg), ref_grads, naive_grads, ("dq", "dk", "dv")):
            check_close(t.grad, want, approx, torch.float16, f"{name} {bounds}", grad=True, floor=floor)
    # one checked result per class: the batches' and their options'
    assert general_route == [] and len({key for _, key in validation._checked.values()}) == 2



# ---------------------------------------------------------------------------------------------
# A signature's lane (dispatch.run_lane): once the known route has run a signature with aligned
# pointers, its later eager calls (a dense forward without dropout and nothing to record straight
# from the custom op's entry; the rest inside the known route) run the held plan with nothing
# looked up; a changed setting, a new chain, forgotten plans, a failed backend or a misaligned
# pointer (the tests above) close it for the call.


@pytest.fixture
def known_lookups(monkeypatch) -> list:
    """The known routes looked up from now on (a lane's call looks up none)."""
    looked: list = []
    real = dispatch._first_route

    def first_route(device, kind, op):
        if kind == "known":
            looked.append(op)
        return real(device, kind, op)

    monkeypatch.setattr(dispatch, "_first_route", first_route)
    return looked


def test_a_signatures_later_calls_take_its_lane(launches, general_route, known_lookups):
    """From its third call, a signature's no-grad forward, decode step and packed forward run on
    the lane (made at the second: a signature met once makes none): no known route looked up, the
    very launches the planner gives, on the triton backend."""
    q, k, v = _qkv(2, 64, 4, 64)
    step = _decode_step(torch.Generator().manual_seed(12))
    packed = _packed(96, [40, 70], torch.Generator().manual_seed(13))
    expected = (list(_forward_plan(q, k, v).launches), None, _packed_plans(*packed))
    for n in range(4):
        known_lookups.clear()
        made = []
        for call in (lambda: flash_attn_func(q, k, v, causal=True),
                     lambda: flash_attn_with_kvcache(step[0], step[1], step[2], cache_seqlens=step[3], causal=True),
                     lambda: flash_attn_varlen_func(*packed[:3], packed[3], packed[3], packed[4], packed[4],
                                                    causal=True)):
            launches.clear()
            call()
            made.append(list(launches))
            assert dispatch.last_backend() == "triton"
        assert known_lookups == ([] if n > 1 else ["forward", "forward_kvcache", "forward"])
        assert made[0] == expected[0] and made[2] == expected[2] and made[1]
        if n:
            assert made[1] == first_step
        first_step = made[1]
    assert general_route == []


def test_a_lane_follows_the_backend_setting_and_the_chain(launches, known_lookups, monkeypatch):
    """A held lane serves only the settings and chain it was held under: another backend setting
    runs that backend (then the lane serves again once the setting is back), and a chain worked
    out anew (what dispatch.reset() and a changed installation give) holds its own lanes."""
    q, k, v = _qkv(1, 32, 2, 64)
    for _ in range(3):
        flash_attn_func(q, k, v)
    launches.clear()
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    out = flash_attn_func(q, k, v)
    assert launches == [] and dispatch.last_backend() == "reference"
    torch.testing.assert_close(out.double(), _plain_attention(q, k, v), rtol=2e-3, atol=2e-3)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "triton")
    known_lookups.clear()
    flash_attn_func(q, k, v)
    assert launches and known_lookups == [] and dispatch.last_backend() == "triton"
    monkeypatch.setattr(dispatch, "_chains", {})
    for _ in range(3):
        flash_attn_func(q, k, v)
    assert known_lookups == ["forward"] * 2  # the new chain's: the known route twice, then its lane


def test_forgotten_or_replaced_plans_close_the_lane(launches, known_lookups, monkeypatch):
    """Forgotten plans (the tuning sweep's) and a plan cache replaced (the aot backend's images of
    another installation) close the lane: the next call is described and planned again, and the
    one after it takes the lane of the new plan."""
    q, k, v = _qkv(2, 64, 4, 64)
    expected = list(_forward_plan(q, k, v).launches)
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True)
    described = _described(monkeypatch)
    for forget in (triton_backend._backend.forget_plans,
                   lambda: monkeypatch.setattr(triton_backend._backend, "plans", PlanCache())):
        forget()
        described.clear()
        known_lookups.clear()
        for _ in range(2):
            launches.clear()
            flash_attn_func(q, k, v, causal=True)
            assert launches == expected
        assert described == [1] and known_lookups == ["forward"]


def test_a_decode_step_on_its_lane_still_checks_the_cache_lengths(launches):
    """cache_seqlens' values are no part of a signature: on the lane too a step whose lengths do not
    fit the cache is refused (CPU tensors: read on the host), as the first call would be."""
    q, k_cache, v_cache, seqlens = _decode_step(torch.Generator().manual_seed(14))
    k_new = torch.randn(2, 1, 2, 64).half()
    for _ in range(2):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=seqlens, causal=True)
    with pytest.raises(ValueError, match="kv cache too small for the append"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=torch.tensor([5, 64], dtype=torch.int32),
                                causal=True)


def test_a_training_steps_backward_takes_its_lane(launches, general_route, known_lookups):
    """From a signature's third training step its backward runs on the lane too (made at the
    second): no known route looked up, the very launches of the first step's backward. The lane
    holds the gradient's strides: a gradient of the same shape and other strides (a transposed
    view's) leaves it for the known route, whose plan then serves the lane, and back."""
    q, k, v = (t.requires_grad_() for t in _qkv(2, 64, 4, 64))
    dout = torch.randn(2, 64, 4, 64).half()
    other = torch.randn(2, 4, 64, 64).half().transpose(1, 2)
    for n in range(4):
        known_lookups.clear()
        launches.clear()
        flash_attn_func(q, k, v, causal=True).backward(dout)
        assert known_lookups == ([] if n > 1 else ["forward", "backward"]), n
        if n == 0:
            first = [launch for launch in launches if launch.kernel != "attn_fwd_kernel"]
        assert [launch for launch in launches if launch.kernel != "attn_fwd_kernel"] == first
    for gradient, route in ((other, ["backward"]), (other, []), (other, []), (dout, ["backward"]), (dout, [])):
        known_lookups.clear()
        flash_attn_func(q, k, v, causal=True).backward(gradient)
        assert known_lookups == route
    assert general_route == [] and dispatch.last_backend() == "triton"


def test_a_backward_on_its_lane_computes_what_the_oracle_does(general_route, interpreter, known_lookups):
    """Through Triton's interpreter: a signature's training steps, the third and fourth with the
    backward on its lane, against the float64 oracle's gradients."""
    from support.oracle import attention_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import check_close  # noqa: PLC0415

    g = torch.Generator().manual_seed(16)
    q, k, v, dout = (torch.randn(1, 24, 2, 32, generator=g).half() for _ in range(4))
    _, ref_grads, _, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, causal=True)
    for n in range(4):
        known_lookups.clear()
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        flash_attn_func(*inputs, causal=True).backward(dout)
        for name, t, ref, naive in zip(("dq", "dk", "dv"), inputs, ref_grads, naive_grads):
            check_close(t.grad, ref, naive, torch.float16, f"{name}, step {n}", grad=True)
        assert dispatch.last_backend() == "interpret"
        assert known_lookups == ([] if n > 1 else ["forward", "backward"]), n
    assert general_route == []


def test_lanes_compute_what_the_oracle_does(general_route, interpreter, known_lookups):
    """Through Triton's interpreter: no-grad forwards of one signature (with the probabilities asked
    for, and with sinks) and decode steps, the third and fourth on their lanes, against the float64
    oracle."""
    from support.oracle import attention_ref, kvcache_ref  # noqa: PLC0415
    from support.tolerance import check_close  # noqa: PLC0415

    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, 24, 2, 32, generator=g).half() for _ in range(3))
    sinks = torch.randn(2, generator=g)
    want = {name: (attention_ref(q, k, v, causal=True, sinks=s), attention_ref(q, k, v, causal=True, sinks=s,
                                                                                 compute_dtype=None))
            for name, s in (("plain", None), ("sinks", sinks))}
    step_q, k_cache, v_cache = (torch.randn(2, 1, 2, 32, generator=g).half(),
                                *(torch.randn(2, 40, 1, 32, generator=g).half() for _ in range(2)))
    seqlens = torch.tensor([7, 33], dtype=torch.int32)
    step_ref = kvcache_ref(step_q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    step_naive = kvcache_ref(step_q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, compute_dtype=None)
    for n in range(4):
        known_lookups.clear()
        out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        ref, naive = want["plain"]
        check_close(out, ref.out, naive.out, torch.float16, f"out, call {n}")
        torch.testing.assert_close(lse.double(), ref.lse, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(probs.double(), ref.probs, rtol=0, atol=2e-3)
        out = flash_attn_func(q, k, v, causal=True, learnable_sink=sinks)
        ref, naive = want["sinks"]
        check_close(out, ref.out, naive.out, torch.float16, f"out with sinks, call {n}")
        step_out = flash_attn_with_kvcache(step_q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
        check_close(step_out, step_ref.out, step_naive.out, torch.float16, f"decode out, call {n}")
        assert dispatch.last_backend() == "interpret"
        assert known_lookups == ([] if n > 1 else ["forward", "forward", "forward_kvcache"])
    assert general_route == []


# ---------------------------------------------------------------------------------------------
# A new key length (a decode loop's growing cache): filled in from its layout's template
# (flash_attn.planning.extents), not planned again.


def _growing(layout: str, length: int, g) -> list:
    """q of one token and k, v of ``length`` keys as a decode loop passes them: contiguous, or
    Hugging Face's cache ``(b, hk, s, d)`` transposed."""
    q = torch.randn(1, 1, 4, 64, generator=g).half()
    if layout == "hf":
        return [q, *(torch.randn(1, 2, length, 64, generator=g).half().transpose(1, 2) for _ in range(2))]
    return [q, *(torch.randn(1, length, 2, 64, generator=g).half() for _ in range(2))]


def test_a_new_key_length_is_filled_in_from_its_layouts_template(launches, general_route, monkeypatch):
    """Every key length of both layouts is one class of signatures: checked once, on the first
    call; each later signature has a params.KeyLengths key, and its first call is filled in
    from the class's one template (described once, at the class's first such call) and held under
    the signature's own key, which a length met again finds, on the known route and then on the
    class's lane: each call's launches are the planner's own for its length."""
    from flash_attn import flash_attn_interface  # noqa: PLC0415

    made, checks = [], []
    real, real_checks = P.template, flash_attn_interface._dense_checks
    monkeypatch.setattr(P, "template", lambda *a: made.append(1) or real(*a))
    monkeypatch.setattr(flash_attn_interface, "_dense_checks", lambda *a: checks.append(1) or real_checks(*a))
    keys = _known_keys(monkeypatch)
    described, calls_described = _described(monkeypatch), []
    g = torch.Generator().manual_seed(4)
    for layout in ("contiguous", "hf"):
        for length in (40, 57, 1, 300, 57):
            q, k, v = _growing(layout, length, g)
            launches.clear()
            described.clear()
            flash_attn_func(q, k, v, causal=True)
            calls_described.append(len(described))
            assert launches == list(_forward_plan(q, k, v).launches), (layout, length)
    assert made == [1]  # one template for both layouts (strides are filled in too), every length filled in
    assert checks == [1] and calls_described == [1, 1] + [0] * 8  # the first call, the class's first
    # on the known route: the first call, and the class's first two joining calls, which hold the
    # class's lane for every later one (57 met again: its signature's plan, held)
    assert [type(key) for key in keys] == [int, params.KeyLengths, params.KeyLengths]
    assert keys[1].shared == keys[2].shared and keys[1].own != keys[2].own and general_route == []


def _known_keys(monkeypatch) -> list:
    """The keys of the forward calls that take the known route from now on."""
    keys: list = []
    real = dispatch.run_known

    def run_known(op, device, call, *args):
        if op == "forward":
            keys.append(call)
        return real(op, device, call, *args)

    monkeypatch.setattr(dispatch, "run_known", run_known)
    return keys


def _class_key():
    """What flash_attn_func's one class of signatures holds (checked_call's: the checks' result and
    the class's key)."""
    [found] = [found for (tag, *rest), found in validation._checked.items() if tag == "flash_attn_func"
               and rest[0] == "class"]
    return found


def test_calls_outside_a_key_length_class_are_checked_and_planned_on_their_own(launches, monkeypatch):
    """Once a layout's class is known, a call that differs in more than its key length and strides
    is not in it: k and v of different lengths, or a last dimension not contiguous, still fail
    their checks; strides the kernels do not read in place (copied first), dropout and the
    probabilities asked for are checked on their own and run the planner's plan for them."""
    from flash_attn import flash_attn_interface  # noqa: PLC0415
    from flash_attn.params import AttentionParams  # noqa: PLC0415

    checks = []
    real_checks = flash_attn_interface._dense_checks
    monkeypatch.setattr(flash_attn_interface, "_dense_checks", lambda *a: checks.append(1) or real_checks(*a))
    g = torch.Generator().manual_seed(6)
    q, k, v = _growing("hf", 40, g)
    flash_attn_func(q, k, v, causal=True)
    class_key = _class_key()
    assert checks == [1]
    with pytest.raises(ValueError, match="k and v must agree"):
        flash_attn_func(q, k, v[:, :39], causal=True)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        flash_attn_func(q, k, torch.randn(1, 2, 64, 41, generator=g).half().permute(0, 3, 1, 2)[:, :, :, :64])
    padded = [torch.randn(1, 41, 2, 66, generator=g).half()[..., :64] for _ in range(2)]  # head stride 66
    plan = P.plan_forward(P.describe_forward(q, *padded, AttentionParams(64 ** -0.5, -1, 0)), H100)
    checks.clear()
    for args, kwargs in (((q, *padded), {}), ((q, k, v), dict(return_attn_probs=True)),
                         ((q, k, v), dict(dropout_p=0.1))):
        launches.clear()
        flash_attn_func(*args, causal=True, **kwargs)
        if not kwargs:
            assert launches == list(plan.launches) and plan.prepare  # copied into the kernels' layout first
    assert checks == [1, 1, 1] and _class_key() == class_key


def test_forgotten_plans_close_a_key_length_classs_lane(launches, monkeypatch):
    """The class's lane serves only the plans it came from: once they are forgotten (the tuning
    sweep), a new length takes the known route again, is described and planned afresh, and runs
    the planner's plan; the class's lane is held again from it."""
    keys = _known_keys(monkeypatch)
    g = torch.Generator().manual_seed(10)
    for length in (40, 41, 42, 43):
        flash_attn_func(*_growing("hf", length, g), causal=True)
    assert len(keys) == 3  # the fourth on the class's lane
    triton_backend._backend.forget_plans()
    described = _described(monkeypatch)
    for length in (44, 45, 46, 47):
        q, k, v = _growing("hf", length, g)
        launches.clear()
        flash_attn_func(q, k, v, causal=True)
        assert launches == list(_forward_plan(q, k, v).launches), length
    assert len(keys) == 4 and len(described) == 1 + 4  # 44 on the known route, described; 4 by the test


def test_a_misaligned_member_of_a_key_length_class_gets_its_own_plan(launches):
    """A pointer's alignment is no part of a signature: a call of the class whose k starts off a
    16-byte boundary runs the planner's plan for it (a copy first), not the class's template, and
    the class's aligned calls still run theirs."""
    g = torch.Generator().manual_seed(7)
    for length, misalign in ((40, False), (41, False), (42, True), (43, False), (44, True), (45, False)):
        q, k, v = _growing("contiguous", length, g)
        if misalign:
            k = _misaligned(k)
        launches.clear()
        flash_attn_func(q, k, v, causal=True)
        assert launches == list(_forward_plan(q, k, v).launches), (length, misalign)


def test_the_backward_of_a_key_length_class_follows_each_calls_length(launches):
    """A training call of a class's layout (grad on): the backward's plans are found by the
    forward's key and the call's own key length and k/v strides, so each length's backward runs
    the planner's plan for that length, however the calls interleave."""
    from flash_attn.params import AttentionParams  # noqa: PLC0415

    params = AttentionParams(64 ** -0.5, -1, 0)
    g = torch.Generator().manual_seed(8)
    calls = {length: [t.requires_grad_() for t in _growing(layout, length, g)]
             for length, layout in ((40, "hf"), (57, "contiguous"), (24, "hf"))}
    for length in (40, 57, 40, 24, 57):
        q, k, v = calls[length]
        out = flash_attn_func(q, k, v, causal=True)
        dout = torch.randn(out.shape, generator=g).half()
        lse = torch.empty(1, 4, 1, dtype=torch.float32)
        want = list(P.plan_backward(P.describe_backward(dout, q, k, v, out.detach(), lse, params), H100).launches)
        launches.clear()
        out.backward(dout)
        assert launches == want, length


def test_new_key_lengths_compute_what_the_oracle_does(interpreter):
    """Through Triton's interpreter: each step of a growing cache against the float64 oracle."""
    from support.oracle import attention_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import check_close  # noqa: PLC0415

    g = torch.Generator().manual_seed(5)
    for layout in ("contiguous", "hf"):
        for length in (9, 23, 24):
            q, k, v = _growing(layout, length, g)
            out = flash_attn_func(q, k, v, causal=True)
            assert dispatch.last_backend() == "interpret"
            ref, _, naive, _ = oracle_pair(attention_ref, [q, k, v], causal=True)
            check_close(out, ref.out, naive.out, torch.float16, f"out ({layout}, {length} keys)")


def test_training_calls_of_a_key_length_class_compute_what_the_oracle_does(interpreter, monkeypatch):
    """Through Triton's interpreter: forward and backward of one layout's calls of several key
    lengths (one class of signatures), interleaved, against the float64 oracle."""
    from support.oracle import attention_ref, oracle_pair  # noqa: PLC0415
    from support.tolerance import backward_floor, check_close  # noqa: PLC0415

    monkeypatch.setattr(validation, "_checked", {})

    keys = _known_keys(monkeypatch)
    g = torch.Generator().manual_seed(9)
    for length in (9, 23, 9, 16):
        q, k, v = _growing("hf", length, g)
        dout = torch.randn(q.shape, generator=g).half()
        ref, ref_grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, causal=True)
        floor = backward_floor(q, k, v, dout, probs=ref.probs)
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qg, kg, vg, causal=True)
        out.backward(dout)
        assert dispatch.last_backend() == "interpret"
        check_close(out, ref.out, naive.out, torch.float16, f"out ({length} keys)")
        for t, want, approx, name in zip((qg, kg, vg), ref_grads, naive_grads, ("dq", "dk", "dv")):
            check_close(t.grad, want, approx, torch.float16, f"{name} ({length} keys)", grad=True, floor=floor)
    assert [type(key) for key in keys] == [int, params.KeyLengths, int, params.KeyLengths]
