"""Hugging Face OPT checkpoints (``OPTForCausalLM``) for ``flash_attn.models.gpt.GPTLMHeadModel``:
``opt_config_to_gpt2_config`` and ``remap_state_dict_hf_opt``, with upstream flash-attn's names.

Also the helpers the other conversion modules (falcon, gptj, gpt_neox, bigcode, btlm) share:
``_embeddings_and_head`` and ``_fuse_qkv``."""

import re
from collections import OrderedDict

import torch
import torch.nn.functional as F
from transformers import GPT2Config, OPTConfig

from flash_attn.models.gpt import _pad_rows, _padded_vocab_size, _rename

# OPT's learned positions start at index 2 (rows 0 and 1 belong to padding).
_OPT_POSITION_OFFSET = 2

_OPT_RULES = (
    (r"^transformer\.embed_positions\.", "transformer.embeddings.position_embeddings."),
    (r"^transformer\.project_in\.", "transformer.embeddings.project_in."),  # OPT-350m
    (r"^transformer\.project_out\.", "project_out."),  # OPT-350m
    (r"^transformer\.(final_layer_norm|layer_norm)\.", "transformer.ln_f."),
    (r"^transformer\.layers\.(\d+)\.self_attn_layer_norm\.", r"transformer.layers.\1.norm1."),
    (r"^transformer\.layers\.(\d+)\.final_layer_norm\.", r"transformer.layers.\1.norm2."),
    (r"^transformer\.layers\.(\d+)\.fc(1|2)\.", r"transformer.layers.\1.mlp.fc\2."),
    (r"^transformer\.layers\.(\d+)\.self_attn\.out_proj\.",
     r"transformer.layers.\1.mixer.out_proj."),
)


def _fuse_qkv(state_dict, prefix, out_prefix, suffixes=("weight", "bias")):
    """Pop ``{prefix}.{q,k,v}_proj.<suffix>`` and store their concatenation (rows q, then k,
    then v) as ``{out_prefix}.Wqkv.<suffix>``; a suffix the checkpoint lacks is skipped."""
    for suffix in suffixes:
        keys = [f"{prefix}.{name}_proj.{suffix}" for name in "qkv"]
        if keys[0] in state_dict:
            parts = [state_dict.pop(key) for key in keys]
            state_dict[f"{out_prefix}.Wqkv.{suffix}"] = torch.cat(parts, dim=0)


def _embeddings_and_head(state_dict, config, words_key, head_keys=("lm_head.weight",)):
    """Pop the word embeddings (``words_key``) and the output head (the first of ``head_keys``
    present; its bias, if any) and return ``GPTLMHeadModel``'s entries for them, padded to
    ``pad_vocab_size_multiple``. With ``config.tie_word_embeddings`` the head is the embeddings;
    otherwise a missing head is an error, not a silent tie."""
    vocab_size = _padded_vocab_size(config)
    words = _pad_rows(state_dict.pop(words_key), vocab_size)
    present = [key for key in head_keys if key in state_dict]
    heads = [state_dict.pop(key) for key in present]
    biases = [state_dict.pop(key[: -len("weight")] + "bias", None) for key in present]
    entries = {"transformer.embeddings.word_embeddings.weight": words, "lm_head.weight": words}
    if getattr(config, "tie_word_embeddings", True):
        return entries
    if not heads:
        raise KeyError(f"none of {head_keys} is in the state dict and the config does not tie "
                       "the head to the word embeddings (tie_word_embeddings=False)")
    entries["lm_head.weight"] = _pad_rows(heads[0], vocab_size)
    if biases[0] is not None:
        entries["lm_head.bias"] = F.pad(biases[0], (0, vocab_size - biases[0].shape[0]))
    return entries


def remap_state_dict_hf_opt(state_dict, config):
    """An ``OPTForCausalLM`` (or ``OPTModel``) state dict -> ``GPTLMHeadModel``'s (``config``:
    from ``opt_config_to_gpt2_config``). OPT ties its head to the word embeddings, so the head is
    taken from them; the vocabulary is padded to ``pad_vocab_size_multiple``."""
    # "model.decoder." (OPTForCausalLM) or "decoder." (OPTModel, e.g. OPT-350m's checkpoint)
    state_dict = OrderedDict(
        (re.sub(r"^(model\.)?decoder\.", "transformer.", key), value)
        for key, value in state_dict.items()
    )
    head = _embeddings_and_head(state_dict, config, "transformer.embed_tokens.weight")
    positions = state_dict.pop("transformer.embed_positions.weight")
    state_dict["transformer.embed_positions.weight"] = positions[_OPT_POSITION_OFFSET:]
    for i in range(config.n_layer):
        layer = f"transformer.layers.{i}"
        _fuse_qkv(state_dict, f"{layer}.self_attn", f"{layer}.mixer")
    state_dict = _rename(state_dict, _OPT_RULES)
    state_dict.update(head)
    return state_dict


def _check_opt(opt_config) -> None:
    if getattr(opt_config, "model_type", None) != "opt":
        raise ValueError(
            f"opt_config_to_gpt2_config needs an OPTConfig, got {type(opt_config).__name__} "
            f"(model_type {getattr(opt_config, 'model_type', None)!r})"
        )
    # Training-time layer drop and norms without weights have no counterpart in GPTLMHeadModel.
    if opt_config.layerdrop != 0.0:
        raise AssertionError(f"OPT layerdrop must be 0.0, got {opt_config.layerdrop}")
    if not opt_config.layer_norm_elementwise_affine:
        raise AssertionError("OPT layer_norm_elementwise_affine=False is not supported")
    if getattr(opt_config, "_remove_final_layer_norm", False) and opt_config.do_layer_norm_before:
        raise NotImplementedError("OPT with _remove_final_layer_norm=True is not supported")


def opt_config_to_gpt2_config(opt_config: OPTConfig) -> GPT2Config:
    """The ``GPT2Config`` of the ``GPTLMHeadModel`` that computes what ``opt_config``'s model
    does (learned positions, ``do_layer_norm_before`` -> ``prenorm``, OPT-350m's projections)."""
    _check_opt(opt_config)
    word_embed_proj_dim = opt_config.word_embed_proj_dim
    bias = getattr(opt_config, "enable_bias", True)
    return GPT2Config(
        vocab_size=opt_config.vocab_size,
        n_positions=opt_config.max_position_embeddings,
        n_embd=opt_config.hidden_size,
        n_layer=opt_config.num_hidden_layers,
        n_head=opt_config.num_attention_heads,
        n_inner=opt_config.ffn_dim,
        activation_function=opt_config.activation_function,
        resid_pdrop=opt_config.dropout,
        embd_pdrop=opt_config.dropout,
        attn_pdrop=opt_config.attention_dropout,
        initializer_range=opt_config.init_std,
        bos_token_id=opt_config.bos_token_id,
        eos_token_id=opt_config.eos_token_id,
        prenorm=opt_config.do_layer_norm_before,
        word_embed_proj_dim=(
            None if word_embed_proj_dim == opt_config.hidden_size else word_embed_proj_dim
        ),
        qkv_proj_bias=bias,
        out_proj_bias=bias,
        mlp_fc1_bias=bias,
        mlp_fc2_bias=bias,
    )
