r"""Variants of a benchmarked config, timed in the same run as the config itself, so
that two implementations compare on the same machine under the same load.

A variant is a name and config overrides, in a config's benchmark section
(`c.benchmark.variants = dict(before=dict(model=dict(head_block=2, remat=False)))`)
or as `--variant=before:model.head_block=2,model.remat=False` (values are Python
literals, else strings). An unknown key, a value of another type or a config that
fails the checks is a ConfigError, before anything compiles.
"""
import ast
import dataclasses
import difflib
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.config.errors import ConfigError

# The sections a variant may override: those of a run config.
SECTIONS = run_config.RunConfig.sections()


def _split(text: str) -> list[str]:
  """`text` split at the commas outside brackets and quotes."""
  parts, depth, quote, start = [], 0, None, 0
  for i, ch in enumerate(text):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  return parts + [text[start:]]


def _literal(raw: str):
  try:
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    return raw


def from_flags(flags: Sequence[str], variants: Mapping[str, Any] | None = None
               ) -> dict[str, dict[str, dict[str, Any]]]:
  """`variants` (a plan's) with those of `--variant=NAME:section.key=value,...` flags
  added; a flag's keys override the same keys of a variant of the same name.

  Raises:
    ConfigError: a flag that is not NAME:section.key=value[,...].
  """
  merged = {name: {s: dict(keys) if isinstance(keys, Mapping) else keys
                   for s, keys in sections.items()}
            for name, sections in (variants or {}).items()}
  for flag in flags:
    name, _, overrides = flag.partition(":")
    items = [item.strip() for item in _split(overrides)]
    if not name.strip() or not all("=" in i and "." in i.split("=")[0] for i in items):
      raise ConfigError(f"--variant={flag}: expected NAME:SECTION.KEY=VALUE[,...], e.g. "
                        "--variant=before:model.head_block=2,model.remat=False.")
    for item in items:
      key, _, raw = item.partition("=")
      section, _, field = key.strip().partition(".")
      merged.setdefault(name.strip(), {}).setdefault(section, {})[field] = _literal(raw)
  return merged


def _typed(where: str, current, value):
  """`value` as the type of the key's `current` value (`where`: 'Variant NAME:
  section.key'); ConfigError if it is not."""
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if isinstance(current, bool):
    ok = isinstance(value, bool)
  elif isinstance(current, int):
    ok = number and float(value).is_integer()
    value = int(value) if ok else value
  elif isinstance(current, float):
    ok, value = number, float(value) if number else value
  elif isinstance(current, str):
    ok = isinstance(value, str)
  elif isinstance(current, tuple):
    ok = isinstance(value, (list, tuple))
    value = tuple(value) if ok else value
  else:   # unset (None): any value its checks accept
    ok, value = True, tuple(value) if isinstance(value, list) else value
  if not ok:
    raise ConfigError(f"{where}={value!r}, but the config's value is {current!r}: give a "
                      f"{type(current).__name__}.")
  return value


def _overridden(run: run_config.RunConfig, name: str,
                sections: Mapping[str, Any]) -> run_config.RunConfig:
  replaced = {}
  for section, keys in sections.items():
    if section not in SECTIONS:
      raise ConfigError(f"Variant {name!r}: {section!r} is no section of a run config; a "
                        "variant overrides {section: {key: value}} of "
                        f"{', '.join(SECTIONS)}.")
    if not isinstance(keys, Mapping):
      raise ConfigError(f"Variant {name!r}: its {section} is {keys!r}; give the keys it "
                        f"overrides, e.g. {section}=dict(KEY=VALUE).")
    current = getattr(run, section)
    known = [f.name for f in dataclasses.fields(current)]
    for key in keys:
      if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {section}.{close[0]}?" if close else (
            f"{section} has {', '.join(known)}.")
        raise ConfigError(f"Variant {name!r}: the config has no {section}.{key}; {hint} A "
                          "variant overrides keys the config has.")
    replaced[section] = dataclasses.replace(current, **{
        k: _typed(f"Variant {name!r}: {section}.{k}", getattr(current, k), v)
        for k, v in keys.items()})
  return dataclasses.replace(run, **replaced)


def resolve(run: run_config.RunConfig, variants: Mapping[str, Any]
            ) -> dict[str, run_config.RunConfig]:
  """Each variant's checked config: `run` with its overrides.

  Raises:
    ConfigError: an override of a key the config lacks or of another type, or a
      variant's config that fails the config checks (the message names the variant).
  """
  configs = {}
  for name, sections in variants.items():
    variant = _overridden(run, name, sections)
    try:
      configs[name] = assembly.checked_config(variant)
    except ConfigError as e:
      raise ConfigError(f"Variant {name!r}: {e}") from None
  return configs


def entry(overrides, train: dict, evaluation: dict, base_train: dict,
          base_eval: dict | None) -> dict:
  """A variant's report: its overrides, its baseline train step's figures (`train`,
  as the config's), its evaluation's with every head (None: not timed), and their
  tokens/s as ratios to the config's, measured in the same rounds (None for the
  evaluation where it or the plan's `heads_kept` leaves out 1.0), with the spread of
  those ratios round by round: the quartiles of each round's ratio."""
  timed_eval = bool(evaluation and base_eval)
  return {"overrides": {section: dict(keys) for section, keys in overrides.items()},
          "train": train, "eval": evaluation,
          "train_tokens_per_s_ratio": train["tokens_per_s"] / base_train["tokens_per_s"],
          "train_ratio_quartiles": _quartiles(base_train["step_s_rounds"],
                                              train["step_s_rounds"]),
          "eval_tokens_per_s_ratio": (evaluation["tokens_per_s"] / base_eval["tokens_per_s"]
                                      if timed_eval else None),
          "eval_ratio_quartiles": (_quartiles(base_eval["segment_s_rounds"],
                                              evaluation["segment_s_rounds"])
                                   if timed_eval else None)}


def _quartiles(base_seconds, variant_seconds) -> list[float]:
  """[first, third] quartile of the rounds' speed ratios, config's seconds over the
  variant's (one round: its ratio twice)."""
  ratios = [b / v for b, v in zip(base_seconds, variant_seconds)]
  if len(ratios) < 2:
    return ratios * 2
  first, _, third = statistics.quantiles(ratios, n=4, method="inclusive")
  return [first, third]
