"""FlashAttention-3's interface module, imported from the source tree (``fa3_interface/``).

The module ships in its own distribution (``flash_attn_3``; the conda output ``flash-attn-fa3``),
not in flash-attn's wheel, so the tests load it from its file without putting ``fa3_interface/``
on ``sys.path`` (which would make every other test see a ``flash_attn_3`` and so an "installed" FA3).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

FA3_SOURCE = Path(__file__).resolve().parents[2] / "fa3_interface"


@lru_cache(maxsize=None)
def fa3_interface():
    spec = importlib.util.spec_from_file_location("flash_attn_interface", FA3_SOURCE / "flash_attn_interface.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
