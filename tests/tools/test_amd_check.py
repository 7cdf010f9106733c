"""``.ci/amd-check``, the AMD GPU check prepared for when an AMD GPU can be measured (none is
available here): it refuses a machine that is not ROCm PyTorch with an AMD GPU, and says so."""

import subprocess
import sys
from pathlib import Path

from support import REPO

SCRIPT = REPO / ".ci" / "amd-check"


def _run(*args, tmp: Path):
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp)}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def test_usage_and_unknown_steps(tmp_path):
    assert _run(tmp=tmp_path).returncode == 2
    assert _run(str(tmp_path / "out"), "nonsense", tmp=tmp_path).returncode == 2


def test_its_env_step_fails_without_rocm_and_the_summary_says_so(tmp_path):
    out = tmp_path / "out"
    result = _run(str(out), "env", tmp=tmp_path)
    assert result.returncode == 1
    summary = (out / "summary.txt").read_text()
    assert "== env" in summary and "FAIL" in summary
    assert "not a ROCm build of PyTorch" in (out / "env.log").read_text()
