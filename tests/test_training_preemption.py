"""SIGTERM in every phase of the demo pipeline, and Ctrl-C at a random step of it: it
stops there with Preempted (exit status 143, or 130 for Ctrl-C), and rerunning the
same command goes on from there, redoing no finished phase, to the results of an
uninterrupted run.

Each phase gets the signal from inside, when it starts (os.kill from a wrapper of a
function the phase calls), so the tests do not depend on timing.
"""
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys

import pytest

import data_fixtures
from helpers import assert_bit_identical
from helpers import run_pipeline
from helpers import saved_state
from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax.reports import demo_report
from allatt_jax.config import errors
from allatt_jax.pruning import model_export
from allatt_jax.evaluation import speed
from allatt_jax.evaluation import stream_eval
from allatt_jax.training import loop
from allatt_jax.config.errors import Preempted

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASELINE_STEPS, PRUNE_STEPS = 4, 4

CONFIG_FILE = """
from allatt_jax.config import config_base


def get_config(arg=None):
  c = config_base.load({demo!r}, "tiny")
  c.data.update(dict(name="text8", manual_dir={manual_dir!r}, data_dir={data_dir!r}))
  c.train.update(dict(num_steps={baseline}, log_every_steps=2))
  c.checkpoint.every_steps = 2
  c.pipeline.prune_train.update(dict(num_steps={prune}, warmup_steps=1))
  c.pipeline.prune_gates.update(dict(l0_warmup_steps=1, freeze_step=2))
  c.pipeline.speed_batches = 1
  return c
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
  """(config file, its config, the workdir of an uninterrupted pipeline run)."""
  root = tmp_path_factory.mktemp("preemption")
  manual_dir, data_dir = data_fixtures.prepared_text8(root)
  path = root / "demo_tiny.py"
  path.write_text(CONFIG_FILE.format(
      demo=str(ROOT / "configs" / "demo.py"), manual_dir=manual_dir,
      data_dir=data_dir, baseline=BASELINE_STEPS, prune=PRUNE_STEPS))
  config = config_base.load(path)
  run_pipeline(config, root / "uninterrupted")
  return path, config, root / "uninterrupted"


class Calls:
  """Counts the calls of functions a rerun must not repeat (training, evaluation)."""

  def __init__(self, monkeypatch):
    self.saves, self.evaluations = 0, 0
    save, evaluate_splits = checkpointing.RunCheckpoints.save, stream_eval.evaluate_splits

    def counted_save(checkpoints, *args, **kwargs):
      self.saves += 1
      return save(checkpoints, *args, **kwargs)

    def counted_evaluation(*args, **kwargs):
      self.evaluations += 1
      return evaluate_splits(*args, **kwargs)

    monkeypatch.setattr(checkpointing.RunCheckpoints, "save", counted_save)
    monkeypatch.setattr(stream_eval, "evaluate_splits", counted_evaluation)


def sigterm_before(monkeypatch, owner, name, when=lambda *args, **kwargs: True):
  """Makes `owner.name` send this process SIGTERM when it is called (and `when` holds)."""
  real = getattr(owner, name)

  def signalled(*args, **kwargs):
    if when(*args, **kwargs):
      os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)

  monkeypatch.setattr(owner, name, signalled)


def sigterm_after(monkeypatch, owner, name):
  real = getattr(owner, name)

  def signalled(*args, **kwargs):
    result = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return result

  monkeypatch.setattr(owner, name, signalled)


def test_sigterm_in_each_phase_stops_there_and_the_rerun_goes_on(demo, tmp_path):
  _, config, uninterrupted = demo
  workdir = tmp_path / "demo"
  baseline, pruned = workdir / "baseline", workdir / "pruned"

  def rerun(arrange, match=None):
    """One invocation of the pipeline; returns the counts of repeated work."""
    with pytest.MonkeyPatch.context() as monkeypatch:
      calls = Calls(monkeypatch)
      arrange(monkeypatch)
      if match is None:
        run_pipeline(config, workdir)
      else:
        with pytest.raises(Preempted, match=match):
          run_pipeline(config, workdir)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    return calls

  # 1. During the baseline's last step (after the loop's last look at the flag).
  calls = rerun(lambda m: sigterm_before(
      m, checkpointing.RunCheckpoints, "save", lambda _, step, *a, **k: step == BASELINE_STEPS),
      rf"^Preempted after training \(checkpoint of step {BASELINE_STEPS} in "
      rf"{baseline}/checkpoints\)\. Rerun the same command to run the final evaluation\.$")
  assert calls.evaluations == 0 and not pruned.exists()
  assert checkpointing.latest_finished_step(baseline) == BASELINE_STEPS

  # 2. During the baseline's final evaluation: no step is trained again.
  calls = rerun(lambda m: sigterm_before(m, stream_eval, "evaluate_splits"),
                rf"^Preempted after the final evaluation \(kept in "
                rf"{baseline}/{loop.PHASES_FILE}\)\. Rerun the same command to write "
                r"results.json\.$")
  assert (calls.saves, calls.evaluations) == (0, 1) and not pruned.exists()

  # 3. Between the stages: the baseline is not evaluated again.
  calls = rerun(lambda m: sigterm_after(m, loop, "train_and_evaluate"),
                rf"^Preempted after the baseline stage \(in {baseline}\)\. Rerun the same "
                r"command to go on with the pruning stage\.$")
  assert (calls.saves, calls.evaluations) == (0, 0)
  assert (baseline / "results.json").is_file() and not pruned.exists()

  # 4. During the pruning run's export, after its own training and evaluation.
  calls = rerun(lambda m: sigterm_before(m, model_export, "save"),
                rf"^Preempted after the export to {pruned}/export\. Rerun the same "
                r"command to write results.json\.$")
  assert calls.evaluations == 2 and not (pruned / "results.json").exists()

  # 5. During the speed comparison of the report: nothing before it is redone.
  calls = rerun(lambda m: sigterm_before(m, speed, "tokens_per_s"),
                rf"^Preempted after the pruning stage \(in {pruned}\); the speed "
                r"comparison in progress is not kept\. Rerun the same command to "
                r"measure both models' speeds and write the report\.$")
  assert (calls.saves, calls.evaluations) == (0, 0)
  assert (pruned / "results.json").is_file() and not (workdir / "report.json").exists()

  # 6. While the report is written, past the last safe point: it finishes.
  calls = rerun(lambda m: sigterm_before(m, demo_report, "build"))
  assert (calls.saves, calls.evaluations) == (0, 0)

  # The interrupted pipeline ends where the uninterrupted one does.
  for stage, steps in (("baseline", BASELINE_STEPS), ("pruned", PRUNE_STEPS)):
    assert_bit_identical(saved_state(workdir / stage, steps),
                         saved_state(uninterrupted / stage, steps))
    assert ((workdir / stage / "results.json").read_text().replace(str(workdir), "W")
            == (uninterrupted / stage / "results.json").read_text().replace(
                str(uninterrupted), "W"))
  report, reference = (pipeline_report(d) for d in (workdir, uninterrupted))
  assert report == reference


def pipeline_report(workdir) -> dict:
  """report.json without the measured speeds, which vary from run to run."""
  report = json.loads((workdir / "report.json").read_text())
  report["speed"] = {k: v for k, v in report["speed"].items() if "macs" in k}
  return report


def test_sigterm_in_the_last_training_step_exits_143_before_the_next_stage(demo, tmp_path):
  """The command itself: exit status 143, no traceback, the pruning stage not begun."""
  config_path, _, _ = demo
  workdir = tmp_path / "demo"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3",
         "JAX_COMPILATION_CACHE_DIR": str(config_path.parent / "jax_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  done = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "sigterm_worker.py"), str(BASELINE_STEPS),
       f"--config={config_path}", f"--workdir={workdir}"],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == errors.PREEMPTED_EXIT_STATUS, done.stderr[-3000:]
  assert "Traceback" not in done.stderr
  assert (f"Preempted after training (checkpoint of step {BASELINE_STEPS} in "
          f"{workdir / 'baseline' / 'checkpoints'}). Rerun the same command to run the "
          "final evaluation.") in done.stderr
  assert checkpointing.latest_finished_step(workdir / "baseline") == BASELINE_STEPS
  assert not (workdir / "pruned").exists()


def test_ctrl_c_at_a_random_step_then_the_same_command_ends_as_an_uninterrupted_run(
    demo, tmp_path):
  config_path, config, uninterrupted = demo
  workdir = tmp_path / "demo"
  at = random.Random().randint(1, BASELINE_STEPS + PRUNE_STEPS)
  stage, step = (("baseline", at) if at <= BASELINE_STEPS
                 else ("pruned", at - BASELINE_STEPS))
  print(f"Ctrl-C after step {step} of the {stage} stage")   # shown when it fails
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3",
         "JAX_COMPILATION_CACHE_DIR": str(config_path.parent / "jax_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  done = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "signal_worker.py"), "SIGINT", str(at),
       f"--config={config_path}", f"--workdir={workdir}"],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == errors.INTERRUPTED_EXIT_STATUS, done.stderr[-3000:]
  assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
  steps = BASELINE_STEPS if stage == "baseline" else PRUNE_STEPS
  lines = [line for line in done.stderr.splitlines() if line.startswith("Interrupted")]
  assert lines == [f"Interrupted: saved a checkpoint at step {step} of {steps} in "
                   f"{workdir / stage / 'checkpoints'}. Rerun the same command to "
                   "resume."], done.stderr[-3000:]
  assert checkpointing.latest_finished_step(workdir / stage) == step
  assert (workdir / "pruned").exists() == (stage == "pruned")

  done = subprocess.run(
      [sys.executable, "-m", "allatt_jax.main", f"--config={config_path}",
       f"--workdir={workdir}"], env=env, cwd=ROOT, capture_output=True, text=True,
      timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert re.search(rf"Resuming from step {step} in {workdir / stage}", done.stderr)
  for name, steps in (("baseline", BASELINE_STEPS), ("pruned", PRUNE_STEPS)):
    assert_bit_identical(saved_state(workdir / name, steps),
                         saved_state(uninterrupted / name, steps))
  assert pipeline_report(workdir) == pipeline_report(uninterrupted)
