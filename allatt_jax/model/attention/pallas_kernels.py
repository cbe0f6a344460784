"""The bodies of the fused attention kernels, each program one tile row or column of
one (head, batch) pair: `forward_kernel` (online softmax over context, then persistent,
key blocks), `query_grads_kernel`, `context_kv_grads_kernel` and `slot_grads_kernel`.

Relative shift: query i scores key j against row c = j + T − i of the padded position
table, so a (queries × keys) tile needs the 2·rows table rows below its diagonal, each
query row at another offset: the block's queries times those rows are staged in a
scratch tile and read back shifted (`_shift_rows`; backward `_unshift_rows`), so no
(T, K) array of positional logits exists outside a tile. Dropout and masking match the
XLA path (its Threefry hash of (head, position); logit −1e30, weight exactly 0).
"""
import dataclasses

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from allatt_jax.model.attention import xla_core

_F32 = jnp.float32
# The seeds array: the context and persistent dropout keys (two words each), then the
# first head and batch row of this shard (nonzero inside a shard_map).
SEEDS = 8
HEAD_OFFSET, BATCH_OFFSET = 4, 5


def pow2_at_least(n: int, floor: int = 16) -> int:
  return max(floor, 1 << max(0, n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Geometry:
  """The static shape of one call: true sizes, tiles and options; padded sizes.

  Queries and context keys are padded to whole tiles of `rows`, slots to tiles of
  `slots`, the head size to a power of two.
  """
  t: int                 # queries (T)
  k: int                 # context keys (K = S + T)
  n: int                 # persistent slots (N)
  dh: int                # head size
  rows: int              # queries, and context keys, per tile
  slots: int             # persistent slots per tile
  batch_block: int       # batch rows per program of the slot gradients
  rate: float            # attention dropout
  interpret: bool        # run in Pallas' interpreter

  @property
  def t_pad(self) -> int:
    return _round_up(self.t, self.rows)

  @property
  def k_pad(self) -> int:
    return _round_up(self.k, self.rows)

  @property
  def n_pad(self) -> int:
    return _round_up(self.n, self.slots)

  @property
  def dh_pad(self) -> int:
    return pow2_at_least(self.dh)

  @property
  def q_blocks(self) -> int:
    return self.t_pad // self.rows

  @property
  def k_blocks(self) -> int:
    return self.k_pad // self.rows

  @property
  def n_blocks(self) -> int:
    return self.n_pad // self.slots

  @property
  def table_rows(self) -> int:
    """Rows of the extended position table, which holds every window a tile reads."""
    return self.k_pad + self.t_pad + 1

  @property
  def table_offset(self) -> int:
    """The extended table's row of the padded table's row 0."""
    return self.t_pad - self.t

  def window_start(self, i0, j0):
    """The first extended-table row of the tile at queries i0.., keys j0..: padded
    table row j + T - i of query i0 + rows - 1 against key j0."""
    return j0 - i0 + self.t_pad - self.rows + 1


# --- tile arithmetic (traced inside the kernels) -------------------------------------

def dot(a, b):      # a @ b
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def dot_t(a, b):    # a @ b.T
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def t_dot(a, b):    # a.T @ b
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def _iota(shape, axis):
  return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _barrier(g: Geometry):
  """All threads' scratch writes (reads) done before any thread reads (rewrites) it."""
  if not g.interpret:   # the interpreter runs a program's steps in order
    plgpu.debug_barrier()


def _shift_rows(p_RxW, scratch_ref, g: Geometry):
  """The rel-shift of one tile: out[a, c] = p[a, c - a + rows - 1], (rows, rows).

  p holds the block's queries against the 2·rows table rows of its window.
  """
  rows = g.rows
  _barrier(g)
  scratch_ref[...] = p_RxW
  _barrier(g)
  a, c = _iota((rows, rows), 0), _iota((rows, rows), 1)
  return scratch_ref[a, c - a + rows - 1]


def _unshift_rows(ds_RxR, scratch_ref, g: Geometry):
  """The transpose of `_shift_rows`: the two (rows, rows) halves of the window's
  gradient, out[a, w] = ds[a, w + a - rows + 1] where that key is in the tile, else 0."""
  rows = g.rows
  _barrier(g)
  scratch_ref[:, pl.ds(0, rows)] = ds_RxR
  _barrier(g)
  a, w = _iota((rows, rows), 0), _iota((rows, rows), 1)
  halves = []
  for first in (0, rows):
    col = w + first + a - rows + 1
    inside = (col >= 0) & (col < rows)
    halves.append(jnp.where(inside, scratch_ref[a, jnp.where(inside, col, 0)], 0.0))
  return halves


def _context_logits(g, qu, qv, k, r_ref, scratch_ref, i0, j0):
  """(q + u)·k + (q + v)·r of queries i0.. against keys j0.., rel-shifted."""
  window = r_ref[pl.ds(g.window_start(i0, j0), 2 * g.rows), :]
  return dot_t(qu, k) + _shift_rows(dot_t(qv, window), scratch_ref, g)


def _visible(lo, hi, j0, cols):
  """Which keys j0..j0+cols each row sees: its mask row is the interval [lo, hi]."""
  j = j0 + _iota((lo.shape[0], cols), 1)
  return (j >= lo[:, None]) & (j <= hi[:, None])


def _real_slots(g: Geometry, n0):
  """Which of the slots n0..n0+slots exist (the last tile is padded)."""
  return n0 + _iota((g.rows, g.slots), 1) < g.n


def _keep(g: Geometry, seeds_ref, which: int, h, b, i0, j0, cols, width):
  """The XLA path's dropout mask of a tile (`xla_core.keep_mask`): Threefry
  of (head, flat index (b·T + i)·width + j within the head) under keys `which` (0:
  context, 1: persistent), the head and batch row counted over the whole array."""
  if not g.rate:
    return None
  shape = (g.rows, cols)
  u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
  i = u32(i0) + _iota(shape, 0).astype(jnp.uint32)
  j = u32(j0) + _iota(shape, 1).astype(jnp.uint32)
  row = u32(b) + seeds_ref[BATCH_OFFSET]
  lo = (row * jnp.uint32(g.t) + i) * jnp.uint32(width) + j
  hi = jnp.zeros(shape, jnp.uint32) + (u32(h) + seeds_ref[HEAD_OFFSET])
  b0, b1 = xla_core.threefry2x32(seeds_ref[2 * which], seeds_ref[2 * which + 1],
                                 hi, lo)
  return (b0 ^ b1) >= jnp.uint32(int(g.rate * 2.0 ** 32))


def _online_softmax_step(g, carry, s, visible, keep, v):
  """One tile of the forward pass's online softmax and weighted sum."""
  m, l, acc = carry
  s = jnp.where(visible, s, xla_core.NEG_INF)
  m_next = jnp.maximum(m, s.max(axis=1))
  correction = jnp.exp(m - m_next)
  p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
  l = l * correction + p.sum(axis=1)
  p = xla_core.dropped(p, keep, g.rate)
  acc = acc * correction[:, None] + dot(p.astype(v.dtype), v)
  return m_next, l, acc


def _weights_and_grads(g, s, visible, lse, keep, dout, v, delta):
  """A tile's dropped weights and logit gradients p ⊙ (keep ⊙ dp / (1 - rate) - δ),
  written as p_dropped ⊙ dp - p ⊙ δ as in the XLA path."""
  p = jnp.where(visible, jnp.exp(s - lse[:, None]), 0.0)
  p_dropped = xla_core.dropped(p, keep, g.rate)
  return p_dropped, p_dropped * dot_t(dout, v) - p * delta[:, None]


# --- kernels ------------------------------------------------------------------------

def forward_kernel(g: Geometry, has_slots: bool, lo_ref, hi_ref, first_ref, last_ref,
                   seeds_ref, qu_ref, qv_ref, k_ref, v_ref, r_ref, *refs):
  """Outputs and log-normalisers of one block of queries; grid (head, batch, block)."""
  if has_slots:
    qp_ref, pk_ref, pv_ref, out_ref, lse_ref, scratch_ref = refs
  else:
    out_ref, lse_ref, scratch_ref = refs
  h, b, ib = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, i0 = g.rows, ib * g.rows
  qu, qv = qu_ref[...], qv_ref[...]
  lo, hi = lo_ref[...], hi_ref[...]

  def context_step(jb, carry):
    j0 = jb * rows
    s = _context_logits(g, qu, qv, k_ref[pl.ds(j0, rows), :], r_ref, scratch_ref, i0, j0)
    keep = _keep(g, seeds_ref, 0, h, b, i0, j0, rows, g.k)
    return _online_softmax_step(g, carry, s, _visible(lo, hi, j0, rows), keep,
                                v_ref[pl.ds(j0, rows), :])

  carry = (jnp.full((rows,), -jnp.inf, _F32), jnp.zeros((rows,), _F32),
           jnp.zeros((rows, g.dh_pad), _F32))
  carry = jax.lax.fori_loop(first_ref[ib], last_ref[ib] + 1, context_step, carry)
  if has_slots:
    qp = qp_ref[...]

    def slot_step(nb, carry):
      n0 = nb * g.slots
      s = dot_t(qp, pk_ref[pl.ds(n0, g.slots), :])
      keep = _keep(g, seeds_ref, 1, h, b, i0, n0, g.slots, g.n)
      return _online_softmax_step(g, carry, s, _real_slots(g, n0), keep,
                                  pv_ref[pl.ds(n0, g.slots), :])

    carry = jax.lax.fori_loop(0, g.n_blocks, slot_step, carry)
  m, l, acc = carry
  out_ref[...] = (acc / l[:, None]).astype(out_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def query_grads_kernel(g: Geometry, has_slots: bool, lo_ref, hi_ref, first_ref,
                       last_ref, seeds_ref, qu_ref, qv_ref, k_ref, v_ref, r_ref, lse_ref,
                       delta_ref, dout_ref, *refs):
  """Gradients of one block of queries (qu, qv, qp) and its share of the position
  table's: grid (head, batch, block).

  Key block jb's window starts `rows` table rows after key block jb-1's, so the upper
  half of one is the lower half of the next: the share is k_blocks + 1 blocks of
  `rows` table rows, block jb the lower half of key block jb's gradient plus the
  upper half of key block jb-1's, written once each (zeros where no tile reaches).
  """
  if has_slots:
    qp_ref, pk_ref, pv_ref, dqu_ref, dqv_ref, dqp_ref, dr_ref, scratch_ref = refs
  else:
    dqu_ref, dqv_ref, dr_ref, scratch_ref = refs
  h, b, ib = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, i0, dtype = g.rows, ib * g.rows, qu_ref.dtype
  qu, qv, dout = qu_ref[...], qv_ref[...], dout_ref[...]
  lo, hi, lse, delta = lo_ref[...], hi_ref[...], lse_ref[...], delta_ref[...]
  first, last = first_ref[ib], last_ref[ib]
  zero_block = jnp.zeros((rows, g.dh_pad), _F32)

  def store_table_grads(u, value):
    dr_ref[pl.ds(u * rows, rows), :] = value

  def zero_fill(u, carry):
    store_table_grads(u, zero_block)
    return carry

  def context_step(jb, carry):
    dqu, dqv, upper = carry
    j0 = jb * rows
    k, v = k_ref[pl.ds(j0, rows), :], v_ref[pl.ds(j0, rows), :]
    s = _context_logits(g, qu, qv, k, r_ref, scratch_ref, i0, j0)
    keep = _keep(g, seeds_ref, 0, h, b, i0, j0, rows, g.k)
    _, ds = _weights_and_grads(g, s, _visible(lo, hi, j0, rows), lse, keep, dout, v,
                               delta)
    ds_lower, ds_upper = (x.astype(dtype) for x in _unshift_rows(ds, scratch_ref, g))
    start = g.window_start(i0, j0)
    dqv = (dqv + dot(ds_lower, r_ref[pl.ds(start, rows), :])
           + dot(ds_upper, r_ref[pl.ds(start + rows, rows), :]))
    store_table_grads(jb, upper + t_dot(ds_lower, qv))
    return dqu + dot(ds.astype(dtype), k), dqv, t_dot(ds_upper, qv)

  jax.lax.fori_loop(0, first, zero_fill, 0)
  dqu, dqv, upper = jax.lax.fori_loop(first, last + 1, context_step,
                                      (zero_block, zero_block, zero_block))
  store_table_grads(last + 1, upper)
  jax.lax.fori_loop(last + 2, g.k_blocks + 1, zero_fill, 0)
  dqu_ref[...] = dqu.astype(dqu_ref.dtype)
  dqv_ref[...] = dqv.astype(dqv_ref.dtype)
  if has_slots:
    qp = qp_ref[...]

    def slot_step(nb, dqp):
      n0 = nb * g.slots
      pk = pk_ref[pl.ds(n0, g.slots), :]
      keep = _keep(g, seeds_ref, 1, h, b, i0, n0, g.slots, g.n)
      _, ds = _weights_and_grads(g, dot_t(qp, pk), _real_slots(g, n0), lse, keep, dout,
                                 pv_ref[pl.ds(n0, g.slots), :], delta)
      return dqp + dot(ds.astype(dtype), pk)

    dqp = jax.lax.fori_loop(0, g.n_blocks, slot_step, zero_block)
    dqp_ref[...] = dqp.astype(dqp_ref.dtype)


def context_kv_grads_kernel(g: Geometry, lo_ref, hi_ref, first_ref, last_ref, seeds_ref,
                            qu_ref, qv_ref, k_ref, v_ref, r_ref, lse_ref, delta_ref,
                            dout_ref, dk_ref, dv_ref, scratch_ref):
  """Gradients of one block of context keys and values, over the query blocks that
  see it: grid (head, batch, key block)."""
  h, b, jb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, j0, dtype = g.rows, jb * g.rows, qu_ref.dtype
  k, v = k_ref[...], v_ref[...]

  def query_step(ib, carry):
    dk, dv = carry
    i0 = ib * rows
    block = pl.ds(i0, rows)
    qu, dout = qu_ref[block, :], dout_ref[block, :]
    s = _context_logits(g, qu, qv_ref[block, :], k, r_ref, scratch_ref, i0, j0)
    keep = _keep(g, seeds_ref, 0, h, b, i0, j0, rows, g.k)
    visible = _visible(lo_ref[block], hi_ref[block], j0, rows)
    p_dropped, ds = _weights_and_grads(g, s, visible, lse_ref[block], keep, dout, v,
                                       delta_ref[block])
    return (dk + t_dot(ds.astype(dtype), qu), dv + t_dot(p_dropped.astype(dtype), dout))

  zero = jnp.zeros((rows, g.dh_pad), _F32)
  dk, dv = jax.lax.fori_loop(first_ref[jb], last_ref[jb] + 1, query_step, (zero, zero))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def slot_grads_kernel(g: Geometry, seeds_ref, qp_ref, pk_ref, pv_ref, lse_ref, delta_ref,
                      dout_ref, dpk_ref, dpv_ref):
  """Gradients of one block of persistent keys and values from `batch_block` batch
  rows (summed over the batch outside): grid (head, slot block, batch block)."""
  h, nb, bb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, n0, dtype = g.rows, nb * g.slots, qp_ref.dtype
  pk, pv = pk_ref[...], pv_ref[...]
  visible = _real_slots(g, n0)

  def query_step(step, carry):
    dpk, dpv = carry
    bi, ib = jax.lax.div(step, g.q_blocks), jax.lax.rem(step, g.q_blocks)
    i0 = ib * rows
    block = pl.ds(i0, rows)
    qp, dout = qp_ref[bi, block, :], dout_ref[bi, block, :]
    keep = _keep(g, seeds_ref, 1, h, bb * g.batch_block + bi, i0, n0, g.slots, g.n)
    p_dropped, ds = _weights_and_grads(g, dot_t(qp, pk), visible, lse_ref[bi, block],
                                       keep, dout, pv, delta_ref[bi, block])
    return (dpk + t_dot(ds.astype(dtype), qp), dpv + t_dot(p_dropped.astype(dtype), dout))

  zero = jnp.zeros((g.slots, g.dh_pad), _F32)
  dpk, dpv = jax.lax.fori_loop(0, g.batch_block * g.q_blocks, query_step, (zero, zero))
  dpk_ref[...] = dpk
  dpv_ref[...] = dpv
