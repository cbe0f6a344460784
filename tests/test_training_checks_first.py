"""Every stage of a pipeline and every run of an experiment suite is checked before the
first step of the first: ranges, names, budgets and their reachability. The errors
name the flag as the user sets it for that config (`--config.pipeline.prune_gates.lam`,
`--config.experiments.lambdas`), and a budget that no head count meets, or one that
keeps no head, is refused with the nearest budget that is met.
"""
import math
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from allatt_jax.config import config_base
from allatt_jax.pruning import cost_model
from allatt_jax.pruning import freeze
from allatt_jax.pruning import gate_values
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import assembly
from allatt_jax.training import pipeline
from allatt_jax.config import run_config
from allatt_jax.config.errors import ConfigError
from allatt_jax.experiments import __main__ as cli
from allatt_jax.experiments import plan as plan_lib
from allatt_jax.experiments import runs as runs_lib
from allatt_jax.training import config_checks
from allatt_jax.training import loop

ROOT = pathlib.Path(__file__).resolve().parents[1]
GATES, TRAIN, DISTILL = ("--config.pipeline.prune_gates", "--config.pipeline.prune_train",
                         "--config.pipeline.prune_distill")


def demo(section: str = "", **keys):
  """configs/demo.py:tiny (2 layers of 4 heads; 30 pruning steps, gates frozen at 15)
  with `keys` of its pipeline `section`."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  if section:
    config.pipeline[section].update(keys)
  return config


def run_of_demo(**sections):
  """configs/demo.py:tiny's baseline run (2 layers of 4 heads, 30 steps, a vocabulary
  of 27) with `sections`' keys."""
  config = demo()
  config.model.vocab_size = 27
  for name, keys in sections.items():
    config[name].update(keys)
  return run_config.RunConfig.of(config)


# The last value each check lets through, then the first it refuses.
@pytest.mark.parametrize("accepted, refused, named", [
    (dict(distill=dict(weight=1.0)), dict(distill=dict(weight=1.01)),
     r"distill.weight=1.01 is out of range: the cross-entropy's weight 1 − α would be "
     r"negative"),
    (dict(gates=dict(enabled=True, freeze_step=30)),
     dict(gates=dict(enabled=True, freeze_step=31)),
     r"gates.freeze_step=31 is beyond config.train.num_steps=30"),
    (dict(model=dict(heads_per_layer=(4, 0))), dict(model=dict(heads_per_layer=(4, 5))),
     r"heads_per_layer=\(4, 5\) needs one count in \[0, num_heads=4\] per layer "
     r"\(num_layers=2\)"),
    (dict(model=dict(heads_per_layer=(4, 0))), dict(model=dict(heads_per_layer=(4,))),
     r"heads_per_layer=\(4,\) needs one count"),
    (dict(model=dict(cutoffs=(10,), cluster_fractions=(0.0, 1.0))),
     dict(model=dict(cutoffs=(10,), cluster_fractions=(1.0,))),
     r"cluster_fractions=\(1.0,\) needs one share in \[0, 1\] per cluster of the adaptive "
     r"softmax \(cutoffs \(10,\): 2\)"),
    (dict(model=dict(cutoffs=(10,), cluster_fractions=(0.0, 1.0))),
     dict(model=dict(cutoffs=(10,), cluster_fractions=(-0.5, 1.5))),
     r"cluster_fractions=\(-0.5, 1.5\) needs one share in \[0, 1\]"),
    (dict(model=dict(kind="txl", d_ff=1)), dict(model=dict(kind="txl", d_ff=0)),
     r"model.d_ff=0 but a 'txl' model has a feed-forward sub-layer"),
    (dict(model=dict(dtype="bfloat16")), dict(model=dict(dtype="int32")),
     r"model.dtype='int32' is not a float dtype"),
    (dict(gates=dict(temperature=1e-3)), dict(gates=dict(temperature=0.0)),
     r"gates.temperature=0.0 is out of range: the hard-concrete gates divide"),
    (dict(gates=dict(enabled=True, freeze_step=15, target_sparsity=0.5)),
     dict(gates=dict(enabled=True, freeze_step=15, target_sparsity=0.5, target_params=9e3)),
     r"set at most one budget target"),
], ids=["distill_weight", "freeze_step", "heads_per_layer", "heads_per_layer_count",
        "cluster_fraction_count", "cluster_fraction_range", "txl_d_ff", "dtype",
        "gate_temperature", "budget_targets"])
def test_each_check_lets_its_edge_through_and_names_what_is_past_it(accepted, refused,
                                                                    named):
  config_checks.check_config(run_of_demo(**accepted), 1)
  with pytest.raises(ConfigError, match=named):
    config_checks.check_config(run_of_demo(**refused), 1)


@pytest.mark.parametrize("init_from", ["", run_config.FROM_SCRATCH])
def test_a_distilling_run_without_a_teacher_is_refused(init_from):
  config = run_config.derived_run(run_of_demo(distill=dict(weight=0.5)), init_from=init_from)
  with pytest.raises(ConfigError, match=r"^config.distill \(weight=0.5, hidden_weight=0.0\) "
                     r"asks to learn from a teacher.*--config.distill.weight=0"):
    config_checks.check_starting_point(config)
  config_checks.check_starting_point(run_config.derived_run(config, init_from="/baseline"))


@pytest.mark.parametrize("section, keys, named", [
    ("prune_gates", dict(lam=-0.1),
     [f"{GATES[2:]}.lam=-0.1 is out of range", f"Set {GATES}.lam to a value >= 0"]),
    ("prune_gates", dict(l0_warmup_steps=-1), [f"Set {GATES}.l0_warmup_steps"]),
    ("prune_gates", dict(temperature=0.0), [f"{GATES[2:]}.temperature=0.0"]),
    ("prune_gates", dict(freeze_step=100),
     [f"Set {GATES}.freeze_step to at most 30", f"raise {TRAIN}.num_steps"]),
    ("prune_train", dict(num_steps=10),
     [f"{GATES[2:]}.freeze_step=15 is beyond {TRAIN[2:]}.num_steps=10"]),
    ("prune_train", dict(learning_rate=-1.0), [f"Set {TRAIN}.learning_rate"]),
    ("prune_gates", dict(target_sparsity=1.2),
     [f"{GATES[2:]}.target_sparsity=1.2 is out of range", "in [0, 1]",
      f"{GATES}.target_sparsity=0.875 (1 of 8 heads)", f"{GATES}.allow_empty=True"]),
    ("prune_gates", dict(target_sparsity=-0.2),
     [f"{GATES[2:]}.target_sparsity=-0.2 is out of range",
      f"{GATES}.target_sparsity=0 (8 of 8 heads)"]),
    ("prune_gates", dict(target_sparsity=0.5, target_macs=1000.0),
     [f"{GATES[2:]} sets ['target_sparsity', 'target_macs']", "at most one"]),
    # No head leaves no MACs at all; a budget of 0 is none, so 1 MAC is the least.
    ("prune_gates", dict(target_macs=-5.0),
     [f"{GATES[2:]}.target_macs=-5.0 is not positive",
      f"to remove every head, {GATES}.target_macs=1 with {GATES}.allow_empty=True"]),
    ("prune_distill", dict(weight=1.5),
     [f"{DISTILL[2:]}.weight=1.5 is out of range", f"Set {DISTILL}.weight"]),
    ("prune_distill", dict(temperature=0.0), [f"Set {DISTILL}.temperature to a value > 0"]),
    ("prune_distill", dict(hidden_weight=-1.0), [f"Set {DISTILL}.hidden_weight"]),
    ("prune_distill", dict(kl_clusters="tail"), [f"{DISTILL[2:]}.kl_clusters='tail'"]),
])
def test_the_pruning_stage_is_checked_with_the_baseline_naming_its_flags(section, keys,
                                                                         named):
  with pytest.raises(ConfigError) as error:
    assembly.checked_pipeline(demo(section, **keys))
  message = str(error.value)
  for text in named:
    assert text in message, message
  assert "--config.gates." not in message and "--config.distill." not in message, message


def test_a_pruning_stage_that_turns_its_gates_off_is_refused():
  with pytest.raises(ConfigError, match=r"^config\.pipeline\.prune_gates\.enabled=False, "
                     r"but this is a pruning run, which trains the L0 gates\. Leave it True"):
    assembly.checked_pipeline(demo("prune_gates", enabled=False))


def test_a_key_the_pipeline_section_leaves_keeps_the_baselines_flag():
  config = demo("prune_gates", freeze_step=40)
  with config.unlocked():   # the pruning stage then trains the baseline's steps
    del config.pipeline.prune_train["num_steps"]
  with pytest.raises(ConfigError, match=(
      rf"^config.pipeline.prune_gates.freeze_step=40 is beyond config.train.num_steps=30"
      rf".* Set {GATES}.freeze_step to at most 30, or raise --config.train.num_steps ")):
    assembly.checked_pipeline(config)


@pytest.mark.parametrize("keys, named", [
    # 8 heads: 1% of them is none.
    (dict(target_sparsity=0.99),
     ["target_sparsity=0.99 leaves none of the model's 8 heads", "rarely what anyone",
      f"{GATES}.target_sparsity=0.875 (1 of 8 heads)",
      f"add {GATES}.allow_empty=True"]),
    # Below what no head holds: W_O's bias of each of 2 layers of width 32.
    (dict(target_params=10),
     ["target_params=10 (read as a count of non-embedding parameters; a fraction of the "
      "unpruned model's 12,608 is a value below 1) is below the 64 non-embedding "
      "parameters that no head holds",
      f"{GATES}.target_params=1744 (1 of 8 heads)",
      f"{GATES}.target_params=64 with {GATES}.allow_empty=True"]),
    (dict(target_params=10, allow_empty=True),
     ["below the 64 non-embedding parameters", f"{GATES}.target_params=64 (0 of 8 heads)"]),
    (dict(target_params=1000), ["target_params=1000 (read as a count of non-embedding "
                                "parameters; a fraction of the unpruned model's 12,608 "
                                "is a value below 1) leaves none of the model's 8 heads",
                                f"{GATES}.target_params=1744 (1 of 8 heads)"]),
    # MACs per token at the eval shape: a head's persistent keys and values (2·16·32·8
    # MACs a step) are shared by the batch's 64 × 16 tokens.
    (dict(target_macs=100.0), ["leaves none", f"{GATES}.target_macs=2568 (1 of 8 heads)"]),
])
def test_a_budget_that_no_head_count_meets_or_that_keeps_none_is_refused(keys, named):
  with pytest.raises(ConfigError) as error:
    assembly.checked_pipeline(demo("prune_gates", **keys))
  for text in named:
    assert text in str(error.value), str(error.value)


@pytest.mark.parametrize("sections, named", [
    # A size asked of a run without gates, which would train the baseline unpruned.
    (dict(gates=dict(target_sparsity=0.5)),
     "config.gates.target_sparsity=0.5 asks a pruning run for a size, but "
     "config.gates.enabled is False. Set --config.gates.enabled=True"),
    # An export of pruned persistent groups: its heads cost different amounts.
    (dict(gates=dict(enabled=True, freeze_step=20, target_params=2000),
          model=dict(persistent_slots=((16, 8, 16, 16), (16, 16, 16, 16)))),
     "config.gates.target_params=2000.0: a budget counts heads of equal cost, but this "
     "model's heads keep different numbers of persistent vectors"),
    # 1 is a count, not the fraction 1 of the unpruned model: named as it was given,
    # read as a count, and a fraction said to be a value below 1.
    (dict(gates=dict(enabled=True, freeze_step=20, target_params=1)),
     "config.gates.target_params=1 (read as a count of non-embedding parameters; a "
     "fraction of the unpruned model's 12,608 is a value below 1) is below the 64 "
     "non-embedding parameters"),
    (dict(gates=dict(enabled=True, freeze_step=20, target_macs=1.5)),
     "config.gates.target_macs=1.5 (read as a count of non-embedding MACs per token; a "
     "fraction of the unpruned model's 20,544 is a value below 1) leaves none of the "
     "model's 8 heads"),
    # Below 0 the nearest sparsity met keeps every head.
    (dict(gates=dict(enabled=True, freeze_step=20, target_sparsity=-0.25)),
     "target_sparsity=-0.25 is out of range: it is the fraction of the model's 8 heads to "
     "remove, in [0, 1]. The nearest budget that is met: --config.gates.target_sparsity=0 "
     "(8 of 8 heads)."),
])
def test_a_single_runs_budget_is_refused_with_the_fix(sections, named):
  with pytest.raises(ConfigError) as error:
    config_checks.check_config(run_of_demo(**sections), 1)
  assert named in str(error.value), str(error.value)


@pytest.mark.parametrize("keys", [dict(target_sparsity=0.99), dict(target_sparsity=1.0),
                                  dict(target_params=64), dict(target_params=1000)])
def test_an_empty_model_is_made_when_asked_for(keys):
  pruning = assembly.checked_pipeline(demo("prune_gates", allow_empty=True, **keys)).pruning
  assert pruning.gates.allow_empty
  assert cost_model.target_open_heads(pruning,
                                      model_lib.ModelConfig.from_config(pruning)) == 0


def test_the_nearest_budgets_named_are_met():
  """Each value an error proposes keeps the heads it says, and what is left with no
  head is the real parameter count of a model without heads."""
  config = run_config.RunConfig.of(demo())
  config = run_config.derived_run(config, model=dict(vocab_size=27))
  cfg = model_lib.ModelConfig.from_config(config)
  for key, value in (("target_sparsity", 0.5), ("target_params", 5000),
                     ("target_macs", 5000.0)):
    budget = run_config.derived_run(config, gates=dict(enabled=True, **{key: value}))
    scale = cost_model.BudgetScale.of(budget, cfg)
    for heads in range(9):
      assert scale.heads(float(scale.value_for(heads))) == heads, (key, heads)
  empty = dataclasses.replace(cfg, heads_per_layer=(0, 0))
  params = run_config.derived_run(config, gates=dict(enabled=True, target_params=1))
  assert (cost_model.BudgetScale.of(params, cfg).empty
          == cost_model.param_counts(empty)["params_non_embedding"] == 64)


def test_a_budget_run_says_first_the_size_it_prunes_to():
  config = demo()
  config.model.vocab_size = 27
  config.gates.update(dict(enabled=True, freeze_step=20, target_params=0.5))
  config.init_from = "none"   # from scratch: no model to read
  corpus = types.SimpleNamespace(vocab_size=27, splits={"train": np.arange(100) % 27})
  note = assembly.prepared_run(assembly.checked_config(config), corpus).note
  assert note == ("Budget target_params=0.5: 6,304 non-embedding parameters, that "
                  "fraction of the unpruned model's 12,608."), note


def test_the_pruning_stages_banner_names_its_goal():
  goal = lambda **keys: pipeline._pruning_goal(
      assembly.checked_pipeline(demo("prune_gates", **keys)).pruning)
  assert goal(lam=0.05) == "λ=0.05"
  assert goal(target_sparsity=0.5) == "target_sparsity=0.5: 4 of 8 heads"
  assert goal(target_params=5000) == "target_params=5,000: 3 of 8 heads"
  # A fraction as it was asked, beside the figure it stands for.
  assert goal(target_params=0.4) == "target_params=0.4 (5,043): 3 of 8 heads"
  groups = "groups of 8 persistent slots"
  assert goal(lam=0.05, persistent_group=8) == f"λ=0.05 over heads and {groups}"
  assert goal(lam=0.05, persistent_group=8, heads=False) == f"λ=0.05 over {groups}"
  assert goal(target_params=11000, persistent_group=8, heads=False) == (
      f"target_params=11,000 over {groups}")


def test_a_size_in_0_1_is_that_fraction_of_the_unpruned_models():
  """target_params and target_macs in (0, 1) are fractions of the unpruned model's
  non-embedding count, as target_sparsity is of its heads: the checked config holds
  the figure, which the budget's checks, the run and its first lines use."""
  cfg = model_lib.ModelConfig.from_config(
      run_config.derived_run(run_config.RunConfig.of(demo()), model=dict(vocab_size=27)))
  e = demo().eval
  params = cost_model.param_counts(cfg)["params_non_embedding"]
  macs = cost_model.macs_per_token(cfg, e.seq_len, e.mem_len,
                                   e.batch_size)["macs_per_token_non_embedding"]
  pruning = assembly.checked_pipeline(demo("prune_gates", target_params=0.5)).pruning
  assert pruning.gates.target_params == params // 2 == 6304
  pruning = assembly.checked_pipeline(demo("prune_gates", target_macs=0.5)).pruning
  assert pruning.gates.target_macs == 0.5 * macs
  assert cost_model.target_open_heads(pruning, cfg) == 4
  assert cost_model.budget_note(pruning, cfg) == (
      f"Budget target_macs=0.5: {macs / 2:,.0f} non-embedding MACs per token, that "
      f"fraction of the unpruned model's {macs:,.0f}.")
  assert pruning.gates.budget_fraction == 0.5
  # Resolved again (a checked config checked once more), it keeps what was asked.
  assert assembly.checked_config(pruning).gates.budget_fraction == 0.5
  # A whole count is a count, as before.
  pruning = assembly.checked_pipeline(demo("prune_gates", target_params=5000)).pruning
  assert pruning.gates.target_params == 5000 and pruning.gates.budget_fraction is None
  assert cost_model.budget_note(pruning, cfg) == (
      "Budget target_params=5,000 non-embedding parameters: 0.40 of the unpruned model's "
      "12,608.")
  # The checks apply to the figure, and say what the fraction stood for.
  with pytest.raises(ConfigError, match=(
      rf"target_macs=0.01 \(0.01 of the unpruned model's {macs:,.0f}: {macs / 100:,.0f}\) "
      "leaves none of the model's 8 heads")):
    assembly.checked_pipeline(demo("prune_gates", target_macs=0.01))


def _tiny_demo(workdir, *flags):
  """`python -m allatt_jax.main` on the tiny demo with `flags`, as a user runs it."""
  return subprocess.run(
      [sys.executable, "-m", "allatt_jax.main", "--config=configs/demo.py:tiny",
       f"--workdir={workdir}", *flags],
      capture_output=True, text=True, cwd=ROOT, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_a_fraction_is_read_from_the_flag_and_checked_as_its_figure(tmp_path):
  result = _tiny_demo(tmp_path / "run", f"{GATES}.target_params=0.001")
  assert result.returncode == 2, result.stderr
  assert (f"error: {GATES[2:]}.target_params=0.001 (0.001 of the unpruned model's "
          "12,608: 12) is below the 64 non-embedding parameters") in result.stderr


def test_a_pipeline_with_a_bad_pruning_key_stops_before_the_baseline(tmp_path):
  result = _tiny_demo(tmp_path / "run", f"{GATES}.target_sparsity=1.2")
  assert result.returncode == 2, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and f"{GATES}.target_sparsity=0.875" in errors[0], result.stderr
  assert "Baseline" not in result.stdout and not (tmp_path / "run").exists()


# --- Experiments: every run of the suites asked for.

@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
  config = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny")
  config.data.data_dir = str(tmp_path_factory.mktemp("tfds") / "never_read")
  return config


def planned_check(config, suite, **plan_keys):
  plan = plan_lib.ExperimentPlan.from_dict({**config.experiments.to_dict(), **plan_keys})
  experiment = runs_lib.Experiment(assembly.checked_config(config),
                                   plan, "unused", read_data=False)
  experiment.check(cli.PLANNED_RUNS[suite](experiment), suite)


@pytest.mark.parametrize("suite, plan_keys, named", [
    ("lambda_sweep", dict(lambdas=(0.1, -0.2)),
     ["--suite=lambda_sweep, run l0_lam-0.2_full_s0",
      "Set --config.experiments.lambdas to a value >= 0"]),
    ("ablation", dict(ablation_lambda=-1.0), ["Set --config.experiments.ablation_lambda"]),
    ("txl_widths", dict(txl_widths=(30,)),
     ["config.experiments.txl_widths=30 is not divisible by config.model.num_heads"]),
    # A fraction, and the advice as a fraction, in the flag that sets it: of 14,656
    # non-embedding parameters, 2,000 stay with one head and 64 with none.
    ("budget", dict(budgets=(("target_params", 0.001),)),
     ["run budget_params0.001_s0: config.experiments.budgets=0.001 (0.001 of the "
      "unpruned model's 14,656: 14) is below the 64 non-embedding parameters that no "
      "head holds", "met: --config.experiments.budgets=0.137 (1 of 8 heads); to remove "
      "every head, --config.experiments.budgets=0.0044 with "
      "--config.experiments.prune_gates.allow_empty=True."]),
    ("distill", dict(distill_sparsities=(0.5, 1.5)),
     ["run budget_sparsity1.5_s0", "config.experiments.distill_sparsities=1.5 is out of "
      "range", "--config.experiments.distill_sparsities=0.875 (1 of 8 heads)"]),
    ("distill", dict(distill_variants=dict(logit=dict(weight=2.0))),
     ["run budget_sparsity0.5_s0_distill_logit",
      "Set --config.experiments.distill_variants.logit.weight to a value in [0, 1]"]),
    ("persistent", dict(persistent_group=5),
     ["--suite=persistent, run budget_macs0.6_heads_groups5_s0: ",
      "config.experiments.persistent_group=5 does not divide config.model.num_persistent"
      "=32", "Choose one of [1, 2, 4, 8, 16, 32]"]),
    # A longer context than the baseline's, whose relative position table it starts from.
    ("lambda_sweep", dict(prune_train=dict(num_steps=100, seq_len=32)),
     ["--suite=lambda_sweep, run continued_s0", "config.experiments.prune_train.seq_len + "
      "config.train.mem_len = 48 sizes a learned relative position table of 48 distances",
      "holds 32. Set --config.model.max_relative_len=48"]),
    ("heuristics", dict(prune_train=dict(num_steps=100, mem_len=24)),
     ["--suite=heuristics, run l0_lam", "config.train.seq_len + "
      "config.experiments.prune_train.mem_len = 40 sizes", "holds 32"]),
    # Refused as its pruning runs are made, before they are checked: named as a run's key.
    ("heuristics", dict(prune_gates=dict(enabled=False)),
     ["config.gates.enabled=False, but this is a pruning run"]),
    ("heuristics", dict(prune_gates=dict(freeze_step=10**6)),
     ["Set --config.experiments.prune_gates.freeze_step to at most",
      "raise --config.experiments.prune_train.num_steps"]),
])
def test_every_run_of_a_suite_is_checked_naming_the_experiment_flags(
    experiment, suite, plan_keys, named):
  with pytest.raises(ConfigError) as error:
    planned_check(experiment, suite, **plan_keys)
  for text in named:
    assert text in str(error.value), str(error.value)


def test_the_shipped_plan_passes_its_checks(experiment):
  for suite in cli.ALL:
    planned_check(experiment, suite)
  assert not pathlib.Path(experiment.data.data_dir).exists()   # no data read


def test_a_suite_with_a_bad_run_stops_before_any_data_is_read(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "allatt_jax.experiments", "--config=exp_chars.py:tiny",
       "--suite=all", f"--workdir={tmp_path / 'exp'}", "--config.experiments.lambdas=(-1.0,)",
       f"--config.data.data_dir={tmp_path / 'tfds'}"],
      capture_output=True, text=True, cwd=ROOT, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 2, result.stderr
  assert result.stderr.splitlines()[0].startswith(
      "error: --suite=lambda_sweep, run l0_lam-1_full_s0: config.experiments.lambdas=-1.0 "
      "is out of range"), result.stderr
  assert not (tmp_path / "tfds").exists() and not (tmp_path / "exp").exists()


def test_a_pipeline_checks_each_stage_once_and_reads_its_dataset_once(tmp_path, monkeypatch):
  from allatt_jax.training import config_checks   # pylint: disable=g-import-not-at-top
  from allatt_jax import data as data_lib
  from allatt_jax.training import pipeline
  calls = {"check_config": 0, "load_run_corpus": 0}

  def counted(module, name):
    original = getattr(module, name)
    def wrapper(*args, **kwargs):
      calls[name] += 1
      return original(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)

  counted(config_checks, "check_config")
  counted(data_lib, "load_run_corpus")
  config = demo()
  config.data.data_dir = str(tmp_path / "tfds")
  stages = pipeline.prepare(assembly.checked_pipeline(config), tmp_path / "run")
  assert calls == {"check_config": 2, "load_run_corpus": 1}
  assert stages.pruning.corpus is stages.baseline.corpus
  assert stages.pruning.run.init_from == str(tmp_path / "run" / "baseline")
  assert stages.pruning.run.model.vocab_size == stages.baseline.run.model.vocab_size == 27


def test_pruning_lengths_that_resize_the_relative_table_are_refused_before_the_baseline():
  """The pruning stage starts from the baseline's params: a longer context there would
  need a longer learned table than the baseline trains (it used to fail after the
  baseline had trained, at the pruning stage's init_from check)."""
  config = demo()
  config.pipeline.prune_train.seq_len = 32   # 32 + 16 positions; the baseline's 16 + 16
  with pytest.raises(ConfigError, match=(
      r"^config\.pipeline\.prune_train\.seq_len \+ config\.train\.mem_len = 48 sizes a "
      r"learned relative position table of 48 distances \(the longest train or eval "
      r"context\), but the baseline's, whose "
      r"params the run starts from, holds 32\. Set --config\.model\.max_relative_len=48 "
      r"\(the baseline's too\), or train at the baseline's lengths\.$")):
    assembly.checked_pipeline(config)
  # Its two ways out pass: one table for both stages, or positions that learn nothing.
  config.model.max_relative_len = 48
  stages = assembly.checked_pipeline(config)
  assert stages.baseline.relative_table_len == stages.pruning.relative_table_len == 48
  config.model.update(dict(max_relative_len=0, rel_pos="sinusoidal"))
  assembly.checked_pipeline(config)


def test_the_pruning_stage_keeps_the_output_layer_the_baseline_chose(tmp_path, monkeypatch):
  """Own text at word level, 6,000 types: at the baseline's 32 positions a plain
  softmax costs more than all the layers (so it gets an adaptive one), at the pruning
  stage's 128 it does not; the pruning stage starts from the baseline's params, so it
  keeps the baseline's output layer, in a run and in the commands that measure one."""
  from allatt_jax import data as data_lib   # pylint: disable=g-import-not-at-top
  config = config_base.load(ROOT / "configs" / "demo.py")
  config.data.update(dict(name="text_files", level="word"))
  config.model.update(dict(vocab_size=6000, rel_pos="sinusoidal"))
  config.pipeline.prune_train.update(dict(seq_len=128, mem_len=128))
  stages = assembly.checked_pipeline(config)
  assert assembly.word_output(stages.baseline) and not assembly.word_output(stages.pruning)
  # As the benchmark and compile_check build both stages, without the dataset.
  measured = assembly.pipeline_with_vocab_size(stages)
  assert measured.pruning.model == measured.baseline.model
  assert measured.baseline.model.cutoffs == (450, 900, 4500)
  # Its train split: the first 1,000 ids, all in the head cluster; no <unk> anywhere.
  monkeypatch.setattr(data_lib, "load_run_corpus", lambda run: types.SimpleNamespace(
      vocab_size=6000, level="word", unk_counts=lambda: None,
      splits={"train": np.arange(2000) % 1000}))
  prepared = assembly.prepared_pipeline(stages, tmp_path / "baseline")
  baseline, pruning = prepared.baseline.run.model, prepared.pruning.run.model
  assert (baseline.cutoffs, baseline.div_val) == ((450, 900, 4500), 4)
  assert pruning == baseline and prepared.pruning.setup.lm.cfg.cutoffs == baseline.cutoffs
  assert prepared.pruning.run.train.seq_len == 128


@pytest.mark.parametrize("gates, heads, model", [
    (dict(target_params=0.01), 1, {}), (dict(target_macs=0.01), 1, {}),
    (dict(target_params=0.001, allow_empty=True), 0, {}),
    # No head leaves no MACs: a budget of 0 asks for nothing, so 1 MAC is the least.
    (dict(target_macs=0.0, allow_empty=True), 0, {}),
    (dict(target_params=0.01, persistent_group=4), None, {}),
    (dict(target_macs=0.0, persistent_group=4, allow_empty=True), None, {}),
    (dict(target_params=0.01, persistent_group=4, heads=False), None, {}),
    # The least a budget over groups alone meets, asked as a figure: that figure.
    (dict(target_params=1, persistent_group=4, heads=False), None, {}),
    # Groups of one slot (16 parameters) cost less than 1% of the least figure met, so
    # a short fraction within that 1% can still keep a group or more.
    (dict(target_params=0.01, persistent_group=1, heads=False), None,
     dict(num_persistent=64)),
])
def test_a_refused_budget_names_one_that_passes_in_the_form_it_was_asked(gates, heads,
                                                                          model):
  """A fraction gets a fraction back (short, within 1% of the least figure met); a
  figure a figure; and the budget named passes, keeping the heads (and persistent
  groups) it says."""
  asked = run_of_demo(gates=dict(enabled=True, freeze_step=20, **gates), model=model)
  key = asked.gates.budget_target
  with pytest.raises(ConfigError) as error:
    config_checks.check_config(asked, 1)
  named = re.search(rf"(?:keeps a head|is met): --config\.gates\.{key}=([\d.e-]+)",
                    str(error.value))
  assert named, str(error.value)
  text = named.group(1)
  value = float(text)
  if 0 < getattr(asked.gates, key) < 1:
    assert 0 < value < 1 and len(text.strip("0.").replace("e-", "")) <= 4, text
  else:
    assert value == int(value) >= 1, text
  fixed = run_config.derived_run(asked, gates={key: value})
  config_checks.check_config(fixed, 1)
  if heads is not None:
    cfg = model_lib.ModelConfig.from_config(fixed)
    figure = cost_model.budget_value(fixed, cfg)
    resolved = run_config.derived_run(fixed, gates={key: figure})
    assert cost_model.target_open_heads(resolved, cfg) == heads
    whole = float(cost_model.BudgetScale.of(fixed, cfg).value_for(heads))
    assert whole <= figure <= 1.01 * whole + 1
  if fixed.gates.persistent_group:
    # What the rule at the freeze keeps of a model whose gates all stay open: what
    # the advice says, one head (or, ungated, every head) without persistent vectors,
    # or nothing where that is allowed.
    cfg = model_lib.ModelConfig.from_config(fixed)
    open_gates = {f"layer_{i}": {"attention": {
        "logits": np.ones(h, np.float32),
        "persistent_logits": np.ones((h, cfg.num_persistent // fixed.gates.persistent_group),
                                     np.float32)}} for i, h in enumerate(cfg.layer_heads)}
    _, decision = freeze.keep_within_budget(
        cfg, gate_values.read(cfg, open_gates), cost_model.budget_units(fixed, cfg),
        cost_model.budget_value(fixed, cfg))
    least_heads = (sum(cfg.layer_heads) if not fixed.gates.heads else
                   0 if fixed.gates.allow_empty else 1)
    assert (decision["allowed"], decision["groups"]) == (least_heads, 0), (text, decision)


def test_a_group_budget_below_one_head_and_its_layer_is_refused_naming_one_that_keeps_one():
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")   # 2 x 4 heads, N = 16
  config.model.vocab_size = 27
  config.gates.update(dict(enabled=True, persistent_group=4, freeze_step=20,
                           target_params=1))
  run = run_config.RunConfig.of(config)
  units = cost_model.budget_units(run, model_lib.ModelConfig.from_config(run))
  assert units.layer > 0 and units.head > 0   # a layer's LayerNorm, a head's projections
  one_head = math.ceil(units.empty + units.layer + units.head)
  # Above a head's own cost, below it with its layer's: a model that keeps no head.
  value = math.floor(units.empty + units.head + units.layer / 2)
  assert units.empty + units.head < value < one_head
  config.gates.target_params = value
  with pytest.raises(ConfigError) as error:
    config_checks.check_config(run_config.RunConfig.of(config), 1)
  message = str(error.value)
  assert f"target_params={value} (read as a count" in message, message
  assert ") leaves none of the model's 8 heads" in message, message
  assert (f"nearest budget that keeps a head: --config.gates.target_params={one_head} "
          in message), message
  # The budget it names passes.
  config.gates.target_params = one_head
  config_checks.check_config(run_config.RunConfig.of(config), 1)


def test_a_training_deadline_is_refused_across_processes_before_the_workdir(tmp_path,
                                                                            monkeypatch):
  """Hosts would stop at different steps: refused before the run is even read."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ConfigError, match=r"^A training deadline needs a single process"):
    loop.train_and_evaluate(None, tmp_path / "run", deadline=0.0)
  assert not any(tmp_path.iterdir())
