"""A real context-parallel run: 2 and 4 CPU processes over torch.distributed's ``gloo`` backend on
loopback, each holding a slice of the sequence, passing K/V around a ring and combining blocks
with the low-level API's log-sum-exp (``tests/context_parallel.py``). Output and gradients of
every rank must equal single-process ``flash_attn_func`` on the whole sequence: plain ring
(causal and not) and zigzag load balancing (causal), fp32 and bf16, GQA.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import context_parallel
from conftest import backend_name

TIMEOUT_S = 120


def _spawn(world: int, tmp_path) -> dict:
    ctx = mp.start_processes(context_parallel.worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world}-process ring did not finish within {TIMEOUT_S} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    return {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)}


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_over_gloo_equals_single_process(world, tmp_path, monkeypatch):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this PyTorch build")
    if backend_name() not in ("auto", "reference", "interpret"):
        pytest.skip(f"the ring runs on CPU processes; backend {backend_name()} does not run on CPU tensors")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    results = _spawn(world, tmp_path)
    for rank, cases in results.items():
        assert set(cases) == {name for name, *_ in context_parallel.CASES}
        for name, _, _, dtype in context_parallel.CASES:
            errors = cases[name]
            # fp32: each of the `world` block merges may add a rounding of a few ulps of the largest
            # value; bf16: both sides end rounded to bf16, and the ring's blocks were each rounded
            # once before the fp32 merge: half an ulp of the largest value per block
            eps = torch.finfo(dtype).eps
            tol = eps * errors["scale"] * (2 * world if dtype == torch.float32 else world / 2)
            for what in ("out", "dq", "dk", "dv"):
                assert errors[what] <= tol, f"rank {rank} {name}: {what} differs by {errors[what]:.3e} (> {tol:.3e})"
