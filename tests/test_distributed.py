"""Start-up of multi-process runs, and which batch rows each process reads."""
import types

import numpy as np
import pytest

from allatt_jax import distributed
from allatt_jax import sharding
from allatt_jax.errors import ConfigError

Settings = distributed.Settings


def test_flags_win_over_environment():
  environ = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
             "JAX_PROCESS_ID": "3"}
  assert distributed.settings_from(environ=environ) == Settings("10.0.0.1:1234", 4, 3)
  assert distributed.settings_from("h:1", 2, 0, environ=environ) == Settings("h:1", 2, 0)
  assert distributed.settings_from(environ={}) == Settings()
  with pytest.raises(ConfigError, match="JAX_PROCESS_ID"):
    distributed.settings_from(environ={"JAX_PROCESS_ID": "one"})


@pytest.mark.parametrize("environ,cluster", [
    ({}, None),
    ({"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2"}, "slurm"),
    ({"SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1"}, None),   # one task: no peers
    ({"SLURM_NTASKS": "4"}, None),                                 # batch script, not srun
    ({"OMPI_COMM_WORLD_SIZE": "8"}, "ompi"),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "tpu"),
])
def test_detects_clusters_from_environment(environ, cluster, tmp_path):
  assert distributed.detect_cluster(environ, pci_devices=str(tmp_path)) == cluster


def test_detects_cloud_tpu_from_pci_vendor(tmp_path):
  (tmp_path / "0000:00:04.0").mkdir()
  (tmp_path / "0000:00:04.0" / "vendor").write_text("0x1af4\n")
  assert not distributed.on_cloud_tpu_vm(str(tmp_path))
  (tmp_path / "0000:00:05.0").mkdir()
  (tmp_path / "0000:00:05.0" / "vendor").write_text("0x1ae0\n")
  assert distributed.on_cloud_tpu_vm(str(tmp_path))
  assert distributed.detect_cluster({}, pci_devices=str(tmp_path)) == "tpu"


def test_plan():
  # Nothing given, no cluster: a plain single-process run.
  assert distributed.plan(Settings(), None) is None
  # A cluster JAX knows: it fills in everything.
  assert distributed.plan(Settings(), "tpu") == {}
  full = Settings("10.0.0.1:1234", 2, 1)
  assert distributed.plan(full, None) == {
      "coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}
  # Slurm knows the process count and id; the coordinator port is the user's.
  assert distributed.plan(Settings("n1:5000"), "slurm") == {"coordinator_address": "n1:5000"}
  with pytest.raises(ConfigError, match="missing: num_processes, process_id"):
    distributed.plan(Settings("10.0.0.1:1234"), None)
  with pytest.raises(ConfigError, match="process_id=2 is not in"):
    distributed.plan(Settings("h:1", 2, 2), None)


def test_single_process_initialize_does_nothing(monkeypatch, tmp_path):
  monkeypatch.setattr(distributed, "_PCI_DEVICES", str(tmp_path))
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize",
                      lambda **kwargs: calls.append(kwargs))
  distributed.initialize(Settings(), environ={})
  assert not calls
  distributed.initialize(Settings("h:1", 2, 0), environ={})
  assert calls == [{"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}]


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
