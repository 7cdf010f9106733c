"""The checkpoint conversions ``flash_attn.models.{opt,falcon,gptj,gpt_neox,bigcode,baichuan,btlm}``
(config -> ``GPT2Config``, state dict -> ``GPTLMHeadModel``'s) against their models' own code.

OPT, Falcon, GPT-J, GPT-NeoX and BigCode: the Hugging Face transformers models (random weights,
tiny configs, float32, CPU) are the oracle: converted config and weights, loaded with strict=True,
must give the same logits. Baichuan and BTLM are remote-code models that transformers does not
ship (and there is no network here): their checkpoints are stood in for by state dicts built below
with the real key names and shapes, and their models by short plain-PyTorch forwards written from
the models' published definitions (``naive_baichuan_logits`` / ``naive_btlm_logits``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from flash_attn.models.baichuan import (  # noqa: E402
    baichuan_config_to_gpt2_config,
    remap_state_dict_hf_baichuan,
)
from flash_attn.models.bigcode import (  # noqa: E402
    bigcode_config_to_gpt2_config,
    inv_remap_state_dict_hf_bigcode,
    remap_state_dict_hf_bigcode,
)
from flash_attn.models.btlm import (  # noqa: E402
    btlm_config_to_gpt2_config,
    remap_state_dict_hf_btlm,
)
from flash_attn.models.falcon import (  # noqa: E402
    falcon_config_to_gpt2_config,
    remap_state_dict_hf_falcon,
)
from flash_attn.models.gpt import GPTLMHeadModel  # noqa: E402
from flash_attn.models.gpt_neox import (  # noqa: E402
    gpt_neox_config_to_gpt2_config,
    remap_state_dict_hf_gpt_neox,
)
from flash_attn.models.gptj import (  # noqa: E402
    gptj_config_to_gpt2_config,
    remap_state_dict_hf_gptj,
)
from flash_attn.models.opt import opt_config_to_gpt2_config, remap_state_dict_hf_opt  # noqa: E402

VOCAB, B, S = 100, 2, 11
ATOL = 1e-4


def randomize_(model: torch.nn.Module) -> torch.nn.Module:
    """Weights far from any init (norm weights around 1), so a misplaced tensor shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3)
            if "norm" in name or ".ln" in name or name.startswith("ln"):
                param.add_(1.0)
    return model.eval()


def converted_model(config, state_dict):
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(state_dict, strict=True)
    return model


def random_ids(vocab_size=VOCAB, seed=0):
    return torch.randint(0, vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(hf_model, model, vocab_size=VOCAB):
    ids = random_ids(vocab_size)
    with torch.no_grad():
        expected = hf_model(ids).logits
        got = model(ids).logits
    assert got.shape[-1] >= vocab_size
    torch.testing.assert_close(got[..., :vocab_size], expected, atol=ATOL, rtol=1e-4)
    # Padded vocabulary rows are zero, so their logits are exactly the head bias (or zero).
    assert got.shape[-1] == model.lm_head.weight.shape[0]


def check_hf_conversion(hf_model, to_config, remap, pad_vocab_size_multiple=1):
    torch.manual_seed(0)
    randomize_(hf_model)
    config = to_config(hf_model.config)
    config.pad_vocab_size_multiple = pad_vocab_size_multiple
    state_dict = remap(hf_model.state_dict(), config)
    model = converted_model(config, state_dict)
    assert_same_logits(hf_model, model)
    return config, model


def hf(cls, config_cls, **kwargs):
    config = config_cls(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, **kwargs)
    config._attn_implementation = "eager"
    return cls(config)


# --- OPT ---------------------------------------------------------------------------------------

OPT_BASE = dict(hidden_size=32, num_hidden_layers=2, ffn_dim=48, max_position_embeddings=40,
                num_attention_heads=4, dropout=0.0, pad_token_id=1)


@pytest.mark.parametrize(
    "extra, pad",
    [
        (dict(word_embed_proj_dim=32), 1),  # OPT-125m-like: pre-norm
        (dict(word_embed_proj_dim=16, do_layer_norm_before=False), 1),  # OPT-350m-like
        (dict(word_embed_proj_dim=32, enable_bias=False, activation_function="gelu"), 8),
    ],
    ids=["prenorm", "postnorm-projections", "nobias-gelu-padded"],
)
def test_opt_logits_match_transformers(extra, pad):
    model = hf(transformers.OPTForCausalLM, transformers.OPTConfig, **OPT_BASE, **extra)
    config, _ = check_hf_conversion(model, opt_config_to_gpt2_config, remap_state_dict_hf_opt, pad)
    assert config.prenorm == model.config.do_layer_norm_before


def test_opt_model_prefix_checkpoint():
    """OPT-350m's checkpoint has "decoder." keys (OPTModel's), not "model.decoder."."""
    model = randomize_(hf(transformers.OPTForCausalLM, transformers.OPTConfig, **OPT_BASE))
    config = opt_config_to_gpt2_config(model.config)
    bare = {k[len("model."):]: v for k, v in model.state_dict().items() if k.startswith("model.")}
    assert_same_logits(model, converted_model(config, remap_state_dict_hf_opt(bare, config)))


# --- Falcon ------------------------------------------------------------------------------------

FALCON_BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "extra",
    [
        dict(new_decoder_architecture=True, num_kv_heads=2),  # 40b / 180b: GQA, two norms
        dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1, bias=True),
        dict(multi_query=True),  # 7b: multi-query, one norm
        dict(multi_query=False),  # per-head [q, k, v]
        dict(multi_query=False, parallel_attn=False, tie_word_embeddings=False),  # sequential
        dict(multi_query=True, rope_parameters={"rope_theta": 500.0, "rope_type": "default"}),
    ],
    ids=["new-gqa", "new-one-norm-bias", "multi-query", "mha", "sequential-untied", "rope-base"],
)
def test_falcon_logits_match_transformers(extra):
    model = hf(transformers.FalconForCausalLM, transformers.FalconConfig, **FALCON_BASE, **extra)
    check_hf_conversion(model, falcon_config_to_gpt2_config, remap_state_dict_hf_falcon, 8)


def test_falcon_kv_heads_reach_the_model():
    """Multi-query stays multi-query (a fused Wqkv of n_head + 2 heads), not repeated heads."""
    model = hf(transformers.FalconForCausalLM, transformers.FalconConfig, **FALCON_BASE,
               multi_query=True)
    config = falcon_config_to_gpt2_config(model.config)
    assert config.n_head_kv == 1 and config.parallel_block_tied_norm
    ours = GPTLMHeadModel(config)
    assert ours.transformer.layers[0].mixer.Wqkv.weight.shape == (8 * (4 + 2), 32)


# --- GPT-J -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary_dim, pad", [(4, 1), (8, 8)], ids=["partial", "full-padded"])
def test_gptj_logits_match_transformers(rotary_dim, pad):
    model = hf(transformers.GPTJForCausalLM, transformers.GPTJConfig, n_embd=32, n_layer=2,
               n_head=4, n_inner=48, rotary_dim=rotary_dim, n_positions=40)
    config, ours = check_hf_conversion(model, gptj_config_to_gpt2_config,
                                       remap_state_dict_hf_gptj, pad)
    # The padded head rows and their bias entries are zero.
    assert torch.all(ours.lm_head.bias[VOCAB:] == 0) and torch.all(ours.lm_head.weight[VOCAB:] == 0)


# --- GPT-NeoX ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        dict(use_parallel_residual=True),
        dict(use_parallel_residual=False, tie_word_embeddings=True),
        dict(rope_parameters={"rope_theta": 1000.0, "partial_rotary_factor": 0.5,
                              "rope_type": "default"}, attention_bias=False),
    ],
    ids=["parallel", "sequential-tied", "rope-base-nobias"],
)
def test_gpt_neox_logits_match_transformers(extra):
    model = hf(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, **extra)
    check_hf_conversion(model, gpt_neox_config_to_gpt2_config, remap_state_dict_hf_gpt_neox, 8)


def test_gpt_neox_old_head_name():
    """Checkpoints from transformers < 5 call the head "embed_out"."""
    model = randomize_(hf(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig,
                          hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=48))
    config = gpt_neox_config_to_gpt2_config(model.config)
    state_dict = dict(model.state_dict())
    state_dict["embed_out.weight"] = state_dict.pop("lm_head.weight")
    assert_same_logits(model, converted_model(config, remap_state_dict_hf_gpt_neox(state_dict,
                                                                                   config)))


def test_gpt_neox_missing_untied_head_is_an_error():
    model = hf(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig, hidden_size=32,
               num_hidden_layers=1, num_attention_heads=4, intermediate_size=48)
    config = gpt_neox_config_to_gpt2_config(model.config)
    state_dict = dict(model.state_dict())
    del state_dict["lm_head.weight"]
    with pytest.raises(KeyError, match="tie_word_embeddings"):
        remap_state_dict_hf_gpt_neox(state_dict, config)


# --- BigCode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("multi_query", [True, False], ids=["multi-query", "multi-head"])
def test_bigcode_logits_and_inverse_round_trip(multi_query):
    model = hf(transformers.GPTBigCodeForCausalLM, transformers.GPTBigCodeConfig, n_embd=32,
               n_layer=2, n_head=4, n_inner=48, n_positions=40, multi_query=multi_query,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config, ours = check_hf_conversion(model, bigcode_config_to_gpt2_config,
                                       remap_state_dict_hf_bigcode, 8)
    back = inv_remap_state_dict_hf_bigcode(ours.state_dict(), config)
    original = model.state_dict()
    assert sorted(back) == sorted(original)
    for key, value in original.items():
        torch.testing.assert_close(back[key], value, atol=0, rtol=0, msg=key)
    # ... and the inverse loads into a fresh transformers model that computes the same logits.
    fresh = transformers.GPTBigCodeForCausalLM(model.config).eval()
    fresh.load_state_dict(back, strict=True)
    assert_same_logits(fresh, ours)


# --- Baichuan (remote code) ------------------------------------------------------------------


class BaichuanConfig(transformers.PretrainedConfig):
    """Stands in for Baichuan's remote-code config (the attributes its conversion reads)."""

    model_type = "baichuan"


def baichuan_checkpoint(config, seed=0):
    """A random state dict with ``BaichuanForCausalLM``'s key names and shapes."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size

    def w(*shape, base=0.0):
        return torch.randn(*shape, generator=g) * 0.3 + base

    sd = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": w(h, base=1.0),
          "lm_head.weight": w(v, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        sd.update({
            f"{p}.self_attn.W_pack.weight": w(3 * h, h) / math.sqrt(h),
            f"{p}.self_attn.o_proj.weight": w(h, h) / math.sqrt(h),
            f"{p}.self_attn.rotary_emb.inv_freq": torch.ones(h // config.num_attention_heads // 2),
            f"{p}.mlp.gate_proj.weight": w(inter, h), f"{p}.mlp.up_proj.weight": w(inter, h),
            f"{p}.mlp.down_proj.weight": w(h, inter) / math.sqrt(inter),
            f"{p}.input_layernorm.weight": w(h, base=1.0),
            f"{p}.post_attention_layernorm.weight": w(h, base=1.0),
        })
    return sd


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half_rotary(x, base=10000.0):
    """Llama-style rotary (pairs ``(i, i + d/2)``) over all of x's last dim; x: (b, h, s, d)."""
    d, s = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def alibi_bias(n_heads, s):
    """ALiBi (Press et al.) for a power-of-two head count: ``slope_h * (j - i)``."""
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)])
    pos = torch.arange(s, dtype=torch.float32)
    return slopes[:, None, None] * (pos[None, :] - pos[:, None])[None]


def causal_attention(q, k, v, scale, bias=None):
    """q, k, v: (b, h, s, d)."""
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    s = q.shape[-2]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def split_heads(x, n_heads):
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def naive_baichuan_logits(sd, config, ids, alibi=False, norm_head=False):
    """Baichuan's forward (Llama layout with a packed W_pack; 7B: rotary, 13B: ALiBi;
    Baichuan2: head rows normalised) from its checkpoint's tensors."""
    nh, eps = config.num_attention_heads, config.rms_norm_eps
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        h = rms_norm(x, sd[f"{p}.input_layernorm.weight"], eps)
        qkv = h @ sd[f"{p}.self_attn.W_pack.weight"].t()
        q, k, v = (split_heads(t, nh) for t in qkv.chunk(3, -1))
        if not alibi:
            q, k = rotate_half_rotary(q), rotate_half_rotary(k)
        bias = alibi_bias(nh, ids.shape[1]) if alibi else None
        o = causal_attention(q, k, v, q.shape[-1] ** -0.5, bias).transpose(1, 2).flatten(2)
        x = x + o @ sd[f"{p}.self_attn.o_proj.weight"].t()
        h = rms_norm(x, sd[f"{p}.post_attention_layernorm.weight"], eps)
        gate, up = h @ sd[f"{p}.mlp.gate_proj.weight"].t(), h @ sd[f"{p}.mlp.up_proj.weight"].t()
        gated = F.silu(gate) * up
        x = x + gated @ sd[f"{p}.mlp.down_proj.weight"].t()
    head = sd["lm_head.weight"]
    head = F.normalize(head) if norm_head else head
    return rms_norm(x, sd["model.norm.weight"], eps) @ head.t()


def baichuan_config(hidden_size=32, heads=4, vocab_size=VOCAB):
    return BaichuanConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=2,
                          num_attention_heads=heads, intermediate_size=48, rms_norm_eps=1e-6,
                          initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize(
    "vocab_size, norm_head", [(VOCAB, False), (70016, True)],
    ids=["baichuan-7b", "baichuan2-norm-head"],
)
def test_baichuan_matches_naive_forward(vocab_size, norm_head):
    hf_config = baichuan_config(vocab_size=vocab_size)
    config = baichuan_config_to_gpt2_config(hf_config)
    assert config.norm_head == norm_head and config.rotary_emb_fraction == 1.0
    config.pad_vocab_size_multiple = 8
    sd = baichuan_checkpoint(hf_config)
    model = converted_model(config, remap_state_dict_hf_baichuan(dict(sd), config))
    ids = random_ids(vocab_size)
    with torch.no_grad():
        got = model(ids).logits[..., :vocab_size]
    expected = naive_baichuan_logits(sd, hf_config, ids, norm_head=norm_head)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


def test_baichuan_13b_alibi_matches_naive_forward():
    """Baichuan-13B (hidden size 5120) uses ALiBi; the conversion decides by the hidden size. One
    layer, a tiny MLP and vocabulary keep it affordable."""
    hf_config = baichuan_config(hidden_size=5120, heads=64)
    hf_config.num_hidden_layers = 1
    config = baichuan_config_to_gpt2_config(hf_config)
    assert config.use_alibi and config.rotary_emb_fraction == 0.0
    sd = baichuan_checkpoint(hf_config)
    model = converted_model(config, remap_state_dict_hf_baichuan(dict(sd), config))
    ids = random_ids()
    with torch.no_grad():
        got = model(ids).logits
    expected = naive_baichuan_logits(sd, hf_config, ids, alibi=True)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


# --- BTLM (remote code) ------------------------------------------------------------------------


class BTLMConfig(transformers.PretrainedConfig):
    """Stands in for Cerebras BTLM's remote-code config (the attributes its conversion reads)."""

    model_type = "btlm"
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_head",
                     "num_hidden_layers": "n_layer", "max_position_embeddings": "n_positions"}


def btlm_config(position_embedding_type="alibi"):
    return BTLMConfig(
        vocab_size=VOCAB, n_positions=40, n_embd=32, n_layer=2, n_head=4, n_inner=48,
        activation_function="swiglu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5, initializer_range=0.02, bos_token_id=0, eos_token_id=0,
        position_embedding_type=position_embedding_type, mup_width_scale=0.25,
        mup_embeddings_scale=3.0, mup_output_alpha=2.0, mup_scale_qk_dot_by_d=True,
    )


def btlm_checkpoint(config, seed=0):
    """A random state dict with ``BTLMLMHeadModel``'s key names and shapes (GPT-2's Conv1D
    weights: ``(in_features, out_features)``)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v = config.n_embd, config.n_inner, config.vocab_size

    def w(*shape, base=0.0):
        return torch.randn(*shape, generator=g) * 0.3 + base

    sd = {"transformer.wte.weight": w(v, h), "transformer.ln_f.weight": w(h, base=1.0),
          "transformer.ln_f.bias": w(h),
          "transformer.relative_pe.slopes": torch.ones(config.n_head)}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    if config.position_embedding_type != "alibi":
        sd["transformer.wpe.weight"] = w(config.n_positions, h)
    for i in range(config.n_layer):
        p = f"transformer.h.{i}"
        sd.update({
            f"{p}.ln_1.weight": w(h, base=1.0), f"{p}.ln_1.bias": w(h),
            f"{p}.ln_2.weight": w(h, base=1.0), f"{p}.ln_2.bias": w(h),
            f"{p}.attn.c_attn.weight": w(h, 3 * h), f"{p}.attn.c_attn.bias": w(3 * h),
            f"{p}.attn.c_proj.weight": w(h, h), f"{p}.attn.c_proj.bias": w(h),
            f"{p}.mlp.c_fc.weight": w(h, inter), f"{p}.mlp.c_fc.bias": w(inter),
            f"{p}.mlp.c_fc2.weight": w(h, inter), f"{p}.mlp.c_fc2.bias": w(inter),
            f"{p}.mlp.c_proj.weight": w(inter, h), f"{p}.mlp.c_proj.bias": w(h),
        })
    return sd


def naive_btlm_logits(sd, config, ids):
    """BTLM's forward: GPT-2 blocks with a SwiGLU MLP (``c_fc(x) * silu(c_fc2(x))``), ALiBi or
    learned positions, and muP: embeddings times ``mup_embeddings_scale``, q.k scaled by 1/d,
    logits times ``mup_output_alpha * mup_width_scale``."""
    nh, eps = config.n_head, config.layer_norm_epsilon
    x = sd["transformer.wte.weight"][ids]
    if config.position_embedding_type != "alibi":
        x = x + sd["transformer.wpe.weight"][: ids.shape[1]]
    x = x * config.mup_embeddings_scale
    bias = alibi_bias(nh, ids.shape[1]) if config.position_embedding_type == "alibi" else None

    def conv1d(t, name):
        return t @ sd[f"{name}.weight"] + sd[f"{name}.bias"]

    def ln(t, name):
        return F.layer_norm(t, t.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps)

    for i in range(config.n_layer):
        p = f"transformer.h.{i}"
        qkv = conv1d(ln(x, f"{p}.ln_1"), f"{p}.attn.c_attn")
        q, k, v = (split_heads(t, nh) for t in qkv.chunk(3, -1))
        scale = 1.0 / q.shape[-1] if config.mup_scale_qk_dot_by_d else q.shape[-1] ** -0.5
        attn = causal_attention(q, k, v, scale, bias).transpose(1, 2).flatten(2)
        x = x + conv1d(attn, f"{p}.attn.c_proj")
        h = ln(x, f"{p}.ln_2")
        swiglu = conv1d(h, f"{p}.mlp.c_fc") * F.silu(conv1d(h, f"{p}.mlp.c_fc2"))
        x = x + conv1d(swiglu, f"{p}.mlp.c_proj")
    logits = ln(x, "transformer.ln_f") @ sd["transformer.wte.weight"].t()
    return logits * config.mup_output_alpha * config.mup_width_scale


@pytest.mark.parametrize("position_embedding_type", ["alibi", "learned"])
def test_btlm_matches_naive_forward(position_embedding_type):
    hf_config = btlm_config(position_embedding_type)
    config = btlm_config_to_gpt2_config(hf_config)
    config.pad_vocab_size_multiple = 8
    sd = btlm_checkpoint(hf_config)
    model = converted_model(config, remap_state_dict_hf_btlm(dict(sd), config))
    ids = random_ids()
    with torch.no_grad():
        got = model(ids).logits[..., :VOCAB]
    torch.testing.assert_close(got, naive_btlm_logits(sd, hf_config, ids), atol=ATOL, rtol=1e-4)


# --- bad input ---------------------------------------------------------------------------------

CONVERSIONS = {
    "opt": opt_config_to_gpt2_config,
    "falcon": falcon_config_to_gpt2_config,
    "gptj": gptj_config_to_gpt2_config,
    "gpt_neox": gpt_neox_config_to_gpt2_config,
    "bigcode": bigcode_config_to_gpt2_config,
    "baichuan": baichuan_config_to_gpt2_config,
    "btlm": btlm_config_to_gpt2_config,
}


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_config_of_another_model_is_rejected(name):
    other = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=48)
    with pytest.raises(ValueError, match="LlamaConfig"):
        CONVERSIONS[name](other)


@pytest.mark.parametrize(
    "convert, config, error, match",
    [
        (opt_config_to_gpt2_config, transformers.OPTConfig(layerdrop=0.1), AssertionError,
         "layerdrop"),
        (opt_config_to_gpt2_config, transformers.OPTConfig(layer_norm_elementwise_affine=False),
         AssertionError, "elementwise_affine"),
        (falcon_config_to_gpt2_config, transformers.FalconConfig(alibi=True), NotImplementedError,
         "alibi"),
        (falcon_config_to_gpt2_config,
         transformers.FalconConfig(new_decoder_architecture=True, parallel_attn=False),
         NotImplementedError, "parallel_attn"),
        (gpt_neox_config_to_gpt2_config,
         transformers.GPTNeoXConfig(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                     "rope_theta": 10000.0}),
         NotImplementedError, "linear"),
    ],
    ids=["opt-layerdrop", "opt-no-affine", "falcon-alibi", "falcon-new-sequential",
         "neox-rope-scaling"],
)
def test_unsupported_variants_are_rejected(convert, config, error, match):
    with pytest.raises(error, match=match):
        convert(config)
