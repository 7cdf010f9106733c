"""The ``interpret`` backend: our Triton kernels run by Triton's interpreter on CPU tensors.

For development and tests: it executes exactly the kernel source that the GPU backends compile,
one program after another in numpy (slow; small shapes only), with the launches the planner makes
for the interpreter (small tiles, so that tests cross many tiles). It is never chosen by ``auto``;
select it with ``FLASH_ATTN_BACKEND=interpret``. How the interpreter is driven without
``TRITON_INTERPRET`` (and the bf16 workaround) is in :mod:`flash_attn.backends._interpreter`.
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_attn.backends._execute import KernelBackend, launch_kwargs
from flash_attn.planning import decode_configs, registry
from flash_attn.planning.plan import Target

__all__ = ["BACKEND", "unavailable_reason", "forward", "backward", "forward_kvcache", "TARGET", "run_launch"]

_NAME = "interpret"
MIN_TRITON = (3, 7)
TARGET = Target("interpret", decode_configs.INTERPRET_NUM_SMS)


def unavailable_reason(device: torch.device) -> Optional[str]:
    if torch.device(device).type != "cpu":
        return "it runs Triton's interpreter on CPU tensors only"
    try:
        import numpy  # noqa: F401, PLC0415
        import triton  # noqa: PLC0415
        from triton.runtime import interpreter  # noqa: F401, PLC0415
    except ImportError as exc:
        return f"Triton's interpreter cannot be imported ({exc})"
    version = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
    if version < MIN_TRITON:
        # measured: 3.6's interpreter fails the KV-cache kernels (a TypeError in its load), 3.7 runs them
        return (f"Triton {triton.__version__}'s interpreter cannot run these kernels "
                f"(needs {MIN_TRITON[0]}.{MIN_TRITON[1]} or newer; its GPU compiler is fine)")
    return None


def run_launch(launch, tensors: dict, device=None) -> None:
    """One planned launch in the interpreter (any target's plan: the interpreter runs every tile size)."""
    if 0 in launch.grid:
        return
    from flash_attn.backends import _interpreter as interpreter  # noqa: PLC0415  (imports Triton)

    interpreter.launch(registry.jit_function(launch.kernel), launch.grid, **launch_kwargs(launch, tensors))


_backend = KernelBackend(_NAME, lambda device: TARGET, run_launch)
BACKEND = _backend.contract(unavailable_reason)
forward, backward, forward_kvcache = _backend.forward, _backend.backward, _backend.forward_kvcache
