"""Placeholder for upstream's ``flash_attn.ops.layer_norm``: importing it raises ImportError.

Upstream's module wraps ``dropout_layer_norm``, a separately built CUDA extension (conda-forge:
``flash-attn-layer-norm``); this package does not build it. The Triton implementation upstream
recommends instead, ``flash_attn.ops.triton.layer_norm``, is provided.
"""

raise ImportError(
    "flash_attn.ops.layer_norm is not provided by this flash-attn package: upstream builds it as "
    "a separate CUDA extension (dropout_layer_norm; conda-forge: flash-attn-layer-norm), which is "
    "not shipped here. Use flash_attn.ops.triton.layer_norm instead: layer_norm_fn (dropout, "
    "residual add, prenorm, rowscale, parallel x1/weight1) and the LayerNorm / RMSNorm modules."
)
