"""Sharded training on 8 fake CPU devices matches one device; heads and batch are split.

The 8-device half runs in a subprocess (tests/multidevice_worker.py), since JAX fixes
its device count when first imported; the one-device reference runs here meanwhile.
"""
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from allatt_jax.runs import checkpointing
from allatt_jax import data as data_lib
from allatt_jax.pruning import model_export
from allatt_jax.model import transformer as model_lib
from allatt_jax.runs import run_files

import helpers
import multidevice_worker as worker

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

REPO = pathlib.Path(__file__).resolve().parents[1]
# Sharded reductions add in another order: float32 round-off, compounded over steps.
RTOL = 2e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(8-device results, one-device losses and parameter digests)."""
  out_dir = tmp_path_factory.mktemp("multidevice")
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  data_lib.load_corpus("wikitext_chars", data_dir)     # prepared once, before both read it
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
         "XLA_FLAGS": helpers.xla_flags(cpu_devices=8)}
  log = out_dir / "worker.log"
  with open(log, "w") as log_file:
    child = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "multidevice_worker.py"), str(out_dir), data_dir],
        env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
      state, losses, _, _ = worker.train_steps(worker.test_config(data_dir))
      child.wait(timeout=540)
    finally:
      child.kill()
  assert child.returncode == 0, log.read_text()[-5000:]
  assert jax.device_count() == 1
  result = json.loads((out_dir / "result.json").read_text())
  return out_dir, result, {"losses": losses, "params": worker.param_digest(state)}


@pytest.mark.parametrize("mesh", worker.MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_sharded_steps_match_one_device(runs, mesh):
  _, result, reference = runs
  sharded = result[f"{mesh[0]}x{mesh[1]}"]
  np.testing.assert_allclose(sharded["losses"], reference["losses"], rtol=RTOL)
  assert sharded["params"].keys() == reference["params"].keys()
  for name, digest in reference["params"].items():
    np.testing.assert_allclose(sharded["params"][name], digest, rtol=1e-4, atol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("mesh", worker.MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_heads_split_over_model_and_rows_over_data(runs, mesh):
  data, model = mesh
  placed = runs[1][f"{mesh[0]}x{mesh[1]}"]["placements"]
  expected = {
      # name: (partition spec, per-device shape)
      "query_kernel": ([None, "model", None], [32, 4 // model, 8]),
      "out_kernel": (["model", None, None], [4 // model, 8, 32]),
      "persistent_key": (["model", None, None], [4 // model, 16, 8]),
      "gate_logits": (["model"], [4 // model]),
      "query_kernel_adam_mu": ([None, "model", None], [32, 4 // model, 8]),
      "embedding": ([None, None], [27, 32]),
      "memory_hidden": ([None, "data"], [2, 8 // data, 16, 32]),
      "batch": (["data"], [8 // data, 16]),
  }
  for name, (spec, shard_shape) in expected.items():
    # Trailing unsharded axes may be left out of a spec.
    got = placed[name]["spec"]
    assert got + [None] * (len(spec) - len(got)) == spec, (name, got)
    assert placed[name]["shard_shape"] == shard_shape, (name, placed[name])


def test_sharded_checkpoint_exports_here_as_there(runs, tmp_path):
  """The (4, 2) mesh's checkpoint, exported there and here on one device."""
  out_dir, _, _ = runs
  workdir = out_dir / "pruning_run"
  there_config, there, _ = checkpointing.read_model(workdir / "export")
  here_config, here, _ = checkpointing.read_model(
      model_export.export_run(workdir, tmp_path / "export"))
  assert here_config.to_dict() == there_config.to_dict()
  assert 0 < sum(here_config.model.heads_per_layer) < 8, "some heads should be removed"
  for a, b in zip(jax.tree.leaves(here), jax.tree.leaves(there)):
    np.testing.assert_array_equal(a, b)
  # The smaller model computes what the gated one does with deterministic gates.
  gated_lm, here_lm = (model_lib.TransformerLM.from_config(c)
                       for c in (run_files.load_config(workdir), here_config))
  gated_vars = checkpointing.read_model(workdir)[1]
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 27)
  logp = [lm.apply(v, tokens, model_lib.init_memory(lm.cfg, 2, 16), method=lm.log_probs)[0]
          for lm, v in ((gated_lm, gated_vars), (here_lm, here))]
  np.testing.assert_allclose(logp[1], logp[0], atol=1e-5, rtol=0)
