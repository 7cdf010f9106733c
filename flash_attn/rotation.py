"""Rotary position embedding's rotation of feature pairs, in PyTorch: the one definition that the
rotary op's PyTorch path (:mod:`flash_attn.ops.triton.rotary`) and the KV-cache engine
(:mod:`flash_attn.backends._layouts`) both compute with."""

import torch
from torch import Tensor


def rotate_pairs(x_rot: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``x_rot (..., rotary_dim)`` rotated pair by pair by the angles whose ``cos``/``sin``
    (broadcastable to ``(..., rotary_dim / 2)``) are given, in the dtype of the operands.

    ``interleaved`` pairs features ``(2i, 2i + 1)`` (GPT-J), else ``(i, i + rotary_dim / 2)``
    (GPT-NeoX).
    """
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    else:
        half = x_rot.shape[-1] // 2
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x1 * sin + x2 * cos
    if interleaved:
        return torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((o1, o2), dim=-1)
