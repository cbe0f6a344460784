"""Joining the processes of a multi-host run (TPU pod slice, GPU nodes) at start-up.

Every host runs the same command; `initialize` makes them one JAX runtime whose
`jax.devices()` spans all hosts. It must run before anything touches a device.
Where the settings come from, first match wins:

1. Flags (`--coordinator_address`, `--num_processes`, `--process_id`), then the
   environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
   JAX_PROCESS_ID. All three are needed unless a cluster below can fill the rest.
2. A cluster JAX configures itself from: a Cloud TPU VM (its metadata server lists
   the slice's workers), a Slurm job step with several tasks, an Open MPI job with
   several ranks. `jax.distributed.initialize()` is called without arguments.
3. Otherwise the run is a single process and nothing is initialised.

On CPU, processes exchange data with gloo collectives (JAX's default CPU
implementation), so a multi-process run works on one machine for testing.
"""
import dataclasses
import glob
import os
import pathlib

from absl import logging
import jax

from allatt_jax.errors import ConfigError

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# PCI vendor id of Google devices; TPU chips of a Cloud TPU VM show up under it.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_PCI_DEVICES = "/sys/bus/pci/devices"


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


def _count(environ, name) -> int:
  try:
    return int(environ.get(name, "1"))
  except ValueError:
    return 1


def on_cloud_tpu_vm(pci_devices: str | None = None) -> bool:
  """Whether TPU chips are attached (read from sysfs: no device is touched)."""
  for vendor in glob.glob(os.path.join(pci_devices or _PCI_DEVICES, "*", "vendor")):
    try:
      if pathlib.Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
        return True
    except OSError:
      continue
  return False


def detect_cluster(environ=None, pci_devices: str | None = None) -> str | None:
  """'slurm', 'ompi' or 'tpu' where JAX can find its peers by itself; else None.

  Slurm and Open MPI count only when they launched several processes, so a
  single `python` inside an allocation stays a single-process run.
  """
  environ = os.environ if environ is None else environ
  if "SLURM_STEP_NODELIST" in environ and _count(environ, "SLURM_NTASKS") > 1:
    return "slurm"
  if _count(environ, "OMPI_COMM_WORLD_SIZE") > 1:
    return "ompi"
  if ("TPU_WORKER_HOSTNAMES" in environ or "TPU_PROCESS_ADDRESSES" in environ
      or on_cloud_tpu_vm(pci_devices)):
    return "tpu"
  return None


def plan(settings: Settings, cluster: str | None) -> dict | None:
  """Keyword arguments for `jax.distributed.initialize`, or None for one process."""
  given = settings.given()
  if not given:
    return {} if cluster else None
  missing = sorted(set(dataclasses.asdict(settings)) - set(given))
  if missing and cluster is None:
    raise ConfigError(
        "A multi-process run needs coordinator_address, num_processes and process_id "
        f"(flags, or environment variables {ENV_COORDINATOR_ADDRESS}, {ENV_NUM_PROCESSES}, "
        f"{ENV_PROCESS_ID}); missing: {', '.join(missing)}.")
  if (settings.num_processes is not None and settings.process_id is not None
      and not 0 <= settings.process_id < settings.num_processes):
    raise ConfigError(f"process_id={settings.process_id} is not in "
                      f"[0, num_processes={settings.num_processes}).")
  return given


def initialize(settings: Settings, environ=None) -> None:
  """Joins this process to the run's other processes, if it has any."""
  cluster = detect_cluster(environ)
  kwargs = plan(settings, cluster)
  if kwargs is None:
    return
  try:
    jax.distributed.initialize(**kwargs)
  except ValueError:
    # A TPU VM outside a GCE slice (e.g. a Colab runtime) has no worker list in its
    # metadata: JAX finds no coordinator, and the run is simply single-host.
    if kwargs or cluster != "tpu":
      raise
    logging.info("Cloud TPU VM without slice metadata: running as a single process.")
    return
  logging.info("Joined a %d-process run as process %d (%s).", jax.process_count(),
               jax.process_index(), "explicit settings" if kwargs else f"{cluster} cluster")
