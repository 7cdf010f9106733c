"""How ``flash_attn.ops.triton`` launches its kernels (``cuda_launch``, the rotary, linear and
cross-entropy ops' CUDA path): in a plain eager call the Triton kernel itself, whose host cost is
Triton's launcher (``torch.library.wrap_triton``'s eager dispatch walks the arguments' pytree: most
of a rotary call's 216 us of host time on an H200's host); where PyTorch traces or intercepts the
call, through ``wrap_triton``, which lets it see the launch.

Stand-ins: a kernel that records its launches, ``wrap_triton`` recording what it wraps, CPU tensors
(no device index: the current CUDA device is not asked). They cannot show a GPU launch (the fused-ops
step of ``.ci/gpu-check`` runs the ops on a GPU) nor torch.compile tracing the launch
(``tests/ports/test_cross_entropy.py`` and ``tests/api/test_rotary.py`` compile the ops)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from flash_attn.ops import triton as ops_triton


class _Kernel:
    """A Triton kernel as ``cuda_launch`` uses it: ``kernel[grid](**kwargs)``."""

    def __init__(self, launches: list, how: str):
        self.launches, self.how = launches, how

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append((self.how, grid, sorted(kwargs)))


@pytest.fixture
def launches(monkeypatch) -> list:
    made: list = []
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: _Kernel(made, "wrap_triton"))
    return made


class _Sub(torch.Tensor):
    pass


class _PassDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_plain_eager_launch_is_the_kernels_own(launches):
    x = torch.zeros(4)
    ops_triton.cuda_launch(_Kernel(launches, "kernel"), (1, 2, 3), x_ptr=x, n=4, none_ptr=None)
    assert launches == [("kernel", (1, 2, 3), ["n", "none_ptr", "x_ptr"])]


@pytest.mark.parametrize("why", ["dispatch mode", "function mode", "tensor subclass", "functorch transform"])
def test_a_traced_or_intercepted_launch_goes_through_wrap_triton(launches, why):
    x = torch.zeros(4)
    kernel = _Kernel(launches, "kernel")
    if why == "dispatch mode":
        with _PassDispatch():
            ops_triton.cuda_launch(kernel, (1,), x_ptr=x)
    elif why == "function mode":
        with _PassFunction():
            ops_triton.cuda_launch(kernel, (1,), x_ptr=x)
    elif why == "tensor subclass":
        ops_triton.cuda_launch(kernel, (1,), x_ptr=x, y_ptr=x.as_subclass(_Sub))
    else:
        torch.func.vmap(lambda row: ops_triton.cuda_launch(kernel, (1,), x_ptr=row) or row)(torch.zeros(2, 4))
    assert [how for how, _, _ in launches] == ["wrap_triton"]
