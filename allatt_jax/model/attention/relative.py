"""Relative multi-head attention with Transformer-XL memory, persistent vectors and head gates.

The All-attention layer (N persistent key/value vectors per head under the context's
softmax, Sukhbaatar et al. 2019) and Transformer-XL's (N = 0), scored as Dai et al. 2019:

  score(i, j) = (q_i + u)·k_j + (q_i + v)·W_R r_{i-j}        for context keys j
  score(i, n) = q_i·p^K_n                                     for persistent slot n

u biases the context term only, as the official code (`persistent_content_bias`: (q_i +
u)·p^K_n). Keys are [memory (S), segment (T)], K = S + T. The core is xla_core.py
(XLA) or split_core.py, as core_choice.py chooses.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from allatt_jax.model.attention import core_choice
from allatt_jax.model.attention import xla_core
from allatt_jax.model import gates as gates_lib
from allatt_jax.config import run_config
from allatt_jax.model.attention import split_core

SAME_LENGTH_KEYS = ("mem_len+1", "mem_len")


def attention_mask(seq_len: int, mem_len: int, mem_valid: jax.Array,
                   same_length: bool, same_length_keys: str = "mem_len+1") -> jax.Array:
  """Boolean (T, S+T) mask: query i (key position S+i) may see key j.

  Memory slots hold the last `mem_valid` positions right-aligned; earlier slots are
  empty at the start of a stream (masked, so a stream's start is scored exactly as
  with no memory at all). With `same_length` every query sees the same number of
  context keys: S + 1 (itself and the S before it, `same_length_keys='mem_len+1'`, the
  window of the code behind the paper) or S (`'mem_len'`, Transformer-XL's).
  """
  if same_length_keys not in SAME_LENGTH_KEYS:
    raise ValueError(f"Unknown same_length_keys {same_length_keys!r}; one of "
                     f"{SAME_LENGTH_KEYS}.")
  q_T1 = jnp.arange(seq_len)[:, None] + mem_len
  k_1K = jnp.arange(mem_len + seq_len)[None, :]
  mask = (k_1K <= q_T1) & (k_1K >= mem_len - mem_valid)
  if same_length and mem_len > 0:
    window = mem_len if same_length_keys == "mem_len+1" else mem_len - 1
    mask &= k_1K >= q_T1 - window
  return mask


def sinusoidal_positions(length: int, d_model: int) -> jax.Array:
  """Transformer-XL's sinusoids for distances length-1 .. 0 (descending)."""
  pos_K = jnp.arange(length - 1, -1, -1, dtype=jnp.float32)
  inv_freq = 1.0 / (10000 ** (jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model))
  angles = pos_K[:, None] * inv_freq[None, :]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Projection(nn.Module):
  """Contracts the last `num_in` axes of x with the first axes of a named kernel.

  Written out rather than with nn.DenseGeneral, whose flattened kernel init does not
  survive logical-axis constraints on multi-axis kernels.
  """
  shape: tuple[int, ...]
  names: tuple[str, ...]
  num_in: int = 1
  use_bias: bool = False           # a bias over the output axes
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal(in_axis=tuple(range(self.num_in)),
                                        out_axis=tuple(range(self.num_in, len(self.shape))))
    kernel = self.param("kernel", nn.with_logical_partitioning(init, self.names), self.shape)
    y = jnp.tensordot(x.astype(self.dtype), kernel.astype(self.dtype), axes=self.num_in)
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(
          nn.initializers.zeros, self.names[self.num_in:]), self.shape[self.num_in:])
      y = y + bias.astype(self.dtype)
    return y


class RelativeAttention(nn.Module):
  """Multi-head relative attention over [memory, segment] plus persistent slots.

  Gate logits live in the `gates` collection. They are created at init when `gated`
  is set; at apply time gating is on exactly when the caller passes that collection,
  so the same module applied to params alone is the plain baseline.
  """
  num_heads: int
  head_dim: int
  num_persistent: int = 0
  dropout_attn: float = 0.0
  head_block: int = 0              # heads per step of the core's loop; 0 = all at once
  remat: bool = False              # recompute the softmax weights in the backward pass
  score_dtype: str = "compute"     # scores and weights in memory: 'compute' (dtype), 'float32'
  attention_impl: str = "auto"     # the core: 'auto', 'xla' or 'split' (core_choice)
  persistent_impl: str = "auto"    # the split core's persistent part (persistent_cores)
  persistent_content_bias: bool = False   # persistent logits (q + u)·P_K instead of q·P_K
  out_bias: bool = True            # W_O has a bias (per layer: it survives pruning)
  # An export's persistent slots per head, non-increasing: its arrays hold the
  # largest count (the slots beyond a head's count are padding, never read); None:
  # every head keeps num_persistent, the N of the unpruned model (which also sets the
  # persistent values' scale).
  slot_counts: tuple[int, ...] | None = None
  gated: bool = False
  gate: run_config.GatesSection = run_config.GatesSection()
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD, mem_BxSxD, r_KxD, mask_TxK, *, deterministic: bool,
               sample_gates: bool = False):
    h, dh = self.num_heads, self.head_dim
    d_model = x_BxTxD.shape[-1]
    kv_BxKxD = jnp.concatenate([mem_BxSxD, x_BxTxD], axis=1)
    in_proj = lambda name: Projection((d_model, h, dh), ("embed", "heads", "head_dim"),
                                      dtype=self.dtype, name=name)
    q = in_proj("query")(x_BxTxD)
    k = in_proj("key")(kv_BxKxD)
    v = in_proj("value")(kv_BxKxD)
    r_KxHxDh = in_proj("rel")(r_KxD)
    q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
    k = nn.with_logical_constraint(k, ("batch", "length", "heads", "head_dim"))
    v = nn.with_logical_constraint(v, ("batch", "length", "heads", "head_dim"))

    bias_init = nn.with_logical_partitioning(nn.initializers.zeros, ("heads", "head_dim"))
    u_HxDh = self.param("content_bias", bias_init, (h, dh)).astype(self.dtype)
    v_HxDh = self.param("position_bias", bias_init, (h, dh)).astype(self.dtype)

    scale = 1.0 / math.sqrt(dh)
    head_major = lambda x: jnp.moveaxis(x, 2, 0)
    qu = head_major((q + u_HxDh) * scale)
    qv = head_major((q + v_HxDh) * scale)
    r_pad = jnp.pad(jnp.moveaxis(r_KxHxDh, 1, 0), [(0, 0), (1, 0), (0, 0)])
    qp = pk = pv = pw = None
    if self._stored_slots():
      pk, pv = self._persistent_vectors(h, dh)
      qp = qu if self.persistent_content_bias else head_major(q * scale)
    stats = {}
    if self._has_gates("persistent_logits", self.gate.persistent_group):
      # Before the head gates: a model without these draws its head gates as it did.
      g_HxG, stats = self._persistent_gates(h, deterministic, sample_gates)
      pw = jnp.repeat(g_HxG, self.gate.persistent_group, axis=1).astype(self.dtype)
    rate = 0.0 if deterministic else self.dropout_attn
    if not 0.0 <= rate < 1.0:
      raise ValueError(f"Attention dropout must lie in [0, 1), got {rate}.")
    keys_2x2 = (jax.random.bits(self.make_rng("dropout"), (2, 2), jnp.uint32) if rate
                else None)
    score_dtype = jnp.dtype(self.dtype if self.score_dtype == "compute" else self.score_dtype)

    def core(first, last, slots):
      """The core on heads first..last-1 and their first `slots` persistent slots."""
      whole = (first, last, slots) == (0, h, self._stored_slots())
      heads = lambda x: x if whole or x is None else x[first:last]
      slot_vectors = lambda x: None if not slots else x if whole else x[first:last, :slots]
      args = (heads(qu), heads(qv), heads(qp) if slots else None, heads(head_major(k)),
              heads(head_major(v)), heads(r_pad), slot_vectors(pk), slot_vectors(pv))
      # Each run of heads draws its own dropout masks (the hash counts heads from 0).
      keys = keys_2x2 if keys_2x2 is None or not first else keys_2x2 + jnp.uint32(first)
      block = xla_core.divisor_at_most(last - first, self.head_block or h)
      if core_choice.use_split(self.attention_impl, rate):
        return split_core.attend(rate, block, self.remat, score_dtype, *args, mask_TxK, keys,
                                 pw, persistent=self.persistent_impl)
      return xla_core.attend(rate, block, self.remat, score_dtype, *args, mask_TxK,
                             keys, pw)

    runs = self._head_runs(h)
    out_HxBxTxDh = (core(*runs[0]) if len(runs) == 1
                    else jnp.concatenate([core(*run) for run in runs]))
    if self.is_mutable_collection("intermediates"):
      # For head analysis (experiments/heuristics.py) only: a train or eval step never
      # makes this collection mutable, so it never pays for the extra weights.
      self.sow("intermediates", "attention_probs",
               xla_core.attention_weights(qu, qv, qp, head_major(k), r_pad, pk,
                                          mask_TxK, pw=self._slot_weights(pw)))
    out_BxTxHxDh = jnp.moveaxis(out_HxBxTxDh, 0, 2)

    if self._has_gates("logits", self.gate.heads):
      g_H, head_stats = self._gates(h, deterministic, sample_gates)
      stats = {**head_stats, **stats}
      combine_H = g_H * gates_lib.output_scale(g_H, self.gate)
      out_BxTxHxDh = out_BxTxHxDh * combine_H[:, None].astype(self.dtype)

    out = Projection((h, dh, d_model), ("heads", "head_dim", "embed"), num_in=2,
                     use_bias=self.out_bias, dtype=self.dtype, name="out")(out_BxTxHxDh)
    return out, stats

  def _head_runs(self, h) -> list[tuple[int, int, int]]:
    """(first head, end, persistent slots) of each run of heads the core attends at
    once: all heads with all N slots, or, in an export whose heads keep different
    numbers of slots (`slot_counts`, non-increasing), each run of equal counts with
    its own (ragged: no slot of another head's count is computed)."""
    counts = self.slot_counts or (self._stored_slots(),) * h
    runs = []
    for head, count in enumerate(counts):
      if runs and runs[-1][2] == count:
        runs[-1][1] = head + 1
      else:
        runs.append([head, head + 1, count])
    return [tuple(run) for run in runs]

  def _slot_weights(self, pw):
    """`pw`, or an export's padding slots at weight 0 (every slot else at 1)."""
    if pw is not None or self.slot_counts is None:
      return pw
    counts_Hx1 = jnp.asarray(self.slot_counts)[:, None]
    return (jnp.arange(self._stored_slots())[None, :]
            < counts_Hx1).astype(self.dtype)

  def _stored_slots(self) -> int:
    """The persistent slots each head's arrays hold (an export's largest count)."""
    return max(self.slot_counts) if self.slot_counts else self.num_persistent

  def _has_gates(self, name: str, asked) -> bool:
    """Whether the gates `name` take part: passed in the `gates` collection, or made
    at init for a gated module whose `gate` asks for them."""
    return self.has_variable("gates", name) or (
        self.is_initializing() and self.gated and bool(asked))

  def _persistent_vectors(self, h, dh):
    """Persistent keys/values at the same scale as context keys/values.

    Stored at a small scale (N(0, 1/dh) keys, N(0, 1/N) values) and scaled up at use,
    as in the All-attention reference, so their effective entries start at unit
    variance like LayerNorm-ed context keys and values.
    """
    n, stored = self.num_persistent, self._stored_slots()
    names = ("heads", "persistent", "head_dim")
    pk = self.param("persistent_key", nn.with_logical_partitioning(
        nn.initializers.normal(1.0 / math.sqrt(dh)), names), (h, stored, dh))
    pv = self.param("persistent_value", nn.with_logical_partitioning(
        nn.initializers.normal(1.0 / math.sqrt(n)), names), (h, stored, dh))
    return ((pk * math.sqrt(dh)).astype(self.dtype),
            (pv * math.sqrt(n)).astype(self.dtype))

  def _gates(self, h, deterministic, sample_gates):
    logits_H = self.variable(
        "gates", "logits",
        nn.with_logical_partitioning(nn.initializers.constant(self.gate.init), ("heads",)),
        None, (h,)).value
    g_H = self._gate_values(logits_H, deterministic, sample_gates)
    stats = {"open_prob": gates_lib.open_probability(logits_H, self.gate), "open": g_H}
    return g_H, stats

  def _persistent_gates(self, h, deterministic, sample_gates):
    """One gate per group of `gate.persistent_group` persistent slots of each head:
    (H, N / group) values and their statistics."""
    groups = self.num_persistent // self.gate.persistent_group
    logits_HxG = self.variable(
        "gates", "persistent_logits",
        nn.with_logical_partitioning(nn.initializers.constant(self.gate.init),
                                     ("heads", "persistent_groups")),
        None, (h, groups)).value
    g_HxG = self._gate_values(logits_HxG, deterministic, sample_gates)
    stats = {"persistent_open_prob": gates_lib.open_probability(logits_HxG, self.gate),
             "persistent_open": g_HxG}
    return g_HxG, stats

  def _gate_values(self, logits, deterministic, sample_gates):
    if sample_gates and not deterministic:
      return gates_lib.sample(logits, self.make_rng("gates"), self.gate)
    return gates_lib.deterministic(logits, self.gate)
