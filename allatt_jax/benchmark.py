r"""Throughput of a config's model: train steps, pruned models' inference, matmul peak.

  python -m allatt_jax.benchmark --config=configs/bench_cpu.py --out=/tmp/bench.json

Prints a summary and the JSON report of `throughput.measure` (which describes every
figure); the config's `benchmark` section (configs/bench_cpu.py) sets steps, rounds
and head fractions, and any run config works with `throughput.BenchmarkPlan`'s
defaults (e.g. configs/wt103_base.py on an accelerator).
"""
from collections.abc import Sequence
import json

from absl import flags

from allatt_jax import cli
from allatt_jax import resolver
from allatt_jax import throughput

_CONFIG = cli.DEFINE_config(
    "config", "Config of the model to time; its `benchmark` section (if any) sets "
    "steps, rounds and head fractions (configs/bench_cpu.py).")
_OUT = flags.DEFINE_string("out", None, "Also write the JSON report to this file.")


def main(argv: Sequence[str]) -> None:
  del argv
  plan = throughput.BenchmarkPlan.from_dict(_CONFIG.value.get("benchmark", {}))
  report = throughput.measure(
      resolver.resolve_config(_CONFIG.value, vocab_from_data=True), plan)
  print(throughput.summary(report))
  print(json.dumps(report, indent=2))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(report, f, indent=2)


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
