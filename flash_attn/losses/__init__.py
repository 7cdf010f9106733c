"""Losses with upstream flash-attn's API (``flash_attn.losses.cross_entropy.CrossEntropyLoss``)."""
