r"""Evaluation with memory: every target token of a split scored exactly once.

The split is cut into B contiguous rows read segment by segment with the memory
carried along each row (Transformer-XL's evaluation); padded positions of the last
segment carry zero weight. Word-level corpora report perplexity, character/byte
level ones bits per character.

As a command, evaluates a trained model (a run's workdir, any checkpoint step, or an
export) on a split of its dataset, or on a text file (read as one row, as
`python -m allatt_jax.score` reads it, which needs no dataset), and prints a JSON
summary:

  python -m allatt_jax.evaluate --checkpoint=DIR [--step=N] [--split=valid|test]
  python -m allatt_jax.evaluate --checkpoint=DIR --text_file=FILE
"""
import functools
import json
import math
import pathlib
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from allatt_jax import cli
from allatt_jax import data as data_lib
from allatt_jax import errors
from allatt_jax import loader
from allatt_jax import model as model_lib
from allatt_jax import sharding

SPLITS = ("valid", "test")


def metric_value(mean_nll: float, metric: str) -> float:
  return math.exp(mean_nll) if metric == "ppl" else mean_nll / math.log(2)


def eval_step(variables, memory, inputs_BxT, targets_BxT, weights_BxT, *,
              lm: model_lib.TransformerLM):
  """Weighted NLL sum and token count of one eval batch, and the next memory."""
  nll_BxT, memory, _ = lm.apply(variables, inputs_BxT, targets_BxT, memory)
  return (jnp.sum(nll_BxT * weights_BxT), jnp.sum(weights_BxT)), memory


class Evaluator:
  """Scores token arrays with one jitted step, compiled once per model."""

  def __init__(self, lm: model_lib.TransformerLM, mesh, *, batch_size: int, seq_len: int,
               mem_len: int):
    self.lm, self.mesh = lm, mesh
    self.batch_size, self.seq_len, self.mem_len = batch_size, seq_len, mem_len
    batch = sharding.batch_sharding(mesh)
    self._step = jax.jit(
        functools.partial(eval_step, lm=lm),
        in_shardings=(None, sharding.memory_sharding(mesh), batch, batch, batch),
        out_shardings=(sharding.replicated(mesh), sharding.memory_sharding(mesh)),
        donate_argnums=(1,))

  @classmethod
  def from_config(cls, lm: model_lib.TransformerLM, mesh,
                  config: ml_collections.ConfigDict) -> "Evaluator":
    """The evaluator of `lm` at the run config's eval batch and lengths."""
    e = config.eval
    return cls(lm, mesh, batch_size=e.batch_size, seq_len=e.seq_len, mem_len=e.mem_len)

  def score(self, variables, tokens: np.ndarray, max_batches: int = 0) -> dict:
    """Mean NLL, token count and throughput over `tokens` (or its first batches)."""
    process, count = sharding.process_rows(self.mesh)
    batch_sharding = sharding.batch_sharding(self.mesh)
    memory = jax.device_put(model_lib.init_memory(self.lm.cfg, self.batch_size, self.mem_len),
                            sharding.memory_sharding(self.mesh))
    nll_sum, num_tokens = jnp.zeros(()), jnp.zeros(())
    start = time.perf_counter()
    batches = data_lib.eval_batches(tokens, self.batch_size, self.seq_len, process, count)
    shape = (self.batch_size, self.seq_len)
    for i, arrays in enumerate(batches):
      if max_batches and i >= max_batches:
        break
      inputs, targets, weights = (data_lib.to_global_array(a, batch_sharding, shape)
                                  for a in arrays)
      with sharding.activate(self.mesh):
        (batch_nll, batch_tokens), memory = self._step(variables, memory, inputs, targets,
                                                       weights)
      nll_sum, num_tokens = nll_sum + batch_nll, num_tokens + batch_tokens
    num_tokens = float(num_tokens)
    seconds = time.perf_counter() - start
    return {"nll": float(nll_sum) / max(num_tokens, 1.0), "tokens": int(num_tokens),
            "tokens_per_s": num_tokens / seconds if seconds else 0.0}


def evaluate_splits(evaluator: Evaluator, variables, corpus: data_lib.Corpus,
                    splits=("valid", "test"), max_batches: int = 0) -> dict[str, float]:
  """{split: metric value} plus '{split}_nll' entries."""
  results = {}
  for split in splits:
    scored = evaluator.score(variables, corpus.splits[split], max_batches)
    results[split] = metric_value(scored["nll"], corpus.metric)
    results[f"{split}_nll"] = scored["nll"]
  return results


def evaluate_model(model: loader.LoadedModel, *, split: str | None = None,
                   text: str | None = None) -> dict:
  """{'tokens', metric, 'nll'} of a loaded model on a split of its dataset (at the
  run's eval batch and lengths) or on `text` (one row, as `score` reads it).

  Raises:
    DataError: the dataset cannot be loaded, or the text has fewer than 2 tokens.
  """
  e = model.config.eval
  if text is not None:
    tokens, _ = model.tokenizer.encode(text)
    if len(tokens) < 2:
      raise errors.DataError(f"The text has {len(tokens)} token(s) in the vocabulary; "
                             "evaluation needs at least 2 (the first is context only).")
    batch_size = 1
  else:
    tokens = data_lib.load_run_corpus(model.config).splits[split]
    batch_size = e.batch_size
  # One device: a model trained on a mesh evaluates anywhere, at any batch size.
  mesh = jax.make_mesh((1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  evaluator = Evaluator(model.lm, mesh, batch_size=batch_size, seq_len=e.seq_len,
                        mem_len=e.mem_len)
  scored = evaluator.score(model.variables, tokens)
  metric = model.tokenizer.metric
  return {"tokens": scored["tokens"], metric: metric_value(scored["nll"], metric),
          "nll": scored["nll"]}


def main(argv):
  del argv   # cli.run refuses extra arguments
  text = None
  if _TEXT_FILE.value:
    try:
      text = pathlib.Path(_TEXT_FILE.value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
      raise errors.DataError(f"Cannot read the text file {_TEXT_FILE.value}: {e}") from e
  model = loader.load(_CHECKPOINT.value, _STEP.value)
  summary = evaluate_model(model, split=None if text is not None else _SPLIT.value,
                           text=text)
  source = {"file": _TEXT_FILE.value} if text is not None else {"split": _SPLIT.value}
  json.dump({"checkpoint": _CHECKPOINT.value, "step": _STEP.value, **source, **summary},
            sys.stdout, indent=2)
  print()


if __name__ == "__main__":
  _CHECKPOINT = flags.DEFINE_string(
      "checkpoint", None, "The model: a run's --workdir (its latest checkpoint unless "
      "--step; gated models use their deterministic gates) or an exported model folder.",
      required=True)
  _STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a run's workdir "
                               "(default: the latest finished one).", lower_bound=0)
  _SPLIT = flags.DEFINE_enum("split", "test", SPLITS, "Split of the run's dataset "
                             "(needs the dataset).")
  _TEXT_FILE = flags.DEFINE_string("text_file", None, "Evaluate this UTF-8 text file "
                                   "instead of a split (needs no dataset).")
  cli.run(main)
