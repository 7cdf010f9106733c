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


# ----------------------------------------------------------------------------------------------
# The fast path the backends call, against the readable Philox above
# ----------------------------------------------------------------------------------------------

_SEEDS = [0, 1, 123456789, 2**31 + 5, 0x0123456789ABCDEF, 2**64 - 1]


def _full_range_counters(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counters = [torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64) for _ in range(4)]
    for c in counters:
        c[:3] = torch.tensor([2**32 - 1, 2**31, 2**31 - 1])
    return counters


@pytest.mark.parametrize("wraps", [True, False], ids=["wrapped-multiply", "split-multiply"])
def test_first_word_equals_the_readable_philox(monkeypatch, wraps):
    monkeypatch.setattr(dropout, "_multiply_wraps", lambda device_type: wraps)
    counters = _full_range_counters(5000)
    for seed in _SEEDS + [torch.tensor(-5, dtype=torch.int64)]:
        want = philox4x32(*counters, seed)[0]
        assert torch.equal(dropout.philox_first_word(*counters, seed), want)
    # broadcast counters (columns, rows, heads, batch), with lent buffers larger than needed
    cols, rows = torch.arange(70).view(1, 1, 1, -1), torch.arange(2**32 - 20, 2**32).view(1, 1, -1, 1)
    heads, batch = torch.arange(3).view(1, -1, 1, 1), torch.tensor([0, 2**31]).view(-1, 1, 1, 1)
    buffers = [torch.full((2 * 3 * 20 * 70 + 11,), -1, dtype=torch.int64) for _ in range(5)]
    want = philox4x32(cols, rows, heads, batch, 99)[0].expand(2, 3, 20, 70)
    assert torch.equal(dropout.philox_first_word(cols, rows, heads, batch, 99), want)
    assert torch.equal(dropout.philox_first_word(cols, rows, heads, batch, 99, buffers), want)


def test_this_machine_multiplies_int64_wrapping():
    """The check the fast path relies on, and that it agrees with Python's integers. Other
    devices are not asked (a host read would wait for them): they keep the exact split."""
    assert dropout._multiply_wraps("cpu")
    assert not dropout._multiply_wraps("cuda") and not dropout._multiply_wraps("mps")
    a = torch.tensor([2**32 - 1, 0xDEADBEEF, 7], dtype=torch.int64)
    hi, lo = dropout._mul_hi_lo_wrapped(a, 0xD2511F53)
    assert [(h << 32) | l for h, l in zip(hi.tolist(), lo.tolist())] == [x * 0xD2511F53 for x in a.tolist()]


@pytest.mark.parametrize("p", [0.0, 1e-12, 0.1, 0.25, 0.5, 0.83, 0.999999, 1.0, 1.5])
def test_keep_mask_by_integer_threshold_equals_the_float_comparison(p):
    """``uniform >= p`` as one integer range: checked on random words and on the words around
    the threshold, where a rounding slip would show."""
    smallest = dropout.smallest_kept_word(p)
    near = [max(0, min(2**31 - 1, smallest + d)) for d in range(-3, 4)]
    words = torch.cat([_full_range_counters(20000)[0],
                       torch.tensor(near + [(2**32 - 1) ^ w for w in near] + [0, 2**32 - 1], dtype=torch.int64)])
    want = uint32_to_uniform_float(words) >= torch.tensor(p, dtype=torch.float32)
    got = (words >= smallest) & (words <= 2**32 - 1 - smallest)
    assert torch.equal(got, want)


def test_keep_mask_with_and_without_buffers_is_the_readable_mask():
    heads, rows, cols = torch.arange(4).view(-1, 1, 1), torch.arange(50, 90).view(1, -1, 1), torch.arange(300).view(1, 1, -1)
    for seed, p in [(3, 0.1), (2**63 + 1, 0.5), (11, 0.97)]:
        uniform = uint32_to_uniform_float(philox4x32(cols, rows, heads, torch.tensor(2), seed)[0])
        want = uniform.expand(4, 40, 300) >= torch.tensor(p, dtype=torch.float32)
        buffers = [torch.empty(4 * 40 * 300, dtype=torch.int64) for _ in range(5)]
        assert torch.equal(keep_mask(seed, 2, heads, rows, cols, p), want)
        assert torch.equal(keep_mask(seed, 2, heads, rows, cols, p, buffers), want)
