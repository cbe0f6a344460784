"""Joining the processes of a multi-host run (TPU pod slice, GPU nodes) at start-up.

`initialize` must run before anything touches a device. Settings, first match wins:
flags (`--coordinator_address`, `--num_processes`, `--process_id`), then
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID; a cluster
`jax.distributed.initialize()` detects (Cloud TPU VM, Slurm, Open MPI); else one
process. On CPU, gloo collectives let a multi-process run work on one machine.
"""
import dataclasses
import os

from absl import logging
import jax

from allatt_jax.config.errors import ConfigError

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class Settings:
  """Explicit settings of a multi-process run; None where not given."""
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None

  def given(self) -> dict:
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def settings_from(coordinator_address: str | None = None, num_processes: int | None = None,
                  process_id: int | None = None, environ=None) -> Settings:
  """Flag values, each falling back to its environment variable."""
  environ = os.environ if environ is None else environ

  def integer(value, name):
    if value is None or isinstance(value, int):
      return value
    try:
      return int(value)
    except ValueError:
      raise ConfigError(f"{name}={value!r} is not an integer.") from None

  return Settings(
      coordinator_address=coordinator_address or environ.get(ENV_COORDINATOR_ADDRESS) or None,
      num_processes=integer(
          num_processes if num_processes is not None else environ.get(ENV_NUM_PROCESSES),
          ENV_NUM_PROCESSES),
      process_id=integer(
          process_id if process_id is not None else environ.get(ENV_PROCESS_ID),
          ENV_PROCESS_ID))


def _check(settings: Settings) -> None:
  if (settings.num_processes is not None and settings.process_id is not None
      and not 0 <= settings.process_id < settings.num_processes):
    raise ConfigError(f"process_id={settings.process_id} is not in "
                      f"[0, num_processes={settings.num_processes}).")


def initialize(settings: Settings) -> None:
  """Joins this process to the run's other processes, if it has any.

  Raises:
    ConfigError: settings that are out of range, or incomplete where JAX detects no
      cluster to fill in the rest.
  """
  _check(settings)
  given = settings.given()
  try:
    jax.distributed.initialize(**given)
  except ValueError:
    # JAX raises ValueError when neither the arguments nor a detected cluster name a
    # coordinator, a process count and an id, e.g. on a single machine, or on a TPU VM
    # outside a GCE slice (a Colab runtime), whose metadata lists no workers.
    if given:
      missing = sorted(set(dataclasses.asdict(settings)) - set(given))
      raise ConfigError(
          "A multi-process run needs coordinator_address, num_processes and process_id "
          f"(flags, or environment variables {ENV_COORDINATOR_ADDRESS}, "
          f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); missing: {', '.join(missing)}.") from None
    logging.debug("No multi-process cluster found: running as a single process.")
    return
  logging.info("Joined a %d-process run as process %d (%s).", jax.process_count(),
               jax.process_index(), "explicit settings" if given else "detected cluster")
