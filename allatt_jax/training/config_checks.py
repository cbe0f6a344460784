"""The checks of a run config alone, made once when a command resolves it, before any
data is loaded or code compiled (assembly.py).

A failed check raises one ConfigError (or DataError, for dataset options) that names
the config key, with the flag that sets it, and how to fix it, instead of a
trace-time traceback minutes later. The gates section's budget and persistent groups
are checked against the model by pruning/feasibility.py; a run against its files
(workdir, checkpoints, `init_from`, vocabulary) by runs/workdir_checks.py.
"""
from collections.abc import Mapping
import re

import jax
import jax.numpy as jnp

from allatt_jax.model.attention import relative
from allatt_jax.model.attention import core_choice
from allatt_jax import data as data_lib
from allatt_jax.pruning import feasibility
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import optim
from allatt_jax.config import run_config
from allatt_jax.parallel import sharding
from allatt_jax.config.errors import ConfigError

REL_POS = ("learned", "sinusoidal")
SCORE_DTYPES = ("compute", "float32")
KL_CLUSTERS = ("all", "head")

# Lower bounds of numeric keys; a None value (e.g. gates.learning_rate) means "unset".
_MINIMUM = {
    "model.vocab_size": 0, "model.num_layers": 1, "model.d_model": 1,
    "model.num_heads": 1, "model.num_persistent": 0, "model.d_ff": 0,
    "model.max_relative_len": 0, "model.vocab_block": 0, "model.tail_capacity": 0,
    "gates.lam": 0, "gates.learning_rate": 0, "gates.l0_warmup_steps": 0,
    "gates.freeze_step": 0, "gates.lr_multiplier": 0, "gates.budget_sharpness": 1,
    "gates.budget_warmup_steps": 0, "gates.lagrangian_lr": 0,
    "model.layer_norm_eps": 0, "train.lamb_eps": 0, "train.lamb_max_weight_norm": 0,
    "train.batch_size": 1, "train.seq_len": 1, "train.mem_len": 0, "train.num_steps": 1,
    "train.learning_rate": 0, "train.final_learning_rate": 0, "train.warmup_steps": 0,
    "train.weight_decay": 0, "train.grad_clip": 0, "train.log_every_steps": 1,
    "eval.batch_size": 1, "eval.seq_len": 1, "eval.mem_len": 0, "eval.every_steps": 0,
    "eval.max_batches": 0,
    "checkpoint.every_steps": 1, "checkpoint.keep": 1,
    "distill.weight": 0, "distill.hidden_weight": 0,
}
_WHY_NOT_NEGATIVE = {
    "gates.lam": "a negative λ rewards open heads instead of penalising them",
    "train.learning_rate": "a negative learning rate climbs the loss",
    "train.final_learning_rate": "a negative learning rate climbs the loss",
    "gates.learning_rate": "a negative learning rate climbs the loss",
}


def check_config(config: run_config.RunConfig,
                 num_devices: int) -> run_config.RunConfig:
  """The checks of the config alone, before any of it is built, with `config.mesh` on
  `num_devices` devices; returns the config with a params or MACs budget given as a
  fraction resolved to the figure it stands for (`feasibility.checked_budget`), which
  the budget's checks apply to. An unset `model.vocab_size` is the dataset's, which
  the caller reads next, or refuses (`check_vocab_size_set`).

  Raises:
    ConfigError: an inconsistent or out-of-range config.
  """
  _check_ranges(config)
  _check_names(config)
  _check_model(config)
  _check_lengths(config)
  feasibility.check_persistent_groups(config)
  config = feasibility.checked_budget(config)
  _check_mesh(config, num_devices)
  return config


def check_starting_point(config: run_config.RunConfig) -> None:
  """The config of a run about to train says what it starts from: pruning an
  untrained model is almost always a forgotten flag, which would only show in the
  results after the whole pruning schedule (from scratch is an explicit choice), and
  a distilling run needs its teacher.

  Raises:
    ConfigError: a pruning or distilling run without `init_from`.
  """
  _check_teacher(config)
  if config.gates.enabled and not config.init_from:
    raise ConfigError(
        "config.gates.enabled=True makes this a pruning run, which starts from a "
        "trained baseline, but config.init_from is not set. Add "
        "--config.init_from=BASELINE_WORKDIR (a finished baseline run's --workdir, or "
        "an exported model); to prune a model trained from scratch, "
        f"--config.init_from={run_config.FROM_SCRATCH}.")


def check_vocab_size_set(config: run_config.RunConfig) -> None:
  """A command that reads no dataset needs `model.vocab_size`.

  Raises:
    ConfigError: it is unset.
  """
  if not config.model.vocab_size:
    raise ConfigError(
        "config.model.vocab_size is unset, which means 'the dataset's', and this "
        "command reads no dataset. Set --config.model.vocab_size=V (python -m "
        "allatt_jax.data --dataset=NAME prints V).")


def check_from_baseline(baseline: run_config.RunConfig, run: run_config.RunConfig) -> None:
  """A run that starts from the baseline's params (a pipeline's pruning stage, an
  experiment's runs) must keep its learned relative position table as long as the
  baseline's: the train lengths it changes size the table where
  `model.max_relative_len` is 0."""
  base, own = baseline.relative_table_len, run.relative_table_len
  if baseline.model.rel_pos != "learned" or base == own:
    return
  t = run.train
  raise ConfigError(
      f"config.train.seq_len + config.train.mem_len = {t.seq_len + t.mem_len} sizes a "
      f"learned relative position table of {own} distances (the longest train or eval "
      "context), but the baseline's, whose "
      f"params the run starts from, holds {base}. Set "
      f"--config.model.max_relative_len={max(base, own)} (the baseline's too), or train "
      "at the baseline's lengths.")


def named_as(message: str, flags: Mapping[str, str]) -> str:
  """A check's `message`, which names run config keys as `config.SECTION.KEY` (and
  flags as `--config.SECTION.KEY`), with the keys of a run made from another config
  named as its user sets them: `flags` maps a key ('train.num_steps') or a whole
  section ('gates') to its place in that config ('pipeline.prune_gates')."""
  def rename(match):
    section, key = match.groups()
    if key and f"{section}.{key}" in flags:
      return f"config.{flags[f'{section}.{key}']}"
    if section in flags:
      return f"config.{flags[section]}" + (f".{key}" if key else "")
    return match.group(0)
  return re.sub(r"(?<![\w.])config\.(\w+)(?:\.(\w+))?", rename, message)


def _check_teacher(config: run_config.RunConfig) -> None:
  """The teacher is the `init_from` model: a run that distills needs one."""
  if config.distill.enabled and not config.init_source:
    raise ConfigError(
        f"config.distill (weight={config.distill.weight}, hidden_weight="
        f"{config.distill.hidden_weight}) asks to learn from a teacher, the model that "
        "config.init_from names, but init_from is not set. Add "
        "--config.init_from=BASELINE_WORKDIR (a finished run's --workdir, or an exported "
        "model), or turn distillation off with --config.distill.weight=0 "
        "--config.distill.hidden_weight=0.")


def _value(config, key):
  section, name = key.split(".")
  return getattr(getattr(config, section), name)


def _check_ranges(config):
  for key, minimum in _MINIMUM.items():
    value = _value(config, key)
    if value is not None and value < minimum:
      why = _WHY_NOT_NEGATIVE.get(key, f"it must be at least {minimum}")
      raise ConfigError(f"config.{key}={value} is out of range: {why}. "
                        f"Set --config.{key} to a value >= {minimum}.")
  distill = config.distill
  if distill.weight > 1:
    raise ConfigError(f"config.distill.weight={distill.weight} is out of range: the "
                      "cross-entropy's weight 1 − α would be negative. Set "
                      "--config.distill.weight to a value in [0, 1].")
  if distill.temperature <= 0:
    raise ConfigError(f"config.distill.temperature={distill.temperature} is out of range: "
                      "the logits are divided by it. Set --config.distill.temperature "
                      "to a value > 0 (1 = the plain distributions).")
  gates, train = config.gates, config.train
  if gates.temperature <= 0:
    raise ConfigError(f"config.gates.temperature={gates.temperature} is out of range: the "
                      "hard-concrete gates divide their logits by it. Set "
                      "--config.gates.temperature to a value > 0 (the official code's "
                      "1/3; Louizos et al.'s 2/3).")
  if len(gates.budget_targets) > 1:
    raise ConfigError(f"config.gates sets {list(gates.budget_targets)}; set at most one "
                      "budget target.")
  if gates.enabled and gates.freeze_step > train.num_steps:
    raise ConfigError(
        f"config.gates.freeze_step={gates.freeze_step} is beyond "
        f"config.train.num_steps={train.num_steps}: the gates would never freeze and "
        "the run would end without its fine-tuning phase. Set "
        f"--config.gates.freeze_step to at most {train.num_steps}, or raise "
        "--config.train.num_steps (the paper freezes at 20%: 16K of 80K steps).")


def _check_names(config):
  if config.model.attention_impl == "pallas":
    # Refused by name rather than as unknown: configs and commands written for it exist.
    # (A saved model naming it reads as 'xla': run_files.load_config.)
    raise ConfigError(
        "config.model.attention_impl='pallas' (the whole-core fused kernels) was removed: "
        "on an H200 they were slower than the XLA core (0.73x) and their backward pass "
        "with dropout did not compile; use --config.model.attention_impl=auto (the split "
        "core on a GPU without attention dropout), =split or =xla.")
  for key, choices in (("data.name", data_lib.DATASETS), ("model.kind", model_lib.KINDS),
                       ("model.rel_pos", REL_POS),
                       ("model.same_length_keys", relative.SAME_LENGTH_KEYS),
                       ("model.score_dtype", SCORE_DTYPES),
                       ("model.attention_impl", core_choice.IMPLS),
                       ("model.persistent_impl", core_choice.PERSISTENT_IMPLS),
                       ("train.optimizer", optim.OPTIMIZERS),
                       ("distill.kl_clusters", KL_CLUSTERS)):
    if _value(config, key) not in choices:
      raise ConfigError(f"config.{key}={_value(config, key)!r} is unknown; choose one of "
                        f"{', '.join(map(repr, choices))}.")
  data_lib.check_data_config(config.data)
  try:
    floating = jnp.issubdtype(jnp.dtype(config.model.dtype), jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise ConfigError(f"config.model.dtype={config.model.dtype!r} is not a float dtype; "
                      "use 'float32', or 'bfloat16' on accelerators.")


def _check_model(config):
  m = config.model
  if m.d_model % m.num_heads:
    divisors = [h for h in range(1, m.d_model + 1) if m.d_model % h == 0]
    raise ConfigError(
        f"config.model.d_model={m.d_model} is not divisible by config.model.num_heads="
        f"{m.num_heads}: every head gets d_model / num_heads dimensions. Choose a "
        f"multiple of {m.num_heads} for d_model, or num_heads among {divisors}.")
  if m.heads_per_layer is not None and (
      len(m.heads_per_layer) != m.num_layers
      or not all(0 <= h <= m.num_heads for h in m.heads_per_layer)):
    raise ConfigError(
        f"config.model.heads_per_layer={tuple(m.heads_per_layer)} needs one count in "
        f"[0, num_heads={m.num_heads}] per layer (num_layers={m.num_layers}).")
  if m.cluster_fractions and (
      (m.cutoffs and len(m.cluster_fractions) != len(m.cutoffs) + 1)
      or not all(0 <= f <= 1 for f in m.cluster_fractions)):
    raise ConfigError(
        f"config.model.cluster_fractions={tuple(m.cluster_fractions)} needs one share in "
        f"[0, 1] per cluster of the adaptive softmax (cutoffs {tuple(m.cutoffs)}: "
        f"{len(m.cutoffs) + 1}); () counts them from the dataset.")
  weighted = bool(config.gates.enabled and config.gates.persistent_group)
  core_choice.check_persistent_impl(m.attention_impl, m.persistent_impl, m.dropout_attn,
                                    m.dtype, weighted, m.d_model // m.num_heads)
  if m.kind == "txl" and m.d_ff < 1:
    raise ConfigError("config.model.d_ff=0 but a 'txl' model has a feed-forward "
                      "sub-layer; set it (the paper's TXL uses 4 * d_model).")


def _check_lengths(config):
  if config.model.rel_pos != "learned":
    return
  table = config.relative_table_len
  for section in ("train", "eval"):
    s = getattr(config, section)
    if s.seq_len + s.mem_len > table:
      raise ConfigError(
          f"config.model.max_relative_len={table} is shorter than config.{section}."
          f"seq_len + config.{section}.mem_len = {s.seq_len + s.mem_len}: the learned "
          "relative position table needs an entry for every distance. Set "
          f"model.max_relative_len >= {s.seq_len + s.mem_len} (0 sizes it from train "
          "and eval), or use model.rel_pos='sinusoidal'.")


def _check_mesh(config, num_devices: int) -> None:
  """The model's widths divide over the mesh's 'model' axis, and each batch a step
  splits over its 'data' axis: the train batch, each micro-batch of gradient
  accumulation and the eval batch. With several processes
  each reads a contiguous share of every batch, whole whenever the batch divides by
  `data`."""
  data, model = sharding.mesh_shape(config.mesh, num_devices)
  t, e, m = config.train, config.eval, config.model
  accum = t.grad_accum_steps
  sharding.check_accumulation(t.batch_size, accum)
  heads = sorted({m.num_heads, *(h for h in (m.heads_per_layer or ()) if h)})
  widths = [("config.model.num_heads / heads_per_layer", h) for h in heads]
  if m.kind == "txl":
    widths.append(("config.model.d_ff", m.d_ff))
  for key, width in widths:
    if width % model:
      raise ConfigError(
          f"{key}: {width} is not divisible by the model-parallel size "
          f"(config.mesh.model={model}), which splits heads and the feed-forward width "
          f"across devices. Use a multiple of {model}, or a smaller config.mesh.model.")
  micro = t.batch_size // accum
  batches = [(f"config.train.batch_size={t.batch_size}", t.batch_size),
             (f"the micro-batch config.train.batch_size / grad_accum_steps = "
              f"{t.batch_size} / {accum} = {micro}", micro),
             (f"config.eval.batch_size={e.batch_size}", e.batch_size)]
  bad = [name for name, rows in batches if rows % data]
  if not bad:
    return
  processes = (f", {jax.process_count()} processes each reading its share"
               if jax.process_count() > 1 else "")
  up = lambda n, k: -(-n // k) * k
  raise ConfigError(
      f"{bad[0]} is not divisible by the data-parallel size ({data}: config.mesh.data="
      f"{config.mesh.data} on {num_devices} devices{processes}), which splits "
      f"every batch into equal rows per data shard. Found: "
      + "; ".join(f"{name} ({'ok' if rows % data == 0 else 'not divisible'})"
                  for name, rows in batches)
      + f". Fix: config.train.batch_size a multiple of {data} x grad_accum_steps = "
      f"{data * accum} (e.g. {up(t.batch_size, data * accum)}), config.eval.batch_size "
      f"a multiple of {data} (e.g. {up(e.batch_size, data)}), or a config.mesh with a "
      "smaller data axis.")
