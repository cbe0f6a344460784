"""Checkpoints: the training run's (orbax CheckpointManager) and exported models.

A run's workdir holds `config.json` (the run config) and `checkpoints/<step>/` with
two items: `state` (step, variables incl. gates, optimizer state, memory) and `data`
(the segment stream's position). orbax writes each step to a temporary folder and
renames it when complete, so a save killed half-way is never picked up by restore.

An exported model is a folder with `config.json` (its run config, model section
describing the smaller model) and `params/`: loadable without the training run.
"""
import json
import pathlib

import flax
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from allatt_jax.errors import CheckpointError

CONFIG_FILE = "config.json"


def save_config(directory, config: ml_collections.ConfigDict) -> None:
  path = pathlib.Path(directory) / CONFIG_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(config.to_json_best_effort(indent=2, sort_keys=True))
  tmp.replace(path)


def load_config(directory) -> ml_collections.ConfigDict:
  path = pathlib.Path(directory) / CONFIG_FILE
  if not path.is_file():
    raise CheckpointError(
        f"{directory} has no {CONFIG_FILE}: it is neither a training workdir nor an "
        "exported model. Point at the --workdir of a run, or at its export/ folder.")
  return ml_collections.ConfigDict(json.loads(path.read_text()))


class RunCheckpoints:
  """The CheckpointManager of one training workdir."""

  def __init__(self, workdir, *, keep: int = 3, async_save: bool = True):
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=("state", "data"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state, *, force: bool = False) -> bool:
    return self.manager.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave(flax.serialization.to_state_dict(state)),
        data=ocp.args.JsonSave({k: int(v) for k, v in data_state.items()})))

  def restore(self, step: int, abstract_state):
    """State (placed per `abstract_state`'s shardings) and data-stream state."""
    target = flax.serialization.to_state_dict(abstract_state)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    state = flax.serialization.from_state_dict(abstract_state, restored.state)
    return state, {k: np.int64(v) for k, v in restored.data.items()}

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def restore_variables(workdir, step: int | None = None) -> dict:
  """The model variables of a run's checkpoint (latest by default), as host arrays."""
  run = RunCheckpoints(workdir, async_save=False)
  try:
    step = run.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(
          f"No checkpoint in {run.directory}. Train the run first, or point at a workdir "
          "whose checkpoints/ folder holds a finished save.")
    restored = run.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))
  finally:
    run.close()
  return jax.tree.map(np.asarray, restored.state["variables"])


def save_model(directory, config: ml_collections.ConfigDict, params) -> None:
  """A standalone model: its config and parameters (no optimizer, no gates)."""
  directory = pathlib.Path(directory).absolute()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / "params", params, force=True)
  save_config(directory, config)


def load_model(directory):
  """(run config, variables) of an exported model or of a run's latest checkpoint."""
  directory = pathlib.Path(directory).absolute()
  config = load_config(directory)
  if (directory / "params").is_dir():
    with ocp.StandardCheckpointer() as checkpointer:
      params = checkpointer.restore(directory / "params")
    return config, {"params": jax.tree.map(np.asarray, params)}
  return config, restore_variables(directory)
