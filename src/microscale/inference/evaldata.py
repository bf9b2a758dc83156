"""Evaluation / calibration batches from a corpus source, tokenized with a model's tokenizer.

``eval_batches("stdlib", tok, seq_len=256, batch_size=8, max_batches=16)`` loads the source
with ``microscale.data.load_corpus`` (same sources, split and cache as training: the stdlib,
a text file or folder, JSONL, a pre-tokenized ``.bin``) and cuts its held-out split into
the fixed windows of ``microscale.data.val_batches``: int32 ``[n, batch, seq_len + 1]``.
"""

from __future__ import annotations

import numpy as np

from microscale.data import check_vocab_fits, load_corpus, val_batches

__all__ = ["eval_batches"]


def eval_batches(
    source: str,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int,
    split: str = "val",
    val_fraction: float = 0.05,
    vocab_size: int | None = None,
) -> np.ndarray:
    """Fixed batches of ``split`` ("val" or "train") of ``source``; see the module docstring."""
    if split not in ("val", "train"):
        raise ValueError(f"split={split!r}: expected 'val' or 'train'")
    if tokenizer is None and not source.endswith(".bin"):
        raise ValueError(
            f"data {source!r} is text and the model has no tokenizer "
            "(tokenizer.json); pass a pre-tokenized .bin corpus instead"
        )
    corpus = load_corpus(source, tokenizer=tokenizer, val_fraction=val_fraction)
    tokens = corpus.val if split == "val" else corpus.train
    if vocab_size is not None:
        check_vocab_fits(corpus.vocab_size, vocab_size, what=f"data {source!r}")
    batches = val_batches(np.asarray(tokens), batch_size, seq_len, max_batches)
    if batches.shape[0] == 0:
        raise ValueError(
            f"the {split} split of {source!r} has {len(tokens)} tokens, fewer than one batch "
            f"of {batch_size} x {seq_len + 1}; lower --batch-size / --seq-len or use more data"
        )
    return batches
