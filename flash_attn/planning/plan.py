"""The launch planner: one attention call -> the kernel launches that compute it.

A call is first reduced to its *shape* (:func:`describe_forward`, :func:`describe_backward`,
:func:`describe_kvcache`): dtypes, sizes, strides, alignment and the scalar options, everything
the launches depend on and nothing that changes between two calls of the same layout (tensor data,
the dropout seed). A :class:`Plan` is a pure function of a shape and a :class:`Target`: the
kernels by name, their grids, their arguments by name (tensors as :class:`Slot` names, sizes and
scalars as numbers), compile-time constants and launch configs, the buffers to allocate and the
inputs to bring into the kernels' layout first. The kernel backends (``triton``, ``interpret``,
``aot``) cache plans per shape and execute them; per call only tensors are filled into slots.

Packed (varlen) calls are described so that the batches of packed training share plans: the
total row counts of q and k are left to the call (:class:`Rows`, read from the tensors per call)
and the longest sequences are rounded up (:func:`bucket_seqlen`); the kernels find each
sequence's bounds in ``cu_seqlens`` at run time, so a plan serves every batch with the same
number of sequences, layouts and options.

A planner returns a ``str`` instead of a plan when the kernels cannot run the call; the
dispatcher then falls back to another backend. Nothing here imports Triton, touches a device or
reads a tensor value, so plans are made (and tested) anywhere, also for meta tensors.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from flash_attn import limits
from flash_attn.limits import cdiv
from flash_attn.params import window_applies
from flash_attn.planning import configs, declarations, decode_configs as dc, registry

__all__ = [
    "Slot", "Rows", "Target", "TensorInfo", "Launch", "Buffer", "Prepare", "Plan",
    "describe_forward", "describe_backward", "describe_kvcache", "bucket_seqlen",
    "plan_forward", "plan_backward", "plan_kvcache", "choose_num_splits", "uses_score_features",
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


class Target(NamedTuple):
    """What a plan is made for: the launch configs of ``family`` (an architecture family of
    :mod:`flash_attn.planning.configs`, or ``"interpret"``), the SM count the KV-cache split
    heuristic and the deterministic backward's splits fill, and ``aot``: launch only the
    specialisations an ahead-of-time build ships (flags folded into their exact supersets,
    :mod:`flash_attn.planning.declarations`)."""

    family: str
    sm_count: int
    aot: bool = False


class TensorInfo(NamedTuple):
    shape: tuple
    strides: tuple
    dtype: torch.dtype
    aligned: bool  # data pointer 16-byte aligned


_new_info = tuple.__new__  # a TensorInfo without NamedTuple's Python-level __new__ (once per call)


def info(t: Optional[torch.Tensor]) -> Optional[TensorInfo]:
    if t is None:
        return None
    return _new_info(TensorInfo, (t.shape, t.stride(), t.dtype, t.data_ptr() % limits.POINTER_ALIGNMENT == 0))


@dataclass(frozen=True)
class Launch:
    """One kernel launch. ``args``: the kernel's runtime arguments in its order, ``(name, value)``
    with a :class:`Slot`, an int, a float or ``None`` (an unused pointer); ``constexprs``: every
    compile-time argument."""

    kernel: str
    grid: tuple
    args: tuple
    constexprs: dict
    config: configs.Config


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


@dataclass(frozen=True)
class Plan:
    dtype: torch.dtype  # the q/k/v element type
    prepare: tuple
    buffers: tuple
    launches: tuple
    results: tuple  # the slots the call returns, in order
    needs_seed: bool = False  # a launch reads the "seed" slot (the score-features kernels)
    rows: tuple = ()  # the Rows its buffers and launch arguments use (sizes read per call)


Planned = Union[Plan, str]  # a plan, or why the kernels cannot run the call


# ---------------------------------------------------------------------------------------------
# Call shapes


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
    return VarlenInfo(varlen.cu_seqlens_q.shape[0] - 1, max_q, max_k, info(varlen.cu_seqlens_q),
                      info(varlen.cu_seqlens_k), info(varlen.block_table))


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


class KVCacheShape(NamedTuple):
    q: TensorInfo
    k_cache: TensorInfo
    v_cache: TensorInfo
    k_new: Optional[TensorInfo]
    v_new: Optional[TensorInfo]
    seqlens: TensorInfo
    batch_idx: Optional[TensorInfo]
    leftpad: Optional[TensorInfo]
    block_table: Optional[TensorInfo]
    cos: Optional[TensorInfo]
    sin: Optional[TensorInfo]
    alibi: Optional[TensorInfo]
    scalars: Scalars
    rotary_interleaved: bool
    num_splits: int


def _seed_info(params) -> Optional[TensorInfo]:
    seed = params.dropout_seed
    # without dropout no kernel reads the seed: its layout does not matter (one plan fewer to tell apart)
    return info(seed) if params.dropout_p and isinstance(seed, torch.Tensor) else None


def describe_forward(q, k, v, params, varlen=None, alibi_slopes=None, return_softmax=False) -> ForwardShape:
    # return_softmax: S_dmask is sized by the exact longest sequences
    if _rows_per_call(q, varlen, return_softmax):
        if varlen.block_table is None:
            k_info, v_info = _packed_info(k, K_ROWS), _packed_info(v, K_ROWS)
        else:
            k_info, v_info = info(k), info(v)  # a page pool, not packed rows
        return ForwardShape(_packed_info(q, Q_ROWS), k_info, v_info, _varlen_info(varlen), info(alibi_slopes),
                            _scalars(params), False, _seed_info(params))
    return ForwardShape(info(q), info(k), info(v), _varlen_info(varlen, exact=True), info(alibi_slopes),
                        _scalars(params), bool(return_softmax), _seed_info(params))


def describe_backward(dout, q, k, v, out, lse, params, varlen=None, alibi_slopes=None, deterministic=False,
                      grads=None, delta=False) -> BackwardShape:
    """``grads``: the caller's ``(dq, dk, dv)`` (each may be ``None``) for the kernels to write in
    place where they can; ``delta``: return Delta too (the low-level API's ``softmax_d``)."""
    paged = varlen is not None and varlen.block_table is not None  # refused by the planner
    if _rows_per_call(q, varlen, paged):
        grad_infos = None if grads is None else (
            _packed_info(grads[0], Q_ROWS), _packed_info(grads[1], K_ROWS), _packed_info(grads[2], K_ROWS))
        return BackwardShape(_packed_info(dout, Q_ROWS), _packed_info(q, Q_ROWS), _packed_info(k, K_ROWS),
                             _packed_info(v, K_ROWS), _packed_info(out, Q_ROWS), _packed_lse_info(lse),
                             _varlen_info(varlen), info(alibi_slopes), _scalars(params), _seed_info(params),
                             bool(deterministic), grad_infos, bool(delta))
    grad_infos = None if grads is None else (info(grads[0]), info(grads[1]), info(grads[2]))
    return BackwardShape(info(dout), info(q), info(k), info(v), info(out), info(lse), _varlen_info(varlen, exact=True),
                         info(alibi_slopes), _scalars(params), _seed_info(params), bool(deterministic), grad_infos,
                         bool(delta))


def describe_kvcache(q, params, cache, alibi_slopes=None) -> KVCacheShape:
    return KVCacheShape(
        info(q), info(cache.k_cache), info(cache.v_cache), info(cache.k_new), info(cache.v_new),
        info(cache.cache_seqlens), info(cache.cache_batch_idx), info(cache.cache_leftpad), info(cache.block_table),
        info(cache.rotary_cos), info(cache.rotary_sin), info(alibi_slopes), _scalars(params),
        bool(cache.rotary_interleaved), int(cache.num_splits),
    )


# ---------------------------------------------------------------------------------------------
# Layouts


def _effective_strides(t: TensorInfo) -> tuple:
    """Strides as the kernels use them: a dimension of size 1 is only ever indexed at 0, so its
    stride is irrelevant and given as 0 (it neither costs a copy nor breaks a multiple-of-8 rule)."""
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.strides))


def _fits(t: TensorInfo, how: str) -> bool:
    if not t.aligned:
        return False
    strides = _effective_strides(t)
    if strides and strides[-1] not in (0, 1):
        return False
    if how == "rows":
        return all(s % limits.STRIDE_MULTIPLE == 0 for s in strides[:-1])
    if how == "contiguous":
        return strides == _effective_strides(TensorInfo(t.shape, _contiguous(t.shape), t.dtype, True))
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


class _Layouts:
    """The strides the kernels will see for each slot of one plan, and the preparations that
    produce them."""

    def __init__(self):
        self.strides: dict[str, tuple] = {}
        self.prepare: list[Prepare] = []
        self.buffers: list[Buffer] = []

    def input(self, slot: str, t: TensorInfo, how: str) -> Slot:
        if _fits(t, how):
            self.strides[slot] = _effective_strides(t)
        else:
            self.prepare.append(Prepare(slot, how))
            shape = t.shape
            strides = _padded_strides(shape) if how == "rows" else _contiguous(shape)
            self.strides[slot] = _effective_strides(TensorInfo(shape, strides, t.dtype, True))
        return Slot(slot)

    def column(self, slot: str, source: str, t: TensorInfo) -> Slot:
        self.prepare.append(Prepare(slot, "column", source))
        self.strides[slot] = (1, 0)
        return Slot(slot)

    def output(self, slot: str, given: Optional[TensorInfo], shape: tuple, dtype) -> Slot:
        """A result the kernels write: the caller's tensor (``given``, the call's slot) where laid
        out as they write it (``"rows"``), else a padded buffer."""
        if given is not None and _fits(given, "rows"):
            self.strides[slot] = _effective_strides(given)
            return Slot(slot)
        return self.buffer(slot, shape, dtype, padded=True)

    def buffer(self, slot: str, shape: tuple, dtype, padded: bool = False, zeroed: bool = False,
               unused: bool = False) -> Slot:
        self.buffers.append(Buffer(slot, tuple(shape), dtype, padded, zeroed, unused))
        strides = _padded_strides(shape) if padded else _contiguous(shape)
        self.strides[slot] = _effective_strides(TensorInfo(tuple(shape), strides, dtype, True))
        return Slot(slot)

    def rows(self, slot: str) -> list:
        """(batch, row, head) strides of a q-like tensor: ``(b, s, h, d)``, or packed ``(total, h, d)``
        with batch stride 0; a page pool ``(pages, page_size, h, d)`` gives (page, slot, head)."""
        s = self.strides[slot]
        return list(s[:3]) if len(s) == 4 else [0, s[0], s[1]]


def _launch(kernel: str, grid: tuple, values: dict, constexprs: dict, config: configs.Config) -> Launch:
    """The launch with ``values`` (every runtime argument by name) in the kernel's order."""
    names = registry.arg_names(kernel)
    missing = [n for n in names if n not in values and n not in constexprs]
    if missing:
        raise KeyError(f"{kernel}: no value for {missing}")
    args = tuple((n, values[n]) for n in names if n not in constexprs)
    return Launch(kernel, tuple(grid) + (1,) * (3 - len(grid)), args, dict(constexprs), config)


def _grid_refusal(launches) -> Optional[str]:
    for launch in launches:
        for axis, (n, limit) in enumerate(zip(launch.grid, limits.GRID_LIMITS)):
            if n > limit:
                return f"{launch.kernel} needs {n} programs on grid axis {axis} (CUDA allows {limit})"
    return None


def _kernel_refusal(dtype, head_dim: int, target: Target) -> Optional[str]:
    if str(dtype) not in limits.KERNEL_DTYPES:
        return f"{dtype} inputs (the kernels take fp16/bf16)"
    if head_dim > limits.MAX_HEADDIM:
        return f"head dimension {head_dim} > {limits.MAX_HEADDIM}"
    if target.aot and head_dim % limits.AOT_HEADDIM_MULTIPLE:
        return (f"head dimension {head_dim} (the ahead-of-time kernels need a multiple of "
                f"{limits.AOT_HEADDIM_MULTIPLE})")
    return None


def uses_score_features(scalars: Scalars, alibi: bool) -> bool:
    """Softcap, ALiBi or dropout: the call runs the kernels' *score-features* variant (the three
    compiled in together, each switched at run time), which is also what the ahead-of-time build
    ships, so every backend runs the same kernel for such a call."""
    return scalars.softcap > 0.0 or alibi or scalars.dropout_p > 0.0


def _block_d(head_dim: int, features: bool, target: Target) -> int:
    """``BLOCK_D``: the head dim padded to a power of two (at least 16); the ahead-of-time images
    exist from 32 (64 for the score-features variant) up, exact for smaller head dims."""
    block_d = configs.padded_headdim(head_dim)
    if target.aot:
        block_d = max(block_d, 64 if features else 32)
    return block_d


def _runs_exact_image(kernel: str, target: Target, features: bool, flags: dict, block_d: int,
                      dtype: torch.dtype) -> bool:
    """Whether the call runs its kernel's exact-call specialisation, in that image's launch config
    (``configs.pick(..., exact=True)``): on the JIT any lean call with the exact flags, ahead of
    time where that image ships."""
    decl = declarations.get(kernel)
    if features or not decl.serves_exactly(flags):
        return False
    return not target.aot or decl.ships_exact_image(target.family, block_d, dtype)


def _attention_constexprs(kernel: str, target: Target, features: bool, flags: dict, blocks: dict,
                          exact_image: bool) -> dict:
    """The constexprs of an attention launch: the call's own flags (JIT), or the shipped image's:
    the exact-call image (``exact_image``: :func:`_runs_exact_image`), else the folded superset."""
    if not target.aot:
        return {**flags, **blocks}
    decl = declarations.get(kernel)
    if exact_image:
        return {**decl.exact_constexprs(), **blocks}
    return {**decl.aot_constexprs(features), **blocks}


# ---------------------------------------------------------------------------------------------
# Forward


class _Sizes(NamedTuple):
    head_dim: int
    nheads: int
    nheads_k: int
    batch: int
    seqlen_q: int  # the longest sequence, varlen
    seqlen_k: int
    packed: bool  # varlen
    paged: bool
    features: bool  # softcap, ALiBi or dropout: the score-features variant


def _sizes(s) -> _Sizes:
    """What the forward and backward planners share about a call."""
    packed = s.varlen is not None
    if packed:
        batch, seqlen_q, seqlen_k = s.varlen.batch, s.varlen.max_seqlen_q, s.varlen.max_seqlen_k
    else:
        batch, seqlen_q, seqlen_k = s.q.shape[0], s.q.shape[1], s.k.shape[1]
    return _Sizes(s.q.shape[-1], s.q.shape[-2], s.k.shape[-2], batch, seqlen_q, seqlen_k, packed,
                  packed and s.varlen.block_table is not None, uses_score_features(s.scalars, s.alibi is not None))


def plan_forward(s: ForwardShape, target: Target) -> Planned:
    head_dim, nheads, nheads_k, batch, seqlen_q, seqlen_k, packed, paged, features = _sizes(s)
    why = _kernel_refusal(s.q.dtype, head_dim, target)
    if why is not None:
        return why
    if target.aot and paged:
        return "paged K/V in the varlen forward (not compiled ahead of time)"
    if target.aot and s.return_softmax:
        return "return_attn_probs (a testing feature) is not compiled ahead of time"
    block_d = _block_d(head_dim, features, target)
    flags = dict(IS_LOCAL=_is_local(s.scalars), HAS_SOFTCAP=features, HAS_ALIBI=features, HAS_DROPOUT=features,
                 IS_PAGED=paged, PAD_HEADDIM=head_dim != block_d)
    exact_image = _runs_exact_image("attn_fwd_kernel", target, features, flags, block_d, s.q.dtype)
    config = configs.pick("fwd", head_dim, target.family, features, exact_image)

    lay = _Layouts()
    q, k, v = lay.input("q", s.q, "rows"), lay.input("k", s.k, "rows"), lay.input("v", s.v, "rows")
    out = lay.buffer("out", s.q.shape, s.q.dtype, padded=True)
    lse_shape = (nheads, s.q.shape[0]) if packed else (batch, nheads, seqlen_q)
    lse = lay.buffer("lse", lse_shape, torch.float32)
    if packed:
        cu_q, cu_k = lay.input("cu_q", s.varlen.cu_q, "plain"), lay.input("cu_k", s.varlen.cu_k, "plain")
    else:
        cu_q = cu_k = lay.buffer("no_cu", (1,), torch.int32, unused=True)  # not read (packed = 0)
    block_table = lay.input("block_table", s.varlen.block_table, "plain") if paged else None
    alibi = lay.input("alibi", s.alibi, "plain") if s.alibi is not None else (lse if features else None)
    seed = _seed_slot(lay, s.seed, features)
    lse_strides = list(lay.strides["lse"][:2]) if not packed else [0, lay.strides["lse"][0]]
    common = dict(
        CuSeqlensQ=cu_q, CuSeqlensK=cu_k, BlockTable=block_table, AlibiSlopes=alibi, DropoutSeed=seed,
        stride_lb=lse_strides[0], stride_lh=lse_strides[1],
        stride_btb=lay.strides["block_table"][0] if paged else 0,
        stride_ab=_alibi_batch_stride(lay, s.alibi),
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=nheads // nheads_k, head_dim=head_dim,
        page_size=s.k.shape[1] if paged else 0, packed=int(packed), use_alibi=int(s.alibi is not None),
        **_score_scalars(s.scalars),
    )
    blocks = declarations.get("attn_fwd_kernel").tile_constexprs(block_d, config, target.family)
    grid = (cdiv(seqlen_q, config.block_m) * batch, nheads)
    launches = [_launch("attn_fwd_kernel", grid, dict(
        common, Q=q, K=k, V=v, Out=out, LSE=lse,
        **_named("stride_q", "bsh", lay.rows("q")), **_named("stride_k", "bsh", lay.rows("k")),
        **_named("stride_v", "bsh", lay.rows("v")), **_named("stride_o", "bsh", lay.rows("out"))),
        _attention_constexprs("attn_fwd_kernel", target, features, flags, blocks, exact_image), config)]
    results = ("out", "lse")
    if s.return_softmax:
        s_dmask = lay.buffer("s_dmask", (batch, nheads, seqlen_q, seqlen_k), torch.float32, zeroed=True)
        launches.append(_launch("attn_probs_kernel", grid, dict(
            common, Q=q, K=k, LSE=lse, S=s_dmask,
            **_named("stride_q", "bsh", lay.rows("q")), **_named("stride_k", "bsh", lay.rows("k")),
            **_named("stride_p", "bhs", lay.strides["s_dmask"][:3])),
            dict(flags, **declarations.get("attn_probs_kernel").tile_constexprs(block_d, config, target.family)),
            config))
        results = ("out", "lse", "s_dmask")
    return _finish(s.q.dtype, lay, launches, results)


def _named(prefix: str, suffixes: str, values) -> dict:
    return {prefix + suffix: int(value) for suffix, value in zip(suffixes, values)}


def _is_local(scalars: Scalars) -> bool:
    return window_applies(scalars.window_left, scalars.window_right)


def _score_scalars(scalars: Scalars) -> dict:
    return dict(softmax_scale=scalars.softmax_scale, softcap=scalars.softcap, window_left=scalars.window_left,
                window_right=scalars.window_right, dropout_p=scalars.dropout_p)


def _alibi_batch_stride(lay: _Layouts, alibi: Optional[TensorInfo]) -> int:
    return lay.strides["alibi"][0] if alibi is not None and len(alibi.shape) == 2 else 0


def _seed_slot(lay: _Layouts, seed: Optional[TensorInfo], features: bool) -> Optional[Slot]:
    """The dropout seed (an int64 on the device): read only by the score-features kernels, and
    only when ``dropout_p > 0``; the call always provides one (:func:`seed_tensor`)."""
    if not features:
        return None
    if seed is None:
        return Slot("seed")
    return lay.input("seed", seed, "plain")


def _finish(dtype, lay: _Layouts, launches: list, results: tuple) -> Planned:
    why = _grid_refusal(launches)
    if why is not None:
        return why
    needs_seed = any(isinstance(v, Slot) and v == "seed" for launch in launches for _, v in launch.args)
    rows = tuple(r for r in (Q_ROWS, K_ROWS) if any(r in b.shape for b in lay.buffers)
                 or any(v is r for launch in launches for _, v in launch.args))
    return Plan(dtype, tuple(lay.prepare), tuple(lay.buffers), tuple(launches), results, needs_seed, rows)


# ---------------------------------------------------------------------------------------------
# Backward


def plan_backward(s: BackwardShape, target: Target) -> Planned:
    head_dim, nheads, nheads_k, batch, seqlen_q, seqlen_k, packed, paged, features = _sizes(s)
    why = _kernel_refusal(s.q.dtype, head_dim, target)
    if why is not None:
        return why
    if paged:
        return "the backward of paged K/V (pages may be shared between sequences, which needs atomics)"
    block_d = _block_d(head_dim, features, target)
    lean_block_d = _block_d(head_dim, False, target)

    lay = _Layouts()
    q, k, v = lay.input("q", s.q, "rows"), lay.input("k", s.k, "rows"), lay.input("v", s.v, "rows")
    dout, out = lay.input("dout", s.dout, "rows"), lay.input("out", s.out, "rows")
    # Delta is allocated like lse and the kernels address both with one pair of strides
    lse = lay.input("lse", s.lse, "contiguous")
    delta = lay.buffer("delta", s.lse.shape, torch.float32)
    given = s.grads or (None, None, None)
    dq = lay.output("dq", given[0], s.q.shape, s.q.dtype)
    dk = lay.output("dk", given[1], s.k.shape, s.k.dtype)
    dv = lay.output("dv", given[2], s.v.shape, s.v.dtype)
    if packed:
        cu_q, cu_k = lay.input("cu_q", s.varlen.cu_q, "plain"), lay.input("cu_k", s.varlen.cu_k, "plain")
    else:
        cu_q = cu_k = lay.buffer("no_cu", (1,), torch.int32, unused=True)
    alibi = lay.input("alibi", s.alibi, "plain") if s.alibi is not None else (lse if features else None)
    seed = _seed_slot(lay, s.seed, features)
    lse_strides = list(lay.strides["lse"][:2]) if not packed else [0, lay.strides["lse"][0]]
    lse_args = dict(stride_lb=lse_strides[0], stride_lh=lse_strides[1])
    rows = {name: lay.rows(name) for name in ("q", "k", "v", "dout", "out", "dq", "dk", "dv")}

    pre = configs.pick("fwd", head_dim, target.family)

    def preprocess(accum: Optional[_Accumulator]) -> Launch:
        """Delta, and the fused backward's dQ sums zeroed (``accum``). None: nothing to zero, and
        ``delta`` stands in for the pointer the kernel then does not write (no allocation)."""
        acc = accum or _Accumulator(delta, (0, 0, 0), 0, 0)
        return _launch("attn_bwd_preprocess_kernel", (cdiv(seqlen_q, pre.block_m) * batch, nheads), dict(
            Out=out, dOut=dout, Delta=delta, dQAccum=acc.slot, CuSeqlensQ=cu_q,
            **_named("stride_o", "bsh", rows["out"]), **_named("stride_do", "bsh", rows["dout"]), **lse_args,
            **_named("stride_a", "bsh", acc.rows), seqlen_q=seqlen_q, head_dim=head_dim, packed=int(packed),
            slices=acc.splits, split_stride=acc.split_stride),
            dict(BLOCK_M=pre.block_m, BLOCK_D=lean_block_d), pre)

    common = dict(
        Q=q, K=k, V=v, dOut=dout, LSE=lse, Delta=delta, CuSeqlensQ=cu_q, CuSeqlensK=cu_k, AlibiSlopes=alibi,
        DropoutSeed=seed, **_named("stride_q", "bsh", rows["q"]), **_named("stride_k", "bsh", rows["k"]),
        **_named("stride_v", "bsh", rows["v"]), **_named("stride_do", "bsh", rows["dout"]), **lse_args,
        stride_ab=_alibi_batch_stride(lay, s.alibi), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        group=nheads // nheads_k, head_dim=head_dim, packed=int(packed), use_alibi=int(s.alibi is not None),
        **_score_scalars(s.scalars),
    )
    flags = dict(IS_LOCAL=_is_local(s.scalars), HAS_SOFTCAP=features, HAS_ALIBI=features, HAS_DROPOUT=features,
                 PAD_HEADDIM=head_dim != block_d)
    dkdv = dict(common, dK=dk, dV=dv, **_named("stride_dk", "bsh", rows["dk"]), **_named("stride_dv", "bsh", rows["dv"]))

    def tiles(kernel: str, cfg: configs.Config) -> dict:
        return declarations.get(kernel).tile_constexprs(block_d, cfg, target.family)

    def parts(blocks: dict) -> int:
        """Programs per key block: the head-dim split of the dK/dV programs."""
        return block_d // blocks.get("BLOCK_DOUT", block_d)

    def attention_launch(kernel: str, cfg: configs.Config, per_key_block: bool, values: dict,
                         exact_image: bool = False, key_programs: int = 0) -> Launch:
        """``key_programs``: programs per batch entry and kv head along the keys (0: one per key block)."""
        blocks = tiles(kernel, cfg)
        grid = ((key_programs or cdiv(seqlen_k, cfg.block_n)) * batch, nheads_k * parts(blocks)) if per_key_block \
            else (cdiv(seqlen_q, cfg.block_m) * batch, nheads)
        return _launch(kernel, grid, values, _attention_constexprs(kernel, target, features, flags, blocks, exact_image),
                       cfg)

    fused_exact = _runs_exact_image("attn_bwd_kernel", target, features, flags, block_d, s.q.dtype)
    fused = configs.fused_backward(head_dim, target.family, features, fused_exact)
    splits = 0  # deterministic=False: one program per key block
    if fused is not None and s.deterministic:
        splits = _deterministic_splits(fused, target, cdiv(seqlen_k, fused.block_n),
                                       batch * nheads_k * parts(tiles("attn_bwd_kernel", fused)))
        fused = fused if splits else None
    if fused is None:
        launches = [
            preprocess(None),
            attention_launch("attn_bwd_dkdv_kernel", configs.pick("bwd_dkdv", head_dim, target.family, features), True,
                             dkdv),
            attention_launch("attn_bwd_dq_kernel", configs.pick("bwd_dq", head_dim, target.family, features), False,
                             dict(common, dQ=dq, **_named("stride_dq", "bsh", rows["dq"]))),
        ]
    else:
        # dQ summed in fp32 by atomic adds (into rows the preprocess zeroed; per split where
        # deterministic), then added up, scaled and rounded into dq
        acc = _accumulator(lay, s.q.shape, max(splits, 1))
        key_programs = splits or cdiv(seqlen_k, fused.block_n)
        launches = [
            preprocess(acc),
            attention_launch("attn_bwd_kernel", fused, True, dict(
                dkdv, dQAccum=acc.slot, **_named("stride_dq", "bsh", acc.rows), splits=key_programs,
                split_stride=acc.split_stride), fused_exact, key_programs),
            _launch("attn_bwd_dq_convert_kernel", (cdiv(seqlen_q, pre.block_m) * batch, nheads), dict(
                dQAccum=acc.slot, dQ=dq, CuSeqlensQ=cu_q, **_named("stride_a", "bsh", acc.rows),
                **_named("stride_dq", "bsh", rows["dq"]), seqlen_q=seqlen_q, head_dim=head_dim, packed=int(packed),
                slices=acc.splits, split_stride=acc.split_stride, softmax_scale=s.scalars.softmax_scale),
                dict(BLOCK_M=pre.block_m, BLOCK_D=lean_block_d), pre),
        ]
    return _finish(s.q.dtype, lay, launches, ("dq", "dk", "dv", "delta") if s.delta else ("dq", "dk", "dv"))


class _Accumulator(NamedTuple):
    """The fused backward's fp32 dQ sums: ``splits`` Q-shaped buffers, interleaved per row
    (``(b, s, splits, h, d)`` or ``(total, splits, h, d)``): their (batch, row, head) strides and
    the elements from one split's sums to the next."""

    slot: Slot
    rows: tuple
    splits: int
    split_stride: int


def _accumulator(lay: _Layouts, q_shape: tuple, splits: int) -> _Accumulator:
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


# ---------------------------------------------------------------------------------------------
# KV cache (decoding)


def choose_num_splits(requested: int, programs: int, key_blocks: int, sms: int) -> int:
    """How many key splits to launch.

    ``programs``: attention programs without splitting (batch * nheads_k * query tiles);
    ``key_blocks``: the most key blocks one program may have to visit. ``requested > 0`` is
    honoured, clamped to ``key_blocks`` (more splits would only be empty). ``requested == 0``:
    the GPU runs ``slots = sms *`` :data:`~decode_configs.SPLIT_PROGRAMS_PER_SM` programs at once;
    one split when the programs already fill ~80% of the slots; otherwise the fewest splits whose
    waves of programs are nearly (95%) as full as the best count's, a last wave that runs almost
    empty costing a whole wave's time. At most :data:`~decode_configs.MAX_SPLITS`, no split shorter
    than :data:`~decode_configs.MIN_BLOCKS_PER_SPLIT` blocks, and then the fewest splits that give
    every split the same number of blocks, so that no split is left empty.
    """
    key_blocks = max(int(key_blocks), 1)
    if requested > 0:
        return max(1, min(int(requested), key_blocks))
    slots = sms * dc.SPLIT_PROGRAMS_PER_SM
    programs = max(int(programs), 1)
    if programs >= 0.8 * slots:
        return 1
    most = max(1, min(dc.MAX_SPLITS, key_blocks // dc.MIN_BLOCKS_PER_SPLIT))

    def fullness(splits: int) -> float:
        waves = programs * splits / slots
        return waves / math.ceil(waves)

    best = max(fullness(s) for s in range(1, most + 1))
    splits = next(s for s in range(1, most + 1) if fullness(s) >= 0.95 * best)
    per_split = cdiv(key_blocks, splits)
    return cdiv(key_blocks, per_split)


def _max_visible_keys(capacity: int, scalars: Scalars, query_rows_per_tile: int) -> int:
    """Upper bound on the keys one query tile sees: the cache capacity, or the window span."""
    if scalars.window_left >= 0 and scalars.window_right >= 0:
        return min(capacity, scalars.window_left + scalars.window_right + query_rows_per_tile)
    return capacity


def _cache_refusal(s: KVCacheShape) -> Optional[str]:
    """Why the ahead-of-time decode kernels cannot address these caches: the images assume the
    kernels' layout, and the caches, written in place, cannot be copied into it."""
    for name, t in (("k_cache", s.k_cache), ("v_cache", s.v_cache)):
        if not t.aligned:
            return f"{name} is not 16-byte aligned"
        if not _fits(t, "rows"):
            return (f"{name} has strides {t.strides}: not multiples of {limits.STRIDE_MULTIPLE} elements with a "
                    f"contiguous last dimension")
    return None


def _kvcache_refusal(s: KVCacheShape, target: Target) -> Optional[str]:
    head_dim = s.q.shape[3]
    if target.aot:
        return _kernel_refusal(s.q.dtype, head_dim, target) or _cache_refusal(s)
    if head_dim > limits.MAX_HEADDIM:
        return f"head dimension {head_dim} > {limits.MAX_HEADDIM}"
    return None


class _CacheAddress(NamedTuple):
    """How the kernels find a sequence's cache rows: in pages of ``page_size`` rows listed by
    ``block_table`` (row stride ``stride_btb``), or, when ``identity_table``, page ``b`` for
    sequence ``b``. ``paged``/``batch_idx``: the kernels' ``PAGED``/``HAS_BATCH_IDX`` flags."""

    block_table: Slot
    stride_btb: int
    identity_table: int
    page_size: int
    capacity: int  # the cache rows one sequence can address
    paged: bool
    batch_idx: bool


def _cache_address(s: KVCacheShape, lay: _Layouts, superset: bool, int32_unused: Slot) -> _CacheAddress:
    """The caller's block table; in superset mode (the ahead-of-time images, always paged) a
    plain cache is addressed as one page per sequence: page ``cache_batch_idx[b]`` (a column view
    of it) or page ``b`` (the identity table). ``int32_unused``: an int32 pointer no kernel reads."""
    paged, page_size = s.block_table is not None, s.k_cache.shape[1]
    identity_table = 0
    if paged:
        block_table = lay.input("block_table", s.block_table, "plain")
    elif superset and s.batch_idx is not None:
        block_table = lay.column("block_table", "batch_idx", s.batch_idx)
    else:
        block_table, identity_table = int32_unused, int(superset)
        lay.strides["block_table"] = (0, 0)
    capacity = s.block_table.shape[1] * page_size if paged else s.k_cache.shape[1]
    flags = (True, False) if superset else (paged, s.batch_idx is not None and not paged)
    return _CacheAddress(block_table, lay.strides["block_table"][0], identity_table, page_size, capacity, *flags)


class _KVCall(NamedTuple):
    """One KV-cache call as its launches see it: sizes, tensors by slot, the cache's addressing.
    ``superset``: planned for the ahead-of-time images (inputs in the ``"rows"`` layout, results
    padded, every feature compiled in). Optional pointers a call lacks stand as another tensor of
    the call of the same type, which the kernel does not read: ``lse`` (fp32), ``seqlens`` (int32)."""

    s: KVCacheShape
    superset: bool
    lay: _Layouts
    batch: int
    seqlen_q: int
    nheads: int
    nheads_k: int
    head_dim: int
    seqlen_new: int
    block_d: int
    q: Slot
    out: Slot
    lse: Slot
    seqlens: Slot
    cos: Slot
    sin: Slot
    rotary_half: int
    stride_ro: int
    leftpad: Slot
    batch_idx: Slot
    alibi: Slot
    cache: _CacheAddress

    @property
    def rows(self) -> str:
        """The layout q-like inputs are brought into."""
        return "rows" if self.superset else "plain"

    @property
    def lse_rows(self) -> tuple:
        """lse ``(batch, nheads, seqlen_q)``: its strides in the kernels' (batch, row, head) order."""
        b, h, s = self.lay.strides["lse"]
        return b, s, h


def _kv_call(s: KVCacheShape, target: Target) -> _KVCall:
    """Lays out the call's inputs and results (in this order: the order of its preparations and buffers)."""
    superset = target.aot
    batch, seqlen_q, nheads, head_dim = s.q.shape
    lay = _Layouts()
    q = lay.input("q", s.q, "rows" if superset else "plain")
    lay.strides["k_cache"] = _effective_strides(s.k_cache)
    lay.strides["v_cache"] = _effective_strides(s.v_cache)
    out = lay.buffer("out", s.q.shape, s.q.dtype, padded=superset)
    lse = lay.buffer("lse", (batch, nheads, seqlen_q), torch.float32)
    seqlens = lay.input("seqlens", s.seqlens, "plain")
    if s.cos is not None:
        how = "fp32" if superset else "plain"
        cos, sin = lay.input("cos", s.cos, how), lay.input("sin", s.sin, how)
        rotary_half, stride_ro = s.cos.shape[1], lay.strides["cos"][0]
    else:
        cos = sin = lse
        rotary_half = stride_ro = 0
    leftpad = lay.input("leftpad", s.leftpad, "plain") if s.leftpad is not None else seqlens
    batch_idx = lay.input("batch_idx", s.batch_idx, "plain") if s.batch_idx is not None else seqlens
    alibi = lay.input("alibi", s.alibi, "plain") if s.alibi is not None else lse
    cache = _cache_address(s, lay, superset, seqlens)
    block_d = dc.superset_block_d(head_dim) if superset else configs.padded_headdim(head_dim)
    seqlen_new = 0 if s.k_new is None else s.k_new.shape[1]
    return _KVCall(s=s, superset=superset, lay=lay, batch=batch, seqlen_q=seqlen_q, nheads=nheads,
                   nheads_k=s.k_cache.shape[2], head_dim=head_dim, seqlen_new=seqlen_new, block_d=block_d, q=q,
                   out=out, lse=lse, seqlens=seqlens, cos=cos, sin=sin, rotary_half=rotary_half, stride_ro=stride_ro,
                   leftpad=leftpad, batch_idx=batch_idx, alibi=alibi, cache=cache)


def _kv_splits(kv: _KVCall, target: Target) -> tuple:
    """The split kernel's config, its query tiles per (batch, kv head), and the number of key splits."""
    s, group = kv.s, kv.nheads // kv.nheads_k
    rows = kv.seqlen_q * group
    config = dc.decode_config(target.family, kv.head_dim, rows, fp32=s.q.dtype == torch.float32)
    m_blocks = cdiv(rows, config.block_m)
    query_rows_per_tile = min(kv.seqlen_q, cdiv(config.block_m, group) + 1)
    capacity = kv.cache.capacity
    key_blocks = cdiv(_max_visible_keys(capacity, s.scalars, query_rows_per_tile), config.block_n) + 1
    key_blocks = min(key_blocks, max(cdiv(capacity, config.block_n), 1))
    splits = choose_num_splits(s.num_splits, kv.batch * kv.nheads_k * m_blocks, key_blocks, target.sm_count)
    return config, m_blocks, splits


class _Partials(NamedTuple):
    """Where the split kernel writes: with one split, out and lse themselves; with several, fp32
    partial results ``(splits, batch, seqlen_q, nheads[, head_dim])`` for the combine."""

    splits: int
    out: Slot
    out_strides: tuple  # (split, batch, row, head)
    lse: Slot
    lse_strides: tuple  # (split, batch, row, head)
    empty_lse: float  # the lse of a row that sees no key


def _kv_partials(kv: _KVCall, splits: int) -> _Partials:
    if splits == 1:
        return _Partials(1, kv.lse, (0, 0, 0, 0), kv.lse, (0, *kv.lse_rows), float("inf"))
    lay = kv.lay
    out_part = lay.buffer("out_part", (splits, kv.batch, kv.seqlen_q, kv.nheads, kv.head_dim), torch.float32)
    lse_part = lay.buffer("lse_part", (splits, kv.batch, kv.seqlen_q, kv.nheads), torch.float32)
    return _Partials(splits, out_part, lay.strides["out_part"][:4], lse_part, lay.strides["lse_part"], float("-inf"))


def _append_launch(kv: _KVCall) -> Launch:
    """Writes the new keys and values (rotated, with rotary) into the cache."""
    s, lay, cache = kv.s, kv.lay, kv.cache
    k_new, v_new = lay.input("k_new", s.k_new, kv.rows), lay.input("v_new", s.v_new, kv.rows)
    grid = (kv.batch * kv.nheads_k * cdiv(kv.seqlen_new, dc.APPEND_BLOCK_T),)
    return _launch("append_kv_kernel", grid, dict(
        K_new=k_new, V_new=v_new, K_cache=Slot("k_cache"), V_cache=Slot("v_cache"), Cos=kv.cos, Sin=kv.sin,
        Seqlens=kv.seqlens, BatchIdx=kv.batch_idx, BlockTable=cache.block_table,
        **_named("stride_kn", "bsh", lay.rows("k_new")), **_named("stride_vn", "bsh", lay.rows("v_new")),
        **_named("stride_kc", "bsh", lay.strides["k_cache"][:3]),
        **_named("stride_vc", "bsh", lay.strides["v_cache"][:3]),
        stride_btb=cache.stride_btb, stride_ro=kv.stride_ro, nheads_k=kv.nheads_k, seqlen_new=kv.seqlen_new,
        head_dim=kv.head_dim, rotary_half=kv.rotary_half, page_size=cache.page_size,
        identity_table=cache.identity_table),
        dict(dc.append_constexprs(kv.block_d, cache.paged, cache.batch_idx, s.cos is not None, s.rotary_interleaved)),
        dc.AUX_CONFIG)


def _rotary_q_launch(kv: _KVCall, q_rot: Slot) -> Launch:
    """Writes q rotated into ``q_rot``."""
    lay = kv.lay
    grid = (kv.batch * kv.nheads * cdiv(kv.seqlen_q, dc.APPEND_BLOCK_T),)
    return _launch("rotary_q_kernel", grid, dict(
        Q=kv.q, Q_out=q_rot, Cos=kv.cos, Sin=kv.sin, Seqlens=kv.seqlens,
        **_named("stride_q", "bsh", lay.rows(kv.q)), **_named("stride_o", "bsh", lay.rows(q_rot)),
        stride_ro=kv.stride_ro, nheads=kv.nheads, seqlen_q=kv.seqlen_q, head_dim=kv.head_dim,
        rotary_half=kv.rotary_half),
        dc.rotary_q_constexprs(kv.block_d, _is_local(kv.s.scalars), kv.s.rotary_interleaved), dc.ROTARY_CONFIG)


def _plain_decode(kv: _KVCall, config: configs.Config, target: Target) -> bool:
    """Whether the shipped exact-call image of the decoding step serves this launch exactly
    (:data:`flash_attn.planning.decode_configs.SPLIT_KV_EXACT`)."""
    s, sc = kv.s, kv.s.scalars
    # a window whose left side is unbounded masks nothing for one query row (aligned bottom-right)
    unmasked = not _is_local(sc) or (kv.seqlen_q == 1 and sc.window_left < 0)
    return (dc.ships_exact(target.family) and config == dc.DECODE_CONFIGS[(target.family, kv.block_d)][0]
            and unmasked and sc.softcap == 0.0 and s.alibi is None and s.leftpad is None
            and s.block_table is None and s.batch_idx is None)


def _split_kv_features(kv: _KVCall, config: configs.Config, target: Target) -> dict:
    """The split kernel's feature flags: the call's own (JIT), else the shipped exact-call image's
    where it serves the call, else every feature (superset)."""
    if kv.superset:
        return dict(dc.SPLIT_KV_EXACT if _plain_decode(kv, config, target) else dc.SPLIT_KV_SUPERSET)
    s = kv.s
    return dict(IS_LOCAL=_is_local(s.scalars), HAS_SOFTCAP=s.scalars.softcap > 0.0, HAS_ALIBI=s.alibi is not None,
                HAS_LEFTPAD=s.leftpad is not None, PAGED=kv.cache.paged, HAS_BATCH_IDX=kv.cache.batch_idx)


def _split_kv_launch(kv: _KVCall, q: Slot, config: configs.Config, m_blocks: int, parts: _Partials,
                     target: Target) -> Launch:
    """Attention of q (``q``: rotated or not) over the cache, its keys in ``parts.splits`` splits."""
    s, lay, cache, sc = kv.s, kv.lay, kv.cache, kv.s.scalars
    return _launch("split_kv_kernel", (kv.batch * kv.nheads_k * m_blocks, parts.splits), dict(
        Q=q, K=Slot("k_cache"), V=Slot("v_cache"), Out=kv.out, OutPart=parts.out, Lse=parts.lse,
        Seqlens=kv.seqlens, Leftpad=kv.leftpad, BatchIdx=kv.batch_idx, BlockTable=cache.block_table, Alibi=kv.alibi,
        **_named("stride_q", "bsh", lay.rows(q)), **_named("stride_k", "bsh", lay.strides["k_cache"][:3]),
        **_named("stride_v", "bsh", lay.strides["v_cache"][:3]), **_named("stride_o", "bsh", lay.rows(kv.out)),
        **_named("stride_p", "xbsh", parts.out_strides), **_named("stride_l", "xbsh", parts.lse_strides),
        stride_btb=cache.stride_btb, stride_ab=_alibi_batch_stride(lay, s.alibi),
        nheads_k=kv.nheads_k, seqlen_q=kv.seqlen_q, seqlen_new=kv.seqlen_new, group=kv.nheads // kv.nheads_k,
        head_dim=kv.head_dim, page_size=cache.page_size, use_leftpad=int(s.leftpad is not None),
        use_alibi=int(s.alibi is not None), identity_table=cache.identity_table, softmax_scale=sc.softmax_scale,
        softcap=sc.softcap, window_left=sc.window_left, window_right=sc.window_right, empty_lse=parts.empty_lse),
        dc.split_kv_constexprs(config, kv.block_d, _split_kv_features(kv, config, target)), config)


def _combine_launch(kv: _KVCall, parts: _Partials) -> Launch:
    """Merges the splits' partial results into out and lse."""
    grid = (kv.batch * cdiv(kv.seqlen_q * kv.nheads, dc.COMBINE_BLOCK_R),)
    return _launch("combine_splits_kernel", grid, dict(
        OutPart=parts.out, LsePart=parts.lse, Out=kv.out, Lse=kv.lse,
        **_named("stride_p", "xbsh", parts.out_strides), **_named("stride_m", "xbsh", parts.lse_strides),
        **_named("stride_o", "bsh", kv.lay.rows(kv.out)), **_named("stride_l", "bsh", kv.lse_rows),
        num_splits=parts.splits, seqlen_q=kv.seqlen_q, nheads=kv.nheads, head_dim=kv.head_dim),
        dc.combine_constexprs(kv.block_d), dc.COMBINE_CONFIG)


def plan_kvcache(s: KVCacheShape, target: Target) -> Planned:
    """Append the new keys/values (:func:`_append_launch`), rotate q (:func:`_rotary_q_launch`),
    attend over the cache in key splits (:func:`_split_kv_launch`), combine them (:func:`_combine_launch`)."""
    why = _kvcache_refusal(s, target)
    if why is not None:
        return why
    kv = _kv_call(s, target)
    launches = []
    if s.k_new is not None and kv.seqlen_new > 0 and kv.batch * kv.nheads_k > 0:
        launches.append(_append_launch(kv))
    queries = kv.batch * kv.nheads * kv.seqlen_q
    q = kv.q
    if s.cos is not None and queries > 0:
        q = kv.lay.buffer("q_rot", s.q.shape, s.q.dtype, padded=kv.superset)
        launches.append(_rotary_q_launch(kv, q))
    if queries > 0:
        config, m_blocks, splits = _kv_splits(kv, target)
        parts = _kv_partials(kv, splits)
        launches.append(_split_kv_launch(kv, q, config, m_blocks, parts, target))
        if splits > 1:
            launches.append(_combine_launch(kv, parts))
    return _finish(s.q.dtype, kv.lay, launches, ("out", "lse"))
