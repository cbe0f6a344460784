"""A damaged newest checkpoint: resume, export and readers fall back to the newest one
that restores, say which they skipped and why, and delete nothing.

The damage is done to a finished run's files, as a disk or a copy might: a truncated
array file, garbage in the state's metadata (`_METADATA`, which orbax writes after all
arrays are committed), and no commit: on a local disk orbax commits a step by
renaming `<step>.orbax-checkpoint-tmp-*` to `<step>` (`commit_success.txt` files
mark it only on filesystems without atomic renames), so an uncommitted step is that
temporary folder.
"""
import asyncio
import logging
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import data_fixtures
import helpers
from helpers import assert_bit_identical
from helpers import train_run
from helpers import saved_state
from allatt_jax.runs import checkpointing
from allatt_jax.pruning import model_export
from allatt_jax.training import loop
from allatt_jax.config.errors import CheckpointError

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

NUM_STEPS, EVERY = 6, 2


def damage(step_dir: pathlib.Path, how: str) -> None:
  state = step_dir / "state"
  if how == "truncated_array_file":
    for chunk in state.rglob("d/*"):
      if chunk.is_file():
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
  elif how == "garbage_metadata":
    (state / "_METADATA").write_bytes(b"\xff\xfe\x00 not json")
  elif how == "uncommitted":
    step_dir.rename(step_dir.with_name(f"{step_dir.name}.orbax-checkpoint-tmp-1795000000"))
  else:
    raise ValueError(how)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """(config, workdir) of a finished tiny pruning run with checkpoints 2, 4 and 6."""
  root = tmp_path_factory.mktemp("fallback")
  config = helpers.tiny_run()
  config.data.update(data_fixtures.text8_data(root))
  config.model.dropout = 0.1     # the RNG must resume where the skipped step left it
  config.train.update(dict(num_steps=NUM_STEPS, log_every_steps=2))
  config.gates.update(dict(enabled=True, lam=0.1, l0_warmup_steps=2,
                           freeze_step=NUM_STEPS))
  config.init_from = "none"      # pruning a model trained from scratch, on purpose
  config.checkpoint.update(dict(every_steps=EVERY, keep=10))
  workdir = root / "run"
  train_run(config, workdir)
  return config, workdir


def stopped_after_step_4(finished: pathlib.Path, workdir: pathlib.Path) -> None:
  """`finished` as a run killed after saving step 4 leaves it."""
  shutil.copytree(finished, workdir)
  shutil.rmtree(workdir / "checkpoints" / str(NUM_STEPS))
  for name in ("results.json", loop.PHASES_FILE, "export"):
    shutil.rmtree(workdir / name, ignore_errors=True)
    (workdir / name).unlink(missing_ok=True)


@pytest.mark.parametrize("how", ["truncated_array_file", "garbage_metadata", "uncommitted"])
def test_resume_skips_a_damaged_newest_checkpoint(finished_run, tmp_path, how, caplog):
  config, finished = finished_run
  workdir = tmp_path / "run"
  stopped_after_step_4(finished, workdir)
  damaged = workdir / "checkpoints" / "4"
  damage(damaged, how)
  damaged_files = sorted(p.relative_to(damaged) for p in damaged.rglob("*"))

  with caplog.at_level(logging.WARNING):
    train_run(config, workdir)

  # Resumed from step 2, and ended exactly where the uninterrupted run ended.
  assert_bit_identical(saved_state(workdir, NUM_STEPS), saved_state(finished, NUM_STEPS))
  assert_bit_identical(saved_state(workdir, 4), saved_state(finished, 4))
  if how == "uncommitted":     # never a checkpoint: orbax removes what a save left
    return
  assert f"Checkpoint {damaged} is unreadable (" in caplog.text
  # The damaged checkpoint is kept aside, whole, and step 4 was saved again.
  aside = workdir / checkpointing.UNREADABLE_DIR / "4"
  assert f"moved the unreadable checkpoint of step 4 to {aside}" in caplog.text
  assert sorted(p.relative_to(aside) for p in aside.rglob("*")) == damaged_files


def test_readers_and_export_fall_back_but_an_explicit_step_does_not(finished_run,
                                                                    tmp_path, caplog):
  _, finished = finished_run
  workdir = tmp_path / "run"
  shutil.copytree(finished, workdir)
  damage(workdir / "checkpoints" / str(NUM_STEPS), "garbage_metadata")
  expected = saved_state(finished, 4)["state"]["variables"]

  with caplog.at_level(logging.WARNING):
    _, variables, step = checkpointing.read_model(workdir)
    assert_bit_identical(variables, expected)
    assert step == 4
    model_export.export_run(workdir, tmp_path / "export")
  assert f"Checkpoint {workdir / 'checkpoints' / str(NUM_STEPS)} is unreadable (" in (
      caplog.text)
  assert (f"Using the checkpoint of step 4 in {workdir / 'checkpoints'}, the newest that "
          f"restores (skipped: {NUM_STEPS}).") in caplog.text
  assert (workdir / "checkpoints" / str(NUM_STEPS)).is_dir()   # readers move nothing
  assert_bit_identical(checkpointing.read_model(workdir, step=4)[1], expected)

  with pytest.raises(CheckpointError, match=rf"Checkpoint .*/checkpoints/{NUM_STEPS} is "
                     r"unreadable \(UnicodeDecodeError: .*\)\. Leave out the step"):
    checkpointing.read_model(workdir, step=NUM_STEPS)
  with pytest.raises(CheckpointError, match=r"No checkpoint of step 5 in .*; it holds "
                     r"steps \[2, 4, 6\]"):
    checkpointing.read_model(workdir, step=5)
  with pytest.raises(CheckpointError, match="is an exported model: it has one set of "
                     "parameters, no steps"):
    checkpointing.read_model(tmp_path / "export", step=4)
  assert checkpointing.read_model(tmp_path / "export")[2] is None


def test_no_restorable_checkpoint_lists_each_failure(finished_run, tmp_path):
  config, finished = finished_run
  workdir = tmp_path / "run"
  shutil.copytree(finished, workdir)
  damage(workdir / "checkpoints" / "6", "garbage_metadata")
  damage(workdir / "checkpoints" / "4", "truncated_array_file")
  damage(workdir / "checkpoints" / "2", "truncated_array_file")
  (workdir / loop.PHASES_FILE).unlink()
  pattern = (r"No checkpoint in .*/checkpoints restores \(step 6: UnicodeDecodeError: "
             r".*; step 4: .*; step 2: .*"
             r".*\)\. Restore those folders from a copy, or move checkpoints/ aside")
  with pytest.raises(CheckpointError, match=pattern):
    model_export.export_run(workdir)
  with pytest.raises(CheckpointError, match=pattern):
    train_run(config, workdir)
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4", "6"]


def test_a_command_that_falls_back_prints_its_warnings_not_orbaxs_leftovers(finished_run,
                                                                            tmp_path):
  """orbax's other reads of a damaged checkpoint fail after its restore has, on an event
  loop it has closed, each through sys.unraisablehook: thousands of lines of
  tracebacks around the command's own output, unless they are dropped."""
  workdir = shutil.copytree(finished_run[1], tmp_path / "run")
  damage(workdir / "checkpoints" / str(NUM_STEPS), "truncated_array_file")
  result = subprocess.run(
      [sys.executable, "-m", "allatt_jax.evaluate", f"--checkpoint={workdir}",
       "--split=valid"], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[:3000]
  assert f"the newest that restores (skipped: {NUM_STEPS})" in result.stderr


def test_a_damaged_export_is_refused_with_its_reason_and_the_command_to_redo_it(
    finished_run, tmp_path):
  export = shutil.copytree(finished_run[1] / model_export.EXPORT_DIR, tmp_path / "export")
  for chunk in (export / "params").rglob("d/*"):
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
  pattern = (rf"The exported model in {export} is unreadable \(.+\)\. Export it again "
             rf"from its run: python -m allatt_jax.export --workdir=RUN --out={export} "
             r"--overwrite\.$")
  with pytest.raises(CheckpointError, match=pattern):
    checkpointing.read_variables(export)
  result = subprocess.run(
      [sys.executable, "-m", "allatt_jax.evaluate", f"--checkpoint={export}",
       "--split=valid"], capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[:3000]
  assert re.search("^error: " + pattern, result.stderr, re.M), result.stderr


def test_after_a_failed_read_other_unraisable_errors_still_reach_the_hook(
    finished_run, tmp_path, monkeypatch):
  workdir = shutil.copytree(finished_run[1], tmp_path / "run")
  damage(workdir / "checkpoints" / str(NUM_STEPS), "truncated_array_file")
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  assert checkpointing.read_variables(workdir)[1] == NUM_STEPS - EVERY
  seen.clear()
  sys.unraisablehook(helpers.unraisable(RuntimeError("Event loop is closed")))
  assert not seen
  other = helpers.unraisable(ValueError("a bug elsewhere"))
  sys.unraisablehook(other)
  assert seen == [other]


def test_after_a_failed_read_other_unretrieved_task_errors_are_still_logged(
    finished_run, tmp_path, caplog):
  """The third kind of leftover: asyncio logs the TensorStore error of a read task
  nobody awaited when the task is collected."""
  workdir = shutil.copytree(finished_run[1], tmp_path / "run")
  damage(workdir / "checkpoints" / str(NUM_STEPS), "truncated_array_file")
  assert checkpointing.read_variables(workdir)[1] == NUM_STEPS - EVERY
  caplog.clear()
  unretrieved = lambda error: asyncio.log.logger.error(
      "Task exception was never retrieved\nfuture: <Task finished>",
      exc_info=(type(error), error, None))
  unretrieved(ValueError("OUT_OF_RANGE: Error opening \"zarr\" driver "
                         "[tensorstore_spec='{\"driver\":\"zarr\"}']"))
  assert not caplog.records
  unretrieved(ValueError("a bug elsewhere"))
  assert [r.exc_info[1].args for r in caplog.records] == [("a bug elsewhere",)]
