"""Which attention core a layer runs, as `model.attention_impl` asks: 'xla' (the
default, `xla_core`), 'pallas' (the fused kernels, `pallas_core`, where
they compile and agree with XLA on a trial problem, checked once per process on a
GPU), 'split' (`split_core`: the context part in XLA, the persistent part as
`model.persistent_impl` picks) or 'auto' ('split' on a GPU without attention dropout,
XLA otherwise: `use_split`).
"""
import functools

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax.model.attention import xla_core
from allatt_jax.model.attention import pallas_core
from allatt_jax.config.errors import ConfigError

IMPLS = ("auto", "xla", "pallas", "split")


def use_kernel(impl: str) -> bool:
  """Whether a layer with `model.attention_impl=impl` runs the kernels: 'pallas' where
  they run (`runs_here`), else the XLA path, with a warning (a model read from disk,
  trained where the kernels ran: a command's own config asking for them where they
  cannot run is refused by `check_runs_here`).

  Raises:
    ConfigError: an unknown `impl`.
  """
  if impl not in IMPLS:
    raise ConfigError(f"config.model.attention_impl={impl!r} is unknown; choose one of "
                      f"{', '.join(map(repr, IMPLS))}.")
  if impl != "pallas":
    return False
  why_not = _why_not_here()
  if why_not:
    _warn_once(impl, why_not)
  return why_not is None


def use_split(impl: str, rate: float) -> bool:
  """Whether a layer with `model.attention_impl=impl` and attention dropout `rate` runs
  the split core: 'split', and 'auto' on a GPU where the layer has no attention
  dropout (evaluation, scoring, sampling, dropout-free training). On an H200 the split
  core ran the benchmark's layer 1.67x as fast as the XLA core without dropout (its
  persistent part through cuDNN), and at 0.78x with dropout 0.2 (docs/performance.md),
  so with dropout 'auto' is the XLA core; elsewhere it is the XLA core as before."""
  return impl == "split" or (impl == "auto" and not rate and jax.default_backend() == "gpu")


def check_runs_here(impl: str) -> None:
  """Raises ConfigError if `impl` asks for the kernels and they do not run here."""
  why_not = _why_not_here() if impl == "pallas" else None
  if why_not:
    raise ConfigError(
        f"config.model.attention_impl='pallas' asks for the fused attention kernels, "
        f"but {why_not}. Use --config.model.attention_impl=auto (the split core on a "
        "GPU, XLA elsewhere) or =xla.")


def runs_here() -> bool:
  """Whether the kernels compile on this process's default device and agree with the
  XLA path on a small problem (checked once per process, on a GPU only)."""
  return _why_not_here() is None


@functools.cache
def _warn_once(impl: str, why_not: str) -> None:
  logging.warning("attention_impl=%r: the fused attention kernels do not run here (%s); "
                  "using the XLA path.", impl, why_not)


@functools.cache
def _why_not_here() -> str | None:
  backend = jax.default_backend()
  if backend != "gpu":
    return f"they need a CUDA GPU (Pallas' Triton backend) and this process runs on {backend}"
  try:
    mismatch = trial_mismatch(interpret=False)
  except Exception as e:  # pylint: disable=broad-except  # whatever fails means "not here"
    return (f"they do not compile or run on this GPU ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})")
  return f"they disagree with the XLA path on this GPU ({mismatch})" if mismatch else None


def trial_mismatch(interpret: bool) -> str | None:
  """Runs the kernels forward and backward on a small bf16 problem that reaches every
  part of them (two query blocks, three key blocks, two slot blocks, two batch rows
  per slot-gradient program, memory partly empty, the same-length window, dropout)
  against the XLA path; returns what differs
  by more than bf16 round-off, or None. Callable while another function traces."""
  h, b, t, s, n, dh = 2, 2, 128, 64, 128, 64
  k = s + t
  rng = np.random.default_rng(0)
  # NumPy arrays: jnp ones would be staged into whatever is tracing.
  normal = lambda *shape: rng.standard_normal(shape).astype(jnp.bfloat16)
  args = (normal(h, b, t, dh), normal(h, b, t, dh), normal(h, b, t, dh),
          normal(h, b, k, dh), normal(h, b, k, dh),
          np.pad(normal(h, k, dh), [(0, 0), (1, 0), (0, 0)]), normal(h, n, dh),
          normal(h, n, dh))
  query_Tx1, key_1xK = np.arange(t)[:, None] + s, np.arange(k)[None, :]
  mask = (key_1xK <= query_Tx1) & (key_1xK >= s // 2) & (key_1xK >= query_Tx1 - s)
  keys = np.array([[1, 2], [3, 4]], np.uint32)
  dout = normal(h, b, t, dh)

  def outputs_and_grads(core, *args):
    out, vjp = jax.vjp(lambda *a: core(*a, mask, keys), *args)
    return (out, *vjp(dout))

  def run(core):   # compiled ahead of time: callable while another function traces
    fn = jax.jit(functools.partial(outputs_and_grads, core))
    return fn.lower(*args).compile()(*args)

  got_all = run(functools.partial(pallas_core.attend, 0.5,
                                  blocks=pallas_core.Blocks(rows=64, slots=64, batch=2),
                                  interpret=interpret))
  expected_all = run(functools.partial(xla_core.attend, 0.5, h, False, jnp.float32))
  names = ("out", "qu", "qv", "qp", "k", "v", "r_pad", "pk", "pv")
  for name, got, expected in zip(names, got_all, expected_all):
    got, expected = (np.asarray(x, np.float32) for x in (got, expected))
    scale = np.abs(expected).max()
    if not np.all(np.abs(got - expected) <= 0.05 * scale):
      return f"{name}: max difference {np.abs(got - expected).max():.3g} of {scale:.3g}"
  return None
