"""Datasets: tokenisation, the TFDS builder and its prepared ids, errors, the CLI."""
import dataclasses
import hashlib
import json
import logging
import lzma
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request

import numpy as np
import pytest

import data_fixtures
from helpers import fresh_python_prints
from allatt_jax import data
from allatt_jax.data import embedded
from allatt_jax.data import encoding
from allatt_jax.data import specs
from allatt_jax.data import builder
from allatt_jax.data import cache
from allatt_jax.data import sources
from allatt_jax.data import tokenization
from allatt_jax.config.errors import DataError

SHARED = data_fixtures.SHARED_DATA
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f'{SHARED} not present')


@pytest.fixture
def tfds_prepares(monkeypatch):
  """Names of the datasets TFDS is asked to prepare (it still does)."""
  calls = []
  real_prepare = builder.prepare

  def recording_prepare(spec, *args):
    calls.append(spec.name)
    return real_prepare(spec, *args)

  monkeypatch.setattr(builder, 'prepare', recording_prepare)
  return calls


# Tokenisation.

def test_word_vocab_is_by_frequency_ties_by_first_occurrence():
  vocab, ids = tokenization.encode_train([['b a c', ''], ['c b d']])
  # counts: b 2, c 2, <eos> 3, a 1, d 1; b appears before c, a before d.
  assert vocab == ('<eos>', 'b', 'c', 'a', 'd')
  assert ids.tolist() == [1, 3, 2, 0, 0, 2, 1, 4, 0]
  assert ids.dtype == np.int32


def test_rare_words_become_unk_but_eos_stays_and_existing_unks_are_not_counted_as_cut():
  """A corpus that already holds <unk> (as WikiText does): the words cut are the rare
  ones only; <eos> stays however rare (here 2 lines, min_count 3)."""
  vocab, ids = tokenization.encode_train([['a a <unk> b a', 'a c <unk> a']])
  vocab, ids, cut = tokenization.limit_vocab(vocab, ids, min_count=3)
  # counts: a 5, <unk> 2 + the 2 cut (b, c), <eos> 2.
  assert vocab == ('a', '<unk>', '<eos>')
  assert cut == 2
  assert ids.tolist() == [0, 0, 1, 1, 0, 2, 0, 1, 1, 0, 2]


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
  # Train and valid round down; test takes the rest.
  assert specs.TEXT8.split_sizes(1019)[0] == (917, 50, 52)
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
  leftovers = [p.name for p in (tmp_path / 'data' / 'allatt_text' / 'wikitext2').iterdir()]
  assert leftovers == ['1.0.0']


def test_changed_source_file_rebuilds_the_prepared_dataset(tmp_path, tfds_prepares):
  splits = data_fixtures.tiny_wikitext(tmp_path / 'raw')
  before = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  splits['valid'] = data_fixtures.wikitext_article('Birds', ['the dog sat .'])
  data_fixtures.write_wikitext(tmp_path / 'raw', splits)
  after = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert tfds_prepares == ['wikitext2', 'wikitext2']
  assert len(after.splits['valid']) != len(before.splits['valid'])
  assert after.splits['valid'].tolist() == data_fixtures.expected_word_ids(
      splits['valid'], after.vocab)


def test_cache_from_other_settings_is_not_reused(tmp_path, tfds_prepares):
  data_fixtures.tiny_wikitext(tmp_path / 'raw')
  data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  metadata_file = cache.dataset_dir(tmp_path / 'data', 'wikitext2') / 'metadata.json'
  metadata = json.loads(metadata_file.read_text())
  metadata['settings']['encoding_version'] -= 1
  metadata_file.write_text(json.dumps(metadata))
  np.save(metadata_file.parent / 'valid.npy', np.zeros(3, np.int32))
  rebuilt = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert tfds_prepares == ['wikitext2', 'wikitext2']
  assert len(rebuilt.splits['valid']) > 3
  assert json.loads(metadata_file.read_text())['settings']['encoding_version'] == (
      metadata['settings']['encoding_version'] + 1)


def test_failed_cache_write_leaves_old_cache_and_no_partial_one(tmp_path, monkeypatch):
  splits = data_fixtures.tiny_wikitext(tmp_path / 'raw')
  before = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  cache_dir = cache.dataset_dir(tmp_path / 'data', 'wikitext2')
  old_fingerprint = (cache_dir / 'metadata.json').read_text()
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
  assert (cache_dir / 'metadata.json').read_text() == old_fingerprint
  np.testing.assert_array_equal(np.load(cache_dir / 'train.npy'), before.splits['train'])
  assert [p.name for p in cache_dir.parent.iterdir()] == ['1.0.0']


def test_a_folder_set_aside_goes_also_when_its_rebuild_fails_after_making_the_new_one(
    tmp_path):
  folder = tmp_path / '1.0.0'
  folder.mkdir()
  (folder / 'train.npy').write_text('old')
  with pytest.raises(OSError, match='late'):
    with cache.set_aside(folder):
      folder.mkdir()
      (folder / 'train.npy').write_text('new')
      raise OSError('late')
  assert [p.name for p in tmp_path.iterdir()] == ['1.0.0']
  assert (folder / 'train.npy').read_text() == 'new'


def test_dataset_prepared_meanwhile_by_another_process_is_used(tmp_path, monkeypatch, caplog):
  caplog.set_level(logging.INFO)
  data_fixtures.tiny_wikitext(tmp_path / 'raw')
  real_prepare = builder.AllattText._download_and_prepare
  others = []

  def another_process_first(self, **kwargs):
    monkeypatch.setattr(builder.AllattText, '_download_and_prepare', real_prepare)
    # Another process of the run finishes the same dataset first.
    others.append(data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw'))
    return real_prepare(self, **kwargs)

  monkeypatch.setattr(builder.AllattText, '_download_and_prepare', another_process_first)
  corpus = data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert len(others) == 1 and corpus.vocab == others[0].vocab
  assert 'prepared concurrently; using that one' in caplog.text
  np.testing.assert_array_equal(corpus.splits['train'], others[0].splits['train'])
  assert [p.name for p in (tmp_path / 'data' / 'allatt_text' / 'wikitext2').iterdir()] == [
      '1.0.0']


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


def test_the_embedded_corpus_is_valid_then_test_cleaned_on_one_line(tmp_path):
  with pytest.raises(DataError, match=r'^wiki\.valid\.raw, wiki\.test\.raw missing in '):
    embedded.make_embedded_corpus(tmp_path)
  (tmp_path / 'wiki.valid.raw').write_text(' = Café = \n In 1984 \n', encoding='utf-8')
  (tmp_path / 'wiki.test.raw').write_text('\n The B-52s !\n', encoding='utf-8')
  made = embedded.make_embedded_corpus(tmp_path, tmp_path / 'c.xz')
  assert lzma.decompress(made.read_bytes()) == b'cafe in one nine eight four the b five two s'


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
    # Cut from the middle of an article: a section heading is not a title.
    ('wiki.valid.tokens', b' = = History = = \n the end .\n', 'not a WikiText file'),
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
  data_fixtures.write_text8(tmp_path / 't8', 'text in\ntwo lines')   # text8 is one line
  with pytest.raises(DataError, match="'text8'.*only lowercase a-z and spaces"):
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


@pytest.mark.slow
def test_cli_help_describes_its_flags():
  result = _run_cli('--help')
  assert 'Traceback' not in result.stderr
  assert 'allatt_text/<dataset>/1.0.0' in result.stdout
  for flag, words in (('dataset', 'wikitext103|wikitext2'), ('manual_dir', 'official files'),
                      ('data_dir', 'TFDS data folder'), ('level', 'word, char or byte'),
                      ('files', 'train,valid,test'), ('min_count', 'rarer train words'),
                      ('max_vocab', 'at most this many'), ('clean', 'text8'),
                      ('make_embedded_corpus_from', 'wikitext_chars')):
    assert f'--{flag}:' in result.stdout and words in result.stdout


@pytest.mark.slow
def test_cli_reports_data_errors_without_traceback(tmp_path):
  result = _run_cli('--dataset=enwik8', f'--manual_dir={tmp_path}')
  assert result.returncode == 2   # bad input, as for every command
  assert "Dataset 'enwik8' not found" in result.stderr
  assert 'Traceback' not in result.stderr


def test_one_builder_with_one_config_per_dataset_registered_with_tfds(tmp_path):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  assert 'allatt_text' in tfds.list_builders(with_community_datasets=False)
  assert [config.name for config in builder.AllattText.BUILDER_CONFIGS] == list(data.DATASETS)
  assert builder.AllattText.url_infos is not None  # checksums.tsv is found
  for name in data.DATASETS:
    found = tfds.builder(f'allatt_text/{name}', data_dir=tmp_path)
    assert found.builder_config.spec == specs.get_spec(name)
    assert found.data_path == cache.dataset_dir(tmp_path, name)
  # The TFDS way gives the ids a run reads.
  found = tfds.builder('allatt_text/wikitext_chars', data_dir=tmp_path)
  found.download_and_prepare()
  corpus = data.load_corpus('wikitext_chars', tmp_path)
  valid = corpus.splits['valid']
  assert found.info.splits['valid'].num_examples == valid.size
  assert int(found.info.splits['valid'].num_bytes) == 4 * valid.size   # int32 ids
  # The whole split, over more than one of the chunks it is read in.
  assert valid.size > builder._AS_DATASET_CHUNK
  ids = tfds.as_numpy(found.as_dataset(split='valid', batch_size=-1))['ids']
  np.testing.assert_array_equal(ids, valid)
  with pytest.raises(ValueError, match="Split 'validation': choose one of train, valid"):
    found.as_dataset(split='validation')


def test_preparing_a_dataset_leaves_no_temporary_folder(tmp_path, monkeypatch):
  temporary = tmp_path / 'tmp'
  temporary.mkdir()
  monkeypatch.setattr(tempfile, 'tempdir', str(temporary))
  raw = data_fixtures.write_text_files(tmp_path / 'raw', ['a b c\n', 'a b\n', 'b c\n'])
  corpus = data.load_corpus('text_files', str(tmp_path / 'data'), str(raw))
  assert corpus.vocab and (tmp_path / 'data' / 'allatt_text').is_dir()
  assert not list(temporary.iterdir())


def test_the_tfds_way_checks_the_files_of_a_manual_folder(tmp_path):
  """`tfds.builder(...).download_and_prepare` with a manual folder, as `tfds build`
  does it, refuses a bad file as load_corpus does; a text_files folder without the
  files is named, not taken for no folder."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  data_fixtures.tiny_wikitext(tmp_path / 'raw')
  (tmp_path / 'raw' / 'wiki.valid.tokens').write_bytes(b'')
  manual = tfds.download.DownloadConfig(manual_dir=str(tmp_path / 'raw'))
  found = tfds.builder('allatt_text/wikitext2', data_dir=tmp_path / 'data')
  with pytest.raises(DataError, match=r"'wikitext2'.*wiki.valid.tokens is empty"):
    found.download_and_prepare(download_config=manual)
  found = tfds.builder('allatt_text/text_files', data_dir=tmp_path / 'data')
  with pytest.raises(DataError, match=r'train.txt, valid.txt, test.txt missing in'):
    found.download_and_prepare(download_config=manual)


# One copy of the encoded corpus: sources hashed once, later loads read only it.

@pytest.fixture
def sha256_calls(monkeypatch):
  """How many SHA-256 digests the process starts (it still computes them)."""
  calls = []
  real_sha256 = hashlib.sha256

  def counting_sha256(*args, **kwargs):
    calls.append(args)
    return real_sha256(*args, **kwargs)

  monkeypatch.setattr(hashlib, 'sha256', counting_sha256)
  return calls


def test_first_build_hashes_each_source_file_once(tmp_path, sha256_calls):
  data_fixtures.tiny_wikitext(tmp_path / 'raw')
  data.load_corpus('wikitext2', tmp_path / 'data', tmp_path / 'raw')
  assert len(sha256_calls) == 3            # train, valid, test
  data.load_corpus('wikitext_chars', tmp_path / 'data')
  assert len(sha256_calls) == 4            # the one shipped file


def test_second_load_reads_only_the_prepared_arrays(tmp_path):
  data.load_corpus('wikitext_chars', tmp_path / 'data')
  code = ('import sys; from allatt_jax.data import corpus; '
          "loaded = corpus.load_corpus('wikitext_chars', sys.argv[1]); "
          "print(type(loaded.splits['train']).__name__, "
          "'tensorflow' in sys.modules, 'tensorflow_datasets' in sys.modules)")
  assert fresh_python_prints(code, tmp_path / 'data') == ['memmap', 'False', 'False']


def test_preparing_a_dataset_needs_no_tensorflow(tmp_path):
  """TensorFlow takes seconds to import; only the builder's tf.data view needs it."""
  raw = data_fixtures.write_text_files(tmp_path / 'raw', ['the cat sat\n'] * 3)
  code = ('import sys; from allatt_jax.data import corpus; '
          "loaded = corpus.load_corpus('text_files', sys.argv[1], sys.argv[2]); "
          "print(len(loaded.vocab), 'tensorflow' in sys.modules)")
  assert fresh_python_prints(code, tmp_path / 'data', raw) == ['5', 'False']


@pytest.fixture
def encodings(monkeypatch):
  """Names of the word-level datasets encoded (they still are)."""
  calls = []
  real_encode = encoding.encode_lines
  monkeypatch.setattr(encoding, 'encode_lines',
                      lambda spec, *args: calls.append(spec.name) or real_encode(spec, *args))
  return calls


def _write_earlier_layout(data_dir, name, corpus, source_files):
  """What an earlier allatt_jax left after preparing `name`: TFDS records of the raw
  text in <name>/1.0.0, the ids in allatt_encoded/<name>/, downloads/ from TFDS."""
  records = data_dir / name / '1.0.0'
  records.mkdir(parents=True)
  (records / 'dataset_info.json').write_text('{}')
  (data_dir / 'downloads' / name).mkdir(parents=True)
  (data_dir / 'downloads' / name / 'archive.zip').write_bytes(b'the only copy')
  encoded = data_dir / 'allatt_encoded' / name
  encoded.mkdir(parents=True)
  for split, ids in corpus.splits.items():
    np.save(encoded / f'{split}.npy', np.asarray(ids))
  (encoded / 'vocab.json').write_text(json.dumps(list(corpus.vocab)))
  (encoded / 'fingerprint.json').write_text(json.dumps(
      {**encoding.settings(specs.get_spec(name)), 'split_rule': corpus.split_rule,
       'source_files': source_files}))
  return [encoded, records, data_dir / 'downloads' / name / 'archive.zip']


def test_earlier_layout_is_taken_over_or_encoded_again(tmp_path, encodings, caplog):
  splits = data_fixtures.tiny_wikitext(tmp_path / 'raw')
  expected = data.load_corpus('wikitext2', tmp_path / 'new', tmp_path / 'raw')
  source_files = sources.fingerprint(sources.locate(specs.WIKITEXT2, tmp_path / 'raw'))
  earlier = _write_earlier_layout(tmp_path / 'old', 'wikitext2', expected, source_files)
  assert encodings == ['wikitext2']
  taken = data.load_corpus('wikitext2', tmp_path / 'old', tmp_path / 'raw')
  assert encodings == ['wikitext2']        # the earlier ids are used, not encoded again
  assert taken.vocab == expected.vocab and taken.split_rule == 'official'
  for split in specs.SPLITS:
    np.testing.assert_array_equal(taken.splits[split], expected.splits[split])
  messages = [r.getMessage() for r in caplog.records if 'earlier allatt_jax' in r.getMessage()]
  assert len(messages) == 1 and 'taking over its encoded ids' in messages[0]
  assert all(path.exists() for path in earlier)   # nothing deleted
  # Made from other files: encoded again from the sources, with one line saying so.
  caplog.clear()
  splits['test'] = data_fixtures.wikitext_article('Fish', ['a dog .'])
  data_fixtures.write_wikitext(tmp_path / 'raw', splits)
  shutil.rmtree(cache.dataset_dir(tmp_path / 'old', 'wikitext2'))
  rebuilt = data.load_corpus('wikitext2', tmp_path / 'old', tmp_path / 'raw')
  assert encodings == ['wikitext2', 'wikitext2']
  assert rebuilt.splits['test'].tolist() == data_fixtures.expected_word_ids(
      splits['test'], rebuilt.vocab)
  messages = [r.getMessage() for r in caplog.records if 'earlier allatt_jax' in r.getMessage()]
  assert len(messages) == 1 and 'encoding it again' in messages[0]
  assert all(path.exists() for path in earlier)


@pytest.mark.parametrize('official_lines, warned', [(4, False), (5, True)])
def test_word_splits_count_their_lines_over_every_batch(caplog, official_lines, warned):
  """Lines and unknown words are counted over all of a split's batches, and only a
  train file of another length than the official one is warned about."""
  caplog.set_level(logging.INFO)
  lines = {'train': [[b'a b', b'b <unk>'], [b'a', b'c a']], 'valid': [[b'a x'], [b'y b']],
           'test': [[b'c']]}
  spec = dataclasses.replace(specs.WIKITEXT2, official_train_lines=official_lines)
  vocab, splits = encoding.encode_lines(spec, lambda split: iter(lines[split]))
  assert vocab[:3] == ('<eos>', 'a', 'b') and len(splits['valid']) == 6
  assert "Dataset 'wikitext2' train: 4 lines, 11 tokens, 0 words" in caplog.text
  assert "Dataset 'wikitext2' valid: 2 lines, 6 tokens, 2 words not in the vocabulary" in (
      caplog.text)
  assert ('train has 4 lines, the official file 5' in caplog.text) == warned
