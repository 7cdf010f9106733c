"""Placeholder for upstream's ``flash_attn.ops.rms_norm``: importing it raises ImportError.

Upstream's module is built on ``flash_attn.ops.layer_norm`` and its CUDA extension
``dropout_layer_norm``, which this package does not build; ``flash_attn.ops.triton.layer_norm``
is the replacement.
"""

raise ImportError(
    "flash_attn.ops.rms_norm is not provided by this flash-attn package: upstream builds it on "
    "the separate CUDA extension dropout_layer_norm (conda-forge: flash-attn-layer-norm), which "
    "is not shipped here. Use flash_attn.ops.triton.layer_norm instead: rms_norm_fn and the "
    "RMSNorm module (dropout, residual add, prenorm, residual_in_fp32)."
)
