"""Data: corpora, tokenizers, deterministic resumable batching.

The default corpus is the running Python's standard library (``"stdlib"``: exists on every
machine, no downloads), with a fixed held-out split by file and a second held-out corpus of
English prose (``"stdlib-docs"``). Typical use::

    from microscale.data import DataConfig, load_data

    data = load_data(DataConfig(seq_len=256, batch_size=16))
    batcher = data.train_batcher()
    with batcher.iterate(start_step, num_steps) as it:
        for step, batch in it:                    # int32 [16, 257]
            inputs, targets = batch[:, :-1], batch[:, 1:]
    val = data.val_batches("val")                 # int32 [n, 16, 257], fixed
    bar = data.unigram_entropy("val")             # nats/token a model must beat

Modules: :mod:`~microscale.data.sources` (documents, split, content hash),
:mod:`~microscale.data.tokenizers`, :mod:`~microscale.data.corpus` (tokens, cache, entropy),
:mod:`~microscale.data.batching`, :mod:`~microscale.data.config`.
"""

from microscale.data.batching import Batcher, PrefetchIterator, val_batches
from microscale.data.config import Data, DataConfig, load_data
from microscale.data.corpus import Corpus, cache_root, load_corpus, unigram_entropy
from microscale.data.sources import Documents, read_documents
from microscale.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    check_vocab_fits,
    load_tokenizer,
    token_dtype,
    train_bpe,
)

__all__ = [
    "BPETokenizer",
    "Batcher",
    "ByteTokenizer",
    "Corpus",
    "Data",
    "DataConfig",
    "Documents",
    "PrefetchIterator",
    "Tokenizer",
    "cache_root",
    "check_vocab_fits",
    "load_corpus",
    "load_data",
    "load_tokenizer",
    "read_documents",
    "token_dtype",
    "train_bpe",
    "unigram_entropy",
    "val_batches",
]
