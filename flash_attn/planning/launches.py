"""What a plan is: the :class:`Target` it is made for, its launches (:class:`Launch`), the
:class:`Plan` itself, or a :class:`Refusal`; and how the stage planners put them together.

A launch names its kernel and gives every runtime argument by the name the kernel's ``def``
declares (:func:`launch` puts them in the kernel's order and fails loudly on a name missing or
unknown); tensors stand as :class:`~flash_attn.planning.shapes.Slot` names, filled per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from flash_attn import limits
from flash_attn.planning import configs, declarations, registry
from flash_attn.planning.layouts import Layouts
from flash_attn.planning.shapes import K_ROWS, Q_ROWS, Slot

__all__ = ["Target", "Launch", "Plan", "Refusal", "Planned", "PLANNER", "IMAGES", "DRIVER", "launch", "named",
           "kernel_refusal", "head_dim_refusal", "image_refusal", "finish"]


class Target(NamedTuple):
    """What a plan is made for: the launch configs of ``family`` (a GPU family of
    :mod:`flash_attn.planning.families`, or ``"interpret"``), the SM count the KV-cache split
    heuristic and the deterministic backward's splits fill, and ``aot``: launch only the
    specialisations an ahead-of-time build ships (flags folded into their exact supersets,
    :mod:`flash_attn.planning.declarations`)."""

    family: str
    sm_count: int
    aot: bool = False


@dataclass(frozen=True)
class Launch:
    """One kernel launch. ``args``: the kernel's runtime arguments in its order, ``(name, value)``
    with a :class:`~flash_attn.planning.shapes.Slot`, an int, a float or ``None`` (an unused
    pointer); ``constexprs``: every compile-time argument."""

    kernel: str
    grid: tuple
    args: tuple
    constexprs: dict
    config: configs.Config


@dataclass(frozen=True)
class Plan:
    dtype: torch.dtype  # the q/k/v element type
    prepare: tuple
    buffers: tuple
    launches: tuple
    results: tuple  # the slots the call returns, in order
    needs_seed: bool = False  # a launch reads the "seed" slot (the score-features kernels)
    rows: tuple = ()  # the Rows its buffers and launch arguments use (sizes read per call)


# Who refuses a call: the planner (these kernels, or the images it plans for, do not serve it),
# the ahead-of-time images of the device (none for it, no such specialisation, a value the image's
# signature cannot take), the driver (it cannot load the image).
PLANNER, IMAGES, DRIVER = "planner", "images", "driver"


@dataclass(frozen=True)
class Refusal:
    """Why a kernel backend cannot run a call, answered before anything runs (the dispatcher runs
    it elsewhere). ``reason``: the words users see; ``by``: who refused (:data:`PLANNER`,
    :data:`IMAGES` or :data:`DRIVER`); ``retry``: it may pass (an image load out of memory or
    during graph capture), so it is not kept: the next call of the same shape asks again."""

    reason: str
    by: str = PLANNER
    retry: bool = False

    def __post_init__(self):
        if self.by not in (PLANNER, IMAGES, DRIVER):
            raise ValueError(f"unknown refuser {self.by!r}")

    def __str__(self) -> str:
        return self.reason


Planned = Union[Plan, Refusal]


def launch(kernel: str, grid: tuple, values: dict, constexprs: dict, config: configs.Config) -> Launch:
    """The launch with ``values`` (every runtime argument by name) in the kernel's order."""
    names = registry.arg_names(kernel)
    missing = [n for n in names if n not in values and n not in constexprs]
    unknown = [n for n in (*values, *constexprs) if n not in names]
    if missing or unknown:
        raise KeyError(f"{kernel}: no value for {missing}, no parameter for {unknown}")
    args = tuple((n, values[n]) for n in names if n not in constexprs)
    return Launch(kernel, tuple(grid) + (1,) * (3 - len(grid)), args, dict(constexprs), config)


def named(prefix: str, suffixes: str, values) -> dict:
    """``{prefix + suffix: value}``: strides by the kernels' naming (``stride_qb``, ``stride_qs``, ...)."""
    return {prefix + suffix: int(value) for suffix, value in zip(suffixes, values)}


def kernel_refusal(dtype, head_dim: int, target: Target, head_dim_v: Optional[int] = None) -> Optional[Refusal]:
    """Why the kernels (or, for ``target.aot``, their images) cannot take q/k/v of ``dtype``,
    q/k's ``head_dim`` and v's ``head_dim_v`` (default ``head_dim``)."""
    if str(dtype) not in limits.KERNEL_DTYPES:
        return Refusal(f"{dtype} inputs (the kernels take fp16/bf16)")
    return head_dim_refusal(head_dim, target, head_dim_v)


def head_dim_refusal(head_dim: int, target: Target, head_dim_v: Optional[int] = None) -> Optional[Refusal]:
    """Why the kernels (or, for ``target.aot``, their images) cannot take q/k's ``head_dim`` and
    v's ``head_dim_v`` on ``target``'s family: the widest bucket, the family's refused buckets,
    the images' head-dim multiple."""
    for name, dim in (("head dimension", head_dim), ("head dimension of v", head_dim_v)):
        if dim is None:
            continue
        if dim > limits.MAX_HEADDIM:
            return Refusal(f"{name} {dim} > {limits.MAX_HEADDIM}")
        why = configs.refusal(dim, target.family)
        if why is not None:
            return Refusal(f"{name} {dim} on {target.family}: {why}")
        if target.aot and dim % limits.AOT_HEADDIM_MULTIPLE:
            return Refusal(f"{name} {dim} (the ahead-of-time kernels need a multiple of "
                           f"{limits.AOT_HEADDIM_MULTIPLE})")
    return None


def image_refusal(target: Target, block_d: int, block_dv: int, features: bool) -> Optional[Refusal]:
    """Why the ahead-of-time attention images of ``target`` hold no kernel of these head-dim blocks
    (and variant), or ``None`` (the JIT compiles any)."""
    if not target.aot or declarations.ships_head_dims(target.family, block_d, block_dv, features):
        return None
    widest = max(block_d, block_dv)
    if declarations.ships_head_dims(target.family, widest, widest):
        return Refusal(f"head dimension {widest} with softcap, ALiBi or dropout (its images are of plain calls only)")
    table = declarations.BUCKET_IMAGE_FAMILIES.get(widest, {})
    shipping = [name for name, ships in table.items() if ships]
    return Refusal(f"head dimension {widest} on {target.family} (compiled ahead of time for {', '.join(shipping)} "
                   f"only)")


def _grid_refusal(launches) -> Optional[Refusal]:
    for planned in launches:
        for axis, (n, limit) in enumerate(zip(planned.grid, limits.GRID_LIMITS)):
            if n > limit:
                return Refusal(f"{planned.kernel} needs {n} programs on grid axis {axis} (CUDA allows {limit})")
    return None


def finish(dtype, lay: Layouts, launches: list, results: tuple) -> Planned:
    """The plan of ``launches`` over the slots of ``lay``, returning ``results``; refused where a
    grid exceeds CUDA's limits."""
    why = _grid_refusal(launches)
    if why is not None:
        return why
    needs_seed = any(isinstance(v, Slot) and v == "seed" for planned in launches for _, v in planned.args)
    rows = tuple(r for r in (Q_ROWS, K_ROWS) if any(r in b.shape for b in lay.buffers)
                 or any(v is r for planned in launches for _, v in planned.args))
    return Plan(dtype, tuple(lay.prepare), tuple(lay.buffers), tuple(launches), results, needs_seed, rows)
