"""Call shapes: one attention call reduced to what its launches depend on.

:func:`describe_forward`, :func:`describe_backward` and :func:`describe_kvcache` keep the dtypes,
sizes, strides, alignment and scalar options of a call, and nothing that changes between two
calls of the same layout (tensor data, the dropout seed): a shape is the key under which the
backends cache a plan, so these run on every call and stay cheap.

Packed (varlen) calls are described so that the batches of packed training share plans: the
total row counts of q and k are left to the call (:class:`Rows`, read from the tensors per call)
and the longest sequences are rounded up (:func:`bucket_seqlen`); the kernels find each
sequence's bounds in ``cu_seqlens`` at run time, so a plan serves every batch with the same
number of sequences, layouts and options.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from flash_attn import limits
from flash_attn.limits import cdiv
from flash_attn.params import window_applies

__all__ = [
    "Slot", "Rows", "Q_ROWS", "K_ROWS", "TensorInfo", "info", "info_aligned", "VarlenInfo", "Scalars", "ForwardShape",
    "BackwardShape", "KVCacheShape", "describe_forward", "describe_backward", "describe_kvcache", "bucket_seqlen",
    "is_local",
]


class Slot(str):
    """A tensor of the call, by name (an input, a prepared copy, or a buffer of the plan)."""

    __slots__ = ()


class Rows:
    """The row count (dim 0) of the call's packed input ``slot``: a size known per call, not per
    plan. It stands where a varlen plan would hold the total tokens: a buffer's dim 0, the lse
    head stride (a launch argument), a packed tensor's shape; the backends read it from the
    call's tensor (:func:`flash_attn.backends._execute.slots`). No arithmetic is defined on it,
    so a size the planner derives from it fails loudly. Two instances exist (:data:`Q_ROWS`,
    :data:`K_ROWS`); they compare and hash by identity (cheap in the plan cache key)."""

    __slots__ = ("slot",)

    def __init__(self, slot: str):
        self.slot = slot

    def __repr__(self) -> str:
        return f"Rows({self.slot!r})"


Q_ROWS, K_ROWS = Rows("q"), Rows("k")



class TensorInfo(NamedTuple):
    shape: tuple
    strides: tuple
    dtype: torch.dtype
    aligned: bool  # data pointer 16-byte aligned


_new_info = tuple.__new__  # a named tuple without its Python-level __new__ (every field given; per call)


def info(t: Optional[torch.Tensor]) -> Optional[TensorInfo]:
    if t is None:
        return None
    return _new_info(TensorInfo, (t.shape, t.stride(), t.dtype, t.data_ptr() % limits.POINTER_ALIGNMENT == 0))


def info_aligned(t: torch.Tensor) -> TensorInfo:
    """``t``'s :class:`TensorInfo` with its pointer taken as aligned: what calls whose pointers
    differ share (a class of signatures; plan keys hold the alignment)."""
    return _new_info(TensorInfo, (t.shape, t.stride(), t.dtype, True))



class VarlenInfo(NamedTuple):
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    cu_q: TensorInfo
    cu_k: TensorInfo
    block_table: Optional[TensorInfo]


class Scalars(NamedTuple):
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    dropout_p: float


def _scalars(params) -> Scalars:
    return _new_info(Scalars, (float(params.softmax_scale), int(params.window_left), int(params.window_right),
                               float(params.softcap), float(params.dropout_p)))


# Every kernel's largest tile (configs): longest-sequence buckets are multiples of it.
SEQLEN_TILE = 128


def bucket_seqlen(n: int) -> int:
    """A varlen call's longest sequence ``n`` as its plan knows it: rounded up to a multiple of
    :data:`SEQLEN_TILE`, and of an eighth of the next power of two beyond 1024 (at most four plans
    per doubling). The kernels take it only to size the grid and to decode their program id
    (:func:`~flash_attn.kernels.tiles.block_and_batch`) and read each sequence's true length from
    ``cu_seqlens`` (:func:`~flash_attn.kernels.tiles.sequence_bounds`): the programs past it return
    at once. The grid grows by such programs for less than one step of rows per sequence (128, or
    under a quarter of ``n`` beyond 1024)."""
    if n <= 0:
        return 0
    step = max(SEQLEN_TILE, 1 << max((n - 1).bit_length() - 3, 0))
    return cdiv(n, step) * step


def _varlen_info(varlen, exact: bool = False) -> Optional[VarlenInfo]:
    """The varlen layout; the longest sequences bucketed unless ``exact`` (an output sized by them)."""
    if varlen is None:
        return None
    max_q, max_k = int(varlen.max_seqlen_q), int(varlen.max_seqlen_k)
    if not exact:
        max_q, max_k = bucket_seqlen(max_q), bucket_seqlen(max_k)
    return _new_info(VarlenInfo, (varlen.cu_seqlens_q.shape[0] - 1, max_q, max_k, info(varlen.cu_seqlens_q),
                                  info(varlen.cu_seqlens_k), info(varlen.block_table)))


def _packed_info(t: Optional[torch.Tensor], rows: Rows) -> Optional[TensorInfo]:
    """``info(t)`` of a packed ``(total, ...)`` tensor, its row count left to the call (``rows``)."""
    if t is None:
        return None
    return _new_info(TensorInfo, ((rows, *t.shape[1:]), t.stride(), t.dtype,
                                  t.data_ptr() % limits.POINTER_ALIGNMENT == 0))


def _packed_lse_info(lse: torch.Tensor) -> TensorInfo:
    """``info(lse)`` of a packed lse ``(h, total_q)``: when contiguous, its head stride is the row count."""
    shape, strides, dtype, aligned = info(lse)
    if strides[1] == 1 and strides[0] == shape[1]:
        strides = (Q_ROWS, 1)
    return _new_info(TensorInfo, ((shape[0], Q_ROWS), strides, dtype, aligned))


def _rows_per_call(q, varlen, exact: bool) -> bool:
    """Whether a call's row counts are left to the call: packed inputs, unless an output is sized
    by the exact bounds or the lse head stride (the row count) might not fit the kernels' int32."""
    return varlen is not None and not exact and q.shape[0] <= limits.INT32_MAX


class ForwardShape(NamedTuple):
    q: TensorInfo
    k: TensorInfo
    v: TensorInfo
    varlen: Optional[VarlenInfo]
    alibi: Optional[TensorInfo]
    scalars: Scalars
    return_softmax: bool
    seed: Optional[TensorInfo]
    sinks: Optional[TensorInfo] = None  # fp32 (nheads,): attention sinks
    qv: Optional[TensorInfo] = None  # like q with v's head dim: MLA's absorbed queries


class BackwardShape(NamedTuple):
    dout: TensorInfo
    q: TensorInfo
    k: TensorInfo
    v: TensorInfo
    out: TensorInfo
    lse: TensorInfo
    varlen: Optional[VarlenInfo]
    alibi: Optional[TensorInfo]
    scalars: Scalars
    seed: Optional[TensorInfo]
    deterministic: bool = False  # the split kernels (no atomics) instead of the fused one
    grads: Optional[tuple] = None  # the caller's (dq, dk, dv) to write in place, where laid out as the kernels write
    delta: bool = False  # Delta = rowsum(dout * out) (fp32, lse's layout) returned as a fourth result
    qv: Optional[TensorInfo] = None  # MLA's absorbed queries (the kernels have no backward for them)


class KVCacheShape(NamedTuple):
    q: TensorInfo
    k_cache: TensorInfo
    v_cache: TensorInfo
    k_new: Optional[TensorInfo]
    v_new: Optional[TensorInfo]
    seqlens: Optional[TensorInfo]  # None: every sequence's whole cache
    batch_idx: Optional[TensorInfo]
    leftpad: Optional[TensorInfo]
    block_table: Optional[TensorInfo]
    cos: Optional[TensorInfo]
    sin: Optional[TensorInfo]
    alibi: Optional[TensorInfo]
    scalars: Scalars
    rotary_interleaved: bool
    num_splits: int
    sinks: Optional[TensorInfo] = None
    qv: Optional[TensorInfo] = None


def _seed_info(params) -> Optional[TensorInfo]:
    seed = params.dropout_seed
    # without dropout no kernel reads the seed: its layout does not matter (one plan fewer to tell apart)
    return info(seed) if params.dropout_p and isinstance(seed, torch.Tensor) else None


def describe_forward(q, k, v, params, varlen=None, alibi_slopes=None, return_softmax=False, sinks=None,
                     qv=None) -> ForwardShape:
    # return_softmax: S_dmask is sized by the exact longest sequences
    if _rows_per_call(q, varlen, return_softmax):
        if varlen.block_table is None:
            k_info, v_info = _packed_info(k, K_ROWS), _packed_info(v, K_ROWS)
        else:
            k_info, v_info = info(k), info(v)  # a page pool, not packed rows
        return _new_info(ForwardShape, (_packed_info(q, Q_ROWS), k_info, v_info, _varlen_info(varlen),
                                        info(alibi_slopes), _scalars(params), False, _seed_info(params), info(sinks),
                                        _packed_info(qv, Q_ROWS)))
    return _new_info(ForwardShape, (info(q), info(k), info(v), _varlen_info(varlen, exact=True), info(alibi_slopes),
                                    _scalars(params), bool(return_softmax), _seed_info(params), info(sinks), info(qv)))


def describe_backward(dout, q, k, v, out, lse, params, varlen=None, alibi_slopes=None, deterministic=False,
                      grads=None, delta=False, qv=None) -> BackwardShape:
    """``grads``: the caller's ``(dq, dk, dv)`` (each may be ``None``) for the kernels to write in
    place where they can; ``delta``: return Delta too (the low-level API's ``softmax_d``)."""
    paged = varlen is not None and varlen.block_table is not None  # refused by the planner
    if _rows_per_call(q, varlen, paged):
        grad_infos = None if grads is None else (
            _packed_info(grads[0], Q_ROWS), _packed_info(grads[1], K_ROWS), _packed_info(grads[2], K_ROWS))
        return _new_info(BackwardShape, (
            _packed_info(dout, Q_ROWS), _packed_info(q, Q_ROWS), _packed_info(k, K_ROWS), _packed_info(v, K_ROWS),
            _packed_info(out, Q_ROWS), _packed_lse_info(lse), _varlen_info(varlen), info(alibi_slopes),
            _scalars(params), _seed_info(params), bool(deterministic), grad_infos, bool(delta), info(qv)))
    grad_infos = None if grads is None else (info(grads[0]), info(grads[1]), info(grads[2]))
    return _new_info(BackwardShape, (info(dout), info(q), info(k), info(v), info(out), info(lse),
                                     _varlen_info(varlen, exact=True), info(alibi_slopes), _scalars(params),
                                     _seed_info(params), bool(deterministic), grad_infos, bool(delta), info(qv)))


def describe_kvcache(q, params, cache, alibi_slopes=None, sinks=None, qv=None) -> KVCacheShape:
    return _new_info(KVCacheShape, (
        info(q), info(cache.k_cache), info(cache.v_cache), info(cache.k_new), info(cache.v_new),
        info(cache.cache_seqlens), info(cache.cache_batch_idx), info(cache.cache_leftpad), info(cache.block_table),
        info(cache.rotary_cos), info(cache.rotary_sin), info(alibi_slopes), _scalars(params),
        bool(cache.rotary_interleaved), int(cache.num_splits), info(sinks), info(qv),
    ))


def is_local(scalars: Scalars) -> bool:
    """Whether a window bound (or causality) applies: the kernels' ``IS_LOCAL``."""
    return window_applies(scalars.window_left, scalars.window_right)
