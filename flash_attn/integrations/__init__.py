"""Integrations of flash_attn with other libraries.

* :mod:`flash_attn.integrations.transformers`: Hugging Face Transformers. On a CUDA machine
  transformers uses this package by itself for ``attn_implementation="flash_attention_2"``;
  :func:`flash_attn.integrations.transformers.register` adds an implementation that runs on any
  device (CPU included) through transformers' own flash-attention code path.

Each submodule imports its library lazily, so importing this package never needs it.
"""
