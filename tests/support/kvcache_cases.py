"""The KV-cache cases run on the Triton kernels (kernels/test_triton_decode.py) and on the
ahead-of-time superset (planning/test_decode_superset.py): one ``flash_attn_with_kvcache`` call
each (:class:`Case`), its inputs, our kernels' launches (``interpret``: Triton's interpreter on
CPU tensors; ``triton``: compiled for the GPU), and the check against the float64 oracle under the
tolerance rule: out, lse, and the cache after the call (rows the call writes hold the (rotated)
new k / v, every other row is bit-for-bit unchanged).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import pytest
import torch

from flash_attn.backends import interpret
from flash_attn.backends._execute import KernelBackend
from flash_attn.params import AttentionParams, KVCacheInputs
from flash_attn.planning import plan

from support import oracle
from support.inputs import gen
from support.tolerance import check_close

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
    headdim_v: Optional[int] = None  # the v cache's (and the output's) head dim; None: headdim
    sinks: bool = False  # attention sinks, one fp32 logit per query head
    qv: bool = False  # MLA's absorbed queries (like q with v's head dim)

    @property
    def batch(self) -> int:
        return len(self.seqlens)

    @property
    def dim_v(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def softmax_scale(self) -> float:
        return (self.headdim + (self.dim_v if self.qv else 0)) ** -0.5


def make_inputs(case: Case, dtype, device, seed: int = 0) -> dict:
    """All arguments of the call, drawn on the CPU and moved to ``device``."""
    g = gen(seed)
    b, sq, h, hk, d, dv = case.batch, case.seqlen_q, case.nheads, case.nheads_k, case.headdim, case.dim_v
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    args = {"q": rnd(b, sq, h, d)}
    if case.page_size is None:
        batch_cache = b + 2 if case.batch_idx else b
        args["k_cache"] = rnd(batch_cache, case.seqlen_cache, hk, d)
        args["v_cache"] = rnd(batch_cache, case.seqlen_cache, hk, dv)
        if case.batch_idx:
            perm = torch.randperm(batch_cache, generator=g)[:b]
            args["cache_batch_idx"] = perm.to(torch.int32)
    else:
        pages_per_seq = -(-case.seqlen_cache // case.page_size)
        num_pages = b * pages_per_seq + 3
        args["k_cache"] = rnd(num_pages, case.page_size, hk, d)
        args["v_cache"] = rnd(num_pages, case.page_size, hk, dv)
        perm = torch.randperm(num_pages, generator=g)[: b * pages_per_seq]
        args["block_table"] = perm.view(b, pages_per_seq).to(torch.int32)
    if case.seqlen_new:
        args["k"] = rnd(b, case.seqlen_new, hk, d)
        args["v"] = rnd(b, case.seqlen_new, hk, dv)
    if case.qv:
        args["qv"] = rnd(b, sq, h, dv)
    if case.sinks:
        # of either sign around the scores' scale: some rows' denominators dominated by them
        args["sinks"] = 2.0 * torch.randn(h, generator=g)
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
    params = AttentionParams(softmax_scale=case.softmax_scale, window_left=left, window_right=right,
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
    extras = {name: args[name] for name in ("sinks", "qv") if name in args}
    return backend.forward_kvcache(args["q"], params, cache, alibi_slopes=args.get("alibi_slopes"), **extras)


def oracle_result(case: Case, args: dict, compute_dtype=oracle.F64) -> oracle.KVCacheRef:
    cpu = {k: v.cpu() for k, v in args.items()}
    return oracle.kvcache_ref(
        cpu["q"], cpu["k_cache"], cpu["v_cache"], cpu.get("k"), cpu.get("v"),
        rotary_cos=cpu.get("rotary_cos"), rotary_sin=cpu.get("rotary_sin"),
        cache_seqlens=cpu["cache_seqlens"], cache_batch_idx=cpu.get("cache_batch_idx"),
        cache_leftpad=cpu.get("cache_leftpad"), block_table=cpu.get("block_table"),
        softmax_scale=case.softmax_scale, causal=case.causal, window=case.window, softcap=case.softcap,
        rotary_interleaved=case.rotary != "neox", alibi_slopes=cpu.get("alibi_slopes"),
        compute_dtype=compute_dtype, qv=cpu.get("qv"), sinks=cpu.get("sinks"),
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
    assert out.dtype == dtype and out.shape == (*args["q"].shape[:-1], case.dim_v)
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
    # beyond FlashAttention-2: v's own head dim, sinks (rows without keys get lse = sink), MLA's qv
    "dv128_append_rotary": Case(seqlens=(30, 61), nheads=4, nheads_k=2, headdim=192, headdim_v=128, seqlen_new=2,
                                rotary="neox", causal=True),
    "sinks_paged_window": Case(seqlens=(17, 40), seqlen_q=2, nheads=4, nheads_k=2, seqlen_new=2, page_size=16,
                               window=(10, 0), sinks=True, softcap=3.0),
    "sinks_no_keys": Case(seqlens=(0, 6, 4), seqlen_q=4, seqlen_new=2, causal=True, leftpad=(0, 6, 0), headdim=32,
                          sinks=True),
    "mla_qv_64_512": Case(seqlens=(21, 70), nheads=16, nheads_k=1, headdim=64, headdim_v=512, seqlen_new=1,
                          rotary="neox", qv=True, sinks=True, leftpad=(2, 0)),
    # without rotary the attention kernel appends the new rows itself, reading them from k / v
    "batch_idx_append": Case(seqlens=(30, 50), nheads=4, nheads_k=2, seqlen_new=2, batch_idx=True, leftpad=(7, 0),
                             causal=True),
    # one query row seeing the last 2 keys: the first 2 of the 4 new rows lie in a key block no
    # program attends (the interpreter's 32-key blocks: rows 62, 63 of entry 0, 30, 31 of entry 1),
    # yet they are appended
    "unseen_new_rows": Case(seqlens=(62, 30), seqlen_new=4, window=(1, 0), nheads=2, nheads_k=1, headdim=32),
    "mla_qv_append": Case(seqlens=(21, 70), nheads=16, nheads_k=1, headdim=64, headdim_v=512, seqlen_new=2,
                          qv=True, leftpad=(2, 0)),
}

# Splitting the keys never changes the result beyond rounding (kernels/test_triton_decode.py).
SPLIT_CASES = {
    "decode_gqa_paged": Case(seqlens=(70, 200), nheads=8, nheads_k=2, headdim=64, seqlen_cache=256,
                             page_size=16, seqlen_new=1, rotary="neox"),
    "causal_window_alibi": Case(seqlens=(90, 150), seqlen_q=3, seqlen_new=3, seqlen_cache=160, causal=True,
                                window=(70, -1), alibi="heads", leftpad=(4, 0), headdim=32),
    # the sink joins each row's sum once, whatever the number of splits (the combine adds it)
    "sinks_gqa_dv": Case(seqlens=(70, 200), nheads=8, nheads_k=2, headdim=64, headdim_v=32, seqlen_cache=256,
                         seqlen_new=1, sinks=True),
    "mla_qv_d512": Case(seqlens=(90, 150), nheads=4, nheads_k=1, headdim=64, headdim_v=512, seqlen_cache=160,
                        qv=True, sinks=True),
    # 16 new rows appended by the attention kernel (its most): they cross pages (entry 1), key
    # blocks (entry 0) and splits, and the rows of the kv head span two row blocks
    "long_append_paged": Case(seqlens=(20, 47), seqlen_q=16, seqlen_new=16, nheads=8, nheads_k=1, headdim=32,
                              seqlen_cache=96, page_size=16, causal=True),
}
