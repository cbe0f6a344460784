"""How likely a trained model finds text: per-token log-probabilities of a text, and
its metric (bpc or ppl) on a text or on a split of its dataset.

A text is read as one row, segment by segment, with the Transformer-XL memory carried
across all of it (the eval seq_len and mem_len of the run's config), as `stream_eval`
reads a split: every token after the first, which is context only, is scored once.
`python -m allatt_jax.score` and `python -m allatt_jax.evaluate` print these, and
`api.Model.score` returns them.
"""
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax import data as data_lib
from allatt_jax import errors
from allatt_jax import model as model_lib
from allatt_jax import sharding
from allatt_jax import stream_eval
from allatt_jax import trained_model


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
  (`stream_eval.read_stream`), batched like `stream_eval.Evaluator` with a batch of one,
  so the mean of the negated values is that evaluator's NLL.
  """
  batches = list(data_lib.eval_batches(tokens, 1, seq_len))
  nll_segments, _ = stream_eval.read_stream(
      functools.partial(_segment_nll, variables, lm=lm), batches,
      model_lib.init_memory(lm.cfg, 1, mem_len))
  # One transfer at the end keeps the device busy instead of syncing per segment.
  nll = np.asarray(jnp.concatenate(nll_segments, axis=1)).ravel()
  weights = np.concatenate([batch_weights for *_, batch_weights in batches], axis=1)
  return -nll[weights.ravel() > 0].astype(np.float64)


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
  by default read from the run's config; at the run's eval batch and lengths) or on
  `text` (one row, as `score_text` reads it).

  Raises:
    DataError: the dataset cannot be loaded, or the text has fewer than 2 tokens.
  """
  e = model.config.eval
  if text is not None:
    tokens, _ = _text_ids(model, text)
    batch_size = 1
  else:
    corpus = corpus or data_lib.load_run_corpus(model.config)
    tokens = corpus.splits[split]
    batch_size = e.batch_size
  # One device: a model trained on a mesh evaluates anywhere, at any batch size.
  mesh = jax.make_mesh((1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  evaluator = stream_eval.Evaluator(model.lm, mesh, batch_size=batch_size,
                                   seq_len=e.seq_len, mem_len=e.mem_len)
  scored = evaluator.score(model.variables, tokens)
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
