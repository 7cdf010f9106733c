"""Python launchers of the attention kernels, shared by the ``triton`` and ``interpret`` backends.

They allocate outputs, pick the launch configuration (:mod:`flash_attn.kernels.configs`), compute
grids and the feature flags, and launch either compiled (``interpret=False``, CUDA tensors) or in
Triton's interpreter (``interpret=True``, CPU tensors; :mod:`flash_attn.kernels.interpreter`).
Shapes and conventions are those of the backend contract (:mod:`flash_attn.backends`).
This module does not import Triton: a launch names its kernel, and only the Triton executors of
:func:`_run` resolve the name (:mod:`flash_attn.kernels.registry`), so the ``aot`` backend runs
these launchers without Triton installed.

:func:`supported` says which calls the kernels handle; the backends send the others to the
reference backend (``contract_*``).

What a compiled specialisation may assume (and an ahead-of-time build should declare): every
pointer is 16-byte aligned and every stride but the last (which is 1) a multiple of 8 elements
(:func:`ready` copies inputs that are not, and outputs are allocated that way); sizes, strides
and window bounds fit in int32, the dropout seed is int64 (:func:`kernel_signature`). Pointers a
variant does not use (``cu_seqlens`` when dense, ``block_table`` when not paged, ALiBi slopes
without ALiBi) are passed as ``None`` here; a build may make them ``None`` constexprs. The grid's
last dimension is the batch (at most 65535).
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_attn.kernels import configs, registry
from flash_attn.params import AttentionParams, VarlenLayout

__all__ = ["forward", "backward", "supported", "ready", "kernel_signature", "MAX_HEADDIM"]

MAX_HEADDIM = 256
_DTYPES = (torch.float16, torch.bfloat16)


def supported(op: str, q: torch.Tensor, varlen: Optional[VarlenLayout]) -> Optional[str]:
    """``None`` if the kernels run ``op`` ("forward" / "backward") for these inputs, else why not."""
    if q.dtype not in _DTYPES:
        return f"{q.dtype} inputs (the kernels take fp16/bf16)"
    if q.shape[-1] > MAX_HEADDIM:
        return f"head dimension {q.shape[-1]} > {MAX_HEADDIM}"
    if op == "backward" and varlen is not None and varlen.block_table is not None:
        return "the backward of paged K/V (pages may be shared between sequences, which needs atomics)"
    return None


def _empty_aligned(shape, dtype, device) -> torch.Tensor:
    """Uninitialised tensor whose strides (but the last) are multiples of 8 elements.

    Head dims that are not a multiple of 8 get padded storage (a view of the first ``d`` columns).
    """
    d = shape[-1]
    d8 = -(-d // 8) * 8
    full = torch.empty((*shape[:-1], d8), dtype=dtype, device=device)
    return full if d8 == d else full[..., :d]


def ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the layout every kernel assumes, copying only when needed.

    Last dimension contiguous, all other strides multiples of 8 elements (16 bytes for
    fp16/bf16: the kernels declare it with :func:`~flash_attn.kernels.forward.stride_16b`) and a
    16-byte aligned start, so one compiled specialisation fits all inputs.
    """
    if t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0:
        return t
    copy = _empty_aligned(t.shape, t.dtype, t.device)
    copy.copy_(t)
    return copy


_CONSTANTS: dict[tuple, torch.Tensor] = {}
_MAX_CONSTANTS = 256


def read_only_constant(kind: str, length: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``zeros(length)`` (``kind="zeros"``) or ``arange(0, length * step, step)`` (``"arange"``),
    made once per device and reused: the kernels only read these (neutral ALiBi slopes and left
    padding, the block table of a non-paged cache, the ``cu_seqlens`` of a dense call), so a call
    costs no fill kernel for them. Bounded: the cache is emptied past 256 entries."""
    key = (kind, length, step, dtype, str(device))
    t = _CONSTANTS.get(key)
    if t is None:
        if kind == "zeros":
            t = torch.zeros(length, dtype=dtype, device=device)
        elif kind == "arange":
            t = torch.arange(0, length * step, step, dtype=dtype, device=device) if step else \
                torch.zeros(length, dtype=dtype, device=device)
        else:
            raise ValueError(f"unknown constant kind {kind!r}")
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.clear()
        _CONSTANTS[key] = t
    return t


def _capability(device: torch.device, interpret: bool):
    return None if interpret else torch.cuda.get_device_capability(device)


def _compiled(kernel: str, grid, args: list, flags: dict, config: configs.Config, device) -> None:
    """Executor: ``kernel`` compiled just in time by Triton for ``device``."""
    with torch.cuda.device(device):
        registry.jit_function(kernel)[grid](*args, **flags, num_warps=config.num_warps,
                                            num_stages=config.num_stages)


def _interpreted(kernel: str, grid, args: list, flags: dict, config: configs.Config, device) -> None:
    """Executor: ``kernel`` run by Triton's interpreter (CPU tensors)."""
    from flash_attn.kernels import interpreter  # noqa: PLC0415

    interpreter.launch(registry.jit_function(kernel), grid, *args, **flags)


def _run(kernel: str, grid, args: list, flags: dict, config: configs.Config, interpret: bool, device,
         executor=None) -> None:
    """The single launch point. A launch is described without Triton: the kernel's *name* (see
    :mod:`flash_attn.kernels.registry`), the grid, the runtime ``args`` in signature order, the
    constexpr ``flags`` and the launch ``config``. ``executor(kernel, grid, args, flags, config,
    device)`` runs it: by default Triton (compiled, or interpreted when ``interpret``), which alone
    resolves the name to the ``@triton.jit`` function; the ``aot`` backend passes its own
    (precompiled images, see :mod:`flash_attn.backends.aot`), so it never imports Triton."""
    if executor is None:
        executor = _interpreted if interpret else _compiled
    executor(kernel, grid, args, flags, config, device)


def _scalars(params: AttentionParams) -> list:
    """softmax_scale, softcap, window_left, window_right, dropout_p, dropout_seed."""
    return [
        float(params.softmax_scale), float(params.softcap), int(params.window_left), int(params.window_right),
        float(params.dropout_p), int(params.dropout_seed),
    ]


def uses_score_features(params: AttentionParams, alibi: bool) -> bool:
    """Softcap, ALiBi or dropout: the call runs the kernels' *score-features* variant."""
    return params.softcap > 0.0 or alibi or params.dropout_p > 0.0


def feature_flags(params: AttentionParams, features: bool, varlen: bool, headdim: int) -> dict:
    """The constexpr flags of a call (``features``: :func:`uses_score_features`).

    Softcap, ALiBi and dropout are compiled in together (one *score-features* variant) and each is
    switched at run time (``softcap > 0``, a zero slope, ``dropout_p > 0`` are exact no-ops), so
    the Triton path runs exactly the kernel that the ahead-of-time build ships, and a feature
    costs one extra specialisation, not three.
    """
    return dict(
        IS_VARLEN=varlen,
        IS_LOCAL=params.is_local,
        HAS_SOFTCAP=features,
        HAS_ALIBI=features,
        HAS_DROPOUT=features,
        PAD_HEADDIM=headdim != configs.padded_headdim(headdim),
    )


class _Problem:
    """Sizes and strides of one call in the kernels' (batch, row, head) addressing."""

    def __init__(self, q, k, varlen: Optional[VarlenLayout], alibi_slopes, features: bool = False):
        self.varlen = varlen is not None
        self.paged = self.varlen and varlen.block_table is not None
        self.headdim = q.shape[-1]
        self.nheads = q.shape[-2]
        self.nheads_k = k.shape[-2]
        self.group = self.nheads // self.nheads_k
        if self.varlen:
            self.batch = varlen.cu_seqlens_q.shape[0] - 1
            self.seqlen_q, self.seqlen_k = varlen.max_seqlen_q, varlen.max_seqlen_k
            self.cu_q = varlen.cu_seqlens_q.to(torch.int32)
            self.cu_k = varlen.cu_seqlens_k.to(torch.int32)
        else:
            self.batch, self.seqlen_q = q.shape[0], q.shape[1]
            self.seqlen_k = k.shape[1]
            self.cu_q = self.cu_k = None
        self.page_size = k.shape[1] if self.paged else 0
        self.block_table = varlen.block_table.to(torch.int32) if self.paged else None
        self.alibi = None if alibi_slopes is None else alibi_slopes.to(torch.float32)
        if self.alibi is None and features:
            # the score-features variant always reads slopes: zero slopes add exactly nothing
            self.alibi = read_only_constant("zeros", self.nheads, 1, torch.float32, q.device)
        self.stride_ab = 0 if self.alibi is None or self.alibi.dim() == 1 else self.alibi.stride(0)

    def rows(self, t: torch.Tensor) -> list[int]:
        """(batch, row, head) strides of a q-like or k-like tensor; batch stride 0 when packed.

        A paged page pool ``(pages, page_size, hk, d)`` gives (page, slot, head) strides.
        """
        if t.dim() == 4:
            return [t.stride(0), t.stride(1), t.stride(2)]
        return [0, t.stride(0), t.stride(1)]

    def lse_strides(self, lse: torch.Tensor) -> list[int]:
        if self.varlen:
            return [0, lse.stride(0)]
        return [lse.stride(0), lse.stride(1)]

    def grid(self, block: int, rows: int, heads: int):
        return (registry.cdiv(rows, block), heads, self.batch)

    def sizes(self) -> list[int]:
        return [self.seqlen_q, self.seqlen_k, self.group, self.headdim]


def forward(q, k, v, params: AttentionParams, *, varlen: Optional[VarlenLayout] = None, alibi_slopes=None,
            return_softmax: bool = False, interpret: bool = False, executor=None, capability=None):
    """``(out, lse, s_dmask or None)`` per the backend contract. ``capability``: whose launch
    configs to use (default: the device's; the ``aot`` backend passes its image's)."""
    q, k, v = ready(q), ready(k), ready(v)
    features = uses_score_features(params, alibi_slopes is not None)
    pb = _Problem(q, k, varlen, alibi_slopes, features)
    capability = capability or _capability(q.device, interpret)
    config = configs.pick_config("fwd", pb.headdim, capability, features)
    block_d = configs.padded_headdim(pb.headdim)
    out = _empty_aligned(q.shape, q.dtype, q.device)
    if pb.varlen:
        lse = torch.empty((pb.nheads, q.shape[0]), dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty((pb.batch, pb.nheads, pb.seqlen_q), dtype=torch.float32, device=q.device)
    flags = feature_flags(params, features, pb.varlen, pb.headdim)
    flags.update(IS_PAGED=pb.paged, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d)
    common = [pb.cu_q, pb.cu_k, pb.block_table, pb.alibi]
    args = [
        q, k, v, out, lse, *common,
        *pb.rows(q), *pb.rows(k), *pb.rows(v), *pb.rows(out), *pb.lse_strides(lse),
        0 if pb.block_table is None else pb.block_table.stride(0), pb.stride_ab,
        *pb.sizes(), pb.page_size, *_scalars(params),
    ]
    _run("attn_fwd_kernel", pb.grid(config.block_m, pb.seqlen_q, pb.nheads), args, flags, config, interpret, q.device,
         executor)
    s_dmask = None
    if return_softmax:
        s_dmask = torch.zeros((pb.batch, pb.nheads, pb.seqlen_q, pb.seqlen_k), dtype=torch.float32, device=q.device)
        args = [
            q, k, lse, s_dmask, *common,
            *pb.rows(q), *pb.rows(k), *pb.lse_strides(lse),
            s_dmask.stride(0), s_dmask.stride(1), s_dmask.stride(2),
            0 if pb.block_table is None else pb.block_table.stride(0), pb.stride_ab,
            *pb.sizes(), pb.page_size, *_scalars(params),
        ]
        _run("attn_probs_kernel", pb.grid(config.block_m, pb.seqlen_q, pb.nheads), args, flags, config, interpret,
             q.device, executor)
    return out, lse, s_dmask


def backward(dout, q, k, v, out, lse, params: AttentionParams, *, varlen: Optional[VarlenLayout] = None,
             alibi_slopes=None, interpret: bool = False, executor=None, capability=None):
    """``(dq, dk, dv)`` per the backend contract (not for paged K/V: see :func:`supported`).

    Always deterministic: no atomics, every gradient element is written by one program.
    """
    dout, q, k, v, out = ready(dout), ready(q), ready(k), ready(v), ready(out)
    lse = lse.contiguous()
    features = uses_score_features(params, alibi_slopes is not None)
    pb = _Problem(q, k, varlen, alibi_slopes, features)
    capability = capability or _capability(q.device, interpret)
    block_d = configs.padded_headdim(pb.headdim)
    flags = feature_flags(params, features, pb.varlen, pb.headdim)
    dq = _empty_aligned(q.shape, q.dtype, q.device)
    dk = _empty_aligned(k.shape, k.dtype, k.device)
    dv = _empty_aligned(v.shape, v.dtype, v.device)
    delta = torch.empty_like(lse)

    pre = configs.pick_config("fwd", pb.headdim, capability)
    _run("attn_bwd_preprocess_kernel", pb.grid(pre.block_m, pb.seqlen_q, pb.nheads),
         [out, dout, delta, pb.cu_q, *pb.rows(out), *pb.rows(dout), *pb.lse_strides(lse), pb.seqlen_q, pb.headdim],
         dict(IS_VARLEN=pb.varlen, BLOCK_M=pre.block_m, BLOCK_D=block_d), pre, interpret, q.device, executor)

    common = [pb.cu_q, pb.cu_k, pb.alibi, *pb.rows(q), *pb.rows(k), *pb.rows(v), *pb.rows(dout)]
    tail = [*pb.lse_strides(lse), pb.stride_ab, *pb.sizes(), *_scalars(params)]
    cfg = configs.pick_config("bwd_dkdv", pb.headdim, capability, features)
    _run("attn_bwd_dkdv_kernel", pb.grid(cfg.block_n, pb.seqlen_k, pb.nheads_k),
         [q, k, v, dout, lse, delta, dk, dv, *common, *pb.rows(dk), *pb.rows(dv), *tail],
         dict(flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d), cfg, interpret, q.device,
         executor)
    cfg = configs.pick_config("bwd_dq", pb.headdim, capability, features)
    _run("attn_bwd_dq_kernel", pb.grid(cfg.block_m, pb.seqlen_q, pb.nheads),
         [q, k, v, dout, lse, delta, dq, *common, *pb.rows(dq), *tail],
         dict(flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d), cfg, interpret, q.device,
         executor)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# The backend contract on top of the launchers, shared by the ``triton`` and ``interpret``
# backends: what the kernels cannot do goes to the reference backend, with a one-time warning.


def _reference():
    from flash_attn.backends import reference  # noqa: PLC0415

    return reference


def _fall_back(backend: str, op: str, reason: str):
    from flash_attn.dispatch import warn_once  # noqa: PLC0415

    warn_once(
        f"{backend}:{op}:{reason}",
        f"flash_attn: the {backend} backend's kernels do not support {reason}; "
        f"running the {op} on the (exact, slower) PyTorch reference backend.",
    )
    return _reference()


def contract_forward(backend: str, interpret: bool, q, k, v, params, *, varlen=None, alibi_slopes=None,
                     return_softmax=False):
    reason = supported("forward", q, varlen)
    if reason is not None:
        return _fall_back(backend, "forward", reason).forward(
            q, k, v, params, varlen=varlen, alibi_slopes=alibi_slopes, return_softmax=return_softmax)
    return forward(q, k, v, params, varlen=varlen, alibi_slopes=alibi_slopes, return_softmax=return_softmax,
                   interpret=interpret)


def contract_backward(backend: str, interpret: bool, dout, q, k, v, out, lse, params, *, varlen=None,
                      alibi_slopes=None, deterministic=False):
    reason = supported("backward", q, varlen)
    if reason is not None:
        return _fall_back(backend, "backward", reason).backward(
            dout, q, k, v, out, lse, params, varlen=varlen, alibi_slopes=alibi_slopes, deterministic=deterministic)
    # ``deterministic`` needs nothing: these kernels use no atomics and are always deterministic.
    return backward(dout, q, k, v, out, lse, params, varlen=varlen, alibi_slopes=alibi_slopes, interpret=interpret)


def contract_forward_kvcache(backend: str, interpret: bool, q, params, cache, *, alibi_slopes=None):
    import importlib  # noqa: PLC0415
    import importlib.util  # noqa: PLC0415

    name = "flash_attn.kernels.decode_launch"
    if importlib.util.find_spec(name) is None:
        return _fall_back(backend, "forward_kvcache", "the KV-cache (decode) path yet").forward_kvcache(
            q, params, cache, alibi_slopes=alibi_slopes)
    decode_launch = importlib.import_module(name)
    return decode_launch.forward_kvcache(q, params, cache, alibi_slopes=alibi_slopes, interpret=interpret)


# ---------------------------------------------------------------------------------------------
# The kernels' ABI, for ahead-of-time compilation (and the compile tests).

_FP32_POINTERS = frozenset({"LSE", "Delta", "S", "AlibiSlopes"})
_I32_POINTERS = frozenset({"CuSeqlensQ", "CuSeqlensK", "BlockTable"})
_FLOAT_ARGS = frozenset({"softmax_scale", "softcap", "dropout_p"})
_I64_ARGS = frozenset({"dropout_seed"})
_I32_ARGS = frozenset({"seqlen_q", "seqlen_k", "group", "head_dim", "page_size", "window_left", "window_right"})


def kernel_signature(kernel, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    """``(signature, attrs)`` of one specialisation of ``kernel`` for ``triton.compile(ASTSource)``.

    ``dtype`` is ``"fp16"`` or ``"bf16"`` (the tensors' element type). Sizes, strides and window
    bounds are ``i32``, the dropout seed ``i64``, scale/softcap/dropout ``fp32``; every pointer is
    declared 16-byte aligned (``tt.divisibility``), which :func:`ready` guarantees, as it does
    for strides being multiples of 8 elements (stated inside the kernels). Names in
    ``constexprs`` are compile-time constants (the feature flags, block sizes, and unused
    pointers as ``None``).
    """
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("stride_") or name in _I32_ARGS:
            signature[name] = "i32"
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
        elif name in _I64_ARGS:
            signature[name] = "i64"
        else:
            element = "fp32" if name in _FP32_POINTERS else "i32" if name in _I32_POINTERS else dtype
            signature[name] = "*" + element
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs
