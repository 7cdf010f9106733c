"""Hugging Face GPT-NeoX checkpoints (``GPTNeoXForCausalLM``: GPT-NeoX, Pythia, RedPajama-INCITE)
for ``flash_attn.models.gpt.GPTLMHeadModel``: ``gpt_neox_config_to_gpt2_config`` and
``remap_state_dict_hf_gpt_neox``, with upstream flash-attn's names."""

import re
from collections import OrderedDict

from transformers import GPT2Config, GPTNeoXConfig

from flash_attn.models.gpt import _rename
from flash_attn.models.opt import _embeddings_and_head

_NEOX_RULES = (
    (r"^gpt_neox\.final_layer_norm\.", "transformer.ln_f."),
    (r"^gpt_neox\.layers\.(\d+)\.input_layernorm\.", r"transformer.layers.\1.norm1."),
    (r"^gpt_neox\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.layers.\1.norm2."),
    (r"^gpt_neox\.layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"transformer.layers.\1.mlp.fc1."),
    (r"^gpt_neox\.layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^gpt_neox\.layers\.(\d+)\.attention\.query_key_value\.",
     r"transformer.layers.\1.mixer.Wqkv."),
    (r"^gpt_neox\.layers\.(\d+)\.attention\.dense\.", r"transformer.layers.\1.mixer.out_proj."),
    # Causal-mask buffers and rotary tables of older checkpoints: not weights.
    (r"^gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias)$", None),
    (r".*rotary_emb\.inv_freq$", None),
)


def _per_head_to_qkv(wqkv, head_dim):
    """GPT-NeoX's fused rows ``(heads, 3, head_dim)`` -> ``(3, heads, head_dim)``."""
    return wqkv.unflatten(0, (-1, 3, head_dim)).transpose(0, 1).flatten(0, 2)


def remap_state_dict_hf_gpt_neox(state_dict, config):
    """A ``GPTNeoXForCausalLM`` state dict -> ``GPTLMHeadModel``'s (``config``: from
    ``gpt_neox_config_to_gpt2_config``); the vocabulary is padded to ``pad_vocab_size_multiple``."""
    state_dict = OrderedDict(state_dict)
    # The head is "embed_out" in older transformers, "lm_head" in transformers 5.
    head = _embeddings_and_head(state_dict, config, "gpt_neox.embed_in.weight",
                                ("embed_out.weight", "lm_head.weight"))
    head_dim = config.hidden_size // config.num_attention_heads
    for key in list(state_dict):
        if re.match(r"^gpt_neox\.layers\.\d+\.attention\.query_key_value\.", key):
            state_dict[key] = _per_head_to_qkv(state_dict[key], head_dim)
    state_dict = _rename(state_dict, _NEOX_RULES)
    state_dict.update(head)
    return state_dict


def _neox_rotary(gpt_neox_config):
    """``(rotary fraction, rotary base)``: transformers 5 keeps them in ``rope_parameters``,
    earlier versions in ``rotary_pct`` / ``rotary_emb_base``."""
    rope = (getattr(gpt_neox_config, "rope_parameters", None)
            or getattr(gpt_neox_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"GPT-NeoX rope scaling {rope_type!r} is not supported")
    fraction = rope.get("partial_rotary_factor", getattr(gpt_neox_config, "rotary_pct", None))
    base = rope.get("rope_theta", getattr(gpt_neox_config, "rotary_emb_base", None))
    return (1.0 if fraction is None else float(fraction),
            10000.0 if base is None else float(base))


def gpt_neox_config_to_gpt2_config(gpt_neox_config: GPTNeoXConfig) -> GPT2Config:
    """The ``GPT2Config`` of the ``GPTLMHeadModel`` that computes what ``gpt_neox_config``'s
    model does (rotary on a fraction of each head, parallel or sequential residual blocks)."""
    if getattr(gpt_neox_config, "model_type", None) != "gpt_neox":
        raise ValueError(
            "gpt_neox_config_to_gpt2_config needs a GPTNeoXConfig, got "
            f"{type(gpt_neox_config).__name__} "
            f"(model_type {getattr(gpt_neox_config, 'model_type', None)!r})"
        )
    rotary_fraction, rotary_base = _neox_rotary(gpt_neox_config)
    bias = getattr(gpt_neox_config, "attention_bias", True)
    return GPT2Config(
        vocab_size=gpt_neox_config.vocab_size,
        n_positions=0,  # rotary only
        n_embd=gpt_neox_config.hidden_size,
        n_layer=gpt_neox_config.num_hidden_layers,
        n_head=gpt_neox_config.num_attention_heads,
        n_inner=gpt_neox_config.intermediate_size,
        activation_function=gpt_neox_config.hidden_act,
        resid_pdrop=0.0,  # no dropout
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=gpt_neox_config.layer_norm_eps,
        initializer_range=gpt_neox_config.initializer_range,
        bos_token_id=gpt_neox_config.bos_token_id,
        eos_token_id=gpt_neox_config.eos_token_id,
        prenorm=True,
        parallel_block=gpt_neox_config.use_parallel_residual,
        parallel_block_tied_norm=False,
        rotary_emb_fraction=rotary_fraction,
        rotary_emb_base=rotary_base,
        rotary_emb_interleaved=False,
        tie_word_embeddings=gpt_neox_config.tie_word_embeddings,
        qkv_proj_bias=bias,
        out_proj_bias=bias,
    )
