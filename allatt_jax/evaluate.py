r"""Evaluates a trained model on a split of its dataset, or on a text file, as JSON.

The model is a run's workdir (any checkpoint step) or an export; a text file is read
as one row, as `python -m allatt_jax.score` reads it, and needs no dataset:

  python -m allatt_jax.evaluate --checkpoint=DIR [--step=N] [--split=valid|test]
  python -m allatt_jax.evaluate --checkpoint=DIR --text_file=FILE

The evaluation itself (memory carried along each row, every token scored once) is
`evaluation.py`'s.
"""
import json
import pathlib
import sys

from absl import flags
import jax

from allatt_jax import cli
from allatt_jax import data as data_lib
from allatt_jax import errors
from allatt_jax import evaluation
from allatt_jax import loader
from allatt_jax import sharding


def evaluate_model(model: loader.LoadedModel, *, split: str | None = None,
                   text: str | None = None, corpus: data_lib.Corpus | None = None) -> dict:
  """{'tokens', metric, 'nll'} of a loaded model on a split of its dataset (`corpus`,
  by default read from the run's config; at the run's eval batch and lengths) or on
  `text` (one row, as `score` reads it).

  Raises:
    DataError: the dataset cannot be loaded, or the text has fewer than 2 tokens.
  """
  e = model.config.eval
  if text is not None:
    tokens, _ = model.tokenizer.encode(text)
    if len(tokens) < 2:
      raise errors.DataError(f"The text has {len(tokens)} token(s) in the vocabulary; "
                             "evaluation needs at least 2 (the first is context only).")
    batch_size = 1
  else:
    corpus = corpus or data_lib.load_run_corpus(model.config)
    tokens = corpus.splits[split]
    batch_size = e.batch_size
  # One device: a model trained on a mesh evaluates anywhere, at any batch size.
  mesh = jax.make_mesh((1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  evaluator = evaluation.Evaluator(model.lm, mesh, batch_size=batch_size,
                                   seq_len=e.seq_len, mem_len=e.mem_len)
  scored = evaluator.score(model.variables, tokens)
  metric = model.tokenizer.metric
  return {"tokens": scored["tokens"], metric: evaluation.metric_value(scored["nll"], metric),
          "nll": scored["nll"]}


def main(argv):
  del argv   # cli.run refuses extra arguments
  text = None
  if _TEXT_FILE.value:
    try:
      text = pathlib.Path(_TEXT_FILE.value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
      raise errors.DataError(f"Cannot read the text file {_TEXT_FILE.value}: {e}") from e
  # The dataset is checked before the model is read: a moved folder fails at once.
  corpus = (None if text is not None else
            loader.load_dataset(_CHECKPOINT.value, _MANUAL_DIR.value, _DATA_DIR.value))
  model = loader.load(_CHECKPOINT.value, _STEP.value)
  summary = evaluate_model(model, split=None if text is not None else _SPLIT.value,
                           text=text, corpus=corpus)
  source = {"file": _TEXT_FILE.value} if text is not None else {"split": _SPLIT.value}
  json.dump({"checkpoint": _CHECKPOINT.value, "step": model.step, **source, **summary},
            sys.stdout, indent=2)
  print()


if __name__ == "__main__":
  _CHECKPOINT, _STEP = cli.DEFINE_trained_model()
  _SPLIT = flags.DEFINE_enum("split", "test", evaluation.SPLITS,
                             "Split of the run's dataset (needs the dataset).")
  _TEXT_FILE = flags.DEFINE_string("text_file", None, "Evaluate this UTF-8 text file "
                                   "instead of a split (needs no dataset).")
  _MANUAL_DIR = flags.DEFINE_string(
      "manual_dir", None, "The folder of the dataset's files, if they moved since "
      "training (default: the run's config.data.manual_dir).")
  _DATA_DIR = flags.DEFINE_string(
      "data_dir", None, "The TFDS data folder of the prepared dataset, if it moved "
      "(default: the run's config.data.data_dir, else $TFDS_DATA_DIR).")
  cli.run(main, flag_names={"data.manual_dir": "--manual_dir",
                            "data.data_dir": "--data_dir"},
          fallback_advice="Point --manual_dir at the folder holding the files this "
          "model was trained on.")
