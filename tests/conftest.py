"""Shared test options, fixtures and the tolerance rule.

Options
-------
``--flash-backend NAME`` (default ``cpu`` on the CPU, ``reference`` on other devices): every test
runs with ``FLASH_ATTN_BACKEND=NAME`` (set per test by an autouse fixture), so the same suite checks
the Triton / AOT GPU backends (and, with ``reference``, the exact tiled definition alone).
``--flash-device DEV`` (default ``cpu``): the device the tests put their tensors on
(``--flash-device cuda`` runs the same tests on a GPU).
``--flash-no-skip`` (for ``.ci/gpu-check``): a skipped test fails, unless its reason is one of
:data:`EXPECTED_SKIPS` (right on a GPU machine), so a backend or device that was unavailable
cannot pass as a skip.

Under ``FLASH_ATTN_STRICT_BACKEND=1`` a call the named backend refuses raises
``BackendRefusedError``. A test that fails that way for one of the planner's refusals by design
(:data:`DESIGNED_REFUSALS`: fp32 inputs, ``return_attn_probs`` on aot, ...) is reported as skipped,
"refused by design: ..."; any other refusal (an image the driver cannot load, ...) fails.

Tolerance rule
--------------
A result ``ours`` is compared with the float64 oracle ``ref`` and with the *naive low-precision*
computation ``naive`` (the same formulas evaluated in the input dtype, see ``tests/oracle.py``):

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
import os
import re

import pytest
import torch

_STATE = {"backend": "cpu", "device": "cpu"}

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-3, torch.float64: 1e-10}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def pytest_addoption(parser):
    group = parser.getgroup("flash_attn")
    group.addoption("--flash-backend", default=None,
                    help="FLASH_ATTN_BACKEND used by the tests (default: cpu on the CPU, else reference)")
    group.addoption("--flash-device", default="cpu",
                    help="device the tests create their tensors on (default: cpu; e.g. cuda)")
    group.addoption("--flash-no-skip", action="store_true",
                    help="a skip fails unless its reason is expected on a GPU machine (.ci/gpu-check)")


# Skips that are right on a GPU machine, which --flash-no-skip lets pass: tests of the behaviour
# without a GPU, tests of two GPUs on a machine with one (tests/test_two_devices.py; without any
# GPU its reason differs and fails), tools of a CUDA toolkit the runner lacks, an interpreter
# older than the kernels need (a GPU runner's Triton is PyTorch's, e.g. 3.6 with torch 2.11; its
# GPU compiler runs them, which the triton steps check), a comparison with upstream's source where no
# copy of it is (the recorded table is tested everywhere), tests that override the config table
# or the target for the interpreter (the GPU runs its own table's entries in other tests), and
# refusals by design (below).
EXPECTED_SKIPS = (
    "checks the behaviour without a usable GPU",
    "GPU backends may be available on this device",
    "a GPU is present",
    "a second GPU is absent",
    "cuobjdump not found",
    "interpreter cannot run these kernels",
    "upstream's git mirror is not on this machine",
    "interpreter only: ",
    "refused by design: ",
)
# The planner's refusals by design (Refusal(by="planner") of flash_attn/planning/; not shipped ahead of time:
# flash_attn/aot/specializations.py), as BackendRefusedError words them under
# FLASH_ATTN_STRICT_BACKEND=1: "... refused this <op>: <why>". Any other refusal (an image missing
# from the build, one the driver cannot load) fails.
DESIGNED_REFUSALS = re.compile(
    r"refused this \w+: (torch\.float(32|64) inputs \(the kernels take fp16/bf16\)"
    r"|return_attn_probs \(a testing feature\) is not compiled ahead of time"
    r"|paged K/V in the varlen forward \(not compiled ahead of time\)"
    r"|the backward of paged K/V"
    r"|head dimension \d+ > \d+"
    r"|head dimension \d+ \(the ahead-of-time kernels need a multiple of \d+\)"
    r"|\w+ needs \d+ programs on grid axis \d+ \(CUDA allows \d+\)"
    r"|[kv]_cache is not 16-byte aligned"
    r"|[kv]_cache has strides .*: not multiples of \d+ elements with a contiguous last dimension)"
)


def _designed_refusal(exc: BaseException):
    """The BackendRefusedError in ``exc``'s chain when it is a refusal by design, else None."""
    from flash_attn import dispatch  # noqa: PLC0415

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, dispatch.BackendRefusedError):
            return exc if DESIGNED_REFUSALS.search(str(exc)) else None
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None and not hasattr(report, "wasxfail"):
        refusal = _designed_refusal(call.excinfo.value)
        if refusal is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"refused by design: {refusal}")
    if item.config.getoption("--flash-no-skip") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(expected in reason for expected in EXPECTED_SKIPS):
            report.outcome = "failed"
            report.longrepr = f"--flash-no-skip: skipped, which counts as a failure here: {reason}"
    return report


def pytest_configure(config):
    _STATE["device"] = config.getoption("--flash-device")
    _STATE["backend"] = config.getoption("--flash-backend") or ("cpu" if _STATE["device"] == "cpu" else "reference")
    os.environ["FLASH_ATTN_BACKEND"] = _STATE["backend"]


def backend_name() -> str:
    return _STATE["backend"]


def test_device() -> torch.device:
    return torch.device(_STATE["device"])


def skip_unless_the_interpreter_runs() -> None:
    """Skip a test that runs Triton kernels in Triton's interpreter where that interpreter is too
    old for them (a GPU runner's Triton is PyTorch's, e.g. 3.6; the same kernels run compiled in
    its CUDA tests)."""
    from flash_attn.backends import interpret  # noqa: PLC0415

    reason = interpret.unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


test_device.__test__ = False  # not a test


@pytest.fixture(autouse=True)
def _flash_backend_env(monkeypatch):
    """Every test runs under ``FLASH_ATTN_BACKEND=<--flash-backend>`` and starts from the same
    global RNG state (dropout seeds come from ``torch.manual_seed``)."""
    monkeypatch.setenv("FLASH_ATTN_BACKEND", _STATE["backend"])
    torch.manual_seed(0)
    yield


@pytest.fixture
def device() -> torch.device:
    return test_device()


def gen(seed: int) -> torch.Generator:
    """A CPU generator: tests draw their inputs on the CPU (device-independent values) and then
    move them to the device under test."""
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, seed_or_gen, device=None, scale=1.0, requires_grad=False):
    g = gen(seed_or_gen) if isinstance(seed_or_gen, int) else seed_or_gen
    t = (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(dtype)
    t = t.to(test_device() if device is None else device)
    return t.requires_grad_(requires_grad)


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


def backward_floor(q, k, v, dout, softmax_scale=None, probs=None, dropout_p=0.0) -> float:
    """The error an exact-to-fp32 attention backward cannot avoid, as an absolute slack.

    The backward forms ``dS = P * (dP - D)`` with ``dP = dout . v`` and ``D = rowsum(dout * out)``;
    ``dP - D`` cancels, so fp32 arithmetic leaves an error of about ``eps32 * |dP|`` in each ``dS``
    even where the exact ``dS`` is 0 (e.g. a row that sees a single key, where the naive
    computation is exact because P == 1). That error reaches dq/dk through ``scale * dS @ k|q``,
    summed over at most ``max column sum of P`` weights. So

        floor = 4 * eps32 * scale * max|dP| * max(|q|, |k|) * max(1, max column sum of P)

    (factor 4: the two rounded terms of ``dP - D`` and one more rounding on each side). It uses
    the fp32 epsilon because every implementation accumulates the backward in at least fp32; it
    only matters for fp32 inputs (for fp16/bf16 it is far below ``FLOOR``).
    """
    q, k, v, dout = (t.detach().double().cpu() for t in (q, k, v, dout))
    d, h = q.shape[-1], q.shape[-2]
    hk = k.shape[-2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    do = dout.reshape(-1, h, d)
    vv = v.reshape(-1, hk, d)[:, torch.arange(h) // (h // hk)]
    max_dp = torch.einsum("nhd,mhd->hnm", do, vv).abs().max().item() / (1.0 - dropout_p)
    colsum = 1.0
    if probs is not None and probs.numel():
        colsum = max(1.0, probs.detach().double().sum(dim=-2).max().item())
    big = max(q.abs().max().item(), k.abs().max().item())
    return 4 * torch.finfo(torch.float32).eps * scale * max_dp * big * colsum


def make_slopes(shape, seed=0, device=None) -> torch.Tensor:
    """ALiBi slopes in (0.05, 1): float32."""
    g = gen(seed)
    s = 0.05 + 0.95 * torch.rand(shape, generator=g, dtype=torch.float32)
    return s.to(test_device() if device is None else device)


def cu_from_lens(lens, device=None) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=test_device() if device is None else device)


# ---------------------------------------------------------------------------------------------
# Running the oracles.


def oracle_pair(fn, tensors, dout=None, **kwargs):
    """Run oracle ``fn(*tensors, compute_dtype=..., **kwargs)`` twice: in float64 (the reference)
    and naively in the inputs' dtype. With ``dout``, also backpropagate ``dout`` through both.

    Returns ``(ref, ref_grads, naive, naive_grads)``; grads are lists aligned with ``tensors``
    (``None`` without ``dout``).
    """
    from oracle import F64  # noqa: PLC0415  (tests dir is on sys.path)

    results = []
    for cd in (F64, None):
        ins = [t.detach().to(F64 if cd is F64 else t.dtype).requires_grad_(dout is not None) for t in tensors]
        res = fn(*ins, compute_dtype=cd, **kwargs)
        grads = None
        if dout is not None:
            g = dout.detach().to(F64 if cd is F64 else dout.dtype)
            if res.out.requires_grad:
                grads = torch.autograd.grad(res.out, ins, g, allow_unused=True)
            else:
                grads = [None] * len(ins)
            grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(ins, grads)]
        results.append((res, grads))
    (ref, ref_grads), (naive, naive_grads) = results
    return ref, ref_grads, naive, naive_grads
