"""Checkpoints: the training run's (orbax CheckpointManager) and exported models.

A run's workdir holds `config.json` (the run config), `vocabulary.json` (a fingerprint
of the dataset's vocabulary) and `checkpoints/<step>/` with two items: `state` (step,
variables incl. gates, optimizer state, memory) and `data` (the segment stream's
position). orbax writes each step to `<step>.orbax-checkpoint-tmp` and renames it when
complete, so a save killed half-way is never picked up by restore; the next run's
manager deletes such leftovers.

An exported model is a folder with `config.json` (its run config, model section
describing the smaller model) and `params/`: loadable without the training run.

Every location goes through `run_path`, so a workdir may be a local folder or a
bucket (gs://...), which multi-host runs on Cloud TPU need.
"""
import hashlib
import json
import signal
import threading

from absl import logging
from etils import epath
import flax
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from allatt_jax.errors import CheckpointError

CONFIG_FILE = "config.json"
VOCABULARY_FILE = "vocabulary.json"


def run_path(path) -> epath.Path:
  """A workdir, export or checkpoint location: a URL (gs://...) as given, a local path
  made absolute (orbax wants absolute paths; pathlib would mangle a URL)."""
  if "://" in str(path):
    return epath.Path(path)
  return epath.Path(path).absolute()


def _write_atomically(path: epath.Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(text)
  tmp.replace(path)


def _read_json(path: epath.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path} is unreadable ({e}); restore it, or start the run "
                          "in a new --workdir.") from e


def save_config(directory, config: ml_collections.ConfigDict) -> None:
  _write_atomically(run_path(directory) / CONFIG_FILE,
                    config.to_json_best_effort(indent=2, sort_keys=True))


# Recipe keys added after runs were already saved, with the behaviour those runs had:
# a config.json without them describes a model (and optimizer) of that older form,
# whatever the defaults are now.
_BEFORE_RECIPE_KEYS = {
    "model": dict(same_length_keys="mem_len", out_bias=False, layer_norm_eps=1e-6,
                  final_norm=True, persistent_content_bias=True),
    "gates": dict(open_at_zero=False, lr_multiplier=1.0),
    "train": dict(optimizer="optax_lamb", lamb_eps=1e-6, lamb_max_weight_norm=None,
                  weight_decay_exclude=()),
}


def load_config(directory) -> ml_collections.ConfigDict:
  """A run's or an export's saved config; keys it predates take their old meaning."""
  path = run_path(directory) / CONFIG_FILE
  if not path.is_file():
    raise CheckpointError(
        f"{directory} has no {CONFIG_FILE}: it is neither a training workdir nor an "
        "exported model. Point at the --workdir of a run, or at its export/ folder.")
  saved = _read_json(path)
  for section, old_values in _BEFORE_RECIPE_KEYS.items():
    if section in saved:
      for key, value in old_values.items():
        saved[section].setdefault(key, value)
  return ml_collections.ConfigDict(saved)


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


class RunCheckpoints:
  """The CheckpointManager of one training workdir.

  `read_only` opens another run's checkpoints (init_from, export) without creating
  folders or deleting the temporary folder of a save that run may have in flight.
  """

  def __init__(self, workdir, *, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = run_path(workdir) / "checkpoints"
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": ocp.JsonCheckpointHandler()},
        # Not orbax's read_only option, which logs a warning per setting it overrides.
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, enable_async_checkpointing=async_save,
            create=not read_only, cleanup_tmp_directories=not read_only))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state, *, force: bool = False) -> bool:
    return self.manager.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave(flax.serialization.to_state_dict(state)),
        data=ocp.args.JsonSave({k: int(v) for k, v in data_state.items()})))

  def restore(self, step: int, abstract_state):
    """State (placed per `abstract_state`'s shardings) and data-stream state."""
    target = flax.serialization.to_state_dict(abstract_state)
    restored = self.restore_items(step, state=ocp.args.StandardRestore(target),
                                  data=ocp.args.JsonRestore())
    state = flax.serialization.from_state_dict(abstract_state, restored.state)
    return state, {k: np.int64(v) for k, v in restored.data.items()}

  def restore_items(self, step: int, **items):
    """The named items of a checkpoint (orbax restore args by item name)."""
    try:
      return self.manager.restore(step, args=ocp.args.Composite(**items))
    except (OSError, ValueError) as e:
      raise CheckpointError(
          f"Checkpoint {self.directory / str(step)} is unreadable ({e}). If it is "
          "damaged, delete that folder: the run then resumes from the checkpoint "
          "before it.") from e

  def state_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """{'variables/params/...': shape} of a saved state, read from its metadata only."""
    try:
      metadata = self.manager.item_metadata(step)["state"]
    except (OSError, ValueError) as e:
      raise CheckpointError(
          f"Checkpoint {self.directory / str(step)} is unreadable ({e}).") from e
    return tree_shapes(metadata)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


class PreemptionWatch:
  """Tells the train loop when the job is being preempted, so it saves and stops.

  One process: while the watch is entered, SIGTERM (what Cloud TPU and most schedulers
  send before killing a job) only raises a flag, read between steps. Several
  processes: `jax.distributed.initialize` starts JAX's preemption sync manager (unless
  jax_enable_preemption_service is off), which owns SIGTERM; whichever host receives
  it, orbax's `reached_preemption(step)` turns True at the same step on every host, so
  all save that step together. A Python handler would replace JAX's, so none is set.
  """

  def __init__(self, checkpoints: RunCheckpoints):
    self._checkpoints = checkpoints
    # Python delivers signals to the main thread only.
    self._own_handler = (jax.process_count() == 1
                         and threading.current_thread() is threading.main_thread())
    self._signalled = False
    self._previous = None

  def __enter__(self) -> "PreemptionWatch":
    if self._own_handler:
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    return self

  def __exit__(self, *exc_info) -> None:
    if self._own_handler:
      signal.signal(signal.SIGTERM,
                    signal.SIG_DFL if self._previous is None else self._previous)

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    logging.warning("SIGTERM: saving a checkpoint after the current step, then stopping.")
    self._signalled = True

  def reached(self, step: int) -> bool:
    """Whether to save `step` and stop; every process calls it after every step."""
    if self._own_handler:
      return self._signalled
    return self._checkpoints.manager.reached_preemption(step)


def tree_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{'a/b/c': shape} of every array (or array metadata) leaf of a nested tree."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path):
          tuple(leaf.shape) for path, leaf in leaves}


def latest_finished_step(workdir) -> int:
  """The step of a run's latest complete checkpoint; CheckpointError if it has none."""
  run = RunCheckpoints(workdir, async_save=False, read_only=True)
  try:
    step = run.latest_step()
  finally:
    run.close()
  if step is None:
    raise CheckpointError(
        f"No checkpoint in {run.directory}. Train the run first, or point at a workdir "
        "whose checkpoints/ folder holds a finished save.")
  return step


def restore_variables(workdir, step: int | None = None) -> dict:
  """The model variables of a run's checkpoint (latest by default), as host arrays.

  Arrays are read whole onto this host's CPU rather than onto the mesh that saved
  them, so a checkpoint from a pod or a multi-device run loads on any machine.
  """
  step = latest_finished_step(workdir) if step is None else step
  run = RunCheckpoints(workdir, async_save=False, read_only=True)
  try:
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host),
                          run.manager.item_metadata(step)["state"])
    restored = run.restore_items(step, state=ocp.args.StandardRestore(target))
  finally:
    run.close()
  return jax.tree.map(np.asarray, restored.state["variables"])


def save_model(directory, config: ml_collections.ConfigDict, params) -> None:
  """A standalone model: its config and parameters (no optimizer, no gates)."""
  directory = run_path(directory)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / "params", params, force=True)
  # In a multi-process run one process writes the file, and the others, which read
  # the model back next, wait for it.
  if jax.process_index() == 0:
    save_config(directory, config)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"save_model {directory}")


def load_model(directory):
  """(run config, variables) of an exported model or of a run's latest checkpoint."""
  directory = run_path(directory)
  config = load_config(directory)
  if (directory / "params").is_dir():
    with ocp.StandardCheckpointer() as checkpointer:
      params = checkpointer.restore(directory / "params")
    return config, {"params": jax.tree.map(np.asarray, params)}
  return config, restore_variables(directory)
