"""Prepares a dataset (if needed) and prints its statistics as one JSON object.

  python -m allatt_jax.data --dataset=wikitext2 --manual_dir=DIR [--data_dir=DIR]
  python -m allatt_jax.data --dataset=text_files --manual_dir=DIR --level=word
      [--files=train.txt,valid.txt,test.txt --min_count=1 --max_vocab=0 --clean=]
  python -m allatt_jax.data --make_embedded_corpus_from=PATH/wikitext-2-raw

The ids go to <data_dir>/allatt_text/<dataset>/1.0.0/ (text_files: to
text_files_<hash>/1.0.0/, the hash of its files and options), read there by every run.
"""
import json

from absl import flags

from allatt_jax.config import cli
from allatt_jax.data import corpus as corpus_lib
from allatt_jax.data import embedded
from allatt_jax.data import specs

_DATASET = flags.DEFINE_enum('dataset', 'wikitext_chars', specs.DATASETS,
                             'Dataset to prepare.')
_MANUAL_DIR, _DATA_DIR = cli.DEFINE_data_folders(
    "Folder holding the dataset's official files, or your own train/valid/test files "
    'for text_files (else TFDS downloads the official archive).',
    'TFDS data folder: the ids go to DATA_DIR/allatt_text/DATASET/1.0.0, for '
    'text_files to DATA_DIR/allatt_text/text_files_<hash>/1.0.0 (default '
    '$TFDS_DATA_DIR or ~/tensorflow_datasets).')
_LEVEL = flags.DEFINE_enum('level', '', ('',) + specs.LEVELS,
                           'text_files: word, char or byte (default word).')
_FILES = flags.DEFINE_string('files', specs.DEFAULT_FILES,
                             'text_files: the train,valid,test file names.')
_MIN_COUNT = flags.DEFINE_integer(
    'min_count', 1, 'text_files, word level: rarer train words become <unk>.',
    lower_bound=1)
_MAX_VOCAB = flags.DEFINE_integer(
    'max_vocab', 0, 'text_files: at most this many types (0: no limit); the rest <unk>.',
    lower_bound=0)
_CLEAN = flags.DEFINE_enum('clean', '', specs.CLEANING,
                           'text_files, char level: text8 = clean as text8 was.')
_MAKE_EMBEDDED = flags.DEFINE_string(
    'make_embedded_corpus_from', None,
    'Instead: rebuild the shipped wikitext_chars corpus from this folder of '
    'WikiText-2 raw files.')


def main(argv):
  del argv
  if _MAKE_EMBEDDED.value:
    path = embedded.make_embedded_corpus(_MAKE_EMBEDDED.value)
    print(json.dumps({'written': str(path), 'bytes': path.stat().st_size}))
    return
  corpus = corpus_lib.load_corpus(
      _DATASET.value, _DATA_DIR.value, _MANUAL_DIR.value, level=_LEVEL.value,
      files=_FILES.value, min_count=_MIN_COUNT.value, max_vocab=_MAX_VOCAB.value,
      clean=_CLEAN.value)
  print(json.dumps(corpus.statistics(), ensure_ascii=False))


def run(argv=None) -> None:
  """Runs the command on `argv` (program name first; default: sys.argv)."""
  cli.run(main, argv, flag_names={f'data.{key}': f'--{key}' for key in (
      'manual_dir', 'data_dir', 'level', 'files', 'min_count', 'max_vocab', 'clean')})


if __name__ == '__main__':
  run()
