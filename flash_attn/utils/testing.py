"""Upstream's ``flash_attn.utils.testing``: the helpers test suites written against upstream import
(``generate_random_padding_mask``, ``generate_qkv``, ``construct_local_mask``,
``construct_chunk_mask`` and the naive attention ``attention_ref``), in plain PyTorch (no einops).

Conventions, as upstream's: tensors are ``(batch, seqlen, nheads, head_dim)``; padding masks are
``(batch, seqlen)`` bool, True for real tokens; a *local mask* is True where a key is **hidden**
from a query. Windows are ``(left, right)`` with ``None`` for unbounded; query ``i`` lines up with
key ``i + sk - sq`` (bottom-right alignment, ``sk``/``sq`` the real lengths of the row).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from flash_attn.bert_padding import pad_input, unpad_input

__all__ = [
    "generate_random_padding_mask", "generate_qkv", "construct_local_mask", "construct_chunk_mask",
    "attention_ref",
]

_PADDING_MODES = ("full", "random", "third")
_OUT_OF_RANGE = 2**32  # a key column that no window reaches (left padding of key_leftpad)


def generate_random_padding_mask(max_seqlen, batch_size, device, mode="random", zero_lengths=False):
    """``(batch_size, max_seqlen)`` bool: each row's first ``length`` entries True. Lengths:
    ``"full"`` all ``max_seqlen``; ``"random"`` uniform in ``[max(1, max_seqlen - 20), max_seqlen]``
    (from 0 with ``zero_lengths``); ``"third"`` uniform in ``[max_seqlen // 3, max_seqlen]``.
    ``zero_lengths`` also empties every fifth row and the last one."""
    if mode not in _PADDING_MODES:
        raise AssertionError(f"mode must be one of {_PADDING_MODES}, got {mode!r}")
    if mode == "full":
        lengths = torch.full((batch_size, 1), max_seqlen, device=device, dtype=torch.int32)
    elif mode == "random":
        low = max(0 if zero_lengths else 1, max_seqlen - 20)
        lengths = torch.randint(low, max_seqlen + 1, (batch_size, 1), device=device)
    else:
        lengths = torch.randint(max_seqlen // 3, max_seqlen + 1, (batch_size, 1), device=device)
    if zero_lengths:
        lengths[::5] = 0
        lengths[-1] = 0
    return torch.arange(max_seqlen, device=device).expand(batch_size, max_seqlen) < lengths


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``(b, s, ...)`` -> ``(b * s, ...)``."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _unpad_or_flatten(t, padding_mask, unused_mask):
    """``(packed, indices, cu_seqlens, max_seqlen, seqused)`` of ``t`` (all rows when no mask)."""
    if padding_mask is not None:
        return unpad_input(t, padding_mask, unused_mask)
    batch, seqlen = t.shape[:2]
    cu = torch.arange(0, (batch + 1) * seqlen, step=seqlen, dtype=torch.int32, device=t.device)
    return _flat(t), None, cu, seqlen, None


def _pad_fn(indices, batch, seqlen):
    """The inverse of :func:`_unpad_or_flatten`: ``(total, ...)`` back to ``(batch, seqlen, ...)``."""
    if indices is not None:
        return lambda packed: pad_input(packed, indices, batch, seqlen)
    return lambda packed: packed.reshape(batch, seqlen, *packed.shape[1:])


def _leaf(t):
    return t.detach().requires_grad_()


def _check_qkv(q, k, v, kvpacked, qkvpacked, query_unused_mask, key_unused_mask):
    if kvpacked and qkvpacked:
        raise AssertionError("kvpacked and qkvpacked are exclusive")
    batch, seqlen_k, nheads_k, d = k.shape
    if q.shape[0] != batch or q.shape[-1] != d or tuple(v.shape[:3]) != (batch, seqlen_k, nheads_k):
        raise AssertionError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if (query_unused_mask is not None or key_unused_mask is not None) and (kvpacked or qkvpacked):
        raise AssertionError("unused masks need separate q, k, v (kvpacked=qkvpacked=False)")


def generate_qkv(q, k, v, query_padding_mask=None, key_padding_mask=None, qv=None, kvpacked=False,
                 qkvpacked=False, query_unused_mask=None, key_unused_mask=None):
    """Packed (varlen) versions of padded ``q`` ``(b, sq, h, d)``, ``k`` ``(b, sk, hk, d)``,
    ``v`` ``(b, sk, hk, dv)`` and the functions that pad results back, as upstream's:

    * ``qkvpacked``: ``(qkv_unpad, cu_seqlens_q, max_seqlen_q, qkv, output_pad_fn, dqkv_pad_fn)``;
    * ``kvpacked``: ``(q_unpad, kv_unpad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      q, kv, output_pad_fn, dq_pad_fn, dkv_pad_fn)``;
    * otherwise: ``(q_unpad, k_unpad, v_unpad, qv_unpad, cu_seqlens_q, cu_seqlens_k, seqused_q,
      seqused_k, max_seqlen_q, max_seqlen_k, q, k, v, qv, output_pad_fn, dq_pad_fn, dk_pad_fn)``.

    Returned q/k/v tensors (packed and padded) are fresh leaves requiring grad."""
    _check_qkv(q, k, v, kvpacked, qkvpacked, query_unused_mask, key_unused_mask)
    batch, seqlen_q, nheads = q.shape[:3]
    seqlen_k, nheads_k = k.shape[1:3]
    q_unpad, indices_q, cu_q, max_q, seqused_q = _unpad_or_flatten(q, query_padding_mask, query_unused_mask)
    k_unpad, indices_k, cu_k, max_k, seqused_k = _unpad_or_flatten(k, key_padding_mask, key_unused_mask)
    v_unpad = _unpad_or_flatten(v, key_padding_mask, key_unused_mask)[0]
    output_pad_fn = _pad_fn(indices_q, batch, seqlen_q)
    if qkvpacked:
        same_masks = (query_padding_mask is None and key_padding_mask is None) or (
            query_padding_mask is not None and key_padding_mask is not None
            and torch.equal(query_padding_mask, key_padding_mask))
        if not same_masks:
            raise AssertionError("qkvpacked needs query_padding_mask == key_padding_mask")
        if nheads != nheads_k:
            raise AssertionError("qkvpacked needs as many K/V heads as query heads")
        qkv_unpad = torch.stack([q_unpad, k_unpad, v_unpad], dim=1)
        qkv = torch.stack([q, k, v], dim=2)
        return _leaf(qkv_unpad), cu_q, max_q, _leaf(qkv), output_pad_fn, _pad_fn(indices_q, batch, seqlen_q)
    if kvpacked:
        kv_unpad = torch.stack([k_unpad, v_unpad], dim=1)
        kv = torch.stack([k, v], dim=2)
        return (_leaf(q_unpad), _leaf(kv_unpad), cu_q, cu_k, max_q, max_k, _leaf(q), _leaf(kv),
                output_pad_fn, output_pad_fn, _pad_fn(indices_k, batch, seqlen_k))
    qv_unpad = None
    if qv is not None:
        qv_unpad = _flat(qv)[indices_q] if indices_q is not None else _flat(qv)
    return (_leaf(q_unpad), _leaf(k_unpad), _leaf(v_unpad), None if qv is None else qv_unpad.detach(),
            cu_q, cu_k, seqused_q, seqused_k, max_q, max_k, _leaf(q), _leaf(k), _leaf(v),
            None if qv is None else qv.detach(), output_pad_fn, output_pad_fn, _pad_fn(indices_k, batch, seqlen_k))


def _positions(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device):
    """``(row, col, sq, sk)`` broadcastable to ``(b, 1, sq, sk)`` (or ``(sq, sk)`` without masks):
    query and key indices (keys shifted left by ``key_leftpad``) and the real lengths."""
    row = torch.arange(seqlen_q, device=device, dtype=torch.long).view(seqlen_q, 1)
    col = torch.arange(seqlen_k, device=device, dtype=torch.long)
    if key_leftpad is not None:
        pad = key_leftpad.view(-1, 1, 1, 1).to(torch.long)
        col = col.expand(pad.shape[0], 1, 1, seqlen_k)
        col = torch.where(col >= pad, col - pad, _OUT_OF_RANGE)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).view(-1, 1, 1, 1)
    return row, col, sq, sk


def construct_local_mask(seqlen_q, seqlen_k, window_size=(None, None), sink_token_length=0,
                         query_padding_mask=None, key_padding_mask=None, key_leftpad=None, device=None):
    """True where key ``j`` is outside query ``i``'s window ``(left, right)`` around key
    ``i + sk - sq`` (``None``: unbounded on that side); the first ``sink_token_length`` keys stay
    visible whatever ``left`` is. Shape ``(sq, sk)``, or ``(b, 1, sq, sk)`` with masks/leftpad."""
    left, right = window_size
    row, col, sq, sk = _positions(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device)
    diag = row + sk - sq
    if left is None:
        return col > diag + right
    if key_padding_mask is None:
        sk = torch.full_like(col, seqlen_k)
    too_far_right = col > torch.minimum(diag + right, sk) if right is not None else col > sk
    too_far_left = (col < diag - left) & (col >= sink_token_length)
    return too_far_right | too_far_left


def construct_chunk_mask(seqlen_q, seqlen_k, attention_chunk, query_padding_mask=None, key_padding_mask=None,
                         key_leftpad=None, device=None):
    """True where key ``j`` is outside the chunk of ``attention_chunk`` keys that contains query
    ``i``'s aligned key ``i + sk - sq`` (chunks start at multiples of ``attention_chunk``)."""
    row, col, sq, sk = _positions(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device)
    if key_padding_mask is None:
        sk = torch.full_like(col, seqlen_k)
    diag = row + sk - sq
    chunk_start = diag - diag % attention_chunk  # % rounds toward -inf: right for negative diag
    return (col < chunk_start) | (col >= chunk_start + attention_chunk)


def _repeat_heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """``(b, s, hk, d)`` -> ``(b, s, nheads, d)``: query head ``h`` reads K/V head ``h // (nheads / hk)``."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def _descaled(q, k, v, qv, q_descale, k_descale, v_descale):
    """Apply the per-(batch, head) FP8 descale factors ``(b, h)`` (``q_descale`` per K/V head)."""
    if q_descale is not None:
        factor = q_descale.repeat_interleave(q.shape[2] // k.shape[2], dim=1)[:, None, :, None]
        q = (q.float() * factor).to(q.dtype)
        qv = (qv.float() * factor).to(qv.dtype) if qv is not None else None
    if k_descale is not None:
        k = (k.float() * k_descale[:, None, :, None]).to(k.dtype)
    if v_descale is not None:
        v = (v.float() * v_descale[:, None, :, None]).to(v.dtype)
    return q, k, v, qv


def _scores(q, k, v, qv, softcap, reorder_ops):
    d, dv = q.shape[-1], v.shape[-1]
    scale = 1.0 / math.sqrt(d if qv is None else d + dv)
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if qv is not None:
        scores = scores + torch.einsum("bthd,bshd->bhts", qv * scale, v)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def _hidden_keys(seqlen_q, seqlen_k, window_size, attention_chunk, sink_token_length, query_padding_mask,
                 key_padding_mask, key_leftpad, device):
    """The union of the local-window and chunk masks, or None when neither applies."""
    hidden = None
    if window_size[0] is not None or window_size[1] is not None:
        hidden = construct_local_mask(seqlen_q, seqlen_k, window_size, sink_token_length, query_padding_mask,
                                      key_padding_mask, key_leftpad=key_leftpad, device=device)
    if attention_chunk > 0:
        chunk = construct_chunk_mask(seqlen_q, seqlen_k, attention_chunk, query_padding_mask, key_padding_mask,
                                     key_leftpad=key_leftpad, device=device)
        hidden = chunk if hidden is None else hidden | chunk
    return hidden


def _softmax_with_sink(scores, learnable_sink):
    """Softmax whose denominator also counts ``exp(sink[h])``: a head may attend to nothing."""
    scores = scores.to(torch.float32)
    sink = learnable_sink.view(-1, 1, 1).to(torch.float32)
    top = torch.maximum(sink, scores.amax(dim=-1, keepdim=True))
    weights = torch.exp(scores - top)
    return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))


def _zero_unused_rows(attention, query_padding_mask, key_padding_mask, hidden):
    """Zero padded queries, padded keys and rows with every key hidden (NaN otherwise)."""
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    if key_padding_mask is not None:
        attention = attention.masked_fill(~key_padding_mask[:, None, None, :], 0.0)
    if hidden is not None:
        attention = attention.masked_fill(torch.all(hidden, dim=-1, keepdim=True), 0.0)
    return attention


def attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, key_leftpad=None, attn_bias=None,
                  dropout_p=0.0, dropout_mask=None, causal=False, qv=None, q_descale=None, k_descale=None,
                  v_descale=None, window_size=(None, None), attention_chunk=0, sink_token_length=0,
                  learnable_sink: Optional[torch.Tensor] = None, softcap=0.0, upcast=True, reorder_ops=False,
                  intermediate_dtype=None):
    """Naive attention over the full score matrix, as upstream's reference: q ``(b, sq, h, d)``,
    k ``(b, sk, hk, d)``, v ``(b, sk, hk, dv)`` (``h`` a multiple of ``hk``), scale
    ``1/sqrt(d)`` (``1/sqrt(d + dv)`` with ``qv``). ``upcast`` computes in fp32;
    ``reorder_ops`` scales k instead of q (to measure rounding noise); ``dropout_mask``
    ``(b, h, sq, sk)`` bool keeps True entries and rescales by ``1/(1 - dropout_p)``;
    ``intermediate_dtype`` rounds the probabilities through that dtype before the product with v.

    Returns ``(output (b, sq, h, dv), attention (b, h, sq, sk))`` in q's dtype; ``attention`` is
    the softmax before dropout, 0 for padded queries/keys and fully hidden rows."""
    if causal:
        window_size = (window_size[0], 0)
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        qv = qv.float() if qv is not None else None
    q, k, v, qv = _descaled(q, k, v, qv, q_descale, k_descale, v_descale)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k, v = _repeat_heads(k, q.shape[2]), _repeat_heads(v, q.shape[2])
    scores = _scores(q, k, v, qv, softcap, reorder_ops)
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    hidden = _hidden_keys(seqlen_q, seqlen_k, window_size, attention_chunk, sink_token_length,
                          query_padding_mask, key_padding_mask, key_leftpad, q.device)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias
    if learnable_sink is None:
        attention = torch.softmax(scores, dim=-1).to(v.dtype)
    else:
        attention = _softmax_with_sink(scores, learnable_sink).to(v.dtype)
    attention = _zero_unused_rows(attention, query_padding_mask, key_padding_mask, hidden)
    dropped = attention.masked_fill(~dropout_mask, 0.0) if dropout_mask is not None else attention
    if intermediate_dtype is not None:
        dropped = dropped.to(intermediate_dtype).to(dropped.dtype)
    output = torch.einsum("bhts,bshd->bthd", dropped, v * (1.0 / (1 - dropout_p)))
    if query_padding_mask is not None:
        output = output.masked_fill(~query_padding_mask[:, :, None, None], 0.0)
    return output.to(dtype=dtype_og), attention.to(dtype=dtype_og)
