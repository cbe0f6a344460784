"""Budgets: the rank rule at the freeze, the controller's count, a size from the
pipeline, stage reuse and the refusal of a run with changed settings."""
import dataclasses
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import data_fixtures
from helpers import train_run
from helpers import measured_speeds
from helpers import run_pipeline
from allatt_jax import api
from allatt_jax.pruning import budget
from allatt_jax.pruning import freeze
from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax.pruning import model_export
from allatt_jax.pruning import gate_values
from allatt_jax.model import gates as gates_lib
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import loop
from allatt_jax.training import optim
from allatt_jax.training import progress
from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.runs import workdir_checks
from allatt_jax.config.errors import CheckpointError
from allatt_jax.config.errors import ConfigError
from allatt_jax.reports import demo_report
from allatt_jax.reports import figures
from allatt_jax.experiments import plan as plan_lib
from allatt_jax.experiments import runs as runs_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r"^step +\d+/\d+ ", re.MULTILINE)   # a training step's line
CFG = model_lib.ModelConfig(vocab_size=27, num_layers=3, d_model=16, num_heads=4,
                            gated=True)


def gates_of(*layers):
  return {f"layer_{i}": {"attention": {"logits": np.array(l, np.float32)}}
          for i, l in enumerate(layers)}


def open_heads(cfg, gates):
  return [list(map(int, h)) for h in gate_values.read(cfg, gates).surviving_heads]


# --- The rank rule.

def test_too_many_open_heads_lose_the_lowest_logits():
  gates = gates_of([3.0, 0.5, -1.0, 2.0], [0.1, 4.0, 0.2, -2.0], [1.0, 1.5, -0.3, 0.4])
  assert sum(map(len, open_heads(CFG, gates))) == 9
  new, decision = freeze.keep_open_heads(CFG, gate_values.read(CFG, gates), 6)
  assert open_heads(CFG, new) == [[0, 1, 3], [1], [0, 1]]
  assert decision == {"allowed": 6, "by_gates": 9, "changed": 3, "opened": [],
                      "closed": [[1, 0], [1, 2], [2, 3]]}
  # Survivors keep their logits; only the reversed decisions move.
  np.testing.assert_array_equal(new["layer_0"]["attention"]["logits"], [3.0, 0.5, -1.0, 2.0])


def test_too_few_open_heads_gain_the_highest_closed_logits():
  gates = gates_of([-0.2, -3.0, 1.0, -1.0], [-0.1, -4.0, 2.0, -2.0], [-5, -5, -5, 3.0])
  new, decision = freeze.keep_open_heads(CFG, gate_values.read(CFG, gates), 5)
  assert open_heads(CFG, new) == [[0, 2], [0, 2], [3]]
  assert decision["by_gates"] == 3 and decision["changed"] == 2
  assert decision["opened"] == [[0, 0], [1, 0]] and decision["closed"] == []


def test_equal_logits_go_to_the_lower_layer_then_the_lower_head():
  gates = gates_of([2.0] * 4, [2.0] * 4, [2.0] * 4)
  new, decision = freeze.keep_open_heads(CFG, gate_values.read(CFG, gates), 6)
  assert open_heads(CFG, new) == [[0, 1, 2, 3], [0, 1], []]
  assert decision["changed"] == 6


def test_the_rule_changes_nothing_when_the_gates_agree_and_is_idempotent():
  gates = gates_of([3.0, -0.5, -1.0, 2.0], [0.1, 4.0, -0.2, -2.0], [1.0, -1.5, -0.3, 0.4])
  new, decision = freeze.keep_open_heads(CFG, gate_values.read(CFG, gates), 6)
  assert decision["changed"] == 0
  for i in range(3):
    np.testing.assert_array_equal(new[f"layer_{i}"]["attention"]["logits"],
                                  gates[f"layer_{i}"]["attention"]["logits"])
  once = freeze.keep_open_heads(CFG, gate_values.read(CFG, gates), 2)[0]
  again, decision = freeze.keep_open_heads(CFG, gate_values.read(CFG, once), 2)
  assert decision["changed"] == 0 and sum(map(len, open_heads(CFG, again))) == 2


def test_soft_gates_and_a_budget_out_of_range():
  soft = dataclasses.replace(CFG, gate=run_config.GatesSection(hard=False))
  # Soft gates are open down to σ(π) = 1/12 (π ≈ -2.4).
  gates = gates_of([-2.0, -3.0, 0.0, 1.0], [-4.0] * 4, [-4.0] * 4)
  new, decision = freeze.keep_open_heads(soft, gate_values.read(soft, gates), 2)
  assert decision["by_gates"] == 3 and open_heads(soft, new) == [[2, 3], [], []]
  # All 12 is a budget too (a sparsity of 0); 13 and -1 are none.
  new, decision = freeze.keep_open_heads(soft, gate_values.read(soft, gates), 12)
  assert decision["by_gates"] == 3 and sum(map(len, open_heads(soft, new))) == 12
  with pytest.raises(ConfigError, match="13 open heads does not fit a model of 12"):
    freeze.keep_open_heads(soft, gate_values.read(soft, gates), 13)
  with pytest.raises(ConfigError, match="-1 open heads does not fit a model of 12"):
    freeze.keep_open_heads(soft, gate_values.read(soft, gates), -1)


def test_the_budgets_line_says_whether_it_changed_the_gates_decisions():
  agreeing = gates_of([3.0, -0.5, -1.0, 2.0], [0.1, 4.0, -0.2, -2.0], [1.0, -1.5, -0.3, 0.4])
  penalty = lambda allowed: budget.Penalty(optax.constant_schedule(0.0), CFG.gate,
                                           allowed=allowed)
  line = freeze.keep_budgeted(CFG, gate_values.read(CFG, agreeing), penalty(6))[2]
  assert line == ("budget: the gates keep 6 of 12 heads at the freeze, the budget allows "
                  "6: kept as they are")
  line = freeze.keep_budgeted(CFG, gate_values.read(CFG, agreeing), penalty(4))[2]
  assert line.endswith(": 2 head decision(s) changed by logit rank (opened 0, closed 2)")


def test_heads_closed_by_index_are_closed_for_certain_with_soft_gates_too():
  """`read(closed=...)` (the API's prune_heads) closes a head whatever its logit, in
  soft mode too, where a logit just below 0 still leaves its gate open."""
  soft = dataclasses.replace(CFG, gate=run_config.GatesSection(hard=False))
  gates = gates_of([2.0] * 4, [2.0] * 4, [2.0] * 4)
  read = gate_values.read(soft, gates, closed={0: [1, 2], 2: [0]})
  assert read.head_values[0][1] == read.head_values[0][2] == read.head_values[2][0] == 0.0
  assert [list(h) for h in read.surviving_heads] == [[0, 3], [0, 1, 2, 3], [1, 2, 3]]
  np.testing.assert_array_equal(read.out_factors[0][[1, 2]], 0.0)


def test_gate_logits_of_another_shape_are_refused():
  gates = gates_of([[2.0] * 4], [2.0] * 4, [2.0] * 4)   # (1, 4), not (4,)
  with pytest.raises(CheckpointError, match=r"Gate logits of layer_0 have shape \(1, 4\), "
                     "but the config gives that layer 4 heads"):
    gate_values.read(CFG, gates)


# --- What the controller counts.

def test_the_count_sharpens_from_the_expected_count_after_the_warm_up():
  k = budget.sharpness_schedule(warmup_steps=200, freeze_step=1000, final=4.0)
  np.testing.assert_allclose([k(0), k(200), k(600), k(1000)], [1.0, 1.0, 2.5, 4.0])
  logits = [jnp.array([0.3, -0.2, 2.0]), jnp.array([-1.0, 0.5])]
  hard, soft = run_config.GatesSection(), run_config.GatesSection(hard=False)
  expected = sum(jnp.sum(jax.nn.sigmoid(l)) for l in logits)
  np.testing.assert_allclose(budget.expected_open(hard, logits), expected, rtol=1e-6)
  # Soft gates count P(g > 0), Louizos' open probability.
  np.testing.assert_allclose(
      budget.expected_open(soft, logits),
      sum(jnp.sum(gates_lib.open_probability(l, soft)) for l in logits), rtol=1e-6)
  # Sharper, the count nears the deterministic one (3 open heads here) ...
  sharp = [float(budget.expected_open(hard, logits, s)) for s in (1.0, 4.0, 50.0)]
  assert abs(sharp[0] - 3) > abs(sharp[1] - 3) > abs(sharp[2] - 3)
  assert sharp[2] == pytest.approx(3.0, abs=1e-3)
  # ... and its gradient moves to the heads nearest the decision.
  grad = jax.grad(lambda l: budget.expected_open(hard, l, 4.0))(logits)
  assert float(grad[0][1]) > float(grad[0][0]) > float(grad[1][1]) > float(grad[0][2])


def test_the_controller_steers_the_sharpened_count_after_the_target_warm_up():
  """`Penalty.of` gives the controller the count it steers: the expected count until
  the target warm-up ends, then sharper, k rising to `budget_sharpness` at the freeze."""
  gate = run_config.GatesSection(enabled=True, target_sparsity=0.5, freeze_step=100,
                                 budget_warmup_steps=60, budget_sharpness=10.0)
  penalty = budget.Penalty.of(gate, CFG.layer_heads, allowed=6)
  gates = gates_of([3.0, 0.5, -1.0, 2.0], [0.1, 4.0, 0.2, -2.0], [1.0, 1.5, -0.3, 0.4])
  variables = {"gates": gates}
  for step, k in ((30, 1.0), (60, 1.0), (80, 5.5), (100, 10.0)):
    np.testing.assert_allclose(penalty.open_count(variables, step),
                               budget.expected_open(gate, gates, k), rtol=1e-6)
  assert abs(float(penalty.open_count(variables, 80))
             - float(budget.expected_open(gate, gates))) > 0.1
  # Its target moves from the heads expected open at the gates' init (σ(π0) each,
  # not every head) to the 6 allowed over the warm-up, then stays.
  start = sum(CFG.layer_heads) * float(jax.nn.sigmoid(gate.init))
  np.testing.assert_allclose([penalty.target(s) for s in (0, 30, 60, 100)],
                             [start, (start + 6) / 2, 6.0, 6.0], rtol=1e-6)


@pytest.mark.slow
def test_one_ascent_step_raises_lambda_1_while_too_many_heads_are_open():
  config = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny")
  config.model.vocab_size = 27
  config.gates.update(config.experiments.prune_gates.to_dict())
  config.gates.target_sparsity = 0.5
  config.train.update(config.experiments.prune_train.to_dict())
  setup = assembly.run_setup(config)
  state = setup.new_state()
  step = config.gates.freeze_step - 1          # the target is n* = 4 of 8 by now
  gap = float(setup.penalty.open_count(state.variables, step)) - 4.0
  assert gap > 3.0                                # 8 heads at σ(2) ≈ 0.88 each
  grads = jax.grad(lambda v: setup.penalty(v, None, step))(state.variables)
  updates, _ = setup.optimizer.update(grads, state.opt_state, state.variables, step=step)
  multipliers = updates[budget.COLLECTION]
  # Gradient ascent: the update has the sign of ∂/∂λ1 = gap and ∂/∂λ2 = gap².
  assert float(multipliers["lambda_1"]) > 0 and float(multipliers["lambda_2"]) > 0


def test_an_ascent_step_moves_the_multipliers_by_the_rate_times_the_gap():
  """Plain gradient ascent, unclipped: λ1 += lr·gap, λ2 += lr·gap² (from 0); a
  positive gap raises λ1, which then pushes the gates shut; a negative one lowers
  it; nothing moves from the freeze on."""
  config = config_base.base_config()
  config.gates.update(dict(enabled=True, freeze_step=40, lagrangian_lr=0.01))
  config.train.grad_clip = 0.25      # the gaps' gradients are larger: not clipped
  gate = run_config.GatesSection()
  tx = optim.make_optimizer(config.train, optim.schedules(config), budget.COLLECTION)

  def step(logit, target, step, multipliers=None):
    penalty = budget.Penalty(optax.constant_schedule(0.0), gate,
                             target=optax.constant_schedule(target), allowed=int(target))
    variables = penalty.add_multipliers(
        {"params": {"w": jnp.ones((3,))},
         "gates": {"layer_0": {"attention": {"logits": jnp.full((4,), logit)}}}})
    if multipliers:
      variables[budget.COLLECTION] = {k: jnp.asarray(v) for k, v in multipliers.items()}
    gap = float(penalty.open_count(variables, step)) - target
    grads = jax.grad(lambda v: penalty(v, None, step))(variables)
    updates, _ = tx.update(grads, tx.init(variables), variables, step=jnp.int32(step))
    return gap, optax.apply_updates(variables, updates), updates

  gap, after, _ = step(2.0, 1.0, 10)             # 4 heads at σ(2) ≈ 0.88, 1 allowed
  assert gap == pytest.approx(4 * float(jax.nn.sigmoid(2.0)) - 1.0, rel=1e-6)
  multipliers = after[budget.COLLECTION]
  assert gap > 0 and float(multipliers["lambda_1"]) == pytest.approx(0.01 * gap, rel=1e-5)
  assert float(multipliers["lambda_2"]) == pytest.approx(0.01 * gap ** 2, rel=1e-5)
  # With λ1 > 0 the next step lowers every gate logit.
  _, _, updates = step(2.0, 1.0, 11, dict(lambda_1=1.0, lambda_2=0.0))
  assert np.all(np.asarray(updates["gates"]["layer_0"]["attention"]["logits"]) < 0)
  gap, after, _ = step(-2.0, 3.0, 10)            # too few open: λ1 falls, λ2 still rises
  assert gap < 0
  assert float(after[budget.COLLECTION]["lambda_1"]) == pytest.approx(0.01 * gap, rel=1e-5)
  assert float(after[budget.COLLECTION]["lambda_2"]) > 0
  _, after, _ = step(2.0, 1.0, 40)               # the freeze stops the multipliers
  assert float(after[budget.COLLECTION]["lambda_1"]) == 0.0


# --- A size through the pipeline; stages reused; settings never mixed.

def demo_config(data, **prune_gates):
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  config.data.update(data)
  config.pipeline.prune_gates.update(prune_gates)
  return config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """The data section's keys for a text8 sample, which the runs here train on: each
  stage ends by evaluating its whole splits, 2,000 characters here against the
  embedded corpus's 240,000. Its alphabet is the embedded corpus's (27 symbols)."""
  return data_fixtures.text8_data(tmp_path_factory.mktemp("text8"))


@pytest.fixture(scope="module")
def demo_baseline(tmp_path_factory, data):
  """The tiny demo's baseline stage, trained once: the pipelines below start from a
  copy of it, which they reuse (a pipeline's rerun reuses its baseline; tested below)."""
  workdir = tmp_path_factory.mktemp("demo_baseline")
  baseline = assembly.checked_pipeline(demo_config(data)).baseline
  train_run(baseline, workdir / "baseline")
  return workdir / "baseline"


def with_baseline(workdir, demo_baseline):
  shutil.copytree(demo_baseline, workdir / "baseline")
  return workdir


@pytest.fixture(scope="module")
def sized_demo(tmp_path_factory, demo_baseline, data):
  """The tiny demo asked for half its heads (its λ of 0.05 is replaced)."""
  workdir = with_baseline(tmp_path_factory.mktemp("sized"), demo_baseline)
  report = run_pipeline(demo_config(data, target_sparsity=0.5), workdir)
  return workdir, report


@pytest.mark.slow
def test_the_pipeline_prunes_to_the_size_asked_for(sized_demo):
  workdir, report = sized_demo
  pruned = report["pruned"]
  assert sum(pruned["heads_per_layer"]) == 4 and pruned["sparsity"] == 0.5
  assert pruned["lambda"] is None
  assert pruned["budget"]["key"] == "target_sparsity" and pruned["budget"]["allowed"] == 4
  decision = pruned["budget"]
  assert decision["changed"] == len(decision["opened"]) + len(decision["closed"])
  assert decision["by_gates"] + len(decision["opened"]) - len(decision["closed"]) == 4
  saved = run_files.load_config(workdir / "pruned")
  assert saved.gates.lam == 0.0 and saved.gates.target_sparsity == 0.5
  # Decided as the gates freeze, so every step after it trains the model at its size.
  recorded = json.loads((workdir / "pruned" / loop.BUDGET_FILE).read_text())
  assert recorded["step"] == saved.gates.freeze_step
  assert saved.model.vocab_size == 27          # taken from the dataset (demo: 0)
  # Export, results, the gate figure's marks and Model.costs() agree on the heads.
  gated = checkpointing.read_model(workdir / "pruned")[1]
  cfg = model_lib.ModelConfig.from_config(saved)
  kept = [len(h) for h in gate_values.read(cfg, gated["gates"]).surviving_heads]
  results = json.loads((workdir / "pruned" / "results.json").read_text())
  assert kept == pruned["heads_per_layer"] == results["export"]["heads_per_layer"]
  assert api.load(workdir / "pruned").costs()["heads_per_layer"] == kept
  export_config = run_files.load_config(workdir / "pruned" / "export")
  assert list(export_config.model.heads_per_layer) == kept
  # The figure's colours too: a hard gate's open probability is >= 1/2 iff it is kept.
  last = json.loads((workdir / "pruned" / "gate_history.jsonl").read_text()
                    .splitlines()[-1])
  assert [sum(p >= 0.5 for p in layer) for layer in last["open_prob"]] == kept
  # ... and after the freeze it draws the decision the history records with them.
  assert [sum(layer) for layer in last["decided"]] == kept


@pytest.mark.slow
def test_a_rerun_with_other_pruning_settings_reuses_the_baseline(sized_demo, data, capsys,
                                                                 tmp_path):
  workdir, _ = sized_demo
  baseline_files = {p: p.stat().st_mtime_ns for p in (workdir / "baseline").rglob("*")
                    if "checkpoints" in p.parts}
  saved_config = (workdir / "pruned" / "config.json").read_bytes()
  first_report = {name: (workdir / name).read_bytes() for name in ("report.json", "gates.png")}
  capsys.readouterr()
  report = run_pipeline(demo_config(data, target_sparsity=0.75), workdir)
  out = capsys.readouterr().out
  assert not PROGRESS.search(out.split("== Pruning")[0]), "the baseline trained again"
  assert {p: p.stat().st_mtime_ns for p in baseline_files} == baseline_files
  assert "gates.target_sparsity: 0.5 -> 0.75" in out
  assert report["pruned"]["directory"] == "pruned-2"
  # Its report goes beside the first result's, which stays as it was; the console
  # says where.
  assert f"its report to {workdir / 'report-2.json'} and {workdir / 'gates-2.png'}" in out
  assert json.loads((workdir / "report-2.json").read_text()) == report
  assert {name: (workdir / name).read_bytes() for name in first_report} == first_report
  # gates-2.png draws the gates of pruned-2.
  figures.gate_figure(workdir / "pruned-2", tmp_path / "drawn.png")
  assert (workdir / "gates-2.png").read_bytes() == (tmp_path / "drawn.png").read_bytes()
  assert sum(report["pruned"]["heads_per_layer"]) == 2
  assert (workdir / "pruned" / "config.json").read_bytes() == saved_config
  # The same settings again find their folder; an evaluation setting does not count.
  capsys.readouterr()
  config = demo_config(data, target_sparsity=0.5)
  config.eval.max_batches = 4
  report = run_pipeline(config, workdir)
  assert report["pruned"]["directory"] == "pruned"
  assert not PROGRESS.search(capsys.readouterr().out)     # nothing trained
  assert (workdir / "pruned" / "config.json").read_bytes() != saved_config   # eval key
  assert run_files.load_config(workdir / "pruned").gates.target_sparsity == 0.5


def test_gates_set_outside_the_pipeline_section_name_the_pipeline_flag(tmp_path):
  config = demo_config({})   # refused before any data is read
  config.gates.target_sparsity = 0.5
  with pytest.raises(ConfigError, match=r"Use --config.pipeline.prune_gates."
                                        r"target_sparsity=0.5 instead"):
    run_pipeline(config, tmp_path)
  assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_pruning_run_that_removes_nothing_says_so(tmp_path, demo_baseline, data, capsys):
  config = demo_config(data, lam=0.0)
  report = run_pipeline(config, with_baseline(tmp_path, demo_baseline))
  assert report["pruned"]["heads_per_layer"] == [4, 4]
  [warning] = report["warnings"]
  assert "pruning removed no head of 8" in warning
  assert "--config.pipeline.prune_gates.target_sparsity=0.5" in warning
  # Said at the export, and again under the summary table, the last thing printed.
  after_table = capsys.readouterr().out.split(demo_report.summary_table(report))[-1]
  assert f"warning: {warning}" in after_table


@pytest.mark.slow
def test_a_budget_whose_gates_freeze_with_the_last_step_is_saved_as_decided(
    tmp_path, demo_baseline, data, monkeypatch, capsys):
  """Gates that freeze with the last step are decided on the final state before it is
  saved: every reader of the run's folder sees the export's heads, and a rerun decides
  nothing new."""
  config = demo_config(data, target_sparsity=0.5, freeze_step=30)
  assert config.pipeline.prune_train.num_steps == 30
  report = run_pipeline(config, with_baseline(tmp_path, demo_baseline))
  run = tmp_path / "pruned"
  recorded = json.loads((run / loop.BUDGET_FILE).read_text())
  assert recorded["step"] == 30 and recorded["changed"] > 0
  exported = report["pruned"]["heads_per_layer"]
  assert sum(exported) == 4
  # The last checkpoint: load, costs --checkpoint, plots.
  assert list(api.load(run).heads_per_layer) == exported
  assert list(model_export.trained_model_config(run)[1].layer_heads) == exported
  drawn = []
  monkeypatch.setattr(figures, "_draw_gates", lambda records, kept, *args: drawn.append(
      [len(heads) for heads in kept]))
  figures.gate_figure(run, tmp_path / "gates.png")
  assert drawn == [exported]
  # A rerun decides again on the saved state: nothing changes, nothing is said.
  capsys.readouterr()
  assert run_pipeline(config, tmp_path)["pruned"]["heads_per_layer"] == exported
  assert "budget:" not in capsys.readouterr().out
  assert json.loads((run / loop.BUDGET_FILE).read_text()) == recorded


@pytest.mark.slow
def test_a_resume_with_changed_settings_is_refused(tmp_path, data):
  config = demo_config(data)
  baseline = assembly.checked_pipeline(config).baseline
  baseline = dataclasses.replace(
      run_config.derived_run(baseline, train=dict(num_steps=10)),
      checkpoint=dataclasses.replace(baseline.checkpoint, every_steps=5))
  train_run(baseline, tmp_path / "run")
  saved = (tmp_path / "run" / "config.json").read_bytes()
  changed = run_config.derived_run(baseline, train=dict(learning_rate=0.01),
                                   model=dict(dropout=0.1))
  with pytest.raises(ConfigError, match=(
      r"holds a run trained with other settings \(model.dropout: 0.0 -> 0.1; "
      r"train.learning_rate: 0.003 -> 0.01\)")):
    train_run(changed, tmp_path / "run")
  assert (tmp_path / "run" / "config.json").read_bytes() == saved
  # More steps and another evaluation cadence are a legitimate resume.
  longer = dataclasses.replace(run_config.derived_run(baseline, train=dict(num_steps=15)),
                               eval=dataclasses.replace(baseline.eval, every_steps=5))
  train_run(longer, tmp_path / "run")
  assert run_files.load_config(tmp_path / "run").train.num_steps == 15


@pytest.mark.slow
def test_a_finished_experiment_run_is_not_reused_for_other_settings(tmp_path, data):
  config = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny")
  config.data.update(data)
  config.train.num_steps = 5
  experiment = lambda: runs_lib.Experiment(
      assembly.checked_config(config), plan_lib.from_section(config.experiments.to_dict()),
      tmp_path)
  experiment().baseline()
  config.train.learning_rate = 0.01
  with pytest.raises(ConfigError, match=r"train.learning_rate: 0.003 -> 0.01"):
    experiment().baseline()


def _compared(stages, pruned_heads):
  """`demo_report.compare_models`' figures of the tiny demo's baseline and of the
  same model with `pruned_heads`, the speeds made up."""
  cfg = model_lib.ModelConfig.from_config(
      run_config.derived_run(stages.baseline, model=dict(vocab_size=27)))
  e = stages.baseline.eval
  compared = {}
  for name, model_cfg in (("baseline", cfg),
                          ("pruned", dataclasses.replace(cfg, heads_per_layer=pruned_heads))):
    compared[name] = {"heads_per_layer": list(model_cfg.layer_heads),
                      "persistent_per_layer": model_cfg.layer_slots,
                      **cost_model.param_counts(model_cfg),
                      **cost_model.macs_per_token(model_cfg, e.seq_len, e.mem_len,
                                                  e.batch_size)}
  compared["speed"] = measured_speeds(1000.0, 1500.0)
  return compared


def _table_rows(report):
  """{row label: [baseline cell, pruned cell]} of the demo's summary table."""
  return {row.split(" | ")[0].strip(): [c.strip() for c in row.split(" | ")[1:]]
          for row in demo_report.summary_table(report).splitlines()[3:]}


def _stage_results(decision):
  scores = {"valid": 2.5, "test": 2.4}
  return {"metric": "bpc", **scores}, {**scores, "export": {
      **scores, "budget": decision, "warnings": []}}


def test_a_size_given_as_a_fraction_is_reported_in_full_with_the_cost_met():
  stages = assembly.checked_pipeline(demo_config({}, target_macs=0.5))
  unpruned = cost_model.unpruned_cost(stages.pruning, model_lib.ModelConfig.from_config(
      stages.pruning))
  assert stages.pruning.gates.target_macs == 0.5 * unpruned
  compared = _compared(stages, (2, 2))
  baseline, pruned = _stage_results(dict(allowed=4, by_gates=4, changed=0, opened=[],
                                         closed=[]))
  report = demo_report.build(stages.baseline, stages.pruning, pathlib.Path("pruned"),
                             baseline, pruned, compared)
  met = compared["pruned"]["macs_per_token_non_embedding"]
  assert report["pruned"]["budget"] == {
      "key": "target_macs", "asked": 0.5, "value": 0.5 * unpruned, "unpruned": unpruned,
      "cost": met, "step": None, "allowed": 4, "by_gates": 4, "groups": None,
      "groups_by_gates": None, "changed": 0, "opened": [], "closed": []}
  rows = _table_rows(report)
  ratio = compared["pruned"]["macs_per_token"] / compared["baseline"]["macs_per_token"]
  assert rows["MACs per token"] == ["1.00", f"{ratio:.2f}"]      # with the output layer
  assert rows["MACs/token (non-emb.)"] == [f"{unpruned:,.0f}",
                                           f"{met:,.0f} ({met / unpruned:.2f})"]
  assert rows["budget target_macs"] == ["", f"0.5 ({0.5 * unpruned:,.0f})"]
  params = [compared[m]["params_non_embedding"] for m in ("baseline", "pruned")]
  assert rows["params (non-emb.)"] == [f"{params[0]:,}",
                                       f"{params[1]:,} ({params[1] / params[0]:.2f})"]
  # A sparsity: the heads it keeps, and the sparsity met; the same keys.
  stages = assembly.checked_pipeline(demo_config({}, target_sparsity=0.5))
  sparsity = demo_report.build(stages.baseline, stages.pruning, pathlib.Path("pruned"),
                               baseline, pruned, compared)
  assert sparsity["pruned"]["budget"].keys() == report["pruned"]["budget"].keys()
  assert (sparsity["pruned"]["budget"]["unpruned"], sparsity["pruned"]["budget"]["cost"],
          sparsity["pruned"]["budget"]["asked"]) == (0.0, 0.5, 0.5)
  assert _table_rows(sparsity)["budget target_sparsity"] == ["", "0.5 (4 heads)"]
  # A figure asked as such: shown once.
  stages = assembly.checked_pipeline(demo_config({}, target_macs=float(met)))
  figure = demo_report.build(stages.baseline, stages.pruning, pathlib.Path("pruned"),
                             baseline, pruned, compared)
  assert figure["pruned"]["budget"].keys() == report["pruned"]["budget"].keys()
  assert _table_rows(figure)["budget target_macs"] == ["", f"{met:,.0f}"]


# --- The vocabulary from the data.

def test_vocab_size_comes_from_the_dataset_and_a_wrong_one_names_the_right(data):
  config = assembly.checked_pipeline(demo_config(data)).baseline
  assert config.model.vocab_size == 0
  completed, corpus = assembly.completed_config(assembly.checked_config(config))
  assert completed.model.vocab_size == corpus.vocab_size == 27
  with pytest.raises(ConfigError, match=r"set --config.model.vocab_size=27, or 0"):
    assembly.completed_config(run_config.derived_run(config, model=dict(vocab_size=30)))


def test_controller_settings_count_only_for_a_budget_run():
  config = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny")
  config.gates.update(config.experiments.prune_gates.to_dict())
  config.gates.lam = 0.2
  other = config.copy_and_resolve_references()
  other.gates.budget_sharpness = 3.0
  assert workdir_checks.setting_differences(config, other) == []      # a fixed-λ run
  for c in (config, other):
    c.gates.update(dict(lam=0.0, target_sparsity=0.5))
  assert workdir_checks.setting_differences(config, other) == [
      "gates.budget_sharpness: 10.0 -> 3.0"]


def test_pruning_warnings_name_the_budget_and_its_value():
  """A budget that allows every head, and one the gates ended far from, are said with
  the budget's flag and value (read from the typed run config)."""
  config = config_base.base_config()
  config.model.vocab_size = 27
  config.gates.update(dict(enabled=True, target_sparsity=0.0, freeze_step=100))
  setup = assembly.run_setup(config)
  total = sum(setup.lm.cfg.layer_heads)
  everything = dict(allowed=total, by_gates=total, changed=0)
  [warning] = model_export.pruning_warnings(setup.run, total, total, everything,
                                            "--config.gates")
  assert f"--config.gates.target_sparsity=0 allows all {total} heads" in warning
  far = dict(allowed=total // 2, by_gates=total, changed=total // 2)
  [warning] = model_export.pruning_warnings(setup.run, total, total // 2, far,
                                            "--config.gates")
  assert "--config.gates.freeze_step (now 100" in warning
  assert "--config.gates.budget_warmup_steps (now 60)" in warning
  assert "with --config.train.num_steps after it" in warning
  # A pipeline's pruning stage names its own sections' flags.
  [warning] = model_export.pruning_warnings(setup.run, total, total // 2, far,
                                            "--config.pipeline.prune_gates")
  assert ("--config.pipeline.prune_gates.freeze_step (now 100, with "
          "--config.pipeline.prune_train.num_steps after it)") in warning, warning
  # What each number is: the gates' own count, the budget's, the decisions reversed.
  assert (f"the gates alone kept {total} heads at the freeze, far from the budget's "
          f"{total // 2}: to keep exactly those, the budget reversed {total // 2} of the "
          "gates' decisions by logit rank.") in warning
  empty = dict(allowed=0, by_gates=total, changed=total)
  [warning] = model_export.pruning_warnings(setup.run, total, 0, empty,
                                            "--config.gates")
  assert f"keeps none of the {total} heads (--config.gates.allow_empty=True)" in warning
  [warning] = model_export.pruning_warnings(setup.run, total, 0, None, "--config.gates")
  assert f"pruning removed every one of the {total} heads" in warning
  # Far is a tenth of the heads, at least 2 (here 2), between the gates' count and
  # the budget's.
  assert total == 8
  for off, warned in ((1, False), (2, True)):
    decision = dict(allowed=total // 2, by_gates=total // 2 + off, changed=off)
    assert bool(model_export.pruning_warnings(setup.run, total, total // 2, decision,
                                              "--config.gates")) == warned, off
  # Of 40 heads (WikiText-103's 16 layers hold 128), a tenth is more than 2.
  for off, warned in ((3, False), (4, True)):
    decision = dict(allowed=20, by_gates=20 + off, changed=off)
    assert bool(model_export.pruning_warnings(setup.run, 40, 20, decision,
                                              "--config.gates")) == warned, off
  # A fixed λ that removed no head says so; one that removed some says nothing.
  [warning] = model_export.pruning_warnings(setup.run, total, total, None, "--config.gates")
  assert f"pruning removed no head of {total}" in warning
  assert model_export.pruning_warnings(setup.run, total, total - 1, None,
                                       "--config.gates") == []


def test_group_budget_warnings_say_what_the_budget_left_and_how_far_the_gates_were():
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")   # 2 x 4 heads, N = 16
  config.gates.update(dict(enabled=True, persistent_group=4, target_macs=1000.0))
  run = run_config.RunConfig.of(config)
  flags, groups = "--config.gates", 8 * 16 // 4
  warnings = lambda **decision: model_export.pruning_warnings(
      run, 8, decision["allowed"], {"budget": 1000.0, "cost": 1000.0, "changed": 1,
                                    "cost_by_gates": 1000.0, **decision}, flags)
  [warning] = warnings(allowed=8, groups=groups)
  assert f"{flags}.target_macs=1,000 allows all 8 heads and {groups} persistent" in warning
  assert warnings(allowed=8, groups=groups - 1) == []
  [warning] = warnings(allowed=0, groups=0)
  assert f"keeps none of the 8 heads ({flags}.allow_empty=True)" in warning
  # Heads kept with every group they hold: the heads alone met the budget.
  [warning] = warnings(allowed=6, groups=24, by_gates=7, groups_by_gates=20)
  assert (f"the budget {flags}.target_macs=1,000 kept 6 of 8 heads, each with all its "
          "persistent slots: no persistent group was pruned (the gates alone kept 20 "
          "groups of their 7 heads), so the heads alone met the budget. To prune "
          f"persistent groups rather than heads, gate the groups alone: {flags}.heads="
          "False.") == warning
  # Far is a tenth of the budget between what the gates kept and what the budget did.
  assert warnings(allowed=6, groups=10, cost_by_gates=1099.0) == []
  [warning] = warnings(allowed=6, groups=10, cost_by_gates=1100.0)
  assert ("the gates alone kept a model of 1,100 at the freeze, far from the budget's "
          "1,000: to fit it, the budget reversed 1 of the gates' decisions") in warning


def test_the_progress_line_tells_the_expected_open_heads_from_the_decision():
  summary = {"bpc": 2.5, "nll": 1.7, "open_actual/total": 19.4, "lambda": 0.05}
  sampled = progress.progress_line(1000, 1500, 10.0, summary, "bpc", 32, 15)
  assert sampled.endswith("heads open 19.4/32 expected, 15 decided  λ 0.05"), sampled
  frozen = progress.progress_line(1100, 1500, 10.0, summary, "bpc", 32, 15, frozen=True)
  assert frozen.endswith("heads kept 15/32 (frozen)  λ 0.05"), frozen
