"""Plans shared by calls that differ only in their key length and k/v strides.

A decode loop that keeps its KV cache as growing tensors (Hugging Face's ``generate()`` calls
``flash_attn_func`` with the whole cache every step) makes a call whose key length, and so its
k/v strides, no earlier call had. Planning it afresh costs far more than running it, yet the plan
differs from the last step's only in the launch arguments that carry those numbers. A planner that
knows which arguments those are (:data:`flash_attn.planning.forward.KEY_EXTENTS`) offers a shared
key without them (:func:`flash_attn.planning.forward.shared_by_key_lengths`); the backends keep
one *template* per shared key (:func:`template`: the plan with an :class:`Extent` where each such
argument was) and fill in each call's numbers (:func:`filled`), which gives the very plan the
planner would make (tested against it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

from flash_attn.planning.launches import Plan

__all__ = ["Extent", "reader", "template", "filled"]


class Extent(NamedTuple):
    """A number of the call's tensor ``slot``: the size of dimension ``dim``, or its stride as the
    kernels use it (``stride``: 0 where the size is 1, as
    :func:`~flash_attn.planning.layouts.effective_strides` gives it)."""

    slot: str
    dim: int
    stride: bool = False

    def of(self, shape) -> int:
        """The number in a described call (a field of its shape)."""
        info = getattr(shape, self.slot)
        return self.read(info.shape, info.strides)

    def read(self, sizes, strides) -> int:
        """The number in a tensor of ``sizes`` and ``strides`` (the call's tensor ``slot``: a
        call of a class that leaves it to each call, :class:`flash_attn.params.KeyLengths`,
        is not described)."""
        size = sizes[self.dim]
        if not self.stride:
            return size
        return 0 if size == 1 else strides[self.dim]  # as effective_strides gives it


def reader(extents: tuple) -> Callable[[list], tuple]:
    """``[(sizes, strides) of tensor 0, ...] -> (the number of each of extents, ...)``, where
    ``extents`` are ``(tensor, Extent)`` pairs: :meth:`Extent.read` for several at once (a growing
    cache's every call: one Python call, not one per extent)."""
    reads = tuple((at, e.dim, e.stride) for at, e in extents)

    def numbers(read: list) -> tuple:
        out = []
        for at, dim, stride in reads:  # Extent.read's rule, inline
            sizes, strides = read[at]
            out.append((0 if sizes[dim] == 1 else strides[dim]) if stride else sizes[dim])
        return tuple(out)

    return numbers


def template(plan: Plan, extents: dict, shape) -> Optional[Plan]:
    """``plan`` (made for ``shape``) with the launch arguments named in ``extents`` (name ->
    :class:`Extent`) left to each call, or ``None`` when one of them does not hold what its extent
    reads from ``shape`` (the planner derived it some other way: no template may stand for the
    plan, and its calls are planned one by one; tests check the planners never do)."""
    launches = []
    for launch in plan.launches:
        args = []
        for name, value in launch.args:
            extent = extents.get(name)
            if extent is not None:
                if value != extent.of(shape):
                    return None
                value = extent
            args.append((name, value))
        launches.append(dataclasses.replace(launch, args=tuple(args)))
    return dataclasses.replace(plan, launches=tuple(launches))


def filled(plan: Plan, number: Callable[[Extent], int]) -> Plan:
    """A :func:`template` with each extent replaced by ``number(extent)`` (the call's: read from
    its shape or its tensors)."""
    def concrete(launch):
        args = tuple((name, number(value) if isinstance(value, Extent) else value) for name, value in launch.args)
        return dataclasses.replace(launch, args=args)

    return dataclasses.replace(plan, launches=tuple(concrete(launch) for launch in plan.launches))
