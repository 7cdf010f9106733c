"""The limits of the GPU kernels and of a launch, in one place.

Validation, the planner, the backends and the doctor all read these; nothing else states them:
the op library's C++ checks (csrc/) take INT32_MAX and GRID_LIMITS from a header generated from this
file at build time (csrc/cmake/limits_header.py; tests/aot/test_aot_library.py keeps them equal).
Pure Python (the doctor and the build read it without importing torch).
"""

from __future__ import annotations

# Element types the Triton kernels compute in: torch's name -> the name in the kernels' signatures
# and image keys (fp32 inputs run on the reference backend).
KERNEL_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}
# The kernels' head-dimension buckets: the BLOCK_D of their specialisations, a head dim running on
# the smallest bucket that holds it (the launch-config tables have one entry per bucket).
HEADDIM_BUCKETS = (32, 64, 128, 256, 512)
# Largest head dimension of any backend (validation) and of the kernels: the largest bucket.
MAX_HEADDIM = HEADDIM_BUCKETS[-1]
# The ahead-of-time kernels declare head_dim a multiple of this (vectorised masked loads).
AOT_HEADDIM_MULTIPLE = 8
# Oldest GPU the kernels run on (mma.sync, cp.async, bf16): Ampere.
MIN_CAPABILITY = (8, 0)

# What the kernels assume of every tensor they address (the planner copies inputs that differ):
# strides but the last (which is 1) multiples of 8 elements, data 16-byte aligned.
STRIDE_MULTIPLE = 8
POINTER_ALIGNMENT = 16

# Sizes, strides and offsets are int32 kernel arguments.
INT32_MAX = 2**31 - 1
# CUDA's grid limits (programs per axis).
GRID_LIMITS = (2**31 - 1, 65535, 65535)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (``triton.cdiv`` without Triton): blocks of ``b``
    that cover ``a``."""
    return -(-a // b)
