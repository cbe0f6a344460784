"""Whether a pruning run's gates section asks for what its model can give: persistent
groups it can gate, and a size (a sparsity, params or MACs budget) that some number of
heads, and of persistent groups, meets. Part of a run config's checks
(training/config_checks.py), made before any data is read; a refusal is one
ConfigError naming the flag and the nearest budget that is met.
"""
import math

from allatt_jax.config import run_config
from allatt_jax.config.errors import ConfigError
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import cost_model


def check_persistent_groups(config: run_config.RunConfig) -> None:
  """Gates on persistent groups (`gates.persistent_group`) need an All-att model whose
  every head holds N slots in groups of that size, hard gates and the XLA or split core."""
  gates, m = config.gates, config.model
  group, flag = gates.persistent_group, "--config.gates.persistent_group"
  if not gates.heads and not group:
    raise ConfigError(
        "config.gates.heads=False leaves the heads without gates, and "
        "config.gates.persistent_group=0 gates nothing else. Set "
        f"{flag}=64 (slots per group) to prune persistent groups only, or "
        "--config.gates.heads=True.")
  if not (group and gates.enabled):
    return
  if m.kind != "allatt" or not m.num_persistent:
    raise ConfigError(
        f"config.gates.persistent_group={group} gates groups of persistent slots, which "
        f"this model has none of (config.model.kind={m.kind!r}, num_persistent="
        f"{m.num_persistent}). Set {flag}=0.")
  if m.num_persistent % group:
    divisors = [g for g in range(1, m.num_persistent + 1) if m.num_persistent % g == 0]
    raise ConfigError(
        f"config.gates.persistent_group={group} does not divide config.model."
        f"num_persistent={m.num_persistent}: every group holds the same number of slots. "
        f"Choose one of {divisors}.")
  if m.persistent_slots is not None:
    raise ConfigError(
        f"config.gates.persistent_group={group} needs every head's "
        f"{m.num_persistent} persistent slots, but this model (an export) keeps "
        f"{[sum(s) for s in m.persistent_slots]} per layer. Prune it with {flag}=0, or "
        "start from the unpruned model.")
  if not gates.hard:
    raise ConfigError(
        f"config.gates.persistent_group={group} needs hard gates (config.gates.hard="
        "False): a soft gate's fractional value weights its slots' exponentials, a "
        "per-slot offset of their logits that the export cannot fold into P_K and P_V. "
        "Set --config.gates.hard=True.")
  if gates.target_sparsity is not None:
    raise ConfigError(
        f"config.gates.target_sparsity={gates.target_sparsity} is a fraction of heads, "
        f"and with {flag}={group} persistent groups are pruned too. Ask for a size both "
        "count: --config.gates.target_params or --config.gates.target_macs (or set "
        f"{flag}=0).")


def checked_budget(config: run_config.RunConfig) -> run_config.RunConfig:
  """The config with its params or MACs budget as the figure it stands for
  (`cost_model.budget_value`), checked: a budget (`gates.target_*`) must be one some
  number of heads meets, and one that leaves a head, unless `gates.allow_empty` asks
  for a model without attention; the error names the nearest budget that is met."""
  gates = config.gates
  key = gates.budget_target
  if key is None:
    return config
  asked, flag = getattr(gates, key), f"--config.gates.{key}"
  if not gates.enabled:
    raise ConfigError(
        f"config.gates.{key}={asked} asks a pruning run for a size, but "
        "config.gates.enabled is False. Set --config.gates.enabled=True (and "
        "--config.init_from=BASELINE), or leave the budget unset.")
  cfg = model_lib.ModelConfig.from_config(config)
  if cfg.persistent_slots is not None:
    raise ConfigError(
        f"config.gates.{key}={asked}: a budget counts heads of equal cost, but this "
        "model's heads keep different numbers of persistent vectors (an export of "
        "pruned persistent groups). Prune it with a fixed --config.gates.lam, or start "
        "from the unpruned model.")
  value, shown = asked, f"config.gates.{key}={asked}"
  if key != "target_sparsity":
    value = cost_model.budget_value(config, cfg)
    config = run_config.derived_run(config, gates={key: value})
    shown = f"config.gates.{key}={value}"
    if 0 < asked < 1:   # a fraction: the errors say what it stood for
      shown = (f"config.gates.{key}={asked} ({asked:g} of the unpruned model's "
               f"{cost_model.unpruned_cost(config, cfg):,.0f}: {value:,.0f})")
  if gates.persistent_group:
    _check_group_budget(config, cfg, key, value, shown, flag)
    return config
  scale = cost_model.BudgetScale.of(config, cfg)
  total, allow_empty = scale.total, gates.allow_empty
  fewest = 0 if allow_empty else 1
  keeps = lambda heads: f"{flag}={scale.value_for(heads)} ({heads} of {total} heads)"
  empty_advice = ("" if allow_empty else
                  f"; to remove every head, {flag}={scale.value_for(0)} with "
                  "--config.gates.allow_empty=True")
  if key == "target_sparsity":
    if not 0.0 <= value <= 1.0:
      nearest = keeps(fewest) + empty_advice if value > 1 else keeps(total)
      raise ConfigError(
          f"{shown} is out of range: it is the fraction of the model's {total} heads to "
          f"remove, in [0, 1]. The nearest budget that is met: {nearest}.")
  elif value < scale.empty or value <= 0:
    unit = ("non-embedding parameters" if key == "target_params"
            else "non-embedding MACs per token")
    raise ConfigError(
        f"{shown} is below the {scale.empty:,.0f} {unit} that no head holds (what is "
        "left with every head removed), so no number of heads meets it. The smallest "
        f"budget that is met: {keeps(fewest)}{empty_advice}.")
  if scale.heads(value) == 0 and not allow_empty:
    raise ConfigError(
        f"{shown} leaves none of the model's {total} heads: a model without attention, "
        "which is rarely what anyone wants. The nearest budget that keeps a head: "
        f"{keeps(1)}; to remove every head anyway, add --config.gates.allow_empty=True.")
  return config


def _check_group_budget(config, cfg, key: str, value: float, shown: str,
                        flag: str) -> None:
  """A budget over heads and persistent groups: at least what must stay (nothing, or
  every head without slots when heads are not gated), and a head unless allowed."""
  gates = config.gates
  units = cost_model.budget_units(config, cfg)
  unit = ("non-embedding parameters" if key == "target_params"
          else "non-embedding MACs per token")
  met = lambda cost: f"{flag}={math.ceil(cost - 1e-9)}"
  if not gates.heads:
    floor = units.cost(cfg.layer_heads, [0] * cfg.num_layers)
    if value < floor:
      raise ConfigError(
          f"{shown} is below the {floor:,.0f} {unit} that pruning "
          "persistent groups alone leaves (every head's projections and context "
          f"attention stay, config.gates.heads=False). The smallest budget that is met: "
          f"{met(floor)} (no persistent vector kept); to go lower, gate the heads too: "
          "--config.gates.heads=True.")
    return
  one_head = units.empty + units.layer + units.head
  empty_advice = ("" if gates.allow_empty else
                  f"; to remove every head, {met(units.empty)} with "
                  "--config.gates.allow_empty=True")
  if value < units.empty or value <= 0:
    nearest = met(units.empty) if gates.allow_empty else met(one_head)
    raise ConfigError(
        f"{shown} is below the {units.empty:,.0f} {unit} that no "
        "head holds (what is left with every head removed), so no number of heads "
        f"meets it. The smallest budget that is met: {nearest}{empty_advice}.")
  if value < one_head and not gates.allow_empty:
    raise ConfigError(
        f"{shown} leaves none of the model's {sum(cfg.layer_heads)} "
        "heads: a model without attention, which is rarely what anyone wants. The "
        f"nearest budget that keeps a head: {met(one_head)} (one head without persistent "
        "vectors); to remove every head anyway, add --config.gates.allow_empty=True.")
