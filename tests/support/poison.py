"""Uninitialised memory made visible: inside :func:`poisoned_empty`, ``torch.empty`` and its kin
(``empty_like``, ``empty_strided``, ``new_empty``, a resize) fill what they hand back with NaN
(floating point) or the dtype's largest value (integers), so that a result that reads an element
nobody wrote is wrong on every run instead of on some.

This is PyTorch's own switch (``torch.utils.deterministic.fill_uninitialized_memory``, which acts
under ``torch.use_deterministic_algorithms``), so it reaches allocations made in C++ and inside a
graph torch.compile traces. ``warn_only``: an op without a deterministic implementation (CUDA
ones, mostly) warns instead of raising; what the tests compute is unchanged.

What it stands in for: the allocator's reused blocks, whose old contents are whatever an earlier
tensor left there (on a GPU, and on the CPU once memory is recycled). It cannot show a read of
memory outside a tensor.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def poisoned_empty():
    """Fresh tensors poisoned inside the block (the previous settings restored after it)."""
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.utils.deterministic.fill_uninitialized_memory = was[2]
