"""PyTorch's own fused CPU attention kernels, used (by :mod:`flash_attn.backends.cpu`) wherever
their semantics are exactly ours.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (the kernel behind
``scaled_dot_product_attention`` on the CPU) returns the output *and* the log-sum-exp, handles
GQA natively and takes the softmax scale; its backward takes ``out`` and ``logsumexp`` as inputs
(so a caller's global ``out``/``lse`` are used, as context parallelism needs). What it does not
share with flash-attn is spelled out here and worked around exactly:

* its ``is_causal`` mask is aligned top-left; ours bottom-right. With ``sq > sk`` the first
  ``sq - sk`` rows see nothing and the rest is a square; with ``sq < sk`` the first ``sk - sq``
  keys are seen by every row and the rest is a square: two calls merged by log-sum-exp;
* a sliding window is cut in blocks of query rows: the columns every row of a block sees run
  without a mask, the band's right edge on the kernel's causal mask and its left edge with a
  small explicit mask; invisible columns cost nothing;
* causal ALiBi needs no mask block: for keys left of the diagonal its bias
  ``-slope * (i + sk - sq - j)`` is a per-key term (a broadcast ``(h, 1, cols)`` mask) plus a
  per-row term (taken out of the log-sum-exp), both kept small near the diagonal;
* other ALiBi and per-sequence key ranges (the KV cache) become an explicit additive fp32 mask,
  built per block of query rows over only the key columns that block can see, so memory stays
  O(n) (the tuning's ``mask_budget_bytes``);
* its causal mask skips work only in blocks of 512 keys: an fp32 causal square runs as a tree
  of batched calls that compute about the visible half (:mod:`._causal_tree`);
* a row that sees no key must give out 0 and lse +inf (the kernel gives lse 0): fixed up;
* special values: the kernel's row max skips NaN, so a row whose visible scores are all NaN (a NaN
  in q, say) or hold +inf gives out 0 instead of NaN, and an explicit mask adds -inf to a hidden
  NaN score, which reaches the row. Every such row ends with an lse that is NaN, infinite or 0
  (checked on every call: one pass over lse), and then :func:`attention_forward` answers None
  and the tiled engine, which follows upstream's semantics, computes the problem;
* softcap and dropout (our Philox mask) have no counterpart: :func:`supports` says no and the
  tiled engine of :mod:`._reference_core` runs them, except softcap where :mod:`._onednn`
  computes every call of the plan (it softcaps its scores itself);
* where PyTorch's BLAS is the kernel's slow part (MKL on AMD CPUs), calls without an explicit
  mask or ALiBi run on :mod:`._onednn` instead: the same contract on oneDNN's fp32 products.

Problems are :class:`~flash_attn.backends._reference_core.Problem` objects, so the same code
serves dense tensors, one varlen sequence and the KV cache. Every plan takes the engine's
sizes (:class:`~flash_attn.backends._reference_core.Tuning`) and the CPU's features
(:class:`Features`) as parameters (:func:`flash_attn.backends.cpu.engine`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from flash_attn.backends import _causal_tree, _onednn
from flash_attn.backends import _reference_core as core
from flash_attn.backends._reference_core import DEFAULT_TUNING, Tuning
from flash_attn.params import AttentionParams

# A band at most this many blocks wide runs as one masked call per block: computing its few
# columns under a mask costs less than two more calls and their merge.
NARROW_BAND_BLOCKS = 2
# (Where the tuning's numbers come from: benchmarks/README.md, "CPU engine: where its thresholds come from".)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ops():
    aten = torch.ops.aten
    name = "_scaled_dot_product_flash_attention_for_cpu"
    # torch's own binding of the forward is quicker per call than torch.ops (no Python overload
    # resolution); the backward has none
    forward = getattr(torch, name, None) or getattr(aten, name, None)
    backward = getattr(aten, name + "_backward", None)
    return (forward, backward) if forward is not None and backward is not None else None


OPS = _ops()


def supports(problem: core.Problem, params: AttentionParams, tuning: Tuning = DEFAULT_TUNING,
             features: Optional["Features"] = None) -> bool:
    """True when this module's plan computes exactly this problem (for a CPU with ``features``,
    :data:`THIS_CPU` if not given): the fused kernels, or with softcap, which they have no
    counterpart for, :mod:`._onednn` for every call (:func:`_softcap_on_onednn`)."""
    q = problem.q
    return (
        OPS is not None
        and q.device.type == "cpu"
        and q.dtype in DTYPES
        and params.dropout_p == 0
        and problem.head_dim_v == q.shape[-1]
        and (params.softcap == 0 or _softcap_on_onednn(problem, params, tuning, features or THIS_CPU))
        and problem.qv is None  # PyTorch's kernels have no scores against V, nor attention sinks
        and problem.sinks is None
    )


def _softcap_on_onednn(problem: core.Problem, params: AttentionParams, tuning: Tuning, features: "Features") -> bool:
    """Whether :mod:`._onednn` computes every call of the plan, forward and backward (the backward
    in fp32: bf16 converted head by head there, fp16 as a whole problem first): then the plan
    runs softcap, faster than the tiled engine (oneDNN's fp32 products are the quicker ones where
    it applies)."""
    dtype = problem.q.dtype
    if dtype == torch.float16 and features.native_fp16():
        return False  # computed in fp16 by PyTorch's kernels, which cannot softcap
    forward_dtype = torch.float32 if dtype == torch.float16 else dtype
    for backward, compute in ((False, forward_dtype), (True, torch.float32)):
        for group in plan(problem, params, backward, tuning):
            for call in group:
                if call.masked or problem.alibi_slopes is not None or not onednn_takes(
                        compute, call.i1 - call.i0, call.c1 - call.c0, tuning, features, backward):
                    return False
    return True


# ----------------------------------------------------------------------------------------------
# Half precision computed in fp32 where PyTorch's half kernels are the slower ones
# ----------------------------------------------------------------------------------------------


@functools.cache
def _native_fp16() -> bool:
    """Whether oneDNN multiplies fp16 matrices natively on this CPU (AVX512-FP16 or AMX-FP16);
    without it PyTorch's fp16 attention kernels fall back to scalar products."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


@functools.cache
def _amx() -> bool:
    """Whether this CPU has AMX tiles (taken as true where PyTorch cannot say)."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    return init is None or bool(init())


@dataclasses.dataclass(frozen=True)
class Features:
    """What the engine asks of the CPU it runs on: probes, each asked only where a plan needs the
    answer (those of :data:`THIS_CPU` measure once per process), and oneDNN's product. Tests
    pass fakes, so that every policy runs on any CPU."""

    # () -> whether fp16 products are native (else fp16 problems run on the fp32 kernels).
    native_fp16: Callable[[], bool]
    # () -> whether the CPU has AMX tiles (else larger bf16 forwards run in fp32).
    amx: Callable[[], bool]
    # (threads) -> whether oneDNN's fp32 products are much faster than PyTorch's BLAS here.
    onednn_faster: Callable[[int], bool]
    # oneDNN's fp32 product (:data:`._onednn.LINEAR`), or None: no oneDNN calls.
    onednn_linear: Optional[Callable]


# The CPU this process runs on.
THIS_CPU = Features(native_fp16=_native_fp16, amx=_amx, onednn_faster=_onednn.faster_here,
                    onednn_linear=_onednn.LINEAR)


def bf16_forward_as_fp32_tree(rows: int, cols: int, tuning: Tuning, features: Features) -> bool:
    """Whether a bf16 causal ``rows x cols`` call (top-left aligned) runs forward as the fp32
    tree: from ``tuning.bf16_tree_min_rows`` rows on a CPU without AMX (converting costs more
    than the tree saves on smaller squares)."""
    return (rows >= tuning.bf16_tree_min_rows and _causal_tree.applies(rows, cols, torch.float32, tuning.tree_min_rows)
            and not features.amx())


def bf16_full_forward_in_fp32(rows: int, cols: int, tuning: Tuning, features: Features) -> bool:
    """Whether a bf16 full (unmasked, non-causal) ``rows x cols`` call runs forward on the fp32
    kernel: from ``tuning.bf16_full_fp32_min`` rows and keys on a CPU without AMX."""
    least = tuning.bf16_full_fp32_min
    return rows >= least and cols >= least and not features.amx()


def _runs_in_fp32(problem: core.Problem, groups: list[list[_Call]], backward: bool, tuning: Tuning,
                  features: Features) -> bool:
    """Whether a half-precision problem runs faster on the fp32 kernels (its values are exact in
    fp32, and fp32 arithmetic only rounds less, so the result is at least as accurate):

    * fp16 without native fp16 products (PyTorch's fp16 kernels then use scalar products);
    * the bf16 forward of a causal square from ``tuning.bf16_tree_min_rows`` rows, on a CPU
      without AMX (the fp32 tree);
    * the bf16 forward of full attention from ``tuning.bf16_full_fp32_min`` rows and keys, on a
      CPU without AMX,
    except where :mod:`._onednn`'s forward runs (it converts bf16 block by block itself). The bf16
    backward kernel stays (slower in fp32, also on :mod:`._onednn`). Measurements:
    benchmarks/README.md.
    """
    dtype = problem.q.dtype
    if dtype == torch.float16:
        return not features.native_fp16()
    if dtype != torch.bfloat16 or backward:
        return False
    if any(_onednn_applies(problem, call, tuning, features) for group in groups for call in group):
        return False  # its forward computes bf16 in fp32 itself, block by block
    for group in groups:
        for call in group:
            rows, cols = call.i1 - call.i0, call.c1 - call.c0
            if _plain_causal(problem, call) and bf16_forward_as_fp32_tree(rows, cols, tuning, features):
                return True
            if _plain_full(problem, call) and bf16_full_forward_in_fp32(rows, cols, tuning, features):
                return True
    return False


def _in_fp32(problem: core.Problem) -> core.Problem:
    """The problem with q and every loaded K/V block converted to fp32."""
    load_kv = problem.load_kv
    return dataclasses.replace(problem, q=problem.q.float(),
                               load_kv=lambda c0, c1: tuple(t.float() for t in load_kv(c0, c1)))


# ----------------------------------------------------------------------------------------------
# The plan: which kernel calls cover which rows and columns
# ----------------------------------------------------------------------------------------------


class _Call:
    """One kernel call: query rows ``i0:i1`` against stored key columns ``c0:c1``.

    ``causal``: the kernel's own (top-left) causal mask, used on blocks whose diagonal is ours.
    ``masked``: an explicit mask is built from the problem's geometry.
    """

    __slots__ = ("i0", "i1", "c0", "c1", "causal", "masked")

    def __init__(self, i0, i1, c0, c1, causal=False, masked=False):
        self.i0, self.i1, self.c0, self.c1, self.causal, self.masked = i0, i1, c0, c1, causal, masked

    def __repr__(self):
        kind = "causal" if self.causal else "masked" if self.masked else "full"
        return f"_Call(rows {self.i0}:{self.i1}, cols {self.c0}:{self.c1}, {kind})"


def plan(problem: core.Problem, params: AttentionParams, backward: bool = False,
         tuning: Tuning = DEFAULT_TUNING) -> list[list[_Call]]:
    """Groups of calls; the calls of one group share their rows and see disjoint columns, and
    are merged by log-sum-exp. Rows in no group see no key (out 0, lse +inf). The backward may
    cut a window differently (each call takes its share from the global ``out``/``lse``).
    ``tuning``: the sizes of its blocks."""
    sq, sk = problem.seqlen_q, problem.n_cols
    if sq == 0 or sk == 0:
        return []
    one_range = (
        len(problem.key_start) == 1 and problem.key_start[0] == 0
        and len(problem.key_len) == 1 and problem.key_len[0] == sk
    )
    left, right = params.window_left, params.window_right
    if not one_range or (problem.alibi_slopes is not None and right != 0):
        return _masked_plan(problem, params, tuning)
    if left < 0 and right < 0:
        return [[_Call(0, sq, 0, sk)]]
    if left < 0 and right == 0:  # bottom-right causal from the kernel's top-left causal
        if sq >= sk:
            return [[_Call(sq - sk, sq, 0, sk, causal=True)]]
        return [[_Call(0, sq, 0, sk - sq), _Call(0, sq, sk - sq, sk, causal=True)]]
    # PyTorch's half-precision backward kernels are slow on small blocks: larger ones there
    half_backward = backward and problem.q.dtype != torch.float32
    min_rows = tuning.band_min_rows_half_backward if half_backward else tuning.band_min_rows
    return _band_plan(sq, sk, left, right, min_rows, tuning.band_max_rows)


def _band_plan(sq: int, sk: int, left: int, right: int, min_rows: int, max_rows: int) -> list[list[_Call]]:
    """A sliding window over one key range: per block of rows (an eighth of the window, between
    ``min_rows`` and ``max_rows``: small blocks waste less work on the band's edges, large ones
    make fewer calls), the columns every row sees run unmasked, the left edge with a small mask
    and the right edge on the kernel's causal mask (a narrow band: one masked call per block)."""
    off = sk - sq
    lo = (lambda i: 0) if left < 0 else (lambda i: min(sk, max(0, i + off - left)))
    hi = (lambda i: sk) if right < 0 else (lambda i: min(sk, max(0, i + off + right + 1)))
    span = (sk if left < 0 else left) + (sk if right < 0 else right) + 1
    rows = min(sq, max(min_rows, min(max_rows, span // 8)))
    narrow = span <= NARROW_BAND_BLOCKS * rows
    groups = []
    for i0 in range(0, sq, rows):
        i1 = min(sq, i0 + rows)
        u0, u1 = lo(i0), hi(i1 - 1)  # columns some row sees
        n0, n1 = lo(i1 - 1), hi(i0)  # columns every row sees
        if u0 >= u1:
            continue
        if n0 >= n1 or narrow:  # a narrow band, a block wider than the band, or rows that see nothing
            groups.append([_Call(i0, i1, u0, u1, masked=True)])
            continue
        calls = [_Call(i0, i1, u0, n0, masked=True)] if u0 < n0 else []
        if n1 < u1:
            # row i0 + t sees up to column n1 - 1 + t: top-left causal from column n1 - 1
            if n0 < n1 - 1:
                calls.append(_Call(i0, i1, n0, n1 - 1))
            calls.append(_Call(i0, i1, n1 - 1, u1, causal=True))
        else:
            calls.append(_Call(i0, i1, n0, n1))
        groups.append(calls)
    return groups


def _masked_plan(problem: core.Problem, params: AttentionParams, tuning: Tuning) -> list[list[_Call]]:
    """ALiBi or per-sequence key ranges (the KV cache): one masked call per block of rows, over
    the columns any row of the block may see."""
    sq = problem.seqlen_q
    rows = _mask_rows(problem, tuning)
    groups = []
    for i0 in range(0, sq, rows):
        i1 = min(sq, i0 + rows)
        c0, c1 = core.visible_columns(problem, params, i0, i1)
        if c0 < c1:
            masked = problem.alibi_slopes is not None or not core._tile_fully_visible(problem, params, i0, i1, c0, c1)
            groups.append([_Call(i0, i1, c0, c1, masked=masked)])
    return groups


def _mask_rows(problem: core.Problem, tuning: Tuning) -> int:
    """Query rows per masked call, so that one mask block fits ``tuning.mask_budget_bytes`` (but
    at least ``tuning.min_mask_rows``: fewer make the kernels inefficient)."""
    batch = problem.batch if len(problem.key_len) > 1 or len(problem.key_start) > 1 or _per_batch_slopes(problem) else 1
    heads = problem.nheads if problem.alibi_slopes is not None else 1
    per_row = 4 * batch * heads * max(problem.n_cols, 1)
    return max(tuning.min_mask_rows, tuning.mask_budget_bytes // per_row)


def _per_batch_slopes(problem: core.Problem) -> bool:
    return problem.alibi_slopes is not None and problem.alibi_slopes.shape[0] > 1


def _mask(problem: core.Problem, params: AttentionParams, call: _Call) -> tuple[Tensor, Tensor]:
    """The additive fp32 mask of a call, ``(1 or B, 1 or h, rows, cols)`` (0 / -inf, plus ALiBi),
    and which rows see at least one key, bool ``(1 or B, 1, rows)``."""
    geometry = core._TileGeometry(problem, call.i0, call.i1, call.c0, call.c1)
    visible = geometry.visible(params)[:, :, 0]  # (1 or B, 1, rows, cols)
    hidden = ~visible
    if problem.alibi_slopes is None:
        mask = torch.where(hidden, float("-inf"), 0.0)
    else:
        # -slope * |i + sk - sq - j| per head, in fp32 (rounded once, as the tiled engine does)
        distance = (geometry.diagonal.to(torch.float32) - geometry.positions.to(torch.float32)).abs_()[:, :, 0]
        slopes = problem.alibi_slopes.view(problem.alibi_slopes.shape[0], problem.nheads, 1, 1)
        mask = torch.mul(distance, slopes.neg())
        mask.masked_fill_(hidden, float("-inf"))
    return mask, visible.any(-1)


def _alibi_columns(problem: core.Problem, call: _Call) -> tuple[Tensor, Tensor]:
    """Causal ALiBi of an unmasked call (every key at or left of each row's diagonal):
    ``-slope * (i + sk - sq - j) = slope * (j - j0) - slope * (i + sk - sq - j0)``.

    Returns the per-key term as a broadcast mask ``(1 or B, h, 1, cols)`` and the per-row term
    ``(1 or B, h, rows)`` to take out of the kernel's log-sum-exp. ``j0``, the diagonal of the
    call's last row, keeps both small (exact in fp32) where the probabilities are.
    """
    j0 = call.i1 - 1 + problem.key_len[0] - problem.seqlen_q
    slopes = problem.alibi_slopes.to(torch.float32).view(-1, problem.nheads, 1)
    device = problem.q.device
    first = call.c0 - problem.key_start[0] - j0
    columns = torch.arange(first, first + call.c1 - call.c0, device=device, dtype=torch.float32)
    rows = torch.arange(call.i0 - call.i1 + 1, 1, device=device, dtype=torch.float32)
    return (slopes * columns).unsqueeze(2), slopes * rows


# ----------------------------------------------------------------------------------------------
# Forward and backward
# ----------------------------------------------------------------------------------------------


def _heads_first(x: Tensor) -> Tensor:
    """``(B, s, h, d)`` -> the kernel's ``(B, h, s, d)`` (a view)."""
    return x.transpose(1, 2)


def _run_forward(problem: core.Problem, params: AttentionParams, call: _Call, tuning: Tuning, features: Features,
                 onednn: bool = True) -> tuple[Tensor, Tensor]:
    """``(out (B, h, rows, d), lse fp32 (B, h, rows))`` of one call; a row that sees none of the
    call's keys gets out 0 and lse -inf (the log of an empty sum, so merging ignores it)."""
    forward, _ = OPS
    k, v = problem.load_kv(call.c0, call.c1)
    if onednn and _onednn_applies(problem, call, tuning, features):
        forward = functools.partial(_onednn.forward, softcap=params.softcap, tuning=tuning,
                                    linear=features.onednn_linear)
    elif params.softcap:
        raise AssertionError(f"{call} of a softcap problem is not a oneDNN call")  # supports() said it is
    elif _tree_applies(problem, call, tuning):
        out, lse = _causal_tree.forward(forward, problem.q[:, call.i0:call.i1], k, v, params.softmax_scale,
                                        tuning.tree_base_rows)
        if not plain_scores(lse):
            raise SpecialScores
        return out, lse
    mask = seen = row_term = None
    if call.masked:
        mask, seen = _mask(problem, params, call)
    elif problem.alibi_slopes is not None:
        mask, row_term = _alibi_columns(problem, call)
    out, lse = forward(_heads_first(problem.q[:, call.i0:call.i1]), _heads_first(k), _heads_first(v), 0.0,
                       call.causal, attn_mask=mask, scale=params.softmax_scale)
    if row_term is not None:
        lse = lse - row_term
    if not plain_scores(lse, seen):
        raise SpecialScores
    if seen is not None and not bool(seen.all()):
        seen = seen.expand(lse.shape)
        out = out.masked_fill(~seen.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(~seen, float("-inf"))
    return out, lse


class SpecialScores(Exception):
    """A call met NaN or infinite scores, whose results the fused kernel does not compute as
    upstream does (module docstring)."""


def plain_scores(lse: Tensor, seen: Optional[Tensor] = None) -> bool:
    """Whether the kernel's ``lse`` shows only finite scores: finite and non-zero on every row
    that sees a key (``seen``, broadcast to lse; None: every row). A row with a NaN or +inf
    score, or only -inf ones, ends NaN, infinite or 0 there; an exact lse of 0 is rare and merely
    sends the problem to the tiled engine."""
    size = lse.abs()
    plain = (size > 0) & (size < float("inf"))
    if seen is not None:
        plain |= ~seen
    return bool(plain.all())


def _plain_causal(problem: core.Problem, call: _Call) -> bool:
    """A call on the kernel's causal mask alone (no explicit mask, no ALiBi)."""
    return call.causal and not call.masked and problem.alibi_slopes is None


def _plain_full(problem: core.Problem, call: _Call) -> bool:
    """A call with no mask at all (not causal, no explicit mask, no ALiBi)."""
    return not call.causal and not call.masked and problem.alibi_slopes is None


def onednn_takes(dtype: torch.dtype, rows: int, cols: int, tuning: Tuning, features: Features,
                 backward: bool = False) -> bool:
    """Whether :mod:`._onednn` computes a ``rows x cols`` call without mask or ALiBi, faster than
    the fused kernel: fp32, and the forward of bf16 from ``tuning.bf16_onednn_min`` rows and keys
    (converted block by block, not as a whole problem first)."""
    if dtype == torch.bfloat16:
        if backward or min(rows, cols) < tuning.bf16_onednn_min:
            return False
    elif dtype != torch.float32:
        return False
    return _onednn.applies(rows, cols, tuning, features.onednn_linear, features.onednn_faster)


def _onednn_applies(problem: core.Problem, call: _Call, tuning: Tuning, features: Features,
                    backward: bool = False, dtype: Optional[torch.dtype] = None) -> bool:
    """A call of ``problem`` that :func:`onednn_takes`, computed in ``dtype`` (None: the problem's)."""
    return (not call.masked and problem.alibi_slopes is None
            and onednn_takes(dtype or problem.q.dtype, call.i1 - call.i0, call.c1 - call.c0, tuning, features, backward))


def _tree_applies(problem: core.Problem, call: _Call, tuning: Tuning) -> bool:
    """A plain causal square that :mod:`._causal_tree` serves."""
    return _plain_causal(problem, call) and _causal_tree.applies(call.i1 - call.i0, call.c1 - call.c0,
                                                                 problem.q.dtype, tuning.tree_min_rows)


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Softmax-weighted sum of partial results over disjoint key sets, in fp32."""
    if len(parts) == 1:
        return parts[0]
    lse = parts[0][1]
    for _, part_lse in parts[1:]:
        lse = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isinf(lse), 0.0, lse)
    out = sum(o.float() * torch.exp(part_lse - finite).unsqueeze(-1) for o, part_lse in parts)
    return out.to(parts[0][0].dtype), lse


@torch.no_grad()
def attention_forward(problem: core.Problem, params: AttentionParams, tuning: Tuning = DEFAULT_TUNING,
                      features: Features = THIS_CPU, onednn: bool = True) -> Optional[tuple[Tensor, Tensor]]:
    """``out`` like q and fp32 ``lse (B, h, sq)``, as :func:`core.attention_forward`, planned with
    ``tuning`` for a CPU with ``features``; None where a score is NaN or infinite (the tiled
    engine then computes the problem, see the module docstring). ``onednn``: whether :mod:`._onednn`
    may compute calls (not for a bf16 problem converted to fp32 for the fused kernels' sake: below
    its own size, see :func:`_runs_in_fp32`)."""
    try:
        return _forward(problem, params, tuning, features, onednn)
    except SpecialScores:
        return None


def _forward(problem: core.Problem, params: AttentionParams, tuning: Tuning, features: Features,
             onednn: bool) -> tuple[Tensor, Tensor]:
    q = problem.q
    B, sq, h, d = q.shape
    groups = plan(problem, params, False, tuning)
    if _runs_in_fp32(problem, groups, False, tuning, features):
        out, lse = _forward(_in_fp32(problem), params, tuning, features, onednn=q.dtype != torch.bfloat16)
        return out.to(q.dtype), lse
    if len(groups) == 1 and groups[0][0].i0 == 0 and groups[0][0].i1 == sq:  # one block: no copies
        out, lse = _merge([_run_forward(problem, params, call, tuning, features, onednn) for call in groups[0]])
        if any(call.masked for call in groups[0]):  # only a mask can leave a row without keys
            lse.masked_fill_(lse == float("-inf"), float("inf"))
        return out.transpose(1, 2), lse
    out = q.new_zeros(B, sq, h, d)
    lse = torch.full((B, h, sq), float("inf"), dtype=torch.float32, device=q.device)
    for group in groups:
        rows = slice(group[0].i0, group[0].i1)
        group_out, group_lse = _merge([_run_forward(problem, params, call, tuning, features, onednn)
                                       for call in group])
        out[:, rows] = group_out.transpose(1, 2)
        lse[:, :, rows] = group_lse.masked_fill_(group_lse == float("-inf"), float("inf"))
    return out, lse


@torch.no_grad()
def attention_backward(
    problem: core.Problem, params: AttentionParams, dout: Tensor, out: Tensor, lse: Tensor,
    tuning: Tuning = DEFAULT_TUNING, features: Features = THIS_CPU,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq (B, sq, h, d)``, ``dk, dv (B, n_cols, hk, d)``, as :func:`core.attention_backward`
    (in the dtype computed in when one call covers everything, else accumulated in fp32);
    ``tuning`` and ``features`` as :func:`attention_forward`'s.

    Every call's probabilities come from the given ``lse`` and its correction term from the
    given ``out`` (not recomputed), so a block of a longer sequence gets its exact share.
    """
    q = problem.q
    B, sq, h, d = q.shape
    groups = plan(problem, params, True, tuning)
    if _runs_in_fp32(problem, groups, True, tuning, features):
        return attention_backward(_in_fp32(problem), params, dout.float(), out.float(), lse, tuning, features)
    calls = [call for group in groups for call in group]
    if len(calls) == 1 and (calls[0].i0, calls[0].i1, calls[0].c0, calls[0].c1) == (0, sq, 0, problem.n_cols):
        return _run_backward(problem, params, calls[0], dout, out, lse, tuning, features, q.dtype)
    dq = torch.zeros(B, sq, h, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(B, problem.n_cols, problem.nheads_k, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, problem.n_cols, problem.nheads_k, problem.head_dim_v, dtype=torch.float32, device=q.device)
    for call in calls:
        gq, gk, gv = _run_backward(problem, params, call, dout, out, lse, tuning, features)
        dq[:, call.i0:call.i1] += gq
        dk[:, call.c0:call.c1] += gk
        dv[:, call.c0:call.c1] += gv
    return dq, dk, dv


def _run_backward(problem, params, call, dout, out, lse, tuning, features, grad_dtype=torch.float32):
    """``(dq rows, dk cols, dv cols)`` of one call, ``(B, n, heads, d)``; :mod:`._onednn`'s in
    ``grad_dtype``, the fused kernel's in the dtype it computes in."""
    _, backward = OPS
    rows = slice(call.i0, call.i1)
    k, v = problem.load_kv(call.c0, call.c1)
    lse_c = lse[:, :, rows]
    # softcap's backward: on oneDNN's fp32 products, bf16 converted head by head (_softcap_on_onednn)
    compute = torch.float32 if params.softcap else problem.q.dtype
    if _onednn_applies(problem, call, tuning, features, backward=True, dtype=compute):
        backward = functools.partial(_onednn.backward, softcap=params.softcap, tuning=tuning,
                                     linear=features.onednn_linear, grad_dtype=grad_dtype)
    elif params.softcap:
        raise AssertionError(f"{call} of a softcap problem is not a oneDNN call")  # supports() said it is
    elif _tree_applies(problem, call, tuning):
        return _causal_tree.backward(backward, dout[:, rows], problem.q[:, rows], k, v, out[:, rows], lse_c,
                                     params.softmax_scale, tuning.tree_base_rows)
    mask = None
    if call.masked:
        mask = _mask(problem, params, call)[0]
        # rows that see no key (lse +inf) are all -inf in the mask: any finite lse gives P = 0
        lse_c = torch.where(torch.isinf(lse_c), 0.0, lse_c)
    elif problem.alibi_slopes is not None:
        mask, row_term = _alibi_columns(problem, call)
        lse_c = lse_c + row_term  # the kernel's scores carry only the per-key term
    grads = backward(
        _heads_first(dout[:, rows]), _heads_first(problem.q[:, rows]), _heads_first(k), _heads_first(v),
        _heads_first(out[:, rows]), lse_c.contiguous(), 0.0, call.causal, attn_mask=mask,
        scale=params.softmax_scale,
    )
    return tuple(g.transpose(1, 2) for g in grads)
