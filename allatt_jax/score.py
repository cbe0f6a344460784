r"""Scores a text file with a trained model: per-token log-probabilities, ppl or bpc.

  python -m allatt_jax.score --checkpoint=DIR [--step=N] --text_file=FILE [--out=FILE.jsonl]

DIR is a run's workdir (gated models use their deterministic gates) or an export. The
text, tokenised by the model's tokenizer, is read as one row with the memory carried
(the eval lengths); every token after the first is scored once. Prints a JSON summary;
--out writes {"position": i, "token": ..., "log_prob": ln p(token_i | token_<i)} lines.
"""
import json
import os
import pathlib
import sys

from absl import flags

from allatt_jax.config import cli
from allatt_jax.config import errors
from allatt_jax.evaluation import likelihood
from allatt_jax.runs import trained_model

_CHECKPOINT, _STEP = cli.DEFINE_trained_model()
_TEXT_FILE = flags.DEFINE_string(
    "text_file", None, "UTF-8 text to score, read as one row with the run's "
    "vocabulary.", required=True)
_OUT = flags.DEFINE_string("out", None, "Where to write per-token log-probabilities "
                           "(JSON lines); none written without it.")


def _check_out_file(path) -> None:
  """Raises FlagError unless `path` can be written: checked before the model loads,
  not found out after scoring."""
  path = pathlib.Path(path)
  if path.is_dir():
    raise errors.FlagError(f"--out={path} is a folder; give a file name, e.g. "
                           f"--out={path / 'scores.jsonl'}.")
  if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
    raise errors.FlagError(f"--out={path}: the folder {path.parent} does not exist or "
                           "is not writable; create it, or write the file elsewhere.")


def main(argv):
  del argv
  if _OUT.value:
    _check_out_file(_OUT.value)
  model = trained_model.load(_CHECKPOINT.value, _STEP.value)
  text = likelihood.read_text(_TEXT_FILE.value)
  summary, ids, log_probs = likelihood.score_text(model, text)
  if _OUT.value:
    likelihood.write_token_log_probs(_OUT.value, model.tokenizer.vocab, ids, log_probs)
  json.dump({"file": _TEXT_FILE.value, "checkpoint": _CHECKPOINT.value, **summary},
            sys.stdout, indent=2)
  print()


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv, flag_names={}, fallback_advice=trained_model.OLD_MODEL_ADVICE)


if __name__ == "__main__":
  run()
