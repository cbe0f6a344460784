"""Training and pruning runs: a config resolved and checked, the train step, optimizer,
distillation, the loop, its progress and preemption, and the demo pipeline."""
