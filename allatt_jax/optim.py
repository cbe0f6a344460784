"""Optimizer and schedules: LAMB with warm-up + cosine, and the gate freeze.

The optimizer acts on the whole variables dict {'params': ..., 'gates': ...}. Its
groups are chosen by collection name: `optax.multi_transform` gives the `gates` group
the same LAMB, but with a learning rate that drops to exactly zero at
`gates.freeze_step`, so from then on gate values stay bit-identical. A run with a
budget target (budget.py) has a third group, its Lagrange multipliers, trained by
gradient ascent and left out of the gradient clipping.
"""
import ml_collections
import optax

from allatt_jax import budget


def learning_rate_schedule(train: ml_collections.ConfigDict,
                           peak: float | None = None) -> optax.Schedule:
  """Linear warm-up to the peak, then cosine decay to the final rate."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.learning_rate if peak is None else peak,
      warmup_steps=train.warmup_steps, decay_steps=max(train.num_steps, train.warmup_steps + 1),
      end_value=train.final_learning_rate)


def lambda_schedule(gates: ml_collections.ConfigDict) -> optax.Schedule:
  """λ(t) of the L0 term: linear from 0 over the warm-up (technique 1), then constant."""
  if not gates.l0_warmup_steps:
    return optax.constant_schedule(gates.lam)
  return optax.linear_schedule(0.0, gates.lam, gates.l0_warmup_steps)


def gate_learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The params' schedule (or one with the gates' own peak), zero from the freeze on."""
  return optax.join_schedules(
      [learning_rate_schedule(config.train, config.gates.learning_rate),
       optax.constant_schedule(0.0)],
      [config.gates.freeze_step])


def multiplier_learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The budget controller's ascent rate, zero from the gate freeze on."""
  return optax.join_schedules(
      [optax.constant_schedule(config.gates.lagrangian_lr), optax.constant_schedule(0.0)],
      [config.gates.freeze_step])


def _lamb(train, schedule):
  return optax.lamb(schedule, weight_decay=train.weight_decay)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Clipping over all gradients, then LAMB per group ('params', 'gates')."""
  train = config.train
  groups = {"params": _lamb(train, learning_rate_schedule(train)),
            "gates": _lamb(train, gate_learning_rate_schedule(config))}
  clip = optax.clip_by_global_norm(train.grad_clip) if train.grad_clip else optax.identity()
  if budget.enabled(config):
    # The multipliers' gradients are constraint violations (in heads), not slopes of
    # the loss: clipped together, they would shrink every model gradient.
    clip = optax.masked(clip, lambda v: {name: name != budget.COLLECTION for name in v})
    groups[budget.COLLECTION] = optax.scale_by_learning_rate(
        multiplier_learning_rate_schedule(config), flip_sign=False)
  label_by_collection = lambda variables: {name: name for name in variables}
  return optax.chain(clip, optax.multi_transform(groups, label_by_collection))
