"""The ``interpret`` backend: our Triton kernels run by Triton's interpreter on CPU tensors.

For development and tests: it executes exactly the kernel source that the GPU backends compile,
one program after another in numpy (slow; small shapes only). It is never chosen by ``auto``;
select it with ``FLASH_ATTN_BACKEND=interpret``. Calls the kernels do not cover (fp32 inputs, the
backward of paged K/V) run on the reference backend after a one-time warning; see
:func:`flash_attn.kernels.launch.supported`. How the interpreter is driven without
``TRITON_INTERPRET`` (and the bf16 workaround) is in :mod:`flash_attn.kernels.interpreter`.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["unavailable_reason", "forward", "backward", "forward_kvcache"]

_NAME = "interpret"


def unavailable_reason(device: torch.device) -> Optional[str]:
    if torch.device(device).type != "cpu":
        return "it runs Triton's interpreter on CPU tensors only"
    try:
        import numpy  # noqa: F401, PLC0415
        import triton  # noqa: F401, PLC0415
        from triton.runtime import interpreter  # noqa: F401, PLC0415
    except ImportError as exc:
        return f"Triton's interpreter cannot be imported ({exc})"
    return None


def _launch():
    from flash_attn.kernels import launch  # noqa: PLC0415

    return launch


def forward(q, k, v, params, *, varlen=None, alibi_slopes=None, return_softmax=False):
    return _launch().contract_forward(_NAME, True, q, k, v, params, varlen=varlen, alibi_slopes=alibi_slopes,
                                      return_softmax=return_softmax)


def backward(dout, q, k, v, out, lse, params, *, varlen=None, alibi_slopes=None, deterministic=False):
    return _launch().contract_backward(_NAME, True, dout, q, k, v, out, lse, params, varlen=varlen,
                                       alibi_slopes=alibi_slopes, deterministic=deterministic)


def forward_kvcache(q, params, cache, *, alibi_slopes=None):
    return _launch().contract_forward_kvcache(_NAME, True, q, params, cache, alibi_slopes=alibi_slopes)
