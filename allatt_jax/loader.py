"""Trained models for inference: a run's workdir or an exported model, with its
dataset's vocabulary (`score`, `sample` and the demo's speed comparison read them)."""
import dataclasses
from typing import Any

import jax
import ml_collections

from allatt_jax import checkpointing
from allatt_jax import data as data_lib
from allatt_jax import errors
from allatt_jax import model as model_lib


def load_lm(checkpoint) -> tuple[ml_collections.ConfigDict, model_lib.TransformerLM, Any]:
  """(run config, model, host variables) of a run workdir or an exported model."""
  config, variables = checkpointing.load_model(checkpoint)
  return config, model_lib.TransformerLM.from_config(config), variables


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A trained model ready for inference, with its dataset's vocabulary."""
  config: ml_collections.ConfigDict      # the run config (eval lengths, dataset)
  lm: model_lib.TransformerLM
  variables: Any                         # on the default device
  corpus: data_lib.Corpus


def load(checkpoint) -> LoadedModel:
  """The model of a run workdir or an exported model, and its dataset's vocabulary.

  Raises:
    CheckpointError: no model in `checkpoint`, or one whose vocabulary size is not
      its dataset's.
    DataError: the run's dataset cannot be loaded.
  """
  config, lm, variables = load_lm(checkpoint)
  corpus = data_lib.load_run_corpus(config)
  if corpus.vocab_size != lm.cfg.vocab_size:
    raise errors.CheckpointError(
        f"The model in {checkpoint} has a vocabulary of {lm.cfg.vocab_size} but its "
        f"dataset {config.data.name!r} has {corpus.vocab_size} types; the checkpoint "
        "does not belong to this dataset (check data.name / data.data_dir in its "
        "config.json).")
  return LoadedModel(config, lm, jax.device_put(variables), corpus)
