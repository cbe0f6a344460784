"""Raw text of a dataset to (vocabulary, split ids), and what decides the result.

`settings` describes an encoding apart from its source files; with the sources'
fingerprint and the split rule it is what the prepared dataset records, and what
decides whether a prepared dataset can be reused.
"""
from collections.abc import Callable, Iterator, Mapping
import dataclasses

from absl import logging
import numpy as np

from allatt_jax.data import specs
from allatt_jax.data import tokenization
from allatt_jax.config.errors import DataError

# Bump when the encoding of any dataset changes: every prepared dataset is then rebuilt.
ENCODING_VERSION = 1

_SETTINGS = {
    'word': {'tokens': 'whitespace-split words, <eos> after every line',
             'vocab': 'train only, descending frequency, ties by first occurrence',
             'unknown': tokenization.UNK},
    'char': {'tokens': 'characters', 'vocab': tokenization.TEXT8_ALPHABET},
    'byte': {'tokens': 'bytes', 'vocab': 'id = byte value'},
}

LineBatches = Callable[[str], Iterator[list[bytes]]]  # split -> its lines, a batch at a time


@dataclasses.dataclass(frozen=True)
class Encoding:
  """A dataset's vocabulary and split ids, and what they were made from."""
  vocab: tuple[str, ...]
  splits: Mapping[str, np.ndarray]
  source_files: dict  # sizes and SHA-256 of the files read (sources.fingerprint)
  split_rule: str  # how train/valid/test were cut, e.g. 'proportional 90/5/5'


def settings(spec: specs.DatasetSpec) -> dict:
  """Everything but the source files that decides a dataset's ids."""
  result = {'dataset': spec.name, 'encoding_version': ENCODING_VERSION,
            'level': spec.level, 'settings': _SETTINGS[spec.level]}
  if spec.name == specs.TEXT_FILES_NAME or spec.tfds_name:
    result['options'] = {**specs.options(spec), 'add_unk': spec.add_unk}
  return result


def encode_texts(spec: specs.DatasetSpec, texts: Mapping[str, bytes]
                 ) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
  """Character- or byte-level splits from the raw bytes of each split."""
  if spec.level == 'byte':
    return (tokenization.byte_vocab(),
            {split: np.frombuffer(text, dtype=np.uint8).astype(np.int32)
             for split, text in texts.items()})
  if spec.name == specs.TEXT_FILES_NAME:
    return _encode_own_chars(spec, texts)
  vocab = tuple(tokenization.TEXT8_ALPHABET)
  table = tokenization.char_table(vocab)
  return vocab, {split: tokenization.encode_ascii(text, table)
                 for split, text in texts.items()}


def _encode_own_chars(spec, texts: Mapping[str, bytes]):
  """The user's text at char level (UTF-8, checked by sources.check)."""
  decoded = {split: text.decode('utf-8') for split, text in texts.items()}
  if spec.clean == 'text8':
    vocab = tuple(tokenization.TEXT8_ALPHABET)
    table = tokenization.char_table(vocab)
    return vocab, {split: tokenization.encode_ascii(
        tokenization.clean_text8_style(text).encode('ascii'), table)
                   for split, text in decoded.items()}
  vocab, splits = tokenization.encode_chars(decoded)
  if spec.max_vocab and len(vocab) > spec.max_vocab:
    raise DataError(
        f"Dataset '{spec.name}': the text has {len(vocab)} different characters, "
        f'more than data.max_vocab={spec.max_vocab}, and characters have no <unk> '
        'to map the rest to. Raise or drop --config.data.max_vocab, clean the text '
        'to a-z and space with --config.data.clean=text8, or use '
        '--config.data.level=byte (256 values).')
  return vocab, splits


def encode_lines(spec: specs.DatasetSpec, line_batches: LineBatches
                 ) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
  """Word-level splits: the vocabulary from train, every line ended by <eos>."""
  num_lines = {}

  def decoded(split):
    num_lines[split] = 0
    for batch in line_batches(split):
      num_lines[split] += len(batch)
      try:
        yield [line.decode('utf-8') for line in batch]
      except UnicodeDecodeError as e:
        raise DataError(f"Dataset '{spec.name}': the {split} file is not UTF-8 "
                        f'text ({e}).') from e

  vocab, train = tokenization.encode_train(decoded('train'))
  unknown = {'train': 0}
  if spec.min_count > 1 or spec.max_vocab or spec.add_unk:
    vocab, train, unknown['train'] = tokenization.limit_vocab(
        vocab, train, spec.min_count, spec.max_vocab, spec.add_unk)
  index = {word: i for i, word in enumerate(vocab)}
  splits = {'train': train}
  for split in specs.SPLITS[1:]:
    encoded = [tokenization.encode_lines(batch, index) for batch in decoded(split)]
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
