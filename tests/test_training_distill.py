"""Distillation from the init_from model: the KL against the full-vocabulary formula,
the step with α = β = 0 against the plain pruning step, and (slow) a distilling
pruning run: its teacher untouched, its resume bit-exact."""
import dataclasses
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import data_fixtures
import helpers
from helpers import train_run
from allatt_jax.model import adaptive
from allatt_jax.runs import checkpointing
from allatt_jax.config import config_base
from allatt_jax.training import distill
from allatt_jax.training import progress
from allatt_jax.training import assembly
from allatt_jax.config import run_config
from allatt_jax.parallel import sharding
from allatt_jax.training import train_step
from allatt_jax.config.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _two_output_layers(cutoffs, div_val=1, vocab_size=50, d_model=16, n=12):
  """Two independently initialised output layers and hidden states for each."""
  emb = adaptive.AdaptiveEmbedding(vocab_size, d_model, cutoffs=cutoffs, div_val=div_val)
  h = jax.random.normal(jax.random.key(0), (2, n // 2, d_model))
  layers = []
  for seed in (1, 2):
    params = emb.init(jax.random.key(seed), h, method=emb.log_probs)
    # Biases away from their init, so that every part of the softmax matters.
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.key(seed),
                                                                p.shape), params)
    layers.append((emb, params, h * seed))
  return layers


def _clusters(layer):
  emb, params, h = layer
  return emb.apply(params, h, method=emb.clusters)


def _exact_kl(student, teacher, temperature=1.0):
  """KL(p ‖ q) over the whole vocabulary from both models' log-probabilities."""
  (emb_s, params_s, h_s), (emb_t, params_t, h_t) = student, teacher
  log_q = emb_s.apply(params_s, h_s, method=emb_s.log_probs).reshape(-1, emb_s.vocab_size)
  log_p = emb_t.apply(params_t, h_t, method=emb_t.log_probs).reshape(-1, emb_t.vocab_size)
  if temperature != 1.0:
    log_q = jax.nn.log_softmax(log_q / temperature)   # plain softmax: logits up to a shift
    log_p = jax.nn.log_softmax(log_p / temperature)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


# 0: each cluster at once (sized to the device); 4: the blocked scan, slid back.
@pytest.mark.parametrize("block", [0, 4])
@pytest.mark.parametrize("cutoffs,div_val", [((), 1), ((10, 20, 35), 2)])
def test_kl_is_the_full_vocabulary_kl(cutoffs, div_val, block):
  student, teacher = _two_output_layers(cutoffs, div_val)
  kl = distill.kl_divergence(_clusters(student), _clusters(teacher), 1.0, vocab_block=block)
  np.testing.assert_allclose(kl, _exact_kl(student, teacher), rtol=1e-5, atol=1e-6)
  head_only = distill.kl_divergence(_clusters(student), _clusters(teacher), 1.0,
                                    all_clusters=False, vocab_block=block)
  if cutoffs:   # the head's KL alone is a strict lower bound
    assert np.all(head_only < kl) and np.all(head_only > 0)
  else:
    np.testing.assert_array_equal(head_only, kl)


@pytest.mark.parametrize("block", [0, 7])
def test_kl_with_temperature_and_its_gradient(block):
  """Plain softmax: KL of the tempered softmaxes; the student's gradient is the exact
  formula's, through the blocked, rematerialised accumulator."""
  student, teacher = _two_output_layers(())
  emb, params_s, h_s = student

  def blocked(params):
    return distill.kl_divergence(_clusters((emb, params, h_s)), _clusters(teacher),
                                 2.5, vocab_block=block).mean()

  def exact(params):
    return _exact_kl((emb, params, h_s), teacher, 2.5).mean()

  np.testing.assert_allclose(blocked(params_s), exact(params_s), rtol=1e-5)
  for g, want in zip(jax.tree.leaves(jax.grad(blocked)(params_s)),
                     jax.tree.leaves(jax.grad(exact)(params_s))):
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("cutoffs,div_val", [((), 1), ((10, 20, 35), 2)])
def test_kl_at_once_equals_the_blocked_scan_values_and_grads(cutoffs, div_val):
  """Each cluster in one matmul (the device-sized default) gives the blocked scan's KL
  and student gradient to 1e-6 of their scale."""
  student, teacher = _two_output_layers(cutoffs, div_val)
  emb, params_s, h_s = student

  def kl(params, block):
    return distill.kl_divergence(_clusters((emb, params, h_s)), _clusters(teacher), 2.0,
                                 vocab_block=block)

  def weighted(params, block):
    kl_N = kl(params, block)
    return jnp.sum(kl_N * jnp.arange(1.0, 1.0 + kl_N.size))

  for block in (0, 4):
    assert (block == 0) == all(table.shape[0] <= distill.vocab_logsumexp.block_rows(
        block, h_s.size // h_s.shape[-1]) for cluster in _clusters(student)
                               for _, table, _ in cluster)
  at_once = (kl(params_s, 0), jax.grad(weighted)(params_s, 0))
  scanned = (kl(params_s, 4), jax.grad(weighted)(params_s, 4))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max())), at_once, scanned)


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_the_loss_is_the_formula_term_by_term(alpha):
  """(1 − α)·CE + α·τ²·KL(teacher_τ ‖ student_τ) + β·Σ_l MSE, with τ = 2 and β > 0, each
  term against its own definition: the KL from both models' full log-probabilities,
  the MSE from the layer outputs."""
  student, teacher = _two_output_layers(())
  nll = jnp.float32(2.75)
  rng = np.random.default_rng(0)
  student_layers = [jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32) for _ in range(2)]
  teacher_layers = [jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32) for _ in range(2)]
  settings = run_config.DistillSection(weight=alpha, temperature=2.0, hidden_weight=0.3)
  total, terms = distill.loss(settings, nll, _clusters(student), _clusters(teacher),
                              student_layers, teacher_layers)
  kl = float(_exact_kl(student, teacher, 2.0).mean())
  mse = sum(float(np.mean((np.asarray(s) - np.asarray(t)) ** 2))
            for s, t in zip(student_layers, teacher_layers))
  np.testing.assert_allclose(terms["distill_kl"], kl, rtol=1e-5)
  np.testing.assert_allclose(terms["distill_hidden"], mse, rtol=1e-6)
  np.testing.assert_allclose(total, (1 - alpha) * 2.75 + alpha * 4.0 * kl + 0.3 * mse,
                             rtol=1e-5)


def test_identical_models_have_no_kl_and_no_hidden_difference():
  student, _ = _two_output_layers((10, 20, 35), 2)
  kl = distill.kl_divergence(_clusters(student), _clusters(student), 3.0)
  np.testing.assert_allclose(kl, 0.0, atol=1e-6)
  layers = [jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))]
  assert distill.hidden_mse(layers, layers) == 0.0
  assert distill.hidden_mse(layers, [x + 2 for x in layers]) == pytest.approx(8.0)


def _tiny_pruning_config(**distill_keys):
  config = helpers.tiny_run()
  config.model.vocab_size = 27
  config.gates.update(dict(enabled=True, lam=0.1, l0_warmup_steps=0, freeze_step=2))
  config.train.num_steps = 4
  config.distill.update(distill_keys)
  return config


@pytest.mark.parametrize("accum", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_teacher_with_zero_weights_leaves_the_step_exactly_as_without(accum):
  """α = β = 0 with a teacher in the state: parameters, gates, optimizer state, memory
  and metrics after three steps (gates sampled) equal the plain pruning step's, bit
  for bit."""
  plain = assembly.run_setup(_tiny_pruning_config())
  with_teacher = assembly.run_setup(_tiny_pruning_config(weight=0.5))
  zero = dataclasses.replace(with_teacher.step_config, grad_accum_steps=accum,
                             distill=run_config.DistillSection())
  batch = sharding.batch_sharding(plain.mesh)
  step_fns = []
  for setup, settings in ((plain, dataclasses.replace(plain.step_config,
                                                      grad_accum_steps=accum)),
                          (with_teacher, zero)):
    step_fns.append(train_step.jit_train_step(
        setup.lm, setup.optimizer, setup.penalty, settings, setup.state_sharding, batch,
        sharding.replicated(setup.mesh), sample_gates=True))
  states = [plain.new_state(), with_teacher.new_state()]
  assert states[0].teacher is None and states[1].teacher is not None
  tokens = np.random.default_rng(0).integers(0, 27, (3, 4, 17), dtype=np.int32)
  metrics = [[], []]
  for step_tokens in tokens:
    for k in range(2):
      with sharding.activate(plain.mesh):
        states[k], m = step_fns[k](states[k], step_tokens[:, :-1], step_tokens[:, 1:])
      metrics[k].append({key: v for key, v in m.items() if not key.startswith("distill")})
  helpers.assert_bit_identical(jax.device_get(states[0].replace(teacher=None)),
                               jax.device_get(states[1].replace(teacher=None)))
  helpers.assert_bit_identical(jax.device_get(metrics[0]), jax.device_get(metrics[1]))


def test_an_accumulated_distilling_step_reports_the_whole_batchs_terms():
  """With 2 micro-batches (no dropout; one gate sample per step) a distilling step
  reports the loss, KL and hidden terms of the whole batch: each micro-batch's mean,
  averaged."""
  config = _tiny_pruning_config(weight=0.5, hidden_weight=0.1)
  config.model.update(dict(dropout=0.0, dropout_attn=0.0, dropout_emb=0.0))
  setup = assembly.run_setup(config)
  state = setup.new_state()
  # A teacher other than the student, so that both terms are above 0.
  state = state.replace(teacher={**state.teacher, "params": jax.tree.map(
      lambda p: p * 1.5 + 0.01, state.teacher["params"])})
  host_state = jax.device_get(state)
  tokens = np.random.default_rng(2).integers(0, 27, (4, 17), dtype=np.int32)
  metrics = {}
  for accum in (1, 2):
    step = train_step.jit_train_step(
        setup.lm, setup.optimizer, setup.penalty,
        dataclasses.replace(setup.step_config, grad_accum_steps=accum),
        setup.state_sharding, sharding.batch_sharding(setup.mesh),
        sharding.replicated(setup.mesh), sample_gates=True)
    with sharding.activate(setup.mesh):
      _, metrics[accum] = step(jax.device_put(host_state, setup.state_sharding),
                               tokens[:, :-1], tokens[:, 1:])
  assert float(metrics[1]["distill_kl"]) > 0 and float(metrics[1]["distill_hidden"]) > 0
  for key in ("loss", "nll", "distill_kl", "distill_hidden"):
    np.testing.assert_allclose(metrics[2][key], metrics[1][key], rtol=1e-5, err_msg=key)


def test_a_distilling_step_keeps_the_teacher_and_advances_its_own_memory():
  """The teacher's params leave a step bit for bit as they came; its memory is its own
  forward pass's on the batch, not the student's and not the old one."""
  setup = assembly.run_setup(_tiny_pruning_config(weight=0.5, hidden_weight=0.1))
  state = setup.new_state()
  # A teacher other than the student, so that their memories differ.
  teacher = {**state.teacher, "params": jax.tree.map(lambda p: p * 1.5 + 0.01,
                                                     state.teacher["params"])}
  state = jax.device_put(state.replace(teacher=teacher), setup.state_sharding)
  before = jax.device_get(state.teacher)
  tokens = np.random.default_rng(1).integers(0, 27, (4, 17), dtype=np.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  with sharding.activate(setup.mesh):
    state, _ = setup.train_step(sample_gates=True)(state, inputs, targets)
  after = jax.device_get(state.teacher)
  helpers.assert_bit_identical(after["params"], before["params"])
  teacher_lm = train_step.teacher_model(setup.lm)
  _, memory, _ = teacher_lm.apply({"params": before["params"]}, inputs, targets,
                                  before["memory"])
  # (A jitted step and an eager forward pass round apart by ~1e-6.)
  np.testing.assert_allclose(after["memory"]["hidden"], memory["hidden"], atol=2e-5)
  assert int(after["memory"]["length"]) == int(memory["length"]) > 0
  student_memory = jax.device_get(state.memory)["hidden"]
  assert not np.allclose(student_memory, memory["hidden"], atol=1e-3)


def test_the_progress_line_names_the_terms_the_loss_adds_up():
  """ce (what bpc restates), kl, mse and the L0 penalty: (1 − α)·ce + α·τ²·kl + β·mse
  + penalty is the loss the step trained."""
  alpha, beta = 0.5, 0.1
  setup = assembly.run_setup(_tiny_pruning_config(weight=alpha, hidden_weight=beta))
  tokens = np.random.default_rng(1).integers(0, 27, (4, 17), dtype=np.int32)
  with sharding.activate(setup.mesh):
    _, metrics = setup.train_step(sample_gates=True)(setup.new_state(), tokens[:, :-1],
                                                     tokens[:, 1:])
  m = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
  np.testing.assert_allclose(
      m["loss"], (1 - alpha) * m["nll"] + alpha * m["distill_kl"]
      + beta * m["distill_hidden"] + m["penalty"], rtol=1e-5)
  assert m["penalty"] > 0
  line = progress.progress_line(1, 4, None, {**m, "bpc": m["nll"] / np.log(2)}, "bpc", 0)
  assert line == (f"step 1/4  bpc {m['nll'] / np.log(2):.4f}  ce {m['nll']:.4f}  "
                  f"kl {m['distill_kl']:.4f}  mse {m['distill_hidden']:.4f}  "
                  f"penalty {m['penalty']:.4f}")


def test_after_the_freeze_the_loss_has_no_l0_term_and_the_line_no_penalty():
  """Frozen gates (deterministic, no more updates) make the L0 term a constant: the
  frozen step neither trains it nor reports it, and a logging interval across the
  freeze shows the mean of the steps before it."""
  alpha, beta = 0.5, 0.1
  setup = assembly.run_setup(_tiny_pruning_config(weight=alpha, hidden_weight=beta))
  tokens = np.random.default_rng(1).integers(0, 27, (2, 4, 17), dtype=np.int32)
  state, fetched = setup.new_state(), []
  with sharding.activate(setup.mesh):
    for sample_gates, step_tokens in zip((True, False), tokens):
      state, metrics = setup.train_step(sample_gates=sample_gates)(
          state, step_tokens[:, :-1], step_tokens[:, 1:])
      fetched.append(jax.device_get(metrics))
  sampled, frozen = ({k: float(v) for k, v in m.items() if np.ndim(v) == 0}
                     for m in fetched)
  assert sampled["penalty"] > 0 and "penalty" not in frozen
  np.testing.assert_allclose(
      frozen["loss"], (1 - alpha) * frozen["nll"] + alpha * frozen["distill_kl"]
      + beta * frozen["distill_hidden"], rtol=1e-5)
  summary = progress.summarise(fetched, "bpc", gated=True)
  assert summary["penalty"] == pytest.approx(sampled["penalty"])
  assert summary["nll"] == pytest.approx((sampled["nll"] + frozen["nll"]) / 2)
  line = progress.progress_line(2, 4, None, progress.summarise(fetched[1:], "bpc", True),
                                "bpc", 8, 8, frozen=True)
  assert "penalty" not in line and "heads kept 8/8 (frozen)" in line


def test_a_state_without_teacher_is_saved_as_before_distillation(tmp_path):
  """A run that does not distill saves no 'teacher' entry, so checkpoints made before
  distillation existed (step, variables, opt_state, memory) restore unchanged."""
  setup = assembly.run_setup(_tiny_pruning_config())
  checkpoints = checkpointing.RunCheckpoints(tmp_path, async_save=False)
  try:
    checkpoints.save(1, setup.new_state(), {"position": 0})
    assert set(checkpoints.manager.item_metadata(1)["state"]) == {
        "step", "variables", "opt_state", "memory"}
    _, state, _ = checkpoints.restore_newest(setup.abstract_state)
  finally:
    checkpoints.close()
  assert state.teacher is None and int(state.step) == 0


def test_distillation_config_errors():
  with pytest.raises(ConfigError, match=r"distill.weight=1.5 is out of range.*\[0, 1\]"):
    assembly.checked_config(_tiny_pruning_config(weight=1.5))
  with pytest.raises(ConfigError, match="distill.temperature=0.0 is out of range"):
    assembly.checked_config(_tiny_pruning_config(weight=0.5, temperature=0.0))
  with pytest.raises(ConfigError, match="kl_clusters='tails' is unknown"):
    assembly.checked_config(_tiny_pruning_config(kl_clusters="tails"))
  config = _tiny_pruning_config(hidden_weight=1.0)
  config.gates.enabled = False
  with pytest.raises(ConfigError, match="init_from is not set.*--config.distill.weight=0"):
    train_run(config, "/nonexistent/never/made")
  demo = config_base.load(ROOT / "configs" / "demo.py", "tiny")
  demo.distill.weight = 0.5
  with pytest.raises(ConfigError, match="--config.pipeline.prune_distill.weight=0.5"):
    assembly.checked_pipeline(demo)


@pytest.mark.slow
def test_a_distilling_run_keeps_its_teacher_and_resumes_bit_exactly(tmp_path):
  """A pruning run with logit and hidden distillation: the teacher in its final
  checkpoint is the baseline's params bit for bit, and a restart from its mid-run
  checkpoint ends in the same state (teacher memory included) bit for bit."""
  # On a text8 sample: each of the three starts ends by evaluating its whole splits.
  text8 = data_fixtures.text8_data(tmp_path / "text8")
  config = _tiny_pruning_config()
  config.gates.enabled = False
  config.train.num_steps = 6
  config.data.update(text8)
  train_run(config, tmp_path / "baseline")
  config = _tiny_pruning_config(weight=0.5, temperature=2.0, hidden_weight=0.1)
  config.data.update(text8)
  config.train.num_steps = 10
  config.gates.freeze_step = 6
  config.checkpoint.every_steps = 5
  config.init_from = str(tmp_path / "baseline")
  run = tmp_path / "pruned"
  train_run(config, run)
  uninterrupted = helpers.saved_state(run, 10)
  baseline = helpers.saved_state(tmp_path / "baseline", 6)["state"]
  helpers.assert_bit_identical(uninterrupted["state"]["teacher"]["params"],
                               baseline["variables"]["params"])
  assert np.any(uninterrupted["state"]["teacher"]["memory"]["hidden"])
  # Lose the last checkpoint, as if the run had died after step 5, and restart it.
  shutil.rmtree(run / "checkpoints" / "10")
  train_run(config, run)
  helpers.assert_bit_identical(helpers.saved_state(run, 10), uninterrupted)
