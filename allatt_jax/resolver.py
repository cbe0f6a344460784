"""The resolver: a command's config becomes, once, the typed objects a run is made of.

`resolve_config` turns a command's ConfigDict into a frozen `RunConfig` and checks it
(config_checks.py) before any data is read or code traced; `resolve_pipeline` does
the same for the demo's two stages (a `PipelineConfig`). `resolve` builds from a
config the model, mesh, optimizer, L0 term, train-step constants, state shapes and
evaluator (a `RunSetup`); everything below (`train_step`, `stream_eval`,
`validation`'s state checks, export) receives these objects. `prepare` makes the
config's checks, then reads its dataset, then completes the config from it
(`model.vocab_size` 0 means the dataset's; own word-level text's adaptive softmax,
`word_output`), which is what a run resolves and saves;
`prepare_run` does both for a run about to train, and `prepare_pipeline` for the
demo's stages.
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from allatt_jax import adaptive
from allatt_jax import budget
from allatt_jax import config_base
from allatt_jax import config_checks
from allatt_jax import data as data_lib
from allatt_jax import head_costs
from allatt_jax import model as model_lib
from allatt_jax import optim
from allatt_jax import run_config
from allatt_jax import sharding
from allatt_jax import stream_eval
from allatt_jax import train_step
from allatt_jax import vocab_logsumexp
from allatt_jax.errors import ConfigError
from allatt_jax.run_config import RunConfig


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

    def from_source(variables):
      teacher = None
      if state.teacher is not None:   # a copy: the student's params will change
        teacher = {**state.teacher, "params": jax.tree.map(jnp.copy, variables["params"])}
      return state.replace(variables=variables, opt_state=self.optimizer.init(variables),
                           teacher=teacher)

    with sharding.activate(self.mesh):
      return jax.jit(from_source, out_shardings=self.state_sharding)(
          {**state.variables, "params": source_params})

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


def resolve_config(config, *, vocab_from_data: bool = False) -> RunConfig:
  """The checked RunConfig of a command's ConfigDict (or of a RunConfig).

  `vocab_from_data`: the caller loads the dataset next and takes an unset
  `model.vocab_size` from it (`prepare`).

  Raises:
    ConfigError: an inconsistent or out-of-range config (see config_checks.py).
  """
  return _checked(config, vocab_from_data)[0]


def _checked(config, vocab_from_data: bool = False, starts_run: bool = False
             ) -> tuple[RunConfig, tuple[int, int]]:
  """(the checked RunConfig, its mesh's (data, model) sizes on this machine);
  `starts_run`: also what a run that trains it starts from (its `init_from`)."""
  run = RunConfig.of(config)
  mesh_shape = config_checks.check_config(run, jax.device_count(),
                                          vocab_from_data=vocab_from_data,
                                          starts_run=starts_run)
  return run, mesh_shape


def resolve_pipeline(config) -> run_config.PipelineConfig:
  """The checked stages of a pipeline config (configs/demo.py): its run sections are
  the baseline; its `pipeline` section says how the pruning stage differs
  (`prune_train`, `prune_gates`, `prune_distill`) and how long the speed comparison
  reads (`speed_batches`).

  Raises:
    ConfigError: the config sets its own gates or distill section, which the baseline
      does not use (the message names the pipeline's flag for it); or a stage's
      config fails its checks (ranges, names, a budget no head count meets: the
      message names the flag of the pipeline section that sets the key).
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
  baseline = resolve_config(config, vocab_from_data=True)
  # Its init_from, the baseline's folder, is the pipeline's to set (pipeline.run).
  pruning = run_config.pruning_stage(
      baseline, "", train=stages.prune_train.to_dict(),
      gates=stages.prune_gates.to_dict(),
      distill=stages.get("prune_distill", defaults.distill).to_dict())
  # Checked in full now, before the baseline trains: its errors name the pipeline's
  # flags for the keys the pipeline section sets.
  flags = {"gates": "pipeline.prune_gates",
           **{f"train.{key}": f"pipeline.prune_train.{key}" for key in stages.prune_train}}
  if "prune_distill" in stages:
    flags["distill"] = "pipeline.prune_distill"
  try:
    pruning = resolve_config(pruning, vocab_from_data=True)
  except ConfigError as e:
    raise ConfigError(config_checks.named_as(str(e), flags)) from None
  return run_config.PipelineConfig(baseline=baseline, pruning=pruning,
                                   speed_batches=stages.speed_batches)


def resolve(config, *, starts_run: bool = False) -> RunSetup:
  """The run's objects, after checking the config (a ConfigDict or a RunConfig);
  `starts_run`: the setup of a run about to train, whose starting point (`init_from`)
  is checked too.

  Raises:
    ConfigError: an inconsistent or out-of-range config (see config_checks.py), or a
      pruning or distilling run that does not say what it starts from.
  """
  return _build(*_checked(config, starts_run=starts_run))


def prepare_run(config) -> tuple[RunSetup, data_lib.Corpus]:
  """(the objects of a run about to train, its dataset): its config checked (and what
  it starts from) before the dataset is read, then completed from the dataset
  (`RunConfig.completed`), as the run saves it.

  Raises:
    ConfigError: as `prepare`.
    DataError: the dataset cannot be loaded.
  """
  run, corpus, mesh_shape = _prepared(config)
  return _build(run, mesh_shape), corpus


def _build(run: RunConfig, mesh_shape: tuple[int, int]) -> RunSetup:
  cfg = model_lib.ModelConfig.from_config(run)
  lm = model_lib.TransformerLM(cfg)
  mesh = sharding.make_mesh(mesh_shape)
  # A budget becomes its number of open heads n* here, once; a bad one fails at setup.
  # With persistent groups it stays a size, in the units each kind of gate prunes.
  units = head_costs.budget_units(run, cfg)
  allowed = (None if not run.gates.budget_target
             else head_costs.target_open_heads(run, cfg) if units is None
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


def prepare(config) -> tuple[RunConfig, data_lib.Corpus]:
  """(the config completed from its dataset (`RunConfig.completed`), the dataset).

  The config's own checks come first, so a bad config fails before any dataset is
  read or prepared.

  Raises:
    ConfigError: as `config_checks.check_config`, or a
      `model.vocab_size` that is not the dataset's.
    DataError: the dataset cannot be loaded.
  """
  return _prepared(config)[:2]


def _prepared(config, starts_run: bool = True
              ) -> tuple[RunConfig, data_lib.Corpus, tuple[int, int]]:
  """(the checked config completed from its dataset, the dataset, the mesh shape);
  `starts_run`: also what a run that trains it starts from (its `init_from`)."""
  run, mesh_shape = _checked(config, vocab_from_data=True, starts_run=starts_run)
  corpus = data_lib.load_run_corpus(run)
  vocab_size = run.model.vocab_size
  if vocab_size and corpus.vocab_size != vocab_size:
    raise ConfigError(
        f"config.model.vocab_size is {vocab_size} but dataset {run.data.name!r} has "
        f"{corpus.vocab_size} types; set --config.model.vocab_size={corpus.vocab_size}, "
        "or 0 to take it from the dataset.")
  data_lib.warn_if_unk_untrained(corpus)
  return _completed(run, corpus), corpus, mesh_shape


def _completed(run: RunConfig, corpus: data_lib.Corpus) -> RunConfig:
  """`RunConfig.completed` from the dataset, own word-level text's output layer
  (`word_output`), and with an adaptive softmax each cluster's share of the training
  tokens (unless set), which sizes its tail capacities."""
  run = run.completed(corpus.vocab_size)
  run = run_config.derived_run(run, model=word_output(run))
  cfg = model_lib.ModelConfig.from_config(run)
  if not cfg.cutoffs or run.model.cluster_fractions:
    return run
  bounds = adaptive.cluster_bounds(cfg.vocab_size, cfg.cutoffs)
  fractions = vocab_logsumexp.cluster_fractions(corpus.splits["train"], bounds)
  return run_config.derived_run(run, model=dict(cluster_fractions=fractions))


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
  m, data = run.model, run.data
  if not (m.auto_cutoffs and data.name == "text_files" and data.level in ("", "word")
          and not m.cutoffs and m.div_val == 1 and m.vocab_size):
    return {}
  cutoffs = adaptive.default_cutoffs(data.name, m.vocab_size)
  plain, layers = _output_and_layer_macs(run)
  if not cutoffs or plain <= layers:
    return {}
  return dict(cutoffs=cutoffs,
              div_val=next((k for k in (4, 2) if m.d_model // k ** len(cutoffs)), 1))


def _output_and_layer_macs(run: RunConfig) -> tuple[float, float]:
  """MACs per token of the model's output layer (as it runs, its tail clusters at their
  capacity) and of all its layers, at the train lengths."""
  cfg = model_lib.ModelConfig.from_config(run)
  t = run.train
  return (head_costs.output_macs_per_token(cfg, t.batch_size * t.seq_len),
          head_costs.macs_per_token(cfg, t.seq_len, t.mem_len,
                                    t.batch_size)["macs_per_token_non_embedding"])


def output_note(run: RunConfig) -> str:
  """What a run says in its first lines when `word_output` chose its output layer:
  the cutoffs, and the cost of the plain softmax it replaces; else ''."""
  plain_run = run_config.derived_run(run, model=dict(cutoffs=(), div_val=1))
  chosen = word_output(plain_run)
  if not chosen or any(getattr(run.model, k) != v for k, v in chosen.items()):
    return ""
  plain, layers = _output_and_layer_macs(plain_run)
  adaptive_macs, _ = _output_and_layer_macs(run)
  return (f"Word level, {run.model.vocab_size:,} types: an adaptive softmax (cutoffs "
          f"{', '.join(map(str, run.model.cutoffs))}; div_val {run.model.div_val}) "
          f"costs {adaptive_macs / 1e6:.2f}M MACs per token, where a plain one would cost "
          f"{plain / 1e6:.2f}M, {plain / layers:.1f}x the {layers / 1e6:.2f}M of all the "
          "layers (--config.model.auto_cutoffs=False keeps the plain softmax).")


def prepare_pipeline(config: run_config.PipelineConfig, baseline_dir
                     ) -> tuple[RunConfig, RunConfig, data_lib.Corpus]:
  """(baseline config, pruning config, the dataset): both stages completed from their
  dataset (`prepare`), the pruning stage starting from `baseline_dir`, the
  baseline's folder, which is also its teacher when it distills."""
  baseline, corpus = prepare(config.baseline)
  pruning = run_config.derived_run(config.pruning, init_from=str(baseline_dir))
  return baseline, _completed(pruning, corpus), corpus


def vocab_size(config) -> int:
  """The config's `model.vocab_size`, or, when unset, its dataset's (which is then
  read): for commands that build a model without training it, and so need no
  `init_from`."""
  return (config.model.vocab_size
          or _prepared(config, starts_run=False)[0].model.vocab_size)


def with_vocab_size(config) -> RunConfig:
  """The RunConfig of `config` with its `model.vocab_size` set (`vocab_size`), and
  the output layer a run would complete it with (`word_output`)."""
  run = RunConfig.of(config)
  run = run_config.derived_run(run, model=dict(vocab_size=vocab_size(run)))
  return run_config.derived_run(run, model=word_output(run))
