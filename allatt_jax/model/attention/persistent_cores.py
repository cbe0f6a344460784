"""The persistent part of the split core (split_core.py), pluggable: `model.persistent_impl`
picks 'xla' (the reference, plain jnp, runs anywhere), 'pallas' (flash kernels,
persistent_pallas.py), 'cudnn' (the vendor's fused attention, persistent_cudnn.py)
or 'auto' (on a GPU the fastest of those that pass a trial of seconds, once per
process; 'xla' elsewhere).

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
import statistics
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import dropout_mask
from allatt_jax.model.attention import persistent_cudnn
from allatt_jax.model.attention import persistent_pallas
from allatt_jax.model.attention import persistent_trial
from allatt_jax.config.errors import ConfigError

IMPLS = ("auto", "xla", "pallas", "cudnn")
# Seconds each candidate of 'auto' may take to start, compile, check and time.
TRIAL_SECONDS = 60.0


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


PARTS = {name: Part(name) for name in IMPLS[1:]}


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


def part(impl: str, rate: float, weighted: bool, dtype, head_dim: int) -> Part:
  """The part `model.persistent_impl=impl` runs for a layer with attention dropout
  `rate`, slot weights (`weighted`), compute `dtype` and heads of `head_dim`: 'auto'
  as the module says; an
  implementation that cannot run here falls back to 'xla' with a warning (a model read
  from disk; a command's own config is refused by `check_config`).

  Raises:
    ConfigError: an unknown `impl`, or 'cudnn' with attention dropout or slot weights.
  """
  if impl not in IMPLS:
    raise ConfigError(f"config.model.persistent_impl={impl!r} is unknown; choose one of "
                      f"{', '.join(map(repr, IMPLS))}.")
  if impl == "auto":
    return PARTS[_auto(bool(rate), weighted, jnp.dtype(dtype).name, head_dim)]
  refused = refusal(impl, rate, weighted)
  if refused:
    raise ConfigError(f"config.model.persistent_impl={impl!r}: {refused}. Use "
                      "--config.model.persistent_impl=auto, pallas or xla.")
  why_not = why_not_here(impl, dtype, head_dim)
  if why_not:
    _warn_once(impl, why_not)
    return PARTS["xla"]
  return PARTS[impl]


def check_config(attention_impl: str, impl: str, dropout_attn: float, dtype: str,
                 weighted: bool, head_dim: int) -> None:
  """Raises ConfigError if a model with these settings asks for a persistent part
  that cannot run here, or must not run (`refusal`); the split core runs where
  `attention_impl` is 'split', or 'auto' on a GPU for the layers without attention
  dropout (so there cuDNN's part may serve a model trained with dropout)."""
  if attention_impl not in ("split", "auto") or impl in ("auto", "xla"):
    return
  rate = 0.0 if attention_impl == "auto" else dropout_attn
  why_not = refusal(impl, rate, weighted) or why_not_here(impl, dtype, head_dim)
  if why_not:
    raise ConfigError(f"config.model.persistent_impl={impl!r} asks for the persistent "
                      f"part's {impl} implementation, but {why_not}. Use "
                      "--config.model.persistent_impl=auto (the fastest that runs) or =xla.")


@functools.cache
def _warn_once(impl: str, why_not: str) -> None:
  logging.warning("persistent_impl=%r does not run here (%s); using the XLA part.", impl,
                  why_not)


@functools.cache
def _auto(dropout: bool, weighted: bool, dtype: str, head_dim: int) -> str:
  """'xla' off the GPU; on it the fastest part whose trial passes within
  TRIAL_SECONDS, each in a process of its own (persistent_trial.py; the XLA part's
  own trial only times it)."""
  if jax.default_backend() != "gpu":
    return "xla"
  rate = 0.2 if dropout else 0.0
  seconds = {}
  for name in PARTS:
    why_not = refusal(name, rate, weighted) or why_not_here(name, dtype, head_dim)
    try:
      if why_not:
        raise RuntimeError(why_not)
      seconds[name] = persistent_trial.seconds(name, rate, weighted, dtype, TRIAL_SECONDS)
    except Exception as e:  # pylint: disable=broad-except  # whatever fails is not chosen
      logging.info("persistent_impl='auto': %s left out (%s: %s)", name, type(e).__name__,
                   str(e).strip().splitlines()[0] if str(e).strip() else "")
  best = min(seconds, key=seconds.get) if seconds else "xla"
  logging.info("persistent_impl='auto' chose %r (trial seconds per step: %s)", best,
               {k: f"{v:.2e}" for k, v in seconds.items()})
  return best


def trial_problem(dtype, rate: float, weighted: bool, h=2, b=8, t=128, n=512, dh=64):
  """(qp, pk, pv, pw, row_seeds, column_seeds, dout) of a persistent part's trial, as
  NumPy arrays (jnp ones would be staged into whatever is tracing); `weighted`: every
  fourth slot closed."""
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.standard_normal(shape).astype(dtype)
  pw = (np.arange(n) % 4 != 0)[None].repeat(h, 0).astype(dtype) if weighted else None
  key_2 = np.array([3, 4], np.uint32)
  row_seeds, column_seeds = ((np.asarray(dropout_mask.row_seeds(key_2, h, b, t)),
                              np.asarray(dropout_mask.column_seeds(key_2, n)))
                             if rate else (None, None))
  return (normal(h, b, t, dh), normal(h, n, dh), normal(h, n, dh), pw, row_seeds,
          column_seeds, normal(h, b, t, dh))


def outputs_and_grads(part_: Part, rate: float, score_dtype, qp, pk, pv, pw, row_seeds,
                      column_seeds, dout):
  """A part alone as the only softmax: (out, lse, dqp, dpk, dpv, dpw)."""
  acc, top, norm = part_.forward(rate, qp.shape[0], score_dtype, qp, pk, pv, pw, row_seeds,
                                 column_seeds)
  out = (acc / norm[..., None]).astype(dout.dtype)
  delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), -1)
  grads = part_.backward(rate, qp.shape[0], score_dtype, qp, pk, pv, pw, row_seeds,
                         column_seeds, top, norm, delta, out, dout)
  return (out, top + jnp.log(norm), *grads)


def mismatch(got, expected, tolerance: float) -> str | None:
  """What of (out, lse, dqp, dpk, dpv, dpw) differs by more than `tolerance` of its
  largest value, or None."""
  for name, g, e in zip(("out", "lse", "dqp", "dpk", "dpv", "dpw"), got, expected):
    if e is None:
      continue
    g, e = (np.asarray(x, np.float32) for x in (g, e))
    scale = float(np.abs(e).max()) or 1.0
    if not np.all(np.abs(g - e) <= tolerance * scale):
      return f"{name}: max difference {np.abs(g - e).max():.3g} of {scale:.3g}"
  return None


def trial(name: str, rate: float, weighted: bool, dtype, steps: int = 5) -> float:
  """Seconds per forward and backward step of part `name` on `trial_problem` (median
  of `steps`), after checking it against the XLA part (5% of each result's largest
  value; bf16 round-off gives about 1%). Compiled ahead of time: callable while
  another function traces.

  Raises:
    RuntimeError: the part disagrees with the XLA part.
  """
  args = trial_problem(jnp.dtype(dtype), rate, weighted)

  def compiled(part_name):
    fn = jax.jit(functools.partial(outputs_and_grads, PARTS[part_name], rate, jnp.float32))
    return fn.lower(*args).compile()

  fn = compiled(name)
  got = jax.block_until_ready(fn(*args))
  if name != "xla":
    wrong = mismatch(got, compiled("xla")(*args), 0.05)
    if wrong:
      raise RuntimeError(f"it disagrees with the XLA part ({wrong})")
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)
