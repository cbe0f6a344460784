"""Checks of a run's config and inputs, made before any data is loaded or code compiled.

`check_config` runs first, inside `run_setup.resolve`; `check_workdir`,
`check_pruning_has_a_baseline` and `check_start` (resume and `init_from`, against the
abstract state the setup built) come next in `train.start`, `check_vocabulary` once
the dataset is loaded, and `check_export` guards an export. A failed check raises one error (see errors.py) that
says what is wrong, where (the config key, flag or file) and how to fix it, instead of
a trace-time or orbax traceback minutes later.
"""
import json
import uuid

from absl import logging
from etils import epath
import flax
import jax
import jax.numpy as jnp
import ml_collections

from allatt_jax import attention
from allatt_jax import checkpointing
from allatt_jax import config_base
from allatt_jax import data as data_lib
from allatt_jax import model as model_lib
from allatt_jax import optim
from allatt_jax import rundir
from allatt_jax import sharding
from allatt_jax.errors import CheckpointError
from allatt_jax.errors import ConfigError
from allatt_jax.errors import DataError

REL_POS = ("learned", "sinusoidal")
# config.init_from of a pruning run that deliberately starts from fresh parameters.
FROM_SCRATCH = "none"

# Lower bounds of numeric keys; a None value (e.g. gates.learning_rate) means "unset".
_MINIMUM = {
    "model.vocab_size": 0, "model.num_layers": 1, "model.d_model": 1,
    "model.num_heads": 1, "model.num_persistent": 0, "model.d_ff": 0,
    "model.max_relative_len": 0,
    "gates.lam": 0, "gates.learning_rate": 0, "gates.l0_warmup_steps": 0,
    "gates.freeze_step": 0, "gates.lr_multiplier": 0, "gates.budget_sharpness": 1,
    "gates.budget_warmup_steps": 0,
    "model.layer_norm_eps": 0, "train.lamb_eps": 0, "train.lamb_max_weight_norm": 0,
    "train.batch_size": 1, "train.seq_len": 1, "train.mem_len": 0, "train.num_steps": 1,
    "train.learning_rate": 0, "train.final_learning_rate": 0, "train.warmup_steps": 0,
    "train.weight_decay": 0, "train.grad_clip": 0, "train.log_every_steps": 1,
    "eval.batch_size": 1, "eval.seq_len": 1, "eval.mem_len": 0, "eval.every_steps": 0,
    "eval.max_batches": 0,
    "checkpoint.every_steps": 1, "checkpoint.keep": 1,
}
_WHY_NOT_NEGATIVE = {
    "gates.lam": "a negative λ rewards open heads instead of penalising them",
    "train.learning_rate": "a negative learning rate climbs the loss",
    "train.final_learning_rate": "a negative learning rate climbs the loss",
    "gates.learning_rate": "a negative learning rate climbs the loss",
}
_PARAMS_PREFIX = "variables/params/"
# What a resumed or reused run may change without changing the model it trains: how
# long it runs (more steps), when it logs, evaluates and saves, how it is evaluated,
# where its data and devices are, and two ways of computing the same attention.
RESUMABLE = ("train.num_steps", "train.log_every_steps", "eval.*", "checkpoint.*",
             "mesh.*", "data.data_dir", "data.manual_dir", "model.head_block",
             "model.remat")
# Settings of the budget controller, which a run without a budget never reads.
BUDGET_ONLY = ("gates.budget_sharpness", "gates.budget_warmup_steps", "gates.lagrangian_lr")


def check_config(config: ml_collections.ConfigDict, cfg: model_lib.ModelConfig, *,
                 vocab_from_data: bool = False) -> None:
  """The checks of the config alone (`cfg`: its model, read but not yet traced).

  `vocab_from_data`: the caller loads the dataset next and takes an unset
  `model.vocab_size` from it (`run_setup.prepare`).

  Raises:
    ConfigError: an inconsistent or out-of-range config.
  """
  _check_ranges(config)
  _check_names(config)
  _check_model(config, vocab_from_data)
  _check_lengths(config, cfg)
  _check_mesh(config)


def check_start(config: ml_collections.ConfigDict,
                checkpoints: checkpointing.RunCheckpoints, abstract_state) -> None:
  """The checks of the run's checkpoints and `init_from` against the state's shapes.

  Raises:
    CheckpointError: `init_from` is missing, unreadable or does not fit the config, or
      the workdir holds a checkpoint of a run with other shapes than this config gives.
  """
  state_shapes = checkpointing.tree_shapes(flax.serialization.to_state_dict(abstract_state))
  _check_resume(config, checkpoints, state_shapes)
  if checkpoints.steps():
    check_same_settings(config, checkpoints.directory.parent)
  if init_source(config):
    _check_init_from(config, state_shapes)


def check_same_settings(config: ml_collections.ConfigDict, workdir) -> None:
  """Raises ConfigError when the run trained in `workdir` had other settings than
  `config` in anything a resumed (or reused) run may not change (`RESUMABLE`).

  Resuming would train a mix of both, and the saved config.json would then describe
  a model it did not train; a workdir without config.json has nothing to compare.
  """
  workdir = rundir.run_path(workdir)
  if not (workdir / rundir.CONFIG_FILE).is_file():
    return
  changed = setting_differences(rundir.load_config(workdir), config)
  if changed:
    raise ConfigError(
        f"--workdir {workdir} holds a run trained with other settings ({'; '.join(changed)});"
        " continuing it would mix the two. Rerun with its settings, or train these in a "
        "new --workdir.")


def setting_differences(saved: ml_collections.ConfigDict,
                        config: ml_collections.ConfigDict) -> list[str]:
  """'key: saved -> now' for each setting that differs outside RESUMABLE. Only keys
  both configs have are compared (a key one of them predates cannot have been
  chosen); a run without gates has no gate settings besides `gates.enabled`, and a
  run without a budget no controller settings (BUDGET_ONLY)."""
  old, new = _leaves(saved), _leaves(config)
  ungated = not (old.get("gates.enabled") or new.get("gates.enabled"))
  no_budget = not any(c.get(f"gates.{k}") is not None for c in (old, new)
                      for k in config_base.BUDGET_TARGETS)
  ignored = lambda key: (any(key == k or key.startswith(k.rstrip("*")) for k in RESUMABLE)
                         or (ungated and key.startswith("gates."))
                         or (no_budget and key in BUDGET_ONLY))
  return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(old.keys() & new.keys())
          if old[k] != new[k] and not ignored(k)]


def _leaves(config: ml_collections.ConfigDict) -> dict:
  leaves = {}
  for name, section in json.loads(config.to_json_best_effort()).items():
    leaves.update({f"{name}.{k}": v for k, v in section.items()}
                  if isinstance(section, dict) else {name: section})
  return leaves


def init_source(config: ml_collections.ConfigDict) -> str:
  """The run or export whose parameters the run starts from; '' for a fresh start
  (init_from unset, or FROM_SCRATCH)."""
  return "" if config.init_from in ("", FROM_SCRATCH) else config.init_from


def check_pruning_has_a_baseline(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError for a pruning run that does not say what it starts from.

  Pruning an untrained model is almost always a forgotten flag, which would only show
  in the results after the whole pruning schedule; from scratch is an explicit choice.
  """
  if config.gates.enabled and not config.init_from:
    raise ConfigError(
        "config.gates.enabled=True makes this a pruning run, which starts from a "
        "trained baseline, but config.init_from is not set. Add "
        "--config.init_from=BASELINE_WORKDIR (a finished baseline run's --workdir, or "
        "an exported model); to prune a model trained from scratch, "
        f"--config.init_from={FROM_SCRATCH}.")


def _value(config, key):
  section, name = key.split(".")
  return config[section][name]


def _check_ranges(config):
  for key, minimum in _MINIMUM.items():
    value = _value(config, key)
    if value is not None and value < minimum:
      why = _WHY_NOT_NEGATIVE.get(key, f"it must be at least {minimum}")
      raise ConfigError(f"config.{key}={value} is out of range: {why}. "
                        f"Set --config.{key} to a value >= {minimum}.")
  gates, train = config.gates, config.train
  if gates.enabled and gates.freeze_step > train.num_steps:
    raise ConfigError(
        f"config.gates.freeze_step={gates.freeze_step} is beyond "
        f"config.train.num_steps={train.num_steps}: the gates would never freeze and "
        "the run would end without its fine-tuning phase. Set gates.freeze_step <= "
        "train.num_steps (the paper freezes at 20%: 16K of 80K steps).")


def _check_names(config):
  for key, choices in (("data.name", data_lib.DATASETS), ("model.kind", model_lib.KINDS),
                       ("model.rel_pos", REL_POS),
                       ("model.same_length_keys", attention.SAME_LENGTH_KEYS),
                       ("train.optimizer", optim.OPTIMIZERS)):
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


def _check_model(config, vocab_from_data: bool):
  m = config.model
  if not m.vocab_size and not vocab_from_data:
    raise ConfigError(
        "config.model.vocab_size is unset, which means 'the dataset's', and this "
        "command reads no dataset. Set --config.model.vocab_size=V (python -m "
        "allatt_jax.data --dataset=NAME prints V).")
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
  if m.kind == "txl" and m.d_ff < 1:
    raise ConfigError("config.model.d_ff=0 but a 'txl' model has a feed-forward "
                      "sub-layer; set it (the paper's TXL uses 4 * d_model).")


def _check_lengths(config, cfg: model_lib.ModelConfig):
  if config.model.rel_pos != "learned":
    return
  table = cfg.max_relative_len
  for section in ("train", "eval"):
    s = config[section]
    if s.seq_len + s.mem_len > table:
      raise ConfigError(
          f"config.model.max_relative_len={table} is shorter than config.{section}."
          f"seq_len + config.{section}.mem_len = {s.seq_len + s.mem_len}: the learned "
          "relative position table needs an entry for every distance. Set "
          f"model.max_relative_len >= {s.seq_len + s.mem_len} (0 sizes it from train "
          "and eval), or use model.rel_pos='sinusoidal'.")


def _check_mesh(config):
  data, model = sharding.mesh_shape(config.mesh, jax.device_count())
  _check_batches(config, data)
  m = config.model
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


def _check_batches(config, data: int) -> None:
  """Each batch a step splits over the 'data' axis: the train batch, each micro-batch
  of gradient accumulation and the eval batch. With several processes each reads a
  contiguous share of every batch, whole whenever the batch divides by `data`."""
  t, e = config.train, config.eval
  accum = t.grad_accum_steps
  if accum < 1 or t.batch_size % accum:
    raise ConfigError(
        f"config.train.grad_accum_steps={accum} must be a positive divisor of "
        f"config.train.batch_size={t.batch_size}, one of "
        f"{[d for d in range(1, t.batch_size + 1) if t.batch_size % d == 0]}.")
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
      f"{config.mesh.data} on {jax.device_count()} devices{processes}), which splits "
      f"every batch into equal rows per data shard. Found: "
      + "; ".join(f"{name} ({'ok' if rows % data == 0 else 'not divisible'})"
                  for name, rows in batches)
      + f". Fix: config.train.batch_size a multiple of {data} x grad_accum_steps = "
      f"{data * accum} (e.g. {up(t.batch_size, data * accum)}), config.eval.batch_size "
      f"a multiple of {data} (e.g. {up(e.batch_size, data)}), or a config.mesh with a "
      "smaller data axis.")


def check_workdir(workdir: epath.Path) -> None:
  """Raises ConfigError unless `workdir` can be created and written."""
  probe = workdir / f".write-test-{uuid.uuid4().hex}"
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe.write_text("")
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except  (buckets raise their own types)
    reason = getattr(e, "strerror", None) or e
    raise ConfigError(
        f"--workdir {workdir} is not writable ({reason}); checkpoints and logs go there. "
        "Choose a folder you can write to.") from None


def _check_resume(config, checkpoints: checkpointing.RunCheckpoints, state_shapes):
  # The newest checkpoint whose metadata reads: the run resumes from it or an older
  # one (an unreadable one is skipped then, with a warning).
  for step in checkpoints.steps():
    try:
      found = checkpoints.state_shapes(step)
      break
    except CheckpointError:
      continue
  else:
    return
  if found == state_shapes:
    return
  workdir = checkpoints.directory.parent
  saved = workdir / rundir.CONFIG_FILE
  previous = rundir.load_config(workdir) if saved.is_file() else None
  if previous is not None and previous.model.vocab_size != config.model.vocab_size:
    # Other data changes the shape of every embedding and its optimizer state: the
    # cause says more than that list, which only --verbosity=1 shows.
    logging.debug("Shapes that differ from the checkpoint's: %s", _shape_differences(
        state_shapes, found, limit=len(found) + len(state_shapes)))
    raise CheckpointError(
        f"--workdir {workdir} holds a checkpoint (step {step}) of a run on another "
        f"vocabulary ({previous.model.vocab_size} tokens, dataset "
        f"{previous.data.name!r}; this config: {config.model.vocab_size}, dataset "
        f"{config.data.name!r}). To resume it, rerun with its data (config.data in "
        f"{saved}); to train on this data, use a new --workdir.")
  changed = (_config_differences(previous, config) if previous is not None
             else "unknown (no config.json)")
  raise CheckpointError(
      f"--workdir {workdir} holds a checkpoint (step {step}) of a run whose state has "
      f"other shapes than this config gives ({_shape_differences(state_shapes, found)})."
      f" Config keys changed since that run: {changed}. To resume it, rerun with its "
      f"config ({saved}); to train this config, use a new --workdir.")


def _check_init_from(config, state_shapes):
  source = rundir.run_path(config.init_from)
  if not source.is_dir():
    raise CheckpointError(
        f"config.init_from={source} does not exist or is not a folder; set it to the "
        "--workdir of the finished baseline run, or an exported model, to start from.")
  saved = rundir.load_config(source)
  found = checkpointing.model_param_shapes(source, _PARAMS_PREFIX)
  if saved.model.vocab_size != config.model.vocab_size:
    raise CheckpointError(
        f"config.init_from={source} was trained with a vocabulary of "
        f"{saved.model.vocab_size} tokens (dataset {saved.data.name!r}), this run has "
        f"{config.model.vocab_size} (dataset {config.data.name!r}). Use the baseline's "
        "dataset and model.vocab_size, or a baseline trained on this dataset.")
  expected = {k: v for k, v in state_shapes.items() if k.startswith(_PARAMS_PREFIX)}
  if expected != found:
    raise CheckpointError(
        f"config.init_from={source} holds parameters of other shapes than config.model "
        f"gives ({_shape_differences(expected, found)}). config.model keys that differ "
        f"from the baseline's: {_config_differences(saved, config, ('model',))}. Use the "
        "baseline's model section (and train/eval lengths, which size the relative "
        "position table unless model.max_relative_len is set).")


def check_vocabulary(fingerprint: dict, workdir, init_from: str = "", *,
                     resuming: bool) -> None:
  """Raises DataError if the loaded dataset's vocabulary is not the one the resumed run
  (`resuming` a checkpoint in `workdir`) or the `init_from` model was trained with."""
  sources = [(f"the run in --workdir {workdir}", workdir)] if resuming else []
  if init_from:
    sources.append((f"config.init_from={init_from}", init_from))
  for who, directory in sources:
    saved = rundir.load_vocabulary(directory)
    if saved is not None and saved != fingerprint:
      raise DataError(
          f"The vocabulary of dataset {fingerprint['dataset']!r} ({fingerprint['size']} "
          f"tokens, sha256 {fingerprint['sha256'][:12]}) is not the one {who} was "
          f"trained with ({saved['dataset']!r}, {saved['size']} tokens, sha256 "
          f"{saved['sha256'][:12]}): token ids would mean other tokens. Use the same "
          "dataset files as that run (config.data.name, config.data.manual_dir).")


def check_export(workdir) -> None:
  """Raises CheckpointError unless `workdir` is a pruning run with a finished checkpoint."""
  if (rundir.run_path(workdir) / "params").is_dir():
    raise CheckpointError(
        f"{workdir} is an exported model, not a run: it has no checkpoints or gates left "
        "to export. Give the pruning run's --workdir (the folder holding checkpoints/).")
  config = rundir.load_config(workdir)
  if not config.gates.enabled:
    raise CheckpointError(
        f"{workdir} is a baseline run (gates.enabled=False): it has no head gates, so "
        "there is nothing to prune. Export a pruning run's workdir instead.")
  checkpointing.latest_finished_step(workdir)


def _shape_differences(expected: dict, found: dict, limit: int = 5) -> str:
  # Parameters first: their names say most about what changed.
  order = lambda keys: sorted(keys, key=lambda k: (not k.startswith(_PARAMS_PREFIX), k))
  lines = [f"{k}: saved {found[k]}, now {expected[k]}"
           for k in order(expected.keys() & found.keys()) if expected[k] != found[k]]
  lines += [f"{k}: only now" for k in order(expected.keys() - found.keys())]
  lines += [f"{k}: only saved" for k in order(found.keys() - expected.keys())]
  more = f"; {len(lines) - limit} more" if len(lines) > limit else ""
  return "; ".join(lines[:limit]) + more


def _config_differences(saved: ml_collections.ConfigDict, config: ml_collections.ConfigDict,
                        sections=None, limit: int = 8) -> str:
  """'key: old -> new' for every leaf that differs (in `sections`, or everywhere)."""
  def flat(c):
    return {k: v for k, v in _leaves(c).items()
            if sections is None or k.split(".")[0] in sections}
  old, new = flat(saved), flat(config)
  lines = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
           if old.get(k) != new.get(k)]
  more = f"; {len(lines) - limit} more" if len(lines) > limit else ""
  return ("; ".join(lines[:limit]) + more) or "none"
