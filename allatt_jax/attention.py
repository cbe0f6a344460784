"""Relative multi-head attention with Transformer-XL memory, persistent vectors and head gates.

One module serves both models: the All-attention layer (N persistent key/value
vectors per head under the same softmax as the context, Sukhbaatar et al. 2019) and
the Transformer-XL attention (N = 0). Scores follow Transformer-XL (Dai et al. 2019):

  score(i, j) = (q_i + u)·k_j + (q_i + v)·W_R r_{i-j}        for context keys j
  score(i, n) = (q_i + u)·p^K_n                               for persistent slot n

Keys are [memory (S slots), current segment (T)], so K = S + T. Relative distances
run over 0..K-1 and are looked up with the usual rel_shift trick.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from allatt_jax import gates as gates_lib

_NEG_INF = -1e30


def rel_shift(x_BxHxTxK: jax.Array) -> jax.Array:
  """Re-indexes scores against a descending position table into query-key layout.

  Input column m holds the score against relative distance K-1-m. Query i sits at
  key position S+i = K-T+i, so its score for key j lives in column j + T-1-i. The
  pad-reshape trick realigns every row with one reshape instead of a gather; entries
  for future keys (j > S+i) become garbage, which the causal mask removes.
  """
  *lead, t, k = x_BxHxTxK.shape
  x = jnp.pad(x_BxHxTxK, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])
  x = x.reshape(*lead, k + 1, t)[..., 1:, :]
  return x.reshape(*lead, t, k)


def attention_mask(seq_len: int, mem_len: int, mem_valid: jax.Array,
                   same_length: bool) -> jax.Array:
  """Boolean (T, S+T) mask: query i (key position S+i) may see key j.

  Memory slots hold the last `mem_valid` positions right-aligned; earlier slots are
  empty at the start of a stream. With `same_length` every query sees exactly S
  context keys, as in Transformer-XL's evaluation setting.
  """
  q_T1 = jnp.arange(seq_len)[:, None] + mem_len
  k_1K = jnp.arange(mem_len + seq_len)[None, :]
  mask = (k_1K <= q_T1) & (k_1K >= mem_len - mem_valid)
  if same_length and mem_len > 0:
    mask &= k_1K > q_T1 - mem_len
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
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal(in_axis=tuple(range(self.num_in)),
                                        out_axis=tuple(range(self.num_in, len(self.shape))))
    kernel = self.param("kernel", nn.with_logical_partitioning(init, self.names), self.shape)
    return jnp.tensordot(x.astype(self.dtype), kernel.astype(self.dtype), axes=self.num_in)


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
  gated: bool = False
  gate: gates_lib.GateConfig = gates_lib.GateConfig()
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
    qu = (q + u_HxDh) * scale
    qv = (q + v_HxDh) * scale
    f32 = jnp.float32
    content = jnp.einsum("bthd,bkhd->bhtk", qu, k, preferred_element_type=f32)
    position = rel_shift(jnp.einsum("bthd,khd->bhtk", qv, r_KxHxDh,
                                    preferred_element_type=f32))
    ctx_BxHxTxK = jnp.where(mask_TxK, content + position, _NEG_INF)

    if self.num_persistent:
      pk, pv = self._persistent_vectors(h, dh)
      pers_BxHxTxN = jnp.einsum("bthd,hnd->bhtn", qu, pk, preferred_element_type=f32)
      # One softmax over [context, persistent] without concatenating the two.
      top = jnp.maximum(ctx_BxHxTxK.max(-1, keepdims=True),
                        pers_BxHxTxN.max(-1, keepdims=True))
      e_ctx = jnp.exp(ctx_BxHxTxK - top)
      e_pers = jnp.exp(pers_BxHxTxN - top)
      norm = e_ctx.sum(-1, keepdims=True) + e_pers.sum(-1, keepdims=True)
      p_ctx, p_pers = e_ctx / norm, e_pers / norm
    else:
      p_ctx = jax.nn.softmax(ctx_BxHxTxK, axis=-1)

    dropout = nn.Dropout(self.dropout_attn)
    p_ctx = dropout(p_ctx, deterministic=deterministic).astype(self.dtype)
    out_BxTxHxDh = jnp.einsum("bhtk,bkhd->bthd", p_ctx, v)
    if self.num_persistent:
      p_pers = dropout(p_pers, deterministic=deterministic).astype(self.dtype)
      out_BxTxHxDh += jnp.einsum("bhtn,hnd->bthd", p_pers, pv)

    stats = {}
    if self.has_variable("gates", "logits") or (self.is_initializing() and self.gated):
      g_H, stats = self._gates(h, deterministic, sample_gates)
      combine_H = g_H * gates_lib.output_scale(g_H, self.gate)
      out_BxTxHxDh = out_BxTxHxDh * combine_H[:, None].astype(self.dtype)

    out = Projection((h, dh, d_model), ("heads", "head_dim", "embed"), num_in=2,
                     dtype=self.dtype, name="out")(out_BxTxHxDh)
    return out, stats

  def _persistent_vectors(self, h, dh):
    """Persistent keys/values at the same scale as context keys/values.

    Stored at a small scale (N(0, 1/dh) keys, N(0, 1/N) values) and scaled up at use,
    as in the All-attention reference, so their effective entries start at unit
    variance like LayerNorm-ed context keys and values.
    """
    n = self.num_persistent
    names = ("heads", "persistent", "head_dim")
    pk = self.param("persistent_key", nn.with_logical_partitioning(
        nn.initializers.normal(1.0 / math.sqrt(dh)), names), (h, n, dh))
    pv = self.param("persistent_value", nn.with_logical_partitioning(
        nn.initializers.normal(1.0 / math.sqrt(n)), names), (h, n, dh))
    return ((pk * math.sqrt(dh)).astype(self.dtype),
            (pv * math.sqrt(n)).astype(self.dtype))

  def _gates(self, h, deterministic, sample_gates):
    logits_H = self.variable(
        "gates", "logits",
        nn.with_logical_partitioning(nn.initializers.constant(self.gate.init), ("heads",)),
        None, (h,)).value
    if sample_gates and not deterministic:
      g_H = gates_lib.sample(logits_H, self.make_rng("gates"), self.gate)
    else:
      g_H = gates_lib.deterministic(logits_H, self.gate)
    stats = {"open_prob": gates_lib.open_probability(logits_H, self.gate), "open": g_H}
    return g_H, stats
