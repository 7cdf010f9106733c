"""The recipe's stand-in for abi3audit: the op library must use no Python C API.

abi3audit audits Python extension modules (``*.abi3.so``) for symbols outside the limited API.
flash-attn's op library is not an extension module at all (a plain shared library loaded with
``torch.ops.load_library``), so the check here is stricter: it may import *no* Python symbol
(``Py*``, ``_Py*``) and may not link libpython. That is what lets one build serve every Python 3
(``python.version_independent`` and ``python-abi3`` in the recipe).

Standard library only (the test environment of the recipe has no ELF tools): reads the ELF
dynamic symbol table and the DT_NEEDED entries. Usage: ``python check_no_python_c_api.py LIB...``
or with no argument every ``flash_attn/_C/*.so`` under the running Python's site-packages.
Exit status 1 and the offending names when a library uses the Python C API.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

SHT_DYNSYM, SHT_DYNAMIC = 11, 6
DT_NEEDED = 1


def _sections(data: bytes):
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    if data[4] != 2:
        raise ValueError("only 64-bit ELF is built (linux-64, linux-aarch64)")
    endian = "<" if data[5] == 1 else ">"
    shoff, = struct.unpack_from(endian + "Q", data, 0x28)
    shentsize, shnum = struct.unpack_from(endian + "HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        name, kind, _flags, _addr, offset, size, link, _info, _align, entsize = struct.unpack_from(
            endian + "IIQQQQIIQQ", data, shoff + i * shentsize)
        sections.append((kind, offset, size, link, entsize))
    return endian, sections


def _string(data: bytes, table_offset: int, index: int) -> str:
    end = data.index(b"\0", table_offset + index)
    return data[table_offset + index:end].decode()


def python_c_api_uses(path: Path) -> list[str]:
    """The undefined Python symbols and the libpython NEEDED entries of a shared library."""
    data = path.read_bytes()
    endian, sections = _sections(data)
    found = []
    for kind, offset, size, link, entsize in sections:
        strtab = sections[link][1]
        if kind == SHT_DYNSYM:
            for at in range(offset, offset + size, entsize):
                name_index, _info, _other, shndx, _value, _size = struct.unpack_from(endian + "IBBHQQ", data, at)
                name = _string(data, strtab, name_index)
                if shndx == 0 and name.startswith(("Py", "_Py")):  # undefined: imported
                    found.append(name)
        elif kind == SHT_DYNAMIC:
            for at in range(offset, offset + size, entsize):
                tag, value = struct.unpack_from(endian + "qQ", data, at)
                if tag == DT_NEEDED and _string(data, strtab, value).startswith("libpython"):
                    found.append("NEEDED " + _string(data, strtab, value))
    return sorted(set(found))


def main(argv: list[str]) -> int:
    if argv:
        libraries = [Path(a) for a in argv]
    else:
        import flash_attn

        libraries = sorted((Path(flash_attn.__file__).parent / "_C").glob("*.so"))
        if not libraries:
            print("no op library in this package (the CPU build)")
            return 0
    bad = 0
    for library in libraries:
        uses = python_c_api_uses(library)
        print(f"{library}: {'uses the Python C API: ' + ', '.join(uses) if uses else 'no Python C API'}")
        bad += bool(uses)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
