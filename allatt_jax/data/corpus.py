"""`load_corpus`: a dataset as encoded splits, prepared once and cached.

First run: check the source files, let TFDS prepare the raw text (download or
manual folder), encode it, cache it under `<data_dir>/allatt_encoded/<name>/`.
Later runs with a manual folder (or the shipped corpus) only hash the source
files and memory-map the cache; TensorFlow is not even imported.
"""
from collections.abc import Mapping
import dataclasses
import functools
import os
import pathlib

from absl import logging
import numpy as np

from allatt_jax.data import cache
from allatt_jax.data import sources
from allatt_jax.data import specs
from allatt_jax.data import tokenization
from allatt_jax.errors import DataError

# Bump when the encoding of any dataset changes: every cache is then rebuilt.
ENCODING_VERSION = 1

_SETTINGS = {
    'word': {'tokens': 'whitespace-split words, <eos> after every line',
             'vocab': 'train only, descending frequency, ties by first occurrence',
             'unknown': tokenization.UNK},
    'char': {'tokens': 'characters', 'vocab': tokenization.TEXT8_ALPHABET},
    'byte': {'tokens': 'bytes', 'vocab': 'id = byte value'},
}


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A dataset's vocabulary and its splits as 1-D int32 arrays (memory-mapped)."""
  name: str
  level: str  # 'word' | 'char' | 'byte'
  vocab: tuple[str, ...]  # id -> token; for bytes a printable name per byte
  splits: Mapping[str, np.ndarray]  # 'train' / 'valid' / 'test'
  split_rule: str = 'official'  # how train/valid/test were cut, e.g. 'proportional 90/5/5'

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @property
  def metric(self) -> str:
    return 'ppl' if self.level == 'word' else 'bpc'

  @functools.cached_property
  def _index(self) -> dict[str, int]:
    return {token: i for i, token in enumerate(self.vocab)}

  def encode(self, text: str) -> tuple[np.ndarray, int]:
    """Ids of `text` tokenised like the splits, and how many tokens were unknown.

    Words: each newline is an <eos>; unknown words become <unk>. Characters: the
    text is cleaned as text8 was (lower case, digits spelled out, everything else a
    space), so nothing is unknown. Bytes: UTF-8.
    """
    if self.level == 'word':
      return tokenization.encode_words(text, self._index)
    if self.level == 'byte':
      return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32), 0
    ids = [self._index.get(c, -1) for c in tokenization.clean_text8_style(text)]
    known = np.array([i for i in ids if i >= 0], dtype=np.int32)
    return known, len(ids) - len(known)

  def decode(self, ids) -> str:
    if self.level == 'word':
      return tokenization.decode_words(ids, self.vocab)
    ids = np.asarray(ids).ravel()
    if self.level == 'byte':
      return bytes(ids.astype(np.uint8).tolist()).decode('utf-8', errors='replace')
    return ''.join(self.vocab[i] for i in ids)


def default_data_dir() -> str:
  """TFDS's default: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
  return os.environ.get('TFDS_DATA_DIR',
                        os.path.join(os.path.expanduser('~'), 'tensorflow_datasets'))


def load_corpus(name: str, data_dir: str | None = None,
                manual_dir: str | None = None) -> Corpus:
  """The encoded dataset `name`, built on first use and cached under `data_dir`.

  Args:
    name: one of DATASETS.
    data_dir: TFDS data folder; the encoded cache goes to its `allatt_encoded/`.
    manual_dir: folder holding the official files; without it TFDS downloads them
      (wikitext_chars needs neither: it ships with the package).

  Raises:
    DataError: unknown name, or files missing, empty, truncated or malformed.
  """
  spec = specs.get_spec(name)
  data_dir = os.path.expanduser(data_dir or default_data_dir())
  corpus = _cached_or_built(spec, data_dir, manual_dir)
  if corpus.split_rule != 'official' and spec.official_size is not None:
    logging.warning("Dataset '%s' uses the %s split, not the official one.",
                    spec.name, corpus.split_rule)
  return corpus


def _cached_or_built(spec, data_dir, manual_dir) -> Corpus:
  cache_dir = pathlib.Path(data_dir) / 'allatt_encoded' / spec.name
  source_dir = manual_dir or (specs.CORPUS_DIR if spec.url is None else None)
  source_files = None
  if source_dir is not None:
    paths = sources.locate(spec, source_dir)
    sources.check(spec, paths)
    source_files = sources.fingerprint(paths)
    sources.warn_if_unofficial(spec, source_files)
    found = _load_cached(spec, cache_dir, source_files)
    if found is not None:
      return found

  from allatt_jax.data import tfds_builders  # pylint: disable=g-import-not-at-top
  builder = tfds_builders.prepare(spec, data_dir, source_dir, source_files)
  source_files = builder.info.metadata['source_files']
  found = _load_cached(spec, cache_dir, source_files)
  if found is not None:
    return found

  logging.info("Encoding dataset '%s' into %s.", spec.name, cache_dir)
  split_rule = _split_rule(spec, source_files)
  vocab, splits = _encode(spec, builder)
  cache.write(cache_dir, _fingerprint(spec, source_files, split_rule), vocab, splits)
  return _load_cached(spec, cache_dir, source_files) or Corpus(
      spec.name, spec.level, vocab, splits, split_rule)


def _fingerprint(spec, source_files, split_rule) -> dict:
  return {'dataset': spec.name, 'encoding_version': ENCODING_VERSION,
          'level': spec.level, 'settings': _SETTINGS[spec.level],
          'split_rule': split_rule, 'source_files': source_files}


def _load_cached(spec, cache_dir, source_files) -> Corpus | None:
  split_rule = _split_rule(spec, source_files)
  found = cache.load(cache_dir, _fingerprint(spec, source_files, split_rule))
  if found is None:
    return None
  vocab, splits = found
  return Corpus(spec.name, spec.level, vocab, splits, split_rule)


def _split_rule(spec, source_files) -> str:
  if spec.level == 'word':
    return 'official'
  if spec.url is None:  # The shipped corpus: its size is known only once unpacked.
    return 'proportional {}/{}/{}'.format(*spec.proportions)
  return spec.split_sizes(source_files[spec.files[0]]['size'])[1]


def _encode(spec, builder) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
  if spec.level == 'word':
    return _encode_words(spec, builder)
  data = {split: b''.join(chunk for batch in builder.text_batches(split)
                          for chunk in batch)
          for split in specs.SPLITS}
  if spec.level == 'byte':
    return (tokenization.byte_vocab(),
            {split: np.frombuffer(text, dtype=np.uint8).astype(np.int32)
             for split, text in data.items()})
  vocab = tuple(tokenization.TEXT8_ALPHABET)
  table = tokenization.char_table(vocab)
  return vocab, {split: tokenization.encode_ascii(text, table)
                 for split, text in data.items()}


def _encode_words(spec, builder):
  num_lines = {}

  def line_batches(split):
    num_lines[split] = 0
    for batch in builder.text_batches(split):
      num_lines[split] += len(batch)
      try:
        yield [line.decode('utf-8') for line in batch]
      except UnicodeDecodeError as e:
        raise DataError(f"Dataset '{spec.name}': the {split} file is not UTF-8 "
                        f'text ({e}).') from e

  vocab, train = tokenization.encode_train(line_batches('train'))
  index = {word: i for i, word in enumerate(vocab)}
  splits, unknown = {'train': train}, {'train': 0}
  for split in specs.SPLITS[1:]:
    encoded = [tokenization.encode_lines(batch, index) for batch in line_batches(split)]
    splits[split] = np.concatenate([ids for ids, _ in encoded])
    unknown[split] = sum(count for _, count in encoded)
  for split in specs.SPLITS:
    logging.info("Dataset '%s' %s: %d lines, %d tokens, %d words not in the train "
                 'vocabulary mapped to %s.', spec.name, split, num_lines[split],
                 len(splits[split]), unknown[split], tokenization.UNK)
  if spec.official_train_lines not in (None, num_lines['train']):
    logging.warning("Dataset '%s': train has %d lines, the official file %d; results "
                    'will not be comparable with published numbers.', spec.name,
                    num_lines['train'], spec.official_train_lines)
  return vocab, splits
