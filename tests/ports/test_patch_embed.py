"""``flash_attn.layers.patch_embed.PatchEmbed`` against timm's definition, a ``Conv2d`` with
kernel = stride = patch size, in float64 (same weights: the conv weight flattened channel, row,
column is the linear layer's); layouts, norm, gradients, bad input. Signatures: tests/ports/test_modules.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flash_attn.layers.patch_embed import PatchEmbed


def conv_oracle(module: PatchEmbed, x: torch.Tensor) -> torch.Tensor:
    """``(b, rows, cols, embed)`` by convolution with ``module``'s weights."""
    p1, p2 = module.patch_size
    weight = module.proj.weight.reshape(-1, x.shape[1], p1, p2)
    return F.conv2d(x, weight, module.proj.bias, stride=(p1, p2)).permute(0, 2, 3, 1)


@pytest.mark.parametrize("img_size, patch_size, in_chans", [(32, 8, 3), ((24, 40), (6, 10), 2), (16, 16, 1)])
@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_the_convolution(img_size, patch_size, in_chans, flatten, bias):
    torch.manual_seed(0)
    m = PatchEmbed(img_size, patch_size, in_chans, embed_dim=12, flatten=flatten, bias=bias).double()
    h, w = m.img_size
    x = torch.randn(3, in_chans, h, w, dtype=torch.float64, requires_grad=True)
    out = m(x)
    ref = conv_oracle(m, x)
    rows, cols = m.grid_size
    assert m.num_patches == rows * cols
    if flatten:
        assert out.shape == (3, rows * cols, 12)
        ref = ref.reshape(3, rows * cols, 12)
    else:
        assert out.shape == (3, rows, cols, 12)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, [x, m.proj.weight], grad)
    theirs = torch.autograd.grad(ref, [x, m.proj.weight], grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_norm_layer_is_applied_per_patch():
    torch.manual_seed(1)
    m = PatchEmbed(16, 4, 3, embed_dim=8, norm_layer=nn.LayerNorm).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    expected = F.layer_norm(conv_oracle(m, x).reshape(2, 16, 8), (8,), m.norm.weight, m.norm.bias)
    torch.testing.assert_close(m(x), expected)
    assert isinstance(PatchEmbed(16, 4).norm, nn.Identity)


def test_wrong_image_size_and_fused_bias_fc_raise_as_upstream():
    m = PatchEmbed(32, 8, 3, embed_dim=4)
    with pytest.raises(AssertionError, match=r"Input image height \(24\) doesn't match model \(32\)"):
        m(torch.randn(1, 3, 24, 32))
    with pytest.raises(AssertionError, match=r"Input image width \(16\) doesn't match model \(32\)"):
        m(torch.randn(1, 3, 32, 16))
    with pytest.raises(ValueError, match="not a whole number of 8x8 patches"):
        PatchEmbed(30, 8, 3, embed_dim=4)(torch.randn(1, 3, 30, 30))
    # fused_bias_fc: upstream's FusedDense as proj, the same function of the same weights
    fused, plain = PatchEmbed(32, 8, 3, embed_dim=4, fused_bias_fc=True), PatchEmbed(32, 8, 3, embed_dim=4)
    plain.load_state_dict(fused.state_dict())
    image = torch.randn(2, 3, 32, 32)
    assert type(fused.proj).__name__ == "FusedDense"
    torch.testing.assert_close(fused(image), plain(image), rtol=0, atol=0)
