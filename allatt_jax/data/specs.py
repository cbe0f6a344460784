"""What each dataset is: its official files, where they come from, how it is split."""
import dataclasses
from collections.abc import Mapping
import pathlib

from allatt_jax.errors import DataError

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

  @property
  def archive_name(self) -> str:
    return self.url.rsplit('/', 1)[-1] if self.url else ''

  def source_hint(self) -> str:
    """How a user provides the files, for error messages."""
    if self.url is None:
      return (f'It ships inside the package in {CORPUS_DIR}; reinstall allatt_jax, '
              'or rebuild it with `python -m allatt_jax.data '
              '--make_embedded_corpus_from=DIR` from a folder holding the WikiText-2 '
              'raw files wiki.valid.raw and wiki.test.raw.')
    return ('Either let TFDS download it (needs internet) or pass the folder that '
            'holds the official files with --config.data.manual_dir=DIR (or '
            f'--manual_dir=DIR for `python -m allatt_jax.data`), e.g. an unzip of '
            f'{self.archive_name}.')

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


WIKITEXT103 = DatasetSpec(
    name='wikitext103',
    level='word',
    files=('wiki.train.tokens', 'wiki.valid.tokens', 'wiki.test.tokens'),
    url=_WIKITEXT_URL + 'wikitext-103-v1.zip',
    archive_folder='wikitext-103',
    description=('WikiText-103 (v1): 103M words of Wikipedia Good and Featured '
                 'articles, tokenised, rare words mapped to <unk>. CC BY-SA 3.0.'),
    homepage=_WIKITEXT_HOMEPAGE,
    citation=_WIKITEXT_CITATION,
    official_sha256={
        'wiki.valid.tokens':
            '9aee9f52d6e77de6c7751fc5e7c44287db3ec0eaf15477098acc6b93c1c4250b',
        'wiki.test.tokens':
            '56db52eb157b1ab5c89646eef70510c1eca6e12a3bfdb99f0d6b05b4eacb75b9',
    },
    official_train_lines=1_801_350,
)

WIKITEXT2 = DatasetSpec(
    name='wikitext2',
    level='word',
    files=('wiki.train.tokens', 'wiki.valid.tokens', 'wiki.test.tokens'),
    url=_WIKITEXT_URL + 'wikitext-2-v1.zip',
    archive_folder='wikitext-2',
    description=('WikiText-2 (v1): 2M words of Wikipedia Good and Featured '
                 'articles, tokenised, rare words mapped to <unk>. CC BY-SA 3.0.'),
    homepage=_WIKITEXT_HOMEPAGE,
    citation=_WIKITEXT_CITATION,
    official_sha256={
        'wiki.valid.tokens':
            'f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8',
        'wiki.test.tokens':
            'd790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0',
    },
    official_train_lines=36_718,
)

TEXT8 = DatasetSpec(
    name='text8',
    level='char',
    files=('text8',),
    url='http://mattmahoney.net/dc/text8.zip',
    description=('text8: the first 100M characters of cleaned English Wikipedia '
                 '(lowercase a-z and space), split 90M/5M/5M.'),
    homepage='http://mattmahoney.net/dc/textdata.html',
    citation=_MAHONEY_CITATION,
    official_size=_HUTTER_SIZE,
    official_split=_HUTTER_SPLIT,
)

ENWIK8 = DatasetSpec(
    name='enwik8',
    level='byte',
    files=('enwik8',),
    url='http://mattmahoney.net/dc/enwik8.zip',
    description=('enwik8: the first 100M bytes of an English Wikipedia XML dump, '
                 'split 90M/5M/5M.'),
    homepage='http://mattmahoney.net/dc/textdata.html',
    citation=_MAHONEY_CITATION,
    official_size=_HUTTER_SIZE,
    official_split=_HUTTER_SPLIT,
)

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
)

_SPECS = {spec.name: spec for spec in
          (WIKITEXT103, WIKITEXT2, TEXT8, ENWIK8, WIKITEXT_CHARS)}
DATASETS: tuple[str, ...] = tuple(_SPECS)


def get_spec(name: str) -> DatasetSpec:
  if name not in _SPECS:
    raise DataError(f'Unknown dataset {name!r}; choose one of {", ".join(DATASETS)}.')
  return _SPECS[name]
