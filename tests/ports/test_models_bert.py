"""flash_attn.models.bert against Hugging Face transformers' BertForPreTraining (the oracle): a
tiny random model in float32 is remapped (``remap_state_dict``) into ours, loaded strictly, and
both are run on the same tokens. Checked: sequence and pooled outputs, masked-LM and
next-sentence logits, with padded rows (the unpadded varlen path with ``use_flash_attn``, the
key-padding-mask path without) and without; gradients; the loss; ``last_layer_subset`` /
``dense_seq_output`` at the masked tokens; ``inv_remap_state_dict`` back into transformers;
vocabulary padding; ``from_pretrained`` (with a stand-in loader); clear errors for bad input.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from flash_attn.models.bert import (  # noqa: E402
    BertForPreTraining,
    BertModel,
    inv_remap_state_dict,
    remap_state_dict,
)

VOCAB, HIDDEN, LAYERS, HEADS, INTER, MAX_POS = 100, 64, 2, 4, 128, 32
BATCH, SEQLEN = 3, 12
LENGTHS = (12, 7, 3)  # row 0 unpadded, rows 1 and 2 padded
ATOL, RTOL = 2e-5, 1e-4


def hf_config(**extra):
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=INTER, max_position_embeddings=MAX_POS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager", **extra,
    )


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(1234)
    model = transformers.BertForPreTraining(hf_config()).eval()
    # Non-trivial LayerNorm and bias values, so that a mixed-up parameter cannot go unnoticed,
    # and weights 5x BERT's init, so that attention is far from uniform and GELU far from linear.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif p.ndim == 2 and "embeddings" not in name:
                p.mul_(5.0)
    return model


def ours_from(hf_model, device, **options):
    config = hf_config(**options)
    model = BertForPreTraining(config)
    model.load_state_dict(remap_state_dict(hf_model.state_dict(), config), strict=True)
    return model.to(device).eval()


def inputs(padded: bool):
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQLEN), generator=g)
    token_type_ids = torch.randint(0, 2, (BATCH, SEQLEN), generator=g)
    lengths = LENGTHS if padded else (SEQLEN,) * BATCH
    attention_mask = torch.arange(SEQLEN)[None, :] < torch.tensor(lengths)[:, None]
    return input_ids, token_type_ids, attention_mask


def hf_outputs(hf_model, input_ids, token_type_ids, attention_mask):
    out = hf_model(input_ids, attention_mask=attention_mask.long(), token_type_ids=token_type_ids,
                   output_hidden_states=True)
    pooled = hf_model.bert(input_ids, attention_mask=attention_mask.long(),
                           token_type_ids=token_type_ids).pooler_output
    return out.hidden_states[-1], pooled, out.prediction_logits, out.seq_relationship_logits


def close(ours, ref):
    torch.testing.assert_close(ours.detach().cpu(), ref.detach().cpu(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch_attn", "flash_attn"])
def test_outputs_match_transformers(hf_model, device, use_flash_attn, padded):
    model = ours_from(hf_model, device, use_flash_attn=use_flash_attn)
    input_ids, token_type_ids, mask = inputs(padded)
    ref_seq, ref_pooled, ref_logits, ref_nsp = hf_outputs(hf_model, input_ids, token_type_ids, mask)
    args = (input_ids.to(device),)
    kwargs = dict(token_type_ids=token_type_ids.to(device), attention_mask=mask.to(device))
    with torch.no_grad():
        base = model.bert(*args, **kwargs)
        out = model(*args, **kwargs)
    # Padded positions carry no meaning (zeros in the unpadded path): compare real tokens only.
    close(base.last_hidden_state[mask.to(device)], ref_seq[mask])
    close(base.pooler_output, ref_pooled)
    close(out.prediction_logits[mask.to(device)], ref_logits[mask])
    close(out.seq_relationship_logits, ref_nsp)
    if padded and use_flash_attn:
        assert base.last_hidden_state[~mask.to(device)].abs().max().item() == 0.0


@pytest.mark.parametrize("fused", [dict(fused_dropout_add_ln=True), dict(fused_bias_fc=True)],
                         ids=["fused_dropout_add_ln", "fused_bias_fc"])
def test_fused_options_match_transformers(hf_model, device, fused):
    model = ours_from(hf_model, device, use_flash_attn=True, **fused)
    input_ids, token_type_ids, mask = inputs(padded=True)
    _, _, ref_logits, ref_nsp = hf_outputs(hf_model, input_ids, token_type_ids, mask)
    with torch.no_grad():
        out = model(input_ids.to(device), token_type_ids=token_type_ids.to(device),
                    attention_mask=mask.to(device))
    close(out.prediction_logits[mask.to(device)], ref_logits[mask])
    close(out.seq_relationship_logits, ref_nsp)


def _hf_qkv_grad(hf_model, layer, kind):
    attn = hf_model.bert.encoder.layer[layer].attention.self
    return torch.cat([getattr(attn, n).__getattr__(kind).grad for n in ("query", "key", "value")])


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch_attn", "flash_attn"])
def test_gradients_match_transformers(hf_model, device, use_flash_attn):
    model = ours_from(hf_model, device, use_flash_attn=use_flash_attn)
    hf = copy.deepcopy(hf_model)
    input_ids, token_type_ids, mask = inputs(padded=True)
    g = torch.Generator().manual_seed(3)
    w_logits = torch.randn(BATCH, SEQLEN, VOCAB, generator=g) * mask[..., None]
    w_nsp = torch.randn(BATCH, 2, generator=g)
    _, _, ref_logits, ref_nsp = hf_outputs(hf, input_ids, token_type_ids, mask)
    ((ref_logits * w_logits).sum() + (ref_nsp * w_nsp).sum()).backward()
    out = model(input_ids.to(device), token_type_ids=token_type_ids.to(device),
                attention_mask=mask.to(device))
    logits = torch.where(mask.to(device)[..., None], out.prediction_logits, 0.0)
    ((logits * w_logits.to(device)).sum() + (out.seq_relationship_logits * w_nsp.to(device)).sum()).backward()
    ours = dict(model.named_parameters())
    pairs = {
        "bert.embeddings.word_embeddings.weight": hf.bert.embeddings.word_embeddings.weight.grad,
        "bert.encoder.layers.0.mixer.Wqkv.weight": _hf_qkv_grad(hf, 0, "weight"),
        "bert.encoder.layers.1.mixer.Wqkv.bias": _hf_qkv_grad(hf, 1, "bias"),
        "bert.encoder.layers.1.mlp.fc1.weight": hf.bert.encoder.layer[1].intermediate.dense.weight.grad,
        "bert.emb_ln.weight": hf.bert.embeddings.LayerNorm.weight.grad,
        "bert.pooler.dense.weight": hf.bert.pooler.dense.weight.grad,
        "cls.predictions.decoder.bias": hf.cls.predictions.bias.grad,
    }
    for name, ref in pairs.items():
        torch.testing.assert_close(ours[name].grad.cpu(), ref, atol=1e-4, rtol=1e-3, msg=name)


def _labels(mask):
    """Masked-LM labels at a few real tokens of every row (0 = not predicted), and NSP labels."""
    labels = torch.zeros(BATCH, SEQLEN, dtype=torch.long)
    for row, positions in enumerate(((1, 4, 11), (2, 6), (1,))):
        for position in positions:
            assert mask[row, position]
            labels[row, position] = 7 + 5 * row + position
    return labels, torch.tensor([0, 1, 1])


@pytest.mark.parametrize(
    "options",
    [
        dict(dense_seq_output=True, last_layer_subset=True, use_flash_attn=True),
        dict(dense_seq_output=True, last_layer_subset=True, use_flash_attn=False),
        dict(dense_seq_output=True, use_flash_attn=True),
        dict(use_flash_attn=True, use_xentropy=True),
    ],
    ids=["subset_flash", "subset_torch", "dense_flash", "xentropy"],
)
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_masked_tokens_and_loss_match_transformers(hf_model, device, options, padded):
    """Logits at the masked tokens (row-major), NSP logits and the total loss equal the full
    transformers computation at those tokens."""
    model = ours_from(hf_model, device, **options)
    input_ids, token_type_ids, mask = inputs(padded)
    labels, nsp_labels = _labels(mask)
    _, _, ref_logits, ref_nsp = hf_outputs(hf_model, input_ids, token_type_ids, mask)
    picked = labels > 0
    ref_loss = F.cross_entropy(ref_logits[picked], labels[picked]) + F.cross_entropy(ref_nsp, nsp_labels)
    with torch.no_grad():
        out = model(input_ids.to(device), token_type_ids=token_type_ids.to(device),
                    attention_mask=mask.to(device), labels=labels.to(device),
                    next_sentence_label=nsp_labels.to(device))
    logits = out.prediction_logits
    if not options.get("dense_seq_output"):
        logits = logits[picked.to(device)]
    assert logits.shape == (int(picked.sum()), VOCAB)
    close(logits, ref_logits[picked])
    close(out.seq_relationship_logits, ref_nsp)
    close(out.loss, ref_loss)


def test_last_layer_subset_bert_model(hf_model, device):
    """BertModel with masked_tokens_mask: the last hidden states of exactly those tokens and the
    pooled output of the first tokens."""
    config = hf_config(last_layer_subset=True, use_flash_attn=True)
    model = BertModel(config)
    state = remap_state_dict(hf_model.state_dict(), config)
    bert_state = {k[len("bert."):]: v for k, v in state.items() if k.startswith("bert.")}
    model.load_state_dict(bert_state, strict=True)
    model = model.to(device).eval()
    input_ids, token_type_ids, mask = inputs(padded=True)
    labels, _ = _labels(mask)
    ref_seq, ref_pooled, _, _ = hf_outputs(hf_model, input_ids, token_type_ids, mask)
    with torch.no_grad():
        out = model(input_ids.to(device), token_type_ids=token_type_ids.to(device),
                    attention_mask=mask.to(device), masked_tokens_mask=(labels > 0).to(device))
    close(out.last_hidden_state, ref_seq[labels > 0])
    close(out.pooler_output, ref_pooled)


@pytest.mark.parametrize("last_layer_subset", [False, True], ids=["qkv", "subset_q_kv"])
def test_inv_remap_round_trip_into_transformers(hf_model, last_layer_subset):
    config = hf_config(last_layer_subset=last_layer_subset, dense_seq_output=True)
    original = hf_model.state_dict()
    remapped = remap_state_dict(original, config)
    model = BertForPreTraining(config)
    model.load_state_dict(remapped, strict=True)
    recovered = inv_remap_state_dict(model.state_dict(), config)
    # Hugging Face ties cls.predictions.decoder.bias to cls.predictions.bias; the recovered
    # dict names it once, as cls.predictions.bias.
    assert set(recovered) == set(original) - {"cls.predictions.decoder.bias"}
    for key, value in recovered.items():
        torch.testing.assert_close(value, original[key], atol=0, rtol=0, msg=key)
    fresh = transformers.BertForPreTraining(hf_config()).eval()
    result = fresh.load_state_dict(recovered, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"cls.predictions.decoder.bias"}
    input_ids, token_type_ids, mask = inputs(padded=True)
    close(hf_outputs(fresh, input_ids, token_type_ids, mask)[2],
          hf_outputs(hf_model, input_ids, token_type_ids, mask)[2])


def test_padded_vocabulary(hf_model, device):
    """pad_vocab_size_multiple: 100 -> 104 rows; the real tokens' logits are unchanged, the
    padded ones get a -100 bias, and inv_remap_state_dict cuts the rows back."""
    config = hf_config(pad_vocab_size_multiple=8)
    model = BertForPreTraining(config)
    assert config.vocab_size == 104 and config.orig_vocab_size == VOCAB
    model.load_state_dict(remap_state_dict(hf_model.state_dict(), config), strict=True)
    model = model.to(device).eval()
    input_ids, token_type_ids, mask = inputs(padded=True)
    _, _, ref_logits, _ = hf_outputs(hf_model, input_ids, token_type_ids, mask)
    with torch.no_grad():
        logits = model(input_ids.to(device), token_type_ids=token_type_ids.to(device),
                       attention_mask=mask.to(device)).prediction_logits
    assert logits.shape[-1] == 104
    close(logits[..., :VOCAB][mask.to(device)], ref_logits[mask])
    assert (logits[..., VOCAB:] < -50).all()
    recovered = inv_remap_state_dict(model.cpu().state_dict(), config)
    for key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias"):
        torch.testing.assert_close(recovered[key], hf_model.state_dict()[key], atol=0, rtol=0)


def test_from_pretrained_remaps_the_loaded_checkpoint(hf_model, monkeypatch):
    """from_pretrained reads the checkpoint through flash_attn.utils.pretrained (replaced here by
    a stand-in: no network) and loads it remapped."""
    requested = []

    def fake_loader(model_name, *args, **kwargs):
        requested.append(model_name)
        return hf_model.state_dict()

    fake = types.ModuleType("flash_attn.utils.pretrained")
    fake.state_dict_from_pretrained = fake_loader
    monkeypatch.setitem(sys.modules, "flash_attn.utils.pretrained", fake)
    model = BertForPreTraining.from_pretrained("some/bert", hf_config()).eval()
    assert requested == ["some/bert"]
    input_ids, token_type_ids, mask = inputs(padded=True)
    _, _, ref_logits, _ = hf_outputs(hf_model, input_ids, token_type_ids, mask)
    with torch.no_grad():
        logits = model(input_ids, token_type_ids=token_type_ids, attention_mask=mask).prediction_logits
    close(logits[mask], ref_logits[mask])


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(fused_mlp=True), ValueError, "tanh GELU"),  # upstream's FusedMLP: tanh GELUs only
        (dict(hidden_act="relu"), ValueError, "hidden_act"),
        (dict(last_layer_subset=True), ValueError, "dense_seq_output"),
    ],
)
def test_bad_config_raises(options, error, match):
    with pytest.raises(error, match=match):
        BertForPreTraining(hf_config(**options))


def test_bad_input_raises():
    with pytest.raises(ValueError, match="BertConfig"):
        BertModel(transformers.GPT2Config())
    model = BertModel(hf_config()).eval()
    input_ids, _, mask = inputs(padded=True)
    with pytest.raises(ValueError, match="torch.bool"):
        model(input_ids, attention_mask=mask.long())
    with pytest.raises(ValueError, match="shape"):
        model(input_ids, attention_mask=mask[:, :5])
    with pytest.raises(ValueError, match="input_ids"):
        model(input_ids[0])


def test_fused_mlp_builds_upstreams_fused_mlp():
    from flash_attn.ops.fused_dense import FusedMLP

    model = BertForPreTraining(hf_config(hidden_act="gelu_new", fused_mlp=True, mlp_checkpoint_lvl=[0, 2, 1][:LAYERS]))
    mlps = [layer.mlp for layer in model.bert.encoder.layers]
    assert all(isinstance(m, FusedMLP) for m in mlps)
    assert [m.checkpoint_lvl for m in mlps] == [0, 2, 1][:LAYERS]
