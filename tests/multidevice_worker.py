"""Train steps on ('data', 'model') meshes of fake CPU devices, for test_multidevice.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python tests/multidevice_worker.py OUT_DIR TFDS_DIR

JAX fixes its device count at import, so the test runs this in a subprocess; the
test process imports `train_steps` for the single-device reference. Writes
OUT_DIR/result.json (losses, parameter digests and array shardings per mesh) and
OUT_DIR/pruning_run, a run workdir holding the (4, 2) mesh's sharded state as its
checkpoint, and that checkpoint's export.
"""
import json
import pathlib
import sys

import jax
import numpy as np

from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax import data as data_lib
from allatt_jax.pruning import model_export
from allatt_jax.training import assembly
from allatt_jax.runs import run_files
from allatt_jax.parallel import sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESHES = ((8, 1), (4, 2), (2, 4))
NUM_STEPS = 4


def test_config(data_dir: str, mesh=(-1, 1)):
  """The demo's tiny model as a pruning run from scratch, with dropout on."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  with config.unlocked():
    del config["pipeline"]
  config.data.data_dir = data_dir
  config.model.vocab_size = 27   # assembly.run_setup reads no dataset to fill it in
  config.mesh.data, config.mesh.model = mesh
  # Dropout checks that random masks do not depend on how arrays are sharded.
  config.model.update(dict(dropout=0.1, dropout_attn=0.1, dropout_emb=0.1))
  config.train.update(dict(batch_size=8, num_steps=NUM_STEPS))
  # Gates start on the edge (π = 0 is closed) so the NLL gradient opens some, closes others.
  config.gates.update(dict(enabled=True, lam=0.01, init=0.0, learning_rate=0.2,
                           l0_warmup_steps=0, freeze_step=NUM_STEPS))
  return config


def train_steps(config, num_steps: int = NUM_STEPS):
  """(state, losses, last inputs, stream) after `num_steps` sampled-gate steps."""
  setup = assembly.run_setup(config)
  state = setup.new_state()
  batch = sharding.batch_sharding(setup.mesh)
  step_fn = setup.train_step(sample_gates=True)
  t = config.train
  stream = data_lib.SegmentStream(data_lib.load_run_corpus(config).splits["train"], t.batch_size,
                                  t.seq_len, *sharding.process_rows(setup.mesh))
  losses = []
  for _ in range(num_steps):
    inputs, targets = (data_lib.to_global_array(a, batch, (t.batch_size, t.seq_len))
                       for a in next(stream))
    with sharding.activate(setup.mesh):
      state, metrics = step_fn(state, inputs, targets)
    losses.append(float(metrics["loss"]))
  return state, losses, inputs, stream


def param_digest(state) -> dict[str, list[float]]:
  """Per variable, a few numbers that move whenever its values do."""
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.variables))[0]
  return {jax.tree_util.keystr(path): [float(np.sum(x)), float(np.sum(np.abs(x)))]
          for path, x in flat}


def _placement(array) -> dict:
  return {"spec": [list(a) if isinstance(a, tuple) else a for a in array.sharding.spec],
          "shape": list(array.shape),
          "shard_shape": list(array.addressable_shards[0].data.shape)}


def placements(state, inputs) -> dict[str, dict]:
  """Sharding spec, global and per-device shapes of arrays the test checks."""
  attention = lambda i: state.variables["params"][f"layer_{i}"]["attention"]
  adam_mu = next(x for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
                 if jax.tree_util.keystr(path).endswith(
                     ".mu['params']['layer_0']['attention']['query']['kernel']"))
  arrays = {
      "query_kernel": attention(0)["query"]["kernel"],
      "out_kernel": attention(0)["out"]["kernel"],
      "persistent_key": attention(1)["persistent_key"],
      "gate_logits": state.variables["gates"]["layer_0"]["attention"]["logits"],
      "query_kernel_adam_mu": adam_mu,
      "embedding": state.variables["params"]["embedding"]["emb_0"],
      "memory_hidden": state.memory["hidden"],
      "batch": inputs,
  }
  return {name: _placement(array) for name, array in arrays.items()}


def save_run(workdir: pathlib.Path, config, state, stream) -> None:
  """The state as a run's checkpoint, written as the train loop writes it."""
  run_files.save_config(workdir, config)
  checkpoints = checkpointing.RunCheckpoints(workdir)
  checkpoints.save(int(state.step), state, stream.get_state(), force=True)
  checkpoints.wait()
  checkpoints.close()


def main(out_dir: str, data_dir: str) -> None:
  out_dir = pathlib.Path(out_dir)
  assert jax.device_count() == 8, jax.devices()
  result = {}
  for mesh in MESHES:
    config = test_config(data_dir, mesh)
    state, losses, inputs, stream = train_steps(config)
    result[f"{mesh[0]}x{mesh[1]}"] = {"losses": losses, "params": param_digest(state),
                                      "placements": placements(state, inputs)}
    if mesh == (4, 2):
      save_run(out_dir / "pruning_run", config, state, stream)
      model_export.export_run(out_dir / "pruning_run")
  (out_dir / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main(*sys.argv[1:])
