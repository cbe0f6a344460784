"""Each command does what its flags say, on a pruning run's workdir saved without
training: every head open at step 1, and head 0 of layer 0 closed at step 2, so that a
command that reads the wrong step says something else.

The commands run as a user runs them, one process each (test_commands.py has the bad
input each refuses before any work).
"""
import json

import jax.numpy as jnp
import pytest

import helpers
from helpers import assert_one_error_line
from helpers import command
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import cost_model
from allatt_jax.pruning import model_export
from allatt_jax.runs import checkpointing
from allatt_jax.runs import run_files
from allatt_jax.training import assembly

pytestmark = pytest.mark.slow   # every test starts several commands

TEXT = "the history of the city is the history of its river " * 3


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory):
  config = helpers.tiny_run()
  config.gates.update(dict(enabled=True, freeze_step=15))
  config.model.vocab_size = 27
  config.data.data_dir = str(tmp_path_factory.mktemp("tfds"))
  workdir = tmp_path_factory.mktemp("pruning")
  state = assembly.run_setup(config).new_state()
  open_logits = {layer: {"attention": {"logits": jnp.full((4,), 5.0)}}
                 for layer in ("layer_0", "layer_1")}
  closed_logits = {**open_logits,
                   "layer_0": {"attention": {"logits": jnp.array([-5.0, 5.0, 5.0, 5.0])}}}
  with checkpointing.RunCheckpoints(workdir, async_save=False) as checkpoints:
    for step, logits in ((1, open_logits), (2, closed_logits)):
      saved = state.replace(step=jnp.asarray(step, jnp.int32),
                            variables={**state.variables, "gates": logits})
      checkpoints.save(step, saved, {"position": 0, "epoch": 0, "row_length": 4499},
                       force=True)
  run_files.save_config(workdir, config)
  return workdir


def succeeded(result) -> str:
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout


def test_evaluate_and_score_name_the_model_and_step_they_read(gated_run, tmp_path):
  text_file = tmp_path / "text.txt"
  text_file.write_text(TEXT)
  evaluated = {step: json.loads(succeeded(command(
      "allatt_jax.evaluate", f"--checkpoint={gated_run}", f"--text_file={text_file}",
      *step))) for step in ((), ("--step=1",))}
  newest, first = evaluated[()], evaluated[("--step=1",)]
  assert first["checkpoint"] == newest["checkpoint"] == str(gated_run)
  assert (first["step"], newest["step"]) == (1, 2)
  assert first["file"] == newest["file"] == str(text_file)
  assert "split" not in first
  assert first["nll"] != newest["nll"]   # step 2 reads without head 0 of layer 0
  out = tmp_path / "scores.jsonl"
  scored = json.loads(succeeded(command("allatt_jax.score", f"--checkpoint={gated_run}",
                                        f"--text_file={text_file}", "--step=1",
                                        f"--out={out}")))
  assert (scored["file"], scored["checkpoint"]) == (str(text_file), str(gated_run))
  assert scored["nll"] == first["nll"]
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert scored["tokens"] == len(lines) == len(TEXT.strip()) - 1  # all but the first
  assert [line["token"] for line in lines] == list(TEXT.strip()[1:])
  assert -sum(line["log_prob"] for line in lines) / len(lines) == pytest.approx(
      scored["nll"], rel=1e-5)


def test_evaluate_reads_the_test_split_by_default_prepared_in_the_data_dir_given(
    gated_run, tmp_path):
  moved = tmp_path / "moved_tfds"
  result = json.loads(succeeded(command("allatt_jax.evaluate", f"--checkpoint={gated_run}",
                                        f"--data_dir={moved}")))
  assert (result["split"], result["step"]) == ("test", 2)
  assert any(moved.rglob("dataset_info.json")), "the dataset was not prepared in --data_dir"


def test_score_refuses_a_folder_for_out_before_reading_the_model(tmp_path):
  result = command("allatt_jax.score", f"--checkpoint={tmp_path / 'nowhere'}",
                   f"--text_file={tmp_path / 'text.txt'}", f"--out={tmp_path}")
  assert_one_error_line(result, f"--out={tmp_path} is a folder",
                        f"--out={tmp_path / 'scores.jsonl'}")


def test_sample_follows_its_seed_temperature_and_top_k(gated_run):
  def sample(*flags):
    return succeeded(command("allatt_jax.sample", f"--checkpoint={gated_run}",
                             "--prompt=the city", "--num_tokens=30", *flags))
  seeded = sample("--seed=1")
  assert seeded == sample("--seed=1") != sample("--seed=2")
  greedy = sample("--temperature=0")
  assert greedy == sample("--top_k=1", "--seed=3") != seeded
  assert len(greedy) == len("the city") + 30 + 1


def test_sample_of_no_tokens_prints_the_prompt_as_the_model_read_it(gated_run):
  # The demo's characters are cleaned as text8 was: lower case, '#' a space.
  result = command("allatt_jax.sample", f"--checkpoint={gated_run}",
                   "--prompt=The #City", "--num_tokens=0")
  assert succeeded(result) == "the city\n"


def exported_heads(directory) -> list[int]:
  return list(run_files.load_config(directory).model.heads_per_layer)


def test_export_writes_the_step_asked_for_where_asked_and_replaces_only_when_asked(
    gated_run, tmp_path):
  export = lambda *flags: command("allatt_jax.export", f"--workdir={gated_run}", *flags)
  first = gated_run / "export-step-1"
  assert succeeded(export("--step=1")) == f"Exported the pruned model to {first}\n"
  assert exported_heads(first) == [4, 4]
  out = tmp_path / "smaller"
  # Heads removed: the note on their numbers follows, as the pipeline's export says it.
  assert succeeded(export(f"--out={out}")) == (
      f"Exported the pruned model to {out}\nThe export numbers each layer's heads anew, "
      "0 .. H-1: the heads kept, in the order they had. Model.prune_heads and "
      "prune_persistent_groups take those numbers, and Model.costs() lists each head's "
      "slots (persistent_per_head).\n")
  assert exported_heads(out) == [3, 4]
  assert_one_error_line(export(f"--out={out}", "--step=1"), "--overwrite")
  assert exported_heads(out) == [3, 4]
  succeeded(export(f"--out={out}", "--step=1", "--overwrite"))
  assert exported_heads(out) == [4, 4]
  assert_one_error_line(export("--step=-1"), "--step")


def test_costs_of_a_trained_model_count_the_heads_of_the_step_given(gated_run):
  costs = lambda *flags: json.loads(succeeded(command(
      "allatt_jax.costs", f"--checkpoint={gated_run}", *flags)))
  for flags, step in ((("--step=1", "--heads_kept=0.5"), 1), ((), None)):
    config, cfg = model_export.trained_model_config(gated_run, step)
    heads_kept = 0.5 if "--heads_kept=0.5" in flags else None
    assert costs(*flags) == json.loads(json.dumps(
        cost_model.model_report(config, cfg, heads_kept)))
  assert cfg.layer_heads == (3, 4)


def test_costs_of_a_config_are_at_its_train_lengths():
  overrides = ("--config.train.mem_len=8", "--config.train.batch_size=2")
  result = json.loads(succeeded(command("allatt_jax.costs", "--config=configs/demo.py:tiny",
                                        *overrides, "--heads_kept=0.5")))
  config = helpers.tiny_run()
  config.train.update(dict(mem_len=8, batch_size=2))
  config = assembly.with_vocab_size(assembly.checked_config(config))
  expected = cost_model.report(model_lib.ModelConfig.from_config(config), 16, 8, 2, 0.5)
  assert result == json.loads(json.dumps(expected))
