"""Learning from the unpruned model while pruning: the distillation loss terms.

The student learns from a frozen teacher (`init_from`), as in CoFi (Xia et al. 2022)
and Minitron (Muralidharan et al. 2024):

  loss = (1 − α)·CE + α·τ²·KL(teacher_τ ‖ student_τ) + β·Σ_l MSE(h_l, h_l^teacher)

plus the L0 or budget term; h_l is layer l's output (pruning removes heads, never
layers, so layer l has a teacher layer l).

An adaptive softmax is hierarchical (a tail token's probability is its cluster's head
probability times its probability within the cluster), so by the chain rule of the KL

  KL(p ‖ q) = KL(p_head ‖ q_head) + Σ_i p_head(cluster i)·KL(p_i ‖ q_i).

`kl_clusters='all'` computes both terms: the exact full-vocabulary KL at τ = 1 (at
other τ each softmax is tempered by τ), costing every cluster's logits, Σ_i size_i·d_i
multiply-adds per token per model. 'head' keeps the first term: a lower bound that
skips the tail logits. With a plain softmax both are the exact KL. A cluster's KL runs
over vocabulary blocks sized as the NLL's (`vocab_logsumexp.block_rows`), with an
online accumulator, recomputing each block backward.
"""
import jax
import jax.numpy as jnp

from allatt_jax.config import run_config
from allatt_jax.model import vocab_logsumexp


def loss(d: run_config.DistillSection, nll, student_clusters, teacher_clusters,
         student_layers, teacher_layers, vocab_block: int = 0
         ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(the loss under distillation settings `d`, its distillation terms by name). A
  term of weight 0 is not computed, so α = β = 0 leaves the loss the plain
  cross-entropy, bit for bit. `vocab_block`: as `model.vocab_block`."""
  total, terms = nll, {}
  if d.weight:
    terms["distill_kl"] = kl_divergence(student_clusters, teacher_clusters, d.temperature,
                                        d.kl_clusters == "all", vocab_block).mean()
    total = (1 - d.weight) * total + d.weight * d.temperature**2 * terms["distill_kl"]
  if d.hidden_weight:
    terms["distill_hidden"] = hidden_mse(student_layers, teacher_layers)
    total = total + d.hidden_weight * terms["distill_hidden"]
  return total, terms


def _logits(h_NxK, table_VxK, bias_V, temperature):
  logits_NxV = jnp.einsum("nk,vk->nv", h_NxK, table_VxK.astype(h_NxK.dtype),
                          preferred_element_type=jnp.float32)
  return (logits_NxV + bias_V.astype(jnp.float32)) / temperature


def _accumulate(carry, student_NxB, teacher_NxB, valid_B):
  """One block of the online KL: running (max, Σexp) of both models' logits, and the
  teacher-weighted Σ exp(t − max_t)·(t − s), each rescaled when its max grows."""
  t_max, t_sum, weighted, s_max, s_sum = carry
  masked = lambda x: jnp.where(valid_B, x, -jnp.inf)
  # The maxima only stabilise exp: the KL's gradient does not depend on them.
  new_t_max = jax.lax.stop_gradient(jnp.maximum(t_max, masked(teacher_NxB).max(-1)))
  new_s_max = jax.lax.stop_gradient(jnp.maximum(s_max, masked(student_NxB).max(-1)))
  t_scale = jnp.exp(t_max - new_t_max)
  p_NxB = jnp.exp(masked(teacher_NxB) - new_t_max[:, None])
  difference_NxB = jnp.where(valid_B, teacher_NxB - student_NxB, 0.0)
  return (new_t_max, t_sum * t_scale + p_NxB.sum(-1),
          weighted * t_scale + (p_NxB * difference_NxB).sum(-1),
          new_s_max, s_sum * jnp.exp(s_max - new_s_max)
          + jnp.exp(masked(student_NxB) - new_s_max[:, None]).sum(-1))


def _part(carry, student_part, teacher_part, temperature, block):
  """`carry` after all rows of one part (a table and its bias) of both models, in
  blocks of at most `block` rows."""
  (h_s, table_s, bias_s), (h_t, table_t, bias_t) = student_part, teacher_part
  rows = table_s.shape[0]
  if rows <= block:
    return _accumulate(carry, _logits(h_s, table_s, bias_s, temperature),
                       _logits(h_t, table_t, bias_t, temperature), jnp.ones((rows,), bool))

  @jax.checkpoint
  def step(carry, b):
    # The last block slides back to end at the last row (no padded copy of the
    # tables); the rows an earlier block counted are masked out.
    start = jnp.minimum(b * block, rows - block)
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, block)
    valid_B = start + jnp.arange(block) >= b * block
    return _accumulate(carry, _logits(h_s, cut(table_s), cut(bias_s), temperature),
                       _logits(h_t, cut(table_t), cut(bias_t), temperature), valid_B), None

  carry, _ = jax.lax.scan(step, carry, jnp.arange(-(-rows // block)))
  return carry


def _cluster_kl(student_parts, teacher_parts, temperature, block):
  """(KL per token over one cluster's softmax, the teacher's log-normaliser)."""
  n = student_parts[0][0].shape[0]
  carry = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)),
           jnp.full((n,), -jnp.inf), jnp.zeros((n,)))
  for student_part, teacher_part in zip(student_parts, teacher_parts):
    carry = _part(carry, student_part, teacher_part, temperature, block)
  t_max, t_sum, weighted, s_max, s_sum = carry
  teacher_lse, student_lse = t_max + jnp.log(t_sum), s_max + jnp.log(s_sum)
  return weighted / t_sum - teacher_lse + student_lse, teacher_lse


def kl_divergence(student_clusters, teacher_clusters, temperature: float,
                  all_clusters: bool = True, vocab_block: int = 0) -> jax.Array:
  """KL(teacher_τ ‖ student_τ) per token, float32 (N,), from both models'
  `AdaptiveEmbedding.clusters` (the module docstring says what 'all' and 'head' are);
  `vocab_block` as `model.vocab_block` (0: sized to the device)."""
  n = student_clusters[0][0][0].shape[0]
  block = vocab_logsumexp.block_rows(vocab_block, n // vocab_logsumexp.batch_shards(n))
  kl_N, teacher_lse_N = _cluster_kl(student_clusters[0], teacher_clusters[0], temperature,
                                    block)
  if not all_clusters or len(teacher_clusters) == 1:
    return kl_N
  # p_head(cluster i): the head softmax at the tail clusters' rows (its second part).
  log_p_cluster_NxC = _logits(*teacher_clusters[0][1], temperature) - teacher_lse_N[:, None]
  for i, (student_parts, teacher_parts) in enumerate(zip(student_clusters[1:],
                                                         teacher_clusters[1:])):
    tail_kl_N, _ = _cluster_kl(student_parts, teacher_parts, temperature, block)
    kl_N = kl_N + jnp.exp(log_p_cluster_NxC[:, i]) * tail_kl_N
  return kl_N


def hidden_mse(student_layers, teacher_layers) -> jax.Array:
  """Σ over layers of the mean squared difference of their outputs, float32."""
  return sum(jnp.mean(jnp.square(s.astype(jnp.float32) - t.astype(jnp.float32)))
             for s, t in zip(student_layers, teacher_layers))
