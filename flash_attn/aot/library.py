"""Finds and loads the op library (``flash_attn/_C/libflash_attn_aot.so``) that launches the
ahead-of-time compiled kernels, and says why when it cannot.

The library is C++ on the LibTorch stable ABI, built by ``pip install`` (CMakeLists.txt) and loaded
with ``torch.ops.load_library``; it registers these operators (schemas in ``csrc/README.md``):

- ``flash_attn::aot_register_kernel(image_path, kernel_name, signature, num_warps, num_ctas,
  shared_bytes, ...) -> int``: checks an image and its signature once, returns a kernel id;
- ``flash_attn::aot_launch(kernel, grid, tensors, ints, floats)``: checks the arguments against the
  signature and launches on PyTorch's current CUDA stream of the tensors' device;
- ``flash_attn::aot_run(plan, tensors, rows) -> Tensor[]``: a call's buffers and launches (described
  once in ``plan`` by :mod:`flash_attn.backends.aot`): the buffers made and returned, each launch
  checked and launched as ``aot_launch`` does, in one op call;
- ``flash_attn::aot_count_cpu_launches(enable)`` / ``aot_counted_launches()``: the benchmark's
  stand-in on machines without a GPU (CPU tensors checked and counted, not launched);
- ``flash_attn::aot_use_driver_launch(enable) -> bool``: launches by the driver's ``cuLaunchKernelEx``
  instead of the runtime's ``cudaLaunchKernelExC`` (the benchmark times both on a GPU); returns the
  setting it replaced;
- ``flash_attn::aot_kernel_attributes(kernel, device) -> int[]``: loads it, reports registers etc.;
- ``flash_attn::aot_cuda_info() -> (runtime, driver, device_count, error)``.

Everything here is safe to call anywhere: nothing raises while *finding* or *loading* the library;
:func:`status` carries the reason instead, for the dispatcher and the doctor. The CPU-only build
ships no library at all, only ``_C/build_config.json`` saying so; :func:`status` then names that
as the reason.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

LIBRARY_NAME = "libflash_attn_aot.so"
# Set to a library path to load that one instead of the packaged one (development, tests).
LIBRARY_ENV = "FLASH_ATTN_AOT_LIBRARY"


@dataclass(frozen=True)
class LibraryStatus:
    loaded: bool
    path: Optional[str]
    reason: str  # empty when loaded
    build_config: dict = field(default_factory=dict)
    from_env: bool = False  # the path came from FLASH_ATTN_AOT_LIBRARY


_lock = threading.Lock()
_status: Optional[LibraryStatus] = None


def package_folders() -> list[Path]:
    """The folders of this ``flash_attn`` distribution (an editable install spreads it over the
    source tree and site-packages), not those ``__path__`` gains from other distributions
    (``flash_attn.cute``); the package is imported before any of its modules."""
    package = sys.modules[__name__.split(".")[0]]
    others = set(getattr(package, "_other_distributions", ()))
    return [Path(folder) for folder in package.__path__ if folder not in others]


def _find_in_package(name: str) -> Optional[Path]:
    """``_C/<name>`` in any folder of the package."""
    return next((f / "_C" / name for f in package_folders() if (f / "_C" / name).is_file()), None)


def find_library() -> Optional[Path]:
    """The library file: ``$FLASH_ATTN_AOT_LIBRARY``, else ``_C/`` in any folder of the package."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return Path(override)
    return _find_in_package(LIBRARY_NAME)


def _read_json(path: Optional[Path]) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def _read_build_config(library: Path) -> dict:
    return _read_json(library.parent / "build_config.json")


# The CPU-only build (FLASH_ATTN_CPU_ONLY=1, the conda `cpu` build) installs no library on purpose
# and says so in _C/build_config.json with `"library": null` (CMakeLists.txt).
CPU_ONLY_REASON = (
    "this is a CPU-only build of flash_attn (built with FLASH_ATTN_CPU_ONLY=1, or the conda `cpu` build): "
    "it ships no op library and no ahead-of-time kernels, so the `aot` backend is unavailable; "
    "CPU tensors use the cpu backend, and a GPU needs a CUDA build of flash-attn"
)


def is_cpu_only_build(config: dict) -> bool:
    """Whether a build_config.json is that of the CPU-only build (no op library by design)."""
    return "library" in config and config["library"] is None and config.get("cuda") is False


def _load() -> LibraryStatus:
    try:
        path = find_library()
    except Exception as exc:  # a broken install must not break import
        return LibraryStatus(False, None, f"cannot look for the op library: {exc}")
    if path is None:
        try:
            config = _read_json(_find_in_package("build_config.json"))
        except Exception:  # same as above: explain, never raise
            config = {}
        if is_cpu_only_build(config):
            return LibraryStatus(False, None, CPU_ONLY_REASON, config)
        return LibraryStatus(
            False,
            None,
            f"the op library {LIBRARY_NAME} is not installed (flash_attn was installed without its C++ part; "
            f"reinstall with `pip install .` and a torch >= 2.10 present)",
        )
    from_env = bool(os.environ.get(LIBRARY_ENV))
    if path.is_dir():
        return LibraryStatus(False, str(path), f"{LIBRARY_ENV} points at a folder, {path}, not at the library file "
                             f"({LIBRARY_NAME})", from_env=from_env)
    if not path.is_file():
        return LibraryStatus(False, str(path), f"the op library {path} does not exist ({LIBRARY_ENV} points there)",
                             from_env=from_env)
    config = _read_build_config(path)
    try:
        import torch

        torch.ops.load_library(str(path))
        differs = _schemas_differ(torch.ops.flash_attn)
    except Exception as exc:
        return LibraryStatus(False, str(path), f"the op library {path} failed to load: {loader_message(exc)}", config,
                             from_env)
    if differs:
        return LibraryStatus(False, str(path), f"the op library {path} was built from other sources than this "
                             f"flash_attn ({differs}): rebuild it (`pip install .`) or reinstall", config, from_env)
    return LibraryStatus(True, str(path), "", config, from_env)


# The schemas of the library's ops whose contract this Python relies on beyond its name (csrc/aot_ops.cpp
# defines them): a library built from older sources answers otherwise and is not used.
NEEDED_SCHEMAS = {"aot_run": "flash_attn::aot_run(Tensor plan, Tensor(a!)[] tensors, int[] rows) -> Tensor[]"}


def _schemas_differ(ops) -> str:
    """The first op whose schema is not :data:`NEEDED_SCHEMAS`'s, as the library has it ("" if none)."""
    for name, schema in NEEDED_SCHEMAS.items():
        op = getattr(ops, name, None)
        have = "absent" if op is None else str(op.default._schema)
        if have != schema:
            return f"its {name} is {have!r}, this flash_attn needs {schema!r}"
    return ""


def loader_message(exc: BaseException) -> str:
    """What went wrong, with the dynamic loader's own words: PyTorch raises "Could not load this
    library" and keeps the loader's reason (wrong ELF class, an undefined symbol, a GLIBC version)
    in ``__cause__``; each distinct first line of the chain, outermost first."""
    lines: list[str] = []
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).strip()
        line = text.splitlines()[0] if text else type(exc).__name__
        if line not in lines:
            lines.append(line)
        exc = exc.__cause__ or exc.__context__
    return "; the loader says: ".join(lines)


def status() -> LibraryStatus:
    """Finds and loads the library on the first call (once per process); never raises."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _load()
    return _status


def is_available() -> bool:
    return status().loaded


def ops():
    """``torch.ops.flash_attn`` with the ``aot_*`` operators registered; RuntimeError with the reason if not."""
    s = status()
    if not s.loaded:
        raise RuntimeError(s.reason)
    import torch

    return torch.ops.flash_attn


def cuda_info() -> dict:
    """What the library's CUDA runtime sees: versions (e.g. 13000 = 13.0), device count, and the error
    that explains a count of 0. Initializes the CUDA driver when there is one."""
    runtime, driver, count, error = ops().aot_cuda_info()
    return {"runtime_version": runtime, "driver_version": driver, "device_count": count, "error": error}


# --- the calling contract, shared by the kernel build (manifest) and the dispatcher (launch) --------

HIDDEN_ARGS = ("global_scratch", "profile_scratch")


def triton_signature(src: Any) -> list[str]:
    """The runtime signature of a ``triton.compiler.ASTSource``: its non-constexpr arguments in order
    (pointer ``*fp16``, scalars ``i32``/``fp32``...), ``:16`` where the source's ``attrs`` told Triton
    to assume 16-byte alignment / divisibility by 16, then Triton's two hidden scratch pointers."""
    divisibility: dict[int, int] = {}
    for key, attrs in (getattr(src, "attrs", None) or {}).items():
        if isinstance(key, tuple) and len(key) == 1:
            for name, value in attrs:
                if name == "tt.divisibility":
                    divisibility[key[0]] = int(value)
    tokens = []
    for index, ty in enumerate(src.signature.values()):
        if not isinstance(ty, str):
            raise ValueError(f"argument {index} has type {ty!r}: tuple arguments are not supported by the AOT launcher")
        if ty == "constexpr":
            continue
        tokens.append(f"{ty}:{divisibility[index]}" if index in divisibility else ty)
    return tokens + list(HIDDEN_ARGS)


def manifest_entry(compiled: Any, src: Any) -> dict:
    """A manifest entry for one kernel compiled by ``triton.compile(src, target=...)``: everything
    :func:`register_kernel` needs besides the image file."""
    md = compiled.metadata
    return {
        "name": md.name,
        "signature": triton_signature(src),
        "num_warps": md.num_warps,
        "num_ctas": md.num_ctas,
        "shared": md.shared,
        "global_scratch_size": md.global_scratch_size,
        "global_scratch_align": md.global_scratch_align,
        "profile_scratch_size": md.profile_scratch_size,
        "profile_scratch_align": md.profile_scratch_align,
        "launch_cooperative_grid": bool(md.launch_cooperative_grid),
        "launch_pdl": bool(md.launch_pdl),
    }


COMPRESSED_SUFFIX = ".zlib"


def compress_image(data: bytes) -> bytes:
    """How the build stores an image (``<name>.cubin.zlib``): zlib, 4-6x smaller for cubins/PTX."""
    return zlib.compress(data, 9)


def read_image(image_path: str | os.PathLike) -> bytes:
    """An image's bytes, inflated when it is stored compressed."""
    data = Path(image_path).read_bytes()
    return zlib.decompress(data) if str(image_path).endswith(COMPRESSED_SUFFIX) else data


def register_kernel(image_path: str | os.PathLike, entry: dict) -> int:
    """Registers one manifest entry with its image (cubin or PTX); returns the kernel id for
    :func:`launch`. The same registration again returns the same id. Compressed images
    (:data:`COMPRESSED_SUFFIX`) are inflated here and handed over as bytes; others are read by
    the library itself."""
    image = None
    if str(image_path).endswith(COMPRESSED_SUFFIX):
        import torch  # noqa: PLC0415

        try:
            data = read_image(image_path)
        except (OSError, zlib.error) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise RuntimeError(f"flash_attn: image '{image_path}' cannot be read: {why}") from None
        image = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return ops().aot_register_kernel(
        str(image_path),
        entry["name"],
        ", ".join(entry["signature"]),
        int(entry["num_warps"]),
        int(entry.get("num_ctas", 1)),
        int(entry["shared"]),
        int(entry.get("global_scratch_size", 0)),
        int(entry.get("global_scratch_align", 1)),
        int(entry.get("profile_scratch_size", 0)),
        int(entry.get("profile_scratch_align", 1)),
        bool(entry.get("launch_cooperative_grid", False)),
        bool(entry.get("launch_pdl", False)),
        image,
    )


def launch(kernel: int, grid: Sequence[int], tensors: Sequence, ints: Sequence[int] = (), floats: Sequence[float] = ()) -> None:
    """Launches a registered kernel: ``tensors``, ``ints`` and ``floats`` fill the signature's pointer,
    integer and float parameters, each list in signature order."""
    ops().aot_launch(int(kernel), [int(g) for g in grid], list(tensors), [int(i) for i in ints], [float(f) for f in floats])
