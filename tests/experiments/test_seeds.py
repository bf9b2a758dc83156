"""Seed batches (``experiments/seeds.py``): S replicates vmapped in one program give each
replicate's own ``microscale train`` run.

Which equality: bit for bit, with the gradient clip off. ``vmap`` adds a leading batch
dimension to every operation and reduces over it nowhere, and at these shapes XLA:CPU runs
the batched GEMMs with the per-seed summation order (measured: every loss, eval and weight
identical, on Intel AMX and under the XLA:CPU variants ``ynnpack_off``, ``avx512_bf16``,
``avx``), once Adam's bias corrections are multiplications (``train/optim.py``). Two
reductions do change order under batching and are left out of the exact claim: the clip's
global norm (``optax.tree.norm``; ``tests/train/test_optim.py`` bounds its effect), and, at
the compare regime's 16 x 128-token steps, the GEMMs' (``docs/verifying.md``: gradients one
bfloat16 rounding apart after the first step, so a batched seed is a valid replicate, not
the same trajectory).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from microscale.config import apply_overrides
from microscale.experiments.seeds import (
    AUTO_MAX,
    seed_batch_size,
    train_seeds,
    why_not_batched,
)
from microscale.train import TrainConfig, load_checkpoint, train

from .test_compare import TINY

SMALL = [*TINY, "log_every=1"]  # test_compare's model, every step logged


def _base(corpus: str, **kw) -> TrainConfig:
    cfg = apply_overrides(TrainConfig.tiny(), [*SMALL, f"data.corpus={corpus}"])
    # the clip's norm is a reduction batching reorders (module doc): off for the exact claim
    over = {"steps": 3, "eval_every": 2, "data.heldout": "none", "optim.grad_clip": 0.0}
    return apply_overrides(cfg, {**over, **kw})


def _replicates(base: TrainConfig, out: Path, seeds=(0, 5)) -> list[TrainConfig]:
    return [
        apply_overrides(base, {"seed": s, "data.seed": s + 100, "out": str(out / f"seed{s}")})
        for s in seeds
    ]


def _weights(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _records(run: Path, kind: str) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "nvfp4"])
def test_each_seed_of_a_batch_is_its_own_run(recipe, corpus_dir, tmp_path):
    cfgs = _replicates(_base(corpus_dir, recipe=recipe), tmp_path / "batch")
    batched = train_seeds(cfgs, progress=False)
    for cfg, b in zip(cfgs, batched, strict=True):
        alone = dataclasses.replace(cfg, out=str(tmp_path / "alone" / Path(cfg.out).name))
        a = train(alone, progress=False)
        assert b["status"] == a["status"] == "completed"
        assert b["seed_batch"] == 2
        for kind, keys in (("train", ("loss", "grad_norm", "lr")), ("eval", ("val_loss",))):
            rb, ra = _records(Path(cfg.out), kind), _records(Path(alone.out), kind)
            assert (
                [r["step"] for r in rb]
                == [r["step"] for r in ra]
                == ([1, 2, 3] if kind == "train" else [0, 2, 3])
            )
            for k in keys:
                assert [r[k] for r in rb] == [r[k] for r in ra], (recipe, cfg.seed, kind, k)
        assert b["final_val_batch_losses"] == a["final_val_batch_losses"]
        assert b["precision"] == a["precision"]
        mb, _, meta = load_checkpoint(cfg.out)
        ma, _, _ = load_checkpoint(alone.out)
        assert meta["step"] == 3
        for wb, wa in zip(_weights(mb), _weights(ma), strict=True):
            np.testing.assert_array_equal(wb, wa)
    # the two seeds really differ (initialisation and data order)
    assert batched[0]["final_val_loss"] != batched[1]["final_val_loss"]


@pytest.mark.slow
def test_a_finished_batch_is_a_finished_run(corpus_dir, tmp_path):
    cfgs = _replicates(_base(corpus_dir, steps=2), tmp_path)
    first = train_seeds(cfgs, progress=False)
    # train(resume=true) finds the batch's runs complete and returns their summaries
    again = train(dataclasses.replace(cfgs[1], resume=True), progress=False)
    assert again == first[1]
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        train_seeds(cfgs, progress=False)


def test_a_batch_that_does_not_fit_is_refused_before_any_work(corpus_dir, tmp_path):
    base = _base(corpus_dir)
    cfgs = _replicates(base, tmp_path, seeds=range(4))
    per = seed_batch_size(base, 4, requested=1, memory=1 << 40)
    assert per == 1
    with pytest.raises(ValueError, match=r"seed_batch=4: 4 runs of this model need about .*MiB"):
        train_seeds(cfgs, progress=False, memory=1 << 20)
    assert not any(tmp_path.iterdir())  # refused before a folder was made
    # as many as fit: a budget of 2.5 runs' bytes gives batches of 2
    one = seed_batch_size(base, 1, memory=1 << 40)
    assert one == 1
    from microscale.experiments.seeds import MEMORY_SHARE, _run_bytes

    two_and_a_half = int(2.5 * _run_bytes(base) / MEMORY_SHARE)
    assert seed_batch_size(base, 4, memory=two_and_a_half) == 2
    assert seed_batch_size(base, 4, memory=1 << 40) == 4
    assert seed_batch_size(base, 20, memory=1 << 40) == AUTO_MAX  # measured: no faster past it
    assert seed_batch_size(base, 20, requested=20, memory=1 << 40) == 20
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seed_batch"):
            seed_batch_size(base, 4, requested=bad)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"lr": 2e-3}, "differ in more than seed and data.seed"),
        ({"recipe": "nvfp4"}, "differ in more than seed and data.seed"),
        ({"recipe": "nvfp4", "precision.warmup": 0.5}, "precision.warmup"),
        ({"recipe": "nvfp4", "precision.late.fraction": 0.2}, "precision.late.fraction"),
        ({"recipe": "nvfp4", "precision.kind": "sensitivity"}, "chosen in the run"),
        ({"inject_nonfinite_steps": [2]}, "inject_nonfinite_steps"),
    ],
)
def test_what_cannot_batch_says_why(change, why, corpus_dir, tmp_path):
    a, b = _replicates(_base(corpus_dir), tmp_path)
    if len(change) == 1 and ("lr" in change or "recipe" in change):
        b = apply_overrides(b, change)
    else:
        a, b = apply_overrides(a, change), apply_overrides(b, change)
    assert why in why_not_batched([a, b])
    with pytest.raises(ValueError, match="cannot train as one seed batch"):
        train_seeds([a, b], progress=False)


def test_each_run_needs_its_own_folder(corpus_dir, tmp_path):
    a, b = _replicates(_base(corpus_dir), tmp_path)
    for pair in ([a, dataclasses.replace(b, out=a.out)], [a, dataclasses.replace(b, out=None)]):
        with pytest.raises(ValueError, match="its own out="):
            train_seeds(pair, progress=False)


def test_replicates_batch(corpus_dir, tmp_path):
    assert why_not_batched(_replicates(_base(corpus_dir), tmp_path, seeds=range(3))) is None
