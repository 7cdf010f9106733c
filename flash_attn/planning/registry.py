"""The kernels by name, without importing Triton.

The launch planner (:mod:`flash_attn.planning.plan`) describes a launch by the kernel's *name*;
only the executors that run Triton (compiled or interpreted) resolve it to the ``@triton.jit``
function with :func:`jit_function`, which imports the kernel module (and so Triton) on first use.
The ``aot`` backend never does: it needs the argument names only, which are read from the kernel's
source (:mod:`flash_attn.planning.signatures`; a test keeps them equal to the ``JITFunction``'s).
So the planner, the specialisation set and the ``aot`` backend import and run without Triton.

Pure Python (no torch, no triton import).
"""

from __future__ import annotations

import importlib

from flash_attn.planning import declarations

__all__ = ["KERNEL_MODULES", "jit_function", "arg_names", "constexpr_names"]

# kernel function name -> module that defines it (a @triton.jit function at module level)
KERNEL_MODULES: dict[str, str] = {name: kernel.module for name, kernel in declarations.KERNELS.items()}


def _module(kernel: str) -> str:
    try:
        return KERNEL_MODULES[kernel]
    except KeyError:
        raise KeyError(f"unknown kernel {kernel!r} (not in flash_attn.planning.declarations)") from None


def jit_function(kernel: str):
    """The ``@triton.jit`` function named ``kernel`` (imports its module, and Triton)."""
    return getattr(importlib.import_module(_module(kernel)), kernel)


def arg_names(kernel: str) -> tuple[str, ...]:
    """The parameter names of ``kernel`` in order (``JITFunction.arg_names``), from its source."""
    return declarations.get(kernel).arg_names


def constexpr_names(kernel: str) -> frozenset:
    """The parameters of ``kernel`` annotated ``tl.constexpr``, from its source."""
    return declarations.get(kernel).constexprs
