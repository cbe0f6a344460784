"""Direct budget targets for head pruning: a Lagrangian controller on the expected L0.

A fixed λ gives whatever sparsity it gives; hitting a wanted model size then takes a
sweep. Instead, a pruning run can ask for a budget (at most one of them):

  gates.target_sparsity   fraction of all heads to remove
  gates.target_params     non-embedding parameters of the pruned model
  gates.target_macs       non-embedding MACs per token (at the eval lengths)

The budget becomes a number of open heads n* through the cost model
(`cost_model.target_open_heads`: every head of a layer costs the same parameters
and MACs, so cost is linear in the head count; n* is the most heads that fit), once,
at setup (`run_setup.penalty_from_config`). The L0 term of the loss becomes

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

What the controller counts (`gates.budget_count`):

  'deterministic'  (ours, the default) the heads the export will keep, 1[π open], in
                   the forward pass, with the gradient of the expected count: the
                   constraint is on the number that decides the model's size.
  'expected'       the expected count alone (the controllers above). Gates that are
                   still undecided at the freeze (open probabilities spread around
                   1/2) can then meet the target in expectation and miss it in heads:
                   measured at 50% sparsity, 15.85 expected, 12 kept of 16.

Either way, at the freeze the run keeps exactly n* heads (`prune.keep_open_heads`:
the heads ranked by logit where the gates disagree with the budget), so the gated
model trains its last steps, and is exported, at the size asked for.
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import optax

from allatt_jax import gates as gates_lib

COLLECTION = "lagrangian"


def lambda_schedule(gates: ml_collections.ConfigDict) -> optax.Schedule:
  """λ(t) of the L0 term: linear from 0 over the warm-up (technique 1), then constant."""
  if not gates.l0_warmup_steps:
    return optax.constant_schedule(gates.lam)
  return optax.linear_schedule(0.0, gates.lam, gates.l0_warmup_steps)


COUNTS = ("deterministic", "expected")


def expected_open(gate: gates_lib.GateConfig, gates) -> jax.Array:
  """The expected number of heads open in the gated forward pass.

  With straight-through hard gates a head is open iff its stretched sample reaches
  1/2, i.e. with probability σ(π), which is also what the deterministic rule 1[π > 0]
  rounds; Louizos' P(g > 0) (the L0 penalty) would also count samples in (0, 1/2)
  that the hard gate closes, so a controller on it settles with fewer heads open
  than its target. Soft gates are open iff g > 0: there P(g > 0) is the count.
  """
  prob = jax.nn.sigmoid if gate.hard else lambda x: gates_lib.open_probability(x, gate)
  return sum(jnp.sum(prob(logits_H)) for logits_H in jax.tree.leaves(gates))


def deterministic_open(gate: gates_lib.GateConfig, gates) -> jax.Array:
  """The number of heads open by the deterministic rule (the export's)."""
  return sum(jnp.sum(gates_lib.deterministic(logits_H, gate) > 0)
             for logits_H in jax.tree.leaves(gates)).astype(jnp.float32)


def controlled_open(gate: gates_lib.GateConfig, gates, count: str) -> jax.Array:
  """The open-head count the controller steers (`count`: one of COUNTS).

  'deterministic' is straight-through: its value is the deterministic count, its
  gradient that of the expected count (the count itself has none).
  """
  expected = expected_open(gate, gates)
  if count == "expected":
    return expected
  return expected + jax.lax.stop_gradient(deterministic_open(gate, gates) - expected)


@dataclasses.dataclass(frozen=True)
class Penalty:
  """The L0 term of the loss, resolved once at setup and handed to the train step.

  Without a budget: `lam(step)` (the fixed-λ schedule) times the L0 penalty. With one
  (`target` set): the Lagrangian on `controlled_open` of the variables' gates, its
  target schedule already a constant of the run.
  """
  lam: optax.Schedule
  gate: gates_lib.GateConfig
  target: optax.Schedule | None = None   # t(step), only with a budget
  allowed: int | None = None             # n*, the heads the budget allows
  count: str = "deterministic"           # what t(step) is compared with (COUNTS)

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
    gap = controlled_open(self.gate, variables["gates"], self.count) - self.target(step)
    multipliers = variables[COLLECTION]
    return multipliers["lambda_1"] * gap + multipliers["lambda_2"] * gap ** 2

  def metrics(self, variables, step) -> dict:
    """The controller's state for the train metrics; λ1 is reported as 'lambda'."""
    if not self.controlled:
      return {}
    return {"lambda": variables[COLLECTION]["lambda_1"],
            "lambda_2": variables[COLLECTION]["lambda_2"],
            "open_target": self.target(step),
            "open_controlled": controlled_open(self.gate, variables["gates"], self.count)}
