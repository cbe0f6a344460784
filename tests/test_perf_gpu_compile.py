"""The Pallas persistent kernels compile for the lent GPUs (sm_90a) here, without one:
their Triton IR through the Triton compiler's passes, then ptxas
(allatt_jax/perf/gpu_compile.py). A kernel change that the GPU's compile would reject
fails here, not on a lent GPU."""
import pytest

from allatt_jax.model.attention import persistent_pallas
from allatt_jax.perf import gpu_compile
from allatt_jax.perf import gpu_pieces


def _ptxas():
  """The ptxas to compile with, or a one-line skip saying why there is none."""
  if not gpu_compile.has_triton():
    pytest.skip("the kernels are lowered but not compiled: the triton package is not "
                "installed (pip install -e .[gpu-compile])")
  ptxas = gpu_compile.find_ptxas()
  if ptxas is None:
    pytest.skip("no ptxas here (PATH, CUDA_HOME, /usr/local/cuda, the triton package)")
  return ptxas


@pytest.mark.parametrize("rate", [0.0, 0.2])
@pytest.mark.parametrize("shape", list(gpu_compile.SHAPES))
def test_persistent_kernels_compile_for_sm90(shape, rate):
  """Forward, query and slot gradients, with slot weights, at the benchmark's layer and
  at a shape the tiles do not divide, with and without dropout: each compiles, with
  the default tiles' warps and stages, and fits an H100's shared memory."""
  ptxas = _ptxas()
  fn, args = gpu_compile.persistent_part(gpu_compile.SHAPES[shape], rate)
  try:
    kernels = gpu_compile.triton_kernels(gpu_compile.lowered_for_gpu(fn, *args))
  except ModuleNotFoundError as e:   # a jaxlib without the Triton dialect
    pytest.skip(f"the kernels cannot be lowered here: {e}")
  tiles = persistent_pallas.Tiles()
  assert [(k.name, k.num_warps, k.num_stages) for k in kernels] == [
      ("allatt_persistent_forward", tiles.warps, tiles.stages),
      ("allatt_persistent_query_grads", tiles.warps, tiles.stages),
      ("allatt_persistent_slot_grads", tiles.slot_warps, tiles.stages)]
  for compiled in gpu_compile.compiled(kernels, ptxas):
    assert compiled.registers > 0 and compiled.shared_bytes <= gpu_compile.SHARED_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("tiles", gpu_pieces.TILE_CANDIDATES[1:], ids=str)
def test_device_checks_tiles_compile_for_sm90(tiles):
  """Every tiling that launch/gpu_check.sh times compiles at the benchmark's layer with
  dropout and fits an H100's shared memory (one that does not would spend the lease's
  seconds on an error)."""
  ptxas = _ptxas()
  fn, args = gpu_compile.persistent_part(gpu_compile.SHAPES["benchmark"], 0.2, tiles)
  kernels = gpu_compile.triton_kernels(gpu_compile.lowered_for_gpu(fn, *args))
  for compiled in gpu_compile.compiled(kernels, ptxas):
    assert compiled.shared_bytes <= gpu_compile.SHARED_BYTES
