"""The run config's schema and its typed form: one frozen section per part of a run.

Each section's dataclass is the one definition of its keys, their types and their
defaults; `config_base.base_config` builds from them the ConfigDict that config files
change and flags override. A command reads that ConfigDict once (`RunConfig.of`),
rejecting unknown keys, and everything below receives a `RunConfig` or one of its
sections. A config derived from another (a pruning stage, a continued run, an export)
is a `dataclasses.replace` of it; `to_dict` is what a run saves as config.json.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any

from allatt_jax.config import typed_section
from allatt_jax.config.errors import ConfigError

# The gates keys that ask for a size instead of a λ (budget.py); at most one is set.
BUDGET_TARGETS = ("target_sparsity", "target_params", "target_macs")
# `init_from` of a pruning run that deliberately starts from fresh parameters.
FROM_SCRATCH = "none"


@dataclasses.dataclass(frozen=True)
class _Section:
  """A config section: its keys, their types and their defaults, defined once
  (config_base.base_config builds the ConfigDict that flags override from them)."""

  @classmethod
  def from_dict(cls, values: Mapping[str, Any], flag: str) -> "_Section":
    """The section of a plain dict (a ConfigDict's, or config.json's); `flag` names
    it in errors ('--config.model'). Keys it lacks take their defaults.

    Raises:
      ConfigError: a key the section does not have, or a value of another type.
    """
    return typed_section.read(cls, values, flag)

  def __post_init__(self):
    # A section built by hand (a notebook's ModelConfig(heads_per_layer=[4, 2])) holds
    # tuples, as one read from a config does: a model config is hashed (its traced
    # shapes are cached per config), and a list cannot be.
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, list):
        object.__setattr__(self, field.name, _as_tuples(value))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _as_tuples(value):
  return tuple(map(_as_tuples, value)) if isinstance(value, (list, tuple)) else value


@dataclasses.dataclass(frozen=True)
class ModelSection(_Section):
  """`model`: the architecture (transformer.ModelConfig adds what a run derives)."""
  kind: str = "allatt"                 # 'allatt' or 'txl'
  vocab_size: int = 0                  # 0: the dataset's; a set value must equal it
  num_layers: int = 2
  d_model: int = 64
  num_heads: int = 4                   # H of the unpruned model: head_dim = d_model // H
  heads_per_layer: tuple[int, ...] | None = None   # a pruned model's per-layer counts
  num_persistent: int = 0              # N persistent key/value vectors per head (All-att)
  # An export's persistent slots per layer and head, non-increasing in each layer
  # (pruned persistent groups); None: every head keeps num_persistent.
  persistent_slots: tuple[tuple[int, ...], ...] | None = None
  d_ff: int = 0                        # feed-forward width (TXL)
  rel_pos: str = "learned"             # 'learned' (one shared table) or 'sinusoidal'
  max_relative_len: int = 0            # learned table length; 0 = the longest T + S used
  # Recipe choices the paper leaves open, as the official code makes them (the other
  # form stays selectable; model.py documents each). Every query sees the same number
  # of context keys: S + 1 ('mem_len+1', the official window) or S ('mem_len',
  # Transformer-XL's).
  same_length: bool = True
  same_length_keys: str = "mem_len+1"
  out_bias: bool = True                # W_O has a bias (official); False = none
  layer_norm_eps: float = 1e-5         # official (PyTorch's); flax's default is 1e-6
  final_norm: bool = False             # official: no LayerNorm after the last layer
  persistent_content_bias: bool = False  # persistent logits q·P_K (official); True: (q+u)·P_K
  # Heads per step of the attention core's loop over heads; 0 = all heads in one step.
  # 1 keeps each head's softmax weights in cache: fastest on CPU. Keep 0 when heads
  # are sharded over devices (mesh.model > 1), where a loop would serialise the shards.
  head_block: int = 0
  # Recompute the attention weights in the backward pass instead of keeping them: the
  # (B, H, T, S+T+N) weights of every layer dominate training memory. Costs about a
  # third more attention matmuls (the logits) and one more softmax per layer.
  remat: bool = False
  # The attention core (ours; numerically the same model either way): 'xla' (XLA ops,
  # xla_core.py), 'split' (split_core.py: the context part in XLA, the persistent part
  # by persistent_impl, merged by their log-sum-exps) or 'auto' (by default: the split
  # core on a GPU where a layer has no attention dropout, the XLA core otherwise). On
  # an H200 (jax 0.11.2) the benchmark's layer ran forward and backward 1.67x as fast
  # split as in the XLA core without dropout (cuDNN's persistent part), and 0.78x with
  # dropout 0.2. The whole core as fused Pallas kernels ('pallas') was removed: it ran
  # at 0.73x without dropout and its backward pass with dropout did not compile in
  # 80 s; a saved config naming it reads as 'xla'. head_block and remat apply to both
  # cores.
  attention_impl: str = "auto"
  # The split core's persistent part (ours; persistent_cores.py): 'xla', 'pallas'
  # (flash kernels, GPU), 'cudnn' (the vendor's fused attention, GPU, bf16/fp16; no
  # attention dropout, no persistent groups) or 'auto' (on a GPU the fastest that passes
  # a trial of seconds, 'xla' elsewhere).
  persistent_impl: str = "auto"
  dropout: float = 0.1                 # hidden activations (the paper)
  dropout_attn: float = 0.2            # attention weights (the paper)
  dropout_emb: float = 0.1             # embeddings and relative positions
  cutoffs: tuple[int, ...] = ()        # adaptive input/softmax; () = a plain tied softmax
  div_val: int = 1
  tie_projs: tuple[bool, ...] | None = None
  # Own text at word level (text_files) with neither cutoffs nor div_val set: an
  # adaptive input/softmax sized from the vocabulary (cutoffs at 7.5/15/75% of it,
  # div_val 4) where a plain softmax would cost more than all the layers (ours, after
  # Transformer-XL on its large word-level corpora). False: the plain one.
  auto_cutoffs: bool = True
  dtype: str = "float32"               # compute dtype ('bfloat16' on accelerators)
  # Attention scores and softmax weights kept in memory in the compute dtype
  # ('compute'; max and sum accumulate in float32) or in 'float32' (ours: with a
  # float32 model both are the same; in bfloat16 'compute' halves their traffic).
  score_dtype: str = "compute"
  # The output layer at matmul speed (ours; vocab_logsumexp.py): vocabulary rows per
  # block of a softmax's log-sum-exp (0 = sized to the device's memory: one matmul
  # where the logits fit), and an adaptive softmax's tail clusters run only for the
  # positions whose target is theirs, up to tail_capacity x their share of the
  # training tokens (0 = every position pays for every tail, as in Transformer-XL and
  # the official code, which gathers with dynamic shapes instead).
  vocab_block: int = 0
  tail_capacity: float = 2.0
  # Each cluster's share of the training tokens, head first; () = counted from the
  # dataset when a run reads it, else a Zipf's-law estimate.
  cluster_fractions: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class GatesSection(_Section):
  """`gates`: the head gates (disabled: a baseline), their hard-concrete distribution,
  their L0 term (a fixed λ or a budget) and its schedule."""
  enabled: bool = False
  init: float = 2.0                    # technique 2: π = 2 (≈ 88% open); 0 for the ablation
  temperature: float = 1.0 / 3.0       # β (official; Louizos et al.: 2/3)
  hard: bool = True                    # straight-through discrete gates (the paper)
  # Technique 3: each layer's output times s_g = H / Σg (the paper; the official code
  # has it commented out).
  scale_output: bool = True
  # In hard mode a deterministic gate is open iff π >= 0 (official: σ(π)(ζ-γ)+γ >= 1/2);
  # False: iff π > 0. Only a logit of exactly 0 tells them apart: the π = 0 ablation's
  # starting point.
  open_at_zero: bool = True
  lam: float = 0.0                     # λ of the L0 term
  l0_warmup_steps: int = 4000          # technique 1: λ rises linearly; 0 = no warm-up
  freeze_step: int = 16000             # gates stop updating and become deterministic
  # Gate logits train at lr_multiplier x the model's schedule (10 in the official code;
  # the paper is silent). A set learning_rate replaces that peak.
  lr_multiplier: float = 10.0
  learning_rate: float | None = None
  # A budget instead of λ (budget.py; at most one, lam=0): a Lagrangian controller
  # prunes to this head sparsity, non-embedding parameter count or MACs per token. A
  # count in (0, 1) is that fraction of the unpruned model's, as a sparsity is of its
  # heads: `assembly` sets the figure it stands for (cost_model.budget_value).
  target_sparsity: float | None = None
  target_params: float | None = None
  target_macs: float | None = None
  # Set by the run, no flag: the fraction (0.5) a params or MACs budget was asked as,
  # where `assembly` set the budget to the figure it stands for; None where the figure
  # itself was asked. Lines show both (`budget_shown`).
  budget_fraction: float | None = dataclasses.field(default=None,
                                                    metadata={"set_by_run": True})
  lagrangian_lr: float = 1e-3          # ascent rate of the controller's multipliers
  # The controller's count σ(k·π) sharpens from k = 1 after the target warm-up to this
  # k at the freeze, towards the heads the export keeps (ours; 1 = the expected count
  # of Wang et al. 2020 and CoFi). The freeze keeps exactly the budget's heads either
  # way, ranked by logit where the gates disagree (budget.py).
  budget_sharpness: float = 10.0
  # Steps over which a budget's target moves to its head count (ours); None = 60% of
  # the steps before the freeze (budget.target_warmup_steps says why).
  budget_warmup_steps: int | None = None
  # A budget that keeps no head (a model without attention) is refused unless this
  # asks for it (ours).
  allow_empty: bool = False
  # Gates on persistent memory (ours, after CoFi's gates on feed-forward dimensions;
  # the paper gates heads only): one hard-concrete gate per group of this many
  # persistent slots of each head (it divides model.num_persistent; 0 = off, the
  # paper's recipe). A closed group's keys and values leave the softmax
  # (attention.py). Budgets (target_params, target_macs) then count heads and groups
  # together; target_sparsity stays a fraction of heads.
  persistent_group: int = 0
  heads: bool = True                   # gate the heads (the paper); False with
                                       # persistent_group > 0: persistent groups only

  @property
  def budget_targets(self) -> tuple[str, ...]:
    """The budget keys (BUDGET_TARGETS) this section sets: at most one, as the
    assembly checks."""
    return tuple(k for k in BUDGET_TARGETS if getattr(self, k) is not None)

  @property
  def budget_target(self) -> str | None:
    """The budget key this section sets, or None for a fixed λ (or a baseline)."""
    return next(iter(self.budget_targets), None)

  @property
  def budget_shown(self) -> str:
    """The budget as lines show it, as asked and in full: 'target_sparsity=0.5',
    'target_macs=282,624', or for a fraction 'target_macs=0.5 (282,624)'; '' without
    a budget."""
    key = self.budget_target
    if key is None:
      return ""
    value = getattr(self, key)
    if key == "target_sparsity":
      return f"{key}={value:g}"
    if self.budget_fraction is not None:
      return f"{key}={self.budget_fraction:g} ({value:,.0f})"
    return f"{key}={value:,.0f}"


@dataclasses.dataclass(frozen=True)
class DataSection(_Section):
  """`data`: the dataset, where its files are, and a text_files folder's options."""
  name: str = "wikitext_chars"
  manual_dir: str | None = None
  data_dir: str | None = None
  # Dataset 'text_files' only (your own folder, see the README):
  level: str = ""                      # 'word' (the default), 'char' or 'byte'
  files: str = "train.txt,valid.txt,test.txt"  # the train,valid,test files in manual_dir
  min_count: int = 1                   # word level: train words seen fewer times -> <unk>
  max_vocab: int = 0                   # at most this many types, the rarest -> <unk>; 0 = all
  clean: str = ""                      # char level: 'text8' = lower-case a-z and space only


@dataclasses.dataclass(frozen=True)
class TrainSection(_Section):
  """`train`: the batch, the optimizer and its schedule, logging."""
  batch_size: int = 16                 # global batch (rows of the segment stream)
  seq_len: int = 64                    # T
  mem_len: int = 64                    # S
  num_steps: int = 1000
  learning_rate: float = 1e-2          # peak, after linear warm-up
  final_learning_rate: float = 1e-4    # end of the cosine decay
  warmup_steps: int = 100
  # 'lamb': the official LAMB (no bias correction, eps 1e-8, weight norm clamped to
  # [0, lamb_max_weight_norm]); 'optax_lamb': optax.lamb (optim.py has both).
  optimizer: str = "lamb"
  lamb_eps: float = 1e-8
  lamb_max_weight_norm: float | None = 10.0
  weight_decay: float = 0.0
  # Leaves whose 'a/b/c' path matches one of these regexes get no weight decay (gate
  # logits never do). The official code exempts only LayerNorms: use ('norm',).
  weight_decay_exclude: tuple[str, ...] = ("norm", "bias")
  grad_clip: float = 0.25
  grad_accum_steps: int = 1
  seed: int = 0
  log_every_steps: int = 50
  # A step whose loss or gradient is NaN/inf stops the run (False), or is skipped: its
  # update is dropped, the memory restarts, and `nonfinite_steps` counts it.
  skip_nonfinite_steps: bool = False


@dataclasses.dataclass(frozen=True)
class EvalSection(_Section):
  """`eval`: the evaluation batch and lengths, and how often periodic evals run."""
  batch_size: int = 16
  seq_len: int = 64
  mem_len: int = 64
  every_steps: int = 500
  max_batches: int = 0                 # 0 = the whole split; >0 caps periodic evals only


@dataclasses.dataclass(frozen=True)
class CheckpointSection(_Section):
  every_steps: int = 500
  keep: int = 3


@dataclasses.dataclass(frozen=True)
class DistillSection(_Section):
  """`distill`: learning from the unpruned model while pruning (ours, after CoFi, Xia
  et al. 2022, and Minitron, Muralidharan et al. 2024; the paper has none). The
  teacher is the `init_from` model, frozen. Off (weight = hidden_weight = 0) is the
  paper's recipe."""
  weight: float = 0.0              # α: (1 − α)·CE + α·τ²·KL(teacher_τ ‖ student_τ)
  temperature: float = 1.0         # τ
  hidden_weight: float = 0.0       # β: β·Σ_layers MSE(student, teacher layer outputs)
  # With an adaptive softmax: 'all' = the exact full-vocabulary KL (every tail cluster,
  # in vocabulary blocks); 'head' = the head cluster's KL only (its tokens and the
  # tail clusters' probabilities), a lower bound at a fraction of the cost.
  kl_clusters: str = "all"

  @property
  def enabled(self) -> bool:
    return bool(self.weight or self.hidden_weight)


@dataclasses.dataclass(frozen=True)
class MeshSection(_Section):
  """`mesh`: the ('data', 'model') device mesh; -1 fills the devices left."""
  data: int = -1
  model: int = 1


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One run's whole config, as it trains and as it is saved."""
  model: ModelSection = ModelSection()
  gates: GatesSection = GatesSection()
  data: DataSection = DataSection()
  train: TrainSection = TrainSection()
  eval: EvalSection = EvalSection()
  checkpoint: CheckpointSection = CheckpointSection()
  mesh: MeshSection = MeshSection()
  distill: DistillSection = DistillSection()
  # The baseline run (or export) whose parameters a pruning run starts from.
  init_from: str = ""

  @classmethod
  def of(cls, config) -> "RunConfig":
    """`config` as a RunConfig: a command's ConfigDict (flags applied) is read here,
    once; a RunConfig is itself."""
    return config if isinstance(config, cls) else cls.from_dict(config.to_dict())

  @classmethod
  def from_dict(cls, values: Mapping[str, Any], flag: str = "--config") -> "RunConfig":
    """The run config of a nested dict (a ConfigDict's `to_dict()`, or config.json);
    a section it lacks takes its defaults, and sections that are no part of a run (a
    pipeline's, an experiment's) are left to their commands.

    Raises:
      ConfigError: a key no section has, or a value of another type (named as
        `flag`.SECTION.KEY).
    """
    sections = {name: section.from_dict(values[name], f"{flag}.{name}")
                for name, section in cls.sections().items() if name in values}
    return cls(**sections, init_from=values.get("init_from", ""))

  @classmethod
  def sections(cls) -> dict[str, type]:
    """{name: section dataclass} of every section, in order."""
    return {f.name: f.type for f in dataclasses.fields(cls) if f.name != "init_from"}

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @property
  def init_source(self) -> str:
    """The run or export whose parameters the run starts from; '' for a fresh start
    (init_from unset, or FROM_SCRATCH)."""
    return "" if self.init_from in ("", FROM_SCRATCH) else self.init_from

  @property
  def relative_table_len(self) -> int:
    """The learned relative position table's length: `model.max_relative_len`, or,
    where that is 0, the longest context a train or eval query sees."""
    t, e = self.train, self.eval
    return (self.model.max_relative_len
            or max(t.seq_len + t.mem_len, e.seq_len + e.mem_len))

  def completed(self, vocab_size: int) -> "RunConfig":
    """This config with what it leaves to the run filled in, as the run saves it:
    `model.vocab_size` 0 (or None) becomes `vocab_size` (the dataset's); with a budget
    (`gates.target_*`) the controller finds the L0 weight, so a fixed `gates.lam` is
    set to 0 rather than saved as if it had been used."""
    return derived_run(
        self, model=dict(vocab_size=self.model.vocab_size or vocab_size),
        gates=dict(lam=0.0) if self.gates.budget_target and self.gates.lam else None)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """A pipeline's stages (configs/demo.py): a baseline run, then a pruning run from it
  (its `init_from`, the baseline's folder, set by the pipeline), then a speed
  comparison of both models over `speed_batches` valid batches."""
  baseline: RunConfig
  pruning: RunConfig
  speed_batches: int


def derived_run(base: RunConfig, *, init_from: str | None = None, train=None,
                gates=None, model=None, distill=None) -> RunConfig:
  """`base` with some keys of its train, gates, model and distill sections replaced
  (dicts of keys), and its `init_from`: the one way a run's config is made from
  another's (a pruning stage or a continued run from its baseline, an export from its
  run)."""
  replace = lambda section, keys: dataclasses.replace(section, **(keys or {}))
  return dataclasses.replace(
      base, train=replace(base.train, train), gates=replace(base.gates, gates),
      model=replace(base.model, model), distill=replace(base.distill, distill),
      init_from=base.init_from if init_from is None else init_from)


def pruning_stage(baseline: RunConfig, init_from: str, *, train=None,
                  gates=None, distill=None) -> RunConfig:
  """The pruning run of a baseline: its gates enabled (with `gates`' keys), its
  train section changed by `train`, starting from `init_from`, and learning from it
  as its teacher where `distill` turns that on.

  Raises:
    ConfigError: `gates` turns the gates off (a pipeline's or an experiment's
      `prune_gates.enabled=False`), which the run would otherwise override.
  """
  if (gates or {}).get("enabled") is False:
    raise ConfigError(
        "config.gates.enabled=False, but this is a pruning run, which trains the L0 "
        "gates. Leave it True; to train without gates, give python -m allatt_jax.main "
        "a single run's config (configs/text8_base.py, say).")
  return derived_run(baseline, init_from=init_from, train=train, distill=distill,
                     gates={**(gates or {}), "enabled": True})
