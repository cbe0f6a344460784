"""Heuristic head pruners: a head mask from a trained model, by a per-head score.

`prune_mask` turns a trained, ungated model into a boolean mask per layer (True =
keep) with exactly the requested number of heads removed, for `head_removal.remove_heads`.
Scores (higher keeps a head), measured on training batches read with the memory
carried (`stream_eval.read_stream`):

  michel        Michel et al. 2019: I_h = E_batch |∂L/∂ξ_h| for a mask ξ on each
                head's output, L2-normalised per layer; removed iteratively, a
                fraction of all heads at a time, rescored under the current mask.
  entropy       attention entropy per query over every key it sees (context and
                persistent), / log(#keys); score = −entropy.
  sparsity      Hoyer sparsity (√n − 1/‖p‖₂)/(√n − 1): 1 one-hot, 0 uniform.
  distribution  Jensen-Shannon divergence (bits) from the mean distribution of the
                layer's other heads: heads that attend like their neighbours go first.
  magnitude     L2 norm of the head's slices of W_Q, W_K, W_V, W_R and W_O.
  random        uniform scores from a seeded generator.

Entropy, sparsity and distribution are our reading of attention-guided head pruning's
metrics (its abstract names them without formulas); only Michel's scores are
normalised per layer, as in that paper; the others compare across layers as they are.
"""
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax.model.attention import relative
from allatt_jax import data as data_lib
from allatt_jax.model import transformer as model_lib
from allatt_jax.evaluation import stream_eval

METHODS = ("michel", "entropy", "sparsity", "distribution", "magnitude", "random")
ATTENTION_METRICS = ("entropy", "sparsity", "distribution")
# Where the head axis sits in the kernels `magnitude` measures.
_KERNEL_HEAD_AXIS = {"query": 1, "key": 1, "value": 1, "rel": 1, "out": 0}


@dataclasses.dataclass(frozen=True)
class Segments:
  """Consecutive training batches, read with the memory carried as in training."""
  batches: tuple[tuple[np.ndarray, np.ndarray], ...]   # (inputs, targets), each (B, T)
  mem_len: int

  @classmethod
  def from_tokens(cls, tokens: np.ndarray, batch_size: int, seq_len: int, mem_len: int,
                  num_batches: int) -> "Segments":
    stream = data_lib.SegmentStream(tokens, batch_size, seq_len)
    return cls(tuple(next(stream) for _ in range(num_batches)), mem_len)

  def memory(self, cfg: model_lib.ModelConfig):
    return model_lib.init_memory(cfg, self.batches[0][0].shape[0], self.mem_len)


def full_mask(cfg: model_lib.ModelConfig) -> tuple[np.ndarray, ...]:
  return tuple(np.ones(h, bool) for h in cfg.layer_heads)


def _head_mask_interceptor(xi):
  """Multiplies each head's output by ξ[layer][head] on its way into W_O."""
  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if (context.method_name == "__call__" and isinstance(module, relative.Projection)
        and module.name == "out"):
      layer = int(module.path[0].removeprefix("layer_"))
      x_BxTxHxDh = args[0]
      args = (x_BxTxHxDh * xi[layer][:, None].astype(x_BxTxHxDh.dtype), *args[1:])
    return next_fun(*args, **kwargs)
  return interceptor


def masked_loss(lm: model_lib.TransformerLM, variables, xi, inputs_BxT, targets_BxT,
                memory):
  """Mean NLL of a batch with head outputs scaled by ξ (one (H_l,) array per layer).

  ξ = 1 is the model itself, ξ_h = 0 removes head h exactly as `head_removal.remove_heads`
  does.
  Returns (loss, next memory).
  """
  with nn.intercept_methods(_head_mask_interceptor(xi)):
    nll_BxT, memory, _ = lm.apply(variables, inputs_BxT, targets_BxT, memory)
  return nll_BxT.mean(), memory


@functools.partial(jax.jit, static_argnums=0)
def _mask_gradient(lm, variables, xi, inputs_BxT, targets_BxT, memory):
  return jax.grad(functools.partial(masked_loss, lm), argnums=1, has_aux=True)(
      variables, xi, inputs_BxT, targets_BxT, memory)


def michel_importance(lm, variables, segments: Segments, mask) -> list[np.ndarray]:
  """Per layer, E_batch |∂L/∂ξ_h| at ξ = mask (before the per-layer normalisation)."""
  xi = [jnp.asarray(m, jnp.float32) for m in mask]
  batch_grads, _ = stream_eval.read_stream(
      lambda memory, batch: _mask_gradient(lm, variables, xi, *batch, memory),
      segments.batches, segments.memory(lm.cfg))
  total = [np.zeros(m.shape, np.float64) for m in mask]
  for grads in batch_grads:
    total = [t + np.abs(np.asarray(g)) for t, g in zip(total, grads)]
  return [t / len(segments.batches) for t in total]


def _normalise_per_layer(scores):
  return [s / max(np.linalg.norm(s), 1e-30) for s in scores]


def michel_mask(lm, variables, segments: Segments, num_remove: int, step_fraction: float = 0.1):
  """Iterative removal: the least important open heads, a fraction at a time."""
  mask = [m.copy() for m in full_mask(lm.cfg)]
  total = sum(m.size for m in mask)
  step = max(1, math.ceil(step_fraction * total))
  removed = 0
  while removed < num_remove:
    scores = _normalise_per_layer(
        [s * m for s, m in zip(michel_importance(lm, variables, segments, mask), mask)])
    count = min(step, num_remove - removed)
    _remove_lowest(mask, scores, count)
    removed += count
  return tuple(mask)


def _remove_lowest(mask, scores, count: int) -> None:
  """Closes the `count` open heads with the lowest scores (ties: lower layer, head)."""
  flat = [(float(s), i, h) for i, (layer, m) in enumerate(zip(scores, mask))
          for h, s in enumerate(layer) if m[h]]
  for _, i, h in sorted(flat)[:count]:
    mask[i][h] = False


@functools.partial(jax.jit, static_argnums=0)
def _attention_probs(lm, variables, inputs_BxT, targets_BxT, memory):
  """Per layer, the sown (context, persistent) attention weights of a batch."""
  (_, memory, _), state = lm.apply(variables, inputs_BxT, targets_BxT, memory,
                                   mutable=["intermediates"])
  layers = state["intermediates"]
  probs = [layers[f"layer_{i}"]["attention"]["attention_probs"][0] if h else None
           for i, h in enumerate(lm.cfg.layer_heads)]
  return probs, memory


@jax.jit
def _head_statistics(p_ctx, p_pers, mask_TxK):
  """Per head, summed over queries: normalised entropy, Hoyer sparsity, JS divergence.

  p_ctx (H, B, T, K) and p_pers (H, B, T, N) or None: one attention distribution
  per query; masked keys have weight exactly 0.
  """
  p = p_ctx if p_pers is None else jnp.concatenate([p_ctx, p_pers], -1)
  keys_T = mask_TxK.sum(-1) + (0 if p_pers is None else p_pers.shape[-1])
  n = keys_T[None, None, :].astype(jnp.float32)
  plogp = lambda q: jnp.where(q > 0, q * jnp.log(jnp.where(q > 0, q, 1.0)), 0.0)
  entropy = -plogp(p).sum(-1) / jnp.maximum(jnp.log(n), 1e-9)
  hoyer = (jnp.sqrt(n) - 1.0 / jnp.linalg.norm(p, axis=-1)) / jnp.maximum(jnp.sqrt(n) - 1, 1e-9)
  heads = p.shape[0]
  others = (p.sum(0, keepdims=True) - p) / max(heads - 1, 1)
  m = 0.5 * (p + others)
  js = 0.5 * (plogp(p) + plogp(others) - 2 * plogp(m)).sum(-1) / math.log(2)
  if heads == 1:
    js = jnp.ones_like(js)   # no other head to be redundant with
  return {"entropy": entropy.sum((1, 2)), "sparsity": hoyer.sum((1, 2)),
          "distribution": js.sum((1, 2))}


def attention_metrics(lm, variables, segments: Segments) -> dict[str, list[np.ndarray]]:
  """Per metric, per layer, the per-head mean over all queries of the segments."""
  batch, seq_len = segments.batches[0][0].shape

  def statistics(memory, inputs_and_targets):
    mask_TxK = relative.attention_mask(seq_len, segments.mem_len, memory["length"],
                                       lm.cfg.same_length, lm.cfg.same_length_keys)
    probs, memory = _attention_probs(lm, variables, *inputs_and_targets, memory)
    return [None if layer is None else _head_statistics(*layer, mask_TxK)
            for layer in probs], memory

  batch_statistics, _ = stream_eval.read_stream(statistics, segments.batches,
                                                segments.memory(lm.cfg))
  sums = {k: [np.zeros(h) for h in lm.cfg.layer_heads] for k in ATTENTION_METRICS}
  for layers in batch_statistics:
    for i, layer in enumerate(layers):
      if layer is None:
        continue
      for k, v in layer.items():
        sums[k][i] += np.asarray(v)
  queries = len(segments.batches) * batch * seq_len
  return {k: [s / queries for s in v] for k, v in sums.items()}


def magnitudes(cfg: model_lib.ModelConfig, params) -> list[np.ndarray]:
  """Per layer, the L2 norm of each head's slices of the attention kernels."""
  scores = []
  for i, heads in enumerate(cfg.layer_heads):
    squares = np.zeros(heads)
    if heads:
      layer = params[f"layer_{i}"]["attention"]
      for name, axis in _KERNEL_HEAD_AXIS.items():
        kernel = np.moveaxis(np.asarray(layer[name]["kernel"], np.float64), axis, 0)
        squares += (kernel.reshape(heads, -1) ** 2).sum(-1)
    scores.append(np.sqrt(squares))
  return scores


def head_scores(method: str, lm, variables, segments: Segments,
                seed: int = 0) -> list[np.ndarray]:
  """One-shot scores of every head (higher = keep); Michel's before any removal."""
  if method == "michel":
    return _normalise_per_layer(michel_importance(lm, variables, segments,
                                                  full_mask(lm.cfg)))
  if method in ATTENTION_METRICS:
    metrics = attention_metrics(lm, variables, segments)[method]
    return [-m for m in metrics] if method == "entropy" else metrics
  if method == "magnitude":
    return magnitudes(lm.cfg, variables["params"])
  if method == "random":
    rng = np.random.default_rng(seed)
    return [rng.random(h) for h in lm.cfg.layer_heads]
  raise ValueError(f"Unknown pruning method {method!r}; choose one of {METHODS}.")


def prune_mask(method: str, lm, variables, segments: Segments, num_remove: int, *, seed: int = 0,
               michel_step_fraction: float = 0.1) -> tuple[np.ndarray, ...]:
  """The head mask (True = keep) with exactly `num_remove` heads removed.

  Args:
    method: one of METHODS.
    lm: the ungated model; variables: {'params': ...} of it.
    segments: the training batches the scores are measured on.
    num_remove: how many heads to remove, over all layers.
    seed: the random method's seed.
    michel_step_fraction: the fraction of all heads Michel removes per iteration.
  """
  total = sum(lm.cfg.layer_heads)
  if not 0 <= num_remove <= total:
    raise ValueError(f"Cannot remove {num_remove} of {total} heads.")
  if method == "michel":
    return michel_mask(lm, variables, segments, num_remove, michel_step_fraction)
  scores = head_scores(method, lm, variables, segments, seed)
  mask = [m.copy() for m in full_mask(lm.cfg)]
  _remove_lowest(mask, scores, num_remove)
  return tuple(mask)
