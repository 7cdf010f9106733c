"""The ``flash_attn_3`` import name of this package's FlashAttention-3 interface.

FlashAttention-3 installs a package ``flash_attn_3`` (its compiled ``flash_attn_3._C``) beside the
module ``flash_attn_interface``; code that looks for FA3 (Hugging Face Transformers'
``is_flash_attn_3_available``: ``importlib.util.find_spec("flash_attn_3")``, then
``importlib.metadata``) finds this one, and then imports ``flash_attn_interface``, whose functions
run on :mod:`flash_attn`. There is no ``flash_attn_3._C`` here: nothing in it is FA3's CUDA code.

The distribution is also named ``flash_attn_3``, so pip treats a real FlashAttention-3 as the same
project: installing one replaces the other, never both side by side (docs/compatibility.md).
Its version is flash-attn's (lower than any FA3 release: 3.x replaces it as an upgrade), which
fa3_interface/setup.py reads from flash_attn/_version.py.
"""

from importlib.metadata import version

__version__ = version("flash_attn_3")
