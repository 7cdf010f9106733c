"""Upstream's ``flash_attn.ops.triton``: ops whose CUDA path is a Triton kernel (JIT-compiled by
Triton on first use) and whose path on other devices is plain PyTorch."""

import functools
import warnings

import torch

from flash_attn import validation


@functools.cache
def triton_modules():
    """``(triton, triton.language)``, or ``(None, None)`` where Triton cannot be imported: not
    installed, or an import that fails in another way (a broken or mismatched install raises
    whatever it raises), which is warned about once. Either way every op here then runs its
    PyTorch path, CUDA too, and importing the ops never fails because of Triton."""
    try:
        import triton  # noqa: PLC0415
        import triton.language as tl  # noqa: PLC0415
    except ImportError:
        return None, None
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"flash_attn: Triton is installed but importing it fails ({type(exc).__name__}: {exc}); "
                      f"flash_attn.ops.triton runs its PyTorch paths", UserWarning, stacklevel=2)
        return None, None
    return triton, tl


def triton_available() -> bool:
    """Whether Triton can be imported (:func:`triton_modules`)."""
    return triton_modules()[0] is not None


def cuda_launch(kernel, grid, **kwargs) -> None:
    """Launch on the GPU that holds the tensors (Triton launches on the current device). Where
    PyTorch traces or intercepts the call (:func:`flash_attn.validation.traced`, or a tensor
    subclass among the arguments) through ``wrap_triton``, which lets it see the launch; in a
    plain eager call the kernel itself (``wrap_triton``'s eager dispatch walks the arguments'
    pytree: most of a rotary call's 216 us of host time on an H200, benchmarks/README.md)."""
    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    plain = all(type(t) is torch.Tensor for t in tensors) and not validation.traced()
    launch = kernel if plain else torch.library.wrap_triton(kernel)
    device = tensors[0].device
    if device.index is None or device.index == torch.cuda.current_device():
        launch[grid](**kwargs)
        return
    with torch.cuda.device(device):
        launch[grid](**kwargs)
