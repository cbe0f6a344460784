r"""`python -m allatt_jax.main` that sends itself SIGTERM as it saves step STEP.

  python tests/sigterm_worker.py STEP --config=... --workdir=...

The signal lands after the train loop's last look at its preemption flag for that
step, as a scheduler's SIGTERM during the step's computation does.
"""
import os
import signal
import sys

import jax

from allatt_jax.runs import checkpointing
from allatt_jax.config import cli
from allatt_jax import main


def sigterm_when_saving(step: int) -> None:
  save = checkpointing.RunCheckpoints.save

  def save_after_sigterm(self, saved_step, *args, **kwargs):
    if saved_step == step:
      os.kill(os.getpid(), signal.SIGTERM)
    return save(self, saved_step, *args, **kwargs)

  checkpointing.RunCheckpoints.save = save_after_sigterm


if __name__ == "__main__":
  sigterm_when_saving(int(sys.argv.pop(1)))
  jax.config.config_with_absl()
  cli.run(main.main)
