"""The ahead-of-time op library (csrc/, flash_attn/aot/library.py) and image selection
(flash_attn/aot/archs.py), checked on a CPU-only machine: it loads without a GPU or driver, links
only the stable C shim, checks every argument before launching, and says clearly that there is no
CUDA device. The launch itself needs a GPU (marked ``gpu``). The CPU-only build has no library at
all: checked at the end, with how the package explains that."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from flash_attn import limits
from flash_attn.aot import library as aot
from flash_attn.aot.archs import Arch, DEFAULT_CUDA_ARCHS, parse_arch, parse_arch_list, select_image

from support import REPO, TESTS
from support.aot_buffers import read_plan
from support.packaging_helpers import compiled_files, run_from_site
from support.tolerance import check_close

HAS_GPU = torch.cuda.is_available()


def _library_or_skip() -> Path:
    status = aot.status()
    if not status.loaded:
        if os.environ.get("CI"):  # CI installs the package with its library: a missing one is a failure
            pytest.fail(status.reason)
        pytest.skip(status.reason)
    return Path(status.path)


@pytest.fixture(scope="module")
def library() -> Path:
    return _library_or_skip()


@pytest.fixture(scope="module")
def ops(library):
    return torch.ops.flash_attn


# A kernel image written by hand: what Triton emits for
#   toy(out: *fp32, n: i32, alpha: fp32) with num_warps=4,
# plus Triton's two hidden scratch pointers.
TOY_PTX = """\
.version 8.0
.target sm_80
.address_size 64

.visible .entry toy(
\t.param .u64 .ptr .global .align 1 toy_param_0,
\t.param .u32 toy_param_1,
\t.param .f32 toy_param_2,
\t.param .u64 .ptr .global .align 1 toy_param_3,
\t.param .u64 .ptr .global .align 1 toy_param_4
)
.reqntid 128
{
\tret;
}
"""
TOY_SIG = "*fp32:16, i32:16, fp32, global_scratch, profile_scratch"


@pytest.fixture(scope="module")
def toy_ptx(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("images") / "toy.ptx"
    path.write_text(TOY_PTX)
    return path


@pytest.fixture(scope="module")
def toy(ops, toy_ptx) -> int:
    return ops.aot_register_kernel(str(toy_ptx), "toy", TOY_SIG, 4, 1, 0)


# ---------------------------------------------------------------------------------------------
# Loading and linking
# ---------------------------------------------------------------------------------------------


def test_a_library_built_from_other_sources_is_not_used(library, monkeypatch):
    """A library whose ops answer another contract than this Python's (an older build left in
    place, ``FLASH_ATTN_AOT_LIBRARY`` pointing at one) is refused with the reason, as a library
    that fails to load is: here the needed schema of ``aot_run`` is changed to one it lacks."""
    monkeypatch.setitem(aot.NEEDED_SCHEMAS, "aot_run", "flash_attn::aot_run(Tensor plan) -> ()")
    status = aot._load()
    assert not status.loaded and "built from other sources" in status.reason and "aot_run" in status.reason
    monkeypatch.undo()
    assert aot._load().loaded  # the real expectation: the library built from this tree meets it


def test_library_loads_in_this_pytorch(library):
    status = aot.status()
    assert status.loaded and status.reason == ""
    assert status.build_config.get("torch_target_version") == "2.10"
    for name in ("aot_register_kernel", "aot_launch", "aot_kernel_attributes", "aot_cuda_info"):
        assert hasattr(torch.ops.flash_attn, name), name


def test_schemas(library):
    schemas = {op: str(getattr(torch.ops.flash_attn, op).default._schema)
               for op in ("aot_launch", "aot_run", "aot_count_cpu_launches", "aot_counted_launches",
                          "aot_use_driver_launch", "aot_cuda_info")}
    assert schemas["aot_launch"] == (
        "flash_attn::aot_launch(int kernel, int[] grid, Tensor(a!)[] tensors, int[] ints, float[] floats) -> ()"
    )
    assert schemas["aot_run"] == "flash_attn::aot_run(Tensor plan, Tensor(a!)[] tensors, int[] rows) -> Tensor[]"
    assert schemas["aot_count_cpu_launches"] == "flash_attn::aot_count_cpu_launches(bool enable) -> ()"
    assert schemas["aot_counted_launches"] == "flash_attn::aot_counted_launches() -> int"
    assert schemas["aot_use_driver_launch"] == "flash_attn::aot_use_driver_launch(bool enable) -> bool"
    assert schemas["aot_cuda_info"] == "flash_attn::aot_cuda_info() -> (int, int, int, str)"


def test_missing_library_gives_a_reason(monkeypatch):
    monkeypatch.setenv(aot.LIBRARY_ENV, "/nonexistent/libflash_attn_aot.so")
    status = aot._load()
    assert not status.loaded
    assert "does not exist" in status.reason and aot.LIBRARY_ENV in status.reason


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


SHIM = re.compile(r"^(aoti_torch_|torch_)[A-Za-z0-9_]*$")
SYSTEM_VERSION = re.compile(r"@(GLIBC|GLIBCXX|CXXABI|GCC)_[0-9.]+$")
ALLOWED_NEEDED = {
    "libtorch_cpu.so", "libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "libm.so.6", "libdl.so.2",
    "libpthread.so.0", "librt.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
}


def test_only_stable_c_shim_and_system_symbols_are_undefined(library):
    out = subprocess.run([_tool("nm"), "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True).stdout
    offenders = []
    for line in out.splitlines():
        kind, name = line.split()[-2:]
        if kind == "w":  # weak, optional: __gmon_start__, _ITM_* (toolchain hooks)
            continue
        if SHIM.match(name) or SYSTEM_VERSION.search(name):
            continue
        offenders.append(name)
    assert not offenders, f"undefined symbols outside the stable C shim and libc/libstdc++/libgcc: {offenders}"
    assert any(SHIM.match(line.split()[-1]) for line in out.splitlines())


def test_links_no_cuda_runtime_and_no_unstable_torch_library(library):
    dynamic = subprocess.run([_tool("readelf"), "-d", str(library)], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert needed <= ALLOWED_NEEDED, f"unexpected shared libraries: {needed - ALLOWED_NEEDED}"
    assert "RPATH" not in dynamic and "RUNPATH" not in dynamic
    ldd = subprocess.run([_tool("ldd"), str(library)], capture_output=True, text=True).stdout
    assert "cudart" not in ldd and "libcuda" not in ldd and "libc10" not in ldd


def test_exports_nothing(library):
    out = subprocess.run([_tool("nm"), "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True).stdout
    linker_markers = {"_edata", "_end", "__bss_start", "_init", "_fini"}
    exported = [line.split()[-1] for line in out.splitlines() if line.split()[-1] not in linker_markers]
    assert not exported, f"the library should export no symbol, exports {exported}"


@pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a usable GPU")
def test_cuda_info_without_gpu(library):
    info = aot.cuda_info()
    assert info["device_count"] == 0
    assert info["error"]  # e.g. "cudaGetDeviceCount failed with cudaErrorInsufficientDriver: ..."
    if aot.status().build_config.get("cuda"):
        assert info["runtime_version"] >= 12000


# ---------------------------------------------------------------------------------------------
# aot_register_kernel: the image and the signature are checked once, up front
# ---------------------------------------------------------------------------------------------


def test_register_is_idempotent(ops, toy_ptx, toy):
    assert ops.aot_register_kernel(str(toy_ptx), "toy", TOY_SIG, 4, 1, 0) == toy
    assert aot.register_kernel(toy_ptx, {"name": "toy", "signature": TOY_SIG.split(", "), "num_warps": 4, "shared": 0}) == toy


@pytest.mark.parametrize(
    "kernel, signature, num_warps, extra, message",
    [
        ("nope", TOY_SIG, 4, {}, "has no kernel entry point named 'nope' (entry points: toy)"),
        ("toy", "*fp32, i32, fp32", 4, {}, "takes 5 parameters of sizes [8, 4, 4, 8, 8] bytes but the signature"),
        ("toy", "*fp32, i64, fp32, global_scratch, profile_scratch", 4, {}, "describes 5 of sizes [8, 8, 4, 8, 8]"),
        ("toy", TOY_SIG, 8, {}, "compiled for 128 threads per block but num_warps=8 gives 256"),
        ("toy", "*fp33, i32, fp32, global_scratch, profile_scratch", 4, {}, "unknown pointee type 'fp33'"),
        ("toy", "*fp32, constexpr, i32, fp32, global_scratch, profile_scratch", 4, {}, "constexpr arguments are compiled into the kernel"),
        ("toy", "*fp32, i32, fp16, global_scratch, profile_scratch", 4, {}, "'fp16' is not a supported type"),
        ("toy", "*fp32:3, i32, fp32, global_scratch, profile_scratch", 4, {}, "must be a power of two"),
        ("toy", "*fp32, i32, global_scratch, fp32, profile_scratch", 4, {}, "must be the last entries"),
        ("toy", "*fp32, , i32", 4, {}, "has an empty entry"),
        ("toy", TOY_SIG, 33, {}, "num_warps must be between 1 and 32"),
        # a warp-specialised image's 12 warps pass the config check; this toy was compiled for 4
        ("toy", TOY_SIG, 12, {}, "compiled for 128 threads per block but num_warps=12 gives 384"),
        ("toy", TOY_SIG, 4, {"num_ctas": 0}, "num_ctas must be between 1 and 16"),
        ("toy", TOY_SIG, 4, {"shared_bytes": -1}, "shared_bytes must be between 0 and 1 MiB"),
        ("toy", "*fp32, i32, fp32", 4, {"global_scratch_bytes": 64}, "no global_scratch entry"),
    ],
)
def test_register_rejects(ops, toy_ptx, kernel, signature, num_warps, extra, message):
    kwargs = {"num_ctas": 1, "shared_bytes": 0, **extra}
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        ops.aot_register_kernel(str(toy_ptx), kernel, signature, num_warps, **kwargs)
    assert str(info.value).startswith("flash_attn::aot_register_kernel: ")


def test_register_rejects_unreadable_and_foreign_files(ops, tmp_path):
    with pytest.raises(RuntimeError, match=r"image '/nonexistent/k.cubin' cannot be read \(No such file"):
        ops.aot_register_kernel("/nonexistent/k.cubin", "toy", TOY_SIG, 4, 1, 0)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(RuntimeError, match="neither a cubin"):
        ops.aot_register_kernel(str(text), "toy", TOY_SIG, 4, 1, 0)
    elf = tmp_path / "host.so"
    shutil.copy(aot.status().path, elf)
    with pytest.raises(RuntimeError, match="not a CUDA cubin"):
        ops.aot_register_kernel(str(elf), "toy", TOY_SIG, 4, 1, 0)
    empty = tmp_path / "empty.cubin"
    empty.write_bytes(b"")
    with pytest.raises(RuntimeError, match="is empty"):
        ops.aot_register_kernel(str(empty), "toy", TOY_SIG, 4, 1, 0)


def test_register_takes_image_bytes(ops, tmp_path):
    """Packaged images are stored zlib-compressed: Python inflates them and hands the bytes over
    (the path then only names the image in messages); the bytes get the same checks as a file."""
    toy = torch.frombuffer(bytearray(TOY_PTX.encode()), dtype=torch.uint8)
    assert isinstance(ops.aot_register_kernel("label/toy.ptx", "toy", TOY_SIG, 4, 1, 0, image=toy), int)
    for bad, message in ((toy.float(), "1-D contiguous uint8 CPU tensor"), (toy[::2], "1-D contiguous uint8"),
                         (torch.empty(0, dtype=torch.uint8), "image is empty")):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            ops.aot_register_kernel("label/bad.ptx", "toy", TOY_SIG, 4, 1, 0, image=bad)
    with pytest.raises(RuntimeError, match=r"image 'label/notes.ptx': neither a cubin"):
        ops.aot_register_kernel("label/notes.ptx", "toy", TOY_SIG, 4, 1, 0,
                                image=torch.frombuffer(bytearray(b"hello"), dtype=torch.uint8))
    # through the Python helper, from a compressed file, as the aot backend does it
    stored = tmp_path / ("toy.ptx" + aot.COMPRESSED_SUFFIX)
    stored.write_bytes(aot.compress_image(TOY_PTX.encode()))
    assert stored.stat().st_size < len(TOY_PTX)
    entry = {"name": "toy", "signature": TOY_SIG.split(", "), "num_warps": 4, "shared": 0}
    assert isinstance(aot.register_kernel(stored, entry), int)
    stored.write_bytes(b"not zlib")
    with pytest.raises(RuntimeError, match="cannot be read"):
        aot.register_kernel(stored, entry)


# ---------------------------------------------------------------------------------------------
# aot_launch: every argument is checked before anything reaches CUDA
# ---------------------------------------------------------------------------------------------

OUT = torch.zeros(64)


@pytest.mark.parametrize(
    "grid, tensors, ints, floats, message",
    [
        ([1], [], [16], [1.0], "kernel 'toy' takes 1 tensor, 1 int, 1 float (signature: *fp32:16, i32:16, fp32, global_scratch, profile_scratch); got 0 tensors, 1 ints, 1 floats"),
        ([1], [OUT], [16, 1], [1.0], "got 1 tensors, 2 ints, 1 floats"),
        ([1], [OUT], [16], [], "got 1 tensors, 1 ints, 0 floats"),
        ([1], [OUT.double()], [16], [1.0], "tensors[0] has dtype torch.float64 but kernel 'toy' expects torch.float32 ('*fp32:16')"),
        ([], [OUT], [16], [1.0], "grid must have 1, 2 or 3 entries, got 0"),
        ([1, 1, 1, 1], [OUT], [16], [1.0], "grid must have 1, 2 or 3 entries, got 4"),
        ([-1], [OUT], [16], [1.0], "grid[0] = -1 is outside 0..2147483647"),
        ([1, 65536], [OUT], [16], [1.0], "grid[1] = 65536 is outside 0..65535"),
        ([1], [OUT], [2**31], [1.0], "ints[0] = 2147483648 does not fit the kernel's i32 parameter"),
        ([1], [OUT], [24], [1.0], "ints[0] = 24 must be divisible by 16: the kernel was compiled assuming it ('i32:16')"),
        ([1], [OUT[1:]], [16], [1.0], "is not 16-byte aligned as kernel 'toy' assumes ('*fp32:16')"),
    ],
)
def test_launch_rejects(ops, toy, grid, tensors, ints, floats, message):
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        ops.aot_launch(toy, grid, tensors, ints, floats)
    assert str(info.value).startswith("flash_attn::aot_launch: ")


def test_launch_rejects_unknown_kernel(ops, toy):
    with pytest.raises(RuntimeError, match=r"unknown kernel id 123456 \(\d+ kernels are registered"):
        ops.aot_launch(123456, [1], [OUT], [16], [1.0])


def test_launch_rejects_mixed_devices(ops, library, tmp_path):
    two = tmp_path / "two.ptx"
    two.write_text(TOY_PTX.replace("\t.param .u32 toy_param_1,", "\t.param .u64 .ptr .global .align 1 toy_param_1b,\n\t.param .u32 toy_param_1,"))
    kernel = ops.aot_register_kernel(str(two), "toy", "*fp32, *fp32, i32, fp32, global_scratch, profile_scratch", 4, 1, 0)
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is on meta but tensors\[0\] is on cpu; all must be on the same CUDA device"):
        ops.aot_launch(kernel, [1], [OUT, OUT.to("meta")], [16], [1.0])


@pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a usable GPU")
def test_launch_without_gpu_says_no_cuda_device(ops, toy):
    with pytest.raises(RuntimeError, match=r"^flash_attn::aot_launch: no CUDA device is available: "):
        ops.aot_launch(toy, [1], [OUT], [16], [1.0])
    with pytest.raises(RuntimeError, match="no CUDA device is available"):
        ops.aot_kernel_attributes(toy, 0)


def test_launch_with_meta_tensors_only_checks(ops, toy):
    ops.aot_launch(toy, [4, 2], [OUT.to("meta")], [32], [0.5])  # the Meta kernel: checks, no launch
    with pytest.raises(RuntimeError, match="got 0 tensors"):
        ops.aot_launch(toy, [4, 2], [], [32], [0.5])


def test_launch_limits_are_those_of_limits_py(ops, toy, toy_ptx):
    """The library's grid and int32 checks use flash_attn/limits.py's values (a header generated from
    it at build time): each bound passes the checks, one past it is refused."""
    meta = [OUT.to("meta")]
    ops.aot_launch(toy, list(limits.GRID_LIMITS), meta, [16], [1.0])  # the Meta kernel: checks only
    for axis, limit in enumerate(limits.GRID_LIMITS):
        grid = [1, 1, 1]
        grid[axis] = limit + 1
        with pytest.raises(RuntimeError, match=re.escape(f"grid[{axis}] = {limit + 1} is outside 0..{limit}")):
            ops.aot_launch(toy, grid, meta, [16], [1.0])
    clustered = ops.aot_register_kernel(str(toy_ptx), "toy", TOY_SIG, 4, 2, 0)  # num_ctas=2
    bound = limits.GRID_LIMITS[0] // 2
    ops.aot_launch(clustered, [bound], meta, [16], [1.0])
    with pytest.raises(RuntimeError, match=re.escape(f"grid[0] = {bound + 1} is outside 0..{bound} (num_ctas multiplies")):
        ops.aot_launch(clustered, [bound + 1], meta, [16], [1.0])
    top = limits.INT32_MAX // 16 * 16
    ops.aot_launch(toy, [1], meta, [top], [1.0])
    with pytest.raises(RuntimeError, match=re.escape(f"(range {-limits.INT32_MAX - 1} to {limits.INT32_MAX})")):
        ops.aot_launch(toy, [1], meta, [top + 16], [1.0])


# ---------------------------------------------------------------------------------------------
# aot_run: a call's launches described once (flash_attn/backends/aot.py writes the plan), run by
# one op call with the same checks as aot_launch
# ---------------------------------------------------------------------------------------------


def _plan(*packed, unused=(), buffers=(), results=()):
    """The plan the aot backend writes for these launches (its own encoder, read by the library);
    ``unused``: slots no kernel reads; ``buffers``: the plan's buffers the library makes;
    ``results``: the slots the call returns (the other buffers: its scratch)."""
    from flash_attn.backends import aot as aot_backend  # noqa: PLC0415

    return aot_backend._launches(tuple(aot_backend._Packed(*p) for p in packed), frozenset(unused), tuple(buffers),
                                 tuple(results))


def test_run_plan_layout(toy):
    from flash_attn.planning.plan import K_ROWS, Q_ROWS  # noqa: PLC0415

    written = _plan((toy, [4, 2], ["out"], [16], [0.1]), (toy, [3], ["acc"], [Q_ROWS], [-2.5]),
                    (toy, [1, 1, 1], ["out"], [K_ROWS], [1e300]))
    assert written.names == ("out", "acc") and written.rows == (Q_ROWS, K_ROWS)
    assert read_plan(written.plan) == [
        {"kernel": toy, "grid": [4, 2, 1], "tensors": [0], "ints": [16], "rows": [], "floats": [0.1]},
        {"kernel": toy, "grid": [3, 1, 1], "tensors": [1], "ints": [0], "rows": [(0, 0)], "floats": [-2.5]},
        {"kernel": toy, "grid": [1, 1, 1], "tensors": [0], "ints": [0], "rows": [(0, 1)], "floats": [1e300]},
    ]


def test_run_plan_layout_with_buffers(toy):
    """The buffers come first in the plan, and after the call's tensors in the launches' indices:
    a padded one as its storage and its columns, a row count as ``-(r + 1)``, sharing the row
    indices with the launches' ints."""
    from flash_attn.planning.layouts import Buffer  # noqa: PLC0415
    from flash_attn.planning.plan import K_ROWS, Q_ROWS  # noqa: PLC0415

    buffers = (Buffer("acc", (K_ROWS, 2, 6), torch.float32, padded=True, zeroed=True),
               Buffer("lse", (3, Q_ROWS), torch.float32))
    written = _plan((toy, [2], ["acc", "out", "lse"], [Q_ROWS], [1.0]), buffers=buffers)
    assert written.names == ("out",) and written.made == ("acc", "lse") and written.buffers == buffers
    assert written.rows == (K_ROWS, Q_ROWS)
    assert read_plan(written.plan, with_buffers=True) == (
        [{"flags": 1, "sizes": [-1, 2, 8], "columns": 6}, {"flags": 0, "sizes": [3, -2], "columns": -1}],
        [{"kernel": toy, "grid": [2, 1, 1], "tensors": [1, 0, 2], "ints": [0], "rows": [(0, 1)], "floats": [1.0]}],
    )


@pytest.fixture(scope="module")
def toy_i32(ops, tmp_path_factory) -> int:
    """The toy kernel with an int32 pointer where it has its float one."""
    path = tmp_path_factory.mktemp("images") / "toy_i32.ptx"
    path.write_text(TOY_PTX)
    return ops.aot_register_kernel(str(path), "toy", TOY_SIG.replace("*fp32", "*i32"), 4, 1, 0)


def test_run_makes_the_buffers(ops, toy, toy_i32):
    """The library makes a plan's buffers and returns them: on the device of the call's first
    tensor, in the dtype of the first kernel parameter each is passed to, sized by the call's row
    counts, zero-filled where asked, a padded one a view of its first columns of a fresh storage."""
    from flash_attn.planning.layouts import Buffer  # noqa: PLC0415
    from flash_attn.planning.plan import Q_ROWS  # noqa: PLC0415

    buffers = (Buffer("acc", (Q_ROWS, 2, 6), torch.float32, padded=True, zeroed=True), Buffer("n", (5,), torch.int32))
    written = _plan((toy, [2], ["acc"], [16], [1.0]), (toy_i32, [1], ["n"], [Q_ROWS], [1.0]), (toy, [1], ["out"], [16],
                    [1.0]), buffers=buffers)
    for device in ("meta", "cpu"):
        ops.aot_count_cpu_launches(device == "cpu")
        try:
            before = ops.aot_counted_launches()
            acc, n = ops.aot_run(written.plan, [OUT.to(device)], [32])
            assert ops.aot_counted_launches() == before + (3 if device == "cpu" else 0)
        finally:
            ops.aot_count_cpu_launches(False)
        assert acc.device.type == n.device.type == device
        assert (acc.dtype, n.dtype) == (torch.float32, torch.int32)  # the signatures' *fp32, *i32
        assert acc.shape == (32, 2, 6) and acc.stride() == (16, 8, 1) and acc.storage_offset() == 0
        assert n.shape == (5,) and n.is_contiguous()
        if device == "cpu":
            assert acc.untyped_storage().nbytes() == 32 * 2 * 8 * 4 and bool((acc == 0).all())
    # a buffer is made in one dtype: a later launch taking it as another is refused by its checks
    clash = _plan((toy, [1], ["out"], [16], [1.0]), (toy, [2], ["acc"], [16], [1.0]),
                  (toy_i32, [1], ["acc"], [16], [1.0]), buffers=buffers[:1])
    with pytest.raises(RuntimeError, match=re.escape("tensors[0] has dtype torch.float32 but kernel 'toy' expects "
                                                     "torch.int32")):
        ops.aot_run(clash.plan, [OUT.to("meta")], [32])


def _run_counted(ops, plan, tensors, rows):
    ops.aot_count_cpu_launches(True)
    try:
        return ops.aot_run(plan, tensors, rows)
    finally:
        ops.aot_count_cpu_launches(False)


def test_run_makes_the_calls_scratch_in_one_allocation(ops, toy, toy_i32, toy_ptx):
    """The buffers a call does not return (its scratch: the plan's flag, set by the aot backend's
    writer for every buffer not among the call's results) and the launches' Triton global scratch
    (the most one launch takes) are views of one allocation, each part 256-byte aligned,
    zero-filled where asked; not where no launch has a Triton scratch (each part then costs an
    allocation, one fewer than a shared storage and its views would) nor where a launch may overlap
    the next (PDL); the shared parts are of the dtype most of them have (the others' made alone)."""
    from flash_attn.planning.layouts import Buffer  # noqa: PLC0415
    from flash_attn.planning.plan import Q_ROWS  # noqa: PLC0415

    res, acc, tmp = (Buffer("res", (Q_ROWS, 4), torch.float32),
                     Buffer("acc", (Q_ROWS, 2, 6), torch.float32, padded=True, zeroed=True),
                     Buffer("tmp", (5,), torch.float32))
    with_scratch = ops.aot_register_kernel(str(toy_ptx), "toy", TOY_SIG, 4, 1, 0, 64, 16)  # 64 bytes per program
    overlapping = ops.aot_register_kernel(str(toy_ptx), "toy", TOY_SIG, 4, 1, 0, 64, 16, launch_pdl=True)

    def run(kernel):
        written = _plan((toy, [1], ["out"], [16], [1.0]), (toy, [1], ["res"], [16], [1.0]),
                        (kernel, [4, 2], ["acc"], [16], [1.0]), (toy, [1], ["tmp"], [16], [1.0]),
                        buffers=(res, acc, tmp), results=("res",))
        return written, _run_counted(ops, written.plan, [OUT], [32])

    written, (made_res, made_acc, made_tmp) = run(with_scratch)
    assert [b["flags"] for b in read_plan(written.plan, with_buffers=True)[0]] == [0, 3, 2]
    storage = made_acc.untyped_storage()
    assert made_tmp.untyped_storage().data_ptr() == storage.data_ptr() != made_res.untyped_storage().data_ptr()
    assert made_res.untyped_storage().nbytes() == 32 * 4 * 4 and made_res.dtype == made_tmp.dtype == torch.float32
    assert made_acc.shape == (32, 2, 6) and made_acc.stride() == (16, 8, 1) and made_acc.storage_offset() == 0
    assert bool((made_acc == 0).all())
    assert made_tmp.shape == (5,) and made_tmp.storage_offset() * 4 == 32 * 2 * 8 * 4  # (2048: 256-aligned)
    assert storage.nbytes() == 2048 + 256 + 4 * 2 * 64  # ... and the Triton scratch of the 4 x 2 grid
    meta = ops.aot_run(written.plan, [OUT.to("meta")], [32])
    assert [(t.shape, t.stride(), t.device.type) for t in meta] == [
        (t.shape, t.stride(), "meta") for t in (made_res, made_acc, made_tmp)]
    for kernel in (toy, overlapping):  # no Triton scratch, or one that may overlap: each part its own
        _, (_, made_acc, made_tmp) = run(kernel)
        assert made_acc.untyped_storage().nbytes() == 32 * 2 * 8 * 4 and made_tmp.untyped_storage().nbytes() == 5 * 4
    # of two dtypes: the shared storage is of the one most parts have; the other's part is made alone
    mixed = _plan((toy, [1], ["out"], [16], [1.0]), (toy_i32, [1], ["n"], [16], [1.0]),
                  (with_scratch, [4, 2], ["acc"], [16], [1.0]), (toy, [1], ["tmp"], [16], [1.0]),
                  buffers=(Buffer("n", (5,), torch.int32), acc, tmp), results=("res",))
    n, made_acc, made_tmp = _run_counted(ops, mixed.plan, [OUT], [32])
    assert n.dtype == torch.int32 and n.untyped_storage().nbytes() == 5 * 4
    assert made_acc.untyped_storage().data_ptr() == made_tmp.untyped_storage().data_ptr()


def test_a_held_lane_runs_its_plan_for_tensors_like_the_held_ones(ops, toy, toy_i32):
    """``aot_lane_hold(key, plan, tensors)`` then ``aot_lane_run(key, tensors)``: the plan runs
    (its buffers made, its launches checked and counted: CPU tensors standing in for a GPU's) for
    tensors of the held ones' dims, sizes, strides, dtypes and devices, pointers 16-byte aligned;
    any other call, or another key, gets an empty list and runs nothing. At most 16 shapes per key
    (the oldest goes); ``aot_lanes_clear`` forgets them all."""
    from flash_attn.planning.layouts import Buffer  # noqa: PLC0415

    written = _plan((toy, [2], ["acc"], [16], [1.0]), (toy, [1], ["x"], [16], [1.0]),
                    buffers=(Buffer("acc", (32,), torch.float32),))
    x = torch.zeros(4, 64)
    ops.aot_lanes_clear()
    ops.aot_count_cpu_launches(True)
    try:
        ops.aot_lane_hold(7, written.plan, [x])
        assert ops.aot_lanes_held() == 1
        before = ops.aot_counted_launches()
        made = ops.aot_lane_run(7, [torch.ones(4, 64)])  # other values, the same metadata
        assert [t.shape for t in made] == [(32,)] and ops.aot_counted_launches() == before + 2
        for other in (torch.zeros(4, 32), torch.zeros(64, 4).t(), torch.zeros(4, 64, dtype=torch.float64),
                      torch.zeros(4, 64, device="meta"), torch.zeros(4 * 64 + 1)[1:].view(4, 64),
                      torch.zeros(1, 4, 64)):
            assert ops.aot_lane_run(7, [other]) == []
        assert ops.aot_lane_run(8, [x]) == [] and ops.aot_lane_run(7, [x, x]) == []
        assert ops.aot_counted_launches() == before + 2
        ops.aot_lane_hold(7, written.plan, [torch.zeros(4, 64)])  # the same shape again: still one lane
        assert ops.aot_lanes_held() == 1
        for n in range(17, 33):  # 16 more shapes: the first one goes
            ops.aot_lane_hold(7, written.plan, [torch.zeros(n, 64)])
        assert ops.aot_lanes_held() == 16 and ops.aot_lane_run(7, [x]) == []
        assert len(ops.aot_lane_run(7, [torch.zeros(32, 64)])) == 1
        ops.aot_lanes_clear()
        assert ops.aot_lanes_held() == 0 and ops.aot_lane_run(7, [torch.zeros(32, 64)]) == []
    finally:
        ops.aot_count_cpu_launches(False)
        ops.aot_lanes_clear()
    with pytest.raises(RuntimeError, match="plan must be a 1-D contiguous int64 CPU tensor"):
        ops.aot_lane_hold(7, written.plan.to(torch.int32), [x])


def test_a_held_lane_returns_the_calls_results_alone(ops, toy):
    """A lane's run returns the buffers its call returns (the plan's results, in order), not its
    scratch; its plan is read when held, so a plan taking a per-call row count, tensors of more
    than 8 dims are refused then, with the reason."""
    from flash_attn.planning.layouts import Buffer  # noqa: PLC0415
    from flash_attn.planning.plan import Q_ROWS  # noqa: PLC0415

    written = _plan((toy, [2], ["acc"], [16], [1.0]), (toy, [1], ["res"], [16], [1.0]),
                    (toy, [1], ["tmp"], [16], [1.0]), (toy, [1], ["x"], [16], [1.0]),
                    buffers=(Buffer("acc", (32,), torch.float32), Buffer("res", (8,), torch.float32),
                             Buffer("tmp", (16,), torch.float32)), results=("res", "acc"))
    x = torch.zeros(4, 64)
    ops.aot_lanes_clear()
    ops.aot_count_cpu_launches(True)
    try:
        ops.aot_lane_hold(3, written.plan, [x])
        before = ops.aot_counted_launches()
        made = ops.aot_lane_run(3, [torch.ones(4, 64)])
        assert ops.aot_counted_launches() == before + 4  # every launch ran, the scratch's too
        assert [t.shape for t in made] == [(32,), (8,)]  # acc and res, in the plan's order; tmp not returned
        assert [t.shape for t in ops.aot_run(written.plan, [x], [])] == [(32,), (8,), (16,)]  # aot_run: all
        per_call = _plan((toy, [1], ["x"], [Q_ROWS], [1.0]))
        with pytest.raises(RuntimeError, match=r"aot_lane_hold: plan entry \d+ \(a row index\) is 0, outside 0..-1"):
            ops.aot_lane_hold(3, per_call.plan, [x])
        with pytest.raises(RuntimeError, match="of at most 8 dims"):
            ops.aot_lane_hold(3, written.plan, [torch.zeros([1] * 9)])
        assert ops.aot_lane_run(3, [torch.zeros([1] * 9)]) == [] and ops.aot_lanes_held() == 1
    finally:
        ops.aot_count_cpu_launches(False)
        ops.aot_lanes_clear()


def test_run_plan_stays_on_the_cpu_under_a_default_device(toy):
    """A caller's default device (``torch.set_default_device("cuda")`` in a training script) does
    not move the plan: the library reads it on the host."""
    with torch.device("meta"):
        written = _plan((toy, [1], ["out"], [16], [1.0]))
    assert written.plan.device.type == "cpu" and read_plan(written.plan)[0]["ints"] == [16]


def test_run_checks_each_launch_as_aot_launch_does(ops, toy):
    from flash_attn.planning.plan import Q_ROWS  # noqa: PLC0415

    meta = OUT.to("meta")
    good = _plan((toy, [4, 2], ["out"], [32], [0.5]), (toy, [1], ["out"], [Q_ROWS], [1.0]))
    ops.aot_run(good.plan, [meta], [48])  # the Meta kernel: both launches checked, nothing run
    with pytest.raises(RuntimeError, match=re.escape("ints[0] = 24 must be divisible by 16")) as info:
        ops.aot_run(good.plan, [meta], [24])  # the per-call row count reaches the second launch
    assert str(info.value).startswith("flash_attn::aot_run: ")
    with pytest.raises(RuntimeError, match=re.escape("tensors[0] has dtype torch.float64 but kernel 'toy' expects")):
        ops.aot_run(good.plan, [OUT.double()], [48])
    with pytest.raises(RuntimeError, match="is not 16-byte aligned"):
        ops.aot_run(good.plan, [OUT[1:]], [48])
    with pytest.raises(RuntimeError, match=r"unknown kernel id 123456"):
        ops.aot_run(_plan((123456, [1], ["out"], [16], [1.0])).plan, [OUT], [])


def test_run_passes_a_pointer_no_kernel_reads_as_null(ops, toy, tmp_path):
    """A slot the plan marks unused (the dense calls' absent cu_seqlens) is no tensor at all: index
    -1, checked as nothing and packed as a null pointer; a launch needs one real tensor still."""
    two = tmp_path / "two.ptx"
    two.write_text(TOY_PTX.replace("\t.param .u32 toy_param_1,",
                                   "\t.param .u64 .ptr .global .align 1 toy_param_1b,\n\t.param .u32 toy_param_1,"))
    kernel = ops.aot_register_kernel(str(two), "toy", "*fp32, *i32, i32, fp32, global_scratch, profile_scratch", 4, 1, 0)
    launch = (kernel, [1], ["out", "no_cu"], [16], [1.0])
    assert _plan(launch).names == ("out", "no_cu")
    null = _plan(launch, unused={"no_cu"})
    assert null.names == ("out",) and read_plan(null.plan)[0]["tensors"] == [0, -1]
    ops.aot_run(null.plan, [OUT.to("meta")], [])  # the Meta kernel: checked without the second tensor
    ops.aot_count_cpu_launches(True)
    try:
        before = ops.aot_counted_launches()
        ops.aot_run(null.plan, [OUT], [])
        assert ops.aot_counted_launches() == before + 1
    finally:
        ops.aot_count_cpu_launches(False)
    with pytest.raises(RuntimeError, match="takes no tensor, so there is no device"):
        ops.aot_run(_plan(launch, unused={"out", "no_cu"}).plan, [], [])
    with pytest.raises(RuntimeError, match=re.escape("plan entry 7 (a tensor index) is -2")):
        ops.aot_run(torch.tensor([0, 1, kernel, 1, 1, 1, 2, -2], dtype=torch.int64), [OUT], [])


@pytest.mark.parametrize(
    "plan, tensors, rows, message",
    [
        (torch.zeros(1), 1, 0, "plan must be a 1-D contiguous int64 CPU tensor"),
        (torch.zeros(4, dtype=torch.int64)[::2], 1, 0, "plan must be a 1-D contiguous int64 CPU tensor"),
        ([], 1, 0, "plan ends at entry 0 where the buffer count was expected"),
        ([0], 1, 0, "plan ends at entry 1 where the launch count was expected"),
        ([0, 1], 1, 0, "plan ends at entry 2 where a kernel id was expected"),
        ([-1], 1, 0, "plan entry 0 (the buffer count) is -1, outside 0..4095"),
        ([0, -1], 1, 0, "plan entry 1 (the launch count) is -1, outside 0..4095"),
        ([0, 1, "toy", 1, 1, 1, 1, 5], 1, 0, "plan entry 7 (a tensor index) is 5, outside 0..0"),
        ([0, 1, "toy", 1, 1, 1, 1, 0, 1, 16, 1, 1, 0], 1, 0, "plan entry 11 (an int index) is 1, outside 0..0"),
        ([0, 1, "toy", 1, 1, 1, 1, 0, 1, 16, 1, 0, 0], 1, 0, "plan entry 12 (a row index) is 0, outside 0..-1"),
        ([0, 0, 7], 1, 0, "plan has entries after its 0 launches"),
        # the buffers: flags (zero-filled, scratch), dimensions, sizes (negative: a row count), columns
        ([1, 4], 1, 0, "plan entry 1 (a buffer's flags) is 4, outside 0..3"),
        ([1, 0, 9], 1, 0, "plan entry 2 (a buffer's dimension count) is 9, outside 0..8"),
        ([1, 0, 0], 1, 0, "plan entry 2: a buffer has no dimension"),
        ([1, 0, 1, -2, -1], 1, 1, "plan entry 3 (a buffer size) is the row count rows[1] but the call passes 1"),
        ([1, 0, 2, 4, 8, 9, 0], 1, 0, "plan entry 5 (a buffer's columns) is 9, outside -1..8"),
        ([1, 0, 1, 4, -1, 0], 1, 0, "buffer 0 of the plan is passed to no kernel parameter"),
        ([1, 0, 1, 4, -1, 1, "toy", 1, 1, 1, 1, 0, 1, 16, 0, 1, 0], 0, 0,
         "the plan makes buffers but the call passes no tensor to take their device from"),
    ],
)
def test_run_rejects_a_malformed_plan(ops, toy, plan, tensors, rows, message):
    if isinstance(plan, list):
        plan = torch.tensor([toy if v == "toy" else v for v in plan], dtype=torch.int64)
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        ops.aot_run(plan, [OUT.to("meta")] * tensors, [16] * rows)
    assert str(info.value).startswith("flash_attn::aot_run: ")


def test_counted_cpu_launches_stand_in_for_the_gpu(ops, toy):
    """``bench overhead`` on a machine without a GPU: switched on, CPU tensors go through every check
    and are counted, not launched; a call the checks refuse is not counted; switched off, CPU tensors
    are refused again."""
    plan = _plan((toy, [4, 2], ["out"], [32], [0.5]), (toy, [1], ["out"], [16], [1.0])).plan
    ops.aot_count_cpu_launches(True)
    try:
        before = ops.aot_counted_launches()
        ops.aot_run(plan, [OUT], [])
        ops.aot_launch(toy, [1], [OUT], [16], [1.0])
        assert ops.aot_counted_launches() == before + 3
        with pytest.raises(RuntimeError, match="is not 16-byte aligned"):
            ops.aot_run(plan, [OUT[1:]], [])
        assert ops.aot_counted_launches() == before + 3
    finally:
        ops.aot_count_cpu_launches(False)
    if not HAS_GPU:
        with pytest.raises(RuntimeError, match="no CUDA device is available"):
            ops.aot_run(plan, [OUT], [])
    assert ops.aot_counted_launches() == before + 3


def test_the_driver_route_changes_the_cuda_call_alone(ops, toy):
    """``aot_use_driver_launch`` switches which CUDA API launches (the runtime's or the driver's) and
    returns the setting it replaced; everything before the CUDA call is the same on both routes:
    the checks, the counted stand-in, and without a GPU the refusal that says why."""
    plan = _plan((toy, [4, 2], ["out"], [32], [0.5]),).plan
    previous = ops.aot_use_driver_launch(True)
    try:
        assert previous is False  # the runtime's route by default
        assert ops.aot_use_driver_launch(True) is True
        with pytest.raises(RuntimeError, match="got 0 tensors"):
            ops.aot_launch(toy, [1], [], [16], [1.0])
        ops.aot_count_cpu_launches(True)
        try:
            before = ops.aot_counted_launches()
            ops.aot_run(plan, [OUT], [])
            assert ops.aot_counted_launches() == before + 1
        finally:
            ops.aot_count_cpu_launches(False)
        if not HAS_GPU:
            with pytest.raises(RuntimeError, match="no CUDA device is available"):
                ops.aot_launch(toy, [1], [OUT], [16], [1.0])
    finally:
        ops.aot_use_driver_launch(False)
    assert ops.aot_use_driver_launch(False) is False


def test_csrc_takes_its_limits_from_limits_py():
    """csrc states no limit of its own: the build generates them from limits.py."""
    import importlib.util

    repo = REPO
    spec = importlib.util.spec_from_file_location("limits_header", repo / "csrc" / "cmake" / "limits_header.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    text = generator.header()
    assert f"kInt32Max = {limits.INT32_MAX};" in text
    assert "kGridLimits[3] = {" + ", ".join(map(str, limits.GRID_LIMITS)) + "};" in text
    assert f"kPointerAlignment = {limits.POINTER_ALIGNMENT};" in text
    for source in sorted((repo / "csrc").glob("*.[ch]*")):
        for literal in ("65535", "2147483647", str(limits.GRID_LIMITS[1]), str(limits.INT32_MAX)):
            assert literal not in source.read_text(), f"{source.name} states {literal}: take it from flash_attn/limits.py"
    assert "limits_header.py" in (repo / "CMakeLists.txt").read_text()


def test_python_helpers_pass_arguments_through(library, toy):
    with pytest.raises(RuntimeError, match="ints\\[0\\] = 8 must be divisible by 16"):
        aot.launch(toy, (1,), [OUT], [8], [1.0])


# ---------------------------------------------------------------------------------------------
# A real Triton kernel compiled ahead of time here (no GPU needed), registered from its metadata
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_add(tmp_path_factory, library):
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def aot_test_axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, alpha * x + y, mask=mask)

    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr"}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    src = ASTSource(fn=aot_test_axpy, signature=signature, constexprs={"BLOCK": 256}, attrs=attrs)
    folder = tmp_path_factory.mktemp("triton_aot")
    out = {}
    for cap in (80, 90):
        compiled = triton.compile(src, target=GPUTarget("cuda", cap, 32))
        (folder / f"axpy.sm{cap}.cubin").write_bytes(compiled.asm["cubin"])
        (folder / f"axpy.sm{cap}.ptx").write_text(compiled.asm["ptx"])
        out[cap] = (aot.manifest_entry(compiled, src), folder / f"axpy.sm{cap}.cubin", folder / f"axpy.sm{cap}.ptx")
    return out


def test_triton_manifest_entry(triton_add):
    entry, _, _ = triton_add[80]
    assert entry["name"] == "aot_test_axpy"
    assert entry["signature"] == ["*fp32:16", "*fp32:16", "*fp32:16", "i32", "fp32", "global_scratch", "profile_scratch"]
    assert entry["num_warps"] == 4 and entry["num_ctas"] == 1


@pytest.mark.parametrize("cap", [80, 90])
@pytest.mark.parametrize("image", ["cubin", "ptx"])
def test_triton_kernel_registers_and_launch_checks_pass(triton_add, cap, image):
    entry, cubin, ptx = triton_add[cap]
    kernel = aot.register_kernel(cubin if image == "cubin" else ptx, entry)
    x, y, out = torch.ones(1000), torch.ones(1000), torch.empty(1000)
    grid = [(1000 + 255) // 256]
    aot.launch(kernel, grid, [x.to("meta"), y.to("meta"), out.to("meta")], [1000], [2.0])
    if not HAS_GPU:
        # Everything checks out; only the missing GPU stops it.
        with pytest.raises(RuntimeError, match="^flash_attn::aot_launch: no CUDA device is available"):
            aot.launch(kernel, grid, [x, y, out], [1000], [2.0])
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        aot.launch(kernel, grid, [x[1:], y[1:], out[1:]], [999], [2.0])


def test_triton_cubin_with_dropped_scratch_args_is_rejected(triton_add):
    entry, cubin, _ = triton_add[80]
    broken = dict(entry, signature=entry["signature"][:-2])
    with pytest.raises(RuntimeError, match="takes 7 parameters .* describes 5"):
        aot.register_kernel(cubin, broken)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("driver_route", [False, True])
def test_triton_kernel_runs_on_gpu(triton_add, driver_route):
    major, minor = torch.cuda.get_device_capability()
    archs = {80: "sm_80", 90: "sm_90a"}
    choice = select_image((major, minor), list(archs.values()) + ["compute_80"])
    if not choice.supported:
        pytest.skip(choice.reason)
    cap = 90 if choice.arch.name == "sm_90a" else 80
    entry, cubin, ptx = triton_add[cap]
    kernel = aot.register_kernel(ptx if choice.kind == "ptx" else cubin, entry)
    x = torch.randn(1000, device="cuda")
    y = torch.randn(1000, device="cuda")
    out = torch.empty(1000, device="cuda")
    previous = torch.ops.flash_attn.aot_use_driver_launch(driver_route)
    try:
        aot.launch(kernel, [4], [x, y, out], [1000], [2.0])
    finally:
        torch.ops.flash_attn.aot_use_driver_launch(previous)
    torch.testing.assert_close(out, 2.0 * x + y)
    regs, local, static_shared, max_threads, optin = torch.ops.flash_attn.aot_kernel_attributes(kernel, x.device.index)
    assert regs > 0 and max_threads >= 128 and optin >= 48 * 1024


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("driver_route", [False, True])
def test_the_benchmarks_empty_kernel_launches_on_gpu(ops, driver_route):
    """``bench overhead``'s empty kernel (PTX the driver compiles) launches on either route and
    writes nothing."""
    from flash_attn.bench import overhead  # noqa: PLC0415

    kernel = overhead.empty_kernel()
    x = torch.zeros(16, device="cuda")
    previous = ops.aot_use_driver_launch(driver_route)
    try:
        for _ in range(3):
            ops.aot_launch(kernel, [1], [x], [], [])
        torch.cuda.synchronize()
    finally:
        ops.aot_use_driver_launch(previous)
    assert not x.any()


# ---------------------------------------------------------------------------------------------
# Image selection (pure Python)
# ---------------------------------------------------------------------------------------------

PORTABLE = ["sm_80", "sm_90", "sm_100", "sm_120", "compute_80"]  # 80;90;100;120;80+PTX
TRITON = ["sm_80", "sm_90a", "sm_100a", "sm_120a", "compute_80"]  # what Triton emits for those targets


@pytest.mark.parametrize(
    "cap, portable, triton",
    [
        ((8, 0), ("cubin", "sm_80"), ("cubin", "sm_80")),
        ((8, 6), ("cubin", "sm_80"), ("cubin", "sm_80")),
        ((8, 9), ("cubin", "sm_80"), ("cubin", "sm_80")),
        ((9, 0), ("cubin", "sm_90"), ("cubin", "sm_90a")),
        ((10, 0), ("cubin", "sm_100"), ("cubin", "sm_100a")),
        ((10, 3), ("cubin", "sm_100"), ("ptx", "compute_80")),  # sm_100a runs on 10.0 only
        ((12, 0), ("cubin", "sm_120"), ("cubin", "sm_120a")),
        ((12, 1), ("cubin", "sm_120"), ("ptx", "compute_80")),  # sm_120a runs on 12.0 only
        ((13, 0), ("ptx", "compute_80"), ("ptx", "compute_80")),
        ((7, 5), ("unsupported", None), ("unsupported", None)),
    ],
)
def test_select_image(cap, portable, triton):
    for available, (kind, arch) in ((PORTABLE, portable), (TRITON, triton)):
        choice = select_image(cap, available)
        assert (choice.kind, choice.arch.name if choice.arch else None) == (kind, arch), choice.reason
        assert choice.supported == (kind != "unsupported")


def test_select_image_details():
    assert select_image((9, 0), ["sm_90", "sm_90a"]).arch.name == "sm_90a"  # the exact build wins a tie
    assert select_image((8, 9), ["sm_80", "sm_86", "sm_89"]).arch.name == "sm_89"
    assert select_image((8, 6), ["sm_80", "sm_89"]).arch.name == "sm_80"  # never a newer minor
    assert select_image((10, 3), ["sm_100f"]).arch.name == "sm_100f"  # family cubins span the family
    assert select_image((9, 0), ["compute_90a"]).kind == "ptx"
    assert not select_image((10, 0), ["compute_90a"]).supported  # arch-specific PTX is not portable
    assert "shipped: sm_80" in select_image((7, 5), ["sm_80"]).reason
    assert not select_image((8, 0), []).supported


def test_parse_arch():
    assert parse_arch("sm_80") == parse_arch("sm80") == parse_arch("80") == parse_arch("8.0") == Arch(8, 0)
    assert parse_arch("sm_90a") == parse_arch("9.0a") == Arch(9, 0, "a")
    assert parse_arch("compute_80") == Arch(8, 0, ptx=True)
    assert parse_arch("121").capability == (12, 1)
    for bad in ("", "sm_8", "sm_80x", "gfx90a"):
        with pytest.raises(ValueError):
            parse_arch(bad)


def test_parse_arch_list():
    assert [a.name for a in parse_arch_list("80;90a;100a;120a;80+PTX")] == ["sm_80", "sm_90a", "sm_100a", "sm_120a", "compute_80"]
    assert [a.name for a in parse_arch_list("8.0, 9.0a")] == ["sm_80", "sm_90a"]
    assert parse_arch_list("") == parse_arch_list(None) == parse_arch_list(DEFAULT_CUDA_ARCHS)
    with pytest.raises(ValueError, match="arch-specific"):
        parse_arch_list("90a+PTX")


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)])
def test_default_archs_give_every_current_gpu_a_cubin(cap):
    """A100 .. RTX 40xx, H100/H200, B200/GB200 and B300 (10.3), Thor (11.0), RTX 50xx and DGX
    Spark (12.1): a native cubin each, no driver JIT of the sm_80 PTX with sm_80 tiles."""
    assert select_image(cap, parse_arch_list(DEFAULT_CUDA_ARCHS)).kind == "cubin"
    assert select_image((13, 0), parse_arch_list(DEFAULT_CUDA_ARCHS)).kind == "ptx"


# ---------------------------------------------------------------------------------------------
# The CPU-only build: no op library at all (no compiler, no torch headers, no CUDA), and a package
# that says why it has no `aot` backend
# ---------------------------------------------------------------------------------------------


def _package_with(monkeypatch, tmp_path, build_config: dict | None) -> None:
    """flash_attn as an install whose only ``_C/`` content is this build_config.json (or nothing)."""
    import flash_attn

    folder = tmp_path / "flash_attn"
    (folder / "_C").mkdir(parents=True)
    if build_config is not None:
        (folder / "_C" / "build_config.json").write_text(json.dumps(build_config))
    monkeypatch.delenv(aot.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(flash_attn, "__path__", [str(folder)])


def test_cpu_only_build_config_is_the_reason(monkeypatch, tmp_path):
    _package_with(monkeypatch, tmp_path, {"library": None, "cuda": False, "cuda_runtime": "", "cuda_archs": ""})
    status = aot._load()
    assert not status.loaded and status.path is None
    assert status.reason == aot.CPU_ONLY_REASON and status.build_config["cuda"] is False


@pytest.mark.parametrize("build_config", [None, {"library": "libflash_attn_aot.so", "cuda": True}])
def test_missing_library_of_a_cuda_build_is_not_called_cpu_only(monkeypatch, tmp_path, build_config):
    _package_with(monkeypatch, tmp_path, build_config)
    status = aot._load()
    assert not status.loaded and "is not installed" in status.reason and "CPU-only" not in status.reason


def test_cpu_only_build(tmp_path):
    """FLASH_ATTN_ENABLE_CUDA=OFF configures, builds and installs with no compiler, no torch and no
    CUDA toolkit within reach; it compiles nothing and installs only _C/build_config.json. flash_attn
    laid out as that install (the Python files plus what CMake installed) imports, explains in
    status() and the doctor why there is no `aot` backend, and runs the cpu backend (checked
    against the oracle)."""
    cmake = _tool("cmake")
    _tool("ninja")
    root = REPO
    env = dict(os.environ, CC="/nonexistent/cc", CXX="/nonexistent/c++", CUDA_HOME="/nonexistent",
               FLASH_ATTN_TORCH_DIR="/nonexistent",
               PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if "cuda" not in p.lower()))
    build, site = tmp_path / "build", tmp_path / "site"
    configure = subprocess.run([cmake, "-S", str(root), "-B", str(build), "-G", "Ninja", "-DFLASH_ATTN_ENABLE_CUDA=OFF"],
                               check=True, capture_output=True, text=True, env=env)
    subprocess.run([cmake, "--build", str(build)], check=True, capture_output=True, env=env)
    subprocess.run([cmake, "--install", str(build), "--prefix", str(site)], check=True, capture_output=True, env=env)
    assert "CPU-only build" in configure.stdout and "flash_attn: torch" not in configure.stdout  # no torch lookup
    cache = (build / "CMakeCache.txt").read_text()
    assert "CMAKE_CXX_COMPILER" not in cache and "CMAKE_C_COMPILER" not in cache  # no language enabled
    assert compiled_files(tmp_path) == []
    assert [str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()] == ["flash_attn/_C/build_config.json"]
    assert aot.is_cpu_only_build(json.loads((site / "flash_attn" / "_C" / "build_config.json").read_text()))

    shutil.copytree(root / "flash_attn", site / "flash_attn", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "_C", "_aot", "*.so"))
    script = (
        "import json, sys, torch\n"
        "import flash_attn\n"
        "from flash_attn import flash_attn_func\n"
        "from flash_attn.aot import library as op_library\n"
        "from support.oracle import attention_ref\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q = torch.randn(2, 37, 4, 40, generator=g)\n"
        "k, v = torch.randn(2, 53, 2, 40, generator=g), torch.randn(2, 53, 2, 40, generator=g)\n"
        "out = flash_attn_func(q, k, v, causal=True)\n"
        "ref = attention_ref(q, k, v, causal=True).out\n"
        "naive = attention_ref(q, k, v, causal=True, compute_dtype=None).out\n"
        "torch.save({'out': out, 'ref': ref, 'naive': naive}, sys.argv[1])\n"
        "s = op_library.status()\n"
        "print(json.dumps([flash_attn.__file__, s.loaded, s.reason]))\n"
    )
    backend = {"FLASH_ATTN_BACKEND": "auto"}  # what a user gets: CPU tensors go to the cpu backend
    result = run_from_site(site, "-c", script, str(tmp_path / "out.pt"), cwd=tmp_path, extra_paths=[TESTS], env=backend)
    assert result.returncode == 0, result.stderr
    location, loaded, reason = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(location).is_relative_to(site) and not loaded and reason == aot.CPU_ONLY_REASON
    saved = torch.load(tmp_path / "out.pt")
    check_close(saved["out"], saved["ref"], saved["naive"], torch.float32, "out (CPU-only install)")

    doctor = run_from_site(site, "-m", "flash_attn", "doctor", cwd=tmp_path, env=backend)
    assert "op library" in doctor.stdout and f"not loaded: {aot.CPU_ONLY_REASON}" in doctor.stdout, doctor.stdout
    report = run_from_site(site, "-m", "flash_attn", "doctor", "--json", cwd=tmp_path, env=backend)
    [finding] = [f for f in json.loads(report.stdout)["findings"] if f["check"] == "op-library"]
    assert finding["summary"].startswith("this is the CPU-only build of flash-attn")
    assert finding["detail"] == aot.CPU_ONLY_REASON
    assert finding["severity"] == ("warning" if HAS_GPU else "info")
