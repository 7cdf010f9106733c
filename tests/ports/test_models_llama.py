"""``flash_attn.models.llama`` (+ ``GPTLMHeadModel``) against Hugging Face transformers' Llama
(random weights, tiny configs, float32): grouped-query attention and a non-default rope_theta,
logits, gradients, greedy generation, the inverse remap, Meta-format checkpoints, config
conversion, and (2 gloo ranks) the tensor-parallel model.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from support import gloo_ranks

transformers = pytest.importorskip("transformers")

from flash_attn.models.gpt import GPTLMHeadModel, shard_state_dict_tp  # noqa: E402
from flash_attn.models.llama import (  # noqa: E402
    config_from_checkpoint,
    inv_remap_state_dict_hf_llama,
    llama_config_to_gpt2_config,
    remap_state_dict_hf_llama,
    remap_state_dict_meta_llama,
    state_dicts_from_checkpoint,
)

VOCAB, B, S = 100, 2, 10
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96
ATOL = 1e-4


def llama_config(**extra):
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rope_theta=500.0,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    kwargs.update(extra)
    return transformers.LlamaConfig(**kwargs)


def hf_and_ours(device, use_flash_attn=False, **extra):
    config = llama_config(**extra)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(device).eval()
    gpt_config = llama_config_to_gpt2_config(config)
    gpt_config.use_flash_attn = use_flash_attn
    ours = GPTLMHeadModel(gpt_config, device=device).eval()
    ours.load_state_dict(remap_state_dict_hf_llama(hf.state_dict(), gpt_config), strict=True)
    return hf, ours


def random_ids(device, seqlen=S, seed=1):
    return torch.randint(0, VOCAB, (B, seqlen), generator=torch.Generator().manual_seed(seed)).to(device)


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def test_config_conversion():
    gpt = llama_config_to_gpt2_config(llama_config())
    assert (gpt.n_embd, gpt.n_head, gpt.n_head_kv, gpt.n_inner, gpt.n_layer) == (HIDDEN, HEADS, KV_HEADS, INTER, 2)
    assert gpt.rotary_emb_base == 500.0 and gpt.rotary_emb_interleaved and gpt.rotary_emb_fraction == 1.0
    assert gpt.rms_norm and gpt.activation_function == "swiglu" and gpt.n_positions == 0
    assert gpt.tie_word_embeddings is False
    assert llama_config_to_gpt2_config(transformers.LlamaConfig()).rotary_emb_base == 10000.0


@pytest.mark.parametrize("use_flash_attn", [False, True])
def test_logits_and_gradients_equal_transformers_llama(device, use_flash_attn):
    hf, ours = hf_and_ours(device, use_flash_attn)
    ids, labels = random_ids(device), random_ids(device, seed=2)
    logits_hf, logits = hf(ids).logits, ours(ids).logits
    assert logits.shape == (B, S, VOCAB)
    assert err(logits, logits_hf) < ATOL
    F.cross_entropy(logits_hf.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    layer, hf_layer = ours.transformer.layers[1], hf.model.layers[1]
    # Wqkv's value rows are not permuted by the remap: compare them directly.
    v_rows = layer.mixer.Wqkv.weight.grad[(HEADS + KV_HEADS) * HEAD_DIM:]
    pairs = {
        "v_proj": (v_rows, hf_layer.self_attn.v_proj.weight.grad),
        "o_proj": (layer.mixer.out_proj.weight.grad, hf_layer.self_attn.o_proj.weight.grad),
        "up_proj": (layer.mlp.fc1.weight.grad[:INTER], hf_layer.mlp.up_proj.weight.grad),
        "gate_proj": (layer.mlp.fc1.weight.grad[INTER:], hf_layer.mlp.gate_proj.weight.grad),
        "norm": (ours.transformer.ln_f.weight.grad, hf.model.norm.weight.grad),
        "embed": (ours.transformer.embeddings.word_embeddings.weight.grad, hf.model.embed_tokens.weight.grad),
        "lm_head": (ours.lm_head.weight.grad, hf.lm_head.weight.grad),
    }
    for name, (g, g_hf) in pairs.items():
        assert err(g, g_hf) < ATOL, name


def test_the_rope_base_matters():
    """The oracle can tell a wrong rotary base: with base 10000 the logits differ."""
    hf, ours = hf_and_ours("cpu")
    for layer in ours.transformer.layers:
        rotary = layer.mixer.rotary_emb
        rotary.base = 10000.0
        rotary.inv_freq = rotary._compute_inv_freq()
        rotary._seq_len_cached = 0
    ids = random_ids("cpu")
    assert err(ours(ids).logits, hf(ids).logits) > 1e-3


def greedy_without_cache(model, ids, max_length):
    with torch.no_grad():
        while ids.shape[1] < max_length:
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("use_flash_attn", [False, True])
def test_greedy_generation_equals_transformers_llama(device, use_flash_attn):
    hf, ours = hf_and_ours(device, use_flash_attn)
    ids = random_ids(device, seqlen=5)
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_length=18, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert expected.shape == (B, 18)
    assert torch.equal(ours.generate(ids, max_length=18, top_k=1), expected)
    assert torch.equal(greedy_without_cache(ours, ids, 18), expected)


def test_tied_embeddings_llama():
    hf, ours = hf_and_ours("cpu", tie_word_embeddings=True)
    assert ours.lm_head.weight is ours.transformer.embeddings.word_embeddings.weight
    ids = random_ids("cpu")
    assert err(ours(ids).logits, hf(ids).logits) < ATOL


def test_inverse_remap_round_trip():
    hf, ours = hf_and_ours("cpu")
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    gpt_config = ours.config
    back = inv_remap_state_dict_hf_llama(dict(ours.state_dict()), gpt_config)
    assert back.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(back[key], value), key
    # and a fresh HF model loaded from it computes the same
    other = transformers.LlamaForCausalLM(llama_config()).eval()
    other.load_state_dict(back, strict=True)
    ids = random_ids("cpu")
    assert err(other(ids).logits, hf(ids).logits) == 0.0


def meta_to_hf_permute(w, n_heads):
    """The row permutation Hugging Face's Llama conversion script applies to Meta's wq / wk:
    per head, rows (pair i, member j) -> (member j, pair i)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def test_meta_checkpoint_remap_equals_transformers():
    config = llama_config()
    torch.manual_seed(3)
    ref = transformers.LlamaForCausalLM(config).eval()
    # Build a Meta-format state dict with random weights, then the HF one by the conversion rule.
    meta = {"tok_embeddings.weight": torch.randn(VOCAB, HIDDEN), "norm.weight": torch.rand(HIDDEN) + 0.5,
            "output.weight": torch.randn(VOCAB, HIDDEN) * 0.1, "rope.freqs": torch.zeros(8)}
    hf_sd = {"model.embed_tokens.weight": meta["tok_embeddings.weight"], "model.norm.weight": meta["norm.weight"],
             "lm_head.weight": meta["output.weight"]}
    for i in range(2):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        shapes = {"wq": HEADS * HEAD_DIM, "wk": KV_HEADS * HEAD_DIM, "wv": KV_HEADS * HEAD_DIM}
        for name, rows in shapes.items():
            meta[p + f"attention.{name}.weight"] = torch.randn(rows, HIDDEN) * 0.1
        meta[p + "attention.wo.weight"] = torch.randn(HIDDEN, HIDDEN) * 0.1
        for name, shape in {"w1": (INTER, HIDDEN), "w2": (HIDDEN, INTER), "w3": (INTER, HIDDEN)}.items():
            meta[p + f"feed_forward.{name}.weight"] = torch.randn(shape) * 0.1
        meta[p + "attention_norm.weight"] = torch.rand(HIDDEN) + 0.5
        meta[p + "ffn_norm.weight"] = torch.rand(HIDDEN) + 0.5
        hf_sd[h + "self_attn.q_proj.weight"] = meta_to_hf_permute(meta[p + "attention.wq.weight"], HEADS)
        hf_sd[h + "self_attn.k_proj.weight"] = meta_to_hf_permute(meta[p + "attention.wk.weight"], KV_HEADS)
        hf_sd[h + "self_attn.v_proj.weight"] = meta[p + "attention.wv.weight"]
        hf_sd[h + "self_attn.o_proj.weight"] = meta[p + "attention.wo.weight"]
        hf_sd[h + "mlp.gate_proj.weight"] = meta[p + "feed_forward.w1.weight"]
        hf_sd[h + "mlp.down_proj.weight"] = meta[p + "feed_forward.w2.weight"]
        hf_sd[h + "mlp.up_proj.weight"] = meta[p + "feed_forward.w3.weight"]
        hf_sd[h + "input_layernorm.weight"] = meta[p + "attention_norm.weight"]
        hf_sd[h + "post_attention_layernorm.weight"] = meta[p + "ffn_norm.weight"]
    ref.load_state_dict(hf_sd, strict=True)
    gpt_config = llama_config_to_gpt2_config(config)
    ours = GPTLMHeadModel(gpt_config).eval()
    ours.load_state_dict(remap_state_dict_meta_llama(dict(meta), gpt_config), strict=True)
    ids = random_ids("cpu")
    assert err(ours(ids).logits, ref(ids).logits) < ATOL


def test_config_and_state_dicts_from_a_meta_checkpoint(tmp_path):
    model_dir = tmp_path / "7B"
    model_dir.mkdir()
    params = {"dim": 64, "n_heads": 4, "n_layers": 2, "norm_eps": 1e-6, "multiple_of": 32,
              "n_kv_heads": 2, "rope_theta": 1234.0}
    (model_dir / "params.json").write_text(json.dumps(params))
    config = config_from_checkpoint(tmp_path, "7B")
    # Meta's rule: int(2 * 4 * 64 / 3) = 170, rounded up to a multiple of 32
    assert config.intermediate_size == 192
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 2)
    assert config.rms_norm_eps == 1e-6 and config.vocab_size == 32000
    assert llama_config_to_gpt2_config(config).rotary_emb_base == 1234.0
    for shard in (1, 0, 2):  # written out of order, read back in shard order
        torch.save({"x": torch.tensor([shard])}, model_dir / f"consolidated.0{shard}.pth")
    assert [sd["x"].item() for sd in state_dicts_from_checkpoint(tmp_path, "7B")] == [0, 1, 2]


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 32}, "head_dim"),
    ],
)
def test_unsupported_llama_variants_fail_clearly(extra, match):
    with pytest.raises(NotImplementedError, match=match):
        llama_config_to_gpt2_config(llama_config(**extra))


# ----------------------------------------------------------------------------------------------
# Tensor parallel (GQA + SwiGLU + rotary over 2 gloo ranks)
# ----------------------------------------------------------------------------------------------


def _tp_case(rank, world, sequence_parallel):
    config = llama_config()
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    gpt_config = llama_config_to_gpt2_config(config)
    gpt_config.sequence_parallel = sequence_parallel
    ours = GPTLMHeadModel(gpt_config, process_group=dist.group.WORLD).eval()
    full = remap_state_dict_hf_llama(hf.state_dict(), gpt_config)
    ours.load_state_dict(shard_state_dict_tp(full, gpt_config, world, rank), strict=True)
    ids = random_ids("cpu")
    share = VOCAB // world
    mine = hf(ids).logits.detach()[..., rank * share: (rank + 1) * share]
    with torch.no_grad():
        logits = ours(ids).logits
    errors = {"logits": err(logits, mine.flatten(0, 1) if sequence_parallel else mine)}
    if not sequence_parallel:
        reference = hf.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), max_length=12,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        generated = ours.generate(ids[:, :4], max_length=12, top_k=1, tensor_parallel=world)
        errors["generate"] = float(not torch.equal(generated, reference))
    return errors


TP_CASES = {"plain": lambda r, w: _tp_case(r, w, False), "sequence_parallel": lambda r, w: _tp_case(r, w, True)}


def tp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    gloo_ranks.run_cases(TP_CASES, rank, world, init_file, result_dir)


def test_tensor_parallel_llama_over_gloo_equals_transformers(tmp_path, monkeypatch):
    gloo_ranks.skip_unless_cpu_ranks_can_run(monkeypatch)
    results = gloo_ranks.spawn(tp_worker, 2, tmp_path)
    gloo_ranks.assert_errors_below(results, TP_CASES, ATOL)
