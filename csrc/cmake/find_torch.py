"""Find the PyTorch headers and libtorch_cpu.so to build the stable-ABI op library against.

Run by CMakeLists.txt with the build's Python. Prints ``key=value`` lines (include, lib, version,
found_by) or exits 1 with the reason on stderr. Never imports torch: only files are read, so this
works inside pip's isolated build environment too.

Where it looks, first match wins:
1. ``FLASH_ATTN_TORCH_DIR``: the ``torch`` package directory, set by hand.
2. The build's own interpreter (``--no-build-isolation``, conda-build with torch in ``host``).
3. The environment being installed into: pip's isolated build still runs this interpreter with
   ``sys.prefix`` pointing at the target environment, so its site-packages holds the torch the
   package will run with; ``VIRTUAL_ENV`` and ``CONDA_PREFIX`` are tried as well.
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


def torch_version(torch_dir: str) -> str:
    try:
        with open(os.path.join(torch_dir, "version.py"), encoding="utf-8") as f:
            match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read())
            return match.group(1) if match else "unknown"
    except OSError:
        return "unknown"


def main() -> int:
    tried = []
    for torch_dir, found_by in candidates():
        torch_dir = os.path.abspath(torch_dir)
        if torch_dir in tried:
            continue
        tried.append(torch_dir)
        if not os.path.isfile(os.path.join(torch_dir, STABLE_HEADER)):
            continue
        with open(os.path.join(torch_dir, "include", "torch", "csrc", "stable", "version.h"), encoding="utf-8") as f:
            if "TORCH_VERSION_2_10_0" not in f.read():
                print(f"torch at {torch_dir} is older than 2.10; its stable ABI lacks what the op library needs",
                      file=sys.stderr)
                return 1
        lib_dir = os.path.join(torch_dir, "lib")
        print(f"include={os.path.join(torch_dir, 'include')}")
        print(f"lib={lib_dir}")
        print(f"version={torch_version(torch_dir)}")
        print(f"found_by={found_by}")
        return 0
    print(
        "no PyTorch >= 2.10 with C++ headers found (looked in: " + ", ".join(tried or ["nowhere"]) + "). "
        "Install torch into the environment first (pip install torch), or build with "
        "--no-build-isolation, or set FLASH_ATTN_TORCH_DIR to the torch package directory.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
