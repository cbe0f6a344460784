"""Start-up of multi-process runs: flags, environment and the detected cluster."""
import pytest

from allatt_jax.parallel import distributed
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
