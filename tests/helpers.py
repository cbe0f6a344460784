"""Helpers shared by several test files: the start of a run, a checkpoint's saved
state, bit-exact comparison of trees."""
import jax
import numpy as np
import orbax.checkpoint as ocp

from allatt_jax import checkpointing
from allatt_jax import resolver
from allatt_jax import run_config
from allatt_jax import run_files
from allatt_jax import validation


def start_run(config, workdir, vocabulary: dict | None = None):
  """(setup, checkpoints) of a run about to train, after the checks a run makes
  before it compiles (config and starting point before its dataset is read; then
  `init_from`, workdir, resume and vocabulary), as `train.train_and_evaluate` makes
  them. `vocabulary`: the fingerprint of the config's dataset where the test does
  not hold that dataset (else it is loaded, as a run loads it)."""
  if vocabulary is None:
    setup, corpus = resolver.prepare_run(config)
    vocabulary = run_files.vocabulary_fingerprint(corpus.name, corpus.vocab)
  else:   # completed as a run completes it (a budget's λ is 0)
    run = run_config.RunConfig.of(config)
    setup = resolver.resolve(run.completed(run.model.vocab_size), starts_run=True)
  return setup, validation.open_checkpoints(setup.run, setup.abstract_state,
                                            run_files.run_path(workdir), vocabulary)


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
