"""Language-modelling data: datasets, tokenisation, prepared encodings, batch streams."""
from allatt_jax.data.corpus import check_data_config
from allatt_jax.data.corpus import Corpus
from allatt_jax.data.corpus import load_corpus
from allatt_jax.data.corpus import load_run_corpus
from allatt_jax.data.corpus import warn_if_unk_untrained
from allatt_jax.data.specs import DATASETS
from allatt_jax.data.stream import eval_batches
from allatt_jax.data.stream import SegmentStream
from allatt_jax.data.stream import to_global_array
from allatt_jax.data.tokenization import UNK

__all__ = ['DATASETS', 'UNK', 'Corpus', 'SegmentStream', 'check_data_config',
           'eval_batches', 'load_corpus', 'load_run_corpus', 'to_global_array',
           'warn_if_unk_untrained']
