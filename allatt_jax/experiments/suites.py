"""The experiment suites: which runs each needs, and its table and figures.

Each suite makes (or reads back) an experiment's runs and returns a `Report` (markdown
and PNGs): lambda_sweep (Tables 1/2, Fig. 1), ablation (Table 3), txl_widths (Fig. 3
measured), heuristics, budget, distill and persistent. lambda_sweep and txl_widths need
only a `plan.Plan`, the others an `ExperimentPlan`.
"""
import dataclasses
import glob

import numpy as np

from allatt_jax.reports import figures
from allatt_jax.config.errors import ConfigError
from allatt_jax.experiments import plan as plan_lib
from allatt_jax.experiments import runs as runs_lib

# The paper's Table 3 (WikiText-103, λ = 0.02): test perplexity change per variant.
PAPER_ABLATION_DPPL = {"no_warmup": 0.12, "no_init": 0.61, "no_scaling": 1.25,
                       "vanilla": 1.48}
_TECHNIQUES = {"full": "warm-up, π=2, scaling", "no_warmup": "π=2, scaling",
               "no_init": "warm-up, scaling", "no_scaling": "warm-up, π=2",
               "vanilla": "none"}


@dataclasses.dataclass
class Report:
  markdown: str
  figures: list[str]
  records: list[runs_lib.Record]


def table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _ms(values, digits=3, sign="") -> str:
  """Mean ± sample standard deviation (the mean alone for one value)."""
  mean, std = runs_lib.mean_std(values)
  text = f"{mean:{sign}.{digits}f}"
  return f"{text} ± {std:.{digits}f}" if len(values) > 1 else text


def _pct(x) -> str:
  return f"{100 * x:.1f}%"


def _sparsity(record, total) -> float:
  return 1.0 - record.heads / total


def _total_heads(exp) -> int:
  return sum(exp.base_model.layer_heads)


# The suites that read an ExperimentPlan's keys beyond the common Plan's.
FULL_PLAN_SUITES = ("ablation", "heuristics", "budget", "distill", "persistent")


def check_plan(plan: plan_lib.Plan, names) -> None:
  """Raises ConfigError when one of the suites `names` needs keys that `plan` lacks:
  made before any data is read or run made (`--suite=all` runs them all, in order,
  for hours)."""
  for name in names:
    if name in FULL_PLAN_SUITES:
      full_plan(plan, name)


def full_plan(plan: plan_lib.Plan, suite: str) -> plan_lib.ExperimentPlan:
  """The plan of a suite that needs an ExperimentPlan's keys: checked before the
  suite's first run."""
  if not isinstance(plan, plan_lib.ExperimentPlan):
    missing = [f.name for f in dataclasses.fields(plan_lib.ExperimentPlan)
               if not hasattr(plan, f.name)]
    raise ConfigError(f"--suite={suite} needs experiment keys (as in "
                      "configs/exp_chars.py) that this config's `experiments` section "
                      f"lacks: {', '.join(missing)}.")
  return plan


def lambda_sweep(exp: runs_lib.Experiment) -> Report:
  s, total = exp.plan, _total_heads(exp)
  base = exp.baseline()
  continued = [exp.continued(seed) for seed in s.seeds]
  sweep = {lam: [exp.l0(lam, seed) for seed in s.seeds] for lam in s.lambdas}
  metric = base.metric
  rows = [("baseline", "-", "0%", f"{base.params_non_embedding:,}", f"{base.valid:.3f}",
           f"{base.test:.3f}", "-"),
          ("continued", "0", "0%", f"{base.params_non_embedding:,}",
           _ms([r.valid for r in continued]), _ms([r.test for r in continued]), "-")]
  reference = np.mean([r.test for r in continued])
  for lam, records in sweep.items():
    rows.append((
        "L0 pruned", f"{lam:g}",
        _pct(np.mean([_sparsity(r, total) for r in records])),
        f"{np.mean([r.params_non_embedding for r in records]):,.0f}",
        _ms([r.valid for r in records]), _ms([r.test for r in records]),
        f"{np.mean([r.test for r in records]) - reference:+.3f}"))
  md = table(("model", "λ", "sparsity", "params w/o emb", f"valid {metric}",
              f"test {metric}", "Δ test vs continued"), rows)
  md += "\n\nHeads per layer: " + "; ".join(
      f"λ={lam:g}: " + ", ".join("/".join(map(str, r.heads_per_layer)) for r in records)
      for lam, records in sweep.items())

  cost_file = exp.workdir / "fig1_costs.png"
  e = exp.base.eval
  curves = figures.cost_model_figure(exp.base_model,
                                     (e.seq_len, e.mem_len, e.batch_size), cost_file)
  md += "\n\n" + _cost_table(curves)
  sweep_file = exp.workdir / "lambda_sweep.png"
  figures.xy_figure(
      [figures.Series(f"λ={lam:g}", [100 * _sparsity(r, total) for r in records],
                      [r.test for r in records], marker, hollow=True)
       for (lam, records), marker in zip(sweep.items(), figures.MARKERS)],
      "head sparsity (%)", f"test {metric}", "L0 pruning: sparsity and metric per λ",
      sweep_file, hline=("continued (unpruned)", reference))
  all_records = [base, *continued, *(r for rs in sweep.values() for r in rs)]
  return Report(md, [str(cost_file), str(sweep_file)], all_records)


def _cost_table(curves) -> str:
  rows = []
  for (size, kind), c in curves.items():
    at_half = int(np.argmin(np.abs(c["sparsity"] - 0.5)))
    rows.append((size, kind, _pct(c["macs"][at_half]), _pct(c["params"][at_half])))
  return ("Cost model at 50% head sparsity (Fig. 1; uniform over layers):\n\n"
          + table(("size", "model", "relative MACs", "relative params"), rows))


def ablation(exp: runs_lib.Experiment) -> Report:
  s, total = full_plan(exp.plan, "ablation"), _total_heads(exp)
  base = exp.baseline()
  lam = s.ablation_lambda
  variants = {v: [exp.l0(lam, seed, v) for seed in s.seeds] for v in runs_lib.ABLATIONS}
  full = {r.extra["seed"]: r for r in variants["full"]}
  metric = variants["full"][0].metric
  rows, names, deltas, errors = [], [], [], []
  for variant, records in variants.items():
    delta = [r.test - full[r.extra["seed"]].test for r in records]
    rows.append((variant, _TECHNIQUES[variant],
                 _pct(np.mean([_sparsity(r, total) for r in records])),
                 _ms([r.test for r in records]),
                 "-" if variant == "full" else _ms(delta, sign="+"),
                 f"+{PAPER_ABLATION_DPPL[variant]:.2f}" if variant in PAPER_ABLATION_DPPL
                 else "-"))
    if variant != "full":
      names.append(variant)
      deltas.append(np.mean(delta))
      errors.append(runs_lib.mean_std(delta)[1])
  md = table(("variant", "techniques on", "sparsity", f"test {metric}",
              f"Δ test {metric} vs full", "paper Δ ppl (WT103, λ=0.02)"), rows)
  out = exp.workdir / "ablation.png"
  figures.bar_figure(names, deltas, errors, f"Δ test {metric} vs full",
                     f"Ablation at λ={lam:g} (mean ± sd over seeds)", out)
  return Report(md, [str(out)], [base, *(r for rs in variants.values() for r in rs)])


def txl_widths(exp: runs_lib.Experiment) -> Report:
  s = exp.plan
  txl = [exp.txl(width) for width in s.txl_widths]
  base = exp.baseline()
  continued = [exp.continued(seed) for seed in s.seeds]
  pruned = [exp.l0(lam, seed) for lam in s.lambdas for seed in s.seeds]
  metric = base.metric
  rows = [(f"TXL d={r.d_model}", f"{r.params_non_embedding:,}", f"{r.macs_per_token:,.0f}",
           f"{r.test:.3f}") for r in txl]
  rows += [(f"All-att baseline d={base.d_model}", f"{base.params_non_embedding:,}",
            f"{base.macs_per_token:,.0f}", f"{base.test:.3f}")]
  rows += [(f"All-att continued (seed {r.extra.get('seed', i)})",
            f"{r.params_non_embedding:,}", f"{r.macs_per_token:,.0f}", f"{r.test:.3f}")
           for i, r in enumerate(continued)]
  rows += [(f"All-att L0 λ={r.extra['lam']:g} seed {r.extra['seed']}",
            f"{r.params_non_embedding:,}", f"{r.macs_per_token:,.0f}", f"{r.test:.3f}")
           for r in sorted(pruned, key=lambda r: -r.params_non_embedding)]
  md = table(("model", "params w/o emb", "MACs/token w/o emb", f"test {metric}"), rows)
  out = exp.workdir / "fig3_params.png"
  figures.xy_figure(
      [figures.Series("TXL, reduced width (baseline recipe)",
                      [r.params_non_embedding for r in txl], [r.test for r in txl], "s-"),
       figures.Series("All-att baseline", [base.params_non_embedding], [base.test], "D"),
       figures.Series("All-att continued", [r.params_non_embedding for r in continued],
                      [r.test for r in continued], "^"),
       figures.Series("All-att L0 pruned", [r.params_non_embedding for r in pruned],
                      [r.test for r in pruned], "o")],
      "parameters w/o embedding", f"test {metric}", "Pruned All-att vs narrower TXL",
      out)
  return Report(md, [str(out)], [*txl, base, *continued, *pruned])


def heuristics(exp: runs_lib.Experiment) -> Report:
  s, total = full_plan(exp.plan, "heuristics"), _total_heads(exp)
  base = exp.baseline()
  l0_runs = {lam: [exp.l0(lam, seed) for seed in s.seeds] for lam in s.heuristic_lambdas}
  # Each heuristic removes as many heads as the seed-0 L0 run of that λ did.
  removals = sorted({total - rs[0].heads for rs in l0_runs.values()} - {0})
  results = {}   # (method, removed) -> [(masked, tuned), ...] over seeds
  for removed in removals:
    for method in s.heuristics:
      seeds = s.random_seeds if method == "random" else (0,)
      results[method, removed] = [exp.heuristic(method, removed, seed) for seed in seeds]
  metric = next(iter(l0_runs.values()))[0].metric
  rows = []
  for lam, records in l0_runs.items():
    rows.append((f"L0 λ={lam:g}", ", ".join(str(total - r.heads) for r in records),
                 "(during pruning)", _ms([r.test for r in records])))
  for (method, removed), pairs in results.items():
    rows.append((method, str(removed), _ms([m.test for m, _ in pairs]),
                 _ms([t.test for _, t in pairs])))
  md = table(("method", "heads removed", f"test {metric}, no fine-tuning",
              f"test {metric}, fine-tuned"), rows)
  md += (f"\n\nFine-tuning: {s.prune_train['num_steps']} steps from the masked "
         "baseline, the same steps and learning-rate schedule as an L0 pruning run "
         "(which spends them on gate training, then fine-tuning).")

  # Fine-tuned models only: unpruned-then-masked ones are several bpc worse and would
  # flatten the comparison that matters (they are in the table).
  series = [figures.Series(
      "L0 (each seed)", [100 * _sparsity(r, total) for rs in l0_runs.values() for r in rs],
      [r.test for rs in l0_runs.values() for r in rs], "k*")]
  for method, color in zip(s.heuristics, figures.COLORS):
    points = [(100 * removed / total, np.mean([tuned.test for _, tuned in pairs]))
              for (m, removed), pairs in results.items() if m == method]
    if points:
      xs, ys = zip(*points)
      series.append(figures.Series(method, list(xs), list(ys), "o-", color=color))
  out = exp.workdir / "heuristics.png"
  continued = [exp.continued(seed) for seed in s.seeds]
  figures.xy_figure(series, "head sparsity (%)", f"test {metric}",
                    "L0 gates vs heuristic masks, after the same fine-tuning", out,
                    hline=("continued (unpruned)", np.mean([r.test for r in continued])))
  records = [base, *continued, *(r for rs in l0_runs.values() for r in rs)]
  records += [r for pairs in results.values() for pair in pairs for r in pair]
  return Report(md, [str(out)], records)


def budget(exp: runs_lib.Experiment) -> Report:
  """Each budget's run against the fixed-λ run (seed 0) of the nearest sparsity."""
  s, total = full_plan(exp.plan, "budget"), _total_heads(exp)
  base = exp.baseline()
  records = [exp.budget(key, value, seed) for key, value in s.budgets
             for seed in s.budget_seeds]
  fixed = [exp.l0(lam, 0) for lam in s.budget_reference_lambdas]
  metric = base.metric
  rows = []
  for r in records:
    key, target = r.extra["target_key"], r.extra["target"]
    reached = {"target_sparsity": _pct(_sparsity(r, total)),
               "target_params": f"{r.params_non_embedding:,}",
               "target_macs": f"{r.macs_per_token:,.0f}"}[key]
    asked = _pct(target) if key == "target_sparsity" else f"{target:,.0f}"
    nearest = min(fixed, key=lambda f: abs(f.heads - r.heads))
    rows.append((key.removeprefix("target_"), f"{r.extra['fraction']:g}", asked, reached,
                 r.extra["target_heads"], r.heads, r.extra["by_gates"], r.extra["changed"],
                 f"{r.params_non_embedding / base.params_non_embedding:.3f}",
                 f"{r.macs_per_token / base.macs_per_token:.3f}", f"{r.test:.3f}",
                 f"λ={nearest.extra['lam']:g}: {_pct(_sparsity(nearest, total))}, "
                 f"{nearest.test:.3f}", f"{r.test - nearest.test:+.3f}"))
  md = table(("budget", "in the plan", "asked", "reached", "heads allowed",
              "heads kept", "kept by the gates alone", "decisions changed",
              "params / baseline", "MACs / baseline", f"test {metric}",
              "nearest fixed λ: sparsity, test", "Δ test vs it"), rows)
  trajectories = {}
  for r in records:
    values = scalars(exp.run_dir(r.name), ("open_controlled", "open_target"))
    if values:
      trajectories[budget_label(r.extra)] = {
          "step": values["step"], "open": values["open_controlled"],
          "target": values["open_target"]}
  out = exp.workdir / "budget.png"
  figures.trajectories_figure(trajectories, out)
  return Report(md, [str(out)], [base, *records, *fixed])


def distill(exp: runs_lib.Experiment) -> Report:
  """At each head sparsity: the plain budget run and each distillation variant, all
  with exactly the same heads allowed, against the unpruned `continued` (seed 0)."""
  s, total = full_plan(exp.plan, "distill"), _total_heads(exp)
  base = exp.baseline()
  continued = exp.continued(0)
  variants = ("", *s.distill_variants)
  runs = {(sparsity, variant): exp.budget("target_sparsity", sparsity, 0, variant)
          for sparsity in s.distill_sparsities for variant in variants}
  speed = {key: _train_tokens_per_s(exp.run_dir(r.name)) for key, r in runs.items()}
  rows = []
  for (sparsity, variant), r in runs.items():
    plain = runs[sparsity, ""]
    keys = s.distill_variants[variant] if variant else {}
    rows.append((
        _pct(sparsity), variant or "plain",
        ", ".join(f"{k}={v:g}" for k, v in keys.items() if isinstance(v, float)) or "-",
        f"{r.heads} ({' '.join(map(str, r.heads_per_layer))})", f"{r.test:.3f}",
        f"{r.test - continued.test:+.3f}",
        "-" if not variant else f"{r.test - plain.test:+.3f}",
        f"{speed[sparsity, variant]:,.0f}",
        "-" if not variant else
        f"{speed[sparsity, ''] / speed[sparsity, variant] - 1:+.0%}"))
  md = (f"Baseline test {base.metric} {base.test:.3f}; `continued` (unpruned, the pruning "
        f"recipe's steps): {continued.test:.3f}. Every run of a sparsity keeps exactly "
        f"its heads (of {total}).\n\n")
  md += table(("sparsity", "variant", "distill", "heads kept (per layer)",
               f"test {base.metric}", "Δ vs continued", "Δ vs plain",
               "train tokens/s (median)", "step time vs plain"), rows)
  out = exp.workdir / "distill.png"
  figures.xy_figure(
      [figures.Series(variant or "plain", [100 * sparsity for sparsity in s.distill_sparsities],
                      [runs[sparsity, variant].test for sparsity in s.distill_sparsities],
                      f"{marker}-", hollow=True)
       for variant, marker in zip(variants, figures.MARKERS)],
      "head sparsity (%)", f"test {base.metric}",
      "Budget runs with and without distillation from the baseline", out,
      hline=("continued (unpruned)", continued.test))
  return Report(md, [str(out)], [base, continued, *runs.values()])


def _train_tokens_per_s(workdir) -> float:
  """The median of a run's logged training rates (which leave out the steps that
  compile: `progress.TrainProgress`)."""
  return float(np.median(scalars(workdir, ("tokens_per_s",))["tokens_per_s"]))


def budget_label(extra: dict) -> str:
  """'params 60% of baseline (19 heads)': what a budget run asked for, in words (a
  size the plan gives as a figure, not a fraction: 'params 5,000 (19 heads)')."""
  key, value = extra["target_key"].removeprefix("target_"), extra["fraction"]
  if key == "sparsity":
    asked = f"{100 * value:g}%"
  else:
    asked = f"{100 * value:g}% of baseline" if value < 1 else f"{value:,.0f}"
  return f"{key} {asked} ({extra['target_heads']} heads)"


def scalars(workdir, tags) -> dict[str, list]:
  """Logged scalars of a run (its TensorBoard events), aligned on their steps."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  found = {tag: {} for tag in tags}
  for path in sorted(glob.glob(str(workdir / "events.out.tfevents.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag in found:
          found[value.tag][event.step] = float(tf.make_ndarray(value.tensor))
  steps = sorted(set.intersection(*(set(v) for v in found.values())))
  if not steps:
    return {}
  return {"step": steps, **{tag: [found[tag][k] for k in steps] for tag in tags}}


SUITES = {"lambda_sweep": lambda_sweep, "ablation": ablation, "txl_widths": txl_widths,
          "heuristics": heuristics, "budget": budget, "distill": distill}


# --- The runs each suite makes, listed so that all are checked before the first trains.

def _continued_runs(exp, seeds) -> list[runs_lib.PlannedRun]:
  return [exp.continued_run(seed) for seed in seeds]


def _l0_runs(exp, lam_key: str, seeds, variant: str = "full") -> list[runs_lib.PlannedRun]:
  lambdas = getattr(exp.plan, lam_key)
  return [exp.l0_run(lam, seed, variant, lam_key)
          for lam in (lambdas if isinstance(lambdas, tuple) else (lambdas,))
          for seed in seeds]


def _budget_runs(exp) -> list[runs_lib.PlannedRun]:
  s = full_plan(exp.plan, "budget")
  return ([exp.budget_run(key, value, seed) for key, value in s.budgets
           for seed in s.budget_seeds]
          + _l0_runs(exp, "budget_reference_lambdas", (0,)))


def _distill_runs(exp) -> list[runs_lib.PlannedRun]:
  s = full_plan(exp.plan, "distill")
  return _continued_runs(exp, (0,)) + [
      exp.budget_run("target_sparsity", sparsity, 0, variant, "distill_sparsities")
      for sparsity in s.distill_sparsities for variant in ("", *s.distill_variants)]


# Besides the baseline, whose config the command checks itself. The heuristics suite
# also fine-tunes masked baselines as `continued` is trained, at the sparsities its L0
# runs reach.
PLANNED_RUNS = {
    "lambda_sweep": lambda exp: (_continued_runs(exp, exp.plan.seeds)
                                 + _l0_runs(exp, "lambdas", exp.plan.seeds)),
    "ablation": lambda exp: [run for variant in runs_lib.ABLATIONS for run in _l0_runs(
        exp, "ablation_lambda", full_plan(exp.plan, "ablation").seeds, variant)],
    "txl_widths": lambda exp: ([exp.txl_run(width) for width in exp.plan.txl_widths]
                               + _continued_runs(exp, exp.plan.seeds)
                               + _l0_runs(exp, "lambdas", exp.plan.seeds)),
    "heuristics": lambda exp: (
        _l0_runs(exp, "heuristic_lambdas", full_plan(exp.plan, "heuristics").seeds)
        + _continued_runs(exp, exp.plan.seeds)),
    "budget": _budget_runs,
    "distill": _distill_runs,
}
