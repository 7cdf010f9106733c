"""``.ci/gpu-window tune``, the GPU window's timing step, checked on the CPU with stand-ins for
``python`` and ``nvidia-smi`` (what they stand in for: the sweep, the benchmark and the GPU query on
a device machine; what they cannot show: any timing). It shows the order of the steps, that the
warp-specialised candidates run last, one process per head dim under its own limit, so that one
which hangs (as a deadlocking image would) costs only its head dim, and that the step says so."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
import textwrap
import time
from pathlib import Path

from support import REPO as ROOT


def _stand_ins(tmp_path: Path, hang_when: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'name, driver_version, memory.total'\n")
    (bin_dir / "python").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$*" >> {tmp_path}/calls.log
        if [[ "$*" == *"--tune-step run"* ]]; then
          mkdir -p {tmp_path}/carry/tune && echo '{{"event": "start"}}' >> {tmp_path}/carry/tune/tune-results.jsonl
        fi
        [[ "$*" == *"{hang_when}"* ]] && exec sleep 60
        exit 0
        """))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def test_a_hanging_warp_specialised_head_dim_costs_only_itself(tmp_path):
    bin_dir = _stand_ins(tmp_path, "--tune-ws only --headdims 64")
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "WS_LIMIT_S": "3",
           "TUNE_BUDGET_S": "5", "BENCH_LIMIT_S": "5"}
    began = time.monotonic()
    result = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-window"), "tune", str(out), str(tmp_path / "carry")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - began < 30
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 5, calls
    settled, bench, *ws = calls
    assert "--tune-step run" in settled and "--tune-ws exclude" in settled
    assert bench.startswith("-m flash_attn bench gpu")
    assert [c.split("--headdims ")[1] for c in ws] == ["128", "64", "256"]
    assert all("--tune-ws only" in c and "--budget-s 2" in c for c in ws)
    assert result.returncode == 1
    assert "warp-specialised d64: rc=124" in (out / "tune-ws.log").read_text()
    assert "warp-specialised rc=124" in result.stdout
    assert (out / "tune-results.jsonl").read_text().count("start") == 4  # copied after the last run


def test_the_window_step_tunes_then_checks_in_what_is_left_and_packs_both(tmp_path):
    """``window``: the sweep and benchmark first, then gpu-check with the budget that is left,
    everything packed into one tarball (a device call returns few files)."""
    bin_dir = _stand_ins(tmp_path, "no hang")
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "WS_LIMIT_S": "3",
           "TUNE_BUDGET_S": "5", "BENCH_LIMIT_S": "5", "WINDOW_BUDGET_S": "200"}
    result = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-window"), "window", str(out), str(tmp_path / "carry"),
                             "doctor", "overhead"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert "--tune-step run" in calls[0] and any("flash_attn doctor" in c for c in calls[5:])
    budget = int(re.search(r"=== budget: (\d+)s", result.stdout).group(1))
    assert 190 <= budget <= 200  # what the tune step left of the window's 200 s
    assert result.stdout.count("=== packed") == 2 and "window: tune rc=0 check rc=0" in result.stdout
    with tarfile.open(out / "window.tgz") as packed:
        names = set(packed.getnames())
    assert {"./tune/gpu.txt", "./tune/tune-results.jsonl", "./check/summary.txt", "./check/doctor.log"} <= names
    assert list(out.iterdir()) == [out / "window.tgz"]


def test_tune_sweep_0_measures_the_shipped_images_only(tmp_path):
    """``TUNE_SWEEP=0``: a window that has nothing new to sweep spends its time on ``bench gpu``
    alone (no candidate run, warp-specialised or not)."""
    bin_dir = _stand_ins(tmp_path, "no hang")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TUNE_SWEEP": "0",
           "BENCH_LIMIT_S": "5"}
    result = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-window"), "tune", str(tmp_path / "out"),
                             str(tmp_path / "carry")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("-m flash_attn bench gpu"), calls
    assert "tune rc=0 bench rc=0 warp-specialised rc=0" in result.stdout


def test_the_host_step_measures_then_checks_what_the_call_path_touches(tmp_path):
    """``host`` (issue 42's window): the stubbed overhead, the device overhead beside SDPA, a short
    benchmark, then gpu-check's held, aot and graphs steps in what is left of its budget; a failed
    measurement fails the step but the others still run."""
    bin_dir = _stand_ins(tmp_path, "no hang")
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOST_BUDGET_S": "360"}
    result = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-window"), "host", str(out), str(tmp_path / "carry")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = [c for c in (tmp_path / "calls.log").read_text().splitlines() if "import xdist" not in c]
    assert calls[0].startswith("-m flash_attn bench overhead --profile")
    assert calls[1].startswith("-m flash_attn bench overhead --device cuda")
    # decode on its own first (a training run cut at its limit keeps no decode row), then training
    assert calls[2].startswith("-m flash_attn bench gpu") and "sdpa[flash]" in calls[2]
    assert "--no-decode " not in calls[2] and "--decode-batches 1,8" in calls[2]
    assert calls[3].startswith("-m flash_attn bench gpu") and "--no-decode " in calls[3] and "--held-out" in calls[3]
    pytest_calls = [c for c in calls[4:] if c.startswith("-m pytest")]
    assert len(pytest_calls) == 3 and "test_aot_held_lanes" in pytest_calls[0]
    assert "--flash-backend aot" in pytest_calls[1] and "test_cuda_graphs" in pytest_calls[2]
    assert (out / "host-summary.txt").read_text().split("\n")[:5] == [
        "overhead-stubbed rc=0", "overhead-cuda rc=0", "bench-decode rc=0", "bench rc=0", "gpu-check rc=0"]
    budget = int(re.search(r"=== budget: (\d+)s", result.stdout).group(1))
    assert 350 <= budget <= 360

    (bin_dir / "python").write_text((bin_dir / "python").read_text().replace(
        "exit 0", '[[ "$*" == *"--device cuda"* ]] && exit 3\nexit 0'))
    result = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-window"), "host", str(out), str(tmp_path / "carry")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "overhead-cuda rc=3" in (out / "host-summary.txt").read_text()
    assert "gpu-check rc=0" in (out / "host-summary.txt").read_text()
