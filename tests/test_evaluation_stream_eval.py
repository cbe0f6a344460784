"""Scoring a stream with memory, against one pass over each row with no memory: every
target scored once, padding left out, the metric in the corpus's unit."""
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from allatt_jax.evaluation import likelihood
from allatt_jax.evaluation import stream_eval
from allatt_jax.model import transformer as model_lib
from allatt_jax.parallel import sharding

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
def _one_pass(variables, ids_1xN, *, lm):
  nll_1xN, _, _ = lm.apply(variables, ids_1xN[:, :-1], ids_1xN[:, 1:],
                           model_lib.init_memory(lm.cfg, 1, 0))
  return nll_1xN[0]


def one_pass_nll(lm, variables, ids):
  """-ln p(ids[i] | ids[:i]) for i >= 1, the whole of `ids` read as one segment."""
  return np.asarray(_one_pass(variables, jnp.asarray(ids, jnp.int32)[None], lm=lm),
                    np.float64)


def test_a_split_scores_every_target_once_with_the_memory_carried():
  lm, variables = tiny_model()
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (NUM_TOKENS,), 0, VOCAB))
  mesh = jax.make_mesh((1, 1), sharding.MESH_AXES, devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  evaluator = stream_eval.Evaluator(lm, mesh, batch_size=BATCH, seq_len=SEQ_LEN,
                                    mem_len=MEM_LEN)
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


def test_the_metric_is_bits_per_character_or_perplexity():
  assert stream_eval.metric_value(1.5 * math.log(2), "bpc") == pytest.approx(1.5)
  assert stream_eval.metric_value(math.log(80.0), "ppl") == pytest.approx(80.0)
