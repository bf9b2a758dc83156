"""Tokenizers: a byte-level default and a byte-level BPE trained with HF ``tokenizers``.

Both share one interface: ``encode(str) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
``eos_id``, ``id`` (a short string that changes whenever the mapping changes; part of the
token cache key), ``save(path)``, ``to_dict()`` (a JSON description for run summaries) and
``encode_documents(texts) -> np.ndarray`` which joins documents as
``doc_0 EOS doc_1 EOS ... doc_n EOS`` (every document is *followed* by the end-of-document id,
so a model learns where documents end and that what follows starts afresh).

``ByteTokenizer``
    ids 0-255 are the UTF-8 bytes, id 256 is EOS: ``vocab_size = 257``. Lossless for any
    string, needs no training, and its loss in nats/token is directly nats/byte.

``BPETokenizer``
    GPT-2 style byte-level BPE (``tokenizers`` ``ByteLevel`` pre-tokenizer and decoder, all 256
    byte symbols in the initial alphabet, so any string round-trips). Id 0 is the special
    ``<|eos|>``. Trained on the *train split only* with :func:`train_bpe`; stored as a standard
    HF ``tokenizer.json`` that ``save``/:func:`load_tokenizer` write and read, so a run keeps
    the exact tokenizer it trained with. Text containing the literal string ``<|eos|>`` is
    encoded as ordinary text, never as the special id.

``decode`` drops EOS ids (both tokenizers) and replaces invalid UTF-8 (a window may cut a
multi-byte character) with U+FFFD.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from microscale.files import atomic_write_json, atomic_write_text

EOS_TOKEN = "<|eos|>"
# End-of-text tokens recognised in foreign HF tokenizer files, in order of preference.
_KNOWN_EOS = (EOS_TOKEN, "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def check_vocab_fits(n_ids: int, vocab_size: int, *, what: str = "the tokenizer") -> None:
    """Refuse token ids a model cannot embed: ``what`` (a tokenizer, a corpus) produces
    ids ``0..n_ids-1`` and the model's embedding has ``vocab_size`` rows. The one check
    every command runs where a tokenizer meets a model (train, eval, generate, quantize,
    export); a model with more rows than ids (a padded vocabulary) is fine."""
    if n_ids > vocab_size:
        raise ValueError(
            f"{what} produces token ids up to {n_ids - 1} ({n_ids} ids) but the "
            f"model embeds {vocab_size} (model.vocab_size={vocab_size}): ids >= "
            f"{vocab_size} cannot be embedded; use the model's own tokenizer"
        )


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id of a vocabulary (uint16 or uint32)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of microscale needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def id(self) -> str: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def encode_documents(self, texts: Sequence[str]) -> np.ndarray: ...
    def save(self, path: str | os.PathLike) -> None: ...
    def to_dict(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255 plus EOS = 256 (``vocab_size`` 257)."""

    vocab_size = 257
    eos_id = 256
    id = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).ravel()
        if arr.size and (arr.min() < 0 or arr.max() > self.eos_id):
            raise ValueError(
                f"byte tokenizer ids must be in [0, 256], got {arr.min()}..{arr.max()}"
            )
        return arr[arr != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", "replace")

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        encoded = [t.encode("utf-8") for t in texts]
        if not encoded:
            return np.zeros(0, dtype=np.uint16)
        out = np.frombuffer(b"\0".join(encoded) + b"\0", dtype=np.uint8).astype(np.uint16)
        # Each document is followed by one placeholder byte; overwrite those with EOS.
        ends = np.cumsum(np.fromiter((len(e) + 1 for e in encoded), np.int64, len(encoded))) - 1
        out[ends] = self.eos_id
        return out

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())

    def to_dict(self) -> dict:
        return {"type": "byte", "id": self.id, "vocab_size": self.vocab_size, "eos_id": self.eos_id}

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eos_id=256)"


class BPETokenizer:
    """Byte-level BPE backed by an HF ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer, *, eos_token: str | None = None):
        # tokenizer: a tokenizers.Tokenizer; eos_token: its end-of-document token (default:
        # the first of <|eos|>, <|endoftext|>, </s>, <eos>, <|end_of_text|> it knows).
        self._tok = tokenizer
        candidates = (eos_token,) if eos_token else _KNOWN_EOS
        for cand in candidates:
            tid = tokenizer.token_to_id(cand)
            if tid is not None:
                self.eos_token, self.eos_id = cand, int(tid)
                break
        else:
            raise ValueError(
                f"tokenizer has no end-of-document token; expected one of {list(candidates)}"
            )
        self._tok.encode_special_tokens = True
        self._json = self._tok.to_str()
        # ids it can produce are 0..vocab_size-1 (the largest id + 1 when ids have gaps)
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(
            int(self._tok.get_vocab_size(with_added_tokens=True)), max(ids, default=-1) + 1
        )
        digest = hashlib.sha256(self._json.encode("utf-8")).hexdigest()[:16]
        self.id = f"bpe{self.vocab_size}-{digest}"

    @property
    def hf(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        dtype = token_dtype(self.vocab_size)
        parts = []
        batch = 256
        for i in range(0, len(texts), batch):
            for enc in self._tok.encode_batch(list(texts[i : i + batch]), add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=dtype))
                parts.append(np.asarray([self.eos_id], dtype=dtype))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    def save(self, path: str | os.PathLike) -> None:
        """Write the standard HF ``tokenizer.json`` (atomically)."""
        atomic_write_text(path, self._json)

    def to_dict(self) -> dict:
        return {
            "type": "bpe",
            "id": self.id,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE with ``vocab_size`` ids (including ``<|eos|>`` = 0) on ``texts``.

    Deterministic for the same texts and vocabulary size. On a small corpus the learned
    vocabulary can be smaller than requested (no pair left to merge); ``vocab_size`` of the
    result is the real one.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < 257 or vocab_size > 1 << 20:
        raise ValueError(
            f"BPE vocab_size must be an int in [257, 1048576] (256 byte symbols + <|eos|>), "
            f"got {vocab_size!r}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok, eos_token=EOS_TOKEN)


def load_tokenizer(path: str | os.PathLike) -> ByteTokenizer | BPETokenizer:
    """Read a tokenizer written by ``save`` (or any HF ``tokenizer.json`` with an EOS token)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
        obj = json.loads(text)
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"tokenizer file {str(path)!r} is not a JSON file ({e})") from e
    if isinstance(obj, dict) and obj.get("type") == "byte":
        return ByteTokenizer()
    if isinstance(obj, dict) and "model" in obj:
        from tokenizers import Tokenizer

        return BPETokenizer(Tokenizer.from_str(text))
    raise ValueError(
        f"tokenizer file {str(path)!r}: expected a microscale byte tokenizer "
        "({'type': 'byte'}) or an HF tokenizer.json (with a 'model' key)"
    )
