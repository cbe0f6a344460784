"""The typed run config: one frozen section per part of a run.

A command reads its `ml_collections.ConfigDict` (config_base's schema, overridden by
flags) once, at its boundary (`resolver.resolve_config`, which checks it), and
everything below receives a `RunConfig` or one of its sections. A config derived from
another (a pruning stage, a continued run, an export) is a `dataclasses.replace` of
it, never a copy of a ConfigDict edited in place. The defaults stay in config_base:
these classes say which keys a run has and of what type, and `to_dict` is what a run
saves as config.json.
"""
import dataclasses
from typing import Any

# The gates keys that ask for a size instead of a λ (budget.py); at most one is set.
BUDGET_TARGETS = ("target_sparsity", "target_params", "target_macs")
# `init_from` of a pruning run that deliberately starts from fresh parameters.
FROM_SCRATCH = "none"


def _tuple_or_none(value):
  return None if value is None else tuple(value)


@dataclasses.dataclass(frozen=True)
class _Section:
  """A config section: built from a plain dict (a ConfigDict's, or config.json's),
  whose keys a section lacks (a command's own settings) are not the run's."""

  _TUPLES = ()   # keys JSON reads back as lists

  @classmethod
  def from_dict(cls, values: dict) -> "_Section":
    fields = {f.name for f in dataclasses.fields(cls)}
    kept = {k: v for k, v in values.items() if k in fields}
    kept.update({k: _tuple_or_none(kept[k]) for k in cls._TUPLES if k in kept})
    return cls(**kept)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelSection(_Section):
  """`model`: the architecture (model.ModelConfig is its traced form)."""
  kind: str
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  heads_per_layer: tuple[int, ...] | None
  num_persistent: int
  d_ff: int
  rel_pos: str
  max_relative_len: int
  same_length: bool
  same_length_keys: str
  out_bias: bool
  layer_norm_eps: float
  final_norm: bool
  persistent_content_bias: bool
  head_block: int
  remat: bool
  dropout: float
  dropout_attn: float
  dropout_emb: float
  cutoffs: tuple[int, ...]
  div_val: int
  tie_projs: tuple[bool, ...] | None
  dtype: str
  # Keys newer than some saved config.json files, which then read as these defaults.
  score_dtype: str = "compute"
  vocab_block: int = 0
  tail_capacity: float = 2.0
  cluster_fractions: tuple[float, ...] = ()
  attention_impl: str = "auto"
  auto_cutoffs: bool = False       # completed into cutoffs and div_val (resolver.py)
  # An export's persistent slots per layer and head (None: every head keeps N).
  persistent_slots: tuple[tuple[int, ...], ...] | None = None

  _TUPLES = ("heads_per_layer", "cutoffs", "tie_projs", "cluster_fractions")

  @classmethod
  def from_dict(cls, values: dict) -> "ModelSection":
    section = super().from_dict(values)
    slots = section.persistent_slots
    if slots is None:
      return section
    return dataclasses.replace(section, persistent_slots=tuple(tuple(s) for s in slots))


@dataclasses.dataclass(frozen=True)
class GatesSection(_Section):
  """`gates`: the head gates, their L0 term (a fixed λ or a budget) and its schedule."""
  enabled: bool
  init: float
  temperature: float
  hard: bool
  scale_output: bool
  open_at_zero: bool
  lam: float
  l0_warmup_steps: int
  freeze_step: int
  lr_multiplier: float
  learning_rate: float | None
  target_sparsity: float | None
  target_params: int | None
  target_macs: float | None
  lagrangian_lr: float
  budget_sharpness: float
  budget_warmup_steps: int | None
  allow_empty: bool = False        # a budget may keep no head (config_checks)
  persistent_group: int = 0        # slots per persistent gate group; 0 = no such gates
  heads: bool = True               # gate the heads (False: persistent groups only)

  @property
  def budget_targets(self) -> tuple[str, ...]:
    """The budget keys (BUDGET_TARGETS) this section sets: at most one, as the
    resolver checks."""
    return tuple(k for k in BUDGET_TARGETS if getattr(self, k) is not None)

  @property
  def budget_target(self) -> str | None:
    """The budget key this section sets, or None for a fixed λ (or a baseline)."""
    return next(iter(self.budget_targets), None)


@dataclasses.dataclass(frozen=True)
class DataSection(_Section):
  """`data`: the dataset, where its files are, and a text_files folder's options."""
  name: str
  manual_dir: str | None
  data_dir: str | None
  level: str
  files: str
  min_count: int
  max_vocab: int
  clean: str


@dataclasses.dataclass(frozen=True)
class TrainSection(_Section):
  """`train`: the batch, the optimizer and its schedule, logging."""
  batch_size: int
  seq_len: int
  mem_len: int
  num_steps: int
  learning_rate: float
  final_learning_rate: float
  warmup_steps: int
  optimizer: str
  lamb_eps: float
  lamb_max_weight_norm: float | None
  weight_decay: float
  weight_decay_exclude: tuple[str, ...]
  grad_clip: float
  grad_accum_steps: int
  seed: int
  log_every_steps: int
  skip_nonfinite_steps: bool

  _TUPLES = ("weight_decay_exclude",)


@dataclasses.dataclass(frozen=True)
class EvalSection(_Section):
  """`eval`: the evaluation batch and lengths, and how often periodic evals run."""
  batch_size: int
  seq_len: int
  mem_len: int
  every_steps: int
  max_batches: int


@dataclasses.dataclass(frozen=True)
class CheckpointSection(_Section):
  every_steps: int
  keep: int


@dataclasses.dataclass(frozen=True)
class DistillSection(_Section):
  """`distill`: learning from the unpruned model (the `init_from` one) while pruning.

  Defaults are off, so a config.json saved before this section reads as it trained.
  """
  weight: float = 0.0              # α: (1 − α)·CE + α·τ²·KL(teacher_τ ‖ student_τ)
  temperature: float = 1.0         # τ
  hidden_weight: float = 0.0       # β: β·Σ_layers MSE(student, teacher layer outputs)
  kl_clusters: str = "all"         # adaptive softmax: 'all' (exact) or 'head' (bound)

  @property
  def enabled(self) -> bool:
    return bool(self.weight or self.hidden_weight)


@dataclasses.dataclass(frozen=True)
class MeshSection(_Section):
  """`mesh`: the ('data', 'model') device mesh; -1 fills the devices left."""
  data: int
  model: int


_SECTIONS = dict(model=ModelSection, gates=GatesSection, data=DataSection,
                 train=TrainSection, eval=EvalSection, checkpoint=CheckpointSection,
                 mesh=MeshSection, distill=DistillSection)
# Sections a saved config.json may predate; they then take their defaults.
_OPTIONAL_SECTIONS = ("distill",)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One run's whole config, as it trains and as it is saved."""
  model: ModelSection
  gates: GatesSection
  data: DataSection
  train: TrainSection
  eval: EvalSection
  checkpoint: CheckpointSection
  mesh: MeshSection
  distill: DistillSection = DistillSection()
  init_from: str = ""   # the run or export whose parameters a pruning run starts from

  @classmethod
  def of(cls, config) -> "RunConfig":
    """`config` as a RunConfig: a command's ConfigDict (flags applied) is read here,
    once; a RunConfig is itself."""
    return config if isinstance(config, cls) else cls.from_dict(config.to_dict())

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> "RunConfig":
    """The run config of a nested dict (a ConfigDict's `to_dict()`, or config.json);
    sections and keys a run does not have (a pipeline's, an experiment's) are left."""
    sections = {name: section.from_dict(values[name]) for name, section in _SECTIONS.items()
                if name in values or name not in _OPTIONAL_SECTIONS}
    return cls(**sections, init_from=values.get("init_from", ""))

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
  as its teacher where `distill` turns that on."""
  return derived_run(baseline, init_from=init_from, train=train, distill=distill,
                     gates={**(gates or {}), "enabled": True})
