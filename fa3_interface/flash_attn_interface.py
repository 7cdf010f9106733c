"""FlashAttention-3's Python interface (``flash_attn_interface``) over this package's attention.

FlashAttention-3 (upstream's ``hopper/``, distribution ``flash_attn_3``) ships this top-level module;
code written for it (Hugging Face Transformers' ``flash_attention_3``, serving code) imports
``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``,
``flash_attn_combine`` and ``get_scheduler_metadata`` from here. The functions below take FA3's
arguments, in FA3's order, with FA3's defaults, and return what FA3 returns (upstream
``hopper/flash_attn_interface.py`` at commit 0251105a); they run on :mod:`flash_attn`'s kernels
and PyTorch backends, so they work on every GPU this package supports and on the CPU.

FA3's arguments here (docs/compatibility.md, "FlashAttention-3's interface"):

* computed as FA3 does: ``softmax_scale`` (default ``(headdim + headdim_v of qv) ** -0.5``),
  ``causal``, ``window_size``, ``softcap``, ``qv`` (MLA), GQA, ``seqused_q``/``seqused_k``,
  varlen with or without ``cu_seqlens_*``, paged KV (``page_table``, any page size),
  ``cache_batch_idx``, ``cache_leftpad``, rotary, the cache call's packed queries and new tokens
  (``cu_seqlens_q``, ``cu_seqlens_k_new``), ``deterministic``, ``num_heads_q``;
* ``s_aux`` (keyword-only; the sink spelling of FA3's forks, vLLM's and Transformers' gpt-oss
  path): ``(nheads,)`` attention-sink logits, one per query head, which join every row's softmax
  denominator (flash_attn's ``learnable_sink``; cast to float32, gradients flow back);
* scheduler hints that change nothing here (but must have FA3's types: a wrong one is a
  ``TypeError`` naming it): ``num_splits`` of the dense and varlen calls,
  ``pack_gqa``, ``sm_margin``, ``scheduler_metadata`` (``num_splits`` of the cache call is
  passed on: it never changes the result either);
* refused with ``NotImplementedError`` naming the argument: ``q_descale``/``k_descale``/
  ``v_descale`` (FP8: not built), ``attention_chunk`` other than 0, the cache call's
  ``rotary_seqlens``, and its ``cu_seqlens_k_new`` without ``cu_seqlens_q``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from flash_attn import custom_ops, kvcache, validation

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
]


def _refuse(**arguments) -> None:
    """FA3 arguments this package does not implement: a clear error when one is set."""
    reasons = {
        "q_descale": "FP8 attention is not built here; pass float16/bfloat16/float32 tensors",
        "k_descale": "FP8 attention is not built here; pass float16/bfloat16/float32 tensors",
        "v_descale": "FP8 attention is not built here; pass float16/bfloat16/float32 tensors",
        "attention_chunk": "chunked attention is not implemented here; use 0",
        "cu_seqlens_k_new": "new k/v packed by sequence need cu_seqlens_q too here (or pass them padded)",
        "rotary_seqlens": "rotary positions are the cache positions here (cache_seqlens)",
    }
    for name, value in arguments.items():
        if value is not None and not (name == "attention_chunk" and value == 0):
            shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
            raise NotImplementedError(f"flash_attn_interface: {name} ({shown}) is not supported: {reasons[name]}")


def _hints(num_splits=0, pack_gqa=None, sm_margin=0, scheduler_metadata=None) -> None:
    """Scheduler hints that change nothing here still have FA3's types (a cheap isinstance each:
    a wrong one is a caller's bug worth naming, not something to ignore)."""
    validation.check_int(num_splits, "num_splits", minimum=0)
    validation.check_int(sm_margin, "sm_margin", minimum=0)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None or a bool, got {pack_gqa!r}")
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise TypeError(f"scheduler_metadata must be None or the tensor get_scheduler_metadata returns, "
                        f"got {type(scheduler_metadata).__name__}")


def _optional_int32(t, name: str) -> None:
    if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32):
        raise TypeError(f"{name} must be None or an int32 tensor, got {validation._describe(t)}")


def _sinks(s_aux, q):
    """FA3 forks' ``s_aux`` as flash_attn's ``learnable_sink`` (float32, differentiable); its shape
    and device checked here under its own name when q is a tensor (else q's check names q)."""
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or not s_aux.is_floating_point():
        raise TypeError(f"s_aux must be a floating-point tensor (nheads,) of sink logits, got "
                        f"{validation._describe(s_aux)}")
    if isinstance(q, torch.Tensor) and q.dim() >= 2:
        if tuple(s_aux.shape) != (q.shape[-2],):
            raise ValueError(f"s_aux must have shape ({q.shape[-2]},) (one logit per query head), "
                             f"got {tuple(s_aux.shape)}")
        if s_aux.device != q.device:
            raise ValueError(f"s_aux is on {s_aux.device} but q is on {q.device}")
    return s_aux.float()


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
             window_size, softcap, deterministic, qv, sinks):
    """``(out, lse)`` of one flash_attn forward (dense when ``cu_seqlens_q`` is None), with autograd."""
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    validation.check_softmax_scale(softmax_scale)
    window_size = validation.check_options(0.0, softcap, window_size, None, batch, q.shape[-2], q.device)
    validation.check_sinks(sinks, q.shape[-2], q.device)
    causal, deterministic = validation.check_flag(causal, "causal"), validation.check_flag(deterministic, "deterministic")
    left, right = validation.causal_window(causal, window_size)
    scale = validation.softmax_scale(softmax_scale, q.shape[-1] + (0 if qv is None else qv.shape[-1]))
    out, lse, _, _ = custom_ops.forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, max_seqlen_q, max_seqlen_k, scale, left, right,
        float(softcap), 0.0, False, bool(deterministic), qv=qv, sinks=sinks,
    )
    return out, lse


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """:func:`flash_attn_func` with q, k, v stacked: qkv ``(batch, seqlen, 3, nheads, headdim)``, or
    with ``num_heads_q`` (GQA) ``(batch, seqlen, num_heads_q + 2 * nheads_k, headdim)``."""
    if num_heads_q is not None:
        validation.check_int(num_heads_q, "num_heads_q", minimum=1)
    if num_heads_q is None:
        validation.check_tensor(qkv, "qkv", 5, "(batch, seqlen, 3, nheads, headdim)")
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=2)
    else:
        validation.check_tensor(qkv, "qkv", 4, "(batch, seqlen, num_heads_q + 2 * nheads_k, headdim)")
        nheads_k, rest = divmod(qkv.shape[2] - num_heads_q, 2)
        if rest or nheads_k <= 0:
            raise ValueError(f"qkv's dim 2 ({qkv.shape[2]}) must be num_heads_q ({num_heads_q}) + 2 * nheads_k")
        q, k, v = qkv.split([num_heads_q, nheads_k, nheads_k], dim=2)
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs, s_aux=s_aux)


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """Exact attention over a padded batch, FA3's signature.

    q ``(batch, seqlen_q, nheads, headdim)``, k ``(batch, seqlen_k, nheads_k, headdim)``, v
    ``(batch, seqlen_k, nheads_k, headdim_v)``; masks as :func:`flash_attn.flash_attn_func`'s
    (bottom-right aligned causal, ``window_size``). Returns out ``(batch, seqlen_q, nheads,
    headdim_v)``, and with ``return_attn_probs`` ``(out, softmax_lse)``, softmax_lse float32
    ``(batch, nheads, seqlen_q)`` (FA3 returns no probabilities). ``num_splits``, ``pack_gqa`` and
    ``sm_margin`` change nothing here.
    """
    _refuse(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk)
    _hints(num_splits, pack_gqa, sm_margin)
    validation.check_flag(return_attn_probs, "return_attn_probs")
    validation.check_dense_qkv(q, k, v)
    validation.check_qv(qv, q, v.shape[-1], "(batch, seqlen_q, nheads, headdim_v)")
    out, lse = _forward(q, k, v, None, None, q.shape[1], k.shape[1], softmax_scale, causal, window_size,
                        softcap, deterministic, qv, _sinks(s_aux, q))
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """Exact attention over sequences of different lengths, FA3's signature.

    As in FA3, either side may be packed or padded: with ``cu_seqlens_q`` q is ``(total_q, nheads,
    headdim)`` and sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; with
    ``cu_seqlens_q=None`` q is ``(batch, seqlen_q, nheads, headdim)`` (and likewise k/v with
    ``cu_seqlens_k``). ``seqused_q``/``seqused_k`` (int32 ``(batch,)``) keep only the first
    ``seqused[b]`` rows of each sequence's slot; rows past ``seqused_q[b]`` get output 0 and
    logsumexp +inf (as a row that sees no key) and no gradient. Reading ``seqused_*`` waits for
    the device (the rows kept are gathered on the host's count).

    Returns out (q's layout with v's head dim), and with ``return_attn_probs`` ``(out,
    softmax_lse)``: ``(nheads, total_q)`` for packed q, ``(batch, nheads, seqlen_q)`` for padded q.
    """
    _refuse(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk)
    _hints(num_splits, pack_gqa, sm_margin)
    validation.check_flag(return_attn_probs, "return_attn_probs")
    sinks = _sinks(s_aux, q)
    padded_q = cu_seqlens_q is None
    if padded_q and cu_seqlens_k is None and seqused_q is None and seqused_k is None:
        return flash_attn_func(q, k, v, softmax_scale, causal, qv, None, None, None, window_size, 0, softcap,
                               num_splits, pack_gqa, deterministic, sm_margin, return_attn_probs, s_aux=s_aux)
    for x, name, packed in ((q, "q", not padded_q), (k, "k", cu_seqlens_k is not None),
                            (v, "v", cu_seqlens_k is not None), (qv, "qv", not padded_q)):
        if x is not None or name != "qv":  # each side packed (3 dims) or padded (4 dims), as its cu_seqlens say
            side = "q" if name in ("q", "qv") else "k"
            layout = (f"(total_{side}, nheads, headdim) with cu_seqlens_{side}" if packed
                      else f"(batch, seqlen_{side}, nheads, headdim) without cu_seqlens_{side}")
            validation.check_tensor(x, name, 3 if packed else 4, layout)
    batch = _batch_of(cu_seqlens_q, cu_seqlens_k, q, k, seqused_q, seqused_k)
    q_rows, cu_q, max_q = _packed(q, "q", cu_seqlens_q, max_seqlen_q, seqused_q, batch)
    k_rows, cu_k, max_k = _packed(k, "k", cu_seqlens_k, max_seqlen_k, seqused_k, batch)
    flat = lambda t: t if t.dim() == 3 else t.flatten(0, 1)  # noqa: E731
    q_used, k_used, v_used = flat(q), flat(k), flat(v)
    qv_used = None if qv is None else flat(qv)
    if q_rows is not None:
        q_used = q_used.index_select(0, q_rows)
        qv_used = None if qv_used is None else qv_used.index_select(0, q_rows)
    if k_rows is not None:
        k_used, v_used = k_used.index_select(0, k_rows), v_used.index_select(0, k_rows)
    max_q, max_k = validation.varlen_max_seqlens(q_used, k_used, None, max_q, max_k)
    validation.check_varlen_qkv(q_used, k_used, v_used, cu_q, cu_k, None)
    validation.check_qv(qv_used, q_used, v_used.shape[-1], "(total_q, nheads, headdim_v)")
    out, lse = _forward(q_used, k_used, v_used, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size,
                        softcap, deterministic, qv_used, sinks)
    if q_rows is not None:
        total = q.shape[0] * (q.shape[1] if padded_q else 1)
        out = out.new_zeros((total, *out.shape[1:])).index_copy(0, q_rows, out)
        lse = lse.new_full((lse.shape[0], total), float("inf")).index_copy(1, q_rows, lse)
    if padded_q:
        out = out.unflatten(0, q.shape[:2])
        lse = lse.unflatten(1, q.shape[:2]).transpose(0, 1)
    return (out, lse) if return_attn_probs else out


def _batch_of(cu_seqlens_q, cu_seqlens_k, q, k, seqused_q, seqused_k) -> int:
    for cu, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        if cu is not None:
            validation.check_cu_seqlens(cu, name, q.device)
    for cu in (cu_seqlens_q, cu_seqlens_k):
        if cu is not None:
            return cu.shape[0] - 1
    for used in (seqused_q, seqused_k):
        if used is not None:
            return used.shape[0]
    return q.shape[0] if q.dim() == 4 else k.shape[0]


def _packed(x, name, cu_seqlens, max_seqlen, seqused, batch):
    """For one side (q or k/v): the rows to keep (``None``: all of them), the int32 ``cu_seqlens``
    of the kept rows and their max length. A padded side ``(batch, seqlen, ...)`` is its flattened
    rows with ``cu_seqlens = [0, seqlen, 2 seqlen, ...]``."""
    if cu_seqlens is None:
        validation.check_tensor(x, name, 4, f"(batch, seqlen_{name}, nheads, headdim) when cu_seqlens_{name} is None")
        if x.shape[0] != batch:
            raise ValueError(f"{name} has batch {x.shape[0]}, the other arguments say {batch}")
        seqlen = x.shape[1]
        cu_seqlens = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=x.device)
        max_seqlen = seqlen
    if seqused is None:
        return None, cu_seqlens, max_seqlen
    if not isinstance(seqused, torch.Tensor) or seqused.dtype != torch.int32 or tuple(seqused.shape) != (batch,):
        raise TypeError(f"seqused_{name} must be an int32 tensor of shape ({batch},), got "
                        f"{getattr(seqused, 'dtype', type(seqused).__name__)} {tuple(getattr(seqused, 'shape', ()))}")
    if seqused.device != x.device:
        raise ValueError(f"seqused_{name} is on {seqused.device} but {name} is on {x.device}")
    starts, slots = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    used = seqused.long()
    if bool(((used < 0) | (used > slots)).any()):
        raise ValueError(f"seqused_{name} must be between 0 and each sequence's length in cu_seqlens_{name} "
                         f"(or the padded seqlen), got {seqused.tolist()} for lengths {slots.tolist()}")
    cu_used = torch.cat([used.new_zeros(1), used.cumsum(0)])
    owner = torch.repeat_interleave(torch.arange(batch, device=x.device), used)
    rows = starts[owner] + torch.arange(owner.shape[0], device=x.device) - cu_used[:-1][owner]
    return rows, cu_used.to(torch.int32), int(used.max()) if batch else 0


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge attention computed over disjoint key splits.

    out_partial float32 ``(num_splits, batch, seqlen, nheads, headdim)``, lse_partial float32
    ``(num_splits, batch, seqlen, nheads)`` (each split's output and logsumexp). Returns
    ``(out, softmax_lse)``: ``out = sum_s exp(lse_s - lse) * out_s`` in ``out_dtype`` (default
    out_partial's; written into ``out`` when given) and ``lse = log sum_s exp(lse_s)`` float32
    ``(batch, seqlen, nheads)``. A row whose splits all have lse -inf gets 0 and -inf.
    """
    for name, t, ndim in (("out_partial", out_partial, 5), ("lse_partial", lse_partial, 4)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor with {ndim} dims, got {validation._describe(t)}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"lse_partial must have shape (num_splits, batch, seqlen, nheads) = "
                         f"{tuple(out_partial.shape[:-1])}, got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"lse_partial is on {lse_partial.device} but out_partial is on {out_partial.device}")
    if out_partial.shape[0] == 0:
        raise ValueError("out_partial must hold at least one split")
    if out_dtype is not None and out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype!r}")
    out_dtype = out_dtype or out_partial.dtype
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be None or a tensor of shape {tuple(out_partial.shape[1:])}, "
                            f"got {validation._describe(out)}")
        if tuple(out.shape) != tuple(out_partial.shape[1:]):
            raise ValueError(f"out must have shape (batch, seqlen, nheads, headdim) = {tuple(out_partial.shape[1:])}, "
                             f"got {tuple(out.shape)}")
        if out.device != out_partial.device:
            raise ValueError(f"out is on {out.device} but out_partial is on {out_partial.device}")
    lse = torch.logsumexp(lse_partial, dim=0)
    finite = torch.isfinite(lse)
    weights = torch.where(finite, torch.exp(lse_partial - torch.where(finite, lse, 0.0)), 0.0)
    combined = (weights.unsqueeze(-1) * out_partial).sum(dim=0)
    if out is None:
        return combined.to(out_dtype), lse
    out.copy_(combined)
    return out, lse


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    attention_chunk=0,
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
    *,
    s_aux=None,
):
    """Attention against a key/value cache (decoding), FA3's signature; no backward.

    New ``k``/``v`` are written **in place** into the caches at rows ``cache_seqlens[b] + t``
    before attending (rotated first when ``rotary_cos``/``rotary_sin`` are given), as
    :func:`flash_attn.flash_attn_with_kvcache` does; ``page_table`` is its ``block_table`` (pages of
    any size). ``qv`` with a latent cache as v_cache is MLA decoding.

    With ``cu_seqlens_q`` q (and ``qv``) are packed ``(total_q, nheads, headdim)``, sequence ``b`` owning
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, and new ``k``/``v`` packed likewise by
    ``cu_seqlens_k_new`` (else padded ``(batch, seqlen_new, ...)``); each sequence is one cache call
    here (the lengths are read on the host), ``max_seqlen_q`` is not needed.

    Returns out ``(batch, seqlen_q, nheads, headdim_v)`` (``(total_q, nheads, headdim_v)`` packed,
    softmax_lse then ``(nheads, total_q)``); with ``return_softmax_lse`` FA3's
    ``(out, softmax_lse, out_accum, softmax_lse_accum)``, softmax_lse ``(batch, nheads, seqlen_q)``
    and the two split accumulators empty (the splits here are combined inside the call).
    """
    _refuse(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk,
            rotary_seqlens=rotary_seqlens, cu_seqlens_k_new=None if cu_seqlens_q is not None else cu_seqlens_k_new)
    _hints(num_splits, pack_gqa, sm_margin, scheduler_metadata)
    validation.check_flag(return_softmax_lse, "return_softmax_lse")
    if max_seqlen_q is not None:  # not needed here (the lengths are read from cu_seqlens_q), but an int
        validation.check_int(max_seqlen_q, "max_seqlen_q", minimum=0)
    _optional_int32(cu_seqlens_k_new, "cu_seqlens_k_new")
    _optional_int32(page_table, "page_table")  # flash_attn's block_table: checked under FA3's name
    if page_table is not None and page_table.dim() != 2:
        raise ValueError(f"page_table must have shape (batch_size, max_num_pages_per_seq), "
                         f"got {tuple(page_table.shape)}")
    call = (rotary_cos, rotary_sin, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
            _sinks(s_aux, q))
    if cu_seqlens_q is None:
        out, lse = _kvcache(q, k_cache, v_cache, k, v, qv, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                            *call)
    else:
        out, lse = _kvcache_varlen_q(q, k_cache, v_cache, k, v, qv, cache_seqlens, cache_batch_idx, cache_leftpad,
                                     page_table, cu_seqlens_q, cu_seqlens_k_new, call)
    if not return_softmax_lse:
        return out
    empty = torch.empty((0,), dtype=torch.float32, device=out.device)
    return out, lse, empty, empty.clone()


def _kvcache(q, k_cache, v_cache, k, v, qv, cache_seqlens, cache_batch_idx, cache_leftpad, page_table, rotary_cos,
             rotary_sin, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, sinks):
    return kvcache.forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, page_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                           None, num_splits, qv=qv, sinks=sinks)


def _kvcache_varlen_q(q, k_cache, v_cache, k, v, qv, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                      cu_seqlens_q, cu_seqlens_k_new, call):
    """The cache call for packed q: one call per sequence, each with that sequence's cache row."""
    validation.check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.device)
    validation.check_tensor(q, "q", 3, "(total_q, nheads, headdim) with cu_seqlens_q")
    starts = cu_seqlens_q.tolist()
    batch = len(starts) - 1
    new_starts = cu_seqlens_k_new.tolist() if cu_seqlens_k_new is not None else None
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    rows = torch.arange(batch, dtype=torch.int32, device=q.device)
    outs, lses = [], []
    for b in range(batch):
        one = slice(b, b + 1)
        q_b = q[starts[b]:starts[b + 1]].unsqueeze(0)
        qv_b = None if qv is None else qv[starts[b]:starts[b + 1]].unsqueeze(0)
        new = (None, None)
        if k is not None:
            new = ((k[new_starts[b]:new_starts[b + 1]].unsqueeze(0), v[new_starts[b]:new_starts[b + 1]].unsqueeze(0))
                   if new_starts is not None else (k[one], v[one]))
        empty = q_b.shape[1] == 0
        if empty and (new[0] is None or new[0].shape[1] == 0):
            continue
        if empty:  # no query, but its new tokens still go into the cache: one throwaway query row
            q_b = q.new_zeros((1, 1, *q.shape[1:]))
            qv_b = None if qv is None else qv.new_zeros((1, 1, *qv.shape[1:]))
        out, lse = _kvcache(
            q_b, k_cache, v_cache, *new, qv_b,
            None if cache_seqlens is None else cache_seqlens[one],
            None if page_table is not None else (rows if cache_batch_idx is None else cache_batch_idx)[one],
            None if cache_leftpad is None else cache_leftpad[one], None if page_table is None else page_table[one],
            *call)
        if not empty:
            outs.append(out[0])
            lses.append(lse[0])
    if not outs:
        dv = v_cache.shape[-1]
        return q.new_empty((0, q.shape[1], dv)), torch.empty((q.shape[1], 0), dtype=torch.float32, device=q.device)
    return torch.cat(outs), torch.cat(lses, dim=1)


def get_scheduler_metadata(
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
    cache_seqlens: torch.Tensor,
    qkv_dtype=torch.bfloat16,
    headdim_v=None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_size: Optional[int] = None,
    max_seqlen_k_new=0,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    attention_chunk=0,
    has_softcap=False,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):
    """FA3's precomputed tile schedule for :func:`flash_attn_with_kvcache`'s ``scheduler_metadata``.

    This package plans its launches itself, so the metadata is an empty int32 tensor on
    ``cache_seqlens``' device, which :func:`flash_attn_with_kvcache` accepts and ignores.
    """
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int32 tensor ({batch_size},), got {type(cache_seqlens).__name__}")
    _refuse(attention_chunk=attention_chunk)
    # none of these changes the (empty) result, but each has FA3's type
    for name, value, least in (("batch_size", batch_size, 1), ("max_seqlen_q", max_seqlen_q, 0),
                               ("max_seqlen_k", max_seqlen_k, 0), ("num_heads_q", num_heads_q, 1),
                               ("num_heads_kv", num_heads_kv, 1), ("headdim", headdim, 1),
                               ("headdim_v", headdim_v, 1), ("page_size", page_size, 1),
                               ("max_seqlen_k_new", max_seqlen_k_new, 0)):
        if value is not None or name not in ("headdim_v", "page_size"):
            validation.check_int(value, name, minimum=least)
    if not isinstance(qkv_dtype, torch.dtype) or not qkv_dtype.is_floating_point:
        raise TypeError(f"qkv_dtype must be a floating torch.dtype, got {qkv_dtype!r}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new),
                    ("cache_leftpad", cache_leftpad)):
        _optional_int32(t, name)
    validation.check_flag(causal, "causal")
    validation.check_flag(has_softcap, "has_softcap")
    validation.check_window(window_size)
    _hints(num_splits, pack_gqa, sm_margin)
    return torch.empty((0,), dtype=torch.int32, device=cache_seqlens.device)
