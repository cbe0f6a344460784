"""Ctrl-C at any moment of a command, from its first tenths of a second: it ends with
status 130 and the line of the moment, never a traceback, and is never lost.

The commands run as a terminal starts them: SIGINT at its default, where a background
job of a shell would start with it ignored. The moments are fractions of this
machine's time to import a command (measured here), so that a loaded machine moves
them with it.
"""
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import _thread

import pytest

from helpers import ROOT
from allatt_jax.config import errors
from allatt_jax.config import interrupts
from allatt_jax.training import preemption

DEMO = f"--config={ROOT / 'configs' / 'demo.py'}:tiny"
# The last line of a command that Ctrl-C stopped, by when it lands: while it starts,
# while it reads its data and builds its runs, or in a run (after its notice).
LAST_LINES = (errors.INTERRUPTED_STARTING, errors.INTERRUPTED_OUTSIDE_TRAINING,
              "Interrupted: saved a checkpoint", "Interrupted after")


# `python ARGS` with SIGINT at its default, whatever this process's is: set, then exec,
# in a Python of its own (no Python code may run in a forked child of this
# multithreaded process, as a preexec_fn would).
_WITH_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, "
                        "signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])")


def _started(args, tmp_path) -> subprocess.Popen:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TFDS_DATA_DIR": str(tmp_path / "tfds")}
  return subprocess.Popen(
      [sys.executable, "-c", _WITH_DEFAULT_SIGINT, sys.executable, "-m", *args], cwd=ROOT,
      env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _seconds_to(args, tmp_path) -> float:
  start = time.monotonic()
  process = _started(args, tmp_path)
  process.communicate(timeout=300)
  assert process.returncode == 0
  return time.monotonic() - start


@pytest.fixture(scope="module")
def start_times(tmp_path_factory) -> tuple[float, float]:
  """(seconds of a bare `python -m allatt_jax`, seconds of a command's imports: its
  --helpshort) on this machine, now."""
  tmp = tmp_path_factory.mktemp("start")
  return (_seconds_to(["allatt_jax", "--help"], tmp),
          _seconds_to(["allatt_jax.main", "--helpshort"], tmp))


def _interrupted_at(seconds: float, args, tmp_path, wait: float) -> tuple[int, str]:
  """(exit status, stderr) of `python -m ARGS` sent SIGINT `seconds` after its start;
  a command still running `wait` seconds later is killed (status -9)."""
  process = _started(args, tmp_path)
  time.sleep(seconds)
  process.send_signal(signal.SIGINT)
  try:
    stderr = process.communicate(timeout=wait)[1]
  except subprocess.TimeoutExpired:
    process.kill()
    return -9, process.communicate()[1]
  return process.returncode, stderr


def _assert_stopped_with_its_line(status: int, stderr: str, when: str) -> None:
  assert status == errors.INTERRUPTED_EXIT_STATUS, f"{when}: status {status}\n{stderr}"
  assert "Traceback" not in stderr and "Exception ignored" not in stderr, f"{when}\n{stderr}"
  lines = stderr.strip().splitlines()
  assert lines and lines[-1].startswith(LAST_LINES), f"{when}\n{stderr}"
  if lines[-1] == errors.INTERRUPTED_STARTING:
    assert len(lines) == 1, f"{when}\n{stderr}"
  if lines[-1].startswith(LAST_LINES[2:]):     # in a run: its notice came first
    assert preemption.NOTICES[signal.SIGINT] in lines, f"{when}\n{stderr}"


def test_ctrl_c_while_a_command_starts_ends_it_at_once_with_one_line(start_times, tmp_path):
  python_start, imports = start_times
  # From as soon as Python itself has started (0.2 s on an idle machine) to the end of
  # the imports of JAX, Flax and TensorFlow.
  moments = [max(0.2, 2 * python_start), *(f * imports for f in (0.25, 0.5, 0.75, 0.95))]
  for i, seconds in enumerate(moments):
    status, stderr = _interrupted_at(seconds, ["allatt_jax.main", DEMO,
                                               f"--workdir={tmp_path / f'run{i}'}"],
                                     tmp_path, wait=imports + 60)
    _assert_stopped_with_its_line(status, stderr, f"SIGINT at {seconds:.2f} s")
  # The command list (and each console script through it) starts as its commands do.
  status, stderr = _interrupted_at(0.5 * imports, ["allatt_jax", "main", DEMO,
                                                   f"--workdir={tmp_path / 'listed'}"],
                                   tmp_path, wait=imports + 60)
  _assert_stopped_with_its_line(status, stderr, "python -m allatt_jax main")


@pytest.mark.slow   # the later moments stop a training run
def test_ctrl_c_after_the_imports_or_in_training_stops_with_the_documented_lines(
    start_times, tmp_path):
  _, imports = start_times
  for i, factor in enumerate((1.1, 1.4, 2.0, 3.0)):
    seconds = factor * imports
    status, stderr = _interrupted_at(seconds, ["allatt_jax.main", DEMO,
                                               f"--workdir={tmp_path / f'run{i}'}"],
                                     tmp_path, wait=300)
    _assert_stopped_with_its_line(status, stderr, f"SIGINT at {seconds:.2f} s")


def test_ctrl_c_inside_a_gc_callback_is_raised_once_the_callback_returns(monkeypatch):
  armed, dropped = [], []
  monkeypatch.setattr(sys, "unraisablehook", dropped.append)
  # As a command starts its work: Ctrl-C raising KeyboardInterrupt, whatever an earlier
  # test in this process left.
  monkeypatch.setattr(interrupts, "_handles_sigint", lambda: True)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  inside_callback = []    # for each run of the handler: whether it ran inside a callback
  in_callback = interrupts._in_callback
  monkeypatch.setattr(interrupts, "_in_callback",
                      lambda frame: inside_callback.append(in_callback(frame)) or
                      inside_callback[-1])

  def callback(phase, info):
    del info
    # The main thread's collection only: Python runs signal handlers in the main thread.
    if phase == "start" and armed and threading.current_thread() is threading.main_thread():
      armed.clear()
      # SIGINT as Python's C handler records it (an OS signal could stay pending where
      # the process blocks SIGINT); the handler runs at the loop's next bytecodes, here,
      # inside the callback.
      _thread.interrupt_main(signal.SIGINT)
      for _ in range(1000):
        pass

  gc.callbacks.append(callback)
  raised = False
  try:
    with interrupts.keyboard_interrupts():
      armed.append(True)
      deadline = time.monotonic() + 10.0   # as long as it takes, on a loaded machine
      while time.monotonic() < deadline:
        if armed:
          # Again until the main thread's own collection runs: while another thread
          # collects, gc.collect() returns at once without one.
          gc.collect()
        time.sleep(0.01)
  except KeyboardInterrupt:
    raised = True
  finally:
    gc.callbacks.remove(callback)
    signal.signal(signal.SIGINT, previous)
  if armed:
    pytest.skip("the main thread could not collect in 10 s: other threads' collections "
                "held the collector all along")
  assert not dropped, [d.exc_value for d in dropped]
  assert raised, f"no KeyboardInterrupt in 10 s; the handler ran {len(inside_callback)} times"
  assert inside_callback[0] and not inside_callback[-1], inside_callback


def test_ctrl_c_is_deferred_through_the_main_threads_whole_collection(monkeypatch):
  """Also in the weakref callbacks and finalisers a collection runs, which drop what
  they raise as a gc callback does, whatever their code."""
  monkeypatch.setattr(interrupts, "_main_thread_collecting", False)
  with interrupts.keyboard_interrupts():
    assert gc.callbacks[0] is interrupts._track_collection
    interrupts._track_collection("start", {})
    assert interrupts._in_callback(sys._getframe())
    interrupts._track_collection("stop", {})
    assert not interrupts._in_callback(sys._getframe())
  assert interrupts._track_collection not in gc.callbacks


@pytest.mark.parametrize("argv, module", [
    (["python", "-m", "allatt_jax.main", "--workdir=x"], "allatt_jax.main"),
    (["python", "-X", "importtime", "-u", "-mallatt_jax.data"], "allatt_jax.data"),
    (["python", "-W", "ignore", "-m", "allatt_jax"], "allatt_jax"),
    (["python", "script.py", "-m", "x"], ""),
])
def test_the_module_python_runs_is_read_from_its_command_line(monkeypatch, argv, module):
  monkeypatch.setattr(sys, "orig_argv", argv)
  assert interrupts.module_run_by_python() == module
