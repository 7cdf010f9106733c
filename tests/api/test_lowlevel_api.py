"""Upstream's low-level API (``_flash_attn_forward`` & co., ``flash_attn_gpu``): signatures, custom-op
registration, values against the float64 oracle, and the property context parallelism relies on
(a block's backward normalised by the global ``out``/``softmax_lse``).

The tensors follow ``--flash-device`` (``.ci/gpu-check`` runs this file on ``aot`` and ``triton``
on a GPU, where fp32 cases run in fp16/bf16: the kernels refuse fp32 by design); the tests of the
Triton interpreter at the end stay on the CPU. The multi-process ring run is in
``tests/integration/test_context_parallel.py``.
"""

from __future__ import annotations

import inspect
import typing
from typing import Optional, Tuple  # noqa: F401  (evaluated in upstream's annotations below)

import pytest
import torch

from flash_attn import dispatch, flash_attn_func, flash_attn_varlen_func
from flash_attn.flash_attn_interface import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    flash_attn_gpu,
)

from support.inputs import cu_from_lens, gen, make_slopes, randn
from support.options import test_device
from support.oracle import attention_ref, attention_varlen_ref, kvcache_ref, oracle_pair
from support.tolerance import backward_floor, check_close

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
REQUIRED = object()


def on_device(dtype, half=FP16):
    """The tests' tensors follow ``--flash-device`` (``support.inputs.randn``). On the CPU ``dtype``;
    on a GPU, where a kernel backend takes the call and refuses fp32 by design, fp32 becomes
    ``half`` (fp16 / bf16), so the call is checked instead of skipped."""
    return half if dtype == FP32 and test_device().type != "cpu" else dtype


# ---------------------------------------------------------------------------------------------
# Upstream's signatures, copied as data from flash-attn's current source, version 2.8.4 in its
# flash_attn/__init__.py (Dao-AILab/flash-attention, commit 0251105a2fb19d2957484b7f023cd8c115286ced
# of 2026-08-15, BSD-3-Clause, Copyright (c) 2023 Tri Dao): flash_attn/flash_attn_interface.py
# lines 85, 154, 253, 348 (name, annotation, default). Since v2.8.3 (060c9188) the varlen forward
# gained ``num_splits`` and the entry points' generator slot must be None (a RuntimeError).
UPSTREAM_VERSION = "2.8.4"
UPSTREAM_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"

UPSTREAM_SIGNATURES = {
    "_flash_attn_forward": [
        ("q", "torch.Tensor", REQUIRED), ("k", "torch.Tensor", REQUIRED), ("v", "torch.Tensor", REQUIRED),
        ("dropout_p", "float", REQUIRED), ("softmax_scale", "float", REQUIRED), ("causal", "bool", REQUIRED),
        ("window_size_left", "int", REQUIRED), ("window_size_right", "int", REQUIRED),
        ("softcap", "float", REQUIRED), ("alibi_slopes", "Optional[torch.Tensor]", REQUIRED),
        ("return_softmax", "bool", REQUIRED),
    ],
    "_flash_attn_varlen_forward": [
        ("q", "torch.Tensor", REQUIRED), ("k", "torch.Tensor", REQUIRED), ("v", "torch.Tensor", REQUIRED),
        ("cu_seqlens_q", "torch.Tensor", REQUIRED), ("cu_seqlens_k", "torch.Tensor", REQUIRED),
        ("max_seqlen_q", "int", REQUIRED), ("max_seqlen_k", "int", REQUIRED),
        ("dropout_p", "float", REQUIRED), ("softmax_scale", "float", REQUIRED), ("causal", "bool", REQUIRED),
        ("window_size_left", "int", -1), ("window_size_right", "int", -1), ("softcap", "float", 0.0),
        ("alibi_slopes", "Optional[torch.Tensor]", None), ("return_softmax", "bool", False),
        ("block_table", "Optional[torch.Tensor]", None), ("leftpad_k", "Optional[torch.Tensor]", None),
        ("seqused_k", "Optional[torch.Tensor]", None), ("zero_tensors", "bool", False),
        ("num_splits", "int", 0),
    ],
    "_flash_attn_backward": [
        ("dout", "torch.Tensor", REQUIRED), ("q", "torch.Tensor", REQUIRED), ("k", "torch.Tensor", REQUIRED),
        ("v", "torch.Tensor", REQUIRED), ("out", "torch.Tensor", REQUIRED), ("softmax_lse", "torch.Tensor", REQUIRED),
        ("dq", "Optional[torch.Tensor]", REQUIRED), ("dk", "Optional[torch.Tensor]", REQUIRED),
        ("dv", "Optional[torch.Tensor]", REQUIRED), ("dropout_p", "float", REQUIRED),
        ("softmax_scale", "float", REQUIRED), ("causal", "bool", REQUIRED), ("window_size_left", "int", REQUIRED),
        ("window_size_right", "int", REQUIRED), ("softcap", "float", REQUIRED),
        ("alibi_slopes", "Optional[torch.Tensor]", REQUIRED), ("deterministic", "bool", REQUIRED),
        ("rng_state", "Optional[torch.Tensor]", None),
    ],
    "_flash_attn_varlen_backward": [
        ("dout", "torch.Tensor", REQUIRED), ("q", "torch.Tensor", REQUIRED), ("k", "torch.Tensor", REQUIRED),
        ("v", "torch.Tensor", REQUIRED), ("out", "torch.Tensor", REQUIRED), ("softmax_lse", "torch.Tensor", REQUIRED),
        ("dq", "Optional[torch.Tensor]", REQUIRED), ("dk", "Optional[torch.Tensor]", REQUIRED),
        ("dv", "Optional[torch.Tensor]", REQUIRED), ("cu_seqlens_q", "torch.Tensor", REQUIRED),
        ("cu_seqlens_k", "torch.Tensor", REQUIRED), ("max_seqlen_q", "int", REQUIRED),
        ("max_seqlen_k", "int", REQUIRED), ("dropout_p", "float", REQUIRED), ("softmax_scale", "float", REQUIRED),
        ("causal", "bool", REQUIRED), ("window_size_left", "int", REQUIRED), ("window_size_right", "int", REQUIRED),
        ("softcap", "float", REQUIRED), ("alibi_slopes", "Optional[torch.Tensor]", REQUIRED),
        ("deterministic", "bool", REQUIRED), ("rng_state", "Optional[torch.Tensor]", None),
        ("zero_tensors", "bool", False),
    ],
}
UPSTREAM_RETURNS = {
    "_flash_attn_forward": "Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]",
    "_flash_attn_varlen_forward": "Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]",
    "_flash_attn_backward": "torch.Tensor",
    "_flash_attn_varlen_backward": "torch.Tensor",
}
# The positional arguments of flash_attn_2_cuda's functions (the same commit,
# csrc/flash_attn/flash_api.cpp: mha_fwd line 369, mha_varlen_fwd 539, mha_bwd 801,
# mha_varlen_bwd 1011, mha_fwd_kvcache 1244; bound as fwd, varlen_fwd, bwd, varlen_bwd, fwd_kvcache).
GENERATOR_SLOT = "unused_generator_compat"
# upstream's TORCH_CHECK message (a RuntimeError), the part its own test matches
GENERATOR_MESSAGE = r"generator` argument is no longer supported"
UPSTREAM_ENTRY_POINTS = {
    "fwd": ["q", "k", "v", "out_", "alibi_slopes_", "p_dropout", "softmax_scale", "is_causal", "window_size_left",
            "window_size_right", "softcap", "return_softmax", GENERATOR_SLOT],
    "varlen_fwd": ["q", "k", "v", "out_", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "leftpad_k_", "block_table_",
                   "alibi_slopes_", "max_seqlen_q", "max_seqlen_k", "p_dropout", "softmax_scale", "zero_tensors",
                   "is_causal", "window_size_left", "window_size_right", "softcap", "return_softmax", GENERATOR_SLOT,
                   "num_splits"],
    "bwd": ["dout", "q", "k", "v", "out", "softmax_lse", "dq_", "dk_", "dv_", "alibi_slopes_", "p_dropout",
            "softmax_scale", "is_causal", "window_size_left", "window_size_right", "softcap", "deterministic",
            GENERATOR_SLOT, "rng_state"],
    "varlen_bwd": ["dout", "q", "k", "v", "out", "softmax_lse", "dq_", "dk_", "dv_", "cu_seqlens_q", "cu_seqlens_k",
                   "alibi_slopes_", "max_seqlen_q", "max_seqlen_k", "p_dropout", "softmax_scale", "zero_tensors",
                   "is_causal", "window_size_left", "window_size_right", "softcap", "deterministic",
                   GENERATOR_SLOT, "rng_state"],
    "fwd_kvcache": ["q", "kcache", "vcache", "k_", "v_", "seqlens_k_", "rotary_cos_", "rotary_sin_",
                    "cache_batch_idx_", "leftpad_k_", "block_table_", "alibi_slopes_", "out_", "softmax_scale",
                    "is_causal", "window_size_left", "window_size_right", "softcap", "is_rotary_interleaved",
                    "num_splits"],
}
OPS = {
    "_flash_attn_forward": _flash_attn_forward,
    "_flash_attn_varlen_forward": _flash_attn_varlen_forward,
    "_flash_attn_backward": _flash_attn_backward,
    "_flash_attn_varlen_backward": _flash_attn_varlen_backward,
}


def _upstream_type(text: str):
    return eval(text, {"torch": torch, "Optional": Optional, "Tuple": Tuple})  # noqa: S307 (our own data)


def _same_type(ours, theirs) -> bool:
    """``tuple[X, Y]`` and ``typing.Tuple[X, Y]`` are the same annotation for our purpose."""
    if typing.get_origin(theirs) is not None:
        return typing.get_origin(ours) is typing.get_origin(theirs) and typing.get_args(ours) == typing.get_args(theirs)
    return ours == theirs


@pytest.mark.parametrize("name", list(UPSTREAM_SIGNATURES))
def test_signature_matches_upstream(name):
    fn = OPS[name]._init_fn  # what torch.library.custom_op wraps (and what callers introspect)
    params = list(inspect.signature(fn).parameters.values())
    hints = typing.get_type_hints(fn)
    assert [p.name for p in params] == [n for n, _, _ in UPSTREAM_SIGNATURES[name]]
    for p, (pname, annotation, default) in zip(params, UPSTREAM_SIGNATURES[name]):
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, pname
        expected_default = inspect.Parameter.empty if default is REQUIRED else default
        assert p.default == expected_default and type(p.default) is type(expected_default), pname
        assert _same_type(hints[pname], _upstream_type(annotation)), (pname, hints[pname], annotation)
    assert _same_type(hints["return"], _upstream_type(UPSTREAM_RETURNS[name]))


@pytest.mark.parametrize("name", list(UPSTREAM_ENTRY_POINTS))
def test_flash_attn_gpu_takes_upstreams_positional_arguments(name):
    params = list(inspect.signature(getattr(flash_attn_gpu, name)).parameters)
    assert params == [n.rstrip("_") for n in UPSTREAM_ENTRY_POINTS[name]]


def _default_args(op) -> dict:
    """How context-parallel libraries read the defaults (e.g. ring-flash-attention's
    ``get_default_args``): through ``CustomOpDef._init_fn`` and ``getfullargspec``."""
    spec = inspect.getfullargspec(op._init_fn)
    defaults = spec.defaults or ()
    return dict(zip(spec.args, (None,) * (len(spec.args) - len(defaults)) + tuple(defaults)))


def test_registered_as_custom_ops_under_upstreams_names():
    for name, op in OPS.items():
        assert isinstance(op, torch._library.custom_ops.CustomOpDef), name
        assert getattr(torch.ops.flash_attn, name).default.name() == f"flash_attn::{name}"
    schema = torch.ops.flash_attn._flash_attn_backward.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["dq", "dk", "dv"]
    assert _default_args(_flash_attn_varlen_forward)["zero_tensors"] is False
    assert _default_args(_flash_attn_backward)["rng_state"] is None


def test_ops_pass_torch_library_opcheck():
    """Schema, fake (meta) implementation and dispatch are consistent for every op."""
    g = gen(1)
    dtype = on_device(FP32)
    q, k, v = (randn((2, 24, 4, 32), dtype, g) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    args = (q, k, v, 0.0, 0.2, True, -1, -1, 0.0, None, False)
    torch.library.opcheck(_flash_attn_forward, args)
    out, lse, _, rng = _flash_attn_forward(*args)
    dout = randn(q.shape, dtype, g)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.library.opcheck(_flash_attn_backward, (dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.2, True, -1, -1, 0.0,
                                                 None, False, rng))
    lens = [5, 19]
    cu = cu_from_lens(lens)
    qv, kv, vv = (randn((24, 2, 32), dtype, g) for _ in range(3))
    vargs = (qv, kv, vv, cu, cu, 19, 19, 0.0, 0.3, False, 4, 2)
    torch.library.opcheck(_flash_attn_varlen_forward, vargs)
    out, lse, _, rng = _flash_attn_varlen_forward(*vargs)
    torch.library.opcheck(_flash_attn_varlen_backward, (randn(qv.shape, dtype, g), qv, kv, vv, out, lse, None,
                                                        torch.empty_like(kv), None, cu, cu, 19, 19, 0.0, 0.3, False,
                                                        4, 2, 0.0, None, False, rng))


def test_compiles_without_graph_breaks():
    """A block step as context-parallel code writes it traces as one graph (fake implementations)."""

    def block_step(q, k, v, dout):
        out, lse, _, rng = _flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True, -1, -1, 0.0, None, False, rng)
        return out * 2, lse, dq + dk.sum() + dv.sum()

    g = gen(2)
    q, k, v, dout = (randn((1, 16, 2, 16), on_device(FP32), g) for _ in range(4))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block_step)(q, k, v, dout)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(block_step, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(q, k, v, dout), block_step(q, k, v, dout)):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# Values against the float64 oracle.

DENSE_CASES = [
    # dtype, b, sq, sk, h, hk, d, causal, window, softcap, alibi
    (FP16, 2, 33, 33, 4, 2, 64, True, (-1, -1), 0.0, None),
    (BF16, 1, 40, 77, 2, 1, 32, True, (8, -1), 0.0, "bh"),
    (on_device(FP32, BF16), 2, 65, 20, 3, 3, 40, False, (5, 3), 2.0, "h"),
    (on_device(FP32, FP16), 1, 50, 50, 2, 2, 96, False, (-1, -1), 0.0, None),
]


def _dense_id(c):
    return f"{c[0]}-s{c[2]}x{c[3]}-h{c[4]}k{c[5]}-{'causal' if c[7] else 'nc'}-w{c[8][0]}_{c[8][1]}-cap{c[9]}-{c[10]}".replace("torch.", "")


def _slopes(kind, batch, h):
    return None if kind is None else make_slopes((h,) if kind == "h" else (batch, h), seed=5)


@pytest.mark.parametrize("case", DENSE_CASES, ids=_dense_id)
def test_forward_and_backward_vs_oracle(case):
    dtype, b, sq, sk, h, hk, d, causal, window, softcap, alibi = case
    g = gen(sq * 7 + sk)
    q, k, v = randn((b, sq, h, d), dtype, g), randn((b, sk, hk, d), dtype, g), randn((b, sk, hk, d), dtype, g)
    dout = randn((b, sq, h, d), dtype, g)
    slopes, scale = _slopes(alibi, b, h), 0.7 * d ** -0.5
    out, lse, _, rng = _flash_attn_forward(q, k, v, 0.0, scale, causal, window[0], window[1], softcap, slopes, False)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, softmax_scale=scale, causal=causal,
                                     window=window, softcap=softcap, alibi_slopes=slopes)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "softmax_lse")
    dq, dk, dv = torch.full_like(q, float("nan")), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, window[0], window[1],
                                     softcap, slopes, False, rng)
    floor = backward_floor(q, k, v, dout, scale, ref.probs)
    for got, want, approx, name in zip((dq, dk, dv), rg, ng, ("dq", "dk", "dv")):
        check_close(got, want, approx, dtype, name, grad=True, floor=floor)
    assert softmax_d.shape == (b, h, (sq + 127) // 128 * 128) and softmax_d.dtype == FP32
    expected_d = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[:, :, :sq].double(), expected_d, atol=1e-4, rtol=1e-4)
    assert (softmax_d[:, :, sq:] == 0).all()
    # the probabilities last, from a call of their own: the aot backend refuses return_softmax by
    # design (a testing feature), after the checks above
    s_dmask = _flash_attn_forward(q, k, v, 0.0, scale, causal, window[0], window[1], softcap, slopes, True)[2]
    check_close(s_dmask, ref.probs, naive.probs, FP32, "S_dmask")


def test_v_of_its_own_head_dim_with_fa3_shapes():
    """V with its own head dim (192/128 dense, 32/64 varlen): ``out`` and ``dout`` of v's head dim,
    ``dv`` like v, values and gradients against the oracle; the fake implementations give those
    shapes too (opcheck)."""
    g = gen(11)
    dtype = on_device(FP32, BF16)
    q, k = randn((1, 21, 4, 192), dtype, g), randn((1, 30, 2, 192), dtype, g)
    v, dout = randn((1, 30, 2, 128), dtype, g), randn((1, 21, 4, 128), dtype, g)
    args = (q, k, v, 0.0, 0.1, True, -1, -1, 0.0, None, False)
    torch.library.opcheck(_flash_attn_forward, args)
    out, lse, _, rng = _flash_attn_forward(*args)
    assert out.shape == (1, 21, 4, 128)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, softmax_scale=0.1, causal=True)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "softmax_lse")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bwd_args = (dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.1, True, -1, -1, 0.0, None, False, rng)
    torch.library.opcheck(_flash_attn_backward, bwd_args)
    _flash_attn_backward(*bwd_args)
    floor = backward_floor(q, k, v, dout, 0.1, ref.probs)
    for got, want, approx, name in zip((dq, dk, dv), rg, ng, ("dq", "dk", "dv")):
        check_close(got, want, approx, dtype, name, grad=True, floor=floor)
    with pytest.raises(ValueError, match="dout"):  # dout of q's head dim: not FlashAttention-3's shape
        _flash_attn_backward(randn((1, 21, 4, 192), dtype, g), q, k, v, out, lse, None, None, None, 0.0, 0.1, True,
                             -1, -1, 0.0, None, False, rng)
    lens = [5, 19]
    cu = cu_from_lens(lens)
    qq, kk, vv = randn((24, 2, 32), dtype, g), randn((24, 2, 32), dtype, g), randn((24, 2, 64), dtype, g)
    vargs = (qq, kk, vv, cu, cu, 19, 19, 0.0, 0.3, False, -1, -1)
    torch.library.opcheck(_flash_attn_varlen_forward, vargs)
    out, lse, _, rng = _flash_attn_varlen_forward(*vargs)
    ref, _, naive, _ = oracle_pair(attention_varlen_ref, [qq, kk, vv], None, cu_q=_cu_list(lens), cu_k=_cu_list(lens),
                                   softmax_scale=0.3)
    assert out.shape == (24, 2, 64)
    check_close(out, ref.out, naive.out, dtype, "varlen out")


def test_backward_allocates_or_skips_missing_gradient_buffers():
    g = gen(3)
    q, k, v, dout = (randn((1, 20, 2, 32), BF16, g) for _ in range(4))
    out, lse, _, rng = _flash_attn_forward(q, k, v, 0.0, 0.2, False, -1, -1, 0.0, None, False)
    dk = torch.zeros_like(k)
    _flash_attn_backward(dout, q, k, v, out, lse, None, dk, None, 0.0, 0.2, False, -1, -1, 0.0, None, False)
    dq, dk2, dv, softmax_d = flash_attn_gpu.bwd(dout, q, k, v, out, lse, None, None, None, None, 0.0, 0.2, False,
                                                -1, -1, 0.0, False, None, rng)
    assert dq.shape == q.shape and dv.shape == v.shape and softmax_d.shape == (1, 2, 128)
    torch.testing.assert_close(dk, dk2, atol=0, rtol=0)
    assert dk.abs().sum() > 0


def test_window_bounds_follow_upstream():
    """Upstream treats any negative bound, and a bound >= seqlen_k, as unbounded."""
    g = gen(4)
    dtype = on_device(FP32, BF16)
    q, k, v = randn((1, 12, 2, 16), dtype, g), randn((1, 3, 2, 16), dtype, g), randn((1, 3, 2, 16), dtype, g)
    full = _flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, -1, 0.0, None, False)[0]
    for left, right in ((-5, -2), (3, 3), (7, -1)):
        got = _flash_attn_forward(q, k, v, 0.0, 0.25, False, left, right, 0.0, None, False)[0]
        torch.testing.assert_close(got, full, atol=0, rtol=0)


def test_dropout_backward_uses_the_forwards_mask():
    """With dropout, the backward regenerates the forward's mask from ``rng_state``."""
    g = gen(6)
    dtype = on_device(FP32)
    q, k, v, dout = (randn((1, 30, 2, 32), dtype, g) for _ in range(4))
    out, lse, s_dmask, rng = _flash_attn_forward(q, k, v, 0.25, 0.2, True, -1, -1, 0.0, None, True)
    keep = s_dmask >= 0  # S_dmask is negated where dropout dropped the entry
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, softmax_scale=0.2, causal=True, keep=keep,
                                     dropout_p=0.25)
    check_close(out, ref.out, naive.out, dtype, "out")
    dq, dk, dv, softmax_d = flash_attn_gpu.bwd(dout, q, k, v, out, lse, None, None, None, None, 0.25, 0.2, True,
                                               -1, -1, 0.0, False, None, rng)
    floor = backward_floor(q, k, v, dout, 0.2, ref.probs, dropout_p=0.25)
    for got, want, approx, name in zip((dq, dk, dv), rg, ng, ("dq", "dk", "dv")):
        check_close(got, want, approx, dtype, name, grad=True, floor=floor)
    expected_d = 0.75 * (dout.double() * out.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[:, :, :30].double(), expected_d, atol=1e-4, rtol=1e-4)
    if dispatch.last_backend() in ("cpu", "reference"):  # bit for bit what it always returned
        exact = torch.linalg.vecdot(dout.to(FP32), out.to(FP32)).mul_(0.75).transpose(1, 2)
        assert torch.equal(softmax_d[:, :, :30], exact)
    with pytest.raises(ValueError, match="rng_state"):
        _flash_attn_backward(dout, q, k, v, out, lse, None, None, None, 0.25, 0.2, True, -1, -1, 0.0, None, False)


def _cu_list(lens):
    return cu_from_lens(lens, device="cpu").tolist()


def test_varlen_forward_and_backward_vs_oracle():
    lens_q, lens_k = [7, 0, 40, 1], [30, 5, 40, 9]
    h, hk, d, dtype = 4, 2, 32, BF16
    g = gen(7)
    q, dout = randn((sum(lens_q), h, d), dtype, g), randn((sum(lens_q), h, d), dtype, g)
    k, v = randn((sum(lens_k), hk, d), dtype, g), randn((sum(lens_k), hk, d), dtype, g)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    slopes = make_slopes((4, h), seed=8)
    out, lse, _, rng = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 40, 40, 0.0, 0.3, True, 20, -1, 0.0, slopes)
    ref, rg, naive, ng = oracle_pair(attention_varlen_ref, [q, k, v], dout, cu_q=_cu_list(lens_q),
                                     cu_k=_cu_list(lens_k), softmax_scale=0.3, causal=True, window=(20, -1),
                                     alibi_slopes=slopes)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "softmax_lse")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 40, 40, 0.0, 0.3, True,
                                            20, -1, 0.0, slopes, False, rng)
    floor = backward_floor(q, k, v, dout, 0.3, ref.probs)
    for got, want, approx, name in zip((dq, dk, dv), rg, ng, ("dq", "dk", "dv")):
        check_close(got, want, approx, dtype, name, grad=True, floor=floor)
    # upstream's layout: sequence b's rows start at column cu_seqlens_q[b] + 128 * b
    assert softmax_d.shape == (h, sum(lens_q) + 128 * 4)
    rows = (dout.double() * out.double()).sum(-1).t()
    written = torch.zeros(softmax_d.shape[1], dtype=torch.bool)
    for b, (start, n) in enumerate(zip(_cu_list(lens_q), lens_q)):
        torch.testing.assert_close(softmax_d[:, start + 128 * b: start + 128 * b + n].double(), rows[:, start:start + n],
                                   atol=1e-3, rtol=1e-3)
        written[start + 128 * b: start + 128 * b + n] = True
    assert (softmax_d[:, ~written.to(softmax_d.device)] == 0).all()


def test_varlen_leftpad_and_seqused_select_key_rows():
    """Sequence b attends to its key rows ``leftpad_k[b] : seqused_k[b]`` (checked against the
    oracle on exactly those rows), for packed and for paged keys."""
    lens_q, lens_k = [3, 6, 2], [10, 7, 12]
    lefts, used = [2, 0, 5], [9, 4, 12]
    h, d, dtype = 2, 32, FP16
    g = gen(9)
    q = randn((sum(lens_q), h, d), dtype, g)
    k, v = randn((sum(lens_k), h, d), dtype, g), randn((sum(lens_k), h, d), dtype, g)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    dev = q.device
    leftpad, seqused = torch.tensor(lefts, dtype=torch.int32, device=dev), torch.tensor(used, dtype=torch.int32, device=dev)
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 6, 12, 0.0, 0.2, True, leftpad_k=leftpad,
                                                seqused_k=seqused)
    starts = _cu_list(lens_k)
    rows = [r for b in range(3) for r in range(starts[b] + lefts[b], starts[b] + used[b])]
    picked = torch.tensor(rows, device=dev)
    new_lens = [u - left for u, left in zip(used, lefts)]
    ref, _, naive, _ = oracle_pair(attention_varlen_ref, [q, k[picked], v[picked]], cu_q=_cu_list(lens_q),
                                   cu_k=_cu_list(new_lens), softmax_scale=0.2, causal=True)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "lse")
    # paged keys: seqused_k shortens each sequence's pages
    page = 4
    pool_k, pool_v = k.new_zeros(12, page, h, d), v.new_zeros(12, page, h, d)
    table = torch.arange(12, dtype=torch.int32, device=dev).view(3, 4)
    for b in range(3):
        n = lens_k[b]
        pool_k.view(3, 4 * page, h, d)[b, :n] = k[starts[b]:starts[b + 1]]
        pool_v.view(3, 4 * page, h, d)[b, :n] = v[starts[b]:starts[b + 1]]
    out_p, _, _, _ = _flash_attn_varlen_forward(q, pool_k, pool_v, cu_q, cu_k, 6, 12, 0.0, 0.2, True,
                                                block_table=table, seqused_k=seqused)
    rows = [r for b in range(3) for r in range(starts[b], starts[b] + used[b])]
    picked = torch.tensor(rows, device=dev)
    ref, _, naive, _ = oracle_pair(attention_varlen_ref, [q, k[picked], v[picked]], cu_q=_cu_list(lens_q),
                                   cu_k=_cu_list(used), softmax_scale=0.2, causal=True)
    check_close(out_p, ref.out, naive.out, dtype, "out (paged)")
    with pytest.raises(RuntimeError, match="leftpad_k"):
        bad = torch.tensor([2, 5, 5], dtype=torch.int32, device=dev)  # leftpad 5 > seqused 4
        _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 6, 12, 0.0, 0.2, True, leftpad_k=bad, seqused_k=seqused)
        torch.cuda.synchronize() if dev.type == "cuda" else None


def test_varlen_num_splits_as_upstream():
    """Upstream 2.8.4's ``num_splits`` (its test_flash_attn_varlen_paged_kv_num_splits, on the CPU
    too): the default and an explicit 0 give the same bits, through the op and the entry point;
    a paged call with one query per sequence and a right window of 0 (so no head folding) refuses
    ``num_splits > 1`` with a RuntimeError, and one that folds heads (GQA decoding) accepts it."""
    g = gen(21)
    h, hk, d, page, batch = 4, 2, 32, 4, 2
    pool_k, pool_v = randn((6, page, hk, d), FP16, g), randn((6, page, hk, d), FP16, g)
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32, device=pool_k.device)
    q = randn((batch, h, d), FP16, g)
    cu_q = cu_from_lens([1, 1])
    seqused = torch.tensor([7, 12], dtype=torch.int32, device=q.device)
    cu_k = cu_from_lens([7, 12])
    kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=12, dropout_p=0.0,
                  softmax_scale=d ** -0.5, causal=False, window_size_left=-1, window_size_right=0,
                  block_table=table, seqused_k=seqused)
    default = _flash_attn_varlen_forward(q, pool_k, pool_v, **kwargs)[0]
    explicit = _flash_attn_varlen_forward(q, pool_k, pool_v, **kwargs, num_splits=0)[0]
    assert torch.equal(default, explicit)
    via_entry = flash_attn_gpu.varlen_fwd(q, pool_k, pool_v, None, cu_q, cu_k, seqused, None, table, None, 1, 12,
                                          0.0, d ** -0.5, False, False, -1, 0, 0.0, False, None, 0)[0]
    assert torch.equal(default, via_entry)
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):
        _flash_attn_varlen_forward(q, pool_k, pool_v, **kwargs, num_splits=2)
    folded = _flash_attn_varlen_forward(q, pool_k, pool_v, **{**kwargs, "window_size_right": -1}, num_splits=2)[0]
    assert torch.equal(folded, _flash_attn_varlen_forward(q, pool_k, pool_v, **{**kwargs, "window_size_right": -1})[0])
    with pytest.raises(TypeError, match="num_splits must be an int"):
        _flash_attn_varlen_forward._init_fn(q, pool_k, pool_v, **kwargs, num_splits=1.5)


# ---------------------------------------------------------------------------------------------
# The property context parallelism needs.


@pytest.mark.parametrize("dtype", [FP16, on_device(FP32, BF16)])
def test_blocks_combined_by_lse_with_global_backward_equal_the_whole(dtype):
    """Split the keys in two blocks: the per-block outputs merged with the returned log-sum-exp
    equal attention over all keys, and per-block backwards that are given the *merged* out/lse
    add up to the whole gradient (checked against the oracle)."""
    g = gen(10)
    b, sq, sk, h, hk, d, scale = 2, 24, 40, 4, 2, 32, 0.2
    q, dout = randn((b, sq, h, d), dtype, g), randn((b, sq, h, d), dtype, g)
    k, v = randn((b, sk, hk, d), dtype, g), randn((b, sk, hk, d), dtype, g)
    split = 15
    blocks = [(slice(0, split), False), (slice(split, sk), True)]  # keys 15: seen causally (bottom-right)
    outs, lses = [], []
    for cols, causal in blocks:
        o, lse, _, _ = _flash_attn_forward(q, k[:, cols], v[:, cols], 0.0, scale, causal, -1, -1, 0.0, None, False)
        outs.append(o.float()), lses.append(lse)
    lse = torch.logaddexp(*lses)
    weights = [torch.exp(x - lse).transpose(1, 2).unsqueeze(-1) for x in lses]
    out = (outs[0] * weights[0] + outs[1] * weights[1]).to(dtype)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, softmax_scale=scale, causal=True)
    check_close(out, ref.out, naive.out, dtype, "merged out")
    check_close(lse, ref.lse, naive.lse, FP32, "merged lse")
    dq = torch.zeros(q.shape, dtype=FP32, device=q.device)
    dk, dv = torch.zeros(k.shape, dtype=FP32, device=q.device), torch.zeros(v.shape, dtype=FP32, device=q.device)
    for cols, causal in blocks:
        bq, bk, bv = torch.empty_like(q), torch.empty_like(k[:, cols]), torch.empty_like(v[:, cols])
        _flash_attn_backward(dout, q, k[:, cols], v[:, cols], out, lse, bq, bk, bv, 0.0, scale, causal, -1, -1, 0.0,
                             None, False)
        dq += bq.float()
        dk[:, cols] += bk.float()
        dv[:, cols] += bv.float()
    floor = backward_floor(q, k, v, dout, scale, ref.probs)
    for got, want, approx, name in zip((dq, dk, dv), rg, ng, ("dq", "dk", "dv")):
        # two blocks round twice; the rule's factor 2 on the naive error covers it
        check_close(got, want, approx, dtype, name, grad=True, floor=floor)


# ---------------------------------------------------------------------------------------------
# flash_attn_gpu: upstream's positional entry points.


def test_entry_points_match_the_ops_and_write_out_in_place():
    g = gen(11)
    q, k, v, dout = (randn((2, 18, 2, 32), FP16, g) for _ in range(4))
    out_buf = torch.empty_like(q)
    out, lse, _, rng = flash_attn_gpu.fwd(q, k, v, out_buf, None, 0.0, 0.3, True, -1, -1, 0.0, False, None)
    assert out is out_buf
    torch.testing.assert_close(out, flash_attn_func(q, k, v, softmax_scale=0.3, causal=True), atol=0, rtol=0)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    got = flash_attn_gpu.bwd(dout, q, k, v, out, lse, dq, dk, dv, None, 0.0, 0.3, True, -1, -1, 0.0, False, None, rng)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*leaves, softmax_scale=0.3, causal=True).backward(dout)
    for a, b in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(a, b.grad, atol=0, rtol=0)

    lens = [5, 13]
    cu = cu_from_lens(lens)
    qv, kv, vv, dv_out = (randn((18, 2, 32), FP16, g) for _ in range(4))
    out, lse, _, rng = flash_attn_gpu.varlen_fwd(qv, kv, vv, None, cu, cu, None, None, None, None, 13, 13, 0.0, 0.3,
                                                 False, True, -1, -1, 0.0, False, None)
    torch.testing.assert_close(out, flash_attn_varlen_func(qv, kv, vv, cu, cu, 13, 13, softmax_scale=0.3, causal=True),
                               atol=0, rtol=0)
    dq, dk, dv, softmax_d = flash_attn_gpu.varlen_bwd(dv_out, qv, kv, vv, out, lse, None, None, None, cu, cu, None,
                                                      13, 13, 0.0, 0.3, False, True, -1, -1, 0.0, False, None, rng)
    leaves = [t.detach().clone().requires_grad_() for t in (qv, kv, vv)]
    flash_attn_varlen_func(*leaves, cu, cu, 13, 13, softmax_scale=0.3, causal=True).backward(dv_out)
    for a, b in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(a, b.grad, atol=0, rtol=0)


def test_fwd_kvcache_entry_point_vs_oracle():
    g = gen(12)
    b, h, hk, d = 2, 4, 2, 32
    q = randn((b, 3, h, d), BF16, g)
    k_cache, v_cache = randn((b, 20, hk, d), BF16, g), randn((b, 20, hk, d), BF16, g)
    k_new, v_new = randn((b, 3, hk, d), BF16, g), randn((b, 3, hk, d), BF16, g)
    seqlens = torch.tensor([4, 11], dtype=torch.int32, device=q.device)
    expected = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, softmax_scale=0.25, causal=True)
    naive = kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, softmax_scale=0.25, causal=True,
                        compute_dtype=None)
    out_buf = torch.empty_like(q)
    out, lse = flash_attn_gpu.fwd_kvcache(q, k_cache, v_cache, k_new, v_new, seqlens, None, None, None, None, None,
                                          None, out_buf, 0.25, True, -1, -1, 0.0, True, 0)
    assert out is out_buf
    check_close(out, expected.out, naive.out, BF16, "out")
    check_close(lse, expected.lse, naive.lse, FP32, "lse")
    check_close(k_cache, expected.k_cache, expected.k_cache, BF16, "k_cache (appended in place)")


@pytest.mark.parametrize("bad", [torch.Generator(), torch.empty(1)], ids=["generator", "tensor"])
@pytest.mark.parametrize("name", ["fwd", "varlen_fwd", "bwd", "varlen_bwd"])
def test_generator_slot_must_be_none(name, bad):
    """Upstream 2.8.4 checks the slot first (the other arguments do not matter) and raises a
    RuntimeError; its own test passes a tensor there."""
    args = [None] * len(UPSTREAM_ENTRY_POINTS[name])
    args[UPSTREAM_ENTRY_POINTS[name].index(GENERATOR_SLOT)] = bad
    with pytest.raises(RuntimeError, match=GENERATOR_MESSAGE):
        getattr(flash_attn_gpu, name)(*args)


def test_bad_inputs_raise_clear_errors():
    g = gen(13)
    q, k, v = (randn((1, 8, 2, 16), on_device(FP32), g) for _ in range(3))
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, -1, 0.0, None, False)
    args = dict(dropout_p=0.0, softmax_scale=0.25, causal=False, window_size_left=-1, window_size_right=-1,
                softcap=0.0, alibi_slopes=None, deterministic=False)
    with pytest.raises(ValueError, match="dq must have shape"):
        _flash_attn_backward(out, q, k, v, out, lse, torch.empty(1, 8, 2, 8), None, None, **args)
    with pytest.raises(TypeError, match="dk must have dtype"):
        _flash_attn_backward(out, q, k, v, out, lse, None, k.to(BF16 if k.dtype == FP16 else FP16), None, **args)
    with pytest.raises(ValueError, match="softmax_lse must have shape"):
        _flash_attn_backward(out, q, k, v, out, lse.transpose(1, 2), None, None, None, **args)
    with pytest.raises(ValueError, match="dropout_p"):
        _flash_attn_forward(q, k, v, 1.5, 0.25, False, -1, -1, 0.0, None, False)
    # rng_state lives on q's device (a CUDA forward draws it there). The op's body is called: a meta
    # argument would send the op itself to its fake implementation.
    with pytest.raises(ValueError, match=f"rng_state is on meta but q is on {q.device}"):
        _flash_attn_backward._init_fn(out, q, k, v, out, lse, None, None, None, **{**args, "dropout_p": 0.1},
                                      rng_state=torch.zeros(1, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match="rng_state must be the int64 tensor"):
        _flash_attn_backward(out, q, k, v, out, lse, None, None, None, **args,
                             rng_state=torch.zeros(1, device=q.device))
    with pytest.raises(ValueError, match="out must be"):
        flash_attn_gpu.fwd(q, k, v, torch.empty(3), None, 0.0, 0.25, False, -1, -1, 0.0, False, None)


# ---------------------------------------------------------------------------------------------
# The same ops on the kernel backends: the Triton kernels in Triton's CPU interpreter here (a GPU
# runner runs the whole file with --flash-backend triton / aot).


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_kernel_backend_serves_the_low_level_ops(dtype, monkeypatch):
    from flash_attn.dispatch import unavailable_reason  # noqa: PLC0415

    reason = unavailable_reason("interpret", torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"interpret backend unavailable: {reason}")
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "interpret")
    g = gen(14)
    q, dout = randn((1, 20, 2, 32), dtype, g, device="cpu"), randn((1, 20, 2, 32), dtype, g, device="cpu")
    k, v = randn((1, 36, 1, 32), dtype, g, device="cpu"), randn((1, 36, 1, 32), dtype, g, device="cpu")
    out, lse, _, rng = _flash_attn_forward(q, k, v, 0.0, 0.2, True, 9, -1, 0.0, None, False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.2, True, 9, -1, 0.0, None, False, rng)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, softmax_scale=0.2, causal=True, window=(9, -1))
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "lse")
    floor = backward_floor(q, k, v, dout, 0.2, ref.probs)
    for got, want, approx, name in zip((dq, dk, dv), rg, ng, ("dq", "dk", "dv")):
        check_close(got, want, approx, dtype, name, grad=True, floor=floor)


def _interpret(monkeypatch):
    reason = dispatch.unavailable_reason("interpret", torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"interpret backend unavailable: {reason}")
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "interpret")


def test_kernel_backend_backward_writes_any_gradient_layout(monkeypatch):
    """The kernels write the caller's dq/dk/dv in place where laid out for them, and into their own
    buffers (copied into the caller's) where not: the same values, and softmax_d is the kernels'
    Delta scaled as upstream's (here with dropout, against the reference backend)."""
    _interpret(monkeypatch)
    g = gen(15)
    q, dout = randn((1, 24, 2, 32), FP16, g, device="cpu"), randn((1, 24, 2, 32), FP16, g, device="cpu")
    k, v = randn((1, 40, 1, 32), FP16, g, device="cpu"), randn((1, 40, 1, 32), FP16, g, device="cpu")
    out, lse, _, rng = _flash_attn_forward(q, k, v, 0.2, 0.25, True, -1, -1, 0.0, None, False)
    args = (0.2, 0.25, True, -1, -1, 0.0, None, False, rng)
    plain = [torch.empty_like(t) for t in (q, k, v)]
    d_plain = _flash_attn_backward(dout, q, k, v, out, lse, *plain, *args)
    assert dispatch.last_backend() == "interpret"
    # a row stride of 36 elements (not a multiple of 8): the kernels cannot write these in place
    odd = [torch.full((*t.shape[:-1], 36), float("nan"), dtype=t.dtype)[..., :32] for t in (q, k, v)]
    d_odd = _flash_attn_backward(dout, q, k, v, out, lse, *odd, *args)
    for a, b in zip(plain, odd):
        assert torch.equal(a, b)
    assert torch.equal(d_plain, d_odd)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    ref = [torch.empty_like(t) for t in (q, k, v)]
    d_ref = _flash_attn_backward(dout, q, k, v, out, lse, *ref, *args)
    torch.testing.assert_close(d_plain, d_ref, atol=1e-3, rtol=1e-3)
    assert (d_plain[:, :, 24:] == 0).all()
    for got, want in zip(plain, ref):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_packed_batches_of_other_lengths_run_one_plan_exactly(monkeypatch):
    """Packed batches whose totals and longest sequences differ (padding-free training) share one
    forward and one backward plan (bucketed bounds, row counts read per call), and give bit for
    bit what plans made for their exact sizes give."""
    from flash_attn.backends import _execute, interpret  # noqa: PLC0415
    from flash_attn.planning import shapes  # noqa: PLC0415

    _interpret(monkeypatch)
    h, hk, d = 2, 1, 32

    def step(lens, seed):
        g = gen(seed)
        total = sum(lens)
        q, dout = randn((total, h, d), BF16, g, device="cpu"), randn((total, h, d), BF16, g, device="cpu")
        k, v = randn((total, hk, d), BF16, g, device="cpu"), randn((total, hk, d), BF16, g, device="cpu")
        cu, longest = cu_from_lens(lens, device="cpu"), max(lens)
        out, lse, _, rng = _flash_attn_varlen_forward(q, k, v, cu, cu, longest, longest, 0.0, 0.3, True)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, cu, cu, longest, longest, 0.0, 0.3,
                                                True, -1, 0, 0.0, None, False, rng)
        assert dispatch.last_backend() == "interpret"
        return out, lse, *grads, softmax_d

    batches = ([5, 37, 12], [30, 3, 20])
    monkeypatch.setattr(interpret._backend, "plans", _execute.PlanCache())
    shared = [step(lens, i) for i, lens in enumerate(batches)]
    assert len(interpret._backend.plans) == 2  # one forward and one backward plan for both batches
    # the same calls planned for their exact sizes (as before bucketing)
    monkeypatch.setattr(interpret._backend, "plans", _execute.PlanCache())
    monkeypatch.setattr(shapes, "_rows_per_call", lambda q, varlen, exact: False)
    exact_info = shapes._varlen_info
    monkeypatch.setattr(shapes, "_varlen_info", lambda varlen, exact=False: exact_info(varlen, True))
    exact = [step(lens, i) for i, lens in enumerate(batches)]
    assert len(interpret._backend.plans) == 4
    for got, want in zip(shared, exact):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
