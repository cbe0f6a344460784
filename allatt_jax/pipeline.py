"""Baseline → pruning → export → comparison, as one command (configs/demo.py).

Each stage is an ordinary run in its own folder of the workdir (`baseline/`, then
`pruned/`, or the first free `pruned-N/` when those hold other pruning settings), so a
rerun resumes what was not finished and reuses what was; nothing trained is
overwritten. Writes WORKDIR/report.json and WORKDIR/gates.png, and prints a summary.
"""
from etils import epath
import jax

from allatt_jax import console
from allatt_jax.reports import demo_report
from allatt_jax.reports import figures
from allatt_jax import head_costs
from allatt_jax import model as model_lib
from allatt_jax import preemption
from allatt_jax import resolver
from allatt_jax import run_config
from allatt_jax import run_files
from allatt_jax import train
from allatt_jax import trained_model
from allatt_jax import validation
from allatt_jax.errors import ConfigError
from allatt_jax.run_config import RunConfig


GATE_FLAGS = "--config.pipeline.prune_gates"


def pruning_stage_dir(workdir: epath.Path, prune_config: RunConfig
                      ) -> tuple[epath.Path, str]:
  """Where the pruning stage runs: the stage folder trained with these settings, or
  the first free one; and why, when it is not `pruned/` (else '')."""
  numbered = sorted((d for d in workdir.glob("pruned-*") if d.name[7:].isdigit()),
                    key=lambda d: int(d.name[7:]))
  taken = {}
  for folder in [workdir / "pruned", *numbered]:
    if (folder / run_files.CONFIG_FILE).is_file():
      differences = validation.setting_differences(run_files.load_config(folder),
                                                   prune_config)
      if not differences:
        return folder, ""
      taken[folder.name] = differences
  if not taken:
    return workdir / "pruned", ""
  free = next(workdir / name for name in ("pruned", *(f"pruned-{i}" for i in
                                                      range(2, len(taken) + 3)))
              if name not in taken)
  first, differences = next(iter(taken.items()))
  return free, (f"{workdir / first} holds a pruning stage with other settings "
                f"({'; '.join(differences)}), kept as it is")


def prepare(config: run_config.PipelineConfig, workdir) -> resolver.PreparedPipeline:
  """The stages of a checked pipeline (`resolver.checked_pipeline`) in `workdir`, built
  from one read of their dataset, the pruning stage starting from WORKDIR/baseline.

  Raises:
    ConfigError: `workdir` holds a single run or an export, not a pipeline.
  """
  workdir = run_files.run_path(workdir)
  if (workdir / run_files.CONFIG_FILE).is_file():
    # Its stages would go into new runs inside that run's folder, and exit 0.
    raise ConfigError(
        f"--workdir {workdir} holds a single run or export (its {run_files.CONFIG_FILE}), "
        "but this config is a pipeline, whose runs go in WORKDIR/baseline and "
        "WORKDIR/pruned. Give the pipeline's own --workdir (the folder above its "
        "baseline/), or a new one.")
  return resolver.prepared_pipeline(config, workdir / "baseline")


def run(stages: resolver.PreparedPipeline, workdir) -> dict:
  """Runs (or resumes) the pipeline's stages (`prepare`) in `workdir`; returns the
  report."""
  workdir = run_files.run_path(workdir)
  baseline_config, prune_config = stages.baseline.run, stages.pruning.run
  corpus = stages.baseline.corpus
  # Its folder is chosen by the settings it will really train with, as completed.
  pruned_dir, why = pruning_stage_dir(workdir, prune_config)
  is_main = jax.process_index() == 0
  # One watch for the whole pipeline: a signal between stages stops it there too.
  with preemption.PreemptionWatch() as watch:
    if is_main:
      console.banner(f"Baseline: {baseline_config.train.num_steps} steps of "
                     f"{baseline_config.model.kind} on {baseline_config.data.name} in "
                     f"{workdir / 'baseline'}")
    baseline = train.train_and_evaluate(stages.baseline, workdir / "baseline", watch=watch)
    watch.stop_if_asked(f"the baseline stage (in {workdir / 'baseline'})",
                        "go on with the pruning stage")
    if is_main:
      if why:
        print(f"{why}; this one goes to {pruned_dir}.", flush=True)
      console.banner(f"Pruning: {prune_config.train.num_steps} steps from the baseline "
                     f"with L0 gates ({_pruning_goal(prune_config)}, frozen at "
                     f"step {prune_config.gates.freeze_step}) in {pruned_dir}")
    pruned = train.train_and_evaluate(stages.pruning, pruned_dir, watch=watch,
                                      gate_flags=GATE_FLAGS)
    watch.stop_if_asked(f"the pruning stage (in {pruned_dir})",
                        "go on with the speed comparison and the report")

    if is_main:
      console.banner("Evaluation: inference speed of both models on valid "
                     f"({stages.speed_batches} batches, best of 3)")
    baseline_model = trained_model.load(workdir / "baseline")
    pruned_model = trained_model.load(pruned["export"]["directory"])
    compared = demo_report.compare_models(baseline_config, stages.baseline.setup.mesh,
                                          corpus.splits["valid"],
                                          stages.speed_batches, baseline_model,
                                          pruned_model)
    watch.stop_if_asked("the speed comparison (not kept)",
                        "measure it again and write the report")
    # The last safe point is behind: a SIGTERM now lets the report (a second's work)
    # finish, and the command ends with everything done.
    report = demo_report.build(baseline_config, prune_config, pruned_dir, baseline,
                               pruned, compared)
    if is_main:
      console.banner(f"Report: {workdir / 'report.json'}, {workdir / 'gates.png'}")
      run_files.write_json(workdir / "report.json", report)
      figures.gate_figure(pruned_dir, workdir / "gates.png")
      print(demo_report.summary_table(report))
      for warning in report["warnings"]:
        print(f"warning: {warning}", flush=True)
  return report


def _pruning_goal(prune_config: RunConfig) -> str:
  """'λ=0.05', or the budget: 'target_sparsity=0.5: 16 of 32 heads' (with persistent
  groups: 'target_macs 512,000 over heads and groups of 64 persistent slots')."""
  gates = prune_config.gates
  key = gates.budget_target
  kinds = ("heads and " if gates.heads else "") + (
      f"groups of {gates.persistent_group} persistent slots")
  if key is None:
    return f"λ={gates.lam}" + (f" over {kinds}" if gates.persistent_group else "")
  value = getattr(gates, key)
  # A size in full (the figure a fraction stood for: resolver.checked_config).
  asked = f"{key}={value:g}" if key == "target_sparsity" else f"{key} {value:,.0f}"
  if gates.persistent_group:
    return f"{asked} over {kinds}"
  cfg = model_lib.ModelConfig.from_config(prune_config)
  return (f"{asked}: {head_costs.target_open_heads(prune_config, cfg)} of "
          f"{sum(cfg.layer_heads)} heads")
