"""Hard-concrete head gates and their L0 penalty (Louizos et al. 2018).

One gate logit π per head (and, with `persistent_group`, per group of a head's
persistent slots), sampled while pruning from the stretched, clipped BinConcrete
distribution and made discrete by a straight-through estimator (forward 1[g >= 0.5],
backward through the soft g). The L0 penalty is the expected number of open gates.
Formulas of Shim et al. 2021, §3.2:
  u ~ U(eps, 1-eps),  s = σ((log u - log(1-u) + π) / β),  g = clip(s(ζ-γ) + γ, 0, 1)
  P(g > 0) = σ(π - β log(-γ/ζ))
"""
import jax
import jax.numpy as jnp

from allatt_jax.config import run_config

GAMMA = -0.1
ZETA = 1.1
_EPS = 1e-6


def sample(logits_H: jax.Array, rng: jax.Array, cfg: run_config.GatesSection) -> jax.Array:
  """Stochastic gates for training; hard mode is straight-through."""
  u_H = jax.random.uniform(rng, logits_H.shape, minval=_EPS, maxval=1.0 - _EPS)
  s_H = jax.nn.sigmoid((jnp.log(u_H) - jnp.log1p(-u_H) + logits_H) / cfg.temperature)
  soft_H = jnp.clip(s_H * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)
  if not cfg.hard:
    return soft_H
  hard_H = (soft_H >= 0.5).astype(soft_H.dtype)
  return soft_H + jax.lax.stop_gradient(hard_H - soft_H)


def deterministic(logits_H: jax.Array, cfg: run_config.GatesSection) -> jax.Array:
  """Gates for evaluation and after the freeze: open iff π >= 0 (hard mode)."""
  if cfg.hard:
    is_open = logits_H >= 0 if cfg.open_at_zero else logits_H > 0
    return is_open.astype(logits_H.dtype)
  return jnp.clip(jax.nn.sigmoid(logits_H) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def open_probability(logits_H: jax.Array, cfg: run_config.GatesSection) -> jax.Array:
  """P(g > 0) per head; its sum over heads is the expected L0 norm."""
  return jax.nn.sigmoid(logits_H - cfg.temperature * jnp.log(-GAMMA / ZETA))


def forward_open_probability(logits_H: jax.Array, cfg: run_config.GatesSection,
                             sharpness=1.0) -> jax.Array:
  """P(the sampled gate is open in the forward pass) per head.

  Straight-through hard gates are open iff the stretched sample reaches 1/2, which
  happens with probability σ(π), the probability the deterministic rule rounds;
  P(g > 0) (`open_probability`) also counts samples in (0, 1/2) that the hard gate
  closes. Soft gates are open iff g > 0. With `sharpness` k > 1 the argument of the
  sigmoid is scaled by k: nearer the deterministic decision (the budget's count).
  """
  offset = 0.0 if cfg.hard else cfg.temperature * jnp.log(-GAMMA / ZETA)
  return jax.nn.sigmoid(sharpness * (logits_H - offset))


def output_scale(gates_H: jax.Array, cfg: run_config.GatesSection) -> jax.Array:
  """s_g = H / Σg, at most H (all gates closed), without gradient (technique 3)."""
  num_heads = gates_H.shape[-1]
  if not cfg.scale_output:
    return jnp.ones((), gates_H.dtype)
  # Σg < 1 (every gate closed, or soft gates near zero) would blow the scale up; the
  # clip at H keeps a dead layer at zero output instead of NaN.
  return num_heads / jnp.maximum(jax.lax.stop_gradient(jnp.sum(gates_H)), 1.0)
