"""Scoring and sampling CLIs on a tiny trained baseline (embedded corpus)."""
import functools
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import helpers
from helpers import train_run
from allatt_jax import data as data_lib
from allatt_jax.evaluation import likelihood
from allatt_jax.model import transformer as model_lib
from allatt_jax.evaluation import generation as sampler_lib
from allatt_jax.parallel import sharding
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs import trained_model
from allatt_jax.config.errors import ConfigError

pytestmark = pytest.mark.slow   # every test here trains runs or starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  config = helpers.tiny_run()
  config.data.data_dir = str(tmp_path_factory.mktemp("tfds"))
  workdir = tmp_path_factory.mktemp("baseline")
  train_run(config, workdir)
  return workdir


@pytest.fixture(scope="module")
def model(workdir):
  return trained_model.load(workdir)


@pytest.fixture(scope="module")
def corpus(model):
  return data_lib.load_run_corpus(model.config)


def run_cli(module, *args):
  return subprocess.run([sys.executable, "-m", f"allatt_jax.{module}", *args],
                        capture_output=True, text=True, cwd=ROOT, check=True).stdout


@functools.partial(jax.jit, static_argnames="lm")
def _log_probs_without_memory(variables, ids_1xT, *, lm):
  logp_1xTxV, _ = lm.apply(variables, ids_1xT, model_lib.init_memory(lm.cfg, 1, 0),
                           method=lm.log_probs)
  return logp_1xTxV[0]


def full_prefix_log_probs(model, ids):
  """Log-probabilities at every position of `ids` read as one segment, no memory."""
  return np.asarray(_log_probs_without_memory(
      model.variables, np.asarray(ids, np.int32)[None], lm=model.lm))


def test_score_cli_output(model, corpus, workdir, tmp_path):
  ids = corpus.splits["valid"][:150]
  ids = ids[:np.flatnonzero(ids)[-1] + 1]   # cleaning strips trailing spaces
  assert ids[0] != 0
  text_file, out = tmp_path / "text.txt", tmp_path / "scores.jsonl"
  # Character-level text is cleaned as text8 was: capitals read as lower case.
  text_file.write_text(model.tokenizer.decode(ids).upper())
  summary = json.loads(run_cli("score", f"--checkpoint={workdir}",
                               f"--text_file={text_file}", f"--out={out}"))

  assert set(summary) == {"file", "checkpoint", "tokens", "bpc", "nll"}
  assert summary["tokens"] == len(ids) - 1
  assert summary["bpc"] == pytest.approx(summary["nll"] / math.log(2))
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["position"] for r in records] == list(range(1, len(ids)))
  assert "".join(r["token"] for r in records) == model.tokenizer.decode(ids[1:])
  assert all(r["log_prob"] <= 0 for r in records)
  assert -sum(r["log_prob"] for r in records) == pytest.approx(
      summary["nll"] * summary["tokens"], rel=1e-9)


def test_score_matches_evaluate(model, corpus):
  # Five full segments and a partial one, so memory and padding both matter.
  tokens = np.asarray(corpus.splits["test"][:5 * 16 + 8])
  e = model.config.eval
  log_probs = likelihood.token_log_probs(model.lm, model.variables, tokens,
                                         seq_len=e.seq_len, mem_len=e.mem_len)
  evaluator = stream_eval.Evaluator(model.lm, sharding.make_mesh((1, 1)),
                                    batch_size=1, seq_len=e.seq_len, mem_len=e.mem_len)
  expected = evaluator.score(model.variables, tokens)
  assert len(log_probs) == expected["tokens"] == len(tokens) - 1
  assert -log_probs.mean() == pytest.approx(expected["nll"], rel=1e-5)

  summary, _, _ = likelihood.score_text(model, model.tokenizer.decode(tokens))
  assert summary["bpc"] == pytest.approx(
      stream_eval.metric_value(expected["nll"], "bpc"), rel=1e-5)


def test_score_and_evaluate_give_the_same_number_for_a_text(model, corpus, workdir,
                                                            tmp_path):
  text_file = tmp_path / "text.txt"
  text_file.write_text(model.tokenizer.decode(corpus.splits["test"][:5 * 16 + 8]))
  scored = json.loads(run_cli("score", f"--checkpoint={workdir}",
                              f"--text_file={text_file}"))
  evaluated = json.loads(run_cli("evaluate", f"--checkpoint={workdir}",
                                 f"--text_file={text_file}"))
  assert scored["tokens"] == evaluated["tokens"] == 5 * 16 + 7
  assert scored["bpc"] == evaluated["bpc"] and scored["nll"] == evaluated["nll"]


def test_sampling_is_deterministic_per_seed(model, corpus):
  sampler = sampler_lib.Sampler(model.lm, seq_len=16, mem_len=16)
  prompt = np.asarray(corpus.splits["valid"][:40])
  runs = [sampler.generate(model.variables, prompt, 30, seed) for seed in (0, 0, 1)]
  assert runs[0].shape == (30,) and runs[0].dtype == np.int32
  np.testing.assert_array_equal(runs[0], runs[1])
  assert np.any(runs[0] != runs[2])


def test_generation_with_memory_equals_full_prefix(model, corpus):
  """Each single-token step sees what reading the whole prefix at once would see.

  The memory (24) holds the whole prefix, so steps after a prompt read in segments
  of 8 must give the same next-token distributions as one pass over the prefix.
  """
  prefix = np.asarray(corpus.splits["valid"][:24])
  expected = full_prefix_log_probs(model, prefix)
  sampler = sampler_lib.Sampler(model.lm, seq_len=8, mem_len=24)
  memory = sampler.consume(model.variables, prefix[:11], sampler.initial_memory())
  for position in range(11, len(prefix)):
    _, logp, memory = sampler.step(model.variables, prefix[position], memory,
                                   jax.random.key(0))
    np.testing.assert_allclose(logp, expected[position], atol=2e-5, err_msg=str(position))


def test_top_k_one_is_greedy(model, corpus):
  prompt = np.asarray(corpus.splits["valid"][:10])
  sampler = sampler_lib.Sampler(model.lm, seq_len=8, mem_len=24, top_k=1)
  generated = sampler.generate(model.variables, prompt, 12, seed=3)
  np.testing.assert_array_equal(generated, sampler.generate(model.variables, prompt, 12, 4))
  # Greedy decoding by recomputing the whole prefix for every new token. The prefix
  # sits at the start of a fixed-length buffer (one compile): causality keeps the
  # unfilled positions after it from changing its log-probabilities.
  greedy = np.zeros(len(prompt) + 12, np.int32)
  greedy[:len(prompt)] = prompt
  for length in range(len(prompt), len(greedy)):
    greedy[length] = full_prefix_log_probs(model, greedy)[length - 1].argmax()
  np.testing.assert_array_equal(generated, greedy[len(prompt):])


def test_sample_cli(workdir):
  out = run_cli("sample", f"--checkpoint={workdir}", "--prompt=the city", "--num_tokens=25",
                "--temperature=0.8", "--top_k=5", "--seed=1")
  text = out.rstrip("\n")
  assert text.startswith("the city") and len(text) == len("the city") + 25


def test_sampler_rejects_bad_options(model):
  with pytest.raises(ConfigError, match="top_k"):
    sampler_lib.Sampler(model.lm, seq_len=16, mem_len=16, top_k=model.lm.cfg.vocab_size + 1)
  with pytest.raises(ConfigError, match="mem_len"):
    sampler_lib.Sampler(model.lm, seq_len=16, mem_len=0)
