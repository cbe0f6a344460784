"""Baseline → pruning → export → comparison, as one command (configs/demo.py).

Each stage is an ordinary run in its own folder of the workdir (`baseline/`, then
`pruned/`, or the first free `pruned-N/` when those hold other pruning settings), so a
rerun resumes what was not finished and reuses what was; nothing trained is
overwritten. Writes the report of each result beside the others (`report_files`:
WORKDIR/report.json and WORKDIR/gates.png for `pruned/`, report-N.json and
gates-N.png for `pruned-N/`), and prints a summary.
"""
from etils import epath
import jax

from allatt_jax.config import console
from allatt_jax.reports import demo_report
from allatt_jax.reports import figures
from allatt_jax.evaluation import speed
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import preemption
from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.training import loop
from allatt_jax.runs import trained_model
from allatt_jax.runs import workdir_checks
from allatt_jax.config.errors import ConfigError
from allatt_jax.config.run_config import RunConfig


GATE_FLAGS = "--config.pipeline.prune_gates"


def pruning_stage_dir(workdir: epath.Path, prune_config: RunConfig
                      ) -> tuple[epath.Path, str]:
  """Where the pruning stage runs: the stage folder trained with these settings, or
  the first free one; and why, when it is not `pruned/` (else '')."""
  taken = {}
  for folder in run_files.pruning_stages(workdir):
    saved = run_files.load_config(folder)
    if not workdir_checks.setting_differences(saved, prune_config):
      return folder, ""
    # The user is told every key that differs, also those a resumed stage may change.
    taken[folder.name] = workdir_checks.key_differences(saved, prune_config)
  stage = run_files.PRUNING_STAGE
  if not taken:
    return workdir / stage, ""
  free = next(workdir / name for name in (stage, *(f"{stage}-{i}" for i in
                                                   range(2, len(taken) + 3)))
              if name not in taken)
  first, differences = next(iter(taken.items()))
  return free, (f"{workdir / first} holds a pruning stage with other settings "
                f"({'; '.join(differences)}), kept as it is")


def report_files(workdir: epath.Path, pruned_dir: epath.Path
                 ) -> tuple[epath.Path, epath.Path]:
  """(report.json, gates.png) of the result of pruning stage `pruned_dir`, numbered as
  its folder is (report-2.json and gates-2.png for pruned-2/), so that a result of
  other pruning settings leaves the report of the one before it as it was."""
  number = pruned_dir.name[len(run_files.PRUNING_STAGE):]
  return workdir / f"report{number}.json", workdir / f"gates{number}.png"


def prepare(config: run_config.PipelineConfig, workdir) -> assembly.PreparedPipeline:
  """The stages of a checked pipeline (`assembly.checked_pipeline`) in `workdir`, built
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
  return assembly.prepared_pipeline(config, workdir / "baseline")


def run(stages: assembly.PreparedPipeline, workdir) -> dict:
  """Runs (or resumes) the pipeline's stages (`prepare`) in `workdir`; returns the
  report."""
  workdir = run_files.run_path(workdir)
  baseline_config, prune_config = stages.baseline.run, stages.pruning.run
  corpus = stages.baseline.corpus
  # Its folder is chosen by the settings it will really train with, as completed.
  pruned_dir, why = pruning_stage_dir(workdir, prune_config)
  report_file, figure_file = report_files(workdir, pruned_dir)
  is_main = jax.process_index() == 0
  # One watch for the whole pipeline: a signal between stages stops it there too.
  with preemption.PreemptionWatch() as watch:
    if is_main:
      console.banner(f"Baseline: {baseline_config.train.num_steps} steps of "
                     f"{baseline_config.model.kind} on {baseline_config.data.name} in "
                     f"{workdir / 'baseline'}")
    baseline = loop.train_and_evaluate(stages.baseline, workdir / "baseline", watch=watch)
    watch.stop_if_asked(f"the baseline stage (in {workdir / 'baseline'})",
                        "go on with the pruning stage")
    if is_main:
      if why:
        print(f"{why}; this one goes to {pruned_dir}, its report to {report_file} and "
              f"{figure_file}.", flush=True)
      console.banner(f"Pruning: {prune_config.train.num_steps} steps from the baseline "
                     f"with L0 gates ({_pruning_goal(prune_config)}, frozen at "
                     f"step {prune_config.gates.freeze_step}) in {pruned_dir}")
    pruned = loop.train_and_evaluate(stages.pruning, pruned_dir, watch=watch,
                                     gate_flags=GATE_FLAGS)
    watch.stop_if_asked(f"the pruning stage (in {pruned_dir})",
                        "go on with the speed comparison and the report")

    if is_main:
      console.banner("Evaluation: inference speed of both models on valid "
                     f"({stages.speed_batches} batches, in {speed.ROUNDS} interleaved "
                     "rounds)")
    baseline_model = trained_model.load(workdir / "baseline")
    pruned_model = trained_model.load(pruned["export"]["directory"])
    # Its timings are comparable only when measured together, so a part of it is not
    # kept: a signal stops it between its timed runs rather than after them all.
    compared = demo_report.compare_models(
        baseline_config, stages.baseline.setup.mesh, corpus.splits["valid"],
        stages.speed_batches, baseline_model, pruned_model,
        safe_point=lambda: watch.stop_if_asked(
            f"the pruning stage (in {pruned_dir}); the speed comparison in progress is "
            "not kept", "measure both models' speeds and write the report"))
    # The last safe point is behind: a signal now lets the last timed run and the
    # report (a second's work) finish, and the command ends with everything done.
    report = demo_report.build(baseline_config, prune_config, pruned_dir, baseline,
                               pruned, compared)
    if is_main:
      console.banner(f"Report: {report_file}, {figure_file}")
      run_files.write_json(report_file, report)
      print(demo_report.summary_table(report))
      for warning in report["warnings"]:
        print(f"warning: {warning}", flush=True)
    # On every process: it reads the pruning run's checkpoint, which they do together.
    figures.gate_figure(pruned_dir, figure_file)
  return report


def _pruning_goal(prune_config: RunConfig) -> str:
  """'λ=0.05', or the budget as asked and in full: 'target_macs=0.5 (282,624): 16 of
  32 heads' (with persistent groups: 'target_macs=512,000 over heads and groups of 64
  persistent slots')."""
  gates = prune_config.gates
  kinds = ("heads and " if gates.heads else "") + (
      f"groups of {gates.persistent_group} persistent slots")
  if gates.budget_target is None:
    return f"λ={gates.lam}" + (f" over {kinds}" if gates.persistent_group else "")
  if gates.persistent_group:
    return f"{gates.budget_shown} over {kinds}"
  cfg = model_lib.ModelConfig.from_config(prune_config)
  return (f"{gates.budget_shown}: {cost_model.target_open_heads(prune_config, cfg)} of "
          f"{sum(cfg.layer_heads)} heads")
