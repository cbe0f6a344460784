"""`load_corpus`: a dataset as encoded splits, prepared once and memory-mapped.

First run: check and hash the source files, then let the `allatt_text` TFDS builder
(builder.py) encode them into `<data_dir>/allatt_text/<name>/1.0.0/`. Later runs
with a manual folder (or the shipped corpus) only hash the source files and
memory-map the arrays; TensorFlow is not even imported.
"""
from collections.abc import Mapping
import dataclasses
import functools
import hashlib
import json
import os

from absl import logging
import numpy as np

from allatt_jax.config import console
from allatt_jax.data import cache
from allatt_jax.data import encoding as encoding_lib
from allatt_jax.data import sources
from allatt_jax.data import specs
from allatt_jax.data import tokenization
from allatt_jax.config.errors import DataError


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A dataset's vocabulary and its splits as 1-D int32 arrays (memory-mapped)."""
  name: str
  level: str  # 'word' | 'char' | 'byte'
  vocab: tuple[str, ...]  # id -> token; for bytes a printable name per byte
  splits: Mapping[str, np.ndarray]  # 'train' / 'valid' / 'test'
  split_rule: str = 'official'  # how train/valid/test were cut, e.g. 'proportional 90/5/5'
  clean: str = ''  # char level: 'text8' = text is cleaned as text8 was before lookup

  @functools.cached_property
  def tokenizer(self) -> tokenization.Tokenizer:
    """The vocabulary with its rules: what a run saves so its models need no dataset."""
    return tokenization.Tokenizer(self.name, self.level, self.vocab, self.clean)

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @property
  def metric(self) -> str:
    return self.tokenizer.metric

  def encode(self, text: str) -> tuple[np.ndarray, int]:
    """Ids of `text` tokenised like the splits, and how many tokens were unknown
    (see `tokenization.Tokenizer.encode`)."""
    return self.tokenizer.encode(text)

  def decode(self, ids) -> str:
    return self.tokenizer.decode(ids)

  def statistics(self) -> dict:
    """Vocabulary, split sizes and <unk> counts."""
    result = {
        'dataset': self.name, 'level': self.level, 'metric': self.metric,
        'vocab_size': self.vocab_size,
        'num_tokens': {split: int(ids.size) for split, ids in self.splits.items()},
        'split_rule': self.split_rule,
    }
    if self.name == specs.TEXT_FILES_NAME and self.level == 'word':
      result['most_frequent'] = list(self.vocab[:10])
    if (num_unk := self.unk_counts()) is not None:
      result['num_unk'] = num_unk
    return result

  def unk_counts(self) -> dict[str, int] | None:
    """{split: occurrences of <unk>}, or None for a vocabulary without it."""
    if tokenization.UNK not in self.vocab:
      return None
    unk = self.vocab.index(tokenization.UNK)
    return {split: int(np.count_nonzero(ids == unk)) for split, ids in self.splits.items()}


def default_data_dir() -> str:
  """TFDS's default: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
  return os.environ.get('TFDS_DATA_DIR',
                        os.path.join(os.path.expanduser('~'), 'tensorflow_datasets'))


def load_corpus(name: str, data_dir: str | None = None,
                manual_dir: str | None = None, **options) -> Corpus:
  """The encoded dataset `name`, built on first use and cached under `data_dir`.

  Args:
    name: one of DATASETS.
    data_dir: TFDS data folder; the prepared ids go to its `allatt_text/<name>/`.
    manual_dir: folder holding the official files; without it TFDS downloads them
      (wikitext_chars needs neither: it ships with the package; text_files needs it).
    **options: text_files only: level, files, min_count, max_vocab, clean (the keys
      of config.data; see specs.resolve).

  Raises:
    DataError: unknown name or options, or files missing, empty, truncated or
      malformed.
  """
  spec = specs.resolve(name, **options)
  data_dir = os.path.expanduser(data_dir or default_data_dir())
  corpus = _cached_or_built(spec, data_dir, manual_dir)
  if corpus.split_rule != 'official' and spec.official_size is not None:
    logging.warning("Dataset '%s' uses the %s split, not the official one.",
                    spec.name, corpus.split_rule)
  return corpus


def load_run_corpus(config) -> Corpus:
  """The corpus of a run config's `data` section, checked against its eval segments.

  Raises:
    DataError: as load_corpus, or valid/test shorter than one evaluation segment.
  """
  data = config.data
  corpus = load_corpus(data.name, getattr(data, 'data_dir', None),
                       getattr(data, 'manual_dir', None), **_options(data))
  needed = config.eval.seq_len + 1
  for split in specs.SPLITS[1:]:
    if corpus.splits[split].size < needed:
      raise DataError(
          f"Dataset {data.name!r}: the {split} split has {corpus.splits[split].size} "
          f'tokens, fewer than one evaluation segment (config.eval.seq_len + 1 = '
          f'{needed}). Give it more text, or lower --config.eval.seq_len.')
  return corpus


def warn_if_unk_untrained(corpus: Corpus) -> None:
  """Warns when a word-level train split never holds <unk> while valid or test do: a
  model trained on it scores those tokens with an embedding it never trained."""
  counts = corpus.unk_counts() if corpus.level == 'word' else None
  if counts is None or counts['train'] or not (counts['valid'] or counts['test']):
    return
  logging.warning(
      'Dataset %r: <unk> never occurs in the train split but %d times in valid and %d '
      'in test; the model scores them with an embedding it never trained. Set '
      '--config.data.min_count=2 (train words seen once become <unk>) or '
      '--config.data.max_vocab to train it.', corpus.name, counts['valid'], counts['test'])


def check_data_config(data) -> None:
  """Raises DataError when config.data names an unknown dataset or bad options."""
  specs.resolve(data.name, **_options(data))


def _options(data) -> dict:
  """The text_files options a data section sets (a saved config may predate some)."""
  return {key: getattr(data, key) for key in _OPTION_KEYS if hasattr(data, key)}


_OPTION_KEYS = ('level', 'files', 'min_count', 'max_vocab', 'clean')


def _cached_or_built(spec, data_dir, manual_dir) -> Corpus:
  config_name = key = spec.name
  if spec.name == specs.TEXT_FILES_NAME:
    if manual_dir is None:
      raise spec.not_found('no folder given')
    # One prepared dataset per folder and option set: switching between them
    # rebuilds nothing and deletes nothing.
    key = hashlib.sha256(json.dumps(
        [os.path.abspath(os.path.expanduser(manual_dir)), specs.options(spec)]
    ).encode()).hexdigest()[:12]
    config_name = f'{spec.name}_{key}'
  source_files = None
  if not spec.tfds_name:
    source_dir = manual_dir or (specs.CORPUS_DIR if spec.url is None else None)
    if source_dir is not None:  # Else TFDS downloads them, and records their hashes.
      paths = sources.locate(spec, source_dir)
      sources.check(spec, paths)
      source_files = sources.fingerprint(paths)
      sources.warn_if_unofficial(spec, source_files, paths)
  settings = encoding_lib.settings(spec)
  folder = cache.dataset_dir(data_dir, config_name)
  found = cache.load(folder, settings, source_files)
  if found is None:
    _prepare(spec, config_name, key, data_dir, manual_dir, source_files)
    found = cache.load(folder, settings, None)
  if found is None:
    raise DataError(f'The prepared dataset {folder} cannot be read; delete it to '
                    'prepare it again.')
  return Corpus(spec.name, spec.level, found.vocab, found.splits, found.split_rule,
                spec.clean)


def _prepare(spec, config_name, key, data_dir, manual_dir, source_files) -> None:
  """Runs the TFDS builder, taking over what an earlier allatt_jax prepared."""
  # TensorFlow, which the builder imports, prints C++ start-up notices (oneDNN).
  with console.native_stderr_hidden(not console.verbose_requested()):
    from allatt_jax.data import builder  # pylint: disable=g-import-not-at-top
  first_time = not cache.dataset_dir(data_dir, config_name).exists()
  old_folders = cache.legacy_folders(data_dir, spec, key) if first_time else []
  adopted = None
  if old_folders:
    adopted = cache.legacy_encoding(old_folders[0], encoding_lib.settings(spec),
                                    source_files)
    logging.warning(
        "Dataset '%s': %s were prepared by an earlier allatt_jax; %s into %s. "
        'They are no longer read and can be deleted.', spec.name,
        ', '.join(map(str, old_folders)),
        'taking over its encoded ids' if adopted else 'encoding it again',
        cache.dataset_dir(data_dir, config_name))
  builder.prepare(spec, config_name, data_dir, manual_dir, source_files, adopted)
