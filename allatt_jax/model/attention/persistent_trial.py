"""'auto''s trial of one persistent part (persistent_cores.trial) in a process of its
own, ended at its limit: a compile that stalls costs the trial its seconds, and leaves
nothing running in the training process (a thread could not be stopped).

The process starts fresh (a fork of a process that holds a GPU is unsafe): about 2 s
of Python and jax's import before the trial's own compiles, paid once per part, once
per training process, on a GPU only. It takes the GPU memory it uses, no more: the
training process may already hold most of it (XLA preallocates 75%).

  python -m allatt_jax.model.attention.persistent_trial NAME RATE WEIGHTED DTYPE
"""
import json
import os
import subprocess
import sys

# The trial problem is small (persistent_cores.trial_problem): a few MB.
_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def seconds(name: str, rate: float, weighted: bool, dtype: str, limit: float) -> float:
  """persistent_cores.trial(name, rate, weighted, dtype) in a process of its own.

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


def main(argv) -> None:
  # pylint: disable=import-outside-toplevel  # persistent_cores imports this module
  from allatt_jax.model.attention import persistent_cores

  name, rate, weighted, dtype = argv
  print(json.dumps({"seconds": persistent_cores.trial(name, float(rate), bool(int(weighted)),
                                                      dtype)}))


if __name__ == "__main__":
  main(sys.argv[1:])
