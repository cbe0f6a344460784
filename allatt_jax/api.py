"""The Python API: a trained model as one object, giving the CLIs' results.

  import allatt_jax
  model = allatt_jax.load("RUN/pruned/export")        # a run's workdir or an export
  model.score("the river flows")                      # {'tokens', 'bpc' or 'ppl', 'nll'}
  model.generate("the city", num_tokens=50)           # the continuation, as text
  logp, memory = model.log_probs(ids)                 # Transformer-XL memory carried
  smaller = model.prune_heads({0: [1, 3]})            # export's head surgery
  leaner = model.prune_persistent_groups({0: {2: [0, 5]}}, group_size=64)
  smaller.save("DIR")                                 # a standalone exported model
"""
from collections.abc import Iterable, Mapping
import functools

import jax
import jax.numpy as jnp
import numpy as np

from allatt_jax.config import errors
from allatt_jax.pruning import model_export
from allatt_jax.pruning import cost_model
from allatt_jax.evaluation import likelihood
from allatt_jax.model import transformer as model_lib
from allatt_jax.pruning import head_removal
from allatt_jax.config import run_config
from allatt_jax.evaluation import generation
from allatt_jax.evaluation import stream_eval
from allatt_jax.runs import trained_model
from allatt_jax.data import tokenization


@functools.partial(jax.jit, static_argnames="lm")
def _log_probs(variables, memory, inputs_BxT, *, lm):
  return lm.apply(variables, inputs_BxT, memory, method=lm.log_probs)


class Model:
  """A trained model (baseline, pruning run with its deterministic gates, or export)
  with its tokenizer; `load` makes one."""

  def __init__(self, loaded: trained_model.LoadedModel):
    self._loaded = loaded

  @property
  def config(self) -> run_config.RunConfig:
    """The run config (data, eval lengths, the model section of this model)."""
    return self._loaded.config

  @property
  def lm(self) -> model_lib.TransformerLM:
    return self._loaded.lm

  @property
  def variables(self):
    return self._loaded.variables

  @property
  def tokenizer(self) -> tokenization.Tokenizer:
    return self._loaded.tokenizer

  @property
  def heads_per_layer(self) -> tuple[int, ...]:
    """Heads of each layer: a gated model's, those its gates keep, as `costs()`, the
    `costs` command and its export count them (`stored_heads_per_layer`: those its
    parameters hold)."""
    return self._kept.layer_heads

  @property
  def persistent_per_layer(self) -> tuple[int, ...]:
    """Persistent slots each layer keeps, summed over its heads: a gated model's
    without those of its closed heads and closed persistent groups (as `costs()`)."""
    return tuple(self._kept.layer_slots)

  @property
  def stored_heads_per_layer(self) -> tuple[int, ...]:
    """Heads of each layer its parameters hold: a gated model's closed heads too (the
    unpruned shape), which its `prune_heads` numbers. An export's are its heads."""
    return self.lm.cfg.layer_heads

  @functools.cached_property
  def _kept(self) -> model_lib.ModelConfig:
    """The model as it computes: a gated one without its closed heads and groups."""
    return head_removal.running_model_config(self.lm.cfg, self.variables)

  def score(self, text: str) -> dict:
    """{'tokens', 'bpc' or 'ppl', 'nll' (nats per token), and 'unk' for words} of
    `text`, read as `python -m allatt_jax.score` reads a file."""
    return likelihood.score_text(self._loaded, text)[0]

  def log_probs(self, token_ids, memory=None):
    """(log-probabilities (..., T, V) of the next token at every position, new memory).

    token_ids: (T,) or (B, T) ids, read in segments of the run's eval.seq_len.
    memory: what the previous call returned, to continue the same text(s); None
    starts with empty memory of the run's eval.mem_len positions.

    Raises:
      ValueError: ids outside the vocabulary, or not 1-D/2-D.
    """
    ids = np.asarray(token_ids)
    if (ids.ndim not in (1, 2) or not ids.shape[-1]
        or not np.issubdtype(ids.dtype, np.integer)):
      raise ValueError(f"token_ids must be integer ids of shape (T,) or (B, T) with "
                       f"T >= 1, not {ids.dtype} {ids.shape}.")
    if ids.size and not (0 <= ids.min() and ids.max() < self.lm.cfg.vocab_size):
      raise ValueError(f"token_ids must lie in [0, {self.lm.cfg.vocab_size}); got "
                       f"{ids.min()} .. {ids.max()}.")
    ids_BxT = ids.reshape(-1, ids.shape[-1]).astype(np.int32)
    if memory is None:
      memory = model_lib.init_memory(self.lm.cfg, ids_BxT.shape[0],
                                     self.config.eval.mem_len)
    segments, memory = stream_eval.read_stream(
        functools.partial(_log_probs, self.variables, lm=self.lm),
        stream_eval.row_segments(ids_BxT, self.config.eval.seq_len), memory)
    logp_BxTxV = jnp.concatenate(segments, axis=1)
    return logp_BxTxV.reshape(*ids.shape, -1), memory

  def generate(self, prompt: str, num_tokens: int = 100, temperature: float = 1.0,
               top_k: int = 0, seed: int = 0, keep_unk: bool = False) -> str:
    """The text that follows `prompt`, as `python -m allatt_jax.sample` makes it: a
    word vocabulary's <unk> is never sampled, unless `keep_unk`."""
    if num_tokens < 0:
      raise errors.ConfigError(f"num_tokens={num_tokens}: use 0 or more.")
    result = generation.sample_text(self._loaded, prompt, num_tokens,
                                    temperature=temperature, top_k=top_k, seed=seed,
                                    keep_unk=keep_unk)
    return self.tokenizer.decode(result["generated_ids"])

  def costs(self) -> dict:
    """Parameters and MACs per token of this model at its eval lengths (costs.py), and
    its heads: per layer, and each head's persistent slots ('persistent_per_head', in
    the order `prune_heads` numbers them); a gated model's closed heads count as
    removed, as in its export."""
    return cost_model.model_report(self.config, self._kept)

  def prune_heads(self, heads: Mapping[int, Iterable[int]]) -> "Model":
    """A smaller model without `heads` ({layer: [head, ...]}, indices of this model's
    heads), cut out of the parameters as an export cuts closed heads; a gated
    model's closed gates go too.

    The smaller model (as every export) numbers each layer's heads anew, 0 .. H_l − 1:
    the heads left in their order, or, where they keep different numbers of
    persistent slots, by those numbers, most first (equal ones in their order).
    Indices given to it refer to that order, which `costs()['persistent_per_head']`
    shows.

    Raises:
      ConfigError: a layer or head that does not exist.
    """
    return self._pruned(heads)

  def _pruned(self, heads, slots=None) -> "Model":
    host_variables = jax.device_get(self.variables)
    pruned_cfg, params = head_removal.remove_heads(self.lm.cfg, host_variables, heads, slots)
    config = model_export.exported_config(self.config, pruned_cfg)
    return Model(trained_model.LoadedModel(config, model_lib.TransformerLM.from_config(config),
                                           jax.device_put({"params": params}), self.tokenizer))

  def prune_persistent_groups(self, groups: Mapping[int, Mapping[int, Iterable[int]]],
                              group_size: int | None = None) -> "Model":
    """A smaller model without the persistent groups `groups` ({layer: {head:
    [group, ...]}}, indices of this model's heads; group g is slots g·G .. (g+1)·G − 1
    of the head's current slots), cut as an export cuts closed groups: the heads
    keep their other slots (a head may keep none), each layer's heads then numbered
    anew by the slots they keep, most first (`costs()['persistent_per_head']`), as
    the indices the smaller model takes count them. A gated model's closed heads and
    groups go too.

    `group_size`: G, by default the gated model's `gates.persistent_group`.

    Raises:
      ConfigError: a layer, head or group that does not exist, or no group size.
    """
    size = group_size or self.config.gates.persistent_group
    if not size or size < 1:
      raise errors.ConfigError("prune_persistent_groups needs the slots per group: pass "
                               "group_size=G (this model has no persistent group gates).")
    cfg, slots = self.lm.cfg, {}
    for layer, by_head in groups.items():
      slots[layer] = {}
      for head, head_groups in by_head.items():
        exists = (isinstance(layer, int) and 0 <= layer < cfg.num_layers
                  and isinstance(head, int) and 0 <= head < cfg.layer_heads[layer])
        if not exists:
          raise errors.ConfigError(
              f"Layer {layer!r} has no head {head!r} (heads per layer: "
              f"{list(cfg.layer_heads)}). Give groups as {{layer: {{head: [group, ...]}}}}.")
        count = cfg.head_slots(layer)[head] // size
        bad = [g for g in head_groups if not isinstance(g, int) or not 0 <= g < count]
        if bad:
          raise errors.ConfigError(
              f"Head {head} of layer {layer} has no persistent group(s) {bad} of {size} "
              f"slots: its groups are 0 .. {count - 1}.")
        slots[layer][head] = [n for g in head_groups for n in range(g * size, (g + 1) * size)]
    return self._pruned({}, slots)

  def save(self, directory, overwrite: bool = False) -> None:
    """Writes this model as a standalone export (config, params, tokenizer and its
    vocabulary) that `load` and every CLI read; a gated model is saved without its
    closed heads. A folder that holds something already is refused, as `export`
    refuses it; with `overwrite`, an exported model there is replaced.

    Raises:
      FileExistsError: `directory` holds an exported model and `overwrite` is not
        set, or it holds anything else (a run, say), which is never replaced.
    """
    found = model_export.existing_target(directory)
    if found == "other":
      raise FileExistsError(f"{directory} exists and is not an exported model; save to a "
                            "new or empty folder.")
    if found and not overwrite:
      raise FileExistsError(f"{directory} already holds an exported model; save "
                            "elsewhere, or replace it with save(directory, "
                            "overwrite=True).")
    model = self.prune_heads({}) if self.lm.cfg.gated else self
    model_export.save(directory, model.config, model.lm.cfg,
                      jax.device_get(model.variables["params"]), self.tokenizer)


def load(directory, step: int | None = None) -> Model:
  """The model in `directory`: a run's workdir (checkpoint `step`, default the
  latest) or an exported model. Needs neither the dataset nor the network when the
  model carries its tokenizer.json.

  Raises:
    CheckpointError: no model (or no such step) there.
    DataError: an older model without tokenizer.json whose dataset is missing.
  """
  return Model(trained_model.load(directory, step))
