r"""`python -m allatt_jax.main` that sends itself a signal after its N-th train step.

  python tests/signal_worker.py SIGNAL N --config=... --workdir=...

SIGNAL is a name (SIGINT, SIGTERM); the steps are counted over the whole command
(a pipeline's baseline steps, then its pruning steps). The signal lands as a step
ends, before the train loop looks at its flag, as Ctrl-C pressed during a step does.
"""
import os
import signal
import sys

import jax

from allatt_jax.config import cli
from allatt_jax import main
from allatt_jax.training import progress


def signal_after_step(signum: int, count: int) -> None:
  add = progress.TrainProgress.add
  steps = []

  def add_then_signal(self, done, metrics):
    add(self, done, metrics)
    steps.append(done)
    if len(steps) == count:
      os.kill(os.getpid(), signum)

  progress.TrainProgress.add = add_then_signal


if __name__ == "__main__":
  signal_after_step(getattr(signal, sys.argv.pop(1)), int(sys.argv.pop(1)))
  jax.config.config_with_absl()
  cli.run(main.main)
