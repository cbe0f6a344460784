r"""Compiles a config's train step for a large mesh without running it or allocating state.

  python -m allatt_jax.compile_check --config=configs/wt103_base.py --devices=32 --mesh=8,4

Lowers and compiles the sharded train step for `--devices` fake CPU devices arranged as
a (data, model) mesh, from abstract shapes only (`jax.eval_shape`: no parameter is
materialised), so a sharding mistake (an axis that does not divide, a constraint that
cannot hold) shows up in a minute on a laptop instead of on a reserved pod. Prints
the compile time and the per-device memory XLA plans for the step (arguments =
state and batch shards, outputs, temporaries) and its FLOPs.

The figures are for XLA:CPU; a TPU or GPU compile fuses and lays out differently, so
treat the memory as a sanity check of the sharding (does each device hold 1/model of
the heads?), not as an exact HBM budget. `--devices` sets JAX's CPU device count
(`jax_num_cpu_devices`) before JAX starts its backend.
"""
import dataclasses
import json
import math
import time

from absl import flags
import jax
import jax.numpy as jnp

from allatt_jax import cli
from allatt_jax import errors
from allatt_jax import run_config
from allatt_jax import run_setup
from allatt_jax import sharding

_GIB = 2**30


@dataclasses.dataclass
class Report:
  """What compiling one train step took and what it plans per device."""
  config: str
  devices: int
  mesh: tuple[int, int]
  gated: bool
  params: int                       # global parameter count
  state_bytes_per_device: int       # from the shardings: what each device stores
  lower_s: float
  compile_s: float
  memory: dict[str, int]            # XLA's per-device plan (memory_analysis)
  flops_per_device: float

  def summary(self) -> str:
    m = self.memory
    lines = [
        f"{self.config}: train step for {self.devices} devices, mesh data={self.mesh[0]} x "
        f"model={self.mesh[1]} ({'gated' if self.gated else 'baseline'})",
        f"  parameters            {self.params:,}",
        f"  lower / compile       {self.lower_s:.1f} s / {self.compile_s:.1f} s",
        f"  state per device      {self.state_bytes_per_device / _GIB:.3f} GiB (from shardings)",
        "  XLA plan per device:  arguments {:.3f} GiB, outputs {:.3f} GiB, temporaries "
        "{:.3f} GiB, aliased {:.3f} GiB".format(
            *(m[k] / _GIB for k in ("argument", "output", "temp", "alias"))),
        "  total per device      {:.3f} GiB (arguments + outputs + temporaries - "
        "aliased)".format((m["argument"] + m["output"] + m["temp"] - m["alias"]) / _GIB),
        f"  FLOPs per device      {self.flops_per_device:.3e} per step",
    ]
    return "\n".join(lines)


def _shard_bytes(abstract) -> int:
  return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
             for a in jax.tree.leaves(abstract))


def check(config: run_config.RunConfig, mesh_shape: tuple[int, int],
          name: str = "") -> Report:
  """Lowers and compiles the train step of `config` on a mesh of the current devices."""
  config = dataclasses.replace(run_setup.with_vocab_size(config),
                               mesh=run_config.MeshSection(*mesh_shape))
  setup = run_setup.resolve(config)
  mesh, abstract = setup.mesh, setup.abstract_state
  batch = sharding.batch_sharding(mesh)
  gated = "gates" in abstract.variables
  # A pruning run starts with sampled gates: that step is the one that runs first.
  step = setup.train_step(sample_gates=gated)
  t = config.train
  tokens = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=batch)
  with sharding.activate(mesh):
    start = time.perf_counter()
    lowered = step.lower(abstract, tokens, tokens)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
  stats = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return Report(
      config=name, devices=mesh.size, mesh=tuple(mesh_shape), gated=gated,
      params=sum(math.prod(a.shape) for a in jax.tree.leaves(abstract.variables["params"])),
      state_bytes_per_device=_shard_bytes(abstract),
      lower_s=lowered_at - start, compile_s=compiled_at - lowered_at,
      memory={key: int(getattr(stats, f"{key}_size_in_bytes"))
              for key in ("argument", "output", "temp", "alias")}
      | {"peak": int(getattr(stats, "peak_memory_in_bytes", 0))},
      flops_per_device=float((cost or {}).get("flops", 0.0)))


def _mesh_shape(text: str, devices: int) -> tuple[int, int]:
  try:
    data, model = (int(x) for x in text.split(","))
  except ValueError:
    raise errors.ConfigError(f"--mesh={text!r}: expected DATA,MODEL, e.g. 8,4.") from None
  return sharding.mesh_shape(run_config.MeshSection(data=data, model=model), devices)


def main(argv):
  del argv
  wanted = _DEVICES.value
  if wanted:
    # Read once, when the first device is touched: nothing has touched one yet.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", wanted)
  devices = jax.device_count()
  if wanted and devices != wanted:
    raise errors.ConfigError(f"--devices={wanted}, but JAX sees {devices} devices.")
  mesh = _mesh_shape(_MESH.value, devices) if _MESH.value else (devices, 1)
  report = check(_CONFIG.value, mesh,
                 name=cli.config_file_name("config"))
  print(report.summary())
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(dataclasses.asdict(report), f, indent=2)


if __name__ == "__main__":
  _CONFIG = cli.DEFINE_config("config", "Run config whose train step is compiled.")
  _DEVICES = flags.DEFINE_integer(
      "devices", 0, "Fake CPU devices to compile for (default: the devices JAX sees).",
      lower_bound=0)
  _MESH = flags.DEFINE_string("mesh", "", "DATA,MODEL mesh sizes; -1 fills (default: all data).")
  _JSON = flags.DEFINE_string("json", "", "Also write the report to this JSON file.")
  cli.run(main)
