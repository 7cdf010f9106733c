"""``.ci/gpu-check``, the GPU acceptance, checked on the CPU: its dry run (selection and budget
accounting), its real mode with a stand-in ``python`` (what it exports, which exit statuses fail
the run), and the pytest options it relies on (``--flash-no-skip``, refusals by design under
``FLASH_ATTN_STRICT_BACKEND=1``; tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from support import REPO as ROOT, TESTS

SCRIPT = ROOT / ".ci" / "gpu-check"


def _gpu_check(*args, env=None, timeout=600):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The whole dry run, once (it collects each pytest step's selection: ~40 s on two cores)."""
    result = _gpu_check("--dry-run", str(tmp_path_factory.mktemp("gpu-check")))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _selected(stdout: str, step: str) -> int:
    line = re.search(rf"^{step}: dry run \(limit \d+s; selects (.*)\)$", stdout, re.M).group(1)
    return int(re.match(r"(\d+)", line).group(1))  # "115/8409 tests collected ..." or "322 tests collected"


def test_dry_run_selects_the_gpu_tests_not_the_full_matrix(dry_run):
    # -m "gpu" alone replaced pyproject's -m 'not full_matrix' and selected 3,645 tests
    assert 50 <= _selected(dry_run, "gpu") < 400
    assert 10 <= _selected(dry_run, "graphs") < 100
    assert 100 <= _selected(dry_run, "aot") < 1000
    # the triton step: a few public calls, each JIT-compiled on a fresh machine (.ci/gpu-check)
    assert 5 <= _selected(dry_run, "triton") < 30
    for step in ("compile-aot", "compile-triton"):
        assert _selected(dry_run, step) >= 10
    for line in dry_run.splitlines():
        if line.startswith("=== ") and " -m pytest " in line:
            assert "--flash-no-skip" in line and "not\\ full_matrix" in line, line


def test_the_oracle_steps_run_every_device_test_file(dry_run):
    """The aot and triton steps run the oracle tests of every public function (issue 25, part 1):
    the upstream API, the low-level _flash_attn_* / flash_attn_gpu.* functions, the transformers
    integration, and the two-device test (which the gpu step leaves to them). The triton step
    runs a subset of them (-k): the JIT compiles each specialisation first, ~8 s a test on an H200."""
    commands = dict(re.findall(r"^=== (\S+) \(limit \d+s, \d+s of the budget left\): (.*)$", dry_run, re.M))
    for step in ("aot", "triton"):
        for name in ("api/test_attention_oracle.py", "planning/test_decode_superset.py", "api/test_lowlevel_api.py",
                     "integration/test_transformers_integration.py", "integration/test_two_devices.py"):
            assert f" tests/{name}" in commands[step], (step, name)
    assert "--ignore tests/integration/test_two_devices.py" in commands["gpu"]


def test_the_two_device_skip_is_expected_only_with_one_gpu(monkeypatch):
    """With one GPU the two-device test's skip passes --flash-no-skip; without any GPU it fails."""
    import torch

    from conftest import EXPECTED_SKIPS
    from support.gpus import two_devices_skip_reason

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, expected in ((1, True), (0, False)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        reason = two_devices_skip_reason()
        assert reason and any(e in reason for e in EXPECTED_SKIPS) == expected, reason
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert two_devices_skip_reason() == ""


def test_dry_run_limits_fit_the_budget(dry_run):
    budget, reserved = map(int, re.search(r"budget: (\d+)s; step limits \+ 2s grace each: (\d+)s \(fits\)",
                                          dry_run).groups())
    assert budget == 600 and reserved <= budget
    limits = [int(n) for n in re.findall(r"^\S+: dry run \(limit (\d+)s", dry_run, re.M)]
    assert len(limits) == 10 and sum(limits) + 2 * len(limits) == reserved
    assert re.search(r"^total: \d+s of 600s \(dry run: worst case\); passed$", dry_run, re.M)
    # the most valuable evidence first: the aot oracle tests right after env and doctor
    order = re.findall(r"^(\S+): dry run", dry_run, re.M)
    assert order[:3] == ["env", "doctor", "aot"] and order[-1] == "bench"
    assert "FLASH_ATTN_STRICT_BACKEND=1" in dry_run


def test_a_step_left_without_budget_fails_the_run(tmp_path):
    result = _gpu_check("--dry-run", str(tmp_path), "env", "doctor", "overhead",
                        env={"GPU_CHECK_BUDGET_S": "60"})  # env (15+2) and doctor (30+2) fit, overhead not
    assert result.returncode == 1, result.stdout
    assert "DOES NOT FIT" in result.stdout
    assert re.search(r"^overhead: FAIL not run \(budget spent", result.stdout, re.M)
    assert re.search(r"^env: dry run", result.stdout, re.M) and re.search(r"^doctor: dry run", result.stdout, re.M)
    assert (tmp_path / "summary.txt").read_text().splitlines()[-1].endswith("FAILED")


def test_unknown_step_and_missing_out_dir_are_refused(tmp_path):
    assert _gpu_check("--dry-run", str(tmp_path), "nonsense").returncode == 2
    assert _gpu_check("--dry-run").returncode == 2


# ---------------------------------------------------------------------------------------------
# The real mode, with a stand-in python that records its environment and arguments


def _fake_python(tmp_path, fail_when: str = "") -> Path:
    """A ``python`` first on PATH: appends its FLASH_ATTN_* environment and arguments to
    calls.log; exits 1 when its arguments contain ``fail_when``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "strict=${{FLASH_ATTN_STRICT_BACKEND:-}} backend=${{FLASH_ATTN_BACKEND:-}} args=$*" >> {tmp_path}/calls.log
        [[ -n "{fail_when}" && "$*" == *"{fail_when}"* ]] && exit 1
        exit 0
        """))
    fake.chmod(0o755)
    return bin_dir


def _real_run(tmp_path, *steps, fail_when="", env=None):
    bin_dir = _fake_python(tmp_path, fail_when)
    out = tmp_path / "out"
    result = _gpu_check(str(out), *steps, env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **(env or {})},
                        timeout=120)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    return result, calls, out


def test_every_step_runs_in_strict_mode(tmp_path):
    result, calls, out = _real_run(tmp_path, "doctor", "graphs", "overhead", "bench")
    assert result.returncode == 0, result.stdout
    assert len(calls) == 6 and all(c.startswith("strict=1 ") for c in calls)
    probe, graphs, stubbed, overhead, bench = calls[0], *calls[2:]
    assert probe.endswith("-c import xdist")  # the fake python has every module: xdist is there
    assert "--flash-no-skip" in graphs and "-m gpu and not full_matrix" in graphs
    assert " -n 12 " in graphs and "pytest: -n 12" in result.stdout  # the JIT's compiles spread over 12 processes
    # the same Python stubbed on this host's CPU, then for real: strict binds only a named backend
    assert "backend=aot" in stubbed and "--device" not in stubbed and "--profile" in stubbed
    assert "backend=aot" in overhead and "--device cuda" in overhead and "--profile" in overhead
    assert "bench gpu" in bench and f"--out {out}/bench" in bench
    assert {p.name for p in out.iterdir()} >= {"doctor.log", "graphs.log", "summary.txt"}
    assert "bench: ok in " in (out / "summary.txt").read_text()


@pytest.mark.parametrize("workers, fail_when", [("0", ""), ("8", "import xdist")], ids=["workers-0", "no-xdist"])
def test_test_steps_run_in_one_process_without_xdist_or_when_told(tmp_path, workers, fail_when):
    result, calls, _ = _real_run(tmp_path, "graphs", fail_when=fail_when, env={"GPU_CHECK_WORKERS": workers})
    assert result.returncode == 0, result.stdout
    graphs = next(c for c in calls if "-m pytest" in c)
    assert " -n " not in graphs and "pytest: one process" in result.stdout
    assert any("import xdist" in c for c in calls) == (workers != "0")


def test_a_crashed_benchmark_row_fails_the_run(tmp_path):
    result, calls, out = _real_run(tmp_path, "doctor", "bench", fail_when="bench gpu")  # bench gpu exits 1
    assert result.returncode == 1
    summary = (out / "summary.txt").read_text()
    assert "doctor: ok" in summary and re.search(r"^bench: FAIL rc=1 ", summary, re.M)


# ---------------------------------------------------------------------------------------------
# The pytest options (tests/conftest.py), on a sample test file


SAMPLE = '''
import pytest
import torch

from flash_attn import dispatch, flash_attn_func


def test_backend_unavailable():
    pytest.skip("the aot backend cannot run on cuda: no CUDA device is available")


def test_expected_skip():
    pytest.skip("checks the behaviour without a usable GPU")


def test_refused_by_design(monkeypatch):
    # a real refusal: the interpreter backend refuses fp32 inputs (strict: it raises)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "interpret")
    monkeypatch.setenv("FLASH_ATTN_STRICT_BACKEND", "1")
    q = torch.randn(1, 8, 2, 32)
    flash_attn_func(q, q, q)


def test_refused_not_by_design():
    raise dispatch.BackendRefusedError("FLASH_ATTN_STRICT_BACKEND=1: the aot backend (FLASH_ATTN_BACKEND=aot) "
                                       "refused this forward: the sm_90a image fwd-1 cannot be used: no kernel image")


def test_failed_on_first_use():
    raise dispatch.BackendRefusedError("FLASH_ATTN_STRICT_BACKEND=1: the triton backend (FLASH_ATTN_BACKEND=triton) "
                                       "failed on this forward: torch.float32 inputs (the kernels take fp16/bf16)")
'''


def test_the_designed_refusals_are_the_planners_words():
    """The refusals conftest lets pass, against the planner's own wording (a change there must
    show here, not turn refusals into failures on a GPU, or failures into skips)."""
    import torch

    from conftest import DESIGNED_REFUSALS
    from flash_attn import limits
    from flash_attn.planning import launches

    aot = launches.Target("sm90", 132, aot=True)
    too_wide = limits.MAX_HEADDIM + limits.AOT_HEADDIM_MULTIPLE  # past the widest bucket, else well-formed
    reasons = [launches.kernel_refusal(torch.float32, 64, aot), launches.kernel_refusal(torch.float16, 59, aot),
               launches.kernel_refusal(torch.float16, too_wide, aot)]
    for why in reasons:
        assert why and DESIGNED_REFUSALS.search(f"the aot backend (FLASH_ATTN_BACKEND=aot) refused this forward: {why}")
    missing = "attn_fwd_kernel.bf16.d128.m128n64w8s2.1 is not in the sm_90a image set of this installation"
    assert not DESIGNED_REFUSALS.search(f"the aot backend (FLASH_ATTN_BACKEND=aot) refused this forward: {missing}")


def _outcomes(tmp_path, *options) -> dict:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    report = tmp_path / f"report{len(options)}.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("FLASH_ATTN_STRICT_BACKEND", None)
    subprocess.run([sys.executable, "-m", "pytest", "-c", os.devnull, "-p", "conftest", "-p", "no:cacheprovider", "-q",
                    f"--junitxml={report}", "test_sample.py", *options], cwd=tmp_path, env=env, capture_output=True,
                   timeout=300)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("skipped", "failure", "error")]
        message = case[0].get("message", "") if len(case) else ""
        outcomes[case.get("name")] = ((kinds or ["passed"])[0], message)
    return outcomes


def test_refusals_by_design_are_skips_and_other_refusals_fail(tmp_path):
    got = _outcomes(tmp_path)
    assert got["test_backend_unavailable"][0] == "skipped" and got["test_expected_skip"][0] == "skipped"
    kind, message = got["test_refused_by_design"]
    assert kind == "skipped" and "refused by design: " in message and "torch.float32 inputs" in message
    assert got["test_refused_not_by_design"][0] == "failure"
    assert got["test_failed_on_first_use"][0] == "failure"


def test_flash_no_skip_fails_skips_but_the_expected_ones(tmp_path):
    got = _outcomes(tmp_path, "--flash-no-skip")
    kind, message = got["test_backend_unavailable"]
    assert kind == "failure" and "no CUDA device is available" in message
    assert got["test_expected_skip"][0] == "skipped"
    assert got["test_refused_by_design"][0] == "skipped"
    assert got["test_refused_not_by_design"][0] == "failure" and got["test_failed_on_first_use"][0] == "failure"
