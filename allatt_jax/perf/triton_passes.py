"""Triton kernels' IR through the Triton compiler's passes to PTX, for gpu_compile.py,
in a process of its own: the `triton` package's LLVM and TensorFlow's cannot share
one (importing both stops the process: "LLVM ERROR: inconsistency in registered
CommandLine options"), so this module imports neither jax nor TensorFlow.

  python -m allatt_jax.perf.triton_passes < JOB.json   # prints the kernels' PTX as JSON

The job: {"capability": 90, "release": "13.0" (ptxas's CUDA release: the PTX version
it reads), "kernels": [{"name", "ttir", "num_warps", "num_stages"}, ...]}; the answer:
[{"name", "ptx", "shared_bytes"}, ...] in the same order.
"""
import json
import pathlib
import sys
import tempfile


def ptx(kernel: dict, capability: int, release: str) -> dict:
  """One kernel's PTX for sm_{capability}a and the shared memory Triton gives it, from
  its Triton IR by the stages 'ttir' to 'ptx' of Triton's NVIDIA backend.

  Raises:
    RuntimeError: a pass failed (Triton prints its reproducer to stderr).
  """
  # pylint: disable=import-outside-toplevel  # the process that runs main alone needs it
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia import compiler as nvidia
  from triton.compiler import compiler

  backend = compiler.make_backend(GPUTarget("cuda", capability, 32))
  options = backend.parse_options(dict(
      num_warps=kernel["num_warps"], num_stages=kernel["num_stages"], enable_fp_fusion=True,
      ptx_version=nvidia.ptx_get_version(release)))
  context = ir.context()
  ir.load_dialects(context)
  backend.load_dialects(context)
  with tempfile.TemporaryDirectory() as folder:
    path = pathlib.Path(folder, f"{kernel['name']}.ttir")
    path.write_text(kernel["ttir"])
    module = ir.parse_mlir_module(str(path), context)
  module.context = context
  stages, metadata = {}, {}
  backend.add_stages(stages, options, compiler.Language.TRITON)
  for stage in ("ttir", "ttgir", "llir", "ptx"):
    module = stages[stage](module, metadata)
  return {"name": kernel["name"], "ptx": module, "shared_bytes": metadata["shared"]}


def main() -> None:
  job = json.load(sys.stdin)
  print(json.dumps([ptx(kernel, job["capability"], job["release"])
                    for kernel in job["kernels"]]))


if __name__ == "__main__":
  main()
