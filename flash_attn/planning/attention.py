"""What the forward and backward planners share: a call's sizes, its kernels' ``BLOCK_D`` and
flags, which image of a kernel runs it, and the slots and arguments every attention kernel takes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn.planning import configs, declarations
from flash_attn.planning.launches import Target
from flash_attn.planning.layouts import Layouts, alibi_batch_stride
from flash_attn.planning.shapes import Scalars, Slot, TensorInfo, is_local

__all__ = ["Sizes", "sizes", "uses_score_features", "block_dims", "score_flags", "runs_exact_image",
           "attention_constexprs", "CallSlots", "call_slots", "shared_args"]


class Sizes(NamedTuple):
    head_dim: int
    head_dim_v: int  # v's and the output's
    nheads: int
    nheads_k: int
    batch: int
    seqlen_q: int  # the longest sequence, varlen
    seqlen_k: int
    packed: bool  # varlen
    paged: bool
    features: bool  # softcap, ALiBi or dropout: the score-features variant


def sizes(s) -> Sizes:
    """The sizes of a forward or backward shape."""
    packed = s.varlen is not None
    if packed:
        batch, seqlen_q, seqlen_k = s.varlen.batch, s.varlen.max_seqlen_q, s.varlen.max_seqlen_k
    else:
        batch, seqlen_q, seqlen_k = s.q.shape[0], s.q.shape[1], s.k.shape[1]
    return Sizes(s.q.shape[-1], s.v.shape[-1], s.q.shape[-2], s.k.shape[-2], batch, seqlen_q, seqlen_k, packed,
                 packed and s.varlen.block_table is not None, uses_score_features(s.scalars, s.alibi is not None))


def uses_score_features(scalars: Scalars, alibi: bool) -> bool:
    """Softcap, ALiBi or dropout: the call runs the kernels' *score-features* variant (the three
    compiled in together, each switched at run time), which is also what the ahead-of-time build
    ships, so every backend runs the same kernel for such a call."""
    return scalars.softcap > 0.0 or alibi or scalars.dropout_p > 0.0


def block_dims(head_dim: int, head_dim_v: int, features: bool, target: Target) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_DV)``: q/k's and v's head dims padded to powers of two (at least 16; where
    the backward may split the wider one's columns over programs, at least 16 per program, so that
    each part is an MMA operand). Ahead of time: an image pair the build ships for the family
    (:func:`~flash_attn.planning.declarations.ships_head_dims`), each from the smallest head-dim
    bucket (of the score-features variant: its smallest, 64) up; where no image has the pair, the
    square image of the wider one (exact: the narrower one's columns are masked at run time)."""
    widest = configs.padded_headdim(max(head_dim, head_dim_v))
    low = 16 * max(1, widest // configs.GRADIENT_COLUMNS)
    block_d, block_dv = (max(low, configs.padded_headdim(d)) for d in (head_dim, head_dim_v))
    if target.aot:
        smallest = configs.FEATURE_BUCKETS[0] if features else configs.HEADDIM_BUCKETS[0]
        block_d, block_dv = max(block_d, smallest), max(block_dv, smallest)
        if not declarations.ships_head_dims(target.family, block_d, block_dv, features):
            block_d = block_dv = max(block_d, block_dv)
    return block_d, block_dv


def score_flags(scalars: Scalars, features: bool) -> dict:
    """The flags of the scores every attention kernel has (the call's own, before any image folds them)."""
    return dict(IS_LOCAL=is_local(scalars), HAS_SOFTCAP=features, HAS_ALIBI=features, HAS_DROPOUT=features)


def runs_exact_image(kernel: str, target: Target, features: bool, flags: dict, block_d: int,
                     dtype: torch.dtype, block_dv: int) -> bool:
    """Whether the call runs its kernel's exact-call specialisation, in that image's launch config
    (``configs.pick(..., exact=True)``): on the JIT any lean call with the exact flags, ahead of
    time where that image ships."""
    decl = declarations.get(kernel)
    if features or not decl.serves_exactly(flags):
        return False
    return not target.aot or decl.ships_exact_image(target.family, block_d, dtype, block_dv)


def attention_constexprs(kernel: str, target: Target, features: bool, flags: dict, blocks: dict,
                         exact_image: bool) -> dict:
    """The constexprs of an attention launch: the call's own flags (JIT), or the shipped image's:
    the exact-call image (``exact_image``: :func:`runs_exact_image`), else the folded superset."""
    if not target.aot:
        return {**flags, **blocks}
    decl = declarations.get(kernel)
    if exact_image:
        return {**decl.exact_constexprs(), **blocks}
    return {**decl.aot_constexprs(features), **blocks}


class CallSlots(NamedTuple):
    """The slots of a call's sequence bounds, pages, ALiBi slopes and dropout seed, and the
    (batch, head) strides of its lse. A pointer the call lacks stands as another slot of the
    right type that the kernel does not read (lse for the slopes), or ``None`` where no image reads it."""

    cu_q: Slot
    cu_k: Slot
    block_table: Optional[Slot]
    alibi: Optional[Slot]
    seed: Optional[Slot]
    lse_strides: tuple
    sinks: Slot  # the forward's attention sinks (lse where the call has none: not read)


def call_slots(lay: Layouts, s, sz: Sizes, lse: Slot) -> CallSlots:
    if sz.packed:
        cu_q, cu_k = lay.input("cu_q", s.varlen.cu_q, "plain"), lay.input("cu_k", s.varlen.cu_k, "plain")
    else:
        cu_q = cu_k = lay.buffer("no_cu", (1,), torch.int32, unused=True)  # not read (packed = 0)
    block_table = lay.input("block_table", s.varlen.block_table, "plain") if sz.paged else None
    alibi = lay.input("alibi", s.alibi, "plain") if s.alibi is not None else (lse if sz.features else None)
    seed = _seed_slot(lay, s.seed, sz.features)
    lse_strides = tuple(lay.strides["lse"][:2]) if not sz.packed else (0, lay.strides["lse"][0])
    sinks = getattr(s, "sinks", None)
    sinks = lay.input("sinks", sinks, "plain") if sinks is not None else lse
    return CallSlots(cu_q, cu_k, block_table, alibi, seed, lse_strides, sinks)


def _seed_slot(lay: Layouts, seed: Optional[TensorInfo], features: bool) -> Optional[Slot]:
    """The dropout seed (an int64 on the device): read only by the score-features kernels, and
    only when ``dropout_p > 0``; the call always provides one (:func:`seed_tensor`)."""
    if not features:
        return None
    if seed is None:
        return Slot("seed")
    return lay.input("seed", seed, "plain")


def shared_args(s, sz: Sizes, lay: Layouts, slots: CallSlots) -> dict:
    """The arguments every attention kernel (forward, backward) takes alike."""
    sc = s.scalars
    return dict(
        CuSeqlensQ=slots.cu_q, CuSeqlensK=slots.cu_k, AlibiSlopes=slots.alibi, DropoutSeed=slots.seed,
        stride_lb=slots.lse_strides[0], stride_lh=slots.lse_strides[1], stride_ab=alibi_batch_stride(lay, s.alibi),
        seqlen_q=sz.seqlen_q, seqlen_k=sz.seqlen_k, group=sz.nheads // sz.nheads_k, head_dim=sz.head_dim,
        head_dim_v=sz.head_dim_v, packed=int(sz.packed), use_alibi=int(s.alibi is not None), softmax_scale=sc.softmax_scale,
        softcap=sc.softcap, window_left=sc.window_left, window_right=sc.window_right, dropout_p=sc.dropout_p,
    )
