"""The public functions check argument metadata once per call signature
(:func:`flash_attn.validation.checked`): a later call that looks the same to the checks skips
them, and nothing the checks refuse gets through because an equal-looking call passed before."""

from __future__ import annotations

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, validation


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 8, 2, 16, generator=g, dtype=dtype) for _ in range(3)]


def _naive(q, k, v, causal):
    # (b, s, h, d) float64 oracle
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.fixture(autouse=True)
def _fresh_memo():
    validation._checked.clear()
    yield
    validation._checked.clear()


def test_a_repeated_call_skips_the_checks_and_gives_the_same_answer(monkeypatch):
    q, k, v = _qkv()
    first = flash_attn_func(q, k, v, causal=True)
    calls = []
    real = validation.check_dense_qkv
    monkeypatch.setattr(validation, "check_dense_qkv", lambda *a: calls.append(1) or real(*a))
    second = flash_attn_func(q, k, v, causal=True)
    assert calls == []  # the signature was known
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(second.double(), _naive(q, k, v, True), rtol=1e-4, atol=1e-5)
    # another shape, another signature: checked again
    q2, k2, v2 = (t[:, :4] for t in (q, k, v))
    flash_attn_func(q2, k2, v2, causal=True)
    assert calls == [1]


@pytest.mark.parametrize("name, good, bad", [
    ("softcap", 1, True),  # equal to 1 as a key, but a bool is refused
    ("dropout_p", 0, False),
    ("causal", 1, 1.0),  # 1 is a flag, 1.0 is not
    ("window_size", (1, 0), (True, 0)),
    ("window_size", (1, 0), (1.0, 0)),
    ("deterministic", 0, 0.0),
])
def test_an_equal_looking_bad_argument_is_still_refused(name, good, bad):
    q, k, v = _qkv()
    flash_attn_func(q, k, v, **{name: good})
    flash_attn_func(q, k, v, **{name: good})
    with pytest.raises((TypeError, ValueError), match=name):
        flash_attn_func(q, k, v, **{name: bad})


def test_a_refused_call_is_never_remembered():
    q, k, v = _qkv()
    for _ in range(2):
        with pytest.raises(ValueError, match="softcap"):
            flash_attn_func(q, k, v, softcap=-1.0)
    assert not validation._checked


def test_other_layouts_dtypes_and_devices_are_new_signatures():
    q, k, v = _qkv()
    flash_attn_func(q, k, v)
    # a non-contiguous last dimension looks different (strides): refused, not waved through
    bad_q = torch.randn(1, 8, 16, 2).transpose(-1, -2)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        flash_attn_func(bad_q, k, v)
    with pytest.raises(TypeError, match="k has dtype torch.float16 but q has torch.float32"):
        flash_attn_func(q, k.half(), v)
    with pytest.raises(ValueError, match="device"):
        flash_attn_func(q, k.to("meta"), v)


def test_unhashable_arguments_and_subclasses_are_checked_every_time(monkeypatch):
    class Sub(torch.Tensor):
        pass

    q, k, v = _qkv()
    calls = []
    real = validation.check_dense_qkv
    monkeypatch.setattr(validation, "check_dense_qkv", lambda *a: calls.append(1) or real(*a))
    for _ in range(2):
        flash_attn_func(q, k, v, window_size=[2, 0])  # a list: no key
    assert calls == [1, 1] and not validation._checked
    with pytest.raises(TypeError):
        validation.signature((q.as_subclass(Sub),), ())


def test_varlen_and_kvcache_options_are_remembered_and_still_right():
    q, k, v = (t[0] for t in _qkv())  # (8, 2, 16) packed rows
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for _ in range(2):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    for b, (s, e) in enumerate([(0, 3), (3, 8)]):
        want = _naive(q[None, s:e], k[None, s:e], v[None, s:e], True)[0]
        torch.testing.assert_close(out[s:e].double(), want, rtol=1e-4, atol=1e-5)
    k_cache, v_cache = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)
    qd, kd, vd = (torch.randn(2, 1, 2, 16) for _ in range(3))
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    for _ in range(2):
        flash_attn_with_kvcache(qd, k_cache, v_cache, kd, vd, cache_seqlens=seqlens)
    assert any(key[0] == "flash_attn_with_kvcache" for key in validation._checked)
    # an int cache_seqlens (no signature: checked each time) and a wrong-shaped one are still refused
    with pytest.raises(TypeError, match="cache_seqlens"):
        flash_attn_with_kvcache(qd, k_cache, v_cache, kd, vd, cache_seqlens=seqlens[:1])
    with pytest.raises(ValueError, match="cache"):
        flash_attn_with_kvcache(qd, k_cache, v_cache, kd, vd, cache_seqlens=16)


def test_qv_and_learnable_sink_are_part_of_the_signature():
    """qv and learnable_sink are checked tensors of the signature: after a call without them (or
    with good ones) passed, a bad one is still refused, and a good one still changes the answer."""
    q, k, v = _qkv()
    sinks = torch.tensor([0.5, -1.0])
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    k_cache, v_cache = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    calls = {
        "dense": lambda **kw: flash_attn_func(q, k, v, **kw),
        "varlen": lambda **kw: flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, **kw),
        "kvcache": lambda **kw: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=8, **kw),
    }
    for name, call in calls.items():
        for _ in range(2):
            plain = call()
            with_sinks = call(learnable_sink=sinks)
        assert not torch.equal(plain, with_sinks), name
        for bad, error in ((sinks[:1], ValueError), (sinks.double(), TypeError), ([0.5, -1.0], TypeError),
                           (sinks.to("meta"), ValueError)):
            with pytest.raises(error, match="learnable_sink"):
                call(learnable_sink=bad)
        good_qv = torch.randn_like(q if name != "varlen" else q[0])
        call(qv=good_qv)
        call(qv=good_qv)
        with pytest.raises(ValueError, match="qv"):
            call(qv=good_qv[..., :8])
        with pytest.raises(TypeError, match="qv"):
            call(qv=good_qv.double())
    # the sinks' answer, against a naive oracle: one more score column of the sink's value, no value row
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = qd @ kd.transpose(-1, -2) / 16 ** 0.5
    logits = torch.cat([scores, sinks.double().view(1, 2, 1, 1).expand(1, 2, 8, 1)], dim=-1)
    want = (logits.softmax(-1)[..., :-1] @ vd).transpose(1, 2)
    torch.testing.assert_close(flash_attn_func(q, k, v, learnable_sink=sinks).double(), want, rtol=1e-4, atol=1e-5)


def test_a_packed_batch_is_checked_once_and_a_new_batch_not_its_options(monkeypatch):
    """A packed batch's tensors are checked once per signature (every layer of a step repeats
    it, and so does a new batch with other totals whose longest lengths fall in the same
    buckets); a batch in another bucket is a new signature whose options are not checked again; a
    bad packed call that looks like a good one apart from a row count is still refused."""
    q, k, v = (torch.randn(300, 2, 16, generator=torch.Generator().manual_seed(1))[:8] for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    seen = {"qkv": 0, "options": 0}
    real_qkv, real_options = validation.check_varlen_qkv, validation.check_options
    monkeypatch.setattr(validation, "check_varlen_qkv",
                        lambda *a: seen.__setitem__("qkv", seen["qkv"] + 1) or real_qkv(*a))
    monkeypatch.setattr(validation, "check_options",
                        lambda *a: seen.__setitem__("options", seen["options"] + 1) or real_options(*a))
    for _ in range(2):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    assert seen == {"qkv": 1, "options": 1}
    six = torch.tensor([0, 2, 6], dtype=torch.int32)
    small = flash_attn_varlen_func(q[:6], k[:6], v[:6], six, six, 4, 4, causal=True)  # a new batch, the same buckets
    assert seen == {"qkv": 1, "options": 1}
    whole = [t._base for t in (q, k, v)]  # 300 rows, a sequence of 200: the longest lengths' next bucket
    long_cu = torch.tensor([0, 200, 300], dtype=torch.int32)
    long = flash_attn_varlen_func(*whole, long_cu, long_cu, 200, 200, causal=True)
    assert seen == {"qkv": 2, "options": 1}
    # the longest lengths as 0-d tensors (transformers passes them): read as ints, the same signature
    flash_attn_varlen_func(q, k, v, cu, cu, torch.tensor(5), torch.tensor(5), causal=True)
    assert seen["qkv"] == 2
    for got, rows, bounds in ((out, (q, k, v), [0, 3, 8]), (small, (q, k, v), [0, 2, 6]), (long, whole, [0, 200, 300])):
        for s, e in zip(bounds, bounds[1:]):
            want = _naive(*(t[None, s:e] for t in rows), True)[0]
            torch.testing.assert_close(got[s:e].double(), want, rtol=1e-4, atol=1e-5)
    # row counts that a batch's class does not hold but the checks compare: a known class, still refused
    qv = torch.randn(300, 2, 16)
    flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, qv=qv[:8])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attn_varlen_func(q, k, v._base[:7], cu, cu, 5, 5, causal=True)
    with pytest.raises(ValueError, match=r"qv must have shape \(total_q, nheads, headdim_v\)"):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, qv=qv[:7])


@pytest.mark.parametrize("bad", ["q", "k", "v", "qv"])
def test_a_packed_tensor_without_rows_is_refused_when_its_class_is_known(bad):
    """A 0-d tensor where packed rows belong (no class of batches: it has no row count) gets the
    checks' error, before and after a good batch made the class it would otherwise join."""
    q, k, v, qv = (torch.randn(8, 2, 16) for _ in range(4))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    args = dict(q=q, k=k, v=v, qv=qv)
    args[bad] = torch.tensor(1.0)
    for _ in range(2):
        with pytest.raises(ValueError, match=f"{bad} must have shape"):
            flash_attn_varlen_func(args["q"], args["k"], args["v"], cu, cu, 5, 5, qv=args["qv"])
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, qv=qv)
