"""Rotary embedding as one Triton kernel (upstream's ``flash_attn.ops.triton.rotary.apply_rotary``).

Token ``j`` of sequence ``b`` sits at position ``p = j + seqlen_offsets[b]``; the pairs of its first
``rotary_dim`` features (``(i, i + rotary_dim / 2)``, or ``(2i, 2i + 1)`` when ``interleaved``) are
rotated by the angle whose cosine and sine are ``cos[p, i]`` and ``sin[p, i]`` (by minus that angle
when ``conjugate``: the backward). Positions past the table leave the token unrotated.

On CUDA tensors the kernel runs (Triton's JIT, compiled on first use; no ahead-of-time images are
built for it). On every other device the same function computes the rotation in PyTorch, in float32
(float64 for float64 inputs), rounded once to the input dtype; :mod:`flash_attn.layers.rotary`
also uses that path where gradients must reach the tables.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from flash_attn import validation
from flash_attn.ops.triton import cuda_launch, triton_modules
from flash_attn.rotation import rotate_pairs

triton, tl = triton_modules()  # Triton is optional: without it (or without CUDA) the PyTorch path runs

__all__ = ["apply_rotary"]

if triton is not None:

    @triton.jit
    def _rotary_kernel(out_ptr, x_ptr, cos_ptr, sin_ptr, cu_seqlens_ptr, offsets_ptr, offset,
                       seqlen, seqlen_ro,
                       out_stride_b, out_stride_s, out_stride_h, out_stride_d,
                       x_stride_b, x_stride_s, x_stride_h, x_stride_d,
                       HALF: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       VARLEN: tl.constexpr, OFFSETS_TENSOR: tl.constexpr, INTERLEAVED: tl.constexpr,
                       CONJUGATE: tl.constexpr):
        """Program (row block, head, sequence): ``BLOCK_M`` tokens of one head."""
        pid_m = tl.program_id(0)
        head = tl.program_id(1)
        batch = tl.program_id(2)
        if VARLEN:
            start = tl.load(cu_seqlens_ptr + batch).to(tl.int64)
            length = tl.load(cu_seqlens_ptr + batch + 1).to(tl.int64) - start
        else:
            start = 0
            length = seqlen
        if OFFSETS_TENSOR:
            shift = tl.load(offsets_ptr + batch).to(tl.int64)
        else:
            shift = offset
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k = tl.arange(0, BLOCK_K)
        tokens = m < length
        pairs = k < HALF
        pos = m.to(tl.int64) + shift
        in_table = tokens[:, None] & pairs[None, :] & (pos[:, None] < seqlen_ro) & (pos[:, None] >= 0)
        table_at = pos[:, None] * HALF + k[None, :]
        cos = tl.load(cos_ptr + table_at, mask=in_table, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + table_at, mask=in_table, other=0.0).to(tl.float32)
        if CONJUGATE:
            sin = -sin
        # the two features of pair k: (2k, 2k + 1) interleaved, (k, k + HALF) otherwise
        if INTERLEAVED:
            first = 2 * k
            second = 2 * k + 1
        else:
            first = k
            second = k + HALF
        rows = start + m.to(tl.int64)
        x_row = x_ptr + batch.to(tl.int64) * x_stride_b + rows[:, None] * x_stride_s + head.to(tl.int64) * x_stride_h
        o_row = (out_ptr + batch.to(tl.int64) * out_stride_b + rows[:, None] * out_stride_s
                 + head.to(tl.int64) * out_stride_h)
        mask = tokens[:, None] & pairs[None, :]
        x1 = tl.load(x_row + first[None, :] * x_stride_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + second[None, :] * x_stride_d, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + first[None, :] * out_stride_d, x1 * cos - x2 * sin, mask=mask)
        tl.store(o_row + second[None, :] * out_stride_d, x1 * sin + x2 * cos, mask=mask)


# The tests swap these for Triton's interpreter on CPU tensors (flash_attn.backends._interpreter).
_launch: Callable = cuda_launch


def _kernel_applies(x: Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _rotate_triton(x, cos, sin, seqlen_offsets, cu_seqlens, seqlen, interleaved, inplace, conjugate, block_m=None):
    varlen = cu_seqlens is not None
    batch = cu_seqlens.shape[0] - 1 if varlen else x.shape[0]
    nheads, headdim = x.shape[-2], x.shape[-1]
    half = cos.shape[1]
    if inplace:
        out = x
    elif varlen or 2 * half < headdim:
        out = x.clone()  # features past rotary_dim, and rows outside every sequence, pass through
    else:
        out = torch.empty_like(x)
    if x.numel() == 0 or batch == 0 or seqlen == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    offsets_tensor = isinstance(seqlen_offsets, Tensor)
    block_m = block_m or (8 if half <= 64 else 4)
    # strides of (batch, seqlen, heads, features); varlen x has no batch dimension
    x_strides = (0, *x.stride()) if varlen else x.stride()
    out_strides = (0, *out.stride()) if varlen else out.stride()
    grid = (triton.cdiv(seqlen, block_m), nheads, batch)
    _launch(_rotary_kernel, grid, out_ptr=out, x_ptr=x, cos_ptr=cos, sin_ptr=sin,
            cu_seqlens_ptr=cu_seqlens.contiguous() if varlen else None,
            offsets_ptr=seqlen_offsets.contiguous() if offsets_tensor else None,
            offset=0 if offsets_tensor else int(seqlen_offsets), seqlen=seqlen, seqlen_ro=cos.shape[0],
            out_stride_b=out_strides[0], out_stride_s=out_strides[1], out_stride_h=out_strides[2],
            out_stride_d=out_strides[3], x_stride_b=x_strides[0], x_stride_s=x_strides[1],
            x_stride_h=x_strides[2], x_stride_d=x_strides[3], HALF=half,
            BLOCK_K=triton.next_power_of_2(half), BLOCK_M=block_m, VARLEN=varlen,
            OFFSETS_TENSOR=offsets_tensor, INTERLEAVED=interleaved, CONJUGATE=conjugate)
    return out


# --- the PyTorch path (every device but CUDA; also flash_attn.layers.rotary's differentiable one) ---

Offsets = Union[int, Tensor]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_table(cos: Tensor, sin: Tensor, device=None, names: Tuple[str, str] = ("cos", "sin")) -> Tuple[int, int]:
    """Validate cos/sin (on ``device`` when given; ``names``: what the caller calls them) and
    return ``(seqlen_ro, rotary_dim)``."""
    for name, table in zip(names, (cos, sin)):
        if not isinstance(table, Tensor):
            raise ValueError(f"{name} must be a tensor (a table of shape (seqlen_ro, rotary_dim / 2)), got "
                             f"{type(table).__name__}")
        if not table.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {table.dtype}")
        if device is not None and table.device != device:
            raise ValueError(f"{name} is on {table.device} but x is on {device}")
        if table.ndim != 2 or table.shape != cos.shape:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), the same shape as {names[0]}, got "
                             f"{tuple(table.shape)}")
    if cos.shape[1] == 0:
        raise ValueError(f"{names[0]} and {names[1]} must have at least one column (rotary_dim >= 2)")
    return cos.shape[0], 2 * cos.shape[1]


def _check_offsets(seqlen_offsets: Offsets, batch: int, seqlen: int, seqlen_ro: int, device=None) -> None:
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.shape != (batch,):
            raise ValueError(
                f"seqlen_offsets tensor must have shape ({batch},), "
                f"got {tuple(seqlen_offsets.shape)}"
            )
        if seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets must be int32 or int64, got {seqlen_offsets.dtype}")
        if device is not None and seqlen_offsets.device != device:
            raise ValueError(f"seqlen_offsets is on {seqlen_offsets.device} but x is on {device}")
        # positions past the table are left unrotated (upstream's kernel); negative ones are errors
        # where values are checked (CPU tensors; on a GPU with FLASH_ATTN_DEBUG=1, as the attention's
        # are): elsewhere they too rotate nothing, as the kernel masks them
        if batch and validation.host_reads_values(seqlen_offsets):
            validation.check_values(seqlen_offsets.min() >= 0, ValueError, "seqlen_offsets must be >= 0")
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


def _check_args(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Offsets,
    cu_seqlens: Optional[Tensor],
    max_seqlen: Optional[int],
    table_names: Tuple[str, str] = ("cos", "sin"),
) -> int:
    """Validate the arguments of a rotation; return the (longest) sequence length."""
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise ValueError("x must be a floating-point tensor")
    seqlen_ro, rotary_dim = _check_table(cos, sin, x.device, table_names)
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
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of length batch + 1, got "
                             f"{validation._describe(cu_seqlens)}")
        if cu_seqlens.device != x.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but x is on {x.device}")
        if max_seqlen is None:
            raise ValueError("max_seqlen must be given together with cu_seqlens")
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)):
            raise ValueError(f"max_seqlen must be an int (the longest sequence), got {max_seqlen!r}")
        if max_seqlen < 0:
            raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
        batch, seqlen = cu_seqlens.shape[0] - 1, int(max_seqlen)
        if batch:
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            validation.check_values(
                (cu_seqlens[0] == 0) & (lengths.min() >= 0) & (lengths.max() <= seqlen) & (cu_seqlens[-1] <= x.shape[0]),
                ValueError, f"cu_seqlens must start at 0, be non-decreasing and end within x's {x.shape[0]} rows, "
                            f"with no sequence longer than max_seqlen ({seqlen}, the longest)")
    headdim = x.shape[-1]
    if rotary_dim > headdim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= headdim ({headdim})")
    _check_offsets(seqlen_offsets, batch, seqlen, seqlen_ro, x.device)
    return seqlen


def _rotate_torch(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Offsets,
    cu_seqlens: Optional[Tensor],
    interleaved: bool,
    inplace: bool,
    conjugate: bool = False,
) -> Tensor:
    """The rotation in PyTorch ops (differentiable in x, cos and sin); arguments already checked."""
    rotary_dim = 2 * cos.shape[1]
    dtype = _compute_dtype(x.dtype)
    if cu_seqlens is None:
        c, s = _angles_dense(cos, sin, x.shape[1], seqlen_offsets, dtype)
    else:
        c, s = _angles_varlen(cos, sin, cu_seqlens, x.shape[0], seqlen_offsets, dtype)
    if conjugate:
        s = -s
    x_rot = x[..., :rotary_dim].to(dtype)
    if inplace and dtype == x.dtype and (cos.requires_grad or sin.requires_grad):
        # The product with a differentiable table saves x_rot for backward; it must not be
        # the very memory we are about to overwrite.
        x_rot = x_rot.clone()
    rotated = rotate_pairs(x_rot, c, s, interleaved)
    if inplace:
        x[..., :rotary_dim].copy_(rotated)
        return x
    rotated = rotated.to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def apply_rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
) -> Tensor:
    """Rotate the first ``rotary_dim`` features of ``x`` by position (no autograd: see
    :func:`flash_attn.layers.rotary.apply_rotary_emb` for the differentiable function).

    Arguments:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total, nheads, headdim)`` with cu_seqlens.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)``.
        seqlen_offsets: int, or int32/int64 tensor ``(batch,)``, added to every token's position.
        cu_seqlens: ``(batch + 1,)`` sequence boundaries into ``total`` (positions restart at 0 in
            every sequence); needs ``max_seqlen``.
        interleaved: rotate pairs ``(2i, 2i + 1)`` (GPT-J) instead of ``(i, i + rotary_dim / 2)``.
        inplace: write the result into ``x``.
        conjugate: rotate by minus the angle (the gradient of the rotation).

    Returns:
        a tensor shaped like ``x`` (``x`` itself when ``inplace``).
    """
    seqlen = _check_args(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen)
    interleaved, inplace = validation.check_flag(interleaved, "interleaved"), validation.check_flag(inplace, "inplace")
    conjugate = validation.check_flag(conjugate, "conjugate")
    if _kernel_applies(x):
        return _rotate_triton(x, cos, sin, seqlen_offsets, cu_seqlens, seqlen, interleaved, inplace, conjugate)
    return _rotate_torch(x, cos, sin, seqlen_offsets, cu_seqlens, interleaved, inplace, conjugate)
