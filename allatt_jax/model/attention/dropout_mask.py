"""Attention dropout's keep masks, drawn where they are used, the same in every core.

A weight is kept or dropped by a counter-based hash of the layer's key and the
weight's place: its head h, its query's row r = b·T + t, and its column c (a context
key, or a persistent slot under the layer's second key). With `mix`, a 32-bit
multiply-xorshift finalizer (C. Wellons' "lowbias32": two multiplies, three
xorshifts),

  row_seed(h, r)    = mix(mix(k0 + mix(h)) ^ r)      one per query row of a head
  column_seed(c)    = mix(k1 ^ c)                    one per key or slot
  kept(h, r, c)     = mix(row_seed ^ column_seed) ≥ rate · 2³²

so a weight costs one xor, one mix and a compare, computed next to the weight it
drops: in XLA's elementwise pass (the XLA core and the split core's XLA part) or in
registers inside a Pallas tile, from its rows' and columns' seeds. Nothing is stored
or gathered, and every core drops the same weights: a resumed run draws the masks of
the run it resumes whatever its core. (Threefry-2x32, the hash of jax.random and of
this module's predecessor, costs 13 to 20 rounds of adds, rotations and key
injections a weight.)

The layer's key (k0, k1) is flax's dropout rng of the layer for the step, so masks
differ across steps and layers; `h` counts the heads of the layer from 0, so a loop
over blocks of heads draws the same mask as one pass over all. Rows are unique up to
2³² per head. Statistics (tests/test_model_attention.py): each mask keeps 1 − rate of
its weights, masks differ across keys, heads and layers, and neighbouring weights
(along keys, slots and queries) are independent by a χ² test of adjacent pairs.
"""
import jax
import jax.numpy as jnp


def mix(x: jax.Array) -> jax.Array:
  """The lowbias32 finalizer: a bijection of uint32 whose every input bit flips each
  output bit with probability close to 1/2."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def row_seeds(key_2, num_heads: int, batch: int, length: int, first_head=0) -> jax.Array:
  """(H, B, T) uint32: the seed of each query row of heads first_head.. (see module)."""
  shape = (num_heads, batch, length)
  iota = lambda axis: jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
  head = iota(0) + jnp.asarray(first_head, jnp.uint32)
  row = iota(1) * jnp.uint32(length) + iota(2)
  return mix(mix(jnp.asarray(key_2[0], jnp.uint32) + mix(head)) ^ row)


def column_seeds(key_2, num_columns: int) -> jax.Array:
  """(C,) uint32: the seed of each key or slot (see module)."""
  return mix(jnp.asarray(key_2[1], jnp.uint32) ^ jnp.arange(num_columns, dtype=jnp.uint32))


def kept(row_seed: jax.Array, column_seed: jax.Array, rate: float) -> jax.Array:
  """Whether the weights at these (broadcast) seeds are kept: Bernoulli(1 - rate)."""
  return mix(row_seed ^ column_seed) >= jnp.uint32(int(rate * 2.0 ** 32))


def keep_mask(key_2, shape_HxBxTxC, rate: float, first_head=0) -> jax.Array:
  """The (H, B, T, C) keep mask of heads first_head.. under the layer's key `key_2`."""
  h, b, t, c = shape_HxBxTxC
  return kept(row_seeds(key_2, h, b, t, first_head)[..., None], column_seeds(key_2, c), rate)
