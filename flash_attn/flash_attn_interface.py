"""The public functions of flash-attn 2.8, with the same names, parameters, defaults and returns.

Each function checks its arguments (:mod:`flash_attn.validation`), normalises them (default
softmax scale, ``causal`` as a window bound) and calls one ``flash_attn::*`` custom operator
(:mod:`flash_attn.custom_ops`; in plain eager calls its body directly), which runs the backend chosen
by ``FLASH_ATTN_BACKEND`` (:mod:`flash_attn.dispatch`): the ahead-of-time GPU kernels on CUDA tensors when installed,
PyTorch's fused CPU kernels on CPU tensors (the ``cpu`` backend), the exact PyTorch reference backend on
every other device.

Masking (every function): with ``causal=True`` the mask is aligned to the **bottom-right**
corner of the ``seqlen_q x seqlen_k`` score matrix. With seqlen_q = 2 and seqlen_k = 5 the
visible keys (1) are::

    1 1 1 1 0
    1 1 1 1 1

and with seqlen_q = 5, seqlen_k = 2::

    0 0
    0 0
    0 0
    1 0
    1 1

``window_size=(left, right)`` lets query ``i`` see keys ``j`` with
``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (``-1`` = unbounded
on that side); ``causal`` is ``right = 0``. A query row that sees no key gives output 0 and
logsumexp +inf.

MQA/GQA: k/v may have fewer heads than q (nheads % nheads_k == 0); query head ``h`` uses
key/value head ``h // (nheads // nheads_k)``.

Head dims: q and k share one (``headdim``), v may have its own (``headdim_v``, e.g. 192/128 for
DeepSeek's MLA training), and the output has v's; each between 1 and 512.

Beyond flash-attn 2.8, keyword-only at the end of the calls:

* ``learnable_sink`` (FlashAttention-4's name; every function): an optional float32 tensor
  ``(nheads,)``, one attention-sink logit per query head (gpt-oss). It joins every row's softmax
  denominator with no value: ``P[i, j] = exp(s[i, j]) / (exp(sink) + sum_j' exp(s[i, j']))``, so the
  rows' probabilities sum to less than 1 and the logsumexp includes the sink (a row that sees no
  key: output 0, logsumexp ``sink``). It is not scaled, softcapped or biased; gradients flow into it
  when it requires grad. A sink of ``-inf`` is no sink.
* ``qv`` (FlashAttention-3's name; :func:`flash_attn_func`, :func:`flash_attn_varlen_func`,
  :func:`flash_attn_with_kvcache`): MLA's absorbed queries, shaped like q with v's head dim:
  scores become ``softmax_scale * (q . k + qv . v)``, and the default softmax scale
  ``(headdim + headdim_v) ** -0.5`` (MLA decoding: q of 64 with qv of 512 against a 512-wide
  latent cache as v). Gradients flow into qv too.

Upstream's low-level API is importable from here too, for code that combines attention blocks
itself (context parallelism): ``_flash_attn_forward``, ``_flash_attn_varlen_forward``,
``_flash_attn_backward``, ``_flash_attn_varlen_backward`` (:mod:`flash_attn.lowlevel`) and the
``flash_attn_gpu`` entry points (:mod:`flash_attn.entry_points`), and upstream's autograd classes
``FlashAttnFunc``, ``FlashAttnVarlenFunc``, ... with the ``_wrapped_flash_attn_*`` custom-op handles
(:mod:`flash_attn.autograd_functions`).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from flash_attn import entry_points as flash_attn_gpu  # noqa: F401  (upstream's handle, see below)
from flash_attn.autograd_functions import (  # noqa: F401  (upstream's autograd classes and helpers, imported from here)
    USE_TRITON_ROCM,
    FlashAttnFunc,
    FlashAttnKVPackedFunc,
    FlashAttnQKVPackedFunc,
    FlashAttnVarlenFunc,
    FlashAttnVarlenKVPackedFunc,
    FlashAttnVarlenQKVPackedFunc,
    _flash_attn_backward_fake,
    _flash_attn_forward_fake,
    _flash_attn_varlen_backward_fake,
    _flash_attn_varlen_forward_fake,
    _get_block_size_n,
    _torch_custom_op_wrapper,
    _torch_register_fake_wrapper,
    _wrapped_flash_attn_backward,
    _wrapped_flash_attn_forward,
    _wrapped_flash_attn_varlen_backward,
    _wrapped_flash_attn_varlen_forward,
    maybe_contiguous,
    noop_custom_op_wrapper,
    noop_register_fake_wrapper,
    round_multiple,
)
from flash_attn import custom_ops, dispatch, kvcache, validation
from flash_attn.planning.forward import shares_key_lengths
from flash_attn.planning.shapes import bucket_seqlen
from flash_attn.lowlevel import (  # noqa: F401  (upstream's low-level API, imported from here)
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


def _options(alibi_slopes, learnable_sink, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
             return_attn_probs, batch, nheads, headdim, device) -> tuple:
    """The scalar options checked and normalised: ``(softmax_scale, window_left, window_right,
    softcap, dropout_p, return_attn_probs, deterministic)``; ``headdim``: the features the default
    scale counts (q's, plus qv's when given). Arguments in :func:`_checked_options`' order (the
    tensors first, as :func:`flash_attn.validation.checked` passes them)."""
    window_size = validation.check_options(dropout_p, softcap, window_size, alibi_slopes, batch, nheads, device)
    validation.check_sinks(learnable_sink, nheads, device)
    left, right = validation.causal_window(validation.check_flag(causal, "causal"), window_size)
    scale = validation.softmax_scale(softmax_scale, headdim)
    return_attn_probs = validation.check_flag(return_attn_probs, "return_attn_probs")
    return (scale, left, right, validation.softcap_value(softcap, scale), float(dropout_p), return_attn_probs,
            validation.check_flag(deterministic, "deterministic"))


def _dense_checks(q, k, v, qv, alibi_slopes, learnable_sink, dropout_p, softmax_scale, causal, window_size, softcap,
                  deterministic, return_attn_probs) -> tuple:
    validation.check_dense_qkv(q, k, v)
    validation.check_qv(qv, q, v.shape[-1], "(batch, seqlen_q, nheads, headdim_v)")
    return _checked_options(q, qv, q.shape[0], alibi_slopes, learnable_sink, dropout_p, softmax_scale, causal,
                            window_size, softcap, deterministic, return_attn_probs)


def _varlen_checks(q, qv, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, learnable_sink, _max_seqlen_q,
                   _max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                   return_attn_probs) -> tuple:
    # the longest lengths' values are checked per call, against cu_seqlens (custom_ops.varlen_layout)
    validation.check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    validation.check_qv(qv, q, v.shape[-1], "(total_q, nheads, headdim_v)")
    return _checked_options(q, qv, cu_seqlens_q.shape[0] - 1, alibi_slopes, learnable_sink, dropout_p, softmax_scale,
                            causal, window_size, softcap, deterministic, return_attn_probs)


def _batch_signature(tensors: tuple, scalars: tuple) -> Optional[tuple]:
    """The signature a packed call shares with other batches of its class: its row counts' class
    (:func:`flash_attn.validation.packed_rows`) and its longest lengths' buckets, what its plan
    holds (:func:`flash_attn.planning.shapes.describe_forward`); q and qv are packed rows, and k
    and v unless paged. ``None`` (checked on its own) where those are not packed rows (absent, or
    without a first dimension) or the row counts that the checks compare differ: qv's and q's, v's
    and k's."""
    q, qv, k, v, _, _, block_table, _, _ = tensors
    if q is None or k is None or v is None:
        return None
    max_seqlen_q, max_seqlen_k, *options = scalars
    try:
        shared = validation.signature(tensors, (bucket_seqlen(max_seqlen_q), bucket_seqlen(max_seqlen_k), *options),
                                      packed=2 if block_table is not None else 4)
    except TypeError:
        return None
    if (qv is not None and qv.shape[0] != q.shape[0]) or (block_table is None and v.shape[0] != k.shape[0]):
        return None
    return shared


def _key_length_class(tensors: tuple, scalars: tuple) -> Optional[tuple]:
    """The signature a dense call shares with the calls that differ from it only in k and v's key
    length and strides (:class:`flash_attn.params.KeyLengths`; a growing KV cache): the other
    arguments' signature and what the checks read of k and v but those (their other sizes, dtype
    and device; a stride-1 last dimension, which their layout below implies). ``None`` (checked
    on its own) with dropout or the probabilities asked for, or where k and v do not have one key
    length of at least 1 or are not laid out for every length's plan to come from one template
    (:func:`flash_attn.planning.forward.shares_key_lengths`)."""
    q, k, v, *others = tensors
    dropout_p, *_, return_attn_probs = scalars
    if type(dropout_p) not in (int, float) or dropout_p != 0 or return_attn_probs is not False:
        return None
    if type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    ks, vs = k.shape, v.shape
    if len(ks) != 4 or len(vs) != 4 or not 0 < ks[1] == vs[1] or not shares_key_lengths(k, v):
        return None
    try:
        rest = validation.signature((q, *others), scalars)
    except TypeError:
        return None
    return rest, ks[0], ks[2:], k.dtype, k.device, vs[0], vs[2:], v.dtype, v.device


def _checked_options(q, qv, batch, alibi_slopes, learnable_sink, dropout_p, softmax_scale, causal, window_size, softcap,
                     deterministic, return_attn_probs) -> tuple:
    """:func:`_options`, checked once per signature of their own: a new shape (a packed batch, a
    growing cache's key length) is a new call signature, its options mostly the last call's."""
    return validation.checked("attention options", (alibi_slopes, learnable_sink),
                              (dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                               batch, q.shape[-2], _scaled_features(q, qv), q.device), _options)


def _scaled_features(q, qv) -> int:
    """The features the default softmax scale counts: q's, and qv's (``q.k + qv.v``)."""
    return q.shape[-1] + (0 if qv is None else qv.shape[-1])


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, options,
               qv, learnable_sink, call=None):
    """Shared tail of the dense and varlen functions (inputs checked, ``options`` from :func:`_options`;
    ``call``: the call's checked signature, :func:`flash_attn.validation.checked_call`)."""
    scale, left, right, softcap, dropout_p, return_attn_probs, deterministic = options
    out, lse, s_dmask, _ = custom_ops.forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes,
        max_seqlen_q, max_seqlen_k, scale, left, right, softcap, dropout_p, return_attn_probs, deterministic,
        qv=qv, sinks=learnable_sink, call=call,
    )
    return (out, lse, s_dmask) if return_attn_probs else out


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    qv=None,
    learnable_sink=None,
):
    """Exact attention over a padded batch.

    Arguments:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16/bfloat16/float32.
        k: ``(batch, seqlen_k, nheads_k, headdim)``, v: ``(batch, seqlen_k, nheads_k, headdim_v)``,
            same dtype and device as q.
        dropout_p: probability of dropping an attention weight (use 0.0 in evaluation). The mask
            is drawn from PyTorch's RNG: ``torch.manual_seed`` makes it reproducible, and the
            backward uses the very mask of its forward.
        softmax_scale: scale of ``q @ k^T``; default ``headdim ** -0.5``.
        causal: bottom-right aligned causal mask (see the module docstring).
        window_size: ``(left, right)`` sliding-window bounds, ``-1`` = unbounded.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling, before
            masking); 0 or ``inf`` turn it off.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``; adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the score of query i and key j.
        deterministic: make the backward bit-reproducible run to run.
        return_attn_probs: also return the logsumexp and the attention probabilities (testing).
        qv: keyword-only, optional ``(batch, seqlen_q, nheads, headdim_v)``: MLA's absorbed queries
            (see the module docstring).
        learnable_sink: keyword-only, optional float32 ``(nheads,)`` attention sinks (see the module
            docstring).

    Returns:
        out ``(batch, seqlen_q, nheads, headdim_v)``; with ``return_attn_probs`` also
        softmax_lse float32 ``(batch, nheads, seqlen_q)`` (natural log of the softmax denominator
        of the scaled scores) and S_dmask float32 ``(batch, nheads, seqlen_q, seqlen_k)``: the
        softmax probabilities, negative where dropout dropped the entry.
    """
    scalars = (dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)
    # held lanes (dispatch.run_held, held_training) take plain tensors, without ALiBi, qv or sinks
    plain = alibi_slopes is None and qv is None and learnable_sink is None and type(q) is _Tensor and \
        type(k) is _Tensor and type(v) is _Tensor
    if plain:  # a call whose whole route the backend holds: its checks passed before
        shapes = (q.shape, k.shape, v.shape)  # (a growing cache's new key length finds none)
        record = _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        # (as _held_packed_out, inline: the hottest call's frame less)
        if not record:
            made = dispatch.run_held("flash_attn_func", (q, k, v), scalars, shapes)
            if made is not None:
                return made[0]
        else:
            lanes = dispatch.held_training(_DENSE_TRAINING, scalars, shapes)
            if lanes is not None:
                try:
                    return custom_ops.held_training(q, k, v, lanes)
                except custom_ops.HeldRefused:
                    pass
    # a new key length of a known layout (a growing KV cache) shares its class's checks (_key_length_class)
    options, call = validation.checked_call("flash_attn_func", (q, k, v, qv, alibi_slopes, learnable_sink), scalars,
                                            _dense_checks, _key_length_class, own_keys=True)
    out = _attention(q, k, v, None, None, q.shape[1], k.shape[1], None, alibi_slopes, options, qv, learnable_sink,
                     call)
    if plain and type(call) is int and return_attn_probs is False:
        _hold("flash_attn_func", call, (q, k, v), _DENSE_SLOTS, scalars, shapes, record, options,
              (q.shape[1], k.shape[1]))
    return out


def _held_packed_out(tensors: tuple, scalars: tuple, shapes: tuple, record: bool):
    """``out`` of a :func:`flash_attn_varlen_func` call (plain ``tensors``: q, k, v, cu_seqlens_q
    and _k) by the lanes a backend holds for it (:func:`_hold`), or ``None``: none held, or none
    takes the call (the function then takes its checked route), or
    :data:`~flash_attn.dispatch.FIRST_MET`: these arguments are met for the first time (a packed
    batch met once, in a model's first layer, holds nothing). (flash_attn_func does the same inline.)"""
    if not record:
        made = dispatch.run_held(_VARLEN, tensors, scalars, shapes, remember=True)
        return made if made is None or made is dispatch.FIRST_MET else made[0]
    lanes = dispatch.held_training(_VARLEN_TRAINING, scalars, shapes, remember=True)
    if lanes is None or lanes is dispatch.FIRST_MET:
        return lanes
    try:
        return custom_ops.held_packed_training(*tensors[:3], lanes, *tensors[3:])
    except custom_ops.HeldRefused:
        return None


def _hold(tag: str, call: int, tensors: tuple, slots: tuple, scalars: tuple, shapes: tuple, record: bool,
          options: tuple, max_seqlens: tuple) -> None:
    """After the checked route of a plain call of ``tag`` (checked signature ``call``, its
    ``options``, the longest lengths ``max_seqlens``) without S_dmask: have the backend that ran it
    hold its lanes for the later calls its held path looks up (an inference call's forward;
    a training call's without dropout, with its backward once one has run)."""
    if not record:
        dispatch.hold_held(tag, "forward", call, tensors, slots, scalars, shapes, ("out",))
        return
    scale, left, right, softcap, dropout, _, deterministic = options
    if dropout == 0.0:
        dispatch.hold_training(tag + _TRAINING, call, tensors, slots, scalars, shapes,
                               (*max_seqlens, scale, left, right, softcap, 0.0), deterministic)


_TRAINING = ", training"  # the held lanes' tag of a public function's training calls: its name and this
_DENSE_TRAINING, _VARLEN, _VARLEN_TRAINING = "flash_attn_func" + _TRAINING, "flash_attn_varlen_func", \
    "flash_attn_varlen_func" + _TRAINING
_DENSE_SLOTS, _VARLEN_SLOTS = ("q", "k", "v"), ("q", "k", "v", "cu_q", "cu_k")  # the held lanes' tensors


_Tensor, _grad_enabled = torch.Tensor, torch.is_grad_enabled


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """:func:`flash_attn_func` with q, k, v stacked: qkv ``(batch, seqlen, 3, nheads, headdim)``.

    Gradients flow back into ``qkv``. Returns as :func:`flash_attn_func`.
    """
    _check_packed(qkv, "qkv", 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """:func:`flash_attn_func` with k, v stacked: kv ``(batch, seqlen_k, 2, nheads_k, headdim)``."""
    _check_packed(kv, "kv", 5, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    _check_packed_with_q(q, kv)
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    qv=None,
    learnable_sink=None,
):
    """Exact attention over sequences of different lengths packed without padding.

    Arguments:
        q: ``(total_q, nheads, headdim)``: the queries of all sequences, one after another.
        k, v: ``(total_k, nheads_k, headdim)`` and ``(total_k, nheads_k, headdim_v)``; or, with
            ``block_table`` (paged KV), ``(num_blocks, page_block_size, nheads_k, headdim / headdim_v)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` cumulative lengths starting at 0:
            sequence ``b`` owns rows ``cu[b]:cu[b+1]``. Zero-length sequences are allowed.
        max_seqlen_q, max_seqlen_k: int, at least the longest sequence.
        block_table: optional int32 ``(batch, max_pages_per_seq)``: the pages holding sequence
            ``b``'s keys and values, in order.
        qv: keyword-only, optional ``(total_q, nheads, headdim_v)``: MLA's absorbed queries.
        learnable_sink: keyword-only, optional float32 ``(nheads,)`` attention sinks.
        The other arguments as in :func:`flash_attn_func`; masks and ALiBi use each sequence's
        own lengths.

    Returns:
        out ``(total_q, nheads, headdim_v)``; with ``return_attn_probs`` also softmax_lse float32
        ``(nheads, total_q)`` and S_dmask float32 ``(batch, nheads, max_seqlen_q, max_seqlen_k)``.
    """
    # held lanes: plain tensors without a block table, ALiBi, qv or sinks; the longest lengths ints
    # (a 0-d tensor's value is no key: it may change in place); cu_seqlens' values not checked on the
    # host (CPU tensors, FLASH_ATTN_DEBUG: read per call)
    plain = block_table is None and alibi_slopes is None and qv is None and learnable_sink is None and \
        type(max_seqlen_q) is int and type(max_seqlen_k) is int and type(q) is _Tensor and type(k) is _Tensor and \
        type(v) is _Tensor and type(cu_seqlens_q) is _Tensor and type(cu_seqlens_k) is _Tensor and \
        not custom_ops._checks_values(q)
    if plain:  # a packed batch whose whole route the backend holds (a model's later layers): its checks passed before
        scalars = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                   return_attn_probs)
        tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k)
        shapes = (q.shape, k.shape, v.shape, cu_seqlens_q.shape, cu_seqlens_k.shape)
        record = _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        out = _held_packed_out(tensors, scalars, shapes, record)
        if out is not None and out is not dispatch.FIRST_MET:
            return out
        plain = out is None  # (a batch met for the first time: nothing held for it)
    exact = bool(return_attn_probs)
    max_seqlen_q, max_seqlen_k = validation.varlen_max_seqlens(q, k, block_table, max_seqlen_q, max_seqlen_k,
                                                               exact=exact)
    # the longest lengths as ints first (a 0-d tensor's value is no signature). A packed batch's
    # signature (its totals, its longest lengths) is new per batch, then the same in every layer;
    # a new one shares its class's (_batch_signature) unless S_dmask is sized by the exact lengths
    options, call = validation.checked_call(
        "flash_attn_varlen_func", (q, qv, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, learnable_sink),
        (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
         return_attn_probs), _varlen_checks, None if exact else _batch_signature)
    out = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes,
                     options, qv, learnable_sink, call)
    if plain and type(call) is int and return_attn_probs is False:
        _hold(_VARLEN, call, tensors, _VARLEN_SLOTS, scalars, shapes, record, options, (max_seqlen_q, max_seqlen_k))
    return out


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """:func:`flash_attn_varlen_func` with qkv ``(total, 3, nheads, headdim)`` and one set of
    ``cu_seqlens``/``max_seqlen`` for queries and keys."""
    _check_packed(qkv, "qkv", 4, 3, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """:func:`flash_attn_varlen_func` with kv ``(total_k, 2, nheads_k, headdim)``."""
    _check_packed(kv, "kv", 4, 2, "(total_k, 2, nheads_k, headdim)")
    _check_packed_with_q(q, kv)
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, learnable_sink=learnable_sink)


def _check_packed_with_q(q, kv) -> None:
    """kv shares q's dtype and device (named as kv, not as the k and v it holds)."""
    if isinstance(q, torch.Tensor):
        validation.check_same(("q", q), ("kv", kv))


def _check_packed(t, name: str, ndim: int, count: int, layout: str) -> None:
    validation.check_tensor(t, name, ndim, layout)
    pack_dim = ndim - 3
    if t.shape[pack_dim] != count:
        raise ValueError(f"{name} must have shape {layout}: dim {pack_dim} must be {count}, got shape {tuple(t.shape)}")


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    qv=None,
    learnable_sink=None,
):
    """Attention for incremental decoding against a key/value cache (no backward).

    If ``k``/``v`` are given they are written **in place** into ``k_cache``/``v_cache`` at rows
    ``cache_seqlens[b], cache_seqlens[b] + 1, ...`` before attending, so one call appends the
    new tokens and attends over the updated cache. The cache must have room for them.

    Arguments:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_k, headdim)`` and ``(..., headdim_v)``,
            or with ``block_table`` page pools ``(num_blocks, page_block_size, nheads_k, headdim)``
            and ``(..., headdim_v)``.
        k, v: optional ``(batch, seqlen_new, nheads_k, headdim / headdim_v)``, the new tokens.
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)``; rotate the new k at
            positions ``cache_seqlens[b] + t``, and q at the same positions when causal or local,
            otherwise every q row at position ``cache_seqlens[b]``.
        cache_seqlens: int or int32 ``(batch,)``: rows of the cache already filled (including any
            left padding). ``None`` means the whole cache (only without new k/v).
        cache_batch_idx: optional int32 ``(batch,)``: which cache row each batch entry uses.
        cache_leftpad: optional int32 ``(batch,)``: the cache of entry ``b`` starts at this row;
            positions for masking and ALiBi start at 0 there.
        block_table: optional int32 ``(batch, max_pages_per_seq)`` for a paged cache.
        rotary_interleaved: True rotates feature pairs (0, 1), (2, 3), ...; False rotates the
            two halves of the rotary dims (GPT-NeoX style).
        num_splits: how many key splits a GPU kernel may use (0 = heuristic); never changes the
            result.
        return_softmax_lse: also return the logsumexp ``(batch, nheads, seqlen_q)``.
        qv: keyword-only, optional ``(batch, seqlen_q, nheads, headdim_v)``: MLA's absorbed queries,
            scored against the v cache (not rotated). MLA decoding as FlashAttention-3 spells it: q
            of head dim 64, qv of 512, k_cache of 64 and the latent cache of 512 as v_cache.
        learnable_sink: keyword-only, optional float32 ``(nheads,)`` attention sinks (counted once per
            row, whatever the number of key splits).
        The other arguments as in :func:`flash_attn_func`.

    Returns:
        out ``(batch, seqlen_q, nheads, headdim_v)``, and softmax_lse if requested.
    """
    out, lse = kvcache.forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                               cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                               rotary_interleaved, alibi_slopes, num_splits, qv=qv, sinks=learnable_sink)
    return (out, lse) if validation.check_flag(return_softmax_lse, "return_softmax_lse") else out
