"""A causal square cut into a few batched calls of PyTorch's fused CPU kernel, so that only the
visible half of its scores (and a little more) is computed.

The kernel's own causal mask skips whole key blocks of 512 columns per query block of 256 rows
(64 or 32 when the query is shorter), so it still computes 1.46x the visible scores at 1k
tokens and 1.25x at 2k, and a causal square of 512 rows or fewer costs as much as a full one
(measured: 2 x 512 rows 6.95 ms causal, 6.82 ms full).

Here a square of ``n = c * 2^L`` rows (``c`` in ``[BASE_ROWS, 2 * BASE_ROWS)``) is cut into
blocks of ``c`` rows. The ``c x c`` blocks on the diagonal run causal, all in one call (the
blocks become a batch dimension, a view). Every other visible score lies in exactly one of ``L``
levels of full rectangles: at the level of ``n_l = c * 2^l`` rows, the odd block of each aligned
pair of ``n_l``-row blocks sees all of its even partner, and all pairs of a level are again one
call. The last ``n - c * 2^L`` rows (fewer than ``2^L``) see the body fully and themselves
causally. The backward sums the parts' gradients, every part using the global ``out`` and ``lse``
(exact, as context parallelism is; a forward would merge each row's parts by log-sum-exp).

Used for the fp32 backward only. Measured on one thread (4 heads, d 64), kernel time alone:
fp32 backward -21% / -10% / -5% at 1k / 2k / 4k tokens; in ``bench cpu`` (our fwd+bwd against
SDPA's, alternating calls) the fp32 causal forward+backward went from 0.99-1.00x SDPA to
1.14 / 1.05 / 1.02 / 1.03 / 1.00x at 1k-16k. The forward gains in isolation (fp32 -16% at 1k)
but loses in ``bench cpu`` (fp32 0.90-0.96x at 1k-4k, bf16 0.93-0.95x, against 0.94-1.01 with
one call): merging ``L`` levels of fp32 partial outputs moves several times the output through
memory, and the kernel's causal waste is only 1.25x from 2k tokens on. The bf16 backward
kernel is slower on small blocks (1k: 20 ms as one call, 26-35 ms as a tree).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# Diagonal blocks have between BASE_ROWS and 2 * BASE_ROWS rows (64 measured best, 128 close).
BASE_ROWS = 64
# Squares smaller than this run as one causal call.
MIN_ROWS = 4 * BASE_ROWS

# Picks a part's blocks out of a (B, n, ...) tensor as a (B, m, rows, ...) view.
Selector = Callable[[Tensor], Tensor]


def applies(n_rows: int, n_cols: int, dtype: torch.dtype) -> bool:
    """True when the backward of a causal call of ``n_rows x n_cols`` (top-left aligned) gains
    from the tree: an fp32 square (see the module docstring for what was measured)."""
    return dtype == torch.float32 and n_rows == n_cols and n_rows >= MIN_ROWS


def _parts(n: int) -> list[tuple[Selector, Selector, bool]]:
    """The calls that cover a causal square of ``n`` rows: ``(its query rows, its key columns,
    whether the kernel's causal mask applies)``, each call ``m`` blocks of equal shape."""
    levels = 0
    while (n >> (levels + 1)) >= BASE_ROWS:
        levels += 1
    c = n >> levels
    body = c << levels

    def diagonal(t: Tensor) -> Tensor:
        return t[:, :body].unflatten(1, (1 << levels, c))

    parts = [(diagonal, diagonal, True)]
    for level in range(levels):
        size = c << level
        pairs = body // (2 * size)
        parts.append((
            lambda t, s=size, m=pairs: t[:, :body].unflatten(1, (m, 2, s))[:, :, 1],
            lambda t, s=size, m=pairs: t[:, :body].unflatten(1, (m, 2, s))[:, :, 0],
            False,
        ))
    if body < n:
        tail = lambda t: t[:, body:n].unsqueeze(1)  # noqa: E731
        parts.append((tail, lambda t: t[:, :body].unsqueeze(1), False))
        parts.append((tail, tail, True))
    return parts


def _heads_first(x: Tensor) -> Tensor:
    """``(B, m, rows, h, d)`` -> the kernel's ``(B * m, h, rows, d)`` (a view when it can be)."""
    return x.flatten(0, 1).transpose(1, 2)


def _sequence_first(x: Tensor, B: int) -> Tensor:
    """The kernel's ``(B * m, h, rows, d)`` -> ``(B, m, rows, h, d)`` (a view)."""
    return x.transpose(1, 2).unflatten(0, (B, -1))


def backward(kernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of top-left causal attention of ``q (B, n, h, d)`` over ``k, v (B, n, hk, d)``,
    given ``dout, out (B, n, h, d)`` and fp32 ``lse (B, h, n)`` (used as given). Returns fp32
    ``dq (B, n, h, d)``, ``dk, dv (B, n, hk, d)``."""
    B, n = q.shape[:2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    lse_rows = lse.transpose(1, 2)
    for rows, cols, causal in _parts(n):
        lse_p = rows(lse_rows).flatten(0, 1).transpose(1, 2).contiguous()
        grads = kernel(_heads_first(rows(dout)), _heads_first(rows(q)), _heads_first(cols(k)),
                       _heads_first(cols(v)), _heads_first(rows(out)), lse_p, 0.0, causal, scale=scale)
        gq, gk, gv = (_sequence_first(g, B) for g in grads)
        rows(dq).add_(gq)
        cols(dk).add_(gk)
        cols(dv).add_(gv)
    return dq, dk, dv
