"""flash_attn: exact FlashAttention with the flash-attn 2.8 Python API.

GPU kernels are Triton code compiled ahead of time into the package; CPU tensors run on PyTorch's
fused CPU attention kernels (exact, memory-efficient), every other device on an exact PyTorch
reference. ``FLASH_ATTN_BACKEND`` picks the backend (see :mod:`flash_attn.dispatch`).
"""

from pkgutil import extend_path

# Every `flash_attn` folder on sys.path is part of this package, as upstream's: FlashAttention-4's
# distribution installs `flash_attn/cute/` (without an __init__ of `flash_attn`) beside this one.
# The folders extend_path adds are other distributions': this one's op library and kernel images
# are looked up only in its own (two in an editable install), never in another flash-attn's.
_own_path = list(__path__)
__path__ = extend_path(__path__, __name__)
_other_distributions = [folder for folder in __path__ if folder not in _own_path]

from flash_attn._version import __version__  # noqa: E402
from flash_attn.flash_attn_interface import (  # noqa: E402
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
