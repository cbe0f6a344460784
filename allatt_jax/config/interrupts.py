"""Ctrl-C from a command's first line until a run listens for it
(`preemption.PreemptionWatch`, which stops a run at its next safe point).

Python runs a signal's handler in the main thread between two bytecodes, wherever
those are. Its own handler raises KeyboardInterrupt there, and two places lose it:
- the module code of JAX, Flax or TensorFlow being imported, which then ends in a long
  traceback (or a half-initialised extension that crashes);
- a gc callback, such as JAX's `_xla_gc_callback`, which runs at any allocation: the
  interpreter prints "Exception ignored in ..." and the command goes on.

So a command has two handlers before its run's own:
- `exit_at_once` while it starts: from the package's `__init__` under `python -m`
  (`module_run_by_python`), or a console script's first call (`exiting_at_once`),
  until `cli.run` has parsed its flags. Nothing has been done that a stop could lose,
  so Ctrl-C prints one line and ends the process at once, status 130, whatever the
  main thread was running;
- `keyboard_interrupts` while its `main` runs: KeyboardInterrupt, which `cli` turns into
  one line and status 130, raised where Python would raise it, except inside a garbage
  collection (gc callbacks, weakref callbacks, finalisers) or a finaliser, where it is
  delivered again a moment later.

A SIGINT ignored when the process started (a background job of a shell script) stays
ignored, as Python leaves it.
"""
import contextlib
import gc
import os
import signal
import sys
import threading
import _thread

from allatt_jax.config import errors


# How long a Ctrl-C that lands inside a gc callback waits to be delivered again (a
# callback takes microseconds; one still running then defers it again).
REDELIVERY_S = 0.01


def _handles_sigint() -> bool:
  """Whether this thread may set SIGINT's handler, and SIGINT is not ignored."""
  return (threading.current_thread() is threading.main_thread()
          and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)


def _end_at_once(signum, frame) -> None:
  del signum, frame
  # Written straight to the file descriptor: the handler may run in the middle of a
  # write to sys.stderr's buffer.
  os.write(sys.stderr.fileno(), f"{errors.INTERRUPTED_STARTING}\n".encode())
  os._exit(errors.INTERRUPTED_EXIT_STATUS)  # pylint: disable=protected-access


def exit_at_once() -> None:
  """From now on Ctrl-C prints one line and ends the process at once, status 130.

  For a command's start, before its heavy imports: nothing is done yet that a stop
  could lose. `cli.run` hands over to `keyboard_interrupts` once the flags are parsed.
  """
  if _handles_sigint():
    signal.signal(signal.SIGINT, _end_at_once)


def exiting_at_once():
  """`exit_at_once` until the block ends, then SIGINT's handler as it was."""
  return _sigint_handled_by(_end_at_once)


def module_run_by_python() -> str:
  """MODULE of `python [options] -m MODULE ...` (from `sys.orig_argv`), else ''."""
  args = iter(sys.orig_argv[1:])
  for arg in args:
    if arg == "-m":
      return next(args, "")
    if arg.startswith("-m"):
      return arg[2:]
    if arg in ("-W", "-X"):             # the options that take the next argument
      next(args, None)
    elif not arg.startswith("-"):       # a script's path: no -m
      break
  return ""


# Whether the main thread is inside a garbage collection, between its callbacks' 'start'
# and 'stop' (`_track_collection`, first of gc.callbacks while `keyboard_interrupts`
# runs): there the weakref callbacks and finalisers it runs drop what they raise.
_main_thread_collecting = False


def _track_collection(phase, info) -> None:
  del info
  global _main_thread_collecting
  if threading.current_thread() is threading.main_thread():
    _main_thread_collecting = phase == "start"


def _in_callback(frame) -> bool:
  """Whether `frame` runs where an exception is printed as 'Exception ignored' and
  dropped: inside the main thread's garbage collection (a gc callback, a weakref
  callback, a finaliser), or a finaliser or gc callback anywhere."""
  if _main_thread_collecting:
    return True
  callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
  while frame is not None:
    if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
      return True
    frame = frame.f_back
  return False


def _raise_keyboard_interrupt(signum, frame) -> None:
  if _in_callback(frame):
    # Signalled again in a moment, from another thread: signalled from here, the
    # handler would run again at once, in this frame, inside the callback still.
    threading.Timer(REDELIVERY_S, _thread.interrupt_main, (signum,)).start()
    return
  raise KeyboardInterrupt


@contextlib.contextmanager
def keyboard_interrupts():
  """Ctrl-C raises KeyboardInterrupt in the block, as Python's own handler does, but
  never inside a garbage collection (its gc callbacks, weakref callbacks, finalisers)
  or a finaliser, which would drop it."""
  gc.callbacks.insert(0, _track_collection)
  try:
    with _sigint_handled_by(_raise_keyboard_interrupt):
      yield
  finally:
    gc.callbacks.remove(_track_collection)


@contextlib.contextmanager
def _sigint_handled_by(handler):
  """`handler` for SIGINT in the block (where `_handles_sigint`), then the one before,
  unless that ended the command's start, which is over for good once its work has
  begun."""
  if not _handles_sigint():
    yield
    return
  previous = signal.signal(signal.SIGINT, handler)
  try:
    yield
  finally:
    if previous is not _end_at_once:
      signal.signal(signal.SIGINT, previous)
