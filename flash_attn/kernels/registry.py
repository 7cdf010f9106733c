"""The kernels by name, without importing Triton.

The launch planner (:mod:`flash_attn.kernels.plan`) describes a launch by the kernel's *name*;
only the executors that run Triton (compiled or interpreted) resolve it to the ``@triton.jit``
function with :func:`jit_function`, which imports the kernel module (and so Triton) on first use.
The ``aot`` backend never does: it needs the argument names only, which :func:`arg_names` reads
from the kernel's source with :mod:`ast`. So the planner, the specialisation set and the ``aot``
backend import and run without Triton installed.

Pure Python (no torch, no triton import).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import threading

from flash_attn.kernels import declarations

__all__ = ["KERNEL_MODULES", "cdiv", "jit_function", "arg_names", "constexpr_names"]

# kernel function name -> module that defines it (a @triton.jit function at module level)
KERNEL_MODULES: dict[str, str] = {name: kernel.module for name, kernel in declarations.KERNELS.items()}

_lock = threading.Lock()
_signatures: dict[str, tuple[tuple[str, ...], frozenset]] = {}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (``triton.cdiv`` without Triton)."""
    return -(-a // b)


def _module(kernel: str) -> str:
    try:
        return KERNEL_MODULES[kernel]
    except KeyError:
        raise KeyError(f"unknown kernel {kernel!r} (not in flash_attn.kernels.declarations)") from None


def jit_function(kernel: str):
    """The ``@triton.jit`` function named ``kernel`` (imports its module, and Triton)."""
    return getattr(importlib.import_module(_module(kernel)), kernel)


def _is_constexpr(annotation) -> bool:
    return annotation is not None and ast.unparse(annotation).split(".")[-1] == "constexpr"


def _signature_from_source(kernel: str):
    module = _module(kernel)
    spec = importlib.util.find_spec(module)
    source = spec.loader.get_source(module) if spec is not None and spec.loader is not None else None
    if source is None:
        return None
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == kernel:
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            return tuple(a.arg for a in args), frozenset(a.arg for a in args if _is_constexpr(a.annotation))
    raise LookupError(f"{module} defines no function {kernel}")


def _signature(kernel: str) -> tuple[tuple[str, ...], frozenset]:
    with _lock:
        found = _signatures.get(kernel)
    if found is None:
        found = _signature_from_source(kernel)
        if found is None:  # no source shipped: ask the imported kernel
            fn = jit_function(kernel)
            found = tuple(fn.arg_names), frozenset(p.name for p in fn.params if p.is_constexpr)
        with _lock:
            _signatures[kernel] = found
    return found


def arg_names(kernel: str) -> tuple[str, ...]:
    """The parameter names of ``kernel`` in order (``JITFunction.arg_names``), read from its
    source without importing it; from the imported kernel only when the source is not shipped."""
    return _signature(kernel)[0]


def constexpr_names(kernel: str) -> frozenset:
    """The parameters of ``kernel`` annotated ``tl.constexpr``."""
    return _signature(kernel)[1]
