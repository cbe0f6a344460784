r"""Runs experiment suites and writes their tables and figures into the workdir.

  python -m allatt_jax.experiments --suite=lambda_sweep --config=configs/exp_chars.py \
      --workdir=/tmp/exp_chars

Writes WORKDIR/<suite>.md and PNGs; runs live in WORKDIR/runs/ and are reused or
resumed, so suites (or `all`; `repro` is not in it) can share a workdir.
`--max_minutes=M` stops after M minutes with a checkpoint and status 143, as on SIGTERM
(a run ending in time still evaluates and exports first); rerun to continue.
"""
import pathlib
import time

from absl import flags
import jax

from allatt_jax.config import cli
from allatt_jax.training import preemption
from allatt_jax.training import assembly
from allatt_jax.experiments import persistent
from allatt_jax.experiments import plan
from allatt_jax.experiments import repro
from allatt_jax.experiments import runs
from allatt_jax.experiments import suites

# `all`: every suite but repro, which needs its own config and an accelerator.
ALL = (*suites.SUITES, "persistent")
SUITES = {**suites.SUITES, "persistent": persistent.persistent, "repro": repro.repro}
PLANNED_RUNS = {**suites.PLANNED_RUNS, "persistent": persistent.planned_runs,
                "repro": repro.repro_runs}

_CONFIG = cli.DEFINE_config(
    "config", "Experiment config (configs/exp_chars.py; configs/repro_wt2.py for "
    "--suite=repro).", lock_config=False)
_SUITE = flags.DEFINE_enum("suite", None, [*SUITES, "all"], "Which suite to run.",
                           required=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where the runs, tables and figures go; a rerun reuses its "
    "finished runs.", required=True)
_MAX_MINUTES = flags.DEFINE_float(
    "max_minutes", None, "Stop training after this many minutes with a checkpoint and "
    "exit with status 143; rerun to continue.", lower_bound=0.0)


def run_suite(name: str, experiment: runs.Experiment) -> suites.Report:
  """Runs one suite and writes WORKDIR/<name>.md."""
  start = time.perf_counter()
  report = SUITES[name](experiment)
  elapsed = time.perf_counter() - start
  compute = sum({r.name: r.wall_s for r in report.records}.values())
  figures = "".join(f"\n\n![{pathlib.Path(f).stem}]({pathlib.Path(f).name})"
                    for f in report.figures)
  text = (f"## Suite `{name}`\n\n{report.markdown}{figures}\n\n"
          f"Wall time of this invocation: {elapsed / 60:.1f} min; of its "
          f"{len({r.name for r in report.records})} runs when they were made: "
          f"{compute / 60:.1f} min.\n")
  if jax.process_index() == 0:
    (experiment.workdir / f"{name}.md").write_text(text)
  return report


def main(argv):
  del argv
  start = time.monotonic()
  with preemption.PreemptionWatch() as watch:
    deadline = None if _MAX_MINUTES.value is None else start + 60 * _MAX_MINUTES.value
    config = _CONFIG.value
    names = list(ALL) if _SUITE.value == "all" else [_SUITE.value]
    experiment_plan = plan.from_section(config.experiments.to_dict())
    suites.check_plan(experiment_plan, names)
    base = assembly.checked_config(config)
    # Every run of every suite asked for, checked before any data is read.
    planned = runs.Experiment(base, experiment_plan, _WORKDIR.value, read_data=False)
    for name in names:
      planned.check(PLANNED_RUNS[name](planned), name)
    experiment = runs.Experiment(base, experiment_plan, _WORKDIR.value, deadline, watch)
    jax.config.update("jax_compilation_cache_dir",
                      str(experiment.workdir.absolute() / "compile_cache"))
    for name in names:
      run_suite(name, experiment)
      if jax.process_index() == 0:
        print((experiment.workdir / f"{name}.md").read_text())


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
