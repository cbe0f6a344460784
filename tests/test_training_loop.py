"""Training pipeline end to end on real text (the embedded corpus), tiny settings; the
resumed runs on a text8 sample."""
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data_fixtures
import helpers
from helpers import train_run
from helpers import run_pipeline
from allatt_jax.runs import checkpointing
from allatt_jax.evaluation import speed
from allatt_jax.config import config_base
from allatt_jax import data as data_lib
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import assembly
from allatt_jax.training import loop
from allatt_jax.runs import run_files
from allatt_jax.parallel import sharding

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def tiny_config(data_dir, **train_overrides):
  config = helpers.tiny_run()
  config.data.data_dir = data_dir
  config.model.vocab_size = 27   # assembly.run_setup reads no dataset to fill it in
  config.train.update(train_overrides)
  return config


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, data_dir):
  """The whole demo pipeline at tiny size: baseline, pruning, export, report; and what
  its speed comparison timed: (batches, heads per layer of each model)."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.data.data_dir = data_dir
  # Strong, early pressure so that even 30 tiny steps close some heads.
  config.pipeline.prune_gates.update(dict(lam=0.5, init=0.5, learning_rate=0.2))
  workdir = tmp_path_factory.mktemp("demo")
  timed, tokens_per_s = [], speed.tokens_per_s

  def recorded(run, mesh, tokens, num_batches, models, **kwargs):
    timed.append((num_batches, {name: list(model.lm.cfg.layer_heads)
                                for name, model in models.items()}))
    return tokens_per_s(run, mesh, tokens, num_batches, models, **kwargs)

  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.setattr(speed, "tokens_per_s", recorded)
    report = run_pipeline(config, workdir)
  return workdir, config, report, timed


def test_demo_report_and_files(demo_run):
  workdir, config, report, timed = demo_run
  assert json.loads((workdir / "report.json").read_text()) == report
  for key in ("dataset", "metric", "baseline", "pruned", "speed"):
    assert key in report
  assert report["metric"] == "bpc"
  for key in ("valid", "test", "params_non_embedding", "heads_per_layer"):
    assert key in report["baseline"] and key in report["pruned"]
  pruned_heads = report["pruned"]["heads_per_layer"]
  assert report["pruned"]["sparsity"] == pytest.approx(1 - sum(pruned_heads) / 8)
  assert sum(pruned_heads) < 8, "the strong tiny λ should close some heads"
  assert report["pruned"]["params_non_embedding"] < report["baseline"]["params_non_embedding"]
  assert report["speed"]["macs_ratio"] < 1.0
  assert (workdir / "gates.png").stat().st_size > 1000
  assert (workdir / "pruned" / "export" / "config.json").is_file()
  # Its speeds are the baseline's and the export's, over the pipeline's speed_batches.
  assert timed == [(config.pipeline.speed_batches,
                    {"baseline": [4, 4], "pruned": pruned_heads})]


def test_exported_model_scores_like_gated_model(demo_run):
  """Exported logits equal the gated model's deterministic logits on real text."""
  workdir, config, report, _ = demo_run
  assert report["pruned"]["valid"] == pytest.approx(report["pruned"]["gated_valid"], rel=1e-5)
  assert report["pruned"]["test"] == pytest.approx(report["pruned"]["gated_test"], rel=1e-5)

  gated_config = run_files.load_config(workdir / "pruned")
  gated_lm = model_lib.TransformerLM.from_config(gated_config)
  gated_vars = checkpointing.read_model(workdir / "pruned")[1]
  export_config, export_vars, _ = checkpointing.read_model(workdir / "pruned" / "export")
  export_lm = model_lib.TransformerLM.from_config(export_config)
  assert "gates" not in export_vars

  corpus = data_lib.load_corpus("wikitext_chars", config.data.data_dir)
  tokens = jnp.asarray(corpus.splits["valid"][:2 * 4 * 16].reshape(4, 32))
  memories = [model_lib.init_memory(lm.cfg, 4, 16) for lm in (gated_lm, export_lm)]
  for segment in (tokens[:, :16], tokens[:, 16:]):      # the second one uses memory
    gated_logp, memories[0] = gated_lm.apply(gated_vars, segment, memories[0],
                                             method=gated_lm.log_probs)
    export_logp, memories[1] = export_lm.apply(export_vars, segment, memories[1],
                                               method=export_lm.log_probs)
    np.testing.assert_allclose(export_logp, gated_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("persistent_group", [0, 4], ids=["heads", "heads_and_groups"])
def test_gates_frozen_bit_identical_while_params_train(data_dir, persistent_group):
  config = tiny_config(data_dir, num_steps=8)
  config.gates.update(dict(enabled=True, lam=0.1, freeze_step=3, l0_warmup_steps=0,
                           persistent_group=persistent_group))
  setup = assembly.run_setup(config)
  state = setup.new_state()
  step_fns = {sample: setup.train_step(sample_gates=sample) for sample in (True, False)}
  stream = data_lib.SegmentStream(data_lib.load_run_corpus(config).splits["train"], 4, 16)
  history = []
  for step in range(6):
    with sharding.activate(setup.mesh):
      state, _ = step_fns[step < 3](state, *map(jnp.asarray, next(stream)))
    history.append(jax.device_get(state.variables))
  leaves = lambda tree: jax.tree.leaves(tree)
  # Before the freeze gates move; from the freeze on they never change, bit for bit.
  assert any(np.any(a != b) for a, b in zip(leaves(history[0]["gates"]),
                                            leaves(history[1]["gates"])))
  for later in history[3:]:
    for a, b in zip(leaves(history[2]["gates"]), leaves(later["gates"])):
      np.testing.assert_array_equal(a, b)
  assert any(np.any(a != b) for a, b in zip(leaves(history[3]["params"]),
                                            leaves(history[5]["params"])))
  if persistent_group:   # the group gates train, under the L0 term, until the freeze
    groups = [h["gates"]["layer_0"]["attention"]["persistent_logits"] for h in history]
    assert groups[0].shape == (4, 16 // persistent_group)
    assert np.all(groups[2] != config.gates.init) and np.any(groups[1] != groups[2])
    np.testing.assert_array_equal(groups[2], groups[5])


def test_steps_from_the_freeze_on_are_frozen_steps_and_the_last_step_logs(tmp_path, capsys):
  """Gates frozen at step 2: the steps after it train without sampling or the L0 term,
  so no line after the freeze shows a penalty, and each says the heads kept; 5 steps
  logged every 2 end with a line for step 5."""
  text8 = data_fixtures.text8_data(tmp_path / "text8")
  config = tiny_config(text8["data_dir"], num_steps=5, log_every_steps=2)
  config.data.update(text8)
  config.gates.update(dict(enabled=True, lam=0.1, freeze_step=2, l0_warmup_steps=0))
  config.init_from = "none"
  config.eval.every_steps = 0
  train_run(config, tmp_path / "run")
  lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
  assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
  assert "penalty" in lines[0]
  assert not any("penalty" in line for line in lines[1:]), lines
  # Sampled up to the freeze, then the heads kept.
  assert "expected" in lines[0] and all("(frozen)" in line for line in lines[1:]), lines


def test_a_finished_runs_evaluation_is_redone_only_for_another_state_or_evaluation(tmp_path):
  """A rerun of a finished run takes its recorded final evaluation; another eval
  section, or a last step trained again (its checkpoint lost), evaluates anew."""
  text8 = data_fixtures.text8_data(tmp_path / "text8")
  config = tiny_config(text8["data_dir"], num_steps=4)
  config.data.update(text8)
  config.checkpoint.every_steps = 2
  config.eval.every_steps = 0
  workdir = tmp_path / "run"
  phases_file = workdir / loop.PHASES_FILE

  def rerun_with_a_marked_record(config):
    phases = json.loads(phases_file.read_text())
    phases["final"]["marker"] = 1.0
    phases_file.write_text(json.dumps(phases))
    return train_run(config, workdir)

  first = train_run(config, workdir)
  assert rerun_with_a_marked_record(config)["marker"] == 1.0
  config.eval.seq_len = 8
  again = rerun_with_a_marked_record(config)
  assert "marker" not in again and again["valid"] != first["valid"]
  shutil.rmtree(workdir / "checkpoints" / "4")
  assert "marker" not in rerun_with_a_marked_record(config)


@pytest.mark.parametrize("persistent_group", [None, 4], ids=["baseline", "groups_pruned"])
def test_resume_continues_exactly(tmp_path, persistent_group):
  """Restarting from a mid-run checkpoint ends with bit-identical parameters (and
  gates: a pruning run with persistent groups frozen between the two saves). On a
  text8 sample: each start ends by evaluating its whole splits."""
  text8 = data_fixtures.text8_data(tmp_path / "text8")
  config = tiny_config(text8["data_dir"], num_steps=10)
  config.data.update(text8)
  if persistent_group:
    config.gates.update(dict(enabled=True, lam=0.1, freeze_step=7, l0_warmup_steps=0,
                             persistent_group=persistent_group))
    config.init_from = "none"
  config.checkpoint.every_steps = 5
  config.eval.every_steps = 0
  train_run(config, tmp_path)
  uninterrupted = checkpointing.read_model(tmp_path)[1]
  # Lose the last checkpoint, as if the run had died after step 5, and restart it.
  shutil.rmtree(tmp_path / "checkpoints" / "10")
  train_run(config, tmp_path)
  resumed = checkpointing.read_model(tmp_path)[1]
  for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(a, b)
