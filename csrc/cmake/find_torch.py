"""Find the PyTorch headers and libtorch_cpu.so to build the stable-ABI op library against.

Run by CMakeLists.txt with the build's Python. Prints ``key=value`` lines (include, lib, version,
found_by) or exits 1 with the reason on stderr. Never imports torch: only files are read, so this
works inside pip's isolated build environment and in a conda build whose host has no Python torch.

A *torch root* is a folder with ``include/torch/csrc/stable/library.h`` and ``lib/libtorch_cpu.so``:
pip's ``site-packages/torch`` package, or a conda prefix holding conda-forge's ``libtorch``
(headers in ``$PREFIX/include``, libraries in ``$PREFIX/lib``; its ``pytorch`` package has no
``site-packages/torch/include``). Where it looks, first match wins:

1. ``FLASH_ATTN_TORCH_DIR``: a torch root set by hand (recipe/build.sh sets ``$PREFIX``).
2. The build's own interpreter (``--no-build-isolation``).
3. The environment being installed into: pip's isolated build still runs this interpreter with
   ``sys.prefix`` pointing at the target environment; ``VIRTUAL_ENV`` and ``CONDA_PREFIX`` are
   tried as well, first their ``site-packages/torch``, then the prefix itself (conda's layout).
Any torch >= 2.10 works: the library is built for the 2.10 stable ABI (TORCH_TARGET_VERSION), so
the headers' version only has to be at least that, and the result runs with every later torch.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
import sysconfig

STABLE_HEADER = os.path.join("include", "torch", "csrc", "stable", "library.h")
STABLE_VERSION_HEADER = os.path.join("include", "torch", "csrc", "stable", "version.h")
VERSION_HEADER = os.path.join("include", "torch", "headeronly", "version.h")
TORCH_LIBRARY = os.path.join("lib", "libtorch_cpu.so")


def candidates():
    explicit = os.environ.get("FLASH_ATTN_TORCH_DIR")
    if explicit:
        yield explicit, "FLASH_ATTN_TORCH_DIR"
        return
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            yield location, "the build interpreter"
    prefixes = [("sys.prefix", sys.prefix)]
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        if os.environ.get(var):
            prefixes.append((var, os.environ[var]))
    for label, prefix in prefixes:
        for key in ("purelib", "platlib"):
            site = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})[key]
            yield os.path.join(site, "torch"), f"the target environment ({label})"
        for site in glob.glob(os.path.join(prefix, "lib", "python3*", "site-packages")):
            yield os.path.join(site, "torch"), f"the target environment ({label})"
        yield prefix, f"the target environment's libtorch ({label})"


def torch_version(root: str) -> str:
    """The version of the torch root: ``version.py`` of a torch package, else the headers'."""
    try:
        with open(os.path.join(root, "version.py"), encoding="utf-8") as f:
            match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read())
            if match:
                return match.group(1)
    except OSError:
        pass
    try:
        with open(os.path.join(root, VERSION_HEADER), encoding="utf-8") as f:
            parts = dict(re.findall(r"#define TORCH_VERSION_(MAJOR|MINOR|PATCH) (\d+)", f.read()))
        return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    except (OSError, KeyError):
        return "unknown"


def main() -> int:
    tried = []
    for root, found_by in candidates():
        root = os.path.abspath(root)
        if root in tried:
            continue
        tried.append(root)
        if not os.path.isfile(os.path.join(root, STABLE_HEADER)):
            continue
        with open(os.path.join(root, STABLE_VERSION_HEADER), encoding="utf-8") as f:
            if "TORCH_VERSION_2_10_0" not in f.read():
                print(f"torch at {root} is older than 2.10; its stable ABI lacks what the op library needs",
                      file=sys.stderr)
                return 1
        if not os.path.isfile(os.path.join(root, TORCH_LIBRARY)):
            print(f"torch headers found in {os.path.join(root, 'include')} but not {os.path.join(root, TORCH_LIBRARY)}: "
                  "a torch root holds both (a torch package, or a conda prefix with libtorch)", file=sys.stderr)
            return 1
        print(f"include={os.path.join(root, 'include')}")
        print(f"lib={os.path.join(root, 'lib')}")
        print(f"version={torch_version(root)}")
        print(f"found_by={found_by}")
        return 0
    print(
        "no PyTorch >= 2.10 with C++ headers found (looked in: " + ", ".join(tried or ["nowhere"]) + "). "
        "Install torch into the environment first (pip install torch; with conda: libtorch), or build "
        "with --no-build-isolation, or set FLASH_ATTN_TORCH_DIR to the torch package directory or a "
        "prefix holding include/torch and lib/libtorch_cpu.so.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
