"""A run config resolved once into the typed objects a run is made of.

`resolve` is the one place a run reads its ConfigDict for model, mesh, optimizer,
L0 term, train-step constants, state shapes and evaluator; everything below
(`steps`, `evaluate`, `validation`'s state checks, export) receives these objects.
It checks the config first (`validation.check_config`), so a bad config fails before
anything is traced, and it reads no data until a run asks for its `corpus`.
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from allatt_jax import budget
from allatt_jax import cost_model
from allatt_jax import data as data_lib
from allatt_jax import evaluation
from allatt_jax import model as model_lib
from allatt_jax import optim
from allatt_jax import sharding
from allatt_jax import steps
from allatt_jax import validation
from allatt_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RunSetup:
  """Everything a run needs besides its data and its state."""
  config: ml_collections.ConfigDict     # what the run saves as config.json
  lm: model_lib.TransformerLM
  mesh: jax.sharding.Mesh
  optimizer: optax.GradientTransformationExtraArgs
  penalty: budget.Penalty
  settings: steps.StepConfig
  abstract_state: Any                   # steps.TrainState of ShapeDtypeStructs
  state_sharding: Any

  @functools.cached_property
  def evaluator(self) -> evaluation.Evaluator:
    return evaluation.Evaluator.from_config(self.lm, self.mesh, self.config)

  @functools.cached_property
  def corpus(self) -> data_lib.Corpus:
    """The run's dataset (`load_corpus`), loaded on first use."""
    return load_corpus(self.config)

  def new_state(self) -> steps.TrainState:
    """A freshly initialised state, placed on the mesh."""
    init = functools.partial(steps.init_state, self.lm, self.optimizer, self.penalty,
                             self.settings)
    with sharding.activate(self.mesh):
      return jax.jit(init, out_shardings=self.state_sharding)(
          jax.random.key(self.settings.seed))

  def train_step(self, *, sample_gates: bool):
    """The jitted train step over this setup's mesh."""
    return steps.jit_train_step(
        self.lm, self.optimizer, self.penalty, self.settings, self.state_sharding,
        sharding.batch_sharding(self.mesh), sharding.replicated(self.mesh),
        sample_gates=sample_gates)


def resolve(config: ml_collections.ConfigDict) -> RunSetup:
  """The run's objects, after checking the config.

  Raises:
    ConfigError: an inconsistent or out-of-range config (see validation.py).
  """
  cfg = model_lib.ModelConfig.from_config(config)
  validation.check_config(config, cfg)
  lm = model_lib.TransformerLM(cfg)
  mesh = sharding.make_mesh(config.mesh)
  penalty = penalty_from_config(config, cfg)
  optimizer = optim.make_optimizer(
      config, budget.COLLECTION if penalty.controlled else None)
  settings = steps.StepConfig.from_config(config)
  abstract, shardings = steps.abstract_state(lm, optimizer, penalty, settings, mesh)
  return RunSetup(config=config, lm=lm, mesh=mesh, optimizer=optimizer, penalty=penalty,
                  settings=settings, abstract_state=abstract, state_sharding=shardings)


def penalty_from_config(config: ml_collections.ConfigDict,
                        cfg: model_lib.ModelConfig) -> budget.Penalty:
  """The run's L0 term; a budget that cannot work fails here, at setup.

  With a budget, t(step) moves from the initial expected open heads down to n* over
  the L0 warm-up.
  """
  lam = budget.lambda_schedule(config.gates)
  if cost_model.target_key(config) is None:
    return budget.Penalty(lam, cfg.gate)
  end = float(cost_model.target_open_heads(config, cfg))
  if not config.gates.l0_warmup_steps:
    return budget.Penalty(lam, cfg.gate, optax.constant_schedule(end))
  start = float(budget.expected_open(cfg.gate, [jnp.full((h,), cfg.gate.init)
                                                for h in cfg.layer_heads]))
  return budget.Penalty(lam, cfg.gate,
                        optax.linear_schedule(start, end, config.gates.l0_warmup_steps))


def load_corpus(config: ml_collections.ConfigDict) -> data_lib.Corpus:
  """The run's dataset, checked against the model's vocabulary size.

  Raises:
    ConfigError: `model.vocab_size` is not the dataset's.
    DataError: the dataset cannot be loaded.
  """
  corpus = data_lib.load_run_corpus(config)
  if corpus.vocab_size != config.model.vocab_size:
    raise ConfigError(
        f"config.model.vocab_size is {config.model.vocab_size} but dataset "
        f"{config.data.name!r} has {corpus.vocab_size} types; set "
        f"--config.model.vocab_size={corpus.vocab_size}.")
  return corpus
