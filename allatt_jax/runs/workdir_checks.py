"""Checks of a run against its files, made before any code is compiled.

`check_run` checks `init_from`, the workdir and its checkpoints (against the
abstract state) and the dataset's vocabulary (`check_vocabulary`) before a run writes
there;
`check_export` guards an export. A failed check raises one error (errors.py) that
says what is wrong, where, and how to fix it.
"""
import json
import uuid

from absl import logging
from etils import epath
import flax

from allatt_jax.runs import checkpointing
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import ConfigError
from allatt_jax.config.errors import DataError

_PARAMS_PREFIX = "variables/params/"
# What a resumed or reused run may change without changing the model it trains: how
# long it runs (more steps), when it logs, evaluates and saves, how it is evaluated,
# where its data and devices are, the ways of computing the same attention and output
# layer (and the training shares that size the latter), the consent to a budget that
# keeps no head (which the config's checks ask for), and the choice of an output
# layer, saved as the cutoffs it made (compared themselves).
RESUMABLE = ("train.num_steps", "train.log_every_steps", "eval.*", "checkpoint.*",
             "mesh.*", "data.data_dir", "data.manual_dir", "model.head_block",
             "model.remat", "model.score_dtype", "model.vocab_block",
             "model.tail_capacity", "model.cluster_fractions", "model.attention_impl",
             "model.persistent_impl", "gates.allow_empty", "model.auto_cutoffs",
             "gates.budget_fraction")
# Settings of the budget controller, which a run without a budget never reads.
BUDGET_ONLY = ("gates.budget_sharpness", "gates.budget_warmup_steps", "gates.lagrangian_lr")


def check_run(config: run_config.RunConfig, abstract_state, workdir: epath.Path,
              vocabulary: dict) -> None:
  """The checks a run makes before it writes to its workdir: its `init_from` (first,
  so that a wrong one leaves no workdir behind), its workdir and the checkpoints it
  holds (read, not opened for writing), against the state's shapes, the run's
  settings and the loaded dataset's `vocabulary` (`run_files.vocabulary_fingerprint`).

  Raises:
    CheckpointError: `init_from` is missing, unreadable or does not fit the config;
      or the workdir holds a checkpoint of a run with other shapes than this config
      gives.
    ConfigError: the workdir is not writable, or holds a run trained with other
      settings.
    DataError: the dataset's vocabulary is not the one of the run resumed or of
      `init_from`.
  """
  if config.init_source:
    _check_init_from(config, abstract_state)
  check_workdir(workdir)
  state_shapes = checkpointing.tree_shapes(flax.serialization.to_state_dict(abstract_state))
  # What the workdir holds, read before anything is compared with it.
  with checkpointing.RunCheckpoints(workdir, async_save=False, read_only=True) as saved:
    resuming, newest = bool(saved.steps()), saved.newest_state_shapes()
  _check_resume(config, saved.directory, newest, state_shapes)
  if resuming:
    check_same_settings(config, workdir)
  check_vocabulary(vocabulary, workdir, config.init_source, resuming=resuming)


def check_same_settings(config: run_config.RunConfig, workdir) -> None:
  """Raises ConfigError when the run trained in `workdir` had other settings than
  `config` in anything a resumed (or reused) run may not change (`RESUMABLE`).

  Resuming would train a mix of both, and the saved config.json would then describe
  a model it did not train; a workdir without config.json has nothing to compare.
  """
  workdir = run_files.run_path(workdir)
  if not (workdir / run_files.CONFIG_FILE).is_file():
    return
  changed = setting_differences(run_files.load_config(workdir), config)
  if changed:
    raise ConfigError(
        f"--workdir {workdir} holds a run trained with other settings ({'; '.join(changed)});"
        " continuing it would mix the two. Rerun with its settings, or train these in a "
        "new --workdir.")


def setting_differences(saved: run_config.RunConfig,
                        config: run_config.RunConfig) -> list[str]:
  """'key: saved -> now' for each setting that differs outside RESUMABLE. Only keys
  both configs have are compared (a key one of them predates cannot have been
  chosen); a run without gates has no gate settings besides `gates.enabled`, and a
  run without a budget no controller settings (BUDGET_ONLY)."""
  old, new = _leaves(saved), _leaves(config)
  ungated = not (old.get("gates.enabled") or new.get("gates.enabled"))
  no_budget = not any(c.get(f"gates.{k}") is not None for c in (old, new)
                      for k in run_config.BUDGET_TARGETS)
  ignored = lambda key: (any(key == k or key.startswith(k.rstrip("*")) for k in RESUMABLE)
                         or (ungated and key.startswith("gates."))
                         or (no_budget and key in BUDGET_ONLY))
  return _described([k for k in sorted(old.keys() & new.keys())
                     if old[k] != new[k] and not ignored(k)], saved, config)


def _described(keys, saved: run_config.RunConfig, config: run_config.RunConfig) -> list[str]:
  """'key: saved -> now' of each of `keys`, a budget as lines show it: the fraction
  asked beside the figure (`GatesSection.budget_shown`), for which
  'gates.budget_fraction' stands too."""
  saved, config = run_config.RunConfig.of(saved), run_config.RunConfig.of(config)

  def shown(c):
    values = {k: repr(v) for k, v in _leaves(c).items()}
    if c.gates.budget_target:
      values[f"gates.{c.gates.budget_target}"] = c.gates.budget_shown.split("=", 1)[1]
    return values
  old, new = shown(saved), shown(config)
  budget = next((f"gates.{c.gates.budget_target}" for c in (config, saved)
                 if c.gates.budget_target), "gates.budget_fraction")
  keys = dict.fromkeys(budget if k == "gates.budget_fraction" else k for k in keys)
  return [f"{k}: {old.get(k, 'None')} -> {new.get(k, 'None')}" for k in keys]


def _leaves(config: run_config.RunConfig) -> dict:
  leaves = {}
  # Through JSON, so that a tuple compares equal to the list config.json holds.
  for name, section in json.loads(json.dumps(config.to_dict())).items():
    leaves.update({f"{name}.{k}": v for k, v in section.items()}
                  if isinstance(section, dict) else {name: section})
  return leaves


def check_folder(workdir: epath.Path) -> None:
  """Raises ConfigError where `workdir`, or the nearest of the folders above it that
  exists, is a file: made before a command reads any data or prints a banner, naming
  the path given, as writing below it would fail later."""
  for path in (workdir, *workdir.parents):
    if not path.exists():
      continue
    if not path.is_dir():
      what = "is a file" if path == workdir else f"lies under {path}, a file"
      raise ConfigError(
          f"--workdir {workdir} {what}, not a folder; runs, checkpoints and reports go "
          "in a folder. Give the path of a folder: a new one, or the run's own.")
    return


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


def _check_resume(config, checkpoints: epath.Path, newest, state_shapes):
  """Raises CheckpointError unless the newest checkpoint in `checkpoints` whose
  metadata reads (`newest`: `RunCheckpoints.newest_state_shapes`) has `state_shapes`."""
  if newest is None:
    return
  step, found = newest
  if found == state_shapes:
    return
  workdir = checkpoints.parent
  saved = workdir / run_files.CONFIG_FILE
  previous = run_files.load_config(workdir) if saved.is_file() else None
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
  advice = (f"To resume it, rerun with its config ({saved}); to train this config, use "
            "a new --workdir.")
  shapes = _shape_differences(state_shapes, found, limit=3)
  if previous is None:
    raise CheckpointError(
        f"--workdir {workdir} holds a checkpoint (step {step}) of a run whose state has "
        f"other shapes than this config gives ({shapes}), and no {run_files.CONFIG_FILE} "
        f"to say which settings changed. {advice}")
  # The settings that cannot change lead: the shapes follow from them.
  changed = "; ".join(setting_differences(previous, config)) or _config_differences(
      previous, config)
  own_words = config.data.name == "text_files" and config.data.level in ("", "word")
  if (own_words and config.model.auto_cutoffs and config.model.cutoffs
      and not previous.model.cutoffs):
    # A run from before the adaptive softmax was chosen for own word-level text.
    advice = ("The cutoffs are the adaptive softmax chosen for own text at word level; "
              "--config.model.auto_cutoffs=False keeps the plain softmax that run has. "
              + advice)
  raise CheckpointError(
      f"--workdir {workdir} holds a checkpoint (step {step}) of a run with other "
      f"settings. Config keys changed since that run: {changed}. Its state has other "
      f"shapes than this config gives, so it cannot resume. {advice} Shapes that "
      f"differ: {shapes}.")


def check_init_from_files(config: run_config.RunConfig
                          ) -> tuple[run_config.RunConfig, int | None,
                                     dict[str, tuple[int, ...]]]:
  """The checks of the model that `init_from` names that its files alone allow
  (config.json and checkpoint metadata), against the config's `model.vocab_size`
  where it is set. A run makes them before it reads its dataset, whose first
  preparation can take minutes, so that a wrong `init_from` costs none of them.

  Returns:
    (its saved config; the step of the checkpoint it would start from, None for an
    exported model; {path: shape} of its parameters), for the checks against the
    run's state (`check_run`) and `init_from_note`.

  Raises:
    CheckpointError: `init_from` is missing, is not a run or an exported model, holds
      no checkpoint that restores, or was trained with another vocabulary size.
  """
  source = run_files.run_path(config.init_from)
  if not source.is_dir():
    raise CheckpointError(
        f"config.init_from={source} does not exist or is not a folder; set it to the "
        "--workdir of the finished baseline run, or an exported model, to start from.")
  saved = run_files.load_config(source)
  step, found = checkpointing.model_param_shapes(source, _PARAMS_PREFIX)
  vocab_size = config.model.vocab_size
  if vocab_size and saved.model.vocab_size != vocab_size:
    raise CheckpointError(
        f"config.init_from={source} was trained with a vocabulary of "
        f"{saved.model.vocab_size} tokens (dataset {saved.data.name!r}), this run has "
        f"{vocab_size} (dataset {config.data.name!r}). Use the baseline's "
        "dataset and model.vocab_size, or a baseline trained on this dataset.")
  return saved, step, found


def init_from_note(config: run_config.RunConfig) -> str:
  """What a run says first of the model `init_from` names (`check_init_from_files`,
  whose checks it makes): '' for an exported model or a run that finished, else that
  the run stopped short and at which step, since a preempted baseline looks like a
  finished one from the outside."""
  saved, step, _ = check_init_from_files(config)
  if step is None or step >= saved.train.num_steps:
    return ""
  return (f"warning: config.init_from={config.init_from} is a run that stopped at step "
          f"{step:,} of its {saved.train.num_steps:,}: this run starts from that "
          "checkpoint. To start from the finished model, stop this run and rerun that "
          "run's command first, which resumes it.")


def _check_init_from(config, abstract_state):
  saved, _, found = check_init_from_files(config)
  state_shapes = checkpointing.tree_shapes(flax.serialization.to_state_dict(abstract_state))
  expected = {k: v for k, v in state_shapes.items() if k.startswith(_PARAMS_PREFIX)}
  if expected != found:
    raise CheckpointError(
        f"config.init_from={config.init_from} holds parameters of other shapes than "
        f"config.model gives ({_shape_differences(expected, found)}). config.model keys "
        f"that differ from the baseline's: "
        f"{_config_differences(saved, config, ('model',))}. Use the baseline's model "
        "section (and train/eval lengths, which size the relative position table unless "
        "model.max_relative_len is set).")


def check_vocabulary(fingerprint: dict, workdir, init_from: str = "", *,
                     resuming: bool) -> None:
  """Raises DataError if the loaded dataset's vocabulary is not the one the resumed run
  (`resuming` a checkpoint in `workdir`) or the `init_from` model was trained with."""
  sources = [(f"the run in --workdir {workdir}", workdir)] if resuming else []
  if init_from:
    sources.append((f"config.init_from={init_from}", init_from))
  for who, directory in sources:
    saved = run_files.load_vocabulary(directory)
    if saved is not None and saved != fingerprint:
      raise DataError(
          f"The vocabulary of dataset {fingerprint['dataset']!r} ({fingerprint['size']} "
          f"tokens, sha256 {fingerprint['sha256'][:12]}) is not the one {who} was "
          f"trained with ({saved['dataset']!r}, {saved['size']} tokens, sha256 "
          f"{saved['sha256'][:12]}): token ids would mean other tokens. Use the same "
          "dataset files as that run (config.data.name, config.data.manual_dir).")


def check_export(workdir) -> None:
  """Raises CheckpointError unless `workdir` is a pruning run with a finished checkpoint."""
  if (run_files.run_path(workdir) / "params").is_dir():
    raise CheckpointError(
        f"{workdir} is an exported model, not a run: it has no checkpoints or gates left "
        "to export. Give the pruning run's --workdir (the folder holding checkpoints/).")
  config = run_files.load_config(workdir)
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


def key_differences(saved: run_config.RunConfig, config: run_config.RunConfig,
                    sections=None) -> list[str]:
  """'key: old -> new' for every leaf that differs (in `sections`, or everywhere),
  those a resumed run may change (RESUMABLE) too."""
  def flat(c):
    return {k: v for k, v in _leaves(c).items()
            if sections is None or k.split(".")[0] in sections}
  old, new = flat(saved), flat(config)
  return _described([k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)],
                    saved, config)


def _config_differences(saved: run_config.RunConfig, config: run_config.RunConfig,
                        sections=None, limit: int = 8) -> str:
  """`key_differences`, the first `limit` of them, in one string."""
  lines = key_differences(saved, config, sections)
  more = f"; {len(lines) - limit} more" if len(lines) > limit else ""
  return ("; ".join(lines[:limit]) + more) or "none"
