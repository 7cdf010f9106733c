"""GPT-style decoder models built from ``flash_attn.modules``, with upstream flash-attn's names.

``GPTModel`` (embeddings, blocks, final norm) and ``GPTLMHeadModel`` (plus the language-model
head and ``generate``) are configured by a ``transformers.GPT2Config``; attributes that GPT-2
itself lacks are read with defaults, so one config class describes GPT-2, GPT-J/NeoX-style
parallel blocks, Llama (RMSNorm, SwiGLU, rotary, grouped-query attention) and more:

==========================  ==========  ==================================================
attribute                   default     meaning
==========================  ==========  ==================================================
use_flash_attn              False       this package's FlashAttention, else plain PyTorch
fused_bias_fc               False       accepted and ignored, as upstream's MHA does
fused_mlp                   False       upstream's FusedMLP / ParallelFusedMLP (ops.fused_dense)
fused_dropout_add_ln        False       dropout + add + norm through ops.triton.layer_norm
residual_in_fp32            False       keep the residual stream in float32
pad_vocab_size_multiple     1           round the vocabulary up to this multiple
rotary_emb_fraction         0.0         rotary on this fraction of each head's dims
rotary_emb_base             10000.0     rotary frequency base
rotary_emb_interleaved      False       rotate pairs (2i, 2i+1) instead of halves
n_head_kv                   n_head      key/value heads (grouped-query attention)
parallel_block              False       attention and MLP side by side (GPT-J / NeoX)
tie_word_embeddings         True        the head shares the word embedding matrix
rms_norm                    False       RMSNorm instead of LayerNorm
prenorm                     True        pre-norm blocks (False: post-norm)
qkv_proj_bias, ...          True        biases of the projections and MLP layers
activation_function         (GPT-2)     gelu*, relu, sqrelu, glu, swiglu, geglu
==========================  ==========  ==================================================

``shard_state_dict_tp`` / ``combine_state_dicts_tp`` convert between a full state dict and the
per-rank state dicts of the tensor-parallel model (``process_group=...``), whose layouts are
those of ``ParallelMHA`` (per rank: its query heads, then its key heads, then its value heads),
``ParallelMLP`` / ``ParallelGatedMlp`` and ``ParallelGPT2Embeddings``.
"""

import importlib
import logging
import math
import re
from collections import OrderedDict, namedtuple
from collections.abc import Sequence
from functools import partial
from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_attn.modules.block import Block, ParallelBlock
from flash_attn.modules.embedding import GPT2Embeddings, ParallelGPT2Embeddings
from flash_attn.modules.mha import MHA, ParallelMHA
from flash_attn.modules.mlp import GatedMlp, Mlp, ParallelGatedMlp, ParallelMLP
from flash_attn.modules.tensor_parallel import ColumnParallelLinear  # noqa: F401  (upstream's names here)
from flash_attn.ops.activations import sqrelu_fwd
from flash_attn.ops.fused_dense import FusedMLP, ParallelFusedMLP
from flash_attn.ops.triton.mlp import FusedDenseSqreluDense  # noqa: F401
from flash_attn.ops.triton.layer_norm import RMSNorm, layer_norm_fn
from flash_attn.utils.distributed import (
    all_gather,
    all_gather_raw,
    get_dim_for_local_rank,
    sync_shared_params,
)
from flash_attn.utils.generation import GenerationMixin

try:
    from transformers import GPT2Config
except ImportError as _exc:  # pragma: no cover - transformers is how these models are configured
    raise ImportError(
        "flash_attn.models.gpt needs Hugging Face transformers (its GPT2Config configures the "
        f"models): {_exc}"
    ) from _exc

logger = logging.getLogger(__name__)

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])

_TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_approx", "gelu_pytorch_tanh")
_GATED_ACTIVATIONS = {"glu": F.sigmoid, "swiglu": F.silu, "geglu": F.gelu}
SUPPORTED_ACTIVATIONS = ("gelu",) + _TANH_GELUS + ("relu", "sqrelu") + tuple(_GATED_ACTIVATIONS)

_FUSED_MLP_ACTIVATIONS = {**{name: "gelu_approx" for name in _TANH_GELUS}, "relu": "relu", "sqrelu": "sqrelu"}


def _padded_vocab_size(config) -> int:
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    return math.ceil(config.vocab_size / multiple) * multiple


def _num_heads_kv(config) -> int:
    return getattr(config, "n_head_kv", None) or config.num_attention_heads


def _check_config(config) -> None:
    """Head counts the model cannot be built with: a clear error instead of a shape mismatch
    (activation and block-layout settings are checked where the MLPs and blocks are made)."""
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size ({config.hidden_size}) must be divisible by num_attention_heads "
            f"({config.num_attention_heads})"
        )
    if config.num_attention_heads % _num_heads_kv(config):
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be divisible by n_head_kv "
            f"({_num_heads_kv(config)})"
        )


def _parallel_kwargs(config, process_group) -> dict:
    if process_group is None:
        return {}
    return {
        "process_group": process_group,
        "sequence_parallel": getattr(config, "sequence_parallel", True),
    }


def _head_dim(config) -> int:
    return getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)


def _softmax_scale(config, layer_idx) -> float:
    head_dim = _head_dim(config)
    # muP scales q.k by 1/d instead of 1/sqrt(d)
    power = 1.0 if getattr(config, "mup_scale_qk_dot_by_d", False) else 0.5
    scale = head_dim ** (-power) if config.scale_attn_weights else 1.0
    scale *= getattr(config, "mup_attn_multiplier", 1.0)
    if config.scale_attn_by_inverse_layer_idx:
        if layer_idx is None:
            raise ValueError("scale_attn_by_inverse_layer_idx=True needs layer_idx")
        scale /= float(layer_idx + 1)
    return scale


def create_mixer_cls(config, layer_idx=None, process_group=None, device=None, dtype=None):
    """The attention constructor (``MHA``, or ``ParallelMHA`` with ``process_group``) of layer
    ``layer_idx``, as a partial that takes the hidden size."""
    head_dim = _head_dim(config)
    dwconv = getattr(config, "attn_dwconv", False)
    if dwconv and process_group is not None:
        raise NotImplementedError("tensor-parallel attention does not support attn_dwconv")
    serial_kwargs = {}
    if process_group is None:
        serial_kwargs = {"fused_bias_fc": getattr(config, "fused_bias_fc", False),
                         "dwconv": dwconv}
    return partial(
        MHA if process_group is None else ParallelMHA,
        num_heads=config.num_attention_heads,
        num_heads_kv=getattr(config, "n_head_kv", None),
        qkv_proj_bias=getattr(config, "qkv_proj_bias", True),
        out_proj_bias=getattr(config, "out_proj_bias", True),
        dropout=config.attn_pdrop,
        softmax_scale=_softmax_scale(config, layer_idx),
        causal=True,
        layer_idx=layer_idx,
        rotary_emb_dim=int(getattr(config, "rotary_emb_fraction", 0.0) * head_dim),
        rotary_emb_base=getattr(config, "rotary_emb_base", 10000.0),
        rotary_emb_scale_base=getattr(config, "rotary_emb_scale_base", None),
        rotary_emb_interleaved=getattr(config, "rotary_emb_interleaved", False),
        use_alibi=getattr(config, "use_alibi", False),
        window_size=getattr(config, "window_size", (-1, -1)),
        use_flash_attn=getattr(config, "use_flash_attn", False),
        **serial_kwargs,
        **_parallel_kwargs(config, process_group),
        device=device,
        dtype=dtype,
    )


def _plain_activation(name):
    if name == "relu":
        return partial(F.relu, inplace=True)
    if name == "sqrelu":
        return sqrelu_fwd
    return partial(F.gelu, approximate="tanh" if name in _TANH_GELUS else "none")


def _fused_mlp_cls(config, layer_idx, process_group, device, dtype):
    """Upstream's fused MLPs (``fused_mlp``: ``ops.fused_dense.FusedMLP`` / ``ParallelFusedMLP``;
    ``fused_dense_sqrelu_dense``: ``ops.triton.mlp.FusedDenseSqreluDense``), or None."""
    fused_mlp = getattr(config, "fused_mlp", False)
    sqrelu_dense = getattr(config, "fused_dense_sqrelu_dense", False)
    if not (fused_mlp or sqrelu_dense):
        return None
    if fused_mlp and sqrelu_dense:
        raise ValueError("fused_mlp and fused_dense_sqrelu_dense exclude each other")
    checkpoint_lvl = getattr(config, "mlp_checkpoint_lvl", 0)
    if isinstance(checkpoint_lvl, Sequence):  # one per layer
        checkpoint_lvl = checkpoint_lvl[layer_idx]
    factory = {"device": device, "dtype": dtype}
    if sqrelu_dense:
        if config.activation_function != "sqrelu" or process_group is not None:
            raise ValueError("fused_dense_sqrelu_dense needs activation_function 'sqrelu' and no process_group")
        return partial(FusedDenseSqreluDense, hidden_features=config.n_inner, checkpoint_lvl=checkpoint_lvl, **factory)
    if config.activation_function not in _FUSED_MLP_ACTIVATIONS:
        raise ValueError(f"fused_mlp needs activation_function in {sorted(_FUSED_MLP_ACTIVATIONS)}, "
                         f"got {config.activation_function!r}")
    return partial(FusedMLP if process_group is None else ParallelFusedMLP, hidden_features=config.n_inner,
                   activation=_FUSED_MLP_ACTIVATIONS[config.activation_function], checkpoint_lvl=checkpoint_lvl,
                   bias1=getattr(config, "mlp_fc1_bias", True), bias2=getattr(config, "mlp_fc2_bias", True),
                   **_parallel_kwargs(config, process_group), **factory)


def create_mlp_cls(config, layer_idx=None, process_group=None, device=None, dtype=None):
    """The MLP constructor of layer ``layer_idx`` (``Mlp`` / ``GatedMlp``, or their parallel
    forms with ``process_group``), as a partial that takes the hidden size."""
    name = config.activation_function
    if name not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"activation_function {name!r} is not supported; use one of "
            f"{', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    fused = _fused_mlp_cls(config, layer_idx, process_group, device, dtype)
    if fused is not None:
        return fused
    common = dict(
        hidden_features=config.n_inner,
        bias1=getattr(config, "mlp_fc1_bias", True),
        bias2=getattr(config, "mlp_fc2_bias", True),
        **_parallel_kwargs(config, process_group),
        device=device,
        dtype=dtype,
    )
    if name in _GATED_ACTIVATIONS:
        return partial(
            GatedMlp if process_group is None else ParallelGatedMlp,
            activation=_GATED_ACTIVATIONS[name],
            multiple_of=getattr(config, "mlp_multiple_of", 128),
            **common,
        )
    return partial(Mlp if process_group is None else ParallelMLP,
                   activation=_plain_activation(name), **common)


def create_block(config, layer_idx=None, process_group=None, device=None, dtype=None):
    """Transformer block ``layer_idx`` (``Block``, or ``ParallelBlock`` with
    ``parallel_block``)."""
    factory_kwargs = {"device": device, "dtype": dtype}
    mixer_cls = create_mixer_cls(config, layer_idx, process_group=process_group, **factory_kwargs)
    mlp_cls = create_mlp_cls(config, layer_idx, process_group=process_group, **factory_kwargs)
    norm_cls = partial(
        RMSNorm if getattr(config, "rms_norm", False) else nn.LayerNorm,
        eps=config.layer_norm_epsilon,
        **factory_kwargs,
    )
    # The first block's "residual dropout" is the dropout of the embeddings.
    resid_dropout1 = config.resid_pdrop if layer_idx is None or layer_idx > 0 else config.embd_pdrop
    common = dict(
        norm_cls=norm_cls,
        resid_dropout1=resid_dropout1,
        resid_dropout2=config.resid_pdrop,
        fused_dropout_add_ln=getattr(config, "fused_dropout_add_ln", False),
        residual_in_fp32=getattr(config, "residual_in_fp32", False),
        sequence_parallel=getattr(config, "sequence_parallel", True) and process_group is not None,
        mark_shared_params=process_group is not None,
    )
    if getattr(config, "parallel_block", False):
        if not getattr(config, "prenorm", True):
            raise ValueError("parallel_block=True needs prenorm=True")
        block = ParallelBlock(
            config.hidden_size, mixer_cls, mlp_cls,
            tied_norm=getattr(config, "parallel_block_tied_norm", False), **common,
        )
    else:
        block = Block(config.hidden_size, mixer_cls, mlp_cls,
                      prenorm=getattr(config, "prenorm", True), **common)
    block.layer_idx = layer_idx
    return block


# Checkpoint name prefixes -> (module of flash_attn.models, its remap function).
_PRETRAINED_REMAPS = (
    (("gpt2",), "gpt", "remap_state_dict_hf_gpt2"),
    (("facebook/opt",), "opt", "remap_state_dict_hf_opt"),
    (("EleutherAI/gpt-j-", "togethercomputer/GPT-JT-"), "gptj", "remap_state_dict_hf_gptj"),
    (("EleutherAI/gpt-neox-", "EleutherAI/pythia-", "togethercomputer/RedPajama-INCITE-"),
     "gpt_neox", "remap_state_dict_hf_gpt_neox"),
    (("tiiuae/falcon-",), "falcon", "remap_state_dict_hf_falcon"),
    (("meta-llama/Llama-",), "llama", "remap_state_dict_hf_llama"),
    (("bigcode/", "WizardLM/"), "bigcode", "remap_state_dict_hf_bigcode"),
)


def _remap_for(model_name: str):
    for prefixes, module, function in _PRETRAINED_REMAPS:
        if model_name.startswith(prefixes):
            # Imported here: most of these model families are separate modules, some not provided.
            return getattr(importlib.import_module(f"flash_attn.models.{module}"), function)
    raise NotImplementedError(f"Model {model_name} not supported")


class GPTPreTrainedModel(nn.Module):
    """Base of the GPT models: keeps the ``GPT2Config`` and loads pretrained weights."""

    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        if not isinstance(config, GPT2Config):
            name = self.__class__.__name__
            raise ValueError(
                f"Parameter config in `{name}(config)` should be an instance of class "
                f"`GPT2Config`, got {type(config).__name__}. For a Llama config use "
                "flash_attn.models.llama.llama_config_to_gpt2_config."
            )
        _check_config(config)
        self.config = config

    @classmethod
    def from_pretrained(cls, model_name, config, *args, strict=True, device=None, dtype=None,
                        world_size=1, rank=0, **kwargs):
        """Build the model and load ``model_name``'s Hugging Face weights (downloaded through
        ``flash_attn.utils.pretrained``), remapped to this layout and, with ``world_size > 1``,
        this ``rank``'s tensor-parallel shard."""
        remap = _remap_for(model_name)  # an unknown name fails before anything is built
        from flash_attn.utils.pretrained import state_dict_from_pretrained

        model = cls(config, *args, device=device, dtype=dtype, **kwargs)
        # Loaded on the CPU: the model may already fill the GPU.
        state_dict = remap(state_dict_from_pretrained(model_name, device="cpu", dtype=dtype),
                           config)
        if world_size > 1:
            state_dict = shard_state_dict_tp(state_dict, config, world_size, rank)
        logger.info(model.load_state_dict(state_dict, strict=strict))
        return model


def _init_weights(module, n_layer, initializer_range=0.02, mup_width_scale=1.0,
                  rescale_prenorm_residual=True):
    """GPT-2's initialisation: normal linear and embedding weights, zero biases; the output
    projections of the residual branches scaled down by ``sqrt(2 * n_layer)``. ``mup_width_scale``
    (muP) widens the linear init and is recorded as the weights' learning-rate multiplier."""
    linear_std = initializer_range * math.sqrt(mup_width_scale)
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=linear_std)
        optim = getattr(module.weight, "_optim", {})
        optim.update({"lr_multiplier": mup_width_scale})
        module.weight._optim = optim
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, param in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.normal_(param, mean=0.0, std=linear_std / math.sqrt(2 * n_layer))


def _apply_init(model, config, mup_width_scale):
    model.apply(partial(_init_weights, n_layer=config.num_hidden_layers,
                        initializer_range=config.initializer_range,
                        mup_width_scale=mup_width_scale))


class GPTModel(GPTPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` blocks and (prenorm) the final norm ``ln_f``; returns
    the last hidden states ``(batch, seqlen, hidden)`` (with sequence parallelism: this rank's
    rows of ``(batch * seqlen, hidden)``)."""

    def __init__(self, config: GPT2Config, process_group=None, device=None, dtype=None):
        super().__init__(config)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.process_group = process_group
        self.sequence_parallel = getattr(config, "sequence_parallel", True)
        self.embeddings_multiplier = getattr(config, "mup_embeddings_multiplier", 1.0)
        self.residual_in_fp32 = getattr(config, "residual_in_fp32", False)
        self.prenorm = getattr(config, "prenorm", True)
        self.parallel_block = getattr(config, "parallel_block", False)
        self.fused_dropout_add_ln = getattr(config, "fused_dropout_add_ln", False)
        self.embeddings = self._make_embeddings(config, factory_kwargs)
        self.layers = nn.ModuleList(
            [create_block(config, layer_idx=i, process_group=process_group, **factory_kwargs)
             for i in range(config.num_hidden_layers)]
        )
        if getattr(config, "rotary_emb_fraction", 0.0) > 0.0:
            # One rotary module (one cos/sin cache) for all layers.
            for layer in self.layers[1:]:
                layer.mixer.rotary_emb = self.layers[0].mixer.rotary_emb
        if self.prenorm:
            self.drop_f = nn.Dropout(config.resid_pdrop)
            norm_cls = RMSNorm if getattr(config, "rms_norm", False) else nn.LayerNorm
            self.ln_f = norm_cls(config.hidden_size, eps=config.layer_norm_epsilon,
                                 **factory_kwargs)
            if process_group is not None:
                for p in self.ln_f.parameters():
                    p._shared_params = True  # synced at init
                    if self.sequence_parallel:
                        p._sequence_parallel = True  # gradients summed over ranks
        _apply_init(self, config, getattr(config, "mup_width_scale", 1.0))
        self.tie_weights()

    def _make_embeddings(self, config, factory_kwargs):
        vocab_size = _padded_vocab_size(config)
        if self.process_group is None:
            return GPT2Embeddings(
                config.hidden_size, vocab_size, config.max_position_embeddings,
                word_embed_proj_dim=getattr(config, "word_embed_proj_dim", None),
                **factory_kwargs,
            )
        return ParallelGPT2Embeddings(
            config.hidden_size, vocab_size, config.max_position_embeddings,
            process_group=self.process_group, sequence_parallel=self.sequence_parallel,
            **factory_kwargs,
        )

    def tie_weights(self):
        if self.process_group is not None:
            sync_shared_params(self, self.process_group)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {
            i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
            for i, layer in enumerate(self.layers)
        }

    def _run_layers(self, hidden_states, mixer_kwargs):
        """The blocks; returns ``(hidden_states, hidden_states2, residual)`` (``hidden_states2``:
        the last parallel block's MLP output; ``residual``: None for post-norm)."""
        hidden_states2 = residual = None
        for layer in self.layers:
            if not self.prenorm:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            elif self.parallel_block:
                hidden_states, hidden_states2, residual = layer(
                    hidden_states, hidden_states2, residual, mixer_kwargs=mixer_kwargs
                )
            else:
                hidden_states, residual = layer(hidden_states, residual, mixer_kwargs=mixer_kwargs)
        return hidden_states, hidden_states2, residual

    def _final_norm(self, hidden_states, hidden_states2, residual):
        """``ln_f(dropout(last outputs) + residual)``."""
        if self.fused_dropout_add_ln:
            return layer_norm_fn(
                hidden_states, self.ln_f.weight, self.ln_f.bias, residual=residual,
                x1=hidden_states2, eps=self.ln_f.eps,
                dropout_p=self.drop_f.p if self.training else 0.0, prenorm=False,
                is_rms_norm=isinstance(self.ln_f, RMSNorm),
            )
        summed = self.drop_f(hidden_states)
        if hidden_states2 is not None:
            summed = summed + self.drop_f(hidden_states2)
        if residual is not None:
            summed = residual + summed
        return self.ln_f(summed.to(dtype=self.ln_f.weight.dtype))

    def forward(self, input_ids, position_ids=None, inference_params=None):
        """input_ids: ``(batch, seqlen)``; position_ids: optional, for the learned position
        embeddings; inference_params: the kv-cache state of step-by-step decoding."""
        # Sequence parallel splits batch * seqlen over ranks; attention is told seqlen.
        split_tokens = self.process_group is not None and self.sequence_parallel
        embedding_kwargs = {"combine_batch_seqlen_dim": True} if split_tokens else {}
        hidden_states = self.embeddings(input_ids, position_ids=position_ids, **embedding_kwargs)
        if self.embeddings_multiplier != 1.0:
            hidden_states = hidden_states * self.embeddings_multiplier
        mixer_kwargs = {"seqlen": input_ids.shape[1]} if split_tokens else {}
        if inference_params is not None:
            mixer_kwargs["inference_params"] = inference_params
        hidden_states, hidden_states2, residual = self._run_layers(hidden_states, mixer_kwargs)
        if not self.prenorm:
            return hidden_states
        return self._final_norm(hidden_states, hidden_states2, residual)


class GPTLMHeadModel(GPTPreTrainedModel, GenerationMixin):
    """``GPTModel`` plus the language-model head; ``forward`` returns ``CausalLMOutput(logits)``
    and ``generate`` decodes through the kv cache (``flash_attn.utils.generation``)."""

    def __init__(self, config: GPT2Config, process_group=None, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(config)
        self.process_group = process_group
        self.transformer = GPTModel(config, process_group=process_group, **factory_kwargs)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        word_embed_proj_dim = getattr(config, "word_embed_proj_dim", None)  # OPT-350m
        embed_dim = config.n_embd if word_embed_proj_dim is None else word_embed_proj_dim
        self.project_out = None
        if word_embed_proj_dim is not None:
            self.project_out = nn.Linear(config.n_embd, embed_dim, bias=False, **factory_kwargs)
        mup_width_scale = getattr(config, "mup_width_scale", 1.0)
        self.output_scale = getattr(config, "mup_output_multiplier", 1.0) * mup_width_scale
        self.lm_head = self._make_lm_head(config, embed_dim, factory_kwargs)
        self.norm_head = getattr(config, "norm_head", False)
        _apply_init(self, config, mup_width_scale)
        self.tie_weights()

    def _make_lm_head(self, config, embed_dim, factory_kwargs):
        vocab_size = _padded_vocab_size(config)
        bias = getattr(config, "lm_head_bias", False)
        if self.process_group is None:
            return nn.Linear(embed_dim, vocab_size, bias=bias, **factory_kwargs)
        from flash_attn.modules.tensor_parallel import ColumnParallelLinear

        return ColumnParallelLinear(
            embed_dim, vocab_size, self.process_group, bias=bias,
            sequence_parallel=getattr(config, "sequence_parallel", True), **factory_kwargs,
        )

    def tie_weights(self):
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.embeddings.word_embeddings.weight
        if self.process_group is not None:
            sync_shared_params(self, self.process_group)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.transformer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype,
                                                         **kwargs)

    def _logits(self, hidden_states):
        if not self.norm_head:
            return self.lm_head(hidden_states)
        weight = F.normalize(self.lm_head.weight)
        if self.process_group is not None and self.lm_head.sequence_parallel:
            hidden_states = all_gather(hidden_states, self.lm_head.process_group)
        return F.linear(hidden_states, weight, bias=self.lm_head.bias)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        """input_ids: ``(batch, seqlen)`` token ids; inference_params: kv-cache state for
        generation; num_last_tokens: if > 0, the logits of the last that many tokens only.
        Returns ``CausalLMOutput(logits=(batch, seqlen, vocab))`` (tensor parallel, outside
        generation: this rank's slice of the vocabulary)."""
        if input_ids.ndim != 2:
            raise ValueError(
                f"Expected `input_ids` to have shape [b, slen], but got shape {tuple(input_ids.shape)}"
            )
        batch = input_ids.shape[0]
        hidden_states = self.transformer(input_ids, position_ids=position_ids,
                                         inference_params=inference_params)
        if inference_params is not None and hidden_states.ndim != 3:
            raise ValueError("sequence_parallel is not supported in generation mode; build the "
                             "model with config.sequence_parallel=False")
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        if self.output_scale != 1.0:
            hidden_states = hidden_states * self.output_scale
        logits = self._logits(hidden_states)
        if self.process_group is not None and inference_params is not None:
            # Sampling needs the whole vocabulary: gather the ranks' slices side by side.
            gathered, _ = all_gather_raw(logits, self.lm_head.process_group)
            world = gathered.shape[0] // batch
            logits = gathered.unflatten(0, (world, batch)).movedim(0, -2).flatten(-2)
        return CausalLMOutput(logits=logits)

    def load_state_dict(self, state_dict, strict=True):
        if "transformer.ln_0.weight" in state_dict:
            state_dict = _move_norms_to_prenorm(state_dict, len(self.transformer.layers))
        return super().load_state_dict(state_dict, strict=strict)


def _move_norms_to_prenorm(state_dict, n_layers):
    """Older checkpoints ran ``LN -> mixer / MLP -> dropout -> add`` with the norms after the
    branches (``ln_0`` before the first block); this layout normalises before each branch. The
    norm that followed branch k now precedes branch k + 1, and the last one becomes ``ln_f``."""
    state_dict = dict(state_dict)
    # Norms in execution order: ln_0, then norm1 / norm2 of each layer; each moves one place on.
    old_order = ["transformer.ln_0"] + [
        f"transformer.layers.{layer}.norm{i}" for layer in range(n_layers) for i in (1, 2)
    ]
    new_order = old_order[1:] + ["transformer.ln_f"]
    moved = {
        f"{new}.{kind}": state_dict.pop(f"{old}.{kind}")
        for old, new in zip(old_order, new_order)
        for kind in ("weight", "bias")
        if f"{old}.{kind}" in state_dict
    }
    state_dict.update(moved)
    return state_dict


# ----------------------------------------------------------------------------------------------
# Tensor parallel: full state dict <-> per-rank state dicts
# ----------------------------------------------------------------------------------------------


def _shares(total, world_size, multiple_of=1):
    """Each rank's share of ``total`` (as the parallel layers split it)."""
    return [get_dim_for_local_rank(total, world_size, r, multiple_of) for r in range(world_size)]


def _bounds(shares, rank):
    start = sum(shares[:rank])
    return start, start + shares[rank]


def _head_shares(config, world_size):
    """Query and key/value heads of each rank; ``ParallelMHA`` deals out whole kv groups."""
    group = config.n_head // _num_heads_kv(config)
    kv_shares = _shares(_num_heads_kv(config), world_size)
    return [kv * group for kv in kv_shares], kv_shares


def _split_qkv(t, n_q, n_kv, head_dim):
    """Wqkv's rows (or bias) -> (query rows, key rows, value rows)."""
    return torch.split(t, [n_q * head_dim, n_kv * head_dim, n_kv * head_dim], dim=0)


def _check_tp_sizes(config, world_size):
    inner_dim = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
    for what, size in (("vocab size (padded)", _padded_vocab_size(config)),
                       ("hidden_size", config.hidden_size), ("n_inner", inner_dim)):
        if size % world_size:
            raise ValueError(f"{what} ({size}) must be divisible by world_size ({world_size})")


def _layer_keys(i, name):
    return [f"transformer.layers.{i}.{name}.{kind}" for kind in ("weight", "bias")]


def _is_gated(config):
    return config.activation_function in _GATED_ACTIVATIONS


def shard_state_dict_tp(state_dict, config, world_size, rank):
    """The full state dict of a GPT model -> rank ``rank``'s state dict of the tensor-parallel
    model over ``world_size`` ranks. Modifies ``state_dict`` in place and returns it."""
    _check_tp_sizes(config, world_size)
    head_dim = config.hidden_size // config.n_head
    q_shares, kv_shares = _head_shares(config, world_size)
    (q_lo, q_hi), (kv_lo, kv_hi) = _bounds(q_shares, rank), _bounds(kv_shares, rank)

    def rows(t, lo, hi, unit=1):
        return t[lo * unit: hi * unit]

    def take(key, fn):
        if key in state_dict:
            state_dict[key] = fn(state_dict[key])

    def even_rows(t):
        return rows(t, *_bounds(_shares(t.shape[0], world_size), rank))

    def qkv(t):
        q, k, v = _split_qkv(t, config.n_head, _num_heads_kv(config), head_dim)
        return torch.cat([rows(q, q_lo, q_hi, head_dim), rows(k, kv_lo, kv_hi, head_dim),
                          rows(v, kv_lo, kv_hi, head_dim)])

    def gated(t):  # fc1 rows are [value, gate]: each rank keeps its slice of both
        return torch.cat([even_rows(half) for half in t.chunk(2, dim=0)])

    def last_dim(t):
        return even_rows(t.movedim(-1, 0)).movedim(0, -1)

    for key in ("transformer.embeddings.word_embeddings.weight", "lm_head.weight", "lm_head.bias"):
        take(key, even_rows)
    take("transformer.embeddings.position_embeddings.weight", last_dim)
    for i in range(config.num_hidden_layers):
        for key in _layer_keys(i, "mixer.Wqkv"):
            take(key, qkv)
        take(f"transformer.layers.{i}.mixer.out_proj.weight",
             lambda t: t[..., q_lo * head_dim: q_hi * head_dim])
        for key in _layer_keys(i, "mlp.fc1"):
            take(key, gated if _is_gated(config) else even_rows)
        take(f"transformer.layers.{i}.mlp.fc2.weight", last_dim)
        if rank != 0:  # row-parallel biases live on rank 0 only (added once)
            state_dict.pop(f"transformer.layers.{i}.mixer.out_proj.bias", None)
            state_dict.pop(f"transformer.layers.{i}.mlp.fc2.bias", None)
    return state_dict


def _combine_qkv(parts, config):
    """Per-rank Wqkv rows (or biases) -> the full Wqkv: all query heads, then keys, values."""
    head_dim = config.hidden_size // config.n_head
    q_shares, kv_shares = _head_shares(config, len(parts))
    split = [_split_qkv(t, q, kv, head_dim) for t, q, kv in zip(parts, q_shares, kv_shares)]
    return torch.cat([torch.cat([s[which] for s in split]) for which in range(3)])


def combine_state_dicts_tp(state_dicts: List[Dict[str, torch.Tensor]], config: GPT2Config):
    """The reverse of ``shard_state_dict_tp``: the ranks' state dicts (in rank order) -> the
    full state dict. The inputs are left unchanged."""
    world_size = len(state_dicts)
    _check_tp_sizes(config, world_size)
    vocab_share = _padded_vocab_size(config) // world_size
    state_dict = dict(state_dicts[0])

    def join(key, fn):
        if key in state_dict:
            state_dict[key] = fn([s[key] for s in state_dicts])

    def cat_dim(dim):
        return lambda ts: torch.cat(ts, dim=dim)

    def vocab(ts):  # sharded by rows here; some checkpoints shard the embedding dim instead
        return torch.cat(ts, dim=0 if ts[0].shape[0] == vocab_share else 1)

    def gated(ts):
        halves = [t.chunk(2, dim=0) for t in ts]
        return torch.cat([torch.cat([h[which] for h in halves]) for which in range(2)])

    for key in ("transformer.embeddings.word_embeddings.weight", "lm_head.weight"):
        join(key, vocab)
    join("lm_head.bias", cat_dim(0))
    join("transformer.embeddings.position_embeddings.weight", cat_dim(-1))
    for i in range(config.num_hidden_layers):
        for key in _layer_keys(i, "mixer.Wqkv"):
            join(key, lambda ts: _combine_qkv(ts, config))
        join(f"transformer.layers.{i}.mixer.out_proj.weight", cat_dim(-1))
        for key in _layer_keys(i, "mlp.fc1"):
            join(key, gated if _is_gated(config) else cat_dim(0))
        join(f"transformer.layers.{i}.mlp.fc2.weight", cat_dim(-1))
    return state_dict


# ----------------------------------------------------------------------------------------------
# Checkpoint remapping
# ----------------------------------------------------------------------------------------------


def _pad_rows(t, rows):
    """Zero rows appended up to ``rows`` (a vocabulary padded to a multiple)."""
    return F.pad(t, (0, 0, 0, rows - t.shape[0]))


def _rename(state_dict, rules):
    """Apply the first matching ``(pattern, replacement)`` to each key; a replacement of None
    drops the entry; keys no rule matches are kept unchanged."""
    renamed = OrderedDict()
    for key, value in state_dict.items():
        for pattern, replacement in rules:
            if re.match(pattern, key):
                if replacement is not None:
                    renamed[re.sub(pattern, replacement, key)] = value
                break
        else:
            renamed[key] = value
    return renamed


_GPT2_RULES = (
    (r"^wpe\.", "transformer.embeddings.position_embeddings."),
    (r"^ln_f\.", "transformer.ln_f."),
    (r"^h\.(\d+)\.ln_(1|2)\.", r"transformer.layers.\1.norm\2."),
    (r"^h\.(\d+)\.mlp\.c_fc\.", r"transformer.layers.\1.mlp.fc1."),
    (r"^h\.(\d+)\.mlp\.c_proj\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^h\.(\d+)\.attn\.c_attn\.", r"transformer.layers.\1.mixer.Wqkv."),
    (r"^h\.(\d+)\.attn\.c_proj\.", r"transformer.layers.\1.mixer.out_proj."),
    (r"^h\.(\d+)\.attn\.(bias|masked_bias)$", None),  # causal-mask buffers, not weights
)
# GPT-2's Conv1D stores its weight as (in_features, out_features), nn.Linear the transpose.
_GPT2_CONV1D = re.compile(r"^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def _word_and_head(word_embeddings, lm_head, config):
    """The (padded) word embeddings and lm_head entries."""
    vocab_size = _padded_vocab_size(config)
    words = _pad_rows(word_embeddings, vocab_size)
    tied = getattr(config, "tie_word_embeddings", True) or lm_head is None
    return {
        "transformer.embeddings.word_embeddings.weight": words,
        "lm_head.weight": words if tied else _pad_rows(lm_head, vocab_size),
    }


def remap_state_dict_hf_gpt2(state_dict, config):
    """A Hugging Face GPT-2 state dict (``GPT2Model``'s keys, or ``GPT2LMHeadModel``'s with
    their ``transformer.`` prefix) -> ``GPTLMHeadModel``'s. The vocabulary is padded to
    ``pad_vocab_size_multiple``."""
    state_dict = OrderedDict(
        (re.sub(r"^transformer\.", "", key), value) for key, value in state_dict.items()
    )
    state_dict = OrderedDict(
        (key, value.t() if _GPT2_CONV1D.match(key) else value) for key, value in state_dict.items()
    )
    head = _word_and_head(state_dict.pop("wte.weight"), state_dict.pop("lm_head.weight", None),
                          config)
    remapped = _rename(state_dict, _GPT2_RULES)
    remapped.update(head)
    return remapped


_MEGATRON_RULES = (
    (r"^transformer\.final_layernorm\.", "transformer.ln_f."),
    (r"^transformer\.layers\.(\d+)\.input_layernorm\.", r"transformer.layers.\1.norm1."),
    (r"^transformer\.layers\.(\d+)\.post_attention_layernorm\.", r"transformer.layers.\1.norm2."),
    (r"^transformer\.layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"transformer.layers.\1.mlp.fc1."),
    (r"^transformer\.layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"transformer.layers.\1.mlp.fc2."),
    (r"^transformer\.layers\.(\d+)\.self_attention\.rotary_emb\.",
     r"transformer.layers.\1.mixer.rotary_emb."),
    (r"^transformer\.layers\.(\d+)\.self_attention\.query_key_value\.",
     r"transformer.layers.\1.mixer.Wqkv."),
    (r"^transformer\.layers\.(\d+)\.self_attention\.dense\.", r"transformer.layers.\1.mixer.out_proj."),
)


def remap_state_dict_megatron(state_dict, config):
    """A Megatron-LM GPT state dict -> ``GPTLMHeadModel``'s (Megatron interleaves Wqkv per head:
    ``(heads, 3, head_dim)`` rows, this layout has ``(3, heads, head_dim)``)."""
    state_dict = OrderedDict(
        (re.sub(r"^language_model\.(encoder\.)?", "transformer.", key), value)
        for key, value in state_dict.items()
    )
    words = state_dict.pop("transformer.embedding.word_embeddings.weight")
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    words = _pad_rows(words, math.ceil(words.shape[0] / multiple) * multiple)
    state_dict = _rename(state_dict, _MEGATRON_RULES)
    state_dict["transformer.embeddings.word_embeddings.weight"] = words
    state_dict["lm_head.weight"] = words
    head_dim = config.hidden_size // config.num_attention_heads
    for key in list(state_dict):
        if re.match(r"^transformer\.layers\.\d+\.mixer\.Wqkv\.(weight|bias)$", key):
            t = state_dict[key]
            t = t.unflatten(0, (-1, 3, head_dim)).transpose(0, 1)
            state_dict[key] = t.flatten(0, 2)
    return state_dict
