"""A run directory's own files: where it is, its config and its vocabulary.

A workdir (or an export) holds `config.json`, `tokenizer.json` (the vocabulary and its
tokenisation rules) and, for a run, `vocabulary.json` (the dataset vocabulary's
fingerprint). Files are written atomically (temporary file renamed into place). Every
location goes through `run_path`, so a workdir may be a local folder or a bucket
(gs://...), as multi-host Cloud TPU runs need.
"""
import hashlib
import json

from etils import epath

from allatt_jax.config import run_config
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import ConfigError

CONFIG_FILE = "config.json"
VOCABULARY_FILE = "vocabulary.json"
TOKENIZER_FILE = "tokenizer.json"
GATE_HISTORY_FILE = "gate_history.jsonl"   # pruning runs: open probabilities per log
# A pipeline's pruning stages: WORKDIR/pruned, then pruned-2, pruned-3, ... for the
# pruning settings tried after it.
PRUNING_STAGE = "pruned"


def run_path(path) -> epath.Path:
  """A workdir, export or checkpoint location: a URL (gs://...) as given, a local path
  made absolute (orbax wants absolute paths; pathlib would mangle a URL)."""
  if "://" in str(path):
    return epath.Path(path)
  return epath.Path(path).absolute()


def pruning_stages(workdir) -> list[epath.Path]:
  """The pruning stages a pipeline's `workdir` holds (those that saved their config),
  in the order they are made: pruned/, then pruned-2/, pruned-3/, ..."""
  workdir = run_path(workdir)
  numbered = [d for d in workdir.glob(f"{PRUNING_STAGE}-*")
              if d.name[len(PRUNING_STAGE) + 1:].isdigit()]
  folders = [workdir / PRUNING_STAGE,
             *sorted(numbered, key=lambda d: int(d.name[len(PRUNING_STAGE) + 1:]))]
  return [folder for folder in folders if (folder / CONFIG_FILE).is_file()]


def _write_atomically(path: epath.Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(text)
  tmp.replace(path)


def write_json(path, value) -> None:
  """`value` as JSON in `path`, written atomically (a reader sees all of it or none)."""
  _write_atomically(run_path(path), json.dumps(value, indent=2))


def _read_json(path: epath.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path} is unreadable ({e}); restore it, or start the run "
                          "in a new --workdir.") from e


def save_config(directory, config: run_config.RunConfig) -> None:
  """Writes a RunConfig as config.json."""
  _write_atomically(run_path(directory) / CONFIG_FILE,
                    json.dumps(config.to_dict(), indent=2, sort_keys=True))


def save_run(directory, config: run_config.RunConfig, vocabulary: dict,
             tokenizer: dict) -> None:
  """Writes what describes a run or an export besides its parameters: its config,
  its vocabulary's fingerprint and its tokenizer (`Tokenizer.to_dict()`)."""
  save_config(directory, config)
  save_vocabulary(directory, vocabulary)
  save_tokenizer(directory, tokenizer)


# Recipe keys added after runs were already saved, with the behaviour those runs had:
# a config.json without them describes a model (and optimizer) of that older form,
# whatever the defaults are now.
_BEFORE_RECIPE_KEYS = {
    "model": dict(same_length_keys="mem_len", out_bias=False, layer_norm_eps=1e-6,
                  final_norm=True, persistent_content_bias=True, auto_cutoffs=False),
    "gates": dict(open_at_zero=False, lr_multiplier=1.0, budget_sharpness=1.0),
    "train": dict(optimizer="optax_lamb", lamb_eps=1e-6, lamb_max_weight_norm=None,
                  weight_decay_exclude=()),
}
# Choices removed since runs were saved with them, and the choice that computes the
# same model: the whole-core fused attention kernels computed the XLA core's numbers
# (a command's own config naming them is refused: config_checks).
_REMOVED_CHOICES = {("model", "attention_impl"): {"pallas": "xla"}}


def load_config(directory) -> run_config.RunConfig:
  """A run's or an export's saved config; keys it predates take their old meaning."""
  path = run_path(directory) / CONFIG_FILE
  if not run_path(directory).exists():
    raise CheckpointError(f"{directory} does not exist. Point at the --workdir of a run, "
                          "or at its export/ folder.")
  if not path.is_file():
    baseline = run_path(directory) / "baseline"
    runs = [f"{run.name}/" for run in ([baseline] if (baseline / CONFIG_FILE).is_file()
                                       else []) + pruning_stages(directory)]
    listed = f"{', '.join(runs[:-1])} and {runs[-1]}" if len(runs) > 1 else "".join(runs)
    hint = f" It is a pipeline's workdir: its runs are {listed} in it." if runs else ""
    raise CheckpointError(
        f"{directory} has no {CONFIG_FILE}: it is neither a training workdir nor an "
        f"exported model. Point at the --workdir of a run, or at its export/ folder.{hint}")
  saved = _read_json(path)
  for section, old_values in _BEFORE_RECIPE_KEYS.items():
    if section in saved:
      for key, value in old_values.items():
        saved[section].setdefault(key, value)
  if "gates" in saved:   # a budget's target once warmed up with λ's schedule
    saved["gates"].setdefault("budget_warmup_steps", saved["gates"].get("l0_warmup_steps"))
  for (section, key), replaced in _REMOVED_CHOICES.items():
    values = saved.get(section, {})
    if values.get(key) in replaced:
      values[key] = replaced[values[key]]
  # Any other key it lacks (a setting that changes no trained model, such as where
  # the data lies) takes today's default.
  try:
    return run_config.RunConfig.from_dict(saved, flag="config")
  except ConfigError as e:
    raise CheckpointError(f"{path} does not read as a run's config: {e}") from None


def vocabulary_fingerprint(name: str, vocab) -> dict:
  """What identifies a vocabulary: its dataset, size and a hash of its tokens in order."""
  digest = hashlib.sha256(json.dumps(list(vocab), ensure_ascii=False).encode("utf-8"))
  return {"dataset": name, "size": len(vocab), "sha256": digest.hexdigest()}


def save_vocabulary(directory, fingerprint: dict) -> None:
  _write_atomically(run_path(directory) / VOCABULARY_FILE,
                    json.dumps(fingerprint, indent=2, sort_keys=True))


def load_vocabulary(directory) -> dict | None:
  """The vocabulary fingerprint a run saved, or None (runs from before it was saved)."""
  path = run_path(directory) / VOCABULARY_FILE
  return _read_json(path) if path.is_file() else None


def save_tokenizer(directory, description: dict) -> None:
  """Writes a `Tokenizer.to_dict()` description."""
  _write_atomically(run_path(directory) / TOKENIZER_FILE,
                    json.dumps(description, ensure_ascii=False))


def load_tokenizer(directory) -> dict | None:
  """The tokenizer description a run or export saved, or None (saved before it was)."""
  path = run_path(directory) / TOKENIZER_FILE
  return _read_json(path) if path.is_file() else None
