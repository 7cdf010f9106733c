"""Property test: special values (NaN, +-inf, huge and tiny magnitudes) on every backend this
machine can run, against the float64 oracle and against each other, over shapes and features.

The semantics are upstream's kernels' (the oracle's docstring, ``support/oracle.py``): a NaN or
+inf among a row's visible scores makes its output and lse NaN, and the backward agrees (that row's
dq is NaN); a row whose visible scores are all -inf sees no key; a hidden key never reaches a
row. A NaN or inf in ``v`` is only placed where every row sees every key (no causal mask, no
window): with a mask, a hidden key's weight 0 times it is NaN in every fused kernel (upstream's
too), so which rows of a tile it reaches is not part of the semantics. Scores are kept inside
float32's range (huge is 1e15 on fp32/bf16, 3e3 on fp16), where the float64 oracle describes them.

Each backend runs under ``FLASH_ATTN_STRICT_BACKEND=1``, so a result is that backend's; a backend
that refuses a call by design (fp32 inputs on the kernel backends) is left out of that example.
``derandomize=True``: the examples are a pure function of the test (CI is reproducible).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_attn import dispatch, flash_attn_func, flash_attn_varlen_func

from support.inputs import cu_from_lens, gen, make_slopes, randn
from support.oracle import attention_ref, attention_varlen_ref, oracle_pair
from support.options import backends_here, test_device
from support.tolerance import FLOOR, backward_floor, check_close, eps

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
KINDS = ["nan", "inf", "-inf", "huge", "tiny"]
HUGE = {torch.float16: 3e3, torch.bfloat16: 1e15, torch.float32: 1e15}
TINY = {torch.float16: 1e-4, torch.bfloat16: 1e-30, torch.float32: 1e-30}


BACKENDS = backends_here()

seqlen = st.integers(1, 40)


@st.composite
def problems(draw):
    varlen = draw(st.booleans())
    hk = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 2))
    if varlen:
        lens_q = draw(st.lists(st.integers(0, 24), min_size=batch, max_size=batch))
        lens_k = draw(st.lists(st.integers(1, 24), min_size=batch, max_size=batch))
        rows_q, rows_k = sum(lens_q), sum(lens_k)
        sq = sk = None
    else:
        lens_q = lens_k = None
        sq, sk = draw(seqlen), draw(seqlen)
        rows_q, rows_k = sq, sk
    causal = draw(st.booleans())
    window = (draw(st.integers(0, 12)), draw(st.integers(0, 12))) if draw(st.integers(0, 3)) == 0 else (-1, -1)
    masked = causal or window != (-1, -1)
    specials = []
    for _ in range(draw(st.integers(1, 3))):
        tensor = draw(st.sampled_from(["q", "k"] + ([] if masked else ["v"]) + ["v"] * masked))
        kind = draw(st.sampled_from(KINDS if tensor != "v" or not masked else ["huge", "tiny"]))
        specials.append(dict(tensor=tensor, kind=kind, entry=draw(st.integers(0, batch - 1)),
                             row=draw(st.integers(0, max(rows_q if tensor == "q" else rows_k, 1) - 1)),
                             head=draw(st.integers(0, 3)), feature=draw(st.integers(0, 63))))
    return dict(
        varlen=varlen, batch=batch, sq=sq, sk=sk, lens_q=lens_q, lens_k=lens_k, hk=hk,
        h=hk * draw(st.integers(1, 2)), d=draw(st.sampled_from([8, 16, 32, 64])),
        dtype=draw(st.sampled_from(DTYPES)), causal=causal, window=window,
        softcap=draw(st.sampled_from([0.0, 0.0, 0.7, 5.0, 1e4])), alibi=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 0.3])), specials=specials, seed=draw(st.integers(0, 2**16)),
    )


def _inputs(p):
    """q, k, v, dout with the special values in place, on the test device."""
    g = gen(p["seed"])
    h, hk, d, dtype = p["h"], p["hk"], p["d"], p["dtype"]
    if p["varlen"]:
        shapes = [(sum(p["lens_q"]), h, d), (sum(p["lens_k"]), hk, d), (sum(p["lens_k"]), hk, d), (sum(p["lens_q"]), h, d)]
    else:
        b = p["batch"]
        shapes = [(b, p["sq"], h, d), (b, p["sk"], hk, d), (b, p["sk"], hk, d), (b, p["sq"], h, d)]
    q, k, v, dout = (randn(shape, torch.float32, g, device="cpu") for shape in shapes)
    tensors = {"q": q, "k": k, "v": v}
    for special in p["specials"]:
        t = tensors[special["tensor"]]
        if t.numel() == 0:
            continue
        rows = t if p["varlen"] else t[special["entry"]]
        vector = rows[special["row"] % rows.shape[0], special["head"] % rows.shape[1]]
        kind = special["kind"]
        if kind in ("huge", "tiny"):
            vector.mul_((HUGE if kind == "huge" else TINY)[dtype])
        else:
            vector[special["feature"] % d] = float(kind)
    device = test_device()
    return [t.to(dtype).to(device) for t in (q, k, v, dout)]


def _call(p, q, k, v, slopes):
    opts = dict(softmax_scale=p["scale"], causal=p["causal"], window_size=p["window"], softcap=p["softcap"],
                alibi_slopes=slopes, return_attn_probs=True)
    if p["varlen"]:
        cu_q, cu_k = cu_from_lens(p["lens_q"]), cu_from_lens(p["lens_k"])
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(p["lens_q"]), max(p["lens_k"]), **opts)
        return out, lse.transpose(0, 1)  # (total_q, h): a row of lse per row of out
    out, lse, _ = flash_attn_func(q, k, v, **opts)
    return out, lse.transpose(1, 2)  # (b, sq, h)


def _oracle(p, q, k, v, dout, slopes):
    opts = dict(softmax_scale=p["scale"], causal=p["causal"], window=p["window"], softcap=p["softcap"],
                alibi_slopes=slopes)
    if p["varlen"]:
        opts.update(cu_q=cu_from_lens(p["lens_q"]).tolist(), cu_k=cu_from_lens(p["lens_k"]).tolist())
        ref, grads, naive, naive_grads = oracle_pair(attention_varlen_ref, [q, k, v], dout, **opts)
        return ref.out, ref.lse.transpose(0, 1), naive.out, naive.lse.transpose(0, 1), grads, naive_grads
    ref, grads, naive, naive_grads = oracle_pair(attention_ref, [q, k, v], dout, **opts)
    return ref.out, ref.lse.transpose(1, 2), naive.out, naive.lse.transpose(1, 2), grads, naive_grads


def _run(backend, p, q, k, v, dout, slopes, monkeypatch):
    """``(out, lse, (dq, dk, dv))`` on ``backend``, or None where it refuses the call by design."""
    monkeypatch.setenv("FLASH_ATTN_BACKEND", backend)
    monkeypatch.setenv("FLASH_ATTN_STRICT_BACKEND", "1")
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    try:
        out, lse = _call(p, *ins, slopes)
        out.backward(dout)
    except dispatch.BackendRefusedError as exc:
        if backend in dispatch.KERNEL_BACKENDS and "inputs (the kernels take fp16/bf16)" in str(exc):
            return None
        raise
    if q.numel() and k.numel():  # calls with nothing to compute reach no backend
        assert dispatch.last_backend() == backend
    return out.detach(), lse.detach(), [t.grad for t in ins]


def assert_matches(ours, ref, naive, dtype, name):
    """``ours`` against the oracle entry by entry: NaN exactly where the oracle is NaN, equal where it
    is infinite, and where it is finite, finite and within the tolerance rule (support/tolerance.py)
    row by row (the last dim), so that a row of huge values does not loosen the others."""
    o, r, n = (t.detach().double().cpu() for t in (ours, ref, naive))
    if o.dim() == r.dim() - 1:
        o, r, n = o.unsqueeze(-1), r.unsqueeze(-1), n.unsqueeze(-1)
    assert torch.equal(o.isnan(), r.isnan()), f"{name}: NaN at {(o.isnan() != r.isnan()).nonzero()[:4].tolist()} " \
                                              f"(ours NaN there: {o.isnan()[o.isnan() != r.isnan()][:4].tolist()})"
    infinite = r.isinf()
    assert torch.equal(o[infinite], r[infinite]), f"{name}: expected {r[infinite][:4].tolist()} at infinite entries"
    finite = torch.isfinite(r)
    assert torch.isfinite(o[finite]).all(), f"{name}: non-finite where the oracle is finite"
    zero = torch.zeros_like(r)
    err = torch.where(finite, o - r, zero).abs().amax(-1)
    naive_err = torch.where(finite, n - r, zero).abs().amax(-1)
    naive_err = torch.where(naive_err.isnan(), torch.full_like(naive_err, math.inf), naive_err)  # its own overflow
    big = torch.where(finite, r, zero).abs().amax(-1)
    tol = 2 * naive_err + torch.clamp(eps(dtype) * big, min=FLOOR[dtype])
    if not (err <= tol).all():
        worst = (err - tol).argmax()
        raise AssertionError(f"{name}: error {err.flatten()[worst]:.3e} > tolerance {tol.flatten()[worst]:.3e} at "
                             f"row {worst.item()}")


def _groups(p, specials_in):
    """``(entry, kv head)`` groups that no special value reaches, as slices of q/k rows."""
    clean = []
    entries = range(p["batch"])
    for b in entries:
        for kh in range(p["hk"]):
            if not any(specials_in(b, kh)):
                clean.append((b, kh))
    return clean


def _group_slices(p, b, kh):
    """Index tuples of group ``(b, kh)`` in q/out (its query heads) and in k/v."""
    g = p["h"] // p["hk"]
    heads = slice(kh * g, (kh + 1) * g)
    if p["varlen"]:
        cq, ck = cu_from_lens(p["lens_q"], device="cpu").tolist(), cu_from_lens(p["lens_k"], device="cpu").tolist()
        return (slice(cq[b], cq[b + 1]), heads), (slice(ck[b], ck[b + 1]), slice(kh, kh + 1))
    return (b, slice(None), heads), (b, slice(None), slice(kh, kh + 1))


def _reached(p, q, k, v):
    """Whether group ``(b, kh)`` holds a value that is not finite or not of ordinary size."""
    def check(b, kh):
        q_idx, k_idx = _group_slices(p, b, kh)
        for t, idx in ((q, q_idx), (k, k_idx), (v, k_idx)):
            part = t[idx].float()
            size = part.abs()
            yield bool((~torch.isfinite(part)).any() or (size > 100).any() or ((size < 1e-3) & (size > 0)).any())
    return check


@pytest.mark.skipif(not BACKENDS, reason="no backend runs on this device")
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(p=problems())
def test_special_values_match_oracle_on_every_backend(p, monkeypatch):
    q, k, v, dout = _inputs(p)
    slopes = make_slopes((p["h"],), seed=p["seed"]) if p["alibi"] else None
    ref_out, ref_lse, naive_out, naive_lse, ref_grads, naive_grads = _oracle(p, q, k, v, dout, slopes)
    results = {}
    for backend in BACKENDS:
        result = _run(backend, p, q, k, v, dout, slopes, monkeypatch)
        if result is None:
            continue
        out, lse, grads = results[backend] = result
        assert_matches(out, ref_out, naive_out, p["dtype"], f"{backend} out")
        assert_matches(lse, ref_lse, naive_lse, torch.float32, f"{backend} lse")
        # the backward agrees: a row whose output is NaN has an all-NaN dq, any other non-finite
        # output row a non-finite dq
        nan_rows = ref_out.isnan().all(-1).cpu()
        dq = grads[0].detach().cpu()
        assert dq[nan_rows].isnan().all(), f"{backend}: dq of a NaN row is not NaN"
        bad_rows = (~torch.isfinite(ref_out)).any(-1).cpu()
        assert (~torch.isfinite(dq[bad_rows])).any(-1).all(), f"{backend}: finite dq on a non-finite row"
        # and where no special value reaches, the gradients are the oracle's
        for b, kh in _groups(p, _reached(p, q, k, v)):
            q_idx, k_idx = _group_slices(p, b, kh)
            parts = [q[q_idx], k[k_idx], v[k_idx], dout[q_idx]]
            floor = backward_floor(*parts, p["scale"])
            for got, want, approx, idx, name in zip(grads, ref_grads, naive_grads, (q_idx, k_idx, k_idx),
                                                    ("dq", "dk", "dv")):
                check_close(got[idx], want[idx], approx[idx], p["dtype"], f"{backend} {name}", grad=True, floor=floor)
    # against each other: the same non-finite entries everywhere
    names = list(results)
    for first, second in zip(names, names[1:]):
        for i, what in enumerate(("out", "lse")):
            a, b = results[first][i], results[second][i]
            assert torch.equal(a.isnan(), b.isnan()), f"{first} and {second} disagree on NaN in {what}"
            assert torch.equal(a.isinf(), b.isinf()), f"{first} and {second} disagree on inf in {what}"
