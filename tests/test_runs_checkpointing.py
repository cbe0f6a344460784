"""A run's checkpoints, on small states made without a model: which step restores, what
it restores, and what happens to a damaged one (test_runs_checkpoint_fallback.py does
the same on trained runs, in the slow tier); the model a workdir loads as, and the
dataset it is read with."""
import logging
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data_fixtures
import helpers
from helpers import assert_bit_identical
from allatt_jax.config import run_config
from allatt_jax.data import tokenization
from allatt_jax.runs import checkpointing
from allatt_jax.runs import run_files
from allatt_jax.runs import trained_model
from allatt_jax.training import train_step
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import DataError

STEPS = (2, 4, 6)


def state_of(step: int, teacher: bool = False) -> train_step.TrainState:
  """A train state whose every value says which step it belongs to."""
  value = lambda shape: jnp.full(shape, step, jnp.float32) + jnp.arange(
      np.prod(shape), dtype=jnp.float32).reshape(shape)
  return train_step.TrainState(
      step=jnp.asarray(step, jnp.int32),
      variables={"params": {"layer": {"kernel": value((3, 2))}},
                 "gates": {"logits": value((4,))}},
      opt_state={"mu": value((3, 2))}, memory={"hidden": value((1, 2, 2))},
      teacher={"params": {"layer": {"kernel": -value((3, 2))}}} if teacher else None)


def data_state_of(step: int) -> dict:
  return {"position": 10 * step, "epoch": step // 4, "row_length": 99}


def abstract(state):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def saved_run(workdir, teacher: bool = False):
  with checkpointing.RunCheckpoints(workdir, keep=10, async_save=False) as checkpoints:
    for step in STEPS:
      checkpoints.save(step, state_of(step, teacher), data_state_of(step), force=True)
  return workdir


def garble_metadata(workdir, step: int) -> None:
  (workdir / "checkpoints" / str(step) / "state" / "_METADATA").write_bytes(b"\xff not json")


def test_the_newest_checkpoint_restores_with_its_data_position(tmp_path):
  workdir = saved_run(tmp_path)
  with checkpointing.RunCheckpoints(workdir) as checkpoints:
    assert checkpoints.steps() == [6, 4, 2]
    step, state, data_state = checkpoints.restore_newest(abstract(state_of(0)))
  assert step == 6
  assert_bit_identical(state, state_of(6))
  assert data_state == data_state_of(6)
  assert checkpointing.latest_finished_step(workdir) == 6


def test_a_teacher_restores_with_the_state(tmp_path):
  workdir = saved_run(tmp_path, teacher=True)
  with checkpointing.RunCheckpoints(workdir) as checkpoints:
    _, state, _ = checkpoints.restore_newest(abstract(state_of(0, teacher=True)))
  assert_bit_identical(state.teacher, state_of(6, teacher=True).teacher)


def test_a_damaged_newest_checkpoint_is_set_aside_and_an_older_one_restores(tmp_path,
                                                                            caplog):
  workdir = saved_run(tmp_path)
  garble_metadata(workdir, 6)
  with caplog.at_level(logging.WARNING):
    assert checkpointing.read_variables(workdir)[1] == 4   # readers move nothing
    with checkpointing.RunCheckpoints(workdir, async_save=False) as checkpoints:
      assert checkpoints.newest_state_shapes()[0] == 4
      step, state, data_state = checkpoints.restore_newest(abstract(state_of(0)))
      assert (step, data_state) == (4, data_state_of(4))
      assert_bit_identical(state, state_of(4))
      # A resumed run saves step 6 again, and a second damage of it is kept too.
      checkpoints.save(6, state_of(6), data_state_of(6), force=True)
  aside = workdir / checkpointing.UNREADABLE_DIR
  assert [p.name for p in aside.iterdir()] == ["6"]
  assert f"moved the unreadable checkpoint of step 6 to {aside / '6'}" in caplog.text
  garble_metadata(workdir, 6)
  with checkpointing.RunCheckpoints(workdir, async_save=False) as checkpoints:
    assert checkpoints.restore_newest(abstract(state_of(0)))[0] == 4
  assert sorted(p.name for p in aside.iterdir()) == ["6", "6-1"]


def test_a_step_is_read_as_asked_or_refused(tmp_path):
  workdir = saved_run(tmp_path)
  variables, step = checkpointing.read_variables(workdir, 2)
  assert step == 2
  assert_bit_identical(variables, jax.device_get(state_of(2).variables))
  with pytest.raises(CheckpointError, match=r"No checkpoint of step 5 in .*; it holds "
                     r"steps \[2, 4, 6\]\. Choose one of those\."):
    checkpointing.read_variables(workdir, 5)
  garble_metadata(workdir, 6)
  with pytest.raises(CheckpointError, match=r"Checkpoint .*/checkpoints/6 is unreadable "
                     r"\(.*\)\. Leave out the step"):
    checkpointing.read_variables(workdir, 6)


def test_an_export_has_no_steps_and_its_shapes_are_its_params(tmp_path):
  params = jax.device_get(state_of(3).variables["params"])
  checkpointing.save_params(tmp_path, params)
  variables, step = checkpointing.read_variables(tmp_path)
  assert step is None
  assert_bit_identical(variables, {"params": params})
  with pytest.raises(CheckpointError, match="is an exported model: it has one set of "
                     "parameters, no steps"):
    checkpointing.read_variables(tmp_path, 2)
  assert checkpointing.model_param_shapes(tmp_path, "variables/params/") == (
      None, {"variables/params/layer/kernel": (3, 2)})


def test_a_runs_param_shapes_leave_out_the_rest_of_its_state(tmp_path):
  workdir = saved_run(tmp_path)
  assert checkpointing.model_param_shapes(workdir, "variables/params/") == (
      6, {"variables/params/layer/kernel": (3, 2)})


def test_a_run_without_checkpoints_says_so(tmp_path):
  with pytest.raises(CheckpointError, match=r"No checkpoint in .*/checkpoints\. Train the "
                     "run first"):
    checkpointing.latest_finished_step(tmp_path)
  with pytest.raises(CheckpointError, match=r"No checkpoint in .*/checkpoints\."):
    checkpointing.read_variables(tmp_path)
  assert not (tmp_path / "checkpoints").exists()    # a reader creates no folder


def test_a_run_keeps_its_newest_checkpoints(tmp_path):
  with checkpointing.RunCheckpoints(tmp_path, keep=2, async_save=False) as checkpoints:
    for step in STEPS:
      checkpoints.save(step, state_of(step), data_state_of(step), force=True)
    assert checkpoints.steps() == [6, 4]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "6"]


def test_a_reader_leaves_a_save_in_flight_alone_and_the_run_itself_drops_it(tmp_path):
  """orbax commits a save by renaming its temporary folder. Seen by a reader, that
  folder may be a save the run is still writing; seen by the run as it opens, it is
  what a stopped run left."""
  workdir = saved_run(tmp_path)
  in_flight = workdir / "checkpoints" / "8.orbax-checkpoint-tmp"
  (in_flight / "state").mkdir(parents=True)
  assert checkpointing.read_variables(workdir)[1] == 6
  assert checkpointing.model_param_shapes(workdir, "variables/params/")[0] == 6
  assert checkpointing.latest_finished_step(workdir) == 6
  assert in_flight.is_dir()
  with checkpointing.RunCheckpoints(workdir, async_save=False) as checkpoints:
    assert checkpoints.steps() == [6, 4, 2]
  assert not in_flight.exists()


def test_a_checkpoint_without_state_metadata_is_unreadable_and_skipped(tmp_path):
  """orbax writes the state's _METADATA after its arrays, so a copy without it holds
  a save that never finished."""
  workdir = saved_run(tmp_path)
  (workdir / "checkpoints" / "6" / "state" / "_METADATA").unlink()
  with checkpointing.RunCheckpoints(workdir, async_save=False, read_only=True) as run:
    with pytest.raises(CheckpointError, match=r"Checkpoint .*/checkpoints/6 is unreadable "
                       r"\(no state metadata\)\.$"):
      run.state_shapes(6)
    assert run.newest_state_shapes() == (4, run.state_shapes(4))
  assert checkpointing.model_param_shapes(workdir, "variables/params/")[0] == 4


def test_a_damaged_array_file_is_reported_by_what_went_wrong_without_its_store_spec(
    tmp_path):
  workdir = saved_run(tmp_path)
  for chunk in (workdir / "checkpoints" / "6" / "state").rglob("d/*"):
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
  with pytest.raises(CheckpointError) as refused:
    checkpointing.read_variables(workdir, 6)
  reason = str(refused.value)
  assert re.search(r"is unreadable \(ValueError: [^\n]* is not valid for value of size "
                   r"\d+\)\. Leave out the step", reason), reason
  assert "tensorstore_spec" not in reason and "TensorStore details" not in reason


def _coroutine_from(filename: str):
  """A coroutine whose code was read from `filename`, as orbax's are from its files."""
  namespace = {}
  exec(compile("async def read():\n  pass\n", filename, "exec"), namespace)
  coroutine = namespace["read"]()
  coroutine.close()
  return coroutine


def test_opening_checkpoints_drops_only_orbaxs_leftovers_and_hooks_in_once(tmp_path,
                                                                          monkeypatch):
  """test_runs_checkpoint_fallback.py has the leftovers of a real failed read; these
  are the ones the hook must let through."""
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  checkpointing.RunCheckpoints(tmp_path, read_only=True).close()
  hook = sys.unraisablehook
  checkpointing.RunCheckpoints(tmp_path, read_only=True).close()
  assert sys.unraisablehook is hook      # or every opening would wrap it once more
  error = ValueError("a read that failed")
  dropped = [helpers.unraisable(RuntimeError("Event loop is closed")),
             helpers.unraisable(error, _coroutine_from("/site-packages/orbax/checkpoint/io.py"))]
  passed = [helpers.unraisable(RuntimeError("another runtime error")),
            helpers.unraisable(error, _coroutine_from("/site-packages/elsewhere/io.py"))]
  for unraisable in dropped + passed:
    sys.unraisablehook(unraisable)
  assert seen == passed


def test_a_model_is_read_to_host_arrays(tmp_path):
  workdir = saved_run(tmp_path / "run")
  config = helpers.tiny_run()
  config.model.vocab_size = 27
  run_files.save_config(workdir, run_config.RunConfig.of(config))
  _, variables, step = checkpointing.read_model(workdir)
  export = tmp_path / "export"
  checkpointing.save_params(export, jax.device_get(state_of(3).variables["params"]))
  exported = checkpointing.read_variables(export)[0]
  assert step == 6
  for leaf in jax.tree.leaves((variables, exported)):
    assert type(leaf) is np.ndarray


def test_a_pipelines_workdir_is_read_with_load_configs_advice(tmp_path):
  """It holds runs, and no checkpoint of its own: its missing config.json is what to
  say, not a missing checkpoint."""
  config = helpers.tiny_run()
  config.model.vocab_size = 27
  run_files.save_config(tmp_path / "pipeline" / "baseline", run_config.RunConfig.of(config))
  with pytest.raises(CheckpointError, match=r"has no config\.json: .* It is a pipeline's "
                     r"workdir: its runs are baseline/ in it\."):
    checkpointing.read_model(tmp_path / "pipeline")


def test_a_workdir_loads_as_the_model_of_a_step_with_its_own_tokenizer(tmp_path):
  workdir = saved_run(tmp_path)
  config = helpers.tiny_run()
  config.data.name = "text8"      # never read: the model has its tokenizer
  config.model.vocab_size = 27
  run_files.save_config(workdir, run_config.RunConfig.of(config))
  alphabet = tuple(tokenization.TEXT8_ALPHABET)
  run_files.save_tokenizer(workdir, tokenization.Tokenizer("text8", "char", alphabet).to_dict())
  model = trained_model.load(workdir)
  assert (model.step, model.tokenizer.vocab, model.lm.cfg.vocab_size) == (6, alphabet, 27)
  assert_bit_identical(model.variables, state_of(6).variables)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(model.variables))
  assert trained_model.load(workdir, step=2).step == 2
  run_files.save_tokenizer(workdir, tokenization.Tokenizer("text8", "char",
                                                           alphabet[:-1]).to_dict())
  with pytest.raises(CheckpointError, match=r"has a vocabulary of 27 but its tokenizer "
                     r"\(dataset 'text8'\) has 26 types"):
    trained_model.load(workdir)


def text_folder(folder, train: str):
  return data_fixtures.write_text_files(folder, (train, "the cat sat\n", "a cat ran on\n"))


def test_a_models_dataset_must_have_the_vocabulary_it_was_trained_with(tmp_path):
  config = helpers.tiny_run()
  config.data.update(dict(name="text_files", level="word", data_dir=str(tmp_path / "data"),
                          manual_dir=str(text_folder(tmp_path / "raw", "the cat sat on\n"))))
  config.eval.seq_len = 2
  run_files.save_config(tmp_path / "run", run_config.RunConfig.of(config))
  corpus = trained_model.load_dataset(tmp_path / "run")
  run_files.save_tokenizer(tmp_path / "run", corpus.tokenizer.to_dict())
  assert trained_model.load_dataset(tmp_path / "run").vocab == corpus.vocab
  # The files moved, and their prepared copy goes where the model's user says.
  moved = text_folder(tmp_path / "moved", "the cat sat on\n")
  assert trained_model.load_dataset(tmp_path / "run", manual_dir=str(moved),
                                    data_dir=str(tmp_path / "data-2")).vocab == corpus.vocab
  assert (tmp_path / "data-2").is_dir()
  # The files moved, and were edited on the way: to more words, or to as many others.
  edited = text_folder(tmp_path / "edited", "the cat sat on a mat\n")
  with pytest.raises(DataError, match=rf"Dataset 'text_files' read from {edited} has another "
                     rf"vocabulary \({corpus.vocab_size + 2} types\) than the model in .*run "
                     rf"was trained with \({corpus.vocab_size}\): its scores would mean nothing"):
    trained_model.load_dataset(tmp_path / "run", manual_dir=str(edited))
  reworded = text_folder(tmp_path / "reworded", "the cat sat in\n")
  with pytest.raises(DataError, match=rf"read from {reworded} has another vocabulary "
                     rf"\({corpus.vocab_size} types\)"):
    trained_model.load_dataset(tmp_path / "run", manual_dir=str(reworded))
