"""Helpers shared by several test files: the demo's tiny model as a single run, the
start of a run, a checkpoint's saved state, bit-exact comparison of trees, a port for
a coordinator, gate logits of a model with gated persistent groups, a command run as
a user runs it and its one error line, what a fresh interpreter prints, an error as
sys.unraisablehook receives it, what a speed comparison measures."""
import dataclasses
import functools
import os
import pathlib
import random
import socket
import subprocess
import sys
import types

import jax
import numpy as np
import orbax.checkpoint as ocp

from allatt_jax import data as data_lib
from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax.training import config_checks
from allatt_jax.training import pipeline
from allatt_jax.training import assembly
from allatt_jax.runs import run_files
from allatt_jax.training import loop
from allatt_jax.runs import workdir_checks
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config
from allatt_jax.parallel import sharding


ROOT = pathlib.Path(__file__).resolve().parents[1]

# The gate logits of a model of 2 layers of 4 heads with 4 gated persistent groups
# each. Heads: layer 0 closes head 1; layer 1 keeps all four. Groups (H, 4): uneven
# open groups per head (4, 1, 0, 2 in layer 0 and 3, 4, 2, 1 in layer 1): head 2 of
# layer 0 keeps no persistent slot.
HEAD_LOGITS = ((3.0, -4.0, 1.0, 2.0), (2.0, 2.0, 2.0, 2.0))
GROUP_LOGITS = (((2.0, 1.0, 3.0, 0.5), (-1.0, 2.0, -2.0, -3.0), (-1.0, -2.0, -0.5, -4.0),
                 (1.0, -1.0, 2.0, -2.0)),
                ((1.0, 1.0, -1.0, 1.0), (1.0, 2.0, 3.0, 4.0), (-1.0, 2.0, 2.0, -3.0),
                 (-1.0, -2.0, 3.0, -4.0)))


def tiny_run():
  """`configs/demo.py:tiny` as a single run: the demo's baseline, without its pipeline."""
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  with config.unlocked():
    del config["pipeline"]
  return config


def command(*args, cwd=ROOT, tmp=None):
  """`python -m ARGS` on the CPU (TFDS_DATA_DIR in `tmp`, if given), as a user runs a
  command."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  if tmp is not None:
    env["TFDS_DATA_DIR"] = str(tmp / "tfds")
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                        cwd=cwd, env=env, timeout=120)


def assert_one_error_line(result, *names):
  """Exit status 2, no traceback, and an `error:` line naming each of `names`."""
  output = result.stdout + result.stderr
  assert result.returncode == 2, output
  assert "Traceback" not in output, output
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1, output
  for name in names:
    assert name in errors[0], errors[0]


def xla_flags(cpu_devices: int | None = None) -> str:
  """XLA_FLAGS for a process the tests start: the tests' own (conftest.py), without any
  CPU device count, or with `cpu_devices` of them."""
  device_count = "--xla_force_host_platform_device_count"
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(device_count)]
  return " ".join(kept + ([f"{device_count}={cpu_devices}"] if cpu_devices else []))


def fresh_python_prints(code: str, *args: str) -> list[str]:
  """The words `python -c code *args` prints, in a fresh interpreter (one whose imports
  no test has made yet); asserts that it succeeds."""
  result = subprocess.run([sys.executable, "-c", code, *map(str, args)],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  return result.stdout.split()


def free_port() -> int:
  """A port for a coordinator, free now and below Linux's ephemeral range (from
  32768), where the kernel would hand it to another process's outgoing connection
  before the coordinator binds it."""
  rng = random.Random()
  while True:
    port = rng.randrange(20000, 32000)
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return port


def train_run(config, workdir, **kwargs) -> dict:
  """`loop.train_and_evaluate` of a config (a ConfigDict or a RunConfig), resolved as
  the main command resolves it."""
  return loop.train_and_evaluate(assembly.prepared_run(assembly.checked_config(config)),
                                 workdir, **kwargs)


def run_pipeline(config, workdir) -> dict:
  """`pipeline.run` of a pipeline config, resolved as the main command resolves it."""
  return pipeline.run(pipeline.prepare(assembly.checked_pipeline(config), workdir), workdir)


def start_run(config, workdir, vocabulary: dict | None = None):
  """(setup, checkpoints) of a run about to train, after the checks a run makes
  before it compiles (config and starting point before its dataset is read; then
  `init_from`, workdir, resume and vocabulary), as `loop.train_and_evaluate` makes
  them. `vocabulary`: the fingerprint of the config's dataset where the test does
  not hold that dataset (else it is loaded, as a run loads it)."""
  run = assembly.checked_config(config)
  if vocabulary is None:
    prepared = assembly.prepared_run(run)
    setup, corpus = prepared.setup, prepared.corpus
    vocabulary = run_files.vocabulary_fingerprint(corpus.name, corpus.vocab)
  else:   # completed as a run completes it (a budget's λ is 0)
    config_checks.check_starting_point(run)
    setup = assembly.run_setup(run.completed(run.model.vocab_size))
  workdir = run_files.run_path(workdir)
  workdir_checks.check_run(setup.run, setup.abstract_state, workdir, vocabulary)
  return setup, checkpointing.RunCheckpoints(workdir, keep=setup.run.checkpoint.keep)


def measured_speeds(baseline: float, pruned: float, rounds: int = 3,
                    busy: bool = False) -> dict:
  """What `speed.tokens_per_s` measures of a baseline and a pruned model whose
  tokens/s are `baseline` and `pruned` in every round, at 1e6 / tokens/s CPU µs per
  token, on an idle machine or a `busy` one (0.9 of its 2 cores used by others)."""
  speeds = {"rounds": rounds, "machine": {"cores": 2, "own_cores": 1.1 if busy else 1.9,
                                          "other_cores": 0.9 if busy else 0.0,
                                          "busy": busy}}
  for name, tokens_per_s in (("baseline", baseline), ("pruned", pruned)):
    speeds.update({f"{name}_tokens_per_s": tokens_per_s,
                   f"{name}_tokens_per_s_rounds": [tokens_per_s] * rounds,
                   f"{name}_cpu_us_per_token": 1e6 / tokens_per_s,
                   f"{name}_cpu_us_per_token_rounds": [1e6 / tokens_per_s] * rounds})
  return speeds


def unraisable(error: BaseException, source=None):
  """`error` as sys.unraisablehook receives it, raised in `source` (a coroutine, say)."""
  return types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None,
                               err_msg=None, object=source)


class RecordingWriter:
  """A clu metric writer that keeps what a run writes: `scalars[step]`, its summaries;
  `unflushed`, the steps written since the last flush."""

  def __init__(self):
    self.scalars = {}
    self.unflushed = []

  def write_scalars(self, step, scalars):
    self.scalars.setdefault(step, {}).update(scalars)
    self.unflushed.append(step)

  def flush(self):
    self.unflushed = []


def saved_state(workdir, step):
  """Everything a checkpoint holds, as host arrays: state (step, params, gates,
  optimizer state, memory) and the data position."""
  checkpoints = checkpointing.RunCheckpoints(workdir, async_save=False, read_only=True)
  try:
    restored = checkpoints.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
  finally:
    checkpoints.close()
  return {"state": jax.tree.map(np.asarray, restored.state), "data": dict(restored.data)}


def assert_bit_identical(a, b):
  flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
  flat_b = jax.tree_util.tree_flatten_with_path(b)[0]
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    x, y = np.asarray(x), np.asarray(y)
    assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), (
        jax.tree_util.keystr(path))


def stream_log_probs(config, attention_impl: str, tokens_BxT) -> tuple:
  """The log-probabilities a model of `config` with `attention_impl` gives a stream's
  two halves: at its start (no memory yet), then with the memory of the first."""
  lm = model_lib.TransformerLM.from_config(config, attention_impl=attention_impl)
  half = tokens_BxT.shape[1] // 2
  memory = model_lib.init_memory(lm.cfg, tokens_BxT.shape[0], 5)
  variables = jax.jit(lm.init)(jax.random.key(0), tokens_BxT[:, :half], tokens_BxT[:, :half],
                               memory)
  log_probs = jax.jit(functools.partial(lm.apply, method=lm.log_probs))
  first, memory = log_probs(variables, tokens_BxT[:, :half], memory)
  second, _ = log_probs(variables, tokens_BxT[:, half:], memory)
  return first, second


def kernel_test_model(**model):
  """A 2-layer All-att run config (d 16, 4 heads of size 4), with dropout everywhere and
  gradient accumulation, its model keys updated by `model` (heads per layer,
  persistent slots): what the attention cores' tests train and score."""
  config = config_base.base_config()
  config.model.update(dict(vocab_size=11, num_layers=2, d_model=16, num_heads=4,
                           dropout=0.1, dropout_attn=0.3, dropout_emb=0.1))
  config.model.update(model)
  config.train.update(dict(batch_size=4, seq_len=6, mem_len=5, grad_accum_steps=2))
  return run_config.RunConfig.of(config)


def accumulated_step(config):
  """One train step of a model of `config` (`kernel_test_model`: 2 accumulated
  micro-batches, dropout) from a state with memory: a function giving (the update of
  every variable, the step's metrics), the same state and key at every call."""
  import optax   # pylint: disable=import-outside-toplevel
  from allatt_jax.pruning import budget   # pylint: disable=import-outside-toplevel
  from allatt_jax.training import optim   # pylint: disable=import-outside-toplevel
  from allatt_jax.training import train_step   # pylint: disable=import-outside-toplevel
  tokens = np.random.default_rng(2).integers(0, 11, (4, 13))
  lm = model_lib.TransformerLM.from_config(config)
  penalty = budget.Penalty.of(config.gates, lm.cfg.layer_heads, None)
  settings = train_step.StepConfig.from_config(config, optim.schedules(config))
  state = jax.jit(functools.partial(train_step.init_state, lm, optax.sgd(1.0), penalty,
                                    settings))(jax.random.key(0))
  _, memory, _ = jax.jit(lm.apply)(state.variables, tokens[:, :6], tokens[:, 1:7],
                                   state.memory)
  step = jax.jit(functools.partial(train_step.train_step, lm=lm, optimizer=optax.sgd(1.0),
                                   penalty=penalty, step_config=settings, sample_gates=False))

  def run():
    new_state, metrics = step(state.replace(memory=memory), tokens[:, 6:12], tokens[:, 7:13])
    return jax.tree.map(lambda new, old: new - old, new_state.variables,
                        state.variables), metrics

  return run


def export_scoring(cfg: model_lib.ModelConfig, seq_len: int, **gates):
  """(run config, corpus, mesh) to export and score the gated model `cfg` with: its
  model section, hard `gates`, eval rows of `seq_len`, random text of three rows a
  split, one device."""
  config = config_base.base_config()
  config.model.update({f.name: getattr(cfg, f.name) for f in dataclasses.fields(
      run_config.ModelSection) if f.name in config.model})
  config.gates.update(enabled=True, hard=True, **gates)
  config.eval.update(batch_size=1, seq_len=seq_len, mem_len=seq_len)
  rng = np.random.default_rng(0)
  splits = {split: rng.integers(0, cfg.vocab_size, 3 * seq_len, dtype=np.int32)
            for split in ("train", "valid", "test")}
  corpus = data_lib.Corpus("text_files", "char",
                           tuple(chr(48 + i) for i in range(cfg.vocab_size)), splits)
  mesh = jax.make_mesh((1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return run_config.RunConfig.of(config), corpus, mesh
