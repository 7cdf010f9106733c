"""The op library's ``aot_run`` seen from Python, for tests: the plan layout csrc/aot_ops.cpp
documents, read independently of both implementations (:func:`read_plan`, :func:`launched_as`),
and the buffers the library makes for a call, made in Python (:func:`made_buffers`: for the tests'
stand-ins of ``flash_attn.backends.aot._launch``, which must return them as the library does, where
no op library call is made). ``made_buffers`` stands in for csrc/aot_ops.cpp's ``make_buffer``: the
shapes and dtypes the plan gives (row counts from the call), zero-filled, and the library's refusal
of a buffer no launch takes (its dtype is that of a kernel parameter); it cannot show the library's
own allocation (tests/aot/test_aot_library.py checks that)."""

import struct

import torch


def read_plan(plan: torch.Tensor, with_buffers: bool = False):
    """The launches of ``plan`` (a dict each: kernel, grid, tensors, ints, rows as (int index, row
    index) pairs, floats), and with ``with_buffers`` the buffers first."""
    values, buffers, launches = iter(plan.tolist()), [], []
    for _ in range(next(values)):
        buffer = {"flags": next(values)}  # bit 0: zero-filled; bit 1: part of the call's scratch
        buffer["sizes"] = [next(values) for _ in range(next(values))]
        buffer["columns"] = next(values)
        buffers.append(buffer)
    for _ in range(next(values)):
        launch = {"kernel": next(values), "grid": [next(values) for _ in range(3)]}
        launch["tensors"] = [next(values) for _ in range(next(values))]
        launch["ints"] = [next(values) for _ in range(next(values))]
        launch["rows"] = [(next(values), next(values)) for _ in range(next(values))]
        launch["floats"] = [struct.unpack("<d", struct.pack("<q", next(values)))[0] for _ in range(next(values))]
        launches.append(launch)
    assert next(values, None) is None
    return (buffers, launches) if with_buffers else launches


def launched_as(plan: torch.Tensor, rows: tuple):
    """``(buffers, launches)`` of ``plan`` as the library runs it for a call passing ``rows``: each
    row count in the ints it names and in the buffer sizes ``-(r + 1)``, no row pairs left."""
    buffers, launches = read_plan(plan, with_buffers=True)
    for b in buffers:
        b["sizes"] = [rows[-n - 1] if n < 0 else n for n in b["sizes"]]
    for launch in launches:
        for at, r in launch.pop("rows"):
            launch["ints"][at] = rows[r]
    return buffers, launches


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
