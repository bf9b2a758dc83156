"""Corpora as token arrays: load, tokenize, cache, describe; and the unigram-entropy bar.

:func:`load_corpus` turns a source (see :mod:`microscale.data.sources`) into a
:class:`Corpus` with ``train`` and ``val`` 1-D token arrays (``uint16`` when the vocabulary
fits, else ``uint32``; memory-mapped ``.npy`` files from the cache, or a memory-mapped
``.bin``). Documents are tokenized in sorted order and joined as ``doc EOS doc EOS ...``.

Pre-tokenized ``.bin`` files
    Raw little-endian ``uint16``/``uint32`` ids, memory-mapped, never read into memory. The
    dtype comes from the ``dtype=`` argument or a sidecar JSON (``data.json`` or
    ``data.bin.json`` next to ``data.bin``) with keys ``dtype`` (required unless given),
    ``vocab_size``, ``eos_id`` and ``tokenizer`` (path of a ``tokenizer.json``, relative to the
    sidecar). The vocabulary size is, in order: the argument, the sidecar, the tokenizer, or
    ``max(id) + 1`` (one pass). Val = the last ``val_fraction`` of the tokens. The content hash
    (one streaming pass) is cached by (path, size, mtime).

Cache
    Tokenized corpora and trained BPE tokenizers live under ``$MICROSCALE_CACHE`` (default
    ``$XDG_CACHE_HOME/microscale`` or ``~/.cache/microscale``), keyed by content hash + split +
    tokenizer id, so a changed file, split or tokenizer never reuses stale tokens. Every file
    is written to a temporary name and moved into place with ``os.replace``; ``meta.json`` is
    written last and a cache entry without it is ignored, so a killed or concurrent writer
    never leaves a half-written entry that a reader would trust.

Unigram entropy
    ``H = -sum_v p_v ln p_v`` with ``p_v`` the frequency of id ``v`` in the given tokens, in
    nats/token. It is the cross-entropy of the best context-free model *fitted to those very
    tokens*, so a language model's val loss must be clearly below the unigram entropy of the
    val split before it has learned anything beyond token frequencies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from microscale.data.sources import Documents, read_documents
from microscale.data.tokenizers import (
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)
from microscale.files import atomic_write_json, atomic_writer

_CACHE_VERSION = 1


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: the argument, ``$MICROSCALE_CACHE``, or ``~/.cache/microscale``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("MICROSCALE_CACHE"):
        return Path(os.environ["MICROSCALE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "microscale"


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    with atomic_writer(path, "wb") as f:
        np.save(f, arr)


def _atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_json(path, obj, sort_keys=True)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Corpus:
    """A tokenized corpus: train and val token arrays plus what identifies them."""

    # Source name: "stdlib", "stdlib-docs" or the path.
    name: str
    # 1-D token ids of the train split (np.ndarray or read-only memmap); may be empty.
    train: np.ndarray
    # 1-D token ids of the val split.
    val: np.ndarray
    # Number of ids the model's embedding must cover (every id is < vocab_size).
    vocab_size: int
    # End-of-document id (None for a .bin without one).
    eos_id: int | None
    # sha256 hex of the sorted file list and contents (identifies the data, not the split).
    content_hash: str
    # Files read (.bin / JSONL / text file: 1).
    n_files: int
    # Bytes of the source text (.bin: bytes of the token file).
    n_bytes: int
    # The tokenizer that produced the ids (None for a .bin without one).
    tokenizer: Tokenizer | None
    # How the split was made.
    split: dict
    # True when the tokens came from the on-disk cache.
    cached: bool = False

    def describe(self) -> dict:
        """JSON-friendly summary for run summaries and reports."""
        return {
            "name": self.name,
            "content_hash": self.content_hash,
            "n_files": self.n_files,
            "n_bytes": self.n_bytes,
            "train_tokens": int(self.train.shape[0]),
            "val_tokens": int(self.val.shape[0]),
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer": None if self.tokenizer is None else self.tokenizer.to_dict(),
            "split": self.split,
        }


def make_tokenizer(
    spec: str | Tokenizer,
    docs: Documents | None = None,
    *,
    bpe_vocab_size: int = 4096,
    cache_dir: str | os.PathLike | None = None,
) -> Tokenizer:
    """``"byte"``, ``"bpe"`` (trained on ``docs.train``, cached) or a tokenizer.json path."""
    if not isinstance(spec, str):
        if not isinstance(spec, Tokenizer):
            raise TypeError(f"tokenizer must be a str or a Tokenizer, got {type(spec).__name__}")
        return spec
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        if docs is None or not docs.train:
            what = f"corpus {docs.name!r} has no train split" if docs else "a .bin is no text"
            raise ValueError(
                f"tokenizer='bpe' trains on the corpus's train split, but {what}; pass a "
                "trained tokenizer (object or tokenizer.json path) instead"
            )
        key = hashlib.sha256(
            json.dumps(
                [docs.content_hash, docs.split, bpe_vocab_size, _CACHE_VERSION], sort_keys=True
            ).encode()
        ).hexdigest()[:24]
        path = cache_root(cache_dir) / "tokenizers" / f"bpe-{key}.json"
        if path.is_file():
            try:
                return load_tokenizer(path)
            except (ValueError, OSError):
                pass  # damaged entry: retrain and overwrite
        tok = train_bpe((t for _, t in docs.train), bpe_vocab_size)
        tok.save(path)
        return tok
    if spec.endswith(".json") or os.sep in spec or "/" in spec:
        return load_tokenizer(spec)
    raise ValueError(
        f"tokenizer must be 'byte', 'bpe' or the path of a tokenizer.json, got {spec!r}"
    )


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(name).name or name)[:40]


def _tokenize_cached(docs: Documents, tok: Tokenizer, cache_dir, use_cache: bool):
    key = hashlib.sha256(
        json.dumps([docs.content_hash, docs.split, tok.id, _CACHE_VERSION], sort_keys=True).encode()
    ).hexdigest()[:24]
    folder = cache_root(cache_dir) / "tokens" / f"{_slug(docs.name)}-{key}"
    meta_path = folder / "meta.json"
    if use_cache and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            train = np.load(folder / "train.npy", mmap_mode="r")
            val = np.load(folder / "val.npy", mmap_mode="r")
            if [train.shape[0], val.shape[0]] == [meta["train_tokens"], meta["val_tokens"]]:
                return train, val, True
        except (OSError, ValueError, KeyError):
            pass  # damaged entry: rebuild it below
    train = tok.encode_documents([t for _, t in docs.train])
    val = tok.encode_documents([t for _, t in docs.val])
    if use_cache:
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_save_npy(folder / "train.npy", train)
        _atomic_save_npy(folder / "val.npy", val)
        _atomic_write_json(
            meta_path,
            {
                "name": docs.name,
                "content_hash": docs.content_hash,
                "tokenizer": tok.to_dict(),
                "split": docs.split,
                "train_tokens": int(train.shape[0]),
                "val_tokens": int(val.shape[0]),
            },
        )
    return train, val, False


def _file_hash(path: Path, cache_dir, use_cache: bool) -> str:
    """Content hash of one file, framed like text sources; memoized by (path, size, mtime)."""
    st = path.stat()
    stamp: dict[str, Any] = {
        "path": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }
    memo = (
        cache_root(cache_dir)
        / "hashes"
        / f"{hashlib.sha256(stamp['path'].encode()).hexdigest()[:24]}.json"
    )
    if use_cache and memo.is_file():
        try:
            obj = json.loads(memo.read_text(encoding="utf-8"))
            if obj["stamp"] == stamp:
                return obj["content_hash"]
        except (OSError, ValueError, KeyError):
            pass
    h = hashlib.sha256(path.name.encode("utf-8") + b"\0" + struct.pack("<Q", st.st_size))
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if use_cache:
        memo.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_json(memo, {"stamp": stamp, "content_hash": digest})
    return digest


def _load_bin(path: Path, *, dtype, vocab_size, tokenizer, val_fraction, cache_dir, use_cache):
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    side: dict = {}
    for cand in (path.with_suffix(".json"), path.with_name(path.name + ".json")):
        if cand.is_file():
            try:
                side = json.loads(cand.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"sidecar {str(cand)!r} is not valid JSON ({e.msg})") from e
            if not isinstance(side, dict):
                raise ValueError(f"sidecar {str(cand)!r}: expected a JSON object")
            if side.get("tokenizer") and tokenizer is None:
                tokenizer = load_tokenizer(cand.parent / side["tokenizer"])
            break
    dtype = dtype or side.get("dtype")
    if dtype is None:
        raise ValueError(
            f"pre-tokenized file {str(path)!r}: unknown dtype; pass dtype='uint16' or "
            f"'uint32', or write a sidecar {str(path.with_suffix('.json'))!r} with "
            '{"dtype": "uint16", "vocab_size": ...}'
        )
    if str(dtype) not in ("uint16", "uint32"):
        raise ValueError(
            f"pre-tokenized file {str(path)!r}: dtype must be 'uint16' or 'uint32', got {dtype!r}"
        )
    dt = np.dtype(str(dtype))
    size = path.stat().st_size
    if size == 0 or size % dt.itemsize:
        raise ValueError(
            f"pre-tokenized file {str(path)!r}: {size} bytes is not a positive "
            f"multiple of the {dt.name} item size {dt.itemsize}"
        )
    tokens = np.memmap(path, dtype=dt, mode="r")
    n = tokens.shape[0]
    if n < 2:
        raise ValueError(f"pre-tokenized file {str(path)!r} has {n} token(s); need >= 2")
    tok = None if tokenizer is None else make_tokenizer(tokenizer)
    vocab = vocab_size or side.get("vocab_size") or (tok.vocab_size if tok else None)
    if vocab is None:
        vocab = int(max(int(tokens[i : i + (1 << 24)].max()) for i in range(0, n, 1 << 24))) + 1
    eos = side.get("eos_id", tok.eos_id if tok else None)
    n_val = min(max(1, int(round(n * val_fraction))), n - 1)
    return Corpus(
        name=str(path),
        train=tokens[: n - n_val],
        val=tokens[n - n_val :],
        vocab_size=int(vocab),
        eos_id=eos,
        content_hash=_file_hash(path, cache_dir, use_cache),
        n_files=1,
        n_bytes=size,
        tokenizer=tok,
        split={"method": "tail", "val_fraction": val_fraction, "val_tokens": n_val},
    )


def load_corpus(
    source: str = "stdlib",
    *,
    tokenizer: str | Tokenizer | None = None,
    bpe_vocab_size: int = 4096,
    val_fraction: float = 0.05,
    pattern: str | None = None,
    text_field: str = "text",
    dtype: str | None = None,
    vocab_size: int | None = None,
    cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
) -> Corpus:
    """Load ``source`` ("stdlib", "stdlib-docs", a text file/folder, .jsonl or .bin) as tokens.

    ``tokenizer``: None (= "byte"; for a .bin: the sidecar's tokenizer, else none), "byte",
    "bpe" (trained on this corpus's train split with ``bpe_vocab_size`` ids, cached), a
    tokenizer.json path, or a tokenizer object (to tokenize a second corpus exactly like the
    first). ``pattern``: comma-separated globs filtering a folder's files.
    ``text_field``: the JSONL field. ``dtype``/``vocab_size``: for ``.bin`` files (else from the
    sidecar). ``cache=False`` neither reads nor writes the cache.
    """
    if not isinstance(source, str) or not source:
        raise ValueError(f"corpus source must be a non-empty string, got {source!r}")
    if source.endswith(".bin"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"pre-tokenized corpus {source!r}: no such file")
        return _load_bin(
            path,
            dtype=dtype,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            val_fraction=val_fraction,
            cache_dir=cache_dir,
            use_cache=cache,
        )
    docs = read_documents(source, val_fraction, pattern=pattern, text_field=text_field)
    tok = make_tokenizer(
        "byte" if tokenizer is None else tokenizer,
        docs,
        bpe_vocab_size=bpe_vocab_size,
        cache_dir=cache_dir,
    )
    train, val, hit = _tokenize_cached(docs, tok, cache_dir, cache)
    split = dict(docs.split, n_train_docs=len(docs.train), n_val_docs=len(docs.val))
    if docs.n_skipped:
        split["n_skipped_files"] = docs.n_skipped
    return Corpus(
        name=docs.name,
        train=train,
        val=val,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        content_hash=docs.content_hash,
        n_files=docs.n_files,
        n_bytes=docs.n_bytes,
        tokenizer=tok,
        split=split,
        cached=hit,
    )


def unigram_entropy(tokens: np.ndarray, vocab_size: int | None = None) -> float:
    """Entropy (nats/token) of the empirical unigram distribution of ``tokens``.

    The bar a model must beat: see the module docstring. Works chunk-wise on memmaps.
    """
    tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(
            f"unigram_entropy needs a non-empty 1-D token array, got shape {tokens.shape}"
        )
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"unigram_entropy needs integer token ids, got dtype {tokens.dtype}")
    counts = np.zeros(0, dtype=np.int64)
    for i in range(0, tokens.shape[0], 1 << 24):
        chunk = np.asarray(tokens[i : i + (1 << 24)]).astype(np.int64)
        if chunk.min() < 0:
            raise ValueError("unigram_entropy: negative token id")
        c = np.bincount(chunk)
        if c.shape[0] > counts.shape[0]:
            c[: counts.shape[0]] += counts
            counts = c
        else:
            counts[: c.shape[0]] += c
    if vocab_size is not None and counts.shape[0] > vocab_size:
        raise ValueError(
            f"unigram_entropy: token id {counts.shape[0] - 1} >= vocab_size {vocab_size}"
        )
    p = counts[counts > 0] / float(tokens.shape[0])
    return float(-(p * np.log(p)).sum())


__all__ = ["Corpus", "cache_root", "load_corpus", "make_tokenizer", "unigram_entropy"]
