"""What each dataset is: its official files, where they come from, how it is split."""
import dataclasses
from collections.abc import Mapping
import pathlib

from allatt_jax.config.errors import DataError

SPLITS = ('train', 'valid', 'test')

_WIKITEXT_CITATION = """\
@article{merity2016pointer,
  title={Pointer Sentinel Mixture Models},
  author={Merity, Stephen and Xiong, Caiming and Bradbury, James and Socher, Richard},
  journal={arXiv preprint arXiv:1609.07843},
  year={2016}
}"""

_MAHONEY_CITATION = """\
@misc{mahoney2011large,
  title={Large Text Compression Benchmark},
  author={Mahoney, Matt},
  url={http://mattmahoney.net/dc/text.html},
  year={2011}
}"""

_WIKITEXT_HOMEPAGE = ('https://blog.salesforceairesearch.com/'
                      'the-wikitext-long-term-dependency-language-modeling-dataset/')
_WIKITEXT_URL = 'https://s3.amazonaws.com/research.metamind.io/wikitext/'

# The official split of text8 and enwik8 (Mahoney's 100M-character files).
_HUTTER_SIZE = 100_000_000
_HUTTER_SPLIT = (90_000_000, 5_000_000, 5_000_000)

CORPUS_DIR = pathlib.Path(__file__).resolve().parent.parent / 'corpus'


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """The official form of a dataset, as the loader checks it.

  Word-level datasets come as one file per split (`files` in SPLITS order), read
  line by line. Character- and byte-level datasets are one file (`files[0]`) cut
  into train/valid/test by `split_sizes`.
  """
  name: str
  level: str  # 'word' | 'char' | 'byte'
  files: tuple[str, ...]
  url: str | None  # official archive; None for the corpus shipped in the package
  archive_folder: str = ''  # folder inside the extracted archive holding `files`
  description: str = ''
  homepage: str = ''
  citation: str = ''
  # Known official content, to warn when a run does not use the reference data.
  official_sha256: Mapping[str, str] = dataclasses.field(default_factory=dict)
  official_train_lines: int | None = None
  official_size: int | None = None
  official_split: tuple[int, int, int] | None = None
  proportions: tuple[int, int, int] = (90, 5, 5)
  # MD5s published with the files, where no SHA-256 is (Penn Treebank).
  official_md5: Mapping[str, str] = dataclasses.field(default_factory=dict)
  # Vocabulary: train words seen fewer than `min_count` times, and all but the
  # `max_vocab` most frequent types (0: no limit), become <unk>; with `add_unk` the
  # vocabulary has <unk> even when train has none, for the words of valid/test.
  min_count: int = 1
  max_vocab: int = 0
  add_unk: bool = False
  clean: str = ''  # char level: 'text8' = cleaned as text8 was, '' = characters as they are
  tfds_name: str = ''  # prepared by TFDS's own builder of this name instead of ours

  @property
  def archive_name(self) -> str:
    return self.url.rsplit('/', 1)[-1] if self.url else ''

  def source_hint(self) -> str:
    """How a user provides the files, for error messages."""
    if self.name == TEXT_FILES_NAME:
      return ('Pass the folder holding them with --config.data.manual_dir=DIR. Other '
              'file names go in --config.data.files=TRAIN,VALID,TEST.')
    if self.tfds_name:
      return (f'TFDS downloads {self.archive_name} (needs internet), or finds it in '
              'the folder given with --config.data.manual_dir=DIR.')
    if self.url is None:
      return (f'It ships inside the package in {CORPUS_DIR}; reinstall allatt_jax, '
              'or rebuild it with `python -m allatt_jax.data '
              '--make_embedded_corpus_from=DIR` from a folder holding the WikiText-2 '
              'raw files wiki.valid.raw and wiki.test.raw.')
    return ('Either let TFDS download it (needs internet) or pass the folder that '
            f'holds the official files with --config.data.manual_dir=DIR, e.g. an '
            f'unzip of {self.archive_name}.')

  def not_found(self, reason: str) -> DataError:
    return DataError(
        f"Dataset '{self.name}' not found ({reason}): expected "
        f"{', '.join(self.files)}. {self.source_hint()}")

  def split_sizes(self, total: int) -> tuple[tuple[int, int, int], str]:
    """Lengths of train/valid/test for a single-file dataset, and the rule used.

    The official rule is fixed counts on the full-size file. A shorter file (a
    head of it, as in tests) is split in the same proportions instead, which
    results are not comparable with published numbers.
    """
    if self.official_size is not None and total == self.official_size:
      return self.official_split, 'official'
    if self.official_size is not None and total > self.official_size:
      raise DataError(
          f"Dataset '{self.name}': the file {self.files[0]} has {total:,} bytes, "
          f'more than the official {self.official_size:,}; it is not {self.name}.')
    train_part, valid_part, _ = self.proportions
    train = total * train_part // 100
    valid = total * valid_part // 100
    rule = 'proportional {}/{}/{}'.format(*self.proportions)
    return (train, valid, total - train - valid), rule


_PTB_CITATION = """\
@inproceedings{mikolov2010recurrent,
  title={Recurrent neural network based language model},
  author={Mikolov, Tomas and Karafiat, Martin and Burget, Lukas and Cernocky, Jan
          and Khudanpur, Sanjeev},
  booktitle={Interspeech},
  year={2010}
}"""

_LM1B_CITATION = """\
@article{chelba2013one,
  title={One Billion Word Benchmark for Measuring Progress in Statistical Language Modeling},
  author={Chelba, Ciprian and Mikolov, Tomas and Schuster, Mike and Ge, Qi and Brants,
          Thorsten and Koehn, Phillipp and Robinson, Tony},
  journal={arXiv preprint arXiv:1312.3005},
  year={2013}
}"""

def _wikitext(name: str, folder: str, size: str, valid_sha256: str, test_sha256: str,
              train_lines: int) -> DatasetSpec:
  """A WikiText (v1) dataset: the same files, source and licence at another size."""
  title = folder.replace('wikitext', 'WikiText')
  return DatasetSpec(
      name=name,
      level='word',
      files=('wiki.train.tokens', 'wiki.valid.tokens', 'wiki.test.tokens'),
      url=_WIKITEXT_URL + f'{folder}-v1.zip',
      archive_folder=folder,
      description=(f'{title} (v1): {size} words of Wikipedia Good and Featured '
                   'articles, tokenised, rare words mapped to <unk>. CC BY-SA 3.0.'),
      homepage=_WIKITEXT_HOMEPAGE,
      citation=_WIKITEXT_CITATION,
      official_sha256={'wiki.valid.tokens': valid_sha256, 'wiki.test.tokens': test_sha256},
      official_train_lines=train_lines,
  )


WIKITEXT103 = _wikitext(
    'wikitext103', 'wikitext-103', '103M',
    valid_sha256='9aee9f52d6e77de6c7751fc5e7c44287db3ec0eaf15477098acc6b93c1c4250b',
    test_sha256='56db52eb157b1ab5c89646eef70510c1eca6e12a3bfdb99f0d6b05b4eacb75b9',
    train_lines=1_801_350)

WIKITEXT2 = _wikitext(
    'wikitext2', 'wikitext-2', '2M',
    valid_sha256='f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8',
    test_sha256='d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0',
    train_lines=36_718)


def _hutter(name: str, level: str, description: str, **extra) -> DatasetSpec:
  """A 100M-unit Wikipedia prefix from Matt Mahoney's page, split 90M/5M/5M."""
  return DatasetSpec(
      name=name,
      level=level,
      files=(name,),
      url=f'http://mattmahoney.net/dc/{name}.zip',
      description=description,
      homepage='http://mattmahoney.net/dc/textdata.html',
      citation=_MAHONEY_CITATION,
      official_size=_HUTTER_SIZE,
      official_split=_HUTTER_SPLIT,
      **extra,
  )


TEXT8 = _hutter('text8', 'char', (
    'text8: the first 100M characters of cleaned English Wikipedia '
    '(lowercase a-z and space), split 90M/5M/5M.'), clean='text8')

ENWIK8 = _hutter('enwik8', 'byte', (
    'enwik8: the first 100M bytes of an English Wikipedia XML dump, '
    'split 90M/5M/5M.'))

WIKITEXT_CHARS = DatasetSpec(
    name='wikitext_chars',
    level='char',
    files=('wikitext_chars.txt.xz',),
    url=None,
    description=('WikiText-2 raw valid + test, cleaned like text8 (lowercase a-z and '
                 'space), split 90/5/5 by characters. Shipped with the package so '
                 'demos run offline. CC BY-SA 3.0.'),
    homepage=_WIKITEXT_HOMEPAGE,
    citation=_WIKITEXT_CITATION,
    clean='text8',
)

# Mikolov's preprocessed Penn Treebank: lower case, numbers as N, the 10K most
# frequent words kept and <unk> already in the text. 887,521 / 70,390 / 78,669
# words, so 929,589 / 73,760 / 82,430 tokens with one <eos> per line.
PTB = DatasetSpec(
    name='ptb',
    level='word',
    files=('ptb.train.txt', 'ptb.valid.txt', 'ptb.test.txt'),
    url='http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz',
    archive_folder='simple-examples/data',
    description=('Penn Treebank (Mikolov et al. 2010): 1M words of Wall Street '
                 'Journal text, 10K-word vocabulary, <unk> in the text.'),
    homepage='http://www.fit.vutbr.cz/~imikolov/rnnlm/',
    citation=_PTB_CITATION,
    official_md5={'ptb.train.txt': 'f26c4b92c5fdc7b3f8c7cdcb991d8420',
                  'ptb.valid.txt': 'aa0affc06ff7c36e977d7cd49e3839bf',
                  'ptb.test.txt': '8b80168b89c18661a38ef683c0dc3721'},
    official_train_lines=42_068,
)

# One Billion Word through TFDS's own `lm1b` builder, with Transformer-XL's
# vocabulary (train words seen at least 3 times, ~793K types). TFDS
# has no validation split: its test split (the 50 held-out files) is cut in halves,
# the first for valid, the second for test.
LM1B = DatasetSpec(
    name='lm1b',
    level='word',
    files=(),
    url=('http://www.statmt.org/lm-benchmark/'
         '1-billion-word-language-modeling-benchmark-r13output.tar.gz'),
    description='One Billion Word benchmark (Chelba et al. 2013), one sentence a line.',
    homepage='http://www.statmt.org/lm-benchmark/',
    citation=_LM1B_CITATION,
    min_count=3,
    add_unk=True,
    tfds_name='lm1b',
)

TEXT_FILES_NAME = 'text_files'
LEVELS = ('word', 'char', 'byte')
CLEANING = ('', 'text8')
DEFAULT_FILES = 'train.txt,valid.txt,test.txt'

# The user's own text; `resolve` fills in level, files and vocabulary options.
TEXT_FILES = DatasetSpec(
    name=TEXT_FILES_NAME,
    level='word',
    files=tuple(DEFAULT_FILES.split(',')),
    url=None,
    description='Your own text: one UTF-8 file per split.',
    add_unk=True,
)

_SPECS = {spec.name: spec for spec in
          (WIKITEXT103, WIKITEXT2, TEXT8, ENWIK8, WIKITEXT_CHARS, PTB, LM1B, TEXT_FILES)}
DATASETS: tuple[str, ...] = tuple(_SPECS)


def get_spec(name: str) -> DatasetSpec:
  if name not in _SPECS:
    raise DataError(f'Unknown dataset {name!r}; choose one of {", ".join(DATASETS)}.')
  return _SPECS[name]


def resolve(name: str, level: str = '', files: str = DEFAULT_FILES, min_count: int = 1,
            max_vocab: int = 0, clean: str = '') -> DatasetSpec:
  """The spec of `name` with the options of config.data (text_files only).

  Raises:
    DataError: an unknown dataset, or options it cannot take.
  """
  spec = get_spec(name)
  given = {'level': level, 'files': files, 'min_count': min_count,
           'max_vocab': max_vocab, 'clean': clean}
  defaults = {'level': '', 'files': DEFAULT_FILES, 'min_count': 1, 'max_vocab': 0,
              'clean': ''}
  if name != TEXT_FILES_NAME:
    changed = [f'--config.data.{key}={value!r}' for key, value in given.items()
               if value != defaults[key]]
    if changed:
      raise DataError(f"{', '.join(changed)} only applies to dataset "
                      f"'{TEXT_FILES_NAME}'; dataset {name!r} is always "
                      f'{spec.level}-level as published. Drop the option(s).')
    return spec
  level = level or 'word'
  names = tuple(part.strip() for part in files.split(','))
  problems = []
  if level not in LEVELS:
    problems.append(f"--config.data.level={level!r} is not one of {', '.join(LEVELS)}")
  if len(names) != 3 or not all(names) or len(set(names)) != 3:
    problems.append(f'--config.data.files={files!r} must name three different files, '
                    'train,valid,test')
  if clean not in CLEANING or (clean and level != 'char'):
    problems.append(f"--config.data.clean={clean!r}: use '' or 'text8' (char level "
                    'only)')
  if min_count < 1 or (min_count > 1 and level != 'word'):
    problems.append(f'--config.data.min_count={min_count}: use 1, or more at word '
                    'level only')
  if max_vocab < 0 or (level == 'word' and max_vocab == 1):
    problems.append(f'--config.data.max_vocab={max_vocab}: use 0 (no limit) or at '
                    'least 2 (<eos> and <unk>)')
  if level == 'byte' and 0 < max_vocab < 256:
    problems.append(f'--config.data.max_vocab={max_vocab}: bytes have no <unk> to map '
                    'the rest to, so the vocabulary is all 256 byte values; use 0')
  if problems:
    raise DataError(f"Dataset '{TEXT_FILES_NAME}': " + '; '.join(problems) + '.')
  return dataclasses.replace(spec, level=level, files=names, min_count=min_count,
                             max_vocab=max_vocab, clean=clean)


def options(spec: DatasetSpec) -> dict:
  """What, besides the source files, decides a text_files encoding."""
  return {'level': spec.level, 'files': list(spec.files), 'min_count': spec.min_count,
          'max_vocab': spec.max_vocab, 'clean': spec.clean}

