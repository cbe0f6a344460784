"""Errors that tell the user what is wrong and how to fix it.

Every check that can fail on user input (a config, a dataset, a checkpoint) raises one
of these before any expensive work starts; every command prints the message without a
traceback (`cli.run`).
"""
import contextlib
import sys


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


class Preempted(Exception):
  """The run saved a checkpoint of its current step and stopped, as asked by SIGTERM.

  Not an AllattError: nothing is wrong, and rerunning the same command resumes.
  """


# 128 + SIGTERM, the status of a process the signal ended: schedulers and restart loops
# read it as "stopped before finishing", unlike 0, which would mark the run done.
PREEMPTED_EXIT_STATUS = 143


@contextlib.contextmanager
def reported_to_user():
  """Turns an AllattError into its message on stderr and exit status 2, no traceback.

  A preempted run prints its message and exits with PREEMPTED_EXIT_STATUS.
  """
  try:
    yield
  except AllattError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except Preempted as e:
    print(e, file=sys.stderr)
    sys.exit(PREEMPTED_EXIT_STATUS)
