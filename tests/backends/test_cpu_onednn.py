"""The fused kernel's contract recomputed on oneDNN's fp32 products (:mod:`flash_attn.backends._onednn`).

* the two functions against a float64 attention of their own contract (top-left causal, GQA,
  the natural-log lse, a backward that takes the caller's ``out``/``lse``), on tiles of a few
  rows and keys so that online softmax, skipped and masked blocks all occur on small shapes;
* through the cpu backend's engine with small tiles (``cpu.engine(tuning)``), forced on, against
  the float64 oracle: the plan's calls run here (seen in the profiler) and the results keep the
  oracle's tolerance;
* the choice: off, on, below the size, bf16 (forward here, computed in fp32, backward on
  PyTorch's bf16 kernel), the measured default that leaves the global RNG alone;
* no strided weight ever reaches oneDNN (its slow reference path), bad inputs are refused.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flash_attn import dispatch, flash_attn_func
from flash_attn.backends import _cpu_fused as fused
from flash_attn.backends import _layouts, cpu
from flash_attn.backends import _onednn as onednn
from flash_attn.backends._reference_core import Tuning
from flash_attn.params import AttentionParams

from support.inputs import gen, randn
from support.options import test_device
from support.oracle import attention_ref, oracle_pair
from support.tolerance import backward_floor, check_close

FP32, BF16 = torch.float32, torch.bfloat16

pytestmark = pytest.mark.skipif(test_device().type != "cpu" or onednn.LINEAR is None or fused.OPS is None,
                                reason="oneDNN's products serve CPU tensors where PyTorch ships oneDNN")


# Calls of any size, with tiles of a few rows and keys; windows cut into blocks of a few rows.
SMALL_TILES = Tuning(onednn_min_rows=1, onednn_min_cols=1, onednn_rows=4, onednn_full_forward_rows=8, onednn_cols=16,
                     bf16_onednn_min=1, band_min_rows=4, band_max_rows=8)


@pytest.fixture
def small_tiles(monkeypatch) -> _layouts.Engine:
    """The cpu backend's engine on :data:`SMALL_TILES`, with oneDNN forced on (its public switch)."""
    monkeypatch.setenv(onednn.MODE_ENV, "1")
    return cpu.engine(SMALL_TILES)


def _contract_f64(q, k, v, causal, scale, lse=None):
    """Float64 attention with the fused kernel's conventions, ``(B, h, s, d)``: ``(out, its own
    lse, the probabilities)``, the probabilities from the given ``lse`` when there is one."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    own = torch.logsumexp(s, -1)
    p = torch.exp(s - (own if lse is None else lse.double()).unsqueeze(-1))
    return p @ v, own, p


def _contract_grads_f64(dout, q, k, v, out, lse, causal, scale):
    """dq, dk, dv of the contract in float64, with P from ``lse`` and D from ``out`` as given."""
    _, _, p = _contract_f64(q, k, v, causal, scale, lse)
    group = q.shape[1] // k.shape[1]
    do, qq = dout.double(), q.double()
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vv.transpose(-1, -2) - (do * out.double()).sum(-1, keepdim=True))
    dq = ds @ kk * scale
    dk = ds.transpose(-1, -2) @ qq * scale

    def per_kv_head(t):
        return t.unflatten(1, (k.shape[1], group)).sum(2)

    return dq, per_kv_head(dk), per_kv_head(dv)


def _heads_first(shape, seed):
    """A ``(B, h, s, d)`` view of a ``(B, s, h, d)`` tensor, as the plan passes them."""
    B, h, s, d = shape
    return randn((B, s, h, d), FP32, seed).transpose(1, 2)


@pytest.mark.parametrize("B, h, hk, sq, sk, causal", [
    (2, 4, 2, 37, 37, False),
    (1, 2, 1, 37, 37, True),     # causal square: skipped, masked and whole blocks
    (2, 3, 3, 21, 50, True),     # top-left causal with more keys than rows
    (1, 4, 2, 50, 21, True),     # more rows than keys: the last rows see every key
    (1, 2, 2, 5, 70, False),     # one row block over several key blocks (online softmax)
], ids=str)
def test_kernels_vs_their_contract_in_float64(B, h, hk, sq, sk, causal):
    scale = 0.3
    q, k, v = _heads_first((B, h, sq, 32), 1), _heads_first((B, hk, sk, 32), 2), _heads_first((B, hk, sk, 32), 3)
    out, lse = onednn.forward(q, k, v, 0.0, causal, scale=scale, tuning=SMALL_TILES)
    want_out, want_lse, _ = _contract_f64(q, k, v, causal, scale)
    assert out.shape == q.shape and lse.shape == (B, h, sq) and lse.dtype == FP32
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=32 * torch.finfo(FP32).eps)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=32 * torch.finfo(FP32).eps * want_lse.abs().max().item())
    dout = _heads_first((B, h, sq, 32), 4)
    grads = onednn.backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale, tuning=SMALL_TILES)
    for got, want, name in zip(grads, _contract_grads_f64(dout, q, k, v, out, lse, causal, scale), ("dq", "dk", "dv")):
        assert got.shape == want.shape, name
        atol = 64 * torch.finfo(FP32).eps * max(1.0, want.abs().max().item())
        torch.testing.assert_close(got.double(), want, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_forward_is_the_fp32_forward_rounded_once(causal):
    """bf16 inputs are converted block by block: the same fp32 arithmetic as on their fp32
    values, with only ``out`` rounded to bf16."""
    q, k, v = (_heads_first(shape, seed).bfloat16() for shape, seed in
               (((2, 4, 37, 32), 1), ((2, 2, 45, 32), 2), ((2, 2, 45, 32), 3)))
    out, lse = onednn.forward(q, k, v, 0.0, causal, scale=0.3, tuning=SMALL_TILES)
    out32, lse32 = onednn.forward(q.float(), k.float(), v.float(), 0.0, causal, scale=0.3, tuning=SMALL_TILES)
    assert out.dtype == BF16 and lse.dtype == FP32
    assert torch.equal(out, out32.bfloat16()) and torch.equal(lse, lse32)


@pytest.mark.parametrize("softcap", [0.0, 4.0, 3e4])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_backward_is_the_fp32_backward_rounded_once(causal, softcap):
    """bf16 inputs are converted head by head: the same fp32 arithmetic as on their fp32 values,
    the gradients rounded once to ``grad_dtype`` (softcap's bf16 backward runs here)."""
    q, dout = (_heads_first((2, 4, 37, 32), seed).bfloat16() for seed in (1, 4))
    k, v = (_heads_first((2, 2, 45, 32), seed).bfloat16() for seed in (2, 3))
    out, lse = onednn.forward(q, k, v, 0.0, causal, scale=0.3, softcap=softcap, tuning=SMALL_TILES)
    args = dict(scale=0.3, softcap=softcap, tuning=SMALL_TILES)
    grads = onednn.backward(dout, q, k, v, out, lse, 0.0, causal, grad_dtype=BF16, **args)
    grads32 = onednn.backward(*(t.float() for t in (dout, q, k, v, out)), lse, 0.0, causal, **args)
    for got, want, name in zip(grads, grads32, ("dq", "dk", "dv")):
        assert got.dtype == BF16 and want.dtype == FP32, name
        assert torch.equal(got, want.bfloat16()), name


def test_backward_takes_the_callers_out_and_lse():
    """A block of keys differentiated with the whole sequence's ``out``/``lse`` (what context
    parallelism does) gets that block's share of the gradient, not its own softmax's."""
    scale = 0.25
    q, k, v = _heads_first((1, 2, 24, 16), 5), _heads_first((1, 1, 40, 16), 6), _heads_first((1, 1, 40, 16), 7)
    dout = _heads_first((1, 2, 24, 16), 8)
    out, lse, _ = _contract_f64(q, k, v, False, scale)
    out, lse = out.float(), lse.float()
    block = slice(10, 30)
    kb, vb = k[:, :, block], v[:, :, block]
    dq, dk, dv = onednn.backward(dout, q, kb, vb, out, lse, 0.0, False, scale=scale, tuning=SMALL_TILES)
    want = _contract_grads_f64(dout, q, kb, vb, out, lse, False, scale)
    own = onednn.backward(dout, q, kb, vb, *onednn.forward(q, kb, vb, scale=scale, tuning=SMALL_TILES), scale=scale,
                          tuning=SMALL_TILES)
    for got, expected, wrong in zip((dq, dk, dv), want, own):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)
        assert (wrong.double() - expected).abs().max() > 1e-2  # the block's own softmax differs


CASES = [
    # dtype, b, sq, sk, h, hk, causal, window
    (FP32, 2, 37, 37, 4, 2, False, (-1, -1)),
    (FP32, 1, 45, 45, 2, 1, True, (-1, 0)),
    (FP32, 2, 20, 53, 2, 2, True, (-1, 0)),   # bottom-right causal: a full block beside a causal one
    (FP32, 1, 70, 33, 4, 2, True, (-1, 0)),   # the first rows see nothing
    (FP32, 1, 60, 60, 2, 1, False, (20, 0)),  # a window: the band's unmasked calls run here
    (BF16, 2, 40, 40, 2, 1, False, (-1, -1)),
    (BF16, 1, 40, 52, 2, 2, True, (-1, 0)),
]


def _linear_calls(fn) -> list[str]:
    """The dtype of q in each oneDNN product run while ``fn`` ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [e.input_dtypes[0] for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]


def _forward_and_backward(engine, q, k, v, dout, params):
    """``(out, lse, grads, forward's products, backward's products)`` of one call on ``engine``
    (the products' dtypes, as :func:`_linear_calls` lists them)."""
    result = {}
    forward = _linear_calls(lambda: result.update(zip(("out", "lse", "_"), _layouts.forward(engine, q, k, v, params))))
    out, lse = result["out"], result["lse"]
    backward = _linear_calls(lambda: result.update(grads=_layouts.backward(engine, dout, q, k, v, out, lse, params)))
    return out, lse, result["grads"], forward, backward


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_engine_on_onednn_vs_oracle(case, small_tiles):
    dtype, b, sq, sk, h, hk, causal, window = case
    g = gen(sq * sk + h)
    q = randn((b, sq, h, 32), dtype, g)
    k, v = (randn((b, sk, hk, 32), dtype, g) for _ in range(2))
    dout = randn(q.shape, dtype, g)
    params = AttentionParams(0.3, *window)
    out, lse, grads, forward, backward = _forward_and_backward(small_tiles, q, k, v, dout, params)
    assert forward and set(forward) == {"float"}, forward  # bf16 too: multiplied in fp32
    assert bool(backward) == (dtype == FP32), backward     # bf16 keeps PyTorch's bf16 backward
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, window=window, softmax_scale=0.3)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "lse")
    floor = backward_floor(q, k, v, dout, 0.3, ref.probs)
    for grad, want, approx, name in zip(grads, rg, ng, ("dq", "dk", "dv")):
        check_close(grad, want, approx, dtype, name, grad=True, floor=floor)


def test_the_choice(monkeypatch):
    q = randn((1, 300, 2, 32), FP32, 9)
    call = lambda: flash_attn_func(q, q, q, causal=True)  # noqa: E731
    monkeypatch.setenv(onednn.MODE_ENV, "0")
    assert not _linear_calls(call)
    monkeypatch.setenv(onednn.MODE_ENV, "1")
    assert _linear_calls(call)
    assert not _linear_calls(lambda: flash_attn_func(q[:, :200], q[:, :200], q[:, :200]))  # below onednn_min_rows
    # softcap, which the fused kernel cannot compute: on oneDNN where it takes every call, else the tiled engine
    assert _linear_calls(lambda: flash_attn_func(q, q, q, softcap=5.0))
    assert not _linear_calls(lambda: flash_attn_func(q[:, :200], q[:, :200], q[:, :200], softcap=5.0))
    assert dispatch.last_backend() == "cpu"
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")  # the exact definition alone: never oneDNN
    assert not _linear_calls(call) and dispatch.last_backend() == "reference"
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "cpu")
    assert onednn.applies(4096, 4096) and not onednn.applies(4096, 4096, linear=None)  # a PyTorch without oneDNN
    without = cpu.engine(features=dataclasses.replace(fused.THIS_CPU, onednn_linear=None))
    assert _linear_calls(lambda: _layouts.forward(cpu.ENGINE, q, q, q, AttentionParams(32 ** -0.5, -1, 0)))
    assert not _linear_calls(lambda: _layouts.forward(without, q, q, q, AttentionParams(32 ** -0.5, -1, 0)))


@pytest.mark.parametrize("bf16_min, on_onednn", [(1, True), (1000, False)])
def test_bf16_runs_here_only_from_its_size(bf16_min, on_onednn, small_tiles):
    """A bf16 causal square converted to fp32 for the fp32 tree (no AMX) stays on the tree below
    the tuning's ``bf16_onednn_min`` (the conversion is the tree's, not this module's gain)."""
    tuning = dataclasses.replace(SMALL_TILES, bf16_onednn_min=bf16_min, bf16_tree_min_rows=16, tree_base_rows=4,
                                 tree_min_rows=8)
    engine = cpu.engine(tuning, dataclasses.replace(fused.THIS_CPU, amx=lambda: False))
    q, k, v = (randn((1, 40, 2, 32), BF16, seed) for seed in (1, 2, 3))
    result = {}
    calls = _linear_calls(lambda: result.update(out=_layouts.forward(engine, q, k, v, AttentionParams(0.3, -1, 0))[0]))
    assert bool(calls) == on_onednn, calls
    ref, _, naive, _ = oracle_pair(attention_ref, [q, k, v], window=(-1, 0), softmax_scale=0.3)
    check_close(result["out"], ref.out, naive.out, BF16, "out")


@pytest.fixture
def threads():
    """Set PyTorch's thread count for a test, restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_measured_default_is_cached_and_leaves_the_global_rng_alone(monkeypatch, threads):
    monkeypatch.delenv(onednn.MODE_ENV, raising=False)
    threads(1)
    onednn.faster_here.cache_clear()
    state = torch.random.get_rng_state()
    choice = onednn.applies(1024, 1024)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert choice == onednn.faster_here(1) and isinstance(choice, bool)
    assert onednn.faster_here.cache_info().misses == 1
    onednn.applies(2048, 2048)
    assert onednn.faster_here.cache_info().misses == 1


def test_threads_and_sizes_of_the_measured_default(monkeypatch, threads):
    monkeypatch.delenv(onednn.MODE_ENV, raising=False)

    def applies(rows, cols):  # on a CPU where oneDNN is faster
        return onednn.applies(rows, cols, faster=lambda threads: True)

    threads(1)
    assert applies(256, 256) and not applies(255, 4096) and not applies(4096, 255)
    threads(2)
    assert applies(4096, 4096) and not applies(4095, 8192)
    threads(3)  # not measured: the fused kernel
    assert not applies(16384, 16384)
    monkeypatch.setenv(onednn.MODE_ENV, "1")
    assert applies(256, 256)
    monkeypatch.setenv(onednn.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="FLASH_ATTN_CPU_ONEDNN='fast'"):
        applies(4096, 4096)


def test_no_strided_weight_reaches_onednn():
    """oneDNN multiplies by a strided weight on its reference path (measured 1,500x slower)."""
    weights = []

    def spy(x, w, *args):
        weights.append((tuple(w.shape), w.is_contiguous()))
        return onednn.LINEAR(x, w, *args)

    q, k, v = _heads_first((1, 2, 37, 16), 10), _heads_first((1, 1, 45, 16), 11), _heads_first((1, 1, 45, 16), 12)
    out, lse = onednn.forward(q, k, v, 0.0, True, tuning=SMALL_TILES, linear=spy)
    onednn.backward(q, q, k, v, out, lse, 0.0, True, tuning=SMALL_TILES, linear=spy)
    onednn.forward(q, k, v, 0.0, False, tuning=SMALL_TILES, linear=spy)
    assert weights and all(contiguous for _, contiguous in weights), [w for w in weights if not w[1]]


def test_bad_inputs_are_refused():
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="dropout"):
        onednn.forward(q, q, q, 0.1)
    with pytest.raises(ValueError, match="mask"):
        onednn.forward(q, q, q, attn_mask=torch.zeros(8, 8))
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensors"):
        onednn.forward(q.half(), q.half(), q.half())
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensors"):
        onednn.forward(q, q.bfloat16(), q)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensors"):
        onednn.backward(*(t.half() for t in (q, q, q, q, q)), q[..., 0], 0.0, False)
    with pytest.raises(ValueError, match="heads"):
        onednn.forward(q, q[:, :1].expand(1, 3, 8, 16), q[:, :1].expand(1, 3, 8, 16))
    assert math.isfinite(onednn.forward(q, q, q)[1].sum().item())


@pytest.mark.parametrize("dtype", [FP32, BF16, torch.float16])
@pytest.mark.parametrize("softcap, form", [(4.0, "sigmoid"), (3e4, "expm1")])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_runs_here_in_either_form_vs_oracle(dtype, softcap, form, causal, small_tiles):
    """Softcap, which PyTorch's fused kernel cannot compute, on oneDNN's products (every call of the
    plan here, the backward in fp32): the sigmoid form where ``c`` is at most 4 times the scores'
    bound, the exact expm1 form above; both within the oracle's tolerance, forward and backward."""
    g = gen(17)
    q, k, v, dout = (randn((2, 37, 2, 32), dtype, g, scale=2.0) for _ in range(4))
    bound = 0.3 * float(torch.linalg.vector_norm(q.float(), dim=-1).amax() * torch.linalg.vector_norm(k.float(), dim=-1).amax())
    assert (softcap <= 4 * bound) == (form == "sigmoid")
    params = AttentionParams(0.3, -1, 0 if causal else -1, softcap)
    out, lse, grads, forward, backward = _forward_and_backward(small_tiles, q, k, v, dout, params)
    assert forward and backward and set(backward) == {"float"}
    window = (-1, 0) if causal else (-1, -1)
    ref, rg, naive, ng = oracle_pair(attention_ref, [q, k, v], dout, window=window, softmax_scale=0.3, softcap=softcap)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, FP32, "lse")
    floor = backward_floor(q, k, v, dout, 0.3, ref.probs)
    for grad, want, approx, name in zip(grads, rg, ng, ("dq", "dk", "dv")):
        check_close(grad, want, approx, dtype, name, grad=True, floor=floor)
