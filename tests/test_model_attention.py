"""Attention core: the hand-written backward pass, the loop over heads, the dropout hash,
the choice of core."""
import functools
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.model.attention import relative
from allatt_jax.model.attention import dropout_mask
from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import core_choice
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import config_base
from allatt_jax.config import run_config
from allatt_jax.training import assembly
from allatt_jax.config.errors import ConfigError


def _lowbias32(x: int) -> int:
  """The finalizer in Python's integers, written from its definition."""
  x ^= x >> 16
  x = (x * 0x7FEB352D) & 0xFFFFFFFF
  x ^= x >> 15
  x = (x * 0x846CA68B) & 0xFFFFFFFF
  return x ^ (x >> 16)


def test_dropout_hash_is_lowbias32_of_the_documented_seeds():
  words = [0, 1, 2, 0x9E3779B9, 0xFFFFFFFF]
  np.testing.assert_array_equal(dropout_mask.mix(jnp.array(words, jnp.uint32)),
                                [_lowbias32(w) for w in words])
  key, (h, b, t, c), rate = (11, 13), (3, 2, 5, 7), 0.25
  expected = np.zeros((h, b, t, c), bool)
  for index in np.ndindex(h, b, t, c):
    head, batch, query, column = index
    row_seed = _lowbias32(_lowbias32((key[0] + _lowbias32(head)) & 0xFFFFFFFF)
                          ^ (batch * t + query))
    column_seed = _lowbias32(key[1] ^ column)
    expected[index] = _lowbias32(row_seed ^ column_seed) >= int(rate * 2**32)
  np.testing.assert_array_equal(
      dropout_mask.keep_mask(jnp.array(key, jnp.uint32), (h, b, t, c), rate), expected)


# Keys chosen once at random; the checks below are deterministic.
_MASK_KEYS = np.array([[0x2F6A1C3B, 0x91D04E77], [0x5B3E0A19, 0x0C7D6F25]], np.uint32)


@pytest.mark.parametrize("rate", [0.1, 0.2, 0.5])
def test_dropout_mask_keeps_one_minus_rate_and_neighbours_are_independent(rate):
  """At the benchmark layer's proportions: the kept fraction within 3σ of 1 − rate,
  and along each axis (keys or slots, queries, batch rows, heads) the four kinds of
  disjoint adjacent pairs (kept, kept), (kept, dropped), ... in the proportions of
  independent draws: χ² with 3 degrees of freedom within 3σ of its mean (3 + 3·√6)."""
  shape = (8, 4, 48, 384)
  keep = np.asarray(dropout_mask.keep_mask(_MASK_KEYS[0], shape, rate))
  sigma = np.sqrt(rate * (1 - rate) / keep.size)
  assert abs(keep.mean() - (1 - rate)) < 3 * sigma, (keep.mean(), sigma)
  p = np.array([1 - rate, rate])
  expected_share = np.outer(p, p).ravel()
  for axis in (3, 2, 1, 0):
    along = np.moveaxis(keep, axis, -1)
    even = along.shape[-1] // 2 * 2
    first, second = along[..., 0:even:2].ravel(), along[..., 1:even:2].ravel()
    counts = np.array([np.sum(first & second), np.sum(first & ~second),
                       np.sum(~first & second), np.sum(~first & ~second)])
    expected = first.size * expected_share
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 3 + 3 * np.sqrt(6), (axis, chi2, counts)


def test_dropout_masks_differ_across_keys_and_heads_and_follow_the_head_offset():
  shape, rate = (4, 3, 64, 96), 0.2
  a = np.asarray(dropout_mask.keep_mask(_MASK_KEYS[0], shape, rate))
  b = np.asarray(dropout_mask.keep_mask(_MASK_KEYS[1], shape, rate))
  # Independent masks agree on 0.8² + 0.2² = 0.68 of their weights, within 3σ.
  def assert_independent(x, y):
    sigma = np.sqrt(0.68 * 0.32 / x.size)
    assert abs(float(np.mean(x == y)) - 0.68) < 3 * sigma

  assert_independent(a, b)
  for head in range(1, 4):
    assert_independent(a[0], a[head])
  # Heads 2.. drawn as a block starting at head 2 get the same mask.
  np.testing.assert_array_equal(
      a[2:], dropout_mask.keep_mask(_MASK_KEYS[0], (2, *shape[1:]), rate, first_head=2))
  assert bool(dropout_mask.keep_mask(_MASK_KEYS[0], shape, 0.0).all())


def _inputs(num_persistent, dtype=jnp.float32, h=4, b=2, t=5, s=4, dh=8):
  k = s + t
  rng = iter(jax.random.split(jax.random.key(0), 10))
  normal = lambda shape: jax.random.normal(next(rng), shape).astype(dtype)
  # qu, qv, qp (the persistent logits' own queries), k, v, r_pad, pk, pv.
  args = [normal((h, b, t, dh)), normal((h, b, t, dh)),
          normal((h, b, t, dh)) if num_persistent else None, normal((h, b, k, dh)),
          normal((h, b, k, dh)), jnp.pad(normal((h, k, dh)), [(0, 0), (1, 0), (0, 0)])]
  if num_persistent:
    args += [normal((h, num_persistent, dh)), normal((h, num_persistent, dh))]
  else:
    args += [None, None]
  mask = relative.attention_mask(t, s, jnp.int32(2), False)
  return args, mask, normal((h, b, t, dh))


KEYS = jnp.array([[5, 6], [7, 8]], jnp.uint32)
F32 = jnp.float32


@pytest.mark.parametrize("num_persistent", [0, 6])
@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("head_block,remat", [
    (4, False), pytest.param(1, False, marks=pytest.mark.slow),
    pytest.param(2, True, marks=pytest.mark.slow)])
def test_custom_backward_matches_autodiff(num_persistent, rate, head_block, remat):
  """Values and gradients equal autodiff of the all-heads forward, whatever the options."""
  args, mask, dout = _inputs(num_persistent)
  keys = KEYS if rate else None
  custom = lambda *a: xla_core.attend(rate, head_block, remat, F32, *a, mask, keys)
  plain = lambda *a: xla_core._attend_fwd(rate, 4, False, F32, *a, mask, keys)[0]
  out, custom_vjp = jax.vjp(custom, *args)
  expected_out, plain_vjp = jax.vjp(plain, *args)
  np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
  for got, expected in zip(custom_vjp(dout), plain_vjp(dout)):
    if expected is None:
      assert got is None
      continue
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_a_loop_over_blocks_of_heads_drops_what_one_pass_drops():
  """Each block hashes its masks from the index of its first head, not its own."""
  args, mask, _ = _inputs(6)
  one_pass = xla_core.attend(0.3, 4, False, F32, *args, mask, KEYS)
  for head_block in (1, 2):
    np.testing.assert_allclose(xla_core.attend(0.3, head_block, False, F32, *args, mask, KEYS),
                               one_pass, rtol=1e-6, atol=1e-6, err_msg=f"{head_block=}")


def test_dropout_zeroes_weights_and_rescales():
  args, mask, _ = _inputs(6)
  # With one-hot value rows, the outputs are the (dropped) weights themselves.
  qu, qv, qp, k, _, r_pad, pk, _ = args
  h, b, kk, dh = k.shape
  n = pk.shape[1]
  eye = jnp.eye(kk + n, dtype=jnp.float32)
  v = jnp.broadcast_to(eye[:kk], (h, b, kk, kk + n))
  pv = jnp.broadcast_to(eye[kk:], (h, n, kk + n))
  wide = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, kk + n - dh)])
  inputs = (wide(qu), wide(qv), wide(qp), wide(k), v, wide(r_pad), wide(pk), pv, mask)
  dropped = np.asarray(xla_core.attend(0.5, 1, False, F32, *inputs, KEYS))
  full = np.asarray(xla_core.attend(0.0, 1, False, F32, *inputs, None))
  np.testing.assert_allclose(full.sum(-1), 1.0, rtol=1e-5)   # context + persistent
  kept = dropped != 0
  assert 0.4 < kept[full != 0].mean() < 0.6
  np.testing.assert_allclose(dropped[kept], 2 * full[kept], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("score_dtype", [jnp.float32, jnp.bfloat16])
def test_bfloat16_core_close_to_float32(score_dtype):
  """bf16 compute, with scores and weights in float32 or in bf16 (the 'compute'
  setting), stays within bf16 rounding of the float32 core."""
  args32, mask, dout = _inputs(6)
  args16, _, _ = _inputs(6, jnp.bfloat16)
  loss = lambda dtype: lambda *a: jnp.sum(xla_core.attend(
      0.0, 2, False, dtype, *a, mask, None).astype(jnp.float32) * dout)
  grads32 = jax.grad(loss(F32), argnums=range(8))(*args32)
  grads16 = jax.grad(loss(score_dtype), argnums=range(8))(*args16)
  for g16, g32 in zip(grads16, grads32):
    assert g16.dtype == jnp.bfloat16
    scale = float(jnp.abs(g32).max())
    np.testing.assert_allclose(g16.astype(jnp.float32), g32, atol=0.05 * scale)


@pytest.mark.parametrize("score_dtype", [jnp.float32, jnp.bfloat16])
def test_scores_and_kept_weights_in_the_score_dtype(score_dtype):
  """The weights kept for the backward pass, and every (.., T, K) and (.., T, N) array
  the core writes, are in the score dtype: bf16 halves their memory and traffic."""
  args, mask, _ = _inputs(6, jnp.bfloat16)
  _, residuals = xla_core._attend_fwd(0.3, 4, False, score_dtype, *args, mask, KEYS)
  p_ctx, p_pers = residuals[-3:-1]
  assert p_ctx.dtype == p_pers.dtype == score_dtype
  t, k, n = args[0].shape[2], args[3].shape[2], args[6].shape[1]
  jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(
      lambda *x: xla_core.attend(0.3, 4, False, score_dtype, *x, mask, KEYS),
      *a)[1](a[0]))(*args)
  big = [v.aval for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"
         for v in e.outvars if v.aval.shape[-2:] in ((t, k + 1), (t, k), (t, n))]
  assert big and all(a.dtype == score_dtype for a in big)


def test_head_block_divides_any_head_count():
  assert [xla_core.divisor_at_most(h, 4) for h in (1, 2, 3, 5, 6, 8)] == [1, 2, 3, 1, 3, 4]


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
  mask_TxK = np.asarray(relative.attention_mask(t, s, jnp.int32(3), True))
  dout = rng.standard_normal((h, b, t, dh))

  def loss(core, *args):
    return jnp.sum(core(*args) * dout)

  core = lambda *a: xla_core.attend(0.0, 1, False, jnp.float32, *a, mask_TxK, None)
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
  mask_TxK = relative.attention_mask(t, s, jnp.int32(s), False)
  weights = functools.partial(xla_core.attention_weights, score_dtype=jnp.bfloat16)
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


def test_slot_weighted_layers_keep_their_weights_on_a_gpus_cores(monkeypatch):
  # As on a GPU: 'auto' is the split core, whose persistent part weights the slots
  # (cuDNN's cannot, and is refused for them: test_model_split_core.py); closed slots
  # must take no mass there either.
  monkeypatch.setattr(core_choice, "use_split", lambda choice, rate: choice in ("split", "auto"))
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


def test_the_choice_of_core_and_the_removed_whole_core_kernels():
  config = config_base.base_config()
  config.model.vocab_size = 11
  check = lambda: assembly.checked_config(config)   # a command's first step
  for impl in core_choice.IMPLS:
    config.model.attention_impl = impl
    check()
  # Asked for by a command (a config file or flag written for them): refused by name,
  # in one line with the fix, before anything compiles.
  config.model.attention_impl = "pallas"
  with pytest.raises(ConfigError, match=r"^config\.model\.attention_impl='pallas' \(the "
                     r"whole-core fused kernels\) was removed: .*0\.73x.*did not compile; "
                     r"use --config\.model\.attention_impl=auto .*=split or =xla\.$") as error:
    check()
  assert "\n" not in str(error.value)
  config.model.attention_impl = "triton"
  with pytest.raises(ConfigError, match=r"attention_impl='triton' is unknown; choose one of "
                     r"'auto', 'xla', 'split'\."):
    check()
  # A model built past the checks with a choice that is not one: refused at its trace.
  with pytest.raises(ConfigError, match="attention_impl='pallas' is unknown"):
    core_choice.use_split("pallas", 0.0)
