"""The one reader of a config section into its frozen dataclass, whose type hints say
what each key takes: a run's sections, an experiment's plan, a benchmark's.

Every error names the flag that sets the key, and comes before any work starts.
"""
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from allatt_jax.config.errors import ConfigError


def read(cls, values: Mapping[str, Any], flag: str):
  """`cls` (a dataclass) of `values`: each key one of its fields, every field without
  a default given, each value of its field's type (lists become tuples, ints floats
  where a float is asked for, mappings read-only).

  `flag`: the flag of the section, e.g. '--config.experiments'.

  Raises:
    ConfigError: a key `cls` does not have or lacks, or a value of another type.
  """
  hints = typing.get_type_hints(cls)
  fields = dataclasses.fields(cls)
  names = [f.name for f in fields]
  for key in values:
    if key not in hints:
      raise ConfigError(f"Unknown key {flag}.{key}; known: {', '.join(names)}.")
  missing = [f.name for f in fields if f.name not in values
             and f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]
  if missing:
    raise ConfigError(f"The config has no {flag}.{missing[0]}; set it in its "
                      f"`{flag.rsplit('.', 1)[-1]}` section.")
  typed = {}
  for key in (name for name in names if name in values):
    try:
      typed[key] = _typed(hints[key], values[key])
    except TypeError:
      raise ConfigError(f"{flag}.{key} is {values[key]!r}; it takes "
                        f"{_describe(hints[key])}.") from None
  return cls(**typed)


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _typed(hint, value):
  """`value` as the type `hint` says; TypeError where it is of another type."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if hint is Any:
    return value
  if origin is types.UnionType:   # X | None
    if value is None and type(None) in args:
      return None
    return _typed(next(a for a in args if a is not type(None)), value)
  if hint is bool and isinstance(value, bool):
    return value
  if hint is float and _number(value):
    return float(value)
  if hint in (int, str) and isinstance(value, hint) and not isinstance(value, bool):
    return value
  if origin is tuple and isinstance(value, (tuple, list)):
    if args[-1] is Ellipsis:
      return tuple(_typed(args[0], v) for v in value)
    if len(args) == len(value):
      return tuple(_typed(a, v) for a, v in zip(args, value))
  if origin is Mapping and isinstance(value, Mapping):
    return types.MappingProxyType({_typed(str, k): _typed(args[1], v)
                                   for k, v in value.items()})
  raise TypeError(value)


def _describe(hint) -> str:
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin is types.UnionType:
    return " or ".join("None" if a is type(None) else _describe(a) for a in args)
  if origin is tuple and args[-1] is Ellipsis:
    return f"a tuple of {_describe(args[0])}"
  if origin is tuple:
    return f"({', '.join(map(_describe, args))})"
  if origin is Mapping:
    return "a dict"
  return getattr(hint, "__name__", str(hint))
