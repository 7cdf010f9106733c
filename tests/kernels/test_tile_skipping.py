"""Causal and sliding-window attention skip fully masked tiles, and mask only the edge tiles.

Two views of the same property:

* the tile-range helpers that every kernel loops over (:func:`masking.key_block_range` for the
  forward and dQ kernels, :func:`masking.query_block_range` for dK/dV) are run in Triton's
  interpreter for every block and compared with a brute-force census of the visibility matrix:
  a block visits exactly the tiles holding at least one visible entry, and applies the mask
  exactly to the tiles that are only partly visible;
* the forward kernel itself runs in the interpreter at seqlen 1024 with ``BLOCK_N = 64`` while
  its tile helper calls are counted: the key tiles it visits are the triangular count.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from flash_attn.backends import _interpreter as interpreter
from flash_attn.kernels import forward, masking
from flash_attn.planning import configs  # noqa: E402
from flash_attn.params import AttentionParams


@triton.jit
def _ranges_probe(Out, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  KEYS_OF_QUERY_BLOCK: tl.constexpr):
    """Out[pid] = (lo, mid_lo, mid_hi, hi) of block ``pid``, from the helpers the kernels use."""
    pid = tl.program_id(0)
    if KEYS_OF_QUERY_BLOCK:
        lo, mid_lo, mid_hi, hi = masking.key_block_range(pid * BLOCK_M, seqlen_q, seqlen_k, window_left, window_right,
                                                         BLOCK_M, BLOCK_N, True)
    else:
        lo, mid_lo, mid_hi, hi = masking.query_block_range(pid * BLOCK_N, seqlen_q, seqlen_k, window_left,
                                                           window_right, BLOCK_M, BLOCK_N, True)
    tl.store(Out + pid * 4 + 0, lo)
    tl.store(Out + pid * 4 + 1, mid_lo)
    tl.store(Out + pid * 4 + 2, mid_hi)
    tl.store(Out + pid * 4 + 3, hi)


def visible(sq, sk, left, right):
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    diag = i + sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def _tiles(lo, hi, step):
    return list(range(lo, hi, step))


def census(sq, sk, left, right, block_m, block_n, keys_of_query_block=True):
    """Per block: (tiles with any visible entry, tiles partly visible), from brute force."""
    vis = visible(sq, sk, left, right)
    if not keys_of_query_block:
        vis = vis.T  # key blocks over query tiles
        block_m, block_n = block_n, block_m
    rows, cols = vis.shape
    result = []
    for r0 in range(0, rows, block_m):
        any_tiles, partial = set(), set()
        for c0 in range(0, cols, block_n):
            tile = vis[r0:r0 + block_m, c0:c0 + block_n]
            if tile.any():
                any_tiles.add(c0)
                if not tile.all() or tile.shape[1] < block_n:  # partial tiles need the bounds mask too
                    partial.add(c0)
        result.append((any_tiles, partial))
    return result


def probe(sq, sk, left, right, block_m, block_n, keys_of_query_block=True):
    nblocks = triton.cdiv(sq if keys_of_query_block else sk, block_m if keys_of_query_block else block_n)
    out = torch.full((nblocks, 4), -1, dtype=torch.int32)
    interpreter.launch(_ranges_probe, (nblocks,), out, sq, sk, left, right, BLOCK_M=block_m, BLOCK_N=block_n,
                       KEYS_OF_QUERY_BLOCK=keys_of_query_block)
    return out.tolist()


CASES = [
    # (sq, sk, window_left, window_right, BLOCK_M, BLOCK_N)
    (1024, 1024, -1, 0, 128, 64),  # causal, the forward's sm80 blocks
    (1024, 1024, -1, 0, 64, 64),
    (1000, 1000, -1, 0, 128, 64),  # not multiples of the blocks
    (300, 1024, -1, 0, 64, 64),  # sq < sk: bottom-right aligned
    (1024, 300, -1, 0, 64, 32),  # sq > sk: leading rows see nothing
    (1024, 1024, 100, 0, 64, 64),  # sliding window
    (777, 900, 37, 5, 32, 64),
    (512, 512, -1, 40, 64, 16),  # right-only window
    (512, 512, 50, -1, 16, 64),  # left-only window
    (1, 1024, -1, 0, 16, 64),  # decode-like
]


@pytest.mark.parametrize("keys_of_query_block", [True, False], ids=["key_tiles", "query_tiles"])
@pytest.mark.parametrize("sq,sk,left,right,block_m,block_n", CASES)
def test_tile_ranges_visit_exactly_the_visible_tiles(sq, sk, left, right, block_m, block_n, keys_of_query_block):
    step = block_n if keys_of_query_block else block_m
    expected = census(sq, sk, left, right, block_m, block_n, keys_of_query_block)
    got = probe(sq, sk, left, right, block_m, block_n, keys_of_query_block)
    for block, ((lo, mid_lo, mid_hi, hi), (any_tiles, partial)) in enumerate(zip(got, expected)):
        assert lo <= mid_lo <= mid_hi <= hi
        assert lo % step == 0 and (mid_lo % step == 0 or mid_lo == hi) and (mid_hi % step == 0 or mid_hi == hi)
        masked = set(_tiles(lo, mid_lo, step)) | set(_tiles(mid_hi, hi, step))
        unmasked = set(_tiles(mid_lo, mid_hi, step))
        assert masked | unmasked == any_tiles, f"block {block}: visits {sorted(masked | unmasked)}"
        assert masked == partial, f"block {block}: masks {sorted(masked)}, partly visible {sorted(partial)}"


def test_causal_1024_visits_the_triangle_not_the_square():
    """Counted from the bounds the kernels use: BLOCK_N = 64, causal, seqlen 1024."""
    block_m, block_n, n = 128, 64, 1024
    got = probe(n, n, -1, 0, block_m, block_n)
    visited = sum(len(_tiles(lo, hi, block_n)) for lo, _, _, hi in got)
    # block i (rows 128 i .. 128 i + 127) needs key tiles 0 .. 2 i + 1
    triangular = sum(2 * i + 2 for i in range(n // block_m))
    assert visited == triangular == 72
    assert visited < (n // block_m) * (n // block_n) == 128
    masked = sum(len(_tiles(lo, ml, block_n)) + len(_tiles(mh, hi, block_n)) for lo, ml, mh, hi in got)
    assert masked == 2 * (n // block_m)  # only the two diagonal tiles of each block


def test_forward_kernel_visits_triangular_key_tiles(monkeypatch):
    """Run the forward kernel itself (interpreter, seqlen 1024, BLOCK_N 64) and count its tiles.

    The interpreted clone of the tile loop gets a counting wrapper around its score helper, which
    the loop calls once per visited key tile (with the stage's ``MASKED`` flag).
    """
    block_m, block_n, n = 64, 64, 1024
    monkeypatch.setitem(configs.INTERPRETER_CONFIGS, "fwd", configs.Config(block_m, block_n, 1, 1))
    loop = interpreter.interpreted(forward._attend_key_tiles)
    scope = loop.fn.__globals__
    real_masking = scope["masking"]
    calls = {True: 0, False: 0}
    masked_index = real_masking.logits_log2.arg_names.index("MASKED")

    def counting_logits(*args):
        calls[bool(args[masked_index])] += 1
        return real_masking.logits_log2(*args)

    monkeypatch.setitem(scope, "masking", type(real_masking)("masking_counted"))
    for name, value in vars(real_masking).items():
        setattr(scope["masking"], name, value)
    scope["masking"].logits_log2 = counting_logits

    from flash_attn.backends import interpret
    from flash_attn.backends._execute import KernelBackend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 1, 16, generator=g).half() for _ in range(3))
    fresh = KernelBackend("interpret", lambda device: interpret.TARGET, interpret.run_launch)  # no cached plan
    out, lse, _ = fresh.forward(q, k, v, AttentionParams(0.25, -1, 0))
    blocks = n // block_m
    assert calls[True] + calls[False] == blocks * (blocks + 1) // 2  # 136, not 256
    assert calls[True] == blocks  # the diagonal tile of each block is the only masked one
    assert torch.isfinite(lse).all()
