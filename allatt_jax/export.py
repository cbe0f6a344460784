"""Exports a pruning run as a smaller model without gates or its closed heads.

The export (`exported_model.save`: config.json, params with the closed heads removed
by `prune.remove_heads`, tokenizer.json, vocabulary.json) is loadable and usable on
text without the training run or its dataset (`loader.load`).

A pruning run exports its final state itself, to RUN/export; this command exports a
run's latest checkpoint (or checkpoint --step) again:

  python -m allatt_jax.export --workdir=RUN [--step=N] [--out=DIR] [--overwrite]

Without --out, the final step goes to RUN/export and any other step N to
RUN/export-step-N. An existing export is replaced only with --overwrite: the run's
own is the one its results.json (and a demo's report.json) describes.
"""
from absl import flags
from etils import epath

from allatt_jax import checkpointing
from allatt_jax import cli
from allatt_jax import exported_model
from allatt_jax import loader
from allatt_jax import model as model_lib
from allatt_jax import prune
from allatt_jax import run_config
from allatt_jax import rundir
from allatt_jax import validation
from allatt_jax.errors import FlagError


def export_run(workdir, out_dir=None, step: int | None = None, *,
               overwrite: bool = False) -> epath.Path:
  """Exports a pruning run's checkpoint `step` (default: the newest that restores) as
  a standalone smaller model; a run saved without its tokenizer gets its dataset's.

  Returns the export's folder: `out_dir`, else `default_export_dir`.

  Raises:
    CheckpointError: not a pruning run, or no such (readable) checkpoint.
    FlagError: the folder holds something already, and `overwrite` is not set; or it
      holds something other than an exported model.
  """
  workdir = rundir.run_path(workdir)
  validation.check_export(workdir)
  config = rundir.load_config(workdir)
  tokenizer = loader.load_tokenizer(workdir, config)
  step, variables = checkpointing.restore_step(workdir, step)
  pruned_cfg, params = prune.remove_heads(model_lib.ModelConfig.from_config(config),
                                          variables)
  # The default folder is named after the step that restored, so the check of the
  # folder waits for it (it still comes before anything is written).
  out_dir = (rundir.run_path(out_dir) if out_dir
             else default_export_dir(workdir, config, step))
  _check_target(out_dir, overwrite)
  exported_model.save(out_dir, config, pruned_cfg, params, tokenizer)
  return out_dir


def default_export_dir(workdir, config: run_config.RunConfig,
                       step: int) -> epath.Path:
  """RUN/export for the run's final step, the folder its own export went to, and
  RUN/export-step-N for an earlier one."""
  own = exported_model.EXPORT_DIR
  return workdir / (own if step == config.train.num_steps else f"{own}-step-{step}")


def _check_target(out_dir: epath.Path, overwrite: bool) -> None:
  if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
    return
  # Even --overwrite replaces only a model: the folder could be the run itself.
  if not (out_dir / "params").is_dir():
    raise FlagError(f"{out_dir} exists and is not an exported model; give a new or "
                    "empty folder with --out=DIR.")
  if not overwrite:
    raise FlagError(
        f"{out_dir} already holds an exported model (a run's results.json and a demo's "
        "report.json describe the run's own). Write this one elsewhere with --out=DIR, "
        "or replace it with --overwrite.")


def main(argv):
  del argv
  out_dir = export_run(_WORKDIR.value, _OUT.value, _STEP.value, overwrite=_OVERWRITE.value)
  print(f"Exported the pruned model to {out_dir}")


if __name__ == "__main__":
  _WORKDIR = flags.DEFINE_string(
      "workdir", None, "The --workdir of a pruning run (gates.enabled); its latest "
      "complete checkpoint is exported unless --step says which.", required=True)
  _OUT = flags.DEFINE_string("out", None, "Where to write the model (default: "
                             "WORKDIR/export for the run's final step, the run's own "
                             "export; WORKDIR/export-step-N for step N).")
  _STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the "
                               "latest finished one).", lower_bound=0)
  _OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an exported model already "
                                 "in the folder.")
  cli.run(main, flag_names={}, fallback_advice=loader.OLD_MODEL_ADVICE)
