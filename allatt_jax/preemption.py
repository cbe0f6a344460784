"""Preemption: SIGTERM makes a command stop at its next safe point, resumable.

A command (a run, the demo pipeline, an experiment suite) holds one PreemptionWatch
from start to end. The train loop asks it after every step and, if told, saves that
step and stops; every later phase (final evaluation, export, each pipeline stage,
the report) asks it when it starts, after the phase before has left its result on
disk, so a rerun of the same command redoes nothing that had finished.
"""
import contextlib
import signal
import threading

from absl import logging
import jax
from jax.experimental import multihost_utils

from allatt_jax.errors import Preempted


class PreemptionWatch:
  """Tells a command when the job is being preempted, so it stops at a safe point.

  One process: while the watch is entered, SIGTERM (what Cloud TPU and most schedulers
  send before killing a job) only raises a flag, read at safe points. Several
  processes: `jax.distributed.initialize` starts JAX's preemption sync manager (unless
  jax_enable_preemption_service is off), which owns SIGTERM; whichever host receives
  it, the sync point is reached at the same safe point on every host, so all stop
  together. A Python handler would replace JAX's, so none is set. Every process asks
  at the same safe points, in the same order; the count of them is the sync manager's
  step counter, which must only grow.
  """

  def __init__(self):
    # Python delivers signals to the main thread only.
    self._own_handler = (jax.process_count() == 1
                         and threading.current_thread() is threading.main_thread())
    self._signalled = False
    self._previous = None
    self._safe_points = 0

  def __enter__(self) -> "PreemptionWatch":
    if self._own_handler:
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    return self

  def __exit__(self, *exc_info) -> None:
    if self._own_handler:
      signal.signal(signal.SIGTERM,
                    signal.SIG_DFL if self._previous is None else self._previous)

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    logging.warning("SIGTERM: stopping at the next safe point (after the current step "
                    "or phase), resumable.")
    self._signalled = True

  def reached(self) -> bool:
    """Whether to stop here; every process asks at every safe point."""
    if self._own_handler:
      return self._signalled
    self._safe_points += 1
    try:
      return multihost_utils.reached_preemption_sync_point(self._safe_points)
    except RuntimeError:   # the preemption service is off: nobody will be told
      return False

  def stop_if_asked(self, finished: str, rerun: str) -> None:
    """Raises Preempted if the job is being preempted. `finished`: what is done and
    kept; `rerun`: what a rerun of the same command does next."""
    if self.reached():
      raise Preempted(f"Preempted after {finished}. Rerun the same command to {rerun}.")


@contextlib.contextmanager
def watching(watch: PreemptionWatch | None = None):
  """`watch`, when the caller's command holds one already; else a new one."""
  if watch is not None:
    yield watch
  else:
    with PreemptionWatch() as new:
      yield new
