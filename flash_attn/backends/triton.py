"""The ``triton`` backend: our Triton kernels compiled just in time for the GPU at hand.

Used by ``auto`` on CUDA devices when the ahead-of-time kernels (``aot``) are not installed or do
not serve a call, on AMD GPUs under ROCm PyTorch (where nothing ships ahead of time), or
explicitly with ``FLASH_ATTN_BACKEND=triton``. The first call of each kernel variant compiles it
(seconds); launch configurations come from :mod:`flash_attn.planning.configs` for the device's
family (:mod:`flash_attn.backends.devices`: NVIDIA by compute capability, AMD by ``gcnArchName``),
with the compiler options of that family (:func:`flash_attn.planning.configs.compiler_options`:
AMD's ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``). The launches are those of
:mod:`flash_attn.planning.plan`; calls it refuses (fp32 inputs, the backward of paged K/V) run
elsewhere (:mod:`flash_attn.dispatch`).

The first run of each plan is where Triton itself can fail: it builds its launcher (``driver.c``,
with the machine's C compiler), writes its cache (``~/.triton`` or ``TRITON_CACHE_DIR``) and
compiles the kernels. Such a failure is no fault of the call: it is raised as
:class:`BackendFailed` (the cause and the fix), and the dispatcher runs the call on the next
backend. Nothing user-visible was written by then (a plan writes into its own fresh buffers; the
KV cache append writes the same rows the next backend writes again).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import re
import subprocess
from typing import Optional

import torch

from flash_attn.backends import devices
from flash_attn.backends._execute import KernelBackend, capturing, execute, launch_kwargs, ready
from flash_attn.backends.contract import cuda_tensor_reason
from flash_attn.planning import configs, plan as P, registry
from flash_attn.planning.plan import Target

__all__ = ["BACKEND", "unavailable_reason", "forward", "backward", "forward_kvcache", "BackendFailed", "diagnose"]

_NAME = "triton"


def unavailable_reason(device: torch.device) -> Optional[str]:
    device = torch.device(device)
    reason = cuda_tensor_reason(device, "compiles GPU kernels")
    if reason is not None:
        return reason
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return devices.family_reason(device)


@functools.lru_cache(maxsize=None)
def _device_target(index: int) -> Target:
    device = torch.device("cuda", index)
    return Target(devices.family(device), torch.cuda.get_device_properties(device).multi_processor_count)


def _target(device) -> Target:
    device = torch.device(device)
    return _device_target(device.index if device.index is not None else torch.cuda.current_device())


def _scratch_memory(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global scratch (where kernels keep the tensor descriptors they make), from PyTorch's
    caching allocator on the current device (its blocks are 512-byte aligned)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """A kernel that makes tensor descriptors (the fused backward on Hopper) needs Triton to have
    an allocator; set ours unless the program set one (Triton keeps it per thread/context)."""
    import triton  # noqa: PLC0415
    from triton.runtime import _allocation  # noqa: PLC0415  (no public way to read it)

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch_memory)


def _run_launch(launch, tensors: dict, device) -> None:
    if 0 in launch.grid:
        return
    _ensure_scratch_allocator()
    options = configs.compiler_options(launch.config, _target(device).family)
    with torch.cuda.device(device):
        registry.jit_function(launch.kernel)[launch.grid](**launch_kwargs(launch, tensors), **options)


# --- failures of Triton itself, on a plan's first run ------------------------------------------


class BackendFailed(RuntimeError):
    """Triton failed on the first run of a plan (not the call): the dispatcher runs the call on
    the next backend. ``scope``: ``"backend"`` (the machine: no C compiler, an unwritable cache;
    every later call goes elsewhere too), ``"plan"`` (this call shape's kernels do not compile;
    never tried again) or ``"call"`` (may pass: tried again on the next call)."""

    def __init__(self, cause: str, fix: str, scope: str):
        super().__init__(f"{cause}; fix: {fix}")
        self.cause, self.fix, self.scope = cause, fix, scope


def _summary(exc: BaseException) -> str:
    """The line of an error that says what went wrong: its first, or the last of Triton's compile
    errors (which start with the source position and the offending code)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    line = lines[-1] if re.match(r"at \d+:\d+:", lines[0]) else lines[0]
    line = re.sub(r"\s+", " ", line.strip())
    return line if len(line) <= 300 else line[:297] + "..."


def _in_triton_build(exc: BaseException) -> bool:
    """Raised while Triton builds its C launcher (``triton/runtime/build.py``)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("triton/runtime/build.py"):
            return True
        tb = tb.tb_next
    return False


def diagnose(exc: BaseException, capturing: bool = False) -> BackendFailed:
    """What a failure on a plan's first run means, and its fix."""
    text = _summary(exc)
    if capturing:
        return BackendFailed(f"the first call of a shape compiles and loads its Triton kernels, which CUDA-graph "
                             f"capture does not allow ({text})",
                             "run each call shape once before capturing (a warm-up, as torch.cuda.graph advises)",
                             "call")
    if isinstance(exc, subprocess.CalledProcessError) or "C compiler" in text or _in_triton_build(exc):
        return BackendFailed(f"Triton cannot build its CUDA launcher (driver.c) with a C compiler ({text})",
                             "install a C compiler and Python's headers (conda: `conda install -c conda-forge "
                             "c-compiler`; or set CC to one), or use the shipped kernels (FLASH_ATTN_BACKEND=aot)",
                             "backend")
    if _cache_failure(exc):
        return BackendFailed(f"Triton cannot write its cache directory ({text})",
                             "set TRITON_CACHE_DIR to a writable directory", "backend")
    return BackendFailed(f"Triton cannot compile this call's kernels ({type(exc).__name__}: {text})",
                         "report it with the output of `python -m flash_attn doctor`; the shipped kernels "
                         "(FLASH_ATTN_BACKEND=aot) or FLASH_ATTN_BACKEND=reference avoid Triton", "plan")


def _cache_failure(exc: BaseException) -> bool:
    """An OSError of Triton's cache: one that no folder could avoid (no permission, a read-only
    or full disk), or any about a path inside Triton's cache directories (a path through a file,
    a dangling link: ENOTDIR, ENOENT, EEXIST)."""
    if not isinstance(exc, OSError):
        return False
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC):
        return True
    if not exc.filename:
        return False
    from triton import knobs  # noqa: PLC0415

    path = os.path.abspath(os.fsdecode(exc.filename))
    roots = [os.path.abspath(d) for d in (knobs.cache.dir, knobs.cache.dump_dir, knobs.cache.override_dir) if d]
    return any(path == root or path.startswith(root + os.sep) or root.startswith(path + os.sep) for root in roots)


class _Jitted:
    """A plan made ready to run, and what its first run showed (``ran``, or the failure that
    refuses it from then on)."""

    __slots__ = ("ready", "ran", "failure")

    def __init__(self, plan):
        self.ready, self.ran, self.failure = ready(plan), False, None


# Kernels whose tensor-descriptor (TMA) path this process's Triton could not assemble: their
# launches run the same tiles by plain loads from then on (Triton 3.6's PTX for the d256 forward's
# descriptors crashes the ptxas of CUDA 12.8 and 12.9; CUDA 13.0's assembles it: benchmarks/README.md)
_tma_refused: set = set()


def without_tma(plan: P.Plan, kernels) -> P.Plan:
    """``plan`` with the launches of ``kernels`` loading by pointers instead of tensor descriptors
    (warp specialisation, which needs them, off too); ``plan`` itself where none of them uses TMA."""
    def plain(launch):
        if launch.kernel not in kernels or not launch.constexprs.get("TMA"):
            return launch
        off = {"TMA": False, **({"WS": False} if "WS" in launch.constexprs else {})}
        return dataclasses.replace(launch, constexprs={**launch.constexprs, **off})

    launches = tuple(plain(launch) for launch in plan.launches)
    return plan if launches == plan.launches else dataclasses.replace(plan, launches=launches)


def _jitted(plan: P.Plan) -> _Jitted:
    return _Jitted(without_tma(plan, _tma_refused) if _tma_refused else plan)


def _ptxas_failed(exc: BaseException) -> bool:
    return type(exc).__name__ == "PTXASError"  # triton.runtime.errors, in the Triton versions that have it


class _TritonBackend(KernelBackend):
    def executable(self, plan, target, device):
        return _jitted(plan)

    def filled(self, template: _Jitted, number):
        return _jitted(P.filled(template.ready.plan, number))

    def run(self, jitted: _Jitted, inputs: dict, device) -> tuple:
        if jitted.ran:
            return execute(jitted.ready, inputs, device, self.run_launch)
        if jitted.failure is not None:
            raise BackendFailed(*jitted.failure)
        current, given = [], dict(inputs)  # (execute adds the prepared inputs and the buffers to inputs)

        def first_run_launch(launch, tensors, device):
            current[:] = [launch]
            self.run_launch(launch, tensors, device)

        try:
            result = execute(jitted.ready, inputs, device, first_run_launch)
        except (torch.cuda.OutOfMemoryError, BackendFailed):
            raise  # the call's memory, not Triton (the next backend would need it too); or told already
        except Exception as exc:
            if _ptxas_failed(exc) and current and current[0].constexprs.get("TMA"):
                _tma_refused.add(current[0].kernel)  # the plan again, its launches from the first
                jitted.ready = ready(without_tma(jitted.ready.plan, _tma_refused))
                return self.run(jitted, given, device)
            failure = diagnose(exc, capturing(device))
            if failure.scope == "plan":
                jitted.failure = (failure.cause, failure.fix, failure.scope)
            raise failure from exc
        jitted.ran = True
        return result


_backend = _TritonBackend(_NAME, _target, _run_launch)
BACKEND = _backend.contract(unavailable_reason, failure=BackendFailed)
forward, backward, forward_kvcache = _backend.forward, _backend.backward, _backend.forward_kvcache
