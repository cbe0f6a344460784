"""Text generation from a trained model with the Transformer-XL memory.

A prompt is read once, in segments of at most the eval seq_len, to fill the memory;
each new token is one jitted single-token step attending to the memory and itself, so
the prompt is never recomputed. The same seed gives the same text. A word vocabulary's
<unk> is never sampled unless asked for: it stands for every rare word at once, so a
small model's text would be mostly <unk> (LM samplers commonly mask it).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax.config import errors
from allatt_jax.model import transformer as model_lib
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs import trained_model


@functools.partial(jax.jit, static_argnames="lm", donate_argnums=(1,))
def _consume(variables, memory, inputs_1xT, *, lm):
  _, memory, _ = lm.apply(variables, inputs_1xT, memory, method=lm.hidden)
  return None, memory


@functools.partial(jax.jit, donate_argnums=(2,),
                   static_argnames=("lm", "temperature", "top_k", "masked_token"))
def _step(variables, token_1x1, memory, key, *, lm, temperature, top_k, masked_token):
  logp_1x1xV, memory = lm.apply(variables, token_1x1, memory, method=lm.log_probs)
  logp_V = logp_1x1xV[0, 0]
  chosen = _choose(logp_V, key, temperature, top_k, masked_token)
  return chosen.reshape(1, 1), logp_V, memory


def _choose(logp_V, key, temperature, top_k, masked_token):
  """A token from the distribution sharpened by `temperature` and cut to its top k,
  never `masked_token` (None: any)."""
  if masked_token is not None:
    logp_V = logp_V.at[masked_token].set(-jnp.inf)
  if temperature == 0.0:
    return jnp.argmax(logp_V).astype(jnp.int32)
  logits_V = logp_V / temperature
  if top_k:
    kth_largest = jax.lax.top_k(logits_V, top_k)[0][-1]
    logits_V = jnp.where(logits_V >= kth_largest, logits_V, -jnp.inf)
  return jax.random.categorical(key, logits_V).astype(jnp.int32)


class Sampler:
  """Token generation for one model: a prompt, then one jitted step per new token.

  temperature: divides the log-probabilities before sampling; 0 is greedy decoding.
  top_k: sample among the k most likely tokens only; 0 keeps the whole vocabulary.
  masked_token: a token id never chosen (a word vocabulary's <unk>); None: none.
  """

  def __init__(self, lm: model_lib.TransformerLM, *, seq_len: int, mem_len: int,
               temperature: float = 1.0, top_k: int = 0, masked_token: int | None = None):
    if mem_len < 1:
      raise errors.ConfigError(
          "Sampling feeds one token at a time, so it needs memory: config.eval.mem_len "
          f"is {mem_len}. Use a model whose run config has eval.mem_len >= 1.")
    if temperature < 0:
      raise errors.ConfigError(f"--temperature={temperature}: use 0 (greedy) or more.")
    if not 0 <= top_k <= lm.cfg.vocab_size:
      raise errors.ConfigError(
          f"--top_k={top_k}: use 0 (no cut) up to the vocabulary size "
          f"{lm.cfg.vocab_size}.")
    self.lm, self.seq_len, self.mem_len = lm, seq_len, mem_len
    self._options = dict(lm=lm, temperature=float(temperature), top_k=int(top_k),
                         masked_token=masked_token)

  def initial_memory(self):
    return model_lib.init_memory(self.lm.cfg, 1, self.mem_len)

  def consume(self, variables, tokens: np.ndarray, memory):
    """The memory after reading `tokens` (1-D) in segments of at most seq_len."""
    _, memory = stream_eval.read_stream(
        functools.partial(_consume, variables, lm=self.lm),
        stream_eval.row_segments(np.asarray(tokens, np.int32)[None], self.seq_len), memory)
    return memory

  def step(self, variables, token_1x1, memory, key):
    """(chosen next token (1, 1), log-probabilities over the vocabulary, memory)."""
    return _step(variables, jnp.asarray(token_1x1, jnp.int32).reshape(1, 1), memory, key,
                 **self._options)

  def generate(self, variables, prompt: np.ndarray, num_tokens: int,
               seed: int = 0) -> np.ndarray:
    """`num_tokens` ids following the (non-empty, 1-D) `prompt`."""
    memory = self.consume(variables, prompt[:-1], self.initial_memory())
    # The prompt's last token goes through the single-token step: its output is the
    # first new token's distribution.
    token_1x1, key = prompt[-1:].reshape(1, 1), jax.random.key(seed)
    generated = []
    for i in range(num_tokens):
      token_1x1, _, memory = self.step(variables, token_1x1, memory,
                                       jax.random.fold_in(key, i))
      generated.append(token_1x1)
    if not generated:
      return np.zeros((0,), np.int32)
    return np.asarray(jnp.concatenate(generated, axis=1)).ravel()


def sample_text(model: trained_model.LoadedModel, prompt: str, num_tokens: int, *,
                temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                keep_unk: bool = False) -> dict:
  """The prompt as the model reads it, its continuation, and skipped prompt tokens.
  The continuation holds no <unk> unless `keep_unk` (the prompt may).

  Raises:
    DataError: no token of the prompt is in the vocabulary.
  """
  ids, skipped = model.tokenizer.encode(prompt)
  if not len(ids):
    hint = " (lower-case letters and spaces)" if model.tokenizer.level == "char" else ""
    raise errors.DataError(f"The prompt {prompt!r} has no token in the vocabulary of "
                           f"dataset {model.tokenizer.dataset!r}{hint}.")
  e = model.config.eval
  sampler = Sampler(model.lm, seq_len=e.seq_len, mem_len=e.mem_len,
                    temperature=temperature, top_k=top_k,
                    masked_token=None if keep_unk else model.tokenizer.unk_id)
  generated = sampler.generate(model.variables, ids, num_tokens, seed)
  return {"prompt": model.tokenizer.decode(ids),
          "text": model.tokenizer.decode(np.concatenate([ids, generated])),
          "generated_ids": generated, "skipped": skipped}
