r"""Evaluates a trained model on a split of its dataset, or on a text file, as JSON.

  python -m allatt_jax.evaluate --checkpoint=DIR [--step=N] [--split=valid|test]
  python -m allatt_jax.evaluate --checkpoint=DIR --text_file=FILE

DIR is a run's workdir or an export; a text file is read as one row, as `score` reads
it, and needs no dataset. Every token is scored once, with the memory carried.
"""
import json
import sys

from absl import flags

from allatt_jax.config import cli
from allatt_jax.evaluation import likelihood
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs import trained_model

_CHECKPOINT, _STEP = cli.DEFINE_trained_model()
_SPLIT = flags.DEFINE_enum("split", "test", stream_eval.SPLITS,
                           "Split of the run's dataset (needs the dataset).")
_TEXT_FILE = flags.DEFINE_string("text_file", None, "Evaluate this UTF-8 text file "
                                 "instead of a split (needs no dataset).")
_MANUAL_DIR, _DATA_DIR = cli.DEFINE_data_folders(
    "The folder of the dataset's files, if they moved since training (default: the "
    "run's config.data.manual_dir).",
    "The TFDS data folder of the prepared dataset, if it moved (default: the run's "
    "config.data.data_dir, else $TFDS_DATA_DIR).")


def main(argv):
  del argv   # cli.run refuses extra arguments
  text = likelihood.read_text(_TEXT_FILE.value) if _TEXT_FILE.value else None
  # The dataset is checked before the model is read: a moved folder fails at once.
  corpus = (None if text is not None else
            trained_model.load_dataset(_CHECKPOINT.value, _MANUAL_DIR.value, _DATA_DIR.value))
  model = trained_model.load(_CHECKPOINT.value, _STEP.value)
  summary = likelihood.evaluate_model(
      model, split=None if text is not None else _SPLIT.value, text=text, corpus=corpus)
  source = {"file": _TEXT_FILE.value} if text is not None else {"split": _SPLIT.value}
  json.dump({"checkpoint": _CHECKPOINT.value, "step": model.step, **source, **summary},
            sys.stdout, indent=2)
  print()


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv, flag_names={"data.manual_dir": "--manual_dir",
                                  "data.data_dir": "--data_dir"},
          fallback_advice="Point --manual_dir at the folder holding the files this "
          "model was trained on.")


if __name__ == "__main__":
  run()
