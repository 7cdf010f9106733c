"""The backward's plan: Delta (the preprocess), then either the fused backward (one program per
key block writes dK/dV and adds its dQ share into fp32 sums, which the convert kernel adds up)
or, for ``deterministic=True`` where the fused one cannot keep the GPU busy with its splits, and
where it has no config, the split kernels (dK/dV over key blocks, dQ over query blocks)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn.limits import cdiv
from flash_attn.planning import configs, declarations
from flash_attn.planning.attention import (CallSlots, Sizes, attention_constexprs, block_dims, call_slots,
                                           runs_exact_image, score_flags, shared_args, sizes)
from flash_attn.planning.launches import (Launch, Planned, Refusal, Target, finish, image_refusal, kernel_refusal, launch,
                                         named)
from flash_attn.planning.layouts import Layouts
from flash_attn.planning.shapes import BackwardShape, Slot

__all__ = ["plan_backward"]

_ROWS = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")


class _Backward(NamedTuple):
    """One backward call as its launches see it: sizes, ``BLOCK_D``/``BLOCK_DV`` (of the
    score-features variant where the call has one; ``lean_blocks``: the preprocess and convert
    kernels', which have none), the call's flags, the slots and their (batch, row, head) strides,
    the arguments every dK/dV/dQ kernel takes, and ``pre``: the tiles of the preprocess and
    convert kernels."""

    s: BackwardShape
    target: Target
    sz: Sizes
    block_d: int
    block_dv: int
    lean_blocks: tuple
    flags: dict
    lay: Layouts
    rows: dict
    slots: CallSlots
    common: dict
    pre: configs.Config

    @property
    def config_dim(self) -> int:
        """The head dim whose launch configs size the dK/dV and dQ tiles: the wider block's."""
        return max(self.block_d, self.block_dv)


class _Accumulator(NamedTuple):
    """The fused backward's fp32 dQ sums: ``splits`` Q-shaped buffers, interleaved per row
    (``(b, s, splits, h, d)`` or ``(total, splits, h, d)``): their (batch, row, head) strides and
    the elements from one split's sums to the next."""

    slot: Slot
    rows: tuple
    splits: int
    split_stride: int


def plan_backward(s: BackwardShape, target: Target) -> Planned:
    sz = sizes(s)
    why = kernel_refusal(s.q.dtype, sz.head_dim, target, sz.head_dim_v)
    if why is None and sz.paged:
        why = Refusal("the backward of paged K/V (pages may be shared between sequences, which needs atomics)")
    if why is None and s.qv is not None:
        why = Refusal("the backward of qv (MLA's absorbed queries; FlashAttention-3 has none either)")
    if why is not None:
        return why
    call = _backward_call(s, target, sz)
    why = image_refusal(target, call.block_d, call.block_dv, sz.features)
    if why is not None:
        return why
    fused_exact = runs_exact_image("attn_bwd_kernel", target, sz.features, call.flags, call.block_d, s.q.dtype,
                                   call.block_dv)
    fused = configs.fused_backward(call.config_dim, target.family, sz.features, fused_exact)
    splits = 0  # deterministic=False: one program per key block
    if fused is not None and s.deterministic:
        programs_per_split = sz.batch * sz.nheads_k * _parts(call, _tiles(call, "attn_bwd_kernel", fused))
        splits = _deterministic_splits(fused, target, cdiv(sz.seqlen_k, fused.block_n), programs_per_split)
        fused = fused if splits else None
    launches = _split_launches(call) if fused is None else _fused_launches(call, fused, fused_exact, splits)
    return finish(s.q.dtype, call.lay, launches, ("dq", "dk", "dv", "delta") if s.delta else ("dq", "dk", "dv"))


def _backward_call(s: BackwardShape, target: Target, sz: Sizes) -> _Backward:
    """Lays out the call's inputs and results (in this order: the order of its preparations and buffers)."""
    block_d, block_dv = block_dims(sz.head_dim, sz.head_dim_v, sz.features, target)
    lay = Layouts()
    for name in ("q", "k", "v", "dout", "out"):
        lay.input(name, getattr(s, name), "rows")
    # Delta is allocated like lse and the kernels address both with one pair of strides
    lse = lay.input("lse", s.lse, "contiguous")
    delta = lay.buffer("delta", s.lse.shape, torch.float32)
    for name, given, like in zip(("dq", "dk", "dv"), s.grads or (None, None, None), (s.q, s.k, s.v)):
        lay.output(name, given, like.shape, like.dtype)
    slots = call_slots(lay, s, sz, lse)
    rows = {name: lay.rows(name) for name in _ROWS}
    common = dict(
        shared_args(s, sz, lay, slots), Q=Slot("q"), K=Slot("k"), V=Slot("v"), dOut=Slot("dout"), LSE=lse,
        Delta=delta, **named("stride_q", "bsh", rows["q"]), **named("stride_k", "bsh", rows["k"]),
        **named("stride_v", "bsh", rows["v"]), **named("stride_do", "bsh", rows["dout"])
    )
    flags = dict(score_flags(s.scalars, sz.features), PAD_HEADDIM=sz.head_dim != block_d or sz.head_dim_v != block_dv)
    lean_blocks = block_dims(sz.head_dim, sz.head_dim_v, False, target)
    return _Backward(s, target, sz, block_d, block_dv, lean_blocks, flags, lay, rows, slots, common,
                     configs.pick("fwd", max(lean_blocks), target.family))


def _split_launches(call: _Backward) -> list:
    """Delta, then dK/dV over key blocks and dQ over query blocks (no atomics)."""
    sz, family = call.sz, call.target.family
    dkdv = configs.pick("bwd_dkdv", call.config_dim, family, sz.features)
    dq = configs.pick("bwd_dq", call.config_dim, family, sz.features)
    return [
        _preprocess(call, None),
        _attention_launch(call, "attn_bwd_dkdv_kernel", dkdv, True, _dkdv_args(call)),
        _attention_launch(call, "attn_bwd_dq_kernel", dq, False,
                          dict(call.common, dQ=Slot("dq"), **named("stride_dq", "bsh", call.rows["dq"]))),
    ]


def _fused_launches(call: _Backward, fused: configs.Config, exact_image: bool, splits: int) -> list:
    """Delta with the dQ sums zeroed, the fused backward adding dQ into them in fp32 (by atomic
    adds; per split where deterministic, ``splits`` > 0), then the sums added up, scaled and
    rounded into dq."""
    acc = _accumulator(call.lay, call.s.q.shape, max(splits, 1))
    key_programs = splits or cdiv(call.sz.seqlen_k, fused.block_n)
    values = dict(_dkdv_args(call), dQAccum=acc.slot, **named("stride_dq", "bsh", acc.rows), splits=key_programs,
                  split_stride=acc.split_stride)
    return [
        _preprocess(call, acc),
        _attention_launch(call, "attn_bwd_kernel", fused, True, values, exact_image, key_programs),
        _convert_launch(call, acc),
    ]


def _dkdv_args(call: _Backward) -> dict:
    return dict(call.common, dK=Slot("dk"), dV=Slot("dv"), **named("stride_dk", "bsh", call.rows["dk"]),
                **named("stride_dv", "bsh", call.rows["dv"]))


def _preprocess(call: _Backward, accum: Optional[_Accumulator]) -> Launch:
    """Delta, and the fused backward's dQ sums zeroed (``accum``). None: nothing to zero, and
    ``delta`` stands in for the pointer the kernel then does not write (no allocation)."""
    sz, pre = call.sz, call.pre
    acc = accum or _Accumulator(Slot("delta"), (0, 0, 0), 0, 0)
    return launch("attn_bwd_preprocess_kernel", (cdiv(sz.seqlen_q, pre.block_m) * sz.batch, sz.nheads), dict(
        Out=Slot("out"), dOut=Slot("dout"), Delta=Slot("delta"), dQAccum=acc.slot, CuSeqlensQ=call.slots.cu_q,
        **named("stride_o", "bsh", call.rows["out"]), **named("stride_do", "bsh", call.rows["dout"]),
        stride_lb=call.slots.lse_strides[0], stride_lh=call.slots.lse_strides[1],
        **named("stride_a", "bsh", acc.rows), seqlen_q=sz.seqlen_q, head_dim=sz.head_dim, head_dim_v=sz.head_dim_v,
        packed=int(sz.packed), slices=acc.splits, split_stride=acc.split_stride),
        dict(BLOCK_M=pre.block_m, BLOCK_D=call.lean_blocks[0], BLOCK_DV=call.lean_blocks[1]), pre)


def _convert_launch(call: _Backward, acc: _Accumulator) -> Launch:
    """The dQ sums added up, scaled and rounded into dq."""
    sz, pre = call.sz, call.pre
    return launch("attn_bwd_dq_convert_kernel", (cdiv(sz.seqlen_q, pre.block_m) * sz.batch, sz.nheads), dict(
        dQAccum=acc.slot, dQ=Slot("dq"), CuSeqlensQ=call.slots.cu_q, **named("stride_a", "bsh", acc.rows),
        **named("stride_dq", "bsh", call.rows["dq"]), seqlen_q=sz.seqlen_q, head_dim=sz.head_dim,
        packed=int(sz.packed), slices=acc.splits, split_stride=acc.split_stride,
        softmax_scale=call.s.scalars.softmax_scale),
        dict(BLOCK_M=pre.block_m, BLOCK_D=call.lean_blocks[0]), pre)


def _tiles(call: _Backward, kernel: str, config: configs.Config) -> dict:
    return declarations.get(kernel).tile_constexprs(call.block_d, config, call.target.family, call.block_dv)


def _parts(call: _Backward, blocks: dict) -> int:
    """Programs per key block: the head-dim split of the dK/dV programs."""
    return call.block_d // blocks.get("BLOCK_DOUT", call.block_d)


def _attention_launch(call: _Backward, kernel: str, config: configs.Config, per_key_block: bool, values: dict,
                      exact_image: bool = False, key_programs: int = 0) -> Launch:
    """A dK/dV (``per_key_block``) or dQ launch. ``key_programs``: programs per batch entry and kv
    head along the keys (0: one per key block)."""
    sz, blocks = call.sz, _tiles(call, kernel, config)
    if per_key_block:
        grid = ((key_programs or cdiv(sz.seqlen_k, config.block_n)) * sz.batch, sz.nheads_k * _parts(call, blocks))
    else:
        grid = (cdiv(sz.seqlen_q, config.block_m) * sz.batch, sz.nheads)
    constexprs = attention_constexprs(kernel, call.target, sz.features, call.flags, blocks, exact_image)
    return launch(kernel, grid, values, constexprs, config)


def _accumulator(lay: Layouts, q_shape: tuple, splits: int) -> _Accumulator:
    shape = (*q_shape[:-2], splits, *q_shape[-2:])
    slot = lay.buffer("dq_accum", shape, torch.float32, padded=True)
    strides = lay.strides["dq_accum"]
    rows = (strides[0], strides[1], strides[3]) if len(shape) == 5 else (0, strides[0], strides[2])
    return _Accumulator(slot, rows, splits, strides[-3])


def _deterministic_splits(fused: configs.Config, target: Target, key_blocks: int, programs_per_split: int) -> int:
    """How many splits run ``deterministic=True`` through the fused backward, or 0 for the split
    kernels: enough to give every SM a program (:data:`configs.DETERMINISTIC_SPLITS` at most, no
    more than the key blocks). The fused kernel does 5/7 of the split kernels' products, so it
    runs where its programs keep at least 3/4 of the SMs busy (or all the key blocks); not
    where dQ goes by TMA bulk reductions (asynchronous: no fixed order)."""
    most = configs.deterministic_splits(target.family)
    if most <= 0 or fused.dq_tma:
        return 0
    splits = min(key_blocks, most, cdiv(target.sm_count, programs_per_split))
    busy = min(target.sm_count, key_blocks * programs_per_split)
    return splits if 4 * splits * programs_per_split >= 3 * busy else 0
