"""The suites' tables, read from made-up finished runs: which runs each compares, and
how (experiments/suites.py, experiments/repro.py). The suites end to end, on tiny runs
they train, are in test_experiments.py."""
import pathlib
import types

import jax
import pytest

from allatt_jax.config import config_base
from allatt_jax.config import run_config
from allatt_jax.experiments import plan as plan_lib
from allatt_jax.experiments import repro
from allatt_jax.experiments import runs as runs_lib
from allatt_jax.experiments import suites
from allatt_jax.model import transformer as model_lib
from allatt_jax.reports import figures

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = config_base.load(ROOT / "configs" / "exp_chars.py", "tiny")


def made_up(name, kind, test, heads_per_layer, params=1000, macs=200.0, valid=0.0,
            d_model=16, wall_s=0.0, metric="ppl", **extra) -> runs_lib.Record:
  return runs_lib.Record(name, kind, metric, valid, test, list(heads_per_layer),
                         [0] * len(heads_per_layer), params, macs, d_model, wall_s, extra)


def exp_chars_plan(**changes) -> plan_lib.ExperimentPlan:
  """configs/exp_chars.py:tiny's plan with `changes`."""
  return plan_lib.ExperimentPlan.from_dict({**TINY.experiments.to_dict(), **changes})


def rows_of(markdown: str) -> list[tuple[str, ...]]:
  """The body rows of the first table in `markdown`, as tuples of cells."""
  lines = markdown.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("|"))
  end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")),
             len(lines))
  return [tuple(cell.strip() for cell in line.strip("|").split("|"))
          for line in lines[start + 2:end]]


def log_scalars(workdir: pathlib.Path, values: dict[str, dict[int, float]]) -> None:
  """Writes {tag: {step: value}} as a run's progress does: clu's TensorBoard events."""
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  writer = metric_writers.create_default_writer(str(workdir), asynchronous=False)
  for tag, by_step in values.items():
    for step, value in by_step.items():
      writer.write_scalars(step, {tag: value})
  writer.close()


@pytest.fixture
def drawn(monkeypatch):
  """What the suites hand to the figures: {function name: [(args, kwargs)]}."""
  calls = {}
  for name in ("xy_figure", "trajectories_figure"):
    real = getattr(figures, name)

    def record(*args, _name=name, _real=real, **kwargs):
      calls.setdefault(_name, []).append((args, kwargs))
      return _real(*args, **kwargs)

    monkeypatch.setattr(figures, name, record)
  return calls


def test_scalars_are_read_back_on_the_steps_every_tag_has(tmp_path):
  log_scalars(tmp_path, {"open_controlled": {10: 8.0, 20: 6.0, 30: 5.0},
                         "open_target": {20: 6.5, 30: 5.0}})
  assert suites.scalars(tmp_path, ("open_controlled", "open_target")) == {
      "step": [20, 30], "open_controlled": [6.0, 5.0], "open_target": [6.5, 5.0]}
  assert suites.scalars(tmp_path, ("open_controlled", "tokens_per_s")) == {}


def test_the_lambda_table_compares_each_lambda_with_the_continued_baseline(tmp_path):
  continued = {0: made_up("continued_s0", "continued", 30.0, [4, 4], valid=29.0),
               1: made_up("continued_s1", "continued", 32.0, [4, 4], valid=31.0)}
  pruned = {(0.5, 0): made_up("l0_s0", "l0", 31.5, [2, 2], params=600, valid=30.0),
            (0.5, 1): made_up("l0_s1", "l0", 32.5, [3, 2], params=700, valid=31.0)}
  experiment = types.SimpleNamespace(
      plan=exp_chars_plan(seeds=[0, 1], lambdas=[0.5]), workdir=tmp_path,
      base=run_config.RunConfig.of(TINY),
      base_model=model_lib.ModelConfig(vocab_size=13, num_layers=2, d_model=16,
                                       num_heads=4, max_relative_len=16),
      baseline=lambda: made_up("baseline", "baseline", 29.0, [4, 4], valid=28.0),
      continued=continued.get, l0=lambda lam, seed: pruned[lam, seed])
  assert rows_of(suites.lambda_sweep(experiment).markdown) == [
      ("baseline", "-", "0%", "1,000", "28.000", "29.000", "-"),
      ("continued", "0", "0%", "1,000", "30.000 ± 1.414", "31.000 ± 1.414", "-"),
      ("L0 pruned", "0.5", "43.8%", "650", "30.500 ± 0.707", "32.000 ± 0.707", "+1.000")]


def test_the_ablation_table_compares_each_variant_with_full_seed_by_seed(tmp_path):
  # Test values per (variant, seed): what the table makes of finished runs.
  tests = {"full": (30.0, 31.0), "no_warmup": (30.5, 31.0), "no_init": (31.0, 31.0),
           "no_scaling": (29.0, 33.0), "vanilla": (31.5, 33.0)}
  plan = exp_chars_plan(seeds=[0, 1])

  def l0(lam, seed, variant):
    assert lam == plan.ablation_lambda
    return made_up(f"{variant}_s{seed}", "l0", tests[variant][seed],
                   [3, 1] if variant == "full" else [2, 1], seed=seed)

  experiment = types.SimpleNamespace(
      plan=plan, workdir=tmp_path, l0=l0,
      baseline=lambda: made_up("baseline", "baseline", 29.0, [4, 4]),
      base_model=types.SimpleNamespace(layer_heads=(4, 4)))
  report = suites.ablation(experiment)
  # Its runs, whose wall time the command adds up: the baseline too.
  assert [r.name for r in report.records if r.kind == "baseline"] == ["baseline"]
  # Δ is each seed's change from full's run of the same seed: mean ± sample sd.
  assert rows_of(report.markdown) == [
      ("full", "warm-up, π=2, scaling", "50.0%", "30.500 ± 0.707", "-", "-"),
      ("no_warmup", "π=2, scaling", "62.5%", "30.750 ± 0.354", "+0.250 ± 0.354", "+0.12"),
      ("no_init", "warm-up, scaling", "62.5%", "31.000 ± 0.000", "+0.500 ± 0.707", "+0.61"),
      ("no_scaling", "warm-up, π=2", "62.5%", "31.000 ± 2.828", "+0.500 ± 2.121", "+1.25"),
      ("vanilla", "none", "62.5%", "32.250 ± 1.061", "+1.750 ± 0.354", "+1.48")]


def test_the_heuristics_table_prunes_as_many_heads_as_each_lambdas_first_seed(tmp_path,
                                                                           drawn):
  """Each method removes what the seed-0 L0 run of a λ removed (none: no row); random
  masks once per random seed, the others once; the figure's reference is the continued
  runs' mean."""
  plan = exp_chars_plan(heuristic_lambdas=[0.1, 0.5], seeds=[0, 1],
                        heuristics=["michel", "random"], random_seeds=[0, 1, 2])
  l0_runs = {(0.1, 0): ([4, 4], 30.0), (0.1, 1): ([4, 4], 30.2),
             (0.5, 0): ([2, 3], 31.0), (0.5, 1): ([2, 2], 31.4)}
  asked = []

  def heuristic(method, removed, seed):
    asked.append((method, removed, seed))
    return (made_up("masked", "heuristic", 40.0 + seed, [2, 3]),
            made_up("tuned", "heuristic", 32.0 + seed / 10, [2, 3]))

  experiment = types.SimpleNamespace(
      plan=plan, workdir=tmp_path, base_model=types.SimpleNamespace(layer_heads=(4, 4)),
      l0=lambda lam, seed: made_up("l0", "l0", l0_runs[lam, seed][1], l0_runs[lam, seed][0]),
      heuristic=heuristic,
      continued=lambda seed: made_up(f"continued_s{seed}", "continued", 30.0 + seed,
                                     [4, 4]),
      baseline=lambda: made_up("baseline", "baseline", 29.0, [4, 4]))
  report = suites.heuristics(experiment)
  # Its runs, whose wall time the command adds up: the baseline and continued ones too.
  assert {"baseline", "continued_s0", "continued_s1"} <= {r.name for r in report.records}
  assert asked == [("michel", 3, 0), ("random", 3, 0), ("random", 3, 1), ("random", 3, 2)]
  assert rows_of(report.markdown) == [
      ("L0 λ=0.1", "0, 0", "(during pruning)", "30.100 ± 0.141"),
      ("L0 λ=0.5", "3, 4", "(during pruning)", "31.200 ± 0.283"),
      ("michel", "3", "40.000", "32.000"),
      ("random", "3", "41.000 ± 1.000", "32.100 ± 0.100")]
  assert (f"Fine-tuning: {plan.prune_train['num_steps']} steps from the masked baseline"
          in report.markdown)
  [(_, kwargs)] = drawn["xy_figure"]
  assert kwargs["hline"] == ("continued (unpruned)", pytest.approx(30.5))


def test_the_budget_table_sets_each_budget_beside_the_fixed_lambda_run_nearest_in_heads(
    tmp_path, drawn):
  plan = exp_chars_plan(budgets=[["target_params", 0.5], ["target_sparsity", 0.25]],
                        budget_seeds=[0], budget_reference_lambdas=[0.1, 0.3])
  budget_runs = {
      "target_params": made_up(
          "budget_params", "budget", 31.0, [2, 2], params=480, macs=90.0,
          target_key="target_params", fraction=0.5, target=500, target_heads=4,
          by_gates=5, changed=1),
      "target_sparsity": made_up(
          "budget_sparsity", "budget", 30.0, [3, 3], params=760, macs=150.0,
          target_key="target_sparsity", fraction=0.25, target=0.25, target_heads=6,
          by_gates=6, changed=0)}
  fixed = {0.1: made_up("l0_0.1", "l0", 30.5, [3, 3], lam=0.1),
           0.3: made_up("l0_0.3", "l0", 31.5, [2, 2], lam=0.3)}

  def l0(lam, seed):
    assert seed == 0   # the references are seed 0's
    return fixed[lam]

  log_scalars(tmp_path / "budget_params", {"open_controlled": {10: 8.0, 20: 5.0},
                                           "open_target": {10: 6.0, 20: 4.0}})
  experiment = types.SimpleNamespace(
      plan=plan, workdir=tmp_path, base_model=types.SimpleNamespace(layer_heads=(4, 4)),
      baseline=lambda: made_up("baseline", "baseline", 29.0, [4, 4]),
      budget=lambda key, value, seed: budget_runs[key], l0=l0,
      run_dir=lambda name: tmp_path / name)
  report = suites.budget(experiment)
  assert [r.kind for r in report.records].count("baseline") == 1
  assert rows_of(report.markdown) == [
      ("params", "0.5", "500", "480", "4", "4", "5", "1", "0.480", "0.450", "31.000",
       "λ=0.3: 50.0%, 31.500", "-0.500"),
      ("sparsity", "0.25", "25.0%", "25.0%", "6", "6", "6", "0", "0.760", "0.750",
       "30.000", "λ=0.1: 25.0%, 30.500", "-0.500")]
  [(args, _)] = drawn["trajectories_figure"]
  assert args[0] == {"params 50% of baseline (4 heads)": {
      "step": [10, 20], "open": [8.0, 5.0], "target": [6.0, 4.0]}}
  assert suites.budget_label(budget_runs["target_sparsity"].extra) == "sparsity 25% (6 heads)"
  # A size the plan gives as a figure.
  assert suites.budget_label({**budget_runs["target_params"].extra, "fraction": 5000.0}
                             ) == "params 5,000 (4 heads)"


def test_the_distill_table_compares_each_variant_with_the_plain_run_of_its_sparsity(
    tmp_path):
  plan = exp_chars_plan(distill_sparsities=[0.5], persistent_distill="logit",
                        distill_variants={"logit": {"weight": 0.5, "temperature": 2.0}})
  made = {"": made_up("plain", "budget", 31.0, [2, 2]),
          "logit": made_up("logit", "budget", 30.4, [2, 2])}
  # Training rates as logged: the table takes each run's median.
  log_scalars(tmp_path / "plain", {"tokens_per_s": {1: 100.0, 2: 100.0, 3: 400.0}})
  log_scalars(tmp_path / "logit", {"tokens_per_s": {1: 50.0, 2: 50.0, 3: 50.0}})

  def budget(key, sparsity, seed, variant):
    assert (key, sparsity, seed) == ("target_sparsity", 0.5, 0)
    return made[variant]

  experiment = types.SimpleNamespace(
      plan=plan, workdir=tmp_path, base_model=types.SimpleNamespace(layer_heads=(4, 4)),
      baseline=lambda: made_up("baseline", "baseline", 29.0, [4, 4]),
      continued=lambda seed: made_up("continued", "continued", 30.0, [4, 4]),
      budget=budget, run_dir=lambda name: tmp_path / name)
  report = suites.distill(experiment)
  assert report.markdown.startswith(
      "Baseline test ppl 29.000; `continued` (unpruned, the pruning recipe's steps): "
      "30.000.")
  assert rows_of(report.markdown) == [
      ("50.0%", "plain", "-", "4 (2 2)", "31.000", "+1.000", "-", "100", "-"),
      ("50.0%", "logit", "weight=0.5, temperature=2", "4 (2 2)", "30.400", "+0.400",
       "-0.600", "50", "+100%")]


def test_the_txl_table_lists_the_pruned_runs_largest_first(tmp_path):
  plan = exp_chars_plan(txl_widths=[16, 8], seeds=[0, 1], lambdas=[0.1, 0.3])
  params = {(0.1, 0): 800, (0.1, 1): 820, (0.3, 0): 500, (0.3, 1): 560}
  experiment = types.SimpleNamespace(
      plan=plan, workdir=tmp_path,
      txl=lambda width: made_up(f"txl_{width}", "txl", 35.0 - width / 8, [4, 4],
                                params=width * 10, macs=width * 2.0, d_model=width),
      baseline=lambda: made_up("baseline", "baseline", 29.0, [4, 4]),
      continued=lambda seed: made_up("continued", "continued", 30.0 + seed, [4, 4]),
      l0=lambda lam, seed: made_up("l0", "l0", 31.0, [2, 2], params=params[lam, seed],
                                   macs=params[lam, seed] / 10, lam=lam, seed=seed))
  assert rows_of(suites.txl_widths(experiment).markdown) == [
      ("TXL d=16", "160", "32", "33.000"), ("TXL d=8", "80", "16", "34.000"),
      ("All-att baseline d=16", "1,000", "200", "29.000"),
      ("All-att continued (seed 0)", "1,000", "200", "30.000"),
      ("All-att continued (seed 1)", "1,000", "200", "31.000"),
      ("All-att L0 λ=0.1 seed 1", "820", "82", "31.000"),
      ("All-att L0 λ=0.1 seed 0", "800", "80", "31.000"),
      ("All-att L0 λ=0.3 seed 1", "560", "56", "31.000"),
      ("All-att L0 λ=0.3 seed 0", "500", "50", "31.000")]


def test_the_repro_table_scores_pruned_runs_as_exported_beside_their_gated_model(
    tmp_path):
  plan = plan_lib.Plan.from_dict(dict(
      prune_train=dict(num_steps=3000), prune_gates=dict(freeze_step=2000),
      lambdas=(0.05,), seeds=(0,), txl_widths=(8,)))
  log_scalars(tmp_path / "l0", {"tokens_per_s": {1: 100.0, 2: 100.0, 3: 400.0}})
  experiment = types.SimpleNamespace(
      plan=plan, workdir=tmp_path, base=run_config.RunConfig.of(TINY),
      base_model=types.SimpleNamespace(layer_heads=(4, 4)),
      baseline=lambda: made_up("baseline", "baseline", 3.0, [4, 4], valid=2.9,
                               wall_s=600.0),
      l0=lambda lam, seed: made_up("l0", "l0", 3.1, [2, 3], params=700, macs=150.0,
                                   valid=3.0, wall_s=90.0, lam=lam, seed=seed,
                                   gated_test=3.05),
      txl=lambda width: made_up("txl", "txl", 3.4, [4, 4], params=500, macs=100.0,
                                valid=3.3, d_model=width, wall_s=30.0),
      run_dir=lambda name: tmp_path / name,
      l0_run=lambda lam, seed: ("l0_run", lam, seed), txl_run=lambda width: ("txl_run", width))
  report = repro.repro(experiment)
  assert rows_of(report.markdown) == [
      ("All-att d=16", "-", "0.0%", "4/4", "1,000", "200", "2.90", "3.00", "-", "-", "10.0"),
      ("All-att L0 (seed 0)", "0.05", "37.5%", "2/3", "700", "150", "3.00", "3.10", "3.05",
       "100", "1.5"),
      ("TXL d=8", "-", "0.0%", "4/4", "500", "100", "3.30", "3.40", "-", "-", "0.5")]
  devices = jax.devices()
  assert report.markdown.startswith(f"{devices[0].device_kind} × {len(devices)} (")
  assert ("pruning runs 3,000 steps (gates frozen at 2,000)" in report.markdown)
  # The runs checked before the first trains are the ones it makes.
  assert repro.repro_runs(experiment) == [("l0_run", 0.05, 0), ("txl_run", 8)]
