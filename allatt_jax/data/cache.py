"""The prepared datasets on disk, read without TensorFlow.

`dataset_dir` is the folder the `allatt_text` builder prepares: train/valid/test.npy
(int32, memory-mapped), vocab.json, and TFDS's dataset_info.json and metadata.json
(what the ids were made from, `metadata`). A rebuild sets the old folder aside until the
new one is complete (`set_aside`), so a reader sees the old, none, or the new.
`legacy_encoding` finds an earlier allatt_jax's layouts.
"""
from collections.abc import Iterator
import contextlib
import json
import os
import pathlib
import shutil
import tempfile

from absl import logging
import numpy as np

from allatt_jax.data import specs
from allatt_jax.data.encoding import Encoding

BUILDER_NAME = 'allatt_text'
VERSION = '1.0.0'
_VOCAB = 'vocab.json'
_METADATA = 'metadata.json'  # where TFDS saves DatasetInfo.metadata
_LEGACY_FINGERPRINT = 'fingerprint.json'


def dataset_dir(data_dir, config_name: str) -> pathlib.Path:
  """Where TFDS puts the `allatt_text/<config_name>` dataset under `data_dir`."""
  return pathlib.Path(data_dir) / BUILDER_NAME / config_name / VERSION


def metadata(encoding: Encoding, settings: dict) -> dict:
  return {'settings': settings, 'source_files': encoding.source_files,
          'split_rule': encoding.split_rule}


def write_arrays(folder: pathlib.Path, encoding: Encoding) -> None:
  for split, ids in encoding.splits.items():
    np.save(folder / f'{split}.npy', np.asarray(ids, dtype=np.int32))
  (folder / _VOCAB).write_text(json.dumps(list(encoding.vocab), ensure_ascii=False),
                               encoding='utf-8')


def load(folder: pathlib.Path, settings: dict, source_files: dict | None
         ) -> Encoding | None:
  """The prepared encoding with these settings (and these source files, unless
  None: downloaded ones, recorded when prepared), or None to prepare it again."""
  try:
    found = json.loads((folder / _METADATA).read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    logging.warning('Unreadable prepared dataset %s (%s); rebuilding it.', folder, e)
    return None
  if found.get('settings') != settings or (
      source_files is not None and found.get('source_files') != source_files):
    logging.info('Prepared dataset %s was made from other files or settings; '
                 'rebuilding it.', folder)
    return None
  return _read_arrays(folder, found['source_files'], found['split_rule'])


def _read_arrays(folder, source_files, split_rule) -> Encoding | None:
  try:
    vocab = tuple(json.loads((folder / _VOCAB).read_text(encoding='utf-8')))
    splits = {split: np.load(folder / f'{split}.npy', mmap_mode='r')
              for split in specs.SPLITS}
  except (OSError, ValueError) as e:
    logging.warning('Damaged prepared dataset %s (%s); rebuilding it.', folder, e)
    return None
  return Encoding(vocab, splits, source_files, split_rule)


@contextlib.contextmanager
def set_aside(folder: pathlib.Path) -> Iterator[None]:
  """Moves `folder` out of the way while it is prepared again: back if that fails,
  deleted once it succeeds."""
  if not folder.exists():
    yield
    return
  old = pathlib.Path(tempfile.mkdtemp(prefix=f'.{folder.name}.old-', dir=folder.parent))
  os.replace(folder, old)
  try:
    yield
  except BaseException:
    if not folder.exists():
      os.replace(old, folder)
    raise
  finally:
    shutil.rmtree(old, ignore_errors=True)


def legacy_folders(data_dir, spec: specs.DatasetSpec, key: str) -> list[pathlib.Path]:
  """The folders an earlier allatt_jax prepared for this dataset (encoded ids first)."""
  data_dir = pathlib.Path(data_dir)
  encoded = data_dir / 'allatt_encoded' / spec.name
  if spec.name == specs.TEXT_FILES_NAME:
    records = data_dir / 'allatt_text_files' / key / spec.name / VERSION
    encoded = encoded / key
  else:  # lm1b's records are TFDS's own dataset, which is still read.
    records = None if spec.tfds_name else data_dir / spec.name / VERSION
  return [folder for folder in (encoded, records) if folder and folder.is_dir()]


def legacy_encoding(folder: pathlib.Path, settings: dict, source_files: dict | None
                    ) -> Encoding | None:
  """The ids an earlier allatt_jax encoded into `folder`, if they are the ones
  these settings and source files give."""
  try:
    found = json.loads((folder / _LEGACY_FINGERPRINT).read_text())
  except (OSError, ValueError):
    return None
  found_settings = {key: value for key, value in found.items()
                    if key not in ('source_files', 'split_rule')}
  if found_settings != settings or (
      source_files is not None and found.get('source_files') != source_files):
    return None
  return _read_arrays(folder, found['source_files'], found['split_rule'])
