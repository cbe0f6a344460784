"""TFDS builders for wikitext103, wikitext2, ptb, text8, enwik8, wikitext_chars and
text_files (the user's own folder; lm1b is TFDS's own builder, see lm1b.py).

Importing this module registers them, so `tfds.builder('wikitext103')` works too.
Examples are raw text: one per line at word level, 1 MiB chunks for the others, in
file order (`disable_shuffling`). Encoding to ids happens outside TFDS
(`allatt_jax.data.corpus`), because a 100M-token int array is not a TFDS example.

Sources: the official archive is downloaded unless the folder `manual_dir` (TFDS's
DownloadConfig, default `<data_dir>/downloads/manual`) holds the official files.
The sizes and SHA-256 of the files read are stored in the dataset's metadata
(`info.metadata['source_files']`), which keys the encoded cache.

Checksums: `checksums.tsv` beside this module pins the archives whose SHA-256 is
known (WikiText-103, WikiText-2, enwik8). text8.zip (31,344,016 bytes) is not
pinned; to pin it, run once online
  tfds build allatt_jax/data/tfds_builders.py --datasets=text8 --register_checksums
(or `download_and_prepare` with `DownloadConfig(register_checksums=True)`), which
adds its line to `checksums.tsv`; TFDS then verifies every later download.
"""
from collections.abc import Iterable, Iterator
import contextlib
import os
import pathlib
import socket
import sys
import types
from typing import ClassVar
import urllib.parse
import urllib.request

from etils import epath
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from allatt_jax.data import sources
from allatt_jax.data import specs
from allatt_jax.errors import DataError

VERSION = tfds.core.Version('1.0.0')
_CHUNK_BYTES = 1 << 20
_READ_BATCH = 4096
_PROBE_SECONDS = 10


class _TextBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Raw text of one dataset, from the official archive or a manual folder."""
  SPEC: ClassVar[specs.DatasetSpec]
  VERSION = VERSION
  # Where TFDS looks for checksums.tsv. Its own lookup through package resources
  # fails for editable installs on Python >= 3.9 (it needs importlib_resources).
  code_path = epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=self.SPEC.description,
        features=tfds.features.FeaturesDict(
            {'text': tfds.features.Tensor(shape=(), dtype=np.object_)}),
        homepage=self.SPEC.homepage,
        citation=self.SPEC.citation,
        disable_shuffling=True,
        metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    paths = sources.locate(self.SPEC, self._source_dir(dl_manager))
    sources.check(self.SPEC, paths)
    self.info.metadata['source_files'] = sources.fingerprint(paths)
    if len(self.SPEC.files) == len(specs.SPLITS):  # One file per split.
      read = _lines if self.SPEC.level == 'word' else lambda path: _chunks(path.read_bytes())
      return {split: self._generate_examples(read(paths[name]))
              for split, name in zip(specs.SPLITS, self.SPEC.files)}
    data = sources.read_stream(self.SPEC, paths[self.SPEC.files[0]])
    parts, rule = sources.split_stream(self.SPEC, data)
    self.info.metadata['split_rule'] = rule
    return {split: self._generate_examples(_chunks(part))
            for split, part in parts.items()}

  def _source_dir(self, dl_manager) -> pathlib.Path:
    try:
      manual_dir = dl_manager.manual_dir
    except AssertionError:  # TFDS's answer when the manual folder is absent or empty
      manual_dir = None
    if manual_dir is not None:
      try:
        sources.locate(self.SPEC, manual_dir)
        return manual_dir
      except DataError:  # TFDS's shared default folder may hold other datasets
        pass
    if self.SPEC.url is None:
      return specs.CORPUS_DIR
    check_reachable(self.SPEC)
    try:
      extracted = dl_manager.download_and_extract(self.SPEC.url)
    except Exception as e:  # Any download failure means the same to the user.
      raise self.SPEC.not_found(f'downloading {self.SPEC.url} failed: {e}') from e
    return pathlib.Path(extracted) / self.SPEC.archive_folder

  def _generate_examples(self, pieces: Iterable[bytes]) -> Iterator[tuple[int, dict]]:
    for number, piece in enumerate(pieces):
      yield number, {'text': piece}

  def text_batches(self, split: str) -> Iterator[list[bytes]]:
    """The split's examples in file order, in lists of up to a few thousand."""
    return read_text_batches(self.info.splits[split].filepaths)


def read_text_batches(filepaths) -> Iterator[list[bytes]]:
  """The 'text' of the examples in TFDS record files, in lists of a few thousand.

  Reads the record files a batch at a time: TFDS's own per-example reader
  manages about 15k examples/s here, minutes for WikiText-103's 1.8M lines.
  """
  parse_spec = {'text': tf.io.FixedLenFeature([], tf.string)}
  records = tf.data.TFRecordDataset([os.fspath(path) for path in filepaths])
  texts = records.batch(_READ_BATCH).map(
      lambda serialized: tf.io.parse_example(serialized, parse_spec)['text'])
  for batch in texts.as_numpy_iterator():
    yield batch.tolist()


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


def _lines(path: pathlib.Path) -> Iterator[bytes]:
  with open(path, 'rb') as f:
    for line in f:
      yield line.rstrip(b'\n')


def _chunks(data: bytes) -> Iterator[bytes]:
  for start in range(0, len(data), _CHUNK_BYTES):
    yield data[start:start + _CHUNK_BYTES]


def _registered_builder(spec: specs.DatasetSpec) -> type[_TextBuilder]:
  """The TFDS builder of one dataset, registered under its name (`tfds.builder(name)`
  finds it; its data lives in DATA_DIR/<name>/<version>). `prepare` subclasses the
  text_files one with the options of a run."""
  namespace = dict(name=spec.name, SPEC=spec,
                   MANUAL_DOWNLOAD_INSTRUCTIONS=spec.source_hint(), __module__=__name__)
  class_name = ''.join(part.title() for part in spec.name.split('_'))
  return types.new_class(class_name, (_TextBuilder,), {},
                         lambda ns: ns.update(namespace))


BUILDERS = {spec.name: _registered_builder(spec) for spec in (
    specs.WIKITEXT103, specs.WIKITEXT2, specs.PTB, specs.TEXT8, specs.ENWIK8,
    specs.WIKITEXT_CHARS, specs.TEXT_FILES)}


def prepare(spec: specs.DatasetSpec, data_dir: str, source_dir: str | None,
            expected_sources: dict | None) -> _TextBuilder:
  """A prepared builder; regenerated when it was made from other files."""
  cls = BUILDERS[spec.name]
  if spec != cls.SPEC:  # text_files with its options
    cls = types.new_class(cls.__name__, (cls,), {'skip_registration': True},
                          lambda namespace: namespace.update(SPEC=spec, __module__=__name__))
  # `text_batches` reads the record files itself.
  builder = cls(data_dir=data_dir, file_format='tfrecord')
  mode = tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS
  if (builder.is_prepared() and expected_sources is not None
      and builder.info.metadata.get('source_files') != expected_sources):
    mode = tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS
  config = tfds.download.DownloadConfig(
      manual_dir=source_dir, download_mode=mode, try_download_gcs=False)
  with contextlib.redirect_stdout(sys.stderr):  # TFDS prints progress to stdout.
    builder.download_and_prepare(download_config=config)
  if 'source_files' not in builder.info.metadata:
    raise DataError(f'The TFDS dataset {builder.data_dir} was not made by this '
                    'version of allatt_jax; delete it to rebuild.')
  return builder
