"""A causal square cut into a few batched calls of PyTorch's fused CPU kernel, so that only the
visible half of its scores (and a little more) is computed.

The kernel's own causal mask skips whole key blocks of 512 columns per query block of 256 rows
(64 or 32 when the query is shorter), so it still computes 1.46x the visible scores at 1k
tokens and 1.25x at 2k, and a causal square of 512 rows or fewer costs as much as a full one.

Here a square of ``n = c * 2^L`` rows (``c`` in ``[base_rows, 2 * base_rows)``, ``base_rows``
the tuning's ``tree_base_rows``: :class:`._reference_core.Tuning`) is cut into
blocks of ``c`` rows. The ``c x c`` blocks on the diagonal run causal, all in one call (the
blocks become a batch dimension, a view). Every other visible score lies in exactly one of ``L``
levels of full rectangles: at the level of ``n_l = c * 2^l`` rows, the odd block of each aligned
pair of ``n_l``-row blocks sees all of its even partner, and all pairs of a level are again one
call. The last ``n - c * 2^L`` rows (fewer than ``2^L``) see the body fully and themselves
causally. Every part uses the global ``out`` and ``lse`` in the backward, and the parts'
gradients are summed (exact, as context parallelism is); the forward merges a row's parts in
place, by their shares of the softmax mass (:func:`forward`).

fp32 only: the bf16 backward kernel is slower on small blocks, and merging bf16 partial outputs
would round each of them. What the tree gains (and the sizes below): benchmarks/README.md.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

# Picks a part's blocks out of a (B, n, ...) tensor as a (B, m, rows, ...) view.
Selector = Callable[[Tensor], Tensor]


def applies(n_rows: int, n_cols: int, dtype: torch.dtype, min_rows: int) -> bool:
    """True when a causal call of ``n_rows x n_cols`` (top-left aligned) gains from the tree:
    an fp32 square of at least ``min_rows`` (the tuning's ``tree_min_rows``) rows."""
    return dtype == torch.float32 and n_rows == n_cols and n_rows >= min_rows


class _Part(NamedTuple):
    """One batched call of the tree: ``rows``/``cols`` pick its query rows and key columns out of
    a ``(B, n, ...)`` tensor as ``(B, m, rows, ...)`` views; ``causal``: the kernel's causal mask
    applies; ``first``: no earlier part covers these rows (the forward writes instead of merging)."""

    rows: Selector
    cols: Selector
    causal: bool
    first: bool


def _parts(n: int, base_rows: int) -> list[_Part]:
    """The calls that cover a causal square of ``n`` rows, each ``m`` blocks of equal shape, on
    diagonal blocks of ``base_rows`` to ``2 * base_rows`` rows."""
    levels = 0
    while (n >> (levels + 1)) >= base_rows:
        levels += 1
    c = n >> levels
    body = c << levels

    def diagonal(t: Tensor) -> Tensor:
        return t[:, :body].unflatten(1, (1 << levels, c))

    parts = [_Part(diagonal, diagonal, True, True)]
    for level in range(levels):
        size = c << level
        pairs = body // (2 * size)
        parts.append(_Part(
            lambda t, s=size, m=pairs: t[:, :body].unflatten(1, (m, 2, s))[:, :, 1],
            lambda t, s=size, m=pairs: t[:, :body].unflatten(1, (m, 2, s))[:, :, 0],
            False, False,
        ))
    if body < n:
        tail = lambda t: t[:, body:n].unsqueeze(1)  # noqa: E731
        parts.append(_Part(tail, lambda t: t[:, :body].unsqueeze(1), False, True))
        parts.append(_Part(tail, tail, True, False))
    return parts


def _heads_first(x: Tensor) -> Tensor:
    """``(B, m, rows, h, d)`` -> the kernel's ``(B * m, h, rows, d)`` (a view when it can be)."""
    return x.flatten(0, 1).transpose(1, 2)


def _sequence_first(x: Tensor, B: int) -> Tensor:
    """The kernel's ``(B * m, h, rows[, d])`` -> ``(B, m, rows, h[, d])`` (a view)."""
    return x.transpose(1, 2).unflatten(0, (B, -1))


def forward(kernel, q: Tensor, k: Tensor, v: Tensor, scale: float, base_rows: int) -> tuple[Tensor, Tensor]:
    """Top-left causal attention of fp32 ``q (B, n, h, d)`` over ``k, v (B, n, hk, d)`` on the
    tree of :func:`_parts` (``base_rows``), as the kernel returns it: ``out (B, h, n, d)`` and
    ``lse (B, h, n)`` (views of ``(B, n, ...)`` buffers).

    A later part of a row is merged into what it has so far in place: with ``w`` the part's
    share of the row's softmax mass, ``sigmoid(lse_part - lse_so_far)``, the output moves to
    ``out + w * (out_part - out)`` (one ``lerp_``) and the lse to ``logaddexp`` of the two.
    """
    B, n, h, d = q.shape
    out = lse = None
    for part in _parts(n, base_rows):
        o, lse_p = kernel(_heads_first(part.rows(q)), _heads_first(part.cols(k)), _heads_first(part.cols(v)),
                          0.0, part.causal, scale=scale)
        o, lse_p = _sequence_first(o, B), _sequence_first(lse_p, B)  # (B, m, rows, h[, d])
        if out is None and o.shape[1] * o.shape[2] == n:  # the diagonal covers every row: keep its buffers
            out, lse = o.reshape(B, n, h, d), lse_p.reshape(B, n, h)
            continue
        if out is None:
            out = q.new_empty(B, n, h, d)
            lse = torch.empty(B, n, h, dtype=torch.float32, device=q.device)
        rows_out, rows_lse = part.rows(out), part.rows(lse)
        if part.first:
            rows_out.copy_(o)
            rows_lse.copy_(lse_p)
        else:
            rows_out.lerp_(o, torch.sigmoid(lse_p - rows_lse).unsqueeze(-1))
            rows_lse.copy_(torch.logaddexp(rows_lse, lse_p))
    return out.transpose(1, 2), lse.transpose(1, 2)


def backward(kernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             scale: float, base_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of top-left causal attention of ``q (B, n, h, d)`` over ``k, v (B, n, hk, d)``,
    given ``dout, out (B, n, h, d)`` and fp32 ``lse (B, h, n)`` (used as given). Returns fp32
    ``dq (B, n, h, d)``, ``dk, dv (B, n, hk, d)``."""
    B, n = q.shape[:2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    lse_rows = lse.transpose(1, 2)
    for rows, cols, causal, _ in _parts(n, base_rows):
        lse_p = rows(lse_rows).flatten(0, 1).transpose(1, 2).contiguous()
        grads = kernel(_heads_first(rows(dout)), _heads_first(rows(q)), _heads_first(cols(k)),
                       _heads_first(cols(v)), _heads_first(rows(out)), lse_p, 0.0, causal, scale=scale)
        gq, gk, gv = (_sequence_first(g, B) for g in grads)
        rows(dq).add_(gq)
        cols(dk).add_(gk)
        cols(dv).add_(gv)
    return dq, dk, dv
