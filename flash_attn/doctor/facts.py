"""All the doctor's facts in one dict: what each probe reports, plus one row per GPU that merges
PyTorch's view (else the driver's) with the shipped kernel image and the backend ``auto`` picks."""

from __future__ import annotations

from typing import Any

from flash_attn.aot import forced
from flash_attn.aot.archs import select_image
from flash_attn.doctor import probes
from flash_attn.planning.families import gcn_processor


def collect() -> dict:
    """All facts. The probes are looked up on their module, so tests that replace them take effect."""
    facts: dict[str, Any] = {}
    facts["flash_attn"] = probes.probe_package()
    facts["python"] = probes.probe_python()
    facts["torch"] = probes.probe_torch()
    facts["driver"] = probes.probe_driver()
    facts["op_library"] = probes.probe_op_library()
    facts["aot_kernels"] = probes.probe_kernels()
    facts["triton"] = probes.probe_triton()
    facts["copies"] = probes.probe_copies()
    facts["foreign_extensions"] = probes.probe_foreign_extensions()
    facts["backends"] = (probes.probe_backends(facts["torch"]) if facts["torch"].get("installed")
                         else {"devices": [], "routes": []})
    facts["gpus"] = merge_gpus(facts)
    return facts


def merge_gpus(facts: dict) -> list[dict]:
    """One row per GPU: PyTorch's view when it has one, else the driver's; plus the backend."""
    torch_devices = facts["torch"].get("devices") or []
    source = "torch" if torch_devices else "driver"
    devices = torch_devices or facts["driver"].get("devices") or []
    by_index = {d["index"]: d for d in facts["backends"].get("devices", [])}
    shipped = facts["aot_kernels"].get("archs") or []
    gpus = []
    for device in devices:
        gpu = dict(device, seen_by=source)
        cap = device.get("capability")
        if device.get("gcn_arch"):  # AMD (ROCm): named by its processor; no image ships for it
            gpu["arch"] = gcn_processor(device["gcn_arch"])
        elif cap:
            gpu["arch"] = f"sm_{cap[0]}{cap[1]}"
            if shipped:
                choice = select_image((cap[0], cap[1]), shipped)
                gpu["image"] = {"kind": choice.kind, "arch": choice.arch.name if choice.arch else None,
                                "reason": choice.reason}
            if forced.forced_family():
                gpu["forced_family"] = forced.forced_family()
        backend = by_index.get(device["index"])
        if backend is not None:
            gpu["auto"] = backend["auto"]
            gpu["why_not_aot"] = [] if backend["auto"] == "aot" else backend["reasons"]
            gpu["triton_reason"] = backend.get("triton_reason")
            if "requested_reason" in backend:
                gpu["requested_reason"] = backend["requested_reason"]
        else:
            gpu["auto"] = "reference"
            gpu["why_not_aot"] = [why_torch_cannot_use_gpus(facts["torch"])]
        gpus.append(gpu)
    return gpus


def why_torch_cannot_use_gpus(torch_info: dict) -> str:
    if not torch_info.get("installed"):
        return "PyTorch is not importable"
    if torch_info.get("build") == "CPU":
        return f"PyTorch {torch_info.get('version')} is a CPU build"
    if torch_info.get("build") == "ROCm" and not torch_info.get("cuda_available"):
        return "PyTorch is a ROCm build that sees no AMD GPU (and cannot drive NVIDIA GPUs)"
    why = torch_info.get("cuda_warning") or torch_info.get("cuda_error") or "torch.cuda.is_available() is False"
    return "PyTorch cannot use CUDA: " + why
