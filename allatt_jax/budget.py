"""Direct budget targets for head pruning: a Lagrangian controller on the expected L0.

A fixed λ gives whatever sparsity it gives; hitting a wanted model size then takes a
sweep. Instead, a pruning run can ask for a budget (at most one of them):

  gates.target_sparsity   fraction of all heads to remove
  gates.target_params     non-embedding parameters of the pruned model
  gates.target_macs       non-embedding MACs per token (at the eval lengths)

The budget becomes a number of open heads n* through the cost model (costs.py: every
head of a layer costs the same parameters and MACs, so cost is linear in the head
count; n* is the most heads that fit). The L0 term of the loss becomes

  λ1 (E[L0] − t(step)) + λ2 (E[L0] − t(step))²

where the target t moves linearly from the initial E[L0] to n* over
`gates.l0_warmup_steps` (the analogue of the λ warm-up), and the multipliers λ1, λ2
live in their own variable collection and are trained by gradient *ascent*
(`optim.make_optimizer` gives them their own group): while more heads are expected
open than the target allows, λ1 grows and pushes gates shut; when fewer are, it
shrinks (below zero it pulls gates open). λ2 only grows, damping the oscillation of
the pure Lagrangian. This is the controller of structured-pruning work after the
paper (Wang et al. 2020, "Structured Pruning of Large Language Models"; Xia et al.
2022, CoFi). The multipliers stop with the gates at `gates.freeze_step`.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import optax

from allatt_jax import costs
from allatt_jax import gates as gates_lib
from allatt_jax import model as model_lib
from allatt_jax.errors import ConfigError

COLLECTION = "lagrangian"
TARGET_KEYS = ("target_sparsity", "target_params", "target_macs")


def target_key(config: ml_collections.ConfigDict) -> str | None:
  """The budget key the config sets, or None for a plain fixed-λ (or baseline) run."""
  keys = [k for k in TARGET_KEYS if config.gates.get(k) is not None]
  if len(keys) > 1:
    raise ConfigError(f"config.gates sets {keys}; set at most one budget target.")
  return keys[0] if keys else None


def enabled(config: ml_collections.ConfigDict) -> bool:
  return target_key(config) is not None


def head_cost(cfg: model_lib.ModelConfig, key: str, eval_lengths) -> tuple[float, float]:
  """(cost of the unpruned model, cost of one head) in params or MACs per token.

  Uses layer 0: all heads of all layers cost the same in this model family.
  """
  one_fewer = dataclasses.replace(
      cfg, heads_per_layer=(cfg.layer_heads[0] - 1, *cfg.layer_heads[1:]))
  if key == "target_params":
    cost = lambda c: costs.param_counts(c)["params_non_embedding"]
  else:
    cost = lambda c: costs.macs_per_token(c, *eval_lengths)["macs_per_token_non_embedding"]
  full = cost(cfg)
  return full, full - cost(one_fewer)


def target_open_heads(config: ml_collections.ConfigDict) -> int:
  """n*: the most open heads the config's budget allows.

  Raises:
    ConfigError: no budget, more than one, or one out of range, or a run without
      gates, or one that also sets a fixed λ.
  """
  key = target_key(config)
  if key is None:
    raise ConfigError(f"config.gates sets none of {TARGET_KEYS}.")
  gates = config.gates
  if not gates.enabled:
    raise ConfigError(f"config.gates.{key} needs a pruning run: set gates.enabled=True.")
  if gates.lam:
    raise ConfigError(
        f"config.gates.{key} replaces the fixed λ (the controller finds it), but "
        f"config.gates.lam={gates.lam}; set gates.lam=0.")
  value = gates[key]
  cfg = model_lib.model_config(config)
  total = sum(cfg.layer_heads)
  if key == "target_sparsity":
    if not 0.0 <= value <= 1.0:
      raise ConfigError(f"config.gates.target_sparsity={value} must lie in [0, 1].")
    return round((1.0 - value) * total)
  if value <= 0:
    raise ConfigError(f"config.gates.{key}={value} must be positive.")
  e = config.eval
  full, per_head = head_cost(cfg, key, (e.seq_len, e.mem_len, e.batch_size))
  # The small tolerance keeps a budget computed from an exact head count exact.
  heads = total - math.ceil((full - value) / per_head - 1e-9)
  return min(max(heads, 0), total)


def add_multipliers(config: ml_collections.ConfigDict, variables: dict) -> dict:
  """The variables with the multipliers' collection (zero) when a budget is set."""
  if not enabled(config):
    return variables
  target_open_heads(config)   # a budget that cannot work fails here, at setup
  return {**variables, COLLECTION: {"lambda_1": jnp.zeros(()), "lambda_2": jnp.zeros(())}}


def target_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """t(step): from the initial expected open heads down to n* over the L0 warm-up."""
  cfg = model_lib.model_config(config)
  with jax.ensure_compile_time_eval():   # a constant, also when traced in the step
    start = float(expected_open(config, [jnp.full((h,), cfg.gate.init)
                                         for h in cfg.layer_heads]))
  end = float(target_open_heads(config))
  if not config.gates.l0_warmup_steps:
    return optax.constant_schedule(end)
  return optax.linear_schedule(start, end, config.gates.l0_warmup_steps)


def expected_open(config: ml_collections.ConfigDict, gates) -> jax.Array:
  """The expected number of heads open in the gated forward pass.

  With straight-through hard gates a head is open iff its stretched sample reaches
  1/2, i.e. with probability σ(π), which is also what the deterministic rule 1[π > 0]
  rounds; Louizos' P(g > 0) (the L0 penalty) would also count samples in (0, 1/2)
  that the hard gate closes, so a controller on it settles with fewer heads open
  than its target. Soft gates are open iff g > 0: there P(g > 0) is the count.
  """
  gate = model_lib.model_config(config).gate
  prob = jax.nn.sigmoid if gate.hard else lambda x: gates_lib.open_probability(x, gate)
  return sum(jnp.sum(prob(logits_H)) for logits_H in jax.tree.leaves(gates))


def penalty_fn(config: ml_collections.ConfigDict, step, lam):
  """(variables, expected L0) -> the L0 term of the loss at `step`.

  Without a budget: `lam` (the fixed-λ schedule's value) times the L0 penalty. With
  one: the Lagrangian on `expected_open` of the variables' gates.
  """
  if not enabled(config):
    return lambda variables, l0: lam * l0
  target = target_schedule(config)(step)

  def penalty(variables, l0):
    del l0
    gap = expected_open(config, variables["gates"]) - target
    multipliers = variables[COLLECTION]
    return multipliers["lambda_1"] * gap + multipliers["lambda_2"] * gap ** 2
  return penalty


def metrics(config: ml_collections.ConfigDict, variables, step) -> dict:
  """The controller's state for the train metrics; λ1 is reported as 'lambda'."""
  if not enabled(config):
    return {}
  return {"lambda": variables[COLLECTION]["lambda_1"],
          "lambda_2": variables[COLLECTION]["lambda_2"],
          "open_target": target_schedule(config)(step),
          "open_controlled": expected_open(config, variables["gates"])}

