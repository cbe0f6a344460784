"""The TFDS builder `allatt_text`: every dataset of allatt_jax as token ids.

One config per dataset (`BUILDER_CONFIGS`; text_files gets `text_files_<hash>` per
folder and options). Importing this module registers it (`tfds.builder(
'allatt_text/text8')`); `as_dataset` yields a split's ids in order as {'ids': int32}.
It prepares the encoded corpus itself: train/valid/test.npy and vocab.json in
`<data_dir>/allatt_text/<config>/1.0.0/` (cache.py), no TFDS records of the text.
Sources come from `manual_dir` if it holds the official files, else are downloaded.
"""
import contextlib
import dataclasses
import os
import pathlib
import sys

from absl import logging
from etils import epath
import numpy as np
import tensorflow_datasets as tfds

from allatt_jax.data import cache
from allatt_jax.data import encoding as encoding_lib
from allatt_jax.data import sources
from allatt_jax.data import specs
from allatt_jax.config.errors import DataError

_AS_DATASET_CHUNK = 1 << 16


@dataclasses.dataclass(eq=False)
class DatasetConfig(tfds.core.BuilderConfig):
  """One dataset: its spec (files, source, tokenisation options)."""
  spec: specs.DatasetSpec = dataclasses.field(default=specs.TEXT_FILES, repr=False)


def dataset_config(spec: specs.DatasetSpec, name: str = '') -> DatasetConfig:
  return DatasetConfig(name=name or spec.name, description=spec.description, spec=spec)


class _LocalDatasetInfo(tfds.core.DatasetInfo):
  """The info of a dataset that TFDS's bucket never holds, so a builder made before
  its dataset is prepared does not look there: TFDS's lookup makes a temporary folder
  first, whether or not it may reach the bucket, and leaves it behind."""

  def initialize_from_bucket(self) -> None:
    pass


class AllattText(tfds.core.DatasetBuilder):
  """Token ids of one dataset, encoded from its official files or your folder."""
  VERSION = tfds.core.Version(cache.VERSION)
  BUILDER_CONFIGS = [dataset_config(specs.get_spec(name)) for name in specs.DATASETS]
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      'Put the official files of the dataset (an unzip of its archive) or, for '
      'text_files, your train/valid/test files in the manual folder.')
  # checksums.tsv pins WikiText-103, WikiText-2 and enwik8; text8.zip (31,344,016
  # bytes) is not pinned: to pin it, run once online `tfds build
  # allatt_jax/data/builder.py --config=text8 --register_checksums`.
  # Where TFDS looks for checksums.tsv. Its own lookup through package resources
  # fails for editable installs on Python >= 3.9 (it needs importlib_resources).
  code_path = epath.Path(__file__)

  def __init__(self, *, source_files: dict | None = None,
               encoding: encoding_lib.Encoding | None = None, **kwargs):
    """`source_files`: the sources' fingerprint when the caller has hashed them;
    `encoding`: ids an earlier allatt_jax encoded, written as they are."""
    super().__init__(**kwargs)
    self._known_source_files = source_files
    self._ready_encoding = encoding

  @property
  def spec(self) -> specs.DatasetSpec:
    return self.builder_config.spec

  def _info(self) -> tfds.core.DatasetInfo:
    # Not `dataset_info_from_configs`, whose only addition is a README or CITATIONS
    # file beside this module, which has none: the spec's citation is the one.
    return _LocalDatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({'ids': tfds.features.Scalar(np.int32)}),
        homepage=self.spec.homepage,
        citation=self.spec.citation,
        disable_shuffling=True,
        metadata=tfds.core.MetadataDict(),
    )

  def _download_and_prepare(self, dl_manager, download_config) -> None:
    encoding = self._ready_encoding or self._encode(dl_manager, download_config)
    folder = pathlib.Path(self.data_dir)  # TFDS's temporary folder, renamed when done
    cache.write_arrays(folder, encoding)
    self.info.metadata.update(cache.metadata(encoding, encoding_lib.settings(self.spec)))
    self.info.set_splits(tfds.core.SplitDict([
        tfds.core.SplitInfo(name=split, shard_lengths=[len(ids)], num_bytes=4 * len(ids))
        for split, ids in encoding.splits.items()]))

  def _encode(self, dl_manager, download_config) -> encoding_lib.Encoding:
    spec = self.spec
    if spec.tfds_name:
      from allatt_jax.data import lm1b  # pylint: disable=g-import-not-at-top
      text = lm1b.prepare(spec, self.data_dir_root, download_config.manual_dir)
      vocab, splits = encoding_lib.encode_lines(spec, text.text_batches)
      return encoding_lib.Encoding(vocab, splits, text.source_files, 'official')
    paths = sources.locate(spec, self._source_dir(dl_manager))
    sources.check(spec, paths)
    source_files = self._known_source_files or sources.fingerprint(paths)
    if len(spec.files) == 1:  # One file cut into splits: text8, enwik8, wikitext_chars.
      texts, split_rule = sources.split_stream(
          spec, sources.read_single_file(spec, paths[spec.files[0]]))
      vocab, splits = encoding_lib.encode_texts(spec, texts)
    else:
      files = {split: paths[name] for split, name in zip(specs.SPLITS, spec.files)}
      split_rule = ('one file per split' if spec.name == specs.TEXT_FILES_NAME
                    else 'official')
      if spec.level == 'word':
        vocab, splits = encoding_lib.encode_lines(
            spec, lambda split: sources.line_batches(files[split]))
      else:
        vocab, splits = encoding_lib.encode_texts(
            spec, {split: path.read_bytes() for split, path in files.items()})
    return encoding_lib.Encoding(vocab, splits, source_files, split_rule)

  def _source_dir(self, dl_manager) -> pathlib.Path:
    try:
      manual_dir = dl_manager.manual_dir
    except AssertionError:  # TFDS's answer when the manual folder is absent or empty
      manual_dir = None
    if manual_dir is not None:
      try:
        sources.locate(self.spec, manual_dir)
        return manual_dir
      except DataError:  # TFDS's shared default folder may hold other datasets
        if self.spec.name == specs.TEXT_FILES_NAME:
          raise
    if self.spec.name == specs.TEXT_FILES_NAME:
      raise self.spec.not_found('no folder given')
    if self.spec.url is None:
      return specs.CORPUS_DIR
    sources.check_reachable(self.spec)
    try:
      extracted = dl_manager.download_and_extract(self.spec.url)
    except Exception as e:  # Any download failure means the same to the user.
      raise self.spec.not_found(f'downloading {self.spec.url} failed: {e}') from e
    return pathlib.Path(extracted) / self.spec.archive_folder

  def _as_dataset(self, split, decoders=None, read_config=None, shuffle_files=False):
    del decoders, read_config, shuffle_files  # The ids are read in order, as they are.
    if str(split) not in specs.SPLITS:
      raise ValueError(f'Split {split!r}: choose one of {", ".join(specs.SPLITS)}.')
    ids = np.load(pathlib.Path(self.data_dir) / f'{split}.npy', mmap_mode='r')

    def chunks():
      for start in range(0, len(ids), _AS_DATASET_CHUNK):
        yield np.asarray(ids[start:start + _AS_DATASET_CHUNK])

    # Only this tf.data view needs TensorFlow, whose import takes seconds: preparing a
    # dataset and the runs' own reading (cache.py) do without it.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    signature = tf.TensorSpec(shape=(None,), dtype=tf.int32)
    return (tf.data.Dataset.from_generator(chunks, output_signature=signature)
            .unbatch().map(lambda token: {'ids': token}))


def prepare(spec: specs.DatasetSpec, config_name: str, data_dir: str,
            manual_dir: str | None, source_files: dict | None = None,
            encoding: encoding_lib.Encoding | None = None) -> pathlib.Path:
  """Prepares dataset `spec` as config `config_name` under `data_dir` (again, if a
  stale version is there); returns its folder. `source_files` and `encoding`: see
  AllattText. A text_files folder with its options is a config of its own."""
  folder = cache.dataset_dir(data_dir, config_name)
  registered = AllattText.builder_configs.get(config_name)
  config = config_name if registered and registered.spec == spec else dataset_config(
      spec, config_name)
  download_config = tfds.download.DownloadConfig(
      manual_dir=manual_dir, try_download_gcs=False)
  # The folder is TFDS's, outside any run's workdir: say where, and what moves it.
  logging.info("Preparing dataset '%s' into %s, in the TFDS data folder %s (a "
               "config's data.data_dir or the data command's --data_dir, else "
               '$TFDS_DATA_DIR, else ~/tensorflow_datasets), where later runs read it.',
               spec.name, folder, data_dir)
  with cache.set_aside(folder):
    builder = AllattText(config=config, data_dir=data_dir, source_files=source_files,
                         encoding=encoding)
    try:
      # TFDS prints its own notices to stdout, which commands keep for their results:
      # to stderr with --verbosity=1, else nowhere (the line above says it all).
      with open(os.devnull, 'w') as devnull, contextlib.redirect_stdout(
          sys.stderr if logging.level_debug() else devnull):
        builder.download_and_prepare(download_config=download_config)
    except OSError:
      # Several processes of a run may prepare it at once: the first rename wins.
      if not (folder / 'dataset_info.json').is_file():
        raise
      logging.info('Dataset %s was prepared concurrently; using that one.', folder)
  return folder
