"""Rotary position embeddings (RoPE) with the flash-attn 2.8 API.

A token at position ``p`` has the pairs of its first ``rotary_dim`` features rotated by the
angles whose cosines and sines are row ``p`` of the ``cos`` / ``sin`` tables
``(seqlen_ro, rotary_dim / 2)``. Pair ``i`` is made of features ``(i, i + rotary_dim / 2)``
(GPT-NeoX layout, ``interleaved=False``) or ``(2i, 2i + 1)`` (GPT-J layout, ``interleaved=True``);
features past ``rotary_dim`` are passed through. The arithmetic runs in float32 (float64 for
float64 inputs) and is rounded once to the input dtype: on CUDA by one Triton kernel
(:func:`flash_attn.ops.triton.rotary.apply_rotary`), elsewhere by PyTorch ops. The gradient of a
rotation is the rotation by the opposite angle; as upstream, custom autograd functions write in
place inside their forward, so in-place rotation of a leaf that requires grad works. Gradients
for ``cos``/``sin`` (which upstream does not give) come from the PyTorch ops path.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from flash_attn import validation
from flash_attn.ops.triton.rotary import (
    Offsets,
    _check_args,
    _check_table,
    _rotate_torch,
    apply_rotary,
)

__all__ = [
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_torch",
    "rotate_half",
]

def _autograd_allows_in_place(x: Tensor) -> bool:
    """Whether ``x`` may be marked as modified in place: not a leaf that requires grad, nor a
    view of one (autograd refuses both, even inside a custom Function)."""
    base = x._base if x._is_view() else x
    return not (base.is_leaf and base.requires_grad)


def _rotate_without_autograd(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace,
                             conjugate=False) -> Tensor:
    """The kernel on CUDA, PyTorch elsewhere; nothing recorded for autograd."""
    with torch.no_grad():
        return apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace, conjugate)


class _ApplyRotaryEmb(torch.autograd.Function):
    """Differentiable in ``x`` only (as upstream): forward and backward are rotations, the
    backward by minus the angle, so nothing but the tables is saved. In place, the forward writes
    into ``x``; where autograd allows it (not a leaf, nor a view of one) ``x`` is marked modified and
    returned, so its own history follows; otherwise (upstream's case of a leaf that requires
    grad) the result is a view of ``x`` carrying the rotation's backward."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
        out = _rotate_without_autograd(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace)
        offsets_tensor = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
        ctx.save_for_backward(cos, sin, cu_seqlens, offsets_tensor)
        ctx.offset = None if offsets_tensor is not None else seqlen_offsets
        ctx.options = (max_seqlen, interleaved)
        if inplace and _autograd_allows_in_place(x):
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin, cu_seqlens, offsets_tensor = ctx.saved_tensors
        offsets = offsets_tensor if ctx.offset is None else ctx.offset
        max_seqlen, interleaved = ctx.options
        dx = _rotate_without_autograd(grad, cos, sin, offsets, cu_seqlens, max_seqlen, interleaved,
                                      inplace=False, conjugate=True)
        return dx, None, None, None, None, None, None, None


def _tables_need_grad(cos: Tensor, sin: Tensor) -> bool:
    return torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)


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
        inplace: write the result into ``x`` and return ``x`` (with autograd recording a leaf
            ``x`` that requires grad: a view of ``x``, as upstream).
        seqlen_offsets: int, or int32/int64 tensor ``(batch,)``: token ``j`` of sequence ``b`` is
            at position ``j + offset[b]`` (decoding with a KV cache). Int offsets must keep every
            position inside the table; for tensor offsets (not checked, to avoid a device sync)
            positions past the table are left unrotated.
        cu_seqlens: ``(batch + 1,)`` int sequence boundaries into ``total``; positions restart at
            0 in every sequence. Requires max_seqlen (the longest sequence, an int).

    On CUDA the rotation is one Triton kernel (:func:`flash_attn.ops.triton.rotary.apply_rotary`),
    elsewhere PyTorch ops. Gradients flow to ``x``, and also to ``cos``/``sin`` when they require
    grad (upstream gives them none): then the rotation is recorded op by op in PyTorch.

    Returns a tensor shaped like ``x``.
    """
    _check_args(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    interleaved, inplace = validation.check_flag(interleaved, "interleaved"), validation.check_flag(inplace, "inplace")
    if _tables_need_grad(cos, sin):
        if inplace and not _autograd_allows_in_place(x):
            raise ValueError(
                "inplace=True on a leaf tensor that requires grad (or a view of one) cannot also "
                "give gradients to cos and sin: detach cos and sin, or use inplace=False"
            )
        return _rotate_torch(x, cos, sin, seqlen_offsets, cu_seqlens, interleaved, inplace)
    if torch.is_grad_enabled() and x.requires_grad:
        if inplace and torch.compiler.is_compiling():
            # torch.compile traces neither _is_view() nor a custom Function marking a view dirty:
            # the same rotation out of place, copied back (autograd records the copy).
            return x.copy_(_ApplyRotaryEmb.apply(x, cos, sin, interleaved, False, seqlen_offsets, cu_seqlens,
                                                 max_seqlen))
        return _ApplyRotaryEmb.apply(
            x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen
        )
    return apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace)


# Older name kept by upstream for backward compatibility.
apply_rotary_emb_func = apply_rotary_emb


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """Map each rotated pair ``(a, b)`` to ``(-b, a)`` (multiplication by i)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"x must be a tensor, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(f"x's last dimension (the rotated pairs) must be even, got shape {tuple(x.shape)}")
    if validation.check_flag(interleaved, "interleaved"):
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
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.ndim != 4:
        raise ValueError(f"x must be a floating-point tensor of shape (batch, seqlen, nheads, headdim), got "
                         f"{validation._describe(x)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, Tensor) or not table.dtype.is_floating_point or table.ndim not in (2, 3):
            raise ValueError(f"{name} must be a floating-point tensor of shape (seqlen, rotary_dim / 2) or (batch, "
                             f"seqlen, rotary_dim / 2), got {validation._describe(table)}")
        if table.device != x.device:
            raise ValueError(f"{name} is on {table.device} but x is on {x.device}")
        if table.shape[-2] != x.shape[1] or table.shape != cos.shape:
            raise ValueError(f"{name} must have shape ({x.shape[1]}, rotary_dim / 2) like cos, got {tuple(table.shape)}")
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= headdim ({x.shape[-1]})")
    # Expand the half-width tables to full width in the layout of the pairs.
    if validation.check_flag(interleaved, "interleaved"):
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


def _rotated_parts(packed: Tensor, num_heads_q: Optional[int]) -> Tuple[Tensor, ...]:
    """The views of a packed tensor that get rotated: (q, k) of a qkv (ndim 4 or 5 with 3 in
    dim 2), (k,) of a kv (ndim 5 with 2 in dim 2)."""
    if packed.ndim == 5 and packed.shape[2] == 2:
        return (packed[:, :, 0],)
    return _split_qk(packed, num_heads_q)


def _rotate_parts(parts, tables, interleaved, seqlen_offsets, conjugate=False) -> None:
    for part, (cos, sin) in zip(parts, tables):
        _rotate_without_autograd(part, cos, sin, seqlen_offsets, None, None, interleaved, True, conjugate)


class _RotatePackedInPlace(torch.autograd.Function):
    """Upstream's autograd for ``apply_rotary_emb_qkv_`` / ``apply_rotary_emb_kv_``: the forward
    rotates q and k (or k) inside the packed tensor in place, the backward rotates the same parts
    of the gradient back. Marked as modified in place where autograd allows it (see
    :class:`_ApplyRotaryEmb`); a packed leaf that requires grad comes back as a view of itself."""

    @staticmethod
    def forward(ctx, packed, tables, interleaved, seqlen_offsets, num_heads_q):
        _rotate_parts(_rotated_parts(packed, num_heads_q), tables, interleaved, seqlen_offsets)
        ctx.tables, ctx.offsets, ctx.options = tables, seqlen_offsets, (interleaved, num_heads_q)
        if _autograd_allows_in_place(packed):
            ctx.mark_dirty(packed)
        return packed

    @staticmethod
    def backward(ctx, grad):
        interleaved, num_heads_q = ctx.options
        grad = grad.clone()  # the incoming gradient may be shared or expanded: never write into it
        _rotate_parts(_rotated_parts(grad, num_heads_q), ctx.tables, interleaved, ctx.offsets, conjugate=True)
        return grad, None, None, None, None


# Upstream's names of the autograd classes (code outside the package calls ``ApplyRotaryEmb.apply``).
ApplyRotaryEmb = _ApplyRotaryEmb


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    """Upstream's in-place rotation of q and k in a packed qkv, as an autograd class."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None):
        tables, names = _qkv_tables(qkv, cos, sin, cos_k, sin_k, num_heads_q)  # called directly: its checks too
        _checked_parts(qkv, tables, seqlen_offsets, num_heads_q, names)
        interleaved = validation.check_flag(interleaved, "interleaved")
        return _RotatePackedInPlace.forward(ctx, qkv, tables, interleaved, seqlen_offsets, num_heads_q)

    @staticmethod
    def backward(ctx, dqkv):
        return _RotatePackedInPlace.backward(ctx, dqkv)[0], *(None,) * 7


class ApplyRotaryEmbKV_(torch.autograd.Function):
    """Upstream's in-place rotation of k in a packed kv, as an autograd class."""

    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets=0):
        _check_kv(kv)  # called directly: apply_rotary_emb_kv_'s checks too
        _checked_parts(kv, ((cos, sin),), seqlen_offsets, None, (("cos", "sin"),))
        interleaved = validation.check_flag(interleaved, "interleaved")
        return _RotatePackedInPlace.forward(ctx, kv, ((cos, sin),), interleaved, seqlen_offsets, None)

    @staticmethod
    def backward(ctx, dkv):
        return _RotatePackedInPlace.backward(ctx, dkv)[0], *(None,) * 4


def _apply_rotary_emb_qkv(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, inplace=False, conjugate=False,
                          seqlen_offsets: Offsets = 0, num_heads_q: Optional[int] = None) -> Tensor:
    """Upstream's helper: q and k of a packed qkv rotated (``conjugate``: by minus the angle), in
    place or into a copy; nothing recorded for autograd."""
    out = qkv if inplace else qkv.clone()
    tables = ((cos, sin), (cos, sin) if cos_k is None else (cos_k, sin_k))
    _rotate_parts(_rotated_parts(out, num_heads_q), tables, interleaved, seqlen_offsets, conjugate)
    return out


def _checked_parts(packed, tables, seqlen_offsets, num_heads_q, table_names) -> Tuple[Tensor, ...]:
    """The parts of ``packed`` to rotate, each checked with its tables (before any write)."""
    parts = _rotated_parts(packed, num_heads_q)
    for part, (cos, sin), names in zip(parts, tables, table_names):
        _check_args(part, cos, sin, seqlen_offsets, None, None, names)
    return parts


def _rotate_packed(packed, tables, interleaved, seqlen_offsets, num_heads_q,
                   table_names=(("cos", "sin"), ("cos", "sin"))) -> Tensor:
    """Rotate the parts of ``packed`` in place with ``tables`` ((cos, sin) per part, named
    ``table_names``)."""
    interleaved = validation.check_flag(interleaved, "interleaved")
    parts = _checked_parts(packed, tables, seqlen_offsets, num_heads_q, table_names)
    recorded = torch.is_grad_enabled() and packed.requires_grad
    if recorded and packed.is_leaf and torch.compiler.is_compiling():
        # A leaf that requires grad: eagerly the result is a view of it carrying the rotation
        # (_RotatePackedInPlace), which torch.compile cannot trace, and an in-place write into it
        # with autograd recording is refused. So: the rotation of a copy, whose values are
        # written into the leaf without autograd, and the copy returned (same values, same
        # gradient to the leaf).
        rotated = packed.clone()
        _rotate_packed(rotated, tables, interleaved, seqlen_offsets, num_heads_q, table_names)
        with torch.no_grad():
            packed.copy_(rotated)
        return rotated
    if any(_tables_need_grad(cos, sin) for cos, sin in tables) or (recorded and torch.compiler.is_compiling()):
        # differentiable tables: op by op (a packed leaf that requires grad is refused there);
        # under torch.compile, part by part as apply_rotary_emb traces it
        for part, (cos, sin) in zip(parts, tables):
            apply_rotary_emb(part, cos, sin, interleaved, True, seqlen_offsets)
        return packed
    if recorded:
        return _RotatePackedInPlace.apply(packed, tables, interleaved, seqlen_offsets, num_heads_q)
    _rotate_parts(parts, tables, interleaved, seqlen_offsets)
    return packed


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
    ``sin_k`` when given (XPos), otherwise the same tables as q. With autograd recording a
    leaf ``qkv`` that requires grad, the result is a view of ``qkv`` (as upstream).
    """
    tables, names = _qkv_tables(qkv, cos, sin, cos_k, sin_k, num_heads_q)
    return _rotate_packed(qkv, tables, interleaved, seqlen_offsets, num_heads_q, names)


def _qkv_tables(qkv, cos, sin, cos_k, sin_k, num_heads_q):
    """A packed qkv's checks; its ((cos, sin), (cos_k, sin_k)) tables and their names."""
    if (cos_k is None) != (sin_k is None):
        raise ValueError("cos_k and sin_k must be given together")
    _check_packed(qkv, "qkv")
    if num_heads_q is not None:
        validation.check_int(num_heads_q, "num_heads_q", minimum=1)
    if qkv.ndim == 5 and qkv.shape[2] != 3:
        raise ValueError(
            f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}"
        )
    _split_qk(qkv, num_heads_q)  # shape errors before anything else
    names = (("cos", "sin"), ("cos", "sin") if cos_k is None else ("cos_k", "sin_k"))
    return ((cos, sin), (cos, sin) if cos_k is None else (cos_k, sin_k)), names


def apply_rotary_emb_kv_(
    kv: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    seqlen_offsets: Offsets = 0,
) -> Tensor:
    """Rotate k of a packed kv ``(batch, seqlen, 2, nheads, headdim)`` *in place*; return ``kv``
    (a view of it for a leaf that requires grad, as upstream)."""
    _check_kv(kv)
    return _rotate_packed(kv, ((cos, sin),), interleaved, seqlen_offsets, None)


def _check_kv(kv) -> None:
    _check_packed(kv, "kv")
    if kv.ndim != 5 or kv.shape[2] != 2:
        raise ValueError(
            f"kv must have shape (batch, seqlen, 2, nheads, headdim), got {tuple(kv.shape)}"
        )


def _check_packed(packed, name: str) -> None:
    if not isinstance(packed, Tensor) or not packed.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {validation._describe(packed)}")


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
        dim = validation.check_int(dim, "dim")
        if dim <= 0 or dim % 2 != 0:
            raise ValueError(f"dim must be a positive even number, got {dim}")
        base = validation._real(base, "base", "a float > 0")
        if not base > 0 or base == float("inf"):
            raise ValueError(f"base must be a finite float > 0, got {base!r}")
        if scale_base is not None:
            scale_base = validation._real(scale_base, "scale_base", "a float > 0 or None")
            if not scale_base > 0:
                raise ValueError(f"scale_base must be > 0 (or None: no XPos), got {scale_base!r}")
        self.dim = dim
        self.base = base
        self.interleaved = validation.check_flag(interleaved, "interleaved")
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = self._compute_scale(device) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cached_in_inference = False
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
            or (self.training and self._cached_in_inference)
        ):
            return
        self._seq_len_cached = seqlen
        # Tables made under inference mode cannot be saved for backward. Remembered as a flag
        # rather than asked with tensor.is_inference(), which torch.compile cannot trace.
        self._cached_in_inference = torch.is_inference_mode_enabled()
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
        if not isinstance(qkv, Tensor):
            raise TypeError(f"qkv must be a tensor, got {type(qkv).__name__}")
        if qkv.ndim < 4:
            raise ValueError(f"qkv must have shape (batch, seqlen, ...) with heads and headdim, got {tuple(qkv.shape)}")
        if isinstance(kv, Tensor) and kv.device != qkv.device:
            raise ValueError(f"kv is on {kv.device} but qkv is on {qkv.device}")
        if isinstance(seqlen_offset, bool) or not isinstance(seqlen_offset, (int, Tensor)):
            raise ValueError(f"seqlen_offset must be an int or a tensor of shape (batch,), got {seqlen_offset!r}")
        if max_seqlen is not None:
            max_seqlen = validation.check_int(max_seqlen, "max_seqlen", minimum=0)
        if num_heads_q is not None:
            validation.check_int(num_heads_q, "num_heads_q", minimum=1)
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
