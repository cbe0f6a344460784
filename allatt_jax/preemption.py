"""Preemption: SIGTERM makes the train loop save its current step and stop."""
import signal
import threading

from absl import logging
import jax

from allatt_jax import checkpointing


class PreemptionWatch:
  """Tells the train loop when the job is being preempted, so it saves and stops.

  One process: while the watch is entered, SIGTERM (what Cloud TPU and most schedulers
  send before killing a job) only raises a flag, read between steps. Several
  processes: `jax.distributed.initialize` starts JAX's preemption sync manager (unless
  jax_enable_preemption_service is off), which owns SIGTERM; whichever host receives
  it, orbax's `reached_preemption(step)` turns True at the same step on every host, so
  all save that step together. A Python handler would replace JAX's, so none is set.
  """

  def __init__(self, checkpoints: checkpointing.RunCheckpoints):
    self._checkpoints = checkpoints
    # Python delivers signals to the main thread only.
    self._own_handler = (jax.process_count() == 1
                         and threading.current_thread() is threading.main_thread())
    self._signalled = False
    self._previous = None

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
    logging.warning("SIGTERM: saving a checkpoint after the current step, then stopping.")
    self._signalled = True

  def reached(self, step: int) -> bool:
    """Whether to save `step` and stop; every process calls it after every step."""
    if self._own_handler:
      return self._signalled
    return self._checkpoints.manager.reached_preemption(step)
