r"""Compiles a config's train step for a large mesh without running it or allocating state.

  python -m allatt_jax.compile_check --config=configs/wt103_base.py --devices=16 --mesh=8,2

A pipeline config (configs/demo.py) compiles both stages' steps, the pruning stage's
with its gates (and teacher, where it distills), and `--json` holds both reports by
stage. Compiles the sharded step for `--devices` fake CPU devices as a (data, model) mesh from
abstract shapes, so a sharding mistake shows in a minute on a laptop. Prints compile
time, XLA's per-device memory plan and FLOPs: XLA:CPU's figures, a sanity check of the
sharding, not an exact HBM budget.
"""
import dataclasses
import json

from absl import flags
import jax

from allatt_jax.config import cli
from allatt_jax.perf import compile_report
from allatt_jax.config import errors
from allatt_jax.config import run_config
from allatt_jax.parallel import sharding

_CONFIG = cli.DEFINE_config("config", "Run config whose train step is compiled.")
_DEVICES = flags.DEFINE_integer(
    "devices", 0, "Fake CPU devices to compile for (default: the devices JAX sees).",
    lower_bound=0)
_MESH = flags.DEFINE_string("mesh", "", "DATA,MODEL mesh sizes; -1 fills (default: all data).")
_JSON = flags.DEFINE_string("json", "", "Also write the report to this JSON file.")


def _mesh_shape(text: str, devices: int) -> tuple[int, int]:
  try:
    data, model = (int(x) for x in text.split(","))
  except ValueError:
    raise errors.ConfigError(f"--mesh={text!r}: expected DATA,MODEL, e.g. 8,4.") from None
  return sharding.mesh_shape(run_config.MeshSection(data=data, model=model), devices)


def main(argv):
  del argv
  wanted = _DEVICES.value
  if wanted:
    # Read once, when the first device is touched: nothing has touched one yet.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", wanted)
  devices = jax.device_count()
  if wanted and devices != wanted:
    raise errors.ConfigError(f"--devices={wanted}, but JAX sees {devices} devices.")
  mesh = _mesh_shape(_MESH.value, devices) if _MESH.value else (devices, 1)
  config, name = _CONFIG.value, cli.config_file_name("config")
  if config.get("pipeline"):
    reports = compile_report.check_pipeline(config, mesh, name)
    print("\n".join(report.summary() for report in reports.values()))
    written = {stage: dataclasses.asdict(report) for stage, report in reports.items()}
  else:
    report = compile_report.check(config, mesh, name)
    print(report.summary())
    written = dataclasses.asdict(report)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(written, f, indent=2)


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
