"""The tolerance rule: how close a result must be to the float64 oracle.

A result ``ours`` is compared with the float64 oracle ``ref`` and with the *naive low-precision*
computation ``naive`` (the same formulas evaluated in the input dtype, see ``support/oracle.py``):

    max|ours - ref| <= 2 * max|naive - ref| + slack

i.e. we may be at most twice as wrong as straightforward arithmetic in that dtype. ``slack`` covers
the one error no implementation can avoid, rounding the exact answer to the output dtype, and
the case where the naive computation happens to be (almost) exact:

    slack = max(FLOOR[dtype], ULPS * eps(dtype) * max|ref|)

with ``eps`` the dtype's machine epsilon (one ulp at 1.0), ``ULPS = 1`` for forward values
(one ulp of the largest reference value: at least twice the worst rounding error of any element)
and ``ULPS = 2`` for gradients (they are sums of many products and the reference backward
recomputes the probabilities). ``FLOOR``: fp32 1e-5, fp16 1e-3, bf16 2e-3 (about 1/8 of an ulp
at 1.0 for the half types and ~100 ulps of fp32, covering outputs near 0).
"""

from __future__ import annotations

import math

import torch

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-3, torch.float64: 1e-10}
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def eps(dtype) -> float:
    return torch.finfo(dtype).eps


def tolerance(ref: torch.Tensor, naive: torch.Tensor, dtype, grad: bool = False, floor: float = 0.0) -> float:
    """The bound of the tolerance rule (see the module docstring) for comparing against ``ref``.
    ``floor``: an extra lower bound on the slack (see :func:`backward_floor`)."""
    ref = ref.detach().double().cpu()
    naive = naive.detach().double().cpu()
    finite = torch.isfinite(ref)
    if ref.numel() == 0 or not finite.any():
        return max(FLOOR[dtype], floor)
    naive_err = (naive - ref)[finite].abs().max().item()
    if math.isnan(naive_err):
        naive_err = 0.0
    big = ref[finite].abs().max().item()
    slack = max(FLOOR[dtype], (2 if grad else 1) * eps(dtype) * big, floor)
    return 2 * naive_err + slack


def check_close(ours: torch.Tensor, ref: torch.Tensor, naive: torch.Tensor, dtype, name: str,
                grad: bool = False, floor: float = 0.0) -> None:
    """Assert the tolerance rule. Non-finite reference entries (lse = +inf of rows without keys)
    must be matched exactly; ``ours`` must never be NaN."""
    assert tuple(ours.shape) == tuple(ref.shape), f"{name}: shape {tuple(ours.shape)} != expected {tuple(ref.shape)}"
    o = ours.detach().double().cpu()
    r = ref.detach().double().cpu()
    assert not torch.isnan(o).any(), f"{name}: NaN in result ({int(torch.isnan(o).sum())} entries)"
    inf_ref = ~torch.isfinite(r)
    if inf_ref.any():
        assert torch.equal(o[inf_ref], r[inf_ref]), f"{name}: expected {r[inf_ref][:5].tolist()} at non-finite reference entries, got {o[inf_ref][:5].tolist()}"
    assert torch.isfinite(o[~inf_ref]).all(), f"{name}: non-finite values where the reference is finite"
    if o.numel() == 0 or (~inf_ref).sum() == 0:
        return
    err = (o - r)[~inf_ref].abs().max().item()
    tol = tolerance(r, naive, dtype, grad=grad, floor=floor)
    assert err <= tol, (
        f"{name} ({DTYPE_IDS.get(dtype, dtype)}): max abs error {err:.3e} > tolerance {tol:.3e} "
        f"(naive low-precision error {(naive.detach().double().cpu() - r)[~inf_ref].abs().max().item():.3e})"
    )


def backward_floor(q, k, v, dout, softmax_scale=None, probs=None, dropout_p=0.0, qv=None) -> float:
    """The error an exact-to-fp32 attention backward cannot avoid, as an absolute slack.

    The backward forms ``dS = P * (dP - D)`` with ``dP = dout . v`` and ``D = rowsum(dout * out)``;
    ``dP - D`` cancels, so fp32 arithmetic leaves an error of about ``eps32 * |dP|`` in each ``dS``
    even where the exact ``dS`` is 0 (e.g. a row that sees a single key, where the naive
    computation is exact because P == 1). That error reaches dq/dk through ``scale * dS @ k|q``,
    summed over at most ``max column sum of P`` weights. So

        floor = 4 * eps32 * scale * max|dP| * max(|q|, |k|) * max(1, max column sum of P)

    (factor 4: the two rounded terms of ``dP - D`` and one more rounding on each side). It uses
    the fp32 epsilon because every implementation accumulates the backward in at least fp32; it
    only matters for fp32 inputs (for fp16/bf16 it is far below ``FLOOR``). v may have its own head
    dim; with MLA's ``qv`` the same error reaches dqv and dv through ``dS @ v`` and ``dS^T @ qv``.
    """
    q, k, v, dout = (t.detach().double().cpu() for t in (q, k, v, dout))
    d, h = q.shape[-1], q.shape[-2]
    hk, dv = k.shape[-2], v.shape[-1]
    scale = (d + (0 if qv is None else qv.shape[-1])) ** -0.5 if softmax_scale is None else softmax_scale
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    do = dout.reshape(-1, h, dv)
    vv = v.reshape(-1, hk, dv)[:, torch.arange(h) // (h // hk)]
    max_dp = torch.einsum("nhd,mhd->hnm", do, vv).abs().max().item() / (1.0 - dropout_p)
    colsum = 1.0
    if probs is not None and probs.numel():
        colsum = max(1.0, probs.detach().double().sum(dim=-2).max().item())
    big = max(q.abs().max().item(), k.abs().max().item())
    if qv is not None:
        big = max(big, qv.detach().abs().max().item(), v.abs().max().item())
    return 4 * torch.finfo(torch.float32).eps * scale * max_dp * big * colsum
