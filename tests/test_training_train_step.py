"""The train step: the update the optimizer makes at the state's step and what the step
reports of it; gradient accumulation (4 micro-batches make the same update as one full
batch); the random draws of a step and of its micro-batches."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from allatt_jax.pruning import budget
from allatt_jax.config import config_base
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import optim
from allatt_jax.config import run_config
from allatt_jax.training import train_step
from allatt_jax.config.errors import ConfigError

VOCAB = 29
BATCH, SEQ_LEN, MEM_LEN = 8, 8, 8


def make_config(accum, gated, dropout=0.0, l0_warmup_steps=0):
  config = config_base.base_config()
  config.model.update(dict(vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4,
                           num_persistent=8, dropout=dropout, dropout_attn=dropout,
                           dropout_emb=dropout))
  config.train.update(dict(batch_size=BATCH, seq_len=SEQ_LEN, mem_len=MEM_LEN,
                           grad_accum_steps=accum, grad_clip=0.0))
  # π = 0.5 makes the sampled gates a mix of open and closed; λ > 0 from step 0.
  config.gates.update(dict(enabled=gated, init=0.5, lam=0.1,
                           l0_warmup_steps=l0_warmup_steps))
  return run_config.RunConfig.of(config)


def fixed_lambda(config, lm):
  """The L0 term of these configs, which set no budget."""
  return budget.Penalty.of(config.gates, lm.cfg.layer_heads, None)


def make_state(config):
  """A state whose memory holds a previous segment, different in every row."""
  lm = model_lib.TransformerLM.from_config(config)
  # Plain SGD with rate 1: the update is minus the gradient, so the test compares
  # gradients without an optimizer that could amplify or hide their differences.
  optimizer = optax.sgd(1.0)
  settings = train_step.StepConfig.from_config(config, optim.schedules(config))
  state = train_step.init_state(lm, optimizer, fixed_lambda(config, lm),
                                settings, jax.random.key(0))
  previous = jax.random.randint(jax.random.key(1), (BATCH, SEQ_LEN), 0, VOCAB)
  _, memory, _ = lm.apply(state.variables, previous, previous, state.memory)
  return lm, optimizer, state.replace(memory=memory)


def batch():
  tokens = jax.random.randint(jax.random.key(2), (BATCH, SEQ_LEN + 1), 0, VOCAB)
  return tokens[:, :-1], tokens[:, 1:]


def jit_step(config, lm, optimizer, sample_gates):
  return jax.jit(functools.partial(
      train_step.train_step, lm=lm, optimizer=optimizer,
      penalty=fixed_lambda(config, lm),
      step_config=train_step.StepConfig.from_config(config, optim.schedules(config)),
      sample_gates=sample_gates))


def run_step(accum, gated, memory=None):
  config = make_config(accum, gated)
  lm, optimizer, state = make_state(config)
  if memory is not None:
    state = state.replace(memory=memory)
  old = state.variables
  new_state, metrics = jit_step(config, lm, optimizer, gated)(state, *batch())
  updates = jax.tree.map(jnp.subtract, new_state.variables, old)
  return updates, new_state.memory, metrics


@functools.lru_cache
def default_run(accum, gated):
  """run_step with the state's own memory, computed once per test module."""
  return run_step(accum, gated)


def assert_trees_close(a, b, **tolerance):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tolerance)


def test_the_update_and_its_reported_rate_and_norm_are_the_states_steps():
  """The optimizer gets the state's step (the one every schedule reads), and the step
  reports that step's learning rate and the global norm of the gradient itself."""
  config = make_config(1, gated=False)
  lm, _, state = make_state(config)
  state = state.replace(step=jnp.int32(5))
  # Plain SGD at rate 0.5 (updates half the gradient), and a rate that is the step it
  # is given (updates the step times the gradient).
  optimizers = {"sgd": optax.sgd(0.5),
                "rate_is_step": optim.scale_by_step_schedule(lambda step: step * 1.0)}
  updates, metrics = {}, {}
  for name, optimizer in optimizers.items():
    started = state.replace(opt_state=optimizer.init(state.variables))
    new_state, metrics[name] = jit_step(config, lm, optimizer, False)(started, *batch())
    updates[name] = jax.tree.map(jnp.subtract, new_state.variables, state.variables)
  # (Each update is read back as new params - old ones: float32's rounding of params
  # near 1 is ~1e-7.)
  assert_trees_close(updates["rate_is_step"], jax.tree.map(lambda u: 10 * u, updates["sgd"]),
                     rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["sgd"]["grad_norm"], 2 * optax.tree.norm(updates["sgd"]),
                             rtol=1e-5)
  schedule = optim.learning_rate_schedule(config.train)
  assert float(schedule(5)) != float(schedule(6))   # in the warm-up
  np.testing.assert_allclose(metrics["sgd"]["learning_rate"], schedule(5), rtol=1e-6)


def test_the_loss_is_the_nll_plus_the_reported_penalty_of_the_states_step():
  """In the λ warm-up, where each step has its own λ: the loss adds the penalty the
  step reports, λ of the state's step times the expected open count."""
  config = make_config(1, gated=True, l0_warmup_steps=20)
  lm, optimizer, state = make_state(config)
  state = state.replace(step=jnp.int32(5))
  _, metrics = jit_step(config, lm, optimizer, sample_gates=True)(state, *batch())
  lam = budget.lambda_schedule(config.gates)
  assert 0 < float(lam(5)) < float(lam(6))
  np.testing.assert_allclose(metrics["lambda"], lam(5), rtol=1e-6)
  np.testing.assert_allclose(metrics["penalty"], lam(5) * metrics["l0"], rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], metrics["nll"] + metrics["penalty"], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("gated", [False, True], ids=["baseline", "gated"])
def test_accumulated_step_equals_full_batch(gated):
  full_updates, full_memory, full_metrics = default_run(1, gated)
  accum_updates, accum_memory, accum_metrics = default_run(4, gated)

  assert_trees_close(accum_updates, full_updates, rtol=1e-4, atol=1e-6)
  assert int(accum_memory["length"]) == int(full_memory["length"]) == MEM_LEN
  np.testing.assert_allclose(accum_memory["hidden"], full_memory["hidden"], rtol=1e-5,
                             atol=1e-5)
  for key in ("loss", "nll", "l0", "grad_norm", "open_expected", "open_actual"):
    np.testing.assert_allclose(accum_metrics[key], full_metrics[key], rtol=1e-5, err_msg=key)
  if gated:
    assert any(np.any(u != 0) for u in jax.tree.leaves(full_updates["gates"]))
    assert 0 < float(full_metrics["open_actual"].sum()) < 8, "want open and closed gates"


@pytest.mark.slow
def test_memory_rows_matter():
  """The comparison above can fail: a row's memory visibly changes its update.

  With each row's memory moved to another row (what a micro-batch reading the wrong
  memory rows would see) the update is far outside the tolerance used above.
  """
  full_updates, _, _ = default_run(1, False)
  _, _, state = make_state(make_config(1, gated=False))
  rolled = {"hidden": jnp.roll(state.memory["hidden"], 1, axis=1),
            "length": state.memory["length"]}
  rolled_updates, _, _ = run_step(4, gated=False, memory=rolled)
  diffs = [np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))
           for a, b in zip(jax.tree.leaves(rolled_updates), jax.tree.leaves(full_updates))]
  assert max(diffs) > 1e-2


def test_batch_not_divisible_by_accumulation_steps():
  with pytest.raises(ConfigError, match="grad_accum_steps"):
    run_step(3, gated=False)


def test_each_step_and_each_micro_batch_draw_their_own_masks():
  """Dropout masks and gate samples follow the train step's count, so no two steps
  share them (and a resumed run draws what the uninterrupted one did), and each
  micro-batch draws its own dropout masks."""
  config = make_config(2, gated=True, dropout=0.3)
  lm, optimizer, state = make_state(config)
  step = jit_step(config, lm, optimizer, sample_gates=True)
  # Rows 2j and 2j + 1 are the same text with the same memory, and fall in different
  # micro-batches (micro-batch i holds rows i, i + 2, ...).
  inputs, targets = (jnp.repeat(x[::2], 2, axis=0) for x in batch())
  state = state.replace(memory={"hidden": jnp.repeat(state.memory["hidden"][:, ::2], 2,
                                                      axis=1),
                                "length": state.memory["length"]})
  copy = lambda s: jax.tree.map(jnp.copy, s)   # the step donates its state
  first, first_metrics = step(copy(state), inputs, targets)
  again, again_metrics = step(copy(state), inputs, targets)
  _, next_metrics = step(copy(state.replace(step=state.step + 1)), inputs, targets)

  np.testing.assert_array_equal(again_metrics["nll"], first_metrics["nll"])
  np.testing.assert_array_equal(again.memory["hidden"], first.memory["hidden"])
  assert float(next_metrics["nll"]) != float(first_metrics["nll"])
  # The memory holds each layer's input: the first layer's is the embedding after its
  # dropout, different for the two copies of a row.
  embedded = np.asarray(first.memory["hidden"][0])
  assert not np.array_equal(embedded[0::2], embedded[1::2])


def test_after_the_freeze_the_loss_is_the_nll_and_the_gates_get_no_gradient():
  """Frozen gates take no L0 term: it would be a constant of the loss, and its
  gradient would still count in the global norm that clips the model's."""
  config = make_config(1, gated=True)
  lm, optimizer, state = make_state(config)
  old = jax.tree.map(np.asarray, state.variables)   # the step donates the state
  new_state, metrics = jit_step(config, lm, optimizer, sample_gates=False)(state, *batch())
  assert float(metrics["l0"]) > 0
  assert float(metrics["loss"]) == float(metrics["nll"]) and "penalty" not in metrics
  for before, after in zip(jax.tree.leaves(old["gates"]),
                           jax.tree.leaves(new_state.variables["gates"])):
    np.testing.assert_array_equal(after, before)   # SGD: no gradient, no update
