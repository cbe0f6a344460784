"""Attention core: the hand-written backward pass, the dropout hash, bf16."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax import attention


def test_threefry_matches_jax():
  key = jnp.array([0x13198A2E, 0x03707344], jnp.uint32)
  count = jnp.arange(64, dtype=jnp.uint32) * jnp.uint32(2654435761)
  expected = jax.extend.random.threefry_2x32(key, count)
  b0, b1 = attention._threefry2x32(key[0], key[1], count[:32], count[32:])
  np.testing.assert_array_equal(jnp.concatenate([b0, b1]), expected)


def test_keep_mask_rate_and_keys():
  shape = (4, 3, 64, 96)
  keys = jnp.array([[1, 2], [3, 4]], jnp.uint32)
  a = attention._keep_mask(keys[0], shape, 0.2)
  b = attention._keep_mask(keys[1], shape, 0.2)
  assert abs(float(a.mean()) - 0.8) < 0.01
  assert 0.6 < float((a == b).mean()) < 0.7   # independent masks agree on 0.8² + 0.2²
  np.testing.assert_array_equal(a, attention._keep_mask(keys[0], shape, 0.2))
  assert bool(attention._keep_mask(keys[0], shape, 0.0).all())


def _inputs(num_persistent, dtype=jnp.float32, h=3, b=2, t=5, s=4, dh=8):
  k = s + t
  rng = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda shape: jax.random.normal(next(rng), shape).astype(dtype)
  args = [normal((h, b, t, dh)), normal((h, b, t, dh)), normal((h, b, k, dh)),
          normal((h, b, k, dh)), jnp.pad(normal((h, k, dh)), [(0, 0), (1, 0), (0, 0)])]
  if num_persistent:
    args += [normal((h, num_persistent, dh)), normal((h, num_persistent, dh))]
  else:
    args += [None, None]
  mask = attention.attention_mask(t, s, jnp.int32(2), False)
  return args, mask, normal((h, b, t, dh))


@pytest.mark.parametrize("num_persistent", [0, 6])
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_custom_backward_matches_autodiff(num_persistent, rate):
  args, mask, dout = _inputs(num_persistent)
  keys = jnp.array([[5, 6], [7, 8]], jnp.uint32) if rate else None
  custom = lambda *a: attention._attend(rate, *a, mask, keys)
  plain = lambda *a: attention._attend_fwd(rate, *a, mask, keys)[0]
  out, custom_vjp = jax.vjp(custom, *args)
  expected_out, plain_vjp = jax.vjp(plain, *args)
  np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
  for got, expected in zip(custom_vjp(dout), plain_vjp(dout)):
    if expected is None:
      assert got is None
      continue
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_dropout_zeroes_weights_and_rescales():
  args, mask, _ = _inputs(6)
  keys = jnp.array([[5, 6], [7, 8]], jnp.uint32)
  # With v = one-hot rows, the outputs are the (dropped) weights themselves.
  qu, qv, k, _, r_pad, pk, _ = args
  h, b, kk, dh = k.shape
  n = pk.shape[1]
  eye = jnp.eye(kk + n, dtype=jnp.float32)
  v = jnp.broadcast_to(eye[:kk], (h, b, kk, kk + n))
  pv = jnp.broadcast_to(eye[kk:], (h, n, kk + n))
  wide = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, kk + n - dh)])
  weights = functools.partial(attention._attend, 0.5, wide(qu), wide(qv), wide(k))
  dropped = weights(v, wide(r_pad), wide(pk), pv, mask, keys)
  full = attention._attend(0.0, wide(qu), wide(qv), wide(k), v, wide(r_pad), wide(pk),
                           pv, mask, None)
  dropped, full = np.asarray(dropped), np.asarray(full)
  np.testing.assert_allclose(full.sum(-1), 1.0, rtol=1e-5)   # all weights, ctx + persistent
  kept = dropped != 0
  assert 0.4 < kept[full != 0].mean() < 0.6
  np.testing.assert_allclose(dropped[kept], 2 * full[kept], rtol=1e-5)


def test_bfloat16_core_close_to_float32():
  args32, mask, dout = _inputs(6)
  args16, _, _ = _inputs(6, jnp.bfloat16)
  loss = lambda *a: jnp.sum(attention._attend(0.0, *a, mask, None).astype(jnp.float32)
                            * dout)
  grads32 = jax.grad(loss, argnums=range(7))(*args32)
  grads16 = jax.grad(loss, argnums=range(7))(*args16)
  for g16, g32 in zip(grads16, grads32):
    assert g16.dtype == jnp.bfloat16
    scale = float(jnp.abs(g32).max())
    np.testing.assert_allclose(g16.astype(jnp.float32), g32, atol=0.05 * scale)
