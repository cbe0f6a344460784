"""Preemption, Ctrl-C, crashes and divergence: runs stop cleanly and resume bit for bit.

The interrupted runs are real `python -m allatt_jax.main` processes sent SIGTERM,
SIGINT or SIGKILL; they must end exactly where an uninterrupted run (in this process)
ends.
"""
import itertools
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time
import types

from clu import metric_writers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data_fixtures
import helpers
from helpers import assert_bit_identical
from helpers import train_run
from helpers import saved_state
from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax.config import errors
from allatt_jax.training import preemption
from allatt_jax.training import progress
from allatt_jax.evaluation import stream_eval
from allatt_jax.training import train_step
from allatt_jax.evaluation import speed

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_STEPS, FREEZE_STEP, CHECKPOINT_EVERY = 300, 100, 25

# A tiny pruning run: gates sampled until FREEZE_STEP, dropout on, so the RNG, the λ
# warm-up, the freeze, the memory and the data position all matter for the result.
CONFIG_FILE = """
from allatt_jax.config import config_base


def get_config(arg=None):
  c = config_base.load({demo!r}, "tiny")
  with c.unlocked():
    del c["pipeline"]
  c.data.update(dict(name="text8", manual_dir={manual_dir!r}, data_dir={data_dir!r}))
  c.model.dropout = 0.1
  c.train.update(dict(num_steps={num_steps}, log_every_steps=1))
  c.gates.update(dict(enabled=True, lam=0.1, l0_warmup_steps=20, freeze_step={freeze},
                      learning_rate=0.05))
  c.init_from = "none"   # pruning from scratch, on purpose
  c.eval.every_steps = 0
  c.checkpoint.update(dict(every_steps={every}, keep=3))
  return c
"""
STEP_LOGGED = re.compile(r"^step +(\d+)/", re.M)     # the progress line of a logged step


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
  """(config file, its config): the run every test here interrupts."""
  root = tmp_path_factory.mktemp("reliability")
  manual_dir, data_dir = data_fixtures.prepared_text8(root)
  path = root / "tiny_prune.py"
  path.write_text(CONFIG_FILE.format(
      demo=str(ROOT / "configs" / "demo.py"), manual_dir=manual_dir,
      data_dir=data_dir, num_steps=NUM_STEPS, freeze=FREEZE_STEP,
      every=CHECKPOINT_EVERY))
  return path, config_base.load(path)


@pytest.fixture(scope="module")
def uninterrupted(run_config, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  train_run(run_config[1], workdir)
  return saved_state(workdir, NUM_STEPS)


class Run:
  """One `python -m allatt_jax.main` process (or `command`) on a workdir, logging to a file."""

  def __init__(self, config_path, workdir, log, command=("-m", "allatt_jax.main")):
    self.log = log
    # The processes share compiled steps through JAX's persistent cache, to save time;
    # the in-process reference compiles its own, so the comparison covers both.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": str(pathlib.Path(config_path).parent / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    with open(log, "w") as out:
      self.process = subprocess.Popen(
          [sys.executable, *command, f"--config={config_path}", f"--workdir={workdir}"],
          stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

  def output(self) -> str:
    return self.log.read_text()

  def wait_until(self, done, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not done():
      if self.process.poll() is not None:
        raise AssertionError(f"exited ({self.process.returncode}) before {what}:\n"
                             + self.output()[-3000:])
      if time.monotonic() > deadline:
        self.process.kill()
        raise AssertionError(f"no {what} in {timeout}s:\n" + self.output()[-3000:])
      time.sleep(0.05)

  def wait_for_step(self, step):
    self.wait_until(lambda: any(int(s) >= step for s in STEP_LOGGED.findall(self.output())),
                    f"step {step}")

  def stop(self, signum) -> int:
    self.process.send_signal(signum)
    return self.process.wait(timeout=120)


def preempted_at(output) -> int:
  match = re.search(rf"Preempted: saved a checkpoint at step (\d+) of {NUM_STEPS} in ", output)
  assert match, output[-3000:]
  assert "Traceback" not in output
  return int(match.group(1))


def resumed_from(output) -> int:
  return int(re.search(r"Resuming from step (\d+)", output).group(1))


@pytest.mark.slow
def test_sigterm_and_sigkill_resume_bit_exactly(run_config, uninterrupted, tmp_path):
  config_path, config = run_config
  workdir = tmp_path / "run"

  # 1. SIGTERM before the gate freeze: saves the current step, exits with 143.
  first = Run(config_path, workdir, tmp_path / "first.log")
  first.wait_for_step(20)
  assert first.stop(signal.SIGTERM) == errors.PREEMPTED_EXIT_STATUS
  stopped = preempted_at(first.output())
  assert 20 <= stopped < FREEZE_STEP, "the first interruption should precede the freeze"
  assert checkpointing.latest_finished_step(workdir) == stopped

  # 2. SIGKILL after the freeze, between checkpoints: the steps since the last
  # checkpoint are lost and must be replayed identically.
  second = Run(config_path, workdir, tmp_path / "second.log")
  second.wait_for_step(FREEZE_STEP + 30)
  assert second.stop(signal.SIGKILL) == -signal.SIGKILL
  assert resumed_from(second.output()) == stopped
  killed_after = max(int(s) for s in STEP_LOGGED.findall(second.output()))
  last_saved = checkpointing.latest_finished_step(workdir)   # the save in flight may be lost
  assert FREEZE_STEP <= last_saved < killed_after

  # 3. SIGTERM again, later on.
  third = Run(config_path, workdir, tmp_path / "third.log")
  third.wait_for_step(FREEZE_STEP + 100)
  assert third.stop(signal.SIGTERM) == errors.PREEMPTED_EXIT_STATUS
  assert resumed_from(third.output()) == last_saved
  assert FREEZE_STEP + 100 <= preempted_at(third.output()) < NUM_STEPS

  # 4. The same command finishes the run.
  train_run(config, workdir)
  assert_bit_identical(saved_state(workdir, NUM_STEPS), uninterrupted)


def interrupted_at(output) -> int:
  """The step an interrupted run saved, from its one line on where and how to resume."""
  match = re.search(rf"^Interrupted: saved a checkpoint at step (\d+) of {NUM_STEPS} in "
                    r"\S+/checkpoints\. Rerun the same command to resume\.$", output, re.M)
  assert match, output[-3000:]
  assert "Traceback" not in output and "KeyboardInterrupt" not in output
  return int(match.group(1))


@pytest.mark.slow
def test_ctrl_c_at_a_random_step_saves_it_and_resumes_bit_exactly(run_config, uninterrupted,
                                                                  tmp_path):
  config_path, config = run_config
  workdir = tmp_path / "run"
  at = random.Random().randrange(5, NUM_STEPS - 5)
  print(f"Ctrl-C after step {at}")   # shown when the test fails
  run = Run(config_path, workdir, tmp_path / "run.log")
  run.wait_for_step(at)
  assert run.stop(signal.SIGINT) == errors.INTERRUPTED_EXIT_STATUS
  stopped = interrupted_at(run.output())
  assert at <= stopped < NUM_STEPS
  assert checkpointing.latest_finished_step(workdir) == stopped

  train_run(config, workdir)
  assert_bit_identical(saved_state(workdir, NUM_STEPS), uninterrupted)


@pytest.mark.slow
def test_a_second_ctrl_c_while_saving_exits_at_once_keeping_the_last_checkpoint(
    run_config, uninterrupted, tmp_path):
  config_path, config = run_config
  workdir, stall, marker = tmp_path / "run", tmp_path / "stall", tmp_path / "stalled"
  run = Run(config_path, workdir, tmp_path / "run.log",
            command=(str(ROOT / "tests" / "stalled_save_worker.py"), f"file:{stall}",
                     str(marker)))
  run.wait_for_step(random.Random().randrange(CHECKPOINT_EVERY + 1, 3 * CHECKPOINT_EVERY))
  # Saves commit in the background: stall only once one has finished, to restore below.
  run.wait_until(lambda: any(p.name.isdigit() for p in (workdir / "checkpoints").iterdir()),
                 "a finished checkpoint")
  stall.touch()
  run.process.send_signal(signal.SIGINT)
  run.wait_until(marker.exists, "the save of the interrupted step")
  start = time.monotonic()
  assert run.stop(signal.SIGINT) == errors.INTERRUPTED_EXIT_STATUS
  assert time.monotonic() - start < 10, "the second Ctrl-C should not wait for the save"
  assert preemption.SECOND_INTERRUPT in run.output()
  assert "Traceback" not in run.output()

  # The save cut short is left where restore ignores it; the one before restores.
  last = checkpointing.latest_finished_step(workdir)
  assert list((workdir / "checkpoints").glob("*.orbax-checkpoint-tmp"))
  checkpointing.read_model(workdir, last)
  train_run(config, workdir)
  assert_bit_identical(saved_state(workdir, NUM_STEPS), uninterrupted)


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_the_last_complete_one(run_config, uninterrupted,
                                                                  tmp_path):
  config_path, config = run_config
  workdir, marker = tmp_path / "run", tmp_path / "stalled"
  stalled = 2 * CHECKPOINT_EVERY
  run = Run(config_path, workdir, tmp_path / "run.log",
            command=(str(ROOT / "tests" / "stalled_save_worker.py"), f"step:{stalled}",
                     str(marker)))
  run.wait_until(marker.exists, f"the save of step {stalled}")
  assert run.stop(signal.SIGKILL) == -signal.SIGKILL

  half_written = workdir / "checkpoints" / f"{stalled}.orbax-checkpoint-tmp"
  assert half_written.is_dir() and not (workdir / "checkpoints" / str(stalled)).exists()
  assert checkpointing.latest_finished_step(workdir) == CHECKPOINT_EVERY
  checkpointing.read_model(workdir)           # readers skip it too

  train_run(config, workdir)
  assert not half_written.exists()
  assert_bit_identical(saved_state(workdir, NUM_STEPS), uninterrupted)


# Non-finite losses and gradients.

POISONED_STEP = 5


@pytest.fixture
def poisoned(monkeypatch):
  """Step POISONED_STEP's forward pass reads NaN memory, so its loss and gradient are NaN."""
  real_step = train_step.train_step

  def poisoned_step(state, inputs, targets, **kwargs):
    poison = jnp.where(state.step + 1 == POISONED_STEP, jnp.nan, 1.0)
    memory = {**state.memory, "hidden": state.memory["hidden"] * poison}
    return real_step(state.replace(memory=memory), inputs, targets, **kwargs)

  monkeypatch.setattr(train_step, "train_step", poisoned_step)


def short_config(run_config, **train_overrides):
  config = run_config[1].copy_and_resolve_references()
  config.gates.enabled = False
  config.train.update({**dict(num_steps=8, log_every_steps=4), **train_overrides})
  config.checkpoint.update(dict(every_steps=2, keep=10))
  return config


@pytest.mark.slow
def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
    run_config, poisoned, tmp_path):
  with pytest.raises(errors.TrainingError, match=(
      rf"Non-finite loss \(nan\) at step {POISONED_STEP}: training stopped. The last "
      r"checkpoint, step 4, predates it.*skip_nonfinite_steps=True")):
    train_run(short_config(run_config), tmp_path)
  assert checkpointing.latest_finished_step(tmp_path) == 4
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(checkpointing.read_model(
      tmp_path)[1]))


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_without_update_and_counted(run_config, poisoned,
                                                                tmp_path, monkeypatch):
  writer = helpers.RecordingWriter()
  monkeypatch.setattr(metric_writers, "create_default_writer",
                      lambda *args, **kwargs: writer)
  config = short_config(run_config, skip_nonfinite_steps=True, log_every_steps=2)
  config.checkpoint.every_steps = 1
  train_run(config, tmp_path)

  before, skipped, after, last = (saved_state(tmp_path, s)["state"] for s in
                                  (POISONED_STEP - 1, POISONED_STEP, POISONED_STEP + 1, 8))
  assert_bit_identical(skipped["variables"], before["variables"])
  assert_bit_identical(skipped["opt_state"], before["opt_state"])
  assert skipped["step"] == POISONED_STEP
  assert skipped["memory"]["length"] == 0 and not skipped["memory"]["hidden"].any()
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after["variables"]),
                                                      jax.tree.leaves(skipped["variables"])))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(last))
  counts = {step: s["nonfinite_steps"] for step, s in writer.scalars.items()
            if "nonfinite_steps" in s}
  assert counts == {2: 0, 4: 0, 6: 1, 8: 0}
  assert np.isfinite(writer.scalars[6]["loss"])   # the mean of the finite step


@pytest.mark.slow
def test_a_stopped_run_flushes_the_steps_it_logged(run_config, tmp_path, monkeypatch):
  """TensorBoard's writer may hold them in memory for minutes: the run flushes it when
  it stops, whatever stops it."""
  writer = helpers.RecordingWriter()
  monkeypatch.setattr(metric_writers, "create_default_writer",
                      lambda *args, **kwargs: writer)
  with pytest.raises(errors.Preempted, match="^Time box reached"):
    train_run(short_config(run_config, log_every_steps=1), tmp_path,
              deadline=time.monotonic())
  assert list(writer.scalars) == [1] and not writer.unflushed


@pytest.mark.slow
def test_a_resumed_runs_rate_counts_the_batch_tokens_of_steps_after_its_compile(
    run_config, tmp_path, monkeypatch):
  config = short_config(run_config)
  with pytest.raises(errors.Preempted, match="^Time box reached: saved a checkpoint at step 1 "):
    train_run(config, tmp_path, deadline=time.monotonic())
  writer = helpers.RecordingWriter()
  monkeypatch.setattr(metric_writers, "create_default_writer",
                      lambda *args, **kwargs: writer)
  # A clock that ticks once a reading: the steps timed are those between the reading
  # at the end of the compiling step and the log's.
  monkeypatch.setattr(progress, "time",
                      types.SimpleNamespace(perf_counter=itertools.count().__next__))
  train_run(config, tmp_path)
  # Resumed at step 2, which compiles: steps 3 and 4 are timed by step 4's log.
  tokens_per_step = config.train.batch_size * config.train.seq_len
  assert writer.scalars[4]["tokens_per_s"] == 2 * tokens_per_step


@pytest.mark.slow
def test_skipped_steps_keep_every_schedule_in_step(run_config, poisoned, tmp_path):
  """A skipped step before the gate freeze must not delay the freeze (or any schedule)."""
  config = short_config(run_config, skip_nonfinite_steps=True)
  config.gates.update(dict(enabled=True, l0_warmup_steps=2, freeze_step=POISONED_STEP + 1))
  config.checkpoint.every_steps = 1
  train_run(config, tmp_path)

  states = {s: saved_state(tmp_path, s)["state"] for s in (config.gates.freeze_step, 8)}
  # The optimizer keeps no clock of its own that a rolled-back state could set back...
  clocks = [jax.tree_util.keystr(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(states[8]["opt_state"])[0]
            if "count" in jax.tree_util.keystr(path)]
  assert not clocks
  # ...so the gates stop exactly at the freeze step, though one step before was skipped.
  assert_bit_identical(states[8]["variables"]["gates"],
                       states[config.gates.freeze_step]["variables"]["gates"])
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(states[8]["variables"]["params"]),
      jax.tree.leaves(states[config.gates.freeze_step]["variables"]["params"])))


def test_nonfinite_gradient_is_named():
  metrics = [{"loss": np.float32(2.0), "grad_norm": np.float32(1.0)},
             {"loss": np.float32(2.0), "grad_norm": np.float32(np.inf)},
             {"loss": np.float32(np.nan), "grad_norm": np.float32(np.nan)}]
  assert progress.nonfinite_steps(metrics, 12) == [(11, "grad_norm", np.inf),
                                                   (12, "loss", pytest.approx(np.nan,
                                                                              nan_ok=True))]


def test_a_step_is_skipped_when_its_loss_or_its_gradient_is_not_finite():
  """A finite loss can come with an overflowing gradient: applied, it would poison the
  variables all the same."""
  new, old = {"w": jnp.ones(2)}, {"w": jnp.zeros(2)}
  for loss, grad_norm, kept in ((2.0, 1.0, new), (2.0, np.inf, old), (2.0, np.nan, old),
                                (np.nan, 1.0, old)):
    metrics = {"loss": jnp.float32(loss), "grad_norm": jnp.float32(grad_norm)}
    assert_bit_identical(train_step._where_finite(metrics, new, old), kept)


# Several hosts: orbax's preemption sync point, not a Python signal handler.

def test_multi_process_runs_leave_sigterm_to_jax(monkeypatch):
  calls = []

  def reached_preemption_sync_point(counter):
    calls.append(counter)
    return counter == 3

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(preemption.multihost_utils, "reached_preemption_sync_point",
                      reached_preemption_sync_point)
  before = signal.getsignal(signal.SIGTERM)
  with preemption.PreemptionWatch() as watch:
    assert signal.getsignal(signal.SIGTERM) is before
    assert [watch.reached() for _ in range(2)] == [False, False]
    with pytest.raises(errors.Preempted, match=r"^Preempted after the export\. Rerun "
                       r"the same command to write results\.json\.$"):
      watch.stop_if_asked("the export", "write results.json")
  # Every safe point, train step or phase boundary, is the next sync point: the same
  # count on every host.
  assert calls == [1, 2, 3]


def test_with_the_preemption_service_off_no_safe_point_stops(monkeypatch):
  def service_off(counter):
    raise RuntimeError(f"preemption sync manager not started (step {counter})")

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(preemption.multihost_utils, "reached_preemption_sync_point",
                      service_off)
  with preemption.PreemptionWatch() as watch:
    assert not any(watch.reached() for _ in range(3))
    watch.stop_if_asked("the export", "write results.json")


def test_one_process_catches_ctrl_c_at_safe_points_and_exits_130():
  before = signal.getsignal(signal.SIGINT)
  with preemption.PreemptionWatch() as watch:
    assert not watch.reached()
    os.kill(os.getpid(), signal.SIGINT)      # no KeyboardInterrupt: a flag
    assert watch.reached()
    with pytest.raises(errors.Preempted, match=r"^Interrupted after the final "
                       r"evaluation\. Rerun the same command to export") as stopped:
      watch.stop_if_asked("the final evaluation", "export the pruned model")
    assert stopped.value.exit_status == errors.INTERRUPTED_EXIT_STATUS == 130
  assert signal.getsignal(signal.SIGINT) is before


def test_a_watch_gives_back_the_wakeup_fd_it_found():
  before = signal.set_wakeup_fd(-1)
  signal.set_wakeup_fd(before)
  with preemption.PreemptionWatch() as watch:
    os.kill(os.getpid(), signal.SIGTERM)
    assert watch.reached()
  assert signal.set_wakeup_fd(before) == before


# Ctrl-C, then the scheduler's SIGTERM: one notice, and the stop is still Ctrl-C's, at
# the safe point (a second signal exits at once only when it is a Ctrl-C).
_CTRL_C_THEN_SIGTERM = """
import os, signal, time
from allatt_jax.training import preemption
with preemption.PreemptionWatch() as watch:
  for signum in (signal.SIGINT, signal.SIGTERM):
    os.kill(os.getpid(), signum)
    time.sleep(0.5)     # the thread told of each signal has read it
  stopped = watch.stopped(": at the safe point")
  print(stopped, stopped.exit_status)
"""


def test_a_sigterm_after_ctrl_c_neither_exits_at_once_nor_renames_the_stop():
  done = subprocess.run([sys.executable, "-c", _CTRL_C_THEN_SIGTERM], capture_output=True,
                        text=True, timeout=60, cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert (done.returncode, done.stdout) == (0, "Interrupted: at the safe point 130\n"), (
      done.stderr)
  notices = [line for line in done.stderr.splitlines() if line in preemption.NOTICES.values()]
  assert notices == [preemption.NOTICES[signal.SIGINT]], done.stderr


# The main thread inside C code, as in a compile, where no Python handler runs; Ctrl-C
# lands on another thread, as the kernel may deliver it.
_CTRL_C_TWICE_DURING_A_COMPILE = """
import ctypes, signal, sys, threading, time
from allatt_jax.training import preemption

def press_ctrl_c_twice():
  for _ in range(2):
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)

with preemption.PreemptionWatch():
  threading.Thread(target=press_ctrl_c_twice).start()
  ctypes.CDLL(None).sleep(60)
print("the main thread went on", file=sys.stderr)
"""


def test_ctrl_c_is_told_at_once_and_a_second_exits_at_once_during_a_compile():
  start = time.monotonic()
  done = subprocess.run([sys.executable, "-c", _CTRL_C_TWICE_DURING_A_COMPILE],
                        capture_output=True, text=True, timeout=60, cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == errors.INTERRUPTED_EXIT_STATUS, done.stderr
  assert time.monotonic() - start < 30, "the second Ctrl-C waited for the main thread"
  assert done.stderr.splitlines()[-2:] == [preemption.NOTICES[signal.SIGINT],
                                           preemption.SECOND_INTERRUPT], done.stderr


# Ctrl-C while a run loads TensorFlow, whose C++ notices are hidden meanwhile (file
# descriptor 2 pointed at a file: console.native_stderr_hidden).
_CTRL_C_WHILE_NATIVE_STDERR_IS_HIDDEN = """
import os, signal, time
from allatt_jax.config import console
from allatt_jax.training import preemption
with preemption.PreemptionWatch() as watch:
  with console.native_stderr_hidden():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)     # the thread told of the signal has read it
  print(watch.reached())
"""


def test_the_ctrl_c_notice_shows_while_native_stderr_is_hidden():
  done = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_NATIVE_STDERR_IS_HIDDEN],
                        capture_output=True, text=True, timeout=60, cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
  assert done.stderr.splitlines() == [preemption.NOTICES[signal.SIGINT]], done.stderr


def test_a_signal_stops_the_speed_comparison_at_its_next_timed_run(monkeypatch):
  timed = []

  class Evaluator:
    """Times nothing; the second timed run is where SIGTERM arrives."""

    @classmethod
    def from_config(cls, lm, mesh, config):
      del lm, mesh, config
      return cls()

    def score(self, variables, tokens, max_batches):
      del variables, tokens
      if max_batches > 1:
        timed.append(max_batches)
        if len(timed) == 2:
          os.kill(os.getpid(), signal.SIGTERM)
      return {"tokens": 1}

  monkeypatch.setattr(stream_eval, "Evaluator", Evaluator)
  model = types.SimpleNamespace(lm=None, variables=None)
  with preemption.PreemptionWatch() as watch:
    with pytest.raises(errors.Preempted, match="the speed comparison in progress"):
      speed.tokens_per_s(None, None, None, 5, {"baseline": model, "pruned": model},
                         safe_point=lambda: watch.stop_if_asked(
                             "the speed comparison in progress", "measure it"))
  assert timed == [5, 5]     # of 18: the run after the signal did not start


def test_the_rate_and_eta_leave_out_the_step_that_compiles(tmp_path, monkeypatch, capsys):
  clock = [0.0]
  monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  run = progress.TrainProgress(tmp_path, None, num_steps=100, first_step=40,
                               tokens_per_step=64, metric="bpc", skip_nonfinite=False,
                               gated=False)
  metrics = {"loss": 1.0, "nll": 1.0, "grad_norm": 1.0}
  # A resumed run: its first step compiles for 30 s, the next ones take 0.5 s each.
  for done, seconds in ((41, 30.0), *((done, 0.5) for done in range(42, 51))):
    clock[0] += seconds
    run.add(done, metrics)
  run.fetch(50)
  run.log(50, [], None)
  run.close()
  line = capsys.readouterr().out.splitlines()[-1]
  assert line.endswith("2.0 steps/s  ETA 25s"), line      # 50 steps left at 2 a second


def test_ctrl_c_where_no_run_listens_is_one_line_and_status_130(capsys):
  with pytest.raises(SystemExit) as exited:
    with errors.reported_to_user():
      raise KeyboardInterrupt
  assert exited.value.code == errors.INTERRUPTED_EXIT_STATUS
  assert capsys.readouterr().err == errors.INTERRUPTED_OUTSIDE_TRAINING + "\n"


def test_one_process_catches_sigterm_at_safe_points():
  before = signal.getsignal(signal.SIGTERM)
  with preemption.PreemptionWatch() as watch:
    assert not watch.reached()
    watch.stop_if_asked("nothing", "go on")
    os.kill(os.getpid(), signal.SIGTERM)
    assert watch.reached()
    with pytest.raises(errors.Preempted, match="Preempted after the final evaluation"):
      watch.stop_if_asked("the final evaluation", "export the pruned model")
  assert signal.getsignal(signal.SIGTERM) is before
