"""Experiments: heuristic pruners, the budget controller, the plan, the suites end to
end (tiny)."""
import dataclasses
import json
import pathlib
import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data_fixtures
from helpers import measured_speeds
from allatt_jax.config import config_base
from allatt_jax import data as data_lib
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import head_removal
from allatt_jax.pruning import model_export
from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.config.errors import ConfigError
from allatt_jax.experiments import __main__ as cli
from allatt_jax.experiments import heuristics
from allatt_jax.experiments import persistent
from allatt_jax.experiments import plan as plan_lib
from allatt_jax.experiments import runs as runs_lib
from allatt_jax.experiments import suites

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 13


@pytest.fixture(scope="module", params=model_lib.KINDS)
def tiny_model(request):
  """A perturbed (so no two heads are alike) 3-layer model and training segments."""
  kind = request.param
  cfg = model_lib.ModelConfig(kind=kind, vocab_size=VOCAB, num_layers=3, d_model=16,
                              num_heads=4, num_persistent=4 if kind == "allatt" else 0,
                              d_ff=32 if kind == "txl" else 0, max_relative_len=16)
  lm = model_lib.TransformerLM(cfg)
  tokens_BxT = jnp.zeros((2, 4), jnp.int32)
  params = nn.unbox(lm.init(jax.random.key(0), tokens_BxT, tokens_BxT,
                            model_lib.init_memory(cfg, 2, 4)))["params"]
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = treedef.unflatten([x + 0.3 * jax.random.normal(k, x.shape)
                              for x, k in zip(leaves, keys)])
  tokens = np.random.default_rng(0).integers(0, VOCAB, 500).astype(np.int32)
  segments = heuristics.Segments.from_tokens(tokens, batch_size=2, seq_len=4, mem_len=4,
                                             num_batches=3)
  return lm, {"params": params}, segments


@pytest.mark.parametrize("method", heuristics.METHODS)
def test_masks_remove_exactly_the_requested_heads(tiny_model, method):
  lm, variables, segments = tiny_model
  for num_remove in (0, 5, 12):
    mask = heuristics.prune_mask(method, lm, variables, segments, num_remove)
    assert [m.shape for m in mask] == [(4,)] * 3
    assert all(m.dtype == bool for m in mask)
    assert sum(int(m.sum()) for m in mask) == 12 - num_remove


def test_scores_are_finite_and_tell_heads_apart(tiny_model):
  lm, variables, segments = tiny_model
  metrics = heuristics.attention_metrics(lm, variables, segments)
  for name, per_layer in metrics.items():
    values = np.concatenate(per_layer)
    assert np.all(np.isfinite(values)), name
    assert np.all((values >= 0) & (values <= 1 + 1e-6)), name
    assert np.ptp(values) > 0, name
  for method in heuristics.METHODS:
    scores = np.concatenate(heuristics.head_scores(method, lm, variables, segments))
    assert np.all(np.isfinite(scores)) and len(set(scores.tolist())) == 12, method


def test_random_masks_follow_the_seed(tiny_model):
  lm, variables, segments = tiny_model
  mask = lambda seed: np.concatenate(heuristics.prune_mask(
      "random", lm, variables, segments, 6, seed=seed))
  np.testing.assert_array_equal(mask(3), mask(3))
  assert any(not np.array_equal(mask(0), mask(s)) for s in (1, 2, 3))


@pytest.mark.slow
def test_michel_gradient_matches_finite_differences(tiny_model):
  lm, variables, segments = tiny_model
  if lm.cfg.kind == "txl":
    pytest.skip("ReLU kinks in TXL's feed-forward make finite differences inexact; "
                "the mean-absolute-gradient test covers TXL.")
  inputs, targets = segments.batches[0]
  memory = segments.memory(lm.cfg)
  xi = [jnp.ones(4) for _ in range(3)]
  grads, _ = heuristics._mask_gradient(lm, variables, xi, inputs, targets, memory)
  eps = 1e-2
  for layer in range(3):
    for head in range(4):
      bump = [jnp.zeros(4).at[head].set(eps if i == layer else 0.0) for i in range(3)]
      loss = lambda sign: heuristics.masked_loss(
          lm, variables, [x + sign * b for x, b in zip(xi, bump)], inputs, targets,
          memory)[0]
      numeric = (loss(1.0) - loss(-1.0)) / (2 * eps)
      np.testing.assert_allclose(grads[layer][head], numeric, rtol=2e-2, atol=2e-5)


@pytest.mark.slow
def test_michel_importance_is_the_mean_absolute_batch_gradient(tiny_model):
  lm, variables, segments = tiny_model
  mask = heuristics.full_mask(lm.cfg)
  importance = heuristics.michel_importance(lm, variables, segments, mask)
  xi, memory, expected = [jnp.ones(4)] * 3, segments.memory(lm.cfg), 0.0
  for inputs, targets in segments.batches:
    grads, memory = jax.grad(
        lambda x, m: heuristics.masked_loss(lm, variables, x, inputs, targets, m),
        has_aux=True)(xi, memory)
    expected = expected + np.abs(np.stack(grads))
  np.testing.assert_allclose(np.stack(importance), expected / 3, rtol=1e-5, atol=1e-7)
  normalised = heuristics.head_scores("michel", lm, variables, segments)
  np.testing.assert_allclose([np.linalg.norm(s) for s in normalised], 1.0, rtol=1e-6)


def test_masked_model_equals_the_exported_one(tiny_model):
  lm, variables, segments = tiny_model
  mask = (np.array([True, False, True, False]), np.zeros(4, bool), np.ones(4, bool))
  pruned_cfg, params = head_removal.remove_heads(lm.cfg, variables, mask)
  assert pruned_cfg == dataclasses.replace(lm.cfg, heads_per_layer=(2, 0, 4))
  inputs, targets = segments.batches[0]
  masked, _ = heuristics.masked_loss(lm, variables, [jnp.asarray(m, jnp.float32)
                                                     for m in mask],
                                     inputs, targets, segments.memory(lm.cfg))
  nll, _, _ = model_lib.TransformerLM(pruned_cfg).apply(
      {"params": params}, inputs, targets, segments.memory(pruned_cfg))
  np.testing.assert_allclose(masked, nll.mean(), rtol=1e-6)


def test_attention_statistics_follow_their_formulas():
  """Per head, summed over queries: entropy / log(#keys seen, context and persistent),
  Hoyer sparsity, and the JS divergence (bits) from the mean of the layer's other heads."""
  rng = np.random.default_rng(0)
  mask_TxK = jnp.array([[True, True, False], [True, True, True]])
  weights = rng.random((3, 1, 2, 4)) * np.concatenate(
      [np.broadcast_to(np.asarray(mask_TxK), (3, 1, 2, 3)), np.ones((3, 1, 2, 1))], -1)
  weights[1, 0, 0] = [1, 0, 0, 0]   # one-hot: entropy 0, sparsity 1
  weights /= weights.sum(-1, keepdims=True)
  stats = heuristics._head_statistics(jnp.asarray(weights[..., :3], jnp.float32),
                                      jnp.asarray(weights[..., 3:], jnp.float32), mask_TxK)
  entropy = lambda p: -sum(x * np.log(x) for x in p if x > 0)
  expected = {"entropy": np.zeros(3), "sparsity": np.zeros(3), "distribution": np.zeros(3)}
  for h in range(3):
    for t, keys in enumerate((3, 4)):   # the first query sees 2 context keys and 1 slot
      p = weights[h, 0, t]
      others = (weights[:, 0, t].sum(0) - p) / 2
      mean = (p + others) / 2
      expected["entropy"][h] += entropy(p) / np.log(keys)
      expected["sparsity"][h] += ((np.sqrt(keys) - 1 / np.linalg.norm(p))
                                  / (np.sqrt(keys) - 1))
      expected["distribution"][h] += (2 * entropy(mean) - entropy(p) - entropy(others)
                                      ) / 2 / np.log(2)
  for name, values in expected.items():
    np.testing.assert_allclose(stats[name], values, rtol=1e-5, atol=1e-6, err_msg=name)


def test_entropy_removes_the_broadest_heads_and_magnitude_the_smallest(tiny_model):
  lm, variables, segments = tiny_model
  entropy = np.concatenate(heuristics.attention_metrics(lm, variables, segments)["entropy"])
  removed = ~np.concatenate(heuristics.prune_mask("entropy", lm, variables, segments, 3))
  np.testing.assert_array_equal(np.flatnonzero(removed), np.sort(np.argsort(entropy)[-3:]))

  attention = variables["params"]["layer_1"]["attention"]
  squares = sum((np.asarray(attention[name]["kernel"])[:, 2] ** 2).sum()
                for name in ("query", "key", "value", "rel"))
  squares += (np.asarray(attention["out"]["kernel"])[2] ** 2).sum()
  magnitudes = heuristics.magnitudes(lm.cfg, variables["params"])
  np.testing.assert_allclose(magnitudes[1][2], np.sqrt(squares), rtol=1e-6)


def test_michel_rescores_under_the_mask_with_scores_normalised_per_layer(tiny_model):
  """Michel et al.'s iterative pruning: 10% of the heads (here 2) at a time, the
  open heads rescored under the current mask, L2-normalised within their layer."""
  lm, variables, segments = tiny_model
  expected = [np.ones(4, bool) for _ in range(3)]
  for _ in range(3):
    importance = heuristics.michel_importance(lm, variables, segments, expected)
    scores = [s * m / np.linalg.norm(s * m) for s, m in zip(importance, expected)]
    open_heads = [(scores[i][h], i, h) for i in range(3) for h in range(4) if expected[i][h]]
    for _, i, h in sorted(open_heads)[:2]:
      expected[i][h] = False
  mask = heuristics.prune_mask("michel", lm, variables, segments, 6)
  np.testing.assert_array_equal(np.stack(mask), np.stack(expected))


def budget_config(**gates) -> run_config.RunConfig:
  config = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny")
  config.gates.update({"enabled": True, "lam": 0.0, **gates})
  config.model.vocab_size = 27   # wikitext_chars's, which a run reads from its dataset
  return run_config.RunConfig.of(config)


def test_budgets_convert_to_the_most_heads_that_fit():
  config = budget_config()
  cfg = model_lib.ModelConfig.from_config(config)
  e = config.eval
  for key, cost in (("target_params",
                     lambda c: cost_model.param_counts(c)["params_non_embedding"]),
                    ("target_macs", lambda c: cost_model.macs_per_token(
                        c, e.seq_len, e.mem_len, e.batch_size)["macs_per_token_non_embedding"])):
    five = cost(dataclasses.replace(cfg, heads_per_layer=(3, 2)))
    for value, heads in ((five, 5), (five - 1, 4), (five * 10, 8), (1, 0)):
      assert cost_model.target_open_heads(budget_config(**{key: value}), cfg) == heads, (key, value)
  assert cost_model.target_open_heads(budget_config(target_sparsity=0.25), cfg) == 6


def test_a_config_sets_at_most_one_budget():
  with pytest.raises(ConfigError, match="at most one budget target"):
    assembly.checked_config(budget_config(target_sparsity=0.5, target_params=10))


@pytest.mark.parametrize("gates, match", [
    (dict(target_sparsity=1.5), r"\[0, 1\]"),
    (dict(target_macs=-3.0), "positive"),
])
def test_budget_config_errors(gates, match):
  with pytest.raises(ConfigError, match=match):
    config = budget_config(**gates)
    cost_model.target_open_heads(config, model_lib.ModelConfig.from_config(config))


def test_a_budget_replaces_the_fixed_lambda_in_the_saved_config():
  config = budget_config(target_sparsity=0.5, lam=0.1, l0_warmup_steps=0,
                         budget_warmup_steps=0, freeze_step=10)
  corpus = data_lib.load_run_corpus(config)
  completed = config.completed(corpus.vocab_size)
  assert completed.gates.lam == 0.0 and completed.gates.target_sparsity == 0.5
  penalty = assembly.run_setup(completed).penalty
  assert penalty.allowed == 4 and float(penalty.target(0)) == 4.0


def exp_chars_plan(**changes) -> dict:
  """configs/exp_chars.py:tiny's `experiments` section, as the command hands it in."""
  values = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny").experiments.to_dict()
  return {**values, **changes}


def planned_experiment(tmp_path, **plan_changes) -> runs_lib.Experiment:
  """configs/exp_chars.py:tiny's experiment as its runs are planned and checked,
  before any data is read."""
  config = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny")
  config.model.vocab_size = 27   # wikitext_chars's, which a run reads from its dataset
  return runs_lib.Experiment(
      assembly.checked_config(config),
      plan_lib.ExperimentPlan.from_dict(exp_chars_plan(**plan_changes)), tmp_path,
      read_data=False)


def test_each_ablation_turns_off_its_technique_and_vanilla_all_three(tmp_path):
  """The paper's Table 3: λ warm-up, π = 2 at init and the output scaling s_g."""
  experiment = planned_experiment(tmp_path)

  def techniques(variant):
    gates = experiment.l0_run(0.2, variant=variant).config.gates
    return gates.l0_warmup_steps, gates.init, gates.scale_output

  assert {variant: techniques(variant) for variant in runs_lib.ABLATIONS} == {
      "full": (20, 2.0, True), "no_warmup": (0, 2.0, True), "no_init": (20, 0.0, True),
      "no_scaling": (20, 2.0, False), "vanilla": (0, 0.0, False)}


def test_each_planned_run_has_a_folder_and_a_seed_of_its_own(tmp_path):
  experiment = planned_experiment(tmp_path, seeds=[0, 1])
  runs = [*(experiment.continued_run(seed) for seed in (0, 1)),
          *(experiment.l0_run(lam, seed, variant) for lam in (0.1, 0.2) for seed in (0, 1)
            for variant in ("full", "vanilla")),
          *(experiment.budget_run(key, 0.5, seed, groups=groups)
            for key in ("target_sparsity", "target_macs") for seed in (0, 1)
            for groups in ("", "groups", "both")),
          experiment.budget_run("target_sparsity", 0.5, distill="logit")]
  assert len({run.name for run in runs}) == len(runs)
  assert all(run.config.train.seed == int(re.search(r"_s(\d+)", run.name)[1])
             for run in runs)
  # Each starts from the baseline's folder, on the plan's pruning recipe.
  assert {run.config.init_from for run in runs} == {str(experiment.run_dir("baseline"))}
  assert {run.config.train.num_steps for run in runs} == {100}


def test_a_size_budget_is_its_fraction_of_the_baselines_and_says_so(tmp_path):
  experiment = planned_experiment(tmp_path)
  e = experiment.base.eval
  full, _ = cost_model.head_cost(experiment.base_model, "target_macs",
                                 (e.seq_len, e.mem_len, e.batch_size))
  run = experiment.budget_run("target_macs", 0.6)
  # The plan's fraction, named as its flag; the run's checks make it the figure.
  assert run.config.gates.target_macs == 0.6
  assert run.flags["gates.target_macs"] == "experiments.budgets"
  assert (assembly.checked_config(run.config).gates.target_macs
          == pytest.approx(0.6 * full))
  sparsity = experiment.budget_run("target_sparsity", 0.5)
  assert sparsity.flags["gates.target_sparsity"] == "experiments.budgets"
  assert sparsity.config.gates.target_sparsity == 0.5


def finished(workdir, config, results, wall_s=0.0):
  """A run folder as a finished run leaves it, to be read back."""
  run_files.save_config(workdir, config)
  (workdir / runs_lib.RESULTS_FILE).write_text(json.dumps(results))
  (workdir / runs_lib.SUMMARY_FILE).write_text(json.dumps({"wall_s": wall_s}))


def finished_pruning_run(experiment, planned, heads_per_layer, **export):
  """A finished pruning run of `planned` beside a finished baseline, its export
  keeping `heads_per_layer`; returns (its checked config, the export's model)."""
  finished(experiment.run_dir("baseline"), experiment.base,
           {"valid": 1.5, "test": 1.6, "metric": "bpc"})
  config = assembly.checked_config(planned.config)
  exported_cfg = dataclasses.replace(model_lib.ModelConfig.from_config(config),
                                     heads_per_layer=heads_per_layer)
  export_dir = experiment.workdir / "export"
  run_files.save_config(export_dir, model_export.exported_config(config, exported_cfg))
  finished(experiment.run_dir(planned.name), config,
           {"valid": 1.7, "test": 1.8, "metric": "bpc",
            "export": {"valid": 1.9, "test": 2.0, "directory": str(export_dir), **export}},
           wall_s=12.5)
  return config, exported_cfg


def test_a_finished_pruning_run_is_read_back_as_its_export(tmp_path):
  experiment = planned_experiment(tmp_path)
  config, exported_cfg = finished_pruning_run(experiment, experiment.l0_run(0.2), (3, 1))
  record = experiment.l0(0.2)
  e = config.eval
  assert (record.kind, record.metric, record.valid, record.test) == ("l0", "bpc", 1.9, 2.0)
  assert record.heads_per_layer == [3, 1] and record.persistent_per_layer == [96, 32]
  assert record.params_non_embedding == cost_model.param_counts(exported_cfg)[
      "params_non_embedding"]
  assert record.macs_per_token == cost_model.macs_per_token(
      exported_cfg, e.seq_len, e.mem_len, e.batch_size)["macs_per_token_non_embedding"]
  assert record.wall_s == 12.5
  assert record.extra == {"gated_test": 1.8, "lam": 0.2, "seed": 0, "variant": "full"}
  # A finished run stands only for the settings it was trained with.
  prune_train = {**exp_chars_plan()["prune_train"], "learning_rate": 5e-4}
  with pytest.raises(ConfigError, match=r"train.learning_rate: 0.001 -> 0.0005"):
    planned_experiment(tmp_path, prune_train=prune_train).l0(0.2)


def test_a_finished_budget_run_records_its_target_and_what_it_decided(tmp_path):
  experiment = planned_experiment(tmp_path)
  decision = {"allowed": 4, "by_gates": 3, "changed": 1}
  finished_pruning_run(experiment, experiment.budget_run("target_sparsity", 0.5), (2, 2),
                       budget=decision)
  record = experiment.budget("target_sparsity", 0.5)
  assert record.heads_per_layer == [2, 2]
  assert record.extra == {
      "gated_test": 1.8, "target_key": "target_sparsity", "fraction": 0.5, "target": 0.5,
      "seed": 0, "distill": "", "groups": "", "target_heads": 4, "by_gates": 3,
      "changed": 1, "decision": decision}


def test_a_heuristic_run_fine_tunes_its_masked_export_with_its_own_seed(tmp_path):
  experiment = planned_experiment(tmp_path)
  finished(experiment.run_dir("baseline"), experiment.base,
           {"valid": 1.5, "test": 1.6, "metric": "bpc"})
  masked_dir = experiment.run_dir("michel_r2_s1_masked")
  finished(masked_dir, model_export.exported_config(experiment.base, dataclasses.replace(
      experiment.base_model, heads_per_layer=(3, 3))),
           {"valid": 1.9, "test": 2.0, "metric": "bpc"})
  # Read back only if it is the run the plan makes: from the masked export, with the
  # plan's fine-tuning recipe (the continued run's) and this seed.
  tuned_config = assembly.checked_config(run_config.derived_run(
      experiment.base, init_from=str(masked_dir),
      train={**experiment.plan.prune_train, "seed": 1},
      model=dict(heads_per_layer=(3, 3))))
  finished(experiment.run_dir("michel_r2_s1"), tuned_config,
           {"valid": 1.7, "test": 1.8, "metric": "bpc"})
  masked, tuned = experiment.heuristic("michel", 2, seed=1)
  assert (masked.name, masked.test, tuned.name, tuned.test) == (
      "michel_r2_s1_masked", 2.0, "michel_r2_s1", 1.8)
  assert masked.heads_per_layer == tuned.heads_per_layer == [3, 3]
  assert masked.extra == tuned.extra == {"method": "michel", "removed": 2, "seed": 1}


def test_the_plan_is_typed_and_read_only():
  plan = plan_lib.ExperimentPlan.from_dict(exp_chars_plan(seeds=[0, 1], lambdas=(1, 0.5)))
  assert plan.seeds == (0, 1) and plan.lambdas == (1.0, 0.5)
  assert all(isinstance(lam, float) for lam in plan.lambdas)
  assert plan.budgets == (("target_sparsity", 0.5),)
  assert plan.prune_train["num_steps"] == 100
  assert plan.distill_variants["logit"]["weight"] == 0.5
  with pytest.raises(TypeError):
    plan.prune_gates["lam"] = 1.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.seeds = (2,)
  repro = config_base.load(ROOT / "configs" / "repro_wt2.py", "tiny").experiments
  assert plan_lib.Plan.from_dict(repro.to_dict()).txl_widths == (32,)


@pytest.mark.parametrize("changes, match", [
    (dict(lambda_=0.1), r"Unknown key --config\.experiments\.lambda_;"),
    (dict(seeds=(0.5,)), r"--config\.experiments\.seeds is \(0\.5,\); it takes a tuple "
                         r"of int"),
    (dict(ablation_lambda="high"), r"--config\.experiments\.ablation_lambda is 'high'; "
                                   r"it takes float"),
    (dict(budgets=(("target_sparsity",),)), r"--config\.experiments\.budgets .* a tuple "
                                            r"of \(str, float\)"),
    (dict(budgets=(("target_heads", 4.0),)), r"--config\.experiments\.budgets asks for "
                                             r"'target_heads'"),
    (dict(heuristics=("michel", "oracle")), r"--config\.experiments\.heuristics names "
                                            r"'oracle'"),
    (dict(prune_train=dict(num_step=5)),
     r"Unknown key --config\.experiments\.prune_train\.num_step;"),
    (dict(prune_gates=dict(lamda=0.1)),
     r"Unknown key --config\.experiments\.prune_gates\.lamda; prune_gates takes keys of "
     r"a run's gates section: "),
    (dict(distill_variants=dict(logit=dict(alpha=0.5))),
     r"Unknown key --config\.experiments\.distill_variants\.logit\.alpha;"),
    (dict(importance_batches=True), r"importance_batches is True; it takes int"),
    (dict(persistent_distill="hidden"),
     r"--config\.experiments\.persistent_distill names 'hidden'; the variants are "),
])
def test_plan_errors_name_the_flag(changes, match):
  with pytest.raises(ConfigError, match=match):
    plan_lib.ExperimentPlan.from_dict(exp_chars_plan(**changes))


def test_a_plan_without_a_key_names_it():
  values = exp_chars_plan()
  del values["budget_seeds"]
  with pytest.raises(ConfigError, match=r"no --config\.experiments\.budget_seeds;"):
    plan_lib.from_section(values)
  # The CPU suites' keys are not the repro suite's.
  with pytest.raises(ConfigError, match=r"Unknown key --config\.experiments\.ablation_lambda"):
    plan_lib.Plan.from_dict(exp_chars_plan())


def test_a_section_of_the_common_keys_is_a_plan_for_the_suites_that_need_no_more():
  repro = config_base.load(ROOT / "configs" / "repro_wt2.py").experiments.to_dict()
  plan = plan_lib.from_section(repro)
  assert type(plan) is plan_lib.Plan and plan.lambdas == (0.01, 0.02, 0.04)
  assert type(plan_lib.from_section(exp_chars_plan())) is plan_lib.ExperimentPlan
  with pytest.raises(ConfigError, match=r"Unknown key --config\.experiments\.lambda;"):
    plan_lib.from_section({**repro, "lambda": 0.1})
  # A suite that needs more says so before its first run.
  for suite in suites.FULL_PLAN_SUITES:
    with pytest.raises(ConfigError, match=rf"--suite={suite} needs .*: ablation_lambda, "):
      cli.SUITES[suite](types.SimpleNamespace(plan=plan))
  # And --suite=all before any suite's run: the suites before ablation need no more.
  with pytest.raises(ConfigError, match=r"--suite=ablation needs "):
    suites.check_plan(plan, list(cli.ALL))
  suites.check_plan(plan, ["lambda_sweep", "txl_widths"])


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, monkeypatch_module):
  """The tiny experiment config with the fewest runs that still cover every suite.

  On a text8 sample (27 characters, as the embedded corpus) with valid and test splits
  of 5,000 characters: every run scores both splits whole, which on the embedded
  corpus's 120,331 characters each took most of these tests' time."""
  config = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny")
  config.data.update(data_fixtures.text8_data(tmp_path_factory.mktemp("text8"),
                                              num_chars=100_000))
  monkeypatch_module.setattr(runs_lib, "ABLATIONS", {
      k: runs_lib.ABLATIONS[k] for k in ("full", "vanilla")})
  return runs_lib.Experiment(
      assembly.checked_config(config),
      plan_lib.ExperimentPlan.from_dict(exp_chars_plan(heuristics=("michel",))),
      tmp_path_factory.mktemp("experiment"))


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as patch:
    yield patch


@pytest.mark.slow
@pytest.mark.parametrize("suite", list(cli.ALL))
def test_suite_writes_its_table_and_figures(experiment, suite):
  report = cli.run_suite(suite, experiment)
  text = (experiment.workdir / f"{suite}.md").read_text()
  assert text.startswith(f"## Suite `{suite}`") and "|---|" in text
  assert report.figures
  for figure in report.figures:
    assert pathlib.Path(figure).stat().st_size > 1000
    assert f"({pathlib.Path(figure).name})" in text
  for record in report.records:
    assert np.isfinite(record.test) and record.params_non_embedding > 0
  # Its wall time counts every run it reads, the baseline too.
  assert [r.kind for r in report.records].count("baseline") == 1
  # The runs checked before the suite's first are those it makes, besides the
  # baseline and the heuristics' fine-tuning of the masks its L0 runs decide.
  made = {r.name for r in report.records if r.kind not in ("baseline", "heuristic")}
  assert {run.name for run in cli.PLANNED_RUNS[suite](experiment)} == made


def test_an_experiment_completes_its_baseline_from_the_data_once(experiment):
  """As every run saves its config: a finished run's config.json then compares like
  with like (configs/exp_chars.py leaves model.vocab_size to the dataset)."""
  assert experiment.base.model.vocab_size == experiment.corpus.vocab_size == 27
  assert experiment.base_model.vocab_size == 27


def test_only_groups_alone_have_a_size_they_cannot_prune_below(experiment):
  """Groups alone keep every head's projections and context attention; heads, alone
  or with groups, can remove everything."""
  assert persistent.reachable(experiment, 0.9, "groups")
  assert not persistent.reachable(experiment, 0.01, "groups")
  assert persistent.reachable(experiment, 0.01, "") and persistent.reachable(
      experiment, 0.01, "both")


@pytest.mark.slow
def test_the_persistent_table_compares_each_kind_with_heads_only_at_its_size(experiment,
                                                                            monkeypatch):
  # Timings as if every export ran 3 times as many tokens a second as the baseline.
  monkeypatch.setattr(persistent.speed_lib, "tokens_per_s",
                      lambda *args: measured_speeds(1000.0, 3000.0))
  report = persistent.persistent(experiment)   # the suite's runs, reused
  header, _, *rows = [[cell.strip() for cell in line.strip("|").split("|")]
                      for line in report.markdown.splitlines()
                      if line.startswith("|")]
  rows = [dict(zip(header, row)) for row in rows]
  test = next(column for column in header if column.startswith("test "))
  heads_only = {(r["MACs kept"], r["distill"]): float(r[test]) for r in rows
                if r["pruned"] == "heads"}
  assert heads_only and len(rows) > len(heads_only)
  number = lambda text: float(text.split(" ")[0].replace(",", ""))
  for r in rows:
    assert r["measured speed-up"] == "3.00x"
    if r["pruned"] == "heads":
      assert r["Δ vs heads only"] == "-"
      # Heads go with all their slots: the gates' MACs are as many whole heads.
      gate_heads, _, gate_macs = r["gates alone: heads, groups, MACs"].split(", ")
      assert number(gate_macs) / int(gate_heads) == pytest.approx(
          number(r["MACs (/ baseline)"]) / number(r["heads kept (per layer)"]))
    else:   # from the unrounded figures: within a rounding of each
      reference = heads_only[r["MACs kept"], r["distill"]]
      assert abs(float(r["Δ vs heads only"]) - (float(r[test]) - reference)) <= 1.5e-3


@pytest.mark.slow
def test_budget_run_keeps_exactly_the_heads_it_allows(experiment):
  base, record, reference = suites.budget(experiment).records
  assert base.kind == "baseline"
  assert record.extra["target_heads"] == 4
  assert record.heads == 4, record.heads_per_layer
  # What the rank rule changed is what separates the gates' own count from it.
  assert record.extra["changed"] >= abs(record.extra["by_gates"] - 4)
  assert reference.kind == "l0" and reference.extra["lam"] == 0.2


@pytest.mark.slow
def test_finished_runs_are_reused(experiment):
  experiment.baseline()            # trained here unless a test before trained it
  baseline = experiment.run_dir("baseline")
  before = (baseline / runs_lib.RESULTS_FILE).stat().st_mtime
  report = suites.lambda_sweep(experiment)
  assert (baseline / runs_lib.RESULTS_FILE).stat().st_mtime == before
  assert {r.name for r in report.records} == {"baseline", "continued_s0",
                                              "l0_lam0.2_full_s0"}


@pytest.mark.slow
def test_heuristic_runs_start_from_the_masked_model(experiment):
  suites.heuristics(experiment)    # its runs, unless the suite's test made them
  [masked_dir] = experiment.workdir.glob("runs/michel_r*_s0_masked")
  removed = int(masked_dir.name.split("_")[1][1:])
  exported = (masked_dir / runs_lib.RESULTS_FILE).stat().st_mtime_ns
  masked, tuned = experiment.heuristic("michel", removed)   # reused, not rerun
  assert (masked_dir / runs_lib.RESULTS_FILE).stat().st_mtime_ns == exported
  mask = json.loads((masked_dir / runs_lib.MASK_FILE).read_text())["mask"]
  assert masked.heads_per_layer == tuned.heads_per_layer == [sum(m) for m in mask]
  assert masked.heads == 8 - removed
  assert (run_files.load_vocabulary(masked_dir)
          == run_files.load_vocabulary(experiment.run_dir("baseline")))
  config = json.loads((experiment.run_dir(tuned.name) / "config.json").read_text())
  assert config["init_from"] == str(masked_dir)
  assert not config["gates"]["enabled"]
