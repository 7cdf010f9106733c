"""flash_attn.utils.benchmark: upstream's signatures, a working CPU path, clear errors on bad input."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils import benchmark as tbench

from flash_attn.utils import benchmark as fab

UPSTREAM_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"  # flash-attn 2.8.4
UPSTREAM_MIRROR = Path("/work/.mirror/Dao-AILab+flash-attention/repo")
UPSTREAM_PATH = "flash_attn/utils/benchmark.py"

REQUIRED = object()
P, VAR_P, KW, VAR_KW = "positional_or_keyword", "var_positional", "keyword_only", "var_keyword"
_TIMING_KW = [("grad", KW, "None"), ("repeats", KW, "10"), ("desc", KW, "''"), ("verbose", KW, "True"),
              ("amp", KW, "False"), ("amp_dtype", KW, "torch.float16"), ("kwinputs", VAR_KW, REQUIRED)]

# Recorded from upstream's flash_attn/utils/benchmark.py at UPSTREAM_COMMIT: name -> parameters, in
# order, as (name, kind, default written as source, or REQUIRED).
SIGNATURES = {
    "benchmark_forward": [("fn", P, REQUIRED), ("inputs", VAR_P, REQUIRED)]
    + [p for p in _TIMING_KW if p[0] != "grad"],
    "benchmark_backward": [("fn", P, REQUIRED), ("inputs", VAR_P, REQUIRED)] + _TIMING_KW,
    "benchmark_combined": [("fn", P, REQUIRED), ("inputs", VAR_P, REQUIRED)] + _TIMING_KW,
    "benchmark_fwd_bwd": [("fn", P, REQUIRED), ("inputs", VAR_P, REQUIRED)] + _TIMING_KW,
    "benchmark_all": [("fn", P, REQUIRED), ("inputs", VAR_P, REQUIRED)] + _TIMING_KW,
    "pytorch_profiler": [
        ("fn", P, REQUIRED), ("inputs", VAR_P, REQUIRED), ("trace_filename", KW, "None"),
        ("backward", KW, "False"), ("amp", KW, "False"), ("amp_dtype", KW, "torch.float16"),
        ("cpu", KW, "False"), ("verbose", KW, "True"), ("kwinputs", VAR_KW, REQUIRED),
    ],
    "benchmark_memory": [("fn", P, REQUIRED), ("inputs", VAR_P, REQUIRED), ("desc", KW, "''"),
                         ("verbose", KW, "True"), ("kwinputs", VAR_KW, REQUIRED)],
}


# --- (1) signatures ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_recorded_upstream(name):
    params = list(inspect.signature(getattr(fab, name)).parameters.values())
    got = [(p.name, p.kind.name.lower(), p.default) for p in params]
    want = [(n, k, inspect.Parameter.empty if d is REQUIRED else eval(d, {"torch": torch}))
            for n, k, d in SIGNATURES[name]]
    assert got == want


def test_public_names_are_upstreams():
    ours = {n for n, v in vars(fab).items()
            if inspect.isfunction(v) and v.__module__ == fab.__name__ and not n.startswith("_")}
    assert ours == set(SIGNATURES) == set(fab.__all__)


def _ast_signature(node: ast.FunctionDef) -> list:
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [REQUIRED] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = [(arg.arg, P, d) for arg, d in zip(positional, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, VAR_P, REQUIRED))
    out += [(arg.arg, KW, REQUIRED if d is None else ast.unparse(d)) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, VAR_KW, REQUIRED))
    return out


def test_recorded_table_matches_upstream_mirror():
    if not UPSTREAM_MIRROR.is_dir():
        pytest.skip("upstream's git mirror is not on this machine")
    shown = subprocess.run(["git", "-C", str(UPSTREAM_MIRROR), "show", f"{UPSTREAM_COMMIT}:{UPSTREAM_PATH}"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        pytest.skip(f"upstream's git mirror is not on this machine (commit {UPSTREAM_COMMIT[:8]} "
                    f"not readable: {shown.stderr.strip()})")
    tree = ast.parse(shown.stdout)
    upstream = {n.name: _ast_signature(n) for n in tree.body
                if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    # Defaults as source text; normalise quoting so '' and "" compare equal.
    norm = lambda sig: [(n, k, d if d is REQUIRED else ast.unparse(ast.parse(d, mode="eval"))) for n, k, d in sig]
    assert {k: norm(v) for k, v in upstream.items()} == {k: norm(v) for k, v in SIGNATURES.items()}


# --- (2) it runs on the CPU ----------------------------------------------------------------------


def _matmul_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(16, 8, generator=g, requires_grad=True)
    b = torch.randn(8, 12, generator=g, requires_grad=True)
    return a, b


def _matmul(a, b, scale=1.0):
    return (a @ b) * scale


def _check_pair(pair):
    timer, measurement = pair
    assert isinstance(timer, tbench.Timer)
    assert isinstance(measurement, tbench.Measurement)
    assert measurement.mean > 0 and measurement.median > 0


def test_forward_runs_on_cpu_with_kwinputs(capsys):
    a, b = _matmul_inputs()
    calls = []
    fn = lambda a, b, scale: calls.append(scale) or _matmul(a, b, scale)
    _check_pair(fab.benchmark_forward(fn, a, b, scale=3.0, repeats=3, desc="mm"))
    assert calls and set(calls) == {3.0}
    out = capsys.readouterr().out
    assert "mm - Forward pass" in out and "Measurement object" in out
    assert a.grad is None  # forward only


def test_backward_computes_the_gradients():
    a, b = _matmul_inputs()
    grad = torch.randn(16, 12)
    _check_pair(fab.benchmark_backward(_matmul, a, b, grad=grad, repeats=3, verbose=False))
    # .grad is cleared before each pass, so it holds one pass's gradient, not a sum.
    torch.testing.assert_close(a.grad, grad @ b.detach().T)
    torch.testing.assert_close(b.grad, a.detach().T @ grad)


def test_backward_takes_a_tuple_outputs_first_element():
    a, b = _matmul_inputs()
    _check_pair(fab.benchmark_backward(lambda a, b: (_matmul(a, b), "extra"), a, b, repeats=2, verbose=False))
    assert a.grad is not None and b.grad is not None


def test_combined_runs_forward_and_backward():
    a, b = _matmul_inputs()
    calls = []
    fn = lambda a, b: calls.append(1) or _matmul(a, b)
    grad = torch.ones(16, 12)
    _check_pair(fab.benchmark_combined(fn, a, b, grad=grad, repeats=3, verbose=False))
    assert len(calls) > 3  # the untimed first call, the warm-up and the timed calls all run fn
    torch.testing.assert_close(a.grad, grad @ b.detach().T)


def test_fwd_bwd_and_all_return_pairs(capsys):
    a, b = _matmul_inputs()
    fwd_bwd = fab.benchmark_fwd_bwd(_matmul, a, b, repeats=2, desc="x")
    assert len(fwd_bwd) == 2
    every = fab.benchmark_all(_matmul, a, b, repeats=2, verbose=False)
    assert len(every) == 3
    for pair in fwd_bwd + every:
        _check_pair(pair)
    out = capsys.readouterr().out
    assert "x - Forward pass" in out and "x - Backward pass" in out


def test_amp_autocasts_on_the_inputs_device():
    a, b = _matmul_inputs()
    seen = []

    def fn(a, b):
        seen.append(torch.is_autocast_enabled("cpu"))
        out = a @ b
        seen.append(out.dtype)
        return out

    fab.benchmark_forward(fn, a, b, repeats=2, verbose=False, amp=True, amp_dtype=torch.bfloat16)
    assert seen[:2] == [True, torch.bfloat16]
    seen.clear()
    fab.benchmark_backward(fn, a, b, repeats=2, verbose=False, amp=True, amp_dtype=torch.bfloat16)
    assert seen == [True, torch.bfloat16] and a.grad.dtype == torch.float32


def test_pytorch_profiler_on_cpu(tmp_path, capsys):
    a, b = _matmul_inputs()
    trace = tmp_path / "trace.json"
    assert fab.pytorch_profiler(_matmul, a, b, trace_filename=str(trace), backward=True) is None
    assert "aten::mm" in capsys.readouterr().out  # CPU activity recorded although cpu=False
    assert "traceEvents" in json.loads(trace.read_text())
    assert a.grad is not None


def test_benchmark_memory_on_cpu_reports_the_peak_growth(capsys):
    mib = 2**20

    def fn(n):
        first = torch.empty(8 * mib, dtype=torch.uint8)
        second = torch.empty(16 * mib, dtype=torch.uint8)  # peak: 24 MiB with `first` alive
        del first, second
        return torch.empty(4 * mib, dtype=torch.uint8)

    x = torch.zeros(100 * mib, dtype=torch.uint8)  # live before the call: not counted on the CPU
    mem = fab.benchmark_memory(fn, x, desc="alloc")
    assert isinstance(mem, float)
    assert 24 <= mem * 1000 < 24.5  # upstream's unit: MiB / 1000
    assert "alloc max memory:" in capsys.readouterr().out


# --- (3) clear errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("bench", [fab.benchmark_backward, fab.benchmark_combined, fab.benchmark_fwd_bwd,
                                   fab.benchmark_all])
def test_output_without_grad_is_named(bench):
    a, b = (t.detach() for t in _matmul_inputs())
    with pytest.raises(RuntimeError, match="does not require grad.*requires_grad=True"):
        bench(_matmul, a, b, repeats=2, verbose=False)


def test_profiler_backward_without_grad_is_named():
    a, b = (t.detach() for t in _matmul_inputs())
    with pytest.raises(RuntimeError, match="pytorch_profiler: fn's output does not require grad"):
        fab.pytorch_profiler(_matmul, a, b, backward=True, verbose=False)


def test_non_tensor_output_is_named():
    with pytest.raises(TypeError, match="fn returned float; the backward pass needs a tensor"):
        fab.benchmark_backward(lambda x: 1.0, torch.ones(2, requires_grad=True), verbose=False)


def test_grad_shape_mismatch_shows_both_shapes():
    a, b = _matmul_inputs()
    with pytest.raises(RuntimeError, match=r"grad shape \(12, 16\) does not match output shape \(16, 12\)"):
        fab.benchmark_backward(_matmul, a, b, grad=torch.ones(12, 16), verbose=False)


@pytest.mark.parametrize("repeats", [0, -1, 2.5, True])
def test_bad_repeats(repeats):
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        fab.benchmark_forward(torch.sin, torch.ones(2), repeats=repeats, verbose=False)


def test_fn_not_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        fab.benchmark_forward(torch.ones(2), torch.ones(2), verbose=False)


def test_memory_on_an_unsupported_device():
    with pytest.raises(NotImplementedError, match="CUDA and CPU memory; the inputs are on meta"):
        fab.benchmark_memory(torch.sin, torch.ones(2, device="meta"), verbose=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path():
    a = torch.randn(64, 64, device="cuda", requires_grad=True)
    for pair in fab.benchmark_all(torch.matmul, a, a, repeats=3, verbose=False, amp=True):
        _check_pair(pair)
    assert a.grad is not None
    mem = fab.benchmark_memory(lambda: torch.empty(2**26, dtype=torch.uint8, device="cuda"), verbose=False)
    assert mem * 1000 >= 64
