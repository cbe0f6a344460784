"""Exports a pruning run as a smaller model without gates or its closed heads.

The export holds the model's config.json, params (heads removed by
`prune.prune_variables`) and tokenizer.json: loadable and usable on text without the
training run or its dataset (`loader.load`).

A pruning run exports its final state itself; this command exports a run's latest
checkpoint (or checkpoint --step) again, e.g. to another folder:

  python -m allatt_jax.export --workdir=RUN [--step=N] [--out=DIR]
"""
from absl import flags
from etils import epath
import ml_collections

from allatt_jax import checkpointing
from allatt_jax import cli
from allatt_jax import loader
from allatt_jax import model as model_lib
from allatt_jax import prune
from allatt_jax import rundir
from allatt_jax import validation

EXPORT_DIR = "export"


def exported_config(config: ml_collections.ConfigDict,
                    pruned_cfg: model_lib.ModelConfig) -> ml_collections.ConfigDict:
  """The run's config describing the smaller model: per-layer head counts, no gates,
  no init_from, so that every CLI that takes a checkpoint can load the export."""
  exported = config.copy_and_resolve_references()
  exported.model.heads_per_layer = pruned_cfg.heads_per_layer
  exported.model.max_relative_len = pruned_cfg.max_relative_len
  exported.gates.enabled = False
  exported.init_from = ""
  return exported


def save_export(out_dir, config: ml_collections.ConfigDict,
                pruned_cfg: model_lib.ModelConfig, params, tokenizer: dict) -> None:
  """Writes the pruned model of a run with `config` to `out_dir`, with the run's
  tokenizer (`Tokenizer.to_dict()`)."""
  checkpointing.save_model(out_dir, exported_config(config, pruned_cfg), params,
                           tokenizer)


def export_run(workdir, out_dir=None, step: int | None = None) -> epath.Path:
  """Exports a pruning run's checkpoint `step` (default: the latest) as a standalone
  smaller model; a run saved without its tokenizer gets its dataset's."""
  workdir = rundir.run_path(workdir)
  validation.check_export(workdir)
  config = rundir.load_config(workdir)
  tokenizer = loader.load_tokenizer(workdir, config)
  variables = checkpointing.restore_variables(workdir, step)
  pruned_cfg, params = prune.prune_variables(model_lib.ModelConfig.from_config(config),
                                             variables)
  out_dir = rundir.run_path(out_dir) if out_dir else workdir / EXPORT_DIR
  save_export(out_dir, config, pruned_cfg, params, tokenizer.to_dict())
  return out_dir


def main(argv):
  del argv
  out_dir = export_run(_WORKDIR.value, _OUT.value, _STEP.value)
  print(f"Exported the pruned model to {out_dir}")


if __name__ == "__main__":
  _WORKDIR = flags.DEFINE_string(
      "workdir", None, "The --workdir of a pruning run (gates.enabled); its latest "
      "complete checkpoint is exported unless --step says which.", required=True)
  _OUT = flags.DEFINE_string("out", None, "Where to write the model (default: "
                             "WORKDIR/export, replacing the run's own export).")
  _STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the "
                               "latest finished one).", lower_bound=0)
  cli.run(main, flag_names={}, fallback_advice=loader.OLD_MODEL_ADVICE)
