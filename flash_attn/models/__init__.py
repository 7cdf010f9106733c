"""Upstream's ``flash_attn.models`` (GPT, Llama, BERT, ... built from ``flash_attn.modules``) is
not provided by this package: each ``flash_attn.models.<name>`` raises ImportError saying so.

Why: upstream's model files depend on its separately built CUDA extensions (fused_dense,
dropout_layer_norm) and on ``transformers`` checkpoint-conversion code that this package does not
test. The building blocks are here: ``flash_attn.modules.mha`` / ``mlp`` / ``block`` /
``embedding`` and ``flash_attn.utils.generation``.
"""

UPSTREAM_MODELS = ("baichuan", "bigcode", "btlm", "falcon", "gpt_neox", "gptj", "opt")


def not_provided(name: str) -> ImportError:
    """The ImportError that ``import flash_attn.models.<name>`` raises."""
    return ImportError(
        f"flash_attn.models.{name} is not provided by this flash-attn package: upstream's model "
        "definitions need its separately built CUDA extensions (fused_dense, dropout_layer_norm), "
        "which are not shipped here. Build the model from flash_attn.modules (MHA, Mlp / GatedMlp, "
        "Block, GPT2Embeddings) with flash_attn.ops.triton.layer_norm for the norms, or use the "
        "model from Hugging Face transformers with attn_implementation=\"flash_attention_2\" "
        "(off CUDA: flash_attn.integrations.transformers.register())."
    )
