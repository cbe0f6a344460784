"""The split attention core (`model.attention_impl='split'`): the softmax over [context
keys, persistent slots] as two partial softmaxes merged by their log-sum-exps.

What `xla_core.attend` computes, in two parts. The context part (T + S keys:
relative positions, rel-shift, the causal mask and a stream start's empty memory) runs
in XLA as the XLA core scores it; the persistent part (N slots: no position term, no
shift, no mask, keys and values shared by every batch row; 84% of the scores at the
WikiText-103 benchmark's shape) runs through a pluggable implementation
(persistent_cores.py). Each part returns its log-sum-exp as flash attention's pair,
a shift m and the sum l of its exponentials (lse = m + log l), with its output before
the division by l, acc; the merge is exact, dropout included (each part's acc is its
own dropped exponentials times its values):

  m = max(m_ctx, m_pers),  l = l_ctx·exp(m_ctx − m) + l_pers·exp(m_pers − m)
  out = (acc_ctx·exp(m_ctx − m) + acc_pers·exp(m_pers − m)) / l

The backward pass (a hand-written `jax.custom_vjp`) hands each part the merged
softmax's statistics, (m, l) and δ = Σ out·dout, from which each yields its full
gradients (as flash, blockwise and ring attention do): the weights are exp(s − m)/l
and ∂L/∂s = p·(keep·dp/(1 − rate) − δ) in both parts. The pair rather than one lse:
exp(s − lse) errs by |lse| ulps, which made the split core's float32 gradients three
times further from a float64 reference than the XLA core's; with the pair they are
closer (tests/test_model_split_core.py).

Dropout: both parts draw the XLA core's masks (dropout_mask.py) where they use them;
the persistent part from the seeds of its rows and slots, hashed here once a step.
So the split core drops the weights the XLA core drops, under the same key.
"""
import functools

import jax
import jax.numpy as jnp

from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import dropout_mask
from allatt_jax.model.attention import core_choice


def attend(rate, head_block, remat, score_dtype, qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK,
           keys_2x2, pw=None, *, persistent: str = "auto"):
  """`xla_core.attend` (same arguments and result) as the split core, its
  persistent part `model.persistent_impl=persistent` (core_choice.persistent_part).

  head_block: heads per step of the context part's loop (and the XLA persistent
  part's). remat: recompute the context weights in the backward pass instead of
  keeping them (the persistent part keeps none: it recomputes them from (m, l)).
  Without persistent slots (pk None) this is the XLA core.
  """
  if pk is None:
    return xla_core.attend(rate, head_block, remat, score_dtype, qu, qv, qp, k, v,
                           r_pad, pk, pv, mask_TxK, keys_2x2, pw)
  part = core_choice.persistent_part(persistent, rate, pw is not None, qp.dtype,
                                     qp.shape[-1])
  row_seeds, column_seeds = ((dropout_mask.row_seeds(keys_2x2[1], *qp.shape[:3]),
                              dropout_mask.column_seeds(keys_2x2[1], pk.shape[1]))
                             if rate else (None, None))
  return _split(rate, head_block, remat, score_dtype, part, qu, qv, qp, k, v, r_pad, pk, pv,
                mask_TxK, keys_2x2, row_seeds, column_seeds, pw)


def _context_scores(qu, qv, k, r_pad, mask_TxK, score_dtype):
  """The context logits in float32, masked, as `xla_core._weights` scores them."""
  content = jnp.einsum("hbtd,hbkd->hbtk", qu, k, preferred_element_type=score_dtype)
  position = xla_core.rel_shift(jnp.einsum("hbtd,hkd->hbtk", qv, r_pad,
                                           preferred_element_type=score_dtype))
  return jnp.where(mask_TxK, content.astype(jnp.float32) + position.astype(jnp.float32),
                   xla_core.NEG_INF)


def _context_forward(rate, score_dtype, keep_weights, mask_TxK, keys_2x2, first_head, qu,
                     qv, k, v, r_pad):
  """One block of heads' context part alone: (acc, m, l) (float32) and, with
  `keep_weights`, its softmax weights (in `score_dtype`)."""
  s = _context_scores(qu, qv, k, r_pad, mask_TxK, score_dtype)
  top = s.max(-1, keepdims=True)
  e = jnp.exp(s - top)
  norm = e.sum(-1)
  keep = xla_core.keep_masks(keys_2x2, e, None, rate, first_head)[0]
  acc = jnp.einsum("hbtk,hbkd->hbtd", xla_core.dropped(e, keep, rate).astype(v.dtype),
                   v, preferred_element_type=jnp.float32)
  p = (e * (1.0 / norm[..., None])).astype(score_dtype) if keep_weights else None
  return acc, top[..., 0], norm, p


def _context_backward(rate, score_dtype, mask_TxK, keys_2x2, first_head, qu, qv, k, v, r_pad,
                      p_ctx, share_ctx, top, norm, out, dout):
  """One block of heads' context gradients (dqu, dqv, dk, dv, dr_pad) under the merged
  softmax (shift `top`, sum `norm`): its weights exp(s − top)/norm, recomputed or from
  the kept ones (p_ctx, of the context alone, times its share of the merged sum),
  through the XLA core's backward pass."""
  if p_ctx is None:
    # Tied to dout, as in the XLA core: no merging with the forward pass's scores.
    qu, qv, k, r_pad, top, dout = jax.lax.optimization_barrier((qu, qv, k, r_pad, top, dout))
    s = _context_scores(qu, qv, k, r_pad, mask_TxK, score_dtype)
    p = jnp.exp(s - top[..., None]) * (1.0 / norm[..., None])
  else:
    p = p_ctx.astype(jnp.float32) * share_ctx[..., None]
  dqu, dqv, _, dk, dv, dr_pad, *_ = xla_core.block_backward(
      rate, score_dtype, mask_TxK, keys_2x2, first_head, qu, qv, None, k, v, r_pad, None,
      None, None, p.astype(score_dtype), None, out, dout)
  return dqu, dqv, dk, dv, dr_pad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _split(rate, head_block, remat, score_dtype, part, qu, qv, qp, k, v, r_pad, pk, pv,
           mask_TxK, keys_2x2, row_seeds, column_seeds, pw):
  return _split_fwd(rate, head_block, remat, score_dtype, part, qu, qv, qp, k, v, r_pad, pk,
                    pv, mask_TxK, keys_2x2, row_seeds, column_seeds, pw)[0]


def _split_fwd(rate, head_block, remat, score_dtype, part, qu, qv, qp, k, v, r_pad, pk, pv,
               mask_TxK, keys_2x2, row_seeds, column_seeds, pw):
  context = functools.partial(_context_forward, rate, score_dtype, not remat, mask_TxK,
                              keys_2x2)
  acc_ctx, top_ctx, norm_ctx, p_ctx = xla_core.over_head_blocks(
      context, head_block, qu, qv, k, v, r_pad)
  acc_pers, top_pers, norm_pers = part.forward(rate, head_block, score_dtype, qp, pk, pv, pw,
                                               row_seeds, column_seeds)
  top = jnp.maximum(top_ctx, top_pers)
  scale_ctx, scale_pers = jnp.exp(top_ctx - top), jnp.exp(top_pers - top)
  norm = norm_ctx * scale_ctx + norm_pers * scale_pers
  inv_norm = 1.0 / norm
  out = ((acc_ctx * (scale_ctx * inv_norm)[..., None]
          + acc_pers.astype(jnp.float32) * (scale_pers * inv_norm)[..., None]).astype(v.dtype))
  # The kept context weights' share of the merged sum (the backward pass's factor).
  share_ctx = None if p_ctx is None else norm_ctx * scale_ctx * inv_norm
  return out, (qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, keys_2x2, row_seeds, column_seeds,
               pw, p_ctx, share_ctx, top, norm, out)


def _split_bwd(rate, head_block, remat, score_dtype, part, residuals, dout):
  del remat   # the residuals say whether the context weights were kept
  (qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK, keys_2x2, row_seeds, column_seeds, pw, p_ctx,
   share_ctx, top, norm, out) = residuals
  context = functools.partial(_context_backward, rate, score_dtype, mask_TxK, keys_2x2)
  dqu, dqv, dk, dv, dr_pad = xla_core.over_head_blocks(
      context, head_block, qu, qv, k, v, r_pad, p_ctx, share_ctx, top, norm, out, dout)
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  dqp, dpk, dpv, dpw = part.backward(rate, head_block, score_dtype, qp, pk, pv, pw, row_seeds,
                                     column_seeds, top, norm, delta, out, dout)
  cast = lambda grad, like: grad.astype(like.dtype)
  return (cast(dqu, qu), cast(dqv, qv), cast(dqp, qp), cast(dk, k), cast(dv, v),
          cast(dr_pad, r_pad), cast(dpk, pk), cast(dpv, pv), None, None, None, None,
          None if pw is None else cast(dpw, pw))


_split.defvjp(_split_fwd, _split_bwd)
