"""Upstream's ``flash_attn.layers.patch_embed``: ``PatchEmbed``, the image-to-patches embedding of
vision transformers with timm's API, computed as one linear layer over the flattened patches
(equal to timm's ``Conv2d`` with kernel = stride = patch size, and faster)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from flash_attn.ops.fused_dense import FusedDense

__all__ = ["PatchEmbed"]


class PatchEmbed(nn.Module):
    """2D image to patch embedding: ``(batch, in_chans, H, W)`` -> ``(batch, num_patches, embed_dim)``
    (``flatten=True``) or ``(batch, H / p, W / p, embed_dim)``.

    Each patch's features are ordered channel, row, column (``c p1 p2``), as upstream's, so a
    ``Conv2d`` weight ``(embed_dim, in_chans, p1, p2)`` reshaped to ``(embed_dim, -1)`` is ``proj``'s.
    ``fused_bias_fc=True`` makes ``proj`` upstream's ``FusedDense`` (:mod:`flash_attn.ops.fused_dense`:
    the same linear layer).
    """

    def __init__(
        self,
        img_size=224,
        patch_size=16,
        in_chans=3,
        embed_dim=768,
        norm_layer=None,
        flatten=True,
        bias=True,
        fused_bias_fc=False,
    ):
        super().__init__()
        self.img_size = _pair(img_size)
        self.patch_size = _pair(patch_size)
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten = flatten
        self.proj = (FusedDense if fused_bias_fc else nn.Linear)(in_chans * self.patch_size[0] * self.patch_size[1], embed_dim, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        batch, chans, height, width = x.shape
        # AssertionError, as upstream's (torch._assert)
        torch._assert(height == self.img_size[0], f"Input image height ({height}) doesn't match model ({self.img_size[0]}).")
        torch._assert(width == self.img_size[1], f"Input image width ({width}) doesn't match model ({self.img_size[1]}).")
        p1, p2 = self.patch_size
        if height % p1 or width % p2:
            raise ValueError(f"image size {height}x{width} is not a whole number of {p1}x{p2} patches")
        rows, cols = self.grid_size
        # (b, c, rows*p1, cols*p2) -> (b, rows, cols, c*p1*p2): one row of features per patch
        patches = x.reshape(batch, chans, rows, p1, cols, p2).permute(0, 2, 4, 1, 3, 5)
        out = self.proj(patches.reshape(batch, rows, cols, chans * p1 * p2))
        if self.flatten:
            out = out.reshape(batch, rows * cols, -1)
        return self.norm(out)
