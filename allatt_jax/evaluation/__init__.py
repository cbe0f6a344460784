"""A trained model's scores: evaluation with memory, per-token log-likelihoods,
generated text, inference speeds."""
