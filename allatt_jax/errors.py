"""Errors that tell the user what is wrong and how to fix it.

Every check that can fail on user input (a config, a dataset, a checkpoint) raises one
of these before any expensive work starts; `main` prints the message without a
traceback.
"""
import contextlib
import sys


class AllattError(Exception):
  """Base class: the message names the problem, the config key or file, and the fix."""


class ConfigError(AllattError):
  """A run config is inconsistent or out of range."""


class DataError(AllattError):
  """A dataset is missing, unreadable or malformed."""


class CheckpointError(AllattError):
  """A checkpoint is missing, unreadable or does not match the config."""


@contextlib.contextmanager
def reported_to_user():
  """Turns an AllattError into its message on stderr and exit status 2, no traceback."""
  try:
    yield
  except AllattError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
