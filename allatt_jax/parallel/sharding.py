"""The device mesh and how logical axis names map onto it.

Parameters and activations carry logical names (batch, heads, persistent, ...); the
rules below place the batch on the 'data' mesh axis and attention heads (hence each
head's projections and persistent vectors) and the feed-forward width on 'model'.
Everything else is replicated. A batch splits evenly over the 'data' axis, and into
the micro-batches of gradient accumulation (`check_accumulation`).
"""
import contextlib
import functools

import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from allatt_jax.config import run_config
from allatt_jax.config.errors import ConfigError

MESH_AXES = ("data", "model")
LOGICAL_RULES = (
    ("batch", "data"),
    ("heads", "model"),
    ("mlp", "model"),
)


def mesh_shape(mesh_config: run_config.MeshSection, num_devices: int) -> tuple[int, int]:
  """(data, model) sizes; one of them may be -1 to take the remaining devices."""
  data, model = mesh_config.data, mesh_config.model
  if data == -1 and model == -1:
    raise ConfigError("config.mesh: at most one of data and model may be -1.")
  if -1 in (data, model):
    known = model if data == -1 else data
    if known <= 0 or num_devices % known:
      raise ConfigError(
          f"config.mesh: {known} does not divide the {num_devices} available devices; "
          f"set config.mesh.data / config.mesh.model to divisors of {num_devices}.")
    data, model = (num_devices // known, model) if data == -1 else (data, num_devices // known)
  if data * model != num_devices:
    raise ConfigError(
        f"config.mesh: data={data} x model={model} = {data * model} devices, but "
        f"{num_devices} are available; use -1 for one axis to fill the rest.")
  return data, model


def make_mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
  """The ('data', 'model') mesh of these sizes (`mesh_shape`)."""
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def run_mesh(mesh_config: run_config.MeshSection) -> jax.sharding.Mesh:
  """The mesh a run's `mesh` section gives over every device of the job."""
  return make_mesh(mesh_shape(mesh_config, jax.device_count()))


@contextlib.contextmanager
def activate(mesh):
  """The mesh and logical rules under which models are traced and steps run."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
    yield


def on_host(tree):
  """`tree`'s arrays whole on this host, also where they are sharded over processes
  (every process must call it, as it gathers from all of them)."""
  if jax.process_count() > 1:
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)


def on_mesh(mesh, fn):
  """`fn`, run under `activate(mesh)` at every call (a jitted step traces there)."""
  @functools.wraps(fn)
  def run(*args, **kwargs):
    with activate(mesh):
      return fn(*args, **kwargs)
  return run


def logical_shardings(mesh, abstract_tree):
  """NamedShardings of a tree whose leaves may carry logical-axis metadata."""
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_tree), mesh,
                                     LOGICAL_RULES)


def batch_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def memory_sharding(mesh):
  return {"hidden": NamedSharding(mesh, P(None, "data")), "length": NamedSharding(mesh, P())}


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def process_rows(mesh, process_index: int | None = None) -> tuple[int, int]:
  """(i, n): this process supplies rows [i*B/n, (i+1)*B/n) of every global batch.

  Those are the rows its devices hold under `batch_sharding`. When the 'data' axis
  runs across processes in order this is (process_index, process_count); processes
  whose devices differ only along 'model' (a model axis spanning hosts) share rows.
  """
  process_index = jax.process_index() if process_index is None else process_index
  axis = mesh.axis_names.index("data")
  shards = sorted({index[axis] for index, device in np.ndenumerate(mesh.devices)
                   if device.process_index == process_index})
  if not shards:
    raise ConfigError(f"The mesh has no device of process {process_index}.")
  first, count, num_shards = shards[0], len(shards), mesh.shape["data"]
  if shards != list(range(first, first + count)) or first % count or num_shards % count:
    raise ConfigError(
        f"The mesh gives process {process_index} the batch shards {shards} of "
        f"{num_shards}, not one aligned block, so it cannot read a contiguous slice "
        "of the batch; choose config.mesh sizes that keep each host's devices together.")
  return first // count, num_shards // count


def check_accumulation(batch_size: int, accum: int) -> None:
  """Raises ConfigError unless `accum` micro-batches split the global batch evenly:
  checked when a config is resolved, and again when a step is traced on a batch."""
  if accum < 1 or batch_size % accum:
    raise ConfigError(
        f"config.train.grad_accum_steps={accum} must be a positive divisor of "
        f"config.train.batch_size={batch_size}, one of "
        f"{[d for d in range(1, batch_size + 1) if batch_size % d == 0]}.")
