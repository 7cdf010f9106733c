"""Settings read on every call, straight from the process environment.

``os.environ.get`` costs ~0.5 us (a Mapping method and the key's encoding); the environment's own
dict behind it (bytes keys and values on POSIX) a tenth of that, and holds the same values
(``os.environ`` writes through to it). Elsewhere ``os.environ`` itself is read.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional, Union

__all__ = ["raw_getter"]

_RAW = getattr(os.environ, "_data", None) if os.name == "posix" else None


def raw_getter(name: str) -> Callable[[], Optional[Union[bytes, str]]]:
    """A function returning setting ``name`` as set now, undecoded (bytes on POSIX), or ``None``
    when unset: for cache keys and on/off tests, not for reading the value as text."""
    if _RAW is not None:
        return functools.partial(_RAW.get, os.fsencode(name))
    return functools.partial(os.environ.get, name)
