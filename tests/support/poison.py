"""Uninitialised memory made visible: :func:`poisoned_empty` makes ``torch.empty`` and its kin hand
back tensors filled with NaN (floating point) or the dtype's largest value (integers), so that a
result that reads an element nobody wrote is wrong on every run instead of on some.

What it stands in for: the allocator's reused blocks, whose old contents are whatever an earlier
tensor left there (on a GPU, and on the CPU once memory is recycled). It cannot show a read of
memory outside a tensor, nor an empty tensor made in C++ (PyTorch's own ops), which it does not
reach; the code of this package allocates from Python. Nor a graph torch.compile traces (its
allocations are the compiled graph's).
"""

from __future__ import annotations

import contextlib

import pytest
import torch


def _poison(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).max)
    return tensor


def _poisoning(allocate):
    def allocate_poisoned(*args, **kwargs):
        if torch.compiler.is_compiling():  # what torch.compile traces: the graph's own allocation
            return allocate(*args, **kwargs)
        return _poison(allocate(*args, **kwargs))

    return allocate_poisoned


@contextlib.contextmanager
def poisoned_empty():
    """``torch.empty``, ``empty_like``, ``empty_strided`` and ``Tensor.new_empty`` return poisoned
    tensors inside the block."""
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"),
                            (torch.Tensor, "new_empty")):
            patch.setattr(owner, name, _poisoning(getattr(owner, name)))
        yield
