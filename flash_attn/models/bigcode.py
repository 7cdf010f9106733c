"""Hugging Face BigCode checkpoints (``GPTBigCodeForCausalLM``: SantaCoder, StarCoder,
WizardCoder) for ``flash_attn.models.gpt.GPTLMHeadModel``: ``bigcode_config_to_gpt2_config``,
``remap_state_dict_hf_bigcode`` and its inverse ``inv_remap_state_dict_hf_bigcode``, with upstream
flash-attn's names.

As upstream does, a multi-query checkpoint's single key/value head is repeated for every query
head, so the model is an ordinary multi-head one (the inverse keeps the first copy).
"""

from collections import OrderedDict

import torch
from transformers import GPT2Config, GPTBigCodeConfig, PretrainedConfig

from flash_attn.models.gpt import _rename
from flash_attn.models.opt import _embeddings_and_head

_BIGCODE_RULES = (
    (r"^transformer\.wpe\.", "transformer.embeddings.position_embeddings."),
    (r"^transformer\.ln_f\.", "transformer.ln_f."),
    (r"^transformer\.h\.(\d+)\.ln_(1|2)\.", r"transformer.layers.\1.norm\2."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_fc\.", r"transformer.layers.\1.mlp.fc1."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^transformer\.h\.(\d+)\.attn\.c_attn\.", r"transformer.layers.\1.mixer.Wqkv."),
    (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"transformer.layers.\1.mixer.out_proj."),
)

_INV_BIGCODE_RULES = (
    (r"^transformer\.embeddings\.position_embeddings\.", "transformer.wpe."),
    (r"^transformer\.ln_f\.", "transformer.ln_f."),
    (r"^transformer\.layers\.(\d+)\.norm(1|2)\.", r"transformer.h.\1.ln_\2."),
    (r"^transformer\.layers\.(\d+)\.mlp\.fc1\.", r"transformer.h.\1.mlp.c_fc."),
    (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"transformer.h.\1.mlp.c_proj."),
    (r"^transformer\.layers\.(\d+)\.mixer\.Wqkv\.", r"transformer.h.\1.attn.c_attn."),
    (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"transformer.h.\1.attn.c_proj."),
)


def _c_attn_to_qkv(c_attn, config):
    """BigCode's ``c_attn`` rows -> ``(3, heads, head_dim)`` rows. Multi-query: ``[q (all heads),
    k (one head), v (one head)]``, k and v repeated per query head; otherwise per head
    ``[q, k, v]``."""
    n_head, embed_dim = config.n_head, config.n_embd
    head_dim = embed_dim // n_head
    if config.multi_query:
        q, k, v = torch.split(c_attn, [embed_dim, head_dim, head_dim], dim=0)
        repeats = (n_head,) + (1,) * (c_attn.dim() - 1)
        return torch.cat([q, k.repeat(repeats), v.repeat(repeats)], dim=0)
    return c_attn.unflatten(0, (n_head, 3, head_dim)).transpose(0, 1).flatten(0, 2)


def _qkv_to_c_attn(wqkv, config):
    """The inverse of ``_c_attn_to_qkv`` (multi-query: the first head's copy of k and v)."""
    n_head, embed_dim = config.n_head, config.n_embd
    head_dim = embed_dim // n_head
    if config.multi_query:
        q, k, v = torch.split(wqkv, [embed_dim, embed_dim, embed_dim], dim=0)
        return torch.cat([q, k[:head_dim], v[:head_dim]], dim=0)
    return wqkv.unflatten(0, (3, n_head, head_dim)).transpose(0, 1).flatten(0, 2)


def _map_attention(state_dict, pattern, convert, config):
    for key in list(state_dict):
        if pattern in key:
            state_dict[key] = convert(state_dict[key], config)


def remap_state_dict_hf_bigcode(state_dict, config: PretrainedConfig):
    """A ``GPTBigCodeForCausalLM`` state dict -> ``GPTLMHeadModel``'s (``config``: from
    ``bigcode_config_to_gpt2_config``). BigCode ties its head to the word embeddings; the
    vocabulary is padded to ``pad_vocab_size_multiple``."""
    state_dict = OrderedDict(state_dict)
    head = _embeddings_and_head(state_dict, config, "transformer.wte.weight")
    _map_attention(state_dict, ".attn.c_attn.", _c_attn_to_qkv, config)
    state_dict = _rename(state_dict, _BIGCODE_RULES)
    state_dict.update(head)
    return state_dict


def inv_remap_state_dict_hf_bigcode(state_dict, config: PretrainedConfig):
    """``GPTLMHeadModel``'s state dict -> ``GPTBigCodeForCausalLM``'s: the inverse of
    ``remap_state_dict_hf_bigcode`` (padding rows of the vocabulary are dropped)."""
    state_dict = OrderedDict(state_dict)
    words = state_dict.pop("transformer.embeddings.word_embeddings.weight")[: config.vocab_size]
    state_dict.pop("lm_head.weight", None)
    _map_attention(state_dict, ".mixer.Wqkv.", _qkv_to_c_attn, config)
    state_dict = _rename(state_dict, _INV_BIGCODE_RULES)
    state_dict["transformer.wte.weight"] = words
    state_dict["lm_head.weight"] = words
    return state_dict


def bigcode_config_to_gpt2_config(bigcode_config: GPTBigCodeConfig) -> GPT2Config:
    """The ``GPT2Config`` of the ``GPTLMHeadModel`` that computes what ``bigcode_config``'s model
    does; it keeps BigCode's ``multi_query`` flag, which the remaps read."""
    if getattr(bigcode_config, "model_type", None) != "gpt_bigcode":
        raise ValueError(
            "bigcode_config_to_gpt2_config needs a GPTBigCodeConfig, got "
            f"{type(bigcode_config).__name__} "
            f"(model_type {getattr(bigcode_config, 'model_type', None)!r})"
        )
    copied = ("activation_function", "attn_pdrop", "bos_token_id", "embd_pdrop", "eos_token_id",
              "initializer_range", "layer_norm_epsilon", "multi_query", "n_embd", "n_head",
              "n_inner", "n_layer", "n_positions", "resid_pdrop", "scale_attn_weights",
              "use_cache", "vocab_size")
    # Attributes older BigCode configs had (transformers 5 dropped some): copied when present.
    optional = ("max_batch_size", "max_sequence_length", "summary_activation",
                "summary_first_dropout", "summary_proj_to_labels", "summary_type",
                "summary_use_proj")
    kwargs = {name: getattr(bigcode_config, name) for name in copied}
    kwargs.update({name: getattr(bigcode_config, name) for name in optional
                   if hasattr(bigcode_config, name)})
    return GPT2Config(model_type=bigcode_config.model_type, **kwargs)
