"""What the test folders share, imported as ``support.<module>``: pyproject.toml's pytest setting
``pythonpath = ["tests"]`` puts tests/ on ``sys.path`` (processes the tests spawn inherit it; a
child started with a fresh ``python`` gets ``TESTS`` on its path from the test that starts it).

* ``options``: the backend and device this run tests (``--flash-backend``, ``--flash-device``);
* ``inputs``: seeded random tensors, ALiBi slopes, cumulative sequence lengths;
* ``tolerance``: the tolerance rule, ``check_close``;
* ``oracle``: the float64 attention oracle (and its naive low-precision twin);
* ``kvcache_cases``: the KV-cache cases run on the kernels (kernels/ and planning/ tests);
* ``calls``: representative calls of the three operations; ``synthetic_images``: a manifest
  without compiled images; ``gpus``: the two-GPU tests' skip;
* ``gloo_ranks``, ``context_parallel``, ``context_parallel_libraries``: CPU process groups;
* ``packaging_helpers``, ``conda_channel``, ``conda_forge_pinning``: the recipe and the solver.

The pytest options, hooks and fixtures are in tests/conftest.py.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
