"""``python -m flash_attn doctor`` (also the ``flash-attn-doctor`` script): what is installed, what
runs where, and what to fix.

It reports this package (version, location, how it was installed), Python, PyTorch (version, CUDA
version, CPU/CUDA/ROCm build), the NVIDIA driver (asked directly through ``libcuda``, so it is seen
even by a CPU build of PyTorch), every visible GPU, the op library, the GPU architectures of the
kernel images the ``aot`` backend finds (``$FLASH_ATTN_AOT_DIR``, else the package's ``_aot/``),
which backend ``FLASH_ATTN_BACKEND=auto`` uses on each GPU (and, when it is not ``aot``, why), and
what a call on each device (the CPU, every GPU, MPS) does with the environment as set: the
dispatcher's own decision (:func:`flash_attn.dispatch.route`).
Then it explains every problem it finds with a concrete fix. Findings come in this order, one
function per check in :mod:`flash_attn.doctor.checks`:

=========================  ======================================================================
check                      problem
=========================  ======================================================================
``shadowed``               another ``flash_attn`` earlier on ``sys.path`` (e.g. upstream's wheel)
``other-copy``             another ``flash_attn`` later on ``sys.path`` / a second distribution
``foreign-extension``      a ``flash_attn_2_cuda`` that does not import; an ``undefined symbol``
                           is demangled and explained (C++ ABI / PyTorch version mismatch)
``torch-missing``          PyTorch cannot be imported
``torch-cpu-build``        a CPU build of PyTorch on a machine with an NVIDIA GPU
``torch-rocm``             a ROCm build of PyTorch: which AMD GPUs run the Triton kernels (and
                           that Triton is missing, where it is)
``driver-too-old``         the driver's CUDA version is older than the major CUDA version that
                           PyTorch (or the op library) was built with
``torch-cuda-unusable``    a CUDA PyTorch that cannot use the GPUs the driver sees
``driver-error``           a driver that is installed but reports an error and no GPU
``op-library``             the op library (``flash_attn/_C``) fails to load, or is missing
``aot-kernels``            the kernel manifest cannot be read (or is not a valid manifest), some
                           of its entries are malformed, or no kernels are shipped
``arch-not-shipped``       a GPU whose architecture has no shipped kernel image (and whether
                           PTX, Triton or only the reference backend covers it)
``triton-missing``         Triton is not installed although a GPU needs it
``gpu-backend``            a GPU that runs on the (slow) reference backend or only on Triton
``forced-family``          ``FLASH_ATTN_FORCE_FAMILY`` is set: a GPU runs another family's launch
                           configs (a measuring aid), or the aot backend refuses it there
``backend-env``            every call on a device raises with the environment as set: an invalid
                           ``FLASH_ATTN_BACKEND``, ``FLASH_ATTN_STRICT_BACKEND`` or
                           ``FLASH_ATTN_CPU_ONEDNN``, or a named backend that cannot run there
``fused-ops``              what ``flash_attn.ops.triton`` (norms, loss, rotary) runs on the GPUs:
                           Triton's JIT (information), or without Triton the PyTorch path
``other-gpus``             Intel (xpu) or Apple (mps) GPUs: the reference backend, and why
``no-gpu``                 no NVIDIA GPU is visible (information)
=========================  ======================================================================

Exit status: 0 when no problem (``error``) was found, 1 otherwise (``--strict``: warnings too).
``--json`` prints the same facts and findings as one JSON object.

Modules: :mod:`~flash_attn.doctor.probes` (facts about the machine; tests replace them to simulate
one), :mod:`~flash_attn.doctor.facts` (all facts in one dict), :mod:`~flash_attn.doctor.checks`
(facts -> findings), :mod:`~flash_attn.doctor.render` (text), :mod:`~flash_attn.doctor.cli`.
"""

from flash_attn.doctor.checks import CHECKS, diagnose, run_checks
from flash_attn.doctor.cli import add_arguments, main, run
from flash_attn.doctor.facts import collect
from flash_attn.doctor.render import render_text
from flash_attn.doctor.report import Finding, Report

__all__ = ["CHECKS", "Finding", "Report", "add_arguments", "collect", "diagnose", "main", "render_text", "run",
           "run_checks"]
