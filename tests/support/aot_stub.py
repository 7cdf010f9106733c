"""The benchmark's stub of the ``aot`` backend as a pytest fixture (:func:`flash_attn.bench.overhead.
stubbed_aot`: the installed sm_90a images, the real op library checking CPU tensors and counting the
launches instead of running them), and inputs for it. What it can show: which tensors reach the
library, which plan runs and how often; not the kernels' numbers (the GPU acceptance run computes
those against the oracle through the same routes)."""

import pytest
import torch

from flash_attn.backends import aot


@pytest.fixture
def stub(monkeypatch):
    """The stubbed aot backend; the Python side's op library calls recorded: (plan, tensors
    passed, results); yields ``(calls, counted)``, ``counted()`` the launches the library counted."""
    from flash_attn.bench import overhead  # noqa: PLC0415

    monkeypatch.setenv("FLASH_ATTN_BACKEND", "aot")
    try:
        context = overhead.stubbed_aot()
        counted = context.__enter__()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    calls = []
    real = aot._launch

    def recording(launches, passed, rows):
        made = real(launches, passed, rows)
        calls.append((launches.plan, tuple(passed), made))
        return made

    monkeypatch.setattr(aot, "_launch", recording)
    try:
        yield calls, counted
    finally:
        context.__exit__(None, None, None)


def bf16(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at the same shape and strides, starting 2 bytes past a 16-byte boundary."""
    base = torch.empty(t.numel() + 8, dtype=t.dtype)
    view = base[1:1 + t.numel()].view(t.shape).copy_(t)
    assert view.stride() == t.stride() and view.data_ptr() % 16 != 0
    return view
