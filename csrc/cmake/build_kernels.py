"""Runs ``flash_attn.kernel_build.build`` from the source tree during the CMake build (CMakeLists.txt).

The build environment has triton (build requirement) but usually not torch, and importing
``flash_attn`` runs its ``__init__`` (the torch-based interface). The kernel build needs neither:
this script registers a bare ``flash_attn`` package pointing at the source tree, so only the
modules the build uses are imported. It also runs at the top of every worker process (they are
started with ``spawn`` and re-run this file as ``__mp_main__``).
"""

import sys
import types
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[2] / "flash_attn"
if "flash_attn" not in sys.modules:
    _package = types.ModuleType("flash_attn")
    _package.__path__ = [str(_SOURCE)]
    _package.__file__ = str(_SOURCE / "__init__.py")
    sys.modules["flash_attn"] = _package

if __name__ == "__main__":
    import argparse

    from flash_attn.kernel_build import build as aot_build

    parser = argparse.ArgumentParser(prog="build_kernels.py")
    aot_build.add_arguments(parser)
    sys.exit(aot_build.run(parser.parse_args()))
