"""flash_attn.models.vit against Hugging Face transformers' ViTForImageClassification (the
oracle). Its parameters have another layout, so the test maps them into timm's names (what
``VisionTransformer.load_state_dict`` takes: a Conv2d patch embedding, ``attn.qkv`` packed q/k/v,
``attn.proj``), which ours loads strictly. Both use class-token pooling, pre-norm blocks and
LayerNorm eps 1e-6. Checked: logits and all-token features on random 32x32 images (patch 8,
2 blocks, width 64) in float32, with and without ``use_flash_attn`` and
``fused_dropout_add_ln``; ``no_embed_class``; gradients; the timm init; the named
constructors; clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from flash_attn.models.vit import (  # noqa: E402
    VisionTransformer,
    vit_base_patch16_224,
    vit_large_patch16_224,
)

IMG, PATCH, WIDTH, DEPTH, HEADS, CLASSES, BATCH = 32, 8, 64, 2, 4, 10, 3
ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(4321)
    config = transformers.ViTConfig(
        image_size=IMG, patch_size=PATCH, num_channels=3, hidden_size=WIDTH,
        num_hidden_layers=DEPTH, num_attention_heads=HEADS, intermediate_size=4 * WIDTH,
        hidden_act="gelu", layer_norm_eps=1e-6, qkv_bias=True, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )
    model = transformers.ViTForImageClassification(config).eval()
    with torch.no_grad():  # no zero / unit parameters: every mapping mistake shows
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.05))
    return model


def _qkv(attention, kind):
    return torch.cat([getattr(attention, f"{n}_proj").__getattr__(kind) for n in "qkv"])


def hf_to_timm(hf_model):
    """Hugging Face ViT parameters under timm's names (the test's own mapping)."""
    vit = hf_model.vit
    state = {
        "cls_token": vit.embeddings.cls_token,
        "pos_embed": vit.embeddings.position_embeddings,
        "patch_embed.proj.weight": vit.embeddings.patch_embeddings.projection.weight,
        "patch_embed.proj.bias": vit.embeddings.patch_embeddings.projection.bias,
        "norm.weight": vit.layernorm.weight,
        "norm.bias": vit.layernorm.bias,
        "head.weight": hf_model.classifier.weight,
        "head.bias": hf_model.classifier.bias,
    }
    for i, layer in enumerate(vit.layers):
        for kind in ("weight", "bias"):
            state[f"blocks.{i}.attn.qkv.{kind}"] = _qkv(layer.attention, kind)
            state[f"blocks.{i}.attn.proj.{kind}"] = getattr(layer.attention.o_proj, kind)
            state[f"blocks.{i}.norm1.{kind}"] = getattr(layer.layernorm_before, kind)
            state[f"blocks.{i}.norm2.{kind}"] = getattr(layer.layernorm_after, kind)
            state[f"blocks.{i}.mlp.fc1.{kind}"] = getattr(layer.mlp.fc1, kind)
            state[f"blocks.{i}.mlp.fc2.{kind}"] = getattr(layer.mlp.fc2, kind)
    return {k: v.detach().clone() for k, v in state.items()}


def ours_from(hf_model, device, **options):
    model = VisionTransformer(img_size=IMG, patch_size=PATCH, num_classes=CLASSES, embed_dim=WIDTH,
                              depth=DEPTH, num_heads=HEADS, **options)
    model.load_state_dict(hf_to_timm(hf_model), strict=True)
    return model.to(device).eval()


def images():
    return torch.randn(BATCH, 3, IMG, IMG, generator=torch.Generator().manual_seed(9))


def close(ours, ref, atol=ATOL, rtol=RTOL, msg=None):
    torch.testing.assert_close(ours.detach().cpu(), ref.detach().cpu(), atol=atol, rtol=rtol, msg=msg)


OPTIONS = [
    dict(),
    dict(use_flash_attn=True),
    dict(use_flash_attn=True, fused_dropout_add_ln=True),
    dict(use_flash_attn=True, fused_bias_fc=True),  # upstream's FusedDense in the patch embedding
]
OPTION_IDS = ["torch_attn", "flash_attn", "fused_ln", "fused_bias_fc"]


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_logits_and_features_match_transformers(hf_model, device, options):
    model = ours_from(hf_model, device, **options)
    x = images()
    with torch.no_grad():
        ref = hf_model(x, output_hidden_states=True)
        ref_features = hf_model.vit(x).last_hidden_state
        logits = model(x.to(device))
        features = model.forward_features(x.to(device), all_tokens=True)
        cls_only = model.forward_features(x.to(device), all_tokens=False)
    close(logits, ref.logits)
    close(features, ref_features)
    assert cls_only.shape == (BATCH, 1, WIDTH)
    close(cls_only[:, 0], ref_features[:, 0])
    close(model.forward_head(features, pre_logits=True), ref_features[:, 0])


def test_no_embed_class_matches_transformers(hf_model, device):
    """no_embed_class: position embeddings for the patches only, the class token unembedded;
    equal to transformers' model when our class token holds its class token plus its first
    position embedding."""
    state = hf_to_timm(hf_model)
    state["cls_token"] = state["cls_token"] + state["pos_embed"][:, :1]
    state["pos_embed"] = state["pos_embed"][:, 1:]
    model = VisionTransformer(img_size=IMG, patch_size=PATCH, num_classes=CLASSES, embed_dim=WIDTH,
                              depth=DEPTH, num_heads=HEADS, no_embed_class=True)
    assert model.pos_embed.shape == (1, (IMG // PATCH) ** 2, WIDTH)
    model.load_state_dict(state, strict=True)
    model = model.to(device).eval()
    with torch.no_grad():
        close(model(images().to(device)), hf_model(images()).logits)


def test_gradients_match_transformers(hf_model, device):
    model = ours_from(hf_model, device, use_flash_attn=True)
    hf = copy.deepcopy(hf_model)
    x = images()
    weights = torch.randn(BATCH, CLASSES, generator=torch.Generator().manual_seed(2))
    (hf(x).logits * weights).sum().backward()
    (model(x.to(device)) * weights.to(device)).sum().backward()
    ours = dict(model.named_parameters())
    last = hf.vit.layers[DEPTH - 1].attention
    pairs = {
        "patch_embed.proj.weight": hf.vit.embeddings.patch_embeddings.projection.weight.grad.flatten(1),
        "pos_embed": hf.vit.embeddings.position_embeddings.grad,
        "cls_token": hf.vit.embeddings.cls_token.grad,
        "blocks.0.mixer.Wqkv.weight": torch.cat([getattr(hf.vit.layers[0].attention, f"{n}_proj").weight.grad
                                                 for n in "qkv"]),
        f"blocks.{DEPTH - 1}.mixer.Wq.weight": last.q_proj.weight.grad,
        f"blocks.{DEPTH - 1}.mixer.Wkv.bias": torch.cat([last.k_proj.bias.grad, last.v_proj.bias.grad]),
        "blocks.0.norm2.weight": hf.vit.layers[0].layernorm_after.weight.grad,
        "norm.weight": hf.vit.layernorm.weight.grad,
        "head.weight": hf.classifier.weight.grad,
    }
    for name, ref in pairs.items():
        close(ours[name].grad, ref, atol=1e-4, rtol=1e-3, msg=name)


def test_drop_path_and_dropout_only_in_training(hf_model, device):
    """Stochastic depth / dropout settings leave evaluation unchanged and act in training."""
    model = ours_from(hf_model, device, drop_rate=0.2, drop_path_rate=0.3)
    x = images().to(device)
    with torch.no_grad():
        ref = hf_model(images()).logits
        close(model(x), ref)
        model.train()
        assert (model(x).cpu() - ref).abs().max().item() > 1e-3
    rates = [block.drop_path2.p for block in model.blocks]
    assert rates == pytest.approx([0.0, 0.3]) and model.drop_path.p == pytest.approx(0.3)


def test_init_weights_is_timms():
    model = VisionTransformer(img_size=IMG, patch_size=PATCH, num_classes=CLASSES, embed_dim=WIDTH,
                              depth=DEPTH, num_heads=HEADS)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    # patch embed; qkv, out, fc1, fc2 per block (the last block's q and kv apart); head
    assert len(linears) == 1 + DEPTH * 4 + 1 + 1
    for m in linears:
        assert torch.count_nonzero(m.bias) == 0
        assert m.weight.abs().max().item() <= 2.0  # truncated at +-2 (timm's absolute bounds)
        assert 0.015 < m.weight.std().item() < 0.025
    assert model.cls_token.abs().max().item() < 1e-4
    assert 0.015 < model.pos_embed.std().item() < 0.025
    assert model.no_weight_decay() == {"pos_embed", "cls_token"}


def test_named_constructors():
    base = vit_base_patch16_224()
    assert sum(p.numel() for p in base.parameters()) == 86_567_656  # timm's ViT-B/16
    with torch.device("meta"):
        large = vit_large_patch16_224()
    assert sum(p.numel() for p in large.parameters()) == 304_326_632  # timm's ViT-L/16
    assert (large.embed_dim, len(large.blocks), large.blocks[0].mixer.num_heads) == (1024, 24, 16)
    small = vit_base_patch16_224(img_size=32, num_classes=3)
    assert small.patch_embed.num_patches == 4 and small.head.out_features == 3


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(global_pool="avg"), ValueError, "global_pool"),
        (dict(class_token=False), ValueError, "class_token"),
        (dict(init_values=1e-5), ValueError, "LayerScale"),
        (dict(fc_norm=True), ValueError, "fc_norm"),
        (dict(pre_norm=True), ValueError, "pre_norm"),
        (dict(weight_init="jax"), ValueError, "weight_init"),
        (dict(depth=0), ValueError, "depth"),
        (dict(num_heads=5), ValueError, "divisible"),
    ],
)
def test_bad_config_raises(options, error, match):
    kwargs = dict(img_size=IMG, patch_size=PATCH, num_classes=CLASSES, embed_dim=WIDTH, depth=DEPTH,
                  num_heads=HEADS)
    kwargs.update(options)
    with pytest.raises(error, match=match):
        VisionTransformer(**kwargs)


def test_bad_input_raises(hf_model):
    model = ours_from(hf_model, "cpu")
    with pytest.raises(AssertionError, match="height"):
        model(torch.randn(1, 3, 48, IMG))
    with pytest.raises(AssertionError, match="width"):
        model(torch.randn(1, 3, IMG, 24))
    with pytest.raises(ValueError, match="pretrained"):
        vit_base_patch16_224(pretrained=True)
    with pytest.raises(RuntimeError, match="size mismatch"):
        bad = hf_to_timm(hf_model)
        bad["pos_embed"] = bad["pos_embed"][:, :-1]
        model.load_state_dict(bad)


def test_fused_mlp_is_upstreams_fused_dense_mlp(hf_model, device):
    """``fused_mlp``: every block's MLP is ops.fused_dense.FusedMLP (tanh GELU, as upstream's, so
    not transformers' exact GELU): the model equals the same model with each MLP recomputed by hand."""
    from flash_attn.ops.fused_dense import FusedMLP

    model = ours_from(hf_model, device, fused_mlp=True)
    assert all(isinstance(block.mlp, FusedMLP) for block in model.blocks)
    x = torch.randn(2, 5, WIDTH, generator=torch.Generator().manual_seed(3)).to(device)
    mlp = model.blocks[0].mlp
    close(mlp(x), mlp.fc2(torch.nn.functional.gelu(mlp.fc1(x), approximate="tanh")))
    with torch.no_grad():
        assert model(images().to(device)).shape == (BATCH, CLASSES)
