"""Tokenizers: byte and BPE round trips, EOS joining, save/load."""

import numpy as np
import pytest

from microscale.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    token_dtype,
    train_bpe,
)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):\n'
    "        self.x = x\n        self.y = y\n",
    "Ünïcödé — 日本語 😀 and <|eos|> as plain text\n",
] * 20

SAMPLE = "def f(x):\n    return x ** 2  # é 😀 <|eos|>\n\t\r\n"


def test_byte_roundtrip_and_documents():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    ids = tok.encode_documents(["ab", "", "ç"])
    assert ids.dtype == np.uint16
    assert ids.tolist() == [97, 98, 256, 256, 0xC3, 0xA7, 256]
    assert tok.decode(ids) == "abç"
    with pytest.raises(ValueError, match="byte tokenizer ids"):
        tok.decode([300])


def test_bpe_train_roundtrip_save_load(tmp_path):
    tok = train_bpe(TEXTS, 300)
    assert isinstance(tok, Tokenizer) and isinstance(tok, BPETokenizer)
    assert tok.eos_id == 0 and 257 < tok.vocab_size <= 300
    for text in TEXTS[:3] + [SAMPLE, ""]:
        assert tok.decode(tok.encode(text)) == text
    # the literal "<|eos|>" in text is never the special id
    assert tok.eos_id not in tok.encode(TEXTS[2])
    docs = tok.encode_documents(TEXTS[:3])
    assert (docs == tok.eos_id).sum() == 3 and docs[-1] == tok.eos_id
    assert docs.tolist() == sum((tok.encode(t) + [0] for t in TEXTS[:3]), [])
    path = tmp_path / "tok" / "tokenizer.json"
    tok.save(path)
    back = load_tokenizer(path)
    assert back.id == tok.id and back.encode(SAMPLE) == tok.encode(SAMPLE)
    assert back.to_dict() == tok.to_dict()
    assert train_bpe(TEXTS, 300).id == tok.id  # deterministic


def test_byte_save_load(tmp_path):
    ByteTokenizer().save(tmp_path / "t.json")
    assert isinstance(load_tokenizer(tmp_path / "t.json"), ByteTokenizer)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(TEXTS, 100)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="expected a microscale byte tokenizer"):
        load_tokenizer(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("not json")
    with pytest.raises(ValueError, match="not a JSON file"):
        load_tokenizer(tmp_path / "y.json")


def test_token_dtype():
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
