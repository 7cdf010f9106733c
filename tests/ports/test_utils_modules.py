"""flash_attn.utils.{pretrained, torch, testing, library}.

* pretrained: checkpoints written by the tests (.bin, .safetensors, sharded indexes) in a local
  directory, and in a Hugging Face Hub cache laid out as ``huggingface_hub`` writes it (a stand-in
  for a Hub repository: offline, no network), read back exactly;
* torch: the custom_fwd / custom_bwd adapters (the keyword they add, autograd through them, and
  CUDA autocast's input casting with ``--flash-device cuda``);
* testing: attention_ref (with generate_qkv's packing and the local masks) against the independent
  naive oracle of tests/support/oracle.py, plus the mask helpers against loops written here;
* library: triton_op's schema, fake tensors, and whether torch.compile decomposes the operator.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from support import oracle
from support.options import test_device
from flash_attn.utils import testing as ut
from flash_attn.utils.pretrained import state_dict_from_pretrained

safetensors_torch = pytest.importorskip("safetensors.torch")


# --- pretrained ------------------------------------------------------------------------------------------


def tiny_state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(5, 4, generator=g), "layer.0.bias": torch.randn(4, generator=g),
            "layer.1.weight": torch.randn(3, 4, generator=g)}


def write_sharded(directory: Path, state_dict, safe: bool):
    """Two shards and their index, named as transformers names them."""
    names = sorted(state_dict)
    shards = {"a": names[:1], "b": names[1:]}
    ext = "safetensors" if safe else "bin"
    stem = "model" if safe else "pytorch_model"
    weight_map = {}
    for i, (key, shard_names) in enumerate(shards.items()):
        filename = f"{stem}-{i + 1:05d}-of-00002.{ext}"
        part = {n: state_dict[n] for n in shard_names}
        safetensors_torch.save_file(part, directory / filename) if safe else torch.save(part, directory / filename)
        weight_map.update({n: filename for n in shard_names})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / f"{stem}.{ext}.index.json").write_text(json.dumps(index))


def assert_same(loaded, expected, dtype=None):
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        want = tensor if dtype is None else tensor.to(dtype)
        assert loaded[name].dtype == want.dtype and loaded[name].device.type == "cpu"
        assert torch.equal(loaded[name], want), name


@pytest.mark.parametrize("layout", ["bin", "safetensors", "sharded-bin", "sharded-safetensors"])
def test_local_checkpoint_layouts(tmp_path, layout):
    sd = tiny_state_dict()
    if layout == "bin":
        torch.save(sd, tmp_path / "pytorch_model.bin")
    elif layout == "safetensors":
        safetensors_torch.save_file(sd, tmp_path / "model.safetensors")
    else:
        write_sharded(tmp_path, sd, safe=layout.endswith("safetensors"))
    assert_same(state_dict_from_pretrained(str(tmp_path)), sd)
    assert_same(state_dict_from_pretrained(tmp_path, device="cpu", dtype=torch.float16), sd, torch.float16)


def test_bin_is_preferred_over_safetensors_as_upstream(tmp_path):
    torch.save(tiny_state_dict(1), tmp_path / "pytorch_model.bin")
    safetensors_torch.save_file(tiny_state_dict(2), tmp_path / "model.safetensors")
    assert_same(state_dict_from_pretrained(str(tmp_path)), tiny_state_dict(1))


def test_missing_checkpoint_raises_environment_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EnvironmentError, match="was not found"):
        state_dict_from_pretrained(str(tmp_path))


def test_hub_cache_stand_in(tmp_path):
    """A Hub repository id resolved from the Hub cache (offline): stands in for a download from
    huggingface.co. The cache holds a sharded safetensors checkpoint only (upstream's Hub
    fallback looks for .bin files only; ours goes on to safetensors)."""
    sd = tiny_state_dict(3)
    repo = tmp_path / "hub" / "models--tiny-org--tiny-model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    write_sharded(snapshot, sd, safe=True)
    torch.save(sd, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import torch
        from flash_attn.utils.pretrained import state_dict_from_pretrained
        got = state_dict_from_pretrained("tiny-org/tiny-model", dtype=torch.float64)
        want = torch.load({str(tmp_path / 'expected.pt')!r})
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        assert all(torch.equal(got[k], want[k].double()) for k in want)
        try:
            state_dict_from_pretrained("tiny-org/absent-model")
        except OSError as exc:
            assert "was not found" in str(exc) or "absent-model" in str(exc), exc
        else:
            raise AssertionError("an absent repository loaded")
    """)
    env = dict(os.environ, HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_module_imports_without_transformers(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs the transformers package"):
        state_dict_from_pretrained(str(tmp_path))


# --- torch ---------------------------------------------------------------------------------------------


def test_custom_amp_decorator_adds_the_device_type_when_needed():
    from flash_attn.utils.torch import custom_amp_decorator

    calls = []

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return "decorated"

    assert custom_amp_decorator(recorder, True)("fn", cast_inputs=torch.float16) == "decorated"
    custom_amp_decorator(recorder, False)("fn")
    assert calls == [(("fn",), {"cast_inputs": torch.float16, "device_type": "cuda"}), (("fn",), {})]


def make_cube_function(forward_decorator):
    from flash_attn.utils.torch import custom_bwd

    class Cube(torch.autograd.Function):
        @staticmethod
        @forward_decorator
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.seen_dtype = x.dtype
            return x ** 3

        @staticmethod
        @custom_bwd
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 3 * x * x * grad

    return Cube


@pytest.mark.parametrize("form", ["bare", "with cast_inputs"])
def test_custom_fwd_bwd_in_autograd(form):
    from flash_attn.utils.torch import custom_fwd

    decorator = custom_fwd if form == "bare" else custom_fwd(cast_inputs=torch.float32)
    x = torch.linspace(-2, 2, 7, dtype=torch.float64, requires_grad=True)
    y = make_cube_function(decorator).apply(x)
    y.sum().backward()
    torch.testing.assert_close(y, x.detach() ** 3)
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)


def test_custom_fwd_casts_inputs_under_cuda_autocast():
    if test_device().type != "cuda":
        pytest.skip("CUDA autocast needs --flash-device cuda")
    from flash_attn.utils.torch import custom_fwd

    cube = make_cube_function(custom_fwd(cast_inputs=torch.float32))
    x = torch.randn(4, device="cuda", dtype=torch.float16, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.float16):
        y = cube.apply(x)
    assert y.dtype == torch.float32 and y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(x.grad.float(), 3 * x.detach().float() ** 2, rtol=1e-3, atol=1e-3)


# --- testing: masks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "random", "third"])
def test_generate_random_padding_mask(mode):
    torch.manual_seed(0)
    mask = ut.generate_random_padding_mask(30, 7, "cpu", mode=mode)
    lengths = mask.sum(-1)
    assert mask.shape == (7, 30) and mask.dtype == torch.bool
    # each row is a prefix of True
    assert torch.equal(mask, torch.arange(30).expand(7, 30) < lengths[:, None])
    low = {"full": 30, "random": 10, "third": 10}[mode]
    assert bool((lengths >= low).all()) and bool((lengths <= 30).all())


def test_padding_mask_with_zero_lengths():
    torch.manual_seed(0)
    # seqlen 30: the random lengths are at least 30 - 20, so only the forced rows are empty
    lengths = ut.generate_random_padding_mask(30, 12, "cpu", zero_lengths=True).sum(-1)
    assert lengths[[0, 5, 10, 11]].eq(0).all() and lengths[[1, 2, 3, 4, 6, 7, 8, 9]].ge(10).all()
    with pytest.raises(AssertionError, match="mode"):
        ut.generate_random_padding_mask(8, 2, "cpu", mode="half")


def hidden_by_loop(sq, sk, left, right, sink=0):
    """True where key j is hidden from query i: window [i + sk - sq - left, i + sk - sq + right]
    (None: unbounded), keys beyond sk hidden, the first ``sink`` keys never hidden by ``left``."""
    out = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            diag = i + sk - sq
            beyond_right = right is not None and j > diag + right
            beyond_left = left is not None and j < diag - left and j >= sink
            out[i, j] = beyond_right or beyond_left
    return out


@pytest.mark.parametrize("sq, sk", [(5, 9), (9, 5), (6, 6)])
@pytest.mark.parametrize("window", [(None, 0), (2, 1), (0, 0), (3, None), (1, 2)])
def test_construct_local_mask_matches_loops(sq, sk, window):
    if window[0] is None:
        got = ut.construct_local_mask(sq, sk, window)
    else:
        got = ut.construct_local_mask(sq, sk, window, sink_token_length=1)
    want = hidden_by_loop(sq, sk, *window, sink=0 if window[0] is None else 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("sq, sk, chunk", [(4, 10, 3), (10, 10, 4), (7, 5, 2)])
def test_construct_chunk_mask_matches_loops(sq, sk, chunk):
    want = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        start = ((i + sk - sq) // chunk) * chunk  # floor division: chunks of negative positions too
        for j in range(sk):
            want[i, j] = not (start <= j < start + chunk)
    assert torch.equal(ut.construct_chunk_mask(sq, sk, chunk), want)


# --- testing: attention_ref against tests/support/oracle.py ----------------------------------------------------


def qkv(b=2, sq=5, sk=7, h=4, hk=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=g, dtype=torch.float64).to(dtype)
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


def window_for_oracle(window):
    return tuple(-1 if w is None else w for w in window)


@pytest.mark.parametrize("causal, window, softcap", [
    (False, (None, None), 0.0), (True, (None, None), 0.0), (False, (2, 1), 0.0), (False, (None, 0), 0.0),
    (True, (1, None), 0.0), (False, (None, None), 3.0), (False, (3, 3), 2.0),
])
@pytest.mark.parametrize("sq, sk", [(5, 7), (7, 4)])
def test_attention_ref_matches_the_oracle(causal, window, softcap, sq, sk):
    q, k, v = qkv(sq=sq, sk=sk)
    out, attn = ut.attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap, upcast=False)
    ref = oracle.attention_ref(q, k, v, causal=causal, window=window_for_oracle(window), softcap=softcap)
    torch.testing.assert_close(out, ref.out)
    torch.testing.assert_close(attn, ref.probs)


@pytest.mark.parametrize("causal, window", [(False, (None, None)), (True, (None, None)), (False, (2, 1))])
def test_attention_ref_with_padding_matches_the_varlen_oracle(causal, window):
    # generate_qkv packs the padded batch; the oracle runs each sequence at its real length
    q, k, v = qkv(b=3, sq=6, sk=8)
    q_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], dtype=torch.bool)
    k_mask = torch.tensor([[1] * 8, [1] * 3 + [0] * 5, [1] * 7 + [0]], dtype=torch.bool)
    packed = ut.generate_qkv(q, k, v, q_mask, k_mask)
    q_unpad, k_unpad, v_unpad, _, cu_q, cu_k, seqused_q, seqused_k, max_q, max_k = packed[:10]
    output_pad_fn = packed[14]
    assert (max_q, max_k) == (6, 8) and cu_q.tolist() == [0, 6, 10, 12] and cu_k.tolist() == [0, 8, 11, 18]
    assert seqused_q.tolist() == [6, 4, 2] and seqused_k.tolist() == [8, 3, 7]
    ref = oracle.attention_varlen_ref(q_unpad.detach(), k_unpad.detach(), v_unpad.detach(), cu_q.tolist(),
                                      cu_k.tolist(), causal=causal, window=window_for_oracle(window))
    out, attn = ut.attention_ref(q, k, v, q_mask, k_mask, causal=causal, window_size=window, upcast=False)
    torch.testing.assert_close(out, output_pad_fn(ref.out))
    torch.testing.assert_close(attn, ref.probs)


def test_attention_ref_dropout_mask_matches_the_oracle():
    q, k, v = qkv()
    keep = torch.rand(2, 4, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    out, attn = ut.attention_ref(q, k, v, dropout_p=0.3, dropout_mask=keep, upcast=False)
    ref = oracle.attention_ref(q, k, v, keep=keep, dropout_p=0.3)
    torch.testing.assert_close(out, ref.out)
    torch.testing.assert_close(attn, ref.probs)  # before dropout


def test_attention_ref_learnable_sink():
    # the sink is one more logit in every row's softmax, whose value is dropped
    q, k, v = qkv(h=2, hk=2)
    sink = torch.tensor([0.5, -1.0])
    out, attn = ut.attention_ref(q.float(), k.float(), v.float(), learnable_sink=sink)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    with_sink = torch.cat([scores, sink.double().view(1, 2, 1, 1).expand(2, 2, 5, 1)], dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :-1]
    torch.testing.assert_close(attn.double(), probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), torch.einsum("bhts,bshd->bthd", probs, v), rtol=1e-5, atol=1e-6)


def test_attention_ref_upcasts_and_returns_the_input_dtype():
    q, k, v = qkv(dtype=torch.float16)
    out, attn = ut.attention_ref(q, k, v)
    assert out.dtype == attn.dtype == torch.float16
    ref = oracle.attention_ref(q, k, v)
    torch.testing.assert_close(out.double(), ref.out, rtol=2e-3, atol=2e-3)


def test_generate_qkv_packed_forms_round_trip():
    q, k, v = qkv(b=2, sq=5, sk=5, h=2, hk=2)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2], dtype=torch.bool)
    qkv_unpad, cu, max_s, qkv_padded, output_pad_fn, dqkv_pad_fn = ut.generate_qkv(q, k, v, mask, mask, qkvpacked=True)
    assert qkv_unpad.shape == (8, 3, 2, 8) and qkv_padded.shape == (2, 5, 3, 2, 8) and max_s == 5
    assert qkv_unpad.requires_grad and qkv_padded.requires_grad
    expected = torch.stack([q, k, v], dim=2) * mask[:, :, None, None, None]
    assert torch.equal(dqkv_pad_fn(qkv_unpad.detach()), expected)
    packed = ut.generate_qkv(q, k, v, None, mask, kvpacked=True)
    q_unpad, kv_unpad, cu_q, cu_k = packed[:4]
    assert q_unpad.shape == (10, 2, 8) and kv_unpad.shape == (8, 2, 2, 8)
    assert cu_q.tolist() == [0, 5, 10] and cu_k.tolist() == [0, 5, 8]
    assert torch.equal(packed[8](q_unpad.detach()), q)
    with pytest.raises(AssertionError, match="exclusive"):
        ut.generate_qkv(q, k, v, kvpacked=True, qkvpacked=True)
    with pytest.raises(AssertionError, match="query_padding_mask == key_padding_mask"):
        ut.generate_qkv(q, k, v, None, mask, qkvpacked=True)


# --- library -----------------------------------------------------------------------------------------------


from flash_attn.utils.library import triton_op  # noqa: E402


def scale_add(x, alpha):  # no annotations: only the explicit schema can describe it
    return x * alpha + 1.0


SCALE_ADD = triton_op("flash_attn_test_utils::scale_add", scale_add, mutates_args=(),
                      schema="(Tensor x, float alpha) -> Tensor")


@triton_op("flash_attn_test_utils::opaque_double", mutates_args=(), allow_decomposition=False)
def opaque_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def test_triton_op_registers_the_given_schema():
    schema = str(torch.ops.flash_attn_test_utils.scale_add.default._schema)
    assert schema == "flash_attn_test_utils::scale_add(Tensor x, float alpha) -> Tensor"
    x = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(torch.ops.flash_attn_test_utils.scale_add(x, 3.0), 3.0 * x + 1.0)
    torch.testing.assert_close(SCALE_ADD(x, 0.5), 0.5 * x + 1.0)
    assert "opaque_double(Tensor x) -> Tensor" in str(torch.ops.flash_attn_test_utils.opaque_double.default._schema)


def test_triton_op_has_a_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.flash_attn_test_utils.scale_add(torch.empty(3, 4), 2.0)
    assert out.shape == (3, 4) and type(out).__name__ == "FakeTensor"


def compiled_graph_targets(fn, x):
    """The operators in the forward graph AOTAutograd hands the compiler for ``fn(x)``."""
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def capture(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    torch._dynamo.reset()
    out = torch.compile(fn, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(x)
    return out, seen


def test_triton_op_decomposes_under_compile_unless_told_not_to():
    x = torch.randn(6)
    out, targets = compiled_graph_targets(lambda t: torch.ops.flash_attn_test_utils.scale_add(t, 2.0), x)
    torch.testing.assert_close(out, 2.0 * x + 1.0)
    assert not any("scale_add" in t for t in targets) and any("mul" in t for t in targets), targets
    out, targets = compiled_graph_targets(lambda t: torch.ops.flash_attn_test_utils.opaque_double(t), x)
    torch.testing.assert_close(out, 2.0 * x)
    assert any("opaque_double" in t for t in targets), targets
