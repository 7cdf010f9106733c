"""Moving between padded ``(batch, seqlen, ...)`` tensors and packed variable-length ones.

The packed ("unpadded") layout keeps only the selected tokens, concatenated sequence after
sequence, and describes the sequence boundaries with ``cu_seqlens``: an int32 vector of length
``nseq + 1`` starting at 0 whose consecutive differences are the sequence lengths. This is the
layout the ``*_varlen_*`` attention functions take.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from flash_attn import validation

__all__ = [
    "IndexFirstAxis",
    "IndexFirstAxisResidual",
    "IndexPutFirstAxis",
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")


def _check_indices(indices: torch.Tensor, size: Optional[int] = None, of: str = "", data=None,
                   data_name: str = "") -> None:
    """A 1-D int32/int64 tensor; on ``data``'s device when given; every index in ``[0, size)``
    (``of``: what ``size`` counts) when ``size`` is given: checked on the host for CPU tensors, on
    the device otherwise (:func:`flash_attn.validation.check_values`)."""
    if not isinstance(indices, torch.Tensor) or indices.ndim != 1:
        raise ValueError("indices must be a 1-D integer tensor")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
    if data is not None and indices.device != data.device:
        raise ValueError(f"indices is on {indices.device} but {data_name} is on {data.device}")
    if size is not None and indices.numel():
        validation.check_values((indices.min() >= 0) & (indices.max() < size), IndexError,
                                f"indices must lie in [0, {size}) ({of}), got one outside")


class IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along dim 0; the backward scatters (and sums) into zeros."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        _check_tensor(input, "input")
        if input.ndim < 1:
            raise ValueError("index_first_axis needs an input with at least one dimension")
        _check_indices(indices, input.shape[0], "input's rows", input, "input")
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        grad_input = grad_output.new_zeros((ctx.first_axis_dim, *grad_output.shape[1:]))
        # index_add (not a plain scatter) so repeated indices accumulate their gradients.
        grad_input.index_add_(0, indices, grad_output)
        return grad_input, None


class IndexPutFirstAxis(torch.autograd.Function):
    """A ``(first_axis_dim, ...)`` tensor of zeros with ``out[indices] = values``."""

    @staticmethod
    def forward(
        ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int
    ) -> torch.Tensor:
        _check_tensor(values, "values")
        first_axis_dim = validation.check_int(first_axis_dim, "first_axis_dim", minimum=0)
        _check_indices(indices, first_axis_dim, "first_axis_dim", values, "values")
        if values.ndim < 1 or values.shape[0] != indices.shape[0]:
            raise ValueError(
                f"values must have one row per index: got values of shape {tuple(values.shape)}"
                f" and {indices.shape[0]} indices"
            )
        ctx.save_for_backward(indices)
        output = values.new_zeros((first_axis_dim, *values.shape[1:]))
        # index_copy_ takes int64 indices only; transformers hands over int32 ones.
        output.index_copy_(0, indices.long(), values)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad_output.index_select(0, indices), None, None


class IndexFirstAxisResidual(torch.autograd.Function):
    """Like :class:`IndexFirstAxis` but also returns ``input`` itself (detached) as a residual.

    Gradients arriving through the gathered rows and through the residual are added up.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor):
        _check_tensor(input, "input")
        if input.ndim < 1:
            raise ValueError("index_first_axis_residual needs an input with at least one dimension")
        _check_indices(indices, input.shape[0], "input's rows", input, "input")
        ctx.save_for_backward(indices)
        # Detached so autograd does not see the residual as a view of an input it must track.
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, grad_residual: torch.Tensor):
        (indices,) = ctx.saved_tensors
        grad_input = grad_residual.clone()
        grad_input.index_add_(0, indices, grad_output)
        return grad_input, None


index_first_axis = IndexFirstAxis.apply
index_put_first_axis = IndexPutFirstAxis.apply
index_first_axis_residual = IndexFirstAxisResidual.apply


def _check_padded(hidden_states: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    _check_tensor(hidden_states, "hidden_states")
    _check_tensor(mask, name)
    if mask.device != hidden_states.device:
        raise ValueError(f"{name} is on {mask.device} but hidden_states is on {hidden_states.device}")
    if mask.ndim != 2:
        raise ValueError(f"{name} must have shape (batch, seqlen), got {tuple(mask.shape)}")
    if hidden_states.ndim < 2 or tuple(hidden_states.shape[:2]) != tuple(mask.shape):
        raise ValueError(
            f"hidden_states must have shape (batch, seqlen, ...) = {tuple(mask.shape)} + (...), "
            f"got {tuple(hidden_states.shape)}"
        )


def _flatten_tokens(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states.reshape(-1, *hidden_states.shape[2:])


def _max_as_int(seqlens: torch.Tensor) -> int:
    return int(seqlens.max().item()) if seqlens.numel() > 0 else 0


def unpad_input(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    unused_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Pack the selected tokens of a padded batch.

    Arguments:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)`` bool or integer; nonzero marks a real token.
        unused_mask: optional ``(batch, seqlen)``; nonzero marks a slot that is kept in the
            packed tensor (allocated) but is not a real token, e.g. room reserved after a
            sequence. Such slots count toward ``cu_seqlens`` / ``max_seqlen`` but not toward
            ``seqused``, so they should come after the real tokens of their row.

    Returns ``(packed, indices, cu_seqlens, max_seqlen, seqused)``:
        packed: ``(total, ...)`` rows of ``hidden_states`` selected by mask or unused_mask, in
            row-major order.
        indices: ``(total,)`` int64 positions of those rows in the flattened ``batch * seqlen``.
        cu_seqlens: ``(batch + 1,)`` int32, cumulative kept lengths with a leading 0.
        max_seqlen: Python int, the longest kept length.
        seqused: ``(batch,)`` int32, the number of real (attention_mask) tokens per row.
    """
    _check_padded(hidden_states, attention_mask, "attention_mask")
    used = attention_mask != 0
    kept = used
    if unused_mask is not None:
        _check_tensor(unused_mask, "unused_mask")
        if unused_mask.device != attention_mask.device:
            raise ValueError(f"unused_mask is on {unused_mask.device} but attention_mask is on {attention_mask.device}")
        if tuple(unused_mask.shape) != tuple(attention_mask.shape):
            raise ValueError(
                f"unused_mask must have the shape of attention_mask {tuple(attention_mask.shape)},"
                f" got {tuple(unused_mask.shape)}"
            )
        # A slot marked in both masks is one kept token (counted as used), not two.
        kept = used | (unused_mask != 0)
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    packed = index_first_axis(_flatten_tokens(hidden_states), indices)
    return packed, indices, cu_seqlens, _max_as_int(seqlens), seqused


def unpad_input_for_concatenated_sequences(
    hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Pack rows that each hold several sequences laid end to end (sequence packing).

    ``attention_mask_in_length`` is ``(batch, seqlen)`` integer: row ``b`` lists the lengths of
    the sequences packed into row ``b`` of ``hidden_states`` (left-aligned, in order), followed
    by zeros. E.g. ``[[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]]`` means row 0 holds a length-2 then a
    length-3 sequence followed by one padding slot, and row 1 holds one length-6 sequence.

    Returns ``(packed, indices, cu_seqlens, max_seqlen)``; ``cu_seqlens`` has one entry per
    packed *sequence* plus the leading 0 (not ``batch + 1``).
    """
    _check_padded(hidden_states, attention_mask_in_length, "attention_mask_in_length")
    lengths = attention_mask_in_length
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(
            f"attention_mask_in_length must be an integer tensor of lengths, got {lengths.dtype}"
        )
    seqlen = lengths.shape[1]
    row_total = lengths.sum(dim=-1)
    validation.check_values(((lengths >= 0).all() & (row_total <= seqlen).all()), ValueError,
                            "attention_mask_in_length must hold non-negative lengths summing to at most seqlen "
                            "per row")
    positions = torch.arange(seqlen, device=lengths.device)
    token_mask = positions.unsqueeze(0) < row_total.unsqueeze(1)
    flat_lengths = lengths.flatten()
    seqlens = flat_lengths[flat_lengths != 0]
    indices = torch.nonzero(token_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    packed = index_first_axis(_flatten_tokens(hidden_states), indices)
    return packed, indices, cu_seqlens, _max_as_int(seqlens)


def pad_input(
    hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int
) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: scatter ``(total, ...)`` rows to ``(batch, seqlen, ...)``.

    ``indices`` are positions in the flattened ``batch * seqlen`` axis (as returned by
    ``unpad_input``); every other position is zero.
    """
    _check_tensor(hidden_states, "hidden_states")
    batch = validation.check_int(batch, "batch", minimum=0)
    seqlen = validation.check_int(seqlen, "seqlen", minimum=0)
    _check_indices(indices, batch * seqlen, "batch * seqlen", hidden_states, "hidden_states")
    if hidden_states.ndim < 1 or hidden_states.shape[0] != indices.shape[0]:
        raise ValueError(
            f"hidden_states must have one row per index: got {tuple(hidden_states.shape)} and "
            f"{indices.shape[0]} indices"
        )
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])
