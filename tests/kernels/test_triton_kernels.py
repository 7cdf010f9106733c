"""The Triton forward/backward kernels against the float64 oracle.

Backends under test: ``interpret`` (the kernels in Triton's interpreter, CPU tensors; always runs)
and ``triton`` (the same kernels compiled for the GPU; ``@pytest.mark.gpu``, only with CUDA). Each
case calls the backend's contract functions (:mod:`flash_attn.backends`) and compares out, lse and
dq/dk/dv with ``tests/support/oracle.py`` under the tolerance rule of ``tests/support/tolerance.py``.

``CASES`` is the representative matrix that CI runs; ``test_full_matrix`` is the whole cross
product (``-m full_matrix``; hours in the interpreter, not run in CI).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from support import oracle
from support.inputs import gen
from support.oracle import oracle_pair
from support.poison import poisoned_empty
from support.tolerance import check_close

from flash_attn import dispatch
from flash_attn.dropout import keep_mask
from flash_attn.params import AttentionParams, VarlenLayout
from flash_attn.planning import configs, declarations, families

HAS_CUDA = torch.cuda.is_available()
BACKENDS = [
    pytest.param("interpret", id="interpret"),
    pytest.param("triton", id="triton", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]
DROPOUT_SEED = 2**40 + 12345  # exercises both 32-bit halves of the Philox key


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """The backend under test, selected for the whole test (calls it refuses go on to the
    reference backend through the dispatcher, as in real use)."""
    name = request.param
    device = torch.device("cpu" if name == "interpret" else "cuda")
    try:
        module = importlib.import_module(f"flash_attn.backends.{name}")
    except ImportError as exc:  # pragma: no cover - triton missing
        pytest.skip(str(exc))
    reason = module.unavailable_reason(device)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("FLASH_ATTN_BACKEND", name)
    return SimpleNamespace(name=name, module=module, device=device)


# ---------------------------------------------------------------------------------------------
# One attention call, checked end to end.


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.float16
    headdim: int = 64
    nheads: int = 2
    nheads_k: int = 2
    batch: int = 1
    seqlen_q: int = 32
    seqlen_k: int = 32
    lens: Optional[tuple] = None  # varlen: ((len_q, ...), (len_k, ...)); overrides batch/seqlens
    window: tuple = (-1, -1)  # (-1, 0) is causal
    softcap: float = 0.0
    alibi: Optional[str] = None  # "h" (nheads,) or "bh" (batch, nheads)
    dropout_p: float = 0.0
    page_size: Optional[int] = None  # paged K/V (varlen only)
    grads: bool = True
    headdim_v: Optional[int] = None  # v's and the output's head dim (None: headdim)
    sinks: bool = False  # attention sinks, one fp32 logit per query head
    qv: bool = False  # MLA's absorbed queries (forward only: the kernels have no backward for them)

    @property
    def dim_v(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v

    def __str__(self):
        dtype = "fp16" if self.dtype == torch.float16 else "bf16"
        parts = [dtype, f"d{self.headdim}" + (f"v{self.headdim_v}" if self.headdim_v else ""),
                 f"h{self.nheads}-{self.nheads_k}"]
        parts.append(f"varlen{self.lens}" if self.lens else f"b{self.batch}-{self.seqlen_q}x{self.seqlen_k}")
        if self.window != (-1, -1):
            parts.append("causal" if self.window == (-1, 0) else f"win{self.window}")
        if self.softcap:
            parts.append(f"cap{self.softcap}")
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.dropout_p:
            parts.append(f"drop{self.dropout_p}")
        if self.page_size:
            parts.append(f"page{self.page_size}")
        if self.sinks:
            parts.append("sinks")
        if self.qv:
            parts.append("qv")
        return "-".join(parts).replace(" ", "").replace(",", "_")


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    params: AttentionParams
    varlen: Optional[VarlenLayout]
    slopes: Optional[torch.Tensor]
    keep: Optional[torch.Tensor]  # (b, h, max_sq, max_sk) dropout keep mask
    oracle_fn: object
    oracle_kwargs: dict
    sinks: Optional[torch.Tensor] = None
    qv: Optional[torch.Tensor] = None

    @property
    def extras(self) -> dict:
        """The contract's keyword arguments for the sinks and qv the case has."""
        return {name: t for name, t in (("sinks", self.sinks), ("qv", self.qv)) if t is not None}


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    """CPU inputs and the matching oracle call for ``case``."""
    g = gen(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(case.dtype)  # noqa: E731
    h, hk, d, dv = case.nheads, case.nheads_k, case.headdim, case.dim_v
    left, right = case.window
    params = AttentionParams((d + (dv if case.qv else 0)) ** -0.5, left, right, case.softcap, case.dropout_p,
                             DROPOUT_SEED if case.dropout_p else 0)
    kwargs = dict(window=case.window, softcap=case.softcap, dropout_p=case.dropout_p,
                  softmax_scale=params.softmax_scale)
    varlen = None
    if case.lens is None:
        b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
        q, k, v, dout = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, dv), rand(b, sq, h, dv)
        qv = rand(b, sq, h, dv) if case.qv else None
        fn = oracle.attention_ref
    else:
        lens_q, lens_k = case.lens
        b, sq, sk = len(lens_q), max(lens_q), max(lens_k)
        cu_q = [0, *itertools.accumulate(lens_q)]
        cu_k = [0, *itertools.accumulate(lens_k)]
        q, dout = rand(cu_q[-1], h, d), rand(cu_q[-1], h, dv)
        qv = rand(cu_q[-1], h, dv) if case.qv else None
        block_table = None
        if case.page_size is None:
            k, v = rand(cu_k[-1], hk, d), rand(cu_k[-1], hk, dv)
        else:
            page = case.page_size
            need = [max(1, -(-n // page)) for n in lens_k]
            num_pages = sum(need) + 2  # spare pages that no sequence uses
            order = torch.randperm(num_pages, generator=g).tolist()
            block_table, used = [], 0
            for n in need:
                block_table.append(order[used:used + n] + [0] * (max(need) - n))
                used += n
            k, v = rand(num_pages, page, hk, d), rand(num_pages, page, hk, dv)
            kwargs["block_table"] = block_table
            block_table = torch.tensor(block_table, dtype=torch.int32)
        varlen = VarlenLayout(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), sq, sk,
                              block_table)
        fn = oracle.attention_varlen_ref
        kwargs.update(cu_q=cu_q, cu_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk)
    slopes = None
    if case.alibi:
        slopes = 0.05 + 0.95 * torch.rand((h,) if case.alibi == "h" else (b, h), generator=g)
        kwargs["alibi_slopes"] = slopes
    keep = None
    if case.dropout_p:
        bi, hi = torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1)
        ri, ci = torch.arange(sq).view(1, 1, sq, 1), torch.arange(sk).view(1, 1, 1, sk)
        keep = keep_mask(DROPOUT_SEED, bi, hi, ri, ci, case.dropout_p)
        kwargs["keep"] = keep
    # sinks of either sign around the scores' scale: some rows' denominators dominated by them
    sinks = 2.0 * torch.randn(h, generator=g) if case.sinks else None
    return Inputs(q, k, v, dout, params, varlen, slopes, keep, fn, kwargs, sinks, qv)


def oracle_tensors(inp: Inputs) -> tuple[list, object]:
    """The tensors whose gradients the oracle gives (q, k, v, then qv and sinks where the case has
    them) and the oracle function taking them positionally."""
    tensors = [inp.q, inp.k, inp.v] + [t for t in (inp.qv, inp.sinks) if t is not None]
    has_qv, has_sinks = inp.qv is not None, inp.sinks is not None

    def fn(q, k, v, *extra, **kwargs):
        qv = extra[0] if has_qv else None
        sinks = extra[-1] if has_sinks else None
        return inp.oracle_fn(q, k, v, qv=qv, sinks=sinks, **kwargs)

    return tensors, fn


def _to(x, device):
    if x is None:
        return None
    if isinstance(x, VarlenLayout):
        return x._replace(cu_seqlens_q=x.cu_seqlens_q.to(device), cu_seqlens_k=x.cu_seqlens_k.to(device),
                          block_table=_to(x.block_table, device))
    return x.to(device)


def run_forward(backend, inp: Inputs, return_softmax=False):
    dev = backend.device
    return dispatch.run("forward", dev, _to(inp.q, dev), _to(inp.k, dev), _to(inp.v, dev), inp.params,
                        varlen=_to(inp.varlen, dev), alibi_slopes=_to(inp.slopes, dev), return_softmax=return_softmax,
                        **{name: _to(t, dev) for name, t in inp.extras.items()})


def run_backward(backend, inp: Inputs, out, lse, deterministic=False, return_delta=False):
    dev = backend.device
    return dispatch.run("backward", dev, _to(inp.dout, dev), _to(inp.q, dev), _to(inp.k, dev), _to(inp.v, dev), out,
                        lse, inp.params, varlen=_to(inp.varlen, dev), alibi_slopes=_to(inp.slopes, dev),
                        deterministic=deterministic, return_delta=return_delta)


def check_case(backend, case: Case, seed: int = 0, deterministic: bool = False):
    """out, lse and the softmax (``return_attn_probs``: not with qv) against the oracle; with
    ``grads`` dq, dk, dv, and the sinks' gradient from the backward's Delta and the forward's lse
    (:func:`flash_attn.custom_ops.sink_gradient`, what the public functions' autograd returns)."""
    from flash_attn.custom_ops import sink_gradient

    inp = make_inputs(case, seed)
    dout = inp.dout if case.grads else None
    tensors, fn = oracle_tensors(inp)
    ref, ref_grads, naive, naive_grads = oracle_pair(fn, tensors, dout=dout, **inp.oracle_kwargs)
    out, lse, s_dmask = run_forward(backend, inp, return_softmax=not case.qv)
    check_close(out, ref.out, naive.out, case.dtype, f"{case}: out")
    check_close(lse, ref.lse, naive.lse, case.dtype, f"{case}: lse")
    if not case.qv:
        keep = inp.keep if case.dropout_p else torch.ones_like(ref.probs, dtype=torch.bool)
        check_dropout_signs(s_dmask.cpu(), ref.probs, keep, case)
    if case.grads:
        assert not case.qv, "the kernels have no backward of qv: test it on the PyTorch backends"
        *grads, delta = run_backward(backend, inp, out, lse, deterministic, return_delta=True)
        if case.sinks:
            grads.append(sink_gradient(_to(inp.sinks, out.device), lse, delta, inp.varlen is not None))
        for name, ours, r, n in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, naive_grads):
            check_close(ours, r, n, case.dtype, f"{case}: {name}", grad=True)
    return inp, out, lse


def check_case_with(backend, case, kind: str, config: configs.Config, deterministic: bool = False):
    """:func:`check_case` with ``config`` in the place of the interpreter's ``kind`` entry (every
    head dim and variant); plans made before and within are forgotten."""
    if backend.name != "interpret":
        pytest.skip("interpreter only: the GPU runs the table's configs (test_kernels_match_oracle)")
    entries = {(kind, "interpret", bucket, variant): config
               for bucket in configs.HEADDIM_BUCKETS for variant in configs.VARIANTS}
    backend.module._backend.forget_plans()
    try:
        with configs.overridden(entries):
            check_case(backend, case, deterministic=deterministic)
    finally:
        backend.module._backend.forget_plans()


def check_dropout_signs(s_dmask, probs, keep, case):
    """S_dmask (``return_softmax``): |entries| are the probabilities, zero where masked, negative
    exactly where dropout dropped them (``keep`` all True without dropout)."""
    assert s_dmask.shape == probs.shape
    assert torch.equal(s_dmask[probs == 0], torch.zeros_like(s_dmask[probs == 0])), f"{case}: S_dmask != 0 where masked"
    clear = probs > 1e-30  # far from fp32 underflow (GPU exp2 flushes denormals to zero)
    assert (s_dmask[clear] != 0).all(), f"{case}: S_dmask is 0 at visible entries"
    assert torch.equal(s_dmask[clear] < 0, ~keep[clear]), f"{case}: S_dmask signs differ from the keep mask"
    torch.testing.assert_close(s_dmask.abs().double(), probs.double(), atol=2e-3, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# The representative matrix (CI).

F16, B16 = torch.float16, torch.bfloat16
CASES = [
    # dense; seqlens multiples of the interpreter blocks (32 x 16) and not; sq != sk both ways
    Case(F16, 64, 2, 2, batch=2, seqlen_q=64, seqlen_k=64),
    Case(B16, 64, 4, 2, batch=2, seqlen_q=37, seqlen_k=45),
    Case(F16, 59, 4, 1, seqlen_q=50, seqlen_k=20, window=(-1, 0)),  # MQA, causal, rows without keys
    Case(B16, 32, 2, 1, seqlen_q=20, seqlen_k=70, window=(-1, 0)),
    Case(F16, 128, 4, 2, seqlen_q=45, seqlen_k=64, window=(8, 3)),
    Case(B16, 256, 1, 1, seqlen_q=33, seqlen_k=33, window=(-1, 0), softcap=5.0),
    # head dim 256 (padded from 200): the fused backward splits the gradients' columns in two
    Case(F16, 200, 4, 2, seqlen_q=37, seqlen_k=45, window=(-1, 0), dropout_p=0.2),
    Case(F16, 64, 2, 2, seqlen_q=40, seqlen_k=40, window=(-1, 5), softcap=2.0, alibi="bh"),
    Case(B16, 128, 2, 1, seqlen_q=1, seqlen_k=77, window=(-1, 0), alibi="h"),
    Case(F16, 32, 1, 1, seqlen_q=1, seqlen_k=1),
    Case(F16, 64, 2, 2, seqlen_q=30, seqlen_k=18, window=(5, -1)),  # left-only window, sq > sk
    Case(B16, 64, 2, 2, seqlen_q=18, seqlen_k=30, window=(-1, 3)),  # right-only window
    Case(F16, 32, 2, 2, seqlen_q=40, seqlen_k=24, window=(0, 0)),  # many rows see no key
    # dropout (with the other features)
    Case(F16, 64, 4, 2, batch=2, seqlen_q=48, seqlen_k=48, window=(-1, 0), dropout_p=0.25),
    Case(B16, 59, 2, 2, seqlen_q=33, seqlen_k=21, softcap=3.0, alibi="h", dropout_p=0.3),
    # varlen, zero-length sequences on either side
    Case(F16, 64, 4, 2, lens=((5, 0, 33, 17), (9, 4, 0, 40)), window=(-1, 0)),
    Case(B16, 128, 2, 2, lens=((20, 1, 40), (35, 1, 16)), window=(6, 2), dropout_p=0.2),
    Case(F16, 32, 2, 1, lens=((17, 31), (64, 17)), alibi="bh", softcap=4.0),
    # paged K/V (forward in the kernels; gradients through the reference fallback)
    Case(F16, 64, 4, 2, lens=((20, 0, 37), (50, 7, 33)), window=(-1, 0), page_size=16),
    Case(B16, 128, 2, 1, lens=((33, 8), (70, 300)), window=(10, 0), alibi="h", page_size=256),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_oracle(backend, case, recwarn):
    check_case(backend, case)


# Beyond FlashAttention-2: v's own head dim (narrower, wider; the (256, 128) pair images' shape),
# attention sinks with every feature they combine with, MLA's qv (forward: the kernels have none of
# its backward), head dim 512 (the forward's output and the backward's gradient columns split over
# programs) and padded up to it. A few d512 cases: the interpreter's time grows with the width.
BEYOND_FA2_CASES = [
    Case(F16, 192, 4, 2, seqlen_q=37, seqlen_k=45, window=(-1, 0), headdim_v=128),
    Case(B16, 128, 2, 1, lens=((20, 0, 33), (35, 7, 0)), window=(6, 2), dropout_p=0.2, headdim_v=64),
    Case(F16, 64, 4, 4, seqlen_q=30, seqlen_k=40, softcap=3.0, alibi="h", headdim_v=128),
    Case(F16, 64, 4, 2, batch=2, seqlen_q=48, seqlen_k=48, window=(-1, 0), sinks=True),
    Case(B16, 59, 2, 2, seqlen_q=33, seqlen_k=21, softcap=3.0, alibi="bh", dropout_p=0.3, sinks=True),
    Case(F16, 128, 6, 2, seqlen_q=40, seqlen_k=24, window=(3, 0), sinks=True),  # rows without keys: lse = sink
    Case(F16, 64, 4, 2, lens=((5, 0, 33, 17), (9, 4, 0, 40)), window=(-1, 0), sinks=True, headdim_v=32),
    Case(F16, 64, 4, 2, lens=((20, 0, 37), (50, 7, 33)), window=(-1, 0), page_size=16, sinks=True, grads=False),
    Case(F16, 64, 4, 1, seqlen_q=20, seqlen_k=50, window=(-1, 0), headdim_v=128, qv=True, sinks=True, grads=False),
    Case(B16, 32, 2, 2, lens=((17, 31), (64, 17)), headdim_v=64, qv=True, grads=False),
    Case(F16, 512, 2, 1, seqlen_q=33, seqlen_k=40, window=(-1, 0), sinks=True),
    Case(B16, 448, 2, 2, seqlen_q=20, seqlen_k=37, softcap=2.0, headdim_v=320),
]


@pytest.mark.parametrize("case", BEYOND_FA2_CASES, ids=str)
def test_beyond_fa2_kernels_match_oracle(backend, case, recwarn):
    check_case(backend, case)


# The AMD families' head-dim-512 tiles (configs._AMD; compiled for their GPUs by `amd-kernels`, run on
# none): each distinct tile of a kind (warps and stages are the compiler's, not the interpreter's) in
# the interpreter, causal GQA with partial tiles; the split kernels through deterministic=True without
# the fused kernel's splits.
AMD_512_TILES = sorted({(kind, config.block_m, config.block_n) for family in families.of_vendor("amd")
                        for kind in configs.KINDS for config in [configs.pick(kind, 512, family)]
                        if config is not None})
AMD_512_CASE = Case(F16, 512, 2, 1, seqlen_q=80, seqlen_k=72, window=(-1, 0))


@pytest.mark.parametrize("kind,block_m,block_n", AMD_512_TILES, ids=[f"{k}-{m}x{n}" for k, m, n in AMD_512_TILES])
def test_amd_head_dim_512_tiles_match_oracle(backend, kind, block_m, block_n, recwarn):
    split = kind in configs.SPLIT_BACKWARD_KINDS
    case = dataclasses.replace(AMD_512_CASE, grads=kind != "fwd")
    with configs.overridden({("deterministic_splits", "interpret"): 0}):
        check_case_with(backend, case, kind, configs.Config(block_m, block_n, 1, 1), deterministic=split)


def test_qv_backward_runs_on_the_reference_with_one_warning(backend, monkeypatch):
    """The kernels have no backward of qv (FlashAttention-3 has none either): the planner refuses it
    before anything runs and the reference computes it, with one warning naming why; under
    FLASH_ATTN_STRICT_BACKEND=1 (as .ci/gpu-check runs) the refusal raises instead, naming qv."""
    _fresh_warnings(monkeypatch)
    case = Case(F16, 32, 2, 2, seqlen_q=9, seqlen_k=9, headdim_v=48, qv=True)
    inp = make_inputs(case)
    out, lse, _ = run_forward(backend, inp)
    args = (*(_to(t, backend.device) for t in (inp.dout, inp.q, inp.k, inp.v)), out, lse, inp.params)
    monkeypatch.setenv(dispatch.STRICT_ENV, "1")
    with pytest.raises(dispatch.BackendRefusedError, match="qv"):
        dispatch.run("backward", backend.device, *args, qv=_to(inp.qv, backend.device))
    monkeypatch.delenv(dispatch.STRICT_ENV)
    with pytest.warns(UserWarning, match="qv"):
        dispatch.run("backward", backend.device, *args, qv=_to(inp.qv, backend.device))


@pytest.fixture
def uninitialized_memory_is_nan():
    """Every ``torch.empty`` filled with NaN (integers: their largest value), PyTorch's own switch
    for finding reads of memory nothing wrote (it needs deterministic algorithms on), on the CPU
    and on CUDA alike. The planner allocates the backward's buffers empty, the dQ sums included."""
    with poisoned_empty():
        yield


ALL_FAMILIES = (*configs.FAMILY_CAPABILITY, "interpret")


# beyond FlashAttention-2: 192/128 (two column parts), sinks with every score feature, head dim 512 (four parts)
@pytest.mark.parametrize("case", [c for c in CASES if c.grads and c.page_size is None][::3]
                         + [BEYOND_FA2_CASES[i] for i in (0, 4, 10)], ids=str)
def test_deterministic_split_kernels_match_oracle(backend, case, recwarn):
    """``deterministic=True`` through the split dK/dV and dQ kernels (every family without a
    fused backward, and calls whose splits of the fused kernel could not keep the SMs busy); the
    default, the fused kernel with atomic dQ, is what test_kernels_match_oracle checks."""
    backend.module._backend.forget_plans()
    try:
        with configs.overridden({("deterministic_splits", family): 0 for family in ALL_FAMILIES}):
            check_case(backend, case, deterministic=True)
    finally:
        backend.module._backend.forget_plans()


# Longer key sequences than the matrix's, so that each split walks several key blocks of the
# interpreter's 32 keys: GQA + causal, the head dim split in two (d200) + dropout (two splits
# each), varlen with an empty query sequence + window (one split: six programs fill the four
# SMs), softcap + ALiBi (one split).
FUSED_DETERMINISTIC_CASES = [
    Case(F16, 64, 4, 2, seqlen_q=70, seqlen_k=150, window=(-1, 0)),
    Case(B16, 200, 2, 1, seqlen_q=40, seqlen_k=130, dropout_p=0.2),
    Case(F16, 32, 2, 2, lens=((17, 0, 60), (90, 25, 140)), window=(6, 2)),
    Case(B16, 128, 2, 2, seqlen_q=33, seqlen_k=100, softcap=3.0, alibi="h"),
]


@pytest.fixture
def two_splits(backend, monkeypatch):
    """The fused backward's ``deterministic=True`` path with few splits: an interpreter target of
    4 SMs (the planner gives every SM a program: splits x batch x kv heads x column parts)."""
    if backend.name != "interpret":
        pytest.skip("interpreter only: a GPU plans its own splits (test_deterministic.py checks them bit for bit)")
    from flash_attn.planning.plan import Target

    monkeypatch.setattr(backend.module, "TARGET", Target("interpret", 4))
    backend.module._backend.forget_plans()
    yield
    backend.module._backend.forget_plans()


@pytest.mark.parametrize("case", FUSED_DETERMINISTIC_CASES, ids=str)
def test_deterministic_fused_backward_matches_oracle(backend, two_splits, case, uninitialized_memory_is_nan,
                                                     recwarn):
    """``deterministic=True`` through the fused kernel (FlashAttention-2's way): each program walks
    the key blocks of its split in turn, adding dQ into sums of its own that the convert adds up
    (every split's sums zeroed by the preprocess: allocations come NaN-filled)."""
    check_case(backend, case, deterministic=True)


@pytest.mark.parametrize("case", FUSED_DETERMINISTIC_CASES[:3], ids=str)
def test_deterministic_fused_backward_with_pointer_loads_matches_oracle(backend, two_splits, case,
                                                                        uninitialized_memory_is_nan, recwarn):
    """Blackwell's way of the above: the same splits with Q and dO by pointer loads (``tma=False``,
    sm100 has no descriptor path in the fused backward): causal GQA, d200 (gradient columns split
    over two programs) + dropout, varlen + window."""
    check_case_with(backend, case, "bwd_fused", configs.INTERPRETER_CONFIGS["bwd_fused"]._replace(tma=False),
                    deterministic=True)


def test_deterministic_fused_backward_keeps_each_splits_dq_apart(backend, two_splits, monkeypatch):
    """What makes it deterministic: split ``s`` of ``n`` adds only its own key blocks (``s, s + n,
    ...``) into its own dQ sums, which no other program touches. The sums (caught as the planner
    allocates them; four splits here, 5 key blocks) against float64 dS K over each split's keys;
    one shared buffer would put every key in split 0 and none in the others."""
    case = Case(F16, 64, 2, 1, seqlen_q=40, seqlen_k=150)
    inp = make_inputs(case)
    made = []
    empty = torch.empty

    def recording_empty(*shape, **kwargs):
        t = empty(*shape, **kwargs)
        if kwargs.get("dtype") == torch.float32 and t.dim() == 5:
            made.append(t)
        return t

    out, lse, _ = run_forward(backend, inp)
    monkeypatch.setattr(torch, "empty", recording_empty)
    run_backward(backend, inp, out, lse, deterministic=True)
    monkeypatch.setattr(torch, "empty", empty)
    (sums,) = made
    splits = sums.shape[2]
    assert sums.shape[:4] == (1, 40, 4, 2)  # (batch, rows, splits, heads)

    q, k, v, dout = (t[0].double().transpose(0, 1) for t in (inp.q, inp.k, inp.v, inp.dout))  # (h, s, d)
    k, v = k.expand(2, -1, -1), v.expand(2, -1, -1)  # one kv head for both query heads
    p = torch.softmax(q @ k.transpose(1, 2) * inp.params.softmax_scale, -1)
    dp = dout @ v.transpose(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # delta = rowsum(dO * O) = rowsum(P * dP)
    block = configs.pick("bwd_fused", 64, "interpret").block_n
    keys = torch.arange(150)
    for split in range(splits):
        own = (keys // block) % splits == split
        expected = (ds[:, :, own] @ k[:, own]).transpose(0, 1)  # (s, h, d)
        got = sums[0, :, split, :, :64].double()
        assert (got - expected).abs().max() <= 1e-2 * expected.abs().max(), f"split {split}"


# Window sides wider than any sequence, up to the largest the kernels' int32 parameters take: the
# same masks as no bound on that side. The kernels once added such a side to a row position in
# int32 and the sum wrapped around, masking every key of the rows it reached (2**31 - 1 with
# more queries than keys).
WIDE_WINDOW_CASES = [
    Case(F16, 64, 2, 1, seqlen_q=40, seqlen_k=20, window=(2**31 - 1, 5)),
    Case(B16, 64, 2, 2, seqlen_q=20, seqlen_k=45, window=(3, 2**31 - 1)),
    Case(F16, 32, 2, 2, lens=((17, 0, 30), (9, 25, 40)), window=(2**31 - 2, 2**31 - 1)),
    Case(F16, 128, 2, 2, seqlen_q=50, seqlen_k=30, window=(2**31 - 1, 0)),  # causal, rows without keys
]


@pytest.mark.parametrize("case", WIDE_WINDOW_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_windows_wider_than_the_sequences_match_oracle(backend, case, deterministic, recwarn):
    check_case(backend, case, deterministic=deterministic)


@pytest.mark.parametrize("case", [CASES[1], CASES[6], CASES[7], CASES[16]], ids=str)
def test_fused_backward_with_64_query_steps_matches_oracle(backend, case, recwarn):
    """Hopper's fused backward walks 64 or more queries a step at head dims <= 128 and then
    computes dQ as such; with fewer (the interpreter's 16, d256's 32) it computes dQ^T. The matrix
    above runs the interpreter's own config: here the other path, on dense, windowed + ALiBi +
    softcap and varlen + dropout calls."""
    check_case_with(backend, case, "bwd_fused", configs.Config(64, 32, 1, 1))


@pytest.mark.parametrize("case", [CASES[6], CASES[7], CASES[16]], ids=str)
def test_fused_backward_with_pointer_loads_matches_oracle(backend, case, recwarn):
    """The interpreter runs the fused backward the Hopper way, Q and dO through tensor
    descriptors; a config with ``tma=False`` (a sweep candidate, or a measured exception) takes
    the pointer loads: split d200 + dropout, windowed + ALiBi + softcap, varlen + dropout."""
    check_case_with(backend, case, "bwd_fused", configs.INTERPRETER_CONFIGS["bwd_fused"]._replace(tma=False))


@pytest.mark.parametrize("case", [CASES[2], CASES[6], CASES[15], CASES[16]], ids=str)
@pytest.mark.parametrize("dq_tma", [False, True], ids=["atomics", "tma-reductions"])
def test_fused_backward_starts_from_the_sums_its_preprocess_zeroed(backend, case, dq_tma, uninitialized_memory_is_nan,
                                                                    recwarn):
    """The fused backward's fp32 dQ sums get no memset: the preprocess zeroes the rows it reads
    (FlashAttention-2's order). With every allocation NaN, a row or column it missed poisons dQ:
    MQA + causal at d59 (rows without keys), the split d200 + dropout, varlen with empty
    sequences, varlen + window + dropout; dQ by atomics and by descriptor reductions."""
    if backend.name != "interpret":
        if dq_tma:
            pytest.skip("interpreter only: a GPU runs its table's config, once (the atomics case)")
        check_case(backend, case)
        return
    check_case_with(backend, case, "bwd_fused", configs.INTERPRETER_CONFIGS["bwd_fused"]._replace(dq_tma=dq_tma))


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[6], CASES[16]], ids=str)
@pytest.mark.parametrize("block_m", [16, 64])
def test_fused_backward_with_dq_by_tma_reductions_matches_oracle(backend, case, block_m, recwarn):
    """``dq_tma=True`` (the sweep's "-red" candidates): the fused backward adds dQ by tensor-
    descriptor reductions, whose bounds drop the rows past the sequence and the columns past the
    head dim (MQA + causal at d59, windowed d128, split d200 + dropout, varlen + window +
    dropout), after a dQ^T product (16 queries a step) or a plain one (64). The interpreter runs
    the reduction through the stand-in of flash_attn/backends/_interpreter.py (its meaning, not
    the hardware's ordering: a GPU run checks that)."""
    config = configs.Config(block_m, 32, 1, 1, dq_tma=True)
    assert declarations.get("attn_bwd_kernel").tile_constexprs(128, config, "interpret")["TMA_DQ"] is True
    check_case_with(backend, case, "bwd_fused", config)


def _check_dkdv_column_split(backend, case, monkeypatch, tma: bool, overrides: dict):
    """``deterministic=True`` with the interpreter's dK/dV kernel splitting the gradient columns
    at head dims over 128 (and streaming Q and dO through tensor descriptors where ``tma``), within
    ``configs.overridden(overrides)``."""
    if backend.name != "interpret":
        pytest.skip("interpreter only: the GPU runs its own family's way (test_deterministic_kernels_match_oracle)")
    if tma:
        monkeypatch.setitem(configs.TMA_FAMILIES, "bwd_dkdv", frozenset({"interpret"}))
    monkeypatch.setitem(configs.SPLIT_COLUMN_FAMILIES, "bwd_dkdv", frozenset({"interpret"}))
    backend.module._backend.forget_plans()
    try:
        decl = declarations.get("attn_bwd_dkdv_kernel")
        blocks = decl.tile_constexprs(256, configs.pick("bwd_dkdv", 256, "interpret"), "interpret")
        assert (blocks["TMA"], blocks["BLOCK_DOUT"]) == (tma, 128)
        with configs.overridden(overrides):
            check_case(backend, case, deterministic=True)
    finally:
        backend.module._backend.forget_plans()


@pytest.mark.parametrize("case", [CASES[4], CASES[5], CASES[6], CASES[16]], ids=str)
def test_deterministic_dkdv_kernel_the_hopper_way_matches_oracle(backend, case, recwarn, monkeypatch):
    """``deterministic=True`` on Hopper: the dK/dV kernel streams Q and dO through tensor
    descriptors and, at head dims over 128, splits the gradient columns over two programs (as the
    fused backward does); the interpreter's own family runs the Ampere way (pointers, whole rows).
    Windowed d128, causal d256 + softcap, split d200 + dropout, varlen + window + dropout."""
    _check_dkdv_column_split(backend, case, monkeypatch, True, {})


@pytest.mark.parametrize("case", [CASES[5], CASES[6]], ids=str)
def test_deterministic_dkdv_kernel_with_split_columns_the_ampere_way_matches_oracle(backend, case, recwarn,
                                                                                   monkeypatch):
    """``deterministic=True`` on the mma.sync families (sm80, sm86, sm120): at head dims over 128
    the dK/dV kernel splits the gradient columns over two programs with pointer loads (no tensor
    descriptors), through the split kernels (no fused splits). Causal d256 + softcap, split d200
    + dropout."""
    _check_dkdv_column_split(backend, case, monkeypatch, False, {("deterministic_splits", "interpret"): 0})


# The mma.sync tables' tiles (sm80, sm86, sm120; their static floors: tests/aot/test_mma_sync_floors.py)
# at sequence lengths that straddle them: 128 x 64 forward steps, 128 keys per dK/dV program over
# 32 or 16 queries a step, dQ over 128 queries, the fused backward over 128 keys with pointer
# loads (sm80 at d128).
MMA_SYNC_CASES = [
    Case(B16, 128, 2, 1, seqlen_q=150, seqlen_k=140, window=(-1, 0)),
    Case(F16, 64, 2, 2, lens=((70, 0, 133), (140, 9, 60)), softcap=3.0, dropout_p=0.2),
]


@pytest.mark.parametrize("case", MMA_SYNC_CASES, ids=str)
@pytest.mark.parametrize("kind,config", [("fwd", configs.Config(128, 64, 1, 1)),
                                         ("bwd_dkdv", configs.Config(32, 128, 1, 1)),
                                         ("bwd_dkdv", configs.Config(16, 128, 1, 1)),
                                         ("bwd_dq", configs.Config(128, 32, 1, 1)),
                                         ("bwd_fused", configs.Config(16, 128, 1, 1, tma=False))], ids=str)
def test_mma_sync_tiles_match_oracle(backend, case, kind, config, recwarn):
    with configs.overridden({("deterministic_splits", "interpret"): 0}):  # dK/dV, dQ: the split kernels
        check_case_with(backend, case, kind, config, deterministic=kind in configs.SPLIT_BACKWARD_KINDS)


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[16], CASES[19]], ids=str)
def test_forward_through_tensor_descriptors_matches_oracle(backend, case, recwarn):
    """The forward with ``tma=True`` (the sweep's "-tma" candidates): K and V through tensor
    descriptors, whose bounds mask the rows past the sequence and the columns past the head dim;
    MQA + causal with d59, a two-sided window, varlen + dropout, and paged K/V (which keeps its
    pointer gather)."""
    check_case_with(backend, case, "fwd", configs.INTERPRETER_CONFIGS["fwd"]._replace(tma=True))


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[5], CASES[12], CASES[16], CASES[17], CASES[19]], ids=str)
def test_forward_warp_specialised_matches_oracle(backend, case, recwarn):
    """The forward with ``ws=True`` (the sweep's "-ws" candidates): one loop over every key tile,
    each masked, Q, K and V through tensor descriptors, and no early return for blocks past the
    sequence (varlen with empty and short sequences); paged K/V keeps the three-stage pointer
    path. The interpreter runs this code, not the warp specialisation itself (producer and
    consumer warpgroups): that only a GPU runs (the sweep checks each candidate's output)."""
    check_case_with(backend, case, "fwd", configs.INTERPRETER_CONFIGS["fwd"]._replace(ws=True))


def test_jit_backend_sets_a_scratch_allocator_only_where_none_is_set():
    """Kernels that make tensor descriptors (the fused backward's TMA loads on Hopper) ask Triton's
    allocator for scratch memory at launch: the JIT backend provides one (PyTorch's caching
    allocator) unless the program set its own. Checked in a fresh context (Triton keeps the
    allocator in a context variable); the allocation itself needs a GPU."""
    pytest.importorskip("triton")
    import contextvars

    import triton
    from triton.runtime import _allocation

    from flash_attn.backends import triton as jit

    def mine(size, alignment, stream):
        raise AssertionError("not called here")

    def run():
        jit._ensure_scratch_allocator()
        ours = _allocation._allocator.get()
        triton.set_allocator(mine)
        jit._ensure_scratch_allocator()
        return ours, _allocation._allocator.get()

    assert contextvars.Context().run(run) == (jit._scratch_memory, mine)


def test_backward_is_deterministic(backend):
    case = Case(F16, 64, 4, 1, batch=2, seqlen_q=45, seqlen_k=45, window=(-1, 0), dropout_p=0.2, alibi="h")
    inp = make_inputs(case)
    out, lse, _ = run_forward(backend, inp)
    first = run_backward(backend, inp, out, lse, deterministic=True)
    second = run_backward(backend, inp, out, lse, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_rows_without_keys(backend):
    """Out 0, lse +inf, zero gradients and no NaN for rows that see no key."""
    case = Case(F16, 32, 2, 2, seqlen_q=40, seqlen_k=8, window=(-1, 0), alibi="h", softcap=3.0)
    inp = make_inputs(case)
    out, lse, _ = run_forward(backend, inp)
    blind = 40 - 8  # with sq > sk and causal, the first sq - sk rows see nothing
    assert torch.equal(out[:, :blind].cpu(), torch.zeros_like(out[:, :blind].cpu()))
    assert torch.isinf(lse[..., :blind]).all() and (lse[..., :blind] > 0).all()
    assert torch.isfinite(lse[..., blind:]).all()
    dq, dk, dv = run_backward(backend, inp, out, lse)
    assert torch.equal(dq[:, :blind].cpu(), torch.zeros_like(dq[:, :blind].cpu()))
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))


# ---------------------------------------------------------------------------------------------
# Dropout: the very same mask as the reference backend and the PyTorch RNG.


def test_dropout_masks_bit_equal_to_reference_backend(backend):
    from flash_attn.backends import reference

    case = Case(B16, 64, 3, 1, batch=2, seqlen_q=40, seqlen_k=56, window=(20, -1), dropout_p=0.4)
    inp = make_inputs(case, seed=3)
    _, _, ours = run_forward(backend, inp, return_softmax=True)
    _, _, theirs = reference.forward(inp.q, inp.k, inp.v, inp.params, return_softmax=True)
    ours = ours.cpu()
    clear = theirs.abs() > 1e-30  # away from fp32 underflow
    assert clear.float().mean() > 0.5
    assert torch.equal(ours[theirs == 0], theirs[theirs == 0])
    assert torch.equal(ours[clear] < 0, theirs[clear] < 0)  # bit-equal keep masks


def test_dropout_kept_fraction(backend):
    p = 0.3
    case = Case(F16, 32, 4, 4, batch=2, seqlen_q=64, seqlen_k=64, dropout_p=p, grads=False)
    inp = make_inputs(case, seed=5)
    _, _, s_dmask = run_forward(backend, inp, return_softmax=True)
    n = s_dmask.numel()
    dropped = (s_dmask < 0).sum().item() / n
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(dropped - p) < 5 * sigma, f"dropped fraction {dropped:.4f}, expected {p} +- {5 * sigma:.4f}"


# ---------------------------------------------------------------------------------------------
# Fallbacks and plumbing.


def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())


def test_paged_backward_falls_back_to_reference_with_one_warning(backend, monkeypatch):
    _fresh_warnings(monkeypatch)
    case = Case(F16, 64, 2, 2, lens=((20, 9), (40, 17)), page_size=16)
    inp = make_inputs(case)
    out, lse, _ = run_forward(backend, inp)
    with pytest.warns(UserWarning, match="paged"):
        run_backward(backend, inp, out, lse)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        run_backward(backend, inp, out, lse)


def test_fp32_inputs_fall_back_to_reference(backend, monkeypatch):
    _fresh_warnings(monkeypatch)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=gen(1)).to(backend.device) for _ in range(3))
    params = AttentionParams(0.25)
    with pytest.warns(UserWarning, match="float32"):
        out, lse, _ = dispatch.run("forward", backend.device, q, k, v, params)
    from flash_attn.backends import reference

    ref_out, ref_lse, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), params)
    torch.testing.assert_close(out.cpu(), ref_out)


def test_public_api_runs_on_the_backend(backend, monkeypatch):
    """flash_attn_func with FLASH_ATTN_BACKEND=<backend>: forward and autograd go through the kernels."""
    from flash_attn import flash_attn_func

    monkeypatch.setenv("FLASH_ATTN_BACKEND", backend.name)
    g = gen(11)
    q, k, v = (torch.randn(2, 24, 4, 40, generator=g).half().to(backend.device).requires_grad_() for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    monkeypatch.setenv("FLASH_ATTN_BACKEND", "reference")
    for t in (q, k, v):
        t.grad = None
    ref = flash_attn_func(q.cpu(), k.cpu(), v.cpu(), causal=True) if backend.device.type != "cpu" else \
        flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-3, rtol=1e-2)
    if backend.device.type == "cpu":
        ref.float().square().sum().backward()
        for ours, theirs in zip(grads, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


def test_interpreter_leaves_triton_untouched():
    """After an interpreted launch, triton.language and the interpreter are as they were."""
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter
    from triton.runtime.jit import JITFunction

    from flash_attn.backends import interpret

    before = {name: value for name, value in vars(tl).items()}
    case = Case(B16, 32, 1, 1, seqlen_q=16, seqlen_k=16, dropout_p=0.5, grads=False)
    inp = make_inputs(case)
    interpret.forward(inp.q, inp.k, inp.v, inp.params)
    assert isinstance(tl.philox, JITFunction) and isinstance(tl.sum, JITFunction)
    assert {name: value for name, value in vars(tl).items()} == before
    assert "create_dot" not in vars(triton_interpreter.interpreter_builder)
    assert "create_descriptor_reduce" not in vars(triton_interpreter.interpreter_builder)


def test_interpreter_stand_in_for_descriptor_reductions():
    """Triton 3.9's interpreter has no descriptor reductions (``desc.atomic_add``: TMA's bulk
    reduction, and min/max/and/or/xor); our launches get a stand-in with their meaning: the block
    combined at the descriptor's offsets, what lies past the descriptor's shape dropped. Checked
    against results written out here: four 16 x 32 blocks reduced into rows 2.. of a 10 x 24 view
    of a 20 x 32 buffer (rows past 10 and columns past 24 stay as they were)."""
    import triton
    import triton.language as tl

    from flash_attn.backends import _interpreter

    @triton.jit
    def reduce_blocks(X, Y, rows, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        y = tl.make_tensor_descriptor(Y, shape=[rows, 24], strides=[BLOCK_D, 1], block_shape=[BLOCK_M, BLOCK_D])
        offs = (pid * BLOCK_M + tl.arange(0, BLOCK_M))[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        y.atomic_add([2, 0], tl.load(X + offs))

    x = torch.randn(4 * 16, 32, generator=torch.Generator().manual_seed(3))
    y = torch.zeros(20, 32)
    _interpreter.launch(reduce_blocks, (4,), x, y, 10, BLOCK_M=16, BLOCK_D=32)
    expected = torch.zeros(20, 32)
    expected[2:10, :24] = sum(x[16 * i: 16 * i + 8, :24] for i in range(4))
    torch.testing.assert_close(y, expected)

    # the integer reductions the language has, the same way (signed min and max, and xor)
    @triton.jit
    def reduce_ints(X, Y, rows, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr):
        pid = tl.program_id(0)
        y = tl.make_tensor_descriptor(Y, shape=[rows, 24], strides=[BLOCK_D, 1], block_shape=[BLOCK_M, BLOCK_D])
        x = tl.load(X + (pid * BLOCK_M + tl.arange(0, BLOCK_M))[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :])
        if KIND == 0:
            y.atomic_max([2, 0], x)
        elif KIND == 1:
            y.atomic_min([2, 0], x)
        else:
            y.atomic_xor([2, 0], x)

    xi = torch.randint(-1000, 1000, (4 * 16, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(4))
    blocks = [xi[16 * i: 16 * i + 8, :24] for i in range(4)]
    start = torch.full((20, 32), 7, dtype=torch.int32)
    for kind, combine in enumerate((torch.maximum, torch.minimum, torch.bitwise_xor)):
        y = start.clone()
        _interpreter.launch(reduce_ints, (4,), xi, y, 10, BLOCK_M=16, BLOCK_D=32, KIND=kind)
        expected = start.clone()
        for block in blocks:
            expected[2:10, :24] = combine(expected[2:10, :24], block)
        assert torch.equal(y, expected), kind


# ---------------------------------------------------------------------------------------------
# The whole cross product (not in CI).

FULL_SHAPES = [(1, 1), (16, 16), (17, 64), (64, 17), (45, 45), (64, 96)]
FULL_HEADS = [(2, 2), (4, 2), (4, 1)]
FULL_MASKS = [(-1, -1), (-1, 0), (7, 3), (0, -1)]
FULL_FEATURES = [{}, {"softcap": 5.0}, {"alibi": "bh"}, {"dropout_p": 0.2}]
# Not in the matrix: dropout with a single key. There P == 1 exactly, the exact dQ is 0 and the
# naive low-precision oracle gets exactly 0 too, so the rule leaves only its floor; FlashAttention's
# delta = rowsum(dO * O) uses the output *rounded to the input dtype* (upstream does the same, and
# so does our reference backend), which leaves an error of an ulp of O times |dO| |K| in dQ.
FULL_CASES = [
    Case(dtype, d, h, hk, batch=2, seqlen_q=sq, seqlen_k=sk, window=w, **feat)
    for dtype in (F16, B16)
    for d in (32, 59, 64, 128, 256)
    for (sq, sk) in FULL_SHAPES
    for (h, hk) in FULL_HEADS
    for w in FULL_MASKS
    for feat in FULL_FEATURES
    if not (feat.get("dropout_p") and sk == 1)
] + [
    Case(dtype, d, 4, 2, lens=lens, window=w, page_size=page, **feat)
    for dtype in (F16, B16)
    for d in (32, 59, 128, 256)
    for lens in (((1, 0, 17, 40), (3, 5, 0, 64)), ((64, 33), (17, 300)))
    for w in FULL_MASKS
    for page in (None, 16, 256)
    for feat in FULL_FEATURES
]


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", FULL_CASES, ids=str)
def test_full_matrix(backend, case, recwarn):
    check_case(backend, case)


# ---------------------------------------------------------------------------------------------
# Launch configurations and GPU compilation (no GPU needed).

CAPABILITIES = [((8, 0), "sm80"), ((8, 6), "sm86"), ((8, 9), "sm86"), ((9, 0), "sm90"), ((10, 0), "sm100"),
                 ((10, 3), "sm100"), ((12, 0), "sm120"), ((12, 1), "sm120")]


@pytest.mark.parametrize("capability,family", CAPABILITIES)
def test_every_picked_config_fits_its_architecture(capability, family):
    """Whatever head dim (1..512) and variant a call has, the config it gets is a valid launch on
    that GPU: MMA-sized tiles, 4 or 8 warps, and shared memory within the architecture's limit.
    (Whether it is a good config is for the build report: registers, spills, MMA family.)"""
    assert configs.arch_family(capability) == family
    limit = configs.SHARED_MEMORY_LIMIT[family]
    for kind in configs.KINDS:
        for features in (False, True):
            for headdim in range(1, 513):
                config = configs.pick_config(kind, headdim, capability, features=features)
                if config is None:  # only the fused backward: the split kernels serve that head dim
                    assert kind == "bwd_fused" and configs.pick_config("bwd_dkdv", headdim, capability, features)
                    continue
                assert config.block_m % 16 == 0 and config.block_n % 16 == 0, (kind, headdim, config)
                # 2 warps: tiles of 16 rows a warp where shared memory holds no more (head dim 512;
                # 256 on 99 KB: the dK/dV kernel's 32 keys, each warp its own rows)
                assert config.num_warps in ((2, 4, 8) if headdim > 256 or (headdim > 128 and limit < 100 * 1024)
                                            else (4, 8)) and config.num_stages >= 1
                padded = configs.padded_headdim(headdim)
                estimate = configs.estimate_shared_memory(kind, config, padded, family)
                assert estimate <= limit, f"{kind} d={headdim} features={features} {config}: ~{estimate} B > {limit} B"
        with pytest.raises(ValueError):
            configs.pick_config(kind, 513, capability)


def test_interpreter_uses_small_blocks():
    for kind in configs.KINDS:
        config = configs.pick_config(kind, 128, None)
        assert config.block_m <= 32 and config.block_n <= 32


def test_padded_headdim():
    assert [configs.padded_headdim(d) for d in (1, 16, 17, 32, 59, 64, 65, 128, 200, 256)] == \
        [16, 16, 32, 32, 64, 64, 128, 128, 256, 256]


ALL_FEATURES = dict(IS_LOCAL=True, HAS_SOFTCAP=True, HAS_ALIBI=True, HAS_DROPOUT=True, IS_PAGED=True, PAD_HEADDIM=True,
                    HAS_QV=True)
KERNEL_NAMES = {"fwd": "attn_fwd_kernel", "probs": "attn_probs_kernel", "bwd_preprocess": "attn_bwd_preprocess_kernel",
                "bwd_dkdv": "attn_bwd_dkdv_kernel", "bwd_dq": "attn_bwd_dq_kernel", "bwd_fused": "attn_bwd_kernel"}


def _compile(name, capability, headdim, flags, dtype="fp16"):
    """Compile kernel ``name`` for ``capability`` with the types of its declaration."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flash_attn.planning import registry
    from flash_attn.planning import declarations
    from flash_attn.aot import specializations as S

    kernel = KERNEL_NAMES[name]
    decl = declarations.get(kernel)
    config = configs.pick_config(decl.config_kind, headdim, capability)
    tiles = decl.tile_constexprs(configs.padded_headdim(headdim), config, configs.arch_family(capability))
    constexprs = {n: value for n, value in {**flags, **tiles}.items() if n in registry.arg_names(kernel)}
    signature, attrs = S.signature(S.Spec.of(kernel, dtype, constexprs, config))
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    compiled = triton.compile(ASTSource(registry.jit_function(kernel), signature, constexprs=constexprs, attrs=attrs),
                              target=target, options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return compiled, config


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(KERNEL_NAMES))
def test_kernels_compile_for_the_gpu_with_every_feature(name):
    """The interpreter is lenient (types, scoping); the GPU compiler is not. sm80, all flags on."""
    # the fused backward has no sm80 entry (the split kernels run there): compiled for sm90
    compiled, _ = _compile(name, (9, 0) if name == "bwd_fused" else (8, 0), 96, ALL_FEATURES, dtype="bf16")
    assert "mma" in compiled.asm["ptx"] or name == "bwd_preprocess"


@pytest.mark.parametrize("name,capability,headdim", [("fwd", (8, 0), 128), ("fwd", (8, 0), 512), ("fwd", (9, 0), 512),
                                                     ("fwd", (10, 0), 512), ("bwd_dkdv", (8, 6), 128),
                                                     ("bwd_fused", (9, 0), 64), ("bwd_fused", (9, 0), 256),
                                                     ("bwd_fused", (10, 0), 128), ("bwd_fused", (10, 0), 256)])
def test_compiled_shared_memory_within_estimate_and_loads_pipelined(name, capability, headdim):
    """Compile one table entry for its arch (no GPU needed) and read the compiler's shared memory.

    The lean variant with unused pointers as ``None`` (what the JIT sees for a plain call). The
    loads must be vectorised asynchronous copies (``cp.async``): that is what the 16-byte
    alignment contract of the planner (inputs copied into that layout when they are not) buys.
    """
    flags = dict(IS_LOCAL=True, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, IS_PAGED=False,
                 PAD_HEADDIM=False, HAS_QV=False, BlockTable=None, AlibiSlopes=None, DropoutSeed=None, QV=None)
    compiled, config = _compile(name, capability, headdim, flags)
    family = configs.arch_family(capability)
    kind = declarations.get(KERNEL_NAMES[name]).config_kind
    estimate = configs.estimate_shared_memory(kind, config, headdim, family)
    limit = configs.SHARED_MEMORY_LIMIT[family]
    assert compiled.metadata.shared <= estimate <= limit
    if config.num_stages > 1:  # one stage: no software pipeline, so no asynchronous copies
        assert "cp.async" in compiled.asm["ptx"]


def test_forward_kvcache_goes_to_the_decode_kernels(backend):
    """The backend hands KV-cache calls to the decode launcher (or, without it, the reference)."""
    from flash_attn.backends import reference
    from flash_attn.params import KVCacheInputs

    g = gen(21)
    dev = backend.device
    q = torch.randn(2, 1, 4, 64, generator=g).half()
    k_cache, v_cache = (torch.randn(2, 40, 2, 64, generator=g).half() for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 64, generator=g).half() for _ in range(2))
    seqlens = torch.tensor([7, 30], dtype=torch.int32)
    params = AttentionParams(0.125, -1, 0)

    def call(module, device):
        cache = KVCacheInputs(k_cache.clone().to(device), v_cache.clone().to(device), seqlens.to(device),
                              k_new.to(device), v_new.to(device))
        out, lse = module.forward_kvcache(q.to(device), params, cache)
        return out.cpu(), lse.cpu(), cache.k_cache.cpu()

    out, lse, kc = call(backend.module, dev)
    ref_out, ref_lse, ref_kc = call(reference, torch.device("cpu"))
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert torch.equal(kc, ref_kc)
