"""Multi-head attention modules with upstream flash-attn's names, signatures and return values.

``MHA`` projects, optionally rotates (rotary), attends and projects back; self-attention (packed
QKV), cross-attention and grouped-query attention (``num_heads_kv``), and step-by-step decoding
through a kv cache held in ``InferenceParams``. The inner attention is ``FlashSelfAttention`` /
``FlashCrossAttention`` (this package's kernels; varlen through ``cu_seqlens``) with
``use_flash_attn=True``, or ``SelfAttention`` / ``CrossAttention`` (plain PyTorch, with
``key_padding_mask``) otherwise. ``ParallelMHA`` shards heads over a ``torch.distributed`` group.
"""

import math

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch import Tensor

from flash_attn import validation
from flash_attn.flash_attn_interface import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flash_attn.layers.rotary import RotaryEmbedding
from flash_attn.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from flash_attn.utils.distributed import get_dim_for_local_rank, get_start_for_local_rank


def get_alibi_slopes(nheads):
    """ALiBi's per-head slopes (Press et al.): a geometric sequence starting at
    ``2 ** (-8 / n)`` for ``n`` a power of two; otherwise the slopes of the power of two below,
    followed by every other slope of the power of two above."""

    def geometric(n):
        first = 2.0 ** (-8.0 / n)
        return [first ** (i + 1) for i in range(n)]

    nheads = validation.check_int(nheads, "nheads", minimum=1)
    lower = 2 ** math.floor(math.log2(nheads))
    if lower == nheads:
        return geometric(nheads)
    return geometric(lower) + geometric(2 * lower)[0::2][: nheads - lower]


def _check_options(causal=False, softmax_scale=None, dropout=0.0, dropout_name="attention_dropout",
                   window_size=(-1, -1), alibi_slopes=None, **flags):
    """The modules' scalar options, named as their constructors name them."""
    validation.check_flag(causal, "causal")
    validation.check_softmax_scale(softmax_scale)
    p = validation._real(dropout, dropout_name, "a float in [0, 1)")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{dropout_name} must be in [0, 1), got {dropout!r}")
    validation.check_window(window_size)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor):
            raise TypeError(f"alibi_slopes must be a tensor of shape (nheads,), got {type(alibi_slopes).__name__}")
        if alibi_slopes.dim() != 1:
            raise ValueError(f"alibi_slopes must have shape (nheads,), got {tuple(alibi_slopes.shape)}")
    for name, flag in flags.items():
        validation.check_flag(flag, name)


def _check_tensor(t, name: str, layout: str, ndim: int, device=None):
    """A floating-point tensor of ``ndim`` dims (``layout``), on ``device`` when given."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor of shape {layout}, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the queries are on {device}")


def _check_key_padding_mask(mask, batch: int, seqlen: int, device):
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"key_padding_mask must be a bool tensor of shape (batch, seqlen), got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = keep), got {mask.dtype}")
    if tuple(mask.shape) != (batch, seqlen):
        raise ValueError(f"key_padding_mask must have shape (batch, seqlen) = {(batch, seqlen)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask is on {mask.device} but the queries are on {device}")


def _check_varlen(cu_seqlens, max_seqlen, names=("cu_seqlens", "max_seqlen")):
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{names[0]} must be an int32 tensor of shape (batch + 1,), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{names[0]} must be torch.int32, got {cu_seqlens.dtype}")
    if not isinstance(max_seqlen, int):
        raise ValueError(f"{names[1]} must be an int when {names[0]} is given, got {max_seqlen!r}")


class FlashSelfAttention(nn.Module):
    """Softmax attention of packed ``qkv`` through this package's FlashAttention.

    softmax_scale: default ``1 / sqrt(headdim)``. attention_dropout: applied in training only.
    window_size, alibi_slopes, deterministic: as in ``flash_attn_qkvpacked_func``.
    """

    def __init__(
        self,
        causal=False,
        softmax_scale=None,
        attention_dropout=0.0,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
    ):
        super().__init__()
        _check_options(causal, softmax_scale, attention_dropout, window_size=window_size, alibi_slopes=alibi_slopes,
                       deterministic=deterministic)
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.window_size = window_size
        self.deterministic = deterministic

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        """qkv: ``(B, S, 3, H, D)``, or ``(total, 3, H, D)`` with ``cu_seqlens`` ``(B + 1,)``
        int32 and ``max_seqlen`` (int). causal: overrides ``self.causal``.
        Returns ``(B, S, H, D)`` or ``(total, H, D)``."""
        causal = self.causal if causal is None else causal
        common = dict(
            softmax_scale=self.softmax_scale,
            causal=causal,
            alibi_slopes=_float32(self.alibi_slopes),
            window_size=self.window_size,
            deterministic=self.deterministic,
        )
        dropout_p = self.drop.p if self.training else 0.0
        if cu_seqlens is not None:
            _check_varlen(cu_seqlens, max_seqlen)
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, **common)
        _no_max_seqlen(max_seqlen)
        return flash_attn_qkvpacked_func(qkv, dropout_p, **common)


class FlashCrossAttention(nn.Module):
    """Softmax attention of ``q`` over packed ``kv`` through this package's FlashAttention
    (fewer kv heads than query heads: grouped-query attention)."""

    def __init__(
        self,
        causal=False,
        softmax_scale=None,
        attention_dropout=0.0,
        alibi_slopes=None,
        window_size=(-1, -1),
        deterministic=False,
    ):
        super().__init__()
        _check_options(causal, softmax_scale, attention_dropout, window_size=window_size, alibi_slopes=alibi_slopes,
                       deterministic=deterministic)
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.window_size = window_size
        self.deterministic = deterministic

    def forward(
        self,
        q,
        kv,
        causal=None,
        cu_seqlens=None,
        max_seqlen=None,
        cu_seqlens_k=None,
        max_seqlen_k=None,
    ):
        """q: ``(B, Sq, H, D)``; kv: ``(B, Sk, 2, H_k, D)``. Varlen: q ``(total_q, H, D)``, kv
        ``(total_k, 2, H_k, D)`` with ``cu_seqlens``/``max_seqlen`` for q and
        ``cu_seqlens_k``/``max_seqlen_k`` for kv. Causal masks are aligned to the bottom right."""
        causal = self.causal if causal is None else causal
        common = dict(
            softmax_scale=self.softmax_scale,
            causal=causal,
            alibi_slopes=_float32(self.alibi_slopes),
            window_size=self.window_size,
            deterministic=self.deterministic,
        )
        dropout_p = self.drop.p if self.training else 0.0
        if cu_seqlens is not None:
            _check_varlen(cu_seqlens, max_seqlen)
            if cu_seqlens_k is None:
                raise ValueError("cu_seqlens_k is required when cu_seqlens is given")
            _check_varlen(cu_seqlens_k, max_seqlen_k, ("cu_seqlens_k", "max_seqlen_k"))
            return flash_attn_varlen_kvpacked_func(
                q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, dropout_p, **common
            )
        _no_max_seqlen(max_seqlen)
        _check_tensor(q, "q", "(batch, seqlen_q, nheads, headdim)", 4)
        _check_tensor(kv, "kv", "(batch, seqlen_k, 2, nheads_k, headdim)", 5, q.device)
        if kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"kv {tuple(kv.shape)} must have q's batch size and head dim (q {tuple(q.shape)})"
            )
        return flash_attn_kvpacked_func(q, kv, dropout_p, **common)


def _no_max_seqlen(max_seqlen):
    if max_seqlen is not None:
        raise ValueError("max_seqlen is for varlen calls: pass it together with cu_seqlens (or not at all)")


def _float32(slopes):
    return None if slopes is None else slopes.to(torch.float32)


def _masked_softmax_attention(q, k, v, softmax_scale, drop, key_padding_mask, causal,
                              align_to_key_lengths):
    """Plain attention: q ``(B, Sq, H, D)``, k/v ``(B, Sk, H, D)``; masked scores get the
    dtype's most negative value rather than -inf so that a fully masked row stays finite
    (uniform), as upstream's additive -10000 does. Causal: query i sees keys up to
    ``i + Sk - Sq``, or with ``align_to_key_lengths`` up to ``i + (unpadded key length) - Sq``."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    masked_value = torch.finfo(scores.dtype).min
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], masked_value)
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)
        if key_padding_mask is None or not align_to_key_lengths:
            future = cols > rows + (seqlen_k - seqlen_q)
        else:
            lengths = key_padding_mask.sum(-1).view(-1, 1, 1, 1)
            future = cols > rows + lengths - seqlen_q
        scores = scores.masked_fill(future, masked_value)
    attention = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.einsum("bhts,bshd->bthd", drop(attention), v)


class SelfAttention(nn.Module):
    """Softmax attention of packed ``qkv`` ``(B, S, 3, H, D)`` in plain PyTorch (for
    ``use_flash_attn=False``); ``key_padding_mask`` ``(B, S)`` bool, True = keep."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        _check_options(causal, softmax_scale, attention_dropout)
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None):
        causal = self.causal if causal is None else validation.check_flag(causal, "causal")
        _check_tensor(qkv, "qkv", "(batch, seqlen, 3, nheads, headdim)", 5)
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        _check_key_padding_mask(key_padding_mask, qkv.shape[0], qkv.shape[1], qkv.device)
        q, k, v = qkv.unbind(dim=2)
        return _masked_softmax_attention(
            q, k, v, self.softmax_scale, self.drop, key_padding_mask, causal, False
        )


class CrossAttention(nn.Module):
    """Softmax attention of ``q`` ``(B, Sq, H, D)`` over packed ``kv`` ``(B, Sk, 2, H_k, D)`` in
    plain PyTorch; ``key_padding_mask`` ``(B, Sk)`` bool, True = keep. Causal masks are aligned
    to the bottom right (of the unpadded keys)."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        _check_options(causal, softmax_scale, attention_dropout)
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        causal = self.causal if causal is None else validation.check_flag(causal, "causal")
        _check_tensor(q, "q", "(batch, seqlen_q, nheads, headdim)", 4)
        _check_tensor(kv, "kv", "(batch, seqlen_k, 2, nheads_k, headdim)", 5, q.device)
        if kv.shape[2] != 2:
            raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
        _check_key_padding_mask(key_padding_mask, kv.shape[0], kv.shape[1], q.device)
        if kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"kv {tuple(kv.shape)} must have q's batch size and head dim (q {tuple(q.shape)})"
            )
        k, v = kv.unbind(dim=2)
        groups = q.shape[2] // k.shape[2]
        if groups != 1:  # grouped-query attention: each kv head serves `groups` query heads
            k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        return _masked_softmax_attention(
            q, k, v, self.softmax_scale, self.drop, key_padding_mask, causal, True
        )


class LinearResidual(nn.Linear):
    """``nn.Linear`` that also returns its input: ``(linear(x), x)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        validation.check_int(in_features, "in_features", minimum=0)
        validation.check_int(out_features, "out_features", minimum=0)
        validation.check_flag(bias, "bias")
        super().__init__(in_features, out_features, bias, device, dtype)

    def forward(self, input: Tensor):
        if isinstance(input, Tensor) and (input.dim() < 1 or input.shape[-1] != self.in_features):
            raise ValueError(f"input must have in_features ({self.in_features}) as its last dimension, got shape "
                             f"{tuple(input.shape)}")
        return super().forward(input), input


def _update_kv_cache(kv, inference_params, layer_idx):
    """Write ``kv`` ``(B, S, 2, H_k, D)`` into layer ``layer_idx``'s cache at
    ``inference_params``' batch and sequence offsets (allocating the cache the first time);
    return the cache of these sequences up to the last written position."""
    cache = inference_params.key_value_memory_dict.get(layer_idx)
    if cache is None:
        cache = kv.new_empty(
            (inference_params.max_batch_size, inference_params.max_seqlen, 2, *kv.shape[-2:])
        )
        inference_params.key_value_memory_dict[layer_idx] = cache
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    seq_start = inference_params.seqlen_offset
    seq_end = seq_start + kv.shape[1]
    if batch_end > cache.shape[0]:
        raise ValueError(
            f"inference_params: batch {batch_start}..{batch_end} exceeds the cache's batch size "
            f"{cache.shape[0]} (max_batch_size)"
        )
    if seq_end > cache.shape[1]:
        raise ValueError(
            f"inference_params: positions {seq_start}..{seq_end} exceed the cache's length "
            f"{cache.shape[1]} (max_seqlen)"
        )
    cache[batch_start:batch_end, seq_start:seq_end] = kv
    return cache[batch_start:batch_end, :seq_end]


def _cache_lengths(inference_params, batch):
    """Where each of the ``batch`` sequences' new tokens go: the first ``batch`` per-sequence
    lengths (the state may be sized for a larger batch: CUDA graphs captured for it are reused for
    a smaller one), else the shared ``seqlen_offset``."""
    if inference_params.lengths_per_sample is None:
        return inference_params.seqlen_offset
    return inference_params.lengths_per_sample[:batch]


class _KVCacheAttention(nn.Module):
    """What ``MHA`` and ``ParallelMHA`` share: the head settings, and the attention step
    (rotary, then attention over the new tokens alone (no ``inference_params``) or through the
    kv cache)."""

    def _init_heads(self, embed_dim, num_heads, num_heads_kv, causal, layer_idx, rotary_emb_dim,
                    use_flash_attn, checkpointing):
        """Check the head counts (``num_heads_kv`` defaults to ``num_heads``) and keep the
        settings that the attention step reads."""
        embed_dim = validation.check_int(embed_dim, "embed_dim", minimum=1)
        num_heads = validation.check_int(num_heads, "num_heads", minimum=1)
        if num_heads_kv is not None:
            validation.check_int(num_heads_kv, "num_heads_kv", minimum=1)
        if layer_idx is not None:
            validation.check_int(layer_idx, "layer_idx", minimum=0)
        rotary_emb_dim = validation.check_int(rotary_emb_dim, "rotary_emb_dim", minimum=0)
        num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if num_heads <= 0 or num_heads_kv <= 0 or num_heads % num_heads_kv:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by num_heads_kv ({num_heads_kv})"
            )
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if rotary_emb_dim % 2 or rotary_emb_dim > embed_dim // num_heads:
            raise ValueError(f"rotary_emb_dim must be even and at most the head dim ({embed_dim // num_heads}), got "
                             f"{rotary_emb_dim}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.layer_idx = layer_idx
        self.rotary_emb_dim = rotary_emb_dim
        self.use_flash_attn = use_flash_attn
        self.checkpointing = checkpointing

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        return torch.empty(
            batch_size, max_seqlen, 2, self._local_heads_kv, self.head_dim,
            dtype=dtype, device=self.out_proj.weight.device,
        )

    def _update_kv_cache(self, kv, inference_params):
        """kv: ``(B, S, 2, H_k, D)``; see ``_update_kv_cache``."""
        if getattr(self, "dwconv", False):
            raise NotImplementedError("MHA: generation (inference_params) does not support dwconv")
        if self.layer_idx is None:
            raise ValueError("MHA: generation (inference_params) requires layer_idx in the constructor")
        return _update_kv_cache(kv, inference_params, self.layer_idx)

    def _kvcache_call(self, q, kv, inference_params, rotary_cos=None, rotary_sin=None):
        """Append ``kv`` to the cache and attend, in one ``flash_attn_with_kvcache`` call."""
        if self.layer_idx is None:
            raise ValueError("MHA: generation (inference_params) requires layer_idx in the constructor")
        batch = q.shape[0]
        cache = inference_params.key_value_memory_dict[self.layer_idx][:batch]
        cache_seqlens = _cache_lengths(inference_params, batch)
        attn = self.inner_cross_attn
        return flash_attn_with_kvcache(
            q,
            cache[:, :, 0],
            cache[:, :, 1],
            kv[:, :, 0],
            kv[:, :, 1],
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            cache_seqlens=cache_seqlens,
            softmax_scale=attn.softmax_scale,
            causal=attn.causal,
            window_size=getattr(attn, "window_size", (-1, -1)),
            rotary_interleaved=self.rotary_emb.interleaved if self.rotary_emb_dim > 0 else False,
            alibi_slopes=_float32(getattr(attn, "alibi_slopes", None)),
        )

    def _apply_rotary_update_kvcache_attention(self, q, kv, inference_params):
        """Rotate q and the new k, append to the cache and attend: one kernel call (decoding
        steps after the prompt, ``use_flash_attn`` only). q ``(B, Sq, H, D)``, kv ``(B, Sk, 2,
        H_k, D)``."""
        if inference_params is None or inference_params.seqlen_offset == 0:
            raise ValueError("this path needs inference_params with seqlen_offset > 0")
        rotary_cos = rotary_sin = None
        if self.rotary_emb_dim > 0:
            if self.rotary_emb.scale is not None:
                raise NotImplementedError("the fused kv-cache rotary path does not support xPos")
            self.rotary_emb._update_cos_sin_cache(
                inference_params.max_seqlen, device=q.device, dtype=q.dtype
            )
            rotary_cos, rotary_sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        return self._kvcache_call(q, kv, inference_params, rotary_cos, rotary_sin)

    def _update_kvcache_attention(self, q, kv, inference_params):
        """Write kv to inference_params, then attend over everything cached so far."""
        if inference_params.seqlen_offset == 0 or not self.use_flash_attn:
            # Like upstream, this path writes at seqlen_offset (lengths_per_sample is not used).
            kv = self._update_kv_cache(kv, inference_params)
            return self.inner_cross_attn(q, kv)
        return self._kvcache_call(q, kv, inference_params)

    def _attend(self, q, kv, inference_params, kwargs):
        """q ``(..., H, D)`` and kv ``(..., 2, H_k, D)``, or (kv None) q is packed qkv
        ``(..., 3, H, D)``. Returns the context ``(..., H, D)``."""
        packed = kv is None
        seqlen_offset = 0
        if inference_params is not None:
            seqlen_offset = _cache_lengths(inference_params, q.shape[0])
        # After the prompt, rotary + cache append + attention run fused in flash_attn_with_kvcache
        # (upstream's condition: its kernel takes rotary dims that are multiples of 16).
        fused_decode = (
            inference_params is not None
            and inference_params.seqlen_offset > 0
            and self.rotary_emb_dim > 0
            and self.rotary_emb_dim % 16 == 0
            and self.use_flash_attn
        )
        if fused_decode:
            if packed:
                q, kv = q[:, :, 0], q[:, :, 1:]
            return self._apply_rotary_update_kvcache_attention(q, kv, inference_params)
        if self.rotary_emb_dim > 0:
            rotary_max_seqlen = inference_params.max_seqlen if inference_params is not None else None
            if packed:
                q = self.rotary_emb(q, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
            else:
                q, kv = self.rotary_emb(
                    q, kv, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen
                )
        if inference_params is not None:
            if packed:
                q, kv = q[:, :, 0], q[:, :, 1:]
            return self._update_kvcache_attention(q, kv, inference_params)
        inner = self.inner_attn if packed else self.inner_cross_attn
        args = (q,) if packed else (q, kv)
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)


def _check_mha_options(dropout, softmax_scale, rotary_emb_base, rotary_emb_scale_base, window_size, dtype, **flags):
    """What ``MHA`` and ``ParallelMHA`` take besides the head counts (:meth:`_KVCacheAttention._init_heads`)."""
    _check_options(flags.pop("causal"), softmax_scale, dropout, "dropout", window_size, **flags)
    base = validation._real(rotary_emb_base, "rotary_emb_base", "a float > 0")
    if not base > 0:
        raise ValueError(f"rotary_emb_base must be > 0, got {rotary_emb_base!r}")
    if rotary_emb_scale_base is not None and not validation._real(
            rotary_emb_scale_base, "rotary_emb_scale_base", "a float > 0 or None") > 0:
        raise ValueError(f"rotary_emb_scale_base must be > 0 (or None: no XPos), got {rotary_emb_scale_base!r}")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")


def _check_inference_params(inference_params):
    if inference_params is not None and not (hasattr(inference_params, "key_value_memory_dict")
                                             and hasattr(inference_params, "seqlen_offset")):
        raise TypeError(f"inference_params must be a flash_attn.utils.generation.InferenceParams, got "
                        f"{type(inference_params).__name__}")


def _check_input(x, embed_dim: int, layout: str, ndims=(3,)):
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor of shape {layout}, got {validation._describe(x)}")
    if x.dim() not in ndims or x.shape[-1] != embed_dim:
        raise ValueError(f"x must have shape {layout} with embed_dim = {embed_dim}, got {tuple(x.shape)}")


def _inner_attentions(use_flash_attn, alibi_slopes, window_size, causal, softmax_scale, dropout):
    """The inner self- and cross-attention modules of ``MHA`` / ``ParallelMHA``. Built before
    the projections, so that an option the plain PyTorch path lacks fails before any weight is
    made; the callers assign them after the projections (upstream's submodule order)."""
    common = dict(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
    if use_flash_attn:
        flash = dict(alibi_slopes=alibi_slopes, window_size=window_size)
        return FlashSelfAttention(**common, **flash), FlashCrossAttention(**common, **flash)
    if alibi_slopes is not None:
        raise ValueError("use_alibi=True: the ALiBi code path requires use_flash_attn=True")
    if tuple(window_size) != (-1, -1):
        raise ValueError(
            "window_size: local (sliding window) attention requires use_flash_attn=True"
        )
    return SelfAttention(**common), CrossAttention(**common)


def _make_rotary(dim, base, scale_base, interleaved, device):

    return RotaryEmbedding(dim, base=base, scale_base=scale_base, interleaved=interleaved,
                           device=device)


def _split_heads(t, head_dim):
    return t.unflatten(-1, (-1, head_dim))


def _split_kv_heads(t, head_dim):
    return t.unflatten(-1, (2, -1, head_dim))


def _merge_heads(t):
    return t.flatten(-2)


class MHA(_KVCacheAttention):
    """Multi-head self-attention and cross-attention.

    num_heads_kv: fewer key/value heads than query heads (MQA / GQA); default ``num_heads``.
    cross_attn: queries from ``x``, keys and values from ``x_kv``.
    dwconv: a causal depthwise convolution (kernel 3) over the sequence after the projections.
    rotary_emb_*: rotary embedding of the first ``rotary_emb_dim`` dims of each head.
    use_alibi, window_size: ALiBi / sliding window (``use_flash_attn=True`` only).
    fused_bias_fc: accepted for compatibility and ignored, as in upstream's current source (its
        projections are plain ``nn.Linear`` since it stopped using the fused dense extension).
    use_flash_attn: this package's FlashAttention (varlen via ``cu_seqlens``), else plain
        PyTorch attention (``key_padding_mask``).
    return_residual: also return the input ``x``, for post-norm blocks.
    checkpointing: recompute the inner attention in the backward.
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        num_heads_kv=None,
        cross_attn=False,
        qkv_proj_bias=True,
        out_proj_bias=True,
        dropout=0.0,
        softmax_scale=None,
        causal=False,
        layer_idx=None,
        dwconv=False,
        rotary_emb_dim=0,
        rotary_emb_base=10000.0,
        rotary_emb_scale_base=None,
        rotary_emb_interleaved=False,
        use_alibi=False,
        window_size=(-1, -1),
        fused_bias_fc=False,
        use_flash_attn=False,
        return_residual=False,
        checkpointing=False,
        device=None,
        dtype=None,
    ) -> None:
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        _check_mha_options(dropout, softmax_scale, rotary_emb_base, rotary_emb_scale_base, window_size, dtype,
                           causal=causal, cross_attn=cross_attn, qkv_proj_bias=qkv_proj_bias,
                           out_proj_bias=out_proj_bias, dwconv=dwconv, rotary_emb_interleaved=rotary_emb_interleaved,
                           use_alibi=use_alibi, fused_bias_fc=fused_bias_fc, use_flash_attn=use_flash_attn,
                           return_residual=return_residual, checkpointing=checkpointing)
        self._init_heads(embed_dim, num_heads, num_heads_kv, causal, layer_idx, rotary_emb_dim,
                         use_flash_attn, checkpointing)
        if rotary_emb_dim > 0 and cross_attn:
            raise ValueError("MHA with rotary embedding (rotary_emb_dim) does not support cross_attn")
        self.cross_attn = cross_attn
        self.dwconv = dwconv
        self.return_residual = return_residual
        self._local_heads_kv = self.num_heads_kv
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        kv_dim = 2 * self.head_dim * self.num_heads_kv

        alibi_slopes = (
            torch.tensor(get_alibi_slopes(num_heads), device=device) if use_alibi else None
        )
        inner_attn, inner_cross_attn = _inner_attentions(use_flash_attn, alibi_slopes, window_size,
                                                         causal, softmax_scale, dropout)
        if rotary_emb_dim > 0:
            self.rotary_emb = _make_rotary(rotary_emb_dim, rotary_emb_base, rotary_emb_scale_base,
                                           rotary_emb_interleaved, device)
        if not cross_attn:
            self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        if dwconv:
            # padding=2 then dropping the last 2 outputs: position t sees t-2..t (causal).
            def depthwise(channels):
                return nn.Conv1d(channels, channels, kernel_size=3, padding=2, groups=channels,
                                 **factory)

            if self.num_heads_kv == self.num_heads and not cross_attn:
                self.dwconv_qkv = depthwise(qkv_dim)
            else:
                self.dwconv_q = depthwise(embed_dim)
                self.dwconv_kv = depthwise(kv_dim)
        self.inner_attn, self.inner_cross_attn = inner_attn, inner_cross_attn
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    @staticmethod
    def _causal_conv(conv, t):
        return conv(t.transpose(1, 2))[..., :-2].transpose(1, 2).contiguous()

    def _check_forward_args(self, x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, mixer_subset,
                            inference_params):
        _check_inference_params(inference_params)
        if max_seqlen is not None and cu_seqlens is None:
            raise ValueError("max_seqlen is for varlen calls: pass it together with cu_seqlens (or not at all)")
        if cu_seqlens is not None:
            if max_seqlen is None:
                raise ValueError("max_seqlen is required when cu_seqlens is given")
            if key_padding_mask is not None:
                raise ValueError("pass either cu_seqlens or key_padding_mask, not both")
            if not self.use_flash_attn:
                raise ValueError("cu_seqlens (varlen) requires use_flash_attn=True")
            if self.dwconv or self.rotary_emb_dim > 0:
                raise ValueError("cu_seqlens (varlen) does not support dwconv or rotary_emb_dim")
        if key_padding_mask is not None and self.use_flash_attn:
            raise ValueError(
                "key_padding_mask requires use_flash_attn=False; with FlashAttention unpad the "
                "batch (flash_attn.bert_padding.unpad_input) and pass cu_seqlens/max_seqlen"
            )
        if inference_params is not None:
            if key_padding_mask is not None or cu_seqlens is not None or max_seqlen is not None:
                raise ValueError(
                    "inference_params cannot be combined with key_padding_mask or cu_seqlens"
                )
            if self.dwconv:
                raise NotImplementedError("MHA: generation (inference_params) does not support dwconv")
        if not self.cross_attn and (x_kv is not None or mixer_subset is not None):
            raise ValueError("x_kv and mixer_subset are for cross_attn=True only")
        _check_input(x, self.embed_dim, "(batch, seqlen, embed_dim), or (total, embed_dim) with cu_seqlens",
                     (2,) if cu_seqlens is not None else (3,))
        if key_padding_mask is not None:
            source = x_kv if isinstance(x_kv, Tensor) else x
            _check_key_padding_mask(key_padding_mask, source.shape[0], source.shape[1], x.device)

    def forward(
        self,
        x,
        x_kv=None,
        key_padding_mask=None,
        cu_seqlens=None,
        max_seqlen=None,
        mixer_subset=None,
        inference_params=None,
        **kwargs,
    ):
        """x: ``(batch, seqlen, embed_dim)``, or ``(total, embed_dim)`` with ``cu_seqlens``
        ``(batch + 1,)`` int32 and ``max_seqlen`` (varlen, ``use_flash_attn`` only).
        x_kv: keys/values source for cross-attention (default ``x``).
        key_padding_mask: ``(batch, seqlen)`` bool, True = keep (``use_flash_attn=False`` only).
        mixer_subset: cross-attention only; queries from ``x[:, mixer_subset]``.
        inference_params: ``InferenceParams`` for step-by-step decoding with a kv cache.
        Returns ``out`` of ``x``'s shape, or ``(out, x)`` with ``return_residual``."""
        self._check_forward_args(x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, mixer_subset,
                                 inference_params)
        if self.use_flash_attn:
            kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **kwargs}
        else:
            kwargs = {"key_padding_mask": key_padding_mask, **kwargs}
        d = self.head_dim
        if not self.cross_attn and self.num_heads_kv == self.num_heads:
            qkv = self.Wqkv(x)
            if self.dwconv:
                qkv = self._causal_conv(self.dwconv_qkv, qkv)
            qkv = qkv.unflatten(-1, (3, self.num_heads, d))
            context = self._attend(qkv, None, inference_params, kwargs)
        else:
            if self.cross_attn:
                q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
                kv = self.Wkv(x_kv if x_kv is not None else x)
            else:
                qkv = self.Wqkv(x)
                q, kv = qkv[..., : self.num_heads * d], qkv[..., self.num_heads * d:]
            if self.dwconv:
                q = self._causal_conv(self.dwconv_q, q)
                kv = self._causal_conv(self.dwconv_kv, kv)
            q, kv = _split_heads(q, d), _split_kv_heads(kv, d)
            if cu_seqlens is not None and not self.cross_attn:
                # Grouped-query self-attention: keys share the queries' sequence boundaries
                # (upstream requires cu_seqlens_k here; defaulting it is an extension).
                kwargs.setdefault("cu_seqlens_k", cu_seqlens)
                kwargs.setdefault("max_seqlen_k", max_seqlen)
            context = self._attend(q, kv, inference_params, kwargs)
        out = self.out_proj(_merge_heads(context))
        return (out, x) if self.return_residual else out


class ParallelMHA(_KVCacheAttention):
    """``MHA`` with its heads split over ``process_group`` (tensor parallel): ``Wqkv`` is a
    ``ColumnParallelLinear`` whose rows on each rank are that rank's query heads, then its key
    heads, then its value heads; ``out_proj`` is a ``RowParallelLinear`` over those heads.
    With ``sequence_parallel`` each rank's ``x`` is its slice of ``(batch * seqlen, embed_dim)``
    (pass ``seqlen``) and so is its output."""

    def __init__(
        self,
        embed_dim,
        num_heads,
        process_group,
        num_heads_kv=None,
        qkv_proj_bias=True,
        out_proj_bias=True,
        dropout=0.0,
        softmax_scale=None,
        causal=False,
        layer_idx=None,
        rotary_emb_dim=0,
        rotary_emb_base=10000.0,
        rotary_emb_scale_base=None,
        rotary_emb_interleaved=False,
        use_alibi=False,
        window_size=(-1, -1),
        use_flash_attn=False,
        checkpointing=False,
        sequence_parallel=True,
        device=None,
        dtype=None,
    ) -> None:

        factory = {"device": device, "dtype": dtype}
        super().__init__()
        _check_mha_options(dropout, softmax_scale, rotary_emb_base, rotary_emb_scale_base, window_size, dtype,
                           causal=causal, qkv_proj_bias=qkv_proj_bias, out_proj_bias=out_proj_bias,
                           rotary_emb_interleaved=rotary_emb_interleaved, use_alibi=use_alibi,
                           use_flash_attn=use_flash_attn, checkpointing=checkpointing,
                           sequence_parallel=sequence_parallel)
        if not isinstance(process_group, torch.distributed.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {type(process_group).__name__}")
        self._init_heads(embed_dim, num_heads, num_heads_kv, causal, layer_idx, rotary_emb_dim,
                         use_flash_attn, checkpointing)
        self.process_group = process_group
        self.world_size = process_group.size()
        self.local_rank = torch.distributed.get_rank(process_group)
        # Heads are dealt out in whole kv groups so that each rank's query heads use its own
        # kv heads.
        group = self.num_heads // self.num_heads_kv
        self.num_heads_kv_per_rank = get_dim_for_local_rank(
            self.num_heads_kv, self.world_size, self.local_rank
        )
        self.num_heads_per_rank = self.num_heads_kv_per_rank * group
        self._local_heads_kv = self.num_heads_kv_per_rank
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)

        alibi_slopes = None
        if use_alibi:
            start = get_start_for_local_rank(self.num_heads_kv, self.world_size,
                                             self.local_rank) * group
            alibi_slopes = torch.tensor(
                get_alibi_slopes(num_heads)[start: start + self.num_heads_per_rank], device=device
            )
        inner_attn, inner_cross_attn = _inner_attentions(use_flash_attn, alibi_slopes, window_size,
                                                         causal, softmax_scale, dropout)
        if rotary_emb_dim > 0:
            self.rotary_emb = _make_rotary(rotary_emb_dim, rotary_emb_base, rotary_emb_scale_base,
                                           rotary_emb_interleaved, device)
        self.Wqkv = ColumnParallelLinear(
            embed_dim, qkv_dim, process_group, bias=qkv_proj_bias,
            sequence_parallel=sequence_parallel, multiple_of=self.head_dim * (group + 2),
            **factory,
        )
        self.inner_attn, self.inner_cross_attn = inner_attn, inner_cross_attn
        self.out_proj = RowParallelLinear(
            embed_dim, embed_dim, process_group, bias=out_proj_bias,
            sequence_parallel=sequence_parallel, multiple_of=self.head_dim * group, **factory,
        )

    def forward(self, x, seqlen=None, inference_params=None, **kwargs):
        """x: ``(batch, seqlen, embed_dim)``; or, with ``seqlen`` given, ``(batch * seqlen,
        embed_dim)`` (sequence parallel: this rank's slice of it). Returns the same layout."""
        _check_inference_params(inference_params)
        if seqlen is not None:
            seqlen = validation.check_int(seqlen, "seqlen", minimum=1)
            if isinstance(x, Tensor) and x.dim() and x.shape[0] % seqlen:
                raise ValueError(f"seqlen ({seqlen}) must divide x's {x.shape[0]} rows (batch * seqlen)")
        _check_input(x, self.embed_dim, "(batch, seqlen, embed_dim), or (batch * seqlen, embed_dim) with seqlen",
                     (2,) if seqlen is not None else (3,))
        d = self.head_dim
        qkv = self.Wqkv(x)
        if seqlen is not None:
            qkv = qkv.unflatten(0, (-1, seqlen))
        if self.num_heads_kv == self.num_heads:
            context = self._attend(qkv.unflatten(-1, (3, -1, d)), None, inference_params, kwargs)
        else:
            split = self.num_heads_per_rank * d
            q, kv = _split_heads(qkv[..., :split], d), _split_kv_heads(qkv[..., split:], d)
            context = self._attend(q, kv, inference_params, kwargs)
        context = _merge_heads(context)
        if seqlen is not None:
            context = context.flatten(0, 1)
        return self.out_proj(context)
