"""Your own text (text_files), Penn Treebank and One Billion Word, on corpora written here."""
import dataclasses
import hashlib
import json
import logging
import pathlib
import socket
import types
import urllib.request

import numpy as np
import pytest

from data_fixtures import write_text_files
from helpers import run_pipeline
from allatt_jax.model import adaptive
from allatt_jax.config import config_base
from allatt_jax.training import config_checks
from allatt_jax.evaluation import likelihood
from allatt_jax.model import transformer as model_lib
from allatt_jax.training import assembly
from allatt_jax.pruning import cost_model
from allatt_jax.runs import run_files
from allatt_jax.runs import trained_model
from allatt_jax.runs import workdir_checks
from allatt_jax.data import corpus as corpus_lib
from allatt_jax.data import encoding
from allatt_jax.data import specs
from allatt_jax.data import builder
from allatt_jax.data import cache
from allatt_jax.data import lm1b
from allatt_jax.data import sources
from allatt_jax.config.errors import DataError
from allatt_jax.config import run_config
from allatt_jax.config.run_config import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = 'the cat sat on the mat\nthe dog sat\n\na cat ran\n'
VALID = 'the bird sat\nthe cat\n'
TEST = 'a fish ran on\n'


def load(tmp_path, texts=(TRAIN, VALID, TEST), **options):
  raw = write_text_files(tmp_path / 'raw', texts)
  return corpus_lib.load_corpus('text_files', str(tmp_path / 'data'), str(raw), **options)


def words(corpus, split):
  return [corpus.vocab[i] for i in corpus.splits[split]]


@pytest.fixture
def tfds_prepares(monkeypatch):
  """Names of the datasets TFDS is asked to prepare (it still does)."""
  calls = []
  real_prepare = builder.prepare
  monkeypatch.setattr(builder, 'prepare',
                      lambda spec, *args: calls.append(spec.name) or real_prepare(spec, *args))
  return calls


# Word level.

def test_word_vocabulary_counts_and_unknown_words(tmp_path):
  corpus = load(tmp_path)
  # train counts: <eos> 4, the 3, cat 2, sat 2, then the rest once in order of appearance;
  # <unk> is added for the words of valid/test outside the vocabulary.
  assert corpus.vocab == ('<eos>', 'the', 'cat', 'sat', 'on', 'mat', 'dog', 'a', 'ran',
                          '<unk>')
  assert words(corpus, 'train') == ('the cat sat on the mat <eos> the dog sat <eos> <eos> '
                                    'a cat ran <eos>').split()
  assert words(corpus, 'valid') == 'the <unk> sat <eos> the cat <eos>'.split()
  assert words(corpus, 'test') == 'a <unk> ran on <eos>'.split()
  assert corpus.metric == 'ppl' and corpus.split_rule == 'one file per split'


def test_min_count_and_max_vocab_map_rare_words_to_unk(tmp_path):
  corpus = load(tmp_path / 'a', min_count=2)
  # Seen once: on, mat, dog, a, ran (5 words) -> <unk>, now the second most frequent.
  assert corpus.vocab == ('<unk>', '<eos>', 'the', 'cat', 'sat')
  assert words(corpus, 'train')[:7] == 'the cat sat <unk> the <unk> <eos>'.split()
  capped = load(tmp_path / 'b', max_vocab=4)   # <eos>, <unk> and the two most frequent
  assert capped.vocab == ('<unk>', '<eos>', 'the', 'cat')
  assert words(capped, 'test') == '<unk> <unk> <unk> <unk> <eos>'.split()


def test_unk_in_the_text_is_a_word(tmp_path):
  corpus = load(tmp_path, (' a <unk> b \n <unk> a \n', ' a c \n', ' b \n'))
  # a, <unk> and <eos> twice each: first appearance decides, <unk> after its ties.
  assert corpus.vocab == ('a', '<eos>', '<unk>', 'b')
  assert words(corpus, 'valid') == ['a', '<unk>', '<eos>']


def test_other_file_names(tmp_path):
  raw = write_text_files(tmp_path / 'raw', (TRAIN, VALID, TEST), ('a.txt', 'b.txt', 'c.txt'))
  corpus = corpus_lib.load_corpus('text_files', str(tmp_path / 'data'), str(raw),
                                  files='a.txt, b.txt, c.txt')
  assert corpus.splits['test'].size == 5


# Character and byte level.

def test_characters_as_they_are(tmp_path):
  corpus = load(tmp_path, ('Zürich\nab', 'ab\n', 'üZ'), level='char')
  assert corpus.vocab == ('\n', 'Z', 'a', 'b', 'c', 'h', 'i', 'r', 'ü')  # code-point order
  assert ''.join(words(corpus, 'train')) == 'Zürich\nab'
  assert corpus.splits['test'].tolist() == [8, 1]
  assert corpus.metric == 'bpc'
  ids, unknown = corpus.encode('Zaq')
  assert ids.tolist() == [1, 2] and unknown == 1


def test_characters_cleaned_text8_style(tmp_path):
  corpus = load(tmp_path, ('Café 42!', 'Ab\n', 'x'), level='char', clean='text8')
  assert len(corpus.vocab) == 27
  assert ''.join(words(corpus, 'train')) == 'cafe four two'
  assert ''.join(words(corpus, 'valid')) == 'ab'


def test_bytes(tmp_path):
  corpus = load(tmp_path, (b'\xff\x00ab', 'ü'.encode('utf-8'), b'z'), level='byte')
  assert corpus.vocab_size == 256
  assert corpus.splits['train'].tolist() == [255, 0, 97, 98]
  assert corpus.splits['valid'].tolist() == [0xC3, 0xBC]


# The cache.

def test_cache_reused_then_rebuilt_on_content_or_option_change(tmp_path, tfds_prepares):
  load(tmp_path)
  assert load(tmp_path).vocab_size == 10 and tfds_prepares == ['text_files']
  changed = load(tmp_path, (TRAIN + 'zebra\n', VALID, TEST))   # an edited file
  assert 'zebra' in changed.vocab and len(tfds_prepares) == 2
  chars = load(tmp_path, (TRAIN + 'zebra\n', VALID, TEST), level='char')  # an option
  assert chars.level == 'char' and len(tfds_prepares) == 3
  caches = sorted((tmp_path / 'data' / 'allatt_text').glob('text_files_*/1.0.0'))
  assert len(caches) == 2        # word and char, each with its own fingerprint
  # Where the data command's help (its docstring and --data_dir) says they go.
  data_command = (ROOT / 'allatt_jax' / 'data' / '__main__.py').read_text()
  assert data_command.count('text_files_<hash>/1.0.0') == 2
  fingerprints = [json.loads((c / 'metadata.json').read_text()) for c in caches]
  assert {f['settings']['options']['level'] for f in fingerprints} == {'word', 'char'}
  load(tmp_path, (TRAIN + 'zebra\n', VALID, TEST))   # back to word: nothing rebuilt
  assert len(tfds_prepares) == 3


def test_word_level_data_whose_train_split_never_holds_unk_warns(tmp_path, caplog):
  folder = write_text_files(tmp_path / 'text', ('the cat sat on the mat\n' * 40,
                                               'the dog sat on the rug\n' * 10,
                                               'the cat sat on the hat\n' * 10))
  config = config_base.load(ROOT / 'configs' / 'demo.py', 'tiny')
  config.data.update(dict(name='text_files', manual_dir=str(folder), level='word',
                          data_dir=str(tmp_path / 'tfds')))
  with caplog.at_level(logging.WARNING):
    assembly.completed_config(assembly.checked_config(config))
  [message] = [r.getMessage() for r in caplog.records if '<unk>' in r.getMessage()]
  assert ('<unk> never occurs in the train split but 20 times in valid and 10 in test'
          in message and '--config.data.min_count=2' in message)
  caplog.clear()
  config.data.min_count = 2          # 'on', 'mat' ... seen 40 times; none once
  (folder / 'train.txt').write_text('the cat sat on the mat\n' * 40 + 'a rare word\n')
  with caplog.at_level(logging.WARNING):
    assembly.completed_config(assembly.checked_config(config))
  assert not [r for r in caplog.records if '<unk>' in r.getMessage()]


def test_the_unk_rule_is_part_of_what_a_prepared_dataset_is_reused_for():
  # A release that changed whether a vocabulary gets <unk> must not read the ids
  # prepared under the other rule.
  spec = specs.resolve('text_files', level='word')
  assert spec.add_unk
  assert encoding.settings(spec) != encoding.settings(dataclasses.replace(spec, add_unk=False))


def test_preparing_names_the_folder_it_writes(tmp_path, caplog):
  with caplog.at_level(logging.INFO):
    load(tmp_path)
  folder = next((tmp_path / 'data' / 'allatt_text').glob('text_files_*/1.0.0'))
  [message] = [r.getMessage() for r in caplog.records if 'Preparing' in r.getMessage()]
  assert message.startswith(f"Preparing dataset 'text_files' into {folder}, in the TFDS "
                            f"data folder {tmp_path / 'data'} (a config's data.data_dir")


def test_a_run_cannot_resume_with_another_option_set(tmp_path):
  word = load(tmp_path)
  (tmp_path / 'run' / 'checkpoints').mkdir(parents=True)
  run_files.save_vocabulary(tmp_path / 'run', run_files.vocabulary_fingerprint(
      word.name, word.vocab))
  capped = load(tmp_path, max_vocab=4)
  with pytest.raises(DataError, match="vocabulary of dataset 'text_files' .* is not the one"):
    workdir_checks.check_vocabulary(run_files.vocabulary_fingerprint(
        capped.name, capped.vocab), tmp_path / 'init', init_from=str(tmp_path / 'run'),
        resuming=False)
  assert (tmp_path / 'run' / 'vocabulary.json').is_file()   # nothing deleted


# Errors, before any work.

def test_missing_split_file_is_named_with_its_folder(tmp_path):
  raw = write_text_files(tmp_path / 'raw', (TRAIN, VALID))
  with pytest.raises(DataError, match=f'test.txt missing in {raw}.*data.files'):
    corpus_lib.load_corpus('text_files', str(tmp_path / 'data'), str(raw))
  with pytest.raises(DataError, match='no folder given.*manual_dir'):
    corpus_lib.load_corpus('text_files', str(tmp_path / 'data'))


def test_empty_file(tmp_path):
  with pytest.raises(DataError, match=r'valid.txt is empty'):
    load(tmp_path, (TRAIN, '', TEST))


def test_non_utf8_names_the_byte_offset_and_suggests_bytes(tmp_path):
  bad = 'x' * 70_000 + 'é'
  data = bad.encode('utf-8')[:-1] + b'\n'   # 'é' cut after its first byte
  with pytest.raises(DataError, match=r'train.txt is not UTF-8 text: byte offset 70,000 '
                     r".*--config.data.level=byte"):
    load(tmp_path, (data, VALID, TEST), level='char')
  assert load(tmp_path, (data, VALID, TEST), level='byte').splits['train'].size == 70_002


def test_the_offset_of_a_bad_byte_counts_a_character_split_between_reads(tmp_path,
                                                                          monkeypatch):
  # Read 4,096 bytes at a time, the first read ends inside 'é' (bytes 4,095-4,096),
  # which the decoder holds back into the second; the bad byte is at 4,197.
  monkeypatch.setattr(sources, '_HASH_BLOCK', 4096)
  data = ('x' * 4095 + 'é' + 'x' * 100).encode('utf-8') + b'\xc3\n'
  with pytest.raises(DataError, match=r'byte offset 4,197 '):
    load(tmp_path, (data, VALID, TEST), level='char')


def test_characters_over_max_vocab_are_refused_and_up_to_it_kept(tmp_path):
  # Characters have no <unk> to map the rest to.
  texts = ('abc', 'ab', 'ca')
  with pytest.raises(DataError, match=r'the text has 3 different characters, more than '
                     r'data.max_vocab=2'):
    load(tmp_path / 'over', texts, level='char', max_vocab=2)
  assert load(tmp_path / 'at', texts, level='char', max_vocab=3).vocab == ('a', 'b', 'c')


@pytest.mark.parametrize('name, options, match', [
    ('text_files', dict(level='byte', max_vocab=100), 'bytes have no <unk>'),
    ('text_files', dict(level='word', max_vocab=1), 'at least 2'),
    ('text_files', dict(level='chars'), "level='chars' is not one of"),
    ('text_files', dict(level='char', min_count=2), 'word level only'),
    ('text_files', dict(clean='text8'), 'char level only'),
    ('text_files', dict(files='a.txt,b.txt'), 'three different files'),
    ('text_files', dict(files='a.txt,a.txt,b.txt'), 'three different files'),
    ('ptb', dict(level='char'), "only applies to dataset 'text_files'"),
    ('text8', dict(clean='text8'), r"--config.data.clean='text8' only applies to dataset "
     "'text_files'"),
])
def test_bad_options_fail_with_the_config_check(name, options, match):
  config = config_base.base_config()
  config.data.update(dict(name=name, **options))
  with pytest.raises(DataError, match=match):
    config_checks._check_names(RunConfig.of(config))  # pylint: disable=protected-access


def test_split_shorter_than_an_evaluation_segment(tmp_path):
  config = config_base.base_config()
  config.data.update(dict(name='text_files', data_dir=str(tmp_path / 'data'),
                          manual_dir=str(write_text_files(tmp_path / 'raw', (TRAIN, VALID, TEST)))))
  config.eval.seq_len = 5
  with pytest.raises(DataError, match=r'test split has 5 tokens, fewer than one evaluation '
                     r'segment \(config.eval.seq_len \+ 1 = 6\)'):
    corpus_lib.load_run_corpus(config)
  config.eval.seq_len = 4
  assert corpus_lib.load_run_corpus(config).splits['test'].size == 5


# Adaptive cutoffs.

def test_cutoffs_follow_the_vocabulary_when_not_given():
  assert adaptive.default_cutoffs('lm1b', 793_471) == (60_000, 100_000, 640_000)
  assert adaptive.default_cutoffs('wikitext103', 267_735) == (20_000, 40_000, 200_000)
  # Published cutoffs that do not fit the vocabulary give way to its fractions.
  assert adaptive.default_cutoffs('wikitext103', 100_000) == (7_500, 15_000, 75_000)
  assert adaptive.default_cutoffs('text_files', 10_000) == (750, 1500, 7500)
  assert adaptive.default_cutoffs('text_files', 5) == ()
  config = config_base.base_config()
  config.data.name = 'text_files'
  config.model.update(dict(vocab_size=10_000, div_val=2))
  assert model_lib.ModelConfig.from_config(config).cutoffs == (750, 1500, 7500)
  config.model.cutoffs = (100,)
  assert model_lib.ModelConfig.from_config(config).cutoffs == (100,)


def word_level_demo(vocab_size, **model):
  """configs/demo.py's baseline (4 layers of 8 heads, d=128) on own text at word level,
  completed with a vocabulary of `vocab_size`."""
  config = config_base.load(ROOT / 'configs' / 'demo.py')
  config.data.update(dict(name='text_files', level='word'))
  config.model.update(dict(vocab_size=vocab_size, **model))
  return RunConfig.of(config)


def head_cluster_corpus(run):
  """A dataset of the run's vocabulary whose train split holds only the first 1,000
  ids, all in an adaptive softmax's head cluster."""
  return types.SimpleNamespace(vocab_size=run.model.vocab_size,
                               splits={'train': np.arange(2000) % 1000})


def test_own_words_get_an_adaptive_softmax_where_a_plain_one_costs_more_than_the_layers():
  # 33,278 types (WikiText-2's): the plain softmax, 4.3M MACs a token, is 7.5x the layers.
  run = word_level_demo(33_278)
  assert assembly.word_output(run) == dict(cutoffs=(2496, 4992, 24958), div_val=4)
  # The train split's tokens, all in the head cluster, size the tail capacities.
  completed, cfg, note = assembly.complete(run, head_cluster_corpus(run))
  assert (completed.model.cutoffs, completed.model.div_val) == ((2496, 4992, 24958), 4)
  assert completed.model.cluster_fractions == (1.0, 0.0, 0.0, 0.0)
  # The model returned is the one the completed config builds (as a resumed run does).
  assert cfg == model_lib.ModelConfig.from_config(completed)
  # The adaptive input's projections, d_i x d for d_i = 128, 32, 8, 2, beside the softmax.
  assert cost_model.input_macs_per_token(cfg) == 170 * 128
  adaptive_macs = 170 * 128 + cost_model.output_macs_per_token(
      cfg, completed.train.batch_size * completed.train.seq_len)
  assert note.startswith('Word level, 33,278 types: an adaptive input and softmax (cutoffs '
                         f'2496, 4992, 24958; div_val 4) cost {adaptive_macs / 1e6:.2f}M '
                         'MACs per token, where a plain softmax would cost 4.26M, 7.5x the '
                         '0.57M of all the layers')
  assert '--config.model.auto_cutoffs=False' in note
  assert assembly.with_vocab_size(run).model.cutoffs == (2496, 4992, 24958)
  # Where the plain softmax is the smaller part, or not asked for, nothing changes.
  for other in (word_level_demo(2_000), word_level_demo(33_278, auto_cutoffs=False),
                word_level_demo(33_278, cutoffs=(1000,)),
                word_level_demo(33_278, div_val=2)):
    assert assembly.word_output(other) == {}
    completed, cfg, note = assembly.complete(other, head_cluster_corpus(other))
    assert note == '' and cfg == model_lib.ModelConfig.from_config(completed)
  words = word_level_demo(33_278)
  characters = RunConfig.from_dict({**words.to_dict(),
                                    'data': {**words.data.to_dict(), 'level': 'char'}})
  assert assembly.word_output(characters) == {}
  # The level left unset is words, text_files' default.
  unset = RunConfig.from_dict({**words.to_dict(), 'data': {**words.data.to_dict(), 'level': ''}})
  assert assembly.word_output(unset) == assembly.word_output(words)
  # Cluster shares a config sets are its own: the train split does not replace them.
  shares = (0.7, 0.1, 0.1, 0.1)
  own = word_level_demo(33_278, cutoffs=(2496, 4992, 24958), div_val=4,
                        cluster_fractions=shares)
  completed, cfg, _ = assembly.complete(own, head_cluster_corpus(own))
  assert completed.model.cluster_fractions == cfg.cluster_fractions == shares
  # A model too narrow for width d/64 in the last cluster gets d/8 there.
  narrow = word_level_demo(33_278, d_model=32, num_heads=4, num_layers=1)
  assert assembly.word_output(narrow)['div_val'] == 2


def test_a_size_budget_on_own_words_measures_the_layers_beside_an_adaptive_softmax():
  # The budget counts no vocabulary, so the completed model (adaptive, with its cluster
  # shares) is measured as the plain one, whose layers are the same.
  for key in ('target_params', 'target_macs'):
    adaptive, plain = (run_config.pruning_stage(word_level_demo(33_278, **model), 'base',
                                                gates={key: 0.5})
                       for model in ({}, dict(auto_cutoffs=False)))
    (run, cfg, _), (plain_run, plain_cfg, _) = (
        assembly.complete(r, head_cluster_corpus(r)) for r in (adaptive, plain))
    assert cfg.cutoffs and cfg.cluster_fractions and not plain_cfg.cutoffs
    unpruned = cost_model.unpruned_cost(plain_run, plain_cfg)
    assert cost_model.unpruned_cost(run, cfg) == unpruned
    assert cost_model.budget_note(run, cfg) == cost_model.budget_note(plain_run, plain_cfg)


def test_a_run_saved_before_the_automatic_cutoffs_keeps_its_plain_softmax(tmp_path):
  run = word_level_demo(33_278)
  saved = run.to_dict()
  del saved['model']['auto_cutoffs']
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  loaded = run_files.load_config(tmp_path)
  assert not loaded.model.auto_cutoffs and loaded.model.cutoffs == ()
  assert model_lib.ModelConfig.from_config(loaded).cutoffs == ()


# Penn Treebank: the official files cannot be fetched here, so the counting rule is
# checked on lines in their format (leading space, <unk> in the text, N for numbers).

def test_ptb_counts_words_plus_one_eos_per_line(tmp_path, caplog):
  lines = {'train': [' aer banknote <unk> N \n', ' the <unk> company \n'] * 3,
           'valid': [' the N company \n'], 'test': [' <unk> aer \n', ' the \n']}
  raw = tmp_path / 'raw'
  raw.mkdir()
  for split, name in zip(specs.SPLITS, specs.PTB.files):
    (raw / name).write_text(''.join(lines[split]))
  corpus = corpus_lib.load_corpus('ptb', str(tmp_path / 'data'), str(raw))
  num_words = {split: sum(len(line.split()) for line in lines[split]) for split in lines}
  assert {split: ids.size for split, ids in corpus.splits.items()} == {
      split: num_words[split] + len(lines[split]) for split in lines}
  # <unk> and <eos> 6 times each (<unk> seen first), then the words 3 times each.
  assert corpus.vocab[:3] == ('<unk>', '<eos>', 'aer')
  assert len(corpus.vocab) == 7
  for name in specs.PTB.files:
    assert f"'ptb': {name} differs from the official file" in caplog.text


def test_ptb_official_figures_and_checksums_are_recorded():
  assert specs.PTB.official_train_lines == 42_068
  assert specs.PTB.files == ('ptb.train.txt', 'ptb.valid.txt', 'ptb.test.txt')
  assert specs.PTB.archive_folder == 'simple-examples/data'
  md5 = hashlib.md5(b'').hexdigest()
  assert md5 not in specs.PTB.official_md5.values()
  assert len(specs.PTB.official_md5) == 3


# One Billion Word through TFDS's own builder, on a tiny archive in its layout.

def test_lm1b_through_tfds_builder(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  top = tmp_path / 'extracted' / '1-billion-word-language-modeling-benchmark-r13output'
  train_dir = top / 'training-monolingual.tokenized.shuffled'
  heldout_dir = top / 'heldout-monolingual.tokenized.shuffled'
  train_dir.mkdir(parents=True)
  heldout_dir.mkdir(parents=True)
  train = ['the cat sat .', 'the dog sat .', 'a cat ran .', 'the rare bird sat .']
  (train_dir / 'news.en-00001-of-00100').write_text('\n'.join(train[:2]) + '\n')
  (train_dir / 'news.en-00002-of-00100').write_text('\n'.join(train[2:]) + '\n')
  heldout = ['the cat .', 'a fish sat .', 'the dog .', 'the cat ran .']
  (heldout_dir / 'news.en.heldout-00000-of-00050').write_text('\n'.join(heldout) + '\n')
  monkeypatch.setattr(tfds.download.DownloadManager, 'download_and_extract',
                      lambda self, url: tmp_path / 'extracted')
  monkeypatch.setattr(sources, 'check_reachable', lambda spec: None)
  # Sentences read one at a time: the cut between valid and test falls between reads.
  monkeypatch.setattr(lm1b, '_READ_BATCH', 1)

  corpus = corpus_lib.load_corpus('lm1b', str(tmp_path / 'data'))
  # Seen 3 times or more: . 4, <eos> 4, the 3, sat 3; the 7 others -> <unk>.
  assert corpus.vocab == ('<unk>', '.', '<eos>', 'the', 'sat')
  sentences = ' '.join(words(corpus, 'train')).split(' <eos>')[:-1]
  expected = [' '.join(w if w in corpus.vocab else '<unk>' for w in s.split())
              for s in train]
  assert sorted(s.strip() for s in sentences) == sorted(expected)  # whole, in any order
  # Valid is the first half of TFDS's test split in TFDS's own order, test the rest.
  tfds_test = [example['text'].decode() for example in tfds.as_numpy(
      tfds.builder('lm1b', data_dir=tmp_path / 'data').as_dataset(split='test'))]
  for split, half in (('valid', tfds_test[:2]), ('test', tfds_test[2:])):
    expected = [w if w in corpus.vocab else '<unk>'
                for sentence in half for w in sentence.split() + ['<eos>']]
    assert words(corpus, split) == expected
  # The prepared ids record which TFDS lm1b they were encoded from.
  prepared = cache.load(cache.dataset_dir(tmp_path / 'data', 'lm1b'),
                        encoding.settings(specs.LM1B), None)
  assert prepared.source_files['tfds:lm1b']['num_examples'] == {'test': 4, 'train': 4}
  assert prepared.source_files['tfds:lm1b']['num_bytes'] > 0
  assert corpus_lib.load_corpus('lm1b', str(tmp_path / 'data')).vocab == corpus.vocab


def test_lm1b_without_its_archive_or_internet_is_refused_at_once(tmp_path, monkeypatch):
  with pytest.raises(DataError, match=r"'lm1b'.*r13output.tar.gz missing in "
                                      f"{tmp_path}"):
    corpus_lib.load_corpus('lm1b', str(tmp_path / 'data'), str(tmp_path))

  def no_network(*args, **kwargs):
    raise OSError('Name or service not known')

  monkeypatch.setattr(urllib.request, 'getproxies', dict)
  monkeypatch.setattr(socket, 'create_connection', no_network)
  with pytest.raises(DataError, match="'lm1b'.*cannot reach www.statmt.org"):
    corpus_lib.load_corpus('lm1b', str(tmp_path / 'data'))


# The README recipe at tiny size: stats, then baseline, pruning, export, and scoring.

@pytest.mark.slow
def test_recipe_trains_prunes_exports_and_scores(tmp_path):
  rng = np.random.default_rng(0)
  vocabulary = 'the a cat dog bird sat ran on mat and saw big small red'.split()
  def text(lines):
    return ''.join(' '.join(rng.choice(vocabulary, size=rng.integers(3, 9))) + '\n'
                   for _ in range(lines))
  raw = write_text_files(tmp_path / 'my_text', (text(120), text(15), text(15)))
  config = config_base.load(ROOT / 'configs' / 'demo.py', 'tiny')
  config.data.update(dict(name='text_files', manual_dir=str(raw), level='word',
                          data_dir=str(tmp_path / 'data')))
  config.pipeline.prune_gates.target_macs = 0.5     # no vocab_size: the data's
  report = run_pipeline(config, tmp_path / 'run')
  assert report['metric'] == 'ppl' and report['dataset'] == 'text_files'
  assert np.isfinite(report['pruned']['test'])
  budget = report['pruned']['budget']   # every head costs the same: half of them
  assert budget['key'] == 'target_macs' and budget['cost'] == budget['unpruned'] / 2
  assert report['pruned']['sparsity'] == 0.5
  stats = corpus_lib.load_corpus('text_files', str(tmp_path / 'data'), str(raw))
  assert run_files.load_config(tmp_path / 'run' / 'baseline').model.vocab_size == stats.vocab_size
  model = trained_model.load(tmp_path / 'run' / 'pruned' / 'export')
  summary, ids, log_probs = likelihood.score_text(model, 'the cat saw a zebra\nthe dog ran\n')
  assert summary['unk'] == 1 and len(log_probs) == len(ids) - 1 == 9
  assert np.all(log_probs < 0)
