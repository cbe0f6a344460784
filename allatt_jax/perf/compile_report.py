"""What compiling a config's sharded train step takes and plans per device, from
abstract shapes only (`jax.eval_shape`: no parameter is materialised).

A `Report` gives XLA:CPU's figures for a mesh of fake CPU devices (a sanity check of
the sharding, not an HBM budget) and the step's work and memory traffic per token
(`hlo_counts.step_proxy`).
"""
import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from allatt_jax.perf import hlo_counts
from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.parallel import sharding

_GIB = 2**30


@dataclasses.dataclass
class Report:
  """What compiling one train step took and what it plans per device."""
  config: str
  devices: int
  mesh: tuple[int, int]
  gated: bool
  distills: bool                    # the step also runs a teacher (distill section)
  params: int                       # global parameter count
  state_bytes_per_device: int       # from the shardings: what each device stores
  lower_s: float
  compile_s: float
  memory: dict[str, int]            # XLA's per-device plan (memory_analysis)
  flops_per_device: float           # XLA's cost analysis: loop bodies counted once
  # hlo_counts.step_proxy per token: one device's counts over its share of the tokens
  proxy: dict

  @property
  def _kind(self) -> str:
    return ("gated" if self.gated else "baseline") + (", distilling" if self.distills else "")

  def summary(self) -> str:
    m = self.memory
    lines = [
        f"{self.config}: train step for {self.devices} devices, mesh data={self.mesh[0]} x "
        f"model={self.mesh[1]} ({self._kind})",
        f"  parameters            {self.params:,}",
        f"  lower / compile       {self.lower_s:.1f} s / {self.compile_s:.1f} s",
        f"  state per device      {self.state_bytes_per_device / _GIB:.3f} GiB (from shardings)",
        "  XLA plan per device:  arguments {:.3f} GiB, outputs {:.3f} GiB, temporaries "
        "{:.3f} GiB, aliased {:.3f} GiB".format(
            *(m[k] / _GIB for k in ("argument", "output", "temp", "alias"))),
        "  total per device      {:.3f} GiB (arguments + outputs + temporaries - "
        "aliased)".format((m["argument"] + m["output"] + m["temp"] - m["alias"]) / _GIB),
        f"  FLOPs per device      {self.flops_per_device:.3e} per step (XLA's cost "
        "analysis: loop bodies once)",
        "  per token             {:.4g} MFLOP (matmul {:.4g}, other {:.4g}), {:.4g} MB "
        "accessed (loops by trip count)".format(
            *(self.proxy[k] / 1e6 for k in ("flops", "matmul_flops", "other_flops",
                                            "bytes"))),
    ]
    lines.append("  ... by part           " + "; ".join(
        f"{part.replace('_', ' ')} {p['flops'] / 1e6:.4g} MFLOP, {p['bytes'] / 1e6:.4g} MB"
        for part, p in self.proxy["parts"].items()))
    if "costliest_branches" in self.proxy:
      worst = self.proxy["costliest_branches"]
      lines.append("  ... costliest branches {:.4g} MFLOP, {:.4g} MB".format(
          worst["flops"] / 1e6, worst["bytes"] / 1e6))
    return "\n".join(lines)


def _shard_bytes(abstract) -> int:
  return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
             for a in jax.tree.leaves(abstract))


def check(config, mesh_shape: tuple[int, int], name: str = "") -> Report:
  """Lowers and compiles the train step of `config` (a ConfigDict or a RunConfig) on a
  mesh of these sizes of the current devices."""
  # The mesh first: the config is checked on the mesh it compiles for, not its own.
  config = assembly.with_vocab_size(assembly.checked_config(dataclasses.replace(
      run_config.RunConfig.of(config), mesh=run_config.MeshSection(*mesh_shape))))
  return _compiled(config, mesh_shape, name)


def check_pipeline(config, mesh_shape: tuple[int, int], name: str = "") -> dict[str, Report]:
  """`check` of both stages of a pipeline config (a ConfigDict: configs/demo.py), each
  checked as the pipeline checks it: {'baseline': its step, 'pruning': the pruning
  stage's, with its gates and its teacher where it distills}."""
  config = config.copy_and_resolve_references()
  config.mesh.update(dict(data=mesh_shape[0], model=mesh_shape[1]))
  stages = assembly.pipeline_with_vocab_size(assembly.checked_pipeline(config))
  return {stage: _compiled(run, mesh_shape, f"{name} ({stage} stage)")
          for stage, run in (("baseline", stages.baseline), ("pruning", stages.pruning))}


def _compiled(config: run_config.RunConfig, mesh_shape: tuple[int, int], name: str) -> Report:
  """`check`'s report of a checked config with its vocabulary size."""
  setup = assembly.run_setup(config)
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
    compiled = lowered.compile(compiler_options=hlo_counts.COMPILER_OPTIONS)
    compiled_at = time.perf_counter()
  stats = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return Report(
      config=name, devices=mesh.size, mesh=tuple(mesh_shape), gated=gated,
      distills=config.distill.enabled,
      params=sum(math.prod(a.shape) for a in jax.tree.leaves(abstract.variables["params"])),
      state_bytes_per_device=_shard_bytes(abstract),
      lower_s=lowered_at - start, compile_s=compiled_at - lowered_at,
      memory={key: int(getattr(stats, f"{key}_size_in_bytes"))
              for key in ("argument", "output", "temp", "alias")}
      | {"peak": int(getattr(stats, "peak_memory_in_bytes", 0))},
      flops_per_device=float((cost or {}).get("flops", 0.0)),
      proxy=hlo_counts.step_proxy(compiled, t.batch_size * t.seq_len / mesh.size))
