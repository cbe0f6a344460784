"""The mesh a run's config asks for, and where its state and batches go on it."""
import jax
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
