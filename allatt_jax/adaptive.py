"""Adaptive input and adaptive softmax with tied weights, and the plain tied softmax.

Adaptive input (Baevski & Auli 2019) and adaptive softmax (Grave et al. 2017) as
configured by Transformer-XL for WikiText-103: the vocabulary is split by `cutoffs`
into clusters, cluster i gets an embedding table of width d_i = d_model // div_val**i,
and the same table serves the input lookup and the output logits. With `cutoffs == ()`
the module is a plain tied embedding / softmax over a single (V, d_model) table.

Parameters (all float32; compute dtype is separate):
  emb_i          (size_i, d_i)        cluster i's table, shared by input and output.
  bias_i         (size_i,)            output bias of cluster i's tokens (untied).
  proj_i         (d_i, d_model)       input projection d_i -> d_model; also the output
                                      projection (transposed) when tie_projs[i].
  out_proj_i     (d_i, d_model)       untied output projection; only when not tied.
  cluster_kernel (n_tail, d_0)        head logits of the tail clusters.
  cluster_bias   (n_tail,)
Projections exist only when div_val > 1: like Transformer-XL, with div_val == 1 every
table already has width d_model and neither input nor output is projected (tie_projs
is then irrelevant).

Logical axis names (mapped to mesh axes by rules kept with the model code):
  'vocab'        a vocabulary dimension (tables, biases).
  'embed'        the model width d_model.
  'embed_small'  a cluster's own width d_i, i.e. the space before projection to
                 d_model. Tables without a projection are d_model wide and use
                 'embed' instead, so the plain softmax table is ('vocab', 'embed').
  'cluster'      the tail-cluster dimension of the head (tiny; leave unmapped).

Initialisation: emb_i ~ N(0, 1/d_i), projections ~ N(0, 1/d_model), token biases 0,
and the cluster kernel like a shortlist row of emb_0. Then the input
sqrt(d_model) * e_i @ proj_i has unit variance per component, and for a unit-variance
hidden state (e.g. the output of a final LayerNorm) the projected hidden has unit variance
and every logit, cluster logits included, has unit variance: O(1) logits at init,
whatever div_val. The cluster bias starts at log(cluster size) (Transformer-XL: 0) so
that a tail cluster gets head probability in proportion to its number of tokens: the
initial distribution is then close to uniform over the whole vocabulary instead of
starving the tail clusters (with zeros, a WikiText-103 tail token would start at
about log(20000) nats above a shortlist token).
"""

from collections.abc import Sequence
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from allatt_jax import errors


# Published cutoffs by dataset: Transformer-XL's for WikiText-103 (of 267,735 types)
# and One Billion Word (of ~793K types).
PUBLISHED_CUTOFFS = {'wikitext103': (20_000, 40_000, 200_000),
                     'lm1b': (60_000, 100_000, 640_000)}
# WikiText-103's cutoffs as fractions of its vocabulary, for any other vocabulary.
_CUTOFF_FRACTIONS = (0.075, 0.15, 0.75)


def default_cutoffs(dataset: str, vocab_size: int) -> tuple[int, ...]:
  """Cutoffs for `dataset`: the published ones if they fit its vocabulary, else
  7.5%, 15% and 75% of it (() when too small to cluster)."""
  published = PUBLISHED_CUTOFFS.get(dataset, ())
  if published and published[-1] < vocab_size:
    return published
  cutoffs = tuple(sorted({round(vocab_size * f) for f in _CUTOFF_FRACTIONS}))
  return cutoffs if len(cutoffs) == 3 and 0 < cutoffs[0] and cutoffs[-1] < vocab_size else ()

def _check_config(vocab_size: int, d_model: int, cutoffs: Sequence[int],
                  div_val: int, tie_projs: Sequence[bool] | None) -> None:
  """Raises ConfigError if the vocabulary split or the widths are inconsistent."""
  if vocab_size < 1 or d_model < 1:
    raise errors.ConfigError(
        f'vocab_size ({vocab_size}) and d_model ({d_model}) must be positive.')
  bounds = (0, *cutoffs, vocab_size)
  if any(lo >= hi for lo, hi in zip(bounds[:-1], bounds[1:])):
    raise errors.ConfigError(
        f'cutoffs {tuple(cutoffs)} must be strictly increasing, above 0 and below '
        f'vocab_size {vocab_size}; use () for a plain softmax.')
  if div_val < 1:
    raise errors.ConfigError(f'div_val must be >= 1, got {div_val}.')
  n_clusters = len(cutoffs) + 1
  if d_model // div_val**(n_clusters - 1) < 1:
    raise errors.ConfigError(
        f'div_val {div_val} with {n_clusters} clusters shrinks the last cluster '
        f'width d_model // div_val**{n_clusters - 1} to 0 (d_model {d_model}); '
        'lower div_val or use fewer cutoffs.')
  if tie_projs is not None and len(tie_projs) != n_clusters:
    raise errors.ConfigError(
        f'tie_projs {tuple(tie_projs)} needs one entry per cluster '
        f'({n_clusters} for cutoffs {tuple(cutoffs)}).')


def cluster_bounds(vocab_size: int,
                   cutoffs: Sequence[int]) -> list[tuple[int, int]]:
  """[lo, hi) token range of every cluster; cluster 0 is the head shortlist."""
  bounds = (0, *cutoffs, vocab_size)
  return list(zip(bounds[:-1], bounds[1:]))


def cluster_dims(d_model: int, n_clusters: int, div_val: int) -> list[int]:
  """Embedding width of every cluster."""
  return [d_model // div_val**i for i in range(n_clusters)]


def embedding_param_count(vocab_size: int, d_model: int,
                          cutoffs: Sequence[int] = (), div_val: int = 1,
                          tie_projs: Sequence[bool] | None = None) -> int:
  """Exact number of parameters of AdaptiveEmbedding with these settings."""
  _check_config(vocab_size, d_model, cutoffs, div_val, tie_projs)
  bounds = cluster_bounds(vocab_size, cutoffs)
  dims = cluster_dims(d_model, len(bounds), div_val)
  tables_and_biases = sum((hi - lo) * (d + 1) for (lo, hi), d in zip(bounds, dims))
  n_tail = len(bounds) - 1
  head = n_tail * (dims[0] + 1)
  projections = 0
  if div_val > 1:
    tied = tie_projs if tie_projs is not None else (True,) * len(bounds)
    projections = sum(d * d_model * (1 if t else 2) for d, t in zip(dims, tied))
  return tables_and_biases + head + projections


def _logits(h_NxK: jax.Array, table_VxK: jax.Array, bias_V: jax.Array,
            dtype: Any) -> jax.Array:
  """float32 logits from a matmul in `dtype` (bf16 inputs accumulate in float32)."""
  logits_NxV = jnp.einsum('nk,vk->nv', h_NxK.astype(dtype), table_VxK.astype(dtype),
                          preferred_element_type=jnp.float32)
  return logits_NxV + bias_V.astype(jnp.float32)


def _blocked_logsumexp(h_NxK: jax.Array, table_VxK: jax.Array, bias_V: jax.Array,
                       block: int, dtype: Any) -> jax.Array:
  """log sum_v exp(h . table_v + bias_v), never holding more than (N, block) logits.

  Scans over vocabulary blocks with an online (max, sum) accumulator. The scan body is
  rematerialised, so the backward pass recomputes each block's logits instead of
  storing all of them. When V is not a multiple of `block`, the last block is slid back
  to end at V and the rows an earlier block already counted are masked out, so the
  table is never padded (padding would copy it on every call).
  """
  vocab_size = table_VxK.shape[0]
  n_blocks = -(-vocab_size // block)

  @jax.checkpoint
  def step(carry, b):
    max_N, sum_N = carry
    start = jnp.minimum(b * block, vocab_size - block)
    table_BxK = jax.lax.dynamic_slice_in_dim(table_VxK, start, block)
    bias_B = jax.lax.dynamic_slice_in_dim(bias_V, start, block)
    rows_B = start + jnp.arange(block)
    logits_NxB = _logits(h_NxK, table_BxK, bias_B, dtype)
    logits_NxB = jnp.where(rows_B >= b * block, logits_NxB, -jnp.inf)
    # The running max only stabilises exp; the gradient of max + log(sum) does not
    # depend on it, so stopping its gradient is exact and avoids a useless path.
    new_max_N = jax.lax.stop_gradient(
        jnp.maximum(max_N, jnp.max(logits_NxB, axis=-1)))
    sum_N = (sum_N * jnp.exp(max_N - new_max_N) +
             jnp.sum(jnp.exp(logits_NxB - new_max_N[:, None]), axis=-1))
    return (new_max_N, sum_N), None

  n = h_NxK.shape[0]
  init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32))
  (max_N, sum_N), _ = jax.lax.scan(step, init, jnp.arange(n_blocks))
  return max_N + jnp.log(sum_N)


class AdaptiveEmbedding(nn.Module):
  """Tied adaptive input / adaptive softmax (plain tied softmax when cutoffs == ()).

  Attributes:
    vocab_size: number of tokens V.
    d_model: model width.
    cutoffs: cluster boundaries, e.g. (20000, 40000, 200000); () = one cluster.
    div_val: cluster i has embedding width d_model // div_val**i.
    tie_projs: per cluster, whether the output projection is the input projection;
      None ties all. Transformer-XL's WikiText-103 setting is (False, True, True, True).
    dtype: compute dtype of the matmuls; log-sum-exp is always float32.
    param_dtype: dtype of the parameters.
    vocab_block: clusters larger than this get their log-sum-exp in `nll` computed
      block by block, bounding activation memory at (B*T, vocab_block).
  """
  vocab_size: int
  d_model: int
  cutoffs: tuple[int, ...] = ()
  div_val: int = 1
  tie_projs: tuple[bool, ...] | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  vocab_block: int = 8192

  def setup(self):
    _check_config(self.vocab_size, self.d_model, self.cutoffs, self.div_val,
                  self.tie_projs)
    if self.vocab_block < 1:
      raise errors.ConfigError(
          f'vocab_block must be >= 1, got {self.vocab_block}.')
    self._bounds = cluster_bounds(self.vocab_size, self.cutoffs)
    self._dims = cluster_dims(self.d_model, len(self._bounds), self.div_val)
    projected = self.div_val > 1
    tied = (tuple(self.tie_projs) if self.tie_projs is not None
            else (True,) * len(self._bounds))
    width_axis = 'embed_small' if projected else 'embed'

    def normal(stddev):
      return nn.initializers.normal(stddev=stddev)

    tables, biases, in_projs, out_projs = [], [], [], []
    for i, ((lo, hi), d) in enumerate(zip(self._bounds, self._dims)):
      tables.append(self.param(
          f'emb_{i}',
          nn.with_logical_partitioning(normal(d**-0.5), ('vocab', width_axis)),
          (hi - lo, d), self.param_dtype))
      biases.append(self.param(
          f'bias_{i}',
          nn.with_logical_partitioning(nn.initializers.zeros_init(), ('vocab',)),
          (hi - lo,), self.param_dtype))
      if projected:
        proj_init = nn.with_logical_partitioning(
            normal(self.d_model**-0.5), ('embed_small', 'embed'))
        in_projs.append(self.param(f'proj_{i}', proj_init, (d, self.d_model),
                                   self.param_dtype))
        out_projs.append(in_projs[i] if tied[i] else self.param(
            f'out_proj_{i}', proj_init, (d, self.d_model), self.param_dtype))
    self._tables, self._biases = tables, biases
    self._in_projs, self._out_projs = in_projs, out_projs

    n_tail = len(self._bounds) - 1
    if n_tail:
      self._cluster_kernel = self.param(
          'cluster_kernel',
          nn.with_logical_partitioning(normal(self._dims[0]**-0.5),
                                       ('cluster', width_axis)),
          (n_tail, self._dims[0]), self.param_dtype)
      log_sizes = [math.log(hi - lo) for lo, hi in self._bounds[1:]]
      self._cluster_bias = self.param(
          'cluster_bias',
          nn.with_logical_partitioning(
              nn.initializers.constant(jnp.asarray(log_sizes)), ('cluster',)),
          (n_tail,), self.param_dtype)

  def embed(self, tokens_BxT: jax.Array) -> jax.Array:
    """Adaptive input: (B, T) int tokens -> (B, T, d_model) in self.dtype.

    Every cluster's table is looked up (at a clipped index) and projected for every
    position, then the right cluster is selected: static shapes at the cost of
    n_clusters small (d_i x d_model) projections per token.
    """
    x_BxTxD = jnp.zeros((*tokens_BxT.shape, self.d_model), self.dtype)
    for i, (lo, hi) in enumerate(self._bounds):
      rows_BxT = jnp.clip(tokens_BxT - lo, 0, hi - lo - 1)
      e_BxTxD = jnp.take(self._tables[i], rows_BxT, axis=0).astype(self.dtype)
      if self._in_projs:
        e_BxTxD = e_BxTxD @ self._in_projs[i].astype(self.dtype)
      in_cluster_BxT = (tokens_BxT >= lo) & (tokens_BxT < hi)
      x_BxTxD = x_BxTxD + jnp.where(in_cluster_BxT[..., None], e_BxTxD, 0)
    return x_BxTxD * jnp.asarray(math.sqrt(self.d_model), self.dtype)

  def _project_out(self, h_NxD: jax.Array, i: int) -> jax.Array:
    """Hidden states in cluster i's embedding space, in self.dtype."""
    h_NxD = h_NxD.astype(self.dtype)
    if not self._out_projs:
      return h_NxD
    return h_NxD @ self._out_projs[i].astype(self.dtype).T

  def _cluster_logits(self, head_h_NxK: jax.Array) -> jax.Array:
    return _logits(head_h_NxK, self._cluster_kernel, self._cluster_bias, self.dtype)

  def _logsumexp(self, h_NxK: jax.Array, i: int) -> jax.Array:
    """log-sum-exp of cluster i's token logits, blocked for big clusters."""
    if self._tables[i].shape[0] > self.vocab_block:
      return _blocked_logsumexp(h_NxK, self._tables[i], self._biases[i],
                                self.vocab_block, self.dtype)
    return jax.nn.logsumexp(
        _logits(h_NxK, self._tables[i], self._biases[i], self.dtype), axis=-1)

  def _target_logit(self, h_NxK: jax.Array, i: int,
                    targets_N: jax.Array) -> jax.Array:
    """Logit of each target within cluster i (clipped index if not in cluster i)."""
    lo, hi = self._bounds[i]
    rows_N = jnp.clip(targets_N - lo, 0, hi - lo - 1)
    target_emb_NxK = jnp.take(self._tables[i], rows_N, axis=0).astype(self.dtype)
    dot_N = jnp.einsum('nk,nk->n', h_NxK, target_emb_NxK,
                       preferred_element_type=jnp.float32)
    return dot_N + jnp.take(self._biases[i], rows_N).astype(jnp.float32)

  def nll(self, h_BxTxD: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Exact negative log-likelihood over the whole vocabulary, float32 (B, T).

    Every tail cluster's log-sum-exp is computed for every position and then selected
    for the positions whose target lies in it (static shapes). So each token pays for
    the full adaptive softmax, sum_i size_i * d_i multiply-adds plus the projections:
    for WikiText-103 about 18.8M, where the head alone (which every token needs) is
    about 10.5M; computing a tail only where its targets are would need dynamic shapes.
    """
    h_NxD = h_BxTxD.reshape(-1, self.d_model)
    targets_N = targets_BxT.reshape(-1)
    head_h_NxK = self._project_out(h_NxD, 0)
    head_lse_N = self._logsumexp(head_h_NxK, 0)
    target_logit_N = self._target_logit(head_h_NxK, 0, targets_N)
    n_tail = len(self._bounds) - 1
    if n_tail:
      cluster_logits_NxC = self._cluster_logits(head_h_NxK)
      head_lse_N = jnp.logaddexp(head_lse_N,
                                 jax.nn.logsumexp(cluster_logits_NxC, axis=-1))
      # Index of the target's cluster: 0 for the head, i for tail cluster i.
      cluster_N = jnp.searchsorted(jnp.asarray(self.cutoffs), targets_N,
                                   side='right')
      tail_col_N = jnp.clip(cluster_N - 1, 0, n_tail - 1)
      cluster_logit_N = jnp.take_along_axis(cluster_logits_NxC, tail_col_N[:, None],
                                            axis=-1)[:, 0]
      target_logit_N = jnp.where(cluster_N == 0, target_logit_N, cluster_logit_N)
    nll_N = head_lse_N - target_logit_N
    for i in range(1, n_tail + 1):
      tail_h_NxK = self._project_out(h_NxD, i)
      tail_nll_N = (self._logsumexp(tail_h_NxK, i) -
                    self._target_logit(tail_h_NxK, i, targets_N))
      nll_N = nll_N + jnp.where(cluster_N == i, tail_nll_N, 0.)
    return nll_N.reshape(targets_BxT.shape)

  def clusters(self, h_BxTxD: jax.Array) -> list[list[tuple[jax.Array, ...]]]:
    """The output distribution's clusters, for a loss that compares two models'
    distributions without materialising all their logits (distill.py).

    Cluster i is a list of parts (h_NxK, table_VxK, bias_V), whose logits h·table + bias
    are that cluster's softmax: the head's parts are its shortlist and, with tail
    clusters, their head logits (the last `len(cutoffs)` head rows, in order).
    """
    h_NxD = h_BxTxD.reshape(-1, self.d_model)
    head_h_NxK = self._project_out(h_NxD, 0)
    head = [(head_h_NxK, self._tables[0], self._biases[0])]
    if len(self._bounds) > 1:
      head.append((head_h_NxK, self._cluster_kernel, self._cluster_bias))
    tails = [[(self._project_out(h_NxD, i), self._tables[i], self._biases[i])]
             for i in range(1, len(self._bounds))]
    return [head, *tails]

  def log_probs(self, h_BxTxD: jax.Array) -> jax.Array:
    """Full-vocabulary log-probabilities, float32 (B, T, V); materialises all logits."""
    h_NxD = h_BxTxD.reshape(-1, self.d_model)
    head_h_NxK = self._project_out(h_NxD, 0)
    head_logits_NxH = _logits(head_h_NxK, self._tables[0], self._biases[0],
                              self.dtype)
    n_tail = len(self._bounds) - 1
    if n_tail:
      head_logits_NxH = jnp.concatenate(
          [head_logits_NxH, self._cluster_logits(head_h_NxK)], axis=-1)
    head_logp_NxH = jax.nn.log_softmax(head_logits_NxH, axis=-1)
    shortlist = self._bounds[0][1]
    parts = [head_logp_NxH[:, :shortlist]]
    for i in range(1, n_tail + 1):
      tail_logits_NxS = _logits(self._project_out(h_NxD, i), self._tables[i],
                                self._biases[i], self.dtype)
      parts.append(jax.nn.log_softmax(tail_logits_NxS, axis=-1) +
                   head_logp_NxH[:, shortlist + i - 1, None])
    logp_NxV = jnp.concatenate(parts, axis=-1)
    return logp_NxV.reshape(*h_BxTxD.shape[:-1], self.vocab_size)
