"""A run's folder: its files, checkpoints, the checks of a workdir before a run writes
there, and the trained model opened from it."""
