r"""Evaluation with memory: every target token of a split scored exactly once.

The split is cut into B contiguous rows read segment by segment with the memory
carried (Transformer-XL's evaluation); padding carries zero weight. Word-level corpora
report perplexity, character/byte-level ones bits per character. `read_stream` is the
one loop that reads segments with the memory carried, for any jitted step.
"""
from collections.abc import Callable, Iterable
import functools
import itertools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax import data as data_lib
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config
from allatt_jax.parallel import sharding

SPLITS = ("valid", "test")


def metric_value(mean_nll: float, metric: str) -> float:
  return math.exp(mean_nll) if metric == "ppl" else mean_nll / math.log(2)


def eval_step(variables, memory, inputs_BxT, targets_BxT, weights_BxT, *,
              lm: model_lib.TransformerLM):
  """((weighted NLL sum, token count), per-token NLL) of one eval batch, and the next
  memory: the one jitted step that scores a stream, for a split's mean or a text's
  tokens."""
  nll_BxT, memory, _ = lm.apply(variables, inputs_BxT, targets_BxT, memory)
  return ((jnp.sum(nll_BxT * weights_BxT), jnp.sum(weights_BxT)), nll_BxT), memory


def read_stream(step: Callable[[Any, Any], tuple[Any, Any]], segments: Iterable,
                memory) -> tuple[list, Any]:
  """Reads `segments` in order, each attending to the memory the one before it left.

  Args:
    step: `step(memory, segment)` -> (its output, the next memory).
    segments: what `step` reads (inputs, or a tuple with their targets), in order.
    memory: the memory before the first segment (`model.init_memory`'s, or what an
      earlier read returned).

  Returns:
    (the outputs of the segments in order, the memory after the last one).
  """
  outputs = []
  for segment in segments:
    output, memory = step(memory, segment)
    outputs.append(output)
  return outputs, memory


def row_segments(ids_BxN: np.ndarray, seq_len: int) -> list[np.ndarray]:
  """(B, <= seq_len) consecutive slices of the rows: the segments of a long input, of
  the lengths the relative positions were trained for."""
  return [ids_BxN[:, start:start + seq_len] for start in range(0, ids_BxN.shape[1], seq_len)]


class Evaluator:
  """Scores token arrays with one jitted step, compiled once per model."""

  def __init__(self, lm: model_lib.TransformerLM, mesh, *, batch_size: int, seq_len: int,
               mem_len: int):
    self.lm, self.mesh = lm, mesh
    self.batch_size, self.seq_len, self.mem_len = batch_size, seq_len, mem_len
    self._batch = sharding.batch_sharding(mesh)
    self._memory = sharding.memory_sharding(mesh)
    self._rows = sharding.process_rows(mesh)
    self._replicated = sharding.replicated(mesh)
    self._jitted = jax.jit(
        functools.partial(eval_step, lm=lm),
        in_shardings=(None, self._memory, self._batch, self._batch, self._batch),
        out_shardings=((self._replicated, self._batch), self._memory),
        donate_argnums=(1,))
    self._step = sharding.on_mesh(mesh, self._jitted)
    # Made on the devices, in their shards, rather than copied there from the host.
    self._empty_memory = sharding.on_mesh(mesh, jax.jit(
        functools.partial(model_lib.init_memory, lm.cfg, batch_size, mem_len),
        out_shardings=self._memory))

  @classmethod
  def from_config(cls, lm: model_lib.TransformerLM, mesh,
                  config: run_config.RunConfig) -> "Evaluator":
    """The evaluator of `lm` at the run config's eval batch and lengths."""
    e = config.eval
    return cls(lm, mesh, batch_size=e.batch_size, seq_len=e.seq_len, mem_len=e.mem_len)

  def compiled_step(self, variables) -> jax.stages.Compiled:
    """The step compiled for `variables` (placed as `score` places them): its
    optimized HLO and XLA's cost and memory analyses."""
    tokens = jax.ShapeDtypeStruct((self.batch_size, self.seq_len), jnp.int32,
                                  sharding=self._batch)
    weights = jax.ShapeDtypeStruct(tokens.shape, jnp.float32, sharding=self._batch)
    with sharding.activate(self.mesh):
      return self._jitted.lower(variables, self._empty_memory(), tokens, tokens,
                                weights).compile()

  def _placed(self, variables):
    """`variables` on this mesh: arrays not already there (host arrays, or a loaded
    model's on one device) go to its devices once, not with every batch's step."""
    mesh_devices = set(self.mesh.devices.flat)
    return jax.tree.map(
        lambda x: x if isinstance(x, jax.Array) and x.sharding.device_set == mesh_devices
        else jax.device_put(np.asarray(x), self._replicated), variables)

  def score(self, variables, tokens: np.ndarray, max_batches: int = 0) -> dict:
    """Mean NLL, token count and throughput over `tokens` (or its first batches)."""
    variables = self._placed(variables)
    memory = self._empty_memory()
    shape = (self.batch_size, self.seq_len)

    # The sums ride along with the memory, so each batch's are added as soon as its
    # step is dispatched: the same order of device programs in every process.
    def step(memory_and_sums, arrays):
      memory, (nll_sum, num_tokens) = memory_and_sums
      inputs, targets, weights = (data_lib.to_global_array(a, self._batch, shape)
                                  for a in arrays)
      ((batch_nll, batch_tokens), _), memory = self._step(variables, memory, inputs,
                                                          targets, weights)
      return None, (memory, (nll_sum + batch_nll, num_tokens + batch_tokens))

    start = time.perf_counter()
    batches = data_lib.eval_batches(tokens, self.batch_size, self.seq_len, *self._rows)
    _, (_, (nll_sum, num_tokens)) = read_stream(
        step, itertools.islice(batches, max_batches or None),
        (memory, (jnp.zeros(()), jnp.zeros(()))))
    num_tokens = float(num_tokens)
    seconds = time.perf_counter() - start
    return {"nll": float(nll_sum) / max(num_tokens, 1.0), "tokens": int(num_tokens),
            "tokens_per_s": num_tokens / seconds if seconds else 0.0}

  def token_nll(self, variables, tokens: np.ndarray) -> np.ndarray:
    """-ln p(tokens[i] | tokens[:i]) for i = 1 .. N-1, in nats, read as `score` reads
    `tokens` (so their mean is its NLL). One process: its rows are all the rows."""
    variables = self._placed(variables)
    shape = (self.batch_size, self.seq_len)
    batches = list(data_lib.eval_batches(tokens, self.batch_size, self.seq_len))

    def step(memory, arrays):
      inputs, targets, weights = (data_lib.to_global_array(a, self._batch, shape)
                                  for a in arrays)
      (_, nll_BxT), memory = self._step(variables, memory, inputs, targets, weights)
      return nll_BxT, memory

    nll_segments, _ = read_stream(step, batches, self._empty_memory())
    # One transfer at the end keeps the device busy instead of syncing per segment;
    # rows are contiguous stretches of `tokens`, so row-major order is text order.
    nll = np.asarray(jnp.concatenate(nll_segments, axis=1)).ravel()
    weights = np.concatenate([batch_weights for *_, batch_weights in batches], axis=1)
    return nll[weights.ravel() > 0].astype(np.float64)


def evaluate_splits(evaluator: Evaluator, variables, corpus: data_lib.Corpus,
                    splits=("valid", "test"), max_batches: int = 0) -> dict[str, float]:
  """{split: metric value} plus '{split}_nll' entries."""
  results = {}
  for split in splits:
    scored = evaluator.score(variables, corpus.splits[split], max_batches)
    results[split] = metric_value(scored["nll"], corpus.metric)
    results[f"{split}_nll"] = scored["nll"]
  return results


def results_line(name: str, results: dict, metric: str) -> str:
  """'NAME: valid bpc 2.3406  test bpc 2.3146' of `evaluate_splits`'s results."""
  return f"{name}: valid {metric} {results['valid']:.4f}  test {metric} {results['test']:.4f}"
