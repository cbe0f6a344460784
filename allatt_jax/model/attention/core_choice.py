"""Which attention core a layer runs, as `model.attention_impl` asks: 'xla'
(`xla_core`), 'split' (`split_core`: the context part in XLA, the persistent part as
`model.persistent_impl` picks) or 'auto' ('split' on a GPU without attention dropout,
XLA otherwise: `use_split`).
"""
import jax

from allatt_jax.config.errors import ConfigError

IMPLS = ("auto", "xla", "split")


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
