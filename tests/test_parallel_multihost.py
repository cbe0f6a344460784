"""A 2-process run on one machine (gloo collectives) agrees with a 1-process run, and
fails as a whole, at once, when one process fails alone.

Both processes run `python -m allatt_jax.main` with --coordinator_address,
--num_processes and --process_id, as on two hosts: 3 steps, then a restart that
resumes from the step-3 checkpoint and trains to step 6, with final evaluation and
export. Each process has 2 fake CPU devices. The first start's (2, 2) mesh puts the
batch across the processes and the heads across each process's devices; the restart's
(1, 4) mesh puts the heads across both processes, which then read the same batch rows
and gather the variables they export from each other.
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

import data_fixtures
import helpers
from allatt_jax.config import cli
from allatt_jax.runs import checkpointing

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

REPO = pathlib.Path(__file__).resolve().parents[1]
# The demo's tiny gated model as a plain run, on a text8 sample: each start ends with
# the final evaluation of the whole valid and test splits, 10,000 characters each here.
# A constant learning rate (peak = final, no warm-up) makes the schedule independent
# of num_steps, so a run stopped at step 3 and resumed to step 6 takes the same steps
# as one going straight to 6.
CONFIG = f'''
from allatt_jax.config import config_base


def get_config(arg=None):
  c = config_base.load({str(REPO / "configs" / "demo.py")!r}, "tiny")
  with c.unlocked():
    del c["pipeline"]
  c.data.update(dict(name="text8", manual_dir=MANUAL_DIR))
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
# The demo's pipeline, shortened, with a budget: the pruning stage starts from the
# baseline's checkpoint and decides its heads at the freeze; then both models are read
# back for the speed comparison, and the gate figure reads the pruning run's checkpoint.
PIPELINE_CONFIG = f'''
from allatt_jax.config import config_base


def get_config(arg=None):
  c = config_base.load({str(REPO / "configs" / "demo.py")!r}, "tiny")
  c.data.update(dict(name="text8", manual_dir=MANUAL_DIR))
  c.train.update(dict(num_steps=6, warmup_steps=0, log_every_steps=3))
  c.eval.update(dict(batch_size=128, seq_len=64, mem_len=32))
  c.checkpoint.every_steps = 6
  c.pipeline.prune_train.update(dict(num_steps=6, warmup_steps=0))
  c.pipeline.prune_gates.update(dict(l0_warmup_steps=0, freeze_step=3,
                                     target_sparsity=0.5))
  return c
'''
# The LoggingWriter line of a logging step: "[step] ..., loss=..., ...".
_LOSS_LINE = re.compile(r"\] \[(\d+)\] .*\bloss=([-+.\deE]+)")


# A command whose process 1 of 2 fails (a bug) after both have saved a checkpoint and
# run a collective, while process 0 goes on to its next collective.
FAILING_ALONE = '''
import jax
from jax.experimental import multihost_utils
import numpy as np

from allatt_jax.config import cli
from allatt_jax.parallel import distributed
from allatt_jax.runs import checkpointing


def main(argv):
  del argv
  distributed.initialize(distributed.settings_from())
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  rows = jax.make_array_from_callback(
      (4, 2), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
      lambda index: np.arange(8.0).reshape(4, 2)[index])
  multihost_utils.process_allgather(rows, tiled=True)
  with checkpointing.RunCheckpoints(WORKDIR) as checkpoints:
    checkpoints.save(1, {"rows": rows}, {"position": 0})
    if jax.process_index() == 1:
      raise RuntimeError("process 1 fails alone")
    multihost_utils.process_allgather(rows, tiled=True)


cli.run(main)
'''


def _launch(config_file, workdir, data_dir, num_steps, *, process_id=None, port=None,
            devices=1, mesh=(2, 2)):
  """Starts one `allatt_jax.main` process (of 2 with `process_id`, on a (data, model)
  `mesh`); output goes to a log file next to workdir."""
  # --verbosity=1: every process's metric lines (clu's logging writer), which
  # _LOSS_LINE reads.
  args = ["-m", "allatt_jax.main", f"--config={config_file}",
          f"--workdir={workdir}", f"--config.data.data_dir={data_dir}",
          f"--config.train.num_steps={num_steps}", "--verbosity=1"]
  if process_id is not None:
    args += [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
             f"--process_id={process_id}", f"--config.mesh.data={mesh[0]}",
             f"--config.mesh.model={mesh[1]}"]
  return _start(args, pathlib.Path(f"{workdir}.{num_steps}.{process_id}.log"), devices)


def _start(args, log: pathlib.Path, devices: int, **environ):
  """Starts `python ARGS` with `devices` CPU devices and `environ`; output to `log`."""
  # PYTHONFAULTHANDLER: a process that hangs writes its threads' stacks to its log
  # when _wait stops it with SIGABRT.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
         "PYTHONFAULTHANDLER": "1",
         "XLA_FLAGS": helpers.xla_flags(cpu_devices=devices), **environ}
  with open(log, "w") as out:
    process = subprocess.Popen([sys.executable, *args], env=env, stdout=out,
                               stderr=subprocess.STDOUT)
  return process, log


def _wait(launched, timeout=300, *, succeed=True) -> list[str]:
  """Waits for all processes; returns their logs.

  `succeed`: fails as soon as one process fails (the others may wait for it in a
  collective forever), with its log. After `timeout` seconds, fails with what each
  process was doing (`_hang_summary`).
  """
  deadline = time.monotonic() + timeout
  try:
    while any(process.poll() is None for process, _ in launched):
      for process, log in launched:
        assert not succeed or process.poll() in (None, 0), log.read_text()[-6000:]
      if time.monotonic() > deadline:
        for process, _ in launched:
          process.send_signal(signal.SIGABRT)
          process.wait(timeout=30)
        pytest.fail(f"processes still running after {timeout} s:\n" + "\n".join(
            f"--- {log.name} (whole log: {log})\n{_hang_summary(log.read_text())}"
            for _, log in launched))
      time.sleep(0.2)
    for process, log in launched:
      assert not succeed or process.returncode == 0, log.read_text()[-6000:]
  finally:
    for process, _ in launched:
      process.kill()
  return [log.read_text() for _, log in launched]


# Log lines of JAX compiling and orbax writing: the bulk of a --verbosity=1 log, and
# never the reason a process waits.
_CHATTER = re.compile(r" (cache_key|lru_cache|compiler|compilation_cache|dispatch|pxla|"
                      r"mlir|type_handlers|xla_bridge)\.py:\d+\]")


def _hang_summary(log: str, lines: int = 12) -> str:
  """What one process of a hung run was doing, short enough to survive a CI log's
  truncation: its last log lines that are not chatter, then the stacks
  faulthandler wrote at SIGABRT (the main thread's, and any thread in orbax or
  allatt_jax), without the idle threads of thread pools."""
  text, _, dump = log.partition("Fatal Python error: Aborted")
  kept = [line[:300] for line in text.splitlines() if line and not _CHATTER.search(line)]
  threads = [block for block in dump.split("\n\n")
             if block.startswith("Current thread")
             or ("Thread 0x" in block and re.search(r"orbax|allatt_jax", block))]
  return "\n".join(kept[-lines:] + ["stacks at SIGABRT:"] + threads)


def _losses(log: str) -> dict[int, str]:
  return {int(step): loss for step, loss in _LOSS_LINE.findall(log)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("multihost")
  config_file = root / "config.py"
  # Prepared once, before all read it.
  manual_dir, data_dir = data_fixtures.prepared_text8(root, num_chars=200_000)
  config_file.write_text(CONFIG.replace("MANUAL_DIR", repr(manual_dir)))
  single, multi = root / "single", root / "multi"
  reference = _launch(config_file, single, data_dir, 6)
  port = helpers.free_port()
  first = _wait([_launch(config_file, multi, data_dir, 3, process_id=i, port=port, devices=2)
                 for i in range(2)])
  port = helpers.free_port()
  second = _wait([_launch(config_file, multi, data_dir, 6, process_id=i, port=port, devices=2,
                          mesh=(1, 4)) for i in range(2)])
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
  # atol: Adam divides by a gradient's root mean square, so where a rare character's
  # output bias has gradients that cancel over the steps it magnifies their round-off.
  # The one-process run alone, compiled at XLA's default optimization level instead of
  # the tests' level 0, moves one such bias by 3.3e-6 (on an AVX-512 CPU), where six
  # steps at 3e-3 move a parameter up to 1.8e-2, and one step the wrong way by ~6e-3.
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


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


def test_a_process_failing_alone_ends_the_run_at_once(tmp_path):
  """Its error is printed, and neither process waits for the other (JAX's shutdown
  barrier would hold the failed one for 5 minutes, and the other would wait in its
  collective as long)."""
  script = tmp_path / "failing_alone.py"
  script.write_text(FAILING_ALONE.replace("WORKDIR", repr(str(tmp_path / "run"))))
  address = f"127.0.0.1:{helpers.free_port()}"
  start = time.monotonic()
  launched = [_start([str(script)], tmp_path / f"{i}.log", 1, JAX_COORDINATOR_ADDRESS=address,
                     JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)]
  waiting, failed = _wait(launched, timeout=120, succeed=False)
  assert time.monotonic() - start < 90
  assert [process.returncode for process, _ in launched] == [1, 1]
  assert "RuntimeError: process 1 fails alone" in failed and cli.BUG_REPORT in failed
  # Process 0's collective failed as process 1 left; it says so, as a failure.
  assert "process 1 fails alone" not in waiting and cli.BUG_REPORT in waiting


def test_a_pipeline_across_processes_ends_as_in_one(tmp_path):
  """The demo's pipeline (baseline, pruning to a budget from the baseline's
  checkpoint, export, both models read back and timed, report and gate figure) on
  two processes, each reading half of every batch, against one process.

  One CPU device a process: with several, XLA:CPU's cross-process collectives stall
  once a few of its programs are in flight (a whole split's evaluation), which the
  accelerators' collectives do not.
  """
  manual_dir, data_dir = data_fixtures.prepared_text8(tmp_path, num_chars=200_000)
  config_file = tmp_path / "pipeline.py"
  config_file.write_text(PIPELINE_CONFIG.replace("MANUAL_DIR", repr(manual_dir)))
  single, multi = tmp_path / "single", tmp_path / "multi"
  common = ["-m", "allatt_jax.main", f"--config={config_file}",
            f"--config.data.data_dir={data_dir}"]
  reference = _start([*common, f"--workdir={single}"], tmp_path / "single.log", 1)
  processes = [*common, f"--workdir={multi}", "--config.mesh.data=2", "--config.mesh.model=1",
               f"--coordinator_address=127.0.0.1:{helpers.free_port()}", "--num_processes=2"]
  logs = _wait([_start([*processes, f"--process_id={i}"], tmp_path / f"multi.{i}.log", 1)
                for i in range(2)] + [reference], timeout=600)
  assert all("Joined a 2-process run" in log for log in logs[:2])
  ours, theirs = (json.loads((d / "report.json").read_text()) for d in (multi, single))
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  # The budget decided the same heads, and both models score as in one process.
  assert ours["pruned"]["heads_per_layer"] == theirs["pruned"]["heads_per_layer"]
  assert ours["pruned"]["sparsity"] == 0.5
  for model in ("baseline", "pruned"):
    np.testing.assert_allclose([ours[model]["valid"], ours[model]["test"]],
                               [theirs[model]["valid"], theirs[model]["test"]], rtol=1e-5)
  assert (multi / "gates.png").is_file()
  ours, theirs = (checkpointing.read_variables(d / "pruned" / "export")[0]
                  for d in (multi, single))
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
