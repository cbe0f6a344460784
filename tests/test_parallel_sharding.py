"""The mesh a run's config asks for, where its state and batches go on it, and which
batch rows each process reads."""
import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers
from allatt_jax.config import run_config
from allatt_jax.config.errors import ConfigError
from allatt_jax.parallel import sharding
from allatt_jax.training import assembly


def mesh_section(data, model):
  return run_config.MeshSection(data=data, model=model)


@pytest.mark.parametrize("data,model,devices,shape", [
    (-1, 2, 8, (4, 2)), (2, -1, 8, (2, 4)), (4, 2, 8, (4, 2)), (-1, 1, 1, (1, 1))])
def test_one_axis_may_take_the_devices_the_other_leaves(data, model, devices, shape):
  assert sharding.mesh_shape(mesh_section(data, model), devices) == shape


@pytest.mark.parametrize("data,model,devices,match", [
    (-1, -1, 8, r"at most one of data and model may be -1"),
    (-1, 3, 8, r"3 does not divide the 8 available devices"),
    (-1, 0, 8, r"0 does not divide the 8 available devices"),
    (-2, -1, 8, r"-2 does not divide the 8 available devices"),
    (2, 1, 4, r"data=2 x model=1 = 2 devices, but 4 are available"),
    (4, 2, 4, r"data=4 x model=2 = 8 devices, but 4 are available"),
])
def test_a_mesh_that_is_not_the_devices_is_refused(data, model, devices, match):
  with pytest.raises(ConfigError, match=match):
    sharding.mesh_shape(mesh_section(data, model), devices)


def test_micro_batches_split_the_batch_evenly():
  sharding.check_accumulation(8, 4)
  for accum in (0, -2, 3):
    with pytest.raises(ConfigError, match=rf"grad_accum_steps={accum} must be a positive "
                       r"divisor of config.train.batch_size=8, one of \[1, 2, 4, 8\]"):
      sharding.check_accumulation(8, accum)


def test_a_runs_state_and_batches_follow_the_logical_rules():
  """Heads and the feed-forward width on 'model', batch rows and the memory's rows on
  'data', the rest replicated: a TXL run's shardings (a 1 x 1 mesh names the axes as a
  large one does)."""
  config = helpers.tiny_run()
  config.data.name = "text8"
  config.model.update(dict(vocab_size=27, kind="txl", d_ff=64))
  setup = assembly.run_setup(run_config.RunConfig.of(config))
  layer = setup.state_sharding.variables["params"]["layer_0"]
  specs = jax.tree.map(lambda s: s.spec, {
      "wi": layer["feed_forward"]["wi"], "wo": layer["feed_forward"]["wo"],
      "query": layer["attention"]["query"]["kernel"],
      "out": layer["attention"]["out"]["kernel"],
      "norm": layer["feed_forward_norm"]["scale"],
      "embedding": setup.state_sharding.variables["params"]["embedding"]["emb_0"],
      "memory": setup.state_sharding.memory})
  assert specs == {
      "wi": {"kernel": P(None, "model"), "bias": P("model")},
      "wo": {"kernel": P("model", None), "bias": P(None)},
      "query": P(None, "model", None), "out": P("model", None, None), "norm": P(None),
      "embedding": P(None, None),
      "memory": {"hidden": P(None, "data"), "length": P()}}
  assert sharding.batch_sharding(setup.mesh).spec == P("data")
  assert sharding.replicated(setup.mesh).spec == P()


def fake_mesh(process_of_device, shape):
  """A ('data', 'model') mesh of stand-in devices with the given owning processes."""
  devices = np.array([types.SimpleNamespace(process_index=p) for p in process_of_device],
                     dtype=object).reshape(shape)
  return types.SimpleNamespace(devices=devices, axis_names=("data", "model"),
                               shape={"data": shape[0], "model": shape[1]})


def test_process_rows_follow_the_data_axis():
  # 2 processes x 4 devices, data=4 x model=2: each process holds 2 of the 4 row blocks.
  mesh = fake_mesh([0, 0, 0, 0, 1, 1, 1, 1], (4, 2))
  assert sharding.process_rows(mesh, 0) == (0, 2)
  assert sharding.process_rows(mesh, 1) == (1, 2)
  # The model axis spans the processes: both hold every row.
  mesh = fake_mesh([0, 1, 0, 1], (2, 2))
  assert sharding.process_rows(mesh, 0) == sharding.process_rows(mesh, 1) == (0, 1)
  # 4 processes, 2 row blocks: processes 0 and 1 share block 0.
  mesh = fake_mesh([0, 1, 2, 3], (2, 2))
  assert [sharding.process_rows(mesh, p) for p in range(4)] == [(0, 2), (0, 2), (1, 2),
                                                                (1, 2)]


def test_process_rows_refuse_scattered_rows():
  mesh = fake_mesh([0, 0, 1, 1, 0, 0, 1, 1], (4, 2))      # process 0 holds blocks 0 and 2
  with pytest.raises(ConfigError, match="not one aligned block"):
    sharding.process_rows(mesh, 0)


def test_process_rows_refuse_a_block_across_two_slices():
  # Process 1 holds row blocks 1 and 2 of 4: contiguous, but the second half of the
  # batch's first half and the first half of its second, which no slice of it is.
  mesh = fake_mesh([0, 1, 1, 2], (4, 1))
  with pytest.raises(ConfigError, match=r"process 1 the batch shards \[1, 2\] of 4"):
    sharding.process_rows(mesh, 1)


def test_a_process_with_no_device_on_the_mesh_is_named():
  mesh = fake_mesh([0, 0, 1, 1], (2, 2))
  with pytest.raises(ConfigError, match="The mesh has no device of process 2"):
    sharding.process_rows(mesh, 2)
