"""Upstream's ``flash_attn.utils.library``: ``triton_op``, ``torch.library.triton_op`` with two
differences, both upstream's:

* ``schema`` is honoured (PyTorch's ``triton_op`` accepts it but infers the schema from the type
  annotations anyway), so a function without annotations, or with arguments the inference cannot
  express, can be registered;
* ``allow_decomposition=False`` registers an opaque operator instead: like
  ``torch.library.custom_op``, ``torch.compile`` keeps the call as one node and does not trace
  into the Triton kernels.

What the registration does, as PyTorch's ``triton_op``: the function becomes the operator's
implementation for every device (with ``wrap_triton`` tracing turned off while it runs eagerly:
the kernels get plain tensors), and also its fake (meta) implementation, so ``fn`` must work on
fake tensors (``torch.library.wrap_triton`` launches do); with ``allow_decomposition`` the
operator is replaced by ``fn``'s own operations under functionalization, so ``torch.compile``
(Inductor) sees the kernels themselves.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional, Union

import torch

__all__ = ["triton_op"]


def _without_wrap_triton():
    """``wrap_triton`` launching kernels directly (no higher-order-op dispatch) in eager calls;
    a no-op on PyTorch builds without the switch (a private one)."""
    try:
        from torch._library.triton import set_wrap_triton_enabled  # noqa: PLC0415
    except ImportError:  # pragma: no cover - older PyTorch
        return contextlib.nullcontext()
    return set_wrap_triton_enabled(False)


def _decomposition_disabled() -> bool:
    """Whether ``torch.export`` asked for triton ops to stay whole (a private switch)."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled  # noqa: PLC0415
    except ImportError:  # pragma: no cover - older PyTorch
        return False
    return bool(custom_triton_ops_decomposition_disabled())


def _register_decomposition(op, fn: Callable) -> None:
    """Under functionalization (AOTAutograd, i.e. torch.compile), run ``fn``'s operations instead
    of the operator, unless ``torch.export`` keeps triton ops whole."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode  # noqa: PLC0415

    def decompose(mode, func, types, args, kwargs):
        if _decomposition_disabled():
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return fn(*args, **kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, decompose)


def triton_op(
    name: str,
    fn: Optional[Callable] = None,
    /,
    *,
    mutates_args: Union[str, Iterable[str]],
    schema: Optional[str] = None,
    allow_decomposition: bool = True,
) -> Callable:
    """Register ``fn`` as the operator ``name`` (``"namespace::op_name"``), as a decorator
    (``@triton_op(name, mutates_args=())``) or directly (``triton_op(name, fn, ...)``); returns
    the ``torch.library.CustomOpDef``. ``schema`` (e.g. ``"(Tensor x, float alpha) -> Tensor"``)
    defaults to the one inferred from ``fn``'s annotations."""

    def register(fn: Callable) -> "torch.library.CustomOpDef":
        def eager(*args, **kwargs):
            with _without_wrap_triton():
                return fn(*args, **kwargs)

        op_schema = schema if schema is not None else torch.library.infer_schema(fn, mutates_args=mutates_args)
        op = torch.library.custom_op(name, eager, mutates_args=mutates_args, schema=op_schema)
        op.register_fake(fn)
        if allow_decomposition:
            _register_decomposition(op, fn)
        return op

    return register if fn is None else register(fn)
