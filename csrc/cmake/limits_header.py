"""Writes the op library's limits header from ``flash_attn/limits.py`` (CMakeLists.txt runs it at
build time), so the C++ checks state no limit of their own. tests/aot/test_aot_library.py keeps the
library's answers equal to limits.py.

    python csrc/cmake/limits_header.py <output.h>

limits.py is pure Python and is read by path: neither torch nor the ``flash_attn`` package is imported.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

LIMITS = Path(__file__).resolve().parents[2] / "flash_attn" / "limits.py"


def header(limits_path: Path = LIMITS) -> str:
    """The header's text: limits.py's INT32_MAX, GRID_LIMITS and POINTER_ALIGNMENT as C++ constants."""
    limits = runpy.run_path(str(limits_path))
    int32_max = int(limits["INT32_MAX"])
    grid = [int(n) for n in limits["GRID_LIMITS"]]
    alignment = int(limits["POINTER_ALIGNMENT"])
    if len(grid) != 3:
        raise ValueError(f"{limits_path}: GRID_LIMITS must have 3 entries, has {len(grid)}")
    return (
        "// Generated from flash_attn/limits.py by csrc/cmake/limits_header.py at build time: do not edit.\n"
        "#pragma once\n"
        "\n"
        "#include <cstdint>\n"
        "\n"
        "namespace flash_attn_aot::limits {\n"
        "\n"
        "// INT32_MAX: sizes, strides and offsets are int32 kernel arguments.\n"
        f"constexpr int64_t kInt32Max = {int32_max};\n"
        "// GRID_LIMITS: CUDA's grid limits (programs per axis).\n"
        f"constexpr int64_t kGridLimits[3] = {{{', '.join(map(str, grid))}}};\n"
        "// POINTER_ALIGNMENT: the alignment of every data pointer a held lane's plan assumes.\n"
        f"constexpr int64_t kPointerAlignment = {alignment};\n"
        "\n"
        "}  // namespace flash_attn_aot::limits\n"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: limits_header.py <output.h>", file=sys.stderr)
        return 2
    output = Path(argv[0])
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(header())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
