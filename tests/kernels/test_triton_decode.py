"""KV-cache attention on the Triton kernels (append + rotary, split-KV attention, combine).

Every case runs the launches of :func:`flash_attn.planning.plan.plan_kvcache` and compares with the
float64 oracle of ``tests/oracle.py`` under the tolerance rule of ``tests/conftest.py``:

* ``interpret`` mode: Triton's interpreter on CPU tensors (always runs; shapes are kept small);
* ``triton`` mode: the same cases compiled for the GPU (``@pytest.mark.gpu``, skipped without
  CUDA).

Besides out and lse, each case checks the cache after the call: rows the call writes hold the
(rotated) new k / v, every other row is bit-for-bit unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import pytest
import torch

import oracle
from conftest import check_close, gen

from flash_attn.backends import interpret
from flash_attn.backends._execute import KernelBackend
from flash_attn.params import AttentionParams, KVCacheInputs
from flash_attn.planning import plan

HAS_CUDA = torch.cuda.is_available()

MODES = [
    "interpret",
    pytest.param("triton", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]),
]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


@dataclasses.dataclass(frozen=True)
class Case:
    """One ``flash_attn_with_kvcache`` call. ``seqlens``: cache_seqlens per batch entry."""

    seqlens: tuple
    seqlen_q: int = 1
    nheads: int = 4
    nheads_k: int = 4
    headdim: int = 64
    seqlen_cache: int = 80  # rows per cache sequence (dense) or per block-table row (paged)
    seqlen_new: int = 0
    rotary: Optional[str] = None  # "interleaved" | "neox"
    rotary_dim: Optional[int] = None  # default: headdim rounded down to even
    batch_idx: bool = False  # cache_batch_idx: a permutation into a larger cache
    leftpad: Optional[tuple] = None
    page_size: Optional[int] = None
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # "heads" -> (h,), "batch" -> (b, h)
    num_splits: int = 0
    dtype_tables: bool = False  # rotary tables in the input dtype instead of fp32

    @property
    def batch(self) -> int:
        return len(self.seqlens)


def make_inputs(case: Case, dtype, device, seed: int = 0) -> dict:
    """All arguments of the call, drawn on the CPU and moved to ``device``."""
    g = gen(seed)
    b, sq, h, hk, d = case.batch, case.seqlen_q, case.nheads, case.nheads_k, case.headdim
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    args = {"q": rnd(b, sq, h, d)}
    if case.page_size is None:
        batch_cache = b + 2 if case.batch_idx else b
        args["k_cache"] = rnd(batch_cache, case.seqlen_cache, hk, d)
        args["v_cache"] = rnd(batch_cache, case.seqlen_cache, hk, d)
        if case.batch_idx:
            perm = torch.randperm(batch_cache, generator=g)[:b]
            args["cache_batch_idx"] = perm.to(torch.int32)
    else:
        pages_per_seq = -(-case.seqlen_cache // case.page_size)
        num_pages = b * pages_per_seq + 3
        args["k_cache"] = rnd(num_pages, case.page_size, hk, d)
        args["v_cache"] = rnd(num_pages, case.page_size, hk, d)
        perm = torch.randperm(num_pages, generator=g)[: b * pages_per_seq]
        args["block_table"] = perm.view(b, pages_per_seq).to(torch.int32)
    if case.seqlen_new:
        args["k"] = rnd(b, case.seqlen_new, hk, d)
        args["v"] = rnd(b, case.seqlen_new, hk, d)
    args["cache_seqlens"] = torch.tensor(case.seqlens, dtype=torch.int32)
    if case.leftpad is not None:
        args["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32)
    if case.rotary is not None:
        rd = case.rotary_dim or (d - d % 2)
        capacity = case.seqlen_cache
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        angles = torch.arange(capacity, dtype=torch.float32)[:, None] * inv_freq[None, :]
        args["rotary_cos"], args["rotary_sin"] = angles.cos(), angles.sin()
        if case.dtype_tables:
            args["rotary_cos"], args["rotary_sin"] = args["rotary_cos"].to(dtype), args["rotary_sin"].to(dtype)
    if case.alibi == "heads":
        args["alibi_slopes"] = 0.05 + 0.95 * torch.rand(h, generator=g)
    elif case.alibi == "batch":
        args["alibi_slopes"] = 0.05 + 0.95 * torch.rand(b, h, generator=g)
    return {k: v.to(device) for k, v in args.items()}


def kernel_backend(mode: str, target: Optional[plan.Target] = None, run_launch=None) -> KernelBackend:
    """A backend planning for ``target`` (default: the mode's own, the interpreter's or the
    GPU's) and running launches with ``run_launch`` (default: the mode's). Fresh: no plan cached."""
    if mode == "interpret":
        reason = interpret.unavailable_reason(torch.device("cpu"))
        if reason is not None:
            pytest.skip(f"interpret backend unavailable: {reason}")
        return KernelBackend("test", lambda device: target or interpret.TARGET, run_launch or interpret.run_launch)
    from flash_attn.backends import triton as gpu

    return KernelBackend("test", lambda device: target or gpu._target(device), run_launch or gpu._run_launch)


def run_kernels(case: Case, args: dict, mode: str, num_splits: Optional[int] = None,
                target: Optional[plan.Target] = None, run_launch=None):
    """Our kernels on ``args`` (the cache tensors are mutated). Returns ``(out, lse)``.

    ``target``: plan for it instead of the mode's own (e.g. a GPU family's ahead-of-time set, run
    in the interpreter); ``run_launch``: run each launch with it (e.g. a recorder)."""
    left, right = case.window
    if case.causal:
        right = 0
    params = AttentionParams(softmax_scale=case.headdim ** -0.5, window_left=left, window_right=right,
                             softcap=case.softcap)
    cache = KVCacheInputs(
        k_cache=args["k_cache"], v_cache=args["v_cache"], cache_seqlens=args["cache_seqlens"],
        k_new=args.get("k"), v_new=args.get("v"), cache_batch_idx=args.get("cache_batch_idx"),
        cache_leftpad=args.get("cache_leftpad"), block_table=args.get("block_table"),
        rotary_cos=args.get("rotary_cos"), rotary_sin=args.get("rotary_sin"),
        rotary_interleaved=case.rotary != "neox",
        num_splits=case.num_splits if num_splits is None else num_splits,
    )
    backend = kernel_backend(mode, target, run_launch)
    return backend.forward_kvcache(args["q"], params, cache, alibi_slopes=args.get("alibi_slopes"))


def oracle_result(case: Case, args: dict, compute_dtype=oracle.F64) -> oracle.KVCacheRef:
    cpu = {k: v.cpu() for k, v in args.items()}
    return oracle.kvcache_ref(
        cpu["q"], cpu["k_cache"], cpu["v_cache"], cpu.get("k"), cpu.get("v"),
        rotary_cos=cpu.get("rotary_cos"), rotary_sin=cpu.get("rotary_sin"),
        cache_seqlens=cpu["cache_seqlens"], cache_batch_idx=cpu.get("cache_batch_idx"),
        cache_leftpad=cpu.get("cache_leftpad"), block_table=cpu.get("block_table"),
        softmax_scale=case.headdim ** -0.5, causal=case.causal, window=case.window, softcap=case.softcap,
        rotary_interleaved=case.rotary != "neox", alibi_slopes=cpu.get("alibi_slopes"),
        compute_dtype=compute_dtype,
    )


def check_cache(name: str, after: torch.Tensor, before: torch.Tensor, expected: torch.Tensor,
                written: torch.Tensor, rotated: bool) -> None:
    """Untouched rows bit-identical; written rows equal to the expected (rotated) new rows."""
    after, before = after.cpu(), before.cpu()
    assert torch.equal(after[~written], before[~written]), f"{name}: rows outside the append changed"
    if not written.any():
        return
    got = after[written].double()
    want = expected[written]
    if rotated:
        # fp32 rotation rounded once: within one rounding (half an ulp) of the exact value, plus
        # the fp32 arithmetic itself (which matters for float32 caches)
        bound = torch.finfo(after.dtype).eps * want.abs() + 1e-6
        assert ((got - want).abs() <= bound).all(), f"{name}: rotated rows off by {(got - want).abs().max().item():.3e}"
    else:
        assert torch.equal(got, want), f"{name}: appended rows differ from the new rows"


def check_case(case: Case, dtype, mode: str, seed: int = 0, num_splits: Optional[int] = None,
               transform: Optional[Callable[[dict], dict]] = None, **run_kwargs):
    """Run ``case`` and check out, lse and the cache against the oracle. ``transform`` may change
    the inputs' layout (same values) before the call; ``run_kwargs`` go to :func:`run_kernels`."""
    device = torch.device("cuda" if mode == "triton" else "cpu")
    args = make_inputs(case, dtype, device, seed)
    if transform is not None:
        args = transform(args)
    before = {"k": args["k_cache"].clone(), "v": args["v_cache"].clone()}
    out, lse = run_kernels(case, args, mode, num_splits, **run_kwargs)
    ref = oracle_result(case, {**args, "k_cache": before["k"], "v_cache": before["v"]})
    naive = oracle_result(case, {**args, "k_cache": before["k"], "v_cache": before["v"]}, compute_dtype=None)
    assert out.dtype == dtype and out.shape == args["q"].shape
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (case.batch, case.nheads, case.seqlen_q)
    check_close(out, ref.out, naive.out, dtype, "out")
    check_close(lse, ref.lse, naive.lse, dtype, "lse")
    check_cache("k_cache", args["k_cache"], before["k"], ref.k_cache, ref.written, case.rotary is not None)
    check_cache("v_cache", args["v_cache"], before["v"], ref.v_cache, ref.written, False)
    return out, lse


# ---------------------------------------------------------------------------------------------
# The feature matrix (num_splits=0: the heuristic, which splits these small problems).

CASES = {
    "plain_d64": Case(seqlens=(37, 80)),
    "gqa_append_d32": Case(seqlens=(10, 61, 0), nheads=8, nheads_k=2, headdim=32, seqlen_new=2),
    "mqa_d59_neox_partial": Case(seqlens=(5, 40), nheads=4, nheads_k=1, headdim=59, seqlen_new=3,
                                 rotary="neox", rotary_dim=32),
    # entry 1: 65 keys, the last key block holds only the key on the diagonal of the last row
    "causal_sq3_interleaved": Case(seqlens=(20, 62), seqlen_q=3, seqlen_new=3, rotary="interleaved",
                                   causal=True),
    "noncausal_sq3_interleaved_partial": Case(seqlens=(20, 44), seqlen_q=3, seqlen_new=3,
                                              rotary="interleaved", rotary_dim=16, dtype_tables=True),
    "batch_idx_leftpad": Case(seqlens=(30, 50), nheads=4, nheads_k=2, seqlen_new=2, batch_idx=True,
                              leftpad=(7, 0), causal=True, rotary="neox"),
    "paged16_causal": Case(seqlens=(17, 40), seqlen_q=2, nheads=4, nheads_k=2, seqlen_new=2, page_size=16,
                           causal=True, rotary="interleaved", leftpad=(3, 0)),
    "paged256_d128": Case(seqlens=(100, 3), headdim=128, nheads=2, nheads_k=1, seqlen_cache=256,
                          seqlen_new=1, page_size=256),
    # entry 1: query row 0 sees keys [31, 47], so the first visited key block holds one key;
    # entry 0: the last row sees keys from 33 on, so block [32, 64) is not fully visible
    "window_softcap": Case(seqlens=(44, 45), seqlen_q=4, seqlen_new=4, window=(14, 2), softcap=2.0,
                           nheads=4, nheads_k=2),
    # entry 0: 100 keys; row 1 sees keys [33, 100): key block [32, 64) needs the mask
    "left_window_only": Case(seqlens=(98, 60), seqlen_q=2, seqlen_new=2, seqlen_cache=128, window=(66, -1),
                             nheads=2, nheads_k=2, headdim=32),
    "alibi_causal": Case(seqlens=(25, 60), seqlen_q=2, seqlen_new=2, alibi="heads", causal=True,
                         leftpad=(0, 11)),
    "alibi_batch_softcap": Case(seqlens=(25, 60), alibi="batch", softcap=5.0, headdim=32),
    "empty_rows": Case(seqlens=(0, 6, 4), seqlen_q=4, seqlen_new=2, causal=True, leftpad=(0, 6, 0),
                       headdim=32),
    "no_keys_at_all": Case(seqlens=(5, 9), leftpad=(5, 9), headdim=32, nheads=2, nheads_k=2),
    "many_rows_gqa": Case(seqlens=(12, 40), seqlen_q=20, nheads=8, nheads_k=2, headdim=32,
                          seqlen_new=20, causal=True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_matches_oracle(name, dtype, mode):
    check_case(CASES[name], dtype, mode)


@pytest.mark.parametrize("mode", MODES)
def test_headdim_256(mode):
    check_case(Case(seqlens=(33, 50), nheads=2, nheads_k=1, headdim=256, seqlen_cache=64, seqlen_new=1,
                    rotary="neox", causal=True), torch.float16, mode)


@pytest.mark.parametrize("mode", MODES)
def test_float32_inputs(mode):
    check_case(Case(seqlens=(21, 50), nheads=4, nheads_k=2, seqlen_new=2, rotary="interleaved"),
               torch.float32, mode)


# ---------------------------------------------------------------------------------------------
# Splitting the keys never changes the result beyond rounding.

SPLIT_CASES = {
    "decode_gqa_paged": Case(seqlens=(70, 200), nheads=8, nheads_k=2, headdim=64, seqlen_cache=256,
                             page_size=16, seqlen_new=1, rotary="neox"),
    "causal_window_alibi": Case(seqlens=(90, 150), seqlen_q=3, seqlen_new=3, seqlen_cache=160, causal=True,
                                window=(70, -1), alibi="heads", leftpad=(4, 0), headdim=32),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_num_splits_agree(name, dtype, mode, monkeypatch):
    from flash_attn.planning import kvcache as kv_planner

    chosen = []
    original = kv_planner.choose_num_splits

    def record(*args, **kwargs):
        chosen.append(original(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(kv_planner, "choose_num_splits", record)  # where the KV-cache planner calls it
    results = {n: check_case(SPLIT_CASES[name], dtype, mode, num_splits=n) for n in (1, 3, 0, 1000)}
    # 3 requested splits may become fewer where the key blocks are fewer (wide GPU key blocks);
    # 0 (the heuristic) splits only caches of at least 2 * MIN_BLOCKS_PER_SPLIT blocks
    assert chosen[0] == 1 and chosen[1] > 1, f"splits used: {chosen}"
    out1, lse1 = results[1]
    for n, (out, lse) in results.items():
        # same inputs, different summation order only
        assert (out.float() - out1.float()).abs().max().item() <= 4 * torch.finfo(dtype).eps, f"num_splits={n}"
        assert torch.equal(torch.isinf(lse), torch.isinf(lse1))
        finite = torch.isfinite(lse1)
        assert (lse[finite] - lse1[finite]).abs().max().item() <= 1e-5, f"num_splits={n}"


def test_split_heuristic():
    choose = plan.choose_num_splits
    assert choose(1, programs=1, key_blocks=100, sms=108) == 1  # 1 = no split
    assert choose(3, programs=1, key_blocks=100, sms=108) == 3  # honoured
    assert choose(50, programs=1, key_blocks=4, sms=108) == 4  # clamped to the key blocks
    assert choose(0, programs=200, key_blocks=100, sms=108) == 1  # the SMs are already busy
    assert choose(0, programs=8, key_blocks=1000, sms=108) == 26  # 208 of 216 slots (2 per SM)
    assert choose(0, programs=1, key_blocks=2000, sms=132) == 118  # <= MAX_SPLITS, 17 blocks each
    assert choose(0, programs=2, key_blocks=20, sms=108) == 2  # >= 8 blocks per split
    assert choose(0, programs=2, key_blocks=5, sms=108) == 1  # too few blocks to split
    assert choose(0, programs=2, key_blocks=70, sms=8) == 8  # 8 splits of 9 blocks (the last 7)
    assert choose(0, programs=4, key_blocks=0, sms=108) == 1
    # a last wave nearly empty costs a whole wave: 150 programs on 264 slots run best as 7 splits
    # (1,050 programs in 3.98 waves), not 2 (300 in 1.14)
    assert choose(0, programs=150, key_blocks=1024, sms=132) == 7
    # the best split counts measured on an H100 (132 SMs; d128, 128-key blocks, 8 KV heads;
    # benchmarks/README.md, "Decode"): batch x cache -> programs, key blocks -> splits
    assert choose(0, programs=8, key_blocks=128, sms=132) == 16  # batch 1, 16k
    assert choose(0, programs=8, key_blocks=1024, sms=132) == 32  # batch 1, 128k
    assert choose(0, programs=32, key_blocks=128, sms=132) == 8  # batch 4, 16k
    assert choose(0, programs=32, key_blocks=1024, sms=132) == 8  # batch 4, 128k (9: 0.65x FA2 on an H200)
    assert choose(0, programs=128, key_blocks=1024, sms=132) == 2  # batch 16, 128k
    assert choose(0, programs=512, key_blocks=128, sms=132) == 1  # batch 64


# ---------------------------------------------------------------------------------------------
# Through the public API and the dispatcher.


@pytest.mark.parametrize("mode", MODES)
def test_public_api(mode, monkeypatch):
    from flash_attn import dispatch
    from flash_attn.flash_attn_interface import flash_attn_with_kvcache

    reason = dispatch.unavailable_reason(mode, torch.device("cuda" if mode == "triton" else "cpu"))
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", mode)
    case = Case(seqlens=(20, 44), seqlen_q=2, nheads=4, nheads_k=2, seqlen_new=2, rotary="neox", causal=True)
    device = torch.device("cuda" if mode == "triton" else "cpu")
    args = make_inputs(case, torch.float16, device)
    before = {"k": args["k_cache"].clone(), "v": args["v_cache"].clone()}
    out, lse = flash_attn_with_kvcache(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"],
        rotary_cos=args["rotary_cos"], rotary_sin=args["rotary_sin"], cache_seqlens=args["cache_seqlens"],
        causal=True, rotary_interleaved=False, return_softmax_lse=True,
    )
    ref = oracle_result(case, {**args, "k_cache": before["k"], "v_cache": before["v"]})
    naive = oracle_result(case, {**args, "k_cache": before["k"], "v_cache": before["v"]}, compute_dtype=None)
    check_close(out, ref.out, naive.out, torch.float16, "out")
    check_close(lse, ref.lse, naive.lse, torch.float16, "lse")
    check_cache("k_cache", args["k_cache"], before["k"], ref.k_cache, ref.written, True)
