"""The buffers the op library's ``aot_run`` makes for a call, made in Python: for the tests' stand-ins
of ``flash_attn.backends.aot._launch`` (which must return them as the library does) where no op
library call is made. Stands in for csrc/aot_ops.cpp's ``make_buffer``: the shapes and dtypes the
plan gives (row counts from the call), zero-filled; it cannot show the library's own allocation
(tests/aot/test_aot_library.py checks that)."""

import torch


def made_buffers(launches, tensors: dict) -> list:
    return [torch.zeros([tensors[n] if not isinstance(n, int) else n for n in b.shape], dtype=b.dtype)
            for b in launches.buffers]
