"""Relative multi-head attention with persistent slots, and its cores (XLA, split) and
the choice between them."""
