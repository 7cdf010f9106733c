"""Exact, memory-bounded attention in plain PyTorch: the engine of the reference backend (and
of the cpu backend for what PyTorch's fused kernels do not compute).

Everything here works on one *batched problem* (:class:`Problem`): ``B`` sequences that share
the query length ``sq``. Keys are read chunk by chunk through a loader, so the same code serves
dense tensors, one varlen sequence, and the (possibly paged) KV cache, and never holds a full
``(sq x sk)`` score matrix:

* the forward walks query chunks and, inside each, the key chunks that can be visible to it,
  with an online (running max / running sum) softmax, all in fp32;
* the backward recomputes the probabilities tile by tile from the saved logsumexp (the flash
  attention backward) and accumulates dq per query chunk and dk/dv per key column.

Tiles are small enough to stay in the CPU's caches (``Tuning.tile_budget_bytes``), and scores are
kept in base 2 (``exp2`` is several times faster than ``exp`` on CPUs): the softmax scale times
``log2(e)`` is folded into q. Softcap ``c * tanh(x / c)`` is computed as ``c * e / (e + 2)`` with
``e = expm1(2x / c)`` (``2 / c`` folded into q): exact where ``x / c`` is small (``expm1`` keeps its
relative precision there, where ``2 * sigmoid - 1`` or ``1 - 2 / (exp + 1)`` cancel) and where it
is large (``e / (e + 2)`` rounds to 1), and several times faster than ``tanh`` on CPUs. K/V are
converted to fp32 once per problem when that copy is small (``Tuning.preload_budget_bytes``), not
once per query chunk.

Special values (NaN, +-inf, overflowing products) follow upstream's kernels: a NaN or +inf among a
row's visible scores makes its output and lse NaN (the online max propagates it), a row whose
visible scores are all -inf is a row without keys (out 0, lse +inf), and a hidden key never
reaches a row's scores (the mask replaces a non-finite score instead of adding -inf to it).

Tiles keep the grouped-query layout ``(B, hk, g, rows, cols)`` (``h = hk * g``; query head
``kh * g + gi`` reads kv head ``kh``), so K/V are never repeated across the group.

Stored key *columns* ``c`` (what the loader indexes) map to key *positions* ``j = c - key_start``
(``key_start`` is the KV-cache left padding, else 0); a sequence has ``key_len`` positions, and
masking, ALiBi and dropout all use positions.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from flash_attn.dropout import keep_mask
from flash_attn.params import AttentionParams

# Tile width over height: row statistics and the output accumulator are updated once per tile.
TILE_ASPECT = 4
# Dropout regenerates its mask with int64 arithmetic (several tile-sized int64 temporaries),
# so dropout tiles are made this many times smaller.
DROPOUT_TILE_SHRINK = 2
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# expm1's argument is clamped here: tanh(32) is 1 in fp32, and expm1(+inf) / (expm1(+inf) + 2) is NaN.
SOFTCAP_CLAMP = 64.0


@dataclass(frozen=True)
class Tuning:
    """The sizes the CPU engine is tuned with: this module's tile budgets, and the thresholds of
    the fused kernels' plan (:mod:`._cpu_fused`), the causal tree (:mod:`._causal_tree`) and the
    oneDNN products (:mod:`._onednn`). The defaults are the measured ones (benchmarks/README.md,
    "CPU engine: where its thresholds come from"); tests pass small ones, so that every kind of
    block, tile and call appears on small shapes. A parameter of the engines, never changed in
    place (:func:`flash_attn.backends.cpu.engine`)."""

    # Bytes of one fp32 score tile (B x h x chunk_q x chunk_k) on the CPU: in the caches, yet few tiles.
    tile_budget_bytes: int = 1 << 20
    # The same on GPUs (MPS, ROCm, old CUDA), where every op is a kernel launch: fewer, larger tiles.
    accelerator_tile_budget_bytes: int = 64 << 20
    # Bytes of scratch buffers a thread keeps between calls on the CPU (:class:`_Scratch`).
    kept_scratch_bytes: int = 8 << 20
    # K and V columns (fp32, all a problem may see) are converted once up to this size, else per tile.
    preload_budget_bytes: int = 256 << 20
    # Bytes of one explicit mask block of the fused plan (rows x visible columns x ALiBi heads x batch, fp32).
    mask_budget_bytes: int = 64 << 20
    # Fewest query rows per masked call (fewer make the kernels, the backward most, inefficient).
    min_mask_rows: int = 128
    # Query rows per block of a sliding window: an eighth of the window, within these bounds.
    band_min_rows: int = 128
    band_max_rows: int = 1024
    # The lower bound for the half-precision backward (PyTorch's kernels are slow on small blocks).
    band_min_rows_half_backward: int = 256
    # A bf16 causal square from this many rows runs forward as the fp32 tree without AMX.
    bf16_tree_min_rows: int = 768
    # bf16 full attention from this many rows and keys runs forward in fp32 without AMX.
    bf16_full_fp32_min: int = 3072
    # bf16 forwards from this many rows and keys run on oneDNN (converted block by block).
    bf16_onednn_min: int = 512
    # Rows of the causal tree's diagonal blocks: between this and twice this.
    tree_base_rows: int = 64
    # Smallest causal square cut as a tree (below, its extra calls cost more than they save).
    tree_min_rows: int = 5 * 64
    # Fewest query rows, and keys, of a call on oneDNN (per-tile Python costs more than it saves).
    onednn_min_rows: int = 256
    onednn_min_cols: int = 256
    # Query rows of oneDNN's tiles in the forward of full attention.
    onednn_full_forward_rows: int = 256
    # Query rows of oneDNN's causal and backward tiles (they must divide ``onednn_cols``).
    onednn_rows: int = 128
    # Keys per oneDNN tile.
    onednn_cols: int = 2048


DEFAULT_TUNING = Tuning()

KVLoader = Callable[[int, int], tuple[Tensor, Tensor]]


@dataclass
class Problem:
    """One batched attention problem.

    q: ``(B, sq, h, d)``. ``load_kv(c0, c1)`` returns K and V columns ``c0:c1``, each
    ``(B, c1 - c0, hk, d)`` / ``(B, c1 - c0, hk, dv)``. ``n_cols``: number of stored key
    columns; ``head_dim_v``: V's head dimension. ``key_start`` /
    ``key_len``: per-sequence python ints (length ``B``, or 1 when shared by all).
    ``first_batch``: the batch index of row 0 of q, fed with the rows' offsets to the dropout RNG
    (a varlen sequence is a problem of its own). ``alibi_slopes``:
    fp32 ``(1 or B, h)`` or ``None``. ``qv``: MLA's absorbed queries ``(B, sq, h, dv)``, scored
    against V (``scale * (q.k + qv.v)``), or ``None``. ``sinks``: ``(h,)`` attention sinks, one
    logit per query head that joins every row's softmax denominator with no value, or ``None``.
    """

    q: Tensor
    load_kv: KVLoader
    n_cols: int
    nheads_k: int
    head_dim_v: int
    key_start: Sequence[int]
    key_len: Sequence[int]
    first_batch: int = 0
    alibi_slopes: Optional[Tensor] = None
    qv: Optional[Tensor] = None
    sinks: Optional[Tensor] = None

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def seqlen_q(self) -> int:
        return self.q.shape[1]

    @property
    def nheads(self) -> int:
        return self.q.shape[2]

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k


# ----------------------------------------------------------------------------------------------
# Chunking and cheap visibility bounds
# ----------------------------------------------------------------------------------------------


def chunk_sizes(problem: Problem, params: AttentionParams, chunks: Optional[tuple[int, int]] = None,
                tuning: Tuning = DEFAULT_TUNING) -> tuple[int, int]:
    """``(chunk_q, chunk_k)`` so that one fp32 ``(B, h, chunk_q, chunk_k)`` tile fits the budget;
    ``chunks``, when given, instead (tests run many ragged chunks with it)."""
    if chunks is not None:
        return chunks
    on_cpu = problem.q.device.type == "cpu"
    budget = tuning.tile_budget_bytes if on_cpu else tuning.accelerator_tile_budget_bytes
    budget //= DROPOUT_TILE_SHRINK if params.dropout_p > 0 else 1
    area = max(1, budget // (4 * problem.batch * problem.nheads))
    # A short side (decoding: sq == 1) lets the other grow.
    chunk_q = max(1, min(problem.seqlen_q, math.isqrt(area // TILE_ASPECT)))
    chunk_k = max(1, min(max(problem.n_cols, 1), area // chunk_q))
    chunk_q = max(1, min(problem.seqlen_q, area // chunk_k))
    return chunk_q, chunk_k


def _per_sequence(problem: Problem) -> list[tuple[int, int]]:
    """``(key_start, key_len)`` of every sequence (the shared pair once when broadcast)."""
    n = max(len(problem.key_start), len(problem.key_len))
    starts = list(problem.key_start) * (n // len(problem.key_start))
    lens = list(problem.key_len) * (n // len(problem.key_len))
    return list(zip(starts, lens))


def visible_columns(problem: Problem, params: AttentionParams, i0: int, i1: int) -> tuple[int, int]:
    """Stored columns ``[lo, hi)`` that any query row in ``[i0, i1)`` of any sequence may see.

    Key chunks outside it are skipped entirely (this is what makes causal cheap).
    """
    sq = problem.seqlen_q
    lo, hi = problem.n_cols, 0
    for start, length in _per_sequence(problem):
        first, last = 0, length  # positions [first, last)
        if params.window_left >= 0:
            first = max(first, i0 + length - sq - params.window_left)
        if params.window_right >= 0:
            last = min(last, i1 - 1 + length - sq + params.window_right + 1)
        if first < last:
            lo, hi = min(lo, start + first), max(hi, start + last)
    return (lo, hi) if lo < hi else (0, 0)


def _tile_fully_visible(
    problem: Problem, params: AttentionParams, i0: int, i1: int, c0: int, c1: int
) -> bool:
    """True when every (row, column) of the tile is visible in every sequence: no mask needed."""
    sq = problem.seqlen_q
    for start, length in _per_sequence(problem):
        j0, j1 = c0 - start, c1 - 1 - start  # first and last key position of the tile
        if j0 < 0 or j1 >= length:
            return False
        if params.window_left >= 0 and j0 < i1 - 1 + length - sq - params.window_left:
            return False
        if params.window_right >= 0 and j1 > i0 + length - sq + params.window_right:
            return False
    return True


# ----------------------------------------------------------------------------------------------
# One tile: scores, mask, bias, dropout
# ----------------------------------------------------------------------------------------------


class _TileGeometry:
    """Index tensors of a tile, broadcastable to ``(B, hk, g, rows, cols)``."""

    def __init__(self, problem: Problem, i0: int, i1: int, c0: int, c1: int):
        device = problem.q.device
        self.rows = torch.arange(i0, i1, device=device).view(1, 1, 1, -1, 1)
        cols = torch.arange(c0, c1, device=device).view(1, 1, 1, 1, -1)
        key_start = torch.tensor(list(problem.key_start), device=device).view(-1, 1, 1, 1, 1)
        self.key_len = torch.tensor(list(problem.key_len), device=device).view(-1, 1, 1, 1, 1)
        self.positions = cols - key_start  # key positions j, (1 or B, 1, 1, 1, cols)
        # Bottom-right aligned diagonal: the key position "level" with query row i.
        self.diagonal = self.rows + self.key_len - problem.seqlen_q  # (1 or B, 1, 1, rows, 1)

    def visible(self, params: AttentionParams) -> Tensor:
        """Bool ``(1 or B, 1, 1, rows, cols)``: key inside its sequence and inside the window."""
        j = self.positions
        mask = (j >= 0) & (j < self.key_len)
        if params.window_left >= 0:
            mask = mask & (j >= self.diagonal - params.window_left)
        if params.window_right >= 0:
            mask = mask & (j <= self.diagonal + params.window_right)
        return mask

    def alibi_distance(self) -> Tensor:
        """fp32 ``|i + sk - sq - j|``, ``(1 or B, 1, 1, rows, cols)``."""
        return (self.diagonal - self.positions).abs().to(torch.float32)


@dataclass(frozen=True)
class _Base2:
    """How a problem's scores are computed in base 2 (see the module docstring).

    ``q_scale`` multiplies q before ``q @ k^T``; with softcap the product is ``u = 2x / c`` and
    ``softcap_out = c * log2(e)`` turns ``tanh(u / 2) = expm1(u) / (expm1(u) + 2)`` into the base-2
    score (0: no softcap). ``slopes``: ALiBi slopes times ``log2(e)``, ``(1 or B, hk, g, 1, 1)``,
    or None.
    """

    q_scale: float
    softcap_out: float
    slopes: Optional[Tensor]

    @staticmethod
    def of(problem: "Problem", params: AttentionParams) -> "_Base2":
        slopes = None
        if problem.alibi_slopes is not None:
            slopes = (problem.alibi_slopes * LOG2E).view(-1, problem.nheads_k, problem.group, 1, 1)
        if params.softcap > 0:
            c = params.softcap
            return _Base2(2.0 * params.softmax_scale / c, c * LOG2E, slopes)
        return _Base2(params.softmax_scale * LOG2E, 0.0, slopes)

    @staticmethod
    def lse2(lse: Tensor) -> Tensor:
        """The natural-log ``lse`` in base-2 score units."""
        return lse * LOG2E

    @staticmethod
    def natural_lse(row_max: Tensor, row_sum: Tensor) -> Tensor:
        return (row_max + torch.log2(row_sum)) * LN2


class _Scratch:
    """Buffers (fp32 unless asked otherwise) that every tile (and query chunk) of a call reuses,
    by name.

    A fresh tile-sized tensor per tile is a fresh ``malloc`` of ~1 MiB, and glibc hands such
    blocks back to the OS when they are freed, to take them again page by page for the next
    one: reusing the buffers within a call, and keeping them between calls
    (:func:`_scratch_for`), saves most of those page faults (benchmarks/README.md).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.largest = 0  # elements of the call's largest tile: a buffer that grows, grows to it
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """Buffer ``name`` as a contiguous ``shape``; its contents are whatever it held last."""
        size = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            size_now = size if buffer is None else max(size, self.largest)
            buffer = self._buffers[name] = torch.empty(size_now, dtype=dtype, device=self.device)
        return buffer[:size].view(shape)

    def keep_at_most(self, nbytes: int) -> None:
        """Drop the largest buffers until the rest take at most ``nbytes``."""
        for name in sorted(self._buffers, key=lambda n: self._buffers[n].nbytes):
            nbytes -= self._buffers[name].nbytes
            if nbytes < 0:
                del self._buffers[name]


_KEPT = threading.local()  # .scratch: the one a thread keeps between calls; .busy: a call uses it


@contextlib.contextmanager
def _scratch_for(device: torch.device, largest_tile: int, tuning: Tuning = DEFAULT_TUNING):
    """A :class:`_Scratch` for one call. On the CPU the thread keeps one between calls (at
    most ``tuning.kept_scratch_bytes``), so the next call finds its buffers already paged in; a call
    made while another runs (a hook) gets one of its own. Elsewhere the device's caching
    allocator already reuses memory."""
    keeps = device.type == "cpu" and not getattr(_KEPT, "busy", False)  # the thread's outermost call
    scratch = getattr(_KEPT, "scratch", None) if keeps else None
    scratch = scratch or _Scratch(device)
    scratch.largest = largest_tile
    if keeps:
        _KEPT.busy = True
    try:
        yield scratch
    finally:
        if keeps:
            scratch.keep_at_most(tuning.kept_scratch_bytes)
            _KEPT.scratch, _KEPT.busy = scratch, False


def _tile_scores(
    qs: Tensor,
    kc: Tensor,
    base2: _Base2,
    geometry: Optional[_TileGeometry],
    mask: Optional[Tensor],
    scratch: _Scratch,
    keep_derivative: bool,
    qvs: Optional[Tensor] = None,
    vc: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Base-2 scores of one tile, ready for ``exp2``, and the softcap derivative (if asked for).

    qs: fp32 ``(B, hk, g, rows, d)`` already multiplied by ``base2.q_scale``; kc: fp32
    ``(B, hk, cols, d)``; with ``qvs`` (like qs with v's head dim, scaled alike) the product
    ``qvs @ vc^T`` joins the scores. Returns fp32 ``(B, hk, g, rows, cols)``: the (softcapped)
    scaled score plus ALiBi, times ``log2(e)``, ``-inf`` where ``mask`` (additive, :func:`_tile_mask`)
    hides a key; and with softcap and ``keep_derivative``, ``1 - tanh^2`` of each score (the
    softcap's derivative). ``geometry`` is needed for ALiBi. Both live in ``scratch`` (until the
    next tile).
    """
    s = _grouped_matmul_nt(scratch.take("scores", *qs.shape[:-1], kc.shape[2]), qs, kc)
    if qvs is not None:
        _add_grouped_matmul_nt(s, qvs, vc)
    derivative = None
    if base2.softcap_out:
        s, derivative = softcap_scores_(s, base2.softcap_out, scratch.take("softcap", *s.shape), keep_derivative)
    if base2.slopes is not None:
        s.addcmul_(base2.slopes, geometry.alibi_distance(), value=-1.0)
    if mask is not None:
        if math.isfinite(s.sum()):
            s.add_(mask)  # a broadcast add is several times faster than masked_fill_ ...
        else:
            s.masked_fill_(mask != 0, float("-inf"))  # ... but NaN + -inf is NaN: a hidden key would reach the row
    return s, derivative


def softcap_scores_(s: Tensor, softcap_out: float, buffer: Tensor,
                    keep_derivative: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Scores ``s`` holding ``u = 2x / c`` become ``softcap_out * tanh(x / c)`` in place (with
    ``softcap_out = c * log2(e)``: softcapped scores in base 2), computed as ``e / (e + 2)`` with
    ``e = expm1(u)`` (the module docstring); with ``keep_derivative`` also ``1 - tanh(x / c)^2``,
    the softcap's derivative, in ``buffer`` (a tensor like ``s``, else scratch)."""
    e = s.clamp_(max=SOFTCAP_CLAMP).expm1_()
    t = e.div_(torch.add(e, 2.0, out=buffer))
    derivative = None
    if keep_derivative:
        derivative = torch.addcmul(torch.ones((), device=t.device), t, t, value=-1.0, out=buffer)
    return t.mul_(softcap_out), derivative


def _tile_keep(problem: Problem, params: AttentionParams, geometry: _TileGeometry, scratch: _Scratch) -> Tensor:
    """Dropout keep mask of the tile, bool ``(B, hk, g, rows, cols)`` (positions as counters)."""
    hk, g = problem.nheads_k, problem.group
    heads = torch.arange(problem.nheads, device=problem.q.device).view(1, hk, g, 1, 1)
    batch = torch.arange(problem.first_batch, problem.first_batch + problem.batch, device=problem.q.device)
    batch = batch.view(-1, 1, 1, 1, 1)
    # Columns outside the sequence are masked anyway; clamp so the counters stay non-negative.
    cols = geometry.positions.clamp(min=0)
    size = problem.batch * problem.nheads * geometry.rows.numel() * cols.shape[-1]
    buffers = [scratch.take(f"philox{i}", size, dtype=torch.int64) for i in range(5)]
    return keep_mask(params.dropout_seed, batch, heads, geometry.rows, cols, params.dropout_p, buffers)


def _initial_state(problem: Problem, base2: _Base2, shape: torch.Size) -> tuple[Tensor, Tensor]:
    """The online softmax's running row maxima and sums ``(B, hk, g, rows)`` before any key: empty
    (``-inf``, 0), or with attention sinks the head's sink as a first key with no value (max the
    sink in base-2 score units, sum 1; a sink of ``-inf`` is none)."""
    device = problem.q.device
    if problem.sinks is None:
        return torch.full(shape, float("-inf"), device=device), torch.zeros(shape, device=device)
    sink = base2.lse2(problem.sinks.to(device=device, dtype=torch.float32))
    row_max = sink.view(1, problem.nheads_k, problem.group, 1).expand(shape).contiguous()
    return row_max, (row_max > float("-inf")).to(torch.float32)


def _query_chunk(x: Optional[Tensor], i0: int, i1: int, nheads_k: int, scratch: "_Scratch", name: str,
                 scale: Optional[float] = None) -> Optional[Tensor]:
    """:func:`_grouped_rows` of an optional input (``qv``), times ``scale`` where given."""
    if x is None:
        return None
    rows = _grouped_rows(x, i0, i1, nheads_k, scratch, name)
    return rows if scale is None else rows.mul_(scale)


def _grouped_view(x: Tensor, i0: int, i1: int, nheads_k: int) -> Tensor:
    """Rows ``i0:i1`` of ``x (B, s, h, d)`` seen as ``(B, hk, g, rows, d)`` (a strided view)."""
    B, _, h, d = x.shape
    return x[:, i0:i1].view(B, i1 - i0, nheads_k, h // nheads_k, d).permute(0, 2, 3, 1, 4)


def _grouped_rows(x: Tensor, i0: int, i1: int, nheads_k: int, scratch: _Scratch, name: str) -> Tensor:
    """Rows ``i0:i1`` of ``x (B, s, h, d)`` as contiguous fp32 ``(B, hk, g, rows, d)``, in the
    buffer ``name`` of ``scratch`` (one pass: the layout and the dtype change together)."""
    rows = _grouped_view(x, i0, i1, nheads_k)
    return scratch.take(name, *rows.shape).copy_(rows)


def _load_columns(problem: Problem, c0: int, c1: int) -> tuple[Tensor, Tensor]:
    """K and V columns ``c0:c1`` as contiguous fp32 ``(B, hk, cols, d)`` (a strided operand
    makes the tile's matmuls about twice as slow; the copy is one small pass)."""
    def converted(x: Tensor) -> Tensor:  # one pass: the layout and the dtype change together
        heads_first = x.transpose(1, 2)
        return torch.empty(heads_first.shape, dtype=torch.float32, device=x.device).copy_(heads_first)

    return tuple(converted(x) for x in problem.load_kv(c0, c1))


def _column_source(problem: Problem, params: AttentionParams, chunk_q: int, tuning: Tuning) -> KVLoader:
    """``(c0, c1) -> (k, v)`` as :func:`_load_columns`: slices of one fp32 copy of every column
    the problem may see when several query chunks will read them and the copy is small."""
    lo, hi = visible_columns(problem, params, 0, problem.seqlen_q)
    d = problem.q.shape[-1]
    size = 4 * problem.batch * problem.nheads_k * (hi - lo) * (d + problem.head_dim_v)
    if problem.seqlen_q <= chunk_q or size > tuning.preload_budget_bytes or hi <= lo:
        return lambda c0, c1: _load_columns(problem, c0, c1)
    k_all, v_all = _load_columns(problem, lo, hi)
    return lambda c0, c1: (k_all[:, :, c0 - lo : c1 - lo], v_all[:, :, c0 - lo : c1 - lo])


def _key_chunks(problem: Problem, params: AttentionParams, i0: int, i1: int, chunk_k: int):
    """``(c0, c1)`` of the key chunks that may be visible to query rows ``i0:i1``."""
    lo, hi = visible_columns(problem, params, i0, i1)
    for c0 in range(lo, hi, chunk_k):
        yield c0, min(hi, c0 + chunk_k)


# The tiles' products go into buffers or accumulate in place (``baddbmm_``): no product-sized
# temporary per tile.


def _grouped_matmul_nt(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out (B, hk, g, n, c) = a (B, hk, g, n, m) @ b (B, hk, c, m)^T``, the group folded into
    rows (scores from queries and keys, dP from dO and values); returns ``out``."""
    B, hk, g, n, m = a.shape
    torch.bmm(a.view(B * hk, g * n, m), b.reshape(B * hk, -1, m).transpose(1, 2), out=out.view(B * hk, g * n, -1))
    return out


def _add_grouped_matmul_nt(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc (B, hk, g, n, c) += a (B, hk, g, n, m) @ b (B, hk, c, m)^T`` (:func:`_grouped_matmul_nt`, accumulated)."""
    B, hk, g, n, m = a.shape
    acc.view(B * hk, g * n, -1).baddbmm_(a.reshape(B * hk, g * n, m), b.reshape(B * hk, -1, m).transpose(1, 2))


def _add_grouped_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc (B, hk, g, n, e) += a (B, hk, g, n, m) @ b (B, hk, m, e)``, the group folded into rows."""
    B, hk, g, n, m = a.shape
    acc.view(B * hk, g * n, -1).baddbmm_(a.reshape(B * hk, g * n, m), b.reshape(B * hk, m, -1))


def _add_grouped_matmul_t(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc (B, hk, m, e) += sum over g and n of a[..., n, m] * b[..., n, e]`` for ``a (B, hk, g,
    n, m)``, ``b (B, hk, g, n, e)``: the transposed product that reduces over the group (dk/dv);
    ``acc`` may be a slice of columns."""
    B, hk, g, n, m = a.shape
    a_t = a.reshape(B * hk, g * n, m).transpose(1, 2)
    acc.view(B * hk, m, -1).baddbmm_(a_t, b.reshape(B * hk, g * n, -1))


def _tile(problem: Problem, params: AttentionParams, i0: int, i1: int, c0: int, c1: int, scratch: _Scratch):
    """``(geometry or None, additive mask or None)`` of a tile: index tensors are built only
    when ALiBi or dropout needs them, a mask only when some key of the tile is hidden."""
    geometry = None
    if problem.alibi_slopes is not None or params.dropout_p > 0:
        geometry = _TileGeometry(problem, i0, i1, c0, c1)
    if _tile_fully_visible(problem, params, i0, i1, c0, c1):
        return geometry, None
    return geometry, _tile_mask(problem, params, i0, i1, c0, c1, geometry, scratch)


def _tile_mask(
    problem: Problem, params: AttentionParams, i0: int, i1: int, c0: int, c1: int,
    geometry: Optional[_TileGeometry] = None, scratch: Optional[_Scratch] = None,
) -> Tensor:
    """fp32 0 / -inf of a tile, broadcastable to ``(B, hk, g, rows, cols)``: ``-inf`` where
    the key is outside its sequence or the window (``geometry``: the tile's, if already built;
    ``scratch``: where to build it, else in new tensors)."""
    if len(problem.key_start) > 1 or len(problem.key_len) > 1:
        geometry = geometry or _TileGeometry(problem, i0, i1, c0, c1)
        return torch.where(geometry.visible(params), 0.0, float("-inf"))
    # One key range for all sequences: two triangle fills and two column slices (a few passes
    # instead of a dozen index-tensor ops; this is most of a small causal call's masking time).
    # In tile coordinates (row r = i - i0, column t = c - c0) the window compares t - r with
    # ``offset``, the column of the row's diagonal key in row 0.
    start, length = problem.key_start[0], problem.key_len[0]
    rows, cols = i1 - i0, c1 - c0
    offset = i0 + length - problem.seqlen_q - (c0 - start)
    hidden = float("-inf")
    scratch = scratch or _Scratch(problem.q.device)
    mask = scratch.take("mask", rows, cols)
    if params.window_right >= 0:  # hidden right of the diagonal + window_right
        mask.fill_(hidden).triu_(offset + params.window_right + 1)
    else:
        mask.zero_()
    if params.window_left >= 0:  # hidden left of the diagonal - window_left
        mask.add_(scratch.take("mask_left", rows, cols).fill_(hidden).tril_(offset - params.window_left - 1))
    mask[:, : max(0, start - c0)] = hidden  # key positions before 0 (KV-cache left padding)
    mask[:, max(0, start + length - c0):] = hidden  # key positions past the sequence
    return mask.view(1, 1, 1, rows, cols)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def attention_forward(problem: Problem, params: AttentionParams, chunks: Optional[tuple[int, int]] = None,
                      tuning: Tuning = DEFAULT_TUNING) -> tuple[Tensor, Tensor]:
    """Exact attention of one problem. Returns ``out`` like q and fp32 ``lse (B, h, sq)``.
    ``chunks``: the tile shape to use instead of the budget's (:func:`chunk_sizes`); ``tuning``:
    the budgets."""
    q = problem.q
    B, sq, h, _ = q.shape
    hk = problem.nheads_k
    base2 = _Base2.of(problem, params)
    chunk_q, chunk_k = chunk_sizes(problem, params, chunks, tuning)
    columns = _column_source(problem, params, chunk_q, tuning)
    with _scratch_for(q.device, B * h * chunk_q * chunk_k, tuning) as scratch:
        out = q.new_empty(B, sq, h, problem.head_dim_v)
        lse = torch.empty(B, h, sq, dtype=torch.float32, device=q.device)
        for i0 in range(0, sq, chunk_q):
            i1 = min(sq, i0 + chunk_q)
            qs = _grouped_rows(q, i0, i1, hk, scratch, "q").mul_(base2.q_scale)
            qvs = _query_chunk(problem.qv, i0, i1, hk, scratch, "qv", base2.q_scale)
            row_max, row_sum = _initial_state(problem, base2, qs.shape[:-1])
            acc = scratch.take("acc", *qs.shape[:-1], problem.head_dim_v).zero_()
            for c0, c1 in _key_chunks(problem, params, i0, i1, chunk_k):
                kc, vc = columns(c0, c1)
                geometry, mask = _tile(problem, params, i0, i1, c0, c1, scratch)
                s, _ = _tile_scores(qs, kc, base2, geometry, mask, scratch, keep_derivative=False, qvs=qvs, vc=vc)
                new_max = torch.maximum(row_max, s.amax(-1))
                # A row with nothing visible yet keeps max -inf; use 0 as its shift so no NaN appears.
                shift = torch.where(new_max == float("-inf"), 0.0, new_max)
                rescale = torch.exp2(row_max - shift)
                p = s.sub_(shift.unsqueeze(-1)).exp2_()
                row_sum.mul_(rescale).add_(p.sum(-1))
                if params.dropout_p > 0:
                    # lse uses the undropped probabilities; only the output sees the dropout.
                    keep = _tile_keep(problem, params, geometry, scratch)
                    p = p.masked_fill_(~keep, 0.0).mul_(1.0 / (1.0 - params.dropout_p))
                _add_grouped_matmul(acc.mul_(rescale.unsqueeze(-1)), p, vc)
                row_max = new_max
            # Rows that saw no key: row_sum 0 and acc 0, so out 0 and lse +inf (a NaN sum stays NaN;
            # with a sink: out 0, lse the sink).
            seen = row_sum != 0
            acc.div_(torch.where(seen, row_sum, 1.0).unsqueeze(-1))
            _grouped_view(out, i0, i1, hk).copy_(acc)
            chunk_lse = torch.where(seen, base2.natural_lse(row_max, row_sum), float("inf"))
            lse[:, :, i0:i1] = chunk_lse.view(B, h, i1 - i0)
        return out, lse


@torch.no_grad()
def softmax_with_dropout_signs(problem: Problem, params: AttentionParams, lse: Tensor, sk_out: int,
                               chunks: Optional[tuple[int, int]] = None, tuning: Tuning = DEFAULT_TUNING) -> Tensor:
    """fp32 ``(B, h, sq, sk_out)``: normalised probabilities, negated where dropout drops them.

    Recomputed tile by tile from the forward's ``lse (B, h, sq)``; column ``c`` is written at
    key position ``c - key_start`` (needs the shared ``key_start`` of dense/varlen problems).
    """
    q = problem.q
    B, sq, h, _ = q.shape
    hk = problem.nheads_k
    assert len(problem.key_start) == 1, "return_softmax needs one key_start for all sequences"
    start = problem.key_start[0]
    base2 = _Base2.of(problem, params)
    chunk_q, chunk_k = chunk_sizes(problem, params, chunks, tuning)
    with _scratch_for(q.device, B * h * chunk_q * chunk_k, tuning) as scratch:
        probs = torch.zeros(B, h, sq, sk_out, dtype=torch.float32, device=q.device)
        for i0 in range(0, sq, chunk_q):
            i1 = min(sq, i0 + chunk_q)
            qs = _grouped_rows(q, i0, i1, hk, scratch, "q").mul_(base2.q_scale)
            qvs = _query_chunk(problem.qv, i0, i1, hk, scratch, "qv", base2.q_scale)
            lse_c = base2.lse2(lse[:, :, i0:i1].reshape(qs.shape[:-1]).unsqueeze(-1))
            for c0, c1 in _key_chunks(problem, params, i0, i1, chunk_k):
                kc, vc = _load_columns(problem, c0, c1)
                geometry, mask = _tile(problem, params, i0, i1, c0, c1, scratch)
                s, _ = _tile_scores(qs, kc, base2, geometry, mask, scratch, keep_derivative=False, qvs=qvs, vc=vc)
                p = s.sub_(lse_c).exp2_()
                if params.dropout_p > 0:
                    p = torch.where(_tile_keep(problem, params, geometry, scratch), p, -p)
                probs[:, :, i0:i1, c0 - start : c1 - start] = p.reshape(B, h, i1 - i0, c1 - c0)
        return probs


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def attention_backward(
    problem: Problem, params: AttentionParams, dout: Tensor, out: Tensor, lse: Tensor,
    chunks: Optional[tuple[int, int]] = None, tuning: Tuning = DEFAULT_TUNING,
) -> tuple[Tensor, ...]:
    """Flash-attention backward of one problem, recomputing P tile by tile from ``lse``.

    dout/out: ``(B, sq, h, dv)``; lse: fp32 ``(B, h, sq)``. Returns fp32 ``dq (B, sq, h, d)``
    and fp32 ``dk, dv (B, n_cols, hk, d / dv)`` (gradients w.r.t. the loaded key columns), and with
    ``problem.qv`` fp32 ``dqv (B, sq, h, dv)`` too. The given ``out`` and ``lse`` are used as they
    are (a block of a longer sequence gets its share; with attention sinks lse includes them, so
    the keys' probabilities need nothing else).
    """
    q = problem.q
    B, sq, h, d = q.shape
    hk = problem.nheads_k
    dev = q.device
    dim_v = problem.head_dim_v
    base2 = _Base2.of(problem, params)
    chunk_q, chunk_k = chunk_sizes(problem, params, chunks, tuning)
    dq = torch.zeros(B, sq, h, d, dtype=torch.float32, device=dev)
    dk = torch.zeros(B, hk, problem.n_cols, d, dtype=torch.float32, device=dev)
    dv = torch.zeros(B, hk, problem.n_cols, dim_v, dtype=torch.float32, device=dev)
    with_qv = problem.qv is not None
    # qv's gradients: dqv = dS_qk V, and dS_qk^T qv joins dv (scaled like dq and dk, at the end)
    dqv = torch.zeros(B, sq, h, dim_v, dtype=torch.float32, device=dev) if with_qv else None
    dv_scores = torch.zeros_like(dv) if with_qv else None
    dropout_scale = 1.0 / (1.0 - params.dropout_p)
    columns = _column_source(problem, params, chunk_q, tuning)
    with _scratch_for(dev, B * h * chunk_q * chunk_k, tuning) as scratch:
        for i0 in range(0, sq, chunk_q):
            i1 = min(sq, i0 + chunk_q)
            qc = _grouped_rows(q, i0, i1, hk, scratch, "q")
            qs = torch.mul(qc, base2.q_scale, out=scratch.take("q_scaled", *qc.shape))
            qvc = _query_chunk(problem.qv, i0, i1, hk, scratch, "qv")
            qvs = None if qvc is None else torch.mul(qvc, base2.q_scale, out=scratch.take("qv_scaled", *qvc.shape))
            doc = _grouped_rows(dout, i0, i1, hk, scratch, "dout")
            # D = rowsum(dO * O): the softmax Jacobian's correction term, one value per row.
            delta = _grouped_rows(out, i0, i1, hk, scratch, "out").mul_(doc).sum(-1, keepdim=True)
            lse_c = base2.lse2(lse[:, :, i0:i1].reshape(qc.shape[:-1]).unsqueeze(-1))
            dq_c = scratch.take("dq", *qc.shape).zero_()
            dqv_c = scratch.take("dqv", *qvc.shape).zero_() if with_qv else None
            for c0, c1 in _key_chunks(problem, params, i0, i1, chunk_k):
                kc, vc = columns(c0, c1)
                geometry, mask = _tile(problem, params, i0, i1, c0, c1, scratch)
                s, derivative = _tile_scores(qs, kc, base2, geometry, mask, scratch, keep_derivative=True, qvs=qvs, vc=vc)
                # Rows that saw no key have lse = +inf: s - inf = -inf, so P = 0 and no NaN appears.
                p = s.sub_(lse_c).exp2_()
                dp = _grouped_matmul_nt(scratch.take("dp", *p.shape), doc, vc)
                if params.dropout_p > 0:
                    keep = _tile_keep(problem, params, geometry, scratch)
                    dp.masked_fill_(~keep, 0.0).mul_(dropout_scale)
                    p_dropped = p.masked_fill(~keep, 0.0).mul_(dropout_scale)
                else:
                    p_dropped = p
                _add_grouped_matmul_t(dv[:, :, c0:c1], p_dropped, doc)
                ds = dp.sub_(delta).mul_(p)
                if derivative is not None:
                    ds.mul_(derivative)  # d(c * tanh(x / c)) / dx = 1 - tanh^2
                _add_grouped_matmul(dq_c, ds, kc)
                _add_grouped_matmul_t(dk[:, :, c0:c1], ds, qc)
                if with_qv:
                    _add_grouped_matmul(dqv_c, ds, vc)
                    _add_grouped_matmul_t(dv_scores[:, :, c0:c1], ds, qvc)
            _grouped_view(dq, i0, i1, hk).copy_(dq_c)
            if with_qv:
                _grouped_view(dqv, i0, i1, hk).copy_(dqv_c)
        scale = params.softmax_scale
        grads = dq.mul_(scale), dk.mul_(scale).transpose(1, 2), dv.transpose(1, 2)
        if with_qv:
            dv.add_(dv_scores, alpha=scale)
            grads = (*grads, dqv.mul_(scale))
        return grads
