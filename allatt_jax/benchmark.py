r"""Throughput of a config's model: train steps, pruned models' inference, matmul peak.

  python -m allatt_jax.benchmark --config=configs/bench_cpu.py --out=/tmp/bench.json
  python -m allatt_jax.benchmark --config=configs/bench_cpu.py --profile \
    --variant=two_heads_a_step:model.head_block=2

Prints a summary and the JSON report; the config's `benchmark` section sets steps,
rounds and head fractions. `--out` holds the report of the rounds done so far after
each round (`rounds_done`), so a run stopped at a time limit keeps its figures.
A pipeline config (configs/demo.py) has its baseline timed, and the gated and
distilling steps of its pruning stage (`pipeline.prune_gates`, `prune_distill`,
`prune_train`). `--profile` adds where the baseline step's time goes;
`--variant=NAME:section.key=value,...` times the config with overrides beside it.
The report's `compiles` lists this process's XLA compiles so far, each function's
name and seconds: on a GPU they take most of a benchmark's minutes.
"""
from collections.abc import Sequence
import dataclasses
import json

from absl import flags
import jax

from allatt_jax.perf import bench_report
from allatt_jax.perf import config_variants
from allatt_jax.config import cli
from allatt_jax.runs import run_files
from allatt_jax.training import assembly
from allatt_jax.perf import timing

_CONFIG = cli.DEFINE_config(
    "config", "Config of the model to time; its `benchmark` section (if any) sets "
    "steps, rounds and head fractions (configs/bench_cpu.py).")
_OUT = flags.DEFINE_string("out", None, "Also write the JSON report to this file (the "
                           "rounds done so far after each round, then the whole).")
_PROFILE = flags.DEFINE_boolean(
    "profile", False, "Also trace the baseline train steps and report where their time "
    "goes (the config's benchmark.profile).")
_VARIANT = flags.DEFINE_multi_string(
    "variant", [], "NAME:SECTION.KEY=VALUE[,...]: also time the config with these "
    "overrides, in the same rounds (adds to the config's benchmark.variants).")


# This process's XLA compiles, in order: {"function": name, "seconds": ...}.
_COMPILES = []


def _record_compile(event: str, seconds: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES.append({"function": kwargs.get("fun_name", "?"), "seconds": seconds})


def main(argv: Sequence[str]) -> None:
  del argv
  jax.monitoring.register_event_duration_secs_listener(_record_compile)
  plan = timing.BenchmarkPlan.from_dict(_CONFIG.value.get("benchmark", {}))
  plan = dataclasses.replace(
      plan, profile=plan.profile or _PROFILE.value,
      variants=config_variants.from_flags(_VARIANT.value, plan.variants))
  config = _CONFIG.value
  if config.get("pipeline"):
    # The gated steps are timed as the pipeline's pruning stage trains.
    stages = assembly.pipeline_with_vocab_size(assembly.checked_pipeline(config))
    report = timing.measure(stages.baseline, plan, on_round=_write, pruning=stages.pruning)
  else:
    report = timing.measure(assembly.checked_config(config), plan, on_round=_write)
  _write(report)
  print(bench_report.summary(report))
  seconds = sorted((c["seconds"] for c in _COMPILES), reverse=True)
  print(f"{len(seconds)} XLA compiles, {sum(seconds):.1f} s; over a second: "
        + ", ".join(f"{s:.1f}" for s in seconds if s > 1.0))
  print(json.dumps(report, indent=2))


def _write(report: dict) -> None:
  """The report, with the compiles so far, to --out, atomically: it is rewritten after
  every round."""
  report["compiles"] = list(_COMPILES)
  if _OUT.value:
    run_files.write_json(_OUT.value, report)


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
