"""A dense forward's plan is shared by every key length (and k/v strides) of its layout: the
backends plan the first call of a shared key and fill each later call's numbers into that template
(:mod:`flash_attn.planning.extents`). The oracle is the planner itself: for two calls with the same
shared key, the template of one filled with the other's numbers must be the very plan the planner
makes for the other, on every family, ahead of time and JIT."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_attn.params import AttentionParams
from flash_attn.planning import families
from flash_attn.planning import plan as P

TARGETS = [P.Target(name, 132, aot=aot) for name in families.FAMILIES for aot in (False, True)] + [
    P.Target("interpret", 4)]


def _kv(batch: int, length: int, heads_k: int, head_dim: int, dtype, layout: str) -> torch.Tensor:
    """k or v of ``length`` keys as a caller lays them out: contiguous ``(b, s, hk, d)``; Hugging
    Face's cache ``(b, hk, s, d)`` transposed (its head stride grows with the length); a prefix of a
    longer preallocated cache (strides of the capacity, not the length)."""
    if layout == "contiguous":
        return torch.empty(batch, length, heads_k, head_dim, dtype=dtype)
    if layout == "hf":
        return torch.empty(batch, heads_k, length, head_dim, dtype=dtype).transpose(1, 2)
    return torch.empty(batch, length + 37, heads_k, head_dim, dtype=dtype)[:, :length]


def _shape(q, k, v, causal: bool, window: int, softcap: float, alibi, sinks):
    params = AttentionParams(q.shape[-1] ** -0.5, window, 0 if causal else -1, softcap)
    return P.describe_forward(q, k, v, params, alibi_slopes=alibi, sinks=sinks)


calls = st.fixed_dictionaries({
    "batch": st.integers(1, 3), "seqlen_q": st.sampled_from([1, 7, 64, 130]), "heads": st.sampled_from([(4, 4), (8, 2), (4, 1)]),
    "head_dims": st.sampled_from([(64, 64), (128, 128), (96, 96), (256, 256), (192, 128), (40, 40)]),
    "dtype": st.sampled_from([torch.float16, torch.bfloat16]),
    "layouts": st.lists(st.sampled_from(["contiguous", "hf", "prefix"]), min_size=4, max_size=4),
    "causal": st.booleans(), "window": st.sampled_from([-1, 16]), "softcap": st.sampled_from([0.0, 20.0]),
    "alibi": st.booleans(), "sinks": st.booleans(),
    "lengths": st.lists(st.integers(1, 3000), min_size=2, max_size=4, unique=True),
})


@settings(max_examples=120, deadline=None)
@given(call=calls, target=st.sampled_from(TARGETS))
def test_a_filled_template_is_the_plan_of_its_call(call, target):
    batch, (heads, heads_k), (d, dv), dtype = call["batch"], call["heads"], call["head_dims"], call["dtype"]
    q = torch.empty(batch, call["seqlen_q"], heads, d, dtype=dtype)
    alibi = torch.empty(heads, dtype=torch.float32) if call["alibi"] else None
    sinks = torch.empty(heads, dtype=torch.float32) if call["sinks"] else None
    shapes = []
    shared, extents = P.SHARED_KEYS[P.plan_forward]
    read = P.extent_reader(tuple(("kv".index(e.slot), e) for e in extents.values()))
    for length, layout in zip(call["lengths"], call["layouts"]):  # any layout the kernels read in place shares
        k = _kv(batch, length, heads_k, d, dtype, layout)
        v = _kv(batch, length, heads_k, dv, dtype, layout)
        shapes.append(_shape(q, k, v, call["causal"], call["window"], call["softcap"], alibi, sinks))
        # the numbers a class's call passes, read from its tensors at once, are those of its description
        assert read([(k.shape, k.stride()), (v.shape, v.stride())]) == tuple(e.of(shapes[-1]) for e in extents.values())
    keys = [shared(s) for s in shapes]
    assert all(key is not None for key in keys)  # these layouts all fit the kernels: every length shares
    assert len(set(keys)) == 1
    first = P.plan_forward(shapes[0], target)
    for s in shapes[1:]:
        planned = P.plan_forward(s, target)
        if isinstance(first, P.Refusal):
            assert planned == first  # a refusal of the layout holds for every length
            continue
        assert P.filled(P.template(first, extents, shapes[0]), lambda extent: extent.of(s)) == planned


def test_what_is_not_shared():
    """Packed calls (shared through their row counts already), return_attn_probs (sized by the
    key length), k or v the kernels cannot read where they lie (copied first: the copy's strides
    are the plan's), and a stride beyond int32 get no shared key; a different layout another one."""
    q = torch.empty(1, 8, 4, 64, dtype=torch.float16)
    k = v = torch.empty(1, 100, 4, 64, dtype=torch.float16)
    params = AttentionParams(0.125)
    shared = P.SHARED_KEYS[P.plan_forward][0]
    assert shared(P.describe_forward(q, k, v, params)) is not None
    assert shared(P.describe_forward(q, k, v, params, return_softmax=True)) is None
    odd = torch.empty(1, 100, 4, 68, dtype=torch.float16)[..., :64]  # rows of 68 elements: not a multiple of 8
    assert shared(P.describe_forward(q, odd, v, params)) is None
    unaligned = torch.empty(1 * 100 * 4 * 64 + 1, dtype=torch.float16)[1:].view(1, 100, 4, 64)
    assert shared(P.describe_forward(q, unaligned, v, params)) is None
    huge = torch.empty(2**32, dtype=torch.float16, device="meta").as_strided((2, 1, 4, 64), (2**31, 256, 64, 1))
    q2 = torch.empty(2, 8, 4, 64, dtype=torch.float16, device="meta")
    big = huge.as_strided(huge.shape, (2**30, 256, 64, 1))
    assert shared(P.describe_forward(q2, big, big, params)) is not None
    assert shared(P.describe_forward(q2, big, huge, params)) is None
    from flash_attn.params import VarlenLayout  # noqa: PLC0415

    cu = torch.tensor([0, 8], dtype=torch.int32)
    packed = P.describe_forward(q[0], k[0], v[0], params, VarlenLayout(cu, torch.tensor([0, 100], dtype=torch.int32), 8, 100))
    assert shared(packed) is None
    other_heads = torch.empty(1, 100, 2, 64, dtype=torch.float16)
    assert shared(P.describe_forward(q, other_heads, other_heads, params)) != shared(P.describe_forward(q, k, v, params))


def test_no_template_stands_for_an_argument_the_call_does_not_hold(monkeypatch):
    """A template leaves an argument to the call only where it holds what the call's extent says:
    otherwise (a planner that derived it some other way) there is none, and the backends plan each
    call of that key by itself (the triton backend planning for an H100, launches recorded)."""
    from flash_attn import dispatch, flash_attn_func  # noqa: PLC0415
    from flash_attn.backends import triton as triton_backend  # noqa: PLC0415
    from flash_attn.backends._execute import PlanCache  # noqa: PLC0415

    q = torch.empty(1, 8, 4, 64, dtype=torch.float16)
    k = v = torch.empty(1, 100, 4, 64, dtype=torch.float16)
    s = P.describe_forward(q, k, v, AttentionParams(0.125))
    plan = P.plan_forward(s, P.Target("sm90", 132))
    assert P.template(plan, {"seqlen_q": P.Extent("k", 1)}, s) is None  # seqlen_q (8) is not k's length
    assert P.template(plan, P.KEY_EXTENTS, s) is not None

    monkeypatch.setitem(P.SHARED_KEYS, P.plan_forward, (P.shared_by_key_lengths, {"seqlen_q": P.Extent("k", 1)}))
    monkeypatch.setattr(dispatch, "_chains", {})
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "triton")
    monkeypatch.setattr(triton_backend.BACKEND, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(triton_backend._backend, "target", lambda device: P.Target("sm90", 132))
    monkeypatch.setattr(triton_backend._backend, "plans", PlanCache())
    made: list = []
    monkeypatch.setattr(triton_backend._backend, "run_launch", lambda launch, tensors, device: made.append(launch))
    g = torch.Generator().manual_seed(0)
    for length in (100, 120):
        q, k, v = (torch.randn(1, n, 4, 64, generator=g).half() for n in (8, length, length))
        made.clear()
        flash_attn_func(q, k, v)
        assert made == list(P.plan_forward(P.describe_forward(q, k, v, AttentionParams(0.125)), P.Target("sm90", 132)).launches)
