"""Build benchmark: runs the ahead-of-time kernel build (``python -m flash_attn build-kernels``) for
the default architectures and reports its wall time, peak resident memory (of the build and every
process it waited for, e.g. ptxas) and the size of what it wrote."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

# {out} is replaced by the output folder, {archs} by the architecture list.
DEFAULT_COMMAND = "{python} -m flash_attn build-kernels --output {out}"


def folder_size(path: Path) -> tuple[int, int]:
    """Total bytes and number of files under ``path``."""
    total = count = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
                count += 1
            except OSError:
                pass
    return total, count


def run(command: Optional[str] = None, archs: Optional[str] = None, out_dir: Optional[Path] = None,
        timeout: float = 3600.0) -> dict:
    """Run the build once; never raises for a failing build (the result says what happened)."""
    from flash_attn.aot.archs import DEFAULT_CUDA_ARCHS  # noqa: PLC0415

    archs = archs or DEFAULT_CUDA_ARCHS
    out = Path(tempfile.mkdtemp(prefix="flash_attn_build_")) if out_dir is None else Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = (command or DEFAULT_COMMAND).format(python=shlex.quote(sys.executable), out=shlex.quote(str(out)),
                                               archs=shlex.quote(archs))
    argv: Sequence[str] = shlex.split(text)
    env = dict(os.environ, FLASH_ATTN_CUDA_ARCHS=archs)
    result = {"command": text, "archs": archs, "out": str(out)}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        except OSError as exc:
            result.update(status="error", note=f"cannot start: {exc}")
            return result
        # wait4: this child's own resource usage, including the processes it waited for (ptxas...)
        deadline = start + timeout
        while True:
            pid, wait_status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, wait_status, usage = os.wait4(proc.pid, 0)
                result.update(status="timeout", note=f"over {timeout:.0f} s")
                break
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        wall = time.perf_counter() - start
        log.seek(0)
        output = log.read()
    peak_kib = usage.ru_maxrss
    size, files = folder_size(out)
    result.update(
        wall_s=wall,
        peak_rss_mib=peak_kib / (1024 * (1024 if sys.platform == "darwin" else 1)),
        size_mib=size / 2**20,
        files=files,
        exit_status=proc.returncode,
        log_tail=output.strip().splitlines()[-20:],
    )
    result.setdefault("status", "ok" if proc.returncode == 0 else "error")
    if result["status"] == "error" and "invalid choice: 'build-kernels'" in output:
        result["note"] = "this installation has no `build-kernels` command yet"
    elif result["status"] == "error":
        result["note"] = f"exit {proc.returncode}"
    return result
