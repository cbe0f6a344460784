"""Preemption and Ctrl-C: SIGTERM or SIGINT makes a command stop at its next safe
point, resumable.

A command holds one PreemptionWatch from start to end and asks it at safe points
(after every train step, and as each later phase starts, once the phase before has
left its result on disk), so a rerun redoes nothing that had finished.
"""
import contextlib
import os
import signal
import threading

import jax
from jax.experimental import multihost_utils

from allatt_jax.config import errors
from allatt_jax.config.errors import Preempted

# What a command says when it stops for each signal, and the status it exits with.
_STOPS = {
    signal.SIGTERM: ("Preempted", errors.PREEMPTED_EXIT_STATUS),
    signal.SIGINT: ("Interrupted", errors.INTERRUPTED_EXIT_STATUS),
}
# Printed the moment the signal arrives: the stop itself waits for the step or phase
# in progress, and a step still compiling (a run's first) ends only after its compile.
NOTICES = {
    signal.SIGTERM: "SIGTERM: stopping at the next safe point (the end of the current "
                    "step, once compiled, or phase), resumable.",
    signal.SIGINT: "Ctrl-C: stopping once the current step ends (a step being compiled, "
                   "such as a run's first, ends after its compile), saving it, or once "
                   "the current phase ends; resumable. Press Ctrl-C again to stop at "
                   "once, without saving.",
}
SECOND_INTERRUPT = ("Interrupted again: stopped at once, without saving. The checkpoints "
                    "already complete are kept; rerun the same command to resume from "
                    "the last of them.")


class PreemptionWatch:
  """Tells a command when the job is being preempted or interrupted, so it stops at a
  safe point.

  One process: while the watch is entered, SIGTERM (what Cloud TPU and most schedulers
  send before killing a job) and SIGINT (Ctrl-C) only raise a flag, read at safe
  points. A second Ctrl-C exits at once (status 130): a save in flight never
  completes, and orbax commits a checkpoint by renaming its finished folder, so the
  last complete one stays as it was. The notice of the first signal and that exit
  come from a thread woken by the signal itself (`signal.set_wakeup_fd`): Python runs
  its handlers only between bytecodes of the main thread, which may be inside a
  compile for a minute. Several processes: `jax.distributed.initialize`
  starts JAX's preemption sync manager (unless jax_enable_preemption_service is off),
  which owns SIGTERM; whichever host receives it, the sync point is reached at the
  same safe point on every host, so all stop together. A Python handler would replace
  JAX's, so none is set, for SIGINT neither: one host stopping alone would leave the
  others waiting in a collective, so there Ctrl-C ends a process at once (`cli`).
  Every process asks at the same safe points, in the same order; the count of them is
  the sync manager's step counter, which must only grow.
  """

  def __init__(self):
    # Python delivers signals to the main thread only.
    self._own_handler = (jax.process_count() == 1
                         and threading.current_thread() is threading.main_thread())
    self._signalled = None        # the first signal, as the main thread's handler saw it
    self._previous = {}
    self._safe_points = 0
    self._wakeups = None          # the thread told of each signal, and its pipe
    self._previous_wakeup_fd = -1

  def __enter__(self) -> "PreemptionWatch":
    if self._own_handler:
      self._previous = {signum: signal.signal(signum, self._on_signal)
                        for signum in _STOPS}
      read_fd, write_fd = os.pipe()
      os.set_blocking(write_fd, False)    # the C-level handler must never wait
      self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
      # The notices go where stderr goes now: file descriptor 2 itself may be hidden
      # for a moment later (console.native_stderr_hidden, while TensorFlow loads).
      stderr_fd = os.dup(2)
      thread = threading.Thread(target=self._on_wakeups, args=(read_fd, stderr_fd),
                                daemon=True, name="PreemptionWatch")
      thread.start()
      self._wakeups = (thread, read_fd, write_fd, stderr_fd)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, signal.SIG_DFL if previous is None else previous)
    self._previous = {}
    if self._wakeups is not None:
      thread, read_fd, write_fd, stderr_fd = self._wakeups
      signal.set_wakeup_fd(self._previous_wakeup_fd)
      os.close(write_fd)                  # the thread reads the end of the pipe
      thread.join()
      os.close(read_fd)
      os.close(stderr_fd)
      self._wakeups = None

  def _on_signal(self, signum, frame) -> None:
    """The main thread's handler: the flag the safe points read, set before the main
    thread goes on (a signal at the end of a step stops the run at that step)."""
    del frame
    if self._signalled is None:
      self._signalled = signum

  def _on_wakeups(self, read_fd: int, stderr_fd: int) -> None:
    """Tells of the first signal at once (on `stderr_fd`), and exits at a second
    Ctrl-C, whatever the main thread is doing."""
    first = None
    while received := os.read(read_fd, 64):
      for signum in received:
        if signum not in _STOPS:
          continue
        if first is None:
          first = signum
          os.write(stderr_fd, f"{NOTICES[signum]}\n".encode())
        elif signum == signal.SIGINT:
          os.write(stderr_fd, f"{SECOND_INTERRUPT}\n".encode())
          # Now, from inside whatever the main thread waits on (a save, a step, a
          # compile): no cleanup runs that could wait for it.
          os._exit(errors.INTERRUPTED_EXIT_STATUS)   # pylint: disable=protected-access

  def reached(self) -> bool:
    """Whether to stop here; every process asks at every safe point."""
    if self._own_handler:
      return self._signalled is not None
    self._safe_points += 1
    try:
      return multihost_utils.reached_preemption_sync_point(self._safe_points)
    except RuntimeError:   # the preemption service is off: nobody will be told
      return False

  def stopped(self, message: str) -> Preempted:
    """The Preempted that stops the command: 'Preempted' (SIGTERM, or the preemption
    service) or 'Interrupted' (Ctrl-C), then `message`, with the signal's exit status."""
    reason, status = _STOPS[self._signalled or signal.SIGTERM]
    return Preempted(f"{reason}{message}", status)

  def stop_if_asked(self, finished: str, rerun: str) -> None:
    """Raises Preempted if the job is being preempted or interrupted. `finished`: what
    is done and kept; `rerun`: what a rerun of the same command does next."""
    if self.reached():
      raise self.stopped(f" after {finished}. Rerun the same command to {rerun}.")


@contextlib.contextmanager
def watching(watch: PreemptionWatch | None = None):
  """`watch`, when the caller's command holds one already; else a new one."""
  if watch is not None:
    yield watch
  else:
    with PreemptionWatch() as new:
      yield new
