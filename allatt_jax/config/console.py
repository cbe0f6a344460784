"""What a command prints: its own progress, not its libraries' start-up and routine logs.

By default the libraries' INFO and WARNING records (orbax's per-save steps, clu's
work-unit notes, JAX's platform probing such as the missing libtpu, TFDS's folder
notices) and TensorFlow's C++ start-up notices are hidden, and the records shown are
plain lines (`PlainFormatter`); absl's `--verbosity=1` shows them all, in absl's
format. Errors always show.
"""
import contextlib
import logging
import os
import pathlib
import sys
import tempfile

_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parents[1])


def verbose_requested(argv=None) -> bool:
  """Whether the command line asks for absl verbosity >= 1 (-v / --verbosity).

  Read from the raw arguments because TensorFlow prints its start-up notices when
  it is imported, which happens before absl parses the flags.
  """
  argv = sys.argv if argv is None else argv
  for i, arg in enumerate(argv):
    name, has_value, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-") or name not in ("v", "verbosity"):
      continue
    if not has_value:
      value = argv[i + 1] if i + 1 < len(argv) else ""
    try:
      return int(value) >= 1
    except ValueError:
      return False   # absl reports the bad value when it parses the flags
  return False


@contextlib.contextmanager
def native_stderr_hidden(hide: bool = True):
  """Hides what native code writes to file descriptor 2 inside the block.

  TensorFlow's C++ notices (oneDNN, CPU features) are written there before any log
  level applies. If the block raises, the hidden output is shown, since it may
  explain the failure.
  """
  if not hide:
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as hidden:
    os.dup2(hidden.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      hidden.seek(0)
      sys.stderr.write(hidden.read().decode(errors="replace"))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


class LibraryChatterFilter(logging.Filter):
  """Keeps this package's records and the libraries' errors; drops the rest."""

  def filter(self, record):
    return (record.levelno >= logging.ERROR
            or os.path.abspath(record.pathname).startswith(_PACKAGE_DIR))


class PlainFormatter(logging.Formatter):
  """A record as its message alone, 'warning: ' (or 'error: ') before the serious ones:
  absl's timestamp, thread id and file:line help only whoever reads --verbosity=1."""

  def format(self, record):
    message = super().format(record)
    if record.levelno >= logging.WARNING:
      return f"{record.levelname.lower()}: {message}"
    return message


def banner(text: str) -> None:
  """One line announcing a stage of a command."""
  print(f"== {text}", flush=True)


def duration(seconds: float) -> str:
  """'1h02m', '3m05s' or '42s'."""
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
