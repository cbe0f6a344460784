"""Exports a pruning run as a smaller model without gates or its closed heads.

  python -m allatt_jax.export --workdir=RUN [--step=N] [--out=DIR] [--overwrite]

Exports a run's latest checkpoint (or --step) as a folder usable without the run or
its dataset. Without --out, the final step goes to RUN/export (a pruning run writes it
itself) and step N to RUN/export-step-N; an existing export is replaced only with
--overwrite.
"""
from absl import flags

from allatt_jax.config import cli
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import model_export
from allatt_jax.runs import run_files
from allatt_jax.runs import trained_model

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


def main(argv):
  del argv
  out_dir = model_export.export_run(_WORKDIR.value, _OUT.value, _STEP.value,
                                    overwrite=_OVERWRITE.value)
  print(f"Exported the pruned model to {out_dir}")
  # How the export numbers its heads, as a pruning run's own export says it.
  note = model_export.renumbering_note(
      *(model_lib.ModelConfig.from_config(run_files.load_config(folder))
        for folder in (_WORKDIR.value, out_dir)))
  if note:
    print(note)


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv, flag_names={}, fallback_advice=trained_model.OLD_MODEL_ADVICE)


if __name__ == "__main__":
  run()
