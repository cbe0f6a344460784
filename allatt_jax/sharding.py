"""The device mesh and how logical axis names map onto it.

Parameters and activations carry logical names (batch, heads, persistent, ...); the
rules below place the batch on the 'data' mesh axis and attention heads (hence each
head's projections and persistent vectors) and the feed-forward width on 'model'.
Everything else is replicated.
"""
import contextlib

import flax.linen as nn
import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_collections

from allatt_jax.errors import ConfigError

MESH_AXES = ("data", "model")
LOGICAL_RULES = (
    ("batch", "data"),
    ("heads", "model"),
    ("mlp", "model"),
)


def mesh_shape(mesh_config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int]:
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


def make_mesh(mesh_config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  shape = mesh_shape(mesh_config, jax.device_count())
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 2)


@contextlib.contextmanager
def activate(mesh):
  """The mesh and logical rules under which models are traced and steps run."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
    yield


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
