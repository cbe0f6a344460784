"""A command's config becomes, once, the checked and typed objects its runs are made of.

`checked_config` / `checked_pipeline` check a ConfigDict before any data is read;
`prepared_run` / `prepared_pipeline` read the dataset, complete the config from it and
build each run's `RunSetup`; `run_setup` builds one without data.
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from allatt_jax.model import adaptive
from allatt_jax.pruning import budget
from allatt_jax.config import config_base
from allatt_jax.training import config_checks
from allatt_jax import data as data_lib
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import optim
from allatt_jax.config import run_config
from allatt_jax.parallel import sharding
from allatt_jax.evaluation import stream_eval
from allatt_jax.training import train_step
from allatt_jax.model import vocab_logsumexp
from allatt_jax.runs import workdir_checks
from allatt_jax.config.errors import ConfigError
from allatt_jax.config.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class RunSetup:
  """Everything a run needs besides its data and its state."""
  run: RunConfig                        # what the run saves as config.json
  lm: model_lib.TransformerLM
  mesh: jax.sharding.Mesh
  optimizer: optax.GradientTransformationExtraArgs
  penalty: budget.Penalty
  step_config: train_step.StepConfig
  abstract_state: Any                   # train_step.TrainState of ShapeDtypeStructs
  state_sharding: Any
  rows: tuple[int, int]                 # this process's share of a batch (process_rows)

  @functools.cached_property
  def evaluator(self) -> stream_eval.Evaluator:
    return stream_eval.Evaluator.from_config(self.lm, self.mesh, self.run)

  def new_state(self, source_params=None) -> train_step.TrainState:
    """A freshly initialised state, placed on the mesh; with `source_params` (a
    pruning run's `init_from` model's), those params instead of the initial ones, the
    optimizer state fresh for them, and a distilling run's teacher a copy of them."""
    init = functools.partial(train_step.init_state, self.lm, self.optimizer, self.penalty,
                             self.step_config)
    with sharding.activate(self.mesh):
      state = jax.jit(init, out_shardings=self.state_sharding)(
          jax.random.key(self.step_config.seed))
    if source_params is None:
      return state

    # The fresh state is an argument, not a constant: in a multi-process run its
    # arrays span other processes' devices, which a traced function cannot close over.
    def from_source(state, variables):
      teacher = None
      if state.teacher is not None:   # a copy: the student's params will change
        teacher = {**state.teacher, "params": jax.tree.map(jnp.copy, variables["params"])}
      return state.replace(variables=variables, opt_state=self.optimizer.init(variables),
                           teacher=teacher)

    with sharding.activate(self.mesh):
      return jax.jit(from_source, out_shardings=self.state_sharding)(
          state, {**state.variables, "params": source_params})

  def train_step(self, *, sample_gates: bool):
    """The jitted train step over this setup's mesh (to be called under
    `sharding.activate(mesh)`, on global batches)."""
    return train_step.jit_train_step(
        self.lm, self.optimizer, self.penalty, self.step_config, self.state_sharding,
        sharding.batch_sharding(self.mesh), sharding.replicated(self.mesh),
        sample_gates=sample_gates)

  @functools.cached_property
  def loop_steps(self) -> dict:
    """{sample_gates: step(state, inputs, targets) -> (state, metrics)}: the train
    steps of the loop (a gated run samples its gates before the freeze, not after),
    each taking this process's rows of a batch and running on the mesh."""
    batch = sharding.batch_sharding(self.mesh)
    shape = (self.step_config.batch_size, self.step_config.seq_len)

    def on_rows(jitted):
      def step(state, inputs, targets):
        return jitted(state, data_lib.to_global_array(inputs, batch, shape),
                      data_lib.to_global_array(targets, batch, shape))
      return step

    return {sample: on_rows(sharding.on_mesh(self.mesh, self.train_step(sample_gates=sample)))
            for sample in ((True, False) if self.lm.cfg.gated else (False,))}


@dataclasses.dataclass(frozen=True)
class PreparedRun:
  """A run about to train: its objects, its dataset, and what it says first: of the
  model it starts from (`workdir_checks.init_from_note`) and how the config was
  completed (`complete`, `cost_model.budget_note`)."""
  setup: RunSetup
  corpus: data_lib.Corpus
  note: str = ""

  @property
  def run(self) -> RunConfig:
    return self.setup.run


@dataclasses.dataclass(frozen=True)
class PreparedPipeline:
  """A pipeline's two stages, built from one read of their dataset; the pruning
  stage starts from (and distills from) the baseline's folder."""
  baseline: PreparedRun
  pruning: PreparedRun
  speed_batches: int


def checked_config(config) -> RunConfig:
  """The checked RunConfig of a command's ConfigDict (or of a RunConfig), a budget
  given as a fraction set to the figure it stands for (`cost_model.budget_value`),
  so that every reader of the config sees that figure; an unset `model.vocab_size`
  is left for the dataset to complete.

  Raises:
    ConfigError: an inconsistent or out-of-range config (see config_checks.py).
  """
  return config_checks.check_config(RunConfig.of(config), jax.device_count())


def checked_pipeline(config) -> run_config.PipelineConfig:
  """The checked stages of a pipeline config (configs/demo.py): its run sections are
  the baseline; its `pipeline` section says how the pruning stage differs
  (`prune_train`, `prune_gates`, `prune_distill`) and how long the speed comparison
  reads (`speed_batches`). Each stage is checked once, here, before any data is read.

  Raises:
    ConfigError: the config sets its own gates or distill section, which the baseline
      does not use (the message names the pipeline's flag for it); or a stage's
      config fails its checks (ranges, names, a budget no head count meets, gates
      turned off in the pruning stage: the message names the flag of the pipeline
      section that sets the key), or the pruning stage's train lengths give it
      another model than the baseline's.
  """
  defaults = config_base.base_config()
  for section, stage_section in (("gates", "prune_gates"), ("distill", "prune_distill")):
    changed = {k: v for k, v in config[section].items() if v != defaults[section][k]}
    if changed:
      key, value = next(iter(changed.items()))
      raise ConfigError(
          f"config.{section}.{key}={value}: in a pipeline config the baseline has no "
          f"{section}; the pruning stage's are config.pipeline.{stage_section}. Use "
          f"--config.pipeline.{stage_section}.{key}={value} instead.")
  stages = config.pipeline
  baseline = checked_config(config)
  # Its errors name the pipeline's flags for the keys the pipeline section sets.
  flags = {"gates": "pipeline.prune_gates",
           **{f"train.{key}": f"pipeline.prune_train.{key}" for key in stages.prune_train}}
  if "prune_distill" in stages:
    flags["distill"] = "pipeline.prune_distill"
  try:
    # Its init_from, the baseline's folder, is the pipeline's to set (prepared_pipeline).
    pruning = checked_config(run_config.pruning_stage(
        baseline, "", train=stages.prune_train.to_dict(),
        gates=stages.prune_gates.to_dict(),
        distill=stages.get("prune_distill", defaults.distill).to_dict()))
    config_checks.check_from_baseline(baseline, pruning)
  except ConfigError as e:
    raise ConfigError(config_checks.named_as(str(e), flags)) from None
  return run_config.PipelineConfig(baseline=baseline, pruning=pruning,
                                   speed_batches=stages.speed_batches)


def prepared_run(run: RunConfig, corpus: data_lib.Corpus | None = None) -> PreparedRun:
  """A run about to train, of a checked config (`checked_config`): what it starts from
  checked (the files of its `init_from` too, and what the run will say of it:
  `workdir_checks.init_from_note`), then its dataset read (`corpus`, where the caller
  has read it already) and the config completed from it (`RunConfig.completed`), as
  the run saves it.

  Raises:
    ConfigError: a pruning or distilling run that does not say what it starts from,
      or a `model.vocab_size` that is not the dataset's.
    CheckpointError: its `init_from` holds no model, or one of another vocabulary size.
    DataError: the dataset cannot be loaded.
  """
  config_checks.check_starting_point(run)
  init_note = workdir_checks.init_from_note(run) if run.init_source else ""
  return _prepared(run, corpus or _read_corpus(run), first_note=init_note)


def prepared_pipeline(config: run_config.PipelineConfig, baseline_dir) -> PreparedPipeline:
  """Both stages of a checked pipeline (`checked_pipeline`) from one read of their
  dataset, the pruning stage starting from `baseline_dir`, the baseline's folder,
  which is also its teacher when it distills."""
  corpus = _read_corpus(config.baseline)
  baseline = _prepared(config.baseline, corpus)
  # It starts from the baseline's params: its model is the baseline's as completed,
  # not one completed at its own train lengths (which can choose another output layer
  # for own text at word level: `word_output`).
  pruning = dataclasses.replace(config.pruning, model=baseline.run.model)
  return PreparedPipeline(
      baseline=baseline, pruning=_prepared(pruning, corpus, init_from=str(baseline_dir)),
      speed_batches=config.speed_batches)


def completed_config(run: RunConfig) -> tuple[RunConfig, data_lib.Corpus]:
  """(a checked config completed from its dataset (`RunConfig.completed`), the
  dataset), for a command that reads a dataset without training on it.

  Raises:
    ConfigError: a `model.vocab_size` that is not the dataset's.
    DataError: the dataset cannot be loaded.
  """
  run = RunConfig.of(run)
  corpus = _read_corpus(run)
  return complete(run, corpus)[0], corpus


def run_setup(run: RunConfig) -> RunSetup:
  """The objects of a run of a checked config without its dataset, for commands that
  compile or measure steps: `model.vocab_size` must be set (`with_vocab_size`).

  Raises:
    ConfigError: an unset `model.vocab_size`.
  """
  run = RunConfig.of(run)
  config_checks.check_vocab_size_set(run)
  return _build(run, model_lib.ModelConfig.from_config(run))


def with_vocab_size(run: RunConfig) -> RunConfig:
  """A checked config with its `model.vocab_size` set, from its dataset (which is
  then read) where it is unset, and the output layer a run would complete it with
  (`word_output`): for commands that build a model without training it."""
  run = RunConfig.of(run)
  if not run.model.vocab_size:
    run = run_config.derived_run(run, model=dict(
        vocab_size=completed_config(run)[0].model.vocab_size))
  return run_config.derived_run(run, model=word_output(run))


def pipeline_with_vocab_size(stages: run_config.PipelineConfig) -> run_config.PipelineConfig:
  """`with_vocab_size` of a checked pipeline's baseline, from one read of their dataset;
  the pruning stage takes its model, as `prepared_pipeline` gives it."""
  baseline = with_vocab_size(stages.baseline)
  return dataclasses.replace(stages, baseline=baseline, pruning=dataclasses.replace(
      stages.pruning, model=baseline.model))


def _prepared(run: RunConfig, corpus: data_lib.Corpus,
              init_from: str | None = None, first_note: str = "") -> PreparedRun:
  run, cfg, output_note = complete(run, corpus, init_from)
  notes = (first_note, output_note, cost_model.budget_note(run, cfg))
  return PreparedRun(_build(run, cfg), corpus, "\n".join(note for note in notes if note))


def _read_corpus(run: RunConfig) -> data_lib.Corpus:
  """The run's dataset, whose vocabulary a set `model.vocab_size` must match."""
  corpus = data_lib.load_run_corpus(run)
  vocab_size = run.model.vocab_size
  if vocab_size and corpus.vocab_size != vocab_size:
    raise ConfigError(
        f"config.model.vocab_size is {vocab_size} but dataset {run.data.name!r} has "
        f"{corpus.vocab_size} types; set --config.model.vocab_size={corpus.vocab_size}, "
        "or 0 to take it from the dataset.")
  data_lib.warn_if_unk_untrained(corpus)
  return corpus


def _build(run: RunConfig, cfg: model_lib.ModelConfig) -> RunSetup:
  """The objects of a checked, completed config, whose model is `cfg`."""
  lm = model_lib.TransformerLM(cfg)
  mesh = sharding.run_mesh(run.mesh)
  # A budget becomes its number of open heads n* here, once; a bad one fails at setup.
  # With persistent groups it stays a size, in the units each kind of gate prunes.
  units = cost_model.budget_units(run, cfg)
  allowed = (None if not run.gates.budget_target
             else cost_model.target_open_heads(run, cfg) if units is None
             else getattr(run.gates, run.gates.budget_target))
  penalty = budget.Penalty.of(run.gates, cfg.layer_heads, allowed, units)
  rates = optim.schedules(run)
  optimizer = optim.make_optimizer(run.train, rates,
                                   budget.COLLECTION if penalty.controlled else None)
  step_config = train_step.StepConfig.from_config(run, rates)
  abstract, shardings = train_step.abstract_state(lm, optimizer, penalty, step_config, mesh)
  return RunSetup(run=run, lm=lm, mesh=mesh, optimizer=optimizer, penalty=penalty,
                  step_config=step_config, abstract_state=abstract,
                  state_sharding=shardings, rows=sharding.process_rows(mesh))


def complete(run: RunConfig, corpus: data_lib.Corpus, init_from: str | None = None
               ) -> tuple[RunConfig, model_lib.ModelConfig, str]:
  """(`RunConfig.completed` from the dataset, own word-level text's output layer
  (`word_output`), and with an adaptive softmax each cluster's share of the training
  tokens (unless set), which sizes its tail capacities; its model; what the run says
  first about an output layer it chose, or '')."""
  run = run.completed(corpus.vocab_size)
  plain = model_lib.ModelConfig.from_config(run)
  chosen, plain_macs, layer_macs = _word_output(run, plain)
  # The keys completed here are the model's as they are the config's: a model built
  # from the completed config (`ModelConfig.from_config`) is `cfg`.
  cfg = dataclasses.replace(plain, **chosen)
  completed = dict(chosen)
  if cfg.cutoffs and not cfg.cluster_fractions:
    bounds = adaptive.cluster_bounds(cfg.vocab_size, cfg.cutoffs)
    completed["cluster_fractions"] = vocab_logsumexp.cluster_fractions(
        corpus.splits["train"], bounds)
    cfg = dataclasses.replace(cfg, cluster_fractions=completed["cluster_fractions"])
  run = run_config.derived_run(run, init_from=init_from, model=completed)
  if not chosen:
    return run, cfg, ""
  t = run.train
  # The plain softmax's tied input is a lookup; the adaptive input projects.
  adaptive_macs = (cost_model.input_macs_per_token(cfg)
                   + cost_model.output_macs_per_token(cfg, t.batch_size * t.seq_len))
  return run, cfg, (
      f"Word level, {cfg.vocab_size:,} types: an adaptive input and softmax (cutoffs "
      f"{', '.join(map(str, cfg.cutoffs))}; div_val {cfg.div_val}) cost "
      f"{adaptive_macs / 1e6:.2f}M MACs per token, where a plain softmax would cost "
      f"{plain_macs / 1e6:.2f}M, {plain_macs / layer_macs:.1f}x the "
      f"{layer_macs / 1e6:.2f}M of all the layers (--config.model.auto_cutoffs=False "
      "keeps the plain softmax).")


def word_output(run: RunConfig) -> dict:
  """The model keys that give own text at word level (`text_files`) an adaptive input
  and softmax sized from its vocabulary, as `model.auto_cutoffs` asks, or {}.

  Made when the config sets neither `model.cutoffs` nor `model.div_val` and a plain
  softmax over the vocabulary would cost more MACs per token than all the layers:
  cutoffs at 7.5%, 15% and 75% of the vocabulary (`adaptive.default_cutoffs`, where
  WikiText-103's 20K/40K/200K of 267K lie) and cluster widths d/4^i (div_val 4, as
  Transformer-XL on One Billion Word and its large WikiText-103 model), narrower where
  d_model is too small for the last cluster. The softmax stays exact over the whole
  vocabulary: the tail clusters are narrower, not left out.
  """
  return _word_output(run, model_lib.ModelConfig.from_config(run))[0]


def _word_output(run: RunConfig, cfg: model_lib.ModelConfig) -> tuple[dict, float, float]:
  """(`word_output` of `run`, whose model is `cfg`; the MACs per token of the plain
  softmax and of all the layers at the train lengths, where it was chosen)."""
  m, data, t = run.model, run.data, run.train
  if not (m.auto_cutoffs and data.name == "text_files" and data.level in ("", "word")
          and not m.cutoffs and m.div_val == 1 and m.vocab_size):
    return {}, 0.0, 0.0
  cutoffs = adaptive.default_cutoffs(data.name, m.vocab_size)
  if not cutoffs:
    return {}, 0.0, 0.0
  macs = cost_model.macs_per_token(cfg, t.seq_len, t.mem_len, t.batch_size)
  layers = macs["macs_per_token_non_embedding"]
  plain = macs["macs_per_token"] - layers
  if plain <= layers:
    return {}, 0.0, 0.0
  return (dict(cutoffs=cutoffs,
               div_val=next((k for k in (4, 2) if m.d_model // k ** len(cutoffs)), 1)),
          plain, layers)

