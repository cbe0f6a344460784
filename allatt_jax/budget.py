"""Direct budget targets for head pruning: a Lagrangian controller on the expected L0.

A fixed λ gives whatever sparsity it gives; hitting a wanted model size then takes a
sweep. Instead, a pruning run can ask for a budget (at most one of them):

  gates.target_sparsity   fraction of all heads to remove
  gates.target_params     non-embedding parameters of the pruned model
  gates.target_macs       non-embedding MACs per token (at the eval lengths)

The budget becomes a number of open heads n* through the cost model
(`head_costs.target_open_heads`: every head of a layer costs the same parameters
and MACs, so cost is linear in the head count; n* is the most heads that fit), once,
at setup (`Penalty.of`). The L0 term of the loss becomes

  λ1 (E[L0] − t(step)) + λ2 (E[L0] − t(step))²

where the target t moves linearly from the initial expected count to n* over
`gates.budget_warmup_steps` (the analogue of the λ warm-up; by default 60% of the
steps before the freeze, so that the gates close heads as slowly as a fixed λ would
and the loss, not the controller's pace, picks them), and the multipliers λ1, λ2
live in their own variable collection and are trained by gradient *ascent*
(`optim.make_optimizer` gives them their own group): while more heads are expected
open than the target allows, λ1 grows and pushes gates shut; when fewer are, it
shrinks (below zero it pulls gates open). λ2 only grows, damping the oscillation of
the pure Lagrangian. This is the controller of structured-pruning work after the
paper (Wang et al. 2020, "Structured Pruning of Large Language Models"; Xia et al.
2022, CoFi). The multipliers stop with the gates at `gates.freeze_step`.

What the controller counts. The expected count treats a head at σ(π) = 0.4 as 0.4
of a head, but the export keeps it or not: with gates still undecided at the freeze
(open probabilities spread around 1/2) the expectation can meet the target and the
head count miss it (measured at 50% sparsity: 15.85 expected, 12 kept of 16). So
after the target warm-up the count sharpens, σ(k·π) with k rising linearly from 1 to
`gates.budget_sharpness` at the freeze (ours; 1 keeps the expected count of the
controllers above): the constraint moves towards the count the export keeps, and
its gradient towards the heads near the decision.

Whatever the gates do, at the freeze the run keeps exactly n* heads (`prune.keep_open_heads`:
the heads ranked by logit where the gates disagree with the budget), so the gated
model trains its last steps, and is exported, at the size asked for.

Persistent groups (`gates.persistent_group`). With gates on groups of persistent
slots, units of two costs compete: a head (its projections and context attention)
and each group of its slots (`head_costs.UnitCosts`). The count becomes a size in
heads, Σ_h P_h·(1 − n·s + s·Σ_g Q_hg) for n groups per head, each worth s of a
head's cost (P, Q: the heads' and groups' open probabilities; P = 1 for heads not
gated), the expected cost of the model in units of one whole head (after CoFi's
expected model size). The fixed-λ L0 term counts the same with the parameters'
share s; a budget steers it to its value in those units (`UnitCosts.size_of`), and
at the freeze `persistent_groups.keep_within_budget` makes the model exactly fit:
at or just under the budget, with no unit left out that would still fit.
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from allatt_jax import gates as gates_lib
from allatt_jax import model as model_lib
from allatt_jax import run_config

COLLECTION = "lagrangian"


def lambda_schedule(gates: run_config.GatesSection) -> optax.Schedule:
  """λ(t) of the L0 term: linear from 0 over the warm-up (technique 1), then constant."""
  if not gates.l0_warmup_steps:
    return optax.constant_schedule(gates.lam)
  return optax.linear_schedule(0.0, gates.lam, gates.l0_warmup_steps)


def expected_open(gate: run_config.GatesSection, gates, sharpness=1.0) -> jax.Array:
  """The expected number of heads open in the gated forward pass; with `sharpness`
  k > 1, nearer the deterministic count (`gates.forward_open_probability`).

  Not P(g > 0), the L0 penalty's count: a controller on it would settle with fewer
  hard gates open than its target.
  """
  return sum(jnp.sum(gates_lib.forward_open_probability(logits_H, gate, sharpness))
             for logits_H in jax.tree.leaves(gates))


def expected_size(gate: run_config.GatesSection, gates, group_share: float,
                  sharpness=1.0) -> jax.Array:
  """The expected size of the model in heads when persistent groups are gated too:
  each head's open probability times the share of its cost its expected open groups
  keep (a group is worth `group_share` of a head), summed over heads."""
  total = jnp.zeros(())
  for layer in gates.values():
    layer_gates = layer["attention"]
    groups_HxG = gates_lib.forward_open_probability(layer_gates["persistent_logits"], gate,
                                                    sharpness)
    size_H = 1.0 - group_share * (groups_HxG.shape[1] - jnp.sum(groups_HxG, axis=1))
    if "logits" in layer_gates:
      size_H = size_H * gates_lib.forward_open_probability(layer_gates["logits"], gate,
                                                           sharpness)
    total += jnp.sum(size_H)
  return total


def target_warmup_steps(configured: int | None, freeze_step: int) -> int:
  """The steps over which the target moves to n*: `gates.budget_warmup_steps`, or
  unset, 60% of the gate phase (measured at 50% sparsity on configs/exp_chars.py:
  200 steps → 15 of 16 heads kept by the gates, +0.078 bpc against the fixed λ of
  that size; 600 of 1000 → 16 of 16, +0.001)."""
  return round(0.6 * freeze_step) if configured is None else configured


def sharpness_schedule(warmup_steps: int, freeze_step: int,
                       final: float) -> optax.Schedule:
  """k(step): 1 until the target warm-up ends, then linear to `final` at the freeze."""
  if final == 1.0 or freeze_step <= warmup_steps:
    return optax.constant_schedule(1.0)
  return optax.join_schedules(
      [optax.constant_schedule(1.0),
       optax.linear_schedule(1.0, final, freeze_step - warmup_steps)], [warmup_steps])


@dataclasses.dataclass(frozen=True)
class Penalty:
  """The L0 term of the loss, resolved once at setup and handed to the train step.

  Without a budget: `lam(step)` (the fixed-λ schedule) times the L0 penalty. With one
  (`target` set): the Lagrangian on the sharpened `expected_open` of the variables'
  gates, its target and sharpness schedules already constants of the run.
  """
  lam: optax.Schedule
  gate: run_config.GatesSection
  target: optax.Schedule | None = None      # t(step), only with a budget
  # n*, the heads a budget allows; with persistent groups, the budget's value.
  allowed: float | None = None
  sharpness: optax.Schedule = optax.constant_schedule(1.0)   # k(step) of the count
  # With persistent groups: their units' costs (params for a fixed λ), by which the
  # L0 term and the controller count the model's size.
  units: Any = None

  @classmethod
  def of(cls, gates: run_config.GatesSection, layer_heads, allowed: float | None,
         units=None) -> "Penalty":
    """The run's L0 term: the fixed-λ schedule, or, with a budget of `allowed` heads
    (n*, `head_costs.target_open_heads`), the controller whose target t(step) moves
    from the initial expected open heads (`layer_heads` at the gates' init) down to
    n* over `gates.budget_warmup_steps` (unset: 60% of the steps before the freeze).
    With persistent groups (`units`, `head_costs.UnitCosts`), `allowed` is the
    budget's value and the count is the expected size (`expected_size`)."""
    lam, gate = lambda_schedule(gates), gates
    if allowed is None:
      return cls(lam, gate, units=units)
    warmup = target_warmup_steps(gates.budget_warmup_steps, gates.freeze_step)
    controlled = functools.partial(
        cls, lam, gate, allowed=allowed, units=units,
        sharpness=sharpness_schedule(warmup, gates.freeze_step, gates.budget_sharpness))
    end = (float(allowed) if units is None
           else units.size_of(allowed, len([h for h in layer_heads if h])))
    if not warmup:
      return controlled(optax.constant_schedule(end))
    if units is None:
      start = float(expected_open(gate, [jnp.full((h,), gate.init)
                                         for h in layer_heads if h]))
    else:
      groups = units.groups_per_head
      init_gates = {f"layer_{i}": {"attention": {
          "persistent_logits": jnp.full((h, groups), gate.init),
          **({"logits": jnp.full((h,), gate.init)} if gate.heads else {})}}
                    for i, h in enumerate(layer_heads) if h}
      start = float(expected_size(gate, init_gates, units.group_share))
    return controlled(optax.linear_schedule(start, end, warmup))

  def l0(self, stats) -> jax.Array:
    """The L0 term's expected count of the gated forward pass's statistics (each
    layer's, `model.l0_penalty`)."""
    return model_lib.l0_penalty(stats, None if self.units is None
                                else self.units.group_share)

  @property
  def controlled(self) -> bool:
    return self.target is not None

  def add_multipliers(self, variables: dict) -> dict:
    """The variables with the multipliers' collection (zero) when a budget is set."""
    if not self.controlled:
      return variables
    return {**variables, COLLECTION: {"lambda_1": jnp.zeros(()), "lambda_2": jnp.zeros(())}}

  def __call__(self, variables, l0, step) -> jax.Array:
    if not self.controlled:
      return self.lam(step) * l0
    gap = self.open_count(variables, step) - self.target(step)
    multipliers = variables[COLLECTION]
    return multipliers["lambda_1"] * gap + multipliers["lambda_2"] * gap ** 2

  def metrics(self, variables, step) -> dict:
    """The controller's state for the train metrics; λ1 is reported as 'lambda'."""
    if not self.controlled:
      return {}
    return {"lambda": variables[COLLECTION]["lambda_1"],
            "lambda_2": variables[COLLECTION]["lambda_2"],
            "open_target": self.target(step),
            "open_controlled": self.open_count(variables, step)}

  def open_count(self, variables, step) -> jax.Array:
    """What the controller steers to t(step)."""
    if self.units is not None:
      return expected_size(self.gate, variables["gates"], self.units.group_share,
                           self.sharpness(step))
    return expected_open(self.gate, variables["gates"], self.sharpness(step))
