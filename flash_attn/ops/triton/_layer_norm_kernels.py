"""Triton source of the fused (dropout + residual +) LayerNorm / RMSNorm, forward and backward.

One program normalises one row in the forward; in the backward a program walks a band of rows and
keeps its share of the weight / bias gradients in fp32 registers (summed over programs by the
caller). Every load is converted to fp32 at once: bf16 arithmetic is wrong in Triton's
interpreter, and fp32 statistics are what the result needs anyway. Pointers an option does not
use are passed as ``None`` and never touched (their constexpr flag is off).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dropout(h, seeds, index, cols, dropout_p):
    """Row ``index``'s dropout of ``h`` (kept values scaled by ``1 / (1 - p)``) and its keep-mask;
    the backward draws the same bits from the same seed."""
    keep = tl.rand(tl.load(seeds + index).to(tl.uint32), cols) > dropout_p
    return tl.where(keep, h / (1.0 - dropout_p), 0.0), keep


@triton.jit
def _load_weight(W, cols, inside, ZERO_CENTERED: tl.constexpr):
    """A norm weight in fp32; a zero-centred weight is stored as ``w - 1``."""
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    return w


@triton.jit
def _store_affine(Y, xhat, W, B, cols, inside, ZERO_CENTERED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One output row ``xhat * w (+ b)`` at ``Y`` (y, or y1 with the second weight)."""
    y = xhat * _load_weight(W, cols, inside, ZERO_CENTERED)
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + cols, y, mask=inside)


@triton.jit
def norm_forward_kernel(
    X, X1, RESIDUAL, ROWSCALE, SEEDS, W, B, W1, B1,  # inputs
    Y, Y1, RESIDUAL_OUT, MASK, MASK1, MEAN, RSTD,  # outputs
    stride_x, stride_x1, stride_res, stride_y, stride_y1, stride_res_out,
    M, N, eps, dropout_p,
    BLOCK_N: tl.constexpr, IS_RMS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    HAS_X1: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_MASK: tl.constexpr, STORE_RESIDUAL_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 elements
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    h = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_ROWSCALE:
        h = h * tl.load(ROWSCALE + row).to(tl.float32)
    if HAS_DROPOUT:
        h, keep = _dropout(h, SEEDS, row, cols, dropout_p)
        if STORE_MASK:
            tl.store(MASK + row * N + cols, keep, mask=inside)
    if HAS_X1:
        h1 = tl.load(X1 + row * stride_x1 + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            h1, keep1 = _dropout(h1, SEEDS, M + row, cols, dropout_p)
            if STORE_MASK:
                tl.store(MASK1 + row * N + cols, keep1, mask=inside)
        h = h + h1
    if HAS_RESIDUAL:
        h = h + tl.load(RESIDUAL + row * stride_res + cols, mask=inside, other=0.0).to(tl.float32)
    if STORE_RESIDUAL_OUT:
        tl.store(RESIDUAL_OUT + row * stride_res_out + cols, h, mask=inside)
    # statistics of the fp32 sum (masked columns are 0 and drop out of both sums)
    if IS_RMS_NORM:
        centred = h
    else:
        mean = tl.sum(h, axis=0) / N
        tl.store(MEAN + row, mean)
        centred = tl.where(inside, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    xhat = centred * rstd
    _store_affine(Y + row * stride_y, xhat, W, B, cols, inside, ZERO_CENTERED, HAS_BIAS)
    if HAS_W1:
        _store_affine(Y1 + row * stride_y1, xhat, W1, B1, cols, inside, ZERO_CENTERED, HAS_B1)


@triton.jit
def _compensated_add(total, error, value):
    """Kahan's summation step: ``total + value`` with the rounding error carried in ``error``."""
    value = value - error
    new_total = total + value
    return new_total, (new_total - total) - value


@triton.jit
def norm_backward_kernel(
    H, DY, DY1, DRESIDUAL, W, W1, MEAN, RSTD, ROWSCALE, SEEDS,  # inputs (H: the saved residual_out)
    DX, DX1, DRESIDUAL_IN, DW_PART, DB_PART, DW1_PART, DB1_PART,  # outputs
    stride_h, stride_dy, stride_dy1, stride_dres, stride_dx, stride_dx1, stride_dres_in,
    M, N, dropout_p, rows_per_program,
    BLOCK_N: tl.constexpr, IS_RMS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    HAS_DY1: tl.constexpr, HAS_DRESIDUAL: tl.constexpr, STORE_DRESIDUAL: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_DX1: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_B1: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 elements
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    w = _load_weight(W, cols, inside, ZERO_CENTERED)
    if HAS_DY1:
        w1 = _load_weight(W1, cols, inside, ZERO_CENTERED)
    # the parameter gradients are sums over many rows (a thousand per program on a large batch):
    # compensated sums (Kahan), each with its running rounding error, keep them exact to a few ulp
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dw1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dw_err = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_err = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dw1_err = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db1_err = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        h = tl.load(H + row * stride_h + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS_NORM:
            xhat = h * rstd
        else:
            xhat = tl.where(inside, (h - tl.load(MEAN + row)) * rstd, 0.0)
        dy = tl.load(DY + row * stride_dy + cols, mask=inside, other=0.0).to(tl.float32)
        g = dy * w  # d loss / d xhat
        dw, dw_err = _compensated_add(dw, dw_err, dy * xhat)
        db, db_err = _compensated_add(db, db_err, dy)
        if HAS_DY1:
            dy1 = tl.load(DY1 + row * stride_dy1 + cols, mask=inside, other=0.0).to(tl.float32)
            g += dy1 * w1
            dw1, dw1_err = _compensated_add(dw1, dw1_err, dy1 * xhat)
            db1, db1_err = _compensated_add(db1, db1_err, dy1)
        # d xhat / d h: rstd * (I - xhat xhat^T / N), minus the mean's share for LayerNorm
        dh = g - xhat * (tl.sum(g * xhat, axis=0) / N)
        if not IS_RMS_NORM:
            dh = dh - tl.sum(g, axis=0) / N
        dh = tl.where(inside, dh * rstd, 0.0)
        if HAS_DRESIDUAL:  # prenorm: the residual stream's own gradient joins here
            dh += tl.load(DRESIDUAL + row * stride_dres + cols, mask=inside, other=0.0).to(tl.float32)
        if STORE_DRESIDUAL:
            tl.store(DRESIDUAL_IN + row * stride_dres_in + cols, dh, mask=inside)
        # dropout's gradient is dropout itself with the forward's mask
        if STORE_DX1:
            dx1 = dh
            if HAS_DROPOUT:
                dx1, _ = _dropout(dh, SEEDS, M + row, cols, dropout_p)
            tl.store(DX1 + row * stride_dx1 + cols, dx1, mask=inside)
        dx = dh
        if HAS_DROPOUT:
            dx, _ = _dropout(dx, SEEDS, row, cols, dropout_p)
        if HAS_ROWSCALE:
            dx = dx * tl.load(ROWSCALE + row).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx, mask=inside)
    tl.store(DW_PART + program * N + cols, dw, mask=inside)
    if HAS_BIAS:
        tl.store(DB_PART + program * N + cols, db, mask=inside)
    if HAS_DY1:
        tl.store(DW1_PART + program * N + cols, dw1, mask=inside)
        if HAS_B1:
            tl.store(DB1_PART + program * N + cols, db1, mask=inside)
