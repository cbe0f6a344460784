"""Adaptive input and adaptive softmax with tied weights, and the plain tied softmax.

Baevski & Auli 2019 / Grave et al. 2017 as Transformer-XL configures them for
WikiText-103: `cutoffs` split the vocabulary into clusters; cluster i's table emb_i
(size_i, d_i), d_i = d_model // div_val**i, serves both the input lookup and the
output logits (bias_i untied). Only with div_val > 1 is there a projection proj_i
(d_i, d_model), also the output one when tie_projs[i] (else out_proj_i). The head
scores the tail clusters with cluster_kernel (n_tail, d_0) and cluster_bias. With
`cutoffs == ()`: one (V, d_model) table. Parameters are float32.

Init: emb_i ~ N(0, 1/d_i), projections ~ N(0, 1/d_model), token biases 0, the cluster
kernel like a row of emb_0. So sqrt(d_model)·e_i @ proj_i has unit variance per
component, and for a unit-variance hidden state every logit has unit variance, whatever
div_val. The cluster bias starts at log(cluster size) (Transformer-XL: 0), so a tail
cluster's head probability is in proportion to its tokens and the initial distribution
is near uniform (with zeros, a WikiText-103 tail token starts ~log(20000) nats behind).
"""

from collections.abc import Sequence
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from allatt_jax.config import errors
from allatt_jax.model import vocab_logsumexp


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


def _project(h_NxD: jax.Array, proj_KxD: jax.Array | None, dtype: Any) -> jax.Array:
  """Hidden states in a cluster's embedding space (unchanged without a projection)."""
  h_NxD = h_NxD.astype(dtype)
  return h_NxD if proj_KxD is None else h_NxD @ proj_KxD.astype(dtype).T


def _target_logit(h_NxK: jax.Array, table_VxK: jax.Array, bias_V: jax.Array,
                  rows_N: jax.Array, dtype: Any) -> jax.Array:
  """Logit of table row `rows_N[n]` for each position n, float32."""
  target_emb_NxK = jnp.take(table_VxK, rows_N, axis=0).astype(dtype)
  dot_N = jnp.einsum('nk,nk->n', h_NxK, target_emb_NxK,
                     preferred_element_type=jnp.float32)
  return dot_N + jnp.take(bias_V, rows_N).astype(jnp.float32)


def _within_cluster_nll(h_NxD, targets_N, lo, table_VxK, bias_V, proj_KxD, block, dtype):
  """-log p(target | cluster) at each position, float32 (N,); meaningless where the
  target lies outside the cluster (its row is clipped)."""
  h_NxK = _project(h_NxD, proj_KxD, dtype)
  rows_N = jnp.clip(targets_N - lo, 0, table_VxK.shape[0] - 1)
  return (vocab_logsumexp.logsumexp(h_NxK, table_VxK, bias_V, block, dtype)
          - _target_logit(h_NxK, table_VxK, bias_V, rows_N, dtype))


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
    vocab_block: vocabulary rows per block of a cluster's log-sum-exp in `nll`; a
      cluster with at most this many rows is one matmul. 0 sizes the blocks to the
      device's memory (`vocab_logsumexp.block_rows`).
    tail_capacity: with > 0, a tail cluster's log-sum-exp in `nll` runs only for the
      positions whose target lies in it, up to this factor times its expected share
      (`cluster_fractions`) per group of rows on one device; a batch with more takes
      the dense path (every position, as with 0) for that cluster, so `nll` stays
      exact. 0 = every position pays for every tail.
    cluster_fractions: each cluster's share of the training tokens (head first), for
      the tail capacities; () = a Zipf's-law estimate (`vocab_logsumexp.zipf_fractions`).
  """
  vocab_size: int
  d_model: int
  cutoffs: tuple[int, ...] = ()
  div_val: int = 1
  tie_projs: tuple[bool, ...] | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  vocab_block: int = 0
  tail_capacity: float = 2.0
  cluster_fractions: tuple[float, ...] = ()

  def setup(self):
    _check_config(self.vocab_size, self.d_model, self.cutoffs, self.div_val,
                  self.tie_projs)
    if self.vocab_block < 0 or self.tail_capacity < 0:
      raise errors.ConfigError(
          f'vocab_block ({self.vocab_block}) and tail_capacity ({self.tail_capacity}) '
          'must be >= 0 (0: sized to the device; 0: no tail gathering).')
    if self.cluster_fractions and len(self.cluster_fractions) != len(self.cutoffs) + 1:
      raise errors.ConfigError(
          f'cluster_fractions {tuple(self.cluster_fractions)} needs one entry per '
          f'cluster ({len(self.cutoffs) + 1} for cutoffs {tuple(self.cutoffs)}).')
    self._bounds = cluster_bounds(self.vocab_size, self.cutoffs)
    self._dims = cluster_dims(self.d_model, len(self._bounds), self.div_val)
    projected = self.div_val > 1
    tied = (tuple(self.tie_projs) if self.tie_projs is not None
            else (True,) * len(self._bounds))
    # Logical axes: 'vocab', 'embed' (d_model), 'embed_small' (a cluster's own d_i,
    # before projection; unprojected tables are d_model wide) and 'cluster' (tiny).
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

  def _out_proj(self, i: int) -> jax.Array | None:
    """Cluster i's output projection (None without projections)."""
    return self._out_projs[i] if self._out_projs else None

  def _project_out(self, h_NxD: jax.Array, i: int) -> jax.Array:
    """Hidden states in cluster i's embedding space, in self.dtype."""
    return _project(h_NxD, self._out_proj(i), self.dtype)

  def _cluster_logits(self, head_h_NxK: jax.Array) -> jax.Array:
    return vocab_logsumexp.logits(head_h_NxK, self._cluster_kernel, self._cluster_bias,
                                  self.dtype)

  def nll(self, h_BxTxD: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Exact negative log-likelihood over the whole vocabulary, float32 (B, T).

    Every position pays for the head: the shortlist's logits and the tail clusters'.
    With `tail_capacity` a tail cluster's log-sum-exp runs for the positions whose
    target lies in it (gathered into static shapes, see `_tail_nll`); without, for
    every position, then selected. For WikiText-103 the head costs about 10.5M
    multiply-adds a token and the tails 8.3M more a token when every token pays for
    every tail.
    """
    h_NxD = h_BxTxD.reshape(-1, self.d_model)
    targets_N = targets_BxT.reshape(-1)
    groups = vocab_logsumexp.batch_shards(h_BxTxD.shape[0])
    block = vocab_logsumexp.block_rows(self.vocab_block, targets_N.size // groups)
    head_h_NxK = self._project_out(h_NxD, 0)
    head_lse_N = vocab_logsumexp.logsumexp(head_h_NxK, self._tables[0], self._biases[0],
                                           block, self.dtype)
    shortlist_rows_N = jnp.clip(targets_N, 0, self._bounds[0][1] - 1)
    target_logit_N = _target_logit(head_h_NxK, self._tables[0], self._biases[0],
                                   shortlist_rows_N, self.dtype)
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
      nll_N = nll_N + self._tail_nll(h_NxD, targets_N, cluster_N == i, i, groups, block)
    return nll_N.reshape(targets_BxT.shape)

  def _tail_nll(self, h_NxD: jax.Array, targets_N: jax.Array, in_tail_N: jax.Array,
                i: int, groups: int, block: int) -> jax.Array:
    """Tail cluster i's -log p(target | cluster) where the target lies in it, else 0.

    With `tail_capacity`, the N positions split into `groups` groups of consecutive
    rows, one per device of the batch axis (so the gather stays on its device), and
    each group gathers up to `capacity` positions whose target lies in the cluster.
    Only their hidden states meet the cluster's table: capacity / group size of the
    dense path's work. A batch in which some group has more such positions runs the
    dense path instead (a `lax.cond`: that step pays the full cost, its result is the
    same).
    """
    args = (self._bounds[i][0], self._tables[i], self._biases[i], self._out_proj(i))

    def dense():
      nll_N = _within_cluster_nll(h_NxD, targets_N, *args, block, self.dtype)
      return jnp.where(in_tail_N, nll_N, 0.)

    size = targets_N.size // groups
    fractions = self.cluster_fractions or vocab_logsumexp.zipf_fractions(self._bounds)
    capacity = vocab_logsumexp.tail_capacity(size, fractions[i], self.tail_capacity)
    if not self.tail_capacity or capacity >= size:
      return dense()
    member_GxM = nn.with_logical_constraint(in_tail_N.reshape(groups, size),
                                            ('batch', None))
    count_G = member_GxM.sum(axis=1)

    def gathered():
      rows_GxC = vocab_logsumexp.gathered_rows(member_GxM, capacity)
      h_GxCxD = jnp.take_along_axis(h_NxD.reshape(groups, size, -1), rows_GxC[..., None],
                                    axis=1)
      targets_GxC = jnp.take_along_axis(targets_N.reshape(groups, size), rows_GxC, axis=1)
      nll_C = _within_cluster_nll(
          h_GxCxD.reshape(groups * capacity, -1), targets_GxC.reshape(-1), *args,
          vocab_logsumexp.block_rows(self.vocab_block, capacity), self.dtype)
      valid_GxC = jnp.arange(capacity) < count_G[:, None]
      nll_GxC = jnp.where(valid_GxC, nll_C.reshape(groups, capacity), 0.)
      nll_GxM = jnp.zeros((groups, size), jnp.float32).at[
          jnp.arange(groups)[:, None], rows_GxC].add(nll_GxC)
      return nll_GxM.reshape(-1)

    return jax.lax.cond(jnp.any(count_G > capacity), dense, gathered)

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
    head_logits_NxH = vocab_logsumexp.logits(head_h_NxK, self._tables[0],
                                             self._biases[0], self.dtype)
    n_tail = len(self._bounds) - 1
    if n_tail:
      head_logits_NxH = jnp.concatenate(
          [head_logits_NxH, self._cluster_logits(head_h_NxK)], axis=-1)
    head_logp_NxH = jax.nn.log_softmax(head_logits_NxH, axis=-1)
    shortlist = self._bounds[0][1]
    parts = [head_logp_NxH[:, :shortlist]]
    for i in range(1, n_tail + 1):
      tail_logits_NxS = vocab_logsumexp.logits(self._project_out(h_NxD, i),
                                               self._tables[i], self._biases[i], self.dtype)
      parts.append(jax.nn.log_softmax(tail_logits_NxS, axis=-1) +
                   head_logp_NxH[:, shortlist + i - 1, None])
    logp_NxV = jnp.concatenate(parts, axis=-1)
    return logp_NxV.reshape(*h_BxTxD.shape[:-1], self.vocab_size)
