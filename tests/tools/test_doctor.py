"""``python -m flash_attn doctor``: every problem it must explain is simulated here on a CPU-only
machine, by replacing the doctor's probes (a GPU, an old driver, a CPU PyTorch), by the real
environment knobs (``FLASH_ATTN_AOT_LIBRARY``, ``sys.modules``), and by fake packages and
extensions on ``sys.path``. Also: the command line, and that warnings go through ``warnings``
once per cause and never through ``print``."""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import flash_attn
from flash_attn import __main__ as cli, dispatch, doctor
from flash_attn.aot import library as op_library, manifest as aot_manifest
from flash_attn.doctor import probes, symbols
from flash_attn.doctor.nvidia import cuda_version_text

PACKAGE_DIR = Path(flash_attn.__file__).resolve().parent
A100 = {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0], "memory_bytes": 80 << 30}
RTX_PRO = {"index": 0, "name": "NVIDIA RTX PRO 6000", "capability": [12, 1], "memory_bytes": 96 << 30}
T4 = {"index": 0, "name": "Tesla T4", "capability": [7, 5], "memory_bytes": 16 << 30}


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """The doctor reads FLASH_ATTN_BACKEND; the test suite sets it to its backend for every test."""
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "auto")
    monkeypatch.delenv(op_library.LIBRARY_ENV, raising=False)


def run_json(capsys, *args) -> tuple[int, dict]:
    status = doctor.main(["--json", *args])
    out = capsys.readouterr().out
    return status, json.loads(out)


def checks(report: dict, severity: str | None = None) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in report["findings"]:
        assert f["check"] in doctor.CHECKS, f  # every id is documented and has its check
        if severity is None or f["severity"] == severity:
            out.setdefault(f["check"], []).append(f)
    return out


def driver(devices, cuda_version=12040, release="550.54.14"):
    return {"found": True, "source": "libcuda", "library": "libcuda.so.1", "release": release,
            "cuda_version": cuda_version, "cuda_version_text": cuda_version_text(cuda_version),
            "devices": [dict(d) for d in devices], "error": None}


def cpu_torch():
    return {"installed": True, "version": "2.13.0+cpu", "cuda": None, "hip": None, "cxx11_abi": True,
            "build": "CPU", "cuda_available": False, "devices": [], "mps_available": False}


def cuda_torch(devices, cuda="12.8", available=True, warning=None):
    info = {"installed": True, "version": f"2.13.0+cu{cuda.replace('.', '')}", "cuda": cuda, "hip": None,
            "cxx11_abi": True, "build": "CUDA", "cuda_available": available,
            "devices": [dict(d) for d in devices] if available else [], "mps_available": False}
    if warning:
        info["cuda_warning"] = warning
    return info


@pytest.fixture
def gpu_machine(monkeypatch):
    """Make the doctor see a machine: PyTorch's view, the driver's view, and, for a CUDA PyTorch
    that can use the GPU, the pieces of torch.cuda the real dispatcher consults."""

    def setup(torch_info, driver_info, triton_installed=True):
        # The ahead-of-time backend needs a real GPU; simulated GPUs never get it (and these tests
        # stay independent of how that backend probes the device).
        def no_aot_on_simulated_gpus():
            raise ImportError("no module named flash_attn.backends._aot_not_on_simulated_gpus")

        monkeypatch.setitem(dispatch._IMPORTERS, "aot", no_aot_on_simulated_gpus)
        monkeypatch.setattr(dispatch, "_loaded", {})
        monkeypatch.setattr(probes, "probe_torch", lambda: torch_info)
        monkeypatch.setattr(probes, "probe_driver", lambda: driver_info)
        # Independent of whether this checkout built the op library (its CUDA runtime version
        # would meet the simulated driver): a simulated machine has none installed.
        monkeypatch.setattr(probes, "probe_op_library", lambda: {
            "loaded": False, "path": None, "reason": "not installed on the simulated machine",
            "build_config": {}, "installed": False})
        if not triton_installed:
            monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
            monkeypatch.setattr(probes, "probe_triton", lambda: {"installed": False, "error": "not installed"})
        if torch_info.get("cuda_available"):
            caps = {d["index"]: tuple(d["capability"]) for d in torch_info["devices"]}
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "get_device_capability",
                                lambda device=None: caps[torch.device(device).index or 0])
        return torch_info

    return setup


# ---------------------------------------------------------------------------------------------
# This machine, as it is.
# ---------------------------------------------------------------------------------------------


def test_this_machine_is_healthy_and_reports_everything(capsys):
    status, report = run_json(capsys)
    assert status == 0, [f for f in report["findings"] if f["severity"] == "error"]
    assert report["healthy"] and report["exit_status"] == 0
    assert report["flash_attn"]["version"] == flash_attn.__version__
    assert Path(report["flash_attn"]["location"]) == PACKAGE_DIR
    assert report["flash_attn"]["install"] in ("editable", "pip", "conda", "uv", "source tree (not installed)")
    assert report["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["build"] == ("CUDA" if torch.version.cuda else "CPU")
    for key in ("driver", "gpus", "op_library", "aot_kernels", "triton", "copies", "foreign_extensions", "backends"):
        assert key in report
    assert report["op_library"]["loaded"] == op_library.status().loaded


def test_text_output_and_exit_status(capsys):
    status = doctor.main([])
    out = capsys.readouterr().out
    assert status == 0
    assert "flash_attn doctor" in out and f"{flash_attn.__version__} at {PACKAGE_DIR}" in out
    assert "Result: healthy" in out


def test_command_line_entry_points():
    env = dict(os.environ, FLASH_ATTN_BACKEND="auto")
    proc = subprocess.run([sys.executable, "-m", "flash_attn", "doctor", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["flash_attn"]["version"] == flash_attn.__version__
    proc = subprocess.run([sys.executable, "-m", "flash_attn", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "doctor" in proc.stdout and "bench" in proc.stdout


def test_every_documented_check_has_its_function():
    """The table in the package docstring lists each check id once, in the order findings come."""
    documented = re.findall(r"^``([a-z][a-z-]*)`` ", doctor.__doc__, re.MULTILINE)
    assert documented == list(doctor.CHECKS)


def test_cli_reports_a_command_whose_module_is_broken(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "broken", ("flash_attn._no_such_module", "a command that cannot load"))
    assert cli.main(["broken"]) == 2
    assert "flash_attn._no_such_module cannot be loaded" in capsys.readouterr().err
    assert cli.main(["doctor", "--json"]) == 0  # the others still work


# ---------------------------------------------------------------------------------------------
# PyTorch, driver and GPUs.
# ---------------------------------------------------------------------------------------------


def test_cpu_pytorch_on_a_gpu_machine(capsys, gpu_machine):
    gpu_machine(cpu_torch(), driver([A100], cuda_version=12040))
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["torch-cpu-build"][0]
    assert "CPU build" in finding["summary"] and "A100" in finding["summary"]
    assert "CUDA 12" in finding["fix"] and "12.4" in finding["fix"]
    gpu = report["gpus"][0]
    assert gpu["arch"] == "sm_80" and gpu["seen_by"] == "driver" and gpu["auto"] == "reference"
    assert "CPU build" in gpu["why_not_aot"][0]


def test_driver_too_old_for_pytorchs_cuda(capsys, gpu_machine):
    warning = "The NVIDIA driver on your system is too old (found version 11040)."
    gpu_machine(cuda_torch([A100], cuda="12.8", available=False, warning=warning),
                driver([A100], cuda_version=11040, release="470.82.01"))
    status, report = run_json(capsys)
    assert status == 1
    found = checks(report, "error")
    finding = found["driver-too-old"][0]
    assert "470.82.01" in finding["summary"] and "11.4" in finding["summary"] and "12.8" in finding["summary"]
    assert ">= 525.60.13" in finding["fix"]
    assert "torch-cuda-unusable" not in found  # one cause, explained once


def test_driver_too_old_for_the_op_librarys_runtime(capsys, gpu_machine, monkeypatch):
    gpu_machine(cuda_torch([A100], cuda="12.8"), driver([A100], cuda_version=12080))
    monkeypatch.setattr(probes, "probe_op_library", lambda: {
        "loaded": True, "path": "/x/libflash_attn_aot.so", "reason": "", "installed": True,
        "build_config": {"cuda": True, "cuda_runtime": "13.0.48"}})
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["driver-too-old"][0]
    assert "13.0.48" in finding["summary"] and ">= 580" in finding["detail"]


def test_cuda_pytorch_that_cannot_see_the_gpu(capsys, gpu_machine, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    gpu_machine(cuda_torch([A100], available=False, warning="CUDA initialization: no CUDA-capable device is detected"),
                driver([A100]))
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["torch-cuda-unusable"][0]
    assert "no CUDA-capable device" in finding["detail"] and "CUDA_VISIBLE_DEVICES" in finding["fix"]


def _manifest_entry(arch: str, **changes) -> dict:
    """One entry with every field the manifest's schema requires (what the kernel build writes)."""
    entry = {"arch": arch, "key": "fwd", "name": "fwd", "image": f"images/{arch}/fwd", "signature": ["*fp16:16", "i32"],
             "num_warps": 4, "shared": 0, "ptxas": "13.0", "ptx_isa": "9.0"}
    entry.update(changes)
    return {k: v for k, v in entry.items() if v is not _DROP}


_DROP = object()


def _write_manifest(tmp_path, monkeypatch, archs) -> Path:
    """A kernel folder with the manifest layout the kernel build writes, chosen the way the ``aot``
    backend chooses it: ``FLASH_ATTN_AOT_DIR``."""
    folder = tmp_path / "aot"
    folder.mkdir()
    manifest = folder / "manifest.json"
    kernels = [_manifest_entry(a) for a in archs]
    manifest.write_text(json.dumps({"format": 1, "archs": archs, "kernels": kernels}))
    _write_images(folder, kernels)
    monkeypatch.setenv(aot_manifest.DIR_ENV, str(folder))
    return manifest


def _write_images(folder: Path, kernels) -> None:
    """A stand-in file for every entry's image (the doctor checks that they are there)."""
    for entry in kernels:
        if isinstance(entry, dict) and isinstance(entry.get("image"), str):
            (folder / entry["image"]).parent.mkdir(parents=True, exist_ok=True)
            (folder / entry["image"]).write_bytes(b"\x7fELF stand-in")


def test_kernel_folder_set_by_the_environment(capsys, tmp_path, monkeypatch):
    manifest = _write_manifest(tmp_path, monkeypatch, ["sm_80", "compute_80"])
    status, report = run_json(capsys)
    kernels = report["aot_kernels"]
    assert kernels["manifest"] == str(manifest) and kernels["from_env"] is True
    assert kernels["archs"] == ["sm_80", "compute_80"] and kernels["kernel_count"] == 2
    assert status == 0
    doctor.main([])
    assert f"compute_80 ({manifest}, from FLASH_ATTN_AOT_DIR)" in capsys.readouterr().out


def test_kernel_folder_set_by_the_environment_without_a_manifest(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(aot_manifest.DIR_ENV, str(tmp_path / "nothing-here"))
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["aot-kernels"][0]
    assert str(tmp_path / "nothing-here" / "manifest.json") in finding["detail"]
    assert "FLASH_ATTN_AOT_DIR" in finding["fix"]


def _write_raw_manifest(tmp_path, monkeypatch, data) -> Path:
    folder = tmp_path / "aot"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(data))
    _write_images(folder, data.get("kernels", []) if isinstance(data, dict) else [])
    monkeypatch.setenv(aot_manifest.DIR_ENV, str(folder))
    return folder / "manifest.json"


def test_missing_and_damaged_image_files_are_listed(capsys, tmp_path, monkeypatch):
    """The doctor lists every image file that is gone or damaged (a call warns once, naming the
    first it meets)."""
    entries = [_manifest_entry("sm_80", key=f"k{i}", image=f"images/sm_80/k{i}.cubin.zlib") for i in range(4)]
    _write_raw_manifest(tmp_path, monkeypatch, {"format": 1, "kernels": entries})
    folder = tmp_path / "aot"
    (folder / "images/sm_80/k0.cubin.zlib").write_bytes(__import__("zlib").compress(b"\x7fELF"))  # fine
    (folder / "images/sm_80/k1.cubin.zlib").unlink()
    (folder / "images/sm_80/k2.cubin.zlib").write_bytes(b"")
    (folder / "images/sm_80/k3.cubin.zlib").write_bytes(b"garbage")
    _, report = run_json(capsys)
    finding = checks(report, "warning")["aot-kernels"][0]
    assert "3 of the 4 kernel images" in finding["summary"]
    for name, why in (("k1", "No such file"), ("k2", "empty"), ("k3", "not zlib data")):
        assert f"images/sm_80/{name}.cubin.zlib: {why}" in finding["detail"]
    assert "k0" not in finding["detail"] and "reinstall" in finding["fix"]


def test_a_manifest_that_is_valid_json_but_not_a_manifest(capsys, tmp_path, monkeypatch):
    """(Before the schema check, a top-level list made aot.unavailable_reason raise on every call.)"""
    _write_raw_manifest(tmp_path, monkeypatch, [_manifest_entry("sm_80")])
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["aot-kernels"][0]
    assert "must be a JSON object, got list" in finding["detail"]


def test_malformed_manifest_entries_are_listed_and_left_out(capsys, tmp_path, monkeypatch):
    entries = [_manifest_entry("sm_80"), _manifest_entry("sm_90a", key=_DROP), _manifest_entry("sm_90a", ptxas=13),
               _manifest_entry("sm_9x"), _manifest_entry("sm_80", key="bwd", signature=_DROP)]
    _write_raw_manifest(tmp_path, monkeypatch, {"format": 1, "kernels": entries})
    status, report = run_json(capsys)
    kernels = report["aot_kernels"]
    assert kernels["archs"] == ["sm_80"] and kernels["kernel_count"] == 1  # only the well-formed entry
    assert kernels["invalid_entries"]["count"] == 4
    finding = checks(report, "warning")["aot-kernels"][0]
    assert "4 entries" in finding["summary"] and "no 'key'" in finding["detail"] and "'ptxas'" in finding["detail"]
    assert "build-kernels" in finding["fix"]
    doctor.main([])
    assert "4 entries of the kernel manifest are malformed" in capsys.readouterr().out


def test_gpu_arch_without_a_shipped_kernel_covered_by_triton(capsys, gpu_machine, tmp_path, monkeypatch):
    _write_manifest(tmp_path, monkeypatch, ["sm_80", "sm_90a", "sm_100a", "sm_120a"])
    gpu_machine(cuda_torch([RTX_PRO]), driver([RTX_PRO]))
    status, report = run_json(capsys)
    assert report["aot_kernels"]["archs"] == ["sm_80", "sm_90a", "sm_100a", "sm_120a"]
    gpu = report["gpus"][0]
    assert gpu["image"]["kind"] == "unsupported" and gpu["arch"] == "sm_121"
    finding = checks(report)["arch-not-shipped"][0]
    assert finding["severity"] == "warning" and "Triton compiles" in finding["detail"]
    assert "FLASH_ATTN_CUDA_ARCHS='121'" in finding["fix"]
    assert gpu["auto"] == "triton"  # the real dispatcher: no aot backend here, Triton can run
    assert status == 0  # works, only slower to start


def test_gpu_arch_without_a_shipped_kernel_and_no_triton(capsys, gpu_machine, tmp_path, monkeypatch):
    _write_manifest(tmp_path, monkeypatch, ["sm_80", "sm_90a", "sm_100a", "sm_120a"])
    gpu_machine(cuda_torch([RTX_PRO]), driver([RTX_PRO]), triton_installed=False)
    status, report = run_json(capsys)
    assert status == 1
    errors = checks(report, "error")
    assert "only the exact but slow PyTorch reference backend" in errors["arch-not-shipped"][0]["detail"]
    assert "pip install triton" in errors["triton-missing"][0]["fix"]
    assert report["gpus"][0]["auto"] == "reference"
    assert any("triton is not installed" in r for r in report["gpus"][0]["why_not_aot"])


def test_gpu_arch_covered_by_shipped_ptx(capsys, gpu_machine, tmp_path, monkeypatch):
    _write_manifest(tmp_path, monkeypatch, ["sm_80", "sm_90a", "compute_80"])
    gpu_machine(cuda_torch([RTX_PRO]), driver([RTX_PRO]))
    _, report = run_json(capsys)
    assert report["gpus"][0]["image"] == {"kind": "ptx", "arch": "compute_80",
                                          "reason": "no shipped cubin runs on compute capability 12.1; the driver compiles compute_80 PTX"}
    assert checks(report)["arch-not-shipped"][0]["severity"] == "info"


def test_gpu_too_old_for_the_kernels(capsys, gpu_machine):
    gpu_machine(cuda_torch([T4]), driver([T4]))
    status, report = run_json(capsys)
    gpu = report["gpus"][0]
    assert gpu["auto"] == "reference"
    assert any("below the kernels' minimum 8.0" in r for r in gpu["why_not_aot"])
    finding = checks(report)["gpu-backend"][0]
    assert finding["severity"] == "warning" and "8.0" in finding["fix"]
    assert "arch-not-shipped" not in checks(report)  # no build could ship one below 8.0
    assert status == 0, [f for f in report["findings"] if f["severity"] == "error"]  # nothing to fix


def test_triton_missing_where_it_is_needed(capsys, gpu_machine):
    # no ahead-of-time kernels in this installation, an sm_80 GPU, no Triton: auto falls back to reference
    gpu_machine(cuda_torch([A100]), driver([A100]), triton_installed=False)
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["triton-missing"][0]
    assert "GPU 0" in finding["summary"] and "reference backend" in finding["summary"]
    assert "aot:" in finding["detail"]  # says why the ahead-of-time kernels cannot run either


def test_fused_ops_without_triton_run_their_pytorch_path_on_the_gpu(capsys, gpu_machine):
    gpu_machine(cuda_torch([A100]), driver([A100]), triton_installed=False)
    _, report = run_json(capsys)
    finding = checks(report)["fused-ops"][0]
    assert finding["severity"] == "warning" and "PyTorch path" in finding["summary"]
    assert "install triton" in finding["fix"]


def test_fused_ops_with_triton_run_its_kernels(capsys, gpu_machine):
    gpu_machine(cuda_torch([A100]), driver([A100]), triton_installed=True)
    _, report = run_json(capsys)
    finding = checks(report)["fused-ops"][0]
    assert finding["severity"] == "info" and "Triton kernels" in finding["summary"]


def test_fused_ops_without_a_gpu_say_nothing(capsys):
    _, report = run_json(capsys)
    assert "fused-ops" not in checks(report)


def test_triton_missing_on_a_cpu_machine_is_only_information(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    status, report = run_json(capsys)
    assert report["triton"]["installed"] is False
    assert checks(report)["triton-missing"][0]["severity"] == "info"
    assert status == 0


def test_invalid_backend_setting(capsys, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "cudnn")
    status, report = run_json(capsys)
    assert status == 1
    assert "FLASH_ATTN_BACKEND='cudnn'" in checks(report, "error")["backend-env"][0]["summary"]


def test_backend_setting_that_cannot_run_on_the_gpu(capsys, gpu_machine, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "interpret")
    gpu_machine(cuda_torch([A100]), driver([A100]))
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["backend-env"][0]
    assert "FLASH_ATTN_BACKEND=interpret" in finding["summary"] and "CPU tensors only" in finding["detail"]


# ---------------------------------------------------------------------------------------------
# Other copies of flash_attn, and upstream's compiled extension.
# ---------------------------------------------------------------------------------------------


def _fake_upstream_package(root: Path, version="2.8.3") -> Path:
    package = root / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n\nfrom flash_attn.flash_attn_interface import flash_attn_func\n')
    (package / "flash_attn_interface.py").write_text("import flash_attn_2_cuda as flash_attn_gpu\n")
    return package


def test_upstream_wheel_shadowing_this_package(capsys, tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    package = _fake_upstream_package(site)
    monkeypatch.syspath_prepend(str(site))
    # As in a regular (conda/pip) install, sys.path order decides: drop an editable install's
    # redirecting finder, which would otherwise win over any sys.path entry.
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if "Editable" not in type(f).__name__
                                           and "Redirect" not in type(f).__name__])
    status, report = run_json(capsys)
    assert status == 1
    assert report["copies"]["import_resolves_to"] == str(package.resolve())
    finding = checks(report, "error")["shadowed"][0]
    assert str(package.resolve()) in finding["summary"] and "2.8.3" in finding["summary"]
    assert "upstream flash-attn" in finding["detail"] and str(PACKAGE_DIR) in finding["detail"]
    assert "pip uninstall flash-attn" in finding["fix"]


def test_another_copy_later_on_sys_path(capsys, tmp_path, monkeypatch):
    site = tmp_path / "old-site"
    package = _fake_upstream_package(site, version="2.7.4.post1")
    monkeypatch.syspath_prepend(str(PACKAGE_DIR.parent))  # this package first ...
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])  # ... the other one last
    status, report = run_json(capsys)
    assert Path(report["copies"]["import_resolves_to"]) == PACKAGE_DIR
    finding = checks(report, "warning")["other-copy"][0]
    assert str(package.resolve()) in finding["summary"] and "2.7.4.post1" in finding["summary"]
    assert "shadowed" not in checks(report)
    assert status == 0


UNDEFINED = "_ZN3c104cuda9SetDeviceEi"
UNDEFINED_CXX11 = "_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"


def _fake_extension(root: Path, symbol: str) -> Path:
    """A stand-in for upstream's flash_attn_2_cuda that fails exactly like a mismatched build."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "flash_attn_2_cuda.py"
    so = root / f"flash_attn_2_cuda{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    path.write_text(f"raise ImportError({f'{so}: undefined symbol: {symbol}'!r})\n")
    return path


def test_upstream_extension_with_an_undefined_symbol(capsys, tmp_path, monkeypatch):
    _fake_extension(tmp_path / "ext", UNDEFINED)
    monkeypatch.syspath_prepend(str(tmp_path / "ext"))
    monkeypatch.delitem(sys.modules, "flash_attn_2_cuda", raising=False)
    status, report = run_json(capsys)
    (ext,) = report["foreign_extensions"]
    assert ext["module"] == "flash_attn_2_cuda" and not ext["imports"]
    assert ext["undefined_symbol"]["name"] == "c10::cuda::SetDevice"
    finding = checks(report)["foreign-extension"][0]
    if symbols.demangle(UNDEFINED):
        assert "c10::cuda::SetDevice(int)" in finding["summary"]
    assert "C++ ABI / PyTorch version mismatch" in finding["detail"]
    assert f"installed torch {torch.__version__}" in finding["detail"]
    assert "pip uninstall flash-attn" in finding["fix"]
    assert status == 0  # this package is fine; the leftover is a warning


def test_undefined_symbol_of_the_other_cxx_abi(capsys, tmp_path, monkeypatch):
    _fake_extension(tmp_path / "ext", UNDEFINED_CXX11)
    monkeypatch.syspath_prepend(str(tmp_path / "ext"))
    monkeypatch.delitem(sys.modules, "flash_attn_2_cuda", raising=False)
    real = probes.probe_torch()
    monkeypatch.setattr(probes, "probe_torch", lambda: dict(real, cxx11_abi=False))  # a pre-C++11-ABI torch
    _, report = run_json(capsys)
    detail = checks(report)["foreign-extension"][0]["detail"]
    assert "C++ ABI mismatch" in detail
    assert "built with _GLIBCXX_USE_CXX11_ABI=1" in detail and "torch with _GLIBCXX_USE_CXX11_ABI=0" in detail


def test_undefined_symbol_explanations():
    torch_new_abi = {"installed": True, "version": "2.13.0", "cxx11_abi": True}
    same_abi = symbols.explain_undefined_symbol(UNDEFINED_CXX11, torch_new_abi)["explanation"]
    assert "ABI mismatch" not in same_abi and "different PyTorch version" in same_abi
    old_abi_symbol = "_ZN3c106detail14torchCheckFailEPKcS2_jRKSs"  # std::string of the old ABI (Ss)
    assert "_GLIBCXX_USE_CXX11_ABI=0" in symbols.explain_undefined_symbol(old_abi_symbol, torch_new_abi)["explanation"]
    other = symbols.explain_undefined_symbol("_ZN5cudnn7backend4initEv", torch_new_abi)["explanation"]
    assert "PyTorch" not in other and "different version" in other


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="needs a C compiler")
def test_real_shared_library_with_an_undefined_symbol(capsys, tmp_path, monkeypatch):
    """A real extension module whose loading fails in the dynamic linker, as upstream's does."""
    source = tmp_path / "ext.c"
    source.write_text(textwrap.dedent(f"""
        extern void {UNDEFINED}(int);
        void *PyInit_flash_attn_2_cuda(void) {{ {UNDEFINED}(0); return 0; }}
    """))
    folder = tmp_path / "site"
    folder.mkdir()
    target = folder / f"flash_attn_2_cuda{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    compiler = shutil.which("gcc") or shutil.which("cc")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(target), str(source)], check=True, capture_output=True)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "flash_attn_2_cuda", raising=False)
    _, report = run_json(capsys)
    (ext,) = report["foreign_extensions"]
    assert ext["path"] == str(target)
    assert ext["undefined_symbol"]["symbol"] == UNDEFINED
    assert "PyTorch C++ symbol" in ext["undefined_symbol"]["explanation"]


def test_demangling():
    assert symbols.qualified_name_hint(UNDEFINED) == "c10::cuda::SetDevice"
    assert symbols.qualified_name_hint("_ZNK2at10TensorBase8data_ptrEv") == "at::TensorBase::data_ptr"
    assert symbols.qualified_name_hint("not_mangled") is None
    assert symbols.demangle("plain_c_symbol") is None
    readable = symbols.demangle(UNDEFINED_CXX11)
    if readable is None:
        pytest.skip("neither libstdc++'s __cxa_demangle nor c++filt is available")
    assert readable == ("c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, "
                        "std::char_traits<char>, std::allocator<char> >)")


# ---------------------------------------------------------------------------------------------
# The op library and the install method.
# ---------------------------------------------------------------------------------------------


def test_op_library_that_fails_to_load(capsys, tmp_path, monkeypatch):
    """The installed library fails to load: the loader's own words are shown, and the fix is to
    reinstall."""
    broken = tmp_path / "libflash_attn_aot.so"
    broken.write_bytes(b"this is not an ELF file")
    monkeypatch.setattr(op_library, "find_library", lambda: broken)  # the package's own copy
    monkeypatch.setattr(op_library, "_status", None)  # load afresh (restored after the test)
    status, report = run_json(capsys)
    assert status == 1
    assert report["op_library"]["loaded"] is False and report["op_library"]["installed"] is True
    finding = checks(report, "error")["op-library"][0]
    assert "fails to load" in finding["summary"] and str(broken) in finding["detail"]
    assert "the loader says" in finding["detail"] and "too short" in finding["detail"]  # its __cause__
    assert "--force-reinstall" in finding["fix"]


def test_op_library_set_by_the_environment_that_fails_to_load(capsys, tmp_path, monkeypatch):
    """FLASH_ATTN_AOT_LIBRARY names a file that is not a library: the fix is that variable, not a
    reinstall."""
    broken = tmp_path / "libflash_attn_aot.so"
    broken.write_bytes(b"this is not an ELF file, and longer than an ELF header would be........")
    monkeypatch.setenv(op_library.LIBRARY_ENV, str(broken))
    monkeypatch.setattr(op_library, "_status", None)
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["op-library"][0]
    assert "FLASH_ATTN_AOT_LIBRARY" in finding["summary"] and "invalid ELF header" in finding["detail"]
    assert "FLASH_ATTN_AOT_LIBRARY" in finding["fix"] and "reinstall" not in finding["fix"]


def test_op_library_path_that_does_not_exist(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(op_library.LIBRARY_ENV, str(tmp_path / "missing.so"))
    monkeypatch.setattr(op_library, "_status", None)
    status, report = run_json(capsys)
    assert status == 1
    assert "FLASH_ATTN_AOT_LIBRARY" in checks(report, "error")["op-library"][0]["summary"]


def test_op_library_path_that_is_a_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(op_library.LIBRARY_ENV, str(tmp_path))
    monkeypatch.setattr(op_library, "_status", None)
    status, report = run_json(capsys)
    assert status == 1
    finding = checks(report, "error")["op-library"][0]
    assert "is a folder" in finding["summary"] and "does not exist" not in finding["summary"]
    assert "points at a folder" in finding["detail"]


def test_missing_op_library_matters_only_with_a_gpu(capsys, gpu_machine, monkeypatch):
    missing = {"loaded": False, "path": None, "reason": "not installed", "installed": False, "build_config": {}}
    monkeypatch.setattr(probes, "probe_op_library", lambda: missing)
    _, report = run_json(capsys)
    assert checks(report)["op-library"][0]["severity"] == "info"
    gpu_machine(cuda_torch([A100]), driver([A100]))
    _, report = run_json(capsys)
    assert checks(report)["op-library"][0]["severity"] == "warning"


def test_conda_install_is_recognised(tmp_path, monkeypatch):
    meta = tmp_path / "conda-meta"
    meta.mkdir()
    init = os.path.relpath(PACKAGE_DIR / "__init__.py", tmp_path)
    (meta / "flash-attn-2.9.0-py_cuda12_0.json").write_text(json.dumps({
        "name": "flash-attn", "version": "2.9.0", "build": "py_cuda12_0", "channel": "conda-forge",
        "files": ["lib/python3/site-packages/flash_attn/_version.py", init]}))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    info = probes.probe_package()
    assert info["install"] == "conda"
    assert info["conda"] == {"name": "flash-attn", "version": "2.9.0", "build": "py_cuda12_0", "channel": "conda-forge"}


# ---------------------------------------------------------------------------------------------
# Warnings: through `warnings`/`logging`, once per cause, never print.
# ---------------------------------------------------------------------------------------------


def test_fallback_warning_once_per_cause(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert dispatch.chain(torch.device("cuda", 0))[0] == "reference"
        dispatch.chain(torch.device("cuda", 1))
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 2, messages
    assert "cuda:0" in messages[0] and "cuda:1" in messages[1]
    assert all("reference backend" in m and "aot:" in m and "triton:" in m for m in messages)


# Command-line front ends: their output is the product.
# utils/benchmark.py: upstream's benchmark helpers print their measurements when verbose=True (their API)
LIBRARY_MODULES_THAT_MAY_PRINT = {"__main__.py", "doctor/cli.py", "kernel_build/build.py", "kernel_build/amd.py",
                                  "kernel_build/info.py", "kernel_build/proxy.py",
                                  "kernel_build/pool.py",  # the build commands' progress line without tqdm
                                  "utils/benchmark.py"}


def test_library_code_never_prints():
    """Only the command-line front ends print; everything else warns or logs."""
    offenders = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR)
        if relative.as_posix() in LIBRARY_MODULES_THAT_MAY_PRINT or relative.parts[0] == "bench":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{relative}:{node.lineno}")
    assert not offenders, f"print() in library code: {offenders}"


# ---------------------------------------------------------------------------------------------
# ROCm PyTorch on AMD GPUs, Intel and Apple GPUs (simulated: no such GPU is available here).
# ---------------------------------------------------------------------------------------------

MI300X = {"index": 0, "name": "AMD Instinct MI300X", "capability": [9, 4], "memory_bytes": 192 * 2**30,
          "gcn_arch": "gfx942:sramecc+:xnack-"}
MI250X = {"index": 0, "name": "AMD Instinct MI250X", "capability": [9, 0], "memory_bytes": 64 * 2**30,
          "gcn_arch": "gfx90a:sramecc+:xnack-"}


def rocm_torch(devices):
    return {"installed": True, "version": "2.13.0+rocm7.1", "cuda": None, "hip": "7.1.25424", "cxx11_abi": True,
            "build": "ROCm", "cuda_available": True, "devices": [dict(d) for d in devices], "mps_available": False,
            "xpu_available": False}


@pytest.fixture
def rocm_machine(gpu_machine, monkeypatch):
    """A ROCm PyTorch with one AMD GPU; the real dispatcher asks the stubbed torch.cuda."""

    from flash_attn.backends import triton as triton_backend
    from support import rocm

    def setup(device, triton_installed=True):
        rocm.simulate(monkeypatch, device["gcn_arch"])
        dispatch.reset()
        info = gpu_machine(rocm_torch([device]), driver([]), triton_installed)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))  # ROCm's stand-in
        return info

    yield setup
    dispatch.reset()
    triton_backend._device_target.cache_clear()


def test_rocm_with_a_supported_amd_gpu_runs_the_triton_kernels(capsys, rocm_machine):
    rocm_machine(MI300X)
    status, report = run_json(capsys)
    found = checks(report)
    assert status == 0, [f for f in report["findings"] if f["severity"] == "error"]
    assert report["gpus"][0]["auto"] == "triton" and report["gpus"][0]["arch"] == "gfx942"
    rocm = found["torch-rocm"][0]
    assert rocm["severity"] == "info" and "gfx942" in rocm["detail"] and "Unmeasured" in rocm["detail"]
    backend = found["gpu-backend"][0]
    assert backend["severity"] == "info" and "cdna3" in backend["summary"]
    assert "arch-not-shipped" not in found  # no image is meant for AMD GPUs
    assert all(f["severity"] == "info" for f in found.get("aot-kernels", []))


def test_rocm_with_an_amd_gpu_of_no_family_runs_the_reference_and_says_why(capsys, rocm_machine):
    rocm_machine(MI250X)
    _, report = run_json(capsys)
    backend = checks(report)["gpu-backend"][0]
    assert report["gpus"][0]["auto"] == "reference"
    assert backend["severity"] == "warning" and "gfx90a is in no GPU family" in backend["detail"]
    assert "gfx942" in backend["fix"]


def test_rocm_without_triton_says_to_install_rocms_triton(capsys, rocm_machine):
    rocm_machine(MI300X, triton_installed=False)
    _, report = run_json(capsys)
    found = checks(report)
    assert found["torch-rocm"][0]["severity"] == "warning" and "pytorch-triton-rocm" in found["torch-rocm"][0]["fix"]
    missing = checks(report, "error")["triton-missing"][0]
    assert "pytorch-triton-rocm" in missing["fix"]


@pytest.mark.parametrize("kind,words", [("xpu", "triton-xpu"), ("mps", "Apple GPUs")])
def test_intel_and_apple_gpus_run_the_reference_and_the_doctor_says_why(capsys, gpu_machine, kind, words):
    info = dict(cpu_torch(), xpu_available=kind == "xpu", mps_available=kind == "mps")
    gpu_machine(info, driver([]))
    _, report = run_json(capsys)
    finding = checks(report)["other-gpus"][0]
    assert finding["severity"] == "info" and kind in finding["summary"] and words in finding["detail"]


# ---------------------------------------------------------------------------------------------
# FLASH_ATTN_FORCE_FAMILY: a measuring aid the doctor names.
# ---------------------------------------------------------------------------------------------


def test_a_forced_family_is_named_per_gpu(capsys, gpu_machine, monkeypatch):
    """Set, every NVIDIA GPU gets a warning naming it; where the aot backend does not run (these
    simulated GPUs never get it) the finding says so and why."""
    gpu_machine(cuda_torch([A100]), driver([A100]))
    status, report = run_json(capsys)
    assert "forced-family" not in checks(report) and "forced_family" not in report["gpus"][0]
    monkeypatch.setenv("FLASH_ATTN_FORCE_FAMILY", "sm86")
    status, report = run_json(capsys)
    (finding,) = checks(report, "warning")["forced-family"]
    assert "FLASH_ATTN_FORCE_FAMILY=sm86" in finding["summary"] and "A100" in finding["summary"]
    assert finding["detail"].startswith("the aot backend does not run here: ")
    assert "unset FLASH_ATTN_FORCE_FAMILY" in finding["fix"] and report["gpus"][0]["forced_family"] == "sm86"


def test_a_forced_family_that_runs_says_whose_tables_run():
    from flash_attn.doctor import checks as doctor_checks  # noqa: PLC0415

    gpu = {"index": 0, "name": "NVIDIA H200", "capability": [9, 0], "arch": "sm_90", "seen_by": "torch",
           "auto": "aot", "why_not_aot": [], "forced_family": "sm80"}
    (finding,) = doctor_checks.forced_family({"gpus": [gpu], "torch": cuda_torch([gpu])})
    assert finding.severity == "warning" and "sm80 family's launch configs" in finding.detail
