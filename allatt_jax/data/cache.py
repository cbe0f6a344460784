"""Encoded splits on disk: int32 .npy (memory-mapped on load) + vocab.json.

A cache folder holds exactly one encoding, described by fingerprint.json (the
source files' sizes and hashes plus the tokenisation settings). It is used only
when that description equals the one asked for; otherwise it is rebuilt. It is
written into a temporary folder and renamed into place, so a crash never leaves
a half-written cache where a reader would take it.
"""
import json
import os
import pathlib
import shutil
import tempfile

from absl import logging
import numpy as np

from allatt_jax.data import specs

_FINGERPRINT = 'fingerprint.json'
_VOCAB = 'vocab.json'


def load(cache_dir: pathlib.Path, fingerprint: dict):
  """(vocab, splits as read-only memmaps), or None when absent or stale."""
  try:
    found = json.loads((cache_dir / _FINGERPRINT).read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    logging.warning('Unreadable encoded cache %s (%s); rebuilding it.', cache_dir, e)
    return None
  if found != fingerprint:
    logging.info('Encoded cache %s was made from other files or settings; '
                 'rebuilding it.', cache_dir)
    return None
  try:
    vocab = tuple(json.loads((cache_dir / _VOCAB).read_text(encoding='utf-8')))
    splits = {split: np.load(cache_dir / f'{split}.npy', mmap_mode='r')
              for split in specs.SPLITS}
  except (OSError, ValueError) as e:
    logging.warning('Damaged encoded cache %s (%s); rebuilding it.', cache_dir, e)
    return None
  return vocab, splits


def write(cache_dir: pathlib.Path, fingerprint: dict, vocab, splits) -> None:
  cache_dir.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(
      tempfile.mkdtemp(prefix=f'.{cache_dir.name}.tmp-', dir=cache_dir.parent))
  try:
    for split, ids in splits.items():
      np.save(staging / f'{split}.npy', np.asarray(ids, dtype=np.int32))
    (staging / _VOCAB).write_text(json.dumps(list(vocab), ensure_ascii=False),
                                  encoding='utf-8')
    (staging / _FINGERPRINT).write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
    _replace_dir(staging, cache_dir)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def _replace_dir(new: pathlib.Path, target: pathlib.Path) -> None:
  """Moves `new` to `target`; a reader sees the old folder, none, or the new one."""
  old = None
  if target.exists():
    old = pathlib.Path(tempfile.mkdtemp(prefix=f'.{target.name}.old-', dir=target.parent))
    os.replace(target, old)
  try:
    os.replace(new, target)
  except OSError:  # Another process put its (equally fresh) cache there first.
    logging.info('Encoded cache %s was written concurrently; using that one.', target)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
