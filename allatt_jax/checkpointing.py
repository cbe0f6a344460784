"""Checkpoints: the training run's (orbax CheckpointManager) and exported models.

A run's workdir holds, next to its own files (rundir.py), `checkpoints/<step>/` with
two items: `state` (step,
variables incl. gates, optimizer state, memory) and `data` (the segment stream's
position). orbax writes each step to `<step>.orbax-checkpoint-tmp` and renames it when
complete, so a save killed half-way is never picked up by restore; the next run's
manager deletes such leftovers.

An exported model is a folder with `config.json` (its run config, model section
describing the smaller model) and `params/`: loadable without the training run.
"""
import flax
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from allatt_jax import rundir
from allatt_jax.errors import CheckpointError


class RunCheckpoints:
  """The CheckpointManager of one training workdir.

  `read_only` opens another run's checkpoints (init_from, export) without creating
  folders or deleting the temporary folder of a save that run may have in flight.
  """

  def __init__(self, workdir, *, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = rundir.run_path(workdir) / "checkpoints"
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


def tree_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{'a/b/c': shape} of every array (or array metadata) leaf of a nested tree."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path):
          tuple(leaf.shape) for path, leaf in leaves}


def _finished_step(run: RunCheckpoints) -> int:
  step = run.latest_step()
  if step is None:
    raise CheckpointError(
        f"No checkpoint in {run.directory}. Train the run first, or point at a workdir "
        "whose checkpoints/ folder holds a finished save.")
  return step


def latest_finished_step(workdir) -> int:
  """The step of a run's latest complete checkpoint; CheckpointError if it has none."""
  run = RunCheckpoints(workdir, async_save=False, read_only=True)
  try:
    return _finished_step(run)
  finally:
    run.close()


def restore_variables(workdir, step: int | None = None) -> dict:
  """The model variables of a run's checkpoint (latest by default), as host arrays.

  Arrays are read whole onto this host's CPU rather than onto the mesh that saved
  them, so a checkpoint from a pod or a multi-device run loads on any machine.
  """
  run = RunCheckpoints(workdir, async_save=False, read_only=True)
  try:
    if step is None:
      step = _finished_step(run)
    elif step not in run.manager.all_steps():
      raise CheckpointError(
          f"{run.directory} has no checkpoint of step {step}; its finished steps are "
          f"{sorted(run.manager.all_steps())}.")
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host),
                          run.manager.item_metadata(step)["state"])
    restored = run.restore_items(step, state=ocp.args.StandardRestore(target))
  finally:
    run.close()
  return jax.tree.map(np.asarray, restored.state["variables"])


def save_model(directory, config: ml_collections.ConfigDict, params,
               tokenizer: dict | None = None) -> None:
  """A standalone model: its config, parameters (no optimizer, no gates) and, given
  its description (`Tokenizer.to_dict()`), the tokenizer that reads text for it."""
  directory = rundir.run_path(directory)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / "params", params, force=True)
  # In a multi-process run one process writes the file, and the others, which read
  # the model back next, wait for it.
  if jax.process_index() == 0:
    rundir.save_config(directory, config)
    if tokenizer is not None:
      rundir.save_tokenizer(directory, tokenizer)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"save_model {directory}")


def model_param_shapes(directory, prefix: str) -> dict[str, tuple[int, ...]]:
  """{prefix + 'a/b': shape} of the parameters of an exported model or of a run's latest
  checkpoint (`prefix`: where parameters sit in a train state), from metadata only."""
  directory = rundir.run_path(directory)
  if (directory / "params").is_dir():
    with ocp.StandardCheckpointer() as checkpointer:
      metadata = checkpointer.metadata(directory / "params").item_metadata
    return {prefix + k: v for k, v in tree_shapes(metadata).items()}
  run = RunCheckpoints(directory, async_save=False, read_only=True)
  try:
    shapes = run.state_shapes(_finished_step(run))
  finally:
    run.close()
  return {k: v for k, v in shapes.items() if k.startswith(prefix)}


def load_model(directory, step: int | None = None):
  """(run config, variables) of an exported model or of a run's checkpoint `step`
  (default: the latest); an export has no steps."""
  directory = rundir.run_path(directory)
  config = rundir.load_config(directory)
  if (directory / "params").is_dir():
    with ocp.StandardCheckpointer() as checkpointer:
      params = checkpointer.restore(directory / "params")
    if step is not None:
      raise CheckpointError(
          f"{directory} is an exported model, which has no checkpoint steps; drop the "
          "step, or point at the training run's workdir.")
    return config, {"params": jax.tree.map(np.asarray, params)}
  return config, restore_variables(directory, step)
