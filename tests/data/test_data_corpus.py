"""Corpora: stdlib tokens, cache, .bin/JSONL/folder sources, unigram entropy."""

import json
import math

import numpy as np
import pytest

from microscale.data import ByteTokenizer, load_corpus, unigram_entropy


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROSCALE_CACHE", str(tmp_path / "cache"))


def test_stdlib_byte_corpus_and_cache(tmp_path):
    cold = load_corpus()
    assert not cold.cached and cold.name == "stdlib" and cold.vocab_size == 257
    assert cold.train.dtype == np.uint16 and cold.train.ndim == 1
    assert int(cold.train.max()) <= 256 and int(cold.val.max()) <= 256
    # byte tokens: one per UTF-8 byte plus one EOS per document
    d = cold.describe()
    n_docs = d["split"]["n_train_docs"] + d["split"]["n_val_docs"]
    assert d["train_tokens"] + d["val_tokens"] == cold.n_bytes + n_docs
    assert (cold.val == 256).sum() == d["split"]["n_val_docs"]
    json.dumps(d)
    warm = load_corpus()
    assert warm.cached and warm.content_hash == cold.content_hash
    np.testing.assert_array_equal(warm.train, cold.train)
    np.testing.assert_array_equal(warm.val, cold.val)
    # an entry without meta.json (a writer killed mid-way) is ignored and rebuilt
    metas = list((tmp_path / "cache").rglob("meta.json"))
    assert len(metas) == 1
    metas[0].unlink()
    rebuilt = load_corpus()
    assert not rebuilt.cached and metas[0].is_file()
    assert not list((tmp_path / "cache").rglob(".*tmp*"))
    assert not load_corpus(cache=False).cached


def test_folder_corpus_with_bpe_and_shared_tokenizer(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 5)
    c = load_corpus(str(src), tokenizer="bpe", bpe_vocab_size=300)
    assert c.tokenizer.vocab_size <= 300 and c.eos_id == 0
    assert c.train.size and c.val.size and int(c.train.max()) < c.vocab_size
    text = c.tokenizer.decode(c.val)
    assert "def f" in text
    again = load_corpus(str(src), tokenizer="bpe", bpe_vocab_size=300)
    assert again.cached and again.tokenizer.id == c.tokenizer.id
    # a second corpus tokenized exactly like the first
    jl = tmp_path / "x.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"return x * {i}"}) for i in range(10)))
    other = load_corpus(str(jl), tokenizer=c.tokenizer)
    assert other.tokenizer is c.tokenizer and other.describe()["tokenizer"]["id"] == c.tokenizer.id
    with pytest.raises(ValueError, match="has no train split"):
        load_corpus("stdlib-docs", tokenizer="bpe")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_corpus(tmp_path, dtype):
    tokens = (np.arange(10_000) % 1000).astype(dtype)
    path = tmp_path / "data.bin"
    tokens.tofile(path)
    (tmp_path / "data.json").write_text(json.dumps({"dtype": dtype, "vocab_size": 1024}))
    c = load_corpus(str(path), val_fraction=0.1)
    assert isinstance(c.train, np.memmap) and c.train.dtype == np.dtype(dtype)
    assert (c.train.size, c.val.size, c.vocab_size) == (9000, 1000, 1024)
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), tokens)
    assert c.tokenizer is None and len(c.content_hash) == 64
    assert load_corpus(str(path), val_fraction=0.1).content_hash == c.content_hash
    # no sidecar: dtype from the argument, vocab from the data
    (tmp_path / "data.json").unlink()
    c2 = load_corpus(str(path), dtype=dtype)
    assert c2.vocab_size == 1000
    with pytest.raises(ValueError, match=r"data.bin.*unknown dtype"):
        load_corpus(str(path))
    with pytest.raises(ValueError, match="'uint16' or 'uint32'"):
        load_corpus(str(path), dtype="int8")


def test_bin_errors(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match=r"odd.bin.*3 bytes.*item size 2"):
        load_corpus(str(path), dtype="uint16")
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        load_corpus(str(tmp_path / "missing.bin"))
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 8)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match=r"bad.json.*not valid JSON"):
        load_corpus(str(tmp_path / "bad.bin"))


def test_bin_with_sidecar_tokenizer(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode_documents(["hello world"] * 50)
    ids.tofile(tmp_path / "t.bin")
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "t.json").write_text(json.dumps({"dtype": "uint16", "tokenizer": "tokenizer.json"}))
    c = load_corpus(str(tmp_path / "t.bin"))
    assert c.vocab_size == 257 and c.eos_id == 256
    assert c.tokenizer.decode(c.val).endswith("hello world")


def test_unigram_entropy():
    assert unigram_entropy(np.arange(8).repeat(3), 8) == pytest.approx(math.log(8))
    assert unigram_entropy(np.zeros(100, np.uint16), 257) == 0.0
    p = np.array([0.5, 0.25, 0.25])
    tokens = np.array([0, 0, 1, 2], np.uint32)
    assert unigram_entropy(tokens, 3) == pytest.approx(-(p * np.log(p)).sum())
    assert unigram_entropy(tokens) == unigram_entropy(tokens, 10)  # unused ids cost nothing
    with pytest.raises(ValueError, match="vocab_size"):
        unigram_entropy(tokens, 2)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        unigram_entropy(np.zeros(0, np.uint16))
    with pytest.raises(ValueError, match="integer"):
        unigram_entropy(np.ones(3))


def test_load_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere.*expected 'stdlib'"):
        load_corpus(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="tokenizer must be 'byte', 'bpe'"):
        load_corpus("stdlib", tokenizer="sentencepiece")
    with pytest.raises(ValueError, match="non-empty string"):
        load_corpus("")
