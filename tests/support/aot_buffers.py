"""The buffers the op library's ``aot_run`` makes for a call, made in Python: for the tests' stand-ins
of ``flash_attn.backends.aot._launch`` (which must return them as the library does) where no op
library call is made. Stands in for csrc/aot_ops.cpp's ``make_buffer``: the shapes and dtypes the
plan gives (row counts from the call), zero-filled, and the library's refusal of a buffer no launch
takes (its dtype is that of a kernel parameter); it cannot show the library's own allocation
(tests/aot/test_aot_library.py checks that)."""

import torch


def by_slot(launches, passed: tuple, rows: tuple) -> dict:
    """A call's tensors by slot, and its row counts by :class:`~flash_attn.planning.plan.Rows`, from
    ``_launch``'s arguments."""
    return {**dict(zip(launches.names, passed)), **dict(zip(launches.rows, rows))}


def made_buffers(launches, passed: tuple, rows: tuple) -> list:
    taken = {name for p in launches.packed for name in p.slots}
    for n, b in enumerate(launches.buffers):  # the library's dtype is that of a kernel parameter
        if b.slot not in taken:
            raise RuntimeError(f"flash_attn::aot_run: buffer {n} of the plan is passed to no kernel parameter")
    counts = dict(zip(launches.rows, rows))
    return [torch.zeros([n if isinstance(n, int) else counts[n] for n in b.shape], dtype=b.dtype)
            for b in launches.buffers]
