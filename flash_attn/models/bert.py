"""BERT built from this package's modules, with upstream flash-attn's ``flash_attn.models.bert``
names, signatures and state-dict layout.

The encoder is a stack of post-norm ``Block``s (``MHA`` with packed ``Wqkv``, ``Mlp``). With
``config.use_flash_attn`` and an ``attention_mask``, the padded tokens are removed before the
first layer (``flash_attn.bert_padding.unpad_input``) and every layer runs on the packed tokens
through the varlen kernels; without it, attention masks the padded keys. With
``config.last_layer_subset`` (``BertForPreTraining``, which then needs
``config.dense_seq_output``), the last layer only computes the masked tokens and the first token
of each sequence: its attention is cross-attention from those tokens to the whole sequence.

``remap_state_dict`` / ``inv_remap_state_dict`` convert between Hugging Face's ``BertForPreTraining``
checkpoints and this layout. ``fused_mlp`` and ``fused_bias_fc`` use upstream's fused dense API,
:mod:`flash_attn.ops.fused_dense` (``fused_mlp``: tanh GELUs only, as upstream's); ``fused_dropout_add_ln`` runs through
``flash_attn.ops.triton.layer_norm`` and ``use_xentropy`` through ``flash_attn.losses``.
Needs Hugging Face ``transformers`` (for ``BertConfig`` and the output classes).
"""

import logging
import re
from collections import OrderedDict
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from transformers import BertConfig, PretrainedConfig
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
    from transformers.models.bert.modeling_bert import BertForPreTrainingOutput
except ImportError as exc:  # transformers is an optional dependency of this package
    raise ImportError(
        "flash_attn.models.bert needs Hugging Face transformers (BertConfig and the model output "
        "classes): install it, e.g. pip install 'flash-attn[transformers]'"
    ) from exc

from flash_attn.bert_padding import (
    index_first_axis,
    index_first_axis_residual,
    pad_input,
    unpad_input,
)
from flash_attn.modules.block import Block
from flash_attn.modules.embedding import BertEmbeddings
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import Mlp
from flash_attn.losses.cross_entropy import CrossEntropyLoss  # noqa: F401  (upstream's names here)
from flash_attn.ops.fused_dense import FusedDense, FusedMLP
from flash_attn.ops.triton.layer_norm import layer_norm_fn  # noqa: F401

logger = logging.getLogger(__name__)

_GELU_KINDS = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh"}



def _gelu_approximate(config):
    """``F.gelu``'s ``approximate`` argument for ``config.hidden_act``."""
    if config.hidden_act not in _GELU_KINDS:
        raise ValueError(
            f"config.hidden_act must be one of {sorted(_GELU_KINDS)}, got {config.hidden_act!r}"
        )
    return _GELU_KINDS[config.hidden_act]


def _linear_cls(config):
    """``nn.Linear``, or upstream's ``FusedDense`` (the same layer) with ``fused_bias_fc``."""
    return FusedDense if getattr(config, "fused_bias_fc", False) else nn.Linear


def _layer_norm_fn():
    from flash_attn.ops.triton.layer_norm import layer_norm_fn

    return layer_norm_fn


def create_mixer_cls(config, cross_attn=False, return_residual=False):
    """``MHA`` (bidirectional) with the config's heads, attention dropout and rotary settings."""
    rotary_kwargs = {}
    if getattr(config, "position_embedding_type", "absolute") == "rotary":
        rotary_kwargs = dict(
            rotary_emb_dim=getattr(config, "rotary_emb_dim", config.hidden_size),
            rotary_emb_base=getattr(config, "rotary_emb_base", 10000.0),
            rotary_emb_scale_base=getattr(config, "rotary_emb_scale_base", None),
            rotary_emb_interleaved=getattr(config, "rotary_emb_interleaved", False),
        )
    return partial(
        MHA,
        num_heads=config.num_attention_heads,
        cross_attn=cross_attn,
        dropout=config.attention_probs_dropout_prob,
        causal=False,
        fused_bias_fc=getattr(config, "fused_bias_fc", False),
        use_flash_attn=getattr(config, "use_flash_attn", False),
        return_residual=return_residual,
        **rotary_kwargs,
    )


def create_mlp_cls(config, layer_idx=None, return_residual=False):
    """``Mlp`` with ``config.intermediate_size`` hidden features and the config's GELU."""
    approximate = _gelu_approximate(config)
    if getattr(config, "fused_mlp", False):  # upstream's FusedMLP: tanh GELU only
        if approximate != "tanh":
            raise ValueError(f"fused_mlp needs a tanh GELU (gelu_new, gelu_fast, gelu_pytorch_tanh), got {config.hidden_act!r}")
        checkpoint_lvl = getattr(config, "mlp_checkpoint_lvl", 0)
        if isinstance(checkpoint_lvl, (list, tuple)):  # one per layer
            checkpoint_lvl = checkpoint_lvl[layer_idx]
        return partial(FusedMLP, hidden_features=config.intermediate_size, checkpoint_lvl=checkpoint_lvl,
                       return_residual=return_residual)
    return partial(
        Mlp,
        hidden_features=config.intermediate_size,
        activation=partial(F.gelu, approximate=approximate),
        return_residual=return_residual,
    )


def create_block(config, layer_idx=None):
    """Post-norm block ``layer_idx``; with ``last_layer_subset`` the last one cross-attends."""
    last_layer_subset = getattr(config, "last_layer_subset", False)
    cross_attn = last_layer_subset and layer_idx == config.num_hidden_layers - 1
    # The cross-attention layer's residual is its query input, which the block already holds,
    # so only the self-attention layers hand their input back.
    return_residual = not cross_attn
    return Block(
        config.hidden_size,
        create_mixer_cls(config, cross_attn, return_residual=return_residual),
        create_mlp_cls(config, layer_idx, return_residual=return_residual),
        norm_cls=partial(nn.LayerNorm, eps=config.layer_norm_eps),
        prenorm=False,
        resid_dropout1=config.hidden_dropout_prob,
        resid_dropout2=config.hidden_dropout_prob,
        fused_dropout_add_ln=getattr(config, "fused_dropout_add_ln", False),
        return_residual=return_residual,
    )


def _init_weights(module, initializer_range=0.02):
    """Hugging Face BERT's initialisation: normal weights, zero biases and padding embedding."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()


def _packed_subset(subset_mask, key_padding_mask):
    """Rows of the packed (unpadded) tokens that are in ``subset_mask``, and the subset's
    ``cu_seqlens``."""
    kept = subset_mask & key_padding_mask
    subset_idx = torch.nonzero(subset_mask[key_padding_mask], as_tuple=False).flatten()
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    return subset_idx, F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


class BertEncoder(nn.Module):
    """``config.num_hidden_layers`` post-norm blocks (see the module docstring)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.use_flash_attn = getattr(config, "use_flash_attn", False)
        self.layers = nn.ModuleList(
            [create_block(config, layer_idx=i) for i in range(config.num_hidden_layers)]
        )

    def forward(self, hidden_states, key_padding_mask=None, subset_mask=None):
        """hidden_states: ``(batch, seqlen, hidden)``; key_padding_mask: ``(batch, seqlen)`` bool,
        True = real token. subset_mask: ``(batch, seqlen)`` bool; if given, only those tokens'
        outputs are computed in the last layer and returned, packed as ``(n_subset, hidden)``.
        Otherwise returns ``(batch, seqlen, hidden)`` (zeros at padded tokens when unpadded)."""
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be torch.bool, got {key_padding_mask.dtype}")
        if key_padding_mask is None or not self.use_flash_attn:
            return self._forward_padded(hidden_states, key_padding_mask, subset_mask)
        return self._forward_unpadded(hidden_states, key_padding_mask, subset_mask)

    def _forward_padded(self, hidden_states, key_padding_mask, subset_mask):
        mixer_kwargs = None if key_padding_mask is None else {"key_padding_mask": key_padding_mask}
        for layer in self.layers:
            hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
        return hidden_states if subset_mask is None else hidden_states[subset_mask]

    def _forward_unpadded(self, hidden_states, key_padding_mask, subset_mask):
        batch, seqlen = hidden_states.shape[:2]
        hidden_states, indices, cu_seqlens, max_seqlen, _ = unpad_input(
            hidden_states, key_padding_mask
        )
        mixer_kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        if subset_mask is None:
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            return pad_input(hidden_states, indices, batch, seqlen)
        for layer in self.layers[:-1]:
            hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
        subset_idx, subset_cu_seqlens = _packed_subset(subset_mask, key_padding_mask)
        queries, hidden_states = index_first_axis_residual(hidden_states, subset_idx)
        # The subset's longest sequence is at most max_seqlen, a valid bound for the kernel.
        last_kwargs = {
            "x_kv": hidden_states,
            "cu_seqlens": subset_cu_seqlens,
            "max_seqlen": max_seqlen,
            "cu_seqlens_k": cu_seqlens,
            "max_seqlen_k": max_seqlen,
        }
        return self.layers[-1](queries, mixer_kwargs=last_kwargs)


class BertPooler(nn.Module):
    """``tanh(dense(first token))``; with ``pool=False`` the input already is the first tokens."""

    def __init__(self, config):
        super().__init__()
        self.dense = _linear_cls(config)(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states, pool=True):
        first_token_tensor = hidden_states[:, 0] if pool else hidden_states
        return self.activation(self.dense(first_token_tensor))


class BertPredictionHeadTransform(nn.Module):
    """``layer_norm(gelu(dense(x)))`` before the masked-LM decoder."""

    def __init__(self, config):
        super().__init__()
        self.fused_dropout_add_ln = getattr(config, "fused_dropout_add_ln", False)
        self.dense = _linear_cls(config)(config.hidden_size, config.hidden_size)
        self.transform_act_fn = nn.GELU(approximate=_gelu_approximate(config))
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.transform_act_fn(self.dense(hidden_states))
        if not self.fused_dropout_add_ln:
            return self.layer_norm(hidden_states)
        return _layer_norm_fn()(
            hidden_states, self.layer_norm.weight, self.layer_norm.bias, eps=self.layer_norm.eps
        )


class BertLMPredictionHead(nn.Module):
    """Masked-LM logits; ``decoder.weight`` is tied to the word embeddings by the model."""

    def __init__(self, config):
        super().__init__()
        linear_cls = _linear_cls(config)
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = linear_cls(config.hidden_size, config.vocab_size, bias=True)

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class BertPreTrainingHeads(nn.Module):
    """Masked-LM logits of the sequence output and next-sentence logits of the pooled output."""

    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


class BertPreTrainedModel(nn.Module):
    """Base class: keeps the ``BertConfig`` and loads Hugging Face checkpoints."""

    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        if not isinstance(config, BertConfig):
            name = self.__class__.__name__
            raise ValueError(
                f"Parameter config in `{name}(config)` should be an instance of class "
                f"`BertConfig`, got {type(config).__name__}. To load a pretrained model use "
                f"`{name}.from_pretrained(model_name, config)`"
            )
        self.config = config

    @classmethod
    def from_pretrained(cls, model_name, config, *inputs, **kwargs):
        """Build ``cls(config, *inputs, **kwargs)`` and load the Hugging Face BERT checkpoint
        ``model_name`` (hub name or local path) into it, remapped, non-strictly (a head the
        checkpoint lacks keeps its initialisation)."""
        from flash_attn.utils.pretrained import state_dict_from_pretrained

        model = cls(config, *inputs, **kwargs)
        state_dict = remap_state_dict(state_dict_from_pretrained(model_name), config)
        logger.info(model.load_state_dict(state_dict, strict=False))
        return model


def _pad_vocab_size(config):
    """Round ``config.vocab_size`` up to ``pad_vocab_size_multiple`` (in place, as upstream);
    the original size is kept as ``config.orig_vocab_size`` for ``inv_remap_state_dict``."""
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    remainder = config.vocab_size % multiple
    if remainder:
        if getattr(config, "orig_vocab_size", None) is None:
            config.orig_vocab_size = config.vocab_size
        config.vocab_size += multiple - remainder
    return multiple


class BertModel(BertPreTrainedModel):
    """Embeddings, embedding LayerNorm and dropout, encoder and (optionally) pooler."""

    def __init__(self, config: BertConfig, add_pooling_layer=True):
        super().__init__(config)
        self.pad_vocab_size_multiple = _pad_vocab_size(config)
        self.fused_dropout_add_ln = getattr(config, "fused_dropout_add_ln", False)
        _gelu_approximate(config)  # reject an unsupported activation before building anything
        self.embeddings = BertEmbeddings(
            config.hidden_size,
            config.vocab_size,
            config.max_position_embeddings,
            config.type_vocab_size,
            padding_idx=config.pad_token_id,
        )
        self.emb_drop = nn.Dropout(config.hidden_dropout_prob)
        self.emb_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))

    def _embed(self, input_ids, position_ids, token_type_ids):
        hidden_states = self.embeddings(
            input_ids, position_ids=position_ids, token_type_ids=token_type_ids
        )
        # BERT normalises the embeddings before their dropout.
        if not self.fused_dropout_add_ln:
            hidden_states = self.emb_ln(hidden_states)
        else:
            hidden_states = _layer_norm_fn()(
                hidden_states, self.emb_ln.weight, self.emb_ln.bias, eps=self.emb_ln.eps
            )
        return self.emb_drop(hidden_states)

    def forward(
        self,
        input_ids,
        position_ids=None,
        token_type_ids=None,
        attention_mask=None,
        masked_tokens_mask=None,
    ):
        """input_ids (and position_ids, token_type_ids): ``(batch, seqlen)``; attention_mask:
        ``(batch, seqlen)`` bool, True = real token.

        masked_tokens_mask: ``(batch, seqlen)`` bool (``last_layer_subset``): the last layer only
        computes these tokens and the first token of each sequence; ``last_hidden_state`` is then
        ``(n_masked, hidden)``, the masked tokens in row-major order (those that are padding are
        left out), and ``pooler_output`` is ``(batch, hidden)``.
        Returns ``BaseModelOutputWithPoolingAndCrossAttentions``."""
        _check_token_masks(input_ids, attention_mask, masked_tokens_mask)
        hidden_states = self._embed(input_ids, position_ids, token_type_ids)
        if masked_tokens_mask is None:
            sequence_output = self.encoder(hidden_states, key_padding_mask=attention_mask)
            pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
        else:
            sequence_output, pooled_output = self._forward_subset(
                hidden_states, attention_mask, masked_tokens_mask
            )
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output, pooler_output=pooled_output
        )

    def _forward_subset(self, hidden_states, attention_mask, masked_tokens_mask):
        """The encoder on the masked tokens plus each first token (for the pooler)."""
        first_col_mask = torch.zeros_like(masked_tokens_mask)
        first_col_mask[:, 0] = True
        subset_mask = masked_tokens_mask | first_col_mask
        if attention_mask is not None:
            subset_mask = subset_mask & attention_mask
        subset_output = self.encoder(
            hidden_states, key_padding_mask=attention_mask, subset_mask=subset_mask
        )
        pool_input = subset_output[first_col_mask[subset_mask]]
        sequence_output = subset_output[masked_tokens_mask[subset_mask]]
        pooled_output = self.pooler(pool_input, pool=False) if self.pooler is not None else None
        return sequence_output, pooled_output


def _check_token_masks(input_ids, attention_mask, masked_tokens_mask):
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
    for name, mask in (("attention_mask", attention_mask), ("masked_tokens_mask", masked_tokens_mask)):
        if mask is None:
            continue
        if mask.dtype != torch.bool:
            raise ValueError(f"{name} must be torch.bool (True = keep), got {mask.dtype}")
        if mask.shape != input_ids.shape:
            raise ValueError(
                f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(mask.shape)}"
            )


def _pretraining_loss_cls(config):
    if not getattr(config, "use_xentropy", False):
        return nn.CrossEntropyLoss
    from flash_attn.losses.cross_entropy import CrossEntropyLoss

    return partial(CrossEntropyLoss, inplace_backward=True)


class BertForPreTraining(BertPreTrainedModel):
    """``BertModel`` with the masked-LM and next-sentence heads (decoder tied to the word
    embeddings). ``config.dense_seq_output``: with labels, the masked-LM head only sees the
    masked tokens (``labels > 0``); ``config.last_layer_subset`` (needs ``dense_seq_output``):
    the last layer only computes those tokens too."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.dense_seq_output = getattr(config, "dense_seq_output", False)
        self.last_layer_subset = getattr(config, "last_layer_subset", False)
        if self.last_layer_subset and not self.dense_seq_output:
            raise ValueError("config.last_layer_subset=True requires config.dense_seq_output=True")
        loss_cls = _pretraining_loss_cls(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.mlm_loss = loss_cls(ignore_index=0)
        self.nsp_loss = loss_cls(ignore_index=-1)
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))
        self.tie_weights()

    def tie_weights(self):
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(
        self,
        input_ids,
        position_ids=None,
        token_type_ids=None,
        attention_mask=None,
        labels=None,
        next_sentence_label=None,
    ):
        """labels: ``(batch, seqlen)``, 0 where no token is predicted (padding included);
        next_sentence_label: ``(batch,)``, -1 to ignore. With both, ``loss`` is the masked-LM
        plus next-sentence loss. ``prediction_logits`` is ``(batch, seqlen, vocab)``, or
        ``(n_masked, vocab)`` with ``dense_seq_output`` and labels.
        Returns ``BertForPreTrainingOutput``."""
        use_subset = self.last_layer_subset and labels is not None
        outputs = self.bert(
            input_ids,
            position_ids=position_ids,
            token_type_ids=token_type_ids,
            attention_mask=attention_mask.bool() if attention_mask is not None else None,
            masked_tokens_mask=labels > 0 if use_subset else None,
        )
        sequence_output, pooled_output = outputs.last_hidden_state, outputs.pooler_output
        dense = self.dense_seq_output and labels is not None
        if dense:
            masked_token_idx = torch.nonzero(labels.flatten() > 0, as_tuple=False).flatten()
            if not self.last_layer_subset:
                sequence_output = index_first_axis(sequence_output.flatten(0, 1), masked_token_idx)
        prediction_scores, seq_relationship_score = self.cls(sequence_output, pooled_output)
        total_loss = None
        if labels is not None and next_sentence_label is not None:
            mlm_labels = labels.flatten()[masked_token_idx] if dense else labels.flatten()
            masked_lm_loss = self.mlm_loss(prediction_scores.flatten(0, -2), mlm_labels)
            next_sentence_loss = self.nsp_loss(
                seq_relationship_score.flatten(0, -2), next_sentence_label.flatten()
            )
            total_loss = masked_lm_loss.float() + next_sentence_loss.float()
        return BertForPreTrainingOutput(
            loss=total_loss,
            prediction_logits=prediction_scores,
            seq_relationship_logits=seq_relationship_score,
        )


# Hugging Face name pattern -> this package's name, applied in order (after the LayerNorm
# gamma/beta -> weight/bias and encoder.layer -> encoder.layers renames).
_HF_TO_FLASH = (
    (r"^bert\.embeddings\.LayerNorm\.", "bert.emb_ln."),
    (r"^bert\.encoder\.layers\.(\d+)\.attention\.output\.LayerNorm\.", r"bert.encoder.layers.\1.norm1."),
    (r"^bert\.encoder\.layers\.(\d+)\.output\.LayerNorm\.", r"bert.encoder.layers.\1.norm2."),
    (r"^cls\.predictions\.transform\.LayerNorm\.", "cls.predictions.transform.layer_norm."),
    (r"^bert\.encoder\.layers\.(\d+)\.intermediate\.dense\.", r"bert.encoder.layers.\1.mlp.fc1."),
    (r"^bert\.encoder\.layers\.(\d+)\.output\.dense\.", r"bert.encoder.layers.\1.mlp.fc2."),
    (r"^bert\.encoder\.layers\.(\d+)\.attention\.output\.dense\.", r"bert.encoder.layers.\1.mixer.out_proj."),
)

# The inverse renames, applied to this package's names (before encoder.layers -> encoder.layer).
_FLASH_TO_HF = (
    (r"^bert\.emb_ln\.", "bert.embeddings.LayerNorm."),
    (r"^bert\.encoder\.layers\.(\d+)\.norm1\.", r"bert.encoder.layers.\1.attention.output.LayerNorm."),
    (r"^bert\.encoder\.layers\.(\d+)\.norm2\.", r"bert.encoder.layers.\1.output.LayerNorm."),
    (r"^cls\.predictions\.transform\.layer_norm\.", "cls.predictions.transform.LayerNorm."),
    (r"^bert\.encoder\.layers\.(\d+)\.mlp\.fc1\.", r"bert.encoder.layers.\1.intermediate.dense."),
    (r"^bert\.encoder\.layers\.(\d+)\.mlp\.fc2\.", r"bert.encoder.layers.\1.output.dense."),
    (r"^bert\.encoder\.layers\.(\d+)\.mixer\.out_proj\.", r"bert.encoder.layers.\1.attention.output.dense."),
)


def _rename(key, rules):
    for pattern, replacement in rules:
        key, count = re.subn(pattern, replacement, key)
        if count:
            return key
    return key


def _hf_key_to_flash(key):
    key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
    key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
    key = re.sub(r"^bert\.encoder\.layer\.", "bert.encoder.layers.", key)
    return _rename(key, _HF_TO_FLASH)


def _is_subset_layer(config, layer):
    return getattr(config, "last_layer_subset", False) and layer == config.num_hidden_layers - 1


def _merge_qkv(state_dict, config):
    """Hugging Face's query/key/value -> ``Wqkv`` (``Wq`` and ``Wkv`` for the cross-attention
    last layer of ``last_layer_subset``)."""
    for layer in range(config.num_hidden_layers):
        prefix = f"bert.encoder.layers.{layer}."
        for kind in ("weight", "bias"):
            q, k, v = (state_dict.pop(f"{prefix}attention.self.{n}.{kind}") for n in ("query", "key", "value"))
            if _is_subset_layer(config, layer):
                state_dict[f"{prefix}mixer.Wq.{kind}"] = q
                state_dict[f"{prefix}mixer.Wkv.{kind}"] = torch.cat([k, v], dim=0)
            else:
                state_dict[f"{prefix}mixer.Wqkv.{kind}"] = torch.cat([q, k, v], dim=0)


def _pad_vocab_rows(state_dict, vocab_size):
    """Pad the word embeddings and decoder to ``vocab_size`` rows; the padded tokens get a
    decoder bias of -100 so that they are never predicted."""
    for key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"):
        weight = state_dict[key]
        state_dict[key] = F.pad(weight, (0, 0, 0, vocab_size - weight.shape[0]))
    bias = state_dict["cls.predictions.decoder.bias"]
    state_dict["cls.predictions.decoder.bias"] = F.pad(bias, (0, vocab_size - bias.shape[0]), value=-100.0)


def remap_state_dict(state_dict, config: PretrainedConfig):
    """A Hugging Face ``BertForPreTraining`` state dict in this package's layout (a new dict).

    ``cls.predictions.bias`` becomes ``cls.predictions.decoder.bias`` (Hugging Face ties the
    two; a checkpoint may hold either or both). With ``pad_vocab_size_multiple`` the vocabulary
    rows are padded to ``config.vocab_size`` (build the model first: it rounds that up)."""
    remapped = OrderedDict()
    for key, value in state_dict.items():
        if key == "cls.predictions.bias":
            key = "cls.predictions.decoder.bias"
        remapped[_hf_key_to_flash(key)] = value
    _merge_qkv(remapped, config)
    if getattr(config, "pad_vocab_size_multiple", 1) > 1:
        _pad_vocab_rows(remapped, config.vocab_size)
    return remapped


def _split_qkv(state_dict, config):
    """``Wqkv`` (or ``Wq`` + ``Wkv``) -> Hugging Face's query/key/value."""
    for layer in range(config.num_hidden_layers):
        prefix = f"bert.encoder.layers.{layer}."
        for kind in ("weight", "bias"):
            if _is_subset_layer(config, layer):
                q = state_dict.pop(f"{prefix}mixer.Wq.{kind}")
                k, v = state_dict.pop(f"{prefix}mixer.Wkv.{kind}").chunk(2, dim=0)
            else:
                q, k, v = state_dict.pop(f"{prefix}mixer.Wqkv.{kind}").chunk(3, dim=0)
            for name, tensor in (("query", q), ("key", k), ("value", v)):
                state_dict[f"{prefix}attention.self.{name}.{kind}"] = tensor


def _unpad_vocab_rows(state_dict, config):
    orig_vocab_size = getattr(config, "orig_vocab_size", None)
    if orig_vocab_size is None:
        raise ValueError(
            "inv_remap_state_dict: config.pad_vocab_size_multiple > 1 needs "
            "config.orig_vocab_size (the vocabulary size before padding)"
        )
    for key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight",
                "cls.predictions.decoder.bias"):
        state_dict[key] = state_dict[key][:orig_vocab_size]


def inv_remap_state_dict(state_dict, config: PretrainedConfig):
    """The inverse of ``remap_state_dict``: this package's ``BertForPreTraining`` state dict in
    Hugging Face's layout (a new dict; the decoder bias as ``cls.predictions.bias``, and
    LayerNorm parameters as ``weight`` / ``bias``)."""
    state_dict = OrderedDict(state_dict)
    if getattr(config, "pad_vocab_size_multiple", 1) > 1:
        _unpad_vocab_rows(state_dict, config)
    _split_qkv(state_dict, config)
    restored = OrderedDict()
    for key, value in state_dict.items():
        key = _rename(key, _FLASH_TO_HF)
        key = re.sub(r"^bert\.encoder\.layers\.", "bert.encoder.layer.", key)
        if key == "cls.predictions.decoder.bias":
            key = "cls.predictions.bias"
        restored[key] = value
    return restored
