"""All-attention and Transformer-XL language models with Transformer-XL memory.

Pre-norm layers around one `RelativeAttention`:
  All-att:  x + Attn(LN(x), LN(mem))                          (persistent vectors, no FF)
  TXL:      x + Attn(LN(x), LN(mem));  x + FF(LN(x))           (d_ff = 4d)
Layers may have different head counts; a layer with none passes its input through
(All-att) or keeps its feed-forward (TXL), plus W_O's bias if it has one. Defaults the
paper leaves open follow its official code (`out_bias`, `layer_norm_eps`, `final_norm`,
`persistent_content_bias`, `same_length`). Memory is {'hidden': (L, B, S, D),
'length': int32}: each layer's inputs over the last S positions, `length` of them real.
"""
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from allatt_jax.model import adaptive
from allatt_jax.model.attention import relative
from allatt_jax.config import run_config

KINDS = ("allatt", "txl")
# The parameter of a headless layer holding its removed output projection's bias.
HEADLESS_OUT_BIAS = "attention_out_bias"


@dataclasses.dataclass(frozen=True)
class ModelConfig(run_config.ModelSection):
  """The `model` section as a run builds it: `max_relative_len` resolved (the run's
  longest context where 0), and the gates the model creates."""
  gated: bool = False                # create head gates at init
  gate: run_config.GatesSection = run_config.GatesSection()

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def layer_heads(self) -> tuple[int, ...]:
    return self.heads_per_layer or (self.num_heads,) * self.num_layers

  def head_slots(self, layer: int) -> tuple[int, ...]:
    """The persistent slots each head of `layer` keeps."""
    if self.kind != "allatt":
      return (0,) * self.layer_heads[layer]
    if self.persistent_slots is None:
      return (self.num_persistent,) * self.layer_heads[layer]
    return self.persistent_slots[layer]

  @property
  def layer_slots(self) -> list[int]:
    """The persistent slots each layer keeps, summed over its heads."""
    return [sum(self.head_slots(i)) for i in range(self.num_layers)]

  @classmethod
  def from_config(cls, config: run_config.RunConfig, **overrides) -> "ModelConfig":
    """The ModelConfig of a run config (a ConfigDict of the same shape reads the same):
    the one place a model's hyper-parameters are read."""
    config = run_config.RunConfig.of(config)
    section = config.model
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    values["max_relative_len"] = config.relative_table_len
    if not section.cutoffs and section.div_val > 1:
      # Adaptive input/softmax asked for (div_val) without cutoffs: sized from the vocabulary.
      values["cutoffs"] = adaptive.default_cutoffs(config.data.name, section.vocab_size)
    return cls(**{**values, "gated": config.gates.enabled, "gate": config.gates,
                  **overrides})


def init_memory(cfg: ModelConfig, batch_size: int, mem_len: int) -> dict[str, jax.Array]:
  return {"hidden": jnp.zeros((cfg.num_layers, batch_size, mem_len, cfg.d_model),
                              jnp.dtype(cfg.dtype)),
          "length": jnp.zeros((), jnp.int32)}


class FeedForward(nn.Module):
  d_ff: int
  dropout: float
  dtype: Any

  @nn.compact
  def __call__(self, x_BxTxD, *, deterministic):
    d_model = x_BxTxD.shape[-1]
    dense = lambda features, names, name: nn.Dense(
        features, dtype=self.dtype, name=name,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]))
    h = nn.relu(dense(self.d_ff, ("embed", "mlp"), "wi")(x_BxTxD))
    h = nn.Dropout(self.dropout)(h, deterministic=deterministic)
    return dense(d_model, ("mlp", "embed"), "wo")(h)


def _layer_norm(name, cfg: ModelConfig):
  return nn.LayerNorm(
      epsilon=cfg.layer_norm_eps, dtype=jnp.dtype(cfg.dtype), name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


class Layer(nn.Module):
  cfg: ModelConfig
  num_heads: int
  index: int

  @nn.compact
  def __call__(self, x_BxTxD, mem_BxSxD, r_KxD, mask_TxK, *, deterministic, sample_gates):
    cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
    drop = nn.Dropout(cfg.dropout)
    stats = {}
    if self.num_heads:
      norm = _layer_norm("attention_norm", cfg)
      num_persistent = cfg.num_persistent if cfg.kind == "allatt" else 0
      slots = cfg.head_slots(self.index)
      attn_out, stats = relative.RelativeAttention(
          num_heads=self.num_heads, head_dim=cfg.head_dim, num_persistent=num_persistent,
          slot_counts=None if set(slots) == {num_persistent} else slots,
          dropout_attn=cfg.dropout_attn, head_block=cfg.head_block, remat=cfg.remat,
          score_dtype=cfg.score_dtype,
          attention_impl=cfg.attention_impl, persistent_impl=cfg.persistent_impl,
          persistent_content_bias=cfg.persistent_content_bias, out_bias=cfg.out_bias,
          gated=cfg.gated, gate=cfg.gate, dtype=dtype, name="attention")(
              norm(x_BxTxD), norm(mem_BxSxD), r_KxD, mask_TxK, deterministic=deterministic,
              sample_gates=sample_gates)
      x_BxTxD = x_BxTxD + drop(attn_out, deterministic=deterministic)
    elif cfg.out_bias:
      # All heads removed: the gated layer's output projection of nothing was its bias.
      bias_D = self.param(HEADLESS_OUT_BIAS, nn.with_logical_partitioning(
          nn.initializers.zeros, ("embed",)), (x_BxTxD.shape[-1],))
      x_BxTxD = x_BxTxD + drop(jnp.broadcast_to(bias_D.astype(dtype), x_BxTxD.shape),
                               deterministic=deterministic)
    if cfg.kind == "txl":
      ff_out = FeedForward(cfg.d_ff, cfg.dropout, dtype, name="feed_forward")(
          _layer_norm("feed_forward_norm", cfg)(x_BxTxD), deterministic=deterministic)
      x_BxTxD = x_BxTxD + drop(ff_out, deterministic=deterministic)
    return nn.with_logical_constraint(x_BxTxD, ("batch", "length", "embed")), stats


class TransformerLM(nn.Module):
  """Language model over token segments with memory.

  `__call__` returns per-token NLL (training and evaluation); `log_probs` returns
  full-vocabulary log-probabilities (scoring and sampling). Both return the memory
  for the next segment and per-layer gate statistics (empty without gates).
  """
  cfg: ModelConfig

  @classmethod
  def from_config(cls, config: run_config.RunConfig, **overrides) -> "TransformerLM":
    return cls(ModelConfig.from_config(config, **overrides))

  def setup(self):
    cfg = self.cfg
    if cfg.kind not in KINDS:
      raise ValueError(f"Unknown model kind {cfg.kind!r}; expected one of {KINDS}.")
    self.embedding = adaptive.AdaptiveEmbedding(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, cutoffs=cfg.cutoffs,
        div_val=cfg.div_val, tie_projs=cfg.tie_projs, dtype=jnp.dtype(cfg.dtype),
        vocab_block=cfg.vocab_block, tail_capacity=cfg.tail_capacity,
        cluster_fractions=cfg.cluster_fractions)
    if cfg.rel_pos == "learned":
      self.relative_table = self.param(
          "relative_table", nn.with_logical_partitioning(
              nn.initializers.normal(0.02), ("relpos", "embed")),
          (cfg.max_relative_len, cfg.d_model))
    self.layers = [Layer(cfg, h, i, name=f"layer_{i}") for i, h in enumerate(cfg.layer_heads)]
    self.final_norm = _layer_norm("final_norm", cfg) if cfg.final_norm else None
    self.drop_emb = nn.Dropout(cfg.dropout_emb)
    self.drop = nn.Dropout(cfg.dropout)

  def _relative_positions(self, length: int) -> jax.Array:
    """Relative position vectors for distances length-1 .. 0."""
    if self.cfg.rel_pos == "learned":
      if length > self.cfg.max_relative_len:
        raise ValueError(
            f"Segment plus memory length {length} exceeds the learned relative position "
            f"table ({self.cfg.max_relative_len}); raise model.max_relative_len or use "
            "rel_pos='sinusoidal'.")
      return self.relative_table[:length][::-1]
    return relative.sinusoidal_positions(length, self.cfg.d_model)

  def hidden(self, inputs_BxT, memory, *, deterministic=True, sample_gates=False):
    """Final hidden states, the next memory and gate statistics."""
    cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
    seq_len, mem_len = inputs_BxT.shape[1], memory["hidden"].shape[2]
    mask_TxK = relative.attention_mask(seq_len, mem_len, memory["length"], cfg.same_length,
                                       cfg.same_length_keys)
    r_KxD = self.drop_emb(self._relative_positions(mem_len + seq_len).astype(dtype),
                          deterministic=deterministic)
    x_BxTxD = self.drop_emb(self.embedding.embed(inputs_BxT), deterministic=deterministic)
    x_BxTxD = nn.with_logical_constraint(x_BxTxD, ("batch", "length", "embed"))
    entering, stats = [], []
    for layer, mem_BxSxD in zip(self.layers, memory["hidden"]):
      entering.append(x_BxTxD)
      x_BxTxD, layer_stats = layer(x_BxTxD, mem_BxSxD.astype(dtype), r_KxD, mask_TxK,
                                   deterministic=deterministic, sample_gates=sample_gates)
      # Kept only where 'intermediates' is mutable (distillation's hidden-state term).
      self.sow("intermediates", "layer_outputs", x_BxTxD)
      stats.append(layer_stats)
    if self.final_norm is not None:
      x_BxTxD = self.final_norm(x_BxTxD)
    out_BxTxD = self.drop(x_BxTxD, deterministic=deterministic)
    new_memory = _next_memory(memory, jnp.stack(entering), seq_len)
    return out_BxTxD, new_memory, tuple(stats)

  def __call__(self, inputs_BxT, targets_BxT, memory, *, deterministic=True,
               sample_gates=False):
    out_BxTxD, new_memory, stats = self.hidden(
        inputs_BxT, memory, deterministic=deterministic, sample_gates=sample_gates)
    return self.embedding.nll(out_BxTxD, targets_BxT), new_memory, stats

  def distill_outputs(self, inputs_BxT, targets_BxT, memory, *, deterministic=True,
                      sample_gates=False):
    """As `__call__`, with the output layer's clusters (`AdaptiveEmbedding.clusters`)
    after the per-token NLL, for a distillation loss against another model's."""
    out_BxTxD, new_memory, stats = self.hidden(
        inputs_BxT, memory, deterministic=deterministic, sample_gates=sample_gates)
    return (self.embedding.nll(out_BxTxD, targets_BxT), self.embedding.clusters(out_BxTxD),
            new_memory, stats)

  def log_probs(self, inputs_BxT, memory):
    out_BxTxD, new_memory, _ = self.hidden(inputs_BxT, memory)
    return self.embedding.log_probs(out_BxTxD), new_memory


def _next_memory(memory, entering_LxBxTxD, seq_len):
  mem_len = memory["hidden"].shape[2]
  if mem_len == 0:
    return memory
  hidden = jnp.concatenate(
      [memory["hidden"], entering_LxBxTxD.astype(memory["hidden"].dtype)], axis=2)
  return {"hidden": jax.lax.stop_gradient(hidden[:, :, -mem_len:]),
          "length": jnp.minimum(memory["length"] + seq_len, mem_len)}


def abstract_variables(cfg: ModelConfig):
  """Shapes of `TransformerLM(cfg)`'s variables (boxed with their logical axes), from
  tracing its init on a one-token batch: nothing is allocated."""
  # A tree of its own for each caller, over the traced leaves (immutable).
  return jax.tree.map(lambda leaf: leaf, _traced_variables(cfg))


# The budget's checks and costs ask for the same few configs again and again (a run's
# start: 9 calls over 3 configs, 3 s of tracing for a WikiText-103 budget run).
@functools.lru_cache(maxsize=64)
def _traced_variables(cfg: ModelConfig):
  tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(TransformerLM(cfg).init, jax.random.key(0), tokens_1x1, tokens_1x1,
                        init_memory(cfg, 1, 1))


def l0_penalty(stats, group_share: float | None = None) -> jax.Array:
  """The L0 term: the expected number of open heads over all layers; with persistent
  groups (`group_share`: a group's share of a head's cost), each head counts the
  share of its cost that its expected open groups keep, Σ_h P_h·(1 − n·s + s·Σ_g Q_hg)
  for n groups per head (a head not gated counts P_h = 1)."""
  if group_share is None:
    return sum(jnp.sum(s["open_prob"]) for s in stats if s)
  total = jnp.zeros(())
  for s in stats:
    if not s:
      continue
    groups_HxG = s["persistent_open_prob"]
    size_H = 1.0 - group_share * (groups_HxG.shape[1] - jnp.sum(groups_HxG, axis=1))
    total += jnp.sum(size_H * s["open_prob"]) if "open_prob" in s else jnp.sum(size_H)
  return total
