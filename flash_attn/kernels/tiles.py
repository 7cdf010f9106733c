"""Tile helpers the attention kernels share (forward, backward, KV-cache decode): where a
program's rows and batch entry are, pointers to a tile's rows (dense, varlen or paged), the
dropout seed, the ALiBi slope, the attention sink, and one step of the online softmax in base 2."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def stride_16b(stride):
    """``stride`` (elements), declared a multiple of 8 elements: 16 bytes for fp16/bf16.

    The planner guarantees it (it copies inputs laid out otherwise) for every stride except
    the last dimension's (which is 1). Knowing it lets the compiler use 16-byte vector loads and
    the asynchronous-copy pipeline with a single compiled specialisation for all inputs
    (``tl.multiple_of`` on a scalar argument is not propagated, the arithmetic is; it costs one
    scalar shift per stride and program).
    """
    return (stride // 8) * 8


@triton.jit
def row_ptrs(Base, start, stride_row, BLOCK: tl.constexpr):
    """Pointers to rows ``start .. start + BLOCK - 1`` (``stride_row`` apart) from ``Base``.

    The row base is computed in 64 bits (sequences of millions of rows times wide rows overflow
    32 bits), the in-tile offsets in 32 bits.
    """
    return Base + tl.cast(start, tl.int64) * stride_row + tl.arange(0, BLOCK) * stride_row


@triton.jit
def head_rows(Base, rows, head_dim, stride_row, TMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Where a kernel reads one head's ``rows x head_dim`` matrix from: with ``TMA`` a tensor
    descriptor of ``BLOCK_R x BLOCK_C`` blocks (its bounds zero what lies past the rows and the
    head dim; the planner's 16-byte alignment is what TMA needs), else ``Base`` itself."""
    if TMA:
        src = tl.make_tensor_descriptor(Base, shape=[rows, head_dim], strides=[stride_row, 1],
                                        block_shape=[BLOCK_R, BLOCK_C])
    else:
        src = Base
    return src


@triton.jit
def kv_row_ptrs(Base, start_n, seqlen_k, bt_row, page_size, stride_page, stride_row, BLOCK_N: tl.constexpr,
                IS_PAGED: tl.constexpr):
    """Pointers to the key rows ``start_n .. start_n + BLOCK_N - 1`` of a sequence (one kv head).

    Paged: row ``j`` is slot ``j % page_size`` of page ``block_table[b, j // page_size]``, so the
    rows of one tile may span several pages (any page size works). Otherwise rows are
    ``stride_row`` apart from ``Base``.
    """
    if IS_PAGED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        page = tl.load(bt_row + offs_n // page_size, mask=offs_n < seqlen_k, other=0)
        return Base + page.to(tl.int64) * stride_page + (offs_n % page_size) * stride_row
    else:
        return row_ptrs(Base, start_n, stride_row, BLOCK_N)


@triton.jit
def block_and_batch(seqlen, BLOCK: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """``(block, b)`` of this program: grid axis 0 enumerates ``cdiv(seqlen, BLOCK)`` blocks x the
    batch, block-major (one block index for every batch entry, then the next), so any batch fits
    the axis (up to 2**31 - 1 programs; axes 1 and 2 stop at 65535). ``HEAVY_FIRST`` starts with
    the last block, whose rows see the most keys under a causal mask: the long programs start
    first and the short ones fill the tail of the grid."""
    num_blocks = tl.cdiv(seqlen, BLOCK)
    batch = tl.num_programs(0) // num_blocks
    pid = tl.program_id(0)
    block = pid // batch
    if HEAVY_FIRST:
        block = num_blocks - 1 - block
    return block, pid % batch


@triton.jit
def load_seed(DropoutSeed, HAS_DROPOUT: tl.constexpr):
    """The int64 dropout seed, read on the device (a graph replay draws a new one), or 0."""
    if HAS_DROPOUT:
        return tl.load(DropoutSeed)
    else:
        return 0


@triton.jit
def sequence_bounds(b, CuSeqlens, seqlen, packed):
    """``(start, length)`` of sequence ``b``. Packed (``packed != 0``, varlen): rows
    ``cu_seqlens[b] .. cu_seqlens[b + 1]`` along dim 0. Dense: ``(0, seqlen)``, rows of batch entry
    ``b``, and ``CuSeqlens`` is not read. A run-time switch, so one compiled kernel serves both."""
    is_packed = packed != 0
    start = tl.load(CuSeqlens + b, mask=is_packed, other=0)
    end = tl.load(CuSeqlens + b + 1, mask=is_packed, other=0)
    return start, tl.where(is_packed, end - start, seqlen)


@triton.jit
def alibi_slope_log2(AlibiSlopes, b, h, stride_ab, use_alibi, HAS_ALIBI: tl.constexpr):
    """ALiBi slope of query head ``h`` of batch entry ``b``, times ``log2(e)``; 0 when ALiBi is not
    compiled in or switched off at run time (``use_alibi == 0``: ``AlibiSlopes`` is not read)."""
    if HAS_ALIBI:
        slope = tl.load(AlibiSlopes + b * stride_ab + h, mask=use_alibi != 0, other=0.0)
        return slope.to(tl.float32) * LOG2E
    else:
        return 0.0


@triton.jit
def sink_state(Sinks, h, use_sinks, BLOCK: tl.constexpr):
    """``(m, l)``: the online softmax's running row maxima and sums (base 2) of ``BLOCK`` rows of
    query head ``h`` before any key. With ``use_sinks`` they hold the head's attention sink, a
    logit ``Sinks[h]`` (natural units) with no value that joins every row's denominator; without,
    no key seen yet (``-inf``, 0). A sink of ``-inf`` is no sink."""
    sink = tl.load(Sinks + h, mask=use_sinks != 0, other=float("-inf")).to(tl.float32) * LOG2E
    m = tl.full([BLOCK], 0.0, dtype=tl.float32) + sink
    return m, tl.where(m == float("-inf"), 0.0, 1.0)


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One key tile of the online softmax in base 2: ``(p, alpha, m_new, l_new)`` for the logits
    ``s`` (rows x keys) given the running row maxima ``m_i`` and sums ``l_i``; the caller rescales
    its accumulator by ``alpha``. Rows that have not seen a visible key keep ``m = -inf``: they
    shift by 0, so that ``p = 0``, not NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
