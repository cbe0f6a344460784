"""allatt_jax: All-attention Transformer LMs with layer-wise L0 head pruning.

  model = allatt_jax.load(directory)   # see allatt_jax.api.Model

`load` and `Model` import JAX on first use, so `import allatt_jax` (and every
`python -m allatt_jax....` command's start) stays light.
"""
import os as _os

# TensorFlow is only a data-preparation dependency here (TFDS, clu's writers); its C++
# start-up chatter would bury the training log.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__all__ = ["Model", "load"]


def __getattr__(name):
  if name in __all__:
    from allatt_jax import api  # pylint: disable=g-import-not-at-top
    return getattr(api, name)
  raise AttributeError(f"module 'allatt_jax' has no attribute {name!r}")


def __dir__():
  return sorted([*globals(), *__all__])
