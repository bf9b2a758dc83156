"""Shared fixtures for the trainer tests: a small text corpus and a tiny config."""

from __future__ import annotations

import pytest

from microscale.config import apply_overrides
from microscale.data import DataConfig
from microscale.model import ModelConfig
from microscale.train import OptimConfig, TrainConfig

# Test model: 2 blocks of width 64 (head_dim 32, one kv head), ~60k parameters.
TEST_MODEL = ModelConfig(
    vocab_size=257, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32
)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture
def make_cfg(corpus_dir, data_cache, tmp_path):
    """``make_cfg("k=v", ...)`` -> a tiny TrainConfig writing to a fresh folder."""

    def make(*overrides: str) -> TrainConfig:
        base = TrainConfig(
            model=TEST_MODEL,
            data=DataConfig(
                corpus=corpus_dir,
                heldout="none",
                seq_len=32,
                batch_size=8,
                eval_batches=2,
                val_fraction=0.2,
                cache_dir=data_cache,
                prefetch=1,
            ),
            optim=OptimConfig(lr=3e-3, warmup_steps=5),
            steps=20,
            eval_every=10,
            log_every=1,
            tensorboard=False,
            out=str(tmp_path / "run"),
        )
        return apply_overrides(base, list(overrides))

    return make
