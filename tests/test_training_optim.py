"""Optimizer: the official LAMB by hand, weight-decay masks, the gate rate, the schedules."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from allatt_jax.pruning import budget
from allatt_jax.config import config_base
from allatt_jax.training import optim


def tiny_config(**train):
  c = config_base.base_config()
  c.train.update(dict(num_steps=100, warmup_steps=10, learning_rate=1e-2,
                      final_learning_rate=1e-4, grad_clip=0.0, **train))
  c.gates.update(dict(enabled=True, lam=0.02, l0_warmup_steps=20, freeze_step=40))
  return c


def tiny_tree():
  """A tree with a tensor of norm > 10 (clamped), one of norm 0 and ordinary ones."""
  rng = np.random.default_rng(0)
  params = {"big": {"kernel": 5.0 + rng.normal(size=(4, 3))},      # ‖w‖ ≈ 17.5
            "zero": np.zeros((3,)),
            "attention_norm": {"scale": 1.0 + 0.1 * rng.normal(size=(3,)),
                               "bias": 0.1 * rng.normal(size=(3,))},
            "out": {"bias": 0.1 * rng.normal(size=(3,))}}
  grads = [jax.tree.map(lambda x: rng.normal(size=np.shape(x)), params) for _ in range(2)]
  return params, grads


def lamb_by_hand(params, grads_list, lrs, weight_decay, decayed, b1=0.9, b2=0.999,
                 eps=1e-8, max_norm=10.0):
  """The official LAMB, written out per tensor in float64."""
  flat, treedef = jax.tree.flatten(params)
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  w = [np.asarray(x, np.float64) for x in flat]
  m = [np.zeros_like(x) for x in w]
  v = [np.zeros_like(x) for x in w]
  for grads, lr in zip(grads_list, map(float, lrs)):   # a schedule's rate is float32
    for i, g in enumerate(jax.tree.leaves(grads)):
      m[i] = b1 * m[i] + (1 - b1) * g
      v[i] = b2 * v[i] + (1 - b2) * g * g
      step = m[i] / (np.sqrt(v[i]) + eps)
      if decayed(names[i]):
        step = step + weight_decay * w[i]
      w_norm = min(np.linalg.norm(w[i]), max_norm)
      s_norm = np.linalg.norm(step)
      trust = 1.0 if w_norm == 0 or s_norm == 0 else w_norm / (s_norm + eps)
      w[i] = w[i] - lr * trust * step
  return treedef.unflatten(w)


@pytest.mark.parametrize("weight_decay, eps", [(0.0, 1e-8), (0.1, 1e-8), (0.0, 1e-3)])
def test_official_lamb_equals_two_steps_by_hand(weight_decay, eps):
  """`train.lamb_eps` in both places the official LAMB adds it: Adam's step and the
  trust ratio (1e-3 makes either one visible)."""
  config = tiny_config(weight_decay=weight_decay, lamb_eps=eps)
  params, grads = tiny_tree()
  schedule = optim.learning_rate_schedule(config.train)
  tx = optim.lamb(config.train, schedule, weight_decay)
  f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
  state, p = tx.init(f32(params)), f32(params)
  moved = jax.tree.map(jnp.zeros_like, p)
  for step, g in zip((3, 4), grads):
    updates, state = tx.update(f32(g), state, p, step=jnp.int32(step))
    p = optax.apply_updates(p, updates)
    moved = jax.tree.map(jnp.add, moved, updates)
  decayed = lambda name: "norm" not in name and "bias" not in name
  expected = lamb_by_hand(params, grads, [schedule(3), schedule(4)], weight_decay, decayed,
                          eps=eps)
  # The steps themselves, which are 1e-3 of the params they move.
  jax.tree.map(lambda got, want, start: np.testing.assert_allclose(
      got, want - start, rtol=2e-5, atol=1e-9), moved, expected, params)


def test_weight_decay_spares_layer_norms_biases_and_gates():
  config = tiny_config(weight_decay=0.5)
  params, (grads, _) = tiny_tree()
  # Gate logits and gradients of different sizes: LAMB's trust ratio normalises a
  # tensor's step, so decay added to a uniform one would leave its update unchanged.
  variables = {"params": params,
               "gates": {"layer_0": {"attention": {"logits": np.array([2.0, -1, 0.5, 3])}}}}
  grads = {"params": grads,
           "gates": {"layer_0": {"attention": {"logits": np.array([1.0, -0.5, 0.2, 2])}}}}
  updates = {}
  for decay in (0.0, 0.5):
    config.train.weight_decay = decay
    tx = optim.make_optimizer(config.train, optim.schedules(config))
    updates[decay], _ = tx.update(grads, tx.init(variables), variables, step=jnp.int32(5))
  flat = lambda t: {jax.tree_util.keystr(p): x
                    for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
  without, with_decay = flat(updates[0.0]), flat(updates[0.5])
  spared = [k for k in without if "norm" in k or "bias" in k or "gates" in k]
  assert len(spared) == 4
  for key in without:
    if key in spared:
      np.testing.assert_array_equal(with_decay[key], without[key], err_msg=key)
    elif "zero" not in key:   # a zero tensor has nothing to decay
      assert not np.allclose(with_decay[key], without[key]), key


def test_optax_lamb_stays_selectable():
  config = tiny_config(optimizer="optax_lamb")
  params, grads = jax.tree.map(lambda x: np.asarray(x, np.float32), tiny_tree())
  # Gradients near optax.lamb's eps (1e-6), so that another eps changes the step.
  grads = jax.tree.map(lambda g: 1e-5 * g, grads)
  schedule = optim.learning_rate_schedule(config.train)
  ours, reference = optim.lamb(config.train, schedule, 0.0), optax.lamb(schedule)
  ours_state, ref_state = ours.init(params), reference.init(params)
  for step, g in enumerate(grads):
    got, ours_state = ours.update(g, ours_state, params, step=jnp.int32(step))
    want, ref_state = reference.update(g, ref_state, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), got, want)


def test_clipping_bounds_the_gradients_that_lambs_moments_see():
  """The global-norm clip comes before LAMB: a gradient far above `grad_clip` moves
  the moments as that gradient scaled to norm `grad_clip` does. LAMB's own steps are
  normalised, so a clip of its updates would leave both steps as they were."""
  params, (small, large) = jax.tree.map(lambda x: np.asarray(x, np.float32), tiny_tree())
  small = jax.tree.map(lambda g: 0.05 * g, small)
  large = jax.tree.map(lambda g: 1e3 * g, large)
  assert optax.tree.norm(small) < 1.0 < optax.tree.norm(large)
  scaled = jax.tree.map(lambda g: g / optax.tree.norm(large), large)

  def second_update(grad_clip, grads):
    config = tiny_config()
    config.train.grad_clip = grad_clip
    tx = optim.make_optimizer(config.train, optim.schedules(config))
    variables = {"params": params}
    state = tx.init(variables)
    for step, g in enumerate(grads, start=3):
      updates, state = tx.update({"params": g}, state, variables, step=jnp.int32(step))
    return updates

  clipped = second_update(1.0, [small, large])
  unclipped = second_update(0.0, [small, large])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-9),
               clipped, second_update(0.0, [small, scaled]))
  assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(clipped),
                                                    jax.tree.leaves(unclipped)))


def test_the_update_reads_the_callers_step_not_a_counter():
  config = tiny_config()
  params, (grads, _) = tiny_tree()
  tx = optim.lamb(config.train, optim.learning_rate_schedule(config.train), 0.0)
  state = tx.init(params)
  at = {step: tx.update(grads, state, params, step=jnp.int32(step))[0] for step in (2, 50)}
  schedule = optim.learning_rate_schedule(config.train)
  ratio = float(schedule(50) / schedule(2))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, ratio * b, rtol=1e-5),
               at[50], at[2])


def test_gate_learning_rate_is_ten_times_the_models_unless_set():
  config = tiny_config()
  model, gates = (optim.learning_rate_schedule(config.train),
                  optim.gate_learning_rate_schedule(config))
  for step in (5, 10, 39):
    np.testing.assert_allclose(gates(step), 10 * model(step), rtol=1e-6)
  config.gates.learning_rate = 0.3
  np.testing.assert_allclose(optim.gate_learning_rate_schedule(config)(10), 0.3, rtol=1e-6)


def test_schedules_at_the_named_steps():
  """Learning rates, λ and the freeze at 0, warm-up end, freeze - 1, freeze and the end."""
  config = tiny_config()
  warmup, freeze, end = config.train.warmup_steps, config.gates.freeze_step, 100
  lr = optim.learning_rate_schedule(config.train)
  gate_lr = optim.gate_learning_rate_schedule(config)
  lam = budget.lambda_schedule(config.gates)
  assert float(lr(0)) == 0.0 and float(gate_lr(0)) == 0.0
  np.testing.assert_allclose(lr(warmup), 1e-2, rtol=1e-6)          # the peak
  np.testing.assert_allclose(gate_lr(warmup), 1e-1, rtol=1e-6)
  np.testing.assert_allclose(gate_lr(freeze - 1), 10 * lr(freeze - 1), rtol=1e-6)
  assert float(gate_lr(freeze - 1)) > 0 and float(gate_lr(freeze)) == 0.0
  assert float(gate_lr(end)) == 0.0
  # The cosine spans warm-up end to the last step: half-way down midway between them.
  np.testing.assert_allclose(lr((warmup + end) // 2), (1e-2 + 1e-4) / 2, rtol=1e-6)
  np.testing.assert_allclose(lr(end), 1e-4, rtol=1e-6)               # the final rate
  assert float(lam(0)) == 0.0
  np.testing.assert_allclose(lam(10), 0.01, rtol=1e-6)               # half-way up
  np.testing.assert_allclose([lam(20), lam(freeze), lam(end)], 0.02, rtol=1e-6)

  # The optimizer itself: gates move at freeze - 1 and not from the freeze on.
  variables = {"params": {"w": jnp.ones((3,))},
               "gates": {"layer_0": {"attention": {"logits": jnp.full((4,), 2.0)}}}}
  grads = jax.tree.map(jnp.ones_like, variables)
  tx = optim.make_optimizer(config.train, optim.schedules(config))
  state = tx.init(variables)
  moved = lambda step: tx.update(grads, state, variables, step=jnp.int32(step))[0]["gates"]
  assert np.all(np.asarray(jax.tree.leaves(moved(freeze - 1))[0]) != 0)
  assert np.all(np.asarray(jax.tree.leaves(moved(freeze))[0]) == 0)
  assert np.all(np.asarray(jax.tree.leaves(moved(end))[0]) == 0)


def test_unknown_optimizer_is_refused():
  with pytest.raises(ValueError, match="Unknown train.optimizer 'adamw'"):
    optim.lamb(tiny_config(optimizer="adamw").train, optax.constant_schedule(1.0), 0.0)


@pytest.mark.parametrize("optimizer", ["lamb", "optax_lamb"])
def test_a_zero_gradient_at_the_first_step_moves_nothing_and_stays_finite(optimizer):
  """Adam's eps: at the first step a gradient element of exactly 0 has m = v = 0, so
  its step m / (sqrt(v) + eps) is 0, not 0 / 0; a tensor whose gradient is all 0
  (a trust ratio over a zero step) too."""
  config = tiny_config(optimizer=optimizer)
  params = {"w": jnp.array([[1.0, -2.0, 0.5], [0.3, 0.7, -1.1]]), "b": jnp.ones((3,))}
  grads = {"w": jnp.array([[0.5, 0.0, -0.2], [0.0, 1.5, 0.1]]), "b": jnp.zeros((3,))}
  tx = optim.lamb(config.train, optim.learning_rate_schedule(config.train), 0.0)
  updates, _ = tx.update(grads, tx.init(params), params, step=jnp.int32(5))
  for name, u in updates.items():
    assert np.all(np.isfinite(np.asarray(u))), name
  w = np.asarray(updates["w"])
  np.testing.assert_array_equal(w[np.asarray(grads["w"]) == 0], 0.0)
  assert np.all(np.sign(w[np.asarray(grads["w"]) != 0])
                == -np.sign(np.asarray(grads["w"])[np.asarray(grads["w"]) != 0]))
  np.testing.assert_array_equal(np.asarray(updates["b"]), 0.0)
  # Through the whole optimizer (clipping, groups) as a train step runs it.
  variables = {"params": params}
  full = optim.make_optimizer(config.train, optim.schedules(config))
  updates, _ = full.update({"params": grads}, full.init(variables), variables,
                           step=jnp.int32(5))
  assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))
  np.testing.assert_array_equal(np.asarray(updates["params"]["w"])[
      np.asarray(grads["w"]) == 0], 0.0)
