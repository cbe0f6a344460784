"""Finding, checking, fingerprinting and reading the raw files of a dataset.

Checks run before any expensive work, so a wrong folder fails in a second with a
message that names the file and the fix.
"""
from collections.abc import Iterator
import codecs
import hashlib
import itertools
import lzma
import pathlib
import re
import socket
import urllib.parse
import urllib.request

from absl import logging

from allatt_jax.data import specs
from allatt_jax.config.errors import DataError

_HEAD_BYTES = 1 << 16
_HASH_BLOCK = 1 << 22
_LINE_BATCH = 4096
_PROBE_SECONDS = 10
_WIKITEXT_HEADING = re.compile(rb'^ = [^=].* = $')
_TEXT8_ALPHABET = re.compile(rb'[a-z ]*')


def locate(spec: specs.DatasetSpec, directory) -> dict[str, pathlib.Path]:
  """Paths of the dataset's files in `directory` (or its archive folder inside)."""
  directory = pathlib.Path(directory).expanduser()
  if not directory.is_dir():
    raise spec.not_found(f'{directory} is not a folder')
  candidates = [directory]
  if spec.archive_folder:
    candidates.append(directory / spec.archive_folder)
  for folder in candidates:
    if all((folder / name).is_file() for name in spec.files):
      return {name: folder / name for name in spec.files}
  missing = [name for name in spec.files if not (directory / name).is_file()]
  raise spec.not_found(f'{", ".join(missing)} missing in {directory}')


def check(spec: specs.DatasetSpec, paths: dict[str, pathlib.Path]) -> None:
  """Raises DataError when a file is empty, truncated or not in the official format."""
  for name, path in paths.items():
    if path.stat().st_size == 0:
      fix = ('Put its text in it, or pass the folder holding the full files with '
             '--config.data.manual_dir=DIR.' if spec.name == specs.TEXT_FILES_NAME
             else spec.source_hint())
      raise DataError(f"Dataset '{spec.name}': {path} is empty. {fix}")
    if spec.name == specs.TEXT_FILES_NAME:
      if spec.level != 'byte':
        _check_utf8(spec, path)
    elif spec.name.startswith('wikitext') and spec.level == 'word':
      _check_wikitext(spec, path)
    elif spec.level == 'word':
      _check_ends_with_newline(spec, path)
    elif spec.name == 'enwik8':
      _check_prefix(spec, path, b'<mediawiki', 'an XML dump starting with <mediawiki')
    elif spec.name == 'text8':
      _check_text8_alphabet(spec, path, _read_head(path))


def _read_head(path: pathlib.Path) -> bytes:
  with open(path, 'rb') as f:
    return f.read(_HEAD_BYTES)


def _check_ends_with_newline(spec, path):
  with open(path, 'rb') as f:
    f.seek(-1, 2)
    last = f.read(1)
  if last != b'\n':
    raise DataError(f"Dataset '{spec.name}': {path} is truncated (its last line has "
                    f'no newline). {spec.source_hint()}')


def _check_utf8(spec, path):
  """Decodes the whole file, so a bad byte is found before any work on it."""
  decoder = codecs.getincrementaldecoder('utf-8')()
  offset = 0
  with open(path, 'rb') as f:
    while True:
      block = f.read(_HASH_BLOCK)
      try:
        decoder.decode(block, final=not block)
      except UnicodeDecodeError as e:
        # The decoder may hold back up to 3 bytes of an unfinished character.
        where = offset + e.start - len(e.object) + len(block)
        raise DataError(
            f"Dataset '{spec.name}': {path} is not UTF-8 text: byte offset {where:,} "
            f'({e.reason}). Level {spec.level!r} reads characters; to model the raw '
            'bytes instead, use --config.data.level=byte.') from None
      if not block:
        return
      offset += len(block)


def _check_wikitext(spec, path):
  _check_ends_with_newline(spec, path)
  head = _read_head(path)
  lines = [line for line in head.split(b'\n')[:-1] if line.strip()]
  if not lines or not _WIKITEXT_HEADING.match(lines[0]):
    raise DataError(f"Dataset '{spec.name}': {path} is not a WikiText file: its first "
                    "text line should be an article title like ' = Title = '. "
                    f'{spec.source_hint()}')


def _check_prefix(spec, path, prefix, what):
  if not _read_head(path).startswith(prefix):
    raise DataError(f"Dataset '{spec.name}': {path} is not {what}. "
                    f'{spec.source_hint()}')


def _check_text8_alphabet(spec, where, text: bytes):
  if not _TEXT8_ALPHABET.fullmatch(text):
    bad = re.search(rb'[^a-z ]', text).group()
    raise DataError(f"Dataset '{spec.name}': {where} holds {bad!r}; text8-style text "
                    'has only lowercase a-z and spaces. '
                    f'{spec.source_hint()}')


def fingerprint(paths: dict[str, pathlib.Path]) -> dict[str, dict[str, int | str]]:
  """Size and SHA-256 of every file: what a prepared dataset was made from."""
  result = {}
  for name, path in sorted(paths.items()):
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
      while block := f.read(_HASH_BLOCK):
        digest.update(block)
    result[name] = {'size': path.stat().st_size, 'sha256': digest.hexdigest()}
  return result


def warn_if_unofficial(spec: specs.DatasetSpec, sources: dict,
                       paths: dict[str, pathlib.Path]) -> None:
  official = [(name, sources[name]['sha256'] == sha256)
              for name, sha256 in spec.official_sha256.items()]
  official += [(name, hashlib.md5(paths[name].read_bytes()).hexdigest() == md5)
               for name, md5 in spec.official_md5.items()]
  for name, same in official:
    if not same:
      logging.warning("Dataset '%s': %s differs from the official file; results will "
                      'not be comparable with published numbers.', spec.name, name)


def line_batches(path: pathlib.Path) -> Iterator[list[bytes]]:
  """The lines of a file without their newlines, in lists of a few thousand."""
  with open(path, 'rb') as f:
    lines = (line.rstrip(b'\n') for line in f)
    while batch := list(itertools.islice(lines, _LINE_BATCH)):
      yield batch


def check_reachable(spec: specs.DatasetSpec) -> None:
  """Fails in seconds when offline; TFDS would retry for over three minutes."""
  if urllib.request.getproxies():  # Only the proxy knows; let TFDS try.
    return
  parts = urllib.parse.urlsplit(spec.url)
  port = parts.port or (443 if parts.scheme == 'https' else 80)
  try:
    socket.create_connection((parts.hostname, port), timeout=_PROBE_SECONDS).close()
  except OSError as e:
    raise spec.not_found(f'cannot reach {parts.hostname} to download it: {e}') from e


def read_single_file(spec: specs.DatasetSpec, path: pathlib.Path) -> bytes:
  """The whole text of a single-file dataset, checked."""
  data = path.read_bytes()
  if path.suffix == '.xz':
    try:
      data = lzma.decompress(data)
    except lzma.LZMAError as e:
      raise DataError(f"Dataset '{spec.name}': {path} is not a valid .xz file ({e}). "
                      f'{spec.source_hint()}') from e
  if spec.level == 'char':
    _check_text8_alphabet(spec, path, data)
  if not data:
    raise DataError(f"Dataset '{spec.name}': {path} holds no text.")
  return data


def split_stream(spec: specs.DatasetSpec, data: bytes) -> tuple[dict[str, bytes], str]:
  """Cuts a single-file dataset into splits; logs when it is not the official rule."""
  sizes, rule = spec.split_sizes(len(data))
  if rule != 'official' and spec.official_size is not None:
    logging.warning(
        "Dataset '%s': the file has %s bytes, not the official %s, so it is split "
        '%s (%s) instead of %s; results are not comparable with published numbers.',
        spec.name, f'{len(data):,}', f'{spec.official_size:,}', rule,
        '/'.join(f'{s:,}' for s in sizes), '/'.join(f'{s:,}' for s in spec.official_split))
  if min(sizes) < 2:
    raise DataError(f"Dataset '{spec.name}': the file has only {len(data)} bytes, "
                    'too few to split into train/valid/test.')
  bounds = [0, sizes[0], sizes[0] + sizes[1], len(data)]
  return ({split: data[bounds[i]:bounds[i + 1]] for i, split in enumerate(specs.SPLITS)},
          rule)
