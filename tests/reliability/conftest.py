"""Fixtures for the fault tests: a tiny trained run (two checkpoints) and its export."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

# 2 blocks of width 64, byte tokens: trains 4 steps in seconds.
TRAIN_ARGS = [
    "data.heldout=none",
    "data.seq_len=32",
    "data.batch_size=4",
    "data.eval_batches=1",
    "data.prefetch=0",
    "model.vocab_size=257",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=64",
    "model.max_seq_len=64",
    "optim.warmup_steps=1",
    "steps=4",
    "eval_every=0",
    "checkpoint_every=2",
    "log_every=1",
    "tensorboard=false",
]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a ``python`` child process of these tests: this one's, with the
    checkout's ``src`` first on ``PYTHONPATH`` (the code under test, installed or not),
    plus ``extra`` variables."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {
        **os.environ,
        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **extra,
    }


@pytest.fixture(scope="session")
def words_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rel-corpus")
    rnd = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while"]
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(300)))
    return corpus


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MICROSCALE_CACHE", str(tmp_path_factory.mktemp("rel-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, words_corpus, cache_env) -> Path:
    """A 4-step run of a tiny model with checkpoints at steps 2 and 4 (do not modify:
    copy it with ``copy_tree``)."""
    from microscale.config import apply_overrides
    from microscale.train import TrainConfig, train

    out = tmp_path_factory.mktemp("rel-run") / "run"
    cfg = apply_overrides(
        TrainConfig.preset("tiny"), TRAIN_ARGS + [f"data.corpus={words_corpus}", f"out={out}"]
    )
    train(cfg, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory, tiny_run) -> Path:
    """``tiny_run`` exported (compressed-tensors NVFP4) -- copy it before modifying."""
    from microscale.cli import main

    out = tmp_path_factory.mktemp("rel-export") / "exp"
    assert main(["export", "--model", str(tiny_run), "--out", str(out)]) == 0
    return out


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
