"""Upstream's ``flash_attn.models``: whole models built from ``flash_attn.modules``, with
upstream's names, signatures and checkpoint layouts (they need Hugging Face ``transformers``).

``gpt`` (``GPTModel``, ``GPTLMHeadModel``: one model configured by a ``GPT2Config`` for GPT-2,
Llama, GPT-J/NeoX, Falcon, OPT, ...), ``llama``, ``opt``, ``falcon``, ``gptj``, ``gpt_neox``,
``bigcode``, ``baichuan`` and ``btlm`` (configs and state dicts converted from Hugging Face or
Meta checkpoints to ``gpt``'s), ``bert`` and ``vit``. The fused options run on this package's
replacements of upstream's separately built CUDA extensions: ``fused_mlp`` / ``fused_bias_fc`` on
``flash_attn.ops.fused_dense``, ``fused_dropout_add_ln`` on ``flash_attn.ops.triton.layer_norm``.
"""
