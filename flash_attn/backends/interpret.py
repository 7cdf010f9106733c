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

from flash_attn.backends._kernel_launchers import kernel_backend

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


forward, backward, forward_kvcache = kernel_backend(_NAME, interpret=True)
