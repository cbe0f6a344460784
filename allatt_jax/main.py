r"""Runs a config: a training or pruning run, or the whole demo pipeline.

  python -m allatt_jax.main --config=configs/wt103_prune.py:lam=0.015 --workdir=$WORKDIR

Flags only; the work is in `train` (one run) and `pipeline` (baseline → pruning →
export → comparison, for configs with a `pipeline` section such as configs/demo.py).
"""
import logging as logging_std

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from allatt_jax import distributed
from allatt_jax import pipeline
from allatt_jax import train
from allatt_jax import errors

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Run config file, optionally with an argument: path.py:arg.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, logs and reports go.")
flags.mark_flags_as_required(["config", "workdir"])
# Multi-host runs (see allatt_jax/distributed.py); unset on one host and on Cloud TPU.
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordinator "
    f"(default: ${distributed.ENV_COORDINATOR_ADDRESS}).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, f"Processes in the run (default: ${distributed.ENV_NUM_PROCESSES}).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, f"This process's index (default: ${distributed.ENV_PROCESS_ID}).")


class _LibraryChatterFilter(logging_std.Filter):
  """Hides routine INFO records of the checkpointing and dataset libraries."""

  def filter(self, record):
    return record.levelno > logging_std.INFO or not any(
        part in record.pathname for part in ("/orbax/", "/tensorflow_datasets/"))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_LibraryChatterFilter())
  config = _CONFIG.value
  with errors.reported_to_user():
    distributed.initialize(distributed.settings_from(
        _COORDINATOR_ADDRESS.value, _NUM_PROCESSES.value, _PROCESS_ID.value))
    logging.info("JAX process %d/%d, local devices: %s", jax.process_index(),
                 jax.process_count(), jax.local_devices())
    if config.get("pipeline"):
      pipeline.run(config, _WORKDIR.value)
    else:
      train.train_and_evaluate(config, _WORKDIR.value)


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main)
