"""Llama checkpoints and configs for ``flash_attn.models.gpt``, with upstream flash-attn's names.

``llama_config_to_gpt2_config`` describes a Llama model as the ``GPT2Config`` that
``GPTLMHeadModel`` takes (RMSNorm, SwiGLU, interleaved rotary, grouped-query attention, no
biases); ``remap_state_dict_hf_llama`` / ``remap_state_dict_meta_llama`` convert Hugging Face /
Meta state dicts to that model's layout and ``inv_remap_state_dict_hf_llama`` converts back.

Layout differences the remaps undo: Hugging Face permutes the rows of each query/key head so
that rotary rotates halves (``rotate_half``); this model rotates interleaved pairs, as Meta's
checkpoints do. The MLP's ``fc1`` holds ``[up; gate]`` (Meta's ``[w3; w1]``).
"""

import json
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Union

import torch
import torch.nn.functional as F
from transformers import GPT2Config, LlamaConfig


def _padded(rows: int, config) -> int:
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    return -(-rows // multiple) * multiple


def _pad_vocab(t: torch.Tensor, config) -> torch.Tensor:
    """Zero rows appended up to a multiple of ``pad_vocab_size_multiple``."""
    return F.pad(t, (0, 0, 0, _padded(t.shape[0], config) - t.shape[0]))


def _head_dim(config) -> int:
    return config.n_embd // config.n_head


def _halves_to_pairs(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per head, rows ``[x_0..x_{d/2-1}, y_0..y_{d/2-1}]`` -> ``[x_0, y_0, x_1, y_1, ...]``
    (Hugging Face's rotate-half layout -> the interleaved one)."""
    return w.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def _pairs_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of ``_halves_to_pairs``."""
    return w.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


def _rename(state_dict, rules):
    """Apply the first matching ``(pattern, replacement)`` to each key (others unchanged)."""
    renamed = OrderedDict()
    for key, value in state_dict.items():
        for pattern, replacement in rules:
            if re.match(pattern, key):
                key = re.sub(pattern, replacement, key)
                break
        renamed[key] = value
    return renamed


def _embeddings_and_head(state_dict, config, embed_key, head_key, out_embed_key, out_head_key):
    """Pop the word embeddings and output head and put them back, padded, under the new keys
    (the head is the embeddings when ``config.tie_word_embeddings``)."""
    words = _pad_vocab(state_dict.pop(embed_key), config)
    head = state_dict.pop(head_key, None)
    if getattr(config, "tie_word_embeddings", False):
        head = words
    elif head is None:
        raise KeyError(f"{head_key} is missing and config.tie_word_embeddings is False")
    else:
        head = _pad_vocab(head, config)  # may be sharded differently from the embeddings
    state_dict[out_embed_key] = words
    state_dict[out_head_key] = head


_HF_RULES = (
    (r"^model\.norm\.", "transformer.ln_f."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"transformer.layers.\1.norm1."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.layers.\1.norm2."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.layers.\1.mixer.out_proj."),
)


def remap_state_dict_hf_llama(
    state_dict: Dict[str, torch.Tensor], config: GPT2Config
) -> Dict[str, torch.Tensor]:
    """A Hugging Face ``LlamaForCausalLM`` state dict -> ``GPTLMHeadModel``'s (``config``: from
    ``llama_config_to_gpt2_config``). Entries are moved out of ``state_dict``."""
    head_dim = _head_dim(config)
    _embeddings_and_head(state_dict, config, "model.embed_tokens.weight", "lm_head.weight",
                         "transformer.embeddings.word_embeddings.weight", "lm_head.weight")
    for i in range(config.n_layer):
        hf, ours = f"model.layers.{i}", f"transformer.layers.{i}"
        gate = state_dict.pop(f"{hf}.mlp.gate_proj.weight")
        up = state_dict.pop(f"{hf}.mlp.up_proj.weight")
        state_dict[f"{ours}.mlp.fc1.weight"] = torch.cat([up, gate], dim=0)
        q = _halves_to_pairs(state_dict.pop(f"{hf}.self_attn.q_proj.weight"), head_dim)
        k = _halves_to_pairs(state_dict.pop(f"{hf}.self_attn.k_proj.weight"), head_dim)
        v = state_dict.pop(f"{hf}.self_attn.v_proj.weight")
        state_dict[f"{ours}.mixer.Wqkv.weight"] = torch.cat([q, k, v], dim=0)
        state_dict.pop(f"{hf}.self_attn.rotary_emb.inv_freq", None)  # recomputed, not stored
    return _rename(state_dict, _HF_RULES)


_INV_HF_RULES = (
    (r"^transformer\.ln_f\.", "model.norm."),
    (r"^transformer\.layers\.(\d+)\.norm1\.", r"model.layers.\1.input_layernorm."),
    (r"^transformer\.layers\.(\d+)\.norm2\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^transformer\.layers\.(\d+)\.mlp\.fc2\.", r"model.layers.\1.mlp.down_proj."),
    (r"^transformer\.layers\.(\d+)\.mixer\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
)


def inv_remap_state_dict_hf_llama(
    state_dict: Dict[str, torch.Tensor], config: GPT2Config
) -> Dict[str, torch.Tensor]:
    """``GPTLMHeadModel``'s state dict -> Hugging Face ``LlamaForCausalLM``'s: the inverse of
    ``remap_state_dict_hf_llama`` (the vocabulary stays padded as it is). Entries are moved out
    of ``state_dict``."""
    head_dim = _head_dim(config)
    n_head_kv = getattr(config, "n_head_kv", None) or config.n_head
    q_rows, kv_rows = config.n_head * head_dim, n_head_kv * head_dim
    _embeddings_and_head(state_dict, config, "transformer.embeddings.word_embeddings.weight",
                         "lm_head.weight", "model.embed_tokens.weight", "lm_head.weight")
    for i in range(config.n_layer):
        hf, ours = f"model.layers.{i}", f"transformer.layers.{i}"
        up, gate = state_dict.pop(f"{ours}.mlp.fc1.weight").chunk(2, dim=0)
        state_dict[f"{hf}.mlp.gate_proj.weight"] = gate
        state_dict[f"{hf}.mlp.up_proj.weight"] = up
        q, k, v = state_dict.pop(f"{ours}.mixer.Wqkv.weight").split([q_rows, kv_rows, kv_rows])
        state_dict[f"{hf}.self_attn.q_proj.weight"] = _pairs_to_halves(q, head_dim)
        state_dict[f"{hf}.self_attn.k_proj.weight"] = _pairs_to_halves(k, head_dim)
        state_dict[f"{hf}.self_attn.v_proj.weight"] = v
    return _rename(state_dict, _INV_HF_RULES)


_META_RULES = (
    (r"^transformer\.norm\.", "transformer.ln_f."),
    (r"^transformer\.layers\.(\d+)\.attention_norm\.", r"transformer.layers.\1.norm1."),
    (r"^transformer\.layers\.(\d+)\.ffn_norm\.", r"transformer.layers.\1.norm2."),
    (r"^transformer\.layers\.(\d+)\.feed_forward\.w2\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^transformer\.layers\.(\d+)\.attention\.wo\.", r"transformer.layers.\1.mixer.out_proj."),
)


def remap_state_dict_meta_llama(
    state_dict: Dict[str, torch.Tensor], config: GPT2Config
) -> Dict[str, torch.Tensor]:
    """A Meta (``consolidated.*.pth``, one shard) Llama state dict -> ``GPTLMHeadModel``'s.
    Meta's rotary is already interleaved: no permutation."""
    state_dict = OrderedDict(
        (key if key.startswith("output.") else f"transformer.{key}", value)
        for key, value in state_dict.items()
    )
    _embeddings_and_head(state_dict, config, "transformer.tok_embeddings.weight", "output.weight",
                         "transformer.embeddings.word_embeddings.weight", "lm_head.weight")
    for i in range(config.n_layer):
        layer = f"transformer.layers.{i}"
        w1 = state_dict.pop(f"{layer}.feed_forward.w1.weight")  # gate
        w3 = state_dict.pop(f"{layer}.feed_forward.w3.weight")  # up
        state_dict[f"{layer}.mlp.fc1.weight"] = torch.cat([w3, w1], dim=0)
        wq, wk, wv = (state_dict.pop(f"{layer}.attention.w{x}.weight") for x in "qkv")
        state_dict[f"{layer}.mixer.Wqkv.weight"] = torch.cat([wq, wk, wv], dim=0)
        state_dict.pop(f"{layer}.attention.inner_attention.rope.freqs", None)
    state_dict.pop("transformer.rope.freqs", None)
    return _rename(state_dict, _META_RULES)


def _meta_intermediate_size(hidden_size, multiple_of, ffn_dim_multiplier):
    """Meta's MLP width: 2/3 of 4 * hidden, times ``ffn_dim_multiplier``, rounded up to
    ``multiple_of``."""
    size = int(2 * (4 * hidden_size) / 3)
    if ffn_dim_multiplier is not None:
        size = int(ffn_dim_multiplier * size)
    return multiple_of * -(-size // multiple_of)


def config_from_meta_checkpoint(
    checkpoint_path: Union[str, os.PathLike], model_name: str
) -> LlamaConfig:
    """The ``LlamaConfig`` of a Meta checkpoint (``<checkpoint_path>/<model_name>/params.json``;
    the vocabulary size from ``tokenizer.model`` when present, needing sentencepiece, else
    32000)."""
    directory = Path(checkpoint_path) / model_name
    params = json.loads((directory / "params.json").read_text())
    config = LlamaConfig(
        hidden_size=params["dim"],
        intermediate_size=_meta_intermediate_size(
            params["dim"], params.get("multiple_of", 1), params.get("ffn_dim_multiplier")
        ),
        num_attention_heads=params["n_heads"],
        num_hidden_layers=params["n_layers"],
        rms_norm_eps=params["norm_eps"],
        num_key_value_heads=params.get("n_kv_heads", None),
    )
    if "rope_theta" in params:
        config.rotary_emb_base = params["rope_theta"]
    config.vocab_size = 32000  # params.json does not say; CodeLlama has 32000 or 32016
    tokenizer = directory / "tokenizer.model"
    if tokenizer.is_file():
        from sentencepiece import SentencePieceProcessor

        config.vocab_size = SentencePieceProcessor(str(tokenizer)).vocab_size()
    return config


def config_from_hf_checkpoint(
    checkpoint_path: Union[str, os.PathLike], model_name: str
) -> LlamaConfig:
    """The ``LlamaConfig`` in ``<checkpoint_path>/<model_name>-hf/config.json``."""
    return LlamaConfig.from_pretrained(Path(checkpoint_path) / f"{model_name}-hf" / "config.json")


def config_from_checkpoint(
    checkpoint_path: Union[str, os.PathLike], model_name: str, checkpoint_format="meta"
) -> LlamaConfig:
    """``config_from_meta_checkpoint`` (``checkpoint_format="meta"``) or
    ``config_from_hf_checkpoint`` (any other value)."""
    if checkpoint_format == "meta":
        return config_from_meta_checkpoint(checkpoint_path, model_name)
    return config_from_hf_checkpoint(checkpoint_path, model_name)


def state_dicts_from_checkpoint(
    checkpoint_path: Union[str, os.PathLike], model_name: str
) -> List[dict]:
    """The state dicts of a Meta checkpoint's ``consolidated.*.pth`` shards, in shard order."""
    paths = sorted((Path(checkpoint_path) / model_name).glob("consolidated.*.pth"))
    return [torch.load(path, map_location="cpu", weights_only=True) for path in paths]


def _rope_theta(llama_config) -> float:
    """The rotary base: ``rotary_emb_base`` (set by ``config_from_meta_checkpoint``), else the
    Hugging Face ``rope_theta`` (transformers 5 keeps it in ``rope_parameters``)."""
    explicit = getattr(llama_config, "rotary_emb_base", None)
    if explicit is not None:
        return float(explicit)
    rope = getattr(llama_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(llama_config, "rope_theta", None))
    return float(theta) if theta is not None else 10000.0


def _check_convertible(llama_config) -> None:
    """Llama variants the GPT model would compute differently: refuse rather than mislead."""
    rope = getattr(llama_config, "rope_parameters", None) or getattr(
        llama_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise NotImplementedError(f"rope scaling {rope_type!r} is not supported by GPTLMHeadModel")
    head_dim = getattr(llama_config, "head_dim", None)
    if head_dim is not None and head_dim * llama_config.num_attention_heads != llama_config.hidden_size:
        raise NotImplementedError(
            f"head_dim ({head_dim}) * num_attention_heads ({llama_config.num_attention_heads}) "
            f"must equal hidden_size ({llama_config.hidden_size})"
        )
    if getattr(llama_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {llama_config.hidden_act!r}: only silu (SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(llama_config, flag, False):
            raise NotImplementedError(f"{flag}=True is not supported by the Llama remaps")


def llama_config_to_gpt2_config(llama_config: LlamaConfig) -> GPT2Config:
    """The ``GPT2Config`` of ``GPTLMHeadModel`` that computes what ``llama_config``'s model does
    (no position embeddings, RMSNorm, SwiGLU, full interleaved rotary, no biases, no dropout)."""
    _check_convertible(llama_config)
    return GPT2Config(
        vocab_size=llama_config.vocab_size,
        n_positions=0,  # rotary only
        n_embd=llama_config.hidden_size,
        n_layer=llama_config.num_hidden_layers,
        n_head=llama_config.num_attention_heads,
        n_inner=llama_config.intermediate_size,
        activation_function="swiglu",  # Hugging Face's "silu" in a gated MLP
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=llama_config.rms_norm_eps,
        initializer_range=llama_config.initializer_range,
        bos_token_id=llama_config.bos_token_id,
        eos_token_id=llama_config.eos_token_id,
        pad_token_id=llama_config.pad_token_id,
        rms_norm=True,
        rotary_emb_fraction=1.0,
        rotary_emb_interleaved=True,
        tie_word_embeddings=bool(getattr(llama_config, "tie_word_embeddings", False)),
        qkv_proj_bias=False,
        out_proj_bias=False,
        mlp_fc1_bias=False,
        mlp_fc2_bias=False,
        mlp_multiple_of=1,  # intermediate_size is exact, not rounded up
        rotary_emb_base=_rope_theta(llama_config),
        n_head_kv=llama_config.num_key_value_heads,
    )
