"""allatt_jax: All-attention Transformer LMs with layer-wise L0 head pruning.

  model = allatt_jax.load(directory)   # see allatt_jax.api.Model

`load` and `Model` import JAX on first use, so `import allatt_jax` (and every
`python -m allatt_jax....` command's start) stays light.
"""
import os as _os
import sys as _sys

# `python -m allatt_jax.COMMAND` (and `python -m allatt_jax`) imports this package
# first, before anything heavy. From here until the command has parsed its flags,
# through its imports of JAX, Flax and TensorFlow, Ctrl-C ends it at once with one line
# (config/interrupts.py says why any later would be too late). The measuring scripts
# of perf/, which time GPUs in child processes, keep Python's own handler.
if _sys.argv[:1] == ["-m"]:
  from allatt_jax.config import interrupts as _interrupts
  if not _interrupts.module_run_by_python().startswith("allatt_jax.perf"):
    _interrupts.exit_at_once()

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
