"""Whether a pruning run's gates section asks for what its model can give: persistent
groups it can gate, and a size (a sparsity, params or MACs budget) that some number of
heads, and of persistent groups, meets. Part of a run config's checks
(training/config_checks.py), made before any data is read; a refusal is one
ConfigError naming the flag and the nearest budget that is met, in the form asked (a
fraction for a fraction).
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
    unpruned = cost_model.unpruned_cost(config, cfg)
    # What the lines show beside the figure: the fraction asked, also where this
    # config was resolved before (its figure then asked, its fraction recorded).
    fraction = asked if 0 < asked < 1 else gates.budget_fraction
    if fraction is not None and cost_model.budget_figure(key, fraction, unpruned) != value:
      fraction = None
    config = run_config.derived_run(config, gates={key: value, "budget_fraction": fraction})
    if 0 < asked < 1:   # a fraction: the errors say what it stood for
      shown = (f"config.gates.{key}={asked} ({asked:g} of the unpruned model's "
               f"{unpruned:,.0f}: {value:,.0f})")
    elif asked >= 1:    # a count, maybe meant as a fraction
      shown = (f"config.gates.{key}={asked:g} (read as a count of {_UNITS[key]}; a "
               f"fraction of the unpruned model's {unpruned:,.0f} is a value below 1)")
  # Advice in the form the budget was asked in: a fraction for a fraction.
  fraction_of = _fraction_of(config, cfg, key, asked)
  if gates.persistent_group:
    _check_group_budget(config, cfg, key, value, shown, flag, fraction_of)
    return config
  scale = cost_model.BudgetScale.of(config, cfg)
  total, allow_empty = scale.total, gates.allow_empty
  fewest = 0 if allow_empty else 1
  value_for = lambda heads: (
      scale.value_for(heads) if fraction_of is None else
      _as_asked(key, float(scale.value_for(heads)), fraction_of,
                lambda figure: scale.heads(figure) == heads))
  keeps = lambda heads: f"{flag}={value_for(heads)} ({heads} of {total} heads)"
  empty_advice = ("" if allow_empty else
                  f"; to remove every head, {flag}={value_for(0)} with "
                  "--config.gates.allow_empty=True")
  if key == "target_sparsity":
    if not 0.0 <= value <= 1.0:
      nearest = keeps(fewest) + empty_advice if value > 1 else keeps(total)
      raise ConfigError(
          f"{shown} is out of range: it is the fraction of the model's {total} heads to "
          f"remove, in [0, 1]. The nearest budget that is met: {nearest}.")
  elif value < scale.empty or value <= 0:
    raise ConfigError(
        f"{shown} {_below(key, scale.empty, value)}, so no number of heads meets it. The "
        f"smallest budget that is met: {keeps(fewest)}{empty_advice}.")
  if scale.heads(value) == 0 and not allow_empty:
    raise ConfigError(
        f"{shown} leaves none of the model's {total} heads: a model without attention, "
        "which is rarely what anyone wants. The nearest budget that keeps a head: "
        f"{keeps(1)}; to remove every head anyway, add --config.gates.allow_empty=True.")
  return config


def _check_group_budget(config, cfg, key: str, value: float, shown: str, flag: str,
                        fraction_of: float | None) -> None:
  """A budget over heads and persistent groups: at least what must stay (nothing, or
  every head without slots when heads are not gated), and a head unless allowed."""
  gates = config.gates
  units = cost_model.budget_units(config, cfg)
  unit = _UNITS[key]
  # Of what a budget meets, the least: within one group or head of `cost`.
  step = min(units.group, units.head)
  met = lambda cost: (
      f"{flag}={_as_asked(key, cost, fraction_of, lambda v: v < cost + step)}")
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
        f"{shown} {_below(key, units.empty, value)}, so no number of heads meets it. The "
        f"smallest budget that is met: {nearest}{empty_advice}.")
  if value < one_head and not gates.allow_empty:
    raise ConfigError(
        f"{shown} leaves none of the model's {sum(cfg.layer_heads)} "
        "heads: a model without attention, which is rarely what anyone wants. The "
        f"nearest budget that keeps a head: {met(one_head)} (one head without persistent "
        "vectors); to remove every head anyway, add --config.gates.allow_empty=True.")


_UNITS = {"target_params": "non-embedding parameters",
          "target_macs": "non-embedding MACs per token"}


def _below(key: str, empty: float, value: float) -> str:
  """Why a params or MACs budget of `value` is met by no head count (`empty`: what is
  left with every head removed)."""
  if value <= 0:
    return "is not positive (a budget is the size to prune to)"
  return (f"is below the {empty:,.0f} {_UNITS[key]} that no head holds (what is left with "
          "every head removed)")


def _fraction_of(config: run_config.RunConfig, cfg: model_lib.ModelConfig, key: str,
                 asked: float) -> float | None:
  """The unpruned model's cost, where the user asked for a params or MACs budget as a
  fraction of it (`asked` in (0, 1)): its advice is then a fraction too. Else None."""
  if key == "target_sparsity" or not 0 < asked < 1:
    return None
  return cost_model.unpruned_cost(config, cfg)


def _as_asked(key: str, needed: float, fraction_of: float | None, meets) -> str:
  """A params or MACs budget of at least `needed`, as a flag gives it: whole (1 at
  least, as `BudgetScale.value_for`), or, where the user asked with a fraction of
  `fraction_of` (`_fraction_of`), the shortest fraction whose figure
  (`cost_model.budget_figure`) `meets` what is asked."""
  whole = max(1, math.ceil(needed - 1e-9))
  if fraction_of is None:
    return str(whole)
  share = whole / fraction_of
  for digits in range(1, 10):
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(share)))
    fraction = math.ceil(share * scale) / scale
    figure = cost_model.budget_figure(key, fraction, fraction_of)
    # Near the figure meant (within 1%), and met as that figure is.
    if fraction < 1 and whole <= figure <= 1.01 * whole + 1 and meets(figure):
      return f"{fraction:.{digits}g}"
  return str(whole)
