"""Behaviours no other test pins, each against a reference that does not share the
code under test: the adaptive softmax when one batch shard's tail overflows, the
attention core at large logits against float64, the float32 softmax of bf16 scores,
the group budget that keeps a head only with its layer's cost, and closed slots kept
from the fused kernels under attention_impl='auto'."""
import functools
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax import adaptive
from allatt_jax import attention
from allatt_jax import attention_impl
from allatt_jax import attention_kernel
from allatt_jax import config_base
from allatt_jax import config_checks
from allatt_jax import head_costs
from allatt_jax import model as model_lib
from allatt_jax import run_config
from allatt_jax import vocab_logsumexp
from allatt_jax.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
D = 16


# --- 1. The adaptive softmax: one shard of three overflows a tail's capacity.

def _weighted_nll_and_grads(module, params, h_BxTxD, targets_BxT):
  def f(params, h_BxTxD):
    nll_BxT = module.apply(params, h_BxTxD, targets_BxT, method=module.nll)
    # Distinct weights per position so that per-position errors cannot cancel.
    return jnp.sum(nll_BxT * jnp.arange(1., 1. + nll_BxT.size).reshape(nll_BxT.shape))
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, h_BxTxD)


def test_one_shard_overflowing_a_tail_takes_the_exact_dense_path(monkeypatch):
  # Three batch shards (one per row, as on three devices): only the middle one holds
  # more of the last tail than its capacity, so "any shard" and "all shards" differ.
  groups = 3
  monkeypatch.setattr(vocab_logsumexp, "batch_shards", lambda batch_size: groups)
  make = functools.partial(adaptive.AdaptiveEmbedding, 50, D, (10, 20, 35), 2,
                           (False, True, True, True))
  fast, dense = make(), make(tail_capacity=0.0)   # dense: every position, every tail
  rng = np.random.default_rng(3)
  shapes = jax.eval_shape(functools.partial(fast.init, method=fast.embed),
                          jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  # Every leaf random, so that zero-initialised biases test something.
  params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32),
                        nn.unbox(shapes))
  h_BxTxD = jnp.asarray(rng.normal(size=(groups, 64, D)), jnp.float32)
  targets_BxT = vocab_logsumexp.zipf_tokens(rng, 50, (groups, 64))
  targets_BxT[1, :40] = 36   # in the last tail, [35, 50)
  bounds = adaptive.cluster_bounds(50, fast.cutoffs)
  fractions = vocab_logsumexp.zipf_fractions(bounds)
  overflowing = []
  for (lo, hi), fraction in list(zip(bounds, fractions))[1:]:
    capacity = vocab_logsumexp.tail_capacity(64, fraction, fast.tail_capacity)
    assert capacity < 64   # every tail gathers
    overflowing.append(list(((targets_BxT >= lo) & (targets_BxT < hi)).sum(1) > capacity))
  assert overflowing == [[False] * 3, [False] * 3, [False, True, False]], overflowing
  value, grads = _weighted_nll_and_grads(fast, params, h_BxTxD, jnp.asarray(targets_BxT))
  expected_value, expected_grads = _weighted_nll_and_grads(dense, params, h_BxTxD,
                                                           jnp.asarray(targets_BxT))
  for got, expected in zip(jax.tree.leaves((value, grads)),
                           jax.tree.leaves((expected_value, expected_grads))):
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


# --- 2. and 3. The attention core's softmax.

def _core_inputs(rng, h, b, t, s, n, dh):
  normal = lambda *shape: rng.standard_normal(shape)
  k = s + t
  return [normal(h, b, t, dh), normal(h, b, t, dh), normal(h, b, t, dh), normal(h, b, k, dh),
          normal(h, b, k, dh), np.pad(normal(h, k, dh), [(0, 0), (1, 0), (0, 0)]),
          normal(h, n, dh), normal(h, n, dh)]


def _reference_attend(qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK):
  """The core by its definition, in float64 without a shift (which holds the
  exponentials, and the squared normaliser of autodiff's backward pass, for scores
  below ~354). Query i (key position S+i) scores key j against distance S+i-j: row
  T+j-i of r_pad, written out rather than through `rel_shift`."""
  t, kk = mask_TxK.shape
  rows_TxK = np.clip(t + np.arange(kk)[None, :] - np.arange(t)[:, None], 0, kk)
  content = jnp.einsum("hbtd,hbkd->hbtk", qu, k)
  position = jnp.einsum("hbtd,htkd->hbtk", qv, r_pad[:, rows_TxK])
  e_ctx = jnp.where(mask_TxK, jnp.exp(content + position), 0.0)
  e_pers = jnp.exp(jnp.einsum("hbtd,hnd->hbtn", qp, pk))
  norm = e_ctx.sum(-1, keepdims=True) + e_pers.sum(-1, keepdims=True)
  return (jnp.einsum("hbtk,hbkd->hbtd", e_ctx / norm, v)
          + jnp.einsum("hbtn,hnd->hbtd", e_pers / norm, pv))


def test_the_core_at_large_logits_matches_a_float64_reference():
  h, b, t, s, n, dh = 3, 2, 6, 5, 7, 8
  rng = np.random.default_rng(0)
  args = _core_inputs(rng, h, b, t, s, n, dh)
  qu, _, qp, k, _, _, pk, _ = args
  # Feature 0 adds (query value) x 20 to every score: context then slots about 240 and
  # 120 (head 0), 120 and 240 (head 1), 200 and 200 (head 2), 5 more from row to row.
  # exp of either overflows float32 (~88.7) without a shift that counts both.
  k[..., 0], pk[..., 0] = 20.0, 20.0
  ctx_offset, slot_offset = np.array([12.0, 6.0, 10.0]), np.array([6.0, 12.0, 10.0])
  qu[..., 0] = ctx_offset[:, None, None] + 0.25 * np.arange(t)
  qp[..., 0] = slot_offset[:, None, None] + 0.25 * np.arange(t)
  mask_TxK = np.asarray(attention.attention_mask(t, s, jnp.int32(3), True))
  dout = rng.standard_normal((h, b, t, dh))

  def loss(core, *args):
    return jnp.sum(core(*args) * dout)

  core = lambda *a: attention_kernel.attend(0.0, 1, False, jnp.float32, *a, mask_TxK, None)
  args32 = [jnp.asarray(x, jnp.float32) for x in args]
  out = jax.jit(core)(*args32)
  grads = jax.jit(jax.grad(functools.partial(loss, core), argnums=range(8)))(*args32)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(x, jnp.float64) for x in args]
    reference = functools.partial(_reference_attend, mask_TxK=mask_TxK)
    expected_out = np.asarray(reference(*args64))
    expected_grads = jax.grad(functools.partial(loss, reference), argnums=range(8))(*args64)
    expected_grads = [np.asarray(g) for g in expected_grads]
  top_score = np.einsum("hbtd,hnd->hbtn", args[2], args[6]).max()
  assert 200 < top_score < 354, top_score
  assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
  np.testing.assert_allclose(out, expected_out, rtol=1e-4, atol=1e-4)
  names = ("qu", "qv", "qp", "k", "v", "r_pad", "pk", "pv")
  for name, got, expected in zip(names, grads, expected_grads):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(),
                               err_msg=name)


def _equations(jaxpr):
  """Every equation, including those inside jit/custom_vjp/scan bodies."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _equations(sub)


def test_bf16_scores_take_their_max_exp_and_sum_in_float32():
  # Up to 254 context keys and 60 slots of near-equal weight: sums of ~300
  # exponentials, which bf16 (8 significant bits) rounds by several times 1e-3.
  h, b, t, s, n, dh = 2, 2, 4, 250, 60, 8
  rng = np.random.default_rng(1)
  qu, qv, qp, k, _, r_pad, pk, _ = [jnp.asarray(0.3 * x, jnp.bfloat16)
                                    for x in _core_inputs(rng, h, b, t, s, n, dh)]
  mask_TxK = attention.attention_mask(t, s, jnp.int32(s), False)
  weights = functools.partial(attention_kernel.attention_weights, score_dtype=jnp.bfloat16)
  p_ctx, p_pers = jax.jit(weights)(qu, qv, qp, k, r_pad, pk, mask_TxK)
  assert p_ctx.dtype == p_pers.dtype == jnp.bfloat16
  total = (np.asarray(p_ctx, np.float32).sum(-1) + np.asarray(p_pers, np.float32).sum(-1))
  np.testing.assert_allclose(total, 1.0, atol=1e-3)
  # And in the program itself: every max, exp and sum of the softmax is float32.
  jaxpr = jax.make_jaxpr(weights)(qu, qv, qp, k, r_pad, pk, mask_TxK).jaxpr
  softmax = [e for e in _equations(jaxpr) if e.primitive.name in ("reduce_max", "exp",
                                                                   "reduce_sum", "max")]
  assert len(softmax) >= 4
  for eqn in softmax:
    assert all(v.aval.dtype == jnp.float32 for v in eqn.outvars), eqn


# --- 4. A group budget that keeps a head must pay for its layer too.

def test_a_group_budget_below_one_head_and_its_layer_is_refused_naming_one_that_keeps_one():
  config = config_base.load(ROOT / "configs" / "demo.py", "tiny")   # 2 x 4 heads, N = 16
  config.model.vocab_size = 27
  config.gates.update(dict(enabled=True, persistent_group=4, freeze_step=20,
                           target_params=1))
  run = run_config.RunConfig.of(config)
  units = head_costs.budget_units(run, model_lib.ModelConfig.from_config(run))
  assert units.layer > 0 and units.head > 0   # a layer's LayerNorm, a head's projections
  one_head = math.ceil(units.empty + units.layer + units.head)
  # Above a head's own cost, below it with its layer's: a model that keeps no head.
  value = math.floor(units.empty + units.head + units.layer / 2)
  assert units.empty + units.head < value < one_head
  config.gates.target_params = value
  with pytest.raises(ConfigError) as error:
    config_checks.check_config(run_config.RunConfig.of(config), 1)
  message = str(error.value)
  assert f"target_params={value} leaves none of the model's 8 heads" in message, message
  assert (f"nearest budget that keeps a head: --config.gates.target_params={one_head} "
          in message), message
  # The budget it names passes.
  config.gates.target_params = one_head
  config_checks.check_config(run_config.RunConfig.of(config), 1)


# --- 5. attention_impl='auto' never hands closed slots to the fused kernels.

def test_auto_keeps_slot_weighted_layers_off_the_fused_kernels(monkeypatch):
  # The kernels count as runnable here (Pallas' interpreter on CPU), so 'auto' picks
  # them for every layer they can serve.
  monkeypatch.setattr(attention_impl, "_why_not_here", lambda: None)
  assert attention_impl.use_kernel("auto")
  gate = run_config.GatesSection(hard=True, persistent_group=2)
  make_cfg = lambda impl: model_lib.ModelConfig(
      kind="allatt", vocab_size=11, num_layers=2, d_model=16, num_heads=2, num_persistent=8,
      max_relative_len=32, dropout=0.0, dropout_attn=0.0, dropout_emb=0.0, gated=True,
      gate=gate, attention_impl=impl)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 11, (2, 7)), jnp.int32)
  inputs, targets = tokens[:, :6], tokens[:, 1:]
  xla_cfg = make_cfg("xla")
  memory = model_lib.init_memory(xla_cfg, 2, 4)
  variables = nn.unbox(jax.jit(model_lib.TransformerLM(xla_cfg).init)(
      jax.random.key(0), inputs, targets, memory))
  # Half of each head's groups closed; large keys on them, so any mass they took shows.
  open_HxG = np.array([[1, 0, 1, 0], [0, 0, 1, 1]], bool)
  gates = {name: {"attention": {**layer["attention"],
                                "persistent_logits": jnp.where(open_HxG, 2.0, -2.0)}}
           for name, layer in variables["gates"].items()}
  closed_HxN = np.repeat(~open_HxG, 2, axis=1)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: (x * np.where(closed_HxN, 5.0, 1.0)[..., None]
                       if jax.tree_util.keystr(path).endswith("['persistent_key']") else x),
      variables["params"])
  variables = {**variables, "params": params, "gates": gates}

  def nll(cfg, variables):
    lm = model_lib.TransformerLM(cfg)
    return np.asarray(jax.jit(lm.apply)(variables, inputs, targets, memory)[0])

  expected = nll(xla_cfg, variables)
  np.testing.assert_allclose(nll(make_cfg("auto"), variables), expected, rtol=1e-5,
                             atol=1e-5)
  # The closed slots matter: open, they change every position's NLL.
  all_open = {**variables, "gates": jax.tree.map(jnp.abs, gates)}
  assert np.all(np.abs(nll(xla_cfg, all_open) - expected) > 1e-3)
