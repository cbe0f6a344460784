"""Text to ids as in Transformer-XL's data setup.

Words: split on whitespace, one <eos> per line, vocabulary from train only in
descending frequency (ties: first occurrence), <unk> an ordinary word.
Characters: the text8 alphabet (space and a-z). Bytes: id = byte value.
`Tokenizer`, a vocabulary with its rules, is saved beside a model's config.
"""
from collections.abc import Iterable, Mapping
import dataclasses
import functools
import itertools
import re
import unicodedata

import numpy as np

from allatt_jax.config.errors import DataError

EOS = '<eos>'
UNK = '<unk>'
TEXT8_ALPHABET = ' abcdefghijklmnopqrstuvwxyz'
_DIGIT_WORDS = ('zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven',
                'eight', 'nine')
_DIGIT = re.compile(r'[0-9]')
_NOT_LETTER = re.compile(r'[^a-z]+')


def clean_text8_style(text: str) -> str:
  """Text as text8 was made (see data/embedded.py): a-z and single spaces."""
  decomposed = unicodedata.normalize('NFKD', text)
  text = ''.join(c for c in decomposed if not unicodedata.combining(c)).casefold()
  text = _DIGIT.sub(lambda digit: f' {_DIGIT_WORDS[int(digit.group())]} ', text)
  return _NOT_LETTER.sub(' ', text).strip()


class _FirstSeenIds(dict):
  """word -> id in order of first appearance, assigned on first lookup."""

  def __missing__(self, word: str) -> int:
    self[word] = len(self)
    return self[word]


def encode_train(line_batches: Iterable[Iterable[str]]) -> tuple[tuple[str, ...], np.ndarray]:
  """The vocabulary of the training text and the text's ids, in one pass.

  Words first get ids in order of appearance; a stable sort of those by
  descending count is the frequency order with ties broken by first appearance.
  """
  first_seen = _FirstSeenIds()
  lookup = first_seen.__getitem__
  parts = []
  for lines in line_batches:
    ids = []
    for line in lines:
      ids.extend(map(lookup, line.split()))
      ids.append(lookup(EOS))
    parts.append(np.array(ids, dtype=np.int32))
  ids = np.concatenate(parts)
  order = np.argsort(-np.bincount(ids, minlength=len(first_seen)), kind='stable')
  new_ids = np.empty(len(order), dtype=np.int32)
  new_ids[order] = np.arange(len(order), dtype=np.int32)
  words = list(first_seen)
  return tuple(words[i] for i in order), new_ids[ids]


def limit_vocab(vocab: tuple[str, ...], ids: np.ndarray, min_count: int = 1,
                max_vocab: int = 0, add_unk: bool = False
                ) -> tuple[tuple[str, ...], np.ndarray, int]:
  """Maps the rare words of `encode_train`'s output to <unk>; returns the new vocab,
  ids and how many train words became <unk>.

  Words seen fewer than `min_count` times, then all but the `max_vocab` most frequent
  types (<eos> and <unk> included), become <unk>; <eos> always stays. <unk> joins the
  vocabulary when a word was cut or `add_unk`, and the order is frequency again, <unk>
  counted with the words it replaced (ties: the previous order, <unk> last).
  """
  counts = np.bincount(ids, minlength=len(vocab))
  frequent = [i for i, word in enumerate(vocab)
              if word == EOS or (word != UNK and counts[i] >= min_count)]
  needs_unk = add_unk or UNK in vocab or len(frequent) < len(vocab)
  if max_vocab and len(frequent) > max_vocab - needs_unk:
    # `vocab` is in descending frequency: keep the first, <eos> always.
    eos = vocab.index(EOS)
    frequent = [i for i in frequent if i != eos][:max_vocab - 2]
    frequent = sorted([*frequent, eos])
    needs_unk = True
  if not needs_unk:
    return vocab, ids, 0
  keep = np.zeros(len(vocab), dtype=bool)
  keep[frequent] = True
  num_cut = int(counts[~keep].sum()) - (int(counts[vocab.index(UNK)]) if UNK in vocab else 0)
  kept = np.flatnonzero(keep)
  # Kept words in their old order, then <unk>; ids into that list.
  remap = np.full(len(vocab), len(kept), dtype=np.int32)
  remap[kept] = np.arange(len(kept), dtype=np.int32)
  ids = remap[ids]
  order = np.argsort(-np.bincount(ids, minlength=len(kept) + 1), kind='stable')
  new_ids = np.empty(len(order), dtype=np.int32)
  new_ids[order] = np.arange(len(order), dtype=np.int32)
  words = [vocab[i] for i in kept] + [UNK]
  return tuple(words[i] for i in order), new_ids[ids], num_cut


def encode_lines(lines: Iterable[str], index: Mapping[str, int]) -> tuple[np.ndarray, int]:
  """Ids of the words of `lines`, each line ended by <eos>; and the <unk> count."""
  lookup = index.get
  eos = index[EOS]
  ids = []
  for line in lines:
    ids.extend(map(lookup, line.split(), itertools.repeat(-1)))
    ids.append(eos)
  return _map_unknown(np.array(ids, dtype=np.int32), index)


def encode_words(text: str, index: Mapping[str, int]) -> tuple[np.ndarray, int]:
  """Like the splits: every newline is an <eos>; a final unended line gets none."""
  *lines, last = text.split('\n')
  ids, unknown = encode_lines(lines, index)
  tail = [index.get(word, -1) for word in last.split()]
  tail, tail_unknown = _map_unknown(np.array(tail, dtype=np.int32), index)
  return np.concatenate([ids, tail]), unknown + tail_unknown


def _map_unknown(ids: np.ndarray, index: Mapping[str, int]) -> tuple[np.ndarray, int]:
  unknown = ids < 0
  count = int(unknown.sum())
  if count:
    if UNK not in index:
      raise DataError(f'{count} words are not in the vocabulary, which has no {UNK}.')
    ids[unknown] = index[UNK]
  return ids, count


def decode_words(ids, vocab: tuple[str, ...]) -> str:
  """Words joined by spaces, <eos> as a newline: the inverse of `encode_words`."""
  text, line = [], []
  for word in (vocab[i] for i in np.asarray(ids).ravel()):
    if word == EOS:
      text.append(' '.join(line) + '\n')
      line = []
    else:
      line.append(word)
  text.append(' '.join(line))
  return ''.join(text)


def char_table(vocab: tuple[str, ...]) -> np.ndarray:
  """Byte value -> id for an ASCII vocabulary; -1 for bytes outside it."""
  table = np.full(256, -1, dtype=np.int32)
  table[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
  return table


def encode_ascii(data: bytes, table: np.ndarray) -> np.ndarray:
  ids = table[np.frombuffer(data, dtype=np.uint8)]
  if (ids < 0).any():
    bad = data[int(np.argmax(ids < 0))]
    raise DataError(f'Character {chr(bad)!r} is outside the vocabulary.')
  return ids


def encode_chars(texts: dict[str, str]) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
  """Characters as they are: the vocabulary is every character of all splits (as
  Transformer-XL builds its character vocabularies), in code-point order."""
  code_points = {split: np.frombuffer(text.encode('utf-32-le'), dtype='<u4')
                 for split, text in texts.items()}
  alphabet = np.unique(np.concatenate(list(code_points.values())))
  return (tuple(map(chr, alphabet.tolist())),
          {split: np.searchsorted(alphabet, points).astype(np.int32)
           for split, points in code_points.items()})


def byte_vocab() -> tuple[str, ...]:
  """A printable name per byte: the character itself for printable ASCII."""
  return tuple(chr(b) if 0x20 <= b < 0x7f else f'<0x{b:02X}>' for b in range(256))


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A dataset's vocabulary and the rules that turn text into its ids."""
  dataset: str
  level: str  # 'word' | 'char' | 'byte'
  vocab: tuple[str, ...]  # id -> token; for bytes a printable name per byte
  clean: str = ''  # char level: 'text8' = text is cleaned as text8 was before lookup

  FORMAT_VERSION = 1

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @property
  def metric(self) -> str:
    return 'ppl' if self.level == 'word' else 'bpc'

  @property
  def unk_id(self) -> int | None:
    """The id of <unk>, in a word vocabulary that has it; else None."""
    return self._index.get(UNK) if self.level == 'word' else None

  @functools.cached_property
  def _index(self) -> dict[str, int]:
    return {token: i for i, token in enumerate(self.vocab)}

  def encode(self, text: str) -> tuple[np.ndarray, int]:
    """Ids of `text` tokenised like the splits, and how many tokens were unknown.

    Words: each newline is an <eos>; unknown words become <unk>. Characters: as
    they are, or for text8-style corpora cleaned as text8 was (lower case, digits
    spelled out, everything else a space); unknown ones are left out and counted.
    Bytes: UTF-8.
    """
    if self.level == 'word':
      return encode_words(text, self._index)
    if self.level == 'byte':
      return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32), 0
    if self.clean == 'text8':
      text = clean_text8_style(text)
    ids = [self._index.get(c, -1) for c in text]
    known = np.array([i for i in ids if i >= 0], dtype=np.int32)
    return known, len(ids) - len(known)

  def decode(self, ids) -> str:
    if self.level == 'word':
      return decode_words(ids, self.vocab)
    ids = np.asarray(ids).ravel()
    if self.level == 'byte':
      return bytes(ids.astype(np.uint8).tolist()).decode('utf-8', errors='replace')
    return ''.join(self.vocab[i] for i in ids)

  def to_dict(self) -> dict:
    return {'format_version': self.FORMAT_VERSION, 'dataset': self.dataset,
            'level': self.level, 'clean': self.clean, 'vocab': list(self.vocab)}

  @classmethod
  def from_dict(cls, saved: Mapping) -> 'Tokenizer':
    """The tokenizer `to_dict` described.

    Raises:
      DataError: the description is of an unknown format or level.
    """
    if saved.get('format_version') != cls.FORMAT_VERSION or saved.get('level') not in (
        'word', 'char', 'byte'):
      raise DataError(
          f"Unknown tokenizer description (format_version={saved.get('format_version')!r}, "
          f"level={saved.get('level')!r}); it was written by another version of "
          'allatt_jax. Delete the file to read the vocabulary from the dataset instead.')
    return cls(saved['dataset'], saved['level'], tuple(saved['vocab']),
               saved.get('clean', ''))
