"""The kernels by name, without importing Triton.

The launchers (:mod:`flash_attn.kernels.launch`, :mod:`flash_attn.kernels.decode_launch`) describe
a launch by the kernel's *name*; only the executors that run Triton (compiled or interpreted)
resolve it to the ``@triton.jit`` function with :func:`jit_function`, which imports the kernel
module (and so Triton) on first use. The ``aot`` backend never does: it needs the argument names
only, which :func:`arg_names` reads from the kernel's source with :mod:`ast`. So the launchers,
the specialisation set and the ``aot`` backend import and run without Triton installed.

Pure Python (no torch, no triton import).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import threading

__all__ = ["KERNEL_MODULES", "cdiv", "jit_function", "arg_names"]

# kernel function name -> module that defines it (a @triton.jit function at module level)
KERNEL_MODULES: dict[str, str] = {
    "attn_fwd_kernel": "flash_attn.kernels.forward",
    "attn_probs_kernel": "flash_attn.kernels.forward",
    "attn_bwd_preprocess_kernel": "flash_attn.kernels.backward",
    "attn_bwd_dkdv_kernel": "flash_attn.kernels.backward",
    "attn_bwd_dq_kernel": "flash_attn.kernels.backward",
    "split_kv_kernel": "flash_attn.kernels.decode",
    "combine_splits_kernel": "flash_attn.kernels.decode",
    "append_kv_kernel": "flash_attn.kernels.kvcache_append",
    "rotary_q_kernel": "flash_attn.kernels.kvcache_append",
}

_lock = threading.Lock()
_arg_names: dict[str, tuple[str, ...]] = {}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (``triton.cdiv`` without Triton)."""
    return -(-a // b)


def _module(kernel: str) -> str:
    try:
        return KERNEL_MODULES[kernel]
    except KeyError:
        raise KeyError(f"unknown kernel {kernel!r} (not in flash_attn.kernels.registry.KERNEL_MODULES)") from None


def jit_function(kernel: str):
    """The ``@triton.jit`` function named ``kernel`` (imports its module, and Triton)."""
    return getattr(importlib.import_module(_module(kernel)), kernel)


def _names_from_source(kernel: str):
    module = _module(kernel)
    spec = importlib.util.find_spec(module)
    source = spec.loader.get_source(module) if spec is not None and spec.loader is not None else None
    if source is None:
        return None
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == kernel:
            a = node.args
            return tuple(arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs))
    raise LookupError(f"{module} defines no function {kernel}")


def arg_names(kernel: str) -> tuple[str, ...]:
    """The parameter names of ``kernel`` in order (``JITFunction.arg_names``), read from its
    source without importing it; from the imported kernel only when the source is not shipped."""
    with _lock:
        names = _arg_names.get(kernel)
    if names is None:
        names = _names_from_source(kernel)
        if names is None:
            names = tuple(jit_function(kernel).arg_names)
        with _lock:
            _arg_names[kernel] = names
    return names
