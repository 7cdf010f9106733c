"""Rotary position embeddings (RoPE) with the flash-attn 2.8 API, in plain PyTorch.

A token at position ``p`` has the pairs of its first ``rotary_dim`` features rotated by the
angles whose cosines and sines are row ``p`` of the ``cos`` / ``sin`` tables
``(seqlen_ro, rotary_dim / 2)``. Pair ``i`` is made of features ``(i, i + rotary_dim / 2)``
(GPT-NeoX layout, ``interleaved=False``) or ``(2i, 2i + 1)`` (GPT-J layout, ``interleaved=True``);
features past ``rotary_dim`` are passed through. The arithmetic runs in float32 (float64 for
float64 inputs) and is rounded once to the input dtype. Everything is ordinary differentiable
tensor code, so autograd and ``torch.compile`` see through it; the gradient of a rotation is
the rotation by the opposite angle.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_torch",
    "rotate_half",
]

Offsets = Union[int, Tensor]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_table(cos: Tensor, sin: Tensor) -> Tuple[int, int]:
    """Validate cos/sin and return ``(seqlen_ro, rotary_dim)``."""
    if not isinstance(cos, Tensor) or not isinstance(sin, Tensor):
        raise ValueError("cos and sin must be tensors")
    if cos.ndim != 2:
        raise ValueError(f"cos must have shape (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(
            f"sin and cos must have the same shape, got {tuple(sin.shape)} and {tuple(cos.shape)}"
        )
    if not (cos.dtype.is_floating_point and sin.dtype.is_floating_point):
        raise ValueError(f"cos and sin must be floating point, got {cos.dtype} and {sin.dtype}")
    if cos.shape[1] == 0:
        raise ValueError("cos and sin must have at least one column (rotary_dim >= 2)")
    return cos.shape[0], 2 * cos.shape[1]


def _check_offsets(seqlen_offsets: Offsets, batch: int, seqlen: int, seqlen_ro: int) -> None:
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.shape != (batch,):
            raise ValueError(
                f"seqlen_offsets tensor must have shape ({batch},), "
                f"got {tuple(seqlen_offsets.shape)}"
            )
        if seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets must be int32 or int64, got {seqlen_offsets.dtype}")
        if seqlen > seqlen_ro:
            raise ValueError(f"seqlen {seqlen} is longer than the cos/sin table ({seqlen_ro})")
        return
    if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
        raise ValueError(f"seqlen_offsets must be an int or a tensor, got {type(seqlen_offsets)}")
    if seqlen_offsets < 0:
        raise ValueError(f"seqlen_offsets must be >= 0, got {seqlen_offsets}")
    if seqlen_offsets + seqlen > seqlen_ro:
        raise ValueError(
            f"seqlen_offsets + seqlen = {seqlen_offsets} + {seqlen} exceeds the cos/sin table "
            f"length {seqlen_ro}"
        )


def _lookup(table: Tensor, pos: Tensor, identity: float, dtype: torch.dtype) -> Tensor:
    """Rows ``table[pos]``; positions outside the table give the identity rotation.

    Only tensor offsets (whose values are not checked, to avoid a device sync) can reach
    outside the table; the identity there matches what upstream's kernel does.
    """
    seqlen_ro = table.shape[0]
    valid = (pos >= 0) & (pos < seqlen_ro)
    rows = table[pos.clamp(0, seqlen_ro - 1)].to(dtype)
    return torch.where(valid.unsqueeze(-1), rows, torch.full_like(rows, identity))


def _angles_dense(
    cos: Tensor, sin: Tensor, seqlen: int, seqlen_offsets: Offsets, dtype: torch.dtype
) -> Tuple[Tensor, Tensor]:
    """cos/sin broadcastable to ``(batch, seqlen, nheads, rotary_dim / 2)``."""
    if isinstance(seqlen_offsets, int):
        c = cos[seqlen_offsets : seqlen_offsets + seqlen].to(dtype)
        s = sin[seqlen_offsets : seqlen_offsets + seqlen].to(dtype)
        return c[None, :, None, :], s[None, :, None, :]
    arange = torch.arange(seqlen, device=cos.device, dtype=torch.int64)
    pos = seqlen_offsets.to(device=cos.device, dtype=torch.int64)[:, None] + arange[None, :]
    c, s = _lookup(cos, pos, 1.0, dtype), _lookup(sin, pos, 0.0, dtype)
    return c[:, :, None, :], s[:, :, None, :]


def _angles_varlen(
    cos: Tensor,
    sin: Tensor,
    cu_seqlens: Tensor,
    total: int,
    seqlen_offsets: Offsets,
    dtype: torch.dtype,
) -> Tuple[Tensor, Tensor]:
    """cos/sin broadcastable to ``(total, nheads, rotary_dim / 2)``.

    Positions restart at 0 in every sequence.
    """
    batch = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(device=cos.device, dtype=torch.int64)
    token = torch.arange(total, device=cu.device, dtype=torch.int64)
    # Sequence of each token: how many sequence ends are <= token (empty sequences are skipped).
    seq = torch.searchsorted(cu[1:].contiguous(), token, right=True)
    seq_c = seq.clamp(max=max(batch - 1, 0))
    pos = token - cu[seq_c]
    if isinstance(seqlen_offsets, Tensor):
        if batch > 0:
            pos = pos + seqlen_offsets.to(device=cu.device, dtype=torch.int64)[seq_c]
    else:
        pos = pos + seqlen_offsets
    # Rows past cu_seqlens[-1] belong to no sequence: leave them unrotated (-1 -> identity).
    pos = torch.where(seq < batch, pos, torch.full_like(pos, -1))
    c, s = _lookup(cos, pos, 1.0, dtype), _lookup(sin, pos, 0.0, dtype)
    return c[:, None, :], s[:, None, :]


def _rotate(x_rot: Tensor, c: Tensor, s: Tensor, interleaved: bool) -> Tensor:
    half = x_rot.shape[-1] // 2
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    else:
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
    o1 = x1 * c - x2 * s
    o2 = x1 * s + x2 * c
    if interleaved:
        return torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((o1, o2), dim=-1)


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Offsets = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> Tensor:
    """Rotate the first ``rotary_dim`` features of ``x`` by position.

    Arguments:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total, nheads, headdim)`` with cu_seqlens.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)``, ``rotary_dim <= headdim``.
        interleaved: rotate feature pairs (0, 1), (2, 3), ... (GPT-J) instead of
            (i, i + rotary_dim / 2) (GPT-NeoX).
        inplace: write the result into ``x`` and return ``x``.
        seqlen_offsets: int, or int32/int64 tensor ``(batch,)``: token ``j`` of sequence ``b`` is
            at position ``j + offset[b]`` (decoding with a KV cache). Int offsets must keep every
            position inside the table; for tensor offsets (not checked, to avoid a device sync)
            positions past the table are left unrotated.
        cu_seqlens: ``(batch + 1,)`` int sequence boundaries into ``total``; positions restart at
            0 in every sequence. Requires max_seqlen (the longest sequence, an int).

    Returns a tensor shaped like ``x`` (``x`` itself when ``inplace``).
    """
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise ValueError("x must be a floating-point tensor")
    seqlen_ro, rotary_dim = _check_table(cos, sin)
    if cu_seqlens is None:
        if x.ndim != 4:
            raise ValueError(
                f"x must have shape (batch, seqlen, nheads, headdim), got {tuple(x.shape)}"
            )
        batch, seqlen = x.shape[0], x.shape[1]
    else:
        if x.ndim != 3:
            raise ValueError(
                f"with cu_seqlens, x must have shape (total, nheads, headdim), got {tuple(x.shape)}"
            )
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor of length batch + 1")
        if max_seqlen is None:
            raise ValueError("max_seqlen must be given together with cu_seqlens")
        batch, seqlen = cu_seqlens.shape[0] - 1, int(max_seqlen)
    headdim = x.shape[-1]
    if rotary_dim > headdim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= headdim ({headdim})")
    _check_offsets(seqlen_offsets, batch, seqlen, seqlen_ro)

    dtype = _compute_dtype(x.dtype)
    if cu_seqlens is None:
        c, s = _angles_dense(cos, sin, seqlen, seqlen_offsets, dtype)
    else:
        c, s = _angles_varlen(cos, sin, cu_seqlens, x.shape[0], seqlen_offsets, dtype)
    x_rot = x[..., :rotary_dim].to(dtype)
    if inplace and dtype == x.dtype and (cos.requires_grad or sin.requires_grad):
        # The product with a differentiable table saves x_rot for backward; it must not be
        # the very memory we are about to overwrite.
        x_rot = x_rot.clone()
    rotated = _rotate(x_rot, c, s, interleaved)
    if inplace:
        x[..., :rotary_dim].copy_(rotated)
        return x
    rotated = rotated.to(x.dtype)
    if rotary_dim == headdim:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


# Older name kept by upstream for backward compatibility.
apply_rotary_emb_func = apply_rotary_emb


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """Map each rotated pair ``(a, b)`` to ``(-b, a)`` (multiplication by i)."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((-b, a), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary_emb_torch(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False
) -> Tensor:
    """Reference rotation without offsets, in the dtype of ``x``.

    x: ``(batch, seqlen, nheads, headdim)``; cos, sin: ``(seqlen, rotary_dim / 2)`` or
    ``(batch, seqlen, rotary_dim / 2)``.
    """
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= headdim ({x.shape[-1]})")
    # Expand the half-width tables to full width in the layout of the pairs.
    if interleaved:
        cos_full = cos.repeat_interleave(2, dim=-1)
        sin_full = sin.repeat_interleave(2, dim=-1)
    else:
        cos_full = torch.cat((cos, cos), dim=-1)
        sin_full = torch.cat((sin, sin), dim=-1)
    cos_full, sin_full = cos_full.unsqueeze(-2), sin_full.unsqueeze(-2)
    x_rot = x[..., :rotary_dim]
    rotated = x_rot * cos_full + rotate_half(x_rot, interleaved) * sin_full
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def _split_qk(qkv: Tensor, num_heads_q: Optional[int]) -> Tuple[Tensor, Tensor]:
    """Views of the q and k heads of a packed qkv tensor."""
    if qkv.ndim == 5:
        if qkv.shape[2] != 3:
            raise ValueError(
                f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}"
            )
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.ndim == 4:
        if num_heads_q is None:
            raise ValueError(
                "num_heads_q is required when qkv has shape "
                "(batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)"
            )
        nheads = qkv.shape[2]
        num_heads_k = (nheads - num_heads_q) // 2
        if num_heads_q <= 0 or num_heads_k <= 0 or num_heads_q + 2 * num_heads_k != nheads:
            raise ValueError(
                f"qkv has {nheads} heads, which is not num_heads_q ({num_heads_q}) + "
                "2 * num_heads_k for a positive num_heads_k"
            )
        return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + num_heads_k]
    raise ValueError(
        "qkv must have shape (batch, seqlen, 3, nheads, headdim) or "
        f"(batch, seqlen, num_heads_q + 2 * num_heads_k, headdim), got {tuple(qkv.shape)}"
    )


def apply_rotary_emb_qkv_(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    cos_k: Optional[Tensor] = None,
    sin_k: Optional[Tensor] = None,
    interleaved: bool = False,
    seqlen_offsets: Offsets = 0,
    num_heads_q: Optional[int] = None,
) -> Tensor:
    """Rotate q and k of a packed qkv *in place* and return ``qkv``; v is untouched.

    qkv: ``(batch, seqlen, 3, nheads, headdim)``, or ``(batch, seqlen, num_heads_q +
    2 * num_heads_k, headdim)`` (MQA/GQA, ``num_heads_q`` required). k uses ``cos_k`` /
    ``sin_k`` when given (XPos), otherwise the same tables as q.
    """
    if (cos_k is None) != (sin_k is None):
        raise ValueError("cos_k and sin_k must be given together")
    q, k = _split_qk(qkv, num_heads_q)
    if cos_k is None:
        cos_k, sin_k = cos, sin
    apply_rotary_emb(q, cos, sin, interleaved, True, seqlen_offsets)
    apply_rotary_emb(k, cos_k, sin_k, interleaved, True, seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(
    kv: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    seqlen_offsets: Offsets = 0,
) -> Tensor:
    """Rotate k of a packed kv ``(batch, seqlen, 2, nheads, headdim)`` *in place*; return ``kv``."""
    if kv.ndim != 5 or kv.shape[2] != 2:
        raise ValueError(
            f"kv must have shape (batch, seqlen, 2, nheads, headdim), got {tuple(kv.shape)}"
        )
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding of RoFormer (Su et al.), optionally with the XPos decay (Sun et al.).

    ``dim`` is the rotary dimension; frequencies are ``base ** (-2i / dim)``. With
    ``scale_base`` set, queries are additionally multiplied and keys divided by
    ``zeta_i ** ((p - L // 2) / scale_base)`` with ``zeta_i = (2i + 0.4 dim) / (1.4 dim)``, where
    ``L`` is the current length of the cached tables (upstream's convention).
    The cos/sin tables are cached and rebuilt when a longer length, another device or dtype,
    or training after inference-mode use needs it.
    """

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        interleaved: bool = False,
        scale_base: Optional[float] = None,
        device=None,
    ):
        super().__init__()
        if dim <= 0 or dim % 2 != 0:
            raise ValueError(f"dim must be a positive even number, got {dim}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = self._compute_scale(device) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached: Optional[Tensor] = None
        self._sin_cached: Optional[Tensor] = None
        self._cos_k_cached: Optional[Tensor] = None
        self._sin_k_cached: Optional[Tensor] = None

    def _compute_inv_freq(self, device=None) -> Tensor:
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / (self.base**exponents)

    def _compute_scale(self, device=None) -> Tensor:
        i2 = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32)
        return (i2 + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        cached = self._cos_cached
        if not (
            seqlen > self._seq_len_cached
            or cached is None
            or cached.device != device
            or cached.dtype != dtype
            or (self.training and cached.is_inference())
        ):
            return
        self._seq_len_cached = seqlen
        # Tables are built in float32 even if the module was cast to half precision: positions
        # times frequencies are large numbers, and bf16 would visibly change cos/sin.
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:
            inv_freq = self._compute_inv_freq(device)
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale
        if scale.dtype != torch.float32:
            scale = self._compute_scale(device)
        power = (t - seqlen // 2) / self.scale_base
        xpos = scale.to(device)[None, :] ** power[:, None]
        self._cos_cached, self._sin_cached = (cos * xpos).to(dtype), (sin * xpos).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / xpos).to(dtype), (sin / xpos).to(dtype)

    def forward(
        self,
        qkv: Tensor,
        kv: Optional[Tensor] = None,
        seqlen_offset: Offsets = 0,
        max_seqlen: Optional[int] = None,
        num_heads_q: Optional[int] = None,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Rotate *in place* and return the inputs.

        qkv: packed ``(batch, seqlen, 3, nheads, headdim)`` or ``(batch, seqlen, num_heads_q +
            2 * num_heads_k, headdim)`` when ``kv`` is None; otherwise q ``(batch, seqlen,
            nheads, headdim)``, and then ``(q, kv)`` is returned.
        kv: optional ``(batch, seqlen, 2, nheads_k, headdim)``.
        seqlen_offset: int or ``(batch,)`` tensor, the position of the first token. With a
            tensor, pass ``max_seqlen`` so the tables are built long enough.
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError(
                "with a tensor seqlen_offset, pass max_seqlen to size the cos/sin tables"
            )
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv,
                self._cos_cached,
                self._sin_cached,
                cos_k if xpos else None,
                sin_k if xpos else None,
                interleaved=self.interleaved,
                seqlen_offsets=seqlen_offset,
                num_heads_q=num_heads_q,
            )
        q = apply_rotary_emb(
            qkv,
            self._cos_cached,
            self._sin_cached,
            interleaved=self.interleaved,
            inplace=True,
            seqlen_offsets=seqlen_offset,
        )
        kv = apply_rotary_emb_kv_(
            kv, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset
        )
        return q, kv
