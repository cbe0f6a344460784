"""Attention dropout's keep mask over the persistent slots, hashed once per layer and
step and packed 32 bits to a uint32 word, for the split core (split_core.py).

The XLA core hashes every persistent weight in its forward pass and again in its
backward pass (`xla_core.keep_mask`); the split core hashes each once, before both,
and its persistent parts read the packed words (a 32nd of the (H, B, T, N) weights'
elements) in every pass. The bits are `xla_core.keep_mask`'s under the persistent key:
the same Threefry-2x32 of (head, flat index (b·T + t)·N + n within the head), so the
split and XLA cores drop the same weights, and a resumed run draws the masks of the
run it resumes.
"""
import jax
import jax.numpy as jnp

from allatt_jax.model.attention import xla_core

WORD = 32   # keep bits per uint32 word: slot n is bit n % 32 of word n // 32


def words(num_slots: int) -> int:
  """Words of keep bits per query row of `num_slots` slots."""
  return -(-num_slots // WORD)


def packed(key_2, shape_HxBxTxN, rate: float) -> jax.Array:
  """(H, B, T, words(N)) uint32: bit n % 32 of word n // 32 is set where the weight of
  slot n is kept (Bernoulli(1 - rate)); bits past N are 0."""
  h, b, t, n = shape_HxBxTxN
  shape = (h, b, t, words(n), WORD)
  iota = lambda axis: jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
  slot = iota(3) * jnp.uint32(WORD) + iota(4)
  counter = (iota(1) * jnp.uint32(t) + iota(2)) * jnp.uint32(n) + slot
  b0, b1 = xla_core.threefry2x32(key_2[0], key_2[1], iota(0), counter)
  keep = ((b0 ^ b1) >= jnp.uint32(int(rate * 2.0 ** 32))) & (slot < n)
  # Disjoint bits: their sum is their bitwise or.
  return jnp.sum(keep.astype(jnp.uint32) << iota(4), axis=-1, dtype=jnp.uint32)


def unpacked(words_HxBxTxW: jax.Array, num_slots: int) -> jax.Array:
  """The (H, B, T, N) boolean keep mask of `packed`'s words."""
  bit = jnp.arange(WORD, dtype=jnp.uint32)
  bits = (words_HxBxTxW[..., None] >> bit) & jnp.uint32(1)
  return bits.reshape(*words_HxBxTxW.shape[:-1], -1)[..., :num_slots] != 0
