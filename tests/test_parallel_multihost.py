"""A 2-process run on one machine (gloo collectives) agrees with a 1-process run.

Both processes run `python -m allatt_jax.main` with --coordinator_address,
--num_processes and --process_id, as on two hosts: 3 steps, then a restart that
resumes from the step-3 checkpoint and trains to step 6, with final evaluation and
export. Each process has 2 fake CPU devices; the (2, 2) mesh puts the batch across
the processes and the heads across each process's devices.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import helpers
from allatt_jax.runs import checkpointing
from allatt_jax import data as data_lib

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

REPO = pathlib.Path(__file__).resolve().parents[1]
# The demo's tiny gated model as a plain run. A constant learning rate (peak = final,
# no warm-up) makes the schedule independent of num_steps, so a run stopped at step
# 3 and resumed to step 6 takes the same steps as one going straight to 6.
CONFIG = f'''
from allatt_jax.config import config_base


def get_config(arg=None):
  c = config_base.load({str(REPO / "configs" / "demo.py")!r}, "tiny")
  with c.unlocked():
    del c["pipeline"]
  c.train.update(dict(learning_rate=3e-3, final_learning_rate=3e-3, warmup_steps=0,
                      log_every_steps=1))
  c.eval.update(dict(batch_size=128, seq_len=64, mem_len=32, every_steps=0))
  c.checkpoint.every_steps = 3
  # Gates freeze where the first start stops: each start compiles one step mode.
  c.gates.update(dict(enabled=True, lam=0.01, init=0.0, l0_warmup_steps=0,
                      freeze_step=3))
  c.init_from = "none"   # pruning from scratch, on purpose
  return c
'''
# The LoggingWriter line of a logging step: "[step] ..., loss=..., ...".
_LOSS_LINE = re.compile(r"\] \[(\d+)\] .*\bloss=([-+.\deE]+)")


def _launch(config_file, workdir, data_dir, num_steps, *, process_id=None, port=None,
            devices=1):
  """Starts one `allatt_jax.main` process; output goes to a log file next to workdir."""
  # --verbosity=1: every process's metric lines (clu's logging writer), which
  # _LOSS_LINE reads.
  args = [sys.executable, "-m", "allatt_jax.main", f"--config={config_file}",
          f"--workdir={workdir}", f"--config.data.data_dir={data_dir}",
          f"--config.train.num_steps={num_steps}", "--verbosity=1"]
  if process_id is not None:
    args += [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
             f"--process_id={process_id}", "--config.mesh.data=2", "--config.mesh.model=2"]
  # PYTHONFAULTHANDLER: a process that hangs writes its threads' stacks to its log
  # when _wait stops it with SIGABRT.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
         "PYTHONFAULTHANDLER": "1",
         "XLA_FLAGS": helpers.xla_flags(cpu_devices=devices)}
  log = pathlib.Path(f"{workdir}.{num_steps}.{process_id}.log")
  with open(log, "w") as out:
    process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
  return process, log


def _wait(launched, timeout=300) -> list[str]:
  """Waits for all processes; returns their logs.

  Fails as soon as one process fails (the others may wait for it in a collective
  forever), with its log; after `timeout` seconds, with every log, each ending in
  its process's stacks.
  """
  deadline = time.monotonic() + timeout
  try:
    while any(process.poll() is None for process, _ in launched):
      for process, log in launched:
        assert process.poll() in (None, 0), log.read_text()[-6000:]
      if time.monotonic() > deadline:
        for process, _ in launched:
          process.send_signal(signal.SIGABRT)
          process.wait(timeout=30)
        pytest.fail(f"processes still running after {timeout} s:\n" + "\n".join(
            f"--- {log.name}\n{log.read_text()[-8000:]}" for _, log in launched))
      time.sleep(0.2)
    for process, log in launched:
      assert process.returncode == 0, log.read_text()[-6000:]
  finally:
    for process, _ in launched:
      process.kill()
  return [log.read_text() for _, log in launched]


def _losses(log: str) -> dict[int, str]:
  return {int(step): loss for step, loss in _LOSS_LINE.findall(log)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("multihost")
  config_file = root / "config.py"
  config_file.write_text(CONFIG)
  data_dir = str(root / "tfds")
  data_lib.load_corpus("wikitext_chars", data_dir)    # prepared once, before all read it
  single, multi = root / "single", root / "multi"
  reference = _launch(config_file, single, data_dir, 6)
  port = helpers.free_port()
  first = _wait([_launch(config_file, multi, data_dir, 3, process_id=i, port=port, devices=2)
                 for i in range(2)])
  port = helpers.free_port()
  second = _wait([_launch(config_file, multi, data_dir, 6, process_id=i, port=port, devices=2)
                  for i in range(2)])
  return single, multi, _wait([reference])[0], first, second


def test_processes_agree_with_each_other_and_with_one_process(runs):
  single, multi, reference_log, first, second = runs
  for log in first + second:
    assert "Joined a 2-process run" in log
  for log in second:
    assert "Resuming from step 3" in log
  per_process = [{**_losses(a), **_losses(b)} for a, b in zip(first, second)]
  reference = _losses(reference_log)
  assert sorted(reference) == list(range(1, 7))
  # The metrics are global values: both processes log the same numbers.
  assert per_process[0] == per_process[1]
  np.testing.assert_allclose([float(per_process[0][s]) for s in range(1, 7)],
                             [float(reference[s]) for s in range(1, 7)], rtol=2e-5)
  ours, theirs = (checkpointing.read_model(d)[1] for d in (multi, single))
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _run_files(workdir: pathlib.Path) -> set[str]:
  """A run's files outside its orbax folders (which hold one part per process), with
  TensorBoard files named by what they are."""
  return {"events.out.tfevents" if p.name.startswith("events.out.tfevents") else
          str(p.relative_to(workdir)) for p in workdir.rglob("*")
          if p.is_file() and not p.relative_to(workdir).parts[0] == "checkpoints"
          and "params" not in p.relative_to(workdir).parts}


def test_only_process_zero_writes_files(runs):
  single, multi, _, _, _ = runs
  assert (multi / "results.json").is_file() and (multi / "export" / "params").is_dir()
  # The same files as one process writes, none left half-written (*.tmp) by two
  # processes writing one file, and whole: JSON with the same entries.
  assert _run_files(multi) == _run_files(single)
  assert not list(multi.rglob("*.tmp"))
  for name in ("results.json", "finished_phases.json"):
    ours, theirs = (json.loads((d / name).read_text()) for d in (multi, single))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs), name
  # One TensorBoard file per start (process 0 only); one gate record per step.
  assert len(list(multi.glob("events.out.tfevents.*"))) == 2
  history = (multi / "gate_history.jsonl").read_text().splitlines()
  assert len(history) == 6
  assert sorted(checkpointing.RunCheckpoints(multi, read_only=True).manager.all_steps()) == [3, 6]
