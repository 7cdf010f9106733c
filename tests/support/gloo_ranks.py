"""Running a function on several CPU processes joined by torch.distributed's ``gloo`` backend on
loopback, for the context-parallel tests: each rank writes its results as JSON, which the test
reads back after every process has finished.

This file is a helper, not a test module: spawned processes import it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from support.options import backend_name

TIMEOUT_S = 120


def skip_unless_cpu_ranks_can_run(monkeypatch) -> None:
    """Skip where the ranks cannot run here; keep them on loopback."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this PyTorch build")
    if backend_name() not in ("auto", "cpu", "reference", "interpret"):
        pytest.skip(f"the ranks run on CPU processes; backend {backend_name()} does not run on CPU tensors")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def _run_then_exit(rank: int, worker, world: int, init_file: str, result_dir: str) -> None:
    """``worker``'s rank, then an immediate exit once it returned (its results written, its group
    destroyed): the interpreter's own teardown, where gloo's worker threads may still hold
    tensors, can abort the process (``terminate called without an active exception``, seen once
    in CI on 2026-11-27; pytorch/pytorch#179291 describes it) after everything the test reads is
    done. An exception in ``worker`` still fails its rank as before."""
    worker(rank, world, init_file, result_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, world: int, tmp_path) -> dict:
    """Run ``worker(rank, world, init_file, result_dir)`` on ``world`` processes; each rank's
    results, by rank. Fails the test if the group does not finish within ``TIMEOUT_S``."""
    ctx = mp.start_processes(_run_then_exit, args=(worker, world, str(tmp_path / "rendezvous"), str(tmp_path)),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world}-process group did not finish within {TIMEOUT_S} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    return {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)}


@contextlib.contextmanager
def process_group(rank: int, world: int, init_file: str):
    """This process as ``rank`` of a gloo group (one thread: up to 4 processes share CI's 2 cores)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_result(result_dir: str, rank: int, results: dict) -> None:
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)


def run_cases(cases: dict, rank: int, world: int, init_file: str, result_dir: str) -> None:
    """A worker's body: every case of ``cases`` (``(rank, world) -> {what: error}``) run in the
    group, the errors written for the test (:func:`spawn` returns them)."""
    with process_group(rank, world, init_file):
        results = {name: case(rank, world) for name, case in cases.items()}
    write_result(result_dir, rank, results)


def assert_errors_below(results: dict, cases: dict, atol: float) -> None:
    """Every rank ran every case of ``cases`` and each error it wrote is below ``atol``."""
    for rank, got in results.items():
        assert set(got) == set(cases)
        for name, errors in got.items():
            for what, value in errors.items():
                assert value < atol, f"rank {rank} {name}: {what} = {value}"
