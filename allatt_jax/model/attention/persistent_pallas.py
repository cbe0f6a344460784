"""The split core's persistent part as Pallas flash kernels (persistent_impl='pallas').

The persistent part is plain attention of every query of a head (the B·T rows of the
batch, flattened: the slots are shared by every row) against that head's N slots: no
position term, no shift, no mask but the slot weights. Three kernels, each program a
tile of `rows` queries by `slots` slots at a time, none keeping a (rows, N) array:

- forward, grid (head, query tile): an online softmax over the slot tiles, with the
  weighted sum of values; writes each row's (acc, m, l) (persistent_cores.py);
- query gradients, grid (head, query tile): over the slot tiles, given the merged
  softmax's shift m, sum l and δ;
- slot gradients, grid (head, slot tile, chunk of query tiles): the key, value and
  slot-weight gradients of one slot tile from a chunk of the queries, the chunks'
  shares summed by XLA.

Dropout draws the XLA core's mask in registers (dropout_mask.py): a tile reads the
seeds of its rows and of its slots (a word each) and hashes each weight's pair, so
no mask is stored or gathered. Slot weights are a slot's factor on its exponential
(0: closed, also for the padding slots); a closed slot's exponent is capped at 80 as
in the XLA core. Off the GPU the kernels run in Pallas' interpreter. A jaxlib without
Pallas' Triton backend still imports this module: `unavailable` says why it cannot run.
"""
import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from allatt_jax.model.attention import dropout_mask
from allatt_jax.model.attention import xla_core

try:   # a jaxlib built without Triton lacks it; the model must import all the same
  from jax.experimental.pallas import triton as plgpu
  _TRITON_MISSING = None
except ImportError as e:
  plgpu = None
  _TRITON_MISSING = f"{type(e).__name__}: {e}"

_F32 = jnp.float32


def unavailable() -> str | None:
  """Why this jax cannot run these kernels whatever the device (None: it can)."""
  if _TRITON_MISSING:
    return f"this jaxlib lacks Pallas' Triton backend ({_TRITON_MISSING})"
  return None


@dataclasses.dataclass(frozen=True)
class Tiles:
  """`rows` queries by `slots` slots per tile, at most `chunks` programs along the queries for each slot tile's gradients; `warps` per
  program of the forward and query-gradient kernels, `slot_warps` of the
  slot-gradient kernel, and `stages` of Triton's software pipeline. The defaults are
  untuned: launch/gpu_check.sh times others beside them."""
  rows: int = 64
  slots: int = 64
  chunks: int = 4
  warps: int = 4
  slot_warps: int = 8
  stages: int = 2

  def __str__(self):
    return (f"{self.rows}x{self.slots} warps {self.warps}/{self.slot_warps} "
            f"stages {self.stages}")


@dataclasses.dataclass(frozen=True)
class _Geometry:
  m: int                 # query rows: B·T
  n: int                 # slots
  dh: int
  tiles: Tiles
  rate: float
  weighted: bool         # slot weights given: their gradient is wanted
  interpret: bool

  def _pad(self, size, multiple):
    return -(-size // multiple) * multiple

  @property
  def m_pad(self):
    return self._pad(self.m, self.tiles.rows)

  @property
  def n_pad(self):
    return self._pad(self.n, self.tiles.slots)

  @property
  def dh_pad(self):
    return max(16, 1 << (self.dh - 1).bit_length())

  @property
  def q_tiles(self):
    return self.m_pad // self.tiles.rows

  @property
  def n_tiles(self):
    return self.n_pad // self.tiles.slots

  @property
  def chunks(self):
    return xla_core.divisor_at_most(self.q_tiles, self.tiles.chunks)


# Tile products, accumulated in float32 whatever the tiles' dtype.

def _dot(a, b):      # a @ b
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _dot_t(a, b):    # a @ b.T
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _t_dot(a, b):    # a.T @ b
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def _keep(g: _Geometry, row_ref, rows, column_ref, columns):
  """The keep mask of a tile, hashed in registers from the seeds of its rows and its
  slots (slices of the blocks' seeds); None without dropout."""
  if not g.rate:
    return None
  return dropout_mask.kept(row_ref[rows][:, None], column_ref[columns][None, :], g.rate)


def _refs(g: _Geometry, refs):
  """q, pk, pv, w, the row and column seeds (None without dropout), then the rest."""
  q_ref, pk_ref, pv_ref, w_ref, *rest = refs
  row_ref = column_ref = None
  if g.rate:
    row_ref, column_ref, *rest = rest
  return q_ref, pk_ref, pv_ref, w_ref, row_ref, column_ref, rest


def _forward_kernel(g: _Geometry, *refs):
  q_ref, pk_ref, pv_ref, w_ref, row_ref, column_ref, (acc_ref, top_ref, norm_ref) = _refs(
      g, refs)
  q, rows, slots = q_ref[...], g.tiles.rows, g.tiles.slots

  def step(nb, carry):
    m, l, acc = carry
    n0 = nb * slots
    s = _dot_t(q, pk_ref[pl.ds(n0, slots), :])
    w = w_ref[pl.ds(n0, slots)][None, :]
    m_next = jnp.maximum(m, jnp.where(w > 0, s, xla_core.NEG_INF).max(axis=1))
    correction = jnp.exp(m - m_next)
    e = jnp.exp(jnp.minimum(s - m_next[:, None], xla_core.MAX_EXPONENT)) * w
    l = l * correction + e.sum(axis=1)
    keep = _keep(g, row_ref, pl.ds(0, rows), column_ref, pl.ds(n0, slots))
    e = xla_core.dropped(e, keep, g.rate)
    pv = pv_ref[pl.ds(n0, slots), :]
    return m_next, l, acc * correction[:, None] + _dot(e.astype(pv.dtype), pv)

  m, l, acc = jax.lax.fori_loop(0, g.n_tiles, step, (
      jnp.full((rows,), -jnp.inf, _F32), jnp.zeros((rows,), _F32),
      jnp.zeros((rows, g.dh_pad), _F32)))
  acc_ref[...] = acc
  top_ref[...] = m
  norm_ref[...] = l


def _grads(g, q, pk, pv, keep, top, inv_norm, delta, dout):
  """A tile's dropped weights before the slot weights, and their logits' gradients."""
  q_n = (jnp.exp(jnp.minimum(_dot_t(q, pk) - top[:, None], xla_core.MAX_EXPONENT))
         * inv_norm[:, None])
  q_dropped = xla_core.dropped(q_n, keep, g.rate)
  return q_dropped, q_dropped * _dot_t(dout, pv) - q_n * delta[:, None]


def _query_grads_kernel(g: _Geometry, *refs):
  q_ref, pk_ref, pv_ref, w_ref, row_ref, column_ref, rest = _refs(g, refs)
  top_ref, norm_ref, delta_ref, dout_ref, dq_ref = rest
  q, dout, top, delta = q_ref[...], dout_ref[...], top_ref[...], delta_ref[...]
  inv_norm = 1.0 / norm_ref[...]
  rows, slots = g.tiles.rows, g.tiles.slots

  def step(nb, dq):
    n0 = nb * slots
    pk = pk_ref[pl.ds(n0, slots), :]
    keep = _keep(g, row_ref, pl.ds(0, rows), column_ref, pl.ds(n0, slots))
    _, dlog_q = _grads(g, q, pk, pv_ref[pl.ds(n0, slots), :], keep, top, inv_norm, delta,
                       dout)
    ds = dlog_q * w_ref[pl.ds(n0, slots)][None, :]
    return dq + _dot(ds.astype(pk.dtype), pk)

  dq = jax.lax.fori_loop(0, g.n_tiles, step, jnp.zeros((g.tiles.rows, g.dh_pad), _F32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _slot_grads_kernel(g: _Geometry, *refs):
  q_ref, pk_ref, pv_ref, w_ref, row_ref, column_ref, rest = _refs(g, refs)
  top_ref, norm_ref, delta_ref, dout_ref, dpk_ref, dpv_ref, *dpw_ref = rest
  pk, pv, w = pk_ref[...], pv_ref[...], w_ref[...][None, :]
  rows, slots, dtype = g.tiles.rows, g.tiles.slots, pk_ref.dtype

  def step(i, carry):
    dpk, dpv, dpw = carry
    block = pl.ds(i * rows, rows)
    q, dout = q_ref[block, :], dout_ref[block, :]
    keep = _keep(g, row_ref, block, column_ref, pl.ds(0, slots))
    q_dropped, dlog_q = _grads(g, q, pk, pv, keep, top_ref[block], 1.0 / norm_ref[block],
                               delta_ref[block], dout)
    return (dpk + _t_dot((dlog_q * w).astype(dtype), q),
            dpv + _t_dot((q_dropped * w).astype(dtype), dout),
            dpw + dlog_q.sum(axis=0))

  zero = jnp.zeros((slots, g.dh_pad), _F32)
  dpk, dpv, dpw = jax.lax.fori_loop(0, g.q_tiles // g.chunks, step,
                                    (zero, zero, jnp.zeros((slots,), _F32)))
  dpk_ref[...] = dpk
  dpv_ref[...] = dpv
  if g.weighted:
    dpw_ref[0][...] = dpw


def _call(kernel, g: _Geometry, grid, in_specs, out_specs, out_shape, name, warps):
  """A pallas_call of one kernel with `warps` per program. At the default tiles, head
  size 64, bf16 with dropout, ptxas (Triton 3.9, sm_90a) gives the forward and query
  gradient kernels 128 and 165 registers at 4 warps, the slot gradients' 229 at 8
  warps, no spills (`python -m allatt_jax.perf.gpu_compile`; docs/performance.md)."""
  params = (None if plgpu is None
            else plgpu.CompilerParams(num_warps=warps, num_stages=g.tiles.stages))
  return pl.pallas_call(
      functools.partial(kernel, g), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=g.interpret, name=name, compiler_params=params)


def _geometry(qp, pk, pw, rate, tiles, interpret) -> _Geometry:
  h, b, t, dh = qp.shape
  return _Geometry(m=b * t, n=pk.shape[1], dh=dh, tiles=tiles or Tiles(), rate=float(rate),
                   weighted=pw is not None,
                   interpret=jax.default_backend() != "gpu" if interpret is None else interpret)


def _padded(g: _Geometry, qp, pk, pv, pw, row_seeds, column_seeds, *rows_H):
  """Queries, their row seeds (and `rows_H`: per-row arrays) as (H, m_pad, ...), slots
  as (H, n_pad, ...) and their seeds as (n_pad,), the head size as dh_pad; the slot
  weights, 0 on the padding slots."""
  h = qp.shape[0]

  def pad(x, *sizes):
    widths = [(0, s - d) for s, d in zip(sizes, x.shape)]
    return jnp.pad(x, widths)

  per_row = lambda x: pad(x.reshape(h, g.m, *x.shape[3:]), h, g.m_pad,
                          *((g.dh_pad,) if x.ndim == 4 else ()))
  w = jnp.ones((h, g.n), _F32) if pw is None else pw.astype(_F32)
  return (per_row(qp), pad(pk, h, g.n_pad, g.dh_pad), pad(pv, h, g.n_pad, g.dh_pad),
          pad(w, h, g.n_pad), None if row_seeds is None else per_row(row_seeds),
          None if column_seeds is None else pad(column_seeds, g.n_pad),
          *map(per_row, rows_H))


def _row_specs(g: _Geometry):
  """Specs of q, pk, pv, w and the seeds (with dropout) for a grid (head, query tile)."""
  rows, d = g.tiles.rows, g.dh_pad
  specs = [pl.BlockSpec((None, rows, d), lambda h, i: (h, i, 0)),
           pl.BlockSpec((None, g.n_pad, d), lambda h, i: (h, 0, 0)),
           pl.BlockSpec((None, g.n_pad, d), lambda h, i: (h, 0, 0)),
           pl.BlockSpec((None, g.n_pad), lambda h, i: (h, 0))]
  if g.rate:
    specs += [pl.BlockSpec((None, rows), lambda h, i: (h, i)),
              pl.BlockSpec((g.n_pad,), lambda h, i: (0,))]
  return specs


def forward(qp, pk, pv, pw, row_seeds, column_seeds, *, rate, tiles: Tiles | None = None,
            interpret: bool | None = None):
  """(acc (H, B, T, dh), m, l (H, B, T)), float32, of the persistent part
  (persistent_cores.py); the seeds: dropout_mask's (None without dropout).
  `interpret`: Pallas' interpreter (default: off the GPU)."""
  g = _geometry(qp, pk, pw, rate, tiles, interpret)
  h, b, t, dh = qp.shape
  args = [x for x in _padded(g, qp, pk, pv, pw, row_seeds, column_seeds) if x is not None]
  rows = g.tiles.rows
  stats = pl.BlockSpec((None, rows), lambda h, i: (h, i))
  stats_shape = jax.ShapeDtypeStruct((h, g.m_pad), _F32)
  acc, top, norm = _call(
      _forward_kernel, g, (h, g.q_tiles), _row_specs(g),
      [pl.BlockSpec((None, rows, g.dh_pad), lambda h, i: (h, i, 0)), stats, stats],
      [jax.ShapeDtypeStruct((h, g.m_pad, g.dh_pad), _F32), stats_shape, stats_shape],
      "allatt_persistent_forward", g.tiles.warps)(*args)
  rows_of = lambda x: x[:, :g.m].reshape(h, b, t, *x.shape[2:])
  return rows_of(acc[..., :dh]), rows_of(top), rows_of(norm)


def backward(qp, pk, pv, pw, row_seeds, column_seeds, top, norm, delta, dout, *, rate,
             tiles: Tiles | None = None, interpret: bool | None = None):
  """(dqp, dpk, dpv, dpw or None) given the merged softmax's shift `top`, sum `norm`
  and δ (H, B, T)."""
  g = _geometry(qp, pk, pw, rate, tiles, interpret)
  h, b, t, dh = qp.shape
  # Padding rows get a sum of 1 (their gradients are 0: their dout and δ are).
  *slot_args, top_, norm_, delta_, dout_ = _padded(g, qp, pk, pv, pw, row_seeds,
                                                   column_seeds, top, norm, delta, dout)
  norm_ = norm_.at[:, g.m:].set(1.0)
  slot_args = [x for x in slot_args if x is not None]
  rows, d, slots = g.tiles.rows, g.dh_pad, g.tiles.slots
  stats = pl.BlockSpec((None, rows), lambda h, i: (h, i))
  queries = pl.BlockSpec((None, rows, d), lambda h, i: (h, i, 0))
  dq = _call(_query_grads_kernel, g, (h, g.q_tiles),
             _row_specs(g) + [stats] * 3 + [queries], queries,
             jax.ShapeDtypeStruct(slot_args[0].shape, qp.dtype),
             "allatt_persistent_query_grads", g.tiles.warps)(
                 *slot_args, top_, norm_, delta_, dout_)

  # Grid (head, slot tile, chunk): each program a slot tile against a chunk of queries.
  chunk = g.m_pad // g.chunks
  chunk_rows = pl.BlockSpec((None, chunk, d), lambda h, s, c: (h, c, 0))
  chunk_stats = pl.BlockSpec((None, chunk), lambda h, s, c: (h, c))
  slot_tile = pl.BlockSpec((None, slots, d), lambda h, s, c: (h, s, 0))
  in_specs = [chunk_rows, slot_tile, slot_tile,
              pl.BlockSpec((None, slots), lambda h, s, c: (h, s))]
  if g.rate:
    in_specs += [chunk_stats, pl.BlockSpec((slots,), lambda h, s, c: (s,))]
  share = pl.BlockSpec((None, None, slots, d), lambda h, s, c: (h, c, s, 0))
  shares = jax.ShapeDtypeStruct((h, g.chunks, g.n_pad, d), _F32)
  out_specs, out_shape = [share, share], [shares, shares]
  if g.weighted:
    out_specs.append(pl.BlockSpec((None, None, slots), lambda h, s, c: (h, c, s)))
    out_shape.append(jax.ShapeDtypeStruct((h, g.chunks, g.n_pad), _F32))
  dpk, dpv, *dpw = _call(
      _slot_grads_kernel, g, (h, g.n_tiles, g.chunks),
      in_specs + [chunk_stats] * 3 + [chunk_rows], out_specs, out_shape,
      "allatt_persistent_slot_grads", g.tiles.slot_warps)(*slot_args, top_, norm_, delta_,
                                                           dout_)
  slots_of = lambda x: x.sum(1)[:, :g.n]
  return (dq[:, :g.m, :dh].reshape(h, b, t, dh), slots_of(dpk)[..., :dh].astype(pk.dtype),
          slots_of(dpv)[..., :dh].astype(pv.dtype),
          slots_of(dpw[0]).astype(pw.dtype) if g.weighted else None)
