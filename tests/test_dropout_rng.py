"""The dropout RNG: Philox4x32-10 in int64 PyTorch, bit-identical to Triton's ``tl.philox``.

The Triton comparison runs in a child process because ``TRITON_INTERPRET=1`` must be set before
Triton is first imported (and other tests in this process may import it normally).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flash_attn import dropout
from flash_attn.dropout import dropout_uniform, keep_mask, philox4x32, uint32_to_uniform_float

_TRITON_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    import triton.language as tl
    from flash_attn.dropout import keep_mask, philox4x32, uint32_to_uniform_float


    @triton.jit
    def philox_kernel(words_ptr, uniform_ptr, keep_ptr, c0_ptr, c1_ptr, c2_ptr, c3_ptr, seed, p, n,
                      BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        c0 = tl.load(c0_ptr + offs, mask=inside)
        c1 = tl.load(c1_ptr + offs, mask=inside)
        c2 = tl.load(c2_ptr + offs, mask=inside)
        c3 = tl.load(c3_ptr + offs, mask=inside)
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
        tl.store(words_ptr + offs * 4 + 0, r0.to(tl.int32, bitcast=True), mask=inside)
        tl.store(words_ptr + offs * 4 + 1, r1.to(tl.int32, bitcast=True), mask=inside)
        tl.store(words_ptr + offs * 4 + 2, r2.to(tl.int32, bitcast=True), mask=inside)
        tl.store(words_ptr + offs * 4 + 3, r3.to(tl.int32, bitcast=True), mask=inside)
        uniform = tl.uint_to_uniform_float(r0)
        tl.store(uniform_ptr + offs, uniform, mask=inside)
        tl.store(keep_ptr + offs, (uniform >= p).to(tl.int8), mask=inside)


    def as_int32(x):  # uint32 values (int64 tensor) -> the same bits as int32
        return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


    n = 4096
    gen = torch.Generator().manual_seed(2024)
    counters = [torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64) for _ in range(4)]
    # Small counters (the common case: positions and head/batch indices) and the extremes.
    counters[0][:64] = torch.arange(64)
    for c in counters[1:]:
        c[:64] = torch.arange(64) % 3
    for c in counters:
        c[64] = 2**32 - 1
        c[65] = 2**31
        c[66] = 2**31 - 1
    failures = 0
    for seed, p in [(0, 0.1), (1, 0.5), (123456789, 0.25), (2**31 + 5, 0.9), (0x0123456789ABCDEF, 0.5),
                    (2**62 - 1, 0.3), (2**64 - 1, 0.7)]:
        words = torch.empty(n * 4, dtype=torch.int32)
        uniform = torch.empty(n, dtype=torch.float32)
        keep = torch.empty(n, dtype=torch.int8)
        philox_kernel[(triton.cdiv(n, 512),)](words, uniform, keep, *map(as_int32, counters), seed, p, n, BLOCK=512)
        ours = torch.stack(philox4x32(*counters, seed), dim=-1).reshape(-1)
        our_uniform = uint32_to_uniform_float(philox4x32(*counters, seed)[0])
        our_keep = keep_mask(seed, counters[3], counters[2], counters[1], counters[0], p)
        ok = (torch.equal(ours, words.to(torch.int64) & 0xFFFFFFFF)
              and torch.equal(our_uniform.view(torch.int32), uniform.view(torch.int32))
              and torch.equal(our_keep, keep.bool()))
        if not ok:
            failures += 1
            print("mismatch for seed", seed)
    print("OK" if failures == 0 else "FAILED")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_bit_identical_to_triton_philox_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("OK"), result.stdout


def test_random123_known_answer():
    """Philox4x32-10 of counter 0 under key 0, from the Random123 known-answer tests."""
    zero = torch.zeros((), dtype=torch.int64)
    words = [int(w) for w in philox4x32(zero, zero, zero, zero, seed=0)]
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_split_multiply_is_exact():
    gen = torch.Generator().manual_seed(0)
    a = torch.cat([torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64),
                   torch.tensor([0, 1, 0xFFFF, 0x10000, 2**31, 2**32 - 1])])
    for const in (0xD2511F53, 0xCD9E8D57, 0xFFFFFFFF, 1):
        hi, lo = dropout._mul_hi_lo(a, const)
        for x, h, l in zip(a.tolist(), hi.tolist(), lo.tolist()):
            assert (h << 32) | l == x * const


def test_uniform_is_in_unit_interval_at_the_extremes():
    words = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    u = uint32_to_uniform_float(words)
    assert u.dtype == torch.float32 and torch.all(u >= 0) and torch.all(u < 1)
    assert u[0] == 0 and u[-1] == 0  # 0xffffffff is int32 -1, folded to ~(-1) == 0


@pytest.mark.parametrize("p", [0.1, 0.5, 0.83])
def test_kept_fraction_is_one_minus_p(p):
    n_rows, n_cols = 512, 1024
    keep = keep_mask(77, 3, torch.arange(2).view(2, 1, 1), torch.arange(n_rows).view(1, -1, 1),
                     torch.arange(n_cols).view(1, 1, -1), p)
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.float().mean().item() - (1 - p)) < 6 * sigma
    # Rows and columns are not correlated: each row's kept fraction is binomial too.
    per_row = keep.float().mean(-1)
    assert abs(per_row.std().item() - (p * (1 - p) / n_cols) ** 0.5) < 0.2 * (p * (1 - p) / n_cols) ** 0.5


def test_mask_is_a_pure_function_of_its_coordinates():
    rows, cols = torch.arange(37).view(-1, 1), torch.arange(53).view(1, -1)
    full = keep_mask(5, 1, 2, rows, cols, 0.4)
    assert full.shape == (37, 53)
    # Any tiling gives the same bits; scalars broadcast; other heads/batches/seeds differ.
    assert torch.equal(full[10:20, 7:30], keep_mask(5, 1, 2, rows[10:20], cols[:, 7:30], 0.4))
    assert bool(keep_mask(5, 1, 2, 11, 13, 0.4)) == bool(full[11, 13])
    assert not torch.equal(full, keep_mask(5, 1, 3, rows, cols, 0.4))
    assert not torch.equal(full, keep_mask(5, 0, 2, rows, cols, 0.4))
    assert not torch.equal(full, keep_mask(6, 1, 2, rows, cols, 0.4))
    assert torch.all(keep_mask(5, 1, 2, rows, cols, 0.0))
    assert torch.equal(dropout_uniform(5, 1, 2, rows, cols) >= 0.4, full)
