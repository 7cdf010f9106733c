"""The test options, the hooks that apply them, and the fixtures every test folder shares.

Options
-------
``--flash-backend NAME`` (default ``cpu`` on the CPU, ``reference`` on other devices): every test
runs with ``FLASH_ATTN_BACKEND=NAME`` (set per test by an autouse fixture), so the same suite checks
the Triton / AOT GPU backends (and, with ``reference``, the exact tiled definition alone).
``--flash-device DEV`` (default ``cpu``): the device the tests put their tensors on
(``--flash-device cuda`` runs the same tests on a GPU).
``--flash-poison {auto,on,off}``: ``torch.empty`` and its kin return NaN-filled tensors in every
test (``support/poison.py``), so a result read from memory nobody wrote fails on every run; ``auto``
(the default) poisons on the CPU only (on a GPU it adds a fill per allocation to what the GPU tests
count and time: ``on`` asks for it there).
``--flash-no-skip`` (for ``.ci/gpu-check``): a skipped test fails, unless its reason is one of
:data:`EXPECTED_SKIPS` (right on a GPU machine), so a backend or device that was unavailable
cannot pass as a skip.

Under ``FLASH_ATTN_STRICT_BACKEND=1`` a call the named backend refuses raises
``BackendRefusedError``. A test that fails that way for one of the planner's refusals by design
(:data:`DESIGNED_REFUSALS`: fp32 inputs, ``return_attn_probs`` on aot, ...) is reported as skipped,
"refused by design: ..."; any other refusal (an image the driver cannot load, ...) fails.

The helpers the tests import (the tolerance rule, inputs, the oracle, ...) are in ``tests/support/``
(see its ``__init__``); this file holds only pytest's options, hooks and fixtures.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from support import options, poison


def pytest_addoption(parser):
    group = parser.getgroup("flash_attn")
    group.addoption("--flash-backend", default=None,
                    help="FLASH_ATTN_BACKEND used by the tests (default: cpu on the CPU, else reference)")
    group.addoption("--flash-device", default="cpu",
                    help="device the tests create their tensors on (default: cpu; e.g. cuda)")
    group.addoption("--flash-no-skip", action="store_true",
                    help="a skip fails unless its reason is expected on a GPU machine (.ci/gpu-check)")
    group.addoption("--flash-poison", choices=("auto", "on", "off"), default="auto",
                    help="torch.empty and its kin return NaN-filled tensors in every test (support/poison.py): "
                         "auto (the default) on the CPU only")


# Skips that are right on a GPU machine, which --flash-no-skip lets pass: tests of the behaviour
# without a GPU, tests of two GPUs on a machine with one (support/gpus.py; without any
# GPU its reason differs and fails), tools of a CUDA toolkit the runner lacks, an interpreter
# older than the kernels need (a GPU runner's Triton is PyTorch's, e.g. 3.6 with torch 2.11; its
# GPU compiler runs them, which the triton steps check), a comparison with upstream's source where no
# copy of it is (the recorded table is tested everywhere), tests that override the config table
# or the target for the interpreter (the GPU runs its own table's entries in other tests), and
# refusals by design (below).
EXPECTED_SKIPS = (
    "checks the behaviour without a usable GPU",
    "GPU backends may be available on this device",
    "a GPU is present",
    "a second GPU is absent",
    "cuobjdump not found",
    "interpreter cannot run these kernels",
    "upstream's git mirror is not on this machine",
    "interpreter only: ",
    "refused by design: ",
)
# The planner's refusals by design (Refusal(by="planner") of flash_attn/planning/; not shipped ahead of time:
# flash_attn/aot/specializations.py), as BackendRefusedError words them under
# FLASH_ATTN_STRICT_BACKEND=1: "... refused this <op>: <why>". Any other refusal (an image missing
# from the build, one the driver cannot load) fails.
DESIGNED_REFUSALS = re.compile(
    r"refused this \w+: (torch\.float(32|64) inputs \(the kernels take fp16/bf16\)"
    r"|return_attn_probs \(a testing feature\) is not compiled ahead of time"
    r"|paged K/V in the varlen forward \(not compiled ahead of time\)"
    r"|the backward of paged K/V"
    r"|head dimension( of v)? \d+ > \d+"
    r"|head dimension( of v)? \d+ \(the ahead-of-time kernels need a multiple of \d+\)"
    r"|head dimension \d+ with softcap, ALiBi or dropout \(its images are of plain calls only\)"
    r"|head dimension \d+ on \w+ \(compiled ahead of time for .*\)"
    r"|head dimension \d+ in the KV-cache call \(compiled ahead of time up to \d+\)"
    r"|qv with head dims \d+/\d+ on \w+ \(MLA's absorbed queries are compiled ahead of time for .*\)"
    r"|\w+ needs \d+ programs on grid axis \d+ \(CUDA allows \d+\)"
    r"|[kv]_cache is not 16-byte aligned"
    r"|[kv]_cache has strides .*: not multiples of \d+ elements with a contiguous last dimension)"
)


def _designed_refusal(exc: BaseException):
    """The BackendRefusedError in ``exc``'s chain when it is a refusal by design, else None."""
    from flash_attn import dispatch  # noqa: PLC0415

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, dispatch.BackendRefusedError):
            return exc if DESIGNED_REFUSALS.search(str(exc)) else None
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None and not hasattr(report, "wasxfail"):
        refusal = _designed_refusal(call.excinfo.value)
        if refusal is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"refused by design: {refusal}")
    if item.config.getoption("--flash-no-skip") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(expected in reason for expected in EXPECTED_SKIPS):
            report.outcome = "failed"
            report.longrepr = f"--flash-no-skip: skipped, which counts as a failure here: {reason}"
    return report


def pytest_configure(config):
    os.environ["FLASH_ATTN_BACKEND"] = options.configure(config.getoption("--flash-backend"),
                                                         config.getoption("--flash-device"))


@pytest.fixture(autouse=True)
def _flash_backend_env(monkeypatch):
    """Every test runs under ``FLASH_ATTN_BACKEND=<--flash-backend>`` and starts from the same
    global RNG state (dropout seeds come from ``torch.manual_seed``)."""
    monkeypatch.setenv("FLASH_ATTN_BACKEND", options.backend_name())
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _poisoned_empty(request):
    """Uninitialised memory poisoned in every test (``--flash-poison``)."""
    setting = request.config.getoption("--flash-poison")
    if setting == "off" or (setting == "auto" and options.test_device().type != "cpu"):
        yield
        return
    with poison.poisoned_empty():
        yield


@pytest.fixture
def device() -> torch.device:
    return options.test_device()


@pytest.fixture
def scratch(tmp_path):
    """``tmp_path``, removed when the test ends, passed or failed: for the tests that fill it with
    virtual environments and builds (GBs), so that the suite needs the disk of the largest of them,
    not of all of them (pytest keeps every ``tmp_path`` of a run until the run ends)."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)
