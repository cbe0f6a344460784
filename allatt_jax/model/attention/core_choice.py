"""Which attention core a layer runs, and which persistent part within the split core.

- `model.attention_impl` (`use_split`): 'xla' (`xla_core`), 'split' (`split_core`:
  the context part in XLA, the persistent part apart) or 'auto' ('split' on a GPU
  without attention dropout, XLA otherwise).
- `model.persistent_impl` (`persistent_part`): 'xla', 'pallas' or 'cudnn'
  (persistent_cores.py), or 'auto': on a GPU the fastest of those that pass a trial
  of seconds (persistent_trial.py), once per process and kind of layer; 'xla'
  elsewhere.
"""
import functools

from absl import logging
import jax
import jax.numpy as jnp

from allatt_jax.config.errors import ConfigError
from allatt_jax.model.attention import persistent_cores
from allatt_jax.model.attention import persistent_trial

IMPLS = ("auto", "xla", "split")
PERSISTENT_IMPLS = ("auto", *persistent_cores.PARTS)
# Seconds each candidate of 'auto' may take to start, compile, check and time.
TRIAL_SECONDS = 60.0


def use_split(impl: str, rate: float) -> bool:
  """Whether a layer with `model.attention_impl=impl` and attention dropout `rate` runs
  the split core: 'split', and 'auto' on a GPU where the layer has no attention
  dropout (evaluation, scoring, sampling, dropout-free training). On an H200 the split
  core ran the benchmark's layer 1.67x as fast as the XLA core without dropout (its
  persistent part through cuDNN), and at 0.78x with dropout 0.2 (docs/performance.md),
  so with dropout 'auto' is the XLA core. Elsewhere it is the XLA core as before: on a
  2-core CPU the split core trained x1.04-x1.06 as fast, within the rounds' spread.

  Raises:
    ConfigError: an unknown `impl`.
  """
  if impl not in IMPLS:
    raise ConfigError(f"config.model.attention_impl={impl!r} is unknown; choose one of "
                      f"{', '.join(map(repr, IMPLS))}.")
  return impl == "split" or (impl == "auto" and not rate and jax.default_backend() == "gpu")


def persistent_part(impl: str, rate: float, weighted: bool, dtype,
                    head_dim: int) -> persistent_cores.Part:
  """The part `model.persistent_impl=impl` runs for a layer with attention dropout
  `rate`, slot weights (`weighted`), compute `dtype` and heads of `head_dim`: 'auto'
  as the module says; an implementation that cannot run here falls back to 'xla' with
  a warning (a model read from disk; a command's own config is refused by
  `check_persistent_impl`).

  Raises:
    ConfigError: an unknown `impl`, or 'cudnn' with attention dropout or slot weights.
  """
  if impl not in PERSISTENT_IMPLS:
    raise ConfigError(f"config.model.persistent_impl={impl!r} is unknown; choose one of "
                      f"{', '.join(map(repr, PERSISTENT_IMPLS))}.")
  if impl == "auto":
    return persistent_cores.PARTS[_auto(bool(rate), weighted, jnp.dtype(dtype).name,
                                        head_dim)]
  refused = persistent_cores.refusal(impl, rate, weighted)
  if refused:
    raise ConfigError(f"config.model.persistent_impl={impl!r}: {refused}. Use "
                      "--config.model.persistent_impl=auto, pallas or xla.")
  why_not = persistent_cores.why_not_here(impl, dtype, head_dim)
  if why_not:
    _warn_once(impl, why_not)
    return persistent_cores.PARTS["xla"]
  return persistent_cores.PARTS[impl]


def check_persistent_impl(attention_impl: str, impl: str, dropout_attn: float, dtype: str,
                          weighted: bool, head_dim: int) -> None:
  """Raises ConfigError if a model with these settings asks for a persistent part
  that cannot run here, or must not run (`persistent_cores.refusal`); the split core
  runs where `attention_impl` is 'split', or 'auto' on a GPU for the layers without
  attention dropout (so there cuDNN's part may serve a model trained with dropout)."""
  if attention_impl not in ("split", "auto") or impl in ("auto", "xla"):
    return
  rate = 0.0 if attention_impl == "auto" else dropout_attn
  why_not = (persistent_cores.refusal(impl, rate, weighted)
             or persistent_cores.why_not_here(impl, dtype, head_dim))
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
  for name in persistent_cores.PARTS:
    why_not = (persistent_cores.refusal(name, rate, weighted)
               or persistent_cores.why_not_here(name, dtype, head_dim))
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
