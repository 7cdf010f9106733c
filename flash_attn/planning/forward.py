"""The forward's plan: ``attn_fwd_kernel`` over query tiles, and for ``return_attn_probs`` (a
testing feature, not compiled ahead of time) ``attn_probs_kernel`` writing the probabilities."""

from __future__ import annotations

from typing import Optional

import torch

from flash_attn import limits
from flash_attn.limits import cdiv
from flash_attn.planning import configs, declarations
from flash_attn.planning.attention import (attention_constexprs, block_dims, call_slots, runs_exact_image,
                                           score_flags, shared_args, sizes)
from flash_attn.planning.launches import (Launch, Planned, Refusal, Target, finish, image_refusal, kernel_refusal, launch,
                                         named)
from flash_attn.planning.extents import Extent
from flash_attn.planning.layouts import Layouts, fits
from flash_attn.planning.shapes import ForwardShape, Slot, TensorInfo, info_aligned

__all__ = ["plan_forward", "KEY_EXTENTS", "shared_by_key_lengths", "shares_key_lengths"]

# What a dense forward's plan reads of its k and v beyond the shared key: the key length and their
# leading strides, as arguments of its one launch (planned from k and v where they lie, unprepared).
KEY_EXTENTS = {
    "seqlen_k": Extent("k", 1),
    **{f"stride_{t}{d}": Extent(t, i, stride=True) for t in "kv" for i, d in enumerate("bsh")},
}


def shared_by_key_lengths(s: ForwardShape) -> Optional[tuple]:
    """The key of a plan that serves every key length and k/v strides of ``s`` (its extents filled
    in per call, :mod:`flash_attn.planning.extents`), or ``None``: packed calls (shared already)
    and ``return_softmax`` (sized by the key length), k or v not read in place (:func:`_in_place`)."""
    if s.varlen is not None or s.return_softmax or not _in_place(s.k, s.v):
        return None
    k, v = s.k, s.v
    return s.q, (k.shape[0], k.shape[2:], k.dtype), (v.shape[0], v.shape[2:], v.dtype), s[3:]


def shares_key_lengths(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether dense k and v (4-d) are read as :func:`shared_by_key_lengths` asks, but for their
    pointers' alignment (which plan keys hold): every call whose k and v pass and differ only in
    their key length and strides has a plan from one template."""
    return _in_place(info_aligned(k), info_aligned(v))


def _in_place(k: TensorInfo, v: TensorInfo) -> bool:
    """k and v read where they lie (a copy into the kernels' layout takes its strides from the
    plan), their key length and strides within the kernels' int32."""
    return fits(k, "rows") and fits(v, "rows") and max(k.shape[1], *k.strides, *v.strides) <= limits.INT32_MAX


def _refusal(s: ForwardShape, head_dim: int, head_dim_v: int, paged: bool, target: Target):
    why = kernel_refusal(s.q.dtype, head_dim, target, head_dim_v)
    if why is None and target.aot and paged:
        why = Refusal("paged K/V in the varlen forward (not compiled ahead of time)")
    if why is None and target.aot and s.return_softmax:
        why = Refusal("return_attn_probs (a testing feature) is not compiled ahead of time")
    if why is None and target.aot and s.qv is not None:
        why = Refusal("qv (MLA's absorbed queries) in the forward (not compiled ahead of time; the KV-cache call's is)")
    if why is None and s.qv is not None and s.return_softmax:
        why = Refusal("return_attn_probs with qv")
    return why


def plan_forward(s: ForwardShape, target: Target) -> Planned:
    sz = sizes(s)
    why = _refusal(s, sz.head_dim, sz.head_dim_v, sz.paged, target)
    if why is not None:
        return why
    block_d, block_dv = block_dims(sz.head_dim, sz.head_dim_v, sz.features, target)
    why = image_refusal(target, block_d, block_dv, sz.features)
    if why is not None:
        return why
    flags = dict(score_flags(s.scalars, sz.features), IS_PAGED=sz.paged, HAS_QV=s.qv is not None,
                 PAD_HEADDIM=sz.head_dim != block_d or sz.head_dim_v != block_dv)
    exact_image = runs_exact_image("attn_fwd_kernel", target, sz.features, flags, block_d, s.q.dtype, block_dv)
    config = configs.pick("fwd", max(block_d, block_dv), target.family, sz.features, exact_image)

    lay = Layouts()
    q, k, v = lay.input("q", s.q, "rows"), lay.input("k", s.k, "rows"), lay.input("v", s.v, "rows")
    qv = lay.input("qv", s.qv, "rows") if s.qv is not None else None
    out = lay.buffer("out", (*s.q.shape[:-1], sz.head_dim_v), s.q.dtype, padded=True)
    lse_shape = (sz.nheads, s.q.shape[0]) if sz.packed else (sz.batch, sz.nheads, sz.seqlen_q)
    lse = lay.buffer("lse", lse_shape, torch.float32)
    slots = call_slots(lay, s, sz, lse)
    common = dict(shared_args(s, sz, lay, slots), BlockTable=slots.block_table,
                  stride_btb=lay.strides["block_table"][0] if sz.paged else 0,
                  page_size=s.k.shape[1] if sz.paged else 0)
    blocks = declarations.get("attn_fwd_kernel").tile_constexprs(block_d, config, target.family, block_dv)
    if s.qv is not None:
        blocks["BLOCK_DVOUT"] = block_dv  # qv is scored against all of v's columns (JIT only)
    grid = (cdiv(sz.seqlen_q, config.block_m) * sz.batch, sz.nheads)
    fwd_grid = (grid[0], grid[1] * (block_dv // blocks["BLOCK_DVOUT"]))
    launches = [launch("attn_fwd_kernel", fwd_grid, dict(
        common, Q=q, K=k, V=v, Out=out, LSE=lse, QV=qv, Sinks=slots.sinks, use_sinks=int(s.sinks is not None),
        **named("stride_q", "bsh", lay.rows("q")), **named("stride_k", "bsh", lay.rows("k")),
        **named("stride_v", "bsh", lay.rows("v")), **named("stride_o", "bsh", lay.rows("out")),
        **named("stride_qv", "bsh", lay.rows("qv") if qv is not None else (0, 0, 0))),
        attention_constexprs("attn_fwd_kernel", target, sz.features, flags, blocks, exact_image), config)]
    if not s.return_softmax:
        return finish(s.q.dtype, lay, launches, ("out", "lse"))
    probs_shape = (sz.batch, sz.nheads, sz.seqlen_q, sz.seqlen_k)
    probs_flags = {name: value for name, value in flags.items() if name != "HAS_QV"}
    launches.append(_probs_launch(lay, common, grid, probs_flags, block_d, config, target, probs_shape))
    return finish(s.q.dtype, lay, launches, ("out", "lse", "s_dmask"))


def _probs_launch(lay: Layouts, common: dict, grid: tuple, flags: dict, block_d: int, config: configs.Config,
                  target: Target, probs_shape: tuple) -> Launch:
    """The softmax probabilities ``(batch, nheads, seqlen_q, seqlen_k)`` into ``s_dmask`` (zeroed:
    the kernel writes only part of it), on the forward's tiles."""
    s_dmask = lay.buffer("s_dmask", probs_shape, torch.float32, zeroed=True)
    common = {name: value for name, value in common.items() if name != "head_dim_v"}
    return launch("attn_probs_kernel", grid, dict(
        common, Q=Slot("q"), K=Slot("k"), LSE=Slot("lse"), S=s_dmask,
        **named("stride_q", "bsh", lay.rows("q")), **named("stride_k", "bsh", lay.rows("k")),
        **named("stride_p", "bhs", lay.strides["s_dmask"][:3])),
        dict(flags, **declarations.get("attn_probs_kernel").tile_constexprs(block_d, config, target.family)), config)
