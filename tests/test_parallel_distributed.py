"""Start-up of multi-process runs, and which batch rows each process reads."""
import types

import numpy as np
import pytest

from allatt_jax.parallel import distributed
from allatt_jax.parallel import sharding
from allatt_jax.config.errors import ConfigError

Settings = distributed.Settings


def test_flags_win_over_environment():
  environ = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
             "JAX_PROCESS_ID": "3"}
  assert distributed.settings_from(environ=environ) == Settings("10.0.0.1:1234", 4, 3)
  assert distributed.settings_from("h:1", 2, 0, environ=environ) == Settings("h:1", 2, 0)
  assert distributed.settings_from(environ={}) == Settings()
  with pytest.raises(ConfigError, match="JAX_PROCESS_ID"):
    distributed.settings_from(environ={"JAX_PROCESS_ID": "one"})


def fake_jax_initialize(monkeypatch, cluster=None):
  """Stands in for `jax.distributed.initialize` as it behaves: what the arguments leave
  unset comes from a detected `cluster` (a dict of the values it knows), and a value
  neither names raises ValueError. Returns the arguments of every successful call."""
  calls = []

  def initialize(**kwargs):
    resolved = {**(cluster or {}), **kwargs}
    if set(resolved) != {"coordinator_address", "num_processes", "process_id"}:
      raise ValueError("coordinator_address should be defined.")
    calls.append(kwargs)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", initialize)
  return calls


def test_single_process_without_a_cluster(monkeypatch):
  calls = fake_jax_initialize(monkeypatch)
  distributed.initialize(Settings())
  assert not calls
  distributed.initialize(Settings("h:1", 2, 0))
  assert calls == [{"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}]


def test_a_detected_cluster_fills_what_is_not_given(monkeypatch):
  slurm = {"coordinator_address": "n1:1234", "num_processes": 2, "process_id": 1}
  calls = fake_jax_initialize(monkeypatch, cluster=slurm)
  distributed.initialize(Settings())
  # The coordinator port is the user's; Slurm knows the process count and id.
  distributed.initialize(Settings("n1:5000"))
  assert calls == [{}, {"coordinator_address": "n1:5000"}]


def test_incomplete_or_inconsistent_settings(monkeypatch):
  fake_jax_initialize(monkeypatch)
  with pytest.raises(ConfigError, match="missing: num_processes, process_id"):
    distributed.initialize(Settings("10.0.0.1:1234"))
  with pytest.raises(ConfigError, match="process_id=2 is not in"):
    distributed.initialize(Settings("h:1", 2, 2))


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
