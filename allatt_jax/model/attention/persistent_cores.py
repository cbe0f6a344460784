"""The persistent part of the split core (split_core.py), in three implementations:
'xla' (the reference, plain jnp, runs anywhere), 'pallas' (flash kernels,
persistent_pallas.py) and 'cudnn' (the vendor's fused attention, persistent_cudnn.py);
which one a layer runs, `model.persistent_impl`, is core_choice.py's.

A part scores queries qp (H, B, T, dh) against their head's N persistent slots (keys
pk and values pv (H, N, dh), shared by every batch row; no position term, no shift, no
mask), with slot weights pw (H, N) or None (every slot at 1) and the dropout mask's
seeds (dropout_mask.py: row_seeds (H, B, T) and column_seeds (N,) of the layer's
persistent key, from which each part draws the same mask; None: no dropout):

  forward  -> (acc, m, l), float32: the log-sum-exp log Σ_n w_n·exp(s_n) as a shift m
              (H, B, T) and the sum l = Σ_n w_n·exp(s_n − m), and the output before
              its division by l, acc = Σ_n w_n·exp(s_n − m)·keep_n/(1 − rate)·pv_n
              (H, B, T, dh). Every slot closed: l = 0, acc = 0.
  backward -> (dqp, dpk, dpv, dpw) under the merged softmax, given its shift m and
              sum l, δ = Σ out·dout and out, dout (H, B, T, dh): the weights are
              w_n·q_n, q_n = exp(s_n − m)/l, and
              ∂L/∂s_n = w_n·q_n·(keep_n·dp_n/(1 − rate) − δ).

As in the XLA core, a closed slot's exponent is capped at 80, so w·exp is 0, not 0·inf.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp

from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import dropout_mask
from allatt_jax.model.attention import persistent_cudnn
from allatt_jax.model.attention import persistent_pallas


@dataclasses.dataclass(frozen=True)
class Part:
  """One implementation of the persistent part: `forward` and `backward` as the
  module's docstring says, `head_block` heads per step where the part loops; `tiles`:
  the Pallas kernels' (None: their default)."""
  name: str
  tiles: persistent_pallas.Tiles | None = None

  def forward(self, rate, head_block, score_dtype, qp, pk, pv, pw, row_seeds, column_seeds):
    if self.name == "xla":
      fn = functools.partial(_xla_forward, rate, score_dtype, column_seeds)
      return xla_core.over_head_blocks(lambda _, *a: fn(*a), head_block, qp, pk,
                                       pv, pw, row_seeds)
    forward = (functools.partial(persistent_pallas.forward, rate=rate, tiles=self.tiles)
               if self.name == "pallas" else persistent_cudnn.forward)
    return _per_shard(forward, False, qp, pk, pv, pw, row_seeds, column_seeds)

  def backward(self, rate, head_block, score_dtype, qp, pk, pv, pw, row_seeds, column_seeds,
               top, norm, delta, out, dout):
    if self.name == "xla":
      fn = functools.partial(_xla_backward, rate, score_dtype, column_seeds)
      return xla_core.over_head_blocks(lambda _, *a: fn(*a), head_block, qp, pk,
                                       pv, pw, row_seeds, top, norm, delta, dout)
    if self.name == "pallas":
      backward = lambda qp, pk, pv, pw, rows, columns, top, norm, delta, out, dout: (
          persistent_pallas.backward(qp, pk, pv, pw, rows, columns, top, norm, delta, dout,
                                     rate=rate, tiles=self.tiles))
    else:
      backward = lambda qp, pk, pv, pw, rows, columns, top, norm, delta, out, dout: (
          persistent_cudnn.backward(qp, pk, pv, top + jnp.log(norm), out, dout))
    return _per_shard(backward, True, qp, pk, pv, pw, row_seeds, column_seeds, top, norm,
                      delta, out, dout)


PARTS = {name: Part(name) for name in ("xla", "pallas", "cudnn")}


def _scores(qp, pk, score_dtype):
  return jnp.einsum("hbtd,hnd->hbtn", qp, pk,
                    preferred_element_type=score_dtype).astype(jnp.float32)


def _keep(rate, row_seeds, column_seeds):
  """The (H, B, T, N) keep mask of the seeds, or None without dropout."""
  return (None if row_seeds is None
          else dropout_mask.kept(row_seeds[..., None], column_seeds, rate))


def _xla_forward(rate, score_dtype, column_seeds, qp, pk, pv, pw, row_seeds):
  s = _scores(qp, pk, score_dtype)
  if pw is None:
    top = s.max(-1, keepdims=True)
    e = jnp.exp(s - top)
  else:   # the shift is the largest open slot's logit; a closed one's exp is capped
    w = xla_core.slot_axes(pw)
    top = jnp.where(w > 0, s, xla_core.NEG_INF).max(-1, keepdims=True)
    e = jnp.exp(jnp.minimum(s - top, xla_core.MAX_EXPONENT)) * w
  keep = _keep(rate, row_seeds, column_seeds)
  acc = jnp.einsum("hbtn,hnd->hbtd", xla_core.dropped(e, keep, rate).astype(pv.dtype),
                   pv, preferred_element_type=jnp.float32)
  return acc, top[..., 0], e.sum(-1)


def _xla_backward(rate, score_dtype, column_seeds, qp, pk, pv, pw, row_seeds, top, norm,
                  delta, dout):
  f32, dtype = jnp.float32, dout.dtype
  # Tied to dout, the scores' recomputation neither merges with the forward pass's
  # (which would keep them from forward to backward) nor runs before it is needed.
  qp, pk, pv, pw, dout = jax.lax.optimization_barrier((qp, pk, pv, pw, dout))
  exponent = _scores(qp, pk, score_dtype) - top[..., None]
  q = (jnp.exp(exponent if pw is None else jnp.minimum(exponent, xla_core.MAX_EXPONENT))
       * (1.0 / norm[..., None]))
  dp = jnp.einsum("hbtd,hnd->hbtn", dout, pv, preferred_element_type=score_dtype)
  keep = _keep(rate, row_seeds, column_seeds)
  q_dropped = xla_core.dropped(q, keep, rate)
  dlog_q = q_dropped * dp.astype(f32) - q * delta[..., None]
  dpw = None
  if pw is not None:   # the gradients of q_n's logit: w_n times those of p_n's
    dpw = dlog_q.sum((1, 2)).astype(pw.dtype)
    w = xla_core.slot_axes(pw)
    q_dropped, dlog_q = q_dropped * w, dlog_q * w
  pd, dlog = q_dropped.astype(dtype), dlog_q.astype(dtype)
  dpv = jnp.einsum("hbtd,hbtn->hdn", dout, pd).swapaxes(-1, -2)
  dqp = jnp.einsum("hbtn,hnd->hbtd", dlog, pk, preferred_element_type=f32).astype(dtype)
  dpk = jnp.einsum("hbtd,hbtn->hdn", qp, dlog).swapaxes(-1, -2)
  return dqp, dpk, dpv, dpw


def _per_shard(fn, backward: bool, qp, pk, pv, pw, row_seeds, column_seeds, *rows_rest):
  """fn on each shard of a mesh of several devices (heads over 'model', batch rows over
  'data'; the slot gradients summed over 'data'), or on the whole arrays: a kernel's
  call is not partitioned by XLA. The seeds are the whole layer's, so each shard
  draws its part of the layer's mask."""
  args = (qp, pk, pv, pw, row_seeds, column_seeds, *rows_rest)
  num_heads, batch = qp.shape[:2]
  mesh = jax.sharding.get_abstract_mesh()
  shards = {axis: mesh.shape.get(axis, 1) for axis in ("model", "data")}
  if (mesh.empty or mesh.size == 1 or num_heads % shards["model"]
      or batch % shards["data"]):
    return fn(*args)
  P = jax.sharding.PartitionSpec
  heads = "model" if "model" in mesh.shape else None
  rows = "data" if "data" in mesh.shape else None
  per_row, per_head = P(heads, rows), P(heads)
  in_specs = (per_row, per_head, per_head, per_head, per_row, P()) + (per_row,) * len(rows_rest)

  def local(*args):
    results = fn(*args)
    if backward and rows:
      dqp, *slot_grads = results
      return (dqp, *jax.lax.psum(tuple(slot_grads), rows))
    return results

  out_specs = (per_row, per_head, per_head, per_head) if backward else (per_row,) * 3
  # check_vma=False: kernel outputs carry no varying-axes types to check.
  return jax.shard_map(local, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def why_not_here(impl: str, dtype, head_dim: int) -> str | None:
  """Why `impl` cannot run on this process's default device for a model computing in
  `dtype` with heads of `head_dim` (None: it can)."""
  if impl == "pallas":
    if persistent_pallas.unavailable():
      return persistent_pallas.unavailable()
    if jax.default_backend() != "gpu":
      return (f"its kernels need a CUDA GPU (Pallas' Triton backend) and this process "
              f"runs on {jax.default_backend()}")
  if impl == "cudnn":
    return persistent_cudnn.why_not_here(dtype, head_dim)
  return None


def refusal(impl: str, rate: float, weighted: bool) -> str | None:
  """Why `impl` must not compute this part whatever the device (None: it may)."""
  if impl != "cudnn":
    return None
  if rate:
    return (f"cuDNN's attention dropout cannot follow the step's key, so its masks would "
            f"not be the XLA core's nor a resumed run's; it serves dropout-free work only "
            f"(attention dropout here: {rate})")
  if weighted:
    return ("cuDNN's attention cannot weight persistent slots by their gates "
            "(gates.persistent_group)")
  return None
