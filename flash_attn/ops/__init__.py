"""Upstream's ``flash_attn.ops`` package: fused operations used by its modules and by models.

Here: :mod:`flash_attn.ops.activations` and the Triton ops under :mod:`flash_attn.ops.triton`
(``layer_norm``, ``cross_entropy``, ``rotary``). Each runs its Triton kernels on CUDA tensors and an
exact PyTorch implementation on every other device. Upstream's separately built CUDA extensions
(``ops.fused_dense``, ``ops.layer_norm``, ``ops.rms_norm``) are not part of this package.
"""
