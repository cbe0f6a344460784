"""Datasets: tokenisation, TFDS preparation, the encoded cache, errors, the CLI."""
import json
import lzma
import os
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import data_fixtures
from allatt_jax import data
from allatt_jax.data import embedded
from allatt_jax.data import specs
from allatt_jax.data import tfds_builders
from allatt_jax.data import tokenization
from allatt_jax.errors import DataError

SHARED = data_fixtures.SHARED_DATA
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f'{SHARED} not present')


@pytest.fixture
def tfds_prepares(monkeypatch):
  """Names of the datasets TFDS is asked to prepare (it still does)."""
  calls = []
  real_prepare = tfds_builders.prepare

  def recording_prepare(spec, *args):
    calls.append(spec.name)
    return real_prepare(spec, *args)

  monkeypatch.setattr(tfds_builders, 'prepare', recording_prepare)
  return calls


# Tokenisation.

def test_word_vocab_is_by_frequency_ties_by_first_occurrence():
  vocab, ids = tokenization.encode_train([['b a c', ''], ['c b d']])
  # counts: b 2, c 2, <eos> 3, a 1, d 1; b appears before c, a before d.
  assert vocab == ('<eos>', 'b', 'c', 'a', 'd')
  assert ids.tolist() == [1, 3, 2, 0, 0, 2, 1, 4, 0]
  assert ids.dtype == np.int32


def test_every_line_gets_eos_and_unknown_words_become_unk():
  index = {'<eos>': 0, '<unk>': 1, 'x': 2}
  ids, unknown = tokenization.encode_lines(['x y', '', ' '], index)
  assert ids.tolist() == [2, 1, 0, 0, 0]
  assert unknown == 1


def test_unknown_word_without_unk_in_vocab_is_an_error():
  with pytest.raises(DataError, match='no <unk>'):
    tokenization.encode_lines(['y'], {'<eos>': 0})


def test_text_encoding_matches_split_encoding_and_decodes_back():
  corpus = data.Corpus('toy', 'word', ('<eos>', '<unk>', 'the', 'cat'), {})
  ids, unknown = corpus.encode('the cat\nthe dog\nthe')
  assert ids.tolist() == [2, 3, 0, 2, 1, 0, 2]  # the last line is not ended
  assert unknown == 1
  assert corpus.decode(ids) == 'the cat\nthe <unk>\nthe'
  assert corpus.encode(corpus.decode(ids))[0].tolist() == ids.tolist()
  assert corpus.metric == 'ppl' and corpus.vocab_size == 4


def test_char_and_byte_corpora_encode_and_decode():
  chars = data.Corpus('c', 'char', tuple(tokenization.TEXT8_ALPHABET), {}, clean='text8')
  ids, dropped = chars.encode('Hi there!\n42')   # cleaned as text8 was made
  assert chars.decode(ids) == 'hi there four two' and dropped == 0
  assert chars.metric == 'bpc'
  as_is = data.Corpus('c', 'char', ('\n', 'H', 'i', 'é'), {})
  ids, dropped = as_is.encode('Hié!\nH')   # characters as they are; '!' is unknown
  assert as_is.decode(ids) == 'Hié\nH' and dropped == 1
  raw = data.Corpus('b', 'byte', tokenization.byte_vocab(), {})
  ids, _ = raw.encode('Zürich')
  assert ids.tolist() == list('Zürich'.encode('utf-8'))
  assert raw.decode(ids) == 'Zürich'
  assert raw.vocab_size == 256 and raw.vocab[ord('a')] == 'a' and raw.vocab[10] == '<0x0A>'


def test_split_rule_official_proportional_or_refused():
  assert specs.ENWIK8.split_sizes(100_000_000) == (
      (90_000_000, 5_000_000, 5_000_000), 'official')
  assert specs.TEXT8.split_sizes(1000) == ((900, 50, 50), 'proportional 90/5/5')
  with pytest.raises(DataError, match='more than the official'):
    specs.ENWIK8.split_sizes(100_000_001)


# Word-level datasets through TFDS and the cache.

def test_wikitext_is_tokenised_like_transformer_xl(tmp_path):
  splits = data_fixtures.tiny_wikitext(tmp_path / 'raw')
  corpus = data.load_corpus('wikitext103', tmp_path / 'data', tmp_path / 'raw')
  assert corpus.level == 'word' and corpus.metric == 'ppl'
  assert corpus.vocab[:5] == ('<eos>', '=', 'the', 'cat', '.')  # the, cat, . tie at 3
  assert '<unk>' in corpus.vocab and 'bird' not in corpus.vocab
  for split, lines in splits.items():
    ids = corpus.splits[split]
    assert ids.dtype == np.int32 and isinstance(ids, np.memmap)
    assert ids.tolist() == data_fixtures.expected_word_ids(lines, corpus.vocab)


def test_second_load_uses_the_cache_without_tfds(tmp_path, tfds_prepares):
  data_fixtures.tiny_wikitext(tmp_path / 'raw')
  first = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert tfds_prepares == ['wikitext2']
  second = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert tfds_prepares == ['wikitext2']
  assert second.vocab == first.vocab
  for split in specs.SPLITS:
    np.testing.assert_array_equal(second.splits[split], first.splits[split])
  leftovers = [p.name for p in (tmp_path / 'data' / 'allatt_encoded').iterdir()]
  assert leftovers == ['wikitext2']


def test_changed_source_file_rebuilds_cache_and_tfds_data(tmp_path):
  splits = data_fixtures.tiny_wikitext(tmp_path / 'raw')
  before = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  splits['valid'] = data_fixtures.wikitext_article('Birds', ['the dog sat .'])
  data_fixtures.write_wikitext(tmp_path / 'raw', splits)
  after = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert len(after.splits['valid']) != len(before.splits['valid'])
  assert after.splits['valid'].tolist() == data_fixtures.expected_word_ids(
      splits['valid'], after.vocab)


def test_cache_from_other_settings_is_not_reused(tmp_path, tfds_prepares):
  data_fixtures.tiny_wikitext(tmp_path / 'raw')
  data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  fingerprint_file = tmp_path / 'data' / 'allatt_encoded' / 'wikitext2' / 'fingerprint.json'
  fingerprint = json.loads(fingerprint_file.read_text())
  fingerprint['encoding_version'] -= 1
  fingerprint_file.write_text(json.dumps(fingerprint))
  np.save(fingerprint_file.parent / 'valid.npy', np.zeros(3, np.int32))
  rebuilt = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert tfds_prepares == ['wikitext2', 'wikitext2']
  assert len(rebuilt.splits['valid']) > 3
  assert json.loads(fingerprint_file.read_text())['encoding_version'] == (
      fingerprint['encoding_version'] + 1)


def test_failed_cache_write_leaves_old_cache_and_no_partial_one(tmp_path, monkeypatch):
  splits = data_fixtures.tiny_wikitext(tmp_path / 'raw')
  before = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  cache_dir = tmp_path / 'data' / 'allatt_encoded' / 'wikitext2'
  old_fingerprint = (cache_dir / 'fingerprint.json').read_text()
  splits['test'] = data_fixtures.wikitext_article('Fish', ['a dog .'])
  data_fixtures.write_wikitext(tmp_path / 'raw', splits)
  real_save = np.save

  def save_then_fail(path, array):
    real_save(path, array)
    if str(path).endswith('valid.npy'):
      raise OSError('disk full')

  monkeypatch.setattr(np, 'save', save_then_fail)
  with pytest.raises(OSError, match='disk full'):
    data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert (cache_dir / 'fingerprint.json').read_text() == old_fingerprint
  np.testing.assert_array_equal(np.load(cache_dir / 'train.npy'), before.splits['train'])
  assert [p.name for p in cache_dir.parent.iterdir()] == ['wikitext2']


def test_manual_dir_may_be_the_unzipped_archive_parent(tmp_path):
  data_fixtures.tiny_wikitext(tmp_path / 'raw' / 'wikitext-2')
  corpus = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert corpus.vocab[0] == '<eos>'


# Character- and byte-level datasets.

def test_text8_short_file_is_split_proportionally(tmp_path):
  text = data_fixtures.sample_text8(10_000)
  data_fixtures.write_text8(tmp_path / 'raw', text)
  corpus = data.load_corpus('text8', tmp_path / 'data', tmp_path / 'raw')
  assert corpus.level == 'char' and corpus.metric == 'bpc'
  assert corpus.vocab_size == 27 and corpus.split_rule == 'proportional 90/5/5'
  assert [len(corpus.splits[s]) for s in specs.SPLITS] == [9000, 500, 500]
  decoded = ''.join(corpus.decode(corpus.splits[s]) for s in specs.SPLITS)
  assert decoded == text


def test_enwik8_is_bytes(tmp_path):
  raw = data_fixtures.sample_enwik8(5000)
  data_fixtures.write_enwik8(tmp_path / 'raw', raw)
  corpus = data.load_corpus('enwik8', tmp_path / 'data', tmp_path / 'raw')
  assert corpus.vocab_size == 256 and corpus.level == 'byte'
  joined = np.concatenate([corpus.splits[s] for s in specs.SPLITS])
  assert bytes(joined.astype(np.uint8)) == raw


@needs_shared
def test_enwik8_head_from_shared_data(tmp_path):
  (tmp_path / 'raw').mkdir()
  (tmp_path / 'raw' / 'enwik8').symlink_to(SHARED / 'enwik8-head' / 'enwik8_head')
  corpus = data.load_corpus('enwik8', tmp_path / 'data', tmp_path / 'raw')
  assert [len(corpus.splits[s]) for s in specs.SPLITS] == [963_945, 53_552, 53_554]


def test_embedded_corpus_needs_no_download(tmp_path):
  corpus = data.load_corpus('wikitext_chars', tmp_path / 'data')
  assert corpus.vocab == tuple(' abcdefghijklmnopqrstuvwxyz') and corpus.metric == 'bpc'
  text = lzma.decompress((specs.CORPUS_DIR / 'wikitext_chars.txt.xz').read_bytes())
  sizes = [len(corpus.splits[s]) for s in specs.SPLITS]
  assert sum(sizes) == len(text) > 2_000_000
  assert sizes[0] == len(text) * 90 // 100 and sizes[1] == len(text) * 5 // 100
  assert corpus.decode(corpus.splits['valid'][:200]) == text[sizes[0]:sizes[0] + 200].decode()
  assert (specs.CORPUS_DIR / 'ATTRIBUTION.md').read_text().count('CC BY-SA 3.0') >= 2


def test_text8_style_cleaning():
  assert tokenization.clean_text8_style(' = Café = \n In 1984 @-@ the\tB-52s ! ') == (
      'cafe in one nine eight four the b five two s')


@needs_shared
def test_embedded_corpus_is_reproducible(tmp_path):
  rebuilt = embedded.make_embedded_corpus(SHARED / 'wikitext-2-raw', tmp_path / 'c.xz')
  shipped = specs.CORPUS_DIR / 'wikitext_chars.txt.xz'
  assert lzma.decompress(rebuilt.read_bytes()) == lzma.decompress(shipped.read_bytes())


# The real WikiText-2.

@needs_shared
def test_wikitext2_figures(tmp_path):
  corpus = data.load_corpus('wikitext2', tmp_path / 'data', SHARED / 'wikitext-2')
  assert corpus.vocab_size == 33_278
  assert {s: len(ids) for s, ids in corpus.splits.items()} == {
      'train': 2_088_628, 'valid': 217_646, 'test': 245_569}
  unk = corpus.vocab.index('<unk>')
  assert int((corpus.splits['train'] == unk).sum()) == 54_625
  with open(SHARED / 'wikitext-2' / 'wiki.valid.tokens', encoding='utf-8') as f:
    first_lines = [next(f) for _ in range(50)]
  expected = data_fixtures.expected_word_ids(first_lines, corpus.vocab)
  assert corpus.splits['valid'][:len(expected)].tolist() == expected


# Errors.

def test_unknown_dataset_is_named():
  with pytest.raises(DataError, match="Unknown dataset 'wikitext5'.*wikitext103"):
    data.load_corpus('wikitext5')


def test_missing_files_message_names_dataset_files_and_both_fixes(tmp_path):
  (tmp_path / 'raw').mkdir()
  (tmp_path / 'raw' / 'wiki.train.tokens').write_text(' = A = \n')
  with pytest.raises(DataError) as error:
    data.load_corpus('wikitext103', tmp_path / 'data', tmp_path / 'raw')
  message = str(error.value)
  for part in ("'wikitext103'", 'wiki.valid.tokens, wiki.test.tokens missing',
               'wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens',
               'TFDS download', 'manual_dir=DIR', 'wikitext-103-v1.zip'):
    assert part in message


def test_manual_dir_that_does_not_exist_is_named(tmp_path):
  with pytest.raises(DataError, match=f"'text8' not found .{tmp_path / 'nope'} is not a"):
    data.load_corpus('text8', tmp_path / 'data', tmp_path / 'nope')


def test_offline_without_manual_dir_fails_fast_with_both_fixes(tmp_path, monkeypatch):
  def no_network(*args, **kwargs):
    raise OSError('Name or service not known')

  monkeypatch.setattr(urllib.request, 'getproxies', dict)
  monkeypatch.setattr(socket, 'create_connection', no_network)
  with pytest.raises(DataError) as error:
    data.load_corpus('text8', tmp_path / 'data')
  message = str(error.value)
  for part in ("'text8'", 'cannot reach mattmahoney.net', 'expected text8',
               'TFDS download', 'manual_dir=DIR', 'text8.zip'):
    assert part in message


@pytest.mark.parametrize('name,content,match', [
    ('wiki.valid.tokens', b'', 'is empty'),
    ('wiki.valid.tokens', b' \n = T = \n the end', 'truncated'),
    ('wiki.valid.tokens', b'just some text\nwithout titles\n', 'not a WikiText file'),
])
def test_bad_wikitext_file_is_named(tmp_path, name, content, match):
  data_fixtures.tiny_wikitext(tmp_path / 'raw')
  (tmp_path / 'raw' / name).write_bytes(content)
  with pytest.raises(DataError, match=f"'wikitext2'.*{name}.* {match}"):
    data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')


def test_bad_text8_and_enwik8_files(tmp_path):
  data_fixtures.write_text8(tmp_path / 't8', 'Not Lowercase text')
  with pytest.raises(DataError, match="'text8'.*'N'.*only lowercase"):
    data.load_corpus('text8', tmp_path / 'data', tmp_path / 't8')
  data_fixtures.write_enwik8(tmp_path / 'e8', b'<html>' + b'x' * 100)
  with pytest.raises(DataError, match="'enwik8'.*not an XML dump"):
    data.load_corpus('enwik8', tmp_path / 'data', tmp_path / 'e8')


# The stats CLI.

def _run_cli(*flags):
  return subprocess.run([sys.executable, '-m', 'allatt_jax.data', *flags],
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '3'})


def test_cli_prints_stats_json(tmp_path):
  data_fixtures.write_text8(tmp_path / 'raw', data_fixtures.sample_text8(2000))
  data.load_corpus('text8', tmp_path / 'data', tmp_path / 'raw')  # CLI reads the cache
  result = _run_cli('--dataset=text8', f'--manual_dir={tmp_path / "raw"}',
                    f'--data_dir={tmp_path / "data"}')
  assert result.returncode == 0, result.stderr
  stats = json.loads(result.stdout)
  assert stats['vocab_size'] == 27 and stats['level'] == 'char'
  assert stats['metric'] == 'bpc'
  assert stats['num_tokens'] == {'train': 1800, 'valid': 100, 'test': 100}


def test_cli_reports_data_errors_without_traceback(tmp_path):
  result = _run_cli('--dataset=enwik8', f'--manual_dir={tmp_path}')
  assert result.returncode == 2   # bad input, as for every command
  assert "Dataset 'enwik8' not found" in result.stderr
  assert 'Traceback' not in result.stderr


def test_all_datasets_are_registered_with_tfds():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  assert set(data.DATASETS) <= set(tfds.list_builders(with_community_datasets=False))
  assert tfds_builders.BUILDERS['text8'].url_infos is not None  # checksums.tsv is found
