"""Running our already-decorated ``@triton.jit`` kernels in Triton's interpreter, on CPU tensors.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so our kernels are
ordinary :class:`~triton.runtime.jit.JITFunction` objects (compiled for the GPU when launched).
:func:`interpreted` gives the *same source* as a
:class:`~triton.runtime.interpreter.InterpretedFunction`, in the same process, without any
environment variable, so the ``interpret`` and ``triton`` backends coexist:

* the kernel's function is re-created with a private copy of its module globals in which every
  ``@triton.jit`` helper (also those reached through module attributes such as
  ``masking.logits_log2``) is itself an interpreted clone; the real modules are never modified;
* the ``triton.language`` helpers that are themselves ``@triton.jit`` functions
  (``tl.philox``, ``tl.zeros``, ``tl.sum``, ...) are swapped for interpreted clones on the
  ``triton.language`` modules only for the duration of a launch (:func:`interpreter_scope`),
  just as Triton's interpreter itself patches ``triton.language`` while a grid runs;
* that patching of ``triton.language`` is done once per launch, not on every helper call as
  Triton's ``InterpretedFunction`` does (about 3x faster for our helper-heavy kernels).

Only public-ish interpreter pieces are used (``InterpretedFunction``, ``interpreter_builder``,
``TensorHandle``, ``_patch_lang``); the tests check that nothing stays patched after a launch.

bfloat16 (measured in the project notes): the interpreter keeps bf16 values as raw uint16 bits and its
``dot`` multiplies those bit patterns. We *patch the interpreter's dot* for the duration of our
launches (converting bf16 operands to fp32 first, which is exact, so the result equals a tensor-core
MMA with fp32 accumulation up to summation order) instead of adding an "upcast" constexpr to the
kernels. Reasons: the kernels and their constexpr signatures stay exactly what the GPU and the
ahead-of-time compiler see (no interpreter-only flag in the variant matrix or in any launcher), and
the patch only changes behaviour for bf16 operands, which the unpatched interpreter gets wrong
anyway. Kernels must still do all elementwise arithmetic in fp32 (they convert after loading),
because bf16 elementwise math is equally wrong in the interpreter; loads, stores and casts are fine.

Tensor-descriptor reductions (``desc.atomic_add``: TMA's ``cp.reduce.async.bulk.tensor``, which
the fused backward may use for dQ) are missing from Triton 3.9's interpreter. Where the interpreter
has none, our launches get a stand-in with the instruction's meaning: the block added element by
element at the descriptor's offsets, what lies outside its shape dropped (the descriptor's own
bounds, as its loads use them). What it cannot show: the hardware's ordering and the staging
through shared memory (a GPU run checks those; ``bench tune`` compares every candidate's output).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from typing import Any

import numpy as np
import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = ["interpreted", "interpreter_scope", "launch"]

_lock = threading.RLock()
_clones: dict[int, Any] = {}  # id(JITFunction) -> InterpretedFunction (JITFunctions live forever)
_module_proxies: dict[str, types.ModuleType] = {}
_depth = 0  # nesting of interpreter_scope (only the outermost one patches)


def _interpreter():
    from triton.runtime import interpreter  # noqa: PLC0415  (imports numpy-heavy machinery lazily)

    return interpreter


_HELPER_CLASS = None


def _helper_class():
    """``InterpretedFunction`` without the per-call re-patching of ``triton.language``.

    Triton's interpreter re-patches ``triton.language`` (``inspect.getmembers`` over the whole
    package) on *every* call of a jit helper; that was ~40% of our interpreter time.
    :func:`interpreter_scope` patches ``triton.language`` and ``triton.language.core`` once per
    launch instead (restored on exit), so no helper needs to do it again.
    """
    global _HELPER_CLASS
    if _HELPER_CLASS is None:
        interp = _interpreter()

        class _Helper(interp.InterpretedFunction):
            def __call__(self, *args, **kwargs):
                fn = self.rewrite()
                try:
                    return fn(*args, **kwargs)
                except Exception as exc:
                    raise interp.InterpreterError(repr(exc)) from exc

        _HELPER_CLASS = _Helper
    return _HELPER_CLASS


def _has_jit_functions(module: types.ModuleType) -> bool:
    return any(isinstance(v, JITFunction) for v in vars(module).values())


def _proxy_module(module: types.ModuleType) -> types.ModuleType:
    """A stand-in for ``module`` whose ``@triton.jit`` attributes are interpreted clones."""
    proxy = _module_proxies.get(module.__name__)
    if proxy is None:
        proxy = types.ModuleType(module.__name__)
        _module_proxies[module.__name__] = proxy
        for name, value in vars(module).items():
            setattr(proxy, name, interpreted(value) if isinstance(value, JITFunction) else value)
    return proxy


def interpreted(kernel: JITFunction):
    """The interpreter's version of ``kernel`` (memoised); launch it like the kernel itself.

    Prefer :func:`launch`, which also opens :func:`interpreter_scope`.
    """
    if not isinstance(kernel, JITFunction):  # already interpreted (TRITON_INTERPRET=1 at import)
        return kernel
    with _lock:
        clone = _clones.get(id(kernel))
        if clone is not None:
            return clone
        fn = kernel.fn
        scope = dict(fn.__globals__)
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__annotations__ = dict(getattr(fn, "__annotations__", {}))
        copy.__module__ = fn.__module__
        copy.__qualname__ = fn.__qualname__
        clone = _helper_class()(copy)
        _clones[id(kernel)] = clone  # before recursing: helpers may refer back (cycles)
        for name, value in list(scope.items()):
            if isinstance(value, JITFunction):
                scope[name] = interpreted(value)
            elif (isinstance(value, types.ModuleType) and not value.__name__.startswith("triton")
                  and _has_jit_functions(value)):
                scope[name] = _proxy_module(value)
        return clone


def _triton_language_modules() -> list[types.ModuleType]:
    """``triton.language`` and its submodules (``standard``, ``random``, ...).

    All of them are patched, not only ``tl``: the interpreter recognises ``tl.sum``/``tl.max``
    by the identity of ``tl.standard``'s combine functions and then uses numpy reductions instead
    of an element-by-element Python loop.
    """
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "triton.language" or name.startswith("triton.language."))]


def _preload_lazy_imports() -> None:
    """Import what Triton imports lazily during a launch *before* we patch ``triton.language``.

    (``mangle_type`` imports ``triton.experimental.gluon``, which asserts that the
    ``triton.language`` helpers it wraps are unpatched ``JITFunction``s.)
    """
    try:
        import triton.experimental.gluon  # noqa: F401, PLC0415
    except ImportError:  # older / newer Triton without gluon: nothing to preload
        pass


def _bf16_as_fp32(handle):
    """An interpreter tensor handle with bf16 bits re-read as exact fp32 values."""
    interp = _interpreter()
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    data = np.asarray(handle.data)
    if data.dtype != np.uint16:  # a future interpreter that stores real floats: leave it alone
        return handle
    return interp.TensorHandle((data.astype(np.uint32) << 16).view(np.float32), tl.float32)


def _descriptor_reduce_stand_in(builder):
    """``create_descriptor_reduce`` for an interpreter builder that lacks it: each of the reductions
    Triton's language has (``desc.atomic_add/min/max/and/or/xor``) as the interpreter's own
    element-wise atomic at the descriptor's in-bounds pointers."""
    ir = _interpreter()._ir
    kinds, ops = ir.DESCRIPTOR_REDUCE_KIND, ir.ATOMIC_OP
    # (signed or float, unsigned) atomic of each reduction; the float add has its own
    by_kind = {kinds.ADD: (ops.ADD, ops.ADD), kinds.MIN: (ops.MIN, ops.UMIN), kinds.MAX: (ops.MAX, ops.UMAX),
               kinds.AND: (ops.AND, ops.AND), kinds.OR: (ops.OR, ops.OR), kinds.XOR: (ops.XOR, ops.XOR)}

    def create_descriptor_reduce(kind, desc, value, indices):
        ptrs, mask = desc.materialize_pointers(indices)
        scalar = value.dtype.scalar
        op = ops.FADD if kind == kinds.ADD and scalar.is_floating() else by_kind[kind][scalar.is_int_unsigned()]
        return builder.create_atomic_rmw(op, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED, ir.MEM_SYNC_SCOPE.GPU)

    return create_descriptor_reduce


@contextlib.contextmanager
def interpreter_scope():
    """While open: ``triton.language``'s jit helpers are interpreted and bf16 ``dot`` is exact.

    Not thread-safe with a concurrent GPU compilation in the same process (it swaps attributes of
    ``triton.language``, as Triton's own interpreter does while a grid runs); a lock serialises
    our own launches. Everything is restored on exit, also after an error.
    """
    global _depth
    interp = _interpreter()
    builder = interp.interpreter_builder
    with _lock:
        if _depth:
            yield
            return
        _preload_lazy_imports()
        saved = []
        lang_scope = None
        original_dot = builder.create_dot

        def create_dot(a, b, d, *args, **kwargs):
            return original_dot(_bf16_as_fp32(a), _bf16_as_fp32(b), d, *args, **kwargs)

        _depth += 1
        try:
            for module in _triton_language_modules():
                for name, value in list(vars(module).items()):
                    if isinstance(value, JITFunction):
                        saved.append((module, name, value))
                        setattr(module, name, interpreted(value))
            # what InterpretedFunction.__call__ would redo on every helper call, done once
            lang_scope = interp._patch_lang(types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))
            builder.create_dot = create_dot
            if not hasattr(builder, "create_descriptor_reduce"):
                builder.create_descriptor_reduce = _descriptor_reduce_stand_in(builder)
            yield
        finally:
            _depth -= 1
            for name in ("create_dot", "create_descriptor_reduce"):
                if name in vars(builder):
                    delattr(builder, name)  # the instance attribute; the class's shows again (or none)
            if lang_scope is not None:
                lang_scope.restore()
            for module, name, value in reversed(saved):
                setattr(module, name, value)


def launch(kernel: JITFunction, grid, *args, **kwargs) -> None:
    """Run ``kernel[grid](*args, **kwargs)`` in the interpreter (CPU tensors).

    Launch options meant for the GPU compiler (``num_warps``, ``num_stages``) are accepted and
    ignored.
    """
    with interpreter_scope():
        interpreted(kernel)[grid](*args, **kwargs)
