"""DataConfig validation and load_data end to end."""

import dataclasses
import json

import numpy as np
import pytest

from microscale.data import DataConfig, load_data


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROSCALE_CACHE", str(tmp_path / "cache"))


def test_config_roundtrip_and_validation():
    c = DataConfig()
    d = dataclasses.asdict(c)
    assert DataConfig(**json.loads(json.dumps(d))) == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seq_len = 3
    with pytest.raises(ValueError, match=r"data.seq_len: expected int, got '256'"):
        DataConfig(seq_len="256")
    with pytest.raises(ValueError, match=r"data.cache: expected bool"):
        DataConfig(cache=1)
    with pytest.raises(
        ValueError, match=r"data.batch_size=10 must be divisible by data.grad_accum=4"
    ):
        DataConfig(batch_size=10, grad_accum=4)
    with pytest.raises(ValueError, match="data.sampling"):
        DataConfig(sampling="shuffle")
    with pytest.raises(ValueError, match="data.val_fraction"):
        DataConfig(val_fraction=0.0)
    with pytest.raises(ValueError, match="data.vocab_size"):
        DataConfig(tokenizer="bpe", vocab_size=100)
    assert DataConfig(val_fraction=1e-1 * 1).val_fraction == 0.1
    assert DataConfig().heldout_sources() == ["stdlib-docs"]
    assert DataConfig(corpus="x.bin").heldout_sources() == []
    assert DataConfig(heldout="none").heldout_sources() == []
    assert DataConfig(heldout="a.txt, b").heldout_sources() == ["a.txt", "b"]


def test_load_data_stdlib_default():
    data = load_data(DataConfig(seq_len=64, batch_size=4, eval_batches=2))
    assert set(data.eval_sets()) == {"val", "stdlib-docs"}
    assert data.vocab_size == 257
    b = data.train_batcher()
    assert b.batch_at(0).shape == (4, 65)
    assert data.val_batches().shape == (2, 4, 65)
    assert data.val_batches("stdlib-docs").shape == (2, 4, 65)
    h = data.unigram_entropy()
    assert 2.0 < h < np.log(257)
    desc = json.loads(json.dumps(data.describe()))
    assert desc["corpus_hash"] == data.corpus.content_hash
    with pytest.raises(KeyError, match="unknown held-out set"):
        data.val_batches("nope")


def test_load_data_bpe_folder_with_heldout_and_saved_tokenizer(tmp_path):
    src = tmp_path / "code"
    src.mkdir()
    for i in range(30):
        (src / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    prose = tmp_path / "prose.txt"
    prose.write_text("This function returns the value of x times a constant.\n" * 200)
    cfg = DataConfig(
        corpus=str(src),
        heldout=str(prose),
        tokenizer="bpe",
        vocab_size=320,
        seq_len=16,
        batch_size=4,
        eval_batches=2,
    )
    data = load_data(cfg)
    assert set(data.eval_sets()) == {"val", str(prose)}
    assert data.val_batches(str(prose)).shape == (2, 4, 17)
    path = tmp_path / "run" / "tokenizer.json"
    data.save_tokenizer(path)
    again = load_data(dataclasses.replace(cfg, tokenizer=str(path)))
    assert again.tokenizer.id == data.tokenizer.id
    np.testing.assert_array_equal(again.corpus.train, data.corpus.train)
    np.testing.assert_array_equal(
        again.train_batcher().batch_at(7), data.train_batcher().batch_at(7)
    )
