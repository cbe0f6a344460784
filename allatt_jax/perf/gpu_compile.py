r"""Pallas' Triton kernels compiled for a Hopper GPU on a machine without one, so that a
kernel that cannot compile fails CI rather than a lent GPU's minutes
(tests/test_perf_gpu_compile.py).

  python -m allatt_jax.perf.gpu_compile     # the persistent part's kernels, as ptxas sees them

Three steps, each what the GPU's own compile does first:

1. `lowered_for_gpu`: jax lowers the function for CUDA on an abstract H100 (jax ≥ 0.11
   takes the kernels' compute capability from the device's kind and finds no GPU here
   without it; 0.10 assumes sm_90 by itself);
2. `triton_kernels`, `ptx`: each Triton kernel of that lowering (its Triton IR, warps
   and stages, from the custom call's backend config) through the Triton compiler's
   passes to PTX. jaxlib holds only the Triton dialect and XLA the passes, so this
   step takes them from the `triton` package (`pip install -e .[gpu-compile]`), in a
   process of its own (triton_passes.py: its LLVM and TensorFlow's clash);
3. `compiled`: ptxas for sm_90a, with the registers and spills it reports.

ptxas is the CUDA toolkit's (PTXAS, then PATH, CUDA_HOME, /usr/local/cuda) or else the
one the `triton` package ships.
"""
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir

from allatt_jax.model.attention import dropout_mask
from allatt_jax.model.attention import persistent_pallas

# The GPU the kernels are compiled for: the lent machines' H100 and H200 (sm_90a).
DEVICE_KIND = "NVIDIA H100"
CAPABILITY = 90
SHARED_BYTES = 227 * 1024   # the most shared memory a program may take there
_TRITON_CALL = "__gpu$xla.gpu.triton"
# The persistent part's shapes (H, B, T, N, dh): the benchmark's layer (configs/
# bench_gpu.py, as gpu_pieces.LAYER), and a small one whose sizes are no tile's
# multiple (the kernels pad them).
SHAPES = dict(benchmark=(8, 96, 192, 2048, 64), small=(2, 2, 24, 70, 12))


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One Triton kernel of a lowering: its Triton IR as text and launch settings."""
  name: str
  ttir: str
  num_warps: int
  num_stages: int
  grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Assembled:
  """What ptxas reports for a kernel: registers per thread, spill bytes per thread,
  and the shared memory Triton allocates per program (bytes)."""
  kernel: Kernel
  registers: int
  spill_stores: int
  spill_loads: int
  shared_bytes: int

  def __str__(self):
    k = self.kernel
    return (f"{k.name}: {self.registers} registers, {self.spill_stores}/{self.spill_loads} "
            f"bytes spilled (stores/loads), {self.shared_bytes / 1024:.1f} KiB shared, "
            f"{k.num_warps} warps, {k.num_stages} stages, grid {k.grid}")


def lowered_for_gpu(fn, *args) -> jax.stages.Lowered:
  """jit(fn) traced with `args` (arrays or ShapeDtypeStructs) and lowered for CUDA on
  an abstract DEVICE_KIND, with or without a GPU here."""
  sharding = jax.sharding
  device = sharding.AbstractDevice(device_kind=DEVICE_KIND, num_cores=None, platform="gpu")
  mesh = sharding.AbstractMesh((1,), ("gpu",), axis_types=(sharding.AxisType.Explicit,),
                               abstract_device=device)
  with sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def triton_kernels(lowered: jax.stages.Lowered) -> list[Kernel]:
  """The Triton kernels of a lowering, in the order it calls them.

  Raises:
    ModuleNotFoundError: jaxlib has no Triton dialect to read them with.
  """
  from jaxlib.triton import dialect  # pylint: disable=import-outside-toplevel

  kernels = []

  def visit(op):
    if (op.name == "stablehlo.custom_call"
        and ir.StringAttr(op.attributes["call_target_name"]).value == _TRITON_CALL):
      config = ir.DictAttr(op.attributes["mhlo.backend_config"])
      number = lambda key: ir.IntegerAttr(config[key]).value
      with ir.Context() as context, ir.Location.unknown():
        dialect.register_dialect(context)
        module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
        ttir = module.operation.get_asm(enable_debug_info=False)
      kernels.append(Kernel(ir.StringAttr(config["name"]).value, ttir, number("num_warps"),
                            number("num_stages"),
                            tuple(number(f"grid_{axis}") for axis in "xyz")))
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          visit(inner.operation)

  visit(lowered.compiler_ir("stablehlo").operation)
  return kernels


def has_triton() -> bool:
  """Whether the `triton` package is installed (found, not imported: see ptx)."""
  return importlib.util.find_spec("triton") is not None


def find_ptxas() -> str | None:
  """The path of a ptxas (the CUDA toolkit's, else the `triton` package's), or None."""
  homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
  candidates = [os.environ.get("PTXAS") or shutil.which("ptxas")]
  candidates += [str(pathlib.Path(home, "bin", "ptxas")) for home in homes if home]
  if has_triton():
    package = importlib.util.find_spec("triton").submodule_search_locations[0]
    candidates.append(str(pathlib.Path(package, "backends", "nvidia", "bin", "ptxas")))
  return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def ptxas_release(ptxas: str) -> str:
  """The CUDA release of a ptxas, e.g. '13.0'."""
  out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
  return re.search(r"release (\d+\.\d+)", out).group(1)


def ptx(kernels: list[Kernel], release: str) -> list[tuple[str, int]]:
  """(PTX for sm_90a in the PTX version of CUDA `release`, shared memory bytes) of
  each kernel, by Triton's passes in a process of its own (triton_passes.py).

  Raises:
    RuntimeError: the `triton` package is missing, or a pass failed (the process's
      last lines in the message).
  """
  job = {"capability": CAPABILITY, "release": release,
         "kernels": [dict(name=k.name, ttir=k.ttir, num_warps=k.num_warps,
                          num_stages=k.num_stages) for k in kernels]}
  done = subprocess.run([sys.executable, "-m", "allatt_jax.perf.triton_passes"],
                        input=json.dumps(job), capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError("Triton's passes failed: "
                       + " | ".join(done.stderr.strip().splitlines()[-3:]))
  return [(k["ptx"], k["shared_bytes"]) for k in json.loads(done.stdout)]


def compiled(kernels: list[Kernel], ptxas: str) -> list[Assembled]:
  """The kernels compiled to sm_90a by `ptxas`, with what ptxas reports.

  Raises:
    RuntimeError: Triton's passes or ptxas failed (ptxas's last lines in the message).
  """
  results = []
  for kernel, (text, shared) in zip(kernels, ptx(kernels, ptxas_release(ptxas))):
    with tempfile.TemporaryDirectory() as folder:
      source = pathlib.Path(folder, f"{kernel.name}.ptx")
      source.write_text(text)
      done = subprocess.run([ptxas, f"--gpu-name=sm_{CAPABILITY}a", "-v", str(source), "-o",
                             str(source.with_suffix(".cubin"))],
                            capture_output=True, text=True, check=False)
    log = done.stdout + done.stderr
    if done.returncode:
      raise RuntimeError(f"ptxas could not compile {kernel.name} for sm_{CAPABILITY}a: "
                         + " | ".join(log.strip().splitlines()[-3:]))
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    results.append(Assembled(kernel, int(registers.group(1)), int(spills.group(1)),
                             int(spills.group(2)), shared))
  return results


def persistent_part(shape, rate: float, tiles: persistent_pallas.Tiles | None = None):
  """(fn, args): the Pallas persistent part's forward and backward kernels
  (persistent_pallas.py) at `shape` (H, B, T, N, dh) in bf16 with slot weights, at
  attention dropout `rate`, as a function of ShapeDtypeStructs."""
  h, b, t, n, dh = shape
  kernels = dict(rate=rate, tiles=tiles, interpret=False)

  def forward_and_backward(qp, pk, pv, pw, dout, key):
    rows, columns = ((dropout_mask.row_seeds(key, h, b, t), dropout_mask.column_seeds(key, n))
                     if rate else (None, None))
    acc, top, norm = persistent_pallas.forward(qp, pk, pv, pw, rows, columns, **kernels)
    delta = jnp.sum(acc * dout, -1) / norm
    return acc, persistent_pallas.backward(qp, pk, pv, pw, rows, columns, top, norm, delta,
                                           dout, **kernels)

  array = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype)
  return forward_and_backward, (array(h, b, t, dh), array(h, n, dh), array(h, n, dh),
                                array(h, n), array(h, b, t, dh),
                                array(2, dtype=jnp.uint32))


def main() -> None:
  ptxas = find_ptxas()
  if ptxas is None:
    sys.exit("gpu_compile: no ptxas here (none on PATH, in CUDA_HOME or /usr/local/cuda, "
             "nor in the triton package): pip install -e .[gpu-compile]")
  print(f"jax {jax.__version__}, ptxas {ptxas_release(ptxas)} ({ptxas}), sm_{CAPABILITY}a")
  for name, shape in SHAPES.items():
    for rate in (0.0, 0.2):
      print(f"{name} shape (H, B, T, N, dh) = {shape}, attention dropout {rate}:")
      fn, args = persistent_part(shape, rate)
      for kernel in compiled(triton_kernels(lowered_for_gpu(fn, *args)), ptxas):
        print(f"  {kernel}")


if __name__ == "__main__":
  main()
