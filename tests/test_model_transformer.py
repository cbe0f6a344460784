"""Model layer: causality, memory, gates, rel_shift, uneven heads, bf16."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.model.attention import xla_core
from allatt_jax.model import gates as gates_lib
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config

VOCAB = 37


def make_cfg(kind="allatt", **overrides):
  base = dict(kind=kind, vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4,
              num_persistent=8 if kind == "allatt" else 0,
              d_ff=64 if kind == "txl" else 0, max_relative_len=64)
  base.update(overrides)
  return model_lib.ModelConfig(**base)


def init(cfg, batch=2, seq_len=8, mem_len=8, seed=0):
  lm = model_lib.TransformerLM(cfg)
  tokens = jnp.zeros((batch, seq_len), jnp.int32)
  variables = nn.unbox(lm.init(jax.random.key(seed), tokens, tokens,
                               model_lib.init_memory(cfg, batch, mem_len)))
  return lm, variables


def tokens(seed, shape):
  return jax.random.randint(jax.random.key(seed), shape, 0, VOCAB)


def test_rel_shift_matches_gather():
  b, h, t, s = 2, 3, 5, 4
  k = s + t
  raw = jax.random.normal(jax.random.key(0), (b, h, t, k))
  shifted = xla_core.rel_shift(jnp.pad(raw, [(0, 0)] * 3 + [(1, 0)]))
  i, j = np.meshgrid(np.arange(t), np.arange(k), indexing="ij")
  valid = j <= s + i
  # Column m of the raw scores is relative distance k-1-m; key j at distance s+i-j.
  expected = np.take_along_axis(np.asarray(raw), np.broadcast_to(
      np.clip(j + t - 1 - i, 0, k - 1), raw.shape), axis=-1)
  np.testing.assert_allclose(np.asarray(shifted)[..., valid], expected[..., valid])


@pytest.mark.parametrize("kind", ["allatt", "txl"])
@pytest.mark.parametrize("rel_pos", ["learned", "sinusoidal"])
def test_causal_with_memory(kind, rel_pos):
  cfg = make_cfg(kind, rel_pos=rel_pos)
  lm, variables = init(cfg)
  memory = model_lib.init_memory(cfg, 2, 8)
  _, memory, _ = lm.apply(variables, tokens(1, (2, 8)), tokens(2, (2, 8)), memory)
  x = tokens(3, (2, 8))
  changed = x.at[:, 5:].set((x[:, 5:] + 1) % VOCAB)
  logp, _ = lm.apply(variables, x, memory, method=lm.log_probs)
  logp_changed, _ = lm.apply(variables, changed, memory, method=lm.log_probs)
  np.testing.assert_allclose(logp[:, :5], logp_changed[:, :5], atol=1e-6)
  assert np.abs(logp[:, 5:] - logp_changed[:, 5:]).max() > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["allatt", "txl"])
@pytest.mark.parametrize("empty_mem_len", [0, 8])
def test_memory_equals_concatenation(kind, empty_mem_len):
  """Segment 2 with segment 1's memory scores like the concatenation's last T positions."""
  t = 8
  # With same_length, segment 2's queries would see fewer keys than in the concatenation.
  cfg = make_cfg(kind, same_length=False)
  lm, variables = init(cfg, seq_len=t, mem_len=t)
  seq = tokens(4, (2, 2 * t + 1))
  inputs, targets = seq[:, :-1], seq[:, 1:]
  memory = model_lib.init_memory(cfg, 2, t)
  _, memory, _ = lm.apply(variables, inputs[:, :t], targets[:, :t], memory)
  nll_seg2, _, _ = lm.apply(variables, inputs[:, t:], targets[:, t:], memory)

  empty = model_lib.init_memory(cfg, 2, empty_mem_len)
  nll_concat, _, _ = lm.apply(variables, inputs, targets, empty)
  np.testing.assert_allclose(nll_seg2, nll_concat[:, t:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["allatt", "txl"])
def test_same_length_window_in_the_model(kind):
  """One layer, memory length S = 3: with same_length a query sees itself and the S
  keys before it ('mem_len+1') or the S - 1 before it ('mem_len'), whatever the
  segment holds; without, every earlier key. A token changed at position 2 moves
  exactly the predictions of the queries that see it."""
  t, s, changed_at = 8, 3, 2
  x = tokens(5, (2, t))
  changed = x.at[:, changed_at].set((x[:, changed_at] + 1) % VOCAB)
  for overrides, last_seeing in ((dict(), changed_at + s),
                                 (dict(same_length_keys="mem_len"), changed_at + s - 1),
                                 (dict(same_length=False), t - 1)):
    cfg = make_cfg(kind, num_layers=1, **overrides)
    lm, variables = init(cfg, seq_len=t, mem_len=s)
    memory = model_lib.init_memory(cfg, 2, s)
    logp, _ = lm.apply(variables, x, memory, method=lm.log_probs)
    logp_changed, _ = lm.apply(variables, changed, memory, method=lm.log_probs)
    moved = np.abs(np.asarray(logp) - np.asarray(logp_changed)).max(axis=(0, 2)) > 1e-6
    assert moved.tolist() == [changed_at <= i <= last_seeing for i in range(t)], overrides


@pytest.mark.slow
def test_memory_is_truncated_and_counts_valid_slots():
  cfg = make_cfg()
  lm, variables = init(cfg, seq_len=4, mem_len=6)
  memory = model_lib.init_memory(cfg, 2, 6)
  _, memory, _ = lm.apply(variables, tokens(0, (2, 4)), tokens(1, (2, 4)), memory)
  assert int(memory["length"]) == 4 and memory["hidden"].shape == (2, 2, 6, 32)
  _, memory, _ = lm.apply(variables, tokens(2, (2, 4)), tokens(3, (2, 4)), memory)
  assert int(memory["length"]) == 6


def test_a_model_without_memory_hands_on_an_empty_memory():
  cfg = make_cfg(num_layers=1)
  lm, variables = init(cfg, seq_len=4, mem_len=0)
  empty = model_lib.init_memory(cfg, 2, 0)
  _, memory, _ = lm.apply(variables, tokens(0, (2, 4)), tokens(1, (2, 4)), empty)
  # So a stream without memory keeps one shape: a train loop's state, a scan's carry.
  assert memory["hidden"].shape == (1, 2, 0, 32) and int(memory["length"]) == 0


def test_no_gradient_flows_back_through_the_memory():
  """Transformer-XL's memory is SG(h): a loss on segment 2 has, through the memory
  that segment 1 left, the gradient it has with that memory as a constant."""
  cfg = make_cfg(num_layers=1, same_length=False)
  lm, variables = init(cfg, seq_len=4, mem_len=4)
  x, y = tokens(0, (2, 8)), tokens(1, (2, 8))
  empty = model_lib.init_memory(cfg, 2, 4)

  @jax.jit
  @jax.grad
  def through(params):
    _, memory, _ = lm.apply({"params": params}, x[:, :4], y[:, :4], empty)
    return lm.apply({"params": params}, x[:, 4:], y[:, 4:], memory)[0].mean()

  @jax.jit
  @jax.grad
  def stopped(params, memory):
    return lm.apply({"params": params}, x[:, 4:], y[:, 4:], memory)[0].mean()

  constant = lm.apply(variables, x[:, :4], y[:, :4], empty)[1]
  through, stopped = through(variables["params"]), stopped(variables["params"], constant)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               through, stopped)


def test_the_learned_table_reads_up_to_its_length_and_names_the_fix_beyond():
  cfg = make_cfg(max_relative_len=12)
  lm, variables = init(cfg, seq_len=4, mem_len=8)
  x = tokens(0, (2, 4))
  lm.apply(variables, x, x, model_lib.init_memory(cfg, 2, 8))     # 12 keys: the table
  with pytest.raises(ValueError, match=r"Segment plus memory length 13 exceeds the learned "
                     r"relative position table \(12\); raise model.max_relative_len"):
    lm.apply(variables, x, x, model_lib.init_memory(cfg, 2, 9))


def test_the_sown_layer_outputs_are_what_each_layer_hands_on():
  """Distillation's hidden-state term reads them: layer i's output is what enters
  layer i + 1 (the memory of a segment as long as it), the last one the final norm's
  input."""
  cfg = make_cfg(num_layers=3, final_norm=False)
  lm, variables = init(cfg)
  (hidden, memory, _), sown = lm.apply(
      variables, tokens(0, (2, 8)), model_lib.init_memory(cfg, 2, 8), method=lm.hidden,
      mutable="intermediates")
  outputs = sown["intermediates"]["layer_outputs"]
  assert len(outputs) == 3
  for i in range(2):
    np.testing.assert_array_equal(outputs[i], memory["hidden"][i + 1])
  np.testing.assert_array_equal(outputs[2], hidden)


@pytest.mark.parametrize("kind", ["allatt", "txl"])
def test_training_drops_out_where_the_recipe_says(kind):
  """Transformer-XL's dropout sites: the embeddings and the relative positions at
  dropout_emb; each residual branch, the feed-forward's hidden layer and the final
  hidden states at dropout (attention weights: dropout_attn, in the core)."""
  cfg = make_cfg(kind, dropout=0.1, dropout_emb=0.2)
  lm, variables = init(cfg)
  applied = []

  def record(call, args, kwargs, context):
    if isinstance(context.module, nn.Dropout) and context.method_name == "__call__":
      if not kwargs.get("deterministic", context.module.deterministic):
        applied.append((context.module.rate, args[0].shape))
    return call(*args, **kwargs)

  with nn.intercept_methods(record):
    lm.apply(variables, tokens(0, (2, 8)), tokens(1, (2, 8)),
             model_lib.init_memory(cfg, 2, 8), deterministic=False,
             rngs={"dropout": jax.random.key(0)})
  per_layer = [(0.1, (2, 8, 32))] + (
      [(0.1, (2, 8, 64)), (0.1, (2, 8, 32))] if kind == "txl" else [])
  expected = [(0.2, (16, 32)), (0.2, (2, 8, 32)), *per_layer * 2, (0.1, (2, 8, 32))]
  assert sorted(applied) == sorted(expected)


def test_hard_gate_open_rate_is_sigmoid_of_logit():
  cfg = run_config.GatesSection(temperature=1 / 3, hard=True)
  logits = jnp.array([-2.0, -0.5, 0.0, 1.0, 2.0])
  keys = jax.random.split(jax.random.key(0), 20000)
  g = jax.vmap(lambda k: gates_lib.sample(logits, k, cfg))(keys)
  assert set(np.unique(np.asarray(g))) <= {0.0, 1.0}
  np.testing.assert_allclose(g.mean(0), jax.nn.sigmoid(logits), atol=0.015)


def test_l0_penalty_is_expected_open_count_in_soft_mode():
  cfg = run_config.GatesSection(temperature=2 / 3, hard=False)
  logits = jnp.array([-2.0, -0.5, 0.0, 1.0, 2.0])
  keys = jax.random.split(jax.random.key(1), 20000)
  g = jax.vmap(lambda k: gates_lib.sample(logits, k, cfg))(keys)
  assert np.any((g > 0) & (g < 1))   # soft gates take values inside (0, 1)
  np.testing.assert_allclose((g > 0).mean(0), gates_lib.open_probability(logits, cfg),
                             atol=0.015)


def test_straight_through_gradient_flows_through_soft_gate():
  cfg = run_config.GatesSection(hard=True)
  key = jax.random.key(3)
  grad_hard = jax.grad(lambda p: gates_lib.sample(p, key, cfg).sum())(jnp.zeros(6))
  soft_cfg = dataclasses.replace(cfg, hard=False)
  grad_soft = jax.grad(lambda p: gates_lib.sample(p, key, soft_cfg).sum())(jnp.zeros(6))
  np.testing.assert_allclose(grad_hard, grad_soft)


def test_deterministic_soft_gates_are_the_clipped_stretched_sigmoid():
  """clip(σ(π)(ζ − γ) + γ, 0, 1): exactly 0 and 1 far from π = 0, where an export
  takes a soft gate as closed or as fully open."""
  cfg = run_config.GatesSection(hard=False)
  logits = jnp.array([-10.0, -3.0, -1.0, 0.0, 1.0, 3.0, 10.0])
  stretched = jax.nn.sigmoid(logits) * (gates_lib.ZETA - gates_lib.GAMMA) + gates_lib.GAMMA
  g = np.asarray(gates_lib.deterministic(logits, cfg))
  np.testing.assert_allclose(g, np.clip(stretched, 0.0, 1.0), rtol=1e-6)
  assert g[0] == 0.0 and g[-1] == 1.0 and 0 < g[3] < 1


@pytest.mark.parametrize("hard", [True, False])
def test_a_sharpened_open_count_keeps_its_midpoint(hard):
  """σ(k·(π − o)) moves each head's open probability towards 0 or 1 as k grows, around
  the logit o where k = 1 gives 1/2 (σ(π) for hard gates, P(g > 0) for soft ones)."""
  cfg = run_config.GatesSection(hard=hard, temperature=2 / 3)
  unsharpened = lambda logits: (jax.nn.sigmoid(logits) if hard
                                else gates_lib.open_probability(logits, cfg))
  midpoint = 0.0 if hard else cfg.temperature * np.log(-gates_lib.GAMMA / gates_lib.ZETA)
  logits = jnp.array([midpoint - 0.5, midpoint, midpoint + 0.5])
  probability = lambda k: np.asarray(gates_lib.forward_open_probability(logits, cfg, k))
  np.testing.assert_allclose(probability(1.0), unsharpened(logits), rtol=1e-6)
  for k in (4.0, 16.0):
    np.testing.assert_allclose(probability(k)[1], 0.5, rtol=1e-6)
    assert probability(k)[0] < probability(1.0)[0] and probability(k)[2] > probability(1.0)[2]


def test_the_output_scale_passes_no_gradient_to_the_gates():
  """Technique 3 of the paper: s_g = H / Σg rescales the layer's output but is a
  constant for the gates' gradient, which flows through g alone."""
  gate = run_config.GatesSection(scale_output=True)
  grad = jax.grad(lambda g_H: gates_lib.output_scale(g_H, gate))(jnp.array([1.0, 0.5, 0, 1]))
  np.testing.assert_array_equal(grad, np.zeros(4))


def _with_gate_logits(variables, value):
  gates = jax.tree.map(lambda x: jnp.full_like(x, value), variables["gates"])
  return {"params": variables["params"], "gates": gates}


@pytest.mark.parametrize("scale_output", [False, True])
@pytest.mark.parametrize("kind", ["allatt", "txl"])
def test_open_gates_reproduce_ungated_model(kind, scale_output):
  gate = run_config.GatesSection(scale_output=scale_output)
  cfg = make_cfg(kind, gated=True, gate=gate)
  lm, variables = init(cfg)
  x, y = tokens(5, (2, 8)), tokens(6, (2, 8))
  memory = model_lib.init_memory(cfg, 2, 8)
  ungated, _, stats = lm.apply({"params": variables["params"]}, x, y, memory)
  assert not any(stats)
  gated, _, stats = lm.apply(_with_gate_logits(variables, 10.0), x, y, memory)
  np.testing.assert_array_equal(gated, ungated)
  assert all(np.all(s["open"] == 1) for s in stats)


@pytest.mark.slow
def test_closed_layer_is_scaled_safely():
  gate = run_config.GatesSection(scale_output=True)
  assert float(gates_lib.output_scale(jnp.zeros(8), gate)) == 8.0
  assert float(gates_lib.output_scale(jnp.array([1.0, 1, 0, 0]), gate)) == 2.0
  assert float(gates_lib.output_scale(jnp.array([0.3, 0.2, 0, 0]), gate)) == 4.0

  cfg = make_cfg(gated=True, gate=gate)
  lm, variables = init(cfg)
  closed = _with_gate_logits(variables, -10.0)
  x, y = tokens(7, (2, 8)), tokens(8, (2, 8))
  memory = model_lib.init_memory(cfg, 2, 8)

  def loss(v):
    return lm.apply(v, x, y, memory, deterministic=False, sample_gates=True,
                    rngs={"gates": jax.random.key(0), "dropout": jax.random.key(1)})[0].mean()

  value, grads = jax.value_and_grad(loss)(closed)
  assert np.isfinite(value)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("out_bias", [True, False])
def test_uneven_heads_and_empty_layer_is_identity(out_bias):
  cfg = make_cfg(num_layers=3, heads_per_layer=(4, 0, 2), out_bias=out_bias)
  lm, variables = init(cfg)
  # A headless layer keeps only W_O's bias (zero at init), if W_O has one.
  expected = {model_lib.HEADLESS_OUT_BIAS} if out_bias else set()
  assert set(variables["params"].get("layer_1", {})) == expected
  assert variables["params"]["layer_2"]["attention"]["query"]["kernel"].shape == (32, 2, 8)
  memory = model_lib.init_memory(cfg, 2, 8)
  x = tokens(9, (2, 8))
  hidden, new_memory, _ = lm.apply(variables, x, memory, method=lm.hidden)
  assert hidden.shape == (2, 8, 32)
  # Layer 1 is the identity: what enters layer 2 is what entered layer 1.
  np.testing.assert_array_equal(new_memory["hidden"][1], new_memory["hidden"][2])
  if out_bias:
    # A trained bias, as an export keeps it: added at every position.
    bias_D = jnp.linspace(-1.0, 1.0, 32)
    variables["params"]["layer_1"] = {model_lib.HEADLESS_OUT_BIAS: bias_D}
    _, new_memory, _ = lm.apply(variables, x, memory, method=lm.hidden)
    np.testing.assert_allclose(new_memory["hidden"][2], new_memory["hidden"][1] + bias_D,
                               rtol=1e-6)


def test_bfloat16_compute_keeps_float32_params():
  cfg = make_cfg(dtype="bfloat16")
  lm, variables = init(cfg)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables))
  memory = model_lib.init_memory(cfg, 2, 8)
  nll, new_memory, _ = lm.apply(variables, tokens(0, (2, 8)), tokens(1, (2, 8)), memory)
  assert nll.dtype == jnp.float32 and new_memory["hidden"].dtype == jnp.bfloat16
  f32_lm = model_lib.TransformerLM(make_cfg())
  f32_nll, _, _ = f32_lm.apply(variables, tokens(0, (2, 8)), tokens(1, (2, 8)),
                               model_lib.init_memory(make_cfg(), 2, 8))
  np.testing.assert_allclose(nll, f32_nll, rtol=0.05, atol=0.05)


@pytest.mark.slow
def test_log_probs_normalised_over_vocabulary():
  cfg = make_cfg(vocab_size=VOCAB, cutoffs=(10, 20), div_val=2)
  lm, variables = init(cfg)
  logp, _ = lm.apply(variables, tokens(0, (2, 8)), model_lib.init_memory(cfg, 2, 8),
                     method=lm.log_probs)
  np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, rtol=1e-5)


@pytest.mark.slow
def test_dropout_active_only_in_training():
  cfg = make_cfg(dropout=0.1, dropout_attn=0.2, dropout_emb=0.1)
  lm, variables = init(cfg)
  x, y, memory = tokens(0, (2, 8)), tokens(1, (2, 8)), model_lib.init_memory(cfg, 2, 8)
  eval_a = lm.apply(variables, x, y, memory)[0]
  eval_b = lm.apply(variables, x, y, memory)[0]
  train = lm.apply(variables, x, y, memory, deterministic=False,
                   rngs={"dropout": jax.random.key(0)})[0]
  np.testing.assert_array_equal(eval_a, eval_b)
  assert np.abs(train - eval_a).max() > 1e-4
