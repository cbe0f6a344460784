"""The commands' shared command line: bad input is one `error:` line and exit status 2
before any work, for every command; shipped configs by name; the command list; a quiet
console.

Each command runs as a subprocess (every one imports JAX: a few seconds each), with
inputs that fail before anything is compiled.
"""
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

import data_fixtures
import helpers
from allatt_jax.runs import checkpointing
from allatt_jax.config import cli
from allatt_jax.config import config_base
from allatt_jax.config import console
from allatt_jax import data as data_lib
from allatt_jax import __main__ as commands
from allatt_jax.training import assembly
from allatt_jax.runs import run_files
from allatt_jax.reports import figures
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import ConfigError
from helpers import assert_one_error_line
from helpers import command
from helpers import start_run

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prune_config():
  config = helpers.tiny_run()
  config.gates.update(dict(enabled=True, freeze_step=15))
  config.model.vocab_size = 27   # what a run takes from its dataset (assembly.prepared_run)
  return config


# --- One bad input per command.

def test_main_unknown_override_key_names_the_closest_keys(tmp_path):
  result = command("allatt_jax.main", "--config=configs/demo.py:tiny",
                   f"--workdir={tmp_path}", "--config.train.no_such_key=1")
  assert_one_error_line(result, "--config.train.no_such_key", "config.train has no key",
                        "--config.train.num_steps")


@pytest.mark.slow
def test_main_missing_config_file_lists_the_shipped_configs(tmp_path):
  result = command("allatt_jax.main", "--config=configs/nope.py", f"--workdir={tmp_path}")
  assert_one_error_line(result, "--config=configs/nope.py", "demo.py", "wt103_prune.py")


@pytest.mark.slow
def test_main_config_failing_to_load_names_the_file_and_the_error(tmp_path):
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config(arg=None):\n  return undefined_name\n")
  result = command("allatt_jax.main", f"--config={broken}:x", f"--workdir={tmp_path}")
  assert_one_error_line(result, str(broken), "NameError: name 'undefined_name' is not "
                        "defined")


def test_main_workdir_that_is_a_file_is_refused_before_any_banner_or_data(tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("notes")
  for workdir, said in ((afile, "is a file"), (afile / "sub", f"lies under {afile}, a file")):
    result = command("allatt_jax.main", "--config=configs/demo.py:tiny",
                     f"--workdir={workdir}", tmp=tmp_path)
    assert_one_error_line(result, f"--workdir {workdir} {said}, not a folder")
    assert "==" not in result.stdout, result.stdout        # no stage's banner
  assert not (tmp_path / "tfds").exists()                  # nor the dataset prepared
  assert afile.read_text() == "notes"


def test_export_of_a_pruning_run_without_checkpoints(tmp_path, prune_config):
  run_files.save_config(tmp_path, prune_config)
  result = command("allatt_jax.export", f"--workdir={tmp_path}")
  assert_one_error_line(result, str(tmp_path))


def test_the_export_command_says_how_the_export_numbers_its_heads(tmp_path, prune_config):
  """As a pruning run's own export says it (model_export.renumbering_note)."""
  state = assembly.run_setup(prune_config).new_state()
  gates = state.variables["gates"]
  logits = gates["layer_0"]["attention"]["logits"].at[1].set(-5.0)   # head 1 closes
  gates = {**gates, "layer_0": {"attention": {"logits": logits}}}
  state = state.replace(variables={**state.variables, "gates": gates})
  with checkpointing.RunCheckpoints(tmp_path / "run", async_save=False) as checkpoints:
    checkpoints.save(1, state, {"position": 0, "epoch": 0, "row_length": 4499}, force=True)
  tokenizer = data_lib.load_corpus("wikitext_chars", str(tmp_path / "tfds")).tokenizer
  run_files.save_run(tmp_path / "run", prune_config, {}, tokenizer.to_dict())
  result = command("allatt_jax.export", f"--workdir={tmp_path / 'run'}",
                   f"--out={tmp_path / 'export'}")
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines() == [
      f"Exported the pruned model to {tmp_path / 'export'}",
      "The export numbers each layer's heads anew, 0 .. H-1: the heads kept, in the "
      "order they had. Model.prune_heads and prune_persistent_groups take those numbers, "
      "and Model.costs() lists each head's slots (persistent_per_head)."]


@pytest.mark.slow
def test_export_of_an_export_instead_of_its_run(tmp_path, prune_config):
  run_files.save_config(tmp_path / "export", prune_config)
  (tmp_path / "export" / "params").mkdir()
  result = command("allatt_jax.export", f"--workdir={tmp_path / 'export'}")
  assert_one_error_line(result, "is an exported model, not a run", "--workdir")


@pytest.mark.slow
def test_main_pipeline_into_a_single_runs_workdir(tmp_path, prune_config):
  # Its stages went into new runs nested in that run's folder, and it exited 0.
  run_files.save_config(tmp_path / "run", prune_config)
  result = command("allatt_jax.main", "--config=configs/demo.py:tiny",
                   f"--workdir={tmp_path / 'run'}", tmp=tmp_path)
  assert_one_error_line(result, "holds a single run", "WORKDIR/baseline")
  assert not (tmp_path / "run" / "baseline").exists()


@pytest.mark.slow
def test_score_of_a_pipelines_workdir_names_its_runs(tmp_path, prune_config):
  run_files.save_config(tmp_path / "baseline", prune_config)
  run_files.save_config(tmp_path / "pruned", prune_config)
  result = command("allatt_jax.score", f"--checkpoint={tmp_path}",
                   f"--text_file={tmp_path / 'missing.txt'}")
  assert_one_error_line(result, "no config.json", "pipeline's workdir",
                        "baseline/ and pruned/")


@pytest.mark.slow
def test_score_of_a_folder_without_a_model(tmp_path):
  result = command("allatt_jax.score", f"--checkpoint={tmp_path}",
                   f"--text_file={tmp_path / 'missing.txt'}")
  assert_one_error_line(result, str(tmp_path), "no config.json")


def test_a_missing_model_path_is_reported_as_missing(tmp_path):
  result = command("allatt_jax.score", f"--checkpoint={tmp_path / 'nowhere'}",
                   f"--text_file={tmp_path / 'missing.txt'}")
  assert_one_error_line(result, f"{tmp_path / 'nowhere'} does not exist")
  assert "config.json" not in result.stderr


def test_score_out_file_in_a_missing_folder(tmp_path):
  # Found out after scoring, this was a traceback.
  out = tmp_path / "nowhere" / "scores.jsonl"
  result = command("allatt_jax.score", f"--checkpoint={tmp_path}",
                   f"--text_file={tmp_path / 'missing.txt'}", f"--out={out}")
  assert_one_error_line(result, f"--out={out}", "does not exist")


def test_sample_negative_token_count(tmp_path):
  result = command("allatt_jax.sample", f"--checkpoint={tmp_path}", "--prompt=the",
                   "--num_tokens=-1")
  assert_one_error_line(result, "--num_tokens=-1")


def test_benchmark_unknown_flag():
  result = command("allatt_jax.benchmark", "--config=configs/bench_cpu.py", "--rounds=3")
  assert_one_error_line(result, "'rounds'")


@pytest.mark.parametrize("module", ["allatt_jax.benchmark", "allatt_jax.compile_check"])
def test_a_pipeline_config_is_checked_as_the_pipeline_checks_it(module):
  """Its pruning stage is timed or compiled too: a wrong pruning setting is refused
  with the pipeline's flag, before anything compiles."""
  result = command(module, "--config=configs/demo.py:tiny",
                   "--config.pipeline.prune_gates.persistent_group=5")
  assert_one_error_line(result, "config.pipeline.prune_gates.persistent_group=5",
                        "does not divide config.model.num_persistent=16")


def test_compile_check_bad_mesh():
  result = command("allatt_jax.compile_check", "--config=configs/wt103_base.py:tiny",
                   "--mesh=3")
  assert_one_error_line(result, "--mesh='3'", "DATA,MODEL")


def test_data_missing_folder(tmp_path):
  result = command("allatt_jax.data", "--dataset=text_files",
                   f"--manual_dir={tmp_path / 'nowhere'}", tmp=tmp_path)
  assert_one_error_line(result, str(tmp_path / "nowhere"))


def text_folder(folder, **texts):
  """A text_files folder; each split not in `texts` holds the same 20 lines."""
  return data_fixtures.write_text_files(
      folder, [texts.get(split, "the cat sat on the mat\n" * 20)
               for split in ("train", "valid", "test")])


def saved_run_config(workdir, manual_dir):
  """A run's config.json on dataset text_files in `manual_dir`, without checkpoints."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.data.update(dict(name="text_files", manual_dir=str(manual_dir)))
  run_files.save_config(workdir, config)


@pytest.mark.slow
def test_data_advice_names_the_data_commands_flags(tmp_path):
  result = command("allatt_jax.data", "--dataset=text_files",
                   f"--manual_dir={tmp_path / 'nowhere'}", tmp=tmp_path)
  assert_one_error_line(result, "--manual_dir=DIR", "--files=TRAIN,VALID,TEST")
  assert "--config" not in result.stderr
  two_files = command("allatt_jax.data", "--dataset=text_files", "--files=a.txt,b.txt",
                      f"--manual_dir={text_folder(tmp_path / 'text')}", tmp=tmp_path)
  assert_one_error_line(two_files, "--files='a.txt,b.txt' must name three")


def test_evaluate_reads_a_moved_corpus_from_manual_dir(tmp_path):
  saved_run_config(tmp_path / "run", tmp_path / "moved")
  moved = command("allatt_jax.evaluate", f"--checkpoint={tmp_path / 'run'}",
                  "--split=valid", tmp=tmp_path)
  # Only flags evaluate takes, and the dataset checked before any checkpoint is read.
  assert_one_error_line(moved, str(tmp_path / "moved"), "--manual_dir=DIR")
  assert "--config" not in moved.stderr
  found = command("allatt_jax.evaluate", f"--checkpoint={tmp_path / 'run'}",
                  "--split=valid", f"--manual_dir={text_folder(tmp_path / 'here')}",
                  tmp=tmp_path)
  assert_one_error_line(found, "No checkpoint in")


@pytest.mark.slow
def test_an_empty_file_gets_advice_that_applies(tmp_path):
  result = command("allatt_jax.main", "--config=configs/demo.py:tiny",
                   f"--workdir={tmp_path / 'run'}", "--config.data.name=text_files",
                   f"--config.data.manual_dir={text_folder(tmp_path / 'text', valid='')}",
                   tmp=tmp_path)
  assert_one_error_line(result, "valid.txt is empty. Put its text in it")
  assert "file names" not in result.stderr


def test_advice_is_spelled_in_the_commands_own_flags():
  message = ("Dataset 'x' not found. Pass it with --config.data.manual_dir=DIR. Other "
             "names go in --config.data.files=A,B,C.")
  assert cli.advice_for_command(message, {"data.manual_dir": "--manual_dir",
                                          "data.files": "--files"}) == (
      "Dataset 'x' not found. Pass it with --manual_dir=DIR. Other names go in "
      "--files=A,B,C.")
  # A dropped sentence is replaced by the command's own fix where no advice is left.
  assert cli.advice_for_command(message, {"data.manual_dir": "--manual_dir"},
                                "Or this.") == (
      "Dataset 'x' not found. Pass it with --manual_dir=DIR.")
  assert cli.advice_for_command(message, {}, "Or this.") == (
      "Dataset 'x' not found. Or this.")
  # A sentence naming a key the command can set beside one it cannot goes too.
  assert cli.advice_for_command(
      "Bad data. Set --config.data.manual_dir=DIR and --config.model.vocab_size=0.",
      {"data.manual_dir": "--manual_dir"}) == "Bad data."


def test_a_stray_argument_is_one_error_line():
  result = command("allatt_jax.sample", "--checkpoint=x", "--prompt=the", "stray")
  assert_one_error_line(result, "unexpected arguments ['stray']", "--name=value")


def test_help_is_a_success_that_prints_the_commands_docstring(capsys):
  command_module = types.ModuleType("allatt_jax.some_command", "Does something.")
  with pytest.raises(SystemExit) as raised:
    cli._parse_flags(command_module, ["some_command", "--helpshort"])
  assert raised.value.code == 0
  assert capsys.readouterr().out.startswith("Does something.\nflags:\n")


def test_experiments_missing_required_flag(tmp_path):
  result = command("allatt_jax.experiments", "--config=exp_chars.py:tiny",
                   f"--workdir={tmp_path}")
  assert_one_error_line(result, "--suite is required")


@pytest.mark.slow
def test_all_suites_check_their_plans_before_any_data_or_run(tmp_path):
  # The repro config's plan has the common keys only, and its dataset (WikiText-2, set
  # by --config.data.manual_dir) is not here: ablation's refusal must come first.
  result = command("allatt_jax.experiments", "--config=configs/repro_wt2.py",
                   "--suite=all", f"--workdir={tmp_path / 'exp'}", tmp=tmp_path)
  assert_one_error_line(result, "--suite=ablation needs experiment keys",
                        "ablation_lambda")
  assert not (tmp_path / "exp").exists()


@pytest.mark.slow
def test_main_wrong_data_folder_stops_before_anything_is_written(tmp_path):
  # The pipeline's baseline stage used to open its CheckpointManager first: the folder
  # stayed behind, and orbax's cleanup thread died with a traceback at exit.
  result = command("allatt_jax.main", "--config=configs/demo.py:tiny",
                   f"--workdir={tmp_path / 'run'}", "--config.data.name=text_files",
                   f"--config.data.manual_dir={tmp_path / 'nowhere'}", tmp=tmp_path)
  assert_one_error_line(result, str(tmp_path / "nowhere"), "--config.data.manual_dir")
  assert not (tmp_path / "run" / "baseline").exists()


def test_closing_a_run_waits_for_its_cleanup_thread(tmp_path):
  (tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp").mkdir(parents=True)
  checkpoints = checkpointing.RunCheckpoints(tmp_path)
  checkpoints.close()
  assert not (tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp").exists()


@pytest.mark.slow
def test_a_bug_prints_its_traceback_and_asks_for_a_report():
  result = subprocess.run(
      [sys.executable, "-c", "from allatt_jax.config import cli\n"
       "def main(argv):\n  return {}['missing']\ncli.run(main)"],
      capture_output=True, text=True, timeout=60)
  assert result.returncode == 1
  assert "Traceback" in result.stderr and "KeyError: 'missing'" in result.stderr
  assert result.stderr.strip().endswith(f"error: {cli.BUG_REPORT}")


# --- Pruning needs a baseline.

def test_pruning_without_init_from_is_refused_before_work(tmp_path, prune_config):
  with pytest.raises(ConfigError, match=r"config.init_from is not set.*"
                     r"--config.init_from=BASELINE_WORKDIR.*--config.init_from=none"):
    start_run(prune_config, tmp_path)
  assert not (tmp_path / "checkpoints").exists()


def test_pruning_from_scratch_is_an_explicit_choice(tmp_path, prune_config):
  config = prune_config.copy_and_resolve_references()
  config.init_from = "none"
  config.data.data_dir = str(tmp_path / "tfds")
  setup, checkpoints = start_run(config, tmp_path / "run")
  checkpoints.close()
  # A gated run from fresh parameters: nothing to read, a new workdir, no checkpoint.
  assert setup.run.init_from == "none" and setup.run.init_source == ""
  assert "gates" in setup.abstract_state.variables
  assert (tmp_path / "run").is_dir() and not checkpoints.steps()


@pytest.mark.slow
def test_resume_on_other_data_names_the_vocabulary_not_every_shape(tmp_path, caplog):
  config = helpers.tiny_run()
  config.data.data_dir = str(tmp_path / "tfds")
  config.model.vocab_size = 27   # what a run takes from its dataset (assembly.prepared_run)
  workdir = tmp_path / "run"
  setup, checkpoints = start_run(config, workdir)
  checkpoints.save(1, setup.new_state(), {"position": 0}, force=True)
  checkpoints.wait()
  checkpoints.close()
  run_files.save_config(workdir, config)

  other = config.copy_and_resolve_references()
  other.data.update(dict(name="text_files", manual_dir=str(text_folder(tmp_path / "text"))))
  other.model.vocab_size = 0      # the dataset's
  other.model.vocab_size = data_lib.load_run_corpus(other).vocab_size
  with caplog.at_level(logging.DEBUG, logger="absl"):
    with pytest.raises(CheckpointError) as error:
      start_run(other, workdir)
  message = str(error.value)
  assert (f"another vocabulary (27 tokens, dataset 'wikitext_chars'; this config: "
          f"{other.model.vocab_size}, dataset 'text_files')") in message, message
  assert "use a new --workdir" in message and "saved (" not in message, message
  assert "Shapes that differ" in caplog.text   # for --verbosity=1


# --- Configs by name, from any folder.

@pytest.mark.slow
def test_shipped_config_by_name_from_another_folder(tmp_path):
  result = command("allatt_jax.costs", "--config=wt103_prune.py:lam=0.015",
                   "--heads_kept=0.5", cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  assert '"relative_params"' in result.stdout


def test_find_config():
  assert cli.find_config("configs/demo.py") == pathlib.Path("configs/demo.py")
  for name in ("demo.py", "demo", "/elsewhere/demo.py"):
    assert cli.find_config(name) == cli.CONFIG_DIR / "demo.py"
  with pytest.raises(ConfigError, match=r"--config=demo2.py: .*one of: bench_cpu.py, "):
    cli.find_config("demo2.py")


def test_override_keys_are_checked_against_the_config():
  config = config_base.load(ROOT / "configs" / "demo.py")
  cli.check_override_keys("config", config, ["prog", "--config.gates.lam=0.1",
                                             "--noconfig.gates.enabled", "--other.x=1"])
  with pytest.raises(ConfigError, match=r"--config.lam: config has no key 'lam'; did "
                     r"you mean .*--config.gates.lam"):
    cli.check_override_keys("config", config, ["prog", "--config.lam=0.1"])
  with pytest.raises(ConfigError, match="config.train.seq_len is a value, not a section"):
    cli.check_override_keys("config", config, ["prog", "--config.train.seq_len.x=1"])


# --- The command list, and a quiet console.

def test_the_command_list_names_every_command():
  result = command("allatt_jax")
  assert result.returncode == 0, result.stderr
  listed = [line.split()[0] for line in result.stdout.splitlines()
            if line.startswith("  ")]
  assert listed == list(commands.COMMANDS)
  assert all(len(line.split()) > 2 for line in result.stdout.splitlines()
             if line.startswith("  "))
  assert all(line.endswith(".") for line in result.stdout.splitlines()
             if line.startswith("  ")), result.stdout


def test_a_command_runs_the_same_through_the_command_list():
  direct = command("allatt_jax.costs", "--config=configs/demo.py", "--heads_kept=1.5")
  listed = command("allatt_jax", "costs", "--config=configs/demo.py", "--heads_kept=1.5")
  assert_one_error_line(listed, "--heads_kept=1.5", "[0.0, 1.0]")
  assert (listed.returncode, listed.stderr) == (direct.returncode, direct.stderr)


def test_an_unknown_command_is_refused_with_the_command_list(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["allatt-jax", "trian"])
  with pytest.raises(SystemExit) as raised:
    commands.main()
  assert raised.value.code == 2
  out, err = capsys.readouterr()
  assert not out and err.startswith("error: unknown command 'trian'.\n")
  assert err.endswith(commands.usage() + "\n")


@pytest.mark.parametrize("argv", [[], ["-h"], ["--help"], ["help"]])
def test_the_command_list_is_its_own_help(monkeypatch, capsys, argv):
  monkeypatch.setattr(sys, "argv", ["allatt-jax", *argv])
  commands.main()
  assert capsys.readouterr() == (commands.usage() + "\n", "")


@pytest.fixture
def forwarded(monkeypatch):
  """The (module, argv) of each command the command list runs, none of them imported:
  two command modules in one process would define one flag twice."""
  received = []
  monkeypatch.setattr(commands.importlib, "import_module", lambda module: types.
                      SimpleNamespace(run=lambda argv: received.append((module, argv))))
  return received


def test_the_command_list_runs_the_command_named_on_the_flags_after_it(monkeypatch,
                                                                       forwarded):
  monkeypatch.setattr(sys, "argv", ["allatt-jax", "costs", "--flag=1"])
  commands.main()
  assert forwarded == [("allatt_jax.costs", ["allatt-jax", "--flag=1"])]


@pytest.mark.parametrize("script, name", [("train", "main"), ("evaluate", "evaluate"),
                                          ("score", "score"), ("sample", "sample"),
                                          ("export", "export")])
def test_console_scripts_run_their_command_on_its_flags(monkeypatch, forwarded, script,
                                                       name):
  monkeypatch.setattr(sys, "argv", [f"allatt-{script}", "--flag=1"])
  getattr(commands, script)()
  assert forwarded == [(f"allatt_jax.{name}", [f"allatt-{script}", "--flag=1"])]


@pytest.mark.parametrize("flags, names", [
    ((), ("exactly one of --config", "--checkpoint")),
    (("--config=configs/demo.py", "--step=3"), ("--step", "give --checkpoint too"))])
def test_costs_needs_one_model_and_a_step_only_of_a_checkpoint(flags, names):
  assert_one_error_line(command("allatt_jax.costs", *flags), *names)


@pytest.mark.slow
def test_help_through_the_command_list_is_the_commands_help():
  direct = command("allatt_jax.score", "--help")
  listed = command("allatt_jax", "score", "--help")
  assert listed.returncode == 0, listed.stderr
  # The same text, but for the heading absl gives the flags: the file or the module.
  heading = re.compile(r"^\S*score(\.py)?:$", re.M)
  assert heading.sub("", listed.stdout) == heading.sub("", direct.stdout)
  assert "--text_file" in listed.stdout


@pytest.mark.slow
def test_help_describes_the_flags():
  result = command("allatt_jax.main", "--help")
  assert result.returncode == 0, result.stderr
  for flag in ("--config", "--workdir", "shipped config", "demo.py"):
    assert flag in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name, own_flags", [
    ("score", ("--checkpoint", "--step", "--text_file", "--out")),
    ("sample", ("--checkpoint", "--prompt", "--num_tokens", "--top_k", "--seed",
                "--keep_unk")),
    ("evaluate", ("--checkpoint", "--split", "--text_file")),
    ("export", ("--workdir", "--out", "--step", "--overwrite")),
    ("data", ("--dataset", "--manual_dir", "--data_dir", "--level", "--files")),
])
def test_help_is_a_success_and_lists_the_commands_flags(name, own_flags):
  result = command(f"allatt_jax.{name}", "--help")
  assert result.returncode == 0, result.stdout + result.stderr
  # Each flag of the command, with its help text on its line or the next.
  lines = result.stdout.splitlines()
  for flag in own_flags:
    names = (flag + ":", "--[no]" + flag[2:] + ":")   # a bool flag's negation too
    at = next((i for i, line in enumerate(lines) if line.strip().startswith(names)), None)
    assert at is not None, (flag, result.stdout)
    assert len(" ".join(lines[at:at + 2]).strip()) > len(flag) + 10, (flag, lines[at])


@pytest.mark.parametrize("argv,verbose", [
    (["prog"], False), (["prog", "--verbosity=1"], True), (["prog", "-v", "2"], True),
    (["prog", "--verbosity", "0"], False), (["prog", "--verbosity=x"], False),
])
def test_verbosity_read_before_flag_parsing(argv, verbose):
  assert console.verbose_requested(argv) is verbose


def test_library_records_below_error_are_hidden():
  keep = console.LibraryChatterFilter().filter
  record = lambda path, level: logging.LogRecord("absl", level, path, 1, "m", (), None)
  assert keep(record(str(ROOT / "allatt_jax" / "train.py"), logging.INFO))
  assert not keep(record("/site-packages/orbax/checkpoint/x.py", logging.INFO))
  assert not keep(record("/site-packages/jax/_src/xla_bridge.py", logging.WARNING))
  assert keep(record("/site-packages/orbax/checkpoint/x.py", logging.ERROR))


@pytest.mark.slow
def test_the_default_console_has_no_log_prefixes(tmp_path):
  for name in ("train.txt", "valid.txt", "test.txt"):
    (tmp_path / name).write_text("the cat sat on the mat\n" * 20)
  result = command("allatt_jax.data", "--dataset=text_files", f"--manual_dir={tmp_path}",
                   tmp=tmp_path)
  assert result.returncode == 0, result.stderr
  assert "Preparing dataset 'text_files'" in result.stderr   # shown, as a plain line
  assert not re.search(r"^[IWEF]\d{4} \d\d:\d\d", result.stderr, re.M), result.stderr


def test_plain_records_keep_their_level_where_it_matters():
  plain = console.PlainFormatter().format
  record = lambda level: logging.LogRecord("absl", level, "x.py", 1, "m %d", (3,), None)
  assert plain(record(logging.INFO)) == "m 3"
  assert plain(record(logging.WARNING)) == "warning: m 3"


def test_native_stderr_hidden_unless_the_block_fails(capfd):
  with console.native_stderr_hidden():
    os.write(2, b"native notice\n")
  assert "native notice" not in capfd.readouterr().err
  with pytest.raises(RuntimeError):
    with console.native_stderr_hidden():
      os.write(2, b"why it failed\n")
      raise RuntimeError
  assert "why it failed" in capfd.readouterr().err


@pytest.fixture(scope="module")
def pipeline_workdir(tmp_path_factory, prune_config):
  """A pipeline's workdir as the demo leaves it, made without training: baseline/,
  pruned/ with its export/, and pruned-2/ (other pruning settings), each pruning stage
  with a step-1 checkpoint and a line of gate history."""
  workdir = tmp_path_factory.mktemp("pipeline")
  run_files.save_config(workdir / "baseline", helpers.tiny_run())
  state = assembly.run_setup(prune_config).new_state()
  heads = [prune_config.model.num_heads] * prune_config.model.num_layers
  history = {"step": 10, "open_prob": [[0.9] * h for h in heads],
             "decided": [[1] * h for h in heads]}
  for stage in ("pruned", "pruned-2"):
    with checkpointing.RunCheckpoints(workdir / stage, async_save=False) as checkpoints:
      checkpoints.save(1, state, {"position": 0, "epoch": 0, "row_length": 4499},
                       force=True)
    run_files.save_config(workdir / stage, prune_config)
    (workdir / stage / run_files.GATE_HISTORY_FILE).write_text(json.dumps(history) + "\n")
  export = workdir / "pruned" / "export"
  run_files.save_config(export, helpers.tiny_run())
  (export / "params").mkdir()
  return workdir


def test_plots_of_a_pipelines_workdir_draws_its_newest_pruning_stage(pipeline_workdir):
  result = command("allatt_jax.plots", f"--workdir={pipeline_workdir}")
  assert result.returncode == 0, result.stderr
  drawn = pipeline_workdir / "pruned-2"
  assert result.stdout.strip() == (f"Wrote {drawn / 'gates.png'} (the gates of {drawn}, "
                                   "the pipeline's newest pruning stage)")
  assert (drawn / "gates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_refusals_name_a_run_to_draw(pipeline_workdir, tmp_path):
  export = pipeline_workdir / "pruned" / "export"
  with pytest.raises(CheckpointError, match=r"is an exported model.* Draw the pruning "
                     rf"run it was exported from: --workdir={pipeline_workdir / 'pruned'}\."):
    figures.gated_run(export)
  with pytest.raises(CheckpointError, match=r"not a pruning run.* Draw its pipeline's "
                     rf"pruning stage: --workdir={pipeline_workdir / 'pruned-2'} "):
    figures.gated_run(pipeline_workdir / "baseline")
  run_files.save_config(tmp_path / "baseline", helpers.tiny_run())
  with pytest.raises(CheckpointError, match=r"pruning stage has not started"):
    figures.gated_run(tmp_path)
  assert figures.gated_run(pipeline_workdir / "pruned") == pipeline_workdir / "pruned"
