"""Language-modelling data: datasets, tokenisation, cached encodings."""
from allatt_jax.data.corpus import Corpus
from allatt_jax.data.corpus import load_corpus
from allatt_jax.data.specs import DATASETS

__all__ = ['DATASETS', 'Corpus', 'load_corpus']
