"""``DataConfig`` (embedded in the training config) and :func:`load_data`, its one entry point.

``load_data(cfg)`` loads the training corpus, builds (or trains) the tokenizer, loads the
held-out corpora with that same tokenizer and returns a :class:`Data` that hands out the
train :class:`~microscale.data.batching.Batcher`, the fixed validation batches of each
held-out set, the unigram-entropy bar and a JSON description for run summaries.

Held-out sets: ``"val"`` (the corpus's own val split) always; plus every corpus named by
``heldout`` under its source name (only its val split is used). ``heldout="auto"`` means
``"stdlib-docs"`` when the corpus is the stdlib and none otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from microscale.data.batching import _MODES, Batcher, val_batches
from microscale.data.corpus import Corpus, load_corpus, unigram_entropy
from microscale.data.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What to train on and how it is cut into batches. JSON-friendly fields only."""

    # "stdlib" (default, no downloads), "stdlib-docs", a text file, a folder, a .jsonl or a
    # pre-tokenized .bin path.
    corpus: str = "stdlib"
    # Extra held-out corpora (val split only), comma-separated sources, tokenized with the same
    # tokenizer; "auto" = "stdlib-docs" for the stdlib corpus, else none; "none" = none.
    heldout: str = "auto"
    # "byte" (257 ids), "bpe" (trained on the train split) or a tokenizer.json path.
    tokenizer: str = "byte"
    # Ids of a trained BPE tokenizer (ignored by "byte" and saved tokenizers).
    vocab_size: int = 4096
    # Fraction of documents (of tokens, for one text file or a .bin) held out as val.
    val_fraction: float = 0.05
    # Tokens per training sequence (each batch row holds seq_len + 1).
    seq_len: int = 256
    # Global sequences per optimizer step (all hosts and microbatches together).
    batch_size: int = 16
    # Microbatches per optimizer step (gradient accumulation); divides batch_size.
    grad_accum: int = 1
    # Seed of the data order (independent of the model seed).
    seed: int = 0
    # "epoch" (shuffled non-overlapping windows per epoch) or "random" (uniform windows).
    sampling: str = "epoch"
    # Validation batches per held-out set and eval (at most; fixed windows from the start).
    eval_batches: int = 16
    # Sequences per validation batch; None = batch_size.
    eval_batch_size: int | None = None
    # Batches prepared ahead by the background thread (0 = synchronous).
    prefetch: int = 2
    # Comma-separated globs selecting a folder corpus's files (None = all files).
    pattern: str | None = None
    # JSONL field holding each document's text.
    text_field: str = "text"
    # dtype of a .bin corpus ("uint16"/"uint32"); None = from its sidecar JSON.
    bin_dtype: str | None = None
    # Read/write tokenized corpora in the on-disk cache.
    cache: bool = True
    # Cache folder; None = $MICROSCALE_CACHE or ~/.cache/microscale.
    cache_dir: str | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want = {"str": str, "int": int, "float": (int, float), "bool": bool}
            base = f.type.split(" | ")[0] if isinstance(f.type, str) else f.type
            if v is None and "None" in str(f.type):
                continue
            ok = isinstance(v, want[base]) and (base == "bool" or not isinstance(v, bool))
            if not ok:
                raise ValueError(f"data.{f.name}: expected {f.type}, got {v!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "eval_batches", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("seed", "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ValueError(f"data.eval_batch_size must be >= 1, got {self.eval_batch_size}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"data.batch_size={self.batch_size} must be divisible by "
                f"data.grad_accum={self.grad_accum}"
            )
        if self.sampling not in _MODES:
            raise ValueError(f"data.sampling must be one of {_MODES}, got {self.sampling!r}")
        if self.tokenizer == "bpe" and not 257 <= self.vocab_size <= 1 << 20:
            raise ValueError(
                f"data.vocab_size must be in [257, 1048576] for a BPE tokenizer, "
                f"got {self.vocab_size}"
            )
        if self.bin_dtype not in (None, "uint16", "uint32"):
            raise ValueError(
                f"data.bin_dtype must be 'uint16', 'uint32' or None, got {self.bin_dtype!r}"
            )

    def heldout_sources(self) -> list[str]:
        """The extra held-out corpora ``heldout`` names, resolved."""
        if self.heldout == "auto":
            return ["stdlib-docs"] if self.corpus == "stdlib" else []
        if self.heldout.strip().lower() in ("", "none"):
            return []
        return [s.strip() for s in self.heldout.split(",") if s.strip()]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Data:
    """The loaded data of one run (see :func:`load_data`)."""

    # The config it was loaded from.
    config: DataConfig
    # The training corpus (train and val splits).
    corpus: Corpus
    # Extra held-out corpora by source name (their val splits are used).
    heldout: dict[str, Corpus]

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer of the run (None for a .bin without one)."""
        return self.corpus.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size

    def eval_sets(self) -> dict[str, np.ndarray]:
        """Token arrays of every held-out set: ``{"val": ..., "<heldout source>": ...}``."""
        return {"val": self.corpus.val, **{k: c.val for k, c in self.heldout.items()}}

    def train_batcher(self, *, process_index: int = 0, process_count: int = 1) -> Batcher:
        """The deterministic training batches of this host."""
        c = self.config
        return Batcher(
            self.corpus.train,
            batch_size=c.batch_size,
            seq_len=c.seq_len,
            seed=c.seed,
            mode=c.sampling,
            grad_accum=c.grad_accum,
            process_index=process_index,
            process_count=process_count,
        )

    def val_batches(
        self, name: str = "val", *, process_index: int = 0, process_count: int = 1
    ) -> np.ndarray:
        """Fixed validation batches ``[n, rows, seq_len + 1]`` of held-out set ``name``."""
        sets = self.eval_sets()
        if name not in sets:
            raise KeyError(f"unknown held-out set {name!r}; have {sorted(sets)}")
        c = self.config
        return val_batches(
            sets[name],
            c.eval_batch_size or c.batch_size,
            c.seq_len,
            c.eval_batches,
            process_index=process_index,
            process_count=process_count,
        )

    def unigram_entropy(self, name: str = "val") -> float:
        """Unigram entropy (nats/token) of held-out set ``name``: the bar to beat."""
        return unigram_entropy(self.eval_sets()[name], self.vocab_size)

    def save_tokenizer(self, path: str | os.PathLike) -> None:
        """Store the run's tokenizer (load it back with ``tokenizer=<path>``)."""
        if self.tokenizer is None:
            raise ValueError(f"corpus {self.corpus.name!r} has no tokenizer to save")
        self.tokenizer.save(path)

    def describe(self) -> dict:
        """JSON-friendly summary: corpora, sizes, hashes, tokenizer, entropy bars, config."""
        return {
            "corpus": self.corpus.describe(),
            "corpus_hash": self.corpus.content_hash,
            "heldout": {k: c.describe() for k, c in self.heldout.items()},
            "unigram_entropy": {k: self.unigram_entropy(k) for k in self.eval_sets()},
            "config": dataclasses.asdict(self.config),
        }


def load_data(config: DataConfig | None = None) -> Data:
    """Load the corpus, tokenizer and held-out corpora that ``config`` names."""
    c = DataConfig() if config is None else config
    if not isinstance(c, DataConfig):
        raise TypeError(f"load_data expects a DataConfig, got {type(c).__name__}")
    common: dict[str, Any] = dict(val_fraction=c.val_fraction, cache=c.cache, cache_dir=c.cache_dir)
    corpus = load_corpus(
        c.corpus,
        tokenizer=None if c.corpus.endswith(".bin") and c.tokenizer == "byte" else c.tokenizer,
        bpe_vocab_size=c.vocab_size,
        pattern=c.pattern,
        text_field=c.text_field,
        dtype=c.bin_dtype,
        **common,
    )
    heldout = {}
    for src in c.heldout_sources():
        if corpus.tokenizer is None:
            raise ValueError(
                f"data.heldout={c.heldout!r} needs a tokenizer, but corpus "
                f"{c.corpus!r} has none; set data.tokenizer or data.heldout='none'"
            )
        heldout[src] = load_corpus(
            src, tokenizer=corpus.tokenizer, text_field=c.text_field, **common
        )
    return Data(config=c, corpus=corpus, heldout=heldout)
