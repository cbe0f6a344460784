"""The pieces of the device check (gpu_check.py), each measured in a process of its
own: what the split core and its persistent parts do on this device, at the benchmark's
layer shape (a dry run: tiny shapes, on a CPU). They need jax and the package's model
code only, not the benchmark's ml_collections.

  versions          jax, jaxlib, the device, CUDA and cuDNN
  part:NAME:RATE    persistent part NAME (xla, pallas, cudnn) on a small bf16 problem at
                    attention dropout RATE: compile seconds, and its largest difference
                    to the XLA part, of each result's largest value (agrees: within 5%)
  layer:CORE:RATE   one layer's attention core forward and backward at the benchmark's
                    shape (H=8, B=96, T=S=192, N=2048, dh=64, bf16): 'xla' and each
                    'split-NAME' (median of 10 calls, compile seconds, XLA temporaries)
  alone:NAME        a persistent part alone at its shape in that layer (8 heads of
                    B·T = 18,432 queries against 2,048 shared slots, dh=64, bf16, no
                    dropout), forward and backward from its log-sum-exp
  tiles:pallas:RATE the Pallas part alone as there, at attention dropout RATE, with
                    each of TILE_CANDIDATES (its default first): the fastest, and
                    every one's time or error, handed over after each (so that a stall
                    keeps the tiles timed before it)
"""
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from allatt_jax.model.attention import relative
from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import persistent_cores
from allatt_jax.model.attention import persistent_pallas
from allatt_jax.model.attention import persistent_trial
from allatt_jax.model.attention import split_core

PARTS = ("xla", "pallas", "cudnn")
RATES = (0.0, 0.2)
# (H, B, T, S, N, dh): the benchmark's layer, and a dry run's.
LAYER = dict(gpu=(8, 96, 192, 192, 2048, 64), dry=(2, 2, 8, 8, 64, 16))
SMALL = dict(gpu=dict(h=2, b=8, t=128, n=512, dh=64), dry=dict(h=2, b=2, t=8, n=64, dh=16))
# The Pallas part's tiles beside its untuned default: query tiles of 128 rows (as
# flash kernels on Hopper take them), slot tiles of 128 or of one word, more warps, a
# deeper pipeline (the default's kernels compiled in under a second on an H200).
Tiles = persistent_pallas.Tiles
TILE_CANDIDATES = (Tiles(), Tiles(rows=128, warps=8), Tiles(rows=128),
                   Tiles(slots=128), Tiles(rows=128, slots=128, warps=8),
                   Tiles(rows=128, warps=8, stages=3), Tiles(rows=32, slot_warps=4),
                   Tiles(slots=32, slot_warps=4))


def _dtype(dry: bool):
  return jnp.float32 if dry else jnp.bfloat16


def _timed(fn, args, calls: int = 10) -> dict:
  """Compile seconds, XLA temporaries and median milliseconds of `calls` calls of jit(fn)."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - start
  try:
    temp = compiled.memory_analysis().temp_size_in_bytes
  except Exception:  # pylint: disable=broad-except  # not every backend reports it
    temp = None
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return {"compile_s": compile_s, "ms": 1e3 * statistics.median(times), "temp_bytes": temp}


def _unavailable(name: str, rate: float, dtype) -> str | None:
  head_dim = LAYER["gpu"][-1]   # the pieces' heads, all of a size every part takes
  return (persistent_cores.refusal(name, rate, False)
          or persistent_cores.why_not_here(name, dtype, head_dim))


def _versions(dry: bool) -> dict:
  result = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "dry_run": dry}
  try:
    from jax._src.lib import cuda_versions   # pylint: disable=import-outside-toplevel
    for name in ("cuda_runtime_get_version", "cudnn_get_version", "cuda_driver_get_version"):
      if cuda_versions is not None and hasattr(cuda_versions, name):
        result[name.removesuffix("_get_version")] = getattr(cuda_versions, name)()
  except Exception as e:  # pylint: disable=broad-except  # reported, not fatal
    result["cuda_versions_error"] = f"{type(e).__name__}: {e}"
  return result


def _part(name: str, rate: float, dry: bool) -> dict:
  dtype = _dtype(dry)
  why_not = _unavailable(name, rate, dtype)
  if why_not:
    return {"status": "unavailable", "why": why_not}
  args = persistent_trial.trial_problem(jnp.dtype(dtype), rate, False,
                                        **SMALL["dry" if dry else "gpu"])
  run = lambda part: functools.partial(persistent_trial.outputs_and_grads,
                                       persistent_cores.PARTS[part], rate, jnp.float32)
  start = time.perf_counter()
  got = jax.jit(run(name)).lower(*args).compile()(*args)
  compile_s = time.perf_counter() - start
  expected = jax.jit(run("xla"))(*args)
  differences = {
      key: float(np.abs(np.asarray(g, np.float32) - np.asarray(e, np.float32)).max()
                 / max(float(np.abs(np.asarray(e, np.float32)).max()), 1e-30))
      for key, g, e in zip(("out", "lse", "dqp", "dpk", "dpv"), got, expected)}
  return {"status": "ok", "compile_s": compile_s, "max_difference": differences,
          "agrees": max(differences.values()) <= 0.05}


def _layer(core: str, rate: float, dry: bool) -> dict:
  dtype = _dtype(dry)
  if core != "xla":
    why_not = _unavailable(core.removeprefix("split-"), rate, dtype)
    if why_not:
      return {"status": "unavailable", "why": why_not}
  h, b, t, s, n, dh = LAYER["dry" if dry else "gpu"]
  k = s + t
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  args = (normal(h, b, t, dh), normal(h, b, t, dh), normal(h, b, t, dh), normal(h, b, k, dh),
          normal(h, b, k, dh), jnp.pad(normal(h, k, dh), [(0, 0), (1, 0), (0, 0)]),
          normal(h, n, dh), normal(h, n, dh))
  mask = relative.attention_mask(t, s, jnp.int32(s), True)
  keys = jnp.array([[1, 2], [3, 4]], jnp.uint32) if rate else None
  dout = normal(h, b, t, dh)
  # As configs/bench_gpu.py runs it: all heads at once, no remat, scores in bf16.
  attend = (functools.partial(xla_core.attend, rate, h, False, dtype) if core == "xla"
            else functools.partial(split_core.attend, rate, h, False, dtype,
                                   persistent=core.removeprefix("split-")))

  def forward_and_backward(*args):
    out, vjp = jax.vjp(lambda *a: attend(*a, mask, keys), *args)
    return out, vjp(dout)

  return {"status": "ok", **_timed(forward_and_backward, args)}


def _part_alone(part: persistent_cores.Part, rate: float, dry: bool, calls: int = 10
                ) -> dict:
  """`_timed` of a persistent part alone at its shape in the benchmark's layer, with
  its TFLOP/s."""
  dtype = _dtype(dry)
  h, b, t, _, n, dh = LAYER["dry" if dry else "gpu"]
  args = [jnp.asarray(x) if x is not None else None for x in
          persistent_trial.trial_problem(np.dtype(jnp.dtype(dtype)), rate, False, h=h, b=b,
                                         t=t, n=n, dh=dh)]
  result = _timed(functools.partial(persistent_trial.outputs_and_grads, part, rate, dtype),
                  args, calls)
  # Flash attention's count: 4·M·N·dh forward, 2.5 times that backward.
  result["tflop_per_s"] = 14 * h * b * t * n * dh / (result["ms"] * 1e-3) / 1e12
  return result


def _alone(name: str, dry: bool) -> dict:
  why_not = _unavailable(name, 0.0, _dtype(dry))
  if why_not:
    return {"status": "unavailable", "why": why_not}
  return {"status": "ok", **_part_alone(persistent_cores.PARTS[name], 0.0, dry)}


def _tiles(rate: float, dry: bool, report) -> dict:
  """The Pallas part alone (`_part_alone`) at attention dropout `rate` with each of
  TILE_CANDIDATES, handing `report` the results so far after each: every tiles'
  figures or error, the fastest and its speed-up on the default. A dry run times the
  first two in Pallas' interpreter, once each."""
  why_not = None if dry else _unavailable("pallas", rate, _dtype(dry))
  if why_not:
    return {"status": "unavailable", "why": why_not}
  timed = {}
  for tiles in TILE_CANDIDATES[:2] if dry else TILE_CANDIDATES:
    try:
      timed[str(tiles)] = _part_alone(persistent_cores.Part("pallas", tiles), rate, dry,
                                      calls=1 if dry else 10)
    except Exception as e:  # pylint: disable=broad-except  # e.g. out of shared memory
      timed[str(tiles)] = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    ms = {name: r["ms"] for name, r in timed.items() if "ms" in r}
    best = min(ms, key=ms.get) if ms else None
    default = ms.get(str(TILE_CANDIDATES[0]))
    result = {"status": "ok" if best else "failed", "tiles": dict(timed), "best": best,
              "ms": ms.get(best), "speedup": default / ms[best] if best and default else None}
    report(result)
  return result


def run_piece(piece: str, dry: bool, report=lambda result: None) -> dict:
  """One piece's result (this process runs it); a piece that times several things
  hands `report` its results so far after each."""
  kind, *args = piece.split(":")
  if kind == "versions":
    return _versions(dry)
  if kind == "part":
    return _part(args[0], float(args[1]), dry)
  if kind == "layer":
    return _layer(args[0], float(args[1]), dry)
  if kind == "alone":
    return _alone(args[0], dry)
  if kind == "tiles" and args[0] == "pallas":
    return _tiles(float(args[1]), dry, report)
  raise ValueError(f"unknown piece {piece!r}")
