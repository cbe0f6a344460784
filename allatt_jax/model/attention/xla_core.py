"""The attention core: scores, softmax over context and persistent slots, dropout and
values, with a hand-written backward pass (`jax.custom_vjp`) that recomputes what the
forward need not keep and loops over blocks of heads, so the (B, H, T, K+N) weights of
all heads never sit in memory at once. Dropout masks are hashed from each weight's
place in each pass that uses them (dropout_mask.py), never stored.

Slot weights w_n in [0, 1] (`pw`, (H, N)) multiply a slot's exponential:
p_n = w_n·exp(s_n)/Z, Z summing the context's and the weighted slots' exponentials:
softmax over s_n + log w_n, a closed slot (w = 0) taking no mass, exactly as if absent.
With q_n = exp(s_n)/Z kept for the backward pass, ∂L/∂s_n = w_n·q_n·(dp_n − δ) and
∂L/∂w_n = q_n·(dp_n − δ), finite at w = 0 (what a straight-through gate needs to
reopen). The shift is the largest logit of the context and the open slots; a closed
slot's exponent is capped at 80, so w·exp is 0 rather than 0·inf.
"""
import functools

import jax
import jax.numpy as jnp

from allatt_jax.model.attention import dropout_mask

# A masked logit: finite, so that exp(masked - max) is exactly 0 (never inf - inf).
NEG_INF = -1e30
# The largest exponent of a closed slot's exp (float32 overflows above ~88.7).
MAX_EXPONENT = 80.0


def rel_shift(x_BxHxTxK1: jax.Array) -> jax.Array:
  """Re-indexes scores against a descending position table into query-key layout.

  Input: scores against relative distances K-1 .. 0 in columns 1..K, after a column
  of zeros (scores against a zero first row of the position table, so that the
  Transformer-XL pad is free). Query i sits at key position S+i = K-T+i, so its score
  for key j lives in column 1 + j + T-1-i. Dropping the first T entries of each
  flattened (T, K+1) block realigns every row at once; entries for future keys
  (j > S+i) become garbage, which the causal mask removes.
  """
  *lead, t, k1 = x_BxHxTxK1.shape
  return x_BxHxTxK1.reshape(*lead, t * k1)[..., t:].reshape(*lead, t, k1 - 1)


def _rel_unshift(g_BxHxTxK: jax.Array) -> jax.Array:
  """The transpose of `rel_shift`: cotangents back onto the padded (T, K+1) layout."""
  *lead, t, k = g_BxHxTxK.shape
  flat = jnp.pad(g_BxHxTxK.reshape(*lead, t * k), [(0, 0)] * len(lead) + [(t, 0)])
  return flat.reshape(*lead, t, k + 1)


def dropped(p, keep, rate):
  return p if keep is None else jnp.where(keep, p * (1.0 / (1.0 - rate)), 0.0)


def keep_masks(keys_2x2, p_ctx, p_pers, rate, first_head):
  if not rate:
    return None, None
  return (dropout_mask.keep_mask(keys_2x2[0], p_ctx.shape, rate, first_head),
          None if p_pers is None else dropout_mask.keep_mask(keys_2x2[1], p_pers.shape, rate,
                                                              first_head))


def _weights(qu, qv, qp, k, r_pad, pk, pw, mask_TxK, score_dtype):
  """The softmax over [context keys, persistent slots] without concatenating the two:
  (context weights, persistent weights before the slot weights `pw`).

  The scores leave their matmuls, and the weights their softmax, in `score_dtype`
  (matmuls accumulate in float32 either way); mask, max, exponentials and sums run in
  float32 inside the elementwise passes, which read and write only `score_dtype`.
  """
  f32 = jnp.float32
  content = jnp.einsum("hbtd,hbkd->hbtk", qu, k, preferred_element_type=score_dtype)
  position = rel_shift(jnp.einsum("hbtd,hkd->hbtk", qv, r_pad,
                                  preferred_element_type=score_dtype))
  ctx_HxBxTxK = jnp.where(mask_TxK, content.astype(f32) + position.astype(f32), NEG_INF)
  top = ctx_HxBxTxK.max(-1, keepdims=True)
  if pk is not None:
    pers_HxBxTxN = jnp.einsum("hbtd,hnd->hbtn", qp, pk,
                              preferred_element_type=score_dtype).astype(f32)
    if pw is None:
      top = jnp.maximum(top, pers_HxBxTxN.max(-1, keepdims=True))
    else:
      open_pers = jnp.where(slot_axes(pw) > 0, pers_HxBxTxN, NEG_INF)
      top = jnp.maximum(top, open_pers.max(-1, keepdims=True))
  e_ctx = jnp.exp(ctx_HxBxTxK - top)
  norm = e_ctx.sum(-1, keepdims=True)
  if pk is not None:
    if pw is None:
      e_pers = jnp.exp(pers_HxBxTxN - top)
      norm = norm + e_pers.sum(-1, keepdims=True)
    else:
      # Only a closed slot can lie above the shift; capped, its w·exp is 0, not NaN.
      e_pers = jnp.exp(jnp.minimum(pers_HxBxTxN - top, MAX_EXPONENT))
      norm = norm + (e_pers * slot_axes(pw)).sum(-1, keepdims=True)
  inv_norm = 1.0 / norm
  return ((e_ctx * inv_norm).astype(score_dtype),
          None if pk is None else (e_pers * inv_norm).astype(score_dtype))


def slot_axes(pw_HxN):
  """Slot weights (H, N) in float32, broadcast against (H, B, T, N)."""
  return pw_HxN[:, None, None, :].astype(jnp.float32)


def _slot_weighted(q_pers, pw, dtype):
  """The persistent weights p = w·q of weights `q_pers` before the slot weights."""
  if pw is None:
    return q_pers
  return (q_pers.astype(jnp.float32) * slot_axes(pw)).astype(dtype)


def attention_weights(qu, qv, qp, k, r_pad, pk, mask_TxK, score_dtype=jnp.float32,
                      pw=None):
  """The softmax weights over [context keys, persistent slots] (the latter weighted
  by the slot weights `pw`, when given), as the core computes them."""
  p_ctx, q_pers = _weights(qu, qv, qp, k, r_pad, pk, pw, mask_TxK, score_dtype)
  return p_ctx, None if pk is None else _slot_weighted(q_pers, pw, score_dtype)


def _block_forward(rate, score_dtype, mask_TxK, keys_2x2, first_head, qu, qv, qp, k, v,
                   r_pad, pk, pv, pw):
  """Outputs and softmax weights of one block of heads (the persistent ones before
  the slot weights `pw`)."""
  p_ctx, q_pers = _weights(qu, qv, qp, k, r_pad, pk, pw, mask_TxK, score_dtype)
  keep_ctx, keep_pers = keep_masks(keys_2x2, p_ctx, q_pers, rate, first_head)
  dtype = v.dtype
  out = jnp.einsum("hbtk,hbkd->hbtd", dropped(p_ctx, keep_ctx, rate).astype(dtype), v)
  if pv is not None:
    p_pers = _slot_weighted(q_pers, pw, score_dtype)
    out += jnp.einsum("hbtn,hnd->hbtd", dropped(p_pers, keep_pers, rate).astype(dtype), pv)
  return out, p_ctx, q_pers


def block_backward(rate, score_dtype, mask_TxK, keys_2x2, first_head, qu, qv, qp, k, v,
                   r_pad, pk, pv, pw, p_ctx, q_pers, out, dout):
  """Gradients of one block of heads' inputs (see `attend`).

  p_ctx and q_pers are the saved softmax weights (the persistent ones before the slot
  weights), or None to recompute them. The weights' gradients are computed in float32
  and stored, as the weights are, in `score_dtype`.
  """
  f32, dtype = jnp.float32, dout.dtype
  if p_ctx is None:
    # Tied to dout, the recomputation can neither merge with the forward pass's (CSE)
    # nor be scheduled before the backward pass reaches this layer.
    qu, qv, qp, k, r_pad, pk, pw, dout = jax.lax.optimization_barrier(
        (qu, qv, qp, k, r_pad, pk, pw, dout))
    p_ctx, q_pers = _weights(qu, qv, qp, k, r_pad, pk, pw, mask_TxK, score_dtype)
  keep_ctx, keep_pers = keep_masks(keys_2x2, p_ctx, q_pers, rate, first_head)
  # Σ_j p_j dp_j of the softmax backward equals Σ_d out_d dout_d (dropout included),
  # which avoids one more pass over the weights.
  delta = jnp.sum(dout.astype(f32) * out.astype(f32), -1, keepdims=True)

  def weight_grads(p, dp, keep, out_dtype=dtype):
    """The dropped weights, and the logits' gradient p ⊙ (keep ⊙ dp / (1 - rate) - δ).

    Written as p_dropped ⊙ dp - p ⊙ δ, it reads the mask only through p_dropped, which
    the value gradient needs anyway (XLA:CPU still recomputes the hash in both fusions).
    """
    p_dropped = dropped(p, keep, rate)
    dlogits = p_dropped.astype(f32) * dp.astype(f32) - p.astype(f32) * delta
    return p_dropped.astype(out_dtype), dlogits.astype(out_dtype)

  # Each product contracts a large weights array over its natural row-major axes;
  # the (.., dh, X) results are transposed afterwards, being small.
  pd_ctx, dlog_ctx = weight_grads(
      p_ctx, jnp.einsum("hbtd,hbkd->hbtk", dout, v, preferred_element_type=score_dtype),
      keep_ctx)
  dv = jnp.einsum("hbtd,hbtk->hbdk", dout, pd_ctx).swapaxes(-1, -2)
  dqu = jnp.einsum("hbtk,hbkd->hbtd", dlog_ctx, k, preferred_element_type=f32)
  dk = jnp.einsum("hbtd,hbtk->hbdk", qu, dlog_ctx).swapaxes(-1, -2)
  dpos = _rel_unshift(dlog_ctx)
  dqv = jnp.einsum("hbtk,hkd->hbtd", dpos, r_pad)
  dr_pad = jnp.einsum("hbtd,hbtk->hdk", qv, dpos).swapaxes(-1, -2)
  dqp = dpk = dpv = dpw = None
  if pk is not None:
    dp_pers = jnp.einsum("hbtd,hnd->hbtn", dout, pv, preferred_element_type=score_dtype)
    if pw is None:
      pd_pers, dlog_pers = weight_grads(q_pers, dp_pers, keep_pers)
    else:
      # The gradients of q_n's logit: w_n times those of p_n's (see the module's note).
      qd_pers, dlog_q = weight_grads(q_pers, dp_pers, keep_pers, f32)
      dpw = dlog_q.sum((1, 2)).astype(pw.dtype)
      pd_pers = (qd_pers * slot_axes(pw)).astype(dtype)
      dlog_pers = (dlog_q * slot_axes(pw)).astype(dtype)
    dpv = jnp.einsum("hbtd,hbtn->hdn", dout, pd_pers).swapaxes(-1, -2)
    dqp = jnp.einsum("hbtn,hnd->hbtd", dlog_pers, pk,
                     preferred_element_type=f32).astype(dtype)
    dpk = jnp.einsum("hbtd,hbtn->hdn", qp, dlog_pers).swapaxes(-1, -2)
  return dqu.astype(dtype), dqv, dqp, dk, dv, dr_pad, dpk, dpv, dpw


def over_head_blocks(fn, block: int, *arrays_H):
  """fn(first_head, *arrays) over blocks of `block` heads (axis 0), one after another.

  A loop keeps each block's (B, T, K + N) intermediates in cache, where one pass
  over all heads streams every elementwise pass through memory. None entries pass
  through.
  """
  num_heads = arrays_H[0].shape[0]
  if block >= num_heads:
    return fn(0, *arrays_H)
  split = lambda x: None if x is None else x.reshape(num_heads // block, block, *x.shape[1:])
  merge = lambda x: None if x is None else x.reshape(num_heads, *x.shape[2:])
  outputs = jax.lax.map(lambda xs: fn(xs[0] * block, *xs[1:]),
                        (jnp.arange(num_heads // block), *map(split, arrays_H)))
  return jax.tree.map(merge, outputs)


def attend(rate, head_block, remat, score_dtype, qu, qv, qp, k, v, r_pad, pk, pv, mask_TxK,
           keys_2x2, pw=None):
  """Relative attention with persistent slots on head-major arrays.

  Args:
    rate: attention dropout rate (0 = none).
    head_block: heads per step of the loop over heads (it must divide H).
    remat: recompute the softmax weights in the backward pass instead of keeping them.
    score_dtype: dtype of the scores and softmax weights in memory (`attention_weights`).
    qu, qv: (H, B, T, dh) queries plus the content / position bias, pre-scaled.
    qp: (H, B, T, dh) the queries of the persistent logits, pre-scaled (qp may be qu).
    k, v: (H, B, K, dh) context keys and values.
    r_pad: (H, K+1, dh) projected relative positions for distances K-1..0 after a
      zero row (see `rel_shift`).
    pk, pv: (H, N, dh) persistent keys and values, or None.
    mask_TxK: which keys each query may see.
    keys_2x2: uint32 key words of the context and persistent dropout masks.
    pw: (H, N) slot weights in [0, 1] (0: the slot takes no mass; the module's note),
      differentiable; None: every slot at weight 1.

  Returns:
    (H, B, T, dh) attention outputs.

  Head-major so that every (.., T, K) and (.., T, N) array is produced by a matmul in
  its natural layout and is consumed by the next matmul without a transpose; the
  backward pass is written out for the same reason (autodiff's matmuls transposed
  the (B, H, T, N) persistent weights, the largest arrays of the step). Only the
  softmax weights (or nothing, with remat) are kept for the backward pass.
  """
  return _attend(rate, head_block, remat, score_dtype, qu, qv, qp, k, v, r_pad, pk, pv,
                 mask_TxK, keys_2x2, pw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attend(rate, head_block, remat, score_dtype, qu, qv, qp, k, v, r_pad, pk, pv,
            mask_TxK, keys_2x2, pw):
  return _attend_fwd(rate, head_block, remat, score_dtype, qu, qv, qp, k, v, r_pad, pk, pv,
                     mask_TxK, keys_2x2, pw)[0]


def _attend_fwd(rate, head_block, remat, score_dtype, qu, qv, qp, k, v, r_pad, pk, pv,
                mask_TxK, keys_2x2, pw=None):
  block_fn = functools.partial(_block_forward, rate, score_dtype, mask_TxK, keys_2x2)
  if remat:   # Only the outputs leave the loop.
    out = over_head_blocks(lambda *args: block_fn(*args)[0], head_block, qu, qv, qp, k,
                           v, r_pad, pk, pv, pw)
    p_ctx = q_pers = None
  else:
    out, p_ctx, q_pers = over_head_blocks(block_fn, head_block, qu, qv, qp, k, v, r_pad,
                                          pk, pv, pw)
  return out, (qu, qv, qp, k, v, r_pad, pk, pv, pw, mask_TxK, keys_2x2, p_ctx, q_pers, out)


def _attend_bwd(rate, head_block, remat, score_dtype, residuals, dout):
  del remat   # The residuals say whether the weights were kept.
  *inputs, pw, mask_TxK, keys_2x2, p_ctx, q_pers, out = residuals
  block_fn = functools.partial(block_backward, rate, score_dtype, mask_TxK, keys_2x2)
  *grads, dpw = over_head_blocks(block_fn, head_block, *inputs, pw, p_ctx, q_pers, out,
                                 dout)
  return (*grads, None, None, dpw)


_attend.defvjp(_attend_fwd, _attend_bwd)


def divisor_at_most(n: int, limit: int) -> int:
  """The largest divisor of n not above limit (pruned layers have any head count)."""
  return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)
