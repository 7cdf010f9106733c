"""The compile jobs' process pool (flash_attn/kernel_build/pool.py) that ``build-kernels`` and
``amd-kernels`` share: every job's result once, progress per job, a failing job named and the rest
cancelled. The functions are the standard library's (a spawned worker imports them by name): what
the pool does with them is what it does with the compile functions, minus the compile."""

from __future__ import annotations

import json
from operator import itemgetter

import pytest

from flash_attn.kernel_build import build, pool


def _label(job: dict) -> str:
    return f"job {job.get('x', '?')}"


WORK = [{"x": i} for i in range(5)]


@pytest.mark.parametrize("workers,in_process", [(2, False), (1, False), (1, True)])
def test_every_job_completes_once_with_its_result(workers, in_process):
    progress = pool.Progress(len(WORK), quiet=True)
    results = list(pool.completed(json.dumps, WORK, workers, progress, _label, in_process=in_process))
    assert sorted((job["x"], result) for job, result in results) == [(i, json.dumps({"x": i})) for i in range(5)]
    assert progress.done == len(WORK)
    if in_process:
        assert [job["x"] for job, _ in results] == list(range(5))  # in order, in this process


@pytest.mark.parametrize("workers,in_process", [(2, False), (1, True)])
def test_a_failing_job_is_named(workers, in_process):
    work = [*WORK[:2], {"y": 1}, *WORK[2:]]  # itemgetter("x") raises KeyError on the third
    with pytest.raises(pool.JobFailed, match=r"job \?: 'x'"):
        list(pool.completed(itemgetter("x"), work, workers, pool.Progress(len(work), quiet=True), _label,
                            in_process=in_process))


def test_the_build_reports_a_failed_compile_with_its_kernel_and_target():
    """``build-kernels`` through the pool: a job that cannot compile (an unknown kernel) stops the
    build with the kernel, dtype, head dim and target in the error."""
    job = {"spec": {"kernel": "no_such_kernel", "dtype": "bf16", "block_d": 64, "block_n": 64, "flags": []},
           "cap": 80, "out": "/nonexistent", "cuobjdump": None}
    with pytest.raises(RuntimeError, match="build-kernels: no_such_kernel bf16 d64 sm_80: "):
        build._run_jobs([job], 1, pool.Progress(1, quiet=True))
