"""Upstream flash-attn's building blocks: ``mha`` (MHA, FlashSelfAttention, ...), ``mlp``,
``block``, ``embedding``; ``tensor_parallel`` holds the plain-PyTorch ColumnParallelLinear /
RowParallelLinear that the parallel modules use (upstream keeps them in its fused_dense
extension)."""
