"""Hugging Face GPT-J checkpoints (``GPTJForCausalLM``) for
``flash_attn.models.gpt.GPTLMHeadModel``: ``gptj_config_to_gpt2_config`` and
``remap_state_dict_hf_gptj``, with upstream flash-attn's names."""

from collections import OrderedDict

from transformers import GPT2Config, GPTJConfig

from flash_attn.models.gpt import _rename
from flash_attn.models.opt import _embeddings_and_head, _fuse_qkv

_GPTJ_RULES = (
    (r"^transformer\.ln_f\.", "transformer.ln_f."),
    (r"^transformer\.h\.(\d+)\.ln_1\.", r"transformer.layers.\1.norm1."),
    (r"^transformer\.h\.(\d+)\.mlp\.fc_in\.", r"transformer.layers.\1.mlp.fc1."),
    (r"^transformer\.h\.(\d+)\.mlp\.fc_out\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^transformer\.h\.(\d+)\.attn\.Wqkv\.", r"transformer.layers.\1.mixer.Wqkv."),
    (r"^transformer\.h\.(\d+)\.attn\.out_proj\.", r"transformer.layers.\1.mixer.out_proj."),
    # Causal-mask buffers and rotary tables of older checkpoints: not weights.
    (r"^transformer\.h\.\d+\.attn\.(bias|masked_bias|embed_positions)$", None),
)


def remap_state_dict_hf_gptj(state_dict, config):
    """A ``GPTJForCausalLM`` state dict -> ``GPTLMHeadModel``'s (``config``: from
    ``gptj_config_to_gpt2_config``); the vocabulary (head and head bias included) is padded to
    ``pad_vocab_size_multiple``."""
    state_dict = OrderedDict(state_dict)
    head = _embeddings_and_head(state_dict, config, "transformer.wte.weight")
    for i in range(config.n_layer):
        attn = f"transformer.h.{i}.attn"
        _fuse_qkv(state_dict, attn, attn)
    state_dict = _rename(state_dict, _GPTJ_RULES)
    state_dict.update(head)
    return state_dict


def gptj_config_to_gpt2_config(gptj_config: GPTJConfig) -> GPT2Config:
    """The ``GPT2Config`` of the ``GPTLMHeadModel`` that computes what ``gptj_config``'s model
    does (parallel blocks with one norm, interleaved rotary on ``rotary_dim`` dims of each head,
    an untied head with a bias)."""
    if getattr(gptj_config, "model_type", None) != "gptj":
        raise ValueError(
            f"gptj_config_to_gpt2_config needs a GPTJConfig, got {type(gptj_config).__name__} "
            f"(model_type {getattr(gptj_config, 'model_type', None)!r})"
        )
    head_dim = gptj_config.n_embd // gptj_config.n_head
    rotary_dim = gptj_config.rotary_dim or head_dim  # None: every dim rotates
    return GPT2Config(
        vocab_size=gptj_config.vocab_size,
        n_positions=0,  # rotary only
        n_embd=gptj_config.n_embd,
        n_layer=gptj_config.n_layer,
        n_head=gptj_config.n_head,
        n_inner=gptj_config.n_inner,
        activation_function=gptj_config.activation_function,
        resid_pdrop=gptj_config.resid_pdrop,
        embd_pdrop=gptj_config.embd_pdrop,
        attn_pdrop=gptj_config.attn_pdrop,
        layer_norm_epsilon=gptj_config.layer_norm_epsilon,
        initializer_range=gptj_config.initializer_range,
        bos_token_id=gptj_config.bos_token_id,
        eos_token_id=gptj_config.eos_token_id,
        prenorm=True,
        parallel_block=True,
        parallel_block_tied_norm=True,
        rotary_emb_fraction=rotary_dim / head_dim,
        rotary_emb_interleaved=True,
        tie_word_embeddings=False,
        qkv_proj_bias=False,
        out_proj_bias=False,
        lm_head_bias=True,
    )
