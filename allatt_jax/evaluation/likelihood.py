"""How likely a trained model finds text: per-token log-probabilities of a text, and
its metric (bpc or ppl) on a text or on a split of its dataset.

A text is read as one row with the memory carried across all of it (the eval seq_len
and mem_len), as `stream_eval` reads a split: every token after the first is scored once.
"""
import functools
import json
import pathlib

import jax
import numpy as np

from allatt_jax import data as data_lib
from allatt_jax.config import errors
from allatt_jax.model import transformer as model_lib
from allatt_jax.parallel import sharding
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs import trained_model


@functools.lru_cache(maxsize=8)
def _evaluator(lm: model_lib.TransformerLM, batch_size: int, seq_len: int,
               mem_len: int) -> stream_eval.Evaluator:
  """An evaluator on this host's first device (a model trained on a mesh evaluates
  anywhere, at any batch size), kept so that repeated calls compile once."""
  mesh = jax.make_mesh((1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return stream_eval.Evaluator(lm, mesh, batch_size=batch_size, seq_len=seq_len,
                               mem_len=mem_len)


def token_log_probs(lm: model_lib.TransformerLM, variables, tokens: np.ndarray, *,
                    seq_len: int, mem_len: int) -> np.ndarray:
  """ln p(tokens[i] | tokens[:i]) for i = 1 .. N-1, in nats: one row read in segments
  of `seq_len` with `mem_len` positions of memory, by the evaluator's own step, so the
  mean of the negated values is its NLL."""
  return -_evaluator(lm, 1, seq_len, mem_len).token_nll(variables, tokens)


def _text_ids(model: trained_model.LoadedModel, text: str) -> tuple[np.ndarray, int]:
  """(the token ids of `text`, the words it skipped); DataError under two tokens."""
  ids, skipped = model.tokenizer.encode(text)
  if len(ids) < 2:
    raise errors.DataError(
        f"The text has {len(ids)} token(s) in the vocabulary of dataset "
        f"{model.tokenizer.dataset!r}; scoring needs at least 2 (the first one is context "
        "only).")
  return ids, skipped


def score_text(model: trained_model.LoadedModel, text: str) -> tuple[dict, np.ndarray, np.ndarray]:
  """(summary, token ids, log-probabilities of ids[1:]) of `text`.

  Raises:
    DataError: the text has fewer than two tokens of the vocabulary.
  """
  ids, skipped = _text_ids(model, text)
  e = model.config.eval
  log_probs = token_log_probs(model.lm, model.variables, ids, seq_len=e.seq_len,
                              mem_len=e.mem_len)
  nll = float(-log_probs.mean())
  metric = model.tokenizer.metric
  summary = {"tokens": len(log_probs), metric: stream_eval.metric_value(nll, metric),
             "nll": nll}
  if model.tokenizer.level == "word":
    summary["unk"] = skipped
  return summary, ids, log_probs


def evaluate_model(model: trained_model.LoadedModel, *, split: str | None = None,
                   text: str | None = None, corpus: data_lib.Corpus | None = None) -> dict:
  """{'tokens', metric, 'nll'} of a loaded model on a split of its dataset (`corpus`,
  by default read from the run's config; at the run's eval batch and lengths), or
  `score_text`'s summary of `text`.

  Raises:
    DataError: the dataset cannot be loaded, or the text has fewer than 2 tokens.
  """
  if text is not None:
    return score_text(model, text)[0]
  e = model.config.eval
  corpus = corpus or data_lib.load_run_corpus(model.config)
  evaluator = _evaluator(model.lm, e.batch_size, e.seq_len, e.mem_len)
  scored = evaluator.score(model.variables, corpus.splits[split])
  metric = model.tokenizer.metric
  return {"tokens": scored["tokens"], metric: stream_eval.metric_value(scored["nll"], metric),
          "nll": scored["nll"]}


def read_text(path) -> str:
  """The UTF-8 text of the file `path`.

  Raises:
    DataError: the file cannot be read as UTF-8 text.
  """
  try:
    return pathlib.Path(path).read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise errors.DataError(f"Cannot read the text file {path}: {e}") from e


def write_token_log_probs(path, vocab, ids: np.ndarray, log_probs: np.ndarray) -> None:
  """JSON lines {"position", "token", "log_prob"} for positions 1 .. N-1."""
  with open(path, "w", encoding="utf-8") as f:
    for position, (token_id, log_prob) in enumerate(zip(ids[1:], log_probs), start=1):
      f.write(json.dumps({"position": position, "token": vocab[token_id],
                          "log_prob": float(log_prob)}, ensure_ascii=False) + "\n")
