"""Real context-parallel libraries on this package (``tests/support/context_parallel_libraries.py``): 2 and
4 CPU processes over ``gloo``, each calling ring-flash-attention's ring, zigzag, stripe and llama3
(varlen) functions, or yunchang's Ulysses + ring attention (USP), on its slice of the sequence.
The libraries call our low-level API exactly as they call upstream's; every rank's output and
gradients must match the float64 oracle on the whole sequence.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from support import context_parallel_libraries as libraries, gloo_ranks


def _installed(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (it is in the test extra)")


def _check(results: dict, dtypes: dict, world: int) -> None:
    for rank, cases in results.items():
        assert set(cases) == set(dtypes)
        for name, dtype in dtypes.items():
            case = cases[name]
            assert case["dtypes"] == [str(dtype)] * 4, f"rank {rank} {name}: output/gradient dtypes {case['dtypes']}"
            # fp32: the kernels' own accumulation, a few ulps of the largest value (measured up to
            # 3.7); half precision: each block's result and the final one rounded once (half an ulp
            # of the largest value each, at most world + 1 of them; measured up to 0.7 ulp)
            ulps = 16 if dtype == torch.float32 else (world + 1) / 2
            tol = ulps * torch.finfo(dtype).eps * case["scale"]
            for what, error in case["errors"].items():
                assert error <= tol, f"rank {rank} {name}: {what} differs from the oracle by {error:.3e} (> {tol:.3e})"


@_installed("ring_flash_attn")
@pytest.mark.parametrize("world", [2, 4])
def test_ring_flash_attn_library_matches_the_oracle(world, tmp_path, monkeypatch):
    gloo_ranks.skip_unless_cpu_ranks_can_run(monkeypatch)
    results = gloo_ranks.spawn(libraries.ring_flash_attn_worker, world, tmp_path)
    _check(results, {name: case[-1] for name, case in libraries.CASES.items()}, world)


@_installed("yunchang")
@pytest.mark.parametrize("world", [2, 4])
def test_yunchang_usp_matches_the_oracle(world, tmp_path, monkeypatch):
    gloo_ranks.skip_unless_cpu_ranks_can_run(monkeypatch)
    results = gloo_ranks.spawn(libraries.yunchang_worker, world, tmp_path)
    _check(results, dict.fromkeys(libraries.USP_CASES[world], libraries.USP_DTYPE), world)
