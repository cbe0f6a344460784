"""The accelerator suite `repro` (configs/repro_wt2.py): the paper's Table 1 and Fig. 3.

Runs the All-att baseline, an L0 pruning run at each of `experiments.lambdas` (scored
as its export) and a Transformer-XL at each of `experiments.txl_widths`. The report
names the device and date (its numbers compare only on the same hardware) and each
run's training throughput.
"""
import datetime

import jax
import numpy as np

from allatt_jax.reports import figures
from allatt_jax.experiments import runs as runs_lib
from allatt_jax.experiments import suites


def repro(exp: runs_lib.Experiment) -> suites.Report:
  s = exp.plan
  total = sum(exp.base_model.layer_heads)
  base = exp.baseline()
  pruned = [exp.l0(lam, seed) for lam in s.lambdas for seed in s.seeds]
  txl = [exp.txl(width) for width in s.txl_widths]
  metric = base.metric

  def row(model, lam, r, gated_test="-"):
    return (model, lam, f"{100 * (1 - r.heads / total):.1f}%",
            "/".join(map(str, r.heads_per_layer)), f"{r.params_non_embedding:,}",
            f"{r.macs_per_token:,.0f}", f"{r.valid:.2f}", f"{r.test:.2f}", gated_test,
            _tokens_per_s(exp, r.name), f"{r.wall_s / 60:.1f}")

  rows = [row(f"All-att d={base.d_model}", "-", base)]
  rows += [row(f"All-att L0 (seed {r.extra['seed']})", f"{r.extra['lam']:g}", r,
               f"{r.extra['gated_test']:.2f}") for r in pruned]
  rows += [row(f"TXL d={r.d_model}", "-", r) for r in txl]
  md = _setting(exp) + "\n\n" + suites.table(
      ("model", "λ", "sparsity", "heads per layer", "params w/o emb",
       "MACs/token w/o emb", f"valid {metric}", f"test {metric}",
       f"test {metric} before export", "train tokens/s", "run min"), rows)
  md += ("\n\nPruned models are scored as exported (closed heads removed, s_g folded "
         "in); 'before export' is the gated model they came from, which they must "
         "match.")

  out = exp.workdir / "repro_fig3.png"
  figures.xy_figure(
      [figures.Series("TXL, reduced width", [r.params_non_embedding for r in txl],
                      [r.test for r in txl], "s-"),
       figures.Series("All-att baseline", [base.params_non_embedding], [base.test], "D"),
       figures.Series("All-att L0 pruned", [r.params_non_embedding for r in pruned],
                      [r.test for r in pruned], "o")],
      "parameters w/o embedding", f"test {metric}", "Pruned All-att vs narrower TXL",
      out)
  return suites.Report(md, [str(out)], [base, *pruned, *txl])


def repro_runs(exp: runs_lib.Experiment) -> list[runs_lib.PlannedRun]:
  """The runs of `repro` besides the baseline, for the checks before any of them."""
  s = exp.plan
  return ([exp.l0_run(lam, seed) for lam in s.lambdas for seed in s.seeds]
          + [exp.txl_run(width) for width in s.txl_widths])


def _setting(exp: runs_lib.Experiment) -> str:
  """Where and how the runs were made: device, date, dtype, step counts."""
  c, devices = exp.base, jax.devices()
  return (f"{devices[0].device_kind} × {len(devices)} ({jax.default_backend()}, jax "
          f"{jax.__version__}), {datetime.date.today().isoformat()}; "
          f"{c.model.num_layers} layers, {c.model.dtype} compute; baseline and TXLs "
          f"{c.train.num_steps:,} steps of {c.train.batch_size} × {c.train.seq_len} "
          f"tokens, pruning runs {exp.plan.prune_train['num_steps']:,} steps (gates "
          f"frozen at {exp.plan.prune_gates['freeze_step']:,}).")


def _tokens_per_s(exp: runs_lib.Experiment, name: str) -> str:
  """Median logged training throughput of a run (which leaves out the steps that
  compile: `progress.TrainProgress`)."""
  logged = suites.scalars(exp.run_dir(name), ("tokens_per_s",)).get("tokens_per_s", [])
  return f"{np.median(logged):,.0f}" if logged else "-"
