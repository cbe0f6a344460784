r"""Scores a text file with a trained model: per-token log-probabilities, ppl or bpc.

  python -m allatt_jax.score --checkpoint=DIR [--step=N] --text_file=FILE [--out=FILE.jsonl]

DIR is a run's workdir (baseline or pruning run; gated models use their
deterministic gates) or an exported model. The text is tokenised with the model's
saved tokenizer (its dataset's vocabulary and rules) and read as one row, segment by segment, with the Transformer-XL
memory carried across the whole file (the eval seq_len and mem_len of the run's
config), exactly as `evaluate` reads a split: every token after the first, which is
context only, is scored once. Prints a JSON summary; with --out, writes one JSON line
per scored token: {"position": i, "token": ..., "log_prob": ln p(token_i | token_<i)}.
"""
import functools
import json
import os
import pathlib
import sys

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax import cli
from allatt_jax import data as data_lib
from allatt_jax import errors
from allatt_jax import evaluation
from allatt_jax import loader
from allatt_jax import model as model_lib


@functools.partial(jax.jit, static_argnames="lm", donate_argnums=(1,))
def _segment_nll(variables, memory, batch, *, lm):
  """Per-token NLL of one `eval_batches` batch (its weights are read outside)."""
  inputs_1xT, targets_1xT, _ = batch
  nll_1xT, memory, _ = lm.apply(variables, inputs_1xT, targets_1xT, memory)
  return nll_1xT, memory


def token_log_probs(lm: model_lib.TransformerLM, variables, tokens: np.ndarray, *,
                    seq_len: int, mem_len: int) -> np.ndarray:
  """ln p(tokens[i] | tokens[:i]) for i = 1 .. N-1, in nats.

  One row read in segments of `seq_len` with `mem_len` positions of memory
  (`evaluation.read_stream`), batched like `evaluation.Evaluator` with a batch of one,
  so the mean of the negated values is that evaluator's NLL.
  """
  batches = list(data_lib.eval_batches(tokens, 1, seq_len))
  nll_segments, _ = evaluation.read_stream(
      functools.partial(_segment_nll, variables, lm=lm), batches,
      model_lib.init_memory(lm.cfg, 1, mem_len))
  # One transfer at the end keeps the device busy instead of syncing per segment.
  nll = np.asarray(jnp.concatenate(nll_segments, axis=1)).ravel()
  weights = np.concatenate([batch_weights for *_, batch_weights in batches], axis=1)
  return -nll[weights.ravel() > 0].astype(np.float64)


def score_text(model: loader.LoadedModel, text: str) -> tuple[dict, np.ndarray, np.ndarray]:
  """(summary, token ids, log-probabilities of ids[1:]) of `text`.

  Raises:
    DataError: the text has fewer than two tokens of the vocabulary.
  """
  ids, skipped = model.tokenizer.encode(text)
  if len(ids) < 2:
    raise errors.DataError(
        f"The text has {len(ids)} token(s) in the vocabulary of dataset "
        f"{model.tokenizer.dataset!r}; scoring needs at least 2 (the first one is context "
        "only).")
  e = model.config.eval
  log_probs = token_log_probs(model.lm, model.variables, ids, seq_len=e.seq_len,
                              mem_len=e.mem_len)
  nll = float(-log_probs.mean())
  metric = model.tokenizer.metric
  summary = {"tokens": len(log_probs), metric: evaluation.metric_value(nll, metric),
             "nll": nll}
  if model.tokenizer.level == "word":
    summary["unk"] = skipped
  return summary, ids, log_probs


def write_token_log_probs(path, vocab, ids: np.ndarray, log_probs: np.ndarray) -> None:
  """JSON lines {"position", "token", "log_prob"} for positions 1 .. N-1."""
  with open(path, "w", encoding="utf-8") as f:
    for position, (token_id, log_prob) in enumerate(zip(ids[1:], log_probs), start=1):
      f.write(json.dumps({"position": position, "token": vocab[token_id],
                          "log_prob": float(log_prob)}, ensure_ascii=False) + "\n")


def read_text(path) -> str:
  try:
    return pathlib.Path(path).read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise errors.DataError(f"Cannot read the text file {path}: {e}") from e


def check_out_file(path) -> None:
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
    check_out_file(_OUT.value)
  model = loader.load(_CHECKPOINT.value, _STEP.value)
  summary, ids, log_probs = score_text(model, read_text(_TEXT_FILE.value))
  if _OUT.value:
    write_token_log_probs(_OUT.value, model.tokenizer.vocab, ids, log_probs)
  json.dump({"file": _TEXT_FILE.value, "checkpoint": _CHECKPOINT.value, **summary},
            sys.stdout, indent=2)
  print()


if __name__ == "__main__":
  _CHECKPOINT, _STEP = cli.DEFINE_trained_model()
  _TEXT_FILE = flags.DEFINE_string(
      "text_file", None, "UTF-8 text to score, read as one row with the run's "
      "vocabulary.", required=True)
  _OUT = flags.DEFINE_string("out", None, "Where to write per-token log-probabilities "
                             "(JSON lines); none written without it.")
  cli.run(main, flag_names={}, fallback_advice=loader.OLD_MODEL_ADVICE)
