"""The Python API (`allatt_jax.load`) and standalone models, on a tiny trained run."""
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import allatt_jax
import data_fixtures
from helpers import fresh_python_prints
from helpers import train_run
from allatt_jax import api
from allatt_jax.config import config_base
from allatt_jax.pruning import model_export
from allatt_jax.reports import figures
from allatt_jax.evaluation import likelihood
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import head_removal
from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.runs import trained_model
from allatt_jax.data import tokenization
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import ConfigError
from allatt_jax.config.errors import FlagError

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = "The river flows past the old mill, and the town of 1850 grew along its banks."


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
  """The tiny demo's baseline and pruning configs with the demo's head layout (4
  layers of 8 heads), in RUNS/baseline and RUNS/pruned. On a text8 sample, whose
  alphabet and cleaning are the embedded corpus's: each run ends by evaluating its
  whole splits, 2,000 characters here against the embedded corpus's 240,000."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.model.update(dict(num_layers=4, num_heads=8))
  config.data.update(data_fixtures.text8_data(tmp_path_factory.mktemp("text8")))
  stages = assembly.checked_pipeline(config)
  runs = tmp_path_factory.mktemp("runs")
  return stages.baseline, run_config.derived_run(stages.pruning,
                                                 init_from=str(runs / "baseline"))


@pytest.fixture(scope="module")
def workdir(stages):
  baseline_config, prune_config = stages
  workdir = pathlib.Path(prune_config.init_from)
  train_run(baseline_config, workdir)
  return workdir


@pytest.fixture(scope="module")
def pruned_run(stages, workdir):
  # Gates start on the edge (logit 0, open) with a fast learning rate: within the
  # tiny run's 15 gate steps some close and some stay open (LAMB scales a logit's step
  # by its size, so from the usual init of 2 none would close). A derived RunConfig:
  # the shared `stages` stay as they are.
  prune_config = run_config.derived_run(
      stages[1], gates=dict(init=0.0, lam=0.05, learning_rate=0.1))
  pruned_run = workdir.parent / "pruned"
  train_run(prune_config, pruned_run)
  return pruned_run


@pytest.fixture(scope="module")
def model(workdir):
  return allatt_jax.load(workdir)


@pytest.fixture(scope="module")
def ids(model):
  return model.tokenizer.encode(TEXT)[0]


def masked_log_probs(model, ids, removed):
  """The unpruned model with `removed` heads masked by hard gates (no output scale)."""
  cfg = dataclasses.replace(model.lm.cfg, gated=True,
                            gate=run_config.GatesSection(hard=True, scale_output=False))
  gates = {f"layer_{i}": {"attention": {"logits": np.array(
      [-1.0 if h in removed.get(i, ()) else 1.0 for h in range(heads)], np.float32)}}
           for i, heads in enumerate(cfg.layer_heads)}
  lm = model_lib.TransformerLM(cfg)
  memory = model_lib.init_memory(cfg, 1, model.config.eval.mem_len)
  logp, _ = lm.apply({"params": model.variables["params"], "gates": gates},
                     ids[None], memory, method=lm.log_probs)
  return np.asarray(logp[0])


def run_cli(module, *args, env=None, check=True):
  return subprocess.run([sys.executable, "-m", f"allatt_jax.{module}", *args],
                        capture_output=True, text=True, cwd=ROOT, check=check,
                        env={**os.environ, **(env or {})})


def test_import_is_light_and_exposes_the_api():
  out = fresh_python_prints("import sys, allatt_jax; print('jax' in sys.modules, "
                            "'load' in dir(allatt_jax), 'Model' in dir(allatt_jax))")
  assert out == ["False", "True", "True"]


@pytest.mark.slow
def test_run_saves_its_tokenizer(workdir, model):
  saved = run_files.load_tokenizer(workdir)
  assert saved["level"] == "char" and saved["clean"] == "text8"
  assert len(saved["vocab"]) == model.lm.cfg.vocab_size == 27


@pytest.mark.slow
@pytest.mark.parametrize("removed", [{0: [1, 5], 2: [0]}, {1: list(range(8))}],
                         ids=["some", "a_whole_layer"])
def test_prune_heads_equals_masking_them(model, ids, removed):
  ids = ids[:model.config.eval.seq_len]   # one segment: the masked model's reading
  smaller = model.prune_heads(removed)
  assert smaller.heads_per_layer == tuple(
      8 - len(removed.get(i, ())) for i in range(4))
  logp, _ = smaller.log_probs(ids)
  np.testing.assert_allclose(np.asarray(logp), masked_log_probs(model, ids, removed),
                             atol=1e-5)
  assert smaller.costs()["params_non_embedding"] < model.costs()["params_non_embedding"]


@pytest.mark.slow
def test_bad_heads_are_named(model):
  with pytest.raises(ConfigError, match=r"Layer 4 does not exist.*0 \.\. 3"):
    model.prune_heads({4: [0]})
  with pytest.raises(ConfigError, match=r"Layer 1 has no head\(s\) \[8, -1\]"):
    model.prune_heads({1: [0, 8, -1]})
  with pytest.raises(ConfigError, match=r"Layer 0 has no head\(s\) \[5\]: its heads are 0 \.\. 3"):
    model.prune_heads({0: [0, 1, 2, 3]}).prune_heads({0: [5]})


def untrained_model(**sections) -> api.Model:
  """The tiny demo's model, freshly initialised, with a character vocabulary; its
  config's `sections` updated ({'gates': {'enabled': True}}, ...)."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.model.vocab_size = 27
  for name, values in sections.items():
    config[name].update(values)
  run = run_config.RunConfig.of(config)
  lm = model_lib.TransformerLM.from_config(run)
  tokens = jnp.zeros((1, 1), jnp.int32)
  variables = lm.init(jax.random.key(0), tokens, tokens,
                      model_lib.init_memory(lm.cfg, 1, 1))
  tokenizer = tokenization.Tokenizer("wikitext_chars", "char",
                                     tuple(" abcdefghijklmnopqrstuvwxyz"))
  return api.Model(trained_model.LoadedModel(run, lm, nn.unbox(variables), tokenizer))


def unk_loving_word_model() -> api.Model:
  """`untrained_model` over a word vocabulary, its output bias making <unk> nearly
  certain: what a small word-level model's samples looked like."""
  model = untrained_model()
  words = ("the", "river", "<eos>", "<unk>") + tuple(f"w{i}" for i in range(23))
  params = model.variables["params"]
  bias = params["embedding"]["bias_0"].at[words.index("<unk>")].set(30.0)
  variables = {"params": {**params, "embedding": {**params["embedding"], "bias_0": bias}}}
  return api.Model(trained_model.LoadedModel(
      model.config, model.lm, variables, tokenization.Tokenizer("text_files", "word", words)))


@pytest.mark.slow
def test_samples_leave_unk_out_unless_asked(tmp_path):
  model = unk_loving_word_model()
  for options in (dict(), dict(temperature=0.0)):
    words = model.generate("the river", num_tokens=12, seed=1, **options).split()
    assert len(words) == 12 and "<unk>" not in words, (options, words)
  assert model.generate("the river", num_tokens=12, seed=1, keep_unk=True).split() == (
      ["<unk>"] * 12)
  # The command's flag (the default is the API's, through the same sampler).
  model.save(tmp_path / "model")
  kept = subprocess.run(
      [sys.executable, "-m", "allatt_jax.sample", f"--checkpoint={tmp_path / 'model'}",
       "--prompt=the zebra river", "--num_tokens=6", "--keep_unk"], capture_output=True,
      text=True, cwd=ROOT, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert kept.stdout.split() == ["the", "<unk>", "river"] + ["<unk>"] * 6, kept.stderr
  # The prompt's unknown word is read as <unk>, and the command says so.
  assert ("Prompt tokens outside the vocabulary: 1 (words read as <unk>); the model "
          "reads it as 'the <unk> river'.") in kept.stderr, kept.stderr


def test_save_refuses_a_folder_that_holds_something_unless_overwrite(tmp_path):
  model = untrained_model()
  model.save(tmp_path / "model")
  saved = (tmp_path / "model" / "config.json").stat().st_mtime_ns
  with pytest.raises(FileExistsError, match=r"already holds an exported model; save "
                     r"elsewhere, or replace it with save\(directory, overwrite=True\)"):
    model.save(tmp_path / "model")
  assert (tmp_path / "model" / "config.json").stat().st_mtime_ns == saved
  model.save(tmp_path / "model", overwrite=True)
  assert allatt_jax.load(tmp_path / "model").heads_per_layer == model.heads_per_layer
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "todo.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="exists and is not an exported model"):
    model.save(tmp_path / "notes", overwrite=True)
  assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
  (tmp_path / "empty").mkdir()
  model.save(tmp_path / "empty")          # an empty folder is as good as a new one


def test_a_gated_model_saves_without_its_closed_heads(tmp_path):
  """Saved as its export: closed heads cut out (kept, they would reopen in a model
  without gates), the rest scoring as the gated model. Its log_probs start from empty
  memory of the run's eval.mem_len positions."""
  model = untrained_model(gates=dict(enabled=True), eval=dict(seq_len=16, mem_len=19))
  heads = model.lm.cfg.layer_heads
  gates = {f"layer_{i}": {"attention": {"logits": jnp.asarray(
      [-5.0 if (i, h) == (0, 1) else 5.0 for h in range(heads[i])])}}
           for i in range(len(heads))}
  gated = api.Model(trained_model.LoadedModel(
      model.config, model.lm, {**model.variables, "gates": gates}, model.tokenizer))
  ids = np.arange(20) % 27
  log_probs, memory = gated.log_probs(ids)
  assert memory["hidden"].shape[2] == 19

  gated.save(tmp_path / "model")
  saved = allatt_jax.load(tmp_path / "model")
  assert saved.heads_per_layer == gated.heads_per_layer == (heads[0] - 1, *heads[1:])
  np.testing.assert_allclose(np.asarray(saved.log_probs(ids)[0]), np.asarray(log_probs),
                             rtol=1e-5, atol=1e-5)


def test_a_gated_model_tells_the_heads_and_slots_its_gates_keep_as_its_costs_do():
  """One count of a pruning run's heads: its gates', in heads_per_layer as in costs()
  and its export; the shape its parameters hold, closed heads too, beside it."""
  model = untrained_model(gates=dict(enabled=True, persistent_group=4))
  # Layer 0 closes head 1; layer 1 closes groups 0 and 3 of head 2 (16 slots a head).
  gates = {"layer_0": {"attention": {
               "logits": jnp.asarray([5.0, -5.0, 5.0, 5.0]),
               "persistent_logits": jnp.full((4, 4), 5.0)}},
           "layer_1": {"attention": {
               "logits": jnp.full((4,), 5.0),
               "persistent_logits": jnp.full((4, 4), 5.0).at[2, 0].set(-5.0)
                                                          .at[2, 3].set(-5.0)}}}
  gated = api.Model(trained_model.LoadedModel(
      model.config, model.lm, {**model.variables, "gates": gates}, model.tokenizer))
  costs = gated.costs()
  assert gated.heads_per_layer == tuple(costs["heads_per_layer"]) == (3, 4)
  assert gated.persistent_per_layer == tuple(costs["persistent_per_layer"]) == (48, 56)
  assert gated.stored_heads_per_layer == (4, 4)
  exported = gated.prune_heads({})
  assert (exported.heads_per_layer, exported.persistent_per_layer) == ((3, 4), (48, 56))
  assert exported.stored_heads_per_layer == (3, 4)


def test_prune_persistent_groups_cuts_as_an_export_and_round_trips(tmp_path):
  model = untrained_model()          # 2 layers of 4 heads of 16 slots: groups of 4
  ids = jnp.asarray(np.arange(24) % 27)
  smaller = model.prune_persistent_groups({0: {1: [0, 3]}, 1: {2: [0, 1, 2, 3]}},
                                          group_size=4)
  assert smaller.lm.cfg.persistent_slots == ((16, 16, 16, 8), (16, 16, 16, 0))
  # The cut model numbers its heads by the slots they keep: the old head 1 of layer 0
  # (8 slots left) is now head 3, as costs() and the export's note say.
  assert smaller.costs()["persistent_per_head"] == [[16, 16, 16, 8], [16, 16, 16, 0]]
  assert model.costs()["persistent_per_head"] == [[16] * 4, [16] * 4]
  assert smaller.prune_heads({0: [3]}).lm.cfg.persistent_slots == ((16, 16, 16),
                                                                   (16, 16, 16, 0))
  note = model_export.renumbering_note(model.lm.cfg, smaller.lm.cfg)
  assert ("numbers each layer's heads anew, 0 .. H-1: the heads kept, ordered by their "
          "persistent slots, most first (per head: 16 16 16 8 | 16 16 16 0)") in note
  assert "in the order they had" in model_export.renumbering_note(
      model.lm.cfg, model.prune_heads({0: [1]}).lm.cfg)
  assert model_export.renumbering_note(model.lm.cfg, model.lm.cfg) == ""
  expected_cfg, expected = head_removal.remove_heads(
      model.lm.cfg, jax.device_get(model.variables),
      slots={0: {1: [0, 1, 2, 3, 12, 13, 14, 15]}, 1: {2: list(range(16))}})
  assert smaller.lm.cfg == expected_cfg
  for a, b in zip(jax.tree.leaves(jax.device_get(smaller.variables["params"])),
                  jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)
  # Costs count the slots kept: 24 of 128 gone, 2·dh parameters each.
  dh = model.lm.cfg.head_dim
  assert (model.costs()["params_non_embedding"] - smaller.costs()["params_non_embedding"]
          == 24 * 2 * dh)
  smaller.save(tmp_path / "smaller")
  loaded = allatt_jax.load(tmp_path / "smaller")
  assert loaded.lm.cfg.persistent_slots == smaller.lm.cfg.persistent_slots
  np.testing.assert_array_equal(np.asarray(loaded.log_probs(ids)[0]),
                                np.asarray(smaller.log_probs(ids)[0]))
  with pytest.raises(ConfigError, match=r"Head 1 of layer 0 has no persistent group\(s\) "
                     r"\[4\] of 4 slots: its groups are 0 \.\. 3"):
    model.prune_persistent_groups({0: {1: [4]}}, group_size=4)
  with pytest.raises(ConfigError, match="pass group_size=G"):
    model.prune_persistent_groups({0: {1: [0]}})
  # Groups count a head's slots as it has them now, and a gated model's own group size
  # is the default.
  with pytest.raises(ConfigError, match=r"Head 3 of layer 0 has no persistent group\(s\) "
                     r"\[2\] of 4 slots: its groups are 0 \.\. 1"):
    smaller.prune_persistent_groups({0: {3: [2]}}, group_size=4)
  for layer, head in ((2, 0), (0, 4)):
    with pytest.raises(ConfigError, match=rf"Layer {layer} has no head {head} \(heads per "
                       r"layer: \[4, 4\]\)"):
      model.prune_persistent_groups({layer: {head: [0]}}, group_size=4)
  gated = untrained_model(gates=dict(enabled=True, persistent_group=4))
  assert gated.prune_persistent_groups({0: {1: [0, 3]}}).lm.cfg.persistent_slots == (
      (16, 16, 16, 8), (16, 16, 16, 16))


@pytest.mark.slow
def test_save_load_round_trip_is_exact(workdir, model, ids, tmp_path):
  smaller = model.prune_heads({0: [3], 3: [0, 1, 2, 3, 4, 5, 6, 7]})
  smaller.save(tmp_path / "smaller")
  loaded = allatt_jax.load(tmp_path / "smaller")
  assert loaded.heads_per_layer == smaller.heads_per_layer == (7, 8, 8, 0)
  for a, b in zip(jax.tree.leaves(loaded.variables), jax.tree.leaves(smaller.variables)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(loaded.log_probs(ids)[0]),
                                np.asarray(smaller.log_probs(ids)[0]))
  assert loaded.tokenizer == smaller.tokenizer
  assert run_files.load_vocabulary(tmp_path / "smaller") == run_files.load_vocabulary(workdir)
  with pytest.raises(CheckpointError, match="is an exported model: it has one set of parameters, no steps"):
    allatt_jax.load(tmp_path / "smaller", step=3)


@pytest.mark.slow
def test_log_probs_carry_memory_and_match_score(model, ids):
  e = model.config.eval
  head = ids[:e.seq_len + 1]
  logp, memory = model.log_probs(head[:-1])
  assert logp.shape == (e.seq_len, model.lm.cfg.vocab_size)
  nll = -np.mean(np.asarray(logp)[np.arange(e.seq_len), head[1:]])
  assert model.score(model.tokenizer.decode(head))["nll"] == pytest.approx(nll, rel=1e-5)
  with_memory, _ = model.log_probs(ids[e.seq_len:2 * e.seq_len], memory)
  without, _ = model.log_probs(ids[e.seq_len:2 * e.seq_len])
  assert not np.allclose(np.asarray(with_memory), np.asarray(without))
  # A longer text is read in segments of eval.seq_len, the memory carried between them;
  # rows of a batch are read side by side.
  both = np.concatenate([np.asarray(logp), np.asarray(with_memory)])
  np.testing.assert_allclose(np.asarray(model.log_probs(ids[:2 * e.seq_len])[0]), both,
                             rtol=1e-5, atol=1e-6)
  rows = np.stack([ids[:e.seq_len], ids[e.seq_len:2 * e.seq_len]])
  batched = np.asarray(model.log_probs(rows)[0])
  assert batched.shape == (2, e.seq_len, model.lm.cfg.vocab_size)
  np.testing.assert_allclose(batched[0], np.asarray(logp), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(batched[1], np.asarray(without), rtol=1e-5, atol=1e-6)
  for wrong in (np.array([0, 27]), np.array([-1, 3])):
    with pytest.raises(ValueError, match=r"must lie in \[0, 27\)"):
      model.log_probs(wrong)
  for wrong in (np.zeros((1, 1, 4), np.int32), np.zeros((0,), np.int32),
                np.array([0.0, 1.0])):
    with pytest.raises(ValueError, match=r"must be integer ids of shape \(T,\) or \(B, T\) "
                       r"with T >= 1, not"):
      model.log_probs(wrong)


@pytest.mark.slow
def test_generate_follows_its_seed_and_top_k(model):
  def sample(num_tokens=20, **options):
    return model.generate("the river", num_tokens=num_tokens, **options)
  assert sample(seed=1) == sample(seed=1) != sample(seed=2)
  assert sample(top_k=1, seed=1) == sample(top_k=1, seed=2)    # greedy
  with pytest.raises(ConfigError, match=r"num_tokens=-1: use 0 or more\."):
    sample(num_tokens=-1)


@pytest.mark.slow
def test_export_is_standalone(model, tmp_path):
  """An export copied elsewhere scores, samples, evaluates a file and reports its
  costs with an empty TFDS folder: nothing is prepared there."""
  model.prune_heads({0: [0, 1, 2], 2: [7]}).save(tmp_path / "made")
  export = tmp_path / "elsewhere" / "export"
  shutil.copytree(tmp_path / "made", export)
  empty = tmp_path / "empty_tfds"
  empty.mkdir()
  config = json.loads((export / "config.json").read_text())
  config["data"]["data_dir"] = str(empty)
  config["data"].pop("manual_dir", None)
  (export / "config.json").write_text(json.dumps(config))
  env = {"TFDS_DATA_DIR": str(empty)}
  (tmp_path / "text.txt").write_text(TEXT)

  scored = json.loads(run_cli("score", f"--checkpoint={export}",
                              f"--text_file={tmp_path / 'text.txt'}", env=env).stdout)
  sampled = run_cli("sample", f"--checkpoint={export}", "--prompt=the town",
                    "--num_tokens=20", env=env).stdout
  assert sampled.startswith("the town") and len(sampled.rstrip("\n")) == 28
  # In this process, the library behind evaluate --text_file and costs --checkpoint.
  loaded = trained_model.load(export)
  evaluated = likelihood.evaluate_model(loaded, text=TEXT)
  assert evaluated["bpc"] == pytest.approx(scored["bpc"], rel=1e-5)
  assert evaluated["tokens"] == scored["tokens"]
  assert model_export.trained_model_config(export)[1].layer_heads == (5, 8, 7, 8)
  assert allatt_jax.load(export).score(TEXT)["bpc"] == pytest.approx(scored["bpc"],
                                                                     rel=1e-5)
  assert not any(empty.iterdir())


@pytest.mark.slow
def test_model_saved_before_tokenizers_loads_through_its_dataset(model, ids, tmp_path):
  model.save(tmp_path / "old")
  (tmp_path / "old" / run_files.TOKENIZER_FILE).unlink()
  old = allatt_jax.load(tmp_path / "old")
  assert old.tokenizer == model.tokenizer
  np.testing.assert_array_equal(np.asarray(old.log_probs(ids)[0]),
                                np.asarray(model.log_probs(ids)[0]))


@pytest.mark.slow
def test_evaluate_cli_picks_a_step(workdir):
  last = json.loads(run_cli("evaluate", f"--checkpoint={workdir}", "--split=valid").stdout)
  first = json.loads(run_cli("evaluate", f"--checkpoint={workdir}", "--step=20",
                             "--split=valid").stdout)
  assert first["step"] == 20 and first["tokens"] == last["tokens"] > 0
  assert last["step"] == 30   # the step it used, not the absent flag's None
  assert first["bpc"] != last["bpc"]
  results = json.loads((workdir / "results.json").read_text())
  assert last["bpc"] == pytest.approx(results["valid"], rel=1e-5)
  with pytest.raises(CheckpointError, match=r"No checkpoint of step 7 .*steps \[20, 30\]"):
    allatt_jax.load(workdir, step=7)


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/python-api.md"])
def test_the_docs_python_examples_run(page, workdir, tmp_path, capsys):
  """The first Python block under each page's "Python API" heading, as a user copies it."""
  text = (ROOT / page).read_text()
  example = re.search(r"^#+ .*Python API\n.*?```python\n(.*?)```", text, re.S | re.M).group(1)
  shutil.copytree(workdir, tmp_path / "baseline")
  exec(example.replace("/tmp/allatt_demo", str(tmp_path)), {})  # pylint: disable=exec-used
  printed = capsys.readouterr().out.splitlines()
  assert printed[0] == "(8, 8, 8, 8)"
  assert (tmp_path / "smaller" / run_files.TOKENIZER_FILE).is_file()


@pytest.mark.slow
def test_pruning_run_and_its_export_carry_the_tokenizer(pruned_run, model):
  for directory in (pruned_run, pruned_run / model_export.EXPORT_DIR):
    assert run_files.load_tokenizer(directory) == model.tokenizer.to_dict()
    assert run_files.load_vocabulary(directory) == run_files.load_vocabulary(pruned_run)


@pytest.mark.slow
def test_gated_run_prunes_and_costs_as_its_export(pruned_run, ids):
  gated = allatt_jax.load(pruned_run)
  exported = allatt_jax.load(pruned_run / model_export.EXPORT_DIR)
  assert gated.lm.cfg.gated and sum(exported.heads_per_layer) < 32
  np.testing.assert_allclose(np.asarray(gated.log_probs(ids)[0]),
                             np.asarray(exported.log_probs(ids)[0]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(gated.prune_heads({}).log_probs(ids)[0]),
                             np.asarray(exported.log_probs(ids)[0]), atol=1e-5)
  printed = json.loads(run_cli("costs", f"--checkpoint={pruned_run}").stdout)
  assert printed["heads_per_layer"] == list(exported.heads_per_layer)
  assert gated.heads_per_layer == exported.heads_per_layer
  assert gated.persistent_per_layer == exported.persistent_per_layer
  assert printed == exported.costs() == gated.costs()
  both = run_cli("costs", f"--checkpoint={pruned_run}", "--config=configs/demo.py",
                 check=False)
  assert both.returncode == 2 and "exactly one of --config" in both.stderr


@pytest.mark.slow
def test_export_of_an_earlier_step(pruned_run, tmp_path):
  out = model_export.export_run(pruned_run, tmp_path / "step20", step=20)
  assert allatt_jax.load(out).tokenizer.vocab_size == 27
  with pytest.raises(CheckpointError, match="No checkpoint of step 25"):
    model_export.export_run(pruned_run, tmp_path / "step25", step=25)


@pytest.mark.slow
def test_export_replaces_no_export_unless_asked(pruned_run, tmp_path):
  run = tmp_path / "pruned"
  shutil.copytree(pruned_run, run)
  own = json.loads((run / "results.json").read_text())["export"]
  assert own["directory"] == str(pruned_run / model_export.EXPORT_DIR)
  before = allatt_jax.load(run / model_export.EXPORT_DIR).costs()

  # Another step goes next to the run's own export, which stays what results.json says.
  assert model_export.export_run(run, step=20) == run / "export-step-20"
  assert allatt_jax.load(run / model_export.EXPORT_DIR).costs() == before
  refused = run_cli("export", f"--workdir={run}", "--step=20", check=False)
  assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
  assert re.search(r"^error: .*export-step-20 already holds an exported model.* "
                   r"--out=DIR.* --overwrite\.$", refused.stderr, re.M), refused.stderr
  with pytest.raises(FlagError, match=r"/export already holds an exported model"):
    model_export.export_run(run)
  assert model_export.export_run(run, overwrite=True) == run / model_export.EXPORT_DIR
  # Not even --overwrite writes a model over a folder that is not one.
  with pytest.raises(FlagError, match=r"exists and is not an exported model"):
    model_export.export_run(run, out_dir=run, overwrite=True)
  # A folder given is refused before the model is read (this run has no step 99).
  with pytest.raises(FlagError, match=r"exists and is not an exported model"):
    model_export.export_run(run, out_dir=run, step=99)


@pytest.mark.slow
def test_gate_figure_of_a_pruning_run(pruned_run, tmp_path):
  out = figures.gate_figure(pruned_run, tmp_path / "gates.png")
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(CheckpointError, match="not a pruning run"):
    figures.gate_figure(pruned_run.parent / "baseline")
