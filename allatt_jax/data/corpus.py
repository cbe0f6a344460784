"""`load_corpus`: a dataset as encoded splits, prepared once and cached.

First run: check the source files, let TFDS prepare the raw text (download or
manual folder), encode it, cache it under `<data_dir>/allatt_encoded/<name>/`.
Later runs with a manual folder (or the shipped corpus) only hash the source
files and memory-map the cache; TensorFlow is not even imported.
"""
from collections.abc import Mapping
import dataclasses
import functools
import hashlib
import json
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


def default_data_dir() -> str:
  """TFDS's default: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
  return os.environ.get('TFDS_DATA_DIR',
                        os.path.join(os.path.expanduser('~'), 'tensorflow_datasets'))


def load_corpus(name: str, data_dir: str | None = None,
                manual_dir: str | None = None, **options) -> Corpus:
  """The encoded dataset `name`, built on first use and cached under `data_dir`.

  Args:
    name: one of DATASETS.
    data_dir: TFDS data folder; the encoded cache goes to its `allatt_encoded/`.
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
  corpus = load_corpus(data.name, data.get('data_dir'), data.get('manual_dir'),
                       **{key: data[key] for key in _OPTION_KEYS if key in data})
  needed = config.eval.seq_len + 1
  for split in specs.SPLITS[1:]:
    if corpus.splits[split].size < needed:
      raise DataError(
          f"Dataset {data.name!r}: the {split} split has {corpus.splits[split].size} "
          f'tokens, fewer than one evaluation segment (config.eval.seq_len + 1 = '
          f'{needed}). Give it more text, or lower --config.eval.seq_len.')
  return corpus


def check_data_config(data) -> None:
  """Raises DataError when config.data names an unknown dataset or bad options."""
  specs.resolve(data.name, **{key: data[key] for key in _OPTION_KEYS if key in data})


_OPTION_KEYS = ('level', 'files', 'min_count', 'max_vocab', 'clean')


def _cached_or_built(spec, data_dir, manual_dir) -> Corpus:
  cache_dir = pathlib.Path(data_dir) / 'allatt_encoded' / spec.name
  if spec.tfds_name:
    from allatt_jax.data import lm1b  # pylint: disable=g-import-not-at-top
    builder = lm1b.prepare(spec, data_dir, manual_dir)
    return _load_cached(spec, cache_dir, builder.source_files) or _encode_and_cache(
        spec, cache_dir, builder, builder.source_files)
  if spec.name == specs.TEXT_FILES_NAME:
    if manual_dir is None:
      raise spec.not_found('no folder given')
    # One cache (and TFDS dataset) per folder and option set: switching between
    # them rebuilds nothing and deletes nothing.
    key = hashlib.sha256(json.dumps(
        [os.path.abspath(os.path.expanduser(manual_dir)), specs.options(spec)]
    ).encode()).hexdigest()[:12]
    cache_dir = cache_dir / key
    data_dir = os.path.join(data_dir, 'allatt_text_files', key)
  source_dir = manual_dir or (specs.CORPUS_DIR if spec.url is None else None)
  source_files = None
  if source_dir is not None:
    paths = sources.locate(spec, source_dir)
    sources.check(spec, paths)
    source_files = sources.fingerprint(paths)
    sources.warn_if_unofficial(spec, source_files, paths)
    found = _load_cached(spec, cache_dir, source_files)
    if found is not None:
      return found

  from allatt_jax.data import tfds_builders  # pylint: disable=g-import-not-at-top
  builder = tfds_builders.prepare(spec, data_dir, source_dir, source_files)
  source_files = builder.info.metadata['source_files']
  return (_load_cached(spec, cache_dir, source_files)
          or _encode_and_cache(spec, cache_dir, builder, source_files))


def _encode_and_cache(spec, cache_dir, builder, source_files) -> Corpus:
  logging.info("Encoding dataset '%s' into %s.", spec.name, cache_dir)
  split_rule = _split_rule(spec, source_files)
  vocab, splits = _encode(spec, builder)
  cache.write(cache_dir, _fingerprint(spec, source_files, split_rule), vocab, splits)
  return _load_cached(spec, cache_dir, source_files) or Corpus(
      spec.name, spec.level, vocab, splits, split_rule, spec.clean)


def _fingerprint(spec, source_files, split_rule) -> dict:
  fingerprint = {'dataset': spec.name, 'encoding_version': ENCODING_VERSION,
                 'level': spec.level, 'settings': _SETTINGS[spec.level],
                 'split_rule': split_rule, 'source_files': source_files}
  if spec.name == specs.TEXT_FILES_NAME or spec.tfds_name:
    fingerprint['options'] = {**specs.options(spec), 'add_unk': spec.add_unk}
  return fingerprint


def _load_cached(spec, cache_dir, source_files) -> Corpus | None:
  split_rule = _split_rule(spec, source_files)
  found = cache.load(cache_dir, _fingerprint(spec, source_files, split_rule))
  if found is None:
    return None
  vocab, splits = found
  return Corpus(spec.name, spec.level, vocab, splits, split_rule, spec.clean)


def _split_rule(spec, source_files) -> str:
  if spec.name == specs.TEXT_FILES_NAME:
    return 'one file per split'
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
  if spec.name == specs.TEXT_FILES_NAME:
    return _encode_own_chars(spec, data)
  vocab = tuple(tokenization.TEXT8_ALPHABET)
  table = tokenization.char_table(vocab)
  return vocab, {split: tokenization.encode_ascii(text, table)
                 for split, text in data.items()}


def _encode_own_chars(spec, data: dict[str, bytes]):
  """The user's text at char level (UTF-8, checked by sources.check)."""
  texts = {split: text.decode('utf-8') for split, text in data.items()}
  if spec.clean == 'text8':
    vocab = tuple(tokenization.TEXT8_ALPHABET)
    table = tokenization.char_table(vocab)
    return vocab, {split: tokenization.encode_ascii(
        tokenization.clean_text8_style(text).encode('ascii'), table)
                   for split, text in texts.items()}
  vocab, splits = tokenization.encode_chars(texts)
  if spec.max_vocab and len(vocab) > spec.max_vocab:
    raise DataError(
        f"Dataset '{spec.name}': the text has {len(vocab)} different characters, "
        f'more than data.max_vocab={spec.max_vocab}, and characters have no <unk> '
        'to map the rest to. Raise or drop --config.data.max_vocab, clean the text '
        'to a-z and space with --config.data.clean=text8, or use '
        '--config.data.level=byte (256 values).')
  return vocab, splits


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
  unknown = {'train': 0}
  if spec.min_count > 1 or spec.max_vocab or spec.add_unk:
    vocab, train, unknown['train'] = tokenization.limit_vocab(
        vocab, train, spec.min_count, spec.max_vocab, spec.add_unk)
  index = {word: i for i, word in enumerate(vocab)}
  splits = {'train': train}
  for split in specs.SPLITS[1:]:
    encoded = [tokenization.encode_lines(batch, index) for batch in line_batches(split)]
    splits[split] = np.concatenate([ids for ids, _ in encoded])
    unknown[split] = sum(count for _, count in encoded)
  for split in specs.SPLITS:
    logging.info("Dataset '%s' %s: %d lines, %d tokens, %d words not in the "
                 'vocabulary mapped to %s.', spec.name, split, num_lines[split],
                 len(splits[split]), unknown[split], tokenization.UNK)
  if spec.official_train_lines not in (None, num_lines['train']):
    logging.warning("Dataset '%s': train has %d lines, the official file %d; results "
                    'will not be comparable with published numbers.', spec.name,
                    num_lines['train'], spec.official_train_lines)
  return vocab, splits
