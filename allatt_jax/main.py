r"""Runs a config: a training or pruning run, or the whole demo pipeline.

  python -m allatt_jax.main --config=configs/wt103_prune.py:lam=0.015,init_from=$BASE \
      --workdir=$WORKDIR

Flags only; the work is in `train` (one run) and `pipeline` (baseline → pruning →
export → comparison, for configs with a `pipeline` section such as configs/demo.py).
"""
from absl import flags
from absl import logging
import jax

from allatt_jax.config import cli
from allatt_jax.parallel import distributed
from allatt_jax.runs import run_files
from allatt_jax.runs import workdir_checks
from allatt_jax.training import pipeline
from allatt_jax.training import assembly
from allatt_jax.training import loop

_CONFIG = cli.DEFINE_config(
    "config", "Run config: a baseline or pruning run, or a pipeline (configs/demo.py).")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where checkpoints, logs and reports go; rerunning on the same "
    "workdir resumes.", required=True)
# Multi-host runs (see allatt_jax/parallel/distributed.py); unset on one host and on Cloud TPU.
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordinator "
    f"(default: ${distributed.ENV_COORDINATOR_ADDRESS}).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, f"Processes in the run (default: ${distributed.ENV_NUM_PROCESSES}).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, f"This process's index (default: ${distributed.ENV_PROCESS_ID}).")


def main(argv):
  del argv
  config = _CONFIG.value
  workdir_checks.check_folder(run_files.run_path(_WORKDIR.value))
  distributed.initialize(distributed.settings_from(
      _COORDINATOR_ADDRESS.value, _NUM_PROCESSES.value, _PROCESS_ID.value))
  if jax.process_count() > 1:
    logging.info("JAX process %d/%d, local devices: %s", jax.process_index(),
                 jax.process_count(), jax.local_devices())
  if config.get("pipeline"):
    stages = pipeline.prepare(assembly.checked_pipeline(config), _WORKDIR.value)
    pipeline.run(stages, _WORKDIR.value)
  else:
    loop.train_and_evaluate(assembly.prepared_run(assembly.checked_config(config)),
                            _WORKDIR.value)


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  jax.config.config_with_absl()
  cli.run(main, argv)


if __name__ == "__main__":
  run()
