"""Tokenizer files of an exported folder: a standard HF ``tokenizer.json`` for any
microscale tokenizer, so vLLM / transformers / TensorRT-LLM load the folder as is.

microscale's byte tokenizer (ids 0-255 = UTF-8 bytes, 256 = EOS) is written as an
equivalent byte-level BPE without merges: the GPT-2 byte-to-unicode alphabet maps byte
``b`` to one character whose vocabulary id is ``b``, ``<|eos|>`` is the special id 256,
and the ByteLevel decoder turns characters back into bytes. It encodes every string to
exactly the ids ``ByteTokenizer`` gives. A BPE tokenizer is already an HF
``tokenizer.json`` and is copied. Given the path of a ``tokenizer.json`` (an imported
model's, a run's), the files beside it that describe its special tokens and chat
(:data:`TOKENIZER_FILES`) are copied byte for byte instead of being made up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from microscale.data import BPETokenizer, ByteTokenizer, load_tokenizer
from microscale.files import atomic_write_json, atomic_write_text

__all__ = ["TOKENIZER_FILES", "byte_tokenizer_hf", "write_tokenizer"]

EOS_TOKEN = "<|eos|>"
# An HF tokenizer's files (tokenizer.json first): they travel together, byte for byte.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_tokenizer_hf():
    """A ``tokenizers.Tokenizer`` equivalent to microscale's ``ByteTokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[EOS_TOKEN] = ByteTokenizer.eos_id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    return tok


def write_tokenizer(tokenizer, out_dir: str | os.PathLike, *, max_len: int) -> list[str]:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` for ``tokenizer`` (a microscale
    tokenizer object or a tokenizer file path) into ``out_dir``; returns the file names.
    A path with a ``tokenizer_config.json`` beside it: the HF files there are copied."""
    out = Path(out_dir)
    if isinstance(tokenizer, (str, os.PathLike)):
        src = Path(tokenizer)
        tokenizer = load_tokenizer(src)
        if isinstance(tokenizer, BPETokenizer) and (src.parent / TOKENIZER_FILES[1]).is_file():
            files = [(src, TOKENIZER_FILES[0])] + [
                (src.parent / n, n) for n in TOKENIZER_FILES[1:] if (src.parent / n).is_file()
            ]
            for path, name in files:
                shutil.copyfile(path, out / name)
            return [name for _, name in files]
    if isinstance(tokenizer, ByteTokenizer):
        text, eos = byte_tokenizer_hf().to_str(), EOS_TOKEN
    elif isinstance(tokenizer, BPETokenizer):
        text, eos = tokenizer.hf.to_str(), tokenizer.eos_token
    else:
        raise TypeError(
            f"tokenizer {tokenizer!r}: expected a microscale ByteTokenizer / "
            "BPETokenizer or the path of a tokenizer file"
        )
    atomic_write_text(out / "tokenizer.json", text)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "model_max_length": int(max_len),
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    atomic_write_json(out / "tokenizer_config.json", config)
    return ["tokenizer.json", "tokenizer_config.json"]
