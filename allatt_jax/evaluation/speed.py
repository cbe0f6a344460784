"""Inference speeds of trained models, timed in turns on the same tokens."""
from collections.abc import Callable, Mapping

import jax

from allatt_jax.config.run_config import RunConfig
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs.trained_model import LoadedModel


def tokens_per_s(config: RunConfig, mesh: jax.sharding.Mesh, tokens, num_batches: int,
                 models: Mapping[str, LoadedModel], repeats: int = 3,
                 safe_point: Callable[[], None] = lambda: None) -> dict:
  """'{name}_tokens_per_s' of each of `models`: its evaluation with memory of
  `num_batches` batches of `tokens` (at `config`'s eval batch and lengths, on `mesh`).

  The models are timed in turns, `repeats` times each, and each keeps its best: on a
  shared machine the best of alternating runs is the least disturbed comparison.
  `safe_point` is called before each compile and each timed run, the last included:
  it may stop the command there (by raising), as a signal asks.
  """
  evaluators = {}
  for name, model in models.items():
    safe_point()
    evaluator = stream_eval.Evaluator.from_config(model.lm, mesh, config)
    evaluator.score(model.variables, tokens, max_batches=1)   # compile, untimed
    evaluators[name] = evaluator, model.variables
  speeds = {f"{name}_tokens_per_s": 0.0 for name in evaluators}
  for _ in range(repeats):
    for name, (evaluator, variables) in evaluators.items():
      safe_point()
      scored = evaluator.score(variables, tokens, max_batches=num_batches)
      speeds[f"{name}_tokens_per_s"] = max(speeds[f"{name}_tokens_per_s"],
                                           scored["tokens_per_s"])
  return speeds
