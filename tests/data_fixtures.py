"""Small datasets in the official file formats, and the real data when present."""
import pathlib

# The real datasets (see its README), present on development machines and CI.
SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / 'shared' / 'data'

WIKITEXT_FILES = ('wiki.train.tokens', 'wiki.valid.tokens', 'wiki.test.tokens')


TEXT_FILES = ('train.txt', 'valid.txt', 'test.txt')


def write_text_files(directory: pathlib.Path, texts, names=TEXT_FILES) -> pathlib.Path:
  """`directory` holding one file per split, as dataset text_files reads them: each
  text (str, written as UTF-8, or bytes) under its name."""
  directory.mkdir(parents=True, exist_ok=True)
  for name, text in zip(names, texts):
    (directory / name).write_bytes(text if isinstance(text, bytes) else text.encode('utf-8'))
  return directory


def wikitext_article(title: str, paragraphs: list[str]) -> list[str]:
  """Lines of one article as WikiText stores them (lines start with a space)."""
  lines = [' ', f' = {title} = ', ' ']
  for paragraph in paragraphs:
    lines += [f' {paragraph} ', ' ']
  return lines


def write_wikitext(directory: pathlib.Path, splits: dict[str, list[str]]) -> None:
  """Writes wiki.{train,valid,test}.tokens from lists of lines."""
  directory.mkdir(parents=True, exist_ok=True)
  for name, split in zip(WIKITEXT_FILES, ('train', 'valid', 'test')):
    (directory / name).write_text(''.join(line + '\n' for line in splits[split]),
                                  encoding='utf-8')


def tiny_wikitext(directory: pathlib.Path) -> dict[str, list[str]]:
  splits = {
      'train': (wikitext_article('Cats', ['the cat sat on the mat .',
                                          'a cat is an <unk> animal .'])
                + wikitext_article('Dogs', ['the dog @-@ like cat ran .'])),
      'valid': wikitext_article('Birds', ['the bird sat on the cat .']),
      'test': wikitext_article('Fish', ['a fish , the <unk> fish .']),
  }
  write_wikitext(directory, splits)
  return splits


def expected_word_ids(lines: list[str], vocab: tuple[str, ...]) -> list[int]:
  """Transformer-XL's rule written out plainly: words of each line, then <eos>."""
  index = {word: i for i, word in enumerate(vocab)}
  return [index.get(word, index.get('<unk>')) for line in lines
          for word in line.split() + ['<eos>']]


def write_text8(directory: pathlib.Path, text: str) -> None:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / 'text8').write_text(text, encoding='ascii')


def prepared_text8(root: pathlib.Path, num_chars: int = 20000) -> tuple[str, str]:
  """(manual_dir, data_dir) under `root`: a sample text8 file, encoded once."""
  from allatt_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  write_text8(root / 'raw', sample_text8(num_chars))
  data_lib.load_corpus('text8', str(root / 'data'), str(root / 'raw'))
  return str(root / 'raw'), str(root / 'data')


def text8_data(root: pathlib.Path, num_chars: int = 20000) -> dict[str, str]:
  """The data section's keys for a sample text8 file under `root`, encoded once: the
  embedded corpus's alphabet and cleaning, with splits small enough that a run's final
  evaluation of them whole takes a fraction of a second."""
  manual_dir, data_dir = prepared_text8(root, num_chars)
  return dict(name='text8', manual_dir=manual_dir, data_dir=data_dir)


def sample_text8(num_chars: int) -> str:
  words = ('anarchism originated as a term of abuse first used against early '
           'working class radicals including the diggers of the english revolution '
           'and the sans culottes of the french revolution whilst').split()
  text, i = '', 0
  while len(text) < num_chars:
    text += ' ' + words[i % len(words)]
    i += 7
  return text[:num_chars]


def write_enwik8(directory: pathlib.Path, data: bytes) -> None:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / 'enwik8').write_bytes(data)


def sample_enwik8(num_bytes: int) -> bytes:
  page = ('<page>\n  <title>Zürich</title>\n  <text>Zürich is the largest city in '
          'Switzerland — [[Lake Zürich]].</text>\n</page>\n').encode('utf-8')
  data = b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/">\n'
  while len(data) < num_bytes:
    data += page
  return data[:num_bytes]
