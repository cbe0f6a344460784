"""Tests for the tied adaptive input / adaptive softmax."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.model import adaptive
from allatt_jax.config import errors
from allatt_jax.model import vocab_logsumexp
from allatt_jax.parallel import sharding

D = 16
# Name -> (vocab_size, cutoffs, div_val, tie_projs).
SETTINGS = {
    'plain': (37, (), 1, None),
    'adaptive': (50, (10, 20, 35), 2, (False, True, True, True)),
    'adaptive_all_tied': (50, (10, 20, 35), 2, None),
    'adaptive_div1': (50, (10, 20, 35), 1, None),
}
WT103 = (267735, 512, (20000, 40000, 200000), 4, (False, True, True, True))


def make(name, **kwargs):
  vocab_size, cutoffs, div_val, tie_projs = SETTINGS[name]
  return adaptive.AdaptiveEmbedding(vocab_size, D, cutoffs, div_val, tie_projs,
                                    **kwargs)


@functools.cache
def _jitted(module, method):
  return jax.jit(functools.partial(module.apply, method=method))


def run(module, method, params, *args):
  """module.apply under jit: eager op-by-op dispatch would dominate the test time."""
  return _jitted(module, method.__name__)(params, *args)


def param_shapes(module):
  return jax.eval_shape(functools.partial(module.init, method=module.embed),
                        jax.random.key(0), jnp.zeros((1, 1), jnp.int32))


def random_params(module, seed=0):
  """Params with every leaf random, so that zero-initialised biases test something."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32),
      nn.unbox(param_shapes(module)))


def inputs(vocab_size, seed=2, b=3, t=7):
  """Random hidden states and targets that include every token of a small vocab."""
  rng = np.random.default_rng(seed)
  h_BxTxD = jnp.asarray(rng.normal(size=(b, t, D)), jnp.float32)
  targets_N = rng.integers(0, vocab_size, b * t)
  n = min(vocab_size, b * t)
  targets_N[:n] = np.arange(n)
  return h_BxTxD, jnp.asarray(targets_N.reshape(b, t), jnp.int32)


def naive_log_probs(params, h_BxTxD, vocab_size, cutoffs, div_val):
  """All logits materialised, in float64, straight from the definition."""
  p = {k: np.asarray(v, np.float64) for k, v in params['params'].items()}
  h = np.asarray(h_BxTxD, np.float64)
  bounds = [0, *cutoffs, vocab_size]

  def hidden(i):
    if div_val == 1:
      return h
    return h @ p.get(f'out_proj_{i}', p[f'proj_{i}']).T

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  head = hidden(0) @ p['emb_0'].T + p['bias_0']
  if len(cutoffs):
    head = np.concatenate(
        [head, hidden(0) @ p['cluster_kernel'].T + p['cluster_bias']], -1)
  head_logp = log_softmax(head)
  out = [head_logp[..., :bounds[1]]]
  for i in range(1, len(bounds) - 1):
    tail = hidden(i) @ p[f'emb_{i}'].T + p[f'bias_{i}']
    out.append(log_softmax(tail) + head_logp[..., bounds[1] + i - 1, None])
  return np.concatenate(out, -1)


@pytest.mark.parametrize('name', list(SETTINGS))
def test_probabilities_sum_to_one(name):
  module = make(name)
  params = random_params(module)
  h_BxTxD, _ = inputs(module.vocab_size)
  logp_BxTxV = run(module, module.log_probs, params, h_BxTxD)
  assert logp_BxTxV.shape == (*h_BxTxD.shape[:-1], module.vocab_size)
  assert logp_BxTxV.dtype == jnp.float32
  np.testing.assert_allclose(jnp.exp(logp_BxTxV).sum(-1), 1., atol=1e-5)


@pytest.mark.parametrize('name', list(SETTINGS))
def test_log_probs_and_nll_match_naive_reference(name):
  module = make(name)
  params = random_params(module)
  h_BxTxD, targets_BxT = inputs(module.vocab_size)
  reference_BxTxV = naive_log_probs(params, h_BxTxD, module.vocab_size,
                                    module.cutoffs, module.div_val)
  logp_BxTxV = run(module, module.log_probs, params, h_BxTxD)
  np.testing.assert_allclose(logp_BxTxV, reference_BxTxV, rtol=1e-5, atol=1e-4)
  nll_BxT = run(module, module.nll, params, h_BxTxD, targets_BxT)
  assert nll_BxT.shape == targets_BxT.shape and nll_BxT.dtype == jnp.float32
  gathered_BxT = np.take_along_axis(logp_BxTxV, targets_BxT[..., None], -1)[..., 0]
  np.testing.assert_allclose(nll_BxT, -gathered_BxT, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(
      nll_BxT,
      -np.take_along_axis(reference_BxTxV, targets_BxT[..., None], -1)[..., 0],
      rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['plain', 'adaptive'])
def test_blocked_nll_matches_unblocked_values_and_grads(name):
  # Block 4 splits every cluster (37, 10, 10, 15, 15 tokens) with a remainder.
  blocked, unblocked = make(name, vocab_block=4), make(name, vocab_block=1000)
  params = random_params(blocked)
  h_BxTxD, targets_BxT = inputs(blocked.vocab_size)

  def loss(module):
    def f(params, h_BxTxD):
      nll_BxT = run(module, module.nll, params, h_BxTxD, targets_BxT)
      # Distinct weights per position so that per-position errors cannot cancel.
      return jnp.sum(nll_BxT * jnp.arange(1., 1. + nll_BxT.size).reshape(
          nll_BxT.shape))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

  value, grads = loss(blocked)(params, h_BxTxD)
  ref_value, ref_grads = loss(unblocked)(params, h_BxTxD)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
               grads, ref_grads)


def _avals(jaxpr):
  """Shapes of every intermediate value, including inside scan/remat/jit bodies."""
  for eqn in jaxpr.eqns:
    yield from (v.aval.shape for v in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, 'jaxpr', sub)
        if hasattr(sub, 'eqns'):
          yield from _avals(sub)


def test_blocked_nll_never_materialises_full_logits():
  vocab_size, n = 1000, 12
  module = adaptive.AdaptiveEmbedding(vocab_size, 4, vocab_block=64)
  params = random_params(module)
  h_NxD = jnp.ones((1, n, 4))
  targets_N = jnp.zeros((1, n), jnp.int32)

  def loss(params):
    return module.apply(params, h_NxD, targets_N, method=module.nll).sum()

  shapes = list(_avals(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))
  assert any(64 in s and n in s for s in shapes)  # The walk sees the blocks.
  assert not any(math.prod(s) >= n * vocab_size for s in shapes)


@pytest.mark.parametrize('setting', [
    (37, 16, (), 1, None),
    (50, 16, (10, 20, 35), 2, (False, True, True, True)),
    (50, 16, (10, 20, 35), 2, None),
    (50, 16, (10, 20, 35), 1, None),
    (50, 16, (10,), 4, (False, False)),
    WT103,
])
def test_param_count_matches_param_tree(setting):
  vocab_size, d_model, cutoffs, div_val, tie_projs = setting
  module = adaptive.AdaptiveEmbedding(vocab_size, d_model, cutoffs, div_val,
                                      tie_projs)
  n_params = sum(x.size for x in jax.tree.leaves(param_shapes(module)))
  assert adaptive.embedding_param_count(*setting) == n_params


def test_wt103_param_count():
  # 18,461,880 table entries + 267,735 biases + 512 * (512 + 128 + 32 + 8) input
  # projections + 512 * 512 untied head output projection + 3 * (512 + 1) head.
  assert adaptive.embedding_param_count(*WT103) == 19_341_458


@pytest.mark.parametrize('name, dtype', [
    *((name, jnp.float32) for name in SETTINGS), ('adaptive', jnp.bfloat16)])
def test_embed_shape_dtype_and_values(name, dtype):
  module = make(name, dtype=dtype)
  params = random_params(module)
  tokens_BxT = jnp.arange(module.vocab_size).reshape(1, -1)
  x_BxTxD = run(module, module.embed, params, tokens_BxT)
  assert x_BxTxD.shape == (1, module.vocab_size, D) and x_BxTxD.dtype == dtype
  p = params['params']
  bounds = [0, *module.cutoffs, module.vocab_size]
  expected = []
  for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
    rows = p[f'emb_{i}']
    assert rows.shape[0] == hi - lo
    expected.append(rows @ p[f'proj_{i}'] if module.div_val > 1 else rows)
  expected_VxD = np.concatenate(expected) * math.sqrt(D)
  tol = 1e-5 if dtype == jnp.float32 else 5e-2
  np.testing.assert_allclose(x_BxTxD[0].astype(jnp.float32), expected_VxD,
                             rtol=tol, atol=tol * math.sqrt(D))


def test_weights_are_tied():
  module = make('adaptive')  # Head output projection untied, the others tied.
  params = random_params(module)
  assert set(params['params']) == {
      'emb_0', 'emb_1', 'emb_2', 'emb_3', 'bias_0', 'bias_1', 'bias_2', 'bias_3',
      'proj_0', 'proj_1', 'proj_2', 'proj_3', 'out_proj_0', 'cluster_kernel',
      'cluster_bias'}
  tokens_BxT = jnp.arange(module.vocab_size).reshape(1, -1)
  h_BxTxD, _ = inputs(module.vocab_size)

  def outputs(params):
    return (run(module, module.embed, params, tokens_BxT)[0],
            run(module, module.log_probs, params, h_BxTxD))

  def perturbed(name, row=None):
    value = params['params'][name]
    delta = jnp.asarray(np.random.default_rng(3).normal(size=value.shape),
                        jnp.float32)
    if row is not None:
      delta = jnp.zeros_like(value).at[row].set(delta[row])
    return {'params': {**params['params'], name: value + delta}}

  x_VxD, logp_BxTxV = outputs(params)
  # Row 3 of emb_1 is token 13: it moves that token's input and output embedding.
  x2_VxD, logp2_BxTxV = outputs(perturbed('emb_1', row=3))
  changed_V = np.any(x2_VxD != x_VxD, axis=-1)
  np.testing.assert_array_equal(changed_V, np.arange(module.vocab_size) == 13)
  assert np.all(logp2_BxTxV[..., 13] != logp_BxTxV[..., 13])
  np.testing.assert_array_equal(logp2_BxTxV[..., :10], logp_BxTxV[..., :10])
  # proj_1 is tied: input and output move. proj_0 is not: only the input moves.
  x2_VxD, logp2_BxTxV = outputs(perturbed('proj_1'))
  assert np.all(x2_VxD[10:20] != x_VxD[10:20])
  assert np.all(logp2_BxTxV[..., 10:20] != logp_BxTxV[..., 10:20])
  x2_VxD, logp2_BxTxV = outputs(perturbed('proj_0'))
  assert np.all(x2_VxD[:10] != x_VxD[:10])
  np.testing.assert_array_equal(logp2_BxTxV, logp_BxTxV)


@pytest.mark.slow
def test_init_scale():
  vocab_size, d_model = 2000, 64
  module = adaptive.AdaptiveEmbedding(vocab_size, d_model, (200, 600), 2)
  tokens_BxT = jnp.arange(vocab_size).reshape(4, -1)
  # An rbg key only because its init compiles in half the time of threefry's.
  params = jax.jit(functools.partial(module.init, method=module.embed))(
      jax.random.key(0, impl='rbg'), tokens_BxT)
  x_BxTxD = run(module, module.embed, params, tokens_BxT)
  assert 0.85 < float(jnp.std(x_BxTxD)) < 1.15
  h_BxTxD = jnp.asarray(
      np.random.default_rng(1).normal(size=(*tokens_BxT.shape, d_model)),
      jnp.float32)
  nll_BxT = run(module, module.nll, params, h_BxTxD, tokens_BxT)
  # Unit-variance logits over all tokens and clusters sized by their token count:
  # every cluster's tokens start near the uniform log(V) (+ ~0.5 for the spread).
  for lo, hi in [(0, 200), (200, 600), (600, vocab_size)]:
    mean_nll = float(nll_BxT.reshape(-1)[lo:hi].mean())
    assert math.log(vocab_size) < mean_nll < math.log(vocab_size) + 1.5


@pytest.mark.parametrize('name', ['plain', 'adaptive'])
def test_initial_distribution_of_a_zero_hidden_state_is_uniform(name):
  # Token biases start at 0 and each cluster's head logit at log(its size), so with
  # h = 0 every token has probability 1/V exactly, in its own cluster too (with the
  # cluster bias at 0, as in Transformer-XL, a tail token starts far behind).
  module = make(name)
  h_BxTxD, targets_BxT = inputs(module.vocab_size)
  params = jax.jit(functools.partial(module.init, method=module.nll))(
      jax.random.key(0), h_BxTxD, targets_BxT)
  zeros_BxTxD = jnp.zeros_like(h_BxTxD)
  uniform = math.log(module.vocab_size)
  np.testing.assert_allclose(run(module, module.log_probs, params, zeros_BxTxD),
                             -uniform, rtol=1e-6)
  np.testing.assert_allclose(run(module, module.nll, params, zeros_BxTxD, targets_BxT),
                             uniform, rtol=1e-6)


@pytest.mark.slow
def test_bfloat16_nll_is_float32_and_close():
  module = make('adaptive')
  params = random_params(module)
  h_BxTxD, targets_BxT = inputs(module.vocab_size)
  nll_f32_BxT = run(module, module.nll, params, h_BxTxD, targets_BxT)
  bf16 = make('adaptive', dtype=jnp.bfloat16)

  def loss(params):
    nll_BxT = bf16.apply(params, h_BxTxD, targets_BxT, method=bf16.nll)
    return nll_BxT.mean(), nll_BxT

  (_, nll_BxT), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  assert nll_BxT.dtype == jnp.float32
  np.testing.assert_allclose(nll_BxT, nll_f32_BxT, rtol=5e-2, atol=0.3)
  assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all())
             for g in jax.tree.leaves(grads))


@pytest.mark.parametrize('kwargs', [
    dict(cutoffs=(20, 10)),
    dict(cutoffs=(0, 10)),
    dict(cutoffs=(10, 50)),
    dict(cutoffs=(10, 20), tie_projs=(True, False)),
    dict(cutoffs=(10, 20, 35), div_val=4),  # 16 // 4**3 == 0
])
def test_bad_config_raises_config_error(kwargs):
  module = adaptive.AdaptiveEmbedding(50, D, **kwargs)
  with pytest.raises(errors.ConfigError):
    module.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                method=module.embed)
  with pytest.raises(errors.ConfigError):
    adaptive.embedding_param_count(50, D, **kwargs)


@pytest.mark.parametrize('kwargs', [
    dict(vocab_block=-1), dict(tail_capacity=-1.0),
    dict(cutoffs=(10, 20), cluster_fractions=(0.5, 0.5)),
])
def test_bad_output_layer_settings_raise_config_error(kwargs):
  module = adaptive.AdaptiveEmbedding(50, D, **kwargs)
  with pytest.raises(errors.ConfigError):
    module.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                method=module.embed)


# --- The output layer at matmul speed: one matmul per cluster where the device's memory
# allows, and a tail cluster's log-sum-exp only for the positions whose target is in it.

# Today's path before these: a scan of small rematerialised blocks, and every position
# through every tail cluster.
SCANNED_DENSE = dict(vocab_block=4, tail_capacity=0.0)


def zipf_inputs(vocab_size, b, t, seed=3):
  """Hidden states and targets of Zipfian frequencies (rank r ∝ 1/r), as real text."""
  rng = np.random.default_rng(seed)
  p_V = 1.0 / np.arange(1, vocab_size + 1)
  targets_BxT = rng.choice(vocab_size, size=(b, t), p=p_V / p_V.sum())
  h_BxTxD = rng.normal(size=(b, t, D))
  return jnp.asarray(h_BxTxD, jnp.float32), jnp.asarray(targets_BxT, jnp.int32)


def tails_gathered(module, targets_BxT, groups):
  """Whether every tail cluster takes the gathered path for these targets: its
  capacity is below a group's size and no group overflows it."""
  bounds = adaptive.cluster_bounds(module.vocab_size, module.cutoffs)
  fractions = vocab_logsumexp.zipf_fractions(bounds)
  targets_GxM = np.asarray(targets_BxT).reshape(groups, -1)
  size = targets_GxM.shape[1]
  for (lo, hi), fraction in list(zip(bounds, fractions))[1:]:
    capacity = vocab_logsumexp.tail_capacity(size, fraction, module.tail_capacity)
    counts_G = ((targets_GxM >= lo) & (targets_GxM < hi)).sum(1)
    if capacity >= size or counts_G.max() > capacity:
      return False
  return True


def weighted_nll_and_grads(module, params, h_BxTxD, targets_BxT):
  def f(params, h_BxTxD):
    nll_BxT = module.apply(params, h_BxTxD, targets_BxT, method=module.nll)
    # Distinct weights per position so that per-position errors cannot cancel.
    return jnp.sum(nll_BxT * jnp.arange(1., 1. + nll_BxT.size).reshape(nll_BxT.shape))
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, h_BxTxD)


def assert_equal_to_1e6(tree, reference):
  """Each array equal to 1e-6 of its reference's largest magnitude."""
  def check(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))
  jax.tree.map(check, tree, reference)


@pytest.mark.parametrize('name', list(SETTINGS))
@pytest.mark.parametrize('groups', [1, 3])
def test_output_layer_matches_scanned_dense_path(name, groups, monkeypatch):
  # groups=3: each of the batch's three rows is its own group, as on three devices.
  monkeypatch.setattr(vocab_logsumexp, 'batch_shards', lambda batch_size: groups)
  fast, scanned = make(name), make(name, **SCANNED_DENSE)
  params = random_params(fast)
  h_BxTxD, targets_BxT = zipf_inputs(fast.vocab_size, 3, 64)
  if fast.cutoffs:
    assert tails_gathered(fast, targets_BxT, groups)
  assert_equal_to_1e6(weighted_nll_and_grads(fast, params, h_BxTxD, targets_BxT),
                      weighted_nll_and_grads(scanned, params, h_BxTxD, targets_BxT))


def test_overflowing_batch_takes_the_exact_dense_path():
  fast, scanned = make('adaptive'), make('adaptive', **SCANNED_DENSE)
  params = random_params(fast)
  h_BxTxD, targets_BxT = zipf_inputs(fast.vocab_size, 3, 64)
  targets_BxT = targets_BxT.at[0, :40].set(36)   # far more of the last tail than usual
  assert not tails_gathered(fast, targets_BxT, 1)
  assert_equal_to_1e6(weighted_nll_and_grads(fast, params, h_BxTxD, targets_BxT),
                      weighted_nll_and_grads(scanned, params, h_BxTxD, targets_BxT))


def test_gathered_rows_take_each_groups_first_members_in_order():
  member_GxM = jnp.asarray([[0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 1]], bool)
  np.testing.assert_array_equal(vocab_logsumexp.gathered_rows(member_GxM, 3),
                                [[1, 2, 4], [5, 0, 0]])


def test_tail_capacity_rounds_up_to_eight_rows_within_the_group():
  assert vocab_logsumexp.tail_capacity(18_432, 0.05, 2.0) == 1848
  assert vocab_logsumexp.tail_capacity(18_432, 0.0, 2.0) == 8
  assert vocab_logsumexp.tail_capacity(20, 0.6, 2.0) == 20


def test_a_tail_gathers_within_each_batch_shard_of_the_mesh():
  # One group of rows per device of the batch axis, so that no gather crosses devices;
  # a batch the axis does not divide is one group.
  mesh = jax.sharding.AbstractMesh((2, 3), sharding.MESH_AXES)
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_RULES):
    assert vocab_logsumexp.batch_shards(4) == 2
    assert vocab_logsumexp.batch_shards(3) == 1
  assert vocab_logsumexp.batch_shards(4) == 1


def test_cluster_fractions_count_and_zipf_estimate():
  bounds = adaptive.cluster_bounds(10, (2, 5))
  # Each cluster's first id counts in it: 2 and 5 are the cutoffs.
  assert vocab_logsumexp.cluster_fractions(np.asarray([0, 1, 1, 2, 5]), bounds) == (
      0.6, 0.2, 0.2)
  harmonic = [sum(1 / r for r in range(1, n + 1)) for n in (2, 5, 10)]
  np.testing.assert_allclose(
      vocab_logsumexp.zipf_fractions(bounds),
      np.diff([0.0, *harmonic]) / harmonic[-1], rtol=1e-12)


def test_bfloat16_logits_are_summed_and_returned_in_float32():
  # 1 + 2**-9 is exact in float32; bfloat16 (8 bits of mantissa) rounds it to 1.
  h_NxK = jnp.asarray([[1.0, 2.0**-9]], jnp.bfloat16)
  table_VxK = jnp.ones((1, 2), jnp.float32)
  logits_NxV = vocab_logsumexp.logits(h_NxK, table_VxK, jnp.zeros((1,)), jnp.bfloat16)
  assert logits_NxV.dtype == jnp.float32
  assert float(logits_NxV[0, 0]) == 1.0 + 2.0**-9


def test_block_rows_from_the_device_unless_set():
  assert vocab_logsumexp.block_rows(8192, 10**6) == 8192
  rows = vocab_logsumexp.block_rows(0, 18_432)
  budget = vocab_logsumexp.LOGITS_MEMORY_SHARE * vocab_logsumexp.device_memory_bytes()
  assert rows >= 1024 and (rows == 1024 or rows * 18_432 * 4 <= budget)


def test_zipf_tokens_have_the_clusters_zipf_shares():
  bounds = adaptive.cluster_bounds(1000, (100, 400))
  tokens = vocab_logsumexp.zipf_tokens(np.random.default_rng(0), 1000, (50, 200))
  assert tokens.dtype == np.int32 and tokens.shape == (50, 200)
  np.testing.assert_allclose(vocab_logsumexp.cluster_fractions(tokens, bounds),
                             vocab_logsumexp.zipf_fractions(bounds), atol=0.01)


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
