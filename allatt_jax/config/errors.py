"""Errors that tell the user what is wrong and how to fix it.

Every check that can fail on user input (a config, a dataset, a checkpoint) raises one
of these before any expensive work starts; every command prints the message without a
traceback (`cli.run`).
"""
import contextlib
import sys
from typing import Callable, NoReturn


class AllattError(Exception):
  """Base class: the message names the problem, the config key or file, and the fix."""


class ConfigError(AllattError):
  """A run config is inconsistent or out of range."""


class FlagError(AllattError):
  """A command-line flag is missing, unknown or out of range."""


class DataError(AllattError):
  """A dataset is missing, unreadable or malformed."""


class CheckpointError(AllattError):
  """A checkpoint is missing, unreadable or does not match the config."""


class TrainingError(AllattError):
  """Training cannot go on (a non-finite loss or gradient); the checkpoints are kept."""


# 128 + the signal, the status of a process the signal ended: schedulers, restart loops
# and shells read it as "stopped before finishing", unlike 0, which would mark the run
# done. SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C at a terminal).
PREEMPTED_EXIT_STATUS = 143
INTERRUPTED_EXIT_STATUS = 130


class Preempted(Exception):
  """The run saved a checkpoint of its current step (or finished its phase) and
  stopped, as asked by SIGTERM, Ctrl-C or a time box; `exit_status` is the command's.

  Not an AllattError: nothing is wrong, and rerunning the same command resumes.
  """

  def __init__(self, message: str, exit_status: int = PREEMPTED_EXIT_STATUS):
    super().__init__(message)
    self.exit_status = exit_status


# Ctrl-C while a command starts (its imports and flags: config/interrupts.py), which
# ends it at once.
INTERRUPTED_STARTING = (
    "Interrupted (Ctrl-C) while the command was starting, before it began any work: "
    "nothing was done. Rerun the same command to run it.")
# Ctrl-C where no run listens for it (see reported_to_user).
INTERRUPTED_OUTSIDE_TRAINING = (
    "Interrupted (Ctrl-C) outside a training step: nothing in progress was saved. "
    "Rerun the same command to start again, or to resume from the last checkpoint.")


@contextlib.contextmanager
def reported_to_user(exit_failed: Callable[[int], NoReturn] = sys.exit):
  """Turns an AllattError into its message on stderr and exit status 2, no traceback.

  A preempted or interrupted run prints its message and exits with its status. Ctrl-C
  where no run listens for it (before training starts, or in a multi-process run)
  prints one line instead of a KeyboardInterrupt traceback. `exit_failed` ends the
  process after an error or such a Ctrl-C; a preempted run, which stops at the same
  point in every process, exits normally.
  """
  try:
    yield
  except AllattError as e:
    print(f"error: {e}", file=sys.stderr)
    exit_failed(2)
  except Preempted as e:
    print(e, file=sys.stderr)
    sys.exit(e.exit_status)
  except KeyboardInterrupt:
    print(INTERRUPTED_OUTSIDE_TRAINING, file=sys.stderr)
    exit_failed(INTERRUPTED_EXIT_STATUS)
