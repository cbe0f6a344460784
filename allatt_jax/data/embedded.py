"""The `wikitext_chars` corpus shipped in the package, and how it is made.

WikiText-2 raw valid then test (Merity et al. 2016, CC BY-SA 3.0), cleaned as text8
was from Wikipedia (Mahoney's wikifil.pl), except that accents are removed first (NFKD:
'café' -> 'cafe'; other non-Latin letters become spaces): casefold, digits spelled out
('1984' -> ' one nine eight four '), every other character a space, runs of spaces
collapsed, no leading or trailing space. One line of a-z and spaces, split 90/5/5 by
characters when loaded.
"""
import lzma
import pathlib

from allatt_jax.data import specs
from allatt_jax.data.tokenization import clean_text8_style
from allatt_jax.config.errors import DataError

RAW_FILES = ('wiki.valid.raw', 'wiki.test.raw')
def make_embedded_corpus(raw_dir, out_path=None) -> pathlib.Path:
  """Writes the cleaned, xz-compressed corpus; returns its path."""
  raw_dir = pathlib.Path(raw_dir).expanduser()
  missing = [name for name in RAW_FILES if not (raw_dir / name).is_file()]
  if missing:
    raise DataError(f'{", ".join(missing)} missing in {raw_dir}: pass the folder of '
                    'an unzip of wikitext-2-raw-v1.zip.')
  text = ' '.join(clean_text8_style((raw_dir / name).read_text(encoding='utf-8'))
                  for name in RAW_FILES)
  out_path = pathlib.Path(out_path or specs.CORPUS_DIR / specs.WIKITEXT_CHARS.files[0])
  out_path.write_bytes(lzma.compress(text.encode('ascii'), preset=9 | lzma.PRESET_EXTREME))
  return out_path
