"""allatt_jax: All-attention Transformer LMs with layer-wise L0 head pruning."""
