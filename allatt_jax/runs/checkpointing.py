"""Checkpoints: the training run's (orbax CheckpointManager) and exported models.

A run's `checkpoints/<step>/` holds `state` (step, variables incl. gates, optimizer
state, memory) and `data` (the segment stream's position); a half-written save is
never restored. Readers fall back to the newest checkpoint that restores, warning of
each one skipped; a resuming run moves those to `unreadable_checkpoints/<step>` (orbax
would neither save that step again nor leave it alone when pruning). An exported model
is a folder with `config.json`, `params/` and its tokenizer.
"""
import asyncio
import contextlib
import sys
from typing import Any, Callable

from absl import logging
from etils import epath
import flax
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.config.errors import CheckpointError

UNREADABLE_DIR = "unreadable_checkpoints"


class RunCheckpoints:
  """The CheckpointManager of one training workdir.

  `read_only` opens another run's checkpoints (init_from, export) without creating
  folders or deleting the temporary folder of a save that run may have in flight.
  """

  def __init__(self, workdir, *, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    _drop_leftovers_of_failed_reads()
    # `workdir` as run_files.run_path gives it: orbax wants an absolute path or a URL.
    self.directory = epath.Path(workdir) / "checkpoints"
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": ocp.JsonCheckpointHandler()},
        # Not orbax's read_only option, which logs a warning per setting it overrides.
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, enable_async_checkpointing=async_save,
            create=not read_only, cleanup_tmp_directories=not read_only))

  def __enter__(self) -> "RunCheckpoints":
    return self

  def __exit__(self, *exc_info) -> None:
    # Whatever ends the block, a save in flight completes (or never counts).
    self.wait()
    self.close()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state, *, force: bool = False) -> bool:
    return self.manager.save(step, force=force, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_saved_tree(state)),
        data=ocp.args.JsonSave({k: int(v) for k, v in data_state.items()})))

  def restore(self, step: int, abstract_state):
    """State (placed per `abstract_state`'s shardings) and data-stream state; orbax's
    error if the checkpoint is unreadable."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_saved_tree(abstract_state)),
        data=ocp.args.JsonRestore()))
    state = flax.serialization.from_state_dict(abstract_state,
                                               {"teacher": None, **restored.state})
    return state, {k: np.int64(v) for k, v in restored.data.items()}

  def restore_newest(self, abstract_state) -> tuple[int, Any, dict]:
    """(step, state, data-stream state) of the newest checkpoint that restores.

    Newer, unreadable checkpoints are moved to UNREADABLE_DIR, so that the run can
    save those steps again.

    Raises:
      CheckpointError: no checkpoint restores; the message lists each one's failure.
    """
    step, (state, data_state), skipped = self.newest_restorable(
        lambda s: self.restore(s, abstract_state))
    if skipped:
      self._set_aside(skipped, step)
    return step, state, data_state

  def newest_restorable(self, restore: Callable[[int], Any]
                        ) -> tuple[int, Any, list[int]]:
    """(step, restore(step), steps skipped) for the newest step `restore` reads whole.

    Each unreadable checkpoint is logged with its reason and skipped, never deleted.

    Raises:
      CheckpointError: there is no checkpoint, or none restores.
    """
    failures = []
    for step in self.steps():
      try:
        restored = restore(step)
      # Damaged files fail in many ways: OSError, ValueError (UnicodeDecodeError,
      # JSON), KeyError (a missing item), and TensorStore's plain Exception.
      except Exception as e:  # pylint: disable=broad-except
        reason = _reason(e)
        failures.append((step, reason))
        logging.warning("Checkpoint %s is unreadable (%s); trying the one before it.",
                        self.directory / str(step), reason)
        continue
      skipped = [s for s, _ in failures]
      if skipped:
        logging.warning("Using the checkpoint of step %d in %s, the newest that "
                        "restores (skipped: %s).", step, self.directory,
                        ", ".join(map(str, skipped)))
      return step, restored, skipped
    if not failures:
      raise _no_checkpoint(self.directory)
    tried = "; ".join(f"step {s}: {reason}" for s, reason in failures)
    raise CheckpointError(
        f"No checkpoint in {self.directory} restores ({tried}). Restore those folders "
        "from a copy, or move checkpoints/ aside to start the run from scratch.")

  def _set_aside(self, steps: list[int], restored: int) -> None:
    aside = self.directory.parent / UNREADABLE_DIR
    # Every process has tried the same files; one moves them, the others wait.
    if jax.process_index() == 0:
      aside.mkdir(parents=True, exist_ok=True)
      for step in steps:
        target = aside / str(step)
        for n in range(1, 1000):   # a step damaged again after an earlier move
          if not target.exists():
            break
          target = aside / f"{step}-{n}"
        (self.directory / str(step)).rename(target)
        logging.warning("Resuming from step %d: moved the unreadable checkpoint of step "
                        "%d to %s (kept for inspection; the run saves that step again).",
                        restored, step, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"set aside {self.directory}")
    self.manager.reload()

  def newest_state_shapes(self) -> tuple[int, dict[str, tuple[int, ...]]] | None:
    """(step, `state_shapes`) of the newest checkpoint whose metadata reads, or None:
    the run resumes from it or an older one (an unreadable one is skipped then, with a
    warning)."""
    for step in self.steps():
      try:
        return step, self.state_shapes(step)
      except CheckpointError:
        continue
    return None

  def steps(self) -> list[int]:
    """The steps of the finished checkpoints, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  def state_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """{'variables/params/...': shape} of a saved state, read from its metadata only."""
    try:
      metadata = self.manager.item_metadata(step)["state"]
    except Exception as e:  # pylint: disable=broad-except  (see newest_restorable)
      raise CheckpointError(
          f"Checkpoint {self.directory / str(step)} is unreadable ({_reason(e)}).") from e
    if metadata is None:
      raise CheckpointError(
          f"Checkpoint {self.directory / str(step)} is unreadable (no state metadata).")
    return tree_shapes(metadata)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    # A writable manager starts deleting leftover temporary folders in a thread as it
    # opens, and orbax's close() does not wait for it: a command stopping right after
    # (a bad input) would exit under it, and it dies with a traceback at shutdown.
    self.manager._maybe_await_cleanup_tmp_directory()  # pylint: disable=protected-access
    self.manager.close()


def _saved_tree(state) -> dict:
  """A train state as its checkpoint holds it: without a teacher (a run that does not
  distill), no 'teacher' entry, so checkpoints saved before distillation existed
  restore as they are."""
  tree = flax.serialization.to_state_dict(state)
  if tree.get("teacher") is None:
    tree.pop("teacher", None)
  return tree


def tree_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{'a/b/c': shape} of every array (or array metadata) leaf of a nested tree."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path):
          tuple(leaf.shape) for path, leaf in leaves}


# Where TensorStore's errors append the spec of the store they read: a thousand
# characters of JSON after what went wrong ('[tensorstore_spec=...' today, 'See full
# TensorStore details' in older versions).
_TENSORSTORE_SPEC_MARKERS = (" [tensorstore_spec=", " See full TensorStore details")


def _reason(error: Exception) -> str:
  """The first line of a failed read's error, without the TensorStore spec some carry."""
  lines = str(error).strip().splitlines() or [""]
  reason = lines[0]
  for marker in _TENSORSTORE_SPEC_MARKERS:
    reason = reason.split(marker)[0]
  reason = reason[:600]
  return reason if type(error) is Exception else f"{type(error).__name__}: {reason}"


def _drop_leftovers_of_failed_reads() -> None:
  """Drops, from here on, the tracebacks a read that failed on damaged files leaves
  behind: orbax's other array reads of that checkpoint, still in flight, fail later,
  and nobody awaits them. Thousands of lines for one checkpoint of a small model,
  around the one-line reason the reader reports (and around the output of a command
  that went on with an older checkpoint). They come three ways:
    - never-awaited orbax coroutines (sys.unraisablehook);
    - asyncio's 'Event loop is closed', from reads ending after orbax closed its loop
      (sys.unraisablehook);
    - 'Task exception was never retrieved' with TensorStore's error (asyncio's logger).
  Anything else reaches the hook and the logger as before.

  Called as checkpoints are opened (`RunCheckpoints`, `_export_read`), not after a
  read failed: leftovers can arrive before the read's error reaches its caller (3 runs
  in 24 of one command, on a busy machine), and reading only the metadata of damaged
  files leaves them too."""
  asyncio.log.logger.addFilter(_not_an_unawaited_tensorstore_error)   # adds it once
  previous = sys.unraisablehook
  if getattr(previous, "drops_leftovers_of_failed_reads", False):
    return

  def hook(unraisable):
    error, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
    closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
    if not (closed_loop or (code is not None and "orbax" in code.co_filename)):
      previous(unraisable)

  hook.drops_leftovers_of_failed_reads = True
  sys.unraisablehook = hook


def _not_an_unawaited_tensorstore_error(record) -> bool:
  error = record.exc_info[1] if record.exc_info else None
  return not (record.getMessage().startswith("Task exception was never retrieved")
              and "tensorstore_spec=" in str(error))


@contextlib.contextmanager
def _export_read(directory: epath.Path):
  """Around a read of an exported model, as `RunCheckpoints` around a run's: drops the
  leftovers of a failed read, and turns its error into a CheckpointError that says
  what to do (an export has one set of parameters, nothing older to fall back to)."""
  _drop_leftovers_of_failed_reads()
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  (see newest_restorable)
    raise CheckpointError(
        f"The exported model in {directory} is unreadable ({_reason(e)}). Export it "
        "again from its run: python -m allatt_jax.export --workdir=RUN --out="
        f"{directory} --overwrite.") from e


def _no_checkpoint(directory) -> CheckpointError:
  return CheckpointError(
      f"No checkpoint in {directory}. Train the run first, or point at a workdir "
      "whose checkpoints/ folder holds a finished save.")


def latest_finished_step(workdir) -> int:
  """The step of a run's latest complete checkpoint; CheckpointError if it has none."""
  with RunCheckpoints(run_files.run_path(workdir), async_save=False,
                      read_only=True) as run:
    step = run.latest_step()
  if step is None:
    raise _no_checkpoint(run.directory)
  return step


def _restore_step(workdir: epath.Path, step: int | None = None) -> tuple[int, dict]:
  """(step, model variables as host arrays) of a run's checkpoint (`workdir` as
  run_files.run_path gives it).

  By default the newest checkpoint that restores (unreadable newer ones are skipped
  with a warning); with `step`, that checkpoint or a CheckpointError. Arrays are read
  whole onto this host's CPU rather than onto the mesh that saved them, so a
  checkpoint from a pod or a multi-device run loads on any machine.
  """
  run = RunCheckpoints(workdir, async_save=False, read_only=True)
  host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])

  def read(s):
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host),
                          run.manager.item_metadata(s)["state"])
    restored = run.manager.restore(
        s, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return jax.tree.map(np.asarray, restored.state["variables"])

  try:
    if step is None:
      return run.newest_restorable(read)[:2]
    if step not in run.manager.all_steps():
      raise CheckpointError(
          f"No checkpoint of step {step} in {run.directory}; it holds steps "
          f"{sorted(run.manager.all_steps()) or 'none'}. Choose one of those.")
    try:
      return step, read(step)
    except Exception as e:  # pylint: disable=broad-except  (see newest_restorable)
      raise CheckpointError(
          f"Checkpoint {run.directory / str(step)} is unreadable ({_reason(e)}). Leave "
          "out the step to use the newest checkpoint that restores.") from e
  finally:
    run.close()


def save_params(directory: epath.Path, params) -> None:
  """An exported model's parameters (no optimizer, no gates) in `directory`/params
  (`directory` as run_files.run_path gives it); `model_export.save` writes the rest
  of the folder."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / "params", params, force=True)


def model_param_shapes(directory: epath.Path, prefix: str
                       ) -> tuple[int | None, dict[str, tuple[int, ...]]]:
  """(the checkpoint's step, None for an exported model; {prefix + 'a/b': shape} of
  its parameters) of an exported model or of a run's latest checkpoint (`directory`,
  as run_files.run_path gives it; `prefix`: where parameters sit in a train state),
  from metadata only."""
  if (directory / "params").is_dir():
    with ocp.StandardCheckpointer() as checkpointer, _export_read(directory):
      metadata = checkpointer.metadata(directory / "params").item_metadata
    return None, {prefix + k: v for k, v in tree_shapes(metadata).items()}
  with RunCheckpoints(directory, async_save=False, read_only=True) as run:
    step, shapes, _ = run.newest_restorable(run.state_shapes)
  return step, {k: v for k, v in shapes.items() if k.startswith(prefix)}


def read_model(directory, step: int | None = None
               ) -> tuple[run_config.RunConfig, dict, int | None]:
  """(run config, model variables as host arrays, the checkpoint step read) of an
  exported model (step None) or of a run's workdir (see `read_variables`).

  Raises:
    CheckpointError: no config.json, no such (readable) checkpoint, or a step asked
      of an export.
  """
  directory = run_files.run_path(directory)
  # The config first: a folder without one gets load_config's advice (a pipeline's
  # workdir, say), not a missing checkpoint's.
  config = run_files.load_config(directory)
  return config, *read_variables(directory, step)


def read_variables(directory: epath.Path, step: int | None = None
                   ) -> tuple[dict, int | None]:
  """(model variables as host arrays, the checkpoint step read) of an exported model
  (step None) or of a run's workdir (`directory` as run_files.run_path gives it): its
  checkpoint `step`, by default the newest that restores (see `_restore_step`).

  Raises:
    CheckpointError: no such (readable) checkpoint, or a step asked of an export.
  """
  if (directory / "params").is_dir():
    if step is not None:
      raise CheckpointError(
          f"{directory} is an exported model: it has one set of parameters, no steps. "
          "Leave out the step, or point at the training run's workdir.")
    with ocp.StandardCheckpointer() as checkpointer, _export_read(directory):
      params = checkpointer.restore(directory / "params")
    return {"params": jax.tree.map(np.asarray, params)}, None
  step, variables = _restore_step(directory, step)
  return variables, step
