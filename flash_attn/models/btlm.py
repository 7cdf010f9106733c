"""Cerebras BTLM checkpoints (remote-code ``BTLMLMHeadModel``, e.g. btlm-3b-8k-base) for
``flash_attn.models.gpt.GPTLMHeadModel``: ``btlm_config_to_gpt2_config`` and
``remap_state_dict_hf_btlm``, with upstream flash-attn's names. BTLM is GPT-2 with SwiGLU,
ALiBi and muP scalings."""

import re
from collections import OrderedDict

import torch
from transformers import GPT2Config, PretrainedConfig

from flash_attn.models.gpt import _rename
from flash_attn.models.opt import _embeddings_and_head

_BTLM_RULES = (
    (r"^transformer\.wpe\.", "transformer.embeddings.position_embeddings."),
    (r"^transformer\.ln_f\.", "transformer.ln_f."),
    (r"^transformer\.h\.(\d+)\.ln_(1|2)\.", r"transformer.layers.\1.norm\2."),
    (r"^transformer\.h\.(\d+)\.mlp\.fc1\.", r"transformer.layers.\1.mlp.fc1."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^transformer\.h\.(\d+)\.attn\.c_attn\.", r"transformer.layers.\1.mixer.Wqkv."),
    (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"transformer.layers.\1.mixer.out_proj."),
    # The ALiBi slopes (recomputed by the model) and causal-mask buffers: not weights.
    (r"^transformer\.relative_pe\.slopes$", None),
    (r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$", None),
)
# GPT-2's Conv1D stores its weight as (in_features, out_features), nn.Linear the transpose.
_BTLM_CONV1D = re.compile(r"^transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc2?|"
                          r"mlp\.c_proj)\.weight$")


def remap_state_dict_hf_btlm(state_dict, config):
    """A BTLM ``BTLMLMHeadModel`` state dict -> ``GPTLMHeadModel``'s (``config``: from
    ``btlm_config_to_gpt2_config``). The SwiGLU MLP's ``c_fc`` (value) and ``c_fc2`` (gate)
    become ``fc1``; the head is tied to the word embeddings, padded to
    ``pad_vocab_size_multiple``."""
    state_dict = OrderedDict(
        (key, value.t() if _BTLM_CONV1D.match(key) else value) for key, value in state_dict.items()
    )
    head = _embeddings_and_head(state_dict, config, "transformer.wte.weight")
    for i in range(config.n_layer):
        mlp = f"transformer.h.{i}.mlp"
        for suffix in ("weight", "bias"):
            value = state_dict.pop(f"{mlp}.c_fc.{suffix}")
            gate = state_dict.pop(f"{mlp}.c_fc2.{suffix}")
            state_dict[f"{mlp}.fc1.{suffix}"] = torch.cat([value, gate], dim=0)
    state_dict = _rename(state_dict, _BTLM_RULES)
    state_dict.update(head)
    return state_dict


def btlm_config_to_gpt2_config(btlm_config: PretrainedConfig) -> GPT2Config:
    """The ``GPT2Config`` of the ``GPTLMHeadModel`` that computes what ``btlm_config``'s model
    does (ALiBi through FlashAttention, or learned positions; muP multipliers; exact SwiGLU
    width)."""
    if getattr(btlm_config, "model_type", None) != "btlm":
        raise ValueError(
            "btlm_config_to_gpt2_config needs a BTLM config (model_type 'btlm'), got "
            f"{type(btlm_config).__name__} "
            f"(model_type {getattr(btlm_config, 'model_type', None)!r})"
        )
    alibi = btlm_config.position_embedding_type == "alibi"
    return GPT2Config(
        vocab_size=btlm_config.vocab_size,
        n_positions=0 if alibi else btlm_config.n_positions,
        n_embd=btlm_config.hidden_size,
        n_layer=btlm_config.num_hidden_layers,
        n_head=btlm_config.num_attention_heads,
        n_inner=btlm_config.n_inner,
        activation_function=btlm_config.activation_function,
        resid_pdrop=btlm_config.resid_pdrop,
        embd_pdrop=btlm_config.embd_pdrop,
        attn_pdrop=btlm_config.attn_pdrop,
        layer_norm_epsilon=btlm_config.layer_norm_epsilon,
        initializer_range=btlm_config.initializer_range,
        bos_token_id=btlm_config.bos_token_id,
        eos_token_id=btlm_config.eos_token_id,
        use_alibi=alibi,
        use_flash_attn=alibi,  # ALiBi runs through FlashAttention
        mup_width_scale=btlm_config.mup_width_scale,
        mup_embeddings_multiplier=btlm_config.mup_embeddings_scale,
        mup_output_multiplier=btlm_config.mup_output_alpha,
        mup_scale_qk_dot_by_d=btlm_config.mup_scale_qk_dot_by_d,
        mlp_multiple_of=1,
    )
