"""Vision Transformer built from this package's modules, with upstream flash-attn's
``flash_attn.models.vit`` names, signatures and state-dict layout (timm's ``VisionTransformer``
names, with ``mixer.Wqkv`` / ``mixer.out_proj`` for ``attn.qkv`` / ``attn.proj``).

Blocks are pre-norm ``Block``s that hand the residual stream to the next block (so that dropout,
add and LayerNorm can run fused, ``fused_dropout_add_ln``); the model is the same as timm's. As
upstream, only class-token pooling is supported, and ``forward`` computes the last block for the
class token alone (cross-attention from it to the whole sequence).

Upstream imports timm (weight init helpers) and torchvision (stochastic depth); this module
needs neither. ``fused_bias_fc`` and ``fused_mlp`` use upstream's fused dense API,
:mod:`flash_attn.ops.fused_dense` (``fused_mlp``: a tanh GELU, as upstream's).
"""

import re
from collections import OrderedDict
from functools import partial

import torch
import torch.nn as nn
from torch.nn.init import trunc_normal_

from flash_attn.layers.patch_embed import PatchEmbed
from flash_attn.modules.block import Block, StochasticDepth
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import Mlp
from flash_attn.ops.fused_dense import FusedMLP
from flash_attn.ops.triton.layer_norm import layer_norm_fn  # noqa: F401  (upstream's name here)



def create_mixer_cls(
    num_heads, qkv_bias, attn_drop, use_flash_attn, fused_bias_fc, cross_attn=False
):
    """Bidirectional ``MHA`` (cross-attention for the class-token-only last block)."""
    return partial(
        MHA,
        num_heads=num_heads,
        cross_attn=cross_attn,
        qkv_proj_bias=qkv_bias,
        dropout=attn_drop,
        fused_bias_fc=fused_bias_fc,
        use_flash_attn=use_flash_attn,
    )


def create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp):
    """``Mlp`` with ``embed_dim * mlp_ratio`` hidden features; ``act_layer`` is a module class.
    ``fused_mlp``: upstream's ``FusedMLP`` (tanh GELU, whatever ``act_layer``, as upstream's)."""
    if fused_mlp:
        return partial(FusedMLP, hidden_features=int(embed_dim * mlp_ratio))
    return partial(Mlp, hidden_features=int(embed_dim * mlp_ratio), activation=act_layer())


def create_block(
    embed_dim,
    num_heads,
    mlp_ratio,
    qkv_bias,
    drop_rate,
    attn_drop_rate,
    drop_path1,
    drop_path2,
    norm_layer,
    act_layer,
    use_flash_attn,
    fused_bias_fc,
    fused_mlp,
    fused_dropout_add_ln,
    layer_idx=None,
    n_layer=None,
    last_layer_subset=False,
):
    """Pre-norm block ``layer_idx`` of ``n_layer``. ``drop_path1`` is the stochastic depth of the
    previous block's MLP output (added to the residual here), ``drop_path2`` this block's
    attention output's. The residual stream is kept in float32."""
    cross_attn = last_layer_subset and layer_idx == n_layer - 1
    mixer_cls = create_mixer_cls(
        num_heads, qkv_bias, attn_drop_rate, use_flash_attn, fused_bias_fc, cross_attn=cross_attn
    )
    return Block(
        embed_dim,
        mixer_cls,
        create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp),
        norm_cls=norm_layer,
        prenorm=True,
        resid_dropout1=drop_rate,
        resid_dropout2=drop_rate,
        drop_path1=drop_path1,
        drop_path2=drop_path2,
        fused_dropout_add_ln=fused_dropout_add_ln,
        residual_in_fp32=True,
    )


def _check_supported(global_pool, class_token, init_values, weight_init, fc_norm, pre_norm):
    """Upstream's restrictions: class-token pooling, no layer scale, no extra norms."""
    unsupported = (
        ("global_pool", global_pool, global_pool != "token", "only 'token' (class-token pooling) is supported"),
        ("class_token", class_token, not class_token, "a class token is required (global_pool='token')"),
        ("init_values", init_values, init_values is not None, "LayerScale is not supported"),
        ("weight_init", weight_init, weight_init != "", "only the default ('') init is supported"),
        ("fc_norm", fc_norm, fc_norm is not None, "fc_norm is not supported"),
        ("pre_norm", pre_norm, bool(pre_norm), "pre_norm is not supported"),
    )
    for name, value, bad, why in unsupported:
        if bad:
            raise ValueError(f"VisionTransformer: {name}={value!r}: {why}")


def _stochastic_depth_rates(drop_path_rate, depth):
    """Linearly increasing from 0 to ``drop_path_rate`` over the blocks (timm's rule)."""
    if depth < 1:
        raise ValueError(f"VisionTransformer: depth must be at least 1, got {depth}")
    return torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()


class VisionTransformer(nn.Module):
    """ViT (Dosovitskiy et al., "An Image is Worth 16x16 Words") with timm's constructor
    arguments; ``use_flash_attn``, ``fused_bias_fc``, ``fused_mlp`` and ``fused_dropout_add_ln``
    as upstream flash-attn's. Input ``(batch, in_chans, img_size, img_size)``; ``forward``
    returns ``(batch, num_classes)`` logits (the class token's features with ``num_classes=0``).
    """

    def __init__(
        self,
        img_size=224,
        patch_size=16,
        in_chans=3,
        num_classes=1000,
        global_pool="token",
        embed_dim=768,
        depth=12,
        num_heads=12,
        mlp_ratio=4.0,
        qkv_bias=True,
        init_values=None,
        class_token=True,
        no_embed_class=False,
        pre_norm=False,
        fc_norm=None,
        drop_rate=0.0,
        attn_drop_rate=0.0,
        drop_path_rate=0.0,
        weight_init="",
        embed_layer=PatchEmbed,
        norm_layer=None,
        act_layer=None,
        use_flash_attn=False,
        fused_bias_fc=False,
        fused_mlp=False,
        fused_dropout_add_ln=False,
    ):
        super().__init__()
        _check_supported(global_pool, class_token, init_values, weight_init, fc_norm, pre_norm)
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1 if class_token else 0
        self.no_embed_class = no_embed_class
        self.fused_dropout_add_ln = fused_dropout_add_ln

        self._init_embeddings(embed_layer, img_size, patch_size, in_chans, class_token, pre_norm,
                              fused_bias_fc)
        rates = _stochastic_depth_rates(drop_path_rate, depth)
        self.blocks = nn.ModuleList(
            create_block(
                embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate,
                drop_path1=rates[i - 1] if i > 0 else 0.0, drop_path2=rates[i],
                norm_layer=norm_layer, act_layer=act_layer, use_flash_attn=use_flash_attn,
                fused_bias_fc=fused_bias_fc, fused_mlp=fused_mlp,
                fused_dropout_add_ln=fused_dropout_add_ln, layer_idx=i, n_layer=depth,
                last_layer_subset=(global_pool == "token"),
            )
            for i in range(depth)
        )
        # The last block's MLP output still needs its dropout, stochastic depth and residual add.
        self.dropout = nn.Dropout(p=drop_rate)
        self.drop_path = StochasticDepth(p=rates[-1], mode="row")
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)

    def _init_embeddings(self, embed_layer, img_size, patch_size, in_chans, class_token, pre_norm,
                         fused_bias_fc):
        """Patch embedding, class token and position embeddings."""
        extra = {"fused_bias_fc": fused_bias_fc} if embed_layer is PatchEmbed else {}
        self.patch_embed = embed_layer(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=self.embed_dim,
            bias=not pre_norm, **extra,
        )
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim)) if class_token else None
        embed_len = num_patches if self.no_embed_class else num_patches + self.num_prefix_tokens
        self.pos_embed = nn.Parameter(torch.randn(1, embed_len, self.embed_dim) * 0.02)

    def init_weights(self, mode=""):
        """timm's original ViT init: truncated normal (std 0.02) for ``pos_embed`` and every
        Linear weight, zero biases, ``cls_token`` normal with std 1e-6."""
        if mode != "":
            raise ValueError(f"init_weights: only mode='' is supported, got {mode!r}")
        trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if module is not self:
                init_weights_vit_timm(module)

    def _init_weights(self, m):
        init_weights_vit_timm(m)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def _pos_embed(self, x):
        """Prepend the class token and add the position embeddings (to the patches alone with
        ``no_embed_class``)."""
        if self.no_embed_class:
            x = x + self.pos_embed
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if not self.no_embed_class:
            x = x + self.pos_embed
        return x

    def forward_features(self, x, all_tokens=True):
        """Normalised features ``(batch, tokens, embed_dim)``; with ``all_tokens=False`` only
        the class token's, ``(batch, 1, embed_dim)``, with the last block computed for it alone."""
        hidden_states = self._pos_embed(self.patch_embed(x))
        residual = None
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            subset = slice(0, 1) if i == last and not all_tokens else None
            hidden_states, residual = block(hidden_states, residual, mixer_subset=subset)
        return self._final_norm(hidden_states, residual)

    def _final_norm(self, hidden_states, residual):
        if not self.fused_dropout_add_ln:
            residual = self.drop_path(self.dropout(hidden_states)) + residual
            return self.norm(residual.to(dtype=self.norm.weight.dtype))
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        rowscale = None
        if self.drop_path.p > 0 and self.training:
            rowscale = self.drop_path(hidden_states.new_ones(hidden_states.shape[:-1]))
        return layer_norm_fn(
            hidden_states,
            self.norm.weight,
            self.norm.bias,
            residual=residual,
            eps=self.norm.eps,
            dropout_p=self.dropout.p if self.training else 0.0,
            rowscale=rowscale,
            prenorm=False,
        )

    def forward_head(self, x, pre_logits: bool = False):
        if self.global_pool:
            x = x[:, self.num_prefix_tokens:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x, all_tokens=False))

    def load_state_dict(self, state_dict, strict=True):
        """Also takes timm's layout: a ``Conv2d`` patch embedding weight and ``attn.qkv`` /
        ``attn.proj`` (renamed to ``mixer.Wqkv`` / ``mixer.out_proj``); the last block's
        ``Wqkv`` is split into ``Wq`` and ``Wkv`` for its cross-attention."""
        state_dict = OrderedDict((_timm_key_to_flash(k), v) for k, v in state_dict.items())
        patch_weight = state_dict.get("patch_embed.proj.weight")
        if patch_weight is not None and patch_weight.dim() == 4:
            # (out, c, h, w) -> (out, c * h * w): PatchEmbed's features are ordered c, h, w.
            state_dict["patch_embed.proj.weight"] = patch_weight.flatten(1)
        last = f"blocks.{len(self.blocks) - 1}.mixer."
        if self.blocks[-1].mixer.cross_attn and f"{last}Wqkv.weight" in state_dict:
            for kind in ("weight", "bias"):
                packed = state_dict.pop(f"{last}Wqkv.{kind}", None)
                if packed is not None:
                    state_dict[f"{last}Wq.{kind}"] = packed[: self.embed_dim]
                    state_dict[f"{last}Wkv.{kind}"] = packed[self.embed_dim:]
        return super().load_state_dict(state_dict, strict=strict)


def _timm_key_to_flash(key):
    key = re.sub(r"^blocks\.(\d+)\.attn\.qkv\.", r"blocks.\1.mixer.Wqkv.", key)
    return re.sub(r"^blocks\.(\d+)\.attn\.proj\.", r"blocks.\1.mixer.out_proj.", key)


def init_weights_vit_timm(module: nn.Module, name: str = ""):
    """timm's original ViT init of one module: truncated normal (std 0.02) Linear weights and
    zero biases; other modules with an ``init_weights`` method run it."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights"):
        module.init_weights()


def _no_pretrained(pretrained):
    if pretrained:
        raise ValueError("pretrained=True is not supported: load the weights with load_state_dict")


def vit_base_patch16_224(pretrained=False, **kwargs):
    """ViT-B/16 (patch 16, width 768, 12 blocks, 12 heads); ``kwargs`` go to
    ``VisionTransformer``."""
    _no_pretrained(pretrained)
    return VisionTransformer(**dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, **kwargs))


def vit_large_patch16_224(pretrained=False, **kwargs):
    """ViT-L/16 (patch 16, width 1024, 24 blocks, 16 heads), as timm's; not in upstream
    flash-attn 2.8, which defines only the base model."""
    _no_pretrained(pretrained)
    return VisionTransformer(**dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16, **kwargs))
