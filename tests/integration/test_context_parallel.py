"""A real context-parallel run: 2 and 4 CPU processes over torch.distributed's ``gloo`` backend on
loopback, each holding a slice of the sequence, passing K/V around a ring and combining blocks
with the low-level API's log-sum-exp (``tests/support/context_parallel.py``). Output and gradients of
every rank must equal single-process ``flash_attn_func`` on the whole sequence: plain ring
(causal and not) and zigzag load balancing (causal), fp32 and bf16, GQA.
"""

from __future__ import annotations

import pytest
import torch

from support import context_parallel, gloo_ranks


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_over_gloo_equals_single_process(world, tmp_path, monkeypatch):
    gloo_ranks.skip_unless_cpu_ranks_can_run(monkeypatch)
    results = gloo_ranks.spawn(context_parallel.worker, world, tmp_path)
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
