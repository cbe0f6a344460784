"""A trial of one persistent part (persistent_cores.py), as 'auto' runs it
(core_choice.py): forward and backward on a small problem, checked against the XLA
part, then timed; in a process of its own, ended at its limit (`seconds`), so a
compile that stalls costs the trial its seconds and leaves nothing running in the
training process (a thread could not be stopped).

The process starts fresh (a fork of a process that holds a GPU is unsafe): about 2 s
of Python and jax's import before the trial's own compiles, paid once per part, once
per training process, on a GPU only. It takes the GPU memory it uses, no more: the
training process may already hold most of it (XLA preallocates 75%).

  python -m allatt_jax.model.attention.persistent_trial NAME RATE WEIGHTED DTYPE
"""
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax.model.attention import dropout_mask
from allatt_jax.model.attention import persistent_cores

# The trial problem is small (`trial_problem`): a few MB.
_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def seconds(name: str, rate: float, weighted: bool, dtype: str, limit: float) -> float:
  """`trial(name, rate, weighted, dtype)` in a process of its own.

  Raises:
    TimeoutError: not done within `limit` seconds (the process was ended).
    RuntimeError: the trial failed; its last line says why.
  """
  command = [sys.executable, "-m", __name__, name, repr(float(rate)), str(int(weighted)),
             dtype]
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=limit,
                          env={**os.environ, **_ENV}, check=False)
  except subprocess.TimeoutExpired:   # subprocess.run has ended the process
    raise TimeoutError(f"not done within {limit:g} s; its process was ended") from None
  if done.returncode:
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
    raise RuntimeError(lines[-1] if lines else f"exit status {done.returncode}")
  return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def trial_problem(dtype, rate: float, weighted: bool, h=2, b=8, t=128, n=512, dh=64):
  """(qp, pk, pv, pw, row_seeds, column_seeds, dout) of a persistent part's trial, as
  NumPy arrays (jnp ones would be staged into whatever is tracing); `weighted`: every
  fourth slot closed."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape).astype(dtype)
  pw = (np.arange(n) % 4 != 0)[None].repeat(h, 0).astype(dtype) if weighted else None
  key_2 = np.array([3, 4], np.uint32)
  row_seeds, column_seeds = ((np.asarray(dropout_mask.row_seeds(key_2, h, b, t)),
                              np.asarray(dropout_mask.column_seeds(key_2, n)))
                             if rate else (None, None))
  return (normal(h, b, t, dh), normal(h, n, dh), normal(h, n, dh), pw, row_seeds,
          column_seeds, normal(h, b, t, dh))


def outputs_and_grads(part_: persistent_cores.Part, rate: float, score_dtype, qp, pk, pv,
                      pw, row_seeds, column_seeds, dout):
  """A part alone as the only softmax: (out, lse, dqp, dpk, dpv, dpw)."""
  acc, top, norm = part_.forward(rate, qp.shape[0], score_dtype, qp, pk, pv, pw, row_seeds,
                                 column_seeds)
  out = (acc / norm[..., None]).astype(dout.dtype)
  delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), -1)
  grads = part_.backward(rate, qp.shape[0], score_dtype, qp, pk, pv, pw, row_seeds,
                         column_seeds, top, norm, delta, out, dout)
  return (out, top + jnp.log(norm), *grads)


def mismatch(got, expected, tolerance: float) -> str | None:
  """What of (out, lse, dqp, dpk, dpv, dpw) differs by more than `tolerance` of its
  largest value, or None."""
  for name, g, e in zip(("out", "lse", "dqp", "dpk", "dpv", "dpw"), got, expected):
    if e is None:
      continue
    g, e = (np.asarray(x, np.float32) for x in (g, e))
    scale = float(np.abs(e).max()) or 1.0
    if not np.all(np.abs(g - e) <= tolerance * scale):
      return f"{name}: max difference {np.abs(g - e).max():.3g} of {scale:.3g}"
  return None


def trial(name: str, rate: float, weighted: bool, dtype, steps: int = 5) -> float:
  """Seconds per forward and backward step of part `name` on `trial_problem` (median
  of `steps`), after checking it against the XLA part (5% of each result's largest
  value; bf16 round-off gives about 1%). Compiled ahead of time: callable while
  another function traces.

  Raises:
    RuntimeError: the part disagrees with the XLA part.
  """
  args = trial_problem(jnp.dtype(dtype), rate, weighted)

  def compiled(part_name):
    fn = jax.jit(functools.partial(outputs_and_grads, persistent_cores.PARTS[part_name],
                                   rate, jnp.float32))
    return fn.lower(*args).compile()

  fn = compiled(name)
  got = jax.block_until_ready(fn(*args))
  if name != "xla":
    wrong = mismatch(got, compiled("xla")(*args), 0.05)
    if wrong:
      raise RuntimeError(f"it disagrees with the XLA part ({wrong})")
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv) -> None:
  name, rate, weighted, dtype = argv
  print(json.dumps({"seconds": trial(name, float(rate), bool(int(weighted)), dtype)}))


if __name__ == "__main__":
  main(sys.argv[1:])
