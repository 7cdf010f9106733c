"""The doctor's verdict on where calls run is the dispatcher's own decision
(:func:`flash_attn.dispatch.route`), checked for every ``FLASH_ATTN_*`` setting the package reads at
run time: for each value, what ``python -m flash_attn doctor --json`` says about CPU tensors is
what a call does (the backend it runs on, or the very error it raises), and a setting under which
calls raise fails the doctor. Every ``FLASH_ATTN_*`` name in the package's source is in the table
below, so a new variable fails until its values are added."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import flash_attn
from flash_attn import dispatch, doctor, flash_attn_func

PACKAGE = Path(flash_attn.__file__).resolve().parent
# Read at run time: the values to try (valid ones and invalid ones).
RUNTIME_SETTINGS = {
    "FLASH_ATTN_BACKEND": ["auto", "aot", "triton", "interpret", "cpu", "reference", "", "cudnn"],
    "FLASH_ATTN_STRICT_BACKEND": ["1", "0", "yes", "maybe"],
    "FLASH_ATTN_CPU_ONEDNN": ["auto", "1", "0", "off", "bogus"],
    "FLASH_ATTN_DEBUG": ["1", "0"],
    "FLASH_ATTN_AOT_DIR": ["{missing}"],
    "FLASH_ATTN_AOT_LIBRARY": ["{missing}", "{folder}"],
    "FLASH_ATTN_FORCE_FAMILY": ["sm80", "sm86", "", "bogus"],  # the aot backend's (GPU) diagnostic
}
# Read by the build only (CMakeLists.txt, the kernel build): nothing at run time depends on them.
BUILD_SETTINGS = ("FLASH_ATTN_CUDA_ARCHS", "FLASH_ATTN_CPU_ONLY")
CASES = [(name, value) for name, values in RUNTIME_SETTINGS.items() for value in values]


def test_every_variable_the_package_reads_is_in_the_table():
    names = set()
    for path in PACKAGE.rglob("*.py"):
        names.update(re.findall(r"FLASH_ATTN_[A-Z0-9_]+", path.read_text()))
    assert names == set(RUNTIME_SETTINGS) | set(BUILD_SETTINGS)


def _report(capsys) -> tuple[int, dict]:
    status = doctor.main(["--json"])
    return status, json.loads(capsys.readouterr().out)


def _call(dtype, seqlen):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seqlen, 2, 16, generator=g).to(dtype) for _ in range(3))
    return flash_attn_func(q, k, v, causal=True)


@pytest.mark.parametrize(("variable", "value"), CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_the_doctor_says_what_a_call_on_the_cpu_does(variable, value, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "auto")  # the suite sets its own backend for every test
    monkeypatch.setenv(variable, value.format(missing=tmp_path / "missing", folder=tmp_path))
    monkeypatch.setattr(dispatch, "_chains", {})  # a fresh process's decisions
    status, report = _report(capsys)
    (cpu,) = [r for r in report["backends"]["routes"] if r["device"] == "cpu"]
    assert report["backends"]["settings"][variable] == value.format(missing=tmp_path / "missing", folder=tmp_path)
    calls = [(torch.float16, 24), (torch.float32, 320)]  # the second large enough for oneDNN's products
    if cpu["error"]:
        for dtype, seqlen in calls:
            with pytest.raises(Exception) as raised:
                _call(dtype, seqlen)
            assert str(raised.value) == cpu["error"]
        assert status == 1
        assert any(cpu["error"].split(":")[0] in f["summary"] for f in report["findings"] if f["severity"] == "error")
        return
    for dtype, seqlen in calls:
        _call(dtype, seqlen)
        assert dispatch.last_backend() in cpu["backends"]
    _call(torch.float16, 24)  # a call every backend takes: the first one runs it
    assert dispatch.last_backend() == cpu["backends"][0]
    assert not [f for f in report["findings"] if f["check"] == "backend-env"]


def test_the_text_report_says_where_calls_run(monkeypatch, capsys):
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    monkeypatch.setattr(dispatch, "_chains", {})
    assert doctor.main([]) == 0
    text = capsys.readouterr().out
    assert re.search(r"Calls run on:\n  cpu\s+reference backend", text)
    assert "cpu backend" not in text.replace("reference backend", "")


def test_the_troubleshooting_page_says_what_the_doctor_says(monkeypatch, capsys):
    """docs/troubleshooting.md lists every check the doctor has, in its order, and its example of
    a setting under which nothing runs is the doctor's output for that setting, line for line."""
    page = (PACKAGE.parent / "docs" / "troubleshooting.md").read_text()
    table = re.findall(r"^\| `([a-z-]+)`(?: / `([a-z-]+)`)? \|", page, re.MULTILINE)
    documented = [name for row in table for name in row if name]
    assert documented == list(doctor.CHECKS)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "aot")
    monkeypatch.setattr(dispatch, "_chains", {})
    doctor.main([])
    text = capsys.readouterr().out
    example = page.split("A setting under which nothing runs", 1)[1]
    example = re.search(r"```text\n(.*?)```", example, re.S).group(1)
    printed = {" ".join(line.split()) for line in text.splitlines()}  # the device column's width varies
    for line in example.splitlines():
        if line.strip():
            assert " ".join(line.split()) in printed, line
