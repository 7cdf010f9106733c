"""Placeholder for upstream's ``flash_attn.ops.fused_dense``: importing it raises ImportError.

Upstream's module wraps ``fused_dense_lib``, a separately built CUDA extension (conda-forge ships
it as ``flash-attn-fused-dense``); this package does not build it. ``except ImportError`` around
the import (what upstream's own modules do) keeps working.
"""

raise ImportError(
    "flash_attn.ops.fused_dense is not provided by this flash-attn package: upstream builds it "
    "as a separate CUDA extension (fused_dense_lib; conda-forge: flash-attn-fused-dense), which "
    "is not shipped here. Use torch.nn.Linear instead of FusedDense (the same computation), "
    "flash_attn.modules.mlp.Mlp / GatedMlp instead of FusedMLP, and "
    "flash_attn.modules.tensor_parallel.ColumnParallelLinear / RowParallelLinear "
    "(plain PyTorch over torch.distributed) for tensor parallelism."
)
