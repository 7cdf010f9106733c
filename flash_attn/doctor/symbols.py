"""C++ symbols in readable form, and what an ``undefined symbol`` in someone else's compiled
extension (upstream's ``flash_attn_2_cuda``) means: a C++ ABI or PyTorch version mismatch."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
import subprocess
from typing import Optional

TORCH_NAMESPACES = {"c10", "at", "torch", "caffe2", "aoti_torch"}


def _demangle_cxa(symbol: str) -> Optional[str]:
    names = ["libstdc++.so.6", ctypes.util.find_library("stdc++"), ctypes.util.find_library("c++abi")]
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)
            libc = ctypes.CDLL(None)
        except OSError:
            continue
        fn = getattr(lib, "__cxa_demangle", None)
        if fn is None:
            continue
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
        status = ctypes.c_int(0)
        pointer = fn(symbol.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not pointer:
            return None
        try:
            return ctypes.string_at(pointer).decode(errors="replace")
        finally:
            libc.free.argtypes = [ctypes.c_void_p]
            libc.free(pointer)
    return None


def _demangle_cxxfilt(symbol: str) -> Optional[str]:
    exe = shutil.which("c++filt")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, symbol], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out if out and out != symbol else None


def demangle(symbol: str) -> Optional[str]:
    """A C++ symbol in readable form: libstdc++'s ``__cxa_demangle``, else ``c++filt``."""
    if not symbol.startswith("_Z"):
        return None
    return _demangle_cxa(symbol) or _demangle_cxxfilt(symbol)


def qualified_name_hint(symbol: str) -> Optional[str]:
    """The leading qualified name of an Itanium-mangled symbol without a demangler:
    ``_ZN3c104cuda9SetDeviceEi`` -> ``c10::cuda::SetDevice``."""
    match = re.match(r"_ZN?[KVr]*", symbol)
    if not match:
        return None
    pos, parts = match.end(), []
    while True:
        num = re.match(r"(\d+)", symbol[pos:])
        if not num:
            break
        length = int(num.group(1))
        start = pos + len(num.group(1))
        parts.append(symbol[start : start + length])
        pos = start + length
    return "::".join(parts) or None


def _string_abi(symbol: str, readable: Optional[str]) -> Optional[bool]:
    """Which std::string ABI the symbol was compiled with: ``std::__cxx11`` is the C++11 ABI
    (``_GLIBCXX_USE_CXX11_ABI=1``), a plain ``std::basic_string`` the old one; None: no string."""
    if "__cxx11" in symbol:
        return True
    if "basic_string" in (readable or "") or re.search(r"Ss|Sb", symbol[2:]):
        return False
    return None


def explain_undefined_symbol(symbol: str, torch_info: dict) -> dict:
    """What an ``undefined symbol`` in someone else's compiled extension means."""
    readable = demangle(symbol)
    hint = qualified_name_hint(symbol)
    namespace = (hint or readable or symbol).split("::")[0]
    reasons = []
    wanted_abi, torch_abi = _string_abi(symbol, readable), torch_info.get("cxx11_abi")
    if wanted_abi is not None and torch_abi is not None and wanted_abi != torch_abi:
        reasons.append(
            f"a C++ ABI mismatch: the extension was built with _GLIBCXX_USE_CXX11_ABI={int(wanted_abi)} "
            f"(std::string is {'std::__cxx11::basic_string' if wanted_abi else 'the pre-C++11 std::basic_string'}), "
            f"the installed torch with _GLIBCXX_USE_CXX11_ABI={int(torch_abi)}"
        )
    if namespace in TORCH_NAMESPACES or symbol.startswith(("aoti_torch", "torch_")):
        reasons.append(
            f"it is a PyTorch C++ symbol ({namespace}::...) that the installed torch {torch_info.get('version', '?')} "
            "does not export: the extension was compiled against a different PyTorch version, and PyTorch's C++ "
            "ABI changes between versions"
        )
    if not reasons:
        reasons.append("the library it needs at run time is a different version than the one it was built against")
    return {"symbol": symbol, "demangled": readable, "name": hint, "explanation": "; ".join(reasons)}
