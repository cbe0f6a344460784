"""A run's own files: where they are, what a run writes besides its checkpoints, and
how it writes them (the checks that read them back: test_runs_workdir_checks.py)."""
import pytest

import helpers
from allatt_jax.config import run_config
from allatt_jax.data import tokenization
from allatt_jax.runs import run_files


def test_run_paths_keep_urls_and_make_local_paths_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(run_files.run_path("gs://bucket/runs/a") / "checkpoints") == (
      "gs://bucket/runs/a/checkpoints")
  assert str(run_files.run_path("runs/a")) == str(tmp_path / "runs" / "a")


def test_a_run_is_described_by_its_config_vocabulary_and_tokenizer(tmp_path):
  config = helpers.tiny_run()
  config.data.name = "text8"
  config.model.vocab_size = 27
  config = run_config.RunConfig.of(config)
  alphabet = tokenization.TEXT8_ALPHABET
  vocabulary = run_files.vocabulary_fingerprint("text8", alphabet)
  tokenizer = tokenization.Tokenizer("text8", "char", tuple(alphabet)).to_dict()
  run_files.save_run(tmp_path / "run", config, vocabulary, tokenizer)
  assert run_files.load_config(tmp_path / "run") == config
  assert run_files.load_vocabulary(tmp_path / "run") == vocabulary
  assert run_files.load_tokenizer(tmp_path / "run") == tokenizer
  assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(
      [run_files.CONFIG_FILE, run_files.VOCABULARY_FILE, run_files.TOKENIZER_FILE])


def test_a_write_that_fails_midway_leaves_the_file_as_it_was(tmp_path, monkeypatch):
  """A reader (a resuming run, another host) sees the whole old file or the whole new
  one, never a part."""
  path = tmp_path / "results.json"
  run_files.write_json(path, {"step": 1})
  write_text = type(run_files.run_path(path)).write_text

  def dies_midway(self, text, *args, **kwargs):
    write_text(self, text[:len(text) // 2], *args, **kwargs)
    raise OSError("No space left on device")

  monkeypatch.setattr(type(run_files.run_path(path)), "write_text", dies_midway)
  with pytest.raises(OSError, match="No space left"):
    run_files.write_json(path, {"step": 2, "metrics": list(range(100))})
  monkeypatch.undo()
  assert path.read_text() == '{\n  "step": 1\n}'


def test_a_pipelines_pruning_stages_are_its_numbered_folders_with_a_config(tmp_path):
  for name in ("pruned-10", "pruned-2", "pruned", "pruned-copy", "pruned-3"):
    (tmp_path / name).mkdir()
    if name != "pruned-3":       # a stage that never started
      (tmp_path / name / run_files.CONFIG_FILE).write_text("{}")
  assert [p.name for p in run_files.pruning_stages(tmp_path)] == [
      "pruned", "pruned-2", "pruned-10"]
