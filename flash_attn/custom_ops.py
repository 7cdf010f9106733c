"""The ``flash_attn::*`` custom operators: one boundary between Python and every backend.

Registering through ``torch.library`` gives each operation a fake (meta) implementation for
shape inference and an autograd formula, so ``torch.compile(fullgraph=True)`` traces calls to
``flash_attn_func``/``flash_attn_varlen_func`` as single opaque nodes without graph breaks.
The real implementations pick a backend (:mod:`flash_attn.dispatch`) and call it. They read no
tensor value on the host for CUDA tensors (no device synchronisation, so they run inside CUDA
graph capture): the value checks (cu_seqlens, cache lengths, block tables) run for CPU tensors,
and for CUDA tensors only with ``FLASH_ATTN_DEBUG=1``.

Eager calls go around PyTorch's dispatcher (:func:`eager_call`), and an eager forward first
offers itself to the chosen backend's own route (:func:`flash_attn.dispatch.run_direct`: the cpu
backend's plain calls, one fused-kernel call with PyTorch's own autograd formula): on the CPU the
Python between the public function and the kernel is a large part of a short call. The op bodies
of eager calls with a checked signature (``call``) without dropout run the plan the backend holds
for the signature, or makes and holds on its first call (:func:`flash_attn.dispatch.run_known`),
its later calls by the signature's lane (:func:`flash_attn.dispatch.run_lane`: the held plan's
launches with nothing looked up; an eager dense forward with nothing to record takes it straight
from :func:`forward`); the general route takes the rest, and the calls the backend refuses.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from flash_attn import dispatch, validation
from flash_attn.params import AttentionParams, KVCacheInputs, VarlenLayout, cache_capacity
from flash_attn.placeholders import placeholder

DEBUG_ENV = validation.DEBUG_ENV


def _checks_values(t: Tensor) -> bool:
    """Whether to check argument values on the host: always for CPU tensors; for others (reading
    them waits for the device and breaks CUDA-graph capture) only with ``FLASH_ATTN_DEBUG=1``."""
    return t.device.type == "cpu" or validation.debug_checks()


def _draw_dropout_seed(dropout_p: float, device) -> Tensor:
    """The forward's ``rng_state``: an int64 seed drawn by ``device``'s generator on the device,
    which ``torch.manual_seed`` reproduces and a CUDA graph replay draws anew (PyTorch advances
    the generator's offset per replay). Without dropout nothing reads it: left uninitialised (an
    op's output must be a tensor; the eager calls keep ``None`` instead: no allocation)."""
    if dropout_p == 0.0:
        return torch.empty((1,), dtype=torch.int64, device=device)
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def varlen_layout(q, k, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k) -> Optional[VarlenLayout]:
    """Bundle the varlen arguments (``None`` for dense inputs), checking their values when
    :func:`_checks_values`."""
    if cu_seqlens_q is None:
        return None
    if _checks_values(q):
        _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k)
    return VarlenLayout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)


def _check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k) -> None:
    validation.check_cu_seqlens_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
    paged = block_table is not None
    seqlens_k = validation.check_cu_seqlens_values(
        cu_seqlens_k, "cu_seqlens_k", None if paged else k.shape[0], max_seqlen_k, "max_seqlen_k"
    )
    if paged:
        lengths = [b - a for a, b in zip(seqlens_k, seqlens_k[1:])]
        validation.check_block_table_values(block_table, k.shape[0], k.shape[1], lengths)


def _batch_and_seqlens(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> tuple[int, int, int]:
    if cu_seqlens_q is None:
        return q.shape[0], q.shape[1], k.shape[1]
    return cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k


def _empty_softmax(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


def forward_body(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    block_table: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    return_softmax: bool,
    deterministic: bool,
    seed: Optional[Tensor] = None,
    qv: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``flash_attn::forward`` op's body (also :mod:`flash_attn.lowlevel`'s forward, inside its
    own op). Returns ``(out, lse, s_dmask or an empty tensor, rng_state)``; see the backend contract.

    ``deterministic`` only matters to the backward; it is an input here so that autograd can
    hand it on. ``seed``: the dropout seed drawn by the caller (:func:`forward`), or ``None`` to
    draw it here; ``rng_state`` is a copy of it. ``qv``: MLA's absorbed queries (scores
    ``scale * (q.k + qv.v)``); ``sinks``: fp32 ``(nheads,)`` attention sinks (lse includes them).
    """
    return _forward_run(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
                        softmax_scale, window_left, window_right, softcap, dropout_p, return_softmax, True, seed, qv,
                        sinks)


def _forward_run(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
                 softmax_scale, window_left, window_right, softcap, dropout_p, return_softmax, fresh, seed=None,
                 qv=None, sinks=None, call=None):
    """The forward; ``fresh``: every returned tensor newly made (as an op's outputs must be),
    else the unused ``rng_state`` (no dropout) and an unrequested ``s_dmask`` are ``None`` (the
    direct calls);
    ``call``: the public function's checked signature (:attr:`AttentionParams.call`)."""
    varlen = None if cu_seqlens_q is None else \
        varlen_layout(q, k, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k)
    if q.numel() == 0 or (varlen is None and k.shape[1] == 0):  # nothing to attend: the answer needs no backend
        return _forward_without_keys(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, return_softmax, sinks)
    found = None
    if dropout_p == 0.0:
        rng_state = _draw_dropout_seed(0.0, q.device) if fresh else None
        if call is not None:
            found = dispatch.run_known("forward", q.device, call, q, k, v, alibi_slopes, sinks, qv, return_softmax,
                                       varlen, (softmax_scale, window_left, window_right, softcap))
    elif seed is None:
        rng_state = _draw_dropout_seed(dropout_p, q.device)
    else:
        rng_state = seed.reshape(1).to(torch.int64, copy=True)  # an op's output may not alias its input
    if found is None:
        params = AttentionParams(softmax_scale, window_left, window_right, softcap, dropout_p, rng_state, call)
        extras = {} if qv is None and sinks is None else dict(qv=qv, sinks=sinks)
        found = dispatch.run("forward", q.device, q, k, v, params, varlen=varlen, alibi_slopes=alibi_slopes,
                             return_softmax=return_softmax, **extras)
    out, lse, s_dmask = found
    if s_dmask is None:
        s_dmask = _empty_softmax(q) if fresh else None
    else:
        s_dmask = s_dmask.contiguous()
    return out.contiguous(), lse.contiguous(), s_dmask, rng_state


attention_forward = torch.library.custom_op("flash_attn::forward", mutates_args=())(forward_body)


def _forward_without_keys(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, return_softmax, sinks=None):
    """Rows that see no key: output 0 and logsumexp +inf, or the head's sink with sinks (the fake
    shapes, filled in)."""
    out, lse, s_dmask, rng_state = _forward_fake(
        q, k, v, cu_seqlens_q, None, None, None, max_seqlen_q, max_seqlen_k, 1.0, -1, -1, 0.0, 0.0,
        return_softmax, False,
    )
    lse.fill_(float("inf"))
    if sinks is not None and lse.numel():
        per_head = torch.where(sinks == float("-inf"), float("inf"), sinks.to(torch.float32))
        lse.copy_(per_head.view(-1, 1) if cu_seqlens_q is not None else per_head.view(1, -1, 1))
    return out.zero_(), lse, s_dmask.zero_(), rng_state.zero_()


@attention_forward.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, softcap, dropout_p, return_softmax, deterministic, seed=None, qv=None,
      sinks=None):
    batch, sq, sk = _batch_and_seqlens(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    nheads = q.shape[-2]
    if cu_seqlens_q is None:
        lse = q.new_empty((batch, nheads, sq), dtype=torch.float32)
    else:
        lse = q.new_empty((nheads, q.shape[0]), dtype=torch.float32)
    if return_softmax:
        s_dmask = q.new_empty((batch, nheads, sq, sk), dtype=torch.float32)
    else:
        s_dmask = _empty_softmax(q)
    rng_state = q.new_empty((1,), dtype=torch.int64)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), lse, s_dmask, rng_state


def sink_gradient(sinks: Tensor, lse: Tensor, delta: Tensor, packed: bool) -> Tensor:
    """``d loss / d sinks``: each head's sum over its rows of ``-exp(sink - lse) * delta``.

    A sink is a logit whose value vector is 0, so its share of the scores' gradient is
    ``p_sink * (0 - delta)`` with ``p_sink = exp(sink - lse)`` (the forward's lse includes the
    sink) and ``delta = rowsum(dout * out)``. lse/delta ``(b, h, sq)`` or, packed, ``(h, total)``;
    the result in the sinks' dtype. Rows that saw nothing (lse +inf) add 0."""
    sink = sinks.to(torch.float32).view(-1, 1) if packed else sinks.to(torch.float32).view(1, -1, 1)
    per_row = torch.exp(sink - lse) * delta
    return per_row.sum(dim=1 if packed else (0, 2)).neg().to(sinks.dtype)


def _backward_body(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    block_table: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    rng_state: Tensor,
    deterministic: bool,
    qv: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dqv, dsinks)``; ``dqv``/``dsinks`` empty when the call has no qv / sinks."""
    dq, dk, dv, dqv, dsinks = _backward_run(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
        softmax_scale, window_left, window_right, softcap, dropout_p, rng_state, deterministic, qv, sinks)
    dqv = q.new_empty((0,)) if qv is None else dqv
    dsinks = q.new_empty((0,), dtype=torch.float32) if sinks is None else dsinks
    return dq, dk, dv, dqv, dsinks


def _backward_run(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q,
                  max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, rng_state, deterministic,
                  qv=None, sinks=None, call=None):
    """The backward (:func:`_backward_body`'s arguments); ``call``: its forward's checked signature.
    ``dqv``/``dsinks`` are ``None`` when the call has no qv / sinks (nothing made for them)."""
    varlen = None
    if cu_seqlens_q is not None:
        varlen = VarlenLayout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    dqv = dsinks = None
    if q.numel() == 0 or k.numel() == 0:
        dqv = None if qv is None else qv.new_zeros(qv.shape)
        dsinks = None if sinks is None else sinks.new_zeros(sinks.shape)
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape), dqv, dsinks
    grads = None
    if call is not None and dropout_p == 0.0:
        grads = dispatch.run_known("backward", q.device, call, dout, q, k, v, out, lse, alibi_slopes, qv, deterministic,
                                   sinks is not None, varlen, (softmax_scale, window_left, window_right, softcap))
    if grads is None:
        params = AttentionParams(softmax_scale, window_left, window_right, softcap, dropout_p, rng_state, call)
        extras = {} if qv is None else dict(qv=qv)
        grads = dispatch.run("backward", q.device, dout, q, k, v, out, lse, params, varlen=varlen,
                             alibi_slopes=alibi_slopes, deterministic=deterministic, return_delta=sinks is not None,
                             **extras)
    dq, dk, dv = grads[:3]
    if qv is not None:
        dqv = grads[3].contiguous()
    if sinks is not None:
        dsinks = sink_gradient(sinks, lse, grads[-1], varlen is not None)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dqv, dsinks


attention_backward = torch.library.custom_op("flash_attn::backward", mutates_args=())(_backward_body)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, softcap, dropout_p, rng_state, deterministic, qv=None, sinks=None):
    dqv = q.new_empty((0,)) if qv is None else qv.new_empty(qv.shape)
    dsinks = q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dqv, dsinks


# The forward op's inputs, in order (the autograd formula returns one gradient per input).
_FORWARD_INPUTS = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "block_table", "alibi_slopes", "max_seqlen_q",
    "max_seqlen_k", "softmax_scale", "window_left", "window_right", "softcap", "dropout_p",
    "return_softmax", "deterministic", "seed", "qv", "sinks",
)


def _setup_context(ctx, inputs, output):
    # inputs in _FORWARD_INPUTS' order (the seed not needed here)
    (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k, softmax_scale,
     window_left, window_right, softcap, dropout_p, _, deterministic, _, qv, sinks) = inputs
    out, lse, _, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, rng_state, qv,
                          sinks)
    ctx.scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p)
    ctx.deterministic = deterministic
    ctx.call = None  # the forward's checked signature: set by eager calls (_Attention)


def _backward(ctx, dout, *unused_grads):
    return _gradients(ctx.saved_tensors, ctx.scalars, ctx.deterministic, ctx.call, dout)


def _gradients(saved: tuple, scalars: tuple, deterministic: bool, call, dout) -> tuple:
    """The forward op's gradients (:func:`_backward`'s) from what its record holds: ``saved``
    (:func:`_setup_context`'s tensors), ``scalars`` (max_seqlen_q to dropout_p), ``deterministic``
    and ``call`` (the forward's checked signature, or ``None``)."""
    q, k, v, out, lse, cu_q, cu_k, block_table, alibi, rng_state, qv, sinks = saved
    args = (dout, q, k, v, out, lse, cu_q, cu_k, block_table, alibi, *scalars, rng_state, deterministic, qv, sinks)
    if _eager_backward(call, dout, q, k, v, alibi, qv, sinks) or direct_call_ok(
            (dout, q, k, v, out, lse, cu_q, cu_k, block_table, alibi, qv, sinks)):
        dq, dk, dv, dqv, dsinks = _backward_run(*args, call)
    else:
        if rng_state is None:  # an eager forward without dropout kept none; the op takes a tensor
            args = (*args[:17], placeholder(torch.int64, q.device, (1,)), *args[18:])
        dq, dk, dv, dqv, dsinks = attention_backward(*args)
    # one gradient per _FORWARD_INPUTS: q, k, v, none for the metadata and scalars, qv, sinks
    return (dq, dk, dv, *_NO_GRADS, dqv if qv is not None else None, dsinks if sinks is not None else None)


def _eager_backward(call, dout, *inputs) -> bool:
    """:func:`direct_call_ok` for the backward of an eager forward with a checked signature
    (``call``; its tensors were plain and not meta then, its out and lse are its own), but for
    the gradient it is given and what may have changed since: tracing, and a graph to record
    (``create_graph``)."""
    return call is not None and type(dout) is Tensor and not dout.is_meta and not _traced() and not (
        _grad_enabled() and any_requires_grad(dout, *inputs))


_NO_GRADS = (None,) * (len(_FORWARD_INPUTS) - 5)
# where the forward's scalars (its inputs after the tensors) hold dropout_p and return_softmax
_DROPOUT, _RETURN_SOFTMAX = (_FORWARD_INPUTS.index(name) - _FORWARD_INPUTS.index("max_seqlen_q")
                              for name in ("dropout_p", "return_softmax"))
assert _FORWARD_INPUTS[:3] == ("q", "k", "v") and _FORWARD_INPUTS[6] == "alibi_slopes"
assert _FORWARD_INPUTS[-2:] == ("qv", "sinks")


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _kvcache_body(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    cache_batch_idx: Optional[Tensor],
    cache_leftpad: Optional[Tensor],
    block_table: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    num_splits: int,
    qv: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    return _kvcache_run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                        rotary_cos, rotary_sin, alibi_slopes, softmax_scale, window_left, window_right, softcap,
                        rotary_interleaved, num_splits, qv, sinks)


def _kvcache_run(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
                 rotary_sin, alibi_slopes, softmax_scale, window_left, window_right, softcap, rotary_interleaved,
                 num_splits, qv=None, sinks=None, call=None):
    """The KV-cache call (:func:`_kvcache_body`'s arguments); ``call``: the public function's checked signature."""
    if _checks_values(q):
        _check_kvcache_values(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos)
    if q.shape[0] == 0:  # no sequence: nothing to append, nothing to attend
        return _kvcache_fake(q, k_cache, v_cache)
    cache = _new_cache(KVCacheInputs, (k_cache, v_cache, cache_seqlens, k, v, cache_batch_idx, cache_leftpad,
                                       block_table, rotary_cos, rotary_sin, rotary_interleaved, num_splits))
    found = None if call is None else dispatch.run_known("forward_kvcache", q.device, call, q, cache, alibi_slopes,
                                                         sinks, qv, (softmax_scale, window_left, window_right, softcap))
    if found is None:
        params = AttentionParams(softmax_scale, window_left, window_right, softcap, call=call)
        extras = {} if qv is None and sinks is None else dict(qv=qv, sinks=sinks)
        found = dispatch.run("forward_kvcache", q.device, q, params, cache, alibi_slopes=alibi_slopes, **extras)
    out, lse = found
    return out.contiguous(), lse.contiguous()


_new_cache = tuple.__new__  # KVCacheInputs without its Python-level __new__ (every field given; per decode step)
assert len(KVCacheInputs._fields) == 12


attention_forward_kvcache = torch.library.custom_op("flash_attn::forward_kvcache",
                                                    mutates_args=("k_cache", "v_cache"))(_kvcache_body)


@attention_forward_kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, *args):
    batch, sq, nheads, _ = q.shape
    return q.new_empty((batch, sq, nheads, v_cache.shape[-1])), q.new_empty((batch, nheads, sq), dtype=torch.float32)


def _check_kvcache_values(q, k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos) -> None:
    """Cache rows, batch indices and pages named by the call all exist."""
    seqlen_new = 0 if k is None else k.shape[1]
    capacity = cache_capacity(k_cache, block_table)
    seqlens = [capacity] * q.shape[0] if cache_seqlens is None else cache_seqlens.tolist()
    if any(n < 0 for n in seqlens):
        raise ValueError(f"cache_seqlens must be >= 0, got {seqlens}")
    ends = [n + seqlen_new for n in seqlens]
    what = ("kv cache too small for the append (cache_seqlens + the new tokens)" if seqlen_new
            else "cache_seqlens exceeds the kv cache")
    validation.check_positions_fit(ends, capacity, what)
    if rotary_cos is not None:
        validation.check_positions_fit(ends, rotary_cos.shape[0], "rotary_cos/rotary_sin have too few positions")
    if cache_leftpad is not None:
        pads = cache_leftpad.tolist()
        bad = [b for b, (pad, n) in enumerate(zip(pads, seqlens)) if pad < 0 or pad > n]
        if bad:
            raise ValueError(f"cache_leftpad must be in [0, cache_seqlens[b]], got {pads} for cache_seqlens {seqlens}")
    if cache_batch_idx is not None:
        rows = cache_batch_idx.tolist()
        if any(r < 0 or r >= k_cache.shape[0] for r in rows):
            raise IndexError(f"cache_batch_idx {rows} refers to rows outside the kv cache's batch of {k_cache.shape[0]}")
    if block_table is not None:
        validation.check_block_table_values(block_table, k_cache.shape[0], k_cache.shape[1], ends)


# ---------------------------------------------------------------------------------------------
# The entry points of the public functions: the custom op, or its body directly.


def eager_call(tensors) -> Optional[bool]:
    """How a call may go around PyTorch's dispatcher: ``None`` when it must not (traced by
    torch.compile, a ``__torch_function__``/``__torch_dispatch__`` mode or functorch transform
    active, a meta, fake or subclass tensor: the op and its fake implementation serve those);
    else whether autograd has to record it (grad mode on and an input that requires grad).

    In plain eager calls the result is the same and PyTorch's per-call work is saved: about 10 us
    for the forward op, and 100 us or more where its generated autograd and mutation bookkeeping
    walk the ops' 16-19 arguments quadratically.
    """
    if _traced():
        return None
    grad, record = _grad_enabled(), False
    for t in tensors:
        if t is not None:
            if type(t) is not Tensor or t.is_meta:
                return None
            if grad and not record:
                record = t.requires_grad
    return record


# eager_call's probes, looked up once (each attribute path costs a few tens of ns per call)
_traced, _grad_enabled = validation.traced, torch.is_grad_enabled


def any_requires_grad(*tensors) -> bool:
    """Whether any of ``tensors`` (``None`` skipped) requires grad."""
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def direct_call_ok(tensors) -> bool:
    """Whether a call may run an op's body directly (:func:`eager_call`, nothing to record)."""
    return eager_call(tensors) is False


class _Attention(torch.autograd.Function):
    """The forward op's autograd formula (``_setup_context``, ``_backward``) for eager calls.

    Its inputs are q, k, v and one tuple of the rest (the integer tensors, which have no
    gradient, the op's scalars, ``extra`` and the call's signature), its one output ``out``: the
    non-differentiable results (lse, S_dmask, rng_state) leave through ``extra``, a list the caller
    passes, not as outputs autograd would wrap and mark (each input and output costs the autograd
    machinery a fraction of a microsecond to a microsecond per call). Calls with ALiBi slopes, qv
    or sinks: :class:`_AttentionWithExtras`."""

    @staticmethod
    def forward(ctx, q, k, v, rest):
        return _recorded_forward(ctx, q, k, v, None, None, None, rest)

    @staticmethod
    def backward(ctx, dout):
        return (*_backward(ctx, dout)[:3], None)  # the op's gradients: q, k, v first


class _HeldAttention(torch.autograd.Function):
    """:class:`_Attention` for a training call whose lanes its backend holds
    (:class:`flash_attn.dispatch.HeldTraining`, the input after q, k, v): the forward and, once
    held, the backward each one call of the backend, which compares the tensors with the call it
    held; a call it does not take leaves the forward to the public function's general route
    (:class:`HeldRefused`), the backward to the general backward route. (Its gradients are
    returned as a literal tuple: a tuple built by unpacking cost ~1 us a step here, measured.)"""

    @staticmethod
    def forward(ctx, q, k, v, lanes):
        made = lanes.forward((q, k, v))
        if made is None:
            raise HeldRefused
        ctx.save_for_backward(q, k, v, made[0], made[1])
        ctx.lanes = lanes
        return made[0]

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = _held_gradients(ctx, dout)
        return dq, dk, dv, None


class _HeldPackedAttention(torch.autograd.Function):
    """:class:`_HeldAttention` for a varlen call: its cu_seqlens_q and _k after the lanes, passed
    to them and saved beside q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, lanes, cu_seqlens_q, cu_seqlens_k):
        made = lanes.forward((q, k, v, cu_seqlens_q, cu_seqlens_k))
        if made is None:
            raise HeldRefused
        ctx.save_for_backward(q, k, v, made[0], made[1], cu_seqlens_q, cu_seqlens_k)
        ctx.lanes = lanes
        return made[0]

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = _held_gradients(ctx, dout)
        return dq, dk, dv, None, None, None


def _held_gradients(ctx, dout) -> tuple:
    """dq, dk, dv of a held record: by the backward's held lane, or the general backward route."""
    saved = ctx.saved_tensors
    lanes = ctx.lanes
    # _eager_backward for a held call (its signature checked, nothing but q, k, v recorded), where
    # grad mode on (create_graph) goes through the op whether or not q, k or v still require grad
    if type(dout) is Tensor and not dout.is_meta and not _grad_enabled() and not _traced():
        made = lanes.backward((dout, *saved))
        if made is not None:
            return made
    return lanes.general_backward(
        lambda: _gradients((*saved, *_NO_TENSORS[len(saved) - 5:]), lanes.scalars, lanes.deterministic, lanes.call,
                           dout),
        (dout, *saved))[:3]


_NO_TENSORS = (None,) * 7  # a saved record's tensors after lse (_setup_context's), none in a held call's


def held_training(q: Tensor, k: Tensor, v: Tensor, lanes) -> Tensor:
    """``out`` of a training call of :func:`flash_attn.flash_attn_func` (plain q, k, v, one of which
    requires grad, in grad mode) by its held lanes (:class:`flash_attn.dispatch.HeldTraining`),
    recorded by :class:`_HeldAttention`; raises :class:`HeldRefused` where the lane does not take it."""
    return _apply_held(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), lanes)


def held_packed_training(q: Tensor, k: Tensor, v: Tensor, lanes, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor) -> Tensor:
    """:func:`held_training` for :func:`flash_attn.flash_attn_varlen_func` (:class:`_HeldPackedAttention`)."""
    return _apply_held_packed(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), lanes, cu_seqlens_q,
                              cu_seqlens_k)


class HeldRefused(Exception):
    """:class:`_HeldAttention`'s forward was not taken by the held lane (the public function then
    takes its general route, checks included)."""


class _AttentionWithExtras(torch.autograd.Function):
    """:class:`_Attention` with the ALiBi slopes (no gradient, as upstream's autograd input), MLA's
    ``qv`` and the sinks as inputs too."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, qv, sinks, rest):
        return _recorded_forward(ctx, q, k, v, alibi_slopes, qv, sinks, rest)

    @staticmethod
    def backward(ctx, dout):
        grads = _backward(ctx, dout)  # the op's: the op's 7 tensors first, qv and sinks last
        return (*grads[:3], grads[6], *grads[-2:], None)


def _c_apply(function: type):
    """``function.apply`` without its Python wrapper (2.5 us of a training step's forward here), for
    eager calls, where :func:`eager_call` has found no functorch transform active: what the wrapper
    does then is bind default arguments (``function`` has none) and unwrap functorch's dead
    wrappers, which the caller does (``_unwrap_if_dead``)."""
    base = getattr(torch._C, "_FunctionBase", None)
    apply = None if base is None else base.__dict__.get("apply")
    return function.apply if apply is None else apply.__get__(None, function)


_apply_attention, _apply_held, _apply_held_packed = (_c_apply(_Attention), _c_apply(_HeldAttention),
                                                      _c_apply(_HeldPackedAttention))


def _direct_backward(function: type) -> None:
    """Have autograd call ``function.backward`` itself: the engine calls its node's ``apply``,
    which torch's Python wrapper makes a choice between ``backward`` and ``vjp`` (of which
    ``function`` defines only ``backward``) and a test for boxed gradients (never asked for
    here): ~0.7 us of a training step's backward here. Where torch names no node class, left as is."""
    node = getattr(function, "_backward_cls", None)
    if node is not None and "backward" in vars(function):
        node.apply = vars(function)["backward"].__func__  # a method of the node: backward(ctx, *grads)


for _function in (_Attention, _AttentionWithExtras, _HeldAttention, _HeldPackedAttention):
    _direct_backward(_function)
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _recorded_forward(ctx, q, k, v, alibi_slopes, qv, sinks, rest):
    """Both records' forward: the op's body, its autograd context, the other results into ``extra``."""
    cu_seqlens_q, cu_seqlens_k, block_table, scalars, extra, call = rest
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes)
    # not an op's outputs: an unused rng_state (no dropout) and an unrequested S_dmask are None
    output = _forward_run(*tensors, *scalars[:-1], False, None, qv, sinks, call)
    _setup_context(ctx, (*tensors, *scalars, None, qv, sinks), output)
    ctx.call = call  # the backward's plan is found by it too
    extra.extend(output[1:])
    return output[0]


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, *scalars, qv=None, sinks=None,
            call=None):
    """``flash_attn::forward`` (arguments as the op's, ``qv`` and ``sinks`` by keyword): through the
    op, or in eager calls (:func:`eager_call`) the lane of the call's signature when it has one
    (:func:`flash_attn.dispatch.run_lane`: dense calls without dropout, nothing to record), else
    the backend's own route when it takes the call (:func:`flash_attn.dispatch.run_direct`; calls
    without qv and sinks), else the op's body directly, with autograd's record where needed.
    ``call``: the public function's checked signature (:func:`flash_attn.validation.checked_call`),
    handed to the backends in eager calls."""
    if call is not None and cu_seqlens_q is None and scalars[_DROPOUT] == 0.0 and not (
            _grad_enabled() and any_requires_grad(q, k, v, alibi_slopes, qv, sinks)) and not _traced():
        # An eager call with nothing to record (eager_call's answer False, but for its tensors'
        # types: a checked signature holds plain tensors only, and a meta call's never gets a lane,
        # which only the known route of an eager call holds). A lane reads no scalar; packed calls
        # take theirs after their values are checked, in _forward_run.
        found = dispatch.run_lane("forward", call, q, k, v, alibi_slopes, sinks, qv, scalars[_RETURN_SOFTMAX], None,
                                  None)
        if found is not None:
            out, lse, s_dmask = found
            return out.contiguous(), lse.contiguous(), None if s_dmask is None else s_dmask.contiguous(), None
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes)
    record = eager_call((*tensors, qv, sinks))
    plain = qv is None and sinks is None
    if record is not None and plain:
        direct = dispatch.run_direct("forward", q.device, tensors, scalars)
        if direct is not None:
            return direct
    if record is None:
        # The seed is drawn here, by aten's random op, and handed to the op: the op is pure to
        # PyTorch, so the compiler's CSE merged two identical dropout calls into one mask when the
        # op drew it (the CSE spares only aten's random ops; a nondeterministic_seeded tag on the
        # op does not help in torch 2.13).
        dropout_p = scalars[_DROPOUT]
        seed = _draw_dropout_seed(dropout_p, q.device) if dropout_p != 0.0 else None
        return attention_forward(*tensors, *scalars, seed, qv, sinks)
    if record:
        extra: list = []
        rest = (cu_seqlens_q, cu_seqlens_k, block_table, scalars, extra, call)
        if plain and alibi_slopes is None:
            out = _apply_attention(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), rest)
        else:
            out = _AttentionWithExtras.apply(q, k, v, alibi_slopes, qv, sinks, rest)
        return (out, *extra)
    return _forward_run(*tensors, *scalars[:-1], False, None, qv, sinks, call)


def forward_kvcache(q, k_cache, v_cache, *args, call=None):
    """``flash_attn::forward_kvcache`` (arguments as the op's), directly when :func:`direct_call_ok`
    (with ``call``, the public function's checked signature); then, where new k/v were written into
    the caches, their version counters are bumped here, as the op's registration does."""
    tensors = (q, k_cache, v_cache, *args[:9], *args[15:])  # the tensors: before the scalars, then qv, sinks
    if not direct_call_ok(tensors):
        return attention_forward_kvcache(q, k_cache, v_cache, *args)
    result = _kvcache_run(q, k_cache, v_cache, *args, call=call)
    bump_appended(args[0], k_cache, v_cache)
    return result


def bump_appended(k: Optional[Tensor], k_cache: Tensor, v_cache: Tensor) -> None:
    """Where new ``k`` (and v) were written into the caches, their version counters bumped, as the
    op's registration does (inference tensors have no counter: left alone)."""
    if k is not None:
        torch.autograd.graph.increment_version((k_cache, v_cache))
