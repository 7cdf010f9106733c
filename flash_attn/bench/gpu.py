"""GPU benchmark: forward and forward+backward TFLOPs of this package's ``aot`` and ``triton``
backends against every SDPA backend PyTorch has (flash, efficient, cudnn) and upstream
flash-attn's ``flash_attn_2_cuda`` when it imports.

Shapes follow the usual FlashAttention benchmark: ``batch * seqlen = total_tokens`` (16k) and
``heads * headdim = hidden`` (2048), so every sequence length does the same number of tokens.
Timing: CUDA events around each call after warm-up, the median of the repeats. TFLOPs use
:func:`flash_attn.bench.common.attention_flops` (``4*b*h*sq*sk*d``, halved for causal;
x3.5 for forward+backward).

Before a training case is timed, each implementation's output and gradients on the case's inputs
are compared with float32 attention by PyTorch's math path (:func:`check`, :func:`reference`): the
errors (relative to the reference's largest magnitude) go into the row's ``err_out``/``err_grad``
and ``check``; a result of this package beyond :data:`CHECK_TOLERANCE` is an ``error`` row and is
not timed.

Every timed row also has the host's CPU time per call (``host_ms``, calls back to back) and, where
that is a large share of the event time, ``host_alone_ms`` (the calling thread's for one call timed
alone, after a synchronisation, as the event time is: an event time above ``host_alone_ms`` plus the
GPU's is time neither spends on the call) and, on a GPU, the GPU's own time per call (``gpu_ms``);
``host_bound`` where the host's time exceeds the GPU's (:func:`host_bound`).

Rows are written as they are measured (``bench-gpu.jsonl`` and ``bench-gpu.csv``), so a run cut
short keeps what it measured. A row of this package's backends that crashed, or that another
backend ran (:func:`flash_attn.dispatch.last_backend`), is an ``error`` and makes the command exit
1; so is one whose backend is unavailable under ``FLASH_ATTN_STRICT_BACKEND=1``. Other
implementations' exceptions are ``unsupported`` (their kernels reject some shapes).

Beyond FlashAttention-2 (on by default, issue 44's targets): head dim 512 and 192/128 (v's own head
dim) training against cuDNN and the others where they run the shape, and attention sinks
(``learnable_sink``) at d64/d128 against the same call without them (the table's own d64/d128
rows: the same shapes); FLOPs count q.k and p.v at their own widths.

Decode (on by default): ``flash_attn_with_kvcache`` with one new query token over a full KV cache
(batch 1-64, cache 4k-128k, 32 query / 8 KV heads, d=128, bf16) against SDPA on the same cache.
Decode is memory-bound, so its rows report GB/s (bytes of the K and V cache read, plus q read and
out written, over the time) and that as a percentage of the memory bandwidth measured in the same
process by a large device-to-device copy (bytes read + written over its time) and of the nominal
figure of the device (:data:`NOMINAL_BANDWIDTH`). A size that does not fit in the free GPU memory
is a ``skipped`` row, not an error.

Method (issue 42): each case is timed in ``config["rounds"]`` rounds with the implementations in a
rotated order (:func:`round_orders`), the repeats split over the rounds; each row has the median of
all its times and ``spread_pct``, the range of its round medians. Decode also runs as a real step
(:func:`decode_step_cases`: the new token's k/v appended at each sequence's ``cache_seqlens``, a
contiguous and a paged cache), checked against :func:`decode_step_reference` before it is timed.
PyTorch's ``flex_attention``, compiled, is the Triton peer (``flex``).

The mma.sync proxy (issue 48, ``config["family"]``, ``--family``): our ``aot`` images with the
planner's family forced (:mod:`flash_attn.aot.forced`) beside SDPA flash; rows say the family and
what the proxy is (:func:`proxy_note`), and :func:`proxy_ratios` pairs each case with SDPA flash.

The timer, the device and the free-memory probe are parameters, so the plumbing runs on a CPU in
the tests.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Optional

from flash_attn.bench import common
from flash_attn.bench.common import attention_flops, summarize

DEFAULT_IMPLS = ("flash_attn[aot]", "flash_attn[triton]", "sdpa[flash]", "sdpa[efficient]", "sdpa[cudnn]", "flex",
                 "upstream")
Timer = Callable[[Callable[[], None], int, int], list]

# The rows beyond FlashAttention-2: head dims (v's where it differs) and attention sinks
BEYOND_CASES = ({"headdim": 512}, {"headdim": 192, "headdim_v": 128}, {"headdim": 64, "sinks": True},
                {"headdim": 128, "sinks": True})
DECODE_BATCHES = (1, 4, 16, 64)
DECODE_CACHELENS = (4096, 16384, 65536, 131072)
# a Llama-3-8B-like layer: 32 query heads sharing 8 KV heads
DECODE_SHAPE = {"heads": 32, "kv_heads": 8, "headdim": 128, "dtype": "bf16"}
# a decode call captured in a CUDA graph is timed over this many back-to-back replays: one replay's
# host cost (a few us) then overlaps the GPU's work, as in a server's decode loop
GRAPH_REPLAYS = 20
# the rows of an eager decode call, of one in a CUDA graph, and of a decode step (new k/v appended;
# contiguous and paged cache)
DECODE_PASSES = ("decode", "decode_graph", "decode_step", "decode_step_paged")
COPY_BYTES = 2 << 30  # the bandwidth probe copies 2 GiB (4 GiB moved): long enough to hide launch cost
# left free beside a decode case's tensors: split-KV partial results, SDPA's workspace, allocator rounding
DECODE_HEADROOM = 1 << 30
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
# Nominal memory bandwidth (bytes/s) from NVIDIA's data sheets, by device name: the first
# (substring, label) that the name contains wins, so the H100 variants come before plain "H100".
NOMINAL_BANDWIDTH = (
    ("H200", "H200", 4.8e12),
    ("H100 NVL", "H100 NVL", 3.9e12),
    ("H100 PCIe", "H100 PCIe", 2.0e12),
    ("H100", "H100 SXM", 3.35e12),
)


@dataclass
class Implementation:
    name: str
    # why it cannot run on the device at all (None: it can); checked once
    unavailable: Callable[[object], Optional[str]]
    # run(q, k, v, dout, causal, sinks): forward, and backward when dout is given; sinks: fp32 (heads,)
    # attention sinks or None (raises NotImplementedError where the implementation has none)
    run: Callable
    context: Callable[[], ContextManager] = contextlib.nullcontext
    backend: Optional[str] = None  # this package's backend that must run the calls (None: not ours)
    # decode(q, k_cache, v_cache) -> out: one query token over the whole cache (None: no such call)
    decode: Optional[Callable] = None
    # forward(q, k, v, causal, sinks=None) -> out, for the check against the reference before timing (None: not
    # checked); raises NotImplementedError for sinks where the implementation has none
    forward: Optional[Callable] = None
    # decode_step(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table) -> out: the new token's k/v
    # appended at cache_seqlens per sequence, then attention over the updated cache (None: no such call;
    # raises NotImplementedError for a paged cache where it has none)
    decode_step: Optional[Callable] = None


@contextlib.contextmanager
def _backend_env(name: str):
    old = os.environ.get("FLASH_ATTN_BACKEND")
    os.environ["FLASH_ATTN_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLASH_ATTN_BACKEND", None)
        else:
            os.environ["FLASH_ATTN_BACKEND"] = old


def _autograd_run(forward: Callable) -> Callable:
    """``run`` of :class:`Implementation` from ``forward(q, k, v, causal, sinks)``."""
    def run(q, k, v, dout, causal, sinks=None):
        out = forward(q, k, v, causal, sinks)
        if dout is not None:
            out.backward(dout)
            q.grad = k.grad = v.grad = None
            if sinks is not None:
                sinks.grad = None
    return run


def _ours(backend: str) -> Implementation:
    from flash_attn import dispatch, flash_attn_func, flash_attn_with_kvcache  # noqa: PLC0415

    def forward(q, k, v, causal, sinks=None):
        return flash_attn_func(q, k, v, causal=causal, learnable_sink=sinks)

    return Implementation(
        f"flash_attn[{backend}]",
        lambda device: dispatch.unavailable_reason(backend, device),
        _autograd_run(forward),
        lambda: _backend_env(backend),
        backend,
        decode=lambda q, k_cache, v_cache: flash_attn_with_kvcache(q, k_cache, v_cache),
        forward=forward,
        decode_step=lambda q, k_cache, v_cache, k_new, v_new, seqlens, block_table: flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens, block_table=block_table),
    )


def sdpa_forward(q, k, v, causal: bool, sinks=None):
    """PyTorch's SDPA on our ``(batch, seqlen, heads, headdim)`` layout (whichever SDPA backend the
    caller's ``sdpa_kernel`` context allows); it has no attention sinks."""
    import torch.nn.functional as F  # noqa: PLC0415

    if sinks is not None:
        raise NotImplementedError("SDPA has no attention sinks")
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}  # k/v heads shared by groups of q heads
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         **gqa)
    return out.transpose(1, 2)  # back to (batch, seqlen, heads, headdim), like dout


def _sdpa(label: str, backend_name: str) -> Implementation:
    def unavailable(device):
        try:
            from torch.nn.attention import SDPBackend  # noqa: PLC0415
        except ImportError as exc:
            return f"torch.nn.attention is missing ({exc})"
        if not hasattr(SDPBackend, backend_name):
            return f"this PyTorch has no SDPA backend {backend_name}"
        return None

    def context():
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        return sdpa_kernel(getattr(SDPBackend, backend_name))

    return Implementation(f"sdpa[{label}]", unavailable, _autograd_run(sdpa_forward), context, decode=sdpa_decode,
                          forward=sdpa_forward, decode_step=sdpa_decode_step)


def sdpa_decode(q, k_cache, v_cache):
    """One query token with grouped KV heads through SDPA without copying the cache: the query
    heads that share a KV head become rows of one query block (as FA2's decode does), which every
    SDPA backend takes, non-causal, since the one token sees the whole cache. ``enable_gqa`` would
    say the same but not every backend takes it, and repeating K/V would read 4x the bytes."""
    import torch.nn.functional as F  # noqa: PLC0415

    batch, _, heads, headdim = q.shape
    kv_heads = k_cache.shape[2]
    # query head h uses KV head h // (heads / kv_heads): group the query heads by KV head
    q_rows = q.reshape(batch, kv_heads, heads // kv_heads, headdim)
    out = F.scaled_dot_product_attention(q_rows, k_cache.transpose(1, 2), v_cache.transpose(1, 2))
    return out.reshape(batch, 1, heads, headdim)


def sdpa_decode_step(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=None):
    """A decode step through SDPA as a PyTorch model without flash-attn does it: the new k/v
    written into the cache at each sequence's length (``index_put_``), then :func:`sdpa_decode`'s
    grouped query over the cache with a mask of each sequence's keys (so only SDPA backends that
    take a mask run it: flash does not). No paged cache: SDPA has none."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    if block_table is not None:
        raise NotImplementedError("SDPA has no paged KV cache")
    batch, _, heads, headdim = q.shape
    kv_heads = k_cache.shape[2]
    rows = torch.arange(batch, device=q.device)
    positions = cache_seqlens.long()
    k_cache.index_put_((rows, positions), k_new[:, 0])
    v_cache.index_put_((rows, positions), v_new[:, 0])
    keys = torch.arange(k_cache.shape[1], device=q.device)
    mask = (keys[None, :] <= positions[:, None]).view(batch, 1, 1, -1)  # each sequence's keys, the new one included
    q_rows = q.reshape(batch, kv_heads, heads // kv_heads, headdim)
    out = F.scaled_dot_product_attention(q_rows, k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=mask)
    return out.reshape(batch, 1, heads, headdim)


# flex_attention compiled by torch.compile (what it is timed as); False: eager flex (the CPU tests'
# stand-in for the plumbing: the same semantics without inductor)
FLEX_COMPILE = True
# distinct (shape, mask) compiles one run makes: above dynamo's default limit (8), which would
# otherwise fall back to eager flex and time that
FLEX_RECOMPILES = 256


def flex_unavailable(device) -> Optional[str]:
    """Why PyTorch's ``flex_attention`` cannot run on ``device`` at all (None: it can try; what it
    refuses for a case, e.g. a head dim, is learnt by trying: an ``unsupported`` row)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401, PLC0415
    except ImportError:
        return "this PyTorch has no flex_attention"
    if getattr(device, "type", device) == "cuda" and FLEX_COMPILE:
        try:
            import triton  # noqa: F401, PLC0415
        except ImportError:
            return "flex_attention compiles Triton kernels on CUDA: triton is not installed"
    return None


def _flex() -> Implementation:
    """PyTorch's ``flex_attention``, compiled (Triton kernels that inductor generates): the Triton
    peer baseline. Causal as a block mask (bottom-right aligned, as flash_attn's; one per lengths
    and device, built before timing), GQA by ``enable_gqa``; no sinks, no decode call here."""
    import functools  # noqa: PLC0415

    @functools.lru_cache(maxsize=None)
    def flex():
        import torch  # noqa: PLC0415
        from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

        return torch.compile(flex_attention, dynamic=False) if FLEX_COMPILE else flex_attention

    @functools.lru_cache(maxsize=32)
    def causal_mask(seqlen_q: int, seqlen_k: int, device: str):
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

        offset = seqlen_k - seqlen_q
        return create_block_mask(lambda b, h, i, j: i + offset >= j, None, None, seqlen_q, seqlen_k, device=device)

    def forward(q, k, v, causal, sinks=None):
        if sinks is not None:
            raise NotImplementedError("flex_attention here has no attention sinks")
        mask = causal_mask(q.shape[1], k.shape[1], str(q.device)) if causal else None
        gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
        out = flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, **gqa)
        return out.transpose(1, 2)

    @contextlib.contextmanager
    def context():
        import torch._dynamo.config as dynamo  # noqa: PLC0415

        name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        with dynamo.patch(**{name: FLEX_RECOMPILES}):
            yield

    return Implementation("flex", flex_unavailable, _autograd_run(forward), context, forward=forward)


def _upstream() -> Implementation:
    """Upstream flash-attn 2.6+'s extension, called directly (its Python package is also named
    ``flash_attn``, so only the extension can live next to this package)."""
    state: dict = {}

    def unavailable(device):
        if getattr(device, "type", device) != "cuda":
            return "upstream flash-attn runs on CUDA only"
        try:
            import torch  # noqa: F401, PLC0415

            import flash_attn_2_cuda  # noqa: PLC0415
        except Exception as exc:  # noqa: BLE001  (undefined symbols and the like)
            return f"flash_attn_2_cuda does not import ({type(exc).__name__}: {exc})"
        state["ext"] = flash_attn_2_cuda
        return None

    def run(q, k, v, dout, causal, sinks=None):
        if sinks is not None:
            raise NotImplementedError("flash-attn 2 has no attention sinks")
        ext = state["ext"]
        scale = q.shape[-1] ** -0.5
        out, lse, _, rng = ext.fwd(q, k, v, None, None, 0.0, scale, causal, -1, -1, 0.0, False, None)[:4]
        if dout is not None:
            ext.bwd(dout, q, k, v, out, lse, None, None, None, None, 0.0, scale, causal, -1, -1, 0.0, False, None, rng)

    def decode(q, k_cache, v_cache):
        # flash-attn 2.6+: no new k/v, seqlens_k None (the whole cache), no rotary/paging/alibi
        ext = state["ext"]
        return ext.fwd_kvcache(q, k_cache, v_cache, None, None, None, None, None, None, None, None, None, None,
                               q.shape[-1] ** -0.5, False, -1, -1, 0.0, True, 0)[0]

    def decode_step(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table):
        ext = state["ext"]
        return ext.fwd_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, None, None, None, None, block_table,
                               None, None, q.shape[-1] ** -0.5, False, -1, -1, 0.0, True, 0)[0]

    return Implementation("upstream", unavailable, run, decode=decode, decode_step=decode_step)


# What each implementation is, in the rows ("what"): the baselines named for what they run.
WHAT = {
    "flash_attn[aot]": "flash_attn: Triton kernels compiled ahead of time, launched by the op library",
    "flash_attn[triton]": "flash_attn: the same Triton kernels, JIT-compiled",
    "flash_attn[reference]": "flash_attn: exact PyTorch reference",
    "sdpa[flash]": "PyTorch SDPA flash (vendored FA2)",
    "sdpa[efficient]": "PyTorch SDPA memory-efficient",
    "sdpa[cudnn]": "PyTorch SDPA cuDNN",
    "sdpa[math]": "PyTorch SDPA math (unfused)",
    "upstream": "flash-attn 2 CUDA extension (flash_attn_2_cuda)",
    "flex": "PyTorch flex_attention, compiled (inductor's Triton kernels): a Triton peer",
}

# Shapes the launch configs were not tuned on (the table is 1k/4k/16k tokens, hidden 2048, heads of
# q and k/v equal): (seqlen, batch, heads, kv_heads, headdim) at head dim 128, by `--held-out`
HELD_OUT = (
    (2048, 8, 16, 16, 128), (8192, 2, 16, 16, 128),
    (3001, 4, 16, 16, 128),  # an odd length: partial tiles at every level
    (4096, 4, 32, 4, 128),  # GQA 8:1
    (4096, 4, 32, 32, 128), (4096, 4, 40, 40, 128),  # heads x head dim 4096 and 5120
    (32768, 1, 16, 16, 128),  # batch 1, a long sequence
)


# `--family`: the mma.sync proxy (flash_attn.aot.forced): our images under the forced family beside
# FA2 as PyTorch ships it, at the shapes of issue 48's targets
PROXY_IMPLS = ("flash_attn[aot]", "sdpa[flash]")
PROXY_SEQLENS = (4096, 16384)
PROXY_DTYPES = ("bf16",)


def proxy_note(arch: str, family: str, gpu: Optional[str]) -> str:
    """What a row of our images under forced ``family`` measures (the ``proxy`` column)."""
    from flash_attn.planning import families  # noqa: PLC0415

    how = "PTX, compiled by the driver" if arch.startswith("compute_") else "cubin"
    return (f"proxy: the {family} tables ({families.get(family).gpus}) as {arch} {how} on {gpu or 'this GPU'}; "
            f"its clocks, SMs, shared memory, L2 and HBM, not those GPUs'")


# the baseline's side of the proxy: FA2 picks its own tiles for the GPU it runs on
PROXY_BASELINE_NOTE = "FA2's own tiles for this GPU (on Hopper: its sm80 ones)"


@contextlib.contextmanager
def _forced_family(family: Optional[str]):
    """``FLASH_ATTN_FORCE_FAMILY`` set to ``family`` for the run (nothing without one)."""
    from flash_attn.aot import forced  # noqa: PLC0415

    if family is None:
        yield
        return
    old = os.environ.get(forced.FORCE_ENV)
    os.environ[forced.FORCE_ENV] = family
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(forced.FORCE_ENV, None)
        else:
            os.environ[forced.FORCE_ENV] = old


def _aot_device_image(device):
    from flash_attn.backends import aot  # noqa: PLC0415

    return aot.device_image(device)


def proxy_fields(config: dict, impls, reasons: dict, device, image_of=None) -> dict:
    """Per implementation, the ``family``/``proxy`` fields of its rows under ``config["family"]``
    (empty without one). Our aot images must run the forced family: where they do not (no image
    carries it, the GPU's shared memory is too small), that is the implementation's reason not to run."""
    family = config.get("family")
    if family is None:
        return {impl.name: {} for impl in impls}
    gpu = common.machine().get("gpu")
    out = {}
    for impl in impls:
        if impl.backend != "aot":
            out[impl.name] = {"family": None, "proxy": PROXY_BASELINE_NOTE}
            continue
        out[impl.name] = {"family": family}
        if reasons[impl.name] is not None:
            continue
        try:
            found = (image_of or _aot_device_image)(device)
        except Exception as exc:  # noqa: BLE001  (no CUDA device: the reason, not a crash)
            found = f"{type(exc).__name__}: {exc}"
        if isinstance(found, str):
            reasons[impl.name] = found
        elif found[1] != family:
            reasons[impl.name] = f"the aot backend runs the {found[1]} configs here, not the forced {family}"
        else:
            out[impl.name]["proxy"] = proxy_note(found[0], family, gpu)
    return out


def implementations(names) -> list[Implementation]:
    makers = {
        "flash_attn[aot]": lambda: _ours("aot"),
        "flash_attn[triton]": lambda: _ours("triton"),
        "flash_attn[reference]": lambda: _ours("reference"),
        "sdpa[flash]": lambda: _sdpa("flash", "FLASH_ATTENTION"),
        "sdpa[efficient]": lambda: _sdpa("efficient", "EFFICIENT_ATTENTION"),
        "sdpa[cudnn]": lambda: _sdpa("cudnn", "CUDNN_ATTENTION"),
        "sdpa[math]": lambda: _sdpa("math", "MATH"),
        "upstream": _upstream,
        "flex": _flex,
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {', '.join(makers)}")
    return [makers[n]() for n in names]


def cuda_event_timer(fn: Callable[[], None], warmup: int, repeats: int) -> list:
    import torch  # noqa: PLC0415

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def wall_timer(fn: Callable[[], None], warmup: int, repeats: int) -> list:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def cases(config: dict) -> list[dict]:
    """The training rows: every head dim of the table, then those beyond FlashAttention-2
    (``config["beyond"]``: :data:`BEYOND_CASES`), at every dtype, mask, length and pass."""
    shapes = [{"headdim": d} for d in config["headdims"]] + list(config.get("beyond") or ())
    out = []
    for dtype in config["dtypes"]:
        for shape in shapes:
            headdim = shape["headdim"]
            for causal in config["causal"]:
                for seqlen in config["seqlens"]:
                    for backward in config["backward"]:
                        out.append({
                            **shape, "dtype": dtype, "headdim": headdim, "causal": causal, "seqlen": seqlen,
                            "batch": max(1, config["total_tokens"] // seqlen), "heads": max(1, config["hidden"] // headdim),
                            "pass": "fwd_bwd" if backward else "fwd",
                        })
    for seqlen, batch, heads, kv_heads, headdim in HELD_OUT if config.get("held_out") else ():
        for dtype in config["dtypes"]:
            for causal in config["causal"]:
                for backward in config["backward"]:
                    out.append({"dtype": dtype, "headdim": headdim, "causal": causal, "seqlen": seqlen, "batch": batch,
                                "heads": heads, "kv_heads": kv_heads, "pass": "fwd_bwd" if backward else "fwd",
                                "held_out": True})
    return out


def decode_cases(config: dict) -> list[dict]:
    """One row per (batch, cache length) of ``config["decode"]``; the cache is full, one new token."""
    d = config["decode"]
    return [{"dtype": d["dtype"], "headdim": d["headdim"], "causal": False, "pass": "decode", "seqlen": 1,
             "cachelen": cachelen, "batch": batch, "heads": d["heads"], "kv_heads": d["kv_heads"]}
            for batch in d["batches"] for cachelen in d["cachelens"]]


# the decode step's cache: pages of this many tokens in the paged rows (FA2's paged KV cache takes
# multiples of 256), in a shuffled order, so that the pages of a sequence are not contiguous
PAGE_SIZE = 256
STEP_PASSES = ("decode_step", "decode_step_paged")


def decode_step_cases(config: dict) -> list[dict]:
    """``config["decode"]["steps"]``: per (batch, cache length), a decode step with a contiguous
    and with a paged cache; the sequences' lengths differ (:func:`step_seqlens`)."""
    d = config["decode"]
    if not d.get("steps"):
        return []
    return [{**case, "pass": pass_, **({"page_size": PAGE_SIZE} if pass_ == "decode_step_paged" else {})}
            for case in decode_cases(config) for pass_ in STEP_PASSES]


def step_seqlens(batch: int, cachelen: int) -> list[int]:
    """Each sequence's cached tokens before the step: from ``cachelen - 1`` (the last one fills the
    cache) down towards half of it, so that a batch is ragged as in serving."""
    return [cachelen - 1 - (i * (cachelen // 2)) // max(1, batch) for i in range(batch)]


def decode_step_inputs(case: dict, device, dtype, generator) -> dict:
    """The tensors of one decode step: ``q``, the caches (paged: ``(pages, PAGE_SIZE, kv_heads,
    headdim)`` with a shuffled ``block_table``; else ``(batch, cachelen, kv_heads, headdim)``), the
    new token's ``k_new``/``v_new`` and ``cache_seqlens`` (int32, :func:`step_seqlens`)."""
    import torch  # noqa: PLC0415

    batch, cachelen, kv_heads, headdim = case["batch"], case["cachelen"], case["kv_heads"], case["headdim"]
    page = case.get("page_size")
    block_table = None
    if page:
        per_sequence = -(-cachelen // page)
        cache_shape = (batch * per_sequence, page, kv_heads, headdim)
        block_table = torch.randperm(batch * per_sequence, generator=torch.Generator().manual_seed(0)).view(
            batch, per_sequence).to(device=device, dtype=torch.int32)
    else:
        cache_shape = (batch, cachelen, kv_heads, headdim)

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=dtype, generator=generator)

    return {"q": randn(batch, 1, case["heads"], headdim), "k_cache": randn(*cache_shape), "v_cache": randn(*cache_shape),
            "k_new": randn(batch, 1, kv_heads, headdim), "v_new": randn(batch, 1, kv_heads, headdim),
            "cache_seqlens": torch.tensor(step_seqlens(batch, cachelen), dtype=torch.int32, device=device),
            "block_table": block_table}


def decode_step_reference(inputs: dict):
    """The step's output in float32, from the inputs alone: per sequence, its cached keys (through
    the block table when paged) and the new one, the query heads grouped on their KV heads."""
    import torch  # noqa: PLC0415

    q, k_cache, v_cache = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    block_table = inputs["block_table"]
    heads, headdim = q.shape[2], q.shape[3]
    outs = []
    for b, length in enumerate(inputs["cache_seqlens"].tolist()):
        if block_table is None:
            k, v = k_cache[b, :length], v_cache[b, :length]
        else:  # the sequence's pages in table order, cut at its length
            k = k_cache[block_table[b].long()].flatten(0, 1)[:length]
            v = v_cache[block_table[b].long()].flatten(0, 1)[:length]
        k = torch.cat([k, inputs["k_new"][b]]).float()  # (length + 1, kv_heads, headdim)
        v = torch.cat([v, inputs["v_new"][b]]).float()
        # query head h reads KV head h // group: the query heads as (kv_heads, group) rows
        rows = q[b, 0].float().view(k.shape[1], heads // k.shape[1], headdim)
        scores = torch.einsum("kgd,lkd->kgl", rows, k) * headdim ** -0.5
        outs.append(torch.einsum("kgl,lkd->kgd", scores.softmax(-1), v).reshape(heads, headdim))
    return torch.stack(outs).unsqueeze(1)


def decode_reference(q, k_cache, v_cache):
    """A plain decode call's output in float32: every sequence attends over its whole cache (the
    step's reference with no new key)."""
    import torch  # noqa: PLC0415

    batch, cachelen = k_cache.shape[:2]
    none = k_cache[:, :0]
    return decode_step_reference({"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": None,
                                  "cache_seqlens": torch.full((batch,), cachelen), "k_new": none, "v_new": none})


def decode_step_bytes(case: dict) -> int:
    """Bytes a decode step must move at least: each sequence's cached K and V read (its length and
    the new token), the new k/v written, q read and out written."""
    elt = DTYPE_BYTES[case["dtype"]]
    row = case["kv_heads"] * case["headdim"] * elt
    keys = sum(length + 1 for length in step_seqlens(case["batch"], case["cachelen"]))
    q_and_out = 2 * case["batch"] * case["heads"] * case["headdim"] * elt
    return 2 * keys * row + 2 * case["batch"] * row + q_and_out


def decode_bytes(case: dict) -> int:
    """Bytes a decode call must move at least: the K and V cache read once, q read, out written."""
    elt = DTYPE_BYTES[case["dtype"]]
    cache = 2 * case["batch"] * case["cachelen"] * case["kv_heads"] * case["headdim"] * elt
    q_and_out = 2 * case["batch"] * case["seqlen"] * case["heads"] * case["headdim"] * elt
    return cache + q_and_out


def skip_reason(needed: int, free: Optional[int]) -> Optional[str]:
    """Why a case that allocates ``needed`` bytes is skipped (None: it runs): it needs more than
    the free memory less :data:`DECODE_HEADROOM`. ``free`` None (unknown): never skipped."""
    if free is None or needed + DECODE_HEADROOM <= free:
        return None
    return (f"skipped: would need {(needed + DECODE_HEADROOM) / 2**30:.1f} GiB "
            f"({needed / 2**30:.1f} GiB of tensors + {DECODE_HEADROOM / 2**30:.0f} GiB headroom), "
            f"the GPU has {free / 2**30:.1f} GiB free")


def nominal_bandwidth(device_name: Optional[str]) -> Optional[tuple[str, float]]:
    """``(label, bytes/s)`` of :data:`NOMINAL_BANDWIDTH` for a device name, None if not listed."""
    for needle, label, value in NOMINAL_BANDWIDTH:
        if device_name and needle in device_name:
            return label, value
    return None


def run(config: dict, device=None, timer: Optional[Timer] = None, progress=lambda s: None,
        on_row: Callable[[dict], None] = lambda row: None,
        free_memory: Optional[Callable[[], Optional[int]]] = None,
        capture: Optional[Callable[[Callable[[], None]], Callable[[], None]]] = None,
        image_of: Optional[Callable] = None) -> list[dict]:
    """Measure every case with every implementation, then (``config["decode"]``) the memory
    bandwidth and the decode cases; ``on_row(row)`` as each row is done. ``free_memory()``: free
    bytes on the device (default: CUDA's count, or the host's available memory on a CPU).
    ``capture(call)``: ``call`` captured, as a callable that replays it (default: a CUDA graph;
    for the ``decode_graph`` rows of ``config["decode"]["graphs"]``). ``image_of(device)``: the aot
    backend's ``(image arch, family)`` there (default :func:`flash_attn.backends.aot.device_image`;
    read under ``config["family"]``, the proxy)."""
    import torch  # noqa: PLC0415

    device = torch.device(device or "cuda")
    timer = timer or (cuda_event_timer if device.type == "cuda" else wall_timer)
    rows = []

    def emit(row):
        progress(_progress_line(row))
        on_row(row)
        rows.append(row)

    with _forced_family(config.get("family")):
        impls = implementations(config["impls"])
        reasons = {}
        for impl in impls:
            try:
                reasons[impl.name] = impl.unavailable(device)
            except Exception as exc:  # noqa: BLE001
                reasons[impl.name] = f"{type(exc).__name__}: {exc}"
        fields = proxy_fields(config, impls, reasons, device, image_of)
        _run_training(config, device, timer, impls, reasons, fields, emit)
        if config.get("decode"):
            _run_decode(config, device, timer, impls, reasons, emit, free_memory or _free_memory_probe(device),
                        capture or (cuda_graph if device.type == "cuda" else None))
    return rows


def _run_training(config, device, timer, impls, reasons, fields, emit) -> None:
    import torch  # noqa: PLC0415

    for case in cases(config):
        dtype = _torch_dtype(case["dtype"])
        backward = case["pass"] == "fwd_bwd"
        shape = (case["batch"], case["seqlen"], case["heads"], case["headdim"])
        shape_v = (*shape[:-1], case.get("headdim_v", case["headdim"]))
        kv_shape = shape[:2] + (case.get("kv_heads", case["heads"]), case["headdim"])
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(s, device=device, dtype=dtype, generator=g).requires_grad_(backward)
                   for s in (shape, kv_shape, (*kv_shape[:-1], shape_v[-1])))
        dout = torch.randn(shape_v, device=device, dtype=dtype, generator=g) if backward else None
        sinks = None
        if case.get("sinks"):
            sinks = torch.randn(case["heads"], device=device, generator=g).requires_grad_(backward)
        # q.k at q's head dim and p.v at v's: the mean of the two in the 4*b*h*sq*sk*d count
        flops = attention_flops(case["batch"], case["heads"], case["seqlen"], case["seqlen"],
                                (case["headdim"] + shape_v[-1]) / 2, case["causal"], backward)
        expected = _once(lambda: reference(q, k, v, dout, case["causal"], sinks))
        timed = []
        for impl in impls:
            row = dict(case, impl=impl.name, what=WHAT.get(impl.name), **fields[impl.name])
            _check_row(row, impl, reasons[impl.name], q, k, v, dout, sinks, case, expected)
            # a wrong result is not timed
            timed.append(Timing(row, impl, (lambda impl=impl: impl.run(q, k, v, dout, case["causal"], sinks)), timer,
                                row.get("status") != "error"))

        def done(t, flops=flops):
            if "time_ms" in t.row:
                t.row["tflops"] = flops / (t.row["time_ms"] * 1e-3) / 1e12
            emit(t.row)

        measure_interleaved(timed, reasons, config, device, done)


def _run_decode(config, device, timer, impls, reasons, emit, free_memory, capture) -> None:
    import torch  # noqa: PLC0415

    bandwidth = measure_bandwidth(config, device, timer, free_memory)
    emit(bandwidth)
    measured = bandwidth.get("gbps") if bandwidth["status"] == "ok" else None
    nominal = bandwidth.get("nominal_gbps")
    d = config["decode"]
    for case in decode_cases(config):
        needed = decode_bytes(case)
        skipped = skip_reason(needed, free_memory())
        tensors, expected = (), None
        if skipped is None:
            dtype = _torch_dtype(case["dtype"])
            g = torch.Generator(device=device).manual_seed(0)
            cache_shape = (case["batch"], case["cachelen"], case["kv_heads"], case["headdim"])
            q = torch.randn((case["batch"], 1, case["heads"], case["headdim"]), device=device, dtype=dtype, generator=g)
            tensors = (q, *(torch.randn(cache_shape, device=device, dtype=dtype, generator=g) for _ in range(2)))
            expected = decode_reference(*tensors)
        timed, wrong = [], set()
        for impl, graphed in itertools.product(impls, (False, True) if d.get("graphs") else (False,)):
            row = dict(case, impl=impl.name, gbytes=needed / 1e9, **({"pass": "decode_graph"} if graphed else {}))
            if skipped is not None:
                row.update(status="skipped", note=skipped)
            elif impl.decode is None:
                row.update(status="unsupported", note=f"{impl.name} has no decode call here")
            elif graphed and capture is None:
                row.update(status="unsupported", note="CUDA graphs need a CUDA device")
            elif graphed and impl.name in wrong:
                row.update(status="error", note="wrong result (the eager call's check): not replayed")
            elif graphed:
                call = _Replayed(lambda impl=impl: impl.decode(*tensors), capture)
                timed.append(Timing(row, impl, call, call.per_replay(timer)))
                continue
            else:
                call = (lambda impl=impl: impl.decode(*tensors))
                if reasons[impl.name] is None:  # the graphed row replays the call checked here
                    _check_step(row, impl, call, expected, case["dtype"])
                    if row.get("status") == "error":
                        wrong.add(impl.name)
                timed.append(Timing(row, impl, call, timer, row.get("status") is None))
                continue
            timed.append(Timing(row, impl, None, timer, False))
        measure_interleaved(timed, reasons, config, device,
                            lambda t, needed=needed: emit(_bandwidth_fields(t.row, needed, measured, nominal)))
        del tensors  # before the next case allocates its cache (and counts free memory)
        _empty_cache(device)
    for case in decode_step_cases(config):
        _run_decode_step(case, config, device, timer, impls, reasons, emit, free_memory, measured, nominal)


def _bandwidth_fields(row: dict, needed: int, measured, nominal) -> dict:
    """``row`` with its GB/s and their share of the measured and nominal bandwidth (timed rows)."""
    if "time_ms" in row:
        row["gbps"] = needed / (row["time_ms"] * 1e-3) / 1e9
        row["bw_pct"] = 100 * row["gbps"] / measured if measured else None
        row["nominal_pct"] = 100 * row["gbps"] / nominal if nominal else None
    return row


def _run_decode_step(case, config, device, timer, impls, reasons, emit, free_memory, measured, nominal) -> None:
    """One decode step case: each implementation's output checked against
    :func:`decode_step_reference` before it is timed (a wrong result of ours is an error row),
    then timed interleaved; GB/s from :func:`decode_step_bytes`."""
    import torch  # noqa: PLC0415

    needed = decode_step_bytes(case)
    skipped = skip_reason(needed, free_memory())
    inputs, expected = {}, None
    if skipped is None:
        g = torch.Generator(device=device).manual_seed(0)
        inputs = decode_step_inputs(case, device, _torch_dtype(case["dtype"]), g)
        expected = decode_step_reference(inputs)  # before any call writes into the caches
    args = [inputs.get(name) for name in ("q", "k_cache", "v_cache", "k_new", "v_new", "cache_seqlens", "block_table")]
    timed = []
    for impl in impls:
        row = dict(case, impl=impl.name, gbytes=needed / 1e9)
        call = (lambda impl=impl: impl.decode_step(*args))
        if skipped is not None:
            row.update(status="skipped", note=skipped)
        elif impl.decode_step is None:
            row.update(status="unsupported", note=f"{impl.name} has no decode step call here")
        elif reasons[impl.name] is None:
            _check_step(row, impl, call, expected, case["dtype"])
        timed.append(Timing(row, impl, call, timer, row.get("status") is None))
    measure_interleaved(timed, reasons, config, device,
                        lambda t: emit(_bandwidth_fields(t.row, needed, measured, nominal)))
    inputs.clear()
    _empty_cache(device)


def _check_step(row: dict, impl: Implementation, call, expected, dtype: str) -> None:
    """A decode step's output against the reference, into ``row`` (``err_out``, ``check``): a
    wrong result of ours is an ``error``; a call the implementation does not have is
    ``unsupported`` (NotImplementedError); any other failure is left to the timing, which reports
    it (an ``error`` for ours, ``unsupported`` for the others)."""
    try:
        with impl.context():
            out = call()
    except NotImplementedError as exc:
        row.update(status="unsupported", note=str(exc))
        return
    except Exception as exc:  # noqa: BLE001  (timing reports the implementation's own refusal)
        row["check"] = f"not checked: {type(exc).__name__}"
        return
    row["err_out"] = relative_error(out.detach(), expected)
    row["check"] = "ok" if row["err_out"] <= CHECK_TOLERANCE[dtype] else "mismatch"
    if row["check"] == "mismatch" and impl.backend is not None:
        row.update(status="error", note=f"wrong result: out {row['err_out']:.2g} (relative; tolerance "
                                        f"{CHECK_TOLERANCE[dtype]})")


def cuda_graph(call: Callable[[], None]) -> Callable[[], None]:
    """``call`` captured in a CUDA graph (after a warm-up call on a side stream, which compiles
    and allocates); returns the graph's ``replay``."""
    import torch  # noqa: PLC0415

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


class _Replayed:
    """A decode call as a server runs it: captured once (on the first call, inside the
    implementation's context), then :data:`GRAPH_REPLAYS` replays back to back per call;
    :meth:`per_replay` turns a timer's per-call times into per-replay ones."""

    def __init__(self, call: Callable[[], None], capture):
        self.call, self.capture, self.replay = call, capture, None
        self.backend = None  # the backend the captured call ran on (replays call no Python)

    def __call__(self) -> None:
        if self.replay is None:
            from flash_attn import dispatch  # noqa: PLC0415

            self.replay = self.capture(self.call)
            self.backend = dispatch.last_backend()
        for _ in range(GRAPH_REPLAYS):
            self.replay()

    def per_replay(self, timer: Timer) -> Timer:
        def timed(fn, warmup, repeats):
            self()  # the capture, untimed whatever the warm-up count
            return [t / GRAPH_REPLAYS for t in timer(fn, warmup, repeats)]
        return timed


def measure_bandwidth(config: dict, device, timer: Timer, free_memory) -> dict:
    """The device's memory bandwidth as a copy sees it: ``copy_bytes`` read plus as many
    written, over the median time of ``dst.copy_(src)``; with the nominal figure where known."""
    import torch  # noqa: PLC0415

    size = config["decode"].get("copy_bytes", COPY_BYTES)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    row = {"pass": "copy", "impl": "device copy", "gbytes": 2 * size / 1e9, "device": name}
    nominal = nominal_bandwidth(name)
    if nominal:
        row.update(nominal_label=nominal[0], nominal_gbps=nominal[1] / 1e9)
    skipped = skip_reason(2 * size, free_memory())
    if skipped:
        row.update(status="skipped", note=skipped)
        return row
    try:
        src = torch.ones(size, dtype=torch.uint8, device=device)  # written once, so no page is fresh when timed
        dst = torch.empty_like(src)
        times = timer(lambda: dst.copy_(src), config["warmup"], config["repeats"])
        row.update(summarize(times), status="ok")
        row["gbps"] = 2 * size / (row["time_ms"] * 1e-3) / 1e9
        if nominal:
            row["nominal_pct"] = 100 * row["gbps"] / row["nominal_gbps"]
    except Exception as exc:  # noqa: BLE001  (without it no decode row has a % of the bandwidth)
        row.update(status="error", note=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
    finally:
        src = dst = None
        _empty_cache(device)
    return row


# A result's largest error relative to the reference's largest magnitude that a correct kernel in
# this precision stays within (the inputs' own rounding is ~4e-3 in bf16, ~5e-4 in fp16)
CHECK_TOLERANCE = {"bf16": 3e-2, "fp16": 5e-3, "fp32": 1e-4}
REFERENCE_SCORES = 1 << 28  # score elements the reference holds at once (1 GiB of fp32)


def reference(q, k, v, dout, causal: bool, sinks=None):
    """``(out, grads)``: attention in float32 by PyTorch's math path (and, when ``dout`` is given,
    the gradients of q, k, v, and of ``sinks`` when given), over a few batch x head slices at a
    time so that the scores never exceed :data:`REFERENCE_SCORES` elements. ``grads`` is ``None``
    without ``dout``. With attention sinks the slices are computed naively (:func:`_sink_attention`):
    SDPA has none."""
    import torch  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    batch, seqlen_q, heads, _ = q.shape
    group = heads // k.shape[2]
    if group > 1:  # GQA: each k/v head repeated for its group of q heads, its gradient the group's sum
        out, grads = reference(q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2), dout, causal, sinks)
        if grads is None:
            return out, None
        fold = lambda g: g.reshape(*g.shape[:2], k.shape[2], group, g.shape[3]).sum(3)  # noqa: E731
        return out, (grads[0], fold(grads[1]), fold(grads[2]), *grads[3:])
    step = max(1, REFERENCE_SCORES // (seqlen_q * k.shape[1]))

    def slices(t):  # (batch, seqlen, heads, headdim) -> (batch * heads, seqlen, 1, headdim) in float32
        return t.detach().float().permute(0, 2, 1, 3).reshape(batch * heads, t.shape[1], 1, t.shape[3])

    def back(t):  # the inverse of slices
        return t.reshape(batch, heads, t.shape[1], t.shape[3]).permute(0, 2, 1, 3)

    tensors = [slices(q), slices(k), slices(v)]
    if sinks is not None:  # one sink per slice: batch-major, heads within, as the slices
        tensors.append(sinks.detach().float().repeat(batch))
    df = slices(dout) if dout is not None else None
    outs, grads = [], []
    with sdpa_kernel(SDPBackend.MATH):
        for start in range(0, batch * heads, step):
            part = slice(start, start + step)
            inputs = [t[part].requires_grad_(dout is not None) for t in tensors]
            out = sdpa_forward(*inputs[:3], causal) if sinks is None else _sink_attention(*inputs, causal)
            outs.append(out.detach())
            if dout is not None:
                grads.append(torch.autograd.grad(out, inputs, df[part]))
    out = back(torch.cat(outs))
    if dout is None:
        return out, None
    result = tuple(back(torch.cat([g[i] for g in grads])) for i in range(3))
    if sinks is not None:  # each head's gradient summed over the batch
        result += (torch.cat([g[3] for g in grads]).view(batch, heads).sum(0),)
    return out, result


def _sink_attention(q, k, v, sinks, causal: bool):
    """Naive attention of ``(n, seqlen, 1, headdim)`` slices with one sink logit per slice: an extra
    score column of the sink's value, joining the softmax with no value row."""
    import torch  # noqa: PLC0415

    scores = (q[:, :, 0] @ k[:, :, 0].transpose(1, 2)) * q.shape[-1] ** -0.5
    sq, sk = scores.shape[1:]
    if causal:  # bottom-right aligned
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    logits = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, sq, 1)], dim=-1)
    return (logits.softmax(-1)[..., :-1] @ v[:, :, 0]).unsqueeze(2)


def relative_error(got, want) -> float:
    scale = float(want.abs().max()) or 1.0
    return float((got.float() - want).abs().max()) / scale


def check(forward: Callable, q, k, v, dout, causal: bool, dtype: str, expected=None, sinks=None) -> dict:
    """``forward``'s output (and gradients, when ``dout`` is given) against :func:`reference`
    (or ``expected``, its result for these inputs): ``err_out`` and ``err_grad`` (the largest of
    dq, dk, dv and, with attention sinks, dsinks), each relative to the reference's largest
    magnitude, and ``check``: ``ok``, or ``mismatch`` beyond :data:`CHECK_TOLERANCE` (also for a NaN)."""
    import torch  # noqa: PLC0415

    want_out, want_grads = expected if expected is not None else reference(q, k, v, dout, causal, sinks)
    inputs = [t.detach().clone().requires_grad_(dout is not None) for t in (q, k, v, sinks) if t is not None]
    out = forward(*inputs[:3], causal, *inputs[3:])
    result = {"err_out": relative_error(out.detach(), want_out), "err_grad": None}
    if dout is not None:
        grads = torch.autograd.grad(out, inputs, dout)
        result["err_grad"] = max(relative_error(g, w) for g, w in zip(grads, want_grads))
    errors = [e for e in (result["err_out"], result["err_grad"]) if e is not None]
    result["check"] = "ok" if all(e <= CHECK_TOLERANCE[dtype] for e in errors) else "mismatch"
    return result


def _check_row(row: dict, impl: Implementation, reason: Optional[str], q, k, v, dout, sinks, case,
               expected) -> None:
    """Check ``impl`` on the case's inputs before it is timed (:func:`check`) into ``row``; a wrong
    result of this package is an ``error`` row."""
    if reason is not None or impl.forward is None:
        row["check"] = "not checked" if reason is None else None
        return
    try:
        with impl.context():
            row.update(check(impl.forward, q, k, v, dout, case["causal"], case["dtype"], expected(), sinks))
    except Exception as exc:  # noqa: BLE001  (timing reports the implementation's own refusal)
        row["check"] = f"not checked: {type(exc).__name__}"
        return
    if row["check"] == "mismatch" and impl.backend is not None:
        row.update(status="error", note=f"wrong result: out {row['err_out']:.2g}, grad {row['err_grad']} "
                                        f"(relative; tolerance {CHECK_TOLERANCE[case['dtype']]})")


# Host CPU time per call (`host_ms`): this many calls back to back, without synchronising between
# them. The event timer's span of one call includes the GPU's idle gaps while the host prepares
# the launches, so the GPU's own time is at least the event time less the host's: where the host's
# time is at least GPU_SPAN_SHARE of the event time, the GPU's time per call is measured too
# (`gpu_ms`: the same calls queued behind a sleep kernel, common.cuda_gpu_span), and the row is
# `host_bound` where the host's time exceeds it (the 2026-11-30 H200 decode rows: host 89 us, event
# 123, not flagged by the share rule alone). Without a GPU span (no CUDA device) a row whose host
# time is at least HOST_BOUND_SHARE of its event time is flagged.
HOST_CALLS = 10
GPU_SPAN_SHARE = 0.25
HOST_BOUND_SHARE = 0.8


def _gpu_span(device) -> Optional[Callable]:
    """How ``device``'s own time of back-to-back calls is measured (none off CUDA)."""
    return common.cuda_gpu_span if device.type == "cuda" else None


def host_fields(call: Callable[[], None], device, event_ms: float) -> dict:
    """``host_ms``: the process's CPU time per call of ``call`` in milliseconds (:data:`HOST_CALLS`
    calls back to back); where that is at least :data:`GPU_SPAN_SHARE` of ``event_ms``,
    ``host_alone_ms`` (the calling thread's for one call timed alone, as the event time is:
    :func:`_alone_us`) and, where the device has a GPU span, ``gpu_ms`` (the GPU's time per call,
    kernels back to back) and ``gpu_covered``."""
    import torch  # noqa: PLC0415

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    host_us = common.host_and_gpu(call, HOST_CALLS, sync)["host_us"]
    fields = {"host_ms": host_us / 1e3}
    if fields["host_ms"] < GPU_SPAN_SHARE * event_ms:
        return fields  # the GPU's time is the row's: no more calls spent on the host's
    fields["host_alone_ms"] = _alone_us(call, sync) / 1e3
    span = _gpu_span(device)
    if span is not None:
        ms, covered = span(call, HOST_CALLS, host_us * HOST_CALLS / 1e6)
        fields.update(gpu_ms=ms / HOST_CALLS, gpu_covered=covered)
    return fields


def _alone_us(call: Callable[[], None], sync: Callable[[], None], calls: int = HOST_CALLS) -> float:
    """The calling thread's CPU time of one call right after a device synchronisation, as the event
    timer times a call (the host's caches as a model's call finds them between other work, not
    warm from the same call), median of ``calls``, in microseconds."""
    times = []
    for _ in range(calls):
        sync()
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6


def host_bound(row: dict) -> Optional[bool]:
    """Whether the row's time is the host's: its host time above the GPU's own, or without a GPU
    time, at least :data:`HOST_BOUND_SHARE` of the event time (``None`` without a host time)."""
    host, event, gpu = row.get("host_ms"), row.get("time_ms"), row.get("gpu_ms")
    if host is None or event is None:
        return None
    return host > gpu if gpu is not None else host >= HOST_BOUND_SHARE * event


@dataclass
class Timing:
    """One row to time: its implementation, the call and the timer (``timed``: False for a row
    settled before timing, e.g. a wrong result)."""

    row: dict
    impl: Implementation
    call: Callable[[], None]
    timer: Timer
    timed: bool = True


def round_orders(count: int, rounds: int) -> list[list[int]]:
    """The order of ``count`` implementations in each of ``rounds`` rounds: rotated by one each
    round, so that none always runs first (a cold clock, a fresh cache) or right after the same one."""
    return [[(start + i) % count for i in range(count)] for start in range(rounds)] if count else [[]] * rounds


def round_repeats(repeats: int, rounds: int) -> int:
    """Timed calls per round: the run's repeats split over the rounds (the same budget as one round)."""
    return max(1, -(-repeats // rounds))


def measure_interleaved(timings: list, reasons: dict, config: dict, device,
                        done: Callable[["Timing"], None] = lambda t: None) -> None:
    """Time the rows of one case in ``config["rounds"]`` rounds (default 1), the implementations in
    :func:`round_orders`; each row's times are those of every round (``time_ms`` their median),
    ``round_ms`` the median of each round and ``spread_pct`` their range over the median: how far
    one run's answer may move. The warm-up is done in the first round only. ``done(timing)`` as
    each row is final (in the last round's order; a row not timed there too)."""
    rounds = max(1, int(config.get("rounds", 1)))
    times = {id(t): [] for t in timings}
    medians = {id(t): [] for t in timings}
    orders = round_orders(len(timings), rounds)
    for index, order in enumerate(orders):
        per_round = dict(config, repeats=round_repeats(config["repeats"], rounds),
                         warmup=config["warmup"] if index == 0 else 0)
        for t in (timings[i] for i in order):
            if t.timed and t.row.get("status") in (None, "ok"):
                def recording(fn, warmup, repeats, t=t):
                    got = t.timer(fn, warmup, repeats)
                    times[id(t)].extend(got)
                    medians[id(t)].append(statistics.median(got))
                    return got

                # the host's time per call once, in the last round
                _measure(t.row, t.impl, reasons[t.impl.name], t.call, per_round, recording, device,
                         host=index == len(orders) - 1)
            if index == len(orders) - 1:
                _summarize_rounds(t.row, times[id(t)], medians[id(t)])
                done(t)


def _summarize_rounds(row: dict, times: list, medians: list) -> None:
    if row.get("status") != "ok" or not times:
        return
    row.update(summarize(times))
    row["round_ms"] = medians
    spread = (max(medians) - min(medians)) / row["time_ms"] if row["time_ms"] else 0.0
    row["spread_pct"] = 100 * spread if len(medians) > 1 else None
    row["host_bound"] = host_bound(row)


def _measure(row: dict, impl: Implementation, reason: Optional[str], call, config, timer, device,
             host: bool = True) -> None:
    """Time ``call`` under ``impl``'s context into ``row`` (status, times or note; ``host``: and the
    host's CPU time per call)."""
    import torch  # noqa: PLC0415

    from flash_attn import dispatch  # noqa: PLC0415

    if reason is not None:
        # under strict mode this package's backends must run: unavailable is an error
        ours_required = impl.backend is not None and dispatch.strict()
        row.update(status="error" if ours_required else "unavailable", note=reason)
        return
    try:
        with impl.context():
            times = timer(call, config["warmup"], config["repeats"])
            # a graph replay's host side is one launch: not measured
            if host and row.get("pass") != "decode_graph":
                row.update(host_fields(call, device, statistics.median(times)))
        row.update(summarize(times), status="ok")
        row["host_bound"] = host_bound(row)
        elsewhere = _ran_elsewhere(impl, device.type, call)
        if elsewhere:
            row.update(status="error", note=elsewhere)
    except Exception as exc:  # noqa: BLE001  (an SDPA backend that rejects a shape, OOM...)
        note = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
        row.update(status="error" if impl.backend is not None else "unsupported", note=note)
        row.pop("time_ms", None)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _once(make: Callable) -> Callable:
    """``make()`` on the first call, the same value after (the reference: only if something is checked)."""
    value = []

    def get():
        if not value:
            value.append(make())
        return value[0]
    return get


def _torch_dtype(name: str):
    import torch  # noqa: PLC0415

    return getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[name])


def _empty_cache(device) -> None:
    import torch  # noqa: PLC0415

    if device.type == "cuda":
        torch.cuda.empty_cache()


def _free_memory_probe(device) -> Callable[[], Optional[int]]:
    import torch  # noqa: PLC0415

    if device.type != "cuda":
        return common.available_memory_bytes

    def free() -> int:
        torch.cuda.empty_cache()  # blocks the caching allocator holds count as free
        return torch.cuda.mem_get_info(device)[0]
    return free


def _ran_elsewhere(impl: Implementation, device_type: str, call=None) -> Optional[str]:
    """Why a row of this package's ``impl`` does not count: its last call (for a replayed ``call``,
    the captured one: other rows' calls ran since) ran on another backend. Checked on GPUs only (on
    the CPU a plain dense call skips the dispatcher, which then does not record it)."""
    from flash_attn import dispatch  # noqa: PLC0415

    if impl.backend is None or device_type == "cpu":
        return None
    ran = call.backend if isinstance(call, _Replayed) else dispatch.last_backend()
    return None if ran == impl.backend else f"the {ran} backend ran it, not {impl.backend}"


def _progress_line(row: dict) -> str:
    if row["pass"] == "copy":
        nominal = ""
        if row.get("nominal_pct"):
            nominal = f" ({row['nominal_pct']:.0f} % of the {row['nominal_label']}'s nominal)"
        if row.get("status") != "ok":
            return f"  memory bandwidth (device copy): {row['status']}: {row.get('note', '')}"
        return f"  memory bandwidth (device copy of {row['gbytes'] / 2:.1f} GB): {row['gbps']:.0f} GB/s{nominal}"
    if row["pass"] in DECODE_PASSES:
        call = {"decode_graph": "graph ", "decode_step": "step  ", "decode_step_paged": "paged "}.get(row["pass"], "decode")
        head = f"  {row['dtype']} {call} b={row['batch']:<3} cache={row['cachelen']:<7} {row['impl']:<20}"
        if row.get("status") != "ok":
            return f"{head} {row['status']}: {row.get('note', '')}"
        pct = f" ({row['bw_pct']:.0f} % of measured)" if row.get("bw_pct") is not None else ""
        bound = " (host-bound: the time is the host's)" if row.get("host_bound") else ""
        return f"{head} {row['time_ms']:9.3f} ms {row['gbps']:7.0f} GB/s{pct}{bound}"
    dims = f"{row['headdim']}/{row['headdim_v']}" if row.get("headdim_v") else f"{row['headdim']}"
    dims += "+sinks" if row.get("sinks") else ""
    heads = f" h={row['heads']}/{row['kv_heads']} b={row['batch']}" if row.get("held_out") else ""
    head = (f"  {row['dtype']} d={dims:<3} {'causal' if row['causal'] else 'full':<6} {row['pass']:<7} "
            f"s={row['seqlen']:<6}{heads} {row['impl']:<20}")
    if row.get("status") != "ok":
        return f"{head} {row['status']}: {row.get('note', '')}"
    bound = " (host-bound: the time is the host's)" if row.get("host_bound") else ""
    spread = f" spread {row['spread_pct']:.1f} %" if row.get("spread_pct") is not None else ""
    return f"{head} {row['time_ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s{spread}{bound}"


def plot(rows: list[dict], out_dir: Path, stem: str, title: str) -> list[Path]:
    """One PNG per dtype: rows of panels per head dim, columns per (pass, causal)."""
    from flash_attn.bench.common import pyplot  # noqa: PLC0415

    plt = pyplot()
    if plt is None:
        return []
    # decode and the copy are in GB/s, the held-out shapes each their own: not plotted
    rows = [r for r in rows if r["pass"] in ("fwd", "fwd_bwd") and not r.get("held_out")]

    def dims(r):  # a panel per head dim, v's too where it differs
        return f"{r['headdim']}/{r['headdim_v']}" if r.get("headdim_v") else str(r["headdim"])

    def label(r):  # a line per implementation, with sinks apart
        return r["impl"] + (" +sinks" if r.get("sinks") else "")

    written = []
    for dtype in sorted({r["dtype"] for r in rows}):
        subset = [r for r in rows if r["dtype"] == dtype]
        headdims = sorted({dims(r) for r in subset}, key=lambda text: [int(x) for x in text.split("/")])
        columns = sorted({(r["pass"], r["causal"]) for r in subset})
        fig, axes = plt.subplots(len(headdims), len(columns), figsize=(3.6 * len(columns), 2.8 * len(headdims)),
                                 squeeze=False, sharex=True)
        for i, headdim in enumerate(headdims):
            for j, (pass_, causal) in enumerate(columns):
                ax = axes[i][j]
                for name in dict.fromkeys(label(r) for r in subset):
                    pts = [r for r in subset if label(r) == name and dims(r) == headdim and r["pass"] == pass_
                           and r["causal"] == causal and r.get("status") == "ok"]
                    if pts:
                        ax.plot([r["seqlen"] for r in pts], [r["tflops"] for r in pts], marker="o", label=name)
                ax.set_xscale("log", base=2)
                ax.set_title(f"d={headdim} {pass_} {'causal' if causal else 'non-causal'}", fontsize=9)
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=7)
        for ax in axes[-1]:
            ax.set_xlabel("sequence length")
        fig.suptitle(f"{title} ({dtype})", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{stem}-{dtype}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


COLUMNS = ("impl", "what", "family", "proxy", "held_out", "dtype", "headdim", "headdim_v", "sinks", "causal", "pass", "seqlen", "cachelen", "batch",
           "heads", "kv_heads", "time_ms", "time_ms_min", "repeats", "spread_pct", "tflops", "gbytes", "gbps", "bw_pct", "nominal_pct",
           "host_ms", "host_alone_ms", "gpu_ms", "gpu_covered", "host_bound", "check", "err_out", "err_grad", "status", "note")


class RowWriter:
    """Rows written as they come: ``<stem>.jsonl`` (the meta line first) and ``<stem>.csv``,
    flushed after each row."""

    def __init__(self, out_dir: Path, stem: str, meta: dict):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {"jsonl": out_dir / f"{stem}.jsonl", "csv": out_dir / f"{stem}.csv"}
        self._jsonl = self.paths["jsonl"].open("w")
        self._csv_file = self.paths["csv"].open("w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=list(COLUMNS), extrasaction="ignore")
        self._csv.writeheader()
        self._write_json({"meta": meta})

    def _write_json(self, obj: dict) -> None:
        self._jsonl.write(json.dumps(obj, default=str) + "\n")
        self._jsonl.flush()

    def __call__(self, row: dict) -> None:
        self._write_json(row)
        self._csv.writerow(row)
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


def config_from_args(args, default_seqlens=()) -> dict:
    """The run's configuration from the command line (``default_seqlens`` unless ``--seqlens``)."""
    config = {
        "seqlens": args.seqlens or list(default_seqlens),
        "headdims": [64] if args.quick else args.headdims, "dtypes": ["bf16"] if args.quick else args.dtypes or ["fp16", "bf16"],
        "causal": [False, True], "backward": [False, True], "impls": args.impls or list(DEFAULT_IMPLS),
        "total_tokens": args.total_tokens, "hidden": args.hidden,
        "repeats": args.repeats or (3 if args.quick else 30), "warmup": args.warmup or (1 if args.quick else 5),
        "decode": None, "held_out": bool(getattr(args, "held_out", False)),
        "beyond": list(BEYOND_CASES) if args.beyond and not args.quick else [],
        "rounds": (1 if args.quick else 3) if getattr(args, "rounds", None) is None else args.rounds,
        "family": getattr(args, "family", None),
    }
    if config["rounds"] < 1:
        raise ValueError(f"--rounds must be at least 1, got {config['rounds']}")
    if args.decode and not config["family"]:
        config["decode"] = dict(DECODE_SHAPE, copy_bytes=COPY_BYTES,
                                batches=args.decode_batches or ([1, 4] if args.quick else list(DECODE_BATCHES)),
                                cachelens=args.decode_cachelens or ([4096] if args.quick else list(DECODE_CACHELENS)),
                                graphs=args.decode_graphs, steps=getattr(args, "decode_steps", True))
    if config["family"]:
        _proxy_config(config, args)
    return config


def _proxy_config(config: dict, args) -> None:
    """``--family``: the proxy's defaults where the command line names none (the proxy images hold
    the lean attention kernels only: no decode, no beyond-FA2 rows), and only our aot images."""
    config["seqlens"] = args.seqlens or list(PROXY_SEQLENS)
    config["dtypes"] = args.dtypes or list(PROXY_DTYPES)
    config["impls"] = args.impls or list(PROXY_IMPLS)
    config["beyond"] = []
    ours = [name for name in config["impls"] if name.startswith("flash_attn[")]
    if ours != ["flash_attn[aot]"]:
        raise ValueError(f"--family {config['family']} measures this package's aot images (the planner's family "
                         f"forced): --impls must name flash_attn[aot] and no other backend of ours, got {ours}")


def main(args, default_seqlens=(), device=None, timer: Optional[Timer] = None,
         free_memory: Optional[Callable[[], Optional[int]]] = None) -> int:
    """``python -m flash_attn bench gpu``: 0 when every row of this package's backends ran (on
    them), 1 when one is an ``error``, 2 without a CUDA device (``device``/``timer``/
    ``free_memory``: for tests)."""
    import torch  # noqa: PLC0415

    if device is None and not torch.cuda.is_available():
        print("gpu mode needs a CUDA device (this PyTorch sees none); `python -m flash_attn bench cpu` runs here",
              file=sys.stderr)
        return 2
    try:
        config = config_from_args(args, default_seqlens)
    except ValueError as exc:
        print(f"bench gpu: {exc}", file=sys.stderr)
        return 2
    meta = {"mode": "gpu", "config": config, "machine": common.machine()}
    writer = RowWriter(args.out, "bench-gpu", meta)
    try:
        rows = run(config, device=device, timer=timer, progress=lambda line: print(line, file=sys.stderr, flush=True),
                   on_row=writer, free_memory=free_memory)
    finally:
        writer.close()
    paths = {"jsonl": writer.paths["jsonl"], **common.write_results(args.out, "bench-gpu", meta, rows, COLUMNS)}
    if not args.no_plot:
        pngs = plot(rows, args.out, "bench-gpu", f"{meta['machine'].get('gpu')}, torch {meta['machine']['torch']}")
        paths["png"] = ", ".join(map(str, pngs)) or "(not written: matplotlib is not installed)"
    ok = [r for r in rows if r.get("status") == "ok" and r["pass"] in ("fwd", "fwd_bwd")]
    print(common.markdown_table(ok, [("dtype", "dtype"), ("headdim", "d"), ("headdim_v", "d_v"), ("sinks", "sinks"),
                                     ("causal", "causal"), ("pass", "pass"),
                                     ("seqlen", "seqlen"), ("impl", "implementation"), ("family", "family"),
                                     ("time_ms", "ms"), ("spread_pct", "spread %"), ("tflops", "TFLOP/s")]))
    if config.get("family"):
        print("\n" + proxy_markdown(rows, config["family"]))
    if config["decode"]:
        print("\n" + decode_markdown(rows, config["decode"]))
    print("\n" + "\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    errors = [r for r in rows if r.get("status") == "error"]
    for r in errors:
        print(f"error: {_progress_line(r).strip()}", file=sys.stderr)
    return 1 if errors else 0


def proxy_target(case: dict) -> float:
    """Issue 48's target for the proxy's ratio to SDPA flash: forward 1.0x, forward + backward 0.9x
    at head dims up to 128 and 0.8x above."""
    if case["pass"] == "fwd":
        return 1.0
    return 0.9 if case["headdim"] <= 128 else 0.8


def proxy_ratios(rows: list[dict], baseline: str = "sdpa[flash]") -> list[dict]:
    """Per training case, our aot row's speed against ``baseline``'s in the same run (``ratio``:
    the baseline's time over ours, > 1 faster), with :func:`proxy_target` and whether it is met."""
    keys = ("dtype", "headdim", "causal", "pass", "seqlen", "held_out")
    theirs = {tuple(r.get(k) for k in keys): r for r in rows if r["impl"] == baseline and r.get("status") == "ok"}
    out = []
    for r in rows:
        other = theirs.get(tuple(r.get(k) for k in keys))
        if r["impl"] == "flash_attn[aot]" and r.get("status") == "ok" and other is not None:
            out.append({**{k: r.get(k) for k in keys}, "family": r.get("family"), "ours_ms": r["time_ms"],
                        "baseline_ms": other["time_ms"], "ratio": other["time_ms"] / r["time_ms"],
                        "spread_pct": max(r.get("spread_pct") or 0.0, other.get("spread_pct") or 0.0),
                        "target": proxy_target(r)})
            out[-1]["meets"] = out[-1]["ratio"] >= out[-1]["target"]
    return out


def proxy_markdown(rows: list[dict], family: str) -> str:
    """The proxy's table: our images under ``family``'s tables against SDPA flash, per case."""
    proxy = next((r["proxy"] for r in rows if r.get("family") == family and r.get("proxy")), "not run")
    table = common.markdown_table(proxy_ratios(rows), [
        ("dtype", "dtype"), ("headdim", "d"), ("causal", "causal"), ("pass", "pass"), ("seqlen", "seqlen"),
        ("ours_ms", f"ours ({family}) ms"), ("baseline_ms", "SDPA flash ms"), ("ratio", "x SDPA flash"),
        ("target", "target"), ("meets", "meets"), ("spread_pct", "spread %")])
    return f"### The {family} proxy: {proxy}\n\n{table}"


def decode_markdown(rows: list[dict], decode: dict) -> str:
    """The decode section: the measured bandwidth (and the nominal one), then GB/s per row."""
    copy = next((r for r in rows if r["pass"] == "copy"), {})
    title = (f"### Decode: flash_attn_with_kvcache, 1 new token, {decode['heads']} query / "
             f"{decode['kv_heads']} KV heads, d={decode['headdim']}, {decode['dtype']}")
    if copy.get("status") == "ok":
        bandwidth = f"Memory bandwidth measured by a device-to-device copy in this run: {copy['gbps']:.0f} GB/s"
    else:
        bandwidth = f"Memory bandwidth: not measured ({copy.get('status')}: {copy.get('note', '')})"
    if copy.get("nominal_gbps"):
        bandwidth += f"; nominal {copy['nominal_gbps']:.0f} GB/s ({copy['nominal_label']}, {copy['device']})"
    shown = [r for r in rows if r["pass"] in DECODE_PASSES and r.get("status") in ("ok", "skipped")]
    table = common.markdown_table(shown, [("batch", "batch"), ("cachelen", "cache"), ("impl", "implementation"),
                                          ("pass", "call"),
                                          ("gbytes", "GB moved"), ("time_ms", "ms"), ("gbps", "GB/s"),
                                          ("bw_pct", "% of measured"), ("nominal_pct", "% of nominal"),
                                          ("note", "note")])
    return f"{title}\n\n{bandwidth}\n\n{table}"
