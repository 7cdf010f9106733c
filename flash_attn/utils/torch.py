"""Upstream's ``flash_attn.utils.torch``: ``custom_fwd`` / ``custom_bwd`` for autograd functions
under CUDA autocast, whichever PyTorch provides them.

PyTorch 2.4 moved the decorators from ``torch.cuda.amp`` (deprecated since) to ``torch.amp``, where
they take a required keyword ``device_type``. :func:`custom_amp_decorator` adapts the new ones to
the old call forms: ``@custom_fwd``, ``@custom_fwd(cast_inputs=torch.float16)`` and ``@custom_bwd``
all keep working, for CUDA autocast, on every PyTorch.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["custom_amp_decorator", "custom_fwd", "custom_bwd"]


def custom_amp_decorator(dec: Callable, cuda_amp_deprecated: bool) -> Callable:
    """``dec`` with ``device_type="cuda"`` supplied when ``cuda_amp_deprecated`` (``dec`` is then
    ``torch.amp``'s, which requires it); otherwise ``dec`` called unchanged (``torch.cuda.amp``'s)."""

    def decorator(*args, **kwargs):
        if cuda_amp_deprecated:
            kwargs["device_type"] = "cuda"
        return dec(*args, **kwargs)

    return decorator


# Whether torch.amp has the decorators, i.e. torch.cuda.amp's are the deprecated ones.
deprecated = hasattr(torch.amp, "custom_fwd")
if deprecated:
    custom_fwd = custom_amp_decorator(torch.amp.custom_fwd, True)
    custom_bwd = custom_amp_decorator(torch.amp.custom_bwd, True)
else:  # pragma: no cover - PyTorch < 2.4
    custom_fwd = custom_amp_decorator(torch.cuda.amp.custom_fwd, False)
    custom_bwd = custom_amp_decorator(torch.cuda.amp.custom_bwd, False)
