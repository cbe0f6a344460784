"""One Billion Word (lm1b) through TFDS's own `lm1b` builder.

TFDS downloads the 1.8 GB archive (or takes it from `manual_dir`) and writes one
example per sentence, in an order shuffled by a hash of their keys, the same on every
machine; the stream reads them in that order, each ended by <eos>. Valid is the first
half of TFDS's test split (the 50 held-out files), test the second.
"""
from collections.abc import Iterator
import contextlib
import inspect
import os
import pathlib
import sys

from etils import epath
import tensorflow as tf
import tensorflow_datasets as tfds

from allatt_jax.data import sources
from allatt_jax.data import specs

_TFDS_TEST = 'test'
_READ_BATCH = 4096
_TFDS_BUILDER = tfds.builder_cls('lm1b')


class _Lm1b(_TFDS_BUILDER, skip_registration=True):
  """TFDS's lm1b builder, unchanged but for where its checksums.tsv is looked up."""
  name = _TFDS_BUILDER.name
  # TFDS's own lookup through package resources needs importlib_resources, which
  # Python >= 3.9 environments may lack; the file sits beside the builder's module.
  code_path = epath.Path(inspect.getfile(_TFDS_BUILDER))


class Lm1bText:
  """The prepared TFDS dataset, read as the three splits of the encoder."""

  def __init__(self, builder: tfds.core.DatasetBuilder):
    self._builder = builder
    splits = builder.info.splits
    self._half = splits[_TFDS_TEST].num_examples // 2
    self.source_files = {f'tfds:{builder.name}': {
        'version': str(builder.info.version),
        'num_examples': {name: int(splits[name].num_examples) for name in sorted(splits)},
        'num_bytes': int(builder.info.dataset_size)}}

  def text_batches(self, split: str) -> Iterator[list[bytes]]:
    if split == 'train':
      yield from read_text_batches(self._builder.info.splits['train'].filepaths)
      return
    seen = 0
    for batch in read_text_batches(
        self._builder.info.splits[_TFDS_TEST].filepaths):
      start, seen = seen, seen + len(batch)
      cut = min(max(self._half - start, 0), len(batch))
      part = batch[:cut] if split == 'valid' else batch[cut:]
      if part:
        yield part


def read_text_batches(filepaths) -> Iterator[list[bytes]]:
  """The 'text' of the examples in TFDS record files, in lists of a few thousand.

  Reads the record files a batch at a time: TFDS's own per-example reader
  manages about 15k examples/s here, minutes for millions of sentences.
  """
  parse_spec = {'text': tf.io.FixedLenFeature([], tf.string)}
  records = tf.data.TFRecordDataset([os.fspath(path) for path in filepaths])
  texts = records.batch(_READ_BATCH).map(
      lambda serialized: tf.io.parse_example(serialized, parse_spec)['text'])
  for batch in texts.as_numpy_iterator():
    yield batch.tolist()


def prepare(spec: specs.DatasetSpec, data_dir: str, manual_dir: str | None) -> Lm1bText:
  """TFDS's lm1b, downloaded and prepared on first use (hours; see the README)."""
  builder = _Lm1b(data_dir=data_dir, file_format='tfrecord')
  archive = manual_dir and pathlib.Path(manual_dir).expanduser() / spec.archive_name
  if not builder.is_prepared():
    if manual_dir and not archive.is_file():
      raise spec.not_found(f'{spec.archive_name} missing in {manual_dir}')
    if not manual_dir:
      sources.check_reachable(spec)
  config = tfds.download.DownloadConfig(manual_dir=manual_dir, try_download_gcs=False)
  with contextlib.redirect_stdout(sys.stderr):  # TFDS prints progress to stdout.
    builder.download_and_prepare(download_config=config)
  return Lm1bText(builder)
