"""A gated model's gates collection read once: per layer the logits of its heads and
of their groups of persistent slots, checked against the config, and what they decide
deterministically (no I/O).

With `gates.persistent_group` = G, a head's N persistent slots form N/G groups (group
g: slots g·G .. (g+1)·G − 1), each gated (`.../attention/persistent_logits`, (H_i, N/G);
with `gates.heads`, heads keep `.../logits`). A slot is kept where its group's
deterministic gate is open and its head's is. The head surgery (`head_removal.remove_heads`),
the budget's rule at the freeze (`freeze`) and the training log all read the
gates through `read`, so each decision is made by one rule, once.
"""
import dataclasses

import jax.numpy as jnp
import numpy as np

from allatt_jax.config import errors
from allatt_jax.model import gates as gates_lib
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config

# A gate logit far enough from 0 that its deterministic gate is exactly 1 (or, negated,
# 0) in hard and soft mode alike.
CERTAIN_LOGIT = 10.0
GROUP_LOGITS = "persistent_logits"
# How an ungated model's heads count: open for certain, their outputs unscaled.
_UNGATED = run_config.GatesSection(hard=True, scale_output=False)


@dataclasses.dataclass(frozen=True)
class Gates:
  """The deterministic gates of a model, per layer (empty or None for a headless
  layer). A gated model's by its logits; an ungated model's are all open, with no
  output scale."""
  head_logits: list[np.ndarray]         # (H_i,) float32; certain where heads have no gates
  head_values: list[np.ndarray]         # the deterministic g (H_i,)
  out_factors: list[np.ndarray]         # g · s_g (H_i,) float32: what W_O's slices absorb
  group_logits: list[np.ndarray | None]  # (H_i, N/G) float32; None without group gates
  groups_open: list[np.ndarray | None]   # (H_i, N/G) bool; None without group gates
  # Per layer, the indices of the heads whose deterministic gate is open (> 0),
  # ascending; empty for a fully closed or headless layer.
  surviving_heads: tuple[np.ndarray, ...]
  # Per layer and head, the persistent slots its open groups keep (ascending); None
  # for a layer when the model has no group gates.
  kept_slots: list[list[np.ndarray] | None]


def read(cfg: model_lib.ModelConfig, gates=None,
         closed: dict[int, list[int]] | None = None) -> Gates:
  """The deterministic gates of a model of config `cfg`.

  Args:
    cfg: the model's config, gated or not.
    gates: a gated model's `gates` collection ({'layer_i': {'attention': {'logits':
      (H_i,), 'persistent_logits': (H_i, N/G)}}}), as arrays; unused when ungated.
    closed: heads to close for certain, {layer: [head, ...]} (checked indices).

  Raises:
    CheckpointError: the gates do not fit `cfg`.
  """
  if cfg.gated:
    logits, gate = _head_logits(cfg, gates), cfg.gate
    groups = _group_logits(cfg, gates)
  else:
    logits = [np.full((heads,), CERTAIN_LOGIT, np.float32) for heads in cfg.layer_heads]
    gate, groups = _UNGATED, [None] * cfg.num_layers
  for layer, heads in (closed or {}).items():
    logits[layer][heads] = -CERTAIN_LOGIT
  values = [np.asarray(gates_lib.deterministic(jnp.asarray(logits_H), gate))
            if logits_H.size else logits_H for logits_H in logits]
  # The scale uses the layer's full gate vector, as the gated forward pass does.
  factors = [(g_H * np.asarray(gates_lib.output_scale(jnp.asarray(g_H), gate))
              ).astype(np.float32) for g_H in values]
  groups_open = [None if logits_HxG is None else
                 np.asarray(gates_lib.deterministic(logits_HxG, gate)) > 0
                 for logits_HxG in groups]
  group = cfg.gate.persistent_group
  kept_slots = [None if open_HxG is None else
                [np.flatnonzero(np.repeat(open_G, group)) for open_G in open_HxG]
                for open_HxG in groups_open]
  return Gates(logits, values, factors, groups, groups_open,
               tuple(np.flatnonzero(g_H > 0) for g_H in values), kept_slots)


def _head_logits(cfg: model_lib.ModelConfig, gates) -> list[np.ndarray]:
  """Per layer, a float32 copy of the head gate logits (H_i,); empty for a headless
  layer; open for certain where the heads have no gates (`gates.heads=False`)."""
  logits = []
  for i, heads in enumerate(cfg.layer_heads):
    if not heads:
      logits.append(np.zeros((0,), np.float32))
      continue
    if not cfg.gate.heads:
      logits.append(np.full((heads,), CERTAIN_LOGIT, np.float32))
      continue
    try:
      logits_H = np.array(gates[f"layer_{i}"]["attention"]["logits"], np.float32)
    except KeyError:
      raise errors.CheckpointError(
          f"The gates collection has no logits for layer_{i} (expected at "
          f"gates/layer_{i}/attention/logits); the variables do not come from a gated "
          "model of this config.") from None
    if logits_H.shape != (heads,):
      raise errors.CheckpointError(
          f"Gate logits of layer_{i} have shape {logits_H.shape}, but the config gives "
          f"that layer {heads} heads; the variables do not match the config.")
    logits.append(logits_H)
  return logits


def _group_logits(cfg: model_lib.ModelConfig, gates) -> list[np.ndarray | None]:
  """Per layer, a float32 copy of the group gate logits (H_i, N/G); None for a layer
  without heads, or a model without such gates."""
  group = cfg.gate.persistent_group
  logits = []
  for i, heads in enumerate(cfg.layer_heads):
    if not (heads and group and cfg.gated):
      logits.append(None)
      continue
    found = gates.get(f"layer_{i}", {}).get("attention", {}).get(GROUP_LOGITS)
    expected = (heads, cfg.num_persistent // group)
    if found is None or np.shape(found) != expected:
      got = "none" if found is None else f"shape {np.shape(found)}"
      raise errors.CheckpointError(
          f"The gates of layer_{i} hold {got} at gates/layer_{i}/attention/{GROUP_LOGITS}"
          f", but the config gives that layer {expected[0]} heads of {expected[1]} "
          "persistent groups; the variables do not match the config.")
    logits.append(np.array(found, np.float32))
  return logits
