"""Baichuan checkpoints (remote-code ``BaichuanForCausalLM``: Baichuan-7B / 13B, Baichuan2) for
``flash_attn.models.gpt.GPTLMHeadModel``: ``baichuan_config_to_gpt2_config`` and
``remap_state_dict_hf_baichuan``, with upstream flash-attn's names."""

from collections import OrderedDict

import torch
from transformers import GPT2Config, PretrainedConfig

from flash_attn.models.gpt import _pad_rows, _rename

_BAICHUAN_RULES = (
    (r"^model\.norm\.", "transformer.ln_f."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"transformer.layers.\1.norm1."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.layers.\1.norm2."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^model\.layers\.(\d+)\.self_attn\.W_pack\.", r"transformer.layers.\1.mixer.Wqkv."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.layers.\1.mixer.out_proj."),
    (r".*rotary_emb\.inv_freq$", None),  # recomputed by the model, not a weight
)

# Baichuan-7B has rotary embeddings, the 13B models ALiBi; the configs do not say which, so the
# hidden size decides (7B: 4096, 13B: 5120).
_ALIBI_MIN_HIDDEN_SIZE = 5000
# Baichuan2 (vocabulary ~125k) normalises its head's rows; Baichuan 1 (64k) does not.
_NORM_HEAD_MIN_VOCAB_SIZE = 70000


def _pad_to_multiple(t, config):
    """Zero rows up to a multiple of ``pad_vocab_size_multiple`` of the tensor's own row count
    (Baichuan's embeddings and head may be sharded, so not of ``config.vocab_size``)."""
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    return _pad_rows(t, -(-t.shape[0] // multiple) * multiple)


def remap_state_dict_hf_baichuan(state_dict, config):
    """A Baichuan ``BaichuanForCausalLM`` state dict -> ``GPTLMHeadModel``'s (``config``: from
    ``baichuan_config_to_gpt2_config``). ``W_pack`` is already ``[q; k; v]``; the gated MLP's
    ``up_proj`` / ``gate_proj`` become ``fc1`` (value rows first, then gate rows)."""
    state_dict = OrderedDict(state_dict)
    words = _pad_to_multiple(state_dict.pop("model.embed_tokens.weight"), config)
    head = state_dict.pop("lm_head.weight", None)
    if getattr(config, "tie_word_embeddings", False) or head is None:
        head = words
    else:
        head = _pad_to_multiple(head, config)
    for i in range(config.n_layer):
        mlp = f"model.layers.{i}.mlp"
        up = state_dict.pop(f"{mlp}.up_proj.weight")
        gate = state_dict.pop(f"{mlp}.gate_proj.weight")
        state_dict[f"transformer.layers.{i}.mlp.fc1.weight"] = torch.cat([up, gate], dim=0)
    state_dict = _rename(state_dict, _BAICHUAN_RULES)
    state_dict["transformer.embeddings.word_embeddings.weight"] = words
    state_dict["lm_head.weight"] = head
    return state_dict


def baichuan_config_to_gpt2_config(baichuan_config: PretrainedConfig) -> GPT2Config:
    """The ``GPT2Config`` of the ``GPTLMHeadModel`` that computes what ``baichuan_config``'s
    model does (RMSNorm, SwiGLU, no biases; rotary or ALiBi and a normalised head as above).
    ALiBi runs through FlashAttention (``use_flash_attn=True``)."""
    if getattr(baichuan_config, "model_type", None) != "baichuan":
        raise ValueError(
            "baichuan_config_to_gpt2_config needs a Baichuan config (model_type 'baichuan'), "
            f"got {type(baichuan_config).__name__} "
            f"(model_type {getattr(baichuan_config, 'model_type', None)!r})"
        )
    use_alibi = baichuan_config.hidden_size >= _ALIBI_MIN_HIDDEN_SIZE
    return GPT2Config(
        vocab_size=baichuan_config.vocab_size,
        n_positions=0,  # rotary or ALiBi
        n_embd=baichuan_config.hidden_size,
        n_layer=baichuan_config.num_hidden_layers,
        n_head=baichuan_config.num_attention_heads,
        n_inner=baichuan_config.intermediate_size,
        activation_function="swiglu",  # Baichuan's "silu" in a gated MLP
        resid_pdrop=0.0,  # the released models have no dropout
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=baichuan_config.rms_norm_eps,
        initializer_range=baichuan_config.initializer_range,
        bos_token_id=baichuan_config.bos_token_id,
        eos_token_id=baichuan_config.eos_token_id,
        pad_token_id=baichuan_config.pad_token_id,
        rms_norm=True,
        rotary_emb_fraction=0.0 if use_alibi else 1.0,
        rotary_emb_interleaved=False,
        use_alibi=use_alibi,
        use_flash_attn=use_alibi,
        tie_word_embeddings=False,
        norm_head=baichuan_config.vocab_size > _NORM_HEAD_MIN_VOCAB_SIZE,
        qkv_proj_bias=False,
        out_proj_bias=False,
        mlp_fc1_bias=False,
        mlp_fc2_bias=False,
        mlp_multiple_of=1,  # intermediate_size is exact, not rounded up
    )
