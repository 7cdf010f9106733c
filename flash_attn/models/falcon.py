"""Hugging Face Falcon checkpoints (``FalconForCausalLM``, and the original "RW" remote-code
ones) for ``flash_attn.models.gpt.GPTLMHeadModel``: ``falcon_config_to_gpt2_config`` and
``remap_state_dict_hf_falcon``, with upstream flash-attn's names."""

import re
from collections import OrderedDict

import torch
from transformers import FalconConfig, GPT2Config

from flash_attn.models.gpt import _rename
from flash_attn.models.opt import _embeddings_and_head

_FALCON_RULES = (
    (r"^transformer\.h\.(\d+)\.(input_layernorm|ln_attn)\.", r"transformer.layers.\1.norm1."),
    (r"^transformer\.h\.(\d+)\.(post_attention_layernorm|ln_mlp)\.",
     r"transformer.layers.\1.norm2."),
    (r"^transformer\.h\.(\d+)\.mlp\.dense_h_to_4h\.", r"transformer.layers.\1.mlp.fc1."),
    (r"^transformer\.h\.(\d+)\.mlp\.dense_4h_to_h\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^transformer\.h\.(\d+)\.self_attention\.query_key_value\.",
     r"transformer.layers.\1.mixer.Wqkv."),
    (r"^transformer\.h\.(\d+)\.self_attention\.dense\.", r"transformer.layers.\1.mixer.out_proj."),
    (r".*rotary_emb\.inv_freq$", None),  # recomputed by the model, not a weight
)

_FALCON_MODEL_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")


def _falcon_groups_to_qkv(wqkv, n_head, n_head_kv, head_dim):
    """Falcon's fused rows, per key/value group ``[q_1 .. q_r, k, v]`` (``r = n_head /
    n_head_kv``; this also covers the multi-query and the per-head ``[q, k, v]`` layouts) ->
    all queries, then all keys, then all values."""
    groups = wqkv.unflatten(0, (n_head_kv, n_head // n_head_kv + 2, head_dim))
    q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
    return torch.cat([q.flatten(0, 2), k.flatten(0, 1), v.flatten(0, 1)], dim=0)


def remap_state_dict_hf_falcon(state_dict, config):
    """A ``FalconForCausalLM`` state dict -> ``GPTLMHeadModel``'s (``config``: from
    ``falcon_config_to_gpt2_config``); the vocabulary is padded to ``pad_vocab_size_multiple``."""
    state_dict = OrderedDict(state_dict)
    head = _embeddings_and_head(state_dict, config, "transformer.word_embeddings.weight")
    n_head, n_head_kv = config.n_head, getattr(config, "n_head_kv", None) or config.n_head
    head_dim = config.hidden_size // n_head
    for key in list(state_dict):
        if re.match(r"^transformer\.h\.\d+\.self_attention\.query_key_value\.", key):
            state_dict[key] = _falcon_groups_to_qkv(state_dict[key], n_head, n_head_kv, head_dim)
    state_dict = _rename(state_dict, _FALCON_RULES)
    state_dict.update(head)
    return state_dict


def _falcon_kv_heads(falcon_config) -> int:
    explicit = getattr(falcon_config, "n_head_kv", None)  # the original 40b "RW" config
    if explicit is not None:
        return explicit
    if getattr(falcon_config, "new_decoder_architecture", False):
        return falcon_config.num_kv_heads
    return 1 if getattr(falcon_config, "multi_query", False) else falcon_config.num_attention_heads


def _falcon_rope_theta(falcon_config) -> float:
    """The rotary base (transformers 5 keeps it in ``rope_parameters``); scaled rope is refused."""
    rope = (getattr(falcon_config, "rope_parameters", None)
            or getattr(falcon_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"Falcon rope scaling {rope_type!r} is not supported")
    return float(rope.get("rope_theta", getattr(falcon_config, "rope_theta", 10000.0)))


def _falcon_tied_norm(falcon_config) -> bool:
    """Whether attention and MLP of a parallel block read one norm (``input_layernorm``) rather
    than two (``ln_attn`` / ``ln_mlp``: the new decoder architecture, by default)."""
    if not getattr(falcon_config, "new_decoder_architecture", False):
        # The original 40b "RW" config does not say; its two norms go with grouped kv heads.
        return getattr(falcon_config, "n_head_kv", None) in (None, 1)
    return getattr(falcon_config, "num_ln_in_parallel_attn", None) == 1


def _check_falcon(falcon_config) -> None:
    # "RefinedWeb*": the original remote-code configs of Falcon-40b / -7b.
    if getattr(falcon_config, "model_type", None) not in _FALCON_MODEL_TYPES:
        raise ValueError(
            f"falcon_config_to_gpt2_config needs a FalconConfig, got "
            f"{type(falcon_config).__name__} (model_type "
            f"{getattr(falcon_config, 'model_type', None)!r})"
        )
    if getattr(falcon_config, "alibi", False):
        raise NotImplementedError("Falcon with alibi=True is not supported (rotary only)")
    new_architecture = getattr(falcon_config, "new_decoder_architecture", False)
    if new_architecture and not falcon_config.parallel_attn:
        raise NotImplementedError("Falcon's new decoder architecture needs parallel_attn=True")


def falcon_config_to_gpt2_config(falcon_config: FalconConfig) -> GPT2Config:
    """The ``GPT2Config`` of the ``GPTLMHeadModel`` that computes what ``falcon_config``'s model
    does (full rotary, multi-/grouped-query attention, parallel blocks with one or two norms)."""
    _check_falcon(falcon_config)
    hidden_size = falcon_config.hidden_size
    bias = falcon_config.bias
    return GPT2Config(
        vocab_size=falcon_config.vocab_size,
        n_positions=0,  # rotary only
        n_embd=hidden_size,
        n_layer=falcon_config.num_hidden_layers,
        n_head=falcon_config.num_attention_heads,
        n_inner=getattr(falcon_config, "ffn_hidden_size", None) or 4 * hidden_size,
        activation_function=getattr(falcon_config, "activation", "gelu"),
        resid_pdrop=falcon_config.hidden_dropout,
        embd_pdrop=0.0,  # Falcon has no embedding dropout
        attn_pdrop=falcon_config.attention_dropout,
        layer_norm_epsilon=falcon_config.layer_norm_epsilon,
        initializer_range=falcon_config.initializer_range,
        bos_token_id=falcon_config.bos_token_id,
        eos_token_id=falcon_config.eos_token_id,
        parallel_block=falcon_config.parallel_attn,
        n_head_kv=_falcon_kv_heads(falcon_config),
        parallel_block_tied_norm=_falcon_tied_norm(falcon_config),
        rotary_emb_fraction=1.0,
        rotary_emb_interleaved=False,
        rotary_emb_base=_falcon_rope_theta(falcon_config),
        tie_word_embeddings=getattr(falcon_config, "tie_word_embeddings", True),
        qkv_proj_bias=bias,
        out_proj_bias=bias,
        mlp_fc1_bias=bias,
        mlp_fc2_bias=bias,
        lm_head_bias=False,
    )
