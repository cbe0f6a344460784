"""The suite `persistent`: what to prune at a MAC budget, heads or persistent memory.

At each MAC budget (`experiments.persistent_budgets`, fractions of the unpruned MACs
per token), budget runs prune to the same size by heads only, by groups of persistent
slots only (`gates.heads=False`), and by both, each plain and distilling; a kind that
cannot reach a budget is left out and the table says so. Each export's inference speed
is measured against the baseline's on the same tokens (interleaved rounds: speed.py).
"""
from allatt_jax.evaluation import speed as speed_lib
from allatt_jax.reports import figures
from allatt_jax.pruning import cost_model
from allatt_jax.parallel import sharding
from allatt_jax.runs import trained_model
from allatt_jax.experiments import runs as runs_lib
from allatt_jax.experiments import suites

KINDS = {"": "heads", "groups": "groups", "both": "heads + groups"}
KEY = "target_macs"


def _units(exp: runs_lib.Experiment) -> cost_model.UnitCosts:
  e = exp.base.eval
  return cost_model.UnitCosts.of(exp.base_model, KEY, (e.seq_len, e.mem_len, e.batch_size),
                                 exp.plan.persistent_group)


def reachable(exp: runs_lib.Experiment, fraction: float, groups: str) -> bool:
  """Whether a kind of unit can prune to `fraction` of the MACs: groups alone keep
  every head's own cost."""
  if groups != "groups":
    return True
  units, heads = _units(exp), exp.base_model.layer_heads
  full = units.cost(heads, [h * units.groups_per_head for h in heads])
  return fraction * full >= units.cost(heads, [0] * len(heads))


def _planned(exp: runs_lib.Experiment):
  """(fraction, kind, distill variant) of every run the suite makes, in order."""
  s = suites.full_plan(exp.plan, "persistent")
  return [(fraction, groups, distill) for fraction in s.persistent_budgets
          for groups in KINDS for distill in ("", s.persistent_distill)
          if reachable(exp, fraction, groups)]


def planned_runs(exp: runs_lib.Experiment) -> list[runs_lib.PlannedRun]:
  return [exp.continued_run(0)] + [
      exp.budget_run(KEY, fraction, 0, distill, "persistent_budgets", groups)
      for fraction, groups, distill in _planned(exp)]


def persistent(exp: runs_lib.Experiment) -> suites.Report:
  s = suites.full_plan(exp.plan, "persistent")
  base = exp.baseline()
  continued = exp.continued(0)
  runs = {(f, g, d): exp.budget(KEY, f, 0, d, g, "persistent_budgets")
          for f, g, d in _planned(exp)}
  speed = _speedups(exp, base, runs, s.speed_batches)
  units = _units(exp)
  total_slots = sum(base.persistent_per_layer)
  rows = []
  for (fraction, groups, distill), r in runs.items():
    heads_only = runs.get((fraction, "", distill))
    decision = r.extra["decision"]
    rows.append((
        f"{fraction:.0%}", KINDS[groups], distill or "-",
        f"{r.heads} ({' '.join(map(str, r.heads_per_layer))})",
        f"{sum(r.persistent_per_layer) / total_slots:.1%}",
        f"{r.macs_per_token:,.0f} ({r.macs_per_token / base.macs_per_token:.4f})",
        _by_gates(decision, units), f"{r.test:.3f}", f"{r.test - continued.test:+.3f}",
        "-" if not groups or heads_only is None else f"{r.test - heads_only.test:+.3f}",
        f"{speed[r.name]:.2f}x", f"{base.macs_per_token / r.macs_per_token:.2f}x"))
  left_out = [f"{fraction:.0%} ({KINDS[groups]})" for fraction in s.persistent_budgets
              for groups in KINDS if not reachable(exp, fraction, groups)]
  md = (f"Baseline test {base.metric} {base.test:.3f}; `continued` (unpruned, the "
        f"pruning recipe's steps): {continued.test:.3f}. MAC budgets as fractions of "
        f"the baseline's {base.macs_per_token:,.0f} MACs per token; persistent groups "
        f"of {s.persistent_group} slots; distilling runs: `{s.persistent_distill}`.\n\n")
  md += suites.table(
      ("MACs kept", "pruned", "distill", "heads kept (per layer)", "persistent kept",
       "MACs (/ baseline)", "gates alone: heads, groups, MACs", f"test {base.metric}",
       "Δ vs continued", "Δ vs heads only", "measured speed-up", "MAC speed-up"), rows)
  if left_out:
    md += ("\n\nNot reachable, so not run: " + ", ".join(left_out) + ": groups alone "
           "keep every head's projections and context attention, "
           f"{units.cost(base.heads_per_layer, [0] * len(base.heads_per_layer)) / base.macs_per_token:.1%}"
           " of the MACs.")
  out = exp.workdir / "persistent.png"
  series = []
  for (groups, distill), marker in zip(
      [(g, d) for g in KINDS for d in ("", s.persistent_distill)], figures.MARKERS):
    points = sorted((100 * r.macs_per_token / base.macs_per_token, r.test)
                    for (f, g, d), r in runs.items() if (g, d) == (groups, distill))
    if points:
      xs, ys = zip(*points)
      series.append(figures.Series(f"{KINDS[groups]}{', ' + distill if distill else ''}",
                                   list(xs), list(ys), f"{marker}-" if not distill
                                   else f"{marker}--", hollow=True))
  figures.xy_figure(series, "MACs per token kept (% of the baseline)", f"test {base.metric}",
                    "At equal MACs: pruning heads, persistent groups, or both", out,
                    hline=("continued (unpruned)", continued.test))
  return suites.Report(md, [str(out)], [base, continued, *runs.values()])


def _by_gates(decision: dict, units: cost_model.UnitCosts) -> str:
  """What the gates alone kept at the freeze, before the budget's rank rule."""
  if not decision:
    return "-"
  if "groups" in decision:
    return (f"{decision['by_gates']}, {decision['groups_by_gates']}, "
            f"{decision['cost_by_gates']:,.0f}")
  return f"{decision['by_gates']}, all, {decision['by_gates'] * units.full_head:,.0f}"


def _speedups(exp: runs_lib.Experiment, base, runs: dict, batches: int) -> dict:
  """Each export's inference speed-up over the baseline (`speed_lib.speedup`)."""
  corpus = exp.corpus
  baseline = trained_model.load(exp.run_dir(base.name))
  mesh = sharding.run_mesh(exp.base.mesh)
  speed = {}
  for r in runs.values():
    export = exp.run_dir(r.name) / "export"
    measured = speed_lib.tokens_per_s(exp.base, mesh, corpus.splits["valid"], batches,
                                      {"baseline": baseline,
                                       "pruned": trained_model.load(export)})
    speed[r.name] = speed_lib.speedup(measured)["speedup"]
  return speed

