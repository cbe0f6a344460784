"""Trained models for inference: a run's workdir (any checkpoint step) or an exported
model, with the tokenizer that reads text for it.

The tokenizer comes from the model's own `tokenizer.json`; runs and exports saved
before it existed fall back to rebuilding it from their dataset.
"""
import dataclasses
from typing import Any

import jax

from allatt_jax.runs import checkpointing
from allatt_jax import data as data_lib
from allatt_jax.config import errors
from allatt_jax.model import transformer as model_lib
from allatt_jax.config import run_config
from allatt_jax.runs import run_files
from allatt_jax.data import tokenization

# What score, sample and export, which take no data flags, say when a model saved
# before tokenizer.json existed cannot read its dataset.
OLD_MODEL_ADVICE = ("Its dataset is needed, as the model has no tokenizer.json: put the "
                    "files back where its config.json says (data.manual_dir).")


def load_dataset(checkpoint, manual_dir: str | None = None,
                 data_dir: str | None = None) -> data_lib.Corpus:
  """The dataset a model was trained on, read before the model itself: from its
  config's folders, or from `manual_dir` / `data_dir` where the files have moved.

  Raises:
    CheckpointError: `checkpoint` holds no run or export.
    DataError: the dataset cannot be loaded, or its vocabulary is not the model's.
  """
  config = run_files.load_config(checkpoint)
  moved = {key: value for key, value in (("manual_dir", manual_dir), ("data_dir", data_dir))
           if value}
  config = dataclasses.replace(config, data=dataclasses.replace(config.data, **moved))
  corpus = data_lib.load_run_corpus(config)
  saved = run_files.load_tokenizer(checkpoint)
  if saved is not None and tokenization.Tokenizer.from_dict(saved) != corpus.tokenizer:
    where = config.data.manual_dir or "its prepared folder"
    raise errors.DataError(
        f"Dataset {config.data.name!r} read from {where} has another vocabulary "
        f"({corpus.vocab_size} types) than the model in {checkpoint} was trained with "
        f"({len(saved['vocab'])}): its scores would mean nothing. Point "
        "--config.data.manual_dir at the files the model was trained on.")
  return corpus


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A trained model ready for inference, with its tokenizer."""
  config: run_config.RunConfig      # the run config (eval lengths, dataset)
  lm: model_lib.TransformerLM
  variables: Any                         # on the default device
  tokenizer: tokenization.Tokenizer
  step: int | None = None                # the run's checkpoint step; None: an export


def load(checkpoint, step: int | None = None) -> LoadedModel:
  """The model of a run workdir (checkpoint `step`, default the latest) or of an
  exported model, and its tokenizer.

  Raises:
    CheckpointError: no model (or no such step) in `checkpoint`, or one whose
      vocabulary size is not its tokenizer's.
    DataError: no saved tokenizer and the run's dataset cannot be loaded.
  """
  directory = run_files.run_path(checkpoint)
  # Its own files first (the config gives a folder without one load_config's advice),
  # then its parameters; a model saved before tokenizer.json existed gets its
  # dataset's tokenizer.
  config = run_files.load_config(directory)
  saved_tokenizer = run_files.load_tokenizer(directory)
  variables, step = checkpointing.read_variables(directory, step)
  tokenizer = (tokenization.Tokenizer.from_dict(saved_tokenizer)
               if saved_tokenizer is not None
               else data_lib.load_run_corpus(config).tokenizer)
  lm = model_lib.TransformerLM.from_config(config)
  if tokenizer.vocab_size != lm.cfg.vocab_size:
    raise errors.CheckpointError(
        f"The model in {checkpoint} has a vocabulary of {lm.cfg.vocab_size} but its "
        f"tokenizer (dataset {tokenizer.dataset!r}) has {tokenizer.vocab_size} types; "
        "the checkpoint does not belong to this dataset (check data.name / "
        "data.data_dir in its config.json, or its tokenizer.json).")
  return LoadedModel(config, lm, jax.device_put(variables), tokenizer, step)
