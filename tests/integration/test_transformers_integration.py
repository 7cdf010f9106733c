"""Hugging Face Transformers through this package: a tiny randomly initialised
``LlamaForCausalLM`` (config only, nothing downloaded) gives the same logits, gradients and
``generate()`` tokens through transformers' flash-attention code path as through ``eager``, on
the CPU by default and on ``--flash-device`` (a GPU in ``.ci/gpu-check``).

Two routes are checked:

* ``register()`` + ``attn_implementation="flash_attention_2_portable"``: what a CPU user does;
* ``attn_implementation="flash_attention_2"``: what transformers does by itself on a CUDA machine
  (it imports ``flash_attn`` and ``flash_attn.bert_padding`` itself). Transformers only allows it
  where CUDA is available, so its availability gate is opened here for the test.

Comparisons: fp32 against eager fp32 within a small absolute tolerance; fp16/bf16 by the suite's
tolerance rule (at most twice eager's own error in that dtype against eager in fp32, plus slack).
On a GPU the kernel backends take the calls and refuse fp32 inputs by design, so the fp32 cases
run in fp16 (logits, generate) or bf16 (training, packed sequences, the native path) there.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if os.environ.get("CI"):
    import transformers  # CI installs it: a missing transformers is a failure there
else:
    transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import flash_attn  # noqa: E402
from flash_attn.integrations import transformers as integration  # noqa: E402

from support.options import test_device  # noqa: E402
from support.tolerance import check_close  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

VOCAB = 96
SEQ = 12
DEVICE = test_device()
FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
# fp32 where the device takes it (the CPU); a GPU's kernels refuse it by design
FIRST = FP32 if DEVICE.type == "cpu" else FP16  # the first of the two dtypes of a parametrized test
SINGLE = FP32 if DEVICE.type == "cpu" else BF16  # the dtype of a test of one dtype
DTYPES = pytest.mark.parametrize("dtype", [FIRST, BF16], ids=lambda d: {FP32: "fp32", FP16: "fp16", BF16: "bf16"}[d])


@pytest.fixture(autouse=True)
def _registered():
    integration.register()
    yield
    integration.unregister()


def config(**overrides) -> LlamaConfig:
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2,  # large weights: clear argmax margins for greedy generate()
        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    base.update(overrides)
    return LlamaConfig(**base)


def model_pair(dtype, implementation=integration.IMPLEMENTATION, seed=0):
    """The same weights twice: eager and ``implementation``."""
    torch.manual_seed(seed)
    eager = LlamaForCausalLM(config()).to(dtype).to(DEVICE).eval()
    eager.set_attn_implementation("eager")
    ours = LlamaForCausalLM(copy.deepcopy(eager.config)).to(dtype).to(DEVICE).eval()
    ours.load_state_dict(eager.state_dict())
    ours.set_attn_implementation(implementation)
    assert ours.config._attn_implementation == implementation
    assert eager.config._attn_implementation == "eager"
    return eager, ours


def batch(seed=0, left_pad=(0, 4, 7), right_pad=(0, 0, 0)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(left_pad), SEQ), generator=g)
    mask = torch.ones_like(ids)
    for row, (left, right) in enumerate(zip(left_pad, right_pad)):
        mask[row, :left] = 0
        mask[row, SEQ - right :] = 0
    ids[mask == 0] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def assert_logits_close(ours, eager, reference, dtype, where=None):
    pick = (lambda t: t[where]) if where is not None else (lambda t: t)
    ours, eager, reference = (pick(t).double() for t in (ours, eager, reference))
    err = (ours - reference).abs().max().item()
    if dtype == torch.float32:
        assert err <= 1e-4 * max(1.0, reference.abs().max().item()), err
    else:
        eager_err = (eager - reference).abs().max().item()
        slack = 2 * torch.finfo(dtype).eps * reference.abs().max().item()
        assert err <= 2 * eager_err + slack, (err, eager_err)


def fp32_reference(eager, ids, mask):
    ref = copy.deepcopy(eager).float()
    with torch.no_grad():
        return ref(ids, attention_mask=mask).logits


def assert_like_eager(got, want, eager, run, dtype, where=None):
    """fp32: ``got`` within 1e-4 of eager's ``want``; fp16/bf16: the tolerance rule against eager
    in fp32 (``run(model)`` gives the logits of a model)."""
    if dtype == FP32:
        if where is not None:
            got, want = got[where], want[where]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        return
    ref = copy.deepcopy(eager).float()
    with torch.no_grad():
        reference = run(ref)
    assert_logits_close(got, want, reference, dtype, where=where)


@pytest.fixture
def varlen_calls(monkeypatch):
    """Counts the calls transformers makes to this package's dense and varlen functions."""
    from transformers import modeling_flash_attention_utils as flash_utils

    calls = {"dense": 0, "varlen": 0}

    def counting(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    assert flash_utils._flash_fn is flash_attn.flash_attn_func
    assert getattr(flash_utils._flash_varlen_fn, "__wrapped__", None) is flash_attn.flash_attn_varlen_func
    monkeypatch.setattr(flash_utils, "_flash_fn", counting("dense", flash_utils._flash_fn))
    monkeypatch.setattr(flash_utils, "_flash_varlen_fn", counting("varlen", flash_utils._flash_varlen_fn))
    return calls


@DTYPES
def test_logits_match_eager_without_padding(dtype, varlen_calls):
    eager, ours = model_pair(dtype)
    ids, mask = batch(left_pad=(0, 0, 0))
    with torch.no_grad():
        got, want = ours(ids).logits, eager(ids).logits
    assert_logits_close(got, want, fp32_reference(eager, ids, mask), dtype)
    assert varlen_calls == {"dense": 2, "varlen": 0}  # one call per layer, dense path


@DTYPES
@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch_goes_through_the_varlen_path(dtype, padding, varlen_calls):
    eager, ours = model_pair(dtype)
    ids, mask = batch(left_pad=(0, 4, 7)) if padding == "left" else batch(left_pad=(0, 0, 0), right_pad=(0, 3, 8))
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    valid = mask.bool()  # padded positions are undefined in both
    assert_logits_close(got, want, fp32_reference(eager, ids, mask), dtype, where=valid)
    assert varlen_calls == {"dense": 0, "varlen": 2}


def assert_same_generation(got, want, eager_logits, dtype):
    """Greedy tokens equal; in bf16 they may part only where eager's own top-2 logits were closer
    than bf16 can tell apart (a tie within rounding), after which the continuations differ."""
    assert got.shape == want.shape
    for step in range(got.shape[1] - SEQ):
        differ = got[:, SEQ + step] != want[:, SEQ + step]
        if not differ.any():
            continue
        assert dtype != torch.float32, (step, got[:, SEQ:], want[:, SEQ:])
        top2 = eager_logits[step][differ].float().topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).max().item()
        tie = 4 * torch.finfo(dtype).eps * top2.abs().max().item()
        assert margin <= tie, f"step {step}: eager's margin {margin:.4f} is no tie (> {tie:.4f})"
        return
    return


@DTYPES
def test_generate_matches_eager(dtype):
    eager, ours = model_pair(dtype)
    ids, mask = batch(left_pad=(0, 3, 6))
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        want = eager.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)
    assert got.sequences.shape == (3, SEQ + 5)
    assert_same_generation(got.sequences, want.sequences, want.logits, dtype)


def test_gradients_match_eager():
    """Training on a right-padded batch (with left padding, the first real token's label would be
    predicted from a padding position, whose output is undefined). fp16/bf16: each parameter's
    gradient by the tolerance rule (support.tolerance.check_close) against eager in fp32, eager in that
    dtype as the naive computation."""
    dtype = SINGLE
    eager, ours = model_pair(dtype)
    reference = copy.deepcopy(eager).float() if dtype != FP32 else None
    ids, mask = batch(left_pad=(0, 0, 0), right_pad=(0, 2, 5))
    labels = ids.masked_fill(mask == 0, -100)
    for model in (eager, ours, reference):
        if model is not None:
            model.train()
            model(ids, attention_mask=mask, labels=labels).loss.backward()
    if dtype == FP32:
        for (name, p_eager), p_ours in zip(eager.named_parameters(), ours.parameters()):
            torch.testing.assert_close(p_ours.grad, p_eager.grad, atol=1e-4, rtol=1e-3, msg=name)
        return
    for (name, p_eager), p_ours, p_ref in zip(eager.named_parameters(), ours.parameters(), reference.parameters()):
        check_close(p_ours.grad, p_ref.grad, p_eager.grad, dtype, f"{name}.grad", grad=True)


def test_packed_sequences_from_position_ids(varlen_calls):
    """Padding-free training batches: several sequences in one row, restarted position ids."""
    eager, ours = model_pair(SINGLE)
    lengths = (5, 4, 3)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(DEVICE)

    def separately(model):
        return torch.cat([model(part).logits for part in ids.split(lengths, dim=1)], dim=1)

    with torch.no_grad():
        packed = ours(ids, position_ids=position_ids).logits
        separate = separately(eager)
    assert_like_eager(packed, separate, eager, separately, SINGLE)
    assert varlen_calls["varlen"] == 2


def test_the_cache_slot_is_reclaimed():
    """Another flash implementation loaded in between takes transformers' single function cache."""
    from transformers import modeling_flash_attention_utils as flash_utils

    eager, ours = model_pair(SINGLE)
    ids, mask = batch()
    flash_utils._loaded_implementation = "some_other_flash_implementation"
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = eager(ids, attention_mask=mask).logits
    assert_like_eager(got, want, eager, lambda m: m(ids, attention_mask=mask).logits, SINGLE, where=mask.bool())
    assert flash_utils._loaded_implementation == integration.IMPLEMENTATION


def test_register_rejects_names_transformers_would_misread():
    for name in ("my_attention", "org/flash-kernel", "flash_attention_2", "flash:x"):
        with pytest.raises(ValueError):
            integration.register(name)
    assert integration.register("flash_attn_custom_name") == "flash_attn_custom_name"
    assert integration.is_registered("flash_attn_custom_name")
    integration.unregister("flash_attn_custom_name")
    assert not integration.is_registered("flash_attn_custom_name")


def test_transformers_refuses_flash_attention_2_on_cpu():
    """Why register() exists: transformers' own name needs CUDA."""
    if integration.native_flash_attention_2_available():
        pytest.skip("transformers can use flash_attention_2 here: checks the behaviour without a usable GPU")
    with pytest.raises((ImportError, ValueError)):
        LlamaForCausalLM(config()).set_attn_implementation("flash_attention_2")


@pytest.fixture
def cuda_gate_open(monkeypatch):
    """What a CUDA machine looks like to transformers' flash_attention_2 availability checks."""
    from transformers import modeling_flash_attention_utils as flash_utils

    matrix = flash_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda *a, **k: True)
    monkeypatch.setitem(matrix, "general_availability_check", lambda *a, **k: True)
    monkeypatch.setitem(matrix, "supported_devices", ((lambda: True, "cpu"),))
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    yield
    flash_utils._loaded_implementation = None


def test_native_flash_attention_2_path_imports_this_package(cuda_gate_open):
    """transformers' own import of flash-attn on a CUDA machine: padded batch and generate()."""
    from transformers import modeling_flash_attention_utils as flash_utils

    eager, ours = model_pair(SINGLE, implementation="flash_attention_2")
    assert flash_utils._flash_varlen_fn is flash_attn.flash_attn_varlen_func
    ids, mask = batch(left_pad=(0, 3, 6))
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
        assert_like_eager(got, want, eager, lambda m: m(ids, attention_mask=mask).logits, SINGLE, where=mask.bool())
        kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        try:
            generated = ours.generate(ids, **kwargs)
        except RuntimeError as exc:
            if "Expected a long tensor for index" in str(exc):
                pytest.xfail("flash_attn.bert_padding.pad_input rejects the int32 indices transformers passes")
            raise
        if SINGLE == FP32:
            assert torch.equal(generated, eager.generate(ids, **kwargs))
        else:
            want = eager.generate(ids, **kwargs, return_dict_in_generate=True, output_logits=True)
            assert_same_generation(generated, want.sequences, want.logits, SINGLE)


def test_native_flash_attention_2_path_packed_sequences(cuda_gate_open):
    """Packed sequences: transformers passes max_seqlen as a 0-d tensor (upstream accepts it)."""
    eager, ours = model_pair(SINGLE, implementation="flash_attention_2")
    lengths = (5, 4, 3)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(DEVICE)

    def separately(model):
        return torch.cat([model(part).logits for part in ids.split(lengths, dim=1)], dim=1)

    with torch.no_grad():
        try:
            packed = ours(ids, position_ids=position_ids).logits
        except ValueError as exc:
            if "max_seqlen_q must be a non-negative int, got tensor" in str(exc):
                pytest.xfail("flash_attn_varlen_func rejects the 0-d tensor max_seqlen transformers passes")
            raise
        separate = separately(eager)
    assert_like_eager(packed, separate, eager, separately, SINGLE)
