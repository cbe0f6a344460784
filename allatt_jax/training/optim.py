"""Optimizer and schedules: LAMB with warm-up + cosine, and the gate freeze.

The optimizer acts on {'params': ..., 'gates': ...}, grouped by collection: gates get
the same LAMB at `gates.lr_multiplier` times the learning rate (10, the official
code's), exactly zero from `gates.freeze_step`; a budget's multipliers get gradient
ascent, outside the clipping. Schedules read the train state's step (`update`'s extra
argument `step`), so a rolled-back non-finite step leaves them in line with it.

LAMB (You et al. 2020), per parameter tensor, by `train.optimizer`: 'lamb' as the
official code (Adam moments without bias correction, eps 1e-8, decay added to the Adam
step, ‖w‖ in the trust ratio clamped to [0, 10], ratio 1 where a norm is 0), or
'optax_lamb' (`optax.lamb`: bias-corrected, eps 1e-6, unclamped).
"""
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from allatt_jax.config import run_config

OPTIMIZERS = ("lamb", "optax_lamb")


def learning_rate_schedule(train: run_config.TrainSection,
                           peak: float | None = None) -> optax.Schedule:
  """Linear warm-up to the peak, then cosine decay to the final rate."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.learning_rate if peak is None else peak,
      warmup_steps=train.warmup_steps, decay_steps=max(train.num_steps, train.warmup_steps + 1),
      end_value=train.final_learning_rate)


def gate_learning_rate_schedule(config: run_config.RunConfig) -> optax.Schedule:
  """`gates.lr_multiplier` times the params' schedule, zero from the freeze on.

  A config that sets `gates.learning_rate` gets the params' schedule shape at that
  peak instead.
  """
  gates = config.gates
  if gates.learning_rate is None:
    model, multiplier = learning_rate_schedule(config.train), gates.lr_multiplier
    before_freeze = lambda step: multiplier * model(step)
  else:
    before_freeze = learning_rate_schedule(config.train, gates.learning_rate)
  return optax.join_schedules([before_freeze, optax.constant_schedule(0.0)],
                              [gates.freeze_step])


def multiplier_learning_rate_schedule(config: run_config.RunConfig) -> optax.Schedule:
  """The budget controller's ascent rate, zero from the gate freeze on."""
  return optax.join_schedules(
      [optax.constant_schedule(config.gates.lagrangian_lr), optax.constant_schedule(0.0)],
      [config.gates.freeze_step])


class Schedules(NamedTuple):
  """A run's learning-rate schedules, built once: the optimizer follows them and the
  train step reports the first two."""
  params: optax.Schedule
  gates: optax.Schedule
  multipliers: optax.Schedule     # a budget's ascent rate


def schedules(config: run_config.RunConfig) -> Schedules:
  return Schedules(learning_rate_schedule(config.train), gate_learning_rate_schedule(config),
                   multiplier_learning_rate_schedule(config))


class UnbiasedAdamState(NamedTuple):
  mu: optax.Updates
  nu: optax.Updates


def scale_by_unbiased_adam(b1: float = 0.9, b2: float = 0.999,
                           eps: float = 1e-8) -> optax.GradientTransformation:
  """m / (sqrt(v) + eps) with Adam's moments, without bias correction.

  `optax.scale_by_adam` always corrects the bias; the official LAMB does not, which
  makes the first steps after a (re)start smaller.
  """
  def init_fn(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return UnbiasedAdamState(mu=zeros(), nu=zeros())

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return updates, UnbiasedAdamState(mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_clamped_trust_ratio(max_weight_norm: float | None,
                                 eps: float) -> optax.GradientTransformation:
  """Scales each tensor's update u by min(‖w‖, max) / (‖u‖ + eps); by 1 if a norm is 0.

  `optax.scale_by_trust_ratio` has no upper clamp on ‖w‖.
  """
  def update_fn(updates, state, params):
    def scale(u, w):
      w_norm = jnp.linalg.norm(w.ravel())
      if max_weight_norm is not None:
        w_norm = jnp.minimum(w_norm, max_weight_norm)
      u_norm = jnp.linalg.norm(u.ravel())
      ratio = jnp.where((w_norm == 0) | (u_norm == 0), 1.0, w_norm / (u_norm + eps))
      return u * ratio.astype(u.dtype)
    return jax.tree.map(scale, updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def scale_by_step_schedule(schedule: optax.Schedule,
                           flip_sign: bool = True) -> optax.GradientTransformationExtraArgs:
  """Multiplies updates by -schedule(step), `step` being the caller's extra argument."""
  sign = -1.0 if flip_sign else 1.0

  def update_fn(updates, state, params=None, *, step, **extra_args):
    del params, extra_args
    rate = sign * schedule(step)
    return jax.tree.map(lambda u: u * rate.astype(u.dtype), updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def decay_mask(patterns) -> callable:
  """Weight-decay mask: False for leaves whose 'a/b/c' path matches any pattern."""
  compiled = [re.compile(p) for p in patterns]

  def mask(tree):
    def decayed(path, _):
      name = "/".join(str(getattr(k, "key", k)) for k in path)
      return not any(p.search(name) for p in compiled)
    return jax.tree_util.tree_map_with_path(decayed, tree)
  return mask


def lamb(train: run_config.TrainSection, schedule: optax.Schedule,
         weight_decay: float) -> optax.GradientTransformationExtraArgs:
  """LAMB of the form `train.optimizer` names, at `schedule(step)`."""
  if train.optimizer == "lamb":
    moments = scale_by_unbiased_adam(eps=train.lamb_eps)
    trust = scale_by_clamped_trust_ratio(train.lamb_max_weight_norm, train.lamb_eps)
  elif train.optimizer == "optax_lamb":
    moments = optax.scale_by_adam(eps=1e-6)
    trust = optax.scale_by_trust_ratio()
  else:
    raise ValueError(f"Unknown train.optimizer {train.optimizer!r}; one of {OPTIMIZERS}.")
  decay = (optax.add_decayed_weights(weight_decay, decay_mask(train.weight_decay_exclude))
           if weight_decay else optax.identity())
  return optax.chain(moments, decay, trust, scale_by_step_schedule(schedule))


def make_optimizer(train: run_config.TrainSection, rates: Schedules,
                   ascent_collection: str | None = None
                   ) -> optax.GradientTransformationExtraArgs:
  """Clipping over all gradients, then LAMB per group ('params', 'gates'), and plain
  gradient ascent for `ascent_collection` (a budget's multipliers) when given.

  Its `update` takes the train state's step: `update(grads, state, params, step=step)`.
  """
  groups = {"params": lamb(train, rates.params, train.weight_decay),
            # No decay on gate logits: it would pull every gate towards half open.
            "gates": lamb(train, rates.gates, 0.0)}
  clip = optax.clip_by_global_norm(train.grad_clip) if train.grad_clip else optax.identity()
  if ascent_collection:
    # The multipliers' gradients are constraint violations (in heads), not slopes of
    # the loss: clipped together, they would shrink every model gradient.
    clip = optax.masked(clip, lambda v: {name: name != ascent_collection for name in v})
    groups[ascent_collection] = scale_by_step_schedule(
        rates.multipliers, flip_sign=False)
  label_by_collection = lambda variables: {name: name for name in variables}
  return optax.chain(clip, optax.multi_transform(groups, label_by_collection))

