"""The attention core as fused Pallas kernels: a layer's attention in one pass on the GPU.

`attend` computes what `xla_core.attend` computes (same arguments, same
custom-VJP contract) keeping only outputs and log-normalisers, never the (B, H, T,
K + N) logits. Off the GPU the kernels run in Pallas' interpreter; which core a layer
runs is `core_choice.use_kernel`'s choice.
"""
import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import pallas_kernels as kernels


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes: `rows` queries by `rows` context keys, `rows` queries by `slots`
  persistent slots, and `batch` batch rows per program of the persistent gradients.

  Triton tiles are powers of two, at least 16 for the tensor cores; the rel-shift
  window needs as many keys as queries per tile.
  """
  rows: int = 64
  slots: int = 64
  batch: int = 8

  @classmethod
  def for_shape(cls, seq_len: int, num_slots: int, batch: int) -> "Blocks":
    """64 x 64 tiles (at head size 64 and 8 warps, within the registers of a Hopper
    SM but for the query gradients' few spills), smaller for short segments; `batch`
    the largest divisor of the batch up to 8."""
    return cls(rows=min(64, kernels.pow2_at_least(seq_len)),
               slots=min(64, kernels.pow2_at_least(max(num_slots, 1))),
               batch=xla_core.divisor_at_most(batch, 8))


def _mask_bounds(mask_TxK, g: kernels.Geometry):
  """Each row's first and last visible key (padded rows repeat the last real row's),
  and the tiles they reach: each query block's first and last key block, and each key
  block's first and last query block (first > last: none)."""
  k = mask_TxK.shape[1]
  lo = jnp.argmax(mask_TxK, axis=1).astype(jnp.int32)
  hi = (k - 1 - jnp.argmax(mask_TxK[:, ::-1], axis=1)).astype(jnp.int32)
  pad = [(0, g.t_pad - g.t)]
  lo, hi = jnp.pad(lo, pad, mode="edge"), jnp.pad(hi, pad, mode="edge")
  first_Q = lo.reshape(g.q_blocks, g.rows).min(1) // g.rows
  last_Q = hi.reshape(g.q_blocks, g.rows).max(1) // g.rows
  key_block = jnp.arange(g.k_blocks)
  tiles_QxK = (first_Q[:, None] <= key_block) & (key_block <= last_Q[:, None])
  seen_K = tiles_QxK.any(0)
  first_K = jnp.where(seen_K, jnp.argmax(tiles_QxK, 0), 1)
  last_K = jnp.where(seen_K, g.q_blocks - 1 - jnp.argmax(tiles_QxK[::-1], 0), 0)
  as_i32 = lambda *xs: tuple(x.astype(jnp.int32) for x in xs)
  return (lo, hi), as_i32(first_Q, last_Q), as_i32(first_K, last_K)


def _padded(x, *sizes):
  """x zero-padded at the end of its trailing axes to `sizes`."""
  lead = x.ndim - len(sizes)
  widths = [(0, 0)] * lead + [(0, s - d) for s, d in zip(sizes, x.shape[lead:])]
  return jnp.pad(x, widths) if any(w for _, w in widths) else x


def _pad_inputs(g: kernels.Geometry, qu, qv, qp, k, v, r_pad, pk, pv):
  """The inputs in whole tiles; the position table extended so that every tile's
  window lies inside it."""
  rows = lambda x: None if x is None else _padded(x, g.t_pad, g.dh_pad)
  slots = lambda x: None if x is None else _padded(x, g.n_pad, g.dh_pad)
  after = g.table_rows - g.table_offset - r_pad.shape[1]
  table = jnp.pad(r_pad, [(0, 0), (g.table_offset, after), (0, g.dh_pad - g.dh)])
  return (rows(qu), rows(qv), rows(qp), _padded(k, g.k_pad, g.dh_pad),
          _padded(v, g.k_pad, g.dh_pad), table, slots(pk), slots(pv))


def _seeds(keys_2x2, first_head, first_batch_row):
  """The kernels' seeds array (pallas_kernels.SEEDS)."""
  keys = jnp.zeros((4,), jnp.uint32) if keys_2x2 is None else keys_2x2.reshape(4)
  offsets = jnp.stack([jnp.asarray(first_head), jnp.asarray(first_batch_row)])
  return jnp.concatenate([keys.astype(jnp.uint32), offsets.astype(jnp.uint32),
                          jnp.zeros((kernels.SEEDS - 6,), jnp.uint32)])


# Block specs. Grids are (head, batch row, block) but for the slot gradients'.

def _tile(rows: int, width: int):
  """Block i of `rows` rows of an (H, B, X, width) array."""
  return pl.BlockSpec((None, None, rows, width), lambda h, b, i: (h, b, i, 0))


def _sequence(length: int, width: int):
  """All rows of an (H, B, X, width) array."""
  return pl.BlockSpec((None, None, length, width), lambda h, b, i: (h, b, 0, 0))


def _per_head(length: int, width: int):
  """All of an (H, X, width) array's head: the position table, persistent vectors."""
  return pl.BlockSpec((None, length, width), lambda h, *_: (h, 0, 0))


def _stats(length: int, tiled: bool):
  """Block i of `length` rows of an (H, B, T) array of row statistics, or all of it."""
  return pl.BlockSpec((None, None, length), lambda h, b, i: (h, b, i if tiled else 0))


def _whole(shape):
  """All of a small array, for every program."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _call(kernel, g: kernels.Geometry, grid, in_specs, out_specs, out_shape, *, name,
          shifts=True):
  """A pallas_call of one kernel. Kernels that stage the rel-shift (`shifts`) run
  unpipelined, and with 8 warps on 64-row tiles: at 4 warps their registers spilled
  (Triton 3.9, sm_90; see docs/performance.md)."""
  # Unpipelined: a pipelined loop may issue the next iteration's read of the scratch
  # tile before this one's write. (Triton backend: jax 0.10; deprecated in 0.11.)
  params = (plgpu.CompilerParams(num_warps=8 if g.rows >= 64 else 4, num_stages=1)
            if shifts else plgpu.CompilerParams(num_warps=4, num_stages=2))
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=params, interpret=g.interpret, name=name)


def _scratch(g: kernels.Geometry, num_heads: int, batch: int, blocks: int):
  """A (rows, 2·rows) float32 rel-shift tile per program."""
  return (_tile(g.rows, 2 * g.rows),
          jax.ShapeDtypeStruct((num_heads, batch, blocks * g.rows, 2 * g.rows), jnp.float32))


def _query_block_specs(g: kernels.Geometry, first_Q, last_Q, seeds):
  """Specs of lo, hi, first_Q, last_Q, seeds, qu, qv, k, v and the table."""
  queries = _tile(g.rows, g.dh_pad)
  return [pl.BlockSpec((g.rows,), lambda h, b, i: (i,))] * 2 + [
      _whole(first_Q.shape), _whole(last_Q.shape), _whole(seeds.shape), queries, queries,
      _sequence(g.k_pad, g.dh_pad), _sequence(g.k_pad, g.dh_pad),
      _per_head(g.table_rows, g.dh_pad)]


def _slot_specs(g: kernels.Geometry):
  """Specs of qp and the head's persistent keys and values."""
  return [_tile(g.rows, g.dh_pad), _per_head(g.n_pad, g.dh_pad),
          _per_head(g.n_pad, g.dh_pad)]


def _forward(g: kernels.Geometry, padded, seeds, bounds):
  qu, qv, qp, k, v, table, pk, pv = padded
  (lo, hi), (first_Q, last_Q), _ = bounds
  num_heads, batch = qu.shape[:2]
  has_slots = pk is not None
  queries = _tile(g.rows, g.dh_pad)
  in_specs = _query_block_specs(g, first_Q, last_Q, seeds)
  args = [lo, hi, first_Q, last_Q, seeds, qu, qv, k, v, table]
  if has_slots:
    in_specs += _slot_specs(g)
    args += [qp, pk, pv]
  scratch_spec, scratch_shape = _scratch(g, num_heads, batch, g.q_blocks)
  out, lse, _ = _call(
      functools.partial(kernels.forward_kernel, g, has_slots), g,
      (num_heads, batch, g.q_blocks), in_specs,
      [queries, _stats(g.rows, tiled=True), scratch_spec],
      [jax.ShapeDtypeStruct(qu.shape, qu.dtype),
       jax.ShapeDtypeStruct(qu.shape[:3], jnp.float32), scratch_shape],
      name="allatt_attention_forward")(*args)
  return out, lse


def _query_grads(g: kernels.Geometry, padded, seeds, bounds, lse, delta, dout):
  """(dqu, dqv, dqp or None, the extended table's gradient)."""
  qu, qv, qp, k, v, table, pk, pv = padded
  (lo, hi), (first_Q, last_Q), _ = bounds
  num_heads, batch = qu.shape[:2]
  has_slots = pk is not None
  queries = _tile(g.rows, g.dh_pad)
  in_specs = _query_block_specs(g, first_Q, last_Q, seeds) + [
      _stats(g.rows, tiled=True), _stats(g.rows, tiled=True), queries]
  args = [lo, hi, first_Q, last_Q, seeds, qu, qv, k, v, table, lse, delta, dout]
  grads = 3 if has_slots else 2
  if has_slots:
    in_specs += _slot_specs(g)
    args += [qp, pk, pv]
  # Each program's share of the table gradient: k_blocks + 1 blocks of rows.
  share = (g.k_blocks + 1) * g.rows
  scratch_spec, scratch_shape = _scratch(g, num_heads, batch, g.q_blocks)
  *dq, shares, _ = _call(
      functools.partial(kernels.query_grads_kernel, g, has_slots), g,
      (num_heads, batch, g.q_blocks), in_specs,
      [queries] * grads + [pl.BlockSpec((None, None, None, share, g.dh_pad),
                                        lambda h, b, i: (h, b, i, 0, 0)), scratch_spec],
      [jax.ShapeDtypeStruct(qu.shape, qu.dtype)] * grads + [
          jax.ShapeDtypeStruct((num_heads, batch, g.q_blocks, share, g.dh_pad), jnp.float32),
          scratch_shape],
      name="allatt_attention_query_grads")(*args)
  # Query block ib's share starts at the window of its tile with the first key block.
  shares = shares.sum(1)
  table_grads = jnp.zeros((num_heads, g.table_rows, g.dh_pad), jnp.float32)
  for ib in range(g.q_blocks):
    start = g.window_start(ib * g.rows, 0)
    table_grads = table_grads.at[:, start:start + share].add(shares[:, ib])
  return (*dq, *([None] if not has_slots else []), table_grads)


def _context_kv_grads(g: kernels.Geometry, padded, seeds, bounds, lse, delta, dout):
  qu, qv, _, k, v, table, _, _ = padded
  (lo, hi), _, (first_K, last_K) = bounds
  num_heads, batch = qu.shape[:2]
  queries = _sequence(g.t_pad, g.dh_pad)
  keys = _tile(g.rows, g.dh_pad)
  scratch_spec, scratch_shape = _scratch(g, num_heads, batch, g.k_blocks)
  dk, dv, _ = _call(
      functools.partial(kernels.context_kv_grads_kernel, g), g,
      (num_heads, batch, g.k_blocks),
      [_whole(lo.shape), _whole(hi.shape), _whole(first_K.shape), _whole(last_K.shape),
       _whole(seeds.shape), queries, queries, keys, keys, _per_head(g.table_rows, g.dh_pad),
       _stats(g.t_pad, tiled=False), _stats(g.t_pad, tiled=False), queries],
      [keys, keys, scratch_spec],
      [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2 + [scratch_shape],
      name="allatt_attention_context_kv_grads")(
          lo, hi, first_K, last_K, seeds, qu, qv, k, v, table, lse, delta, dout)
  return dk, dv


def _slot_grads(g: kernels.Geometry, padded, seeds, lse, delta, dout):
  """Persistent key and value gradients, summed over programs of `batch_block` rows;
  grid (head, slot block, batch block)."""
  _, _, qp, _, _, _, pk, pv = padded
  num_heads, batch = qp.shape[:2]
  bb = g.batch_block
  batch_rows = pl.BlockSpec((None, bb, g.t_pad, g.dh_pad), lambda h, s, c: (h, c, 0, 0))
  batch_stats = pl.BlockSpec((None, bb, g.t_pad), lambda h, s, c: (h, c, 0))
  slots = pl.BlockSpec((None, g.slots, g.dh_pad), lambda h, s, c: (h, s, 0))
  partial = (pl.BlockSpec((None, None, g.slots, g.dh_pad), lambda h, s, c: (h, c, s, 0)),
             jax.ShapeDtypeStruct((num_heads, batch // bb, g.n_pad, g.dh_pad), jnp.float32))
  dpk, dpv = _call(
      functools.partial(kernels.slot_grads_kernel, g), g,
      (num_heads, g.n_blocks, batch // bb),
      [_whole(seeds.shape), batch_rows, slots, slots, batch_stats, batch_stats, batch_rows],
      [partial[0]] * 2, [partial[1]] * 2, shifts=False,
      name="allatt_attention_slot_grads")(seeds, qp, pk, pv, lse, delta, dout)
  return dpk.sum(1).astype(pk.dtype), dpv.sum(1).astype(pv.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(g, qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, seeds):
  return _fused_fwd(g, qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, seeds)[0]


def _fused_fwd(g, qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, seeds):
  padded = _pad_inputs(g, qu, qv, qp, k, v, r_pad, pk, pv)
  out, lse = _forward(g, padded, seeds, _mask_bounds(mask_TxK, g))
  out = out[:, :, :g.t, :g.dh]
  return out, (qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, seeds, out, lse)


def _fused_bwd(g, residuals, dout):
  *inputs, mask_TxK, seeds, out, lse = residuals
  padded, bounds = _pad_inputs(g, *inputs), _mask_bounds(mask_TxK, g)
  # Σ_j p_j dp_j of the softmax backward equals Σ_d out_d dout_d, dropout included.
  delta = _padded(jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1), g.t_pad)
  dout = _padded(dout, g.t_pad, g.dh_pad)
  dqu, dqv, dqp, table_grads = _query_grads(g, padded, seeds, bounds, lse, delta, dout)
  dk, dv = _context_kv_grads(g, padded, seeds, bounds, lse, delta, dout)
  dpk = dpv = None
  if inputs[6] is not None:
    dpk, dpv = _slot_grads(g, padded, seeds, lse, delta, dout)
  queries = lambda x: None if x is None else x[:, :, :g.t, :g.dh]
  keys = lambda x: x[:, :, :g.k, :g.dh]
  slots = lambda x: None if x is None else x[:, :g.n, :g.dh]
  r_pad = inputs[5]
  dr_pad = table_grads[:, g.table_offset:g.table_offset + r_pad.shape[1], :g.dh]
  return (queries(dqu), queries(dqv), queries(dqp), keys(dk), keys(dv),
          dr_pad.astype(r_pad.dtype), slots(dpk), slots(dpv), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def attend(rate, qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, keys_2x2, *,
           blocks: Blocks | None = None, interpret: bool | None = None):
  """`xla_core.attend`'s attention as Pallas kernels: the same arguments,
  without its head loop and remat (the kernels keep only outputs and log-normalisers).

  Each row of `mask_TxK` must be one interval of keys, as `attention.attention_mask`'s
  rows are (causal, same-length window, empty memory slots at a stream start).
  `blocks`: the tile sizes (default `Blocks.for_shape`). `interpret`: run the kernels
  in Pallas' interpreter (default: everywhere but on a GPU).

  Under a mesh (`jax.set_mesh`) of several devices the kernels run per shard
  (`jax.shard_map`: heads over 'model', batch rows over 'data'), each counting its
  dropout positions from its first head and batch row, so that the masks are the
  unsharded ones.
  """
  num_heads, batch, t, dh = qu.shape
  mesh = jax.sharding.get_abstract_mesh()
  shards = {axis: mesh.shape.get(axis, 1) for axis in ("model", "data")}
  sharded = (not mesh.empty and mesh.size > 1 and num_heads % shards["model"] == 0
             and batch % shards["data"] == 0)
  local_heads = num_heads // shards["model"] if sharded else num_heads
  local_batch = batch // shards["data"] if sharded else batch
  n = 0 if pk is None else pk.shape[1]
  blocks = blocks or Blocks.for_shape(t, n, local_batch)
  g = kernels.Geometry(
      t=t, k=k.shape[2], n=n, dh=dh, rows=blocks.rows, slots=blocks.slots,
      batch_block=xla_core.divisor_at_most(local_batch, blocks.batch),
      rate=float(rate), interpret=_interpreted() if interpret is None else interpret)
  if not sharded:
    return _fused(g, qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, _seeds(keys_2x2, 0, 0))

  def shard(qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, keys_2x2):
    first = lambda axis, size: jax.lax.axis_index(axis) * size if axis in mesh.shape else 0
    seeds = _seeds(keys_2x2, first("model", local_heads), first("data", local_batch))
    return _fused(g, qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, seeds)

  P = jax.sharding.PartitionSpec
  heads = "model" if "model" in mesh.shape else None
  rows = "data" if "data" in mesh.shape else None
  per_row, per_head = P(heads, rows), P(heads)
  # check_vma=False: pallas_call outputs carry no varying-axes types to check.
  return jax.shard_map(
      shard, in_specs=(per_row,) * 5 + (per_head,) * 3 + (P(), P()), out_specs=per_row,
      check_vma=False)(qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, keys_2x2)


def _interpreted() -> bool:
  """Whether the kernels run in Pallas' interpreter by default: off the GPU."""
  return jax.default_backend() != "gpu"
