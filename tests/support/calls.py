"""Representative calls of the three attention operations, as backend-contract arguments.

Made of any tensors (``device="meta"`` for planning without data): dense and varlen, MHA/GQA,
every mask kind, the score features, KV-cache decoding with and without pages, rotary, left
padding and batch indices. Tests plan them onto the shipped kernels, run them through the ``aot``
path, and check that nothing reads a tensor value on the host.
"""

from __future__ import annotations

import itertools

import torch

from flash_attn.params import AttentionParams, KVCacheInputs, VarlenLayout

MASKS = {"full": (-1, -1), "causal": (-1, 0), "window": (17, 3)}
FEATURES = {"none": {}, "softcap": {"softcap": 20.0}, "alibi": {"alibi": True}, "dropout": {"dropout_p": 0.1}}


def _params(window, softcap=0.0, dropout_p=0.0, seed=None):
    return AttentionParams(0.125, window[0], window[1], softcap, dropout_p, 0 if seed is None else seed)


def attention_calls(dtype, head_dim: int, device="meta"):
    """``(name, op, args, kwargs)`` for :func:`flash_attn.dispatch.run` ("forward"/"backward")."""
    t = lambda *shape, dt=dtype: torch.empty(shape, dtype=dt, device=device)  # noqa: E731
    seed = torch.empty(1, dtype=torch.int64, device=device)
    for (mask, window), (feat, kw), varlen in itertools.product(MASKS.items(), FEATURES.items(), (False, True)):
        params = _params(window, kw.get("softcap", 0.0), kw.get("dropout_p", 0.0), seed)
        h, hk = 8, 2
        if varlen:
            layout = VarlenLayout(t(4, dt=torch.int32), t(4, dt=torch.int32), 300, 257)
            q, k = t(700, h, head_dim), t(600, hk, head_dim)
            lse = t(h, 700, dt=torch.float32)
        else:
            layout = None
            q, k = t(3, 300, h, head_dim), t(3, 257, hk, head_dim)
            lse = t(3, h, 300, dt=torch.float32)
        alibi = t(h, dt=torch.float32) if kw.get("alibi") else None
        name = f"{mask}-{feat}-{'varlen' if varlen else 'dense'}"
        yield name, "forward", (q, k, torch.empty_like(k), params), dict(varlen=layout, alibi_slopes=alibi)
        yield name, "backward", (torch.empty_like(q), q, k, torch.empty_like(k), torch.empty_like(q), lse, params), \
            dict(varlen=layout, alibi_slopes=alibi)


def kvcache_calls(dtype, head_dim: int, device="meta"):
    """``(name, "forward_kvcache", args, kwargs)``: decoding steps and a prefill against a cache."""
    t = lambda *shape, dt=dtype: torch.empty(shape, dtype=dt, device=device)  # noqa: E731
    b, h, hk = 4, 8, 2
    for paged, rotary, seqlen_q, extras in itertools.product(
            (False, True), (None, "neox", "gptj"), (1, 40), ("none", "leftpad", "batch_idx", "alibi")):
        if paged and extras == "batch_idx":
            continue
        if paged:
            k_cache = t(32, 16, hk, head_dim)
            block_table = t(b, 8, dt=torch.int32)
        else:
            k_cache = t(b + 1 if extras == "batch_idx" else b, 128, hk, head_dim)
            block_table = None
        cos = sin = None
        if rotary:
            cos, sin = t(128, head_dim // 2, dt=torch.float32), t(128, head_dim // 2, dt=torch.float32)
        cache = KVCacheInputs(
            k_cache, torch.empty_like(k_cache), t(b, dt=torch.int32), t(b, seqlen_q, hk, head_dim),
            t(b, seqlen_q, hk, head_dim), t(b, dt=torch.int32) if extras == "batch_idx" else None,
            t(b, dt=torch.int32) if extras == "leftpad" else None, block_table, cos, sin, rotary == "gptj",
            0)
        alibi = t(h, dt=torch.float32) if extras == "alibi" else None
        params = _params((-1, 0), softcap=5.0 if extras == "alibi" else 0.0)
        name = f"{'paged' if paged else 'plain'}-{rotary}-q{seqlen_q}-{extras}"
        yield name, "forward_kvcache", (t(b, seqlen_q, h, head_dim), params, cache), dict(alibi_slopes=alibi)


# Head dims beyond FlashAttention-2 and the families whose images hold them (declarations.
# BUCKET_IMAGE_FAMILIES, HEAD_DIM_PAIR_IMAGES; decode_configs.QV_FAMILIES); elsewhere the planner
# refuses them (the JIT runs them), but the pairs, which run on square images.
WIDE_FAMILIES = ("sm80", "sm90")
MLA_FAMILIES = ("sm90",)


def beyond_fa2_calls(dtype, device="meta"):
    """``(name, op, args, kwargs, needs)`` beyond flash-attn 2.8: v's own head dim (192/128, and
    64/160 on a square image), attention sinks (with and without the score features; and at head
    dims 64 and 128, on the images of flash-attn 2.8's calls), head dim 512, MLA decoding with ``qv``. ``needs``: the families whose images hold the call (``None``:
    every family)."""
    t = lambda *shape, dt=dtype: torch.empty(shape, dtype=dt, device=device)  # noqa: E731
    seed = torch.empty(1, dtype=torch.int64, device=device)
    h, hk = 8, 2
    sinks = t(h, dt=torch.float32)
    for (d, dv, needs), (mask, window), with_sinks, feat in itertools.product(
            ((192, 128, None), (64, 160, None), (512, 512, WIDE_FAMILIES), (64, 64, None), (128, 128, None)),
            MASKS.items(), (False, True), ("none", "softcap")):
        if d == dv <= 128 and not with_sinks:
            continue  # flash-attn 2.8's calls: attention_calls
        if d == 512 and feat != "none":
            continue  # head dim 512's images are lean
        params = _params(window, 20.0 if feat == "softcap" else 0.0, seed=seed)
        q, k, v = t(2, 300, h, d), t(2, 257, hk, d), t(2, 257, hk, dv)
        name = f"d{d}v{dv}-{mask}-{feat}" + ("-sinks" if with_sinks else "")
        extra = dict(sinks=sinks) if with_sinks else {}
        yield name, "forward", (q, k, v, params), extra, needs
        yield name, "backward", (t(2, 300, h, dv), q, k, v, t(2, 300, h, dv), t(2, h, 300, dt=torch.float32),
                                 params), {}, needs
    b, s_cache = 2, 128
    for name, d, dv, qv, needs in (("mla", 64, 512, True, MLA_FAMILIES), ("d192v128", 192, 128, False, None)):
        k_cache, v_cache = t(b, s_cache, 1, d), t(b, s_cache, 1, dv)
        cos, sin = t(s_cache, d // 2, dt=torch.float32), t(s_cache, d // 2, dt=torch.float32)
        cache = KVCacheInputs(k_cache, v_cache, t(b, dt=torch.int32), t(b, 1, 1, d), t(b, 1, 1, dv), None, None, None,
                              cos, sin, False, 0)
        extra = dict(sinks=sinks, **(dict(qv=t(b, 1, h, dv)) if qv else {}))
        yield f"kvcache-{name}", "forward_kvcache", (t(b, 1, h, d), _params((-1, 0)), cache), extra, needs
