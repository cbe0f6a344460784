"""The experiment plan: an experiment config's `experiments` section, typed and checked.

Read once (`from_section`), before any run starts; every error names the flag that
sets the key. `Plan` holds the keys every experiment config has (enough for the repro,
lambda_sweep and txl_widths suites); `ExperimentPlan` adds the other suites'.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any

from allatt_jax.config import run_config
from allatt_jax.config import typed_section
from allatt_jax.config.errors import ConfigError
from allatt_jax.experiments import heuristics


def _flag(key: str) -> str:
  return f"--config.experiments.{key}"


def _check_keys(key: str, values: Mapping, section: type) -> None:
  """Every key of `values` is one of the run config `section`'s."""
  known = {f.name for f in dataclasses.fields(section)}
  run_section = section.__name__.removesuffix("Section").lower()
  for name in values:
    if name not in known:
      raise ConfigError(f"Unknown key {_flag(f'{key}.{name}')}; {key} takes keys of a "
                        f"run's {run_section} section: {', '.join(sorted(known))}.")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How every run of an experiment derives from its baseline, and what it sweeps."""
  prune_train: Mapping[str, Any]   # train keys of a pruning or fine-tuning run
  prune_gates: Mapping[str, Any]   # gates keys of a pruning run
  lambdas: tuple[float, ...]
  seeds: tuple[int, ...]           # pruning and fine-tuning seeds (one baseline)
  txl_widths: tuple[int, ...]

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "Plan":
    """The plan of an `experiments` section (a ConfigDict's `to_dict()`).

    Raises:
      ConfigError: a key this plan does not have or lacks, a value of another type, or
        one no run takes (a key a run's section lacks, an unknown pruner or budget).
    """
    return typed_section.read(cls, values, "--config.experiments")

  def __post_init__(self):
    _check_keys("prune_train", self.prune_train, run_config.TrainSection)
    _check_keys("prune_gates", self.prune_gates, run_config.GatesSection)


@dataclasses.dataclass(frozen=True)
class ExperimentPlan(Plan):
  """The CPU suites' plan (configs/exp_chars.py explains each key)."""
  ablation_lambda: float
  heuristics: tuple[str, ...]
  heuristic_lambdas: tuple[float, ...]
  random_seeds: tuple[int, ...]
  importance_batches: int
  michel_step_fraction: float
  budgets: tuple[tuple[str, float], ...]   # (gates.target_* key, value or fraction)
  budget_seeds: tuple[int, ...]
  budget_reference_lambdas: tuple[float, ...]
  distill_sparsities: tuple[float, ...]
  distill_variants: Mapping[str, Mapping[str, Any]]   # name -> distill keys
  # --suite=persistent: MAC budgets (fractions of the unpruned model's), the slots
  # per persistent group, the distill variant of its distilling runs, and the valid
  # batches each export's inference speed is measured on.
  persistent_budgets: tuple[float, ...]
  persistent_group: int
  persistent_distill: str
  speed_batches: int

  def __post_init__(self):
    super().__post_init__()
    if self.persistent_distill not in self.distill_variants:
      raise ConfigError(f"{_flag('persistent_distill')} names {self.persistent_distill!r}; "
                        f"the variants are {', '.join(self.distill_variants)}.")
    for method in self.heuristics:
      if method not in heuristics.METHODS:
        raise ConfigError(f"{_flag('heuristics')} names {method!r}; the pruners are "
                          f"{', '.join(heuristics.METHODS)}.")
    for key, _ in self.budgets:
      if key not in run_config.BUDGET_TARGETS:
        raise ConfigError(f"{_flag('budgets')} asks for {key!r}; a budget is one of "
                          f"{', '.join(run_config.BUDGET_TARGETS)}.")
    for name, keys in self.distill_variants.items():
      _check_keys(f"distill_variants.{name}", keys, run_config.DistillSection)


def from_section(values: Mapping[str, Any]) -> Plan:
  """The plan of an `experiments` section: an ExperimentPlan where it has a key beyond
  Plan's (and then all of them), else a Plan.

  Raises:
    ConfigError: as `Plan.from_dict`.
  """
  beyond = set(values) - {f.name for f in dataclasses.fields(Plan)}
  return (ExperimentPlan if beyond else Plan).from_dict(values)
