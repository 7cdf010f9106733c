"""flash_attn: exact FlashAttention with the flash-attn 2.8 Python API.

GPU kernels are Triton code compiled ahead of time into the package; CPU tensors run on PyTorch's
fused CPU attention kernels (exact, memory-efficient), every other device on an exact PyTorch
reference. ``FLASH_ATTN_BACKEND`` picks the backend (see :mod:`flash_attn.dispatch`).
"""

from flash_attn._version import __version__
from flash_attn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "__version__",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
