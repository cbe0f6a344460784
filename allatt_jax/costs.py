r"""Prints the parameters and MACs per token of a config's or a trained model's heads.

  python -m allatt_jax.costs --config=configs/wt103_base.py --heads_kept=0.5
  python -m allatt_jax.costs --checkpoint=RUN/pruned/export     # a trained model

Before and after head pruning. A config is costed at its training lengths; a trained
model (an export, or a workdir whose closed gates count as removed) at its eval lengths.
"""
from collections.abc import Sequence
import json

from absl import flags

from allatt_jax.config import cli
from allatt_jax.pruning import model_export
from allatt_jax.pruning import cost_model
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import assembly
from allatt_jax.config.errors import ConfigError

_CONFIG = cli.DEFINE_config(
    "config", "Run config whose model is costed (at its train batch, segment and "
    "memory lengths); exclusive with --checkpoint.", required=False)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "A run's workdir or an exported model: the trained model's "
    "real heads per layer, at its eval lengths; exclusive with --config.")
_STEP = flags.DEFINE_integer("step", None, "With --checkpoint on a run's workdir: the "
                             "checkpoint step (default: the latest).", lower_bound=0)
_HEADS_KEPT = flags.DEFINE_float(
    "heads_kept", None, "Keep this fraction of every layer's heads (rounded per "
    "layer) and report the pruned model relative to the unpruned one.",
    lower_bound=0.0, upper_bound=1.0)


def main(argv: Sequence[str]) -> None:
  del argv
  if (_CONFIG.value is None) == (_CHECKPOINT.value is None):
    raise ConfigError("Give exactly one of --config (a run config file) and "
                      "--checkpoint (a run's workdir or an exported model).")
  if _STEP.value is not None and _CHECKPOINT.value is None:
    raise ConfigError("--step picks a checkpoint of --checkpoint's run; give "
                      "--checkpoint too.")
  if _CHECKPOINT.value is not None:
    config, cfg = model_export.trained_model_config(_CHECKPOINT.value, _STEP.value)
    result = cost_model.model_report(config, cfg, _HEADS_KEPT.value)
  else:
    config = assembly.with_vocab_size(assembly.checked_config(_CONFIG.value))
    train = config.train
    result = cost_model.report(model_lib.ModelConfig.from_config(config), train.seq_len,
                               train.mem_len, train.batch_size, _HEADS_KEPT.value)
  print(json.dumps(result, indent=2))


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv)


if __name__ == "__main__":
  run()
