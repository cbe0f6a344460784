"""The split core's persistent part through the vendor's fused attention, cuDNN's flash
attention (persistent_impl='cudnn'): for dropout-free work (evaluation, scoring,
sampling, training with model.dropout_attn=0) in bfloat16 or float16.

The persistent part is plain attention of a head's B·T queries against its N slots,
so cuDNN sees one batch row of B·T queries per head (layout BNTH: (1, H, B·T, dh)
against (1, H, N, dh); reshapes, no copies).

- Forward: jax's cuDNN call with `return_residual`, whose residual is each query's
  log-sum-exp in float32. The lower-level call of jax/_src/cudnn/fused_attention_stablehlo.py:
  `jax.nn.dot_product_attention` casts the residual to the output's dtype, and a
  bf16 log-normaliser would move the merge's weights by up to 1%.
- Backward: cuDNN's backward kernel computes the weights exp(s − stats) and δ = Σ O·dO
  from the residuals it is handed; handed the merged softmax's lse and output
  instead of the part's own, it yields the part's gradients under the merged
  softmax. jax has no public call for that, so its custom VJP's backward rule
  (`_dot_product_attention_bwd_rule`, jax 0.10 to 0.12) is called directly, its parameters
  filled by name and its residuals (the forward rule's array arguments, then the
  statistics and the output) built here. A jax whose rules take other parameters
  makes `why_not_here` say so, and 'auto' leaves this part out.

cuDNN draws dropout masks from its own seed, which cannot follow the step's key
(persistent_cores.refusal); weighting slots would need a bias as large as the scores.
"""
import inspect

import jax
import jax.numpy as jnp

_FORWARD_RULE = "_dot_product_attention_fwd_rule"
_BACKWARD_RULE = "_dot_product_attention_bwd_rule"


def _module():
  """jax's cuDNN attention module, or None where this jax has not the calls used here."""
  try:   # jax's private module, imported here: its absence is a reason, not a crash
    from jax._src.cudnn import fused_attention_stablehlo as fa
  except ImportError:
    return None
  needed = ("dot_product_attention", _FORWARD_RULE, _BACKWARD_RULE, "MaskType",
            "AttentionLayout", "check_cudnn_version")
  return fa if all(hasattr(fa, name) for name in needed) else None


def _values(fa, query, key, value) -> dict:
  """Every parameter of the cuDNN rules of jax 0.10 to 0.12, by name, for attention
  without mask, bias, dropout, packing or score modifier, scale 1 (the queries come
  scaled)."""
  not_used = jnp.zeros(0, query.dtype)
  return dict(query=query, key=key, value=value, bias=not_used, q_seqlen=not_used,
              kv_seqlen=not_used, q_offsets=not_used, kv_offsets=not_used,
              page_table_k=not_used, page_table_v=not_used, scale=1.0, seed=0,
              dropout_rate=0.0, variadic_args=(False, False), mask_type=fa.MaskType.NO_MASK,
              layout=fa.AttentionLayout.BNTH.value, sliding_window_length=None,
              # jax 0.12's flex attention: no score modifier, so no arguments of one
              # (a residual of the forward rule there).
              score_mod=None, score_mod_args=(),
              # jax 0.10 and 0.11's backward rule names the cuDNN version it receives
              # (nondiff_argnums) is_training; neither is read by it.
              is_training=True, cudnn_version=0, return_residual=False)


# The parameters `_values` fills, and the residuals and cotangent of the backward rule.
_KNOWN = frozenset((
    "query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
    "page_table_k", "page_table_v", "scale", "seed", "dropout_rate", "variadic_args",
    "mask_type", "layout", "sliding_window_length", "score_mod", "score_mod_args",
    "is_training", "cudnn_version", "return_residual", "res", "grad_output"))


def _unknown_parameters(fa) -> list[str]:
  rules = (getattr(fa, _FORWARD_RULE), getattr(fa, _BACKWARD_RULE))
  return [name for rule in rules for name in inspect.signature(rule).parameters
          if name not in _KNOWN]


# cuDNN's fused attention takes head dimensions up to this, in multiples of HEAD_DIM_STEP.
MAX_HEAD_DIM, HEAD_DIM_STEP = 256, 8


def why_not_here(dtype, head_dim: int) -> str | None:
  """Why this part cannot run on this process's default device for a model computing
  in `dtype` with heads of `head_dim` (None: it can)."""
  if jax.default_backend() != "gpu":
    return (f"it needs a GPU with cuDNN and this process runs on {jax.default_backend()}")
  fa = _module()
  if fa is None:
    return f"jax {jax.__version__} lacks the cuDNN attention calls it uses"
  unknown = _unknown_parameters(fa)
  if unknown:
    return (f"jax {jax.__version__}'s cuDNN attention rules take parameters it does not "
            f"know ({', '.join(unknown)})")
  try:
    fa.check_cudnn_version()
  except Exception as e:  # pylint: disable=broad-except  # whatever fails means "not here"
    return f"cuDNN is not available ({type(e).__name__}: {e})"
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return (f"cuDNN's attention takes bfloat16 or float16 and the model computes in "
            f"{jnp.dtype(dtype).name}")
  if head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_STEP:
    return (f"cuDNN's attention takes head dimensions up to {MAX_HEAD_DIM} in multiples of "
            f"{HEAD_DIM_STEP} and this model's heads have {head_dim}")
  return None


def _as_bnth(x_HxBxTxD):
  h, b, t, d = x_HxBxTxD.shape
  return x_HxBxTxD.reshape(1, h, b * t, d)


def forward(qp, pk, pv, pw, row_seeds, column_seeds):
  """(acc, m, l) of the persistent part (persistent_cores.py): cuDNN's output, its
  log-sum-exp and 1; `pw` and the seeds are None (persistent_cores.refusal)."""
  del pw, row_seeds, column_seeds
  h, b, t, dh = qp.shape
  out, lse = _module().dot_product_attention(
      _as_bnth(qp), pk[None], pv[None], scale=1.0, qkv_layout="BNTH", return_residual=True)
  lse = lse.reshape(h, b, t)
  return out.reshape(h, b, t, dh), lse, jnp.ones_like(lse)


def backward(qp, pk, pv, lse, out, dout):
  """(dqp, dpk, dpv, None) under the merged softmax: cuDNN's backward pass handed its
  log-normaliser `lse` and output `out` as the residuals of the part's forward pass."""
  fa = _module()
  h, b, t, dh = qp.shape
  values = _values(fa, _as_bnth(qp), pk[None], pv[None])
  forward_params = list(inspect.signature(getattr(fa, _FORWARD_RULE)).parameters)
  arrays = [values[name] for name in forward_params[:forward_params.index("scale")]]
  residuals = (*arrays, lse.reshape(1, h, b * t), _as_bnth(out.astype(qp.dtype)))
  rule = getattr(fa, _BACKWARD_RULE)
  named = {name: values[name] for name in inspect.signature(rule).parameters
           if name not in ("res", "grad_output")}
  dq, dk, dv = rule(**named, res=residuals, grad_output=_as_bnth(dout))[:3]
  return dq.reshape(h, b, t, dh), dk[0], dv[0], None
