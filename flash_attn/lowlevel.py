"""Upstream flash-attn 2.8's low-level functions, as ``flash_attn::_flash_attn_*`` custom ops.

Libraries that split a sequence across processes (ring / zigzag / striped context parallelism:
ring-flash-attention, and the frameworks built on it) import these from
``flash_attn.flash_attn_interface`` instead of ``flash_attn_func``: they need each block's
log-sum-exp to combine partial results, and a backward that normalises with the *global*
``out`` and ``softmax_lse`` they pass in.

Names, parameter names, order, defaults and return values are upstream's (2.8.4), and so is the
``torch.library.custom_op`` registration (the decorated objects are ``CustomOpDef``s, so
``._init_fn`` introspection works; fake implementations serve ``torch.compile``). Unlike
upstream they run on every device and backend: each op checks its arguments and runs the body
of the package's own ``flash_attn::forward`` op (:mod:`flash_attn.custom_ops`), or for the backward the
backend contract (:mod:`flash_attn.backends`) directly, which writes the caller's gradients in
place and hands back the kernels' Delta for ``softmax_d``.

V may have its own head dim (``headdim_v``), with FlashAttention-3's shapes: ``out`` and ``dout``
have v's head dim, ``dv`` v's shape. FlashAttention-3's low-level forward also takes ``qv`` (MLA) and
neither has attention sinks; these are FlashAttention-2's functions, which take neither (the public
functions do: ``qv``, ``learnable_sink``).

Where this package's outputs differ from upstream's (the same as for ``flash_attn_func``):
``S_dmask`` is fp32 ``(batch, nheads, seqlen_q, seqlen_k)`` and returned whenever asked for;
``rng_state`` is an int64 ``(1,)`` tensor on q's device holding the dropout seed, drawn there
(pass it back to the backward unchanged). ``zero_tensors`` changes nothing (every output
element is written). Like the public functions, nothing here reads a CUDA tensor's values on
the host (no device synchronisation; value checks on ``leftpad_k``/``seqused_k`` run on the
device through ``torch._assert_async``).
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_attn import dispatch, validation
from flash_attn.custom_ops import forward_body, varlen_layout
from flash_attn.limits import cdiv
from flash_attn.params import AttentionParams, VarlenLayout

__all__ = [
    "_flash_attn_forward",
    "_flash_attn_varlen_forward",
    "_flash_attn_backward",
    "_flash_attn_varlen_backward",
]


def round_multiple(x: int, m: int) -> int:
    return cdiv(x, m) * m


def _last_dim_contiguous(*tensors):
    """Upstream's ``maybe_contiguous``: copy only tensors whose last dim is strided."""
    return [t.contiguous() if isinstance(t, torch.Tensor) and t.stride(-1) != 1 else t for t in tensors]


def _options(dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, batch,
             nheads, seqlen_k, device) -> tuple[float, int, int, float]:
    """The scalar options checked, as ``(softmax_scale, left, right, softcap)`` (the window bounded
    by ``seqlen_k`` as upstream does, the softcap as the backends take it)."""
    window = validation.check_options(dropout_p, softcap, (window_size_left, window_size_right), alibi_slopes, batch,
                                      nheads, device, any_negative=True)
    if softmax_scale is None:
        raise TypeError("softmax_scale must be a float (the low-level functions have no default), got None")
    scale = validation.softmax_scale(softmax_scale, 1)
    left, right = validation.bounded_window(validation.check_flag(causal, "causal"), window, seqlen_k)
    return scale, left, right, validation.softcap_value(softcap, scale)


def _check_like(t, name: str, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape {tuple(shape)}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _rng_state(rng_state: Optional[torch.Tensor], dropout_p: float, device: torch.device) -> torch.Tensor:
    """The forward's dropout seed, on q's device; without one a dropout backward would use
    another mask. Without dropout nothing reads it."""
    if rng_state is None:
        if dropout_p > 0:
            raise ValueError("dropout_p > 0 needs the rng_state returned by the forward, got None")
        return torch.zeros(1, dtype=torch.int64, device=device)
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64 or rng_state.numel() < 1:
        raise TypeError(
            f"rng_state must be the int64 tensor returned by the forward, got {validation._describe(rng_state)}")
    if rng_state.device != device:
        raise ValueError(
            f"rng_state is on {rng_state.device} but q is on {device} (pass the forward's rng_state unchanged)")
    return rng_state


def _defined_seed(result, dropout_p: float):
    """Without dropout the body leaves ``rng_state`` uninitialised (nothing reads it); an op's
    output should not depend on stale memory, so it is zero then (a device fill, no sync)."""
    if dropout_p == 0:
        result[3].zero_()
    return result


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=())
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense attention ``q (b, sq, h, d)``, ``k/v (b, sk, hk, d)`` ->
    ``(out, softmax_lse fp32 (b, h, sq), S_dmask, rng_state)``."""
    q, k, v = _last_dim_contiguous(q, k, v)
    validation.check_dense_qkv(q, k, v)
    scale, left, right, softcap = _options(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                           softcap, alibi_slopes, q.shape[0], q.shape[2], k.shape[1], q.device)
    return _defined_seed(forward_body(
        q, k, v, None, None, None, alibi_slopes, q.shape[1], k.shape[1], scale, left, right,
        softcap, float(dropout_p), validation.check_flag(return_softmax, "return_softmax"), False,
    ), dropout_p)


def _same_device(q, **tensors) -> None:
    """Every tensor given is on q's device. Checked by the fake implementations too: a call that
    mixes a meta tensor with real ones dispatches to them, not to the op's body."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on the same device")


@_flash_attn_forward.register_fake
def _flash_attn_forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
      return_softmax):
    _same_device(q, k=k, v=v, alibi_slopes=alibi_slopes)
    batch, seqlen_q, nheads, _ = q.shape
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, lse, _fake_s_dmask(q, return_softmax, batch, seqlen_q, k.shape[1]), _fake_rng(q)


def _fake_s_dmask(q, return_softmax, batch, seqlen_q, seqlen_k):
    shape = (batch, q.shape[-2], seqlen_q, seqlen_k) if return_softmax else (0,)
    return q.new_empty(shape, dtype=torch.float32)


def _fake_rng(q):
    return q.new_empty((1,), dtype=torch.int64)


def _select_keys(k, v, cu_seqlens_k, max_seqlen_k, block_table, leftpad_k, seqused_k):
    """Express ``leftpad_k`` / ``seqused_k`` through the layouts every backend knows.

    Sequence ``b`` uses key rows ``leftpad_k[b] : seqused_k[b]`` of its own (``seqused_k``
    defaults to its length). Packed keys become one-row pages addressed by a block table (a view
    of k/v, no copy); a paged cache keeps its table and gets the shorter lengths. Everything
    is computed on the device (no host read); bad values raise through ``torch._assert_async``.
    """
    if leftpad_k is None and seqused_k is None:
        return k, v, cu_seqlens_k, block_table
    batch = cu_seqlens_k.shape[0] - 1
    for name, t in (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if t is not None:
            validation.check_index_vector(t, name, batch, k.device, owner="k")
    if block_table is not None and leftpad_k is not None:
        raise ValueError("leftpad_k cannot be combined with a block_table (paged KV), as in flash-attn")
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    start = torch.zeros_like(lengths) if leftpad_k is None else leftpad_k.to(torch.int64)
    end = lengths if seqused_k is None else seqused_k.to(torch.int64)
    ok = ((start >= 0) & (start <= end) & (end <= lengths)).all() & (cu_seqlens_k[0] == 0)
    if block_table is None:
        ok = ok & (cu_seqlens_k[-1] == k.shape[0])
    torch._assert_async(ok, "flash_attn: need cu_seqlens_k to start at 0 (and end at total_k), and "
                            "0 <= leftpad_k[b] <= seqused_k[b] <= cu_seqlens_k[b+1] - cu_seqlens_k[b]")
    used = end - start
    cu_used = torch.cat([used.new_zeros(1), used.cumsum(0)]).to(torch.int32)
    if block_table is not None:
        return k, v, cu_used, block_table
    total_k = k.shape[0]
    first_row = cu_seqlens_k[:-1].to(torch.int64) + start
    rows = first_row.unsqueeze(1) + torch.arange(max(max_seqlen_k, 1), device=k.device)
    table = rows.clamp_(0, max(total_k - 1, 0)).to(torch.int32)  # entries past a sequence are unused
    return k.unsqueeze(1), v.unsqueeze(1), cu_used, table


def _check_num_splits(num_splits, q, k, block_table, max_seqlen_q, dropout_p, causal, window_size_left,
                      window_size_right, alibi_slopes) -> None:
    """Upstream (2.8.4) splits the keys of a paged varlen call only where it runs decoding with
    the query heads folded into rows (one query per sequence, GQA, no window, dropout or ALiBi);
    elsewhere it refuses ``num_splits > 1`` with a RuntimeError, and so do we."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int (0: automatic), got {type(num_splits).__name__}")
    if block_table is None or num_splits <= 1:
        return
    causal = bool(causal) and not (max_seqlen_q == 1 and alibi_slopes is None)  # one query: causal changes nothing
    right = 0 if causal else window_size_right
    folds_heads = (max_seqlen_q == 1 and q.shape[1] > k.shape[2] and window_size_left < 0 and right < 0
                   and dropout_p == 0 and q.shape[2] % 8 == 0 and alibi_slopes is None)
    if not folds_heads:
        raise RuntimeError("num_splits > 1 is not supported for varlen paged KV (as in flash-attn 2.8.4), "
                           f"got num_splits={num_splits}")


@torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())
def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed sequences ``q (total_q, h, d)``, ``k/v (total_k, hk, d)`` or paged ->
    ``(out, softmax_lse fp32 (h, total_q), S_dmask, rng_state)``.

    ``num_splits`` is upstream's split-KV count (0: its heuristic); the result does not depend on it
    here (every backend reduces the keys in one pass), but the calls upstream refuses are refused."""
    q, k, v = _last_dim_contiguous(q, k, v)
    max_seqlen_q = validation.as_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = validation.as_max_seqlen(max_seqlen_k, "max_seqlen_k")
    validation.check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    batch = cu_seqlens_q.shape[0] - 1
    scale, left, right, softcap = _options(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                           softcap, alibi_slopes, batch, q.shape[1], max_seqlen_k, q.device)
    _check_num_splits(num_splits, q, k, block_table, max_seqlen_q, dropout_p, causal, window_size_left,
                      window_size_right, alibi_slopes)
    k, v, cu_seqlens_k, block_table = _select_keys(k, v, cu_seqlens_k, max_seqlen_k, block_table, leftpad_k, seqused_k)
    return _defined_seed(forward_body(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
        scale, left, right, softcap, float(dropout_p), validation.check_flag(return_softmax, "return_softmax"), False,
    ), dropout_p)


@_flash_attn_varlen_forward.register_fake
def _flash_attn_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
      block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False, num_splits=0):
    _same_device(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
                 block_table=block_table, leftpad_k=leftpad_k, seqused_k=seqused_k)
    batch = cu_seqlens_q.shape[0] - 1
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    s_dmask = _fake_s_dmask(q, return_softmax, batch, max_seqlen_q, max_seqlen_k)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), lse, s_dmask, _fake_rng(q)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _check_backward_inputs(dout, q, k, v, out, softmax_lse, dq, dk, dv, lse_shape) -> None:
    out_shape = (*q.shape[:-1], v.shape[-1])  # v's head dim (FlashAttention-3's shapes)
    _check_like(dout, "dout", out_shape, q.dtype, q.device)
    _check_like(out, "out", out_shape, q.dtype, q.device)
    _check_like(softmax_lse, "softmax_lse", lse_shape, torch.float32, q.device)
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if grad is not None:
            _check_like(grad, name, like.shape, like.dtype, like.device)


def _backward_delta(dout, q, k, v, out, lse, dq, dk, dv, varlen, alibi_slopes, scale, left, right, softcap,
                    dropout_p, rng_state, deterministic) -> torch.Tensor:
    """Write the gradients into the given ``dq``/``dk``/``dv`` (upstream writes, never adds) and
    return Delta ``rowsum(dout * out)`` fp32 shaped like ``lse``.

    The kernel backends write straight into the caller's tensors where they are laid out as the
    kernels write (last dim contiguous, other strides multiples of 8 elements, 16-byte aligned)
    and return the Delta their preprocessing computes anyway; what a backend computed elsewhere
    is copied. No fp32 copy of ``dout``/``out`` here (at 16k tokens x 32 heads x 128 those and
    fresh gradients were ~1.1 GiB of temporaries per ring step)."""
    if q.numel() == 0 or k.numel() == 0:  # nothing to attend: zero gradients, no backend
        for given in (dq, dk, dv):
            if given is not None:
                given.zero_()
        from flash_attn.backends import reference  # noqa: PLC0415  (loaded on demand, as dispatch does)

        return reference.delta(dout, out, varlen is not None)
    params = AttentionParams(softmax_scale=scale, window_left=left, window_right=right, softcap=softcap,
                             dropout_p=dropout_p, dropout_seed=rng_state)
    *grads, delta = dispatch.run("backward", q.device, dout, q, k, v, out, lse, params, varlen=varlen,
                                 alibi_slopes=alibi_slopes, deterministic=deterministic, grads=(dq, dk, dv),
                                 return_delta=True)
    for given, grad in zip((dq, dk, dv), grads):
        if given is not None and grad is not given:
            given.copy_(grad)
    return delta


def _softmax_d(delta: torch.Tensor, dropout_p: float, into: torch.Tensor) -> torch.Tensor:
    """Upstream's ``softmax_d`` values: ``(1 - dropout_p) * rowsum(dout * out)`` (scaled by the
    keep probability, as its kernels keep it), written into ``into`` (a slice of the result)."""
    return torch.mul(delta, 1.0 - dropout_p, out=into) if dropout_p else into.copy_(delta)


@torch.library.custom_op("flash_attn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gradients of dense attention written into ``dq``, ``dk``, ``dv`` (those given).

    The probabilities are recomputed from the given ``softmax_lse`` and the softmax correction
    from the given ``out``, so for a block of a longer sequence, passing the whole sequence's
    ``out``/``softmax_lse`` gives that block's exact share of the gradient. Returns
    ``softmax_d`` fp32 ``(b, h, round_multiple(sq, 128))`` (zero past ``sq``).
    """
    dout, q, k, v, out = _last_dim_contiguous(dout, q, k, v, out)
    validation.check_dense_qkv(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    _check_backward_inputs(dout, q, k, v, out, softmax_lse, dq, dk, dv, (batch, nheads, seqlen_q))
    scale, left, right, softcap = _options(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                           softcap, alibi_slopes, batch, nheads, k.shape[1], q.device)
    delta = _backward_delta(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, None, alibi_slopes, scale, left, right,
        softcap, float(dropout_p), _rng_state(rng_state, dropout_p, q.device),
        validation.check_flag(deterministic, "deterministic"),
    )
    softmax_d = q.new_zeros((batch, nheads, round_multiple(seqlen_q, 128)), dtype=torch.float32)
    _softmax_d(delta, dropout_p, softmax_d[:, :, :seqlen_q])
    return softmax_d


@_flash_attn_backward.register_fake
def _flash_attn_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
      window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _same_device(q, dout=dout, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv,
                 alibi_slopes=alibi_slopes, rng_state=rng_state)
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((batch, nheads, round_multiple(seqlen_q, 128)), dtype=torch.float32)


@torch.library.custom_op("flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    """:func:`_flash_attn_backward` for packed sequences; ``softmax_lse`` is ``(h, total_q)``.

    Returns ``softmax_d`` fp32 ``(h, total_q + 128 * batch)`` in upstream's layout: row ``r`` of
    sequence ``b`` at column ``r + 128 * b`` (zero elsewhere).
    """
    dout, q, k, v, out = _last_dim_contiguous(dout, q, k, v, out)
    max_seqlen_q = validation.as_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = validation.as_max_seqlen(max_seqlen_k, "max_seqlen_k")
    validation.check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, None)
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    _check_backward_inputs(dout, q, k, v, out, softmax_lse, dq, dk, dv, (nheads, total_q))
    scale, left, right, softcap = _options(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                           softcap, alibi_slopes, batch, nheads, max_seqlen_k, q.device)
    varlen_layout(q, k, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, max_seqlen_k)  # value checks
    varlen = VarlenLayout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    delta = _backward_delta(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, varlen, alibi_slopes, scale, left, right,
        softcap, float(dropout_p), _rng_state(rng_state, dropout_p, q.device),
        validation.check_flag(deterministic, "deterministic"),
    )
    softmax_d = q.new_zeros((nheads, total_q + 128 * batch), dtype=torch.float32)
    rows = torch.arange(total_q, device=q.device, dtype=torch.int32)
    sequence = torch.searchsorted(cu_seqlens_q[1:], rows, right=True)
    # row r of sequence b at column r + 128 * b (an index_put, as upstream's layout has gaps)
    softmax_d[:, rows.to(torch.int64) + 128 * sequence] = delta * (1.0 - dropout_p) if dropout_p else delta
    return softmax_d


@_flash_attn_varlen_backward.register_fake
def _flash_attn_varlen_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
      rng_state=None, zero_tensors=False):
    _same_device(q, dout=dout, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes, rng_state=rng_state)
    batch = cu_seqlens_q.shape[0] - 1
    return q.new_empty((q.shape[1], q.shape[0] + 128 * batch), dtype=torch.float32)
