"""The doctor's report as text: a summary of the installation, one block per GPU, the findings
(errors first) and a verdict."""

from __future__ import annotations

from typing import Optional

from flash_attn.aot.manifest import DIR_ENV
from flash_attn.doctor.report import SEVERITIES, Report


def _gib(n: Optional[int]) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n else "?"


def _install_text(pkg: dict) -> str:
    if pkg["install"] == "editable":
        return f"editable install of {pkg.get('source')}"
    if pkg["install"] == "conda" and pkg.get("conda"):
        c = pkg["conda"]
        return f"conda: {c.get('channel') or '?'}::{c.get('name')}-{c.get('version')}-{c.get('build')}"
    return pkg["install"]


def _torch_text(torch_info: dict) -> str:
    if not torch_info.get("installed"):
        return f"not importable: {torch_info.get('error')}"
    build = torch_info["build"] + (f" {torch_info['cuda']}" if torch_info.get("cuda") else "")
    return f"{torch_info['version']} ({build} build; CUDA usable: {'yes' if torch_info.get('cuda_available') else 'no'})"


def _driver_text(driver: dict) -> str:
    if not driver.get("found"):
        return "none found"
    return (f"{driver.get('release') or '?'} (CUDA {driver.get('cuda_version_text') or '?'})"
            + (f"; {driver['error']}" if driver.get("error") else ""))


def _kernels_text(kernels: dict) -> str:
    if not kernels.get("manifest"):
        return "none (no manifest.json in the package)"
    where = kernels["manifest"] + (f", from {DIR_ENV}" if kernels.get("from_env") else "")
    return f"{', '.join(kernels['archs']) or 'none'} ({where})"


def _summary_rows(f: dict) -> list[tuple[str, str]]:
    pkg, py, op = f["flash_attn"], f["python"], f["op_library"]
    if op.get("loaded"):
        op_text = f"{op['path']} (CUDA runtime {(op.get('build_config') or {}).get('cuda_runtime') or 'none'})"
    else:
        op_text = f"not loaded: {op.get('reason')}"
    triton = f["triton"]
    return [
        ("flash_attn", f"{pkg['version']} at {pkg['location']} ({_install_text(pkg)})"),
        ("Python", f"{py['version']} ({py['executable']})"),
        ("PyTorch", _torch_text(f["torch"])),
        ("NVIDIA driver", _driver_text(f["driver"])),
        ("op library", op_text),
        ("shipped kernels", _kernels_text(f["aot_kernels"])),
        ("Triton", triton.get("version") if triton.get("installed") else triton.get("error")),
        ("FLASH_ATTN_BACKEND", f.get("backends", {}).get("requested", "auto")),
    ] + _other_settings(f.get("backends", {}).get("settings", {}))


def _other_settings(settings: dict) -> list[tuple[str, str]]:
    others = {k: v for k, v in settings.items() if k != "FLASH_ATTN_BACKEND"}
    return [("other settings", ", ".join(f"{k}={v}" for k, v in others.items()))] if others else []


def _route_lines(routes: list[dict]) -> list[str]:
    """Where a call on each device runs, with the environment as set (the dispatcher's decision)."""
    lines = []
    width = max((len(r["device"]) for r in routes), default=0)
    for r in routes:
        if r.get("error"):
            lines.append(f"  {r['device'].ljust(width)}  every call raises: {r['error']}")
        else:
            first, *rest = r["backends"]
            then = f" (a call it refuses: {', then '.join(rest)})" if rest else ""
            lines.append(f"  {r['device'].ljust(width)}  {first} backend{then}")
    return lines


def _gpu_lines(gpus: list[dict]) -> list[str]:
    if not gpus:
        return ["  none visible"]
    lines = []
    for gpu in gpus:
        lines.append(f"  [{gpu['index']}] {gpu.get('name')}  {gpu.get('arch', '?')}  {_gib(gpu.get('memory_bytes'))}"
                     f"  -> auto: {gpu.get('auto')}")
        if gpu.get("image"):
            lines.append(f"      image: {gpu['image']['reason']}")
        lines += [f"      not aot: {reason}" for reason in gpu.get("why_not_aot") or ()]
    return lines


def _finding_lines(report: Report) -> list[str]:
    order = {s: i for i, s in enumerate(SEVERITIES)}
    shown = sorted(report.findings, key=lambda x: order[x.severity])
    if not shown:
        return ["  none"]
    lines = []
    for finding in shown:
        lines.append(f"  [{finding.severity.upper()}] {finding.summary}  ({finding.check})")
        if finding.detail:
            lines.append(f"      why: {finding.detail}")
        if finding.fix:
            lines.append(f"      fix: {finding.fix}")
    return lines


def render_text(report: Report, strict: bool = False) -> str:
    """The report as the text ``python -m flash_attn doctor`` prints."""
    rows = _summary_rows(report.facts)
    width = max(len(k) for k, _ in rows)
    verdict = "healthy" if report.exit_status(strict) == 0 else "problems found"
    return "\n".join([
        "flash_attn doctor", "",
        *(f"  {k.ljust(width)}  {v}" for k, v in rows),
        "", "Calls run on:", *_route_lines(report.facts.get("backends", {}).get("routes", [])),
        "", "GPUs:", *_gpu_lines(report.facts["gpus"]),
        "", "Findings:", *_finding_lines(report),
        "", f"Result: {verdict} ({len(report.errors)} error(s), {len(report.warnings)} warning(s))",
    ])
