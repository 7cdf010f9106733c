"""Model building blocks (rotary position embeddings) in the flash-attn 2.8 layout."""
