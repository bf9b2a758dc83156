"""Shared fixtures: a tiny random model with token batches, and a briefly trained run."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from microscale.data import DataConfig
from microscale.model import ModelConfig, Transformer
from microscale.train import OptimConfig, TrainConfig, train

# 2 blocks of width 64 (head_dim 32, one kv head): 14 linear layers in 8 groups.
TINY = ModelConfig(
    vocab_size=257, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=64
)


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
    return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def token_batches() -> tuple[np.ndarray, np.ndarray]:
    """(calibration [2, 4, 33], evaluation [2, 4, 33]) random byte tokens."""
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 257, size=(4, 4, 33)).astype(np.int32)
    return toks[:2], toks[2:]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, corpus_dir) -> str:
    """A run folder: TINY trained 30 steps on ~40 stdlib modules (seq 32)."""
    out = tmp_path_factory.mktemp("q-run") / "run"
    cfg = TrainConfig(
        model=TINY,
        data=DataConfig(
            corpus=corpus_dir,
            heldout="none",
            seq_len=32,
            batch_size=8,
            eval_batches=2,
            val_fraction=0.2,
            cache_dir=str(tmp_path_factory.mktemp("q-cache")),
            prefetch=1,
        ),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
        steps=30,
        eval_every=30,
        log_every=10,
        tensorboard=False,
        out=str(out),
    )
    train(cfg, progress=False)
    return str(out)
