"""Bad configs, checkpoints and data fail early with one clear error each."""
import json
import lzma
import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import pytest

import data_fixtures
import helpers
from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax import data as data_lib
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import pipeline
from allatt_jax.training import assembly
from allatt_jax.training import loop
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.runs import workdir_checks
from allatt_jax.data import tokenization
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import ConfigError
from allatt_jax.config.errors import DataError
from allatt_jax.config.errors import Preempted
from helpers import start_run
from helpers import train_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT8_VOCABULARY = run_files.vocabulary_fingerprint("text8", tokenization.TEXT8_ALPHABET)


def tiny_config(**sections):
  """configs/demo.py:tiny as a single run; `sections` update config sections."""
  config = helpers.tiny_run()
  config.data.name = "text8"
  config.model.vocab_size = 27   # what a run takes from its dataset (assembly.prepared_run)
  for name, values in sections.items():
    if isinstance(values, dict):
      config[name].update(values)
    else:
      config[name] = values
  return config


def check_run(config, workdir):
  """What a run checks before it compiles (`helpers.start_run`), on text8, whose
  vocabulary is TEXT8_VOCABULARY."""
  _, checkpoints = start_run(config, workdir, TEXT8_VOCABULARY)
  checkpoints.close()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """A baseline workdir with a step-1 checkpoint (made without training)."""
  workdir = tmp_path_factory.mktemp("baseline")
  config = tiny_config()
  state = assembly.run_setup(config).new_state()
  checkpoints = checkpointing.RunCheckpoints(workdir, async_save=False)
  checkpoints.save(1, state, {"position": 0, "epoch": 0, "row_length": 4499}, force=True)
  checkpoints.close()
  run_files.save_config(workdir, config)
  run_files.save_vocabulary(workdir, TEXT8_VOCABULARY)
  return workdir


@pytest.fixture(scope="module")
def text8_dirs(tmp_path_factory):
  """(manual_dir, data_dir) of a small text8 file, encoded once."""
  return data_fixtures.prepared_text8(tmp_path_factory.mktemp("text8"))


def _fewer_devices(monkeypatch, count):
  """Pretends to run on `count` devices: the mesh checks only need the number."""
  monkeypatch.setattr(jax, "device_count", lambda: count)


# The config checks, each with the key it names and the fix it proposes.

@pytest.mark.parametrize("sections,devices,match", [
    (dict(model=dict(d_model=30)), 1,
     r"model.d_model=30 is not divisible by config.model.num_heads=4.*multiple of 4"),
    (dict(train=dict(batch_size=6), mesh=dict(data=4, model=1)), 4,
     r"train.batch_size=6 is not divisible by the data-parallel size \(4.*multiple of 4"),
    (dict(eval=dict(batch_size=2), mesh=dict(data=4, model=1)), 4,
     r"eval.batch_size=2 is not divisible by the data-parallel size"),
    (dict(model=dict(num_heads=2, d_model=32), mesh=dict(data=1, model=4)), 4,
     r"num_heads / heads_per_layer: 2 is not divisible by the model-parallel size "
     r"\(config.mesh.model=4\)"),
    (dict(model=dict(heads_per_layer=(4, 3)), mesh=dict(data=2, model=2)), 4,
     r"heads_per_layer: 3 is not divisible by the model-parallel size"),
    (dict(model=dict(kind="txl", d_ff=30), mesh=dict(data=1, model=4)), 4,
     r"config.model.d_ff: 30 is not divisible by the model-parallel size"),
    (dict(data=dict(name="wikitext5")), 1, r"data.name='wikitext5' is unknown.*'text8'"),
    (dict(model=dict(kind="lstm")), 1, r"model.kind='lstm' is unknown.*'allatt', 'txl'"),
    (dict(gates=dict(enabled=True, freeze_step=50)), 1,
     r"gates.freeze_step=50 is beyond config.train.num_steps=30.*Set "
     r"--config.gates.freeze_step to at most 30"),
    (dict(gates=dict(lam=-0.01)), 1, r"gates.lam=-0.01 is out of range: a negative λ"),
    (dict(train=dict(learning_rate=-1e-3)), 1,
     r"train.learning_rate=-0.001 is out of range: a negative learning rate"),
    (dict(model=dict(max_relative_len=20)), 1,
     r"max_relative_len=20 is shorter than config.train.seq_len \+ config.train.mem_len = 32"),
    (dict(model=dict(max_relative_len=32), eval=dict(seq_len=32)), 1,
     r"max_relative_len=32 is shorter than config.eval.seq_len \+ config.eval.mem_len = 48"
     r".*max_relative_len >= 48"),
    (dict(checkpoint=dict(every_steps=0)), 1, r"checkpoint.every_steps=0 is out of range"),
])
def test_bad_config_is_named(tmp_path, monkeypatch, sections, devices, match):
  config = tiny_config(**sections)
  _fewer_devices(monkeypatch, devices)
  with pytest.raises(ConfigError, match=match):
    check_run(config, tmp_path)


def test_valid_config_passes(tmp_path):
  setup, checkpoints = start_run(tiny_config(), tmp_path / "new" / "run", TEXT8_VOCABULARY)
  checkpoints.close()
  # The workdir is made (its parents too) and holds nothing to resume.
  assert (tmp_path / "new" / "run").is_dir() and not checkpoints.steps()
  assert setup.run.model.vocab_size == 27 and setup.lm.cfg.layer_heads == (4, 4)


def test_the_relative_table_may_be_exactly_as_long_as_the_longest_context(tmp_path):
  # train and eval: T + S = 16 + 16.
  check_run(tiny_config(model=dict(max_relative_len=32)), tmp_path / "run")
  with pytest.raises(ConfigError, match=r"max_relative_len=31 is shorter .* = 32"):
    check_run(tiny_config(model=dict(max_relative_len=31)), tmp_path / "run")


def test_checks_run_before_data_or_compilation(tmp_path, monkeypatch):
  """Without the check, the model's own trace-time ValueError would come after loading
  the dataset and building the state."""
  def no_data(*args):
    raise AssertionError("the dataset was loaded before the config was checked")
  monkeypatch.setattr(data_lib, "load_run_corpus", no_data)
  config = tiny_config(model=dict(max_relative_len=20))
  with pytest.raises(ConfigError, match="max_relative_len=20"):
    train_run(config, tmp_path)


def test_unwritable_workdir(tmp_path):
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ConfigError, match=r"--workdir .*a_file/run is not writable"):
    check_run(tiny_config(), tmp_path / "a_file" / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_workdir(tmp_path):
  tmp_path.chmod(0o500)
  try:
    with pytest.raises(ConfigError, match="is not writable"):
      check_run(tiny_config(), tmp_path)
  finally:
    tmp_path.chmod(0o700)


# init_from: the baseline a pruning run starts from.

def test_init_from_baseline_passes(baseline, tmp_path):
  config = tiny_config(gates=dict(enabled=True, freeze_step=15), init_from=str(baseline))
  setup, checkpoints = start_run(config, tmp_path, TEXT8_VOCABULARY)
  checkpoints.close()
  # The baseline's parameters are those of the pruning run's model, gates aside.
  prefix = "variables/params/"
  assert checkpointing.model_param_shapes(run_files.run_path(baseline), prefix) == (1, {
      prefix + key: shape for key, shape in checkpointing.tree_shapes(
          setup.abstract_state.variables["params"]).items()})
  assert setup.run.init_source == str(baseline)


WRONG_INIT_FROM = [
    (lambda tmp, base: tmp / "missing", r"init_from=.*missing does not exist"),
    (lambda tmp, base: _with_file(tmp, "notes.txt", "") / "notes.txt",
     r"init_from=.*notes.txt does not exist or is not a folder"),
    (lambda tmp, base: _with_file(tmp, "notes.txt", ""), r"has no config.json"),
    (lambda tmp, base: _with_file(tmp, "config.json", "{not json"),
     r"config.json is unreadable"),
    (lambda tmp, base: _copy_without(base, tmp, "checkpoints"), r"No checkpoint in"),
]


@pytest.mark.parametrize("make,match", WRONG_INIT_FROM)
def test_missing_or_unreadable_init_from(baseline, tmp_path, make, match):
  config = tiny_config(gates=dict(enabled=True, freeze_step=15),
                       init_from=str(make(tmp_path / "src", baseline)))
  with pytest.raises(CheckpointError, match=match):
    check_run(config, tmp_path / "run")


@pytest.mark.parametrize("make,match", [
    *WRONG_INIT_FROM,
    (lambda tmp, base: base, r"vocabulary of 27 tokens \(dataset 'text8'\), this run has "
                             r"256 \(dataset 'enwik8'\)")])
def test_a_wrong_init_from_is_refused_before_the_dataset_is_read(baseline, tmp_path, make,
                                                                  match):
  """A dataset's first preparation can take minutes (WikiText-103's), and the run
  would then stop at its first check of `init_from`."""
  config = tiny_config(gates=dict(enabled=True, freeze_step=15),
                       init_from=str(make(tmp_path / "src", baseline)),
                       data=dict(name="enwik8", data_dir=str(tmp_path / "tfds")),
                       model=dict(vocab_size=256))
  with pytest.raises(CheckpointError, match=match):
    assembly.prepared_run(assembly.checked_config(config))
  assert not (tmp_path / "tfds").exists()


def test_a_run_that_stopped_short_is_named_as_init_from_with_its_step(baseline, tmp_path,
                                                                      text8_dirs, capsys):
  """A preempted baseline looks finished from the outside: the run says first which
  step it starts from. A finished run, or an export, gets no note."""
  manual_dir, data_dir = text8_dirs
  pruning = lambda init_from: assembly.checked_config(tiny_config(
      gates=dict(enabled=True, freeze_step=15), init_from=str(init_from),
      data=dict(manual_dir=manual_dir, data_dir=data_dir)))
  prepared = assembly.prepared_run(pruning(baseline))
  assert prepared.note.startswith(
      f"warning: config.init_from={baseline} is a run that stopped at step 1 of its 30: "
      "this run starts from that checkpoint."), prepared.note
  capsys.readouterr()
  with pytest.raises(Preempted):
    loop.train_and_evaluate(prepared, tmp_path / "pruned", deadline=time.monotonic())
  assert capsys.readouterr().out.startswith(prepared.note + "\n")
  finished = shutil.copytree(baseline, tmp_path / "finished")
  run_files.save_config(finished, run_config.derived_run(run_files.load_config(baseline),
                                                         train=dict(num_steps=1)))
  export = tmp_path / "export"
  model = checkpointing.read_model(baseline)
  checkpointing.save_params(run_files.run_path(export), model[1]["params"])
  run_files.save_config(export, model[0])
  assert workdir_checks.init_from_note(pruning(finished)) == ""
  assert workdir_checks.init_from_note(pruning(export)) == ""
  # One step short is short.
  run_files.save_config(finished, run_config.derived_run(run_files.load_config(baseline),
                                                         train=dict(num_steps=2)))
  assert workdir_checks.init_from_note(pruning(finished)).startswith(
      f"warning: config.init_from={finished} is a run that stopped at step 1 of its 2:")


def _with_file(directory, name, text):
  directory.mkdir(parents=True, exist_ok=True)
  (directory / name).write_text(text)
  return directory


def _copy_without(source, target, name):
  shutil.copytree(source, target, ignore=shutil.ignore_patterns(name))
  return target


def test_init_from_of_other_shapes(baseline, tmp_path):
  config = tiny_config(model=dict(num_persistent=8), gates=dict(enabled=True, freeze_step=15),
                       init_from=str(baseline))
  with pytest.raises(CheckpointError, match=(
      r"other shapes than config.model gives \(.*persistent_key: saved \(4, 16, 8\), "
      r"now \(4, 8, 8\).*model.num_persistent: 16 -> 8")):
    check_run(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()       # checked before the workdir is made


def test_init_from_with_another_vocabulary_size(baseline, tmp_path):
  config = tiny_config(model=dict(vocab_size=256), data=dict(name="enwik8"),
                       gates=dict(enabled=True, freeze_step=15), init_from=str(baseline))
  with pytest.raises(CheckpointError, match=(
      r"vocabulary of 27 tokens \(dataset 'text8'\), this run has 256 \(dataset 'enwik8'\)")):
    check_run(config, tmp_path)


# Resuming a workdir with a config that changes the state's shapes.

def test_resume_with_shape_changing_config(baseline, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(baseline, workdir)
  config = tiny_config(model=dict(num_heads=2), train=dict(num_steps=60))
  with pytest.raises(CheckpointError) as error:
    check_run(config, workdir)
  message = str(error.value)
  # The key that changed leads; a longer run is no reason, and the shapes come last.
  assert message.startswith(
      f"--workdir {workdir} holds a checkpoint (step 1) of a run with other settings. "
      "Config keys changed since that run: model.num_heads: 4 -> 2. "), message
  assert message.index("use a new --workdir") < message.index(
      "layer_0/attention/key/kernel: saved (32, 4, 8), now (32, 2, 16)"), message
  assert "train.num_steps" not in message
  # A change that keeps the shapes (a longer run) resumes.
  check_run(tiny_config(train=dict(num_steps=60)), workdir)
  # Parameters the config no longer has are named, parameters before optimizer state.
  with pytest.raises(CheckpointError) as error:
    check_run(tiny_config(model=dict(num_layers=1)), workdir)
  shapes = str(error.value).split("Shapes that differ: ")[1].split("; ")
  only_saved = [line for line in shapes if line.endswith(": only saved")]
  assert only_saved and all(line.startswith("variables/params/layer_1/")
                            for line in only_saved), shapes


def test_a_refused_resume_leaves_the_runs_config_json_as_it_was(baseline, tmp_path,
                                                                text8_dirs):
  workdir = tmp_path / "run"
  shutil.copytree(baseline, workdir)
  saved = (workdir / run_files.CONFIG_FILE).read_bytes()
  manual_dir, data_dir = text8_dirs
  changed = tiny_config(train=dict(learning_rate=0.01),
                        data=dict(manual_dir=manual_dir, data_dir=data_dir))
  with pytest.raises(ConfigError, match=r"train.learning_rate: 0.003 -> 0.01"):
    train_run(changed, workdir)
  assert (workdir / run_files.CONFIG_FILE).read_bytes() == saved


def test_a_pruning_stage_with_other_settings_goes_to_a_new_folder(tmp_path):
  stage = run_config.RunConfig.of(tiny_config(
      gates=dict(enabled=True, lam=0.1, freeze_step=15), init_from=str(tmp_path / "b")))
  assert pipeline.pruning_stage_dir(tmp_path, stage) == (tmp_path / "pruned", "")  # none yet
  (tmp_path / "pruned").mkdir()
  run_files.save_config(tmp_path / "pruned", stage)
  assert pipeline.pruning_stage_dir(tmp_path, stage) == (tmp_path / "pruned", "")
  # More steps alone resume the stage; with other settings, every key that differs
  # is named, the number of steps too.
  longer = run_config.derived_run(stage, train=dict(num_steps=90))
  assert pipeline.pruning_stage_dir(tmp_path, longer) == (tmp_path / "pruned", "")
  folder, why = pipeline.pruning_stage_dir(
      tmp_path, run_config.derived_run(longer, gates=dict(lam=0.2)))
  assert folder == tmp_path / "pruned-2"
  assert why == (f"{tmp_path / 'pruned'} holds a pruning stage with other settings "
                 "(gates.lam: 0.1 -> 0.2; train.num_steps: 30 -> 90), kept as it is")
  # Its report goes beside the first one's, numbered as its folder.
  assert pipeline.report_files(tmp_path, tmp_path / "pruned") == (
      tmp_path / "report.json", tmp_path / "gates.png")
  assert pipeline.report_files(tmp_path, folder) == (
      tmp_path / "report-2.json", tmp_path / "gates-2.png")


def test_a_budget_asked_as_a_fraction_is_named_as_asked_beside_its_figure(tmp_path):
  """A rerun at another fraction says what was typed, each with the figure it stands
  for in thousands; a stage saved before the fraction was recorded resumes."""
  def stage(target_macs):
    config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
    config.pipeline.prune_gates.target_macs = target_macs
    return assembly.checked_pipeline(config).pruning

  half = stage(0.5)
  run_files.save_config(tmp_path / "pruned", half)
  folder, why = pipeline.pruning_stage_dir(tmp_path, stage(0.4))
  assert folder == tmp_path / "pruned-2"
  assert why == (f"{tmp_path / 'pruned'} holds a pruning stage with other settings "
                 "(gates.target_macs: 0.5 (10,272) -> 0.4 (8,218)), kept as it is")
  before = run_config.derived_run(half, gates=dict(budget_fraction=None))
  run_files.save_config(tmp_path / "pruned", before)
  assert pipeline.pruning_stage_dir(tmp_path, half) == (tmp_path / "pruned", "")


def test_a_single_runs_workdir_is_refused_as_a_pipelines_before_any_data_is_read(tmp_path):
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.data.data_dir = str(tmp_path / "tfds")     # where a read would prepare it
  run_files.save_config(tmp_path, run_config.RunConfig.of(tiny_config()))
  saved = (tmp_path / run_files.CONFIG_FILE).read_bytes()
  with pytest.raises(ConfigError, match=r"^--workdir .* holds a single run or export \(its "
                     r"config.json\), but this config is a pipeline, whose runs go in "
                     r"WORKDIR/baseline and WORKDIR/pruned"):
    pipeline.prepare(assembly.checked_pipeline(config), tmp_path)
  assert (tmp_path / run_files.CONFIG_FILE).read_bytes() == saved
  assert sorted(p.name for p in tmp_path.iterdir()) == [run_files.CONFIG_FILE]


def test_a_pipelines_workdir_is_refused_naming_its_runs_in_the_order_made(tmp_path):
  config = run_config.RunConfig.of(tiny_config())
  for name in ("baseline", "pruned", "pruned-10", "pruned-2"):
    run_files.save_config(tmp_path / name, config)
  (tmp_path / "pruned-3").mkdir()       # a stage that saved nothing yet
  assert [p.name for p in run_files.pruning_stages(tmp_path)] == [
      "pruned", "pruned-2", "pruned-10"]
  with pytest.raises(CheckpointError) as raised:
    run_files.load_config(tmp_path)
  assert str(raised.value).endswith(
      "It is a pipeline's workdir: its runs are baseline/, pruned/, pruned-2/ and "
      "pruned-10/ in it.")


def test_a_resumed_run_may_change_how_it_runs_but_not_what_it_trains():
  """Settings of how a run is computed, evaluated, saved and placed (RESUMABLE, its
  wildcards included) may change on a resume; what it trains may not."""
  def gated(**sections):
    config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
    config.gates.update(dict(enabled=True, freeze_step=20))
    for name, keys in sections.items():
      config[name].update(keys)
    return run_config.RunConfig.of(config)
  saved = gated()
  assert workdir_checks.setting_differences(saved, gated(
      train=dict(num_steps=90), eval=dict(batch_size=3, mem_len=4),
      checkpoint=dict(every_steps=7), mesh=dict(data=2),
      model=dict(tail_capacity=3.0, attention_impl="xla", remat=True),
      gates=dict(allow_empty=True))) == []
  assert workdir_checks.setting_differences(
      saved, gated(model=dict(d_model=48), gates=dict(lam=0.2))) == [
          f"gates.lam: {saved.gates.lam!r} -> 0.2",
          f"model.d_model: {saved.model.d_model} -> 48"]
  assert workdir_checks.setting_differences(saved, gated(model=dict(dropout=0.3))) == [
      f"model.dropout: {saved.model.dropout!r} -> 0.3"]


def test_turning_the_gates_or_a_budget_on_or_off_is_a_change_of_what_a_run_trains():
  """Gate settings count once either run has gates, and the controller's once either
  has a budget."""
  def run(**gates):
    config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
    config.gates.update(gates)
    return run_config.RunConfig.of(config)
  baseline, gated = run(), run(enabled=True)
  assert workdir_checks.setting_differences(baseline, run(lam=0.5)) == []
  assert workdir_checks.setting_differences(baseline, gated) == [
      "gates.enabled: False -> True"]
  assert workdir_checks.setting_differences(gated, baseline) == [
      "gates.enabled: True -> False"]
  budgeted = run(enabled=True, target_sparsity=0.5, budget_sharpness=5.0)
  assert workdir_checks.setting_differences(budgeted, run(enabled=True)) == [
      "gates.budget_sharpness: 5.0 -> 10.0", "gates.target_sparsity: 0.5 -> None"]
  assert workdir_checks.setting_differences(gated, run(enabled=True, budget_sharpness=5.0)) == []


def test_a_pruning_run_from_scratch_has_no_init_from_to_check(tmp_path):
  check_run(tiny_config(gates=dict(enabled=True, freeze_step=15), init_from="none"),
            tmp_path / "run")


def test_a_resume_on_another_vocabulary_names_the_data(baseline, tmp_path):
  """Every embedding's shape differs then: the message names the cause, not the list."""
  workdir = tmp_path / "run"
  shutil.copytree(baseline, workdir)
  with pytest.raises(CheckpointError, match=(
      r"holds a checkpoint \(step 1\) of a run on another vocabulary \(27 tokens, dataset "
      r"'text8'; this config: 28, dataset 'text8'\)\. To resume it, rerun with its data")):
    check_run(tiny_config(model=dict(vocab_size=28)), workdir)


def test_a_run_saved_before_the_new_keys_resumes(baseline, tmp_path):
  """A config.json without `gates.allow_empty` or `model.auto_cutoffs` (which only
  choose: consent to an empty budget, the cutoffs saved beside it) loads and resumes
  with today's config."""
  workdir = tmp_path / "run"
  shutil.copytree(baseline, workdir)
  saved = json.loads((workdir / run_files.CONFIG_FILE).read_text())
  del saved["gates"]["allow_empty"], saved["model"]["auto_cutoffs"]
  (workdir / run_files.CONFIG_FILE).write_text(json.dumps(saved))
  loaded = run_files.load_config(workdir)
  assert not loaded.gates.allow_empty and not loaded.model.auto_cutoffs
  workdir_checks.check_same_settings(run_config.RunConfig.of(tiny_config()), workdir)
  check_run(tiny_config(), workdir)


def test_an_older_word_level_run_is_told_how_to_keep_its_plain_softmax(baseline, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(baseline, workdir)
  own_words = dict(name="text_files", level="word", manual_dir=str(tmp_path))
  saved = json.loads((workdir / run_files.CONFIG_FILE).read_text())
  saved["data"].update(own_words)          # saved before model.auto_cutoffs
  del saved["model"]["auto_cutoffs"]
  (workdir / run_files.CONFIG_FILE).write_text(json.dumps(saved))
  with pytest.raises(CheckpointError) as error:   # what a run completes own words with
    check_run(tiny_config(model=dict(cutoffs=(10, 15, 20), div_val=2), data=own_words),
              workdir)
  message = str(error.value)
  assert message.startswith(
      f"--workdir {workdir} holds a checkpoint (step 1) of a run with other settings. "
      "Config keys changed since that run: model.cutoffs: [] -> [10, 15, 20]; "
      "model.div_val: 1 -> 2. "), message
  assert "--config.model.auto_cutoffs=False keeps the plain softmax" in message


# Vocabulary of the data vs the checkpoint's.

def test_vocabulary_differs_from_the_resumed_run(baseline, tmp_path, text8_dirs):
  workdir = tmp_path / "run"
  shutil.copytree(baseline, workdir)
  other = run_files.vocabulary_fingerprint("text8", tokenization.TEXT8_ALPHABET[::-1])
  run_files.save_vocabulary(workdir, other)
  manual_dir, data_dir = text8_dirs
  config = tiny_config(data=dict(manual_dir=manual_dir, data_dir=data_dir))
  with pytest.raises(DataError, match=(
      r"vocabulary of dataset 'text8' \(27 tokens.*is not the one the run in --workdir .* "
      r"was trained with.*token ids would mean other tokens")):
    train_run(config, workdir)


def test_vocabulary_differs_from_init_from(baseline, tmp_path):
  other = run_files.vocabulary_fingerprint("wikitext103", ["<eos>", "the"] * 10)
  with pytest.raises(DataError, match=r"is not the one config.init_from=.* was trained with"):
    workdir_checks.check_vocabulary(other, tmp_path, str(baseline), resuming=False)
  workdir_checks.check_vocabulary(TEXT8_VOCABULARY, tmp_path, str(baseline), resuming=False)


def test_a_pruning_run_checks_its_init_froms_vocabulary_not_only_its_size(baseline, tmp_path):
  """Another alphabet of the same 27 letters gives the same shapes: only the saved
  fingerprint tells that the baseline's token ids mean other letters. A source saved
  before vocabularies were (no vocabulary.json) has nothing to compare."""
  source = shutil.copytree(baseline, tmp_path / "other_letters")
  run_files.save_vocabulary(source, run_files.vocabulary_fingerprint(
      "text8", tokenization.TEXT8_ALPHABET[::-1]))
  config = tiny_config(gates=dict(enabled=True, freeze_step=15), init_from=str(source))
  with pytest.raises(DataError, match=r"is not the one config.init_from=.*other_letters"):
    check_run(config, tmp_path / "run")
  older = _copy_without(baseline, tmp_path / "older", run_files.VOCABULARY_FILE)
  check_run(tiny_config(gates=dict(enabled=True, freeze_step=15), init_from=str(older)),
            tmp_path / "run")


def test_init_froms_vocabulary_size_is_checked_only_where_the_config_sets_one(baseline):
  """Before the dataset is read, a config may leave model.vocab_size to it (0)."""
  config = run_config.RunConfig.of(tiny_config(
      model=dict(vocab_size=0), gates=dict(enabled=True, freeze_step=15),
      init_from=str(baseline)))
  saved, step, _ = workdir_checks.check_init_from_files(config)
  assert (saved.model.vocab_size, step) == (27, 1)


def test_the_workdirs_write_check_leaves_nothing_behind(tmp_path):
  workdir_checks.check_workdir(tmp_path / "new" / "run")
  assert list((tmp_path / "new" / "run").iterdir()) == []


# Export.

def test_export_of_a_run_without_gates(baseline):
  with pytest.raises(CheckpointError, match="baseline run .* no head gates"):
    workdir_checks.check_export(baseline)


def test_export_of_a_pruning_run_without_a_checkpoint(tmp_path):
  run_files.save_config(tmp_path, tiny_config(gates=dict(enabled=True, freeze_step=15)))
  with pytest.raises(CheckpointError, match="No checkpoint in"):
    workdir_checks.check_export(tmp_path)


def test_a_workdir_without_config_json_has_no_settings_to_compare(tmp_path):
  """Its checkpoints are still checked against the state's shapes (`_check_resume`)."""
  workdir_checks.check_same_settings(run_config.RunConfig.of(tiny_config()), tmp_path)


def _cli(module, *flags):
  return subprocess.run(
      [sys.executable, "-m", module, *flags], capture_output=True, text=True, timeout=300,
      cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_export_cli_reports_a_run_without_gates(baseline):
  result = _cli("allatt_jax.export", f"--workdir={baseline}")
  assert result.returncode == 2, result.stderr
  assert "error: " in result.stderr and "no head gates" in result.stderr
  assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_train_cli_reports_a_bad_config(tmp_path):
  result = _cli("allatt_jax.main", "--config=configs/demo.py:tiny", f"--workdir={tmp_path}",
                "--config.model.d_model=30")
  assert result.returncode == 2, result.stderr
  assert "error: config.model.d_model=30 is not divisible" in result.stderr
  assert "Traceback" not in result.stderr


# Data files: the gaps tests/test_data.py leaves.

def test_empty_text8_file(tmp_path):
  data_fixtures.write_text8(tmp_path / "raw", "")
  with pytest.raises(DataError, match=r"'text8': .*text8 is empty"):
    data_lib.load_corpus("text8", str(tmp_path / "data"), str(tmp_path / "raw"))


def test_truncated_xz_corpus(tmp_path):
  (tmp_path / "raw").mkdir()
  (tmp_path / "raw" / "wikitext_chars.txt.xz").write_bytes(
      lzma.compress(b"some text " * 100)[:40])
  with pytest.raises(DataError, match="is not a valid .xz file"):
    data_lib.load_corpus("wikitext_chars", str(tmp_path / "data"), str(tmp_path / "raw"))


def test_an_xz_corpus_of_no_text(tmp_path):
  (tmp_path / "raw").mkdir()
  (tmp_path / "raw" / "wikitext_chars.txt.xz").write_bytes(lzma.compress(b""))
  with pytest.raises(DataError, match=r"wikitext_chars.txt.xz holds no text"):
    data_lib.load_corpus("wikitext_chars", str(tmp_path / "data"), str(tmp_path / "raw"))


def test_a_text8_file_too_short_to_split(tmp_path):
  data_fixtures.write_text8(tmp_path / "raw", "a" * 30)   # 27 / 1 / 2
  with pytest.raises(DataError, match=r"only 30 bytes, too few to split"):
    data_lib.load_corpus("text8", str(tmp_path / "data"), str(tmp_path / "raw"))


def test_a_bad_character_past_the_checked_head_of_text8(tmp_path):
  data_fixtures.write_text8(tmp_path / "raw", "a " * 40_000 + "X")
  with pytest.raises(DataError, match=r"text8 holds b'X'; text8-style text has only "):
    data_lib.load_corpus("text8", str(tmp_path / "data"), str(tmp_path / "raw"))


def test_a_short_text8_file_is_split_in_proportion_and_says_so(tmp_path, caplog):
  data_fixtures.write_text8(tmp_path / "raw", data_fixtures.sample_text8(20_000))
  corpus = data_lib.load_corpus("text8", str(tmp_path / "data"), str(tmp_path / "raw"))
  assert [len(corpus.splits[s]) for s in ("train", "valid", "test")] == [18_000, 1_000, 1_000]
  assert ("the file has 20,000 bytes, not the official 100,000,000, so it is split "
          "proportional 90/5/5 (18,000/1,000/1,000) instead of "
          "90,000,000/5,000,000/5,000,000") in caplog.text


def test_damaged_cache_is_rebuilt_not_used(text8_dirs, tmp_path):
  manual_dir, data_dir = text8_dirs
  data_dir = shutil.copytree(data_dir, tmp_path / "data")
  cache = data_dir / "allatt_text" / "text8" / "1.0.0"
  expected = json.loads((cache / "vocab.json").read_text())
  train_npy = (cache / "train.npy").read_bytes()
  (cache / "train.npy").write_bytes(train_npy[:len(train_npy) // 2])  # a cut-off write
  corpus = data_lib.load_corpus("text8", str(data_dir), manual_dir)
  assert list(corpus.vocab) == expected
  assert len(corpus.splits["train"]) == 18000
  assert (cache / "train.npy").read_bytes() == train_npy


def test_unreadable_dataset_metadata_is_rebuilt_not_trusted(text8_dirs, tmp_path):
  manual_dir, data_dir = text8_dirs
  data_dir = shutil.copytree(data_dir, tmp_path / "data")
  cache = data_dir / "allatt_text" / "text8" / "1.0.0"
  metadata = (cache / "metadata.json").read_text()
  (cache / "metadata.json").write_text(metadata[:len(metadata) // 2])   # a cut-off write
  corpus = data_lib.load_corpus("text8", str(data_dir), manual_dir)
  assert len(corpus.splits["train"]) == 18000
  assert json.loads((cache / "metadata.json").read_text()) == json.loads(metadata)


def test_config_saved_before_the_recipe_keys_keeps_its_old_meaning(tmp_path):
  """A run saved without the official-recipe keys describes the model it trained."""
  saved = json.loads(tiny_config().to_json_best_effort())
  saved["gates"]["l0_warmup_steps"] = 7
  for section, keys in (("model", ("same_length_keys", "out_bias", "layer_norm_eps",
                                   "final_norm", "persistent_content_bias",
                                   "auto_cutoffs")),
                        ("gates", ("open_at_zero", "lr_multiplier", "budget_sharpness",
                                   "budget_warmup_steps")),
                        ("train", ("optimizer", "lamb_eps", "lamb_max_weight_norm",
                                   "weight_decay_exclude"))):
    for key in keys:
      del saved[section][key]
  (tmp_path / run_files.CONFIG_FILE).write_text(json.dumps(saved))
  config = run_files.load_config(tmp_path)
  cfg = model_lib.ModelConfig.from_config(config)
  assert (cfg.out_bias, cfg.final_norm, cfg.persistent_content_bias, cfg.layer_norm_eps,
          cfg.same_length_keys, cfg.gate.open_at_zero, cfg.auto_cutoffs) == (
              False, True, True, 1e-6, "mem_len", False, False)
  train = config.train
  assert (train.optimizer, train.lamb_eps, train.lamb_max_weight_norm,
          train.weight_decay_exclude) == ("optax_lamb", 1e-6, None, ())
  # A budget's target warmed up with λ's schedule then.
  gates = config.gates
  assert (gates.lr_multiplier, gates.budget_sharpness, gates.budget_warmup_steps) == (
      1.0, 1.0, 7)
  # A config that has the keys keeps its own values.
  (tmp_path / run_files.CONFIG_FILE).write_text(tiny_config().to_json_best_effort())
  assert model_lib.ModelConfig.from_config(run_files.load_config(tmp_path)).out_bias


def test_every_batch_split_over_the_data_axis_is_checked(monkeypatch):
  """The micro-batch of gradient accumulation too, and on several processes."""
  _fewer_devices(monkeypatch, 8)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  config = tiny_config(train=dict(batch_size=8, grad_accum_steps=4),
                       eval=dict(batch_size=12), mesh=dict(data=-1, model=2))
  check = lambda: assembly.checked_config(config)
  with pytest.raises(ConfigError) as raised:
    check()
  assert str(raised.value) == (
      "the micro-batch config.train.batch_size / grad_accum_steps = 8 / 4 = 2 is not "
      "divisible by the data-parallel size (4: config.mesh.data=-1 on 8 devices, 2 "
      "processes each reading its share), which splits every batch into equal rows per "
      "data shard. Found: config.train.batch_size=8 (ok); the micro-batch "
      "config.train.batch_size / grad_accum_steps = 8 / 4 = 2 (not divisible); "
      "config.eval.batch_size=12 (ok). Fix: config.train.batch_size a multiple of 4 x "
      "grad_accum_steps = 16 (e.g. 16), config.eval.batch_size a multiple of 4 (e.g. "
      "12), or a config.mesh with a smaller data axis.")
  config.train.batch_size = 16
  check()


def test_a_run_whose_vocab_size_is_not_its_datasets_is_refused(tmp_path):
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.data.data_dir = str(tmp_path / "tfds")
  config.model.vocab_size = 5
  with pytest.raises(ConfigError, match=r"config.model.vocab_size is 5 but dataset "
                     r"'wikitext_chars' has 27 types; set --config.model.vocab_size=27"):
    assembly.completed_config(assembly.checked_config(config))
  # A trained model's dataset is read with the model's own checks (trained_model).
  assert data_lib.load_run_corpus(config).vocab_size == 27
