"""The log-sum-exp of a vocabulary's logits, sized to the device.

log Σ_v exp(h·e_v + b_v) is one matmul where the (N, V) float32 logits fit in
`LOGITS_MEMORY_SHARE` of the device (a WikiText-103 batch: 18,432 x 20,003 x 4 B =
1.5 GB), else blocks of `block_rows` with an online (max, sum), recomputed backward.
A tail cluster gathers only its targets' positions, up to `tail_capacity`.
"""
from collections.abc import Sequence
import functools
import math
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# The share of a device's memory one block of float32 logits may take. Autodiff keeps
# one such array (their exponentials) for the backward pass, a distillation step holds
# two models' blocks, and the rest of the step needs the remainder.
LOGITS_MEMORY_SHARE = 1 / 16


@functools.cache
def device_memory_bytes() -> int:
  """Memory of this process's first device: an accelerator's usable HBM, or the host's
  RAM on CPU (where XLA allocates from it). Another process's device cannot be asked."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def block_rows(vocab_block: int, num_tokens: int) -> int:
  """Vocabulary rows per block of logits for `num_tokens` positions on one device.

  Args:
    vocab_block: the configured rows (`model.vocab_block`); 0 derives them from the
      device's memory, as many rows as keep (num_tokens, rows) float32 logits within
      LOGITS_MEMORY_SHARE of it (at least 1024).
    num_tokens: positions whose logits one device computes at once.
  """
  if vocab_block:
    return vocab_block
  budget = LOGITS_MEMORY_SHARE * device_memory_bytes()
  return max(1024, int(budget // (4 * max(num_tokens, 1))))


def logits(h_NxK: jax.Array, table_VxK: jax.Array, bias_V: jax.Array,
           dtype: Any) -> jax.Array:
  """float32 logits from a matmul in `dtype` (bf16 inputs accumulate in float32)."""
  logits_NxV = jnp.einsum("nk,vk->nv", h_NxK.astype(dtype), table_VxK.astype(dtype),
                          preferred_element_type=jnp.float32)
  return logits_NxV + bias_V.astype(jnp.float32)


def logsumexp(h_NxK: jax.Array, table_VxK: jax.Array, bias_V: jax.Array, block: int,
              dtype: Any) -> jax.Array:
  """log Σ_v exp(h·table_v + bias_v) per row, float32 (N,): one matmul when the table
  has at most `block` rows, else `_blocked`."""
  if table_VxK.shape[0] <= block:
    return jax.nn.logsumexp(logits(h_NxK, table_VxK, bias_V, dtype), axis=-1)
  return _blocked(h_NxK, table_VxK, bias_V, block, dtype)


def _blocked(h_NxK: jax.Array, table_VxK: jax.Array, bias_V: jax.Array, block: int,
             dtype: Any) -> jax.Array:
  """`logsumexp`, never holding more than (N, block) logits.

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
    logits_NxB = logits(h_NxK, table_BxK, bias_B, dtype)
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


# --- Tail clusters: a log-sum-exp for just the positions whose target lies in them.

def zipf_fractions(bounds: Sequence[tuple[int, int]]) -> tuple[float, ...]:
  """Each cluster's share of a text's tokens, for clusters of token ids [lo, hi) in
  order of frequency, if frequencies followed Zipf's law (rank r has probability
  ∝ 1/r): an estimate for a model whose corpus has not been counted
  (`cluster_fractions`). Word-level text is usually more concentrated in the head, so
  the estimate errs towards larger tail capacities."""
  harmonic = np.cumsum(1.0 / np.arange(1, bounds[-1][1] + 1))
  return tuple(float((harmonic[hi - 1] - (harmonic[lo - 1] if lo else 0.0)) / harmonic[-1])
               for lo, hi in bounds)


def zipf_tokens(rng: np.random.Generator, vocab_size: int, shape) -> np.ndarray:
  """int32 token ids of `shape` drawn as `zipf_fractions` assumes (id r, the (r+1)-th
  most frequent, with probability ∝ 1/(r+1)): random text whose tail clusters get the
  shares a capacity is sized for, where uniform ids would put most tokens in the
  largest tail (and time every step's dense fallback)."""
  p_V = 1.0 / np.arange(1, vocab_size + 1)
  return rng.choice(vocab_size, size=shape, p=p_V / p_V.sum()).astype(np.int32)


def cluster_fractions(ids: np.ndarray, bounds: Sequence[tuple[int, int]]
                      ) -> tuple[float, ...]:
  """Each cluster's share of the tokens `ids` (a corpus's training split), for
  clusters of token ids [lo, hi)."""
  counts_V = np.bincount(np.asarray(ids).reshape(-1), minlength=bounds[-1][1])
  total = max(int(counts_V.sum()), 1)
  return tuple(int(counts_V[lo:hi].sum()) / total for lo, hi in bounds)


def tail_capacity(num_tokens: int, fraction: float, factor: float) -> int:
  """Rows a tail cluster gathers from `num_tokens` positions: `factor` times its
  expected share, rounded up to a multiple of 8 (a matmul tile's rows), at least 8."""
  return min(num_tokens, 8 * max(1, math.ceil(factor * fraction * num_tokens / 8)))


def batch_shards(batch_size: int) -> int:
  """Devices the 'batch' axis is split over in the mesh being traced under (1 outside
  one), so that a gather within each group of rows stays on its device."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = nn.logical_to_mesh_axes(('batch',))[0]
  if mesh.empty or axes is None:
    return 1
  shards = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
  return shards if batch_size % shards == 0 else 1


def gathered_rows(member_GxM: jax.Array, capacity: int) -> jax.Array:
  """(G, capacity) indices of the first `capacity` members of each group, in order;
  slots beyond a group's member count hold index 0."""
  groups, size = member_GxM.shape
  position_GxM = jnp.cumsum(member_GxM, axis=1) - 1
  slot_GxM = jnp.where(member_GxM & (position_GxM < capacity), position_GxM, capacity)
  rows_GxM = jnp.arange(groups)[:, None]
  indices = jnp.zeros((groups, capacity + 1), jnp.int32).at[rows_GxM, slot_GxM].set(
      jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (groups, size)))
  return indices[:, :capacity]
