"""Memory of the low-level backward (``_flash_attn_backward`` / ``_flash_attn_varlen_backward``),
which ring / zigzag context parallelism calls once per ring step.

Measured on the CPU with the kernel backends' own planner and executor, as an H100 runs them
(``Target("sm90")``: the fused backward) with the launches stubbed out: every tensor the call
allocates is what it would allocate on the GPU. A dispatch mode sees each new storage, and a
finalizer on it when it is freed, so ``peak`` is the most memory the call held at once on top of
its inputs. The kernels compute Delta themselves (their preprocessing) and write the caller's
dq/dk/dv in place: what is left is the fused kernel's fp32 dQ accumulator and lse-sized vectors
(Delta, ``softmax_d``). Before, the call also made fp32 copies of ``dout`` and ``out`` for
``softmax_d`` and fresh gradients that it then copied: at 16k tokens x 32 heads x 128 per rank
(bf16) the peak was 1156 MiB, now 258 MiB (``python tests/api/test_lowlevel_memory.py 16384 32``).
"""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_varlen_backward

MiB = 2**20


class PeakMemory(TorchDispatchMode):
    """The bytes of storages made inside the block: ``peak`` held at once, ``total`` ever made."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.total = 0
        self._held: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(result):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._held or key in inputs:  # a view, or an in-place result
                continue
            self._held.add(key)
            size = storage.nbytes()
            self.live += size
            self.total += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)
        return result

    def _freed(self, key: int, size: int) -> None:
        self._held.discard(key)
        self.live -= size


def stub_h100(monkeypatch) -> list:
    """The interpret backend planning for an H100 with its launches stubbed; returns, per launch,
    the gradient tensors it got by slot name."""
    from flash_attn import dispatch  # noqa: PLC0415
    from flash_attn.backends import _execute, interpret  # noqa: PLC0415
    from flash_attn.planning.plan import Target  # noqa: PLC0415

    launched = []

    def run_launch(launch, tensors, device):
        launched.append({name: t for name, t in tensors.items() if name in ("dq", "dk", "dv")})

    monkeypatch.setenv("FLASH_ATTN_BACKEND", "interpret")
    monkeypatch.setattr(interpret.BACKEND, "unavailable_reason", lambda device: None)  # Triton may be missing: no launch
    monkeypatch.setattr(interpret._backend, "target", lambda device: Target("sm90", 132))
    monkeypatch.setattr(interpret._backend, "run_launch", run_launch)
    monkeypatch.setattr(interpret._backend, "plans", _execute.PlanCache())
    monkeypatch.setattr(dispatch, "_chains", {})
    monkeypatch.setattr(dispatch, "_failed", {})
    return launched


@pytest.fixture
def h100_plans_no_launches(monkeypatch):
    return stub_h100(monkeypatch)


def dense_call(seqlen, heads, head_dim=128, dtype=torch.bfloat16):
    q, k, v, out, dout = (torch.zeros(1, seqlen, heads, head_dim, dtype=dtype) for _ in range(5))
    lse = torch.zeros(1, heads, seqlen, dtype=torch.float32)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    return _flash_attn_backward._init_fn, (dout, q, k, v, out, lse, *grads, 0.0, 0.1, True, -1, 0, 0.0, None, False,
                                           None)


def varlen_call(seqlen, heads, head_dim=128, dtype=torch.bfloat16):
    """The same tokens packed as four sequences."""
    q, k, v, out, dout = (torch.zeros(seqlen, heads, head_dim, dtype=dtype) for _ in range(5))
    lse = torch.zeros(heads, seqlen, dtype=torch.float32)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    cu = torch.tensor([0, seqlen // 4, seqlen // 2, 3 * seqlen // 4, seqlen], dtype=torch.int32)
    return _flash_attn_varlen_backward._init_fn, (dout, q, k, v, out, lse, *grads, cu, cu, seqlen // 4, seqlen // 4,
                                                  0.0, 0.1, True, -1, 0, 0.0, None, False, None)


def measure(fn, args) -> PeakMemory:
    fn(*args)  # planned once (the plan cache), as in a training loop
    with PeakMemory() as memory:
        fn(*args)
    return memory


@pytest.mark.parametrize("call", [dense_call, varlen_call], ids=["dense", "varlen"])
def test_backward_holds_no_copies_of_its_inputs(h100_plans_no_launches, call):
    seqlen, heads, head_dim = 1024, 8, 128
    fn, args = call(seqlen, heads, head_dim)
    memory = measure(fn, args)
    q_fp32 = seqlen * heads * head_dim * 4  # the fused kernel's dQ accumulator
    rows_fp32 = seqlen * heads * 4  # Delta, softmax_d (with its padding) and its index vectors: lse-sized
    assert memory.peak <= q_fp32 + 8 * rows_fp32, f"peak {memory.peak / MiB:.2f} MiB"
    # before: 18 MiB here, with fp32 copies of dout and out (2 x q_fp32), their product (q_fp32)
    # and fresh dq, dk, dv (1.5 x q_fp32)
    dq, dk, dv = args[6:9]
    written = {name: t for tensors in h100_plans_no_launches for name, t in tensors.items()}
    assert written["dq"] is dq and written["dk"] is dk and written["dv"] is dv  # the launches write them


def test_gradients_the_kernels_cannot_write_in_place_are_copied(h100_plans_no_launches):
    """A row stride that is not a multiple of 8 elements: those gradients come from buffers."""
    fn, args = dense_call(256, 2, 64)
    args = list(args)
    args[6] = torch.zeros(1, 256, 2, 68, dtype=torch.bfloat16)[..., :64]
    measure(fn, args)
    written = {name: t for tensors in h100_plans_no_launches for name, t in tensors.items()}
    assert written["dq"] is not args[6] and written["dk"] is args[7]


if __name__ == "__main__":  # python tests/api/test_lowlevel_memory.py [seqlen heads]: the numbers of the docstring
    seqlen, heads = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16384, 32)
    patch = pytest.MonkeyPatch()
    stub_h100(patch)
    for call in (dense_call, varlen_call):
        m = measure(*call(seqlen, heads))
        print(f"{call.__name__} {seqlen} tokens x {heads} heads x 128 bf16: peak {m.peak / MiB:.1f} MiB, "
              f"allocated {m.total / MiB:.1f} MiB")
    patch.undo()
