"""Relative multi-head attention with persistent slots, and its cores (XLA, fused Pallas
kernels) and the choice between them."""
