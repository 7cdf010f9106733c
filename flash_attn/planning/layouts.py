"""Layouts: the strides the kernels see for each tensor of a plan, and what makes them so.

An input the kernels cannot address as it is laid out is copied into their layout first (a
:class:`Prepare` of the plan); a tensor the call allocates is a :class:`Buffer`. The kernels
address every tensor by its slot's strides, with the last dimension contiguous and, in the
``"rows"`` layout the ahead-of-time images assume, the other strides multiples of 8 elements and
the data 16-byte aligned (:data:`flash_attn.limits.STRIDE_MULTIPLE`, ``POINTER_ALIGNMENT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flash_attn import limits
from flash_attn.limits import cdiv
from flash_attn.planning.shapes import Rows, Slot, TensorInfo

__all__ = ["Buffer", "Prepare", "Layouts", "effective_strides", "fits", "padded_shape", "alibi_batch_stride"]


@dataclass(frozen=True)
class Buffer:
    """A tensor the call allocates: ``padded``: the last dimension rounded up to a multiple of 8
    (the kernels' layout) and the slot a view of its first ``shape[-1]`` columns; ``zeroed``:
    filled with zeros (the kernel writes only part of it); ``unused``: never read nor written
    (any tensor of that type will do)."""

    slot: str
    shape: tuple
    dtype: torch.dtype
    padded: bool = False
    zeroed: bool = False
    unused: bool = False  # a pointer no launch reads (a placeholder of the right type)

    @property
    def storage(self) -> tuple:
        """The shape allocated (the slot is a view of its first ``shape[-1]`` columns)."""
        return padded_shape(self.shape) if self.padded else self.shape


@dataclass(frozen=True)
class Prepare:
    """Bring input ``source`` (default: ``slot``) into the layout the kernels read, as ``slot``:

    * ``"rows"``: strides but the last multiples of 8 elements, last dimension contiguous, aligned;
    * ``"plain"``: last dimension contiguous, aligned;
    * ``"contiguous"``: contiguous and aligned;
    * ``"fp32"``: as ``"plain"``, in float32;
    * ``"column"``: as ``"plain"``, viewed as one column ``(n, 1)``.
    """

    slot: str
    how: str
    source: Optional[str] = None




def effective_strides(t: TensorInfo) -> tuple:
    """Strides as the kernels use them: a dimension of size 1 is only ever indexed at 0, so its
    stride is irrelevant and given as 0 (it neither costs a copy nor breaks a multiple-of-8 rule)."""
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.strides))


_STRIDE_MULTIPLE = limits.STRIDE_MULTIPLE


def fits(t: TensorInfo, how: str) -> bool:
    """Whether the kernels read ``t`` where it lies, laid out ``how`` (its :func:`effective_strides`;
    "rows" is asked per call of a growing cache's new key length: no tuple built for it)."""
    if not t.aligned:
        return False
    shape, strides = t.shape, t.strides
    if shape and shape[-1] != 1 and strides[-1] not in (0, 1):
        return False
    if how == "rows":  # (a loop: ~3x faster than all() over a generator)
        for n, s in zip(shape[:-1], strides[:-1]):
            if s % _STRIDE_MULTIPLE and n != 1:
                return False
        return True
    if how == "contiguous":
        return effective_strides(t) == effective_strides(TensorInfo(t.shape, _contiguous(t.shape), t.dtype, True))
    if how == "fp32":
        return t.dtype == torch.float32
    return True


def _contiguous(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        if step is None:
            raise ValueError(f"no stride is known outside a per-call row count in {shape}")
        strides.append(step)
        if isinstance(n, Rows) or isinstance(step, Rows):
            # packed rows come first (q-like: no stride outside them) or alone last (lse (h, rows):
            # the head stride is the row count)
            step = n if step == 1 else None
        else:
            step *= max(n, 1)
    return tuple(reversed(strides))


def padded_shape(shape) -> tuple:
    """The storage of a ``padded`` buffer: the last dimension rounded up to a multiple of 8."""
    return (*shape[:-1], cdiv(shape[-1], 8) * 8) if shape else shape


def _padded_strides(shape) -> tuple:
    return _contiguous(padded_shape(shape))


class Layouts:
    """The strides the kernels will see for each slot of one plan, and the preparations that
    produce them."""

    def __init__(self):
        self.strides: dict[str, tuple] = {}
        self.prepare: list[Prepare] = []
        self.buffers: list[Buffer] = []

    def input(self, slot: str, t: TensorInfo, how: str) -> Slot:
        if fits(t, how):
            self.strides[slot] = effective_strides(t)
        else:
            self.prepare.append(Prepare(slot, how))
            shape = t.shape
            strides = _padded_strides(shape) if how == "rows" else _contiguous(shape)
            self.strides[slot] = effective_strides(TensorInfo(shape, strides, t.dtype, True))
        return Slot(slot)

    def column(self, slot: str, source: str, t: TensorInfo) -> Slot:
        self.prepare.append(Prepare(slot, "column", source))
        self.strides[slot] = (1, 0)
        return Slot(slot)

    def output(self, slot: str, given: Optional[TensorInfo], shape: tuple, dtype) -> Slot:
        """A result the kernels write: the caller's tensor (``given``, the call's slot) where laid
        out as they write it (``"rows"``), else a padded buffer."""
        if given is not None and fits(given, "rows"):
            self.strides[slot] = effective_strides(given)
            return Slot(slot)
        return self.buffer(slot, shape, dtype, padded=True)

    def buffer(self, slot: str, shape: tuple, dtype, padded: bool = False, zeroed: bool = False,
               unused: bool = False) -> Slot:
        self.buffers.append(Buffer(slot, tuple(shape), dtype, padded, zeroed, unused))
        strides = _padded_strides(shape) if padded else _contiguous(shape)
        self.strides[slot] = effective_strides(TensorInfo(tuple(shape), strides, dtype, True))
        return Slot(slot)

    def rows(self, slot: str) -> list:
        """(batch, row, head) strides of a q-like tensor: ``(b, s, h, d)``, or packed ``(total, h, d)``
        with batch stride 0; a page pool ``(pages, page_size, h, d)`` gives (page, slot, head)."""
        s = self.strides[slot]
        return list(s[:3]) if len(s) == 4 else [0, s[0], s[1]]


def alibi_batch_stride(lay: Layouts, alibi: Optional[TensorInfo]) -> int:
    return lay.strides["alibi"][0] if alibi is not None and len(alibi.shape) == 2 else 0
