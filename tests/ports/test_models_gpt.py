"""``flash_attn.models.gpt`` against Hugging Face transformers' GPT-2 (random weights, tiny
configs, float32): logits, gradients, greedy generation (through the kv cache and without it),
the config options that must not change the result, bad configs, the tensor-parallel state-dict
conversions, and (2 gloo ranks) the tensor-parallel model itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from support import gloo_ranks

transformers = pytest.importorskip("transformers")

from flash_attn.models.gpt import (  # noqa: E402
    GPTLMHeadModel,
    GPTModel,
    combine_state_dicts_tp,
    create_block,
    create_mixer_cls,
    create_mlp_cls,
    remap_state_dict_hf_gpt2,
    remap_state_dict_megatron,
    shard_state_dict_tp,
)

VOCAB, B, S = 100, 2, 10
ATOL = 1e-4  # float32, two layers: the two models differ by a few ulps of values of order 1


def gpt2_config(**extra):
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB,
                                     n_positions=64, bos_token_id=0, eos_token_id=None)
    for name, value in extra.items():
        setattr(config, name, value)
    return config


def hf_and_ours(device, **extra):
    """A random HF GPT-2 and our model loaded (strict) with its remapped weights, both eval."""
    config = gpt2_config(**extra)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).to(device).eval()
    ours = GPTLMHeadModel(config, device=device).eval()
    ours.load_state_dict(remap_state_dict_hf_gpt2(hf.state_dict(), config), strict=True)
    return hf, ours


def random_ids(device, batch=B, seqlen=S, seed=1):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed)).to(device)


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("use_flash_attn", [False, True])
def test_logits_and_gradients_equal_transformers_gpt2(device, use_flash_attn):
    hf, ours = hf_and_ours(device, use_flash_attn=use_flash_attn)
    ids = random_ids(device)
    labels = random_ids(device, seed=2)
    logits_hf = hf(ids).logits
    logits = ours(ids).logits
    assert logits.shape == (B, S, VOCAB)
    assert err(logits, logits_hf) < ATOL
    F.cross_entropy(logits_hf.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    pairs = {  # ours -> HF (Conv1D weights are stored transposed)
        "Wqkv": (ours.transformer.layers[0].mixer.Wqkv.weight.grad,
                 hf.transformer.h[0].attn.c_attn.weight.grad.t()),
        "fc1": (ours.transformer.layers[1].mlp.fc1.weight.grad, hf.transformer.h[1].mlp.c_fc.weight.grad.t()),
        "norm1": (ours.transformer.layers[1].norm1.weight.grad, hf.transformer.h[1].ln_1.weight.grad),
        "wte": (ours.transformer.embeddings.word_embeddings.weight.grad, hf.transformer.wte.weight.grad),
        "wpe": (ours.transformer.embeddings.position_embeddings.weight.grad, hf.transformer.wpe.weight.grad),
    }
    for name, (g, g_hf) in pairs.items():
        assert err(g, g_hf) < ATOL, name


def greedy_without_cache(model, ids, max_length):
    """Greedy decoding by running the whole sequence every step (no inference_params)."""
    with torch.no_grad():
        while ids.shape[1] < max_length:
            next_token = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_token], dim=1)
    return ids


@pytest.mark.parametrize("use_flash_attn", [False, True])
def test_greedy_generation_equals_transformers_gpt2(device, use_flash_attn):
    hf, ours = hf_and_ours(device, use_flash_attn=use_flash_attn)
    ids = random_ids(device, seqlen=5)
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_length=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert expected.shape == (B, 16)
    assert torch.equal(ours.generate(ids, max_length=16, top_k=1), expected)  # kv cache
    assert torch.equal(greedy_without_cache(ours, ids, 16), expected)
    out = ours.generate(ids, max_length=16, top_k=1, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, expected) and len(out.scores) == 16 - 5


@pytest.mark.parametrize(
    "extra",
    [
        {"fused_dropout_add_ln": True},
        {"fused_dropout_add_ln": True, "residual_in_fp32": True},
        {"residual_in_fp32": True},
        {"fused_bias_fc": True},  # accepted and ignored, as upstream's MHA does
        {"pad_vocab_size_multiple": 8},
        # settings GPT-2 itself has, which HF applies too
        {"scale_attn_by_inverse_layer_idx": True},
        {"activation_function": "relu", "n_inner": 96},
        {"activation_function": "gelu", "layer_norm_epsilon": 1e-3},
        # upstream's fused MLP (ops.fused_dense.FusedMLP): GPT-2's tanh GELU, and relu recomputed
        {"fused_mlp": True},
        {"fused_mlp": True, "activation_function": "relu", "mlp_checkpoint_lvl": 1},
    ],
    ids=["fused_ln", "fused_ln_fp32_residual", "fp32_residual", "fused_bias_fc", "padded_vocab",
         "inverse_layer_scale", "relu_n_inner", "exact_gelu_eps", "fused_mlp", "fused_mlp_relu_checkpoint"],
)
def test_options_match_transformers_gpt2(device, extra):
    hf, ours = hf_and_ours(device, **extra)
    ids = random_ids(device)
    logits = ours(ids).logits
    padded = -(-VOCAB // extra.get("pad_vocab_size_multiple", 1)) * extra.get("pad_vocab_size_multiple", 1)
    assert logits.shape == (B, S, padded)
    assert err(logits[..., :VOCAB], hf(ids).logits) < ATOL
    # greedy decoding ignores the padded vocabulary entries only if told the real size
    expected = greedy_without_cache(hf, ids[:, :4], 10)
    got = ours.generate(ids[:, :4], max_length=10, top_k=1, vocab_size=VOCAB)
    assert torch.equal(got, expected)


def test_num_last_tokens_position_ids_and_backbone(device):
    hf, ours = hf_and_ours(device)
    ids = random_ids(device)
    full = hf(ids).logits
    assert err(ours(ids, num_last_tokens=3).logits, full[:, -3:]) < ATOL
    positions = torch.arange(4, 4 + S, device=device).expand(B, S)
    assert err(ours(ids, position_ids=positions).logits, hf(ids, position_ids=positions).logits) < ATOL
    backbone = GPTModel(ours.config, device=device).eval()
    backbone.load_state_dict(ours.transformer.state_dict())
    hidden_hf = hf.transformer(ids).last_hidden_state
    assert err(backbone(ids), hidden_hf) < ATOL
    cache = ours.allocate_inference_cache(B, 16)
    assert set(cache) == {0, 1} and cache[0].shape == (B, 16, 2, 4, 16)


def test_tied_and_untied_heads():
    _, tied = hf_and_ours("cpu")
    assert tied.lm_head.weight is tied.transformer.embeddings.word_embeddings.weight
    untied = GPTLMHeadModel(gpt2_config(tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.transformer.embeddings.word_embeddings.weight
    assert "lm_head.weight" in untied.state_dict()


def test_postnorm_and_parallel_block_build_and_run():
    # No HF GPT-2 oracle for these layouts: check them against the blocks run by hand.
    ids = random_ids("cpu")
    for extra in ({"prenorm": False}, {"parallel_block": True, "rotary_emb_fraction": 0.5}):
        model = GPTLMHeadModel(gpt2_config(**extra)).eval()
        t = model.transformer
        h = t.embeddings(ids)
        if extra.get("prenorm", True) is False:
            for layer in t.layers:
                h = layer.norm1(h + layer.mixer(h))
                h = layer.norm2(h + layer.mlp(h))
            expected = model.lm_head(h)
        else:
            residual = h
            for layer in t.layers:
                x = layer.norm1(residual)
                residual = residual + layer.mixer(x) + layer.mlp(layer.norm2(residual))
            expected = model.lm_head(t.ln_f(residual))
        assert err(model(ids).logits, expected) < ATOL


@pytest.mark.parametrize("activation", ["gelu", "relu", "sqrelu", "glu", "swiglu", "geglu"])
def test_activations_build_the_right_mlp(activation):
    config = gpt2_config(activation_function=activation, n_inner=128)
    mlp = create_mlp_cls(config)(64)
    x = torch.randn(3, 64)
    h = F.linear(x, mlp.fc1.weight, mlp.fc1.bias)
    if activation in ("glu", "swiglu", "geglu"):
        value, gate = h.chunk(2, dim=-1)
        act = {"glu": torch.sigmoid, "swiglu": F.silu, "geglu": F.gelu}[activation]
        h = value * act(gate)
    else:
        h = {"gelu": F.gelu, "relu": F.relu, "sqrelu": lambda t: F.relu(t) ** 2}[activation](h)
    assert err(mlp(x), F.linear(h, mlp.fc2.weight, mlp.fc2.bias)) < 1e-5


def test_mixer_and_block_factories_follow_the_config():
    config = gpt2_config(n_head_kv=2, rotary_emb_fraction=0.5, scale_attn_by_inverse_layer_idx=True,
                         qkv_proj_bias=False)
    mixer = create_mixer_cls(config, layer_idx=1)(64)
    assert mixer.num_heads_kv == 2 and mixer.rotary_emb_dim == 8 and mixer.Wqkv.bias is None
    assert mixer.inner_attn.softmax_scale == pytest.approx(16 ** -0.5 / 2)
    block = create_block(gpt2_config(rms_norm=True), layer_idx=0)
    assert type(block.norm1).__name__ == "RMSNorm" and block.layer_idx == 0


@pytest.mark.parametrize(
    "extra, error, match",
    [
        ({"n_embd": 62}, ValueError, "divisible"),
        ({"n_head_kv": 3}, ValueError, "n_head_kv"),
        ({"activation_function": "tanh"}, ValueError, "activation_function"),
        ({"fused_mlp": True, "activation_function": "gelu"}, ValueError, "fused_mlp"),
        ({"fused_dense_sqrelu_dense": True}, ValueError, "sqrelu"),
        ({"fused_mlp": True, "fused_dense_sqrelu_dense": True}, ValueError, "exclude"),
        ({"parallel_block": True, "prenorm": False}, ValueError, "prenorm"),
    ],
)
def test_bad_configs_fail_clearly(extra, error, match):
    with pytest.raises(error, match=match):
        GPTLMHeadModel(gpt2_config(**extra))


def test_bad_inputs_fail_clearly():
    with pytest.raises(ValueError, match="GPT2Config"):
        GPTLMHeadModel(transformers.LlamaConfig())
    model = GPTLMHeadModel(gpt2_config())
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="not supported"):
        GPTLMHeadModel.from_pretrained("someone/unknown-model", gpt2_config())


def test_from_pretrained_remaps_and_loads_offline(monkeypatch):
    """from_pretrained with the download replaced by a random HF GPT-2's state dict."""
    import sys
    import types

    hf, _ = hf_and_ours("cpu")
    calls = []

    def state_dict_from_pretrained(model_name, device=None, dtype=None):
        calls.append((model_name, device, dtype))
        return {k: v.clone() for k, v in hf.state_dict().items()}

    fake = types.ModuleType("flash_attn.utils.pretrained")
    fake.state_dict_from_pretrained = state_dict_from_pretrained
    monkeypatch.setitem(sys.modules, "flash_attn.utils.pretrained", fake)
    ours = GPTLMHeadModel.from_pretrained("gpt2-tiny", gpt2_config()).eval()
    assert calls == [("gpt2-tiny", "cpu", None)]
    ids = random_ids("cpu")
    assert err(ours(ids).logits, hf(ids).logits) < ATOL


def test_legacy_checkpoint_norm_order_is_remapped():
    """Old checkpoints: ln_0 before the first block and each norm after its branch."""
    model = GPTLMHeadModel(gpt2_config())
    for p in model.parameters():
        torch.nn.init.normal_(p)
    current = {k: v.clone() for k, v in model.state_dict().items()}
    legacy = dict(current)
    # Written out by hand for 2 layers: the norm before branch k was stored under branch k - 1.
    moves = {"transformer.layers.0.norm1": "transformer.ln_0",
             "transformer.layers.0.norm2": "transformer.layers.0.norm1",
             "transformer.layers.1.norm1": "transformer.layers.0.norm2",
             "transformer.layers.1.norm2": "transformer.layers.1.norm1",
             "transformer.ln_f": "transformer.layers.1.norm2"}
    for new in moves:
        for kind in ("weight", "bias"):
            del legacy[f"{new}.{kind}"]
    for new, old in moves.items():
        for kind in ("weight", "bias"):
            legacy[f"{old}.{kind}"] = current[f"{new}.{kind}"]
    fresh = GPTLMHeadModel(gpt2_config())
    fresh.load_state_dict(legacy)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, current[key]), key


def test_megatron_remap_reorders_qkv():
    config = gpt2_config()
    _, ours = hf_and_ours("cpu")
    sd = ours.state_dict()
    megatron = {
        "language_model.embedding.word_embeddings.weight": sd["transformer.embeddings.word_embeddings.weight"],
        "language_model.encoder.final_layernorm.weight": sd["transformer.ln_f.weight"],
    }
    heads, head_dim = 4, 16
    for i in range(2):
        w = sd[f"transformer.layers.{i}.mixer.Wqkv.weight"]
        # Megatron: for each head its q, k, v rows
        per_head = [w[which * 64 + h * head_dim: which * 64 + (h + 1) * head_dim]
                    for h in range(heads) for which in range(3)]
        layer = f"language_model.encoder.layers.{i}"
        megatron[f"{layer}.self_attention.query_key_value.weight"] = torch.cat(per_head)
        megatron[f"{layer}.mlp.dense_h_to_4h.weight"] = sd[f"transformer.layers.{i}.mlp.fc1.weight"]
    out = remap_state_dict_megatron(megatron, config)
    for key in ("transformer.layers.1.mixer.Wqkv.weight", "transformer.layers.0.mlp.fc1.weight",
                "transformer.ln_f.weight"):
        assert torch.equal(out[key], sd[key]), key
    assert out["lm_head.weight"] is out["transformer.embeddings.word_embeddings.weight"]


# ----------------------------------------------------------------------------------------------
# Tensor parallel
# ----------------------------------------------------------------------------------------------

TP_CONFIGS = {
    "gpt2": dict(),
    "gqa_swiglu_untied": dict(n_head_kv=2, activation_function="swiglu", n_inner=96, mlp_multiple_of=1,
                              tie_word_embeddings=False, lm_head_bias=True, rotary_emb_fraction=1.0),
}


@pytest.mark.parametrize("name, world", [("gpt2", 2), ("gpt2", 4), ("gqa_swiglu_untied", 2)])
def test_shard_then_combine_is_the_identity(name, world):
    config = gpt2_config(**TP_CONFIGS[name])
    model = GPTLMHeadModel(config)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    shards = [shard_state_dict_tp(dict(full), config, world, rank) for rank in range(world)]
    # Independent check of one layout fact: rank r's query rows are heads [r*4/world, ...).
    head_dim, q_heads = 16, 4 // world
    kv_heads = (config.n_head_kv if hasattr(config, "n_head_kv") else 4) // world
    rank1_q = shards[1]["transformer.layers.0.mixer.Wqkv.weight"][: q_heads * head_dim]
    full_q = full["transformer.layers.0.mixer.Wqkv.weight"][q_heads * head_dim: 2 * q_heads * head_dim]
    assert torch.equal(rank1_q, full_q)
    assert shards[1]["transformer.layers.0.mixer.Wqkv.weight"].shape[0] == (q_heads + 2 * kv_heads) * head_dim
    assert "transformer.layers.0.mlp.fc2.bias" not in shards[1]
    combined = combine_state_dicts_tp(shards, config)
    assert combined.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(combined[key], value), key


def test_shard_rejects_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="divisible by world_size"):
        shard_state_dict_tp({}, gpt2_config(), 3, 0)


def _tp_worker_case(rank, world, sequence_parallel, extra):
    config = gpt2_config(sequence_parallel=sequence_parallel, **extra)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(gpt2_config()).eval()
    ours = GPTLMHeadModel(config, process_group=dist.group.WORLD).eval()
    full = remap_state_dict_hf_gpt2(hf.state_dict(), config)
    ours.load_state_dict(shard_state_dict_tp(full, config, world, rank), strict=True)
    ids = random_ids("cpu")
    expected = hf(ids).logits.detach()
    share = VOCAB // world
    mine = expected[..., rank * share: (rank + 1) * share]
    with torch.no_grad():
        logits = ours(ids).logits
    if sequence_parallel:
        mine = mine.flatten(0, 1)  # all tokens, this rank's vocabulary slice
    errors = {"logits": err(logits, mine)}
    if not sequence_parallel:
        reference = hf.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), max_length=10,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        generated = ours.generate(ids[:, :4], max_length=10, top_k=1, tensor_parallel=world)
        errors["generate"] = float(not torch.equal(generated, reference))
    return errors


TP_CASES = {
    "plain": lambda r, w: _tp_worker_case(r, w, False, {}),
    "sequence_parallel": lambda r, w: _tp_worker_case(r, w, True, {}),
}


def tp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    gloo_ranks.run_cases(TP_CASES, rank, world, init_file, result_dir)


def test_tensor_parallel_model_over_gloo_equals_transformers(tmp_path, monkeypatch):
    gloo_ranks.skip_unless_cpu_ranks_can_run(monkeypatch)
    results = gloo_ranks.spawn(tp_worker, 2, tmp_path)
    gloo_ranks.assert_errors_below(results, TP_CASES, ATOL)
