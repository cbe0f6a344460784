r"""The cost model: parameter counts and forward MACs of a model, before and after head
pruning, and a pruning budget as a number of heads.

Parameters come from the real parameter tree (`jax.eval_shape` of init), and the
per-layer formula must agree with it. MACs per token of a forward pass of B segments
of length T with memory S (K = S + T keys), per layer with h heads of size dh:

    query projection                    d·h·dh
    key, value projections    2·(K/T)·d·h·dh     (memory keys are recomputed per segment)
    relative projection     (K/(B·T))·d·h·dh     (shared by the batch)
    content + position scores     2·K·h·dh
    persistent scores + values    2·N·h·dh       (All-att)
    context values                  K·h·dh
    output projection               h·dh·d
    feed-forward                  2·d·d_ff       (TXL)
  output layer: d·V (plain softmax), or the adaptive head at every position and each
  tail cluster at the positions it runs for (with `model.tail_capacity` its capacity,
  else every position: `macs_per_token_every_tail`): the MACs that run.
  input layer: with div_val > 1, Σ_i d_i·d (the adaptive input projects every
  cluster's lookup at every position); a plain embedding is a lookup.

Elementwise work (softmax, LayerNorm, rel_shift) is left out: a few percent of the
total at the sizes that matter, which the XLA cross-check bounds.
"""
import dataclasses
import math

import jax

from allatt_jax.model import adaptive
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config
from allatt_jax.model import vocab_logsumexp
from allatt_jax.config.errors import ConfigError

EMBEDDING_PARAMS = ("embedding", "relative_table")


def _layer_slots(cfg: model_lib.ModelConfig, heads: int, slots: int | None) -> int:
  """A layer's persistent slots, summed over its heads: `slots`, or N per head."""
  if cfg.kind != "allatt":
    return 0
  return heads * cfg.num_persistent if slots is None else slots


def layer_param_count(cfg: model_lib.ModelConfig, heads: int,
                      slots: int | None = None) -> int:
  """A layer's parameters with `heads` heads holding `slots` persistent slots in all
  (None: N each)."""
  d, dh = cfg.d_model, cfg.head_dim
  count = d if cfg.out_bias else 0   # W_O's bias outlives the layer's last head
  if heads:
    count += 5 * d * heads * dh + 2 * heads * dh + 2 * d   # Q K V O R, u v, LayerNorm
    count += 2 * _layer_slots(cfg, heads, slots) * dh
  if cfg.kind == "txl":
    count += 2 * d * cfg.d_ff + cfg.d_ff + d + 2 * d
  return count


def layer_macs_per_token(cfg: model_lib.ModelConfig, heads: int, seq_len: int,
                         mem_len: int, batch_size: int, slots: int | None = None) -> float:
  """A layer's forward MACs per token with `heads` heads holding `slots` persistent
  slots in all (None: N each)."""
  d, dh = cfg.d_model, cfg.head_dim
  hd, keys = heads * dh, seq_len + mem_len
  macs = 0.0
  if heads:
    macs += d * hd * (1 + 2 * keys / seq_len + keys / (batch_size * seq_len) + 1)
    macs += 3 * keys * hd
    macs += 2 * _layer_slots(cfg, heads, slots) * dh
  if cfg.kind == "txl":
    macs += 2 * d * cfg.d_ff
  return macs


def output_macs_per_token(cfg: model_lib.ModelConfig,
                          positions: int | None = None) -> float:
  """The output layer's forward MACs per position, when a step scores `positions`
  positions on a device (its tail clusters then run at their capacity; None: every
  position pays for every tail)."""
  d, v = cfg.d_model, cfg.vocab_size
  if not cfg.cutoffs:
    return d * v
  bounds = adaptive.cluster_bounds(v, cfg.cutoffs)
  fractions = cfg.cluster_fractions or vocab_logsumexp.zipf_fractions(bounds)
  macs = d * (cfg.cutoffs[0] + len(cfg.cutoffs))        # head: shortlist + cluster logits
  for i, ((lo, hi), d_i) in enumerate(zip(bounds, adaptive.cluster_dims(
      d, len(bounds), cfg.div_val))):
    cluster = (d * d_i if cfg.div_val > 1 else 0)        # projection to the cluster's width
    if i:
      cluster += d_i * (hi - lo)
      if positions and cfg.tail_capacity:
        cluster *= vocab_logsumexp.tail_capacity(positions, fractions[i],
                                                 cfg.tail_capacity) / positions
    macs += cluster
  return macs


def input_macs_per_token(cfg: model_lib.ModelConfig) -> float:
  """The input layer's forward MACs per position: with div_val > 1 each cluster's
  (d_i, d) projection, which `adaptive.AdaptiveEmbedding.embed` runs at every position
  (static shapes), else none (a lookup)."""
  if not cfg.cutoffs or cfg.div_val <= 1:
    return 0.0
  dims = adaptive.cluster_dims(cfg.d_model, len(cfg.cutoffs) + 1, cfg.div_val)
  return float(sum(d_i * cfg.d_model for d_i in dims))


def param_counts(cfg: model_lib.ModelConfig) -> dict[str, int]:
  """Embedding / non-embedding / total parameter counts of the real tree, without an
  export's padding slots (zeros the model never reads)."""
  params = model_lib.abstract_variables(cfg)["params"]
  size = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
  embedding = sum(size(params[k]) for k in EMBEDDING_PARAMS if k in params)
  total = size(params) - 2 * cfg.head_dim * padding_slots(cfg)
  return {"params_non_embedding": total - embedding, "params_embedding": embedding,
          "params_total": total}


def padding_slots(cfg: model_lib.ModelConfig) -> int:
  """The persistent slots an export stores beyond its heads' counts (each layer's
  arrays hold every head at the layer's largest count)."""
  if cfg.kind != "allatt" or cfg.persistent_slots is None:
    return 0
  return sum(len(slots) * max(slots, default=0) - sum(slots)
             for slots in cfg.persistent_slots)


def macs_per_token(cfg: model_lib.ModelConfig, seq_len: int, mem_len: int,
                   batch_size: int) -> dict[str, float]:
  """Forward MACs per token of a step on B = `batch_size` segments: the attention
  stack's, and with the input and output layers' as they run; where tail capacities
  make that less than every position paying for every tail, that count too."""
  layers = sum(layer_macs_per_token(cfg, h, seq_len, mem_len, batch_size, slots)
               for h, slots in zip(cfg.layer_heads, cfg.layer_slots))
  with_input = layers + input_macs_per_token(cfg)
  macs = {"macs_per_token_non_embedding": layers,
          "macs_per_token": with_input + output_macs_per_token(cfg, batch_size * seq_len)}
  every_tail = with_input + output_macs_per_token(cfg)
  if every_tail != macs["macs_per_token"]:
    macs["macs_per_token_every_tail"] = every_tail
  return macs


def _heads(cfg: model_lib.ModelConfig) -> dict:
  """The heads of each layer and their persistent slots: per layer, and per head in
  the model's order of heads, the indices `api.Model.prune_heads` takes (an export
  numbers each layer's heads anew, most slots first: `head_removal.remove_heads`)."""
  return {"heads_per_layer": list(cfg.layer_heads),
          "persistent_per_layer": cfg.layer_slots,
          "persistent_per_head": [list(cfg.head_slots(i)) for i in range(cfg.num_layers)]}


def report(cfg: model_lib.ModelConfig, seq_len: int, mem_len: int, batch_size: int,
           heads_kept: float | None = None) -> dict:
  """The cost report; with `heads_kept`, also relative to the unpruned model."""
  full = {**param_counts(cfg), **macs_per_token(cfg, seq_len, mem_len, batch_size),
          **_heads(cfg), "seq_len": seq_len, "mem_len": mem_len, "batch_size": batch_size}
  if heads_kept is None:
    return full
  pruned_cfg = prune_uniformly(cfg, heads_kept)
  pruned = {**param_counts(pruned_cfg),
            **macs_per_token(pruned_cfg, seq_len, mem_len, batch_size),
            **_heads(pruned_cfg)}
  pruned["relative_params"] = (pruned["params_non_embedding"]
                               / full["params_non_embedding"])
  pruned["relative_macs"] = (pruned["macs_per_token_non_embedding"]
                             / full["macs_per_token_non_embedding"])
  return {**full, **pruned, "heads_kept": heads_kept,
          "unpruned": {k: full[k] for k in ("params_non_embedding",
                                            "macs_per_token_non_embedding")}}


def model_report(config: run_config.RunConfig, cfg: model_lib.ModelConfig,
                 heads_kept: float | None = None) -> dict:
  """The cost report of a trained model `cfg` at its run config's eval lengths."""
  e = config.eval
  return report(cfg, e.seq_len, e.mem_len, e.batch_size, heads_kept)


def prune_uniformly(cfg: model_lib.ModelConfig, heads_kept: float) -> model_lib.ModelConfig:
  """The same model keeping round(F·H) heads in every layer."""
  if not 0.0 <= heads_kept <= 1.0:
    raise ValueError(f"--heads_kept must lie in [0, 1], got {heads_kept}.")
  heads = tuple(round(heads_kept * h) for h in cfg.layer_heads)
  slots = (None if cfg.persistent_slots is None else
           tuple(layer[:h] for layer, h in zip(cfg.persistent_slots, heads)))
  return dataclasses.replace(cfg, heads_per_layer=heads, persistent_slots=slots)


# --- Budgets: a pruning run's requested size as a number of open heads (budget.py
# steers the gates to it).

def _budget_cost(cfg: model_lib.ModelConfig, key: str, eval_lengths) -> float:
  """Non-embedding params or MACs per token of `cfg`; the vocabulary (maybe not known
  yet: `model.vocab_size` 0) counts in neither."""
  cfg = dataclasses.replace(cfg, vocab_size=1, cutoffs=(), div_val=1, tie_projs=None,
                            cluster_fractions=())
  if key == "target_params":
    return param_counts(cfg)["params_non_embedding"]
  return macs_per_token(cfg, *eval_lengths)["macs_per_token_non_embedding"]


def unpruned_cost(config: run_config.RunConfig, cfg: model_lib.ModelConfig) -> float:
  """What the config's params or MACs budget measures of its unpruned model `cfg`: the
  non-embedding parameters, or MACs per token at the eval lengths."""
  e = config.eval
  return _budget_cost(cfg, config.gates.budget_target, (e.seq_len, e.mem_len, e.batch_size))


def budget_value(config: run_config.RunConfig, cfg: model_lib.ModelConfig) -> float:
  """The figure the config's params or MACs budget prunes to (`cfg`: the unpruned
  model): the value set, or, for a value in (0, 1), that fraction of `unpruned_cost`,
  as target_sparsity is a fraction of the heads (no budget of under one parameter or
  MAC means anything else). Parameters are whole: a budget of 0.5 of 1,001 keeps at
  most 500."""
  key = config.gates.budget_target
  return budget_figure(key, getattr(config.gates, key), unpruned_cost(config, cfg))


def budget_figure(key: str, value: float, unpruned: float) -> float:
  """`budget_value` of a `key` budget set to `value`, where the unpruned model costs
  `unpruned`."""
  if 0 < value < 1:
    value *= unpruned
  return math.floor(value) if key == "target_params" else value


def head_cost(cfg: model_lib.ModelConfig, key: str, eval_lengths) -> tuple[float, float]:
  """(cost of the unpruned model, cost of one head) in params or MACs per token.

  Uses layer 0: all heads of all layers cost the same in this model family.
  """
  one_fewer = dataclasses.replace(
      cfg, heads_per_layer=(cfg.layer_heads[0] - 1, *cfg.layer_heads[1:]))
  full = _budget_cost(cfg, key, eval_lengths)
  return full, full - _budget_cost(one_fewer, key, eval_lengths)


@dataclasses.dataclass(frozen=True)
class BudgetScale:
  """What a budget key measures of the model when n of its `total` heads stay open.

  Head sparsity is 1 − n/total. Params and MACs: every head costs the same
  (`per_head`), so a model with n heads costs at most `full` − (total − n)·`per_head`
  (a layer's last head also takes its LayerNorm along); with none it costs `empty`,
  what no head holds (embeddings aside: W_O's biases, a TXL's feed-forward).
  """
  key: str
  total: int
  full: float = 1.0
  per_head: float = 0.0
  empty: float = 0.0

  @classmethod
  def of(cls, config: run_config.RunConfig, cfg: model_lib.ModelConfig) -> "BudgetScale":
    """The scale of the config's budget key (`cfg`: the run's model)."""
    key, total = config.gates.budget_target, sum(cfg.layer_heads)
    if key == "target_sparsity":
      return cls(key, total)
    e = config.eval
    lengths = (e.seq_len, e.mem_len, e.batch_size)
    full, per_head = head_cost(cfg, key, lengths)
    no_heads = dataclasses.replace(cfg, heads_per_layer=(0,) * cfg.num_layers)
    return cls(key, total, full, per_head, _budget_cost(no_heads, key, lengths))

  def measure(self, heads: int) -> float:
    """The budget's value of the model with `heads` heads open (at most that, for
    params)."""
    if self.key == "target_sparsity":
      return 1.0 - heads / self.total
    return self.empty if not heads else self.full - (self.total - heads) * self.per_head

  def heads(self, value: float) -> int:
    """n*: the heads a budget of `value` keeps: the nearest count to the asked
    sparsity, the most heads that fit a params or MAC budget (0 .. total)."""
    if self.key == "target_sparsity":
      heads = round((1.0 - value) * self.total)
    else:
      # The small tolerance keeps a budget computed from an exact head count exact.
      heads = self.total - math.ceil((self.full - value) / self.per_head - 1e-9)
    return min(max(heads, 0), self.total)

  def value_for(self, heads: int) -> str:
    """A budget value, as a flag would give it, that keeps exactly `heads` heads."""
    exact = self.measure(heads)
    if self.key != "target_sparsity":
      # A budget of 0 means none asked for, even where no head leaves nothing.
      return str(max(1, math.ceil(exact)))
    return next(text for text in (f"{exact:.4g}", f"{exact:.6g}", repr(exact))
                if self.heads(float(text)) == heads)


@dataclasses.dataclass(frozen=True)
class UnitCosts:
  """What each unit of a budget over heads and persistent groups costs, in params or
  MACs per token (`key`): a head without its persistent slots (`head`), a group of
  its slots (`group`), what a layer's first head adds besides (`layer`: its
  LayerNorm's parameters), and the model with every head removed (`empty`).

  A model keeping h_l heads and g_l groups (of those heads) in layer l costs exactly
  `cost`: empty + Σ_{l: h_l > 0} (layer + h_l·head + g_l·group). The controller counts
  it in heads (`size_of`): a head with all its groups is 1, a group `group_share`.
  """
  key: str
  empty: float
  layer: float
  head: float
  group: float
  groups_per_head: int

  @classmethod
  def of(cls, cfg: model_lib.ModelConfig, key: str, eval_lengths,
         group_size: int) -> "UnitCosts":
    """The units of `cfg` (all heads with all N slots) under budget key `key`
    ('target_params' or 'target_macs') with groups of `group_size` slots."""
    # A layer priced with one group's slots gates them as one group, whatever size the
    # model's own gates have (an experiment plan may price another size).
    gate = (dataclasses.replace(cfg.gate, persistent_group=group_size)
            if cfg.gate.persistent_group else cfg.gate)
    def one_layer(heads: int, slots: int) -> float:
      single = dataclasses.replace(cfg, num_layers=1, heads_per_layer=(heads,),
                                   num_persistent=slots if heads else 0, gate=gate)
      return _budget_cost(single, key, eval_lengths)
    no_heads = dataclasses.replace(cfg, heads_per_layer=(0,) * cfg.num_layers)
    bare = one_layer(0, 0)
    one, two = one_layer(1, 0) - bare, one_layer(2, 0) - bare
    return cls(key, empty=_budget_cost(no_heads, key, eval_lengths), layer=2 * one - two,
               head=two - one, group=(one_layer(1, group_size) - bare - one),
               groups_per_head=cfg.num_persistent // group_size)

  @property
  def full_head(self) -> float:
    return self.head + self.groups_per_head * self.group

  @property
  def group_share(self) -> float:
    """A group's share of a head's cost (the controller's and the L0 term's weight)."""
    return self.group / self.full_head

  def cost(self, heads_per_layer, groups_per_layer) -> float:
    """The exact cost of a model keeping these heads and groups per layer."""
    return self.empty + sum(self.layer + h * self.head + g * self.group
                            for h, g in zip(heads_per_layer, groups_per_layer) if h)

  def size_of(self, value: float, num_layers: int) -> float:
    """A budget `value` in the controller's units (heads with all their groups), as
    if every layer kept a head."""
    return (value - self.empty - num_layers * self.layer) / self.full_head


def budget_units(config: run_config.RunConfig,
                 cfg: model_lib.ModelConfig) -> UnitCosts | None:
  """The units of a pruning run with persistent groups, under its budget key (the
  parameters' for a fixed λ); None without such gates."""
  group = config.gates.persistent_group
  if not (config.gates.enabled and group):
    return None
  e = config.eval
  key = config.gates.budget_target or "target_params"
  return UnitCosts.of(cfg, key, (e.seq_len, e.mem_len, e.batch_size), group)


def target_open_heads(config: run_config.RunConfig, cfg: model_lib.ModelConfig) -> int:
  """n*: the heads the config's budget keeps (`cfg`: the run's model).

  Raises:
    ConfigError: no budget, or one out of range, or a run without gates (more than
      one, a budget no head count meets, or one that keeps no head unasked, are
      config_checks').
  """
  key = config.gates.budget_target
  if key is None:
    raise ConfigError(f"config.gates sets none of {run_config.BUDGET_TARGETS}.")
  gates = config.gates
  if not gates.enabled:
    raise ConfigError(f"config.gates.{key} needs a pruning run: set "
                      "--config.gates.enabled=True (and --config.init_from=BASELINE).")
  value = getattr(gates, key)
  if key == "target_sparsity" and not 0.0 <= value <= 1.0:
    raise ConfigError(f"config.gates.target_sparsity={value} must lie in [0, 1].")
  if key != "target_sparsity" and value <= 0:
    raise ConfigError(f"config.gates.{key}={value} must be positive.")
  return BudgetScale.of(config, cfg).heads(value)


def budget_note(config: run_config.RunConfig, cfg: model_lib.ModelConfig) -> str:
  """What a run with a params or MACs budget says in its first lines: the budget as
  asked, the figure it prunes to (the one a fraction stood for, `budget_value`) and
  its share of the unpruned model's; else ''."""
  key = config.gates.budget_target
  if key not in ("target_params", "target_macs"):
    return ""
  unpruned = unpruned_cost(config, cfg)
  value = getattr(config.gates, key)
  unit = ("non-embedding parameters" if key == "target_params"
          else "non-embedding MACs per token")
  fraction = config.gates.budget_fraction
  if fraction is None:
    return (f"Budget {key}={value:,.0f} {unit}: {value / unpruned:.2f} of the unpruned "
            f"model's {unpruned:,.0f}.")
  return (f"Budget {key}={fraction:g}: {value:,.0f} {unit}, that fraction of the "
          f"unpruned model's {unpruned:,.0f}.")
