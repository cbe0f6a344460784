"""What every file in configs/ starts from: `base_config()`, each run key at its
default (run_config.py defines the sections), and the recipes configs share.

A config file changes what its run needs, so a key that exists in one config exists
in all of them with the same meaning.

Where each default of the recipe comes from. The paper (Shim et al. 2021) decides
what it states; where it is silent, the released code behind its numbers decides;
the other form stays selectable:

  paper      LAMB; warm-up 4K then cosine; peak 1e-2 (baseline) / 1e-3 (pruning);
             dropout 0.2 on attention weights, 0.1 elsewhere; hard-concrete gates with
             straight-through hard gates, π init 2, λ warm-up, output scaling s_g
             (`gates.scale_output`: the official code has it commented out); gates
             frozen at 16K of 80K pruning steps.
  official   LAMB form (`train.optimizer='lamb'`: no bias correction, eps 1e-8,
             weight norm clamped to [0, 10]; 'optax_lamb' is optax's); gate logits at
             10x the model's learning rate (`gates.lr_multiplier`); no weight decay on
             LayerNorms and gates (`train.weight_decay_exclude`; we also spare biases,
             the official code decays them); β = 1/3 (`gates.temperature`; Louizos:
             2/3); a deterministic gate open at π >= 0 (`gates.open_at_zero`);
             `model.same_length` with S + 1 keys per query (`model.same_length_keys`;
             Transformer-XL: S); W_O with a bias (`model.out_bias`); LayerNorm eps
             1e-5 (`model.layer_norm_eps`); no LayerNorm after the last layer
             (`model.final_norm`); persistent logits q·P_K
             (`model.persistent_content_bias`: (q + u)·P_K).
  ours       empty memory slots at a stream's start are masked (the official model
             attends to zero-filled slots: its first segment's scores depend on the
             padding, ours are those of a model without memory); budgets instead of
             λ (`gates.target_*`, budget.py: target warm-up, sharpened count, exactly
             n* heads kept at the freeze); `model.vocab_size` 0 = the dataset's;
             an adaptive softmax for own word-level text (`model.auto_cutoffs`);
             gates on groups of persistent slots (`gates.persistent_group`, off by
             default), in the budgets beside heads.
"""
import ast
import dataclasses
import importlib.util
import pathlib
import typing

import ml_collections

from allatt_jax.config import run_config


def base_config() -> ml_collections.ConfigDict:
  """Every run key at its default, as `run_config`'s sections define them."""
  c = ml_collections.ConfigDict()
  for name, section in run_config.RunConfig.sections().items():
    c[name] = ml_collections.ConfigDict(_settable(section()))
  c.init_from = ""
  return c


def _settable(section) -> dict:
  """A section's defaults, where a None default becomes a reference of its type, so
  that a flag can set it; without the keys the run sets itself (metadata
  'set_by_run')."""
  hints = typing.get_type_hints(type(section))
  values = {}
  for field in dataclasses.fields(section):
    if field.metadata.get("set_by_run"):
      continue
    value = getattr(section, field.name)
    if value is None:
      kind = next(a for a in typing.get_args(hints[field.name]) if a is not type(None))
      value = ml_collections.FieldReference(None, field_type=typing.get_origin(kind) or kind)
    values[field.name] = value
  return values


def pruning_gates(**overrides) -> ml_collections.ConfigDict:
  """A pruning stage's whole `gates` section (enabled), for a pipeline or experiment
  config: every gate key, the budget targets included, can then be set by flag."""
  gates = base_config().gates
  gates.update(dict(enabled=True, **overrides))
  return gates


def txl_model(d_model: int) -> dict:
  """The model keys that make an All-att config its Transformer-XL: same depth and
  heads, a feed-forward of 4d, no persistent vectors."""
  return dict(kind="txl", d_model=d_model, d_ff=4 * d_model, num_persistent=0)


def paper_pruning(config: ml_collections.ConfigDict, lam: float, init_from: str
                  ) -> ml_collections.ConfigDict:
  """The paper's pruning recipe (Shim et al. 2021, §4.1.2) on top of a baseline config
  file's ConfigDict, which it changes (so that flags still override it) and returns.

  Gates at π = 2, λ warmed up over 4K steps, gates frozen at 16K of 80K steps, peak
  learning rate 1e-3 decayed to 1e-4.
  """
  config.train.update(dict(num_steps=80_000, learning_rate=1e-3, final_learning_rate=1e-4))
  config.gates.update(dict(enabled=True, lam=lam, init=2.0, l0_warmup_steps=4000,
                           freeze_step=16_000))
  config.init_from = init_from
  return config


def parse_arg(arg: str | None, **defaults):
  """Parses a config argument like 'lam=0.015,tiny' against typed defaults.

  A bare word sets a boolean default to True. Values keep the type of their default.
  """
  values = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, has_value, raw = item.partition("=")
    if key not in values:
      raise ValueError(f"Unknown config argument {key!r}; known: {sorted(defaults)}.")
    if not has_value:
      values[key] = True
      continue
    default = defaults[key]
    if isinstance(default, str):
      values[key] = raw
    else:
      values[key] = type(default)(ast.literal_eval(raw))
  return values


def load(path, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file, as `--config=path:arg` would give it."""
  path = pathlib.Path(path)
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*([] if arg is None else [arg]))


def load_sibling(this_file: str, name: str, arg: str | None = None):
  """The config of another file in the same folder, so variants reuse one recipe."""
  return load(pathlib.Path(this_file).with_name(name), arg)
