"""The evaluation folder on an untrained model, in the fast tier: a stream scored with
memory against one pass over each row (every target once, padding left out, the
metric in the corpus's unit); a scored text's summary and per-token file; the
sampler's law (temperature, top k, a fresh draw per token) and its reading of the
prompt; models' speeds timed in turns. test_evaluation_score_sample.py has the commands on a trained model."""
import dataclasses
import functools
import json
import math
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.evaluation import generation
from allatt_jax.evaluation import likelihood
from allatt_jax.evaluation import speed
from allatt_jax.evaluation import stream_eval
from allatt_jax.config import errors
from allatt_jax.data import tokenization
from allatt_jax.model import transformer as model_lib
from allatt_jax.parallel import sharding
from allatt_jax.runs import trained_model

VOCAB = 23
# 26 tokens: 25 targets in 2 rows of 13 and 12, read in segments of 4: the last
# segment is partial and the second row ends one target early (padding).
NUM_TOKENS, BATCH, SEQ_LEN = 26, 2, 4
# Memory longer than a row: a segment sees everything before it in its row, as one
# pass over the row does.
MEM_LEN = 32


def tiny_model():
  cfg = model_lib.ModelConfig(kind="allatt", vocab_size=VOCAB, num_layers=2, d_model=16,
                              num_heads=2, num_persistent=4, max_relative_len=64,
                              same_length=False)
  lm = model_lib.TransformerLM(cfg)
  tokens_1x4 = jnp.zeros((1, 4), jnp.int32)
  variables = nn.unbox(lm.init(jax.random.key(0), tokens_1x4, tokens_1x4,
                               model_lib.init_memory(cfg, 1, 4)))
  return lm, variables


@functools.partial(jax.jit, static_argnames="lm")
def _log_probs(variables, ids_1xN, *, lm):
  """Log-probabilities (N, V) of the next token at every position of one segment read
  with no memory."""
  logp_1xNxV, _ = lm.apply(variables, ids_1xN, model_lib.init_memory(lm.cfg, 1, 0),
                           method=lm.log_probs)
  return logp_1xNxV[0]


def one_pass_nll(lm, variables, ids):
  """-ln p(ids[i] | ids[:i]) for i >= 1, the whole of `ids` read as one segment."""
  ids = np.asarray(ids, np.int32)
  logp_NxV = np.asarray(_log_probs(variables, ids[None, :-1], lm=lm), np.float64)
  return -logp_NxV[np.arange(len(ids) - 1), ids[1:]]


def random_tokens(seed: int) -> np.ndarray:
  return np.asarray(jax.random.randint(jax.random.key(seed), (NUM_TOKENS,), 0, VOCAB))


def one_device_evaluator(lm, mem_len: int = MEM_LEN) -> stream_eval.Evaluator:
  """The evaluator of `lm` in rows of BATCH, segments of SEQ_LEN, on one device, as a
  run's eval section sets it."""
  mesh = jax.make_mesh((1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  config = types.SimpleNamespace(eval=types.SimpleNamespace(
      batch_size=BATCH, seq_len=SEQ_LEN, mem_len=mem_len))
  return stream_eval.Evaluator.from_config(lm, mesh, config)


@pytest.mark.slow
def test_a_split_scores_every_target_once_with_the_memory_carried():
  lm, variables = tiny_model()
  tokens = random_tokens(1)
  evaluator = one_device_evaluator(lm)
  scored = evaluator.score(variables, tokens)

  # The second row's pass reads one token past the text (a 0), whose target it drops:
  # both rows then compile one pass.
  padded = np.append(tokens, 0)
  per_row = [one_pass_nll(lm, variables, padded[:14]),
             one_pass_nll(lm, variables, padded[13:])[:12]]
  assert scored["tokens"] == NUM_TOKENS - 1
  np.testing.assert_allclose(scored["nll"], np.concatenate(per_row).mean(), rtol=1e-5)

  # A text: one row, its tokens' values in order.
  whole = one_pass_nll(lm, variables, tokens)
  log_probs = likelihood.token_log_probs(lm, variables, tokens, seq_len=SEQ_LEN,
                                         mem_len=MEM_LEN)
  assert log_probs.shape == (NUM_TOKENS - 1,)
  np.testing.assert_allclose(-log_probs, whole, rtol=1e-5, atol=1e-6)


def test_an_evaluator_reads_its_config_and_scores_max_batches_of_its_batches():
  lm, variables = tiny_model()
  evaluator = one_device_evaluator(lm, mem_len=6)
  assert (evaluator.batch_size, evaluator.seq_len, evaluator.mem_len) == (BATCH, SEQ_LEN, 6)
  for batches in (1, 2):
    scored = evaluator.score(variables, random_tokens(1), max_batches=batches)
    assert scored["tokens"] == batches * BATCH * SEQ_LEN


def test_without_memory_each_segment_is_scored_alone():
  lm, variables = tiny_model()
  tokens = random_tokens(1)
  expected = []
  for row_start, targets in ((0, 13), (13, 12)):   # the rows of NUM_TOKENS' comment
    for start in range(0, targets, SEQ_LEN):
      end = min(start + SEQ_LEN, targets)
      expected.append(one_pass_nll(lm, variables, tokens[row_start + start:row_start + end + 1]))
  scored = one_device_evaluator(lm, mem_len=0).score(variables, tokens)
  np.testing.assert_allclose(scored["nll"], np.concatenate(expected).mean(), rtol=1e-5)


def test_token_nll_is_in_text_order_over_rows_and_averages_to_the_score():
  """A token changed in the second row's first segment changes no value before its
  own, though values come from both rows of each batch."""
  lm, variables = tiny_model()
  evaluator = one_device_evaluator(lm)
  tokens = random_tokens(1)
  changed = tokens.copy()
  changed[16] = (tokens[16] + 1) % VOCAB   # the target of value 15, in row 2 (14 ..)
  nll, nll_changed = (evaluator.token_nll(variables, t) for t in (tokens, changed))
  assert nll.shape == (NUM_TOKENS - 1,)
  np.testing.assert_allclose(nll_changed[:15], nll[:15], rtol=1e-6)
  assert nll_changed[15] != pytest.approx(nll[15])
  np.testing.assert_allclose(nll.mean(), evaluator.score(variables, tokens)["nll"],
                             rtol=1e-5)


def test_each_split_is_scored_as_its_metric_and_its_nll():
  lm, variables = tiny_model()
  evaluator = one_device_evaluator(lm)
  splits = {"valid": random_tokens(1), "test": random_tokens(2)}
  results = stream_eval.evaluate_splits(
      evaluator, variables, types.SimpleNamespace(splits=splits, metric="bpc"))
  assert results["valid"] != pytest.approx(results["test"])
  for split, tokens in splits.items():
    nll = evaluator.score(variables, tokens)["nll"]
    assert results[f"{split}_nll"] == pytest.approx(nll)
    assert results[split] == pytest.approx(nll / math.log(2))


def test_a_texts_summary_counts_its_scored_tokens_and_a_word_models_unknown_words():
  lm, variables = tiny_model()
  config = types.SimpleNamespace(eval=types.SimpleNamespace(seq_len=SEQ_LEN, mem_len=MEM_LEN))
  words = tokenization.Tokenizer("text_files", "word",
                                 ("<eos>", "<unk>", *(f"w{i}" for i in range(VOCAB - 2))))
  model = trained_model.LoadedModel(config, lm, variables, words)
  summary, ids, log_probs = likelihood.score_text(model, "w1 w2 zebra w3")
  nll = -log_probs.mean()
  assert len(log_probs) == len(ids) - 1     # the first token is context only
  assert summary == {"tokens": len(ids) - 1, "ppl": pytest.approx(math.exp(nll)),
                     "nll": pytest.approx(nll), "unk": 1}
  chars = tokenization.Tokenizer("text_files", "char", tuple("abcdefghijklmnopqrstuvw"))
  summary = likelihood.score_text(dataclasses.replace(model, tokenizer=chars), "abcz")[0]
  assert summary["tokens"] == 2 and set(summary) == {"tokens", "bpc", "nll"}
  with pytest.raises(errors.DataError, match=r"The text has 1 token\(s\) in the vocabulary "
                     r"of dataset 'text_files'; scoring needs at least 2"):
    likelihood.score_text(dataclasses.replace(model, tokenizer=chars), "az")


def test_token_log_probs_are_written_from_position_1(tmp_path):
  likelihood.write_token_log_probs(tmp_path / "t.jsonl", ("a", "b", "c"),
                                   np.array([2, 0, 1]), np.array([-0.5, -1.5]))
  assert [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()] == [
      {"position": 1, "token": "a", "log_prob": -0.5},
      {"position": 2, "token": "b", "log_prob": -1.5}]


def test_the_metric_is_bits_per_character_or_perplexity():
  assert stream_eval.metric_value(1.5 * math.log(2), "bpc") == pytest.approx(1.5)
  assert stream_eval.metric_value(math.log(80.0), "ppl") == pytest.approx(80.0)


def test_a_token_is_drawn_from_the_tempered_distribution_cut_to_its_top_k():
  logp_V = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.06, 0.04]))
  temperature, top_k, masked = 0.5, 3, 1
  draws = 20000
  keys = jax.random.split(jax.random.key(0), draws)
  chosen = jax.jit(jax.vmap(lambda key: generation._choose(
      logp_V, key, temperature, top_k, masked)))(keys)
  counts = np.bincount(np.asarray(chosen), minlength=5)
  # The masked token leaves first, then the cut keeps the top 3 of those left.
  tempered = np.exp(np.asarray(logp_V) / temperature) * np.array([1, 0, 1, 1, 0])
  expected = tempered / tempered.sum()
  sigma = np.sqrt(draws * expected * (1 - expected))
  assert counts[1] == counts[4] == 0
  np.testing.assert_array_less(np.abs(counts - draws * expected), 4 * sigma + 1e-9)


def test_each_new_token_is_a_fresh_draw():
  """At a high temperature the distribution is nearly uniform: tokens drawn with a
  fresh key each would rarely repeat, the same key each time would repeat one."""
  lm, variables = tiny_model()
  sampler = generation.Sampler(lm, seq_len=SEQ_LEN, mem_len=MEM_LEN, temperature=100.0)
  generated = sampler.generate(variables, np.array([1, 2, 3]), 24, seed=0)
  assert len(set(generated.tolist())) > VOCAB // 2


def test_greedy_generation_continues_the_prompt_as_one_pass_over_it_would():
  """The prompt is read once, its last token by the first single-token step: each new
  token is the argmax one pass over the prompt and the tokens so far gives."""
  lm, variables = tiny_model()
  # An untrained model with tied embeddings mostly predicts the token it reads;
  # perturbed weights make the prediction depend on the context.
  leaves, treedef = jax.tree.flatten(variables["params"])
  keys = jax.random.split(jax.random.key(4), len(leaves))
  variables = {"params": treedef.unflatten(
      [x + 0.5 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])}
  prompt = np.asarray(jax.random.randint(jax.random.key(3), (7,), 0, VOCAB))
  sampler = generation.Sampler(lm, seq_len=SEQ_LEN, mem_len=MEM_LEN, temperature=0.0)
  generated = sampler.generate(variables, prompt, 6)
  # The prefix sits at the start of a buffer of fixed length (one compile): causality
  # keeps the positions after it from changing its log-probabilities.
  greedy = np.zeros(len(prompt) + 6, np.int32)
  greedy[:len(prompt)] = prompt
  for length in range(len(prompt), len(greedy)):
    greedy[length] = np.argmax(_log_probs(variables, greedy[None], lm=lm)[length - 1])
  np.testing.assert_array_equal(generated, greedy[len(prompt):])


def test_models_are_timed_in_interleaved_rounds_and_compared_round_by_round(monkeypatch):
  """Each round times each model once, in turn, after an untimed compile each; a
  model's speed is its median, a speed-up the median of the rounds' ratios (not the
  ratio of the medians), CPU time per token beside."""
  # Wall and CPU seconds of each model's timed run of 100 tokens, round by round: the
  # machine slowed both models in round 2.
  walls = {"baseline": iter([1.0, 4.0, 2.0]), "pruned": iter([0.25, 2.0, 2.0])}
  cpus = {"baseline": iter([2.0, 2.2, 1.8]), "pruned": iter([1.0, 1.0, 1.2])}
  clock = {"wall": 0.0, "cpu": 0.0}
  monkeypatch.setattr(speed, "time", types.SimpleNamespace(
      perf_counter=lambda: clock["wall"], monotonic=lambda: clock["wall"],
      process_time=lambda: clock["cpu"]))
  calls = []

  def evaluator(lm, mesh, config):
    del mesh, config

    def score(variables, tokens, max_batches):
      del variables, tokens
      calls.append((lm, max_batches))
      if max_batches > 1:
        clock["wall"] += next(walls[lm])
        clock["cpu"] += next(cpus[lm])
      return {"tokens": 100}
    return types.SimpleNamespace(score=score)

  monkeypatch.setattr(stream_eval.Evaluator, "from_config", evaluator)
  model = lambda name: types.SimpleNamespace(lm=name, variables=None)
  speeds = speed.tokens_per_s(None, None, None, 5, {"baseline": model("baseline"),
                                                    "pruned": model("pruned")}, rounds=3)
  assert calls[:2] == [("baseline", 1), ("pruned", 1)]
  assert calls[2:] == [("baseline", 5), ("pruned", 5)] * 3
  assert speeds["rounds"] == 3
  assert speeds["baseline_tokens_per_s_rounds"] == [100.0, 25.0, 50.0]
  assert speeds["pruned_tokens_per_s_rounds"] == [400.0, 50.0, 50.0]
  assert (speeds["baseline_tokens_per_s"], speeds["pruned_tokens_per_s"]) == (50.0, 50.0)
  assert speeds["baseline_cpu_us_per_token"] == pytest.approx(20000.0)
  assert speeds["pruned_cpu_us_per_token"] == pytest.approx(10000.0)
  compared = speed.speedup(speeds)
  assert compared["speedup"] == pytest.approx(2.0)                 # of 4, 2 and 1
  assert compared["speedup_quartiles"] == pytest.approx([1.5, 3.0])
  assert compared["cpu_speedup"] == pytest.approx(2.0)             # of 2, 2.2 and 1.5


@pytest.mark.parametrize("ticks, load_average, other, busy", [
    ((10.0, 30.0), None, 0.5, True),     # 2.0 of 2 cores used, 0.5 by others
    ((10.0, 25.5), None, 0.05, False),   # 0.45 idle, but the others used only 0.05
    ((10.0, 20.0), None, 0.0, False),    # this process alone
    ((None, None), 3.0, 1.5, True),      # no /proc/stat: the load average, 3 of 2
])
def test_the_machine_counts_as_busy_when_others_took_cores_it_had_no_idle(
    monkeypatch, ticks, load_average, other, busy):
  monkeypatch.setattr(speed.os, "cpu_count", lambda: 2)
  monkeypatch.setattr(speed.os, "getloadavg", lambda: (load_average, 0.0, 0.0))
  # 10 s of wall time in which this process ran 15 CPU seconds.
  load = speed._load((0.0, 0.0, ticks[0]), (10.0, 15.0, ticks[1]))  # pylint: disable=protected-access
  assert load == {"cores": 2, "own_cores": 1.5, "other_cores": other, "busy": busy}
