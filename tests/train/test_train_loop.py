"""End-to-end training runs on CPU: the loss goes down, files, resume, non-finite steps."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from microscale.train import Checkpointer, TrainingAborted, load_checkpoint, train


def _records(out, kind):
    lines = Path(out, "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.slow
def test_loss_goes_down_and_files(make_cfg):
    cfg = make_cfg("steps=30", "eval_every=15", "log_every=5", "tensorboard=true")
    s = train(cfg, progress=False)
    out = Path(cfg.out)
    for name in (
        "config.yaml",
        "summary.json",
        "metrics.jsonl",
        "precision_rules.json",
        "tokenizer.json",
    ):
        assert (out / name).exists(), name
    assert list((out / "tb").iterdir()), "no tensorboard event file"
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(s))
    evals = _records(out, "eval")
    assert [e["step"] for e in evals] == [0, 15, 30]
    assert evals[0]["val_loss"] > 5.0  # ~ln(257) at init
    assert s["final_val_loss"] < evals[0]["val_loss"] - 1.5
    assert s["status"] == "completed" and s["tokens"] == 30 * 8 * 32 and s["steps"] == 30
    for k in (
        "final_val_loss",
        "val_ppl",
        "final_train_loss",
        "tokens_per_s",
        "recipe",
        "params",
        "corpus_hash",
        "unigram_entropy",
        "wall_time_s",
        "config",
    ):
        assert s[k] is not None, k
    train_recs = _records(out, "train")
    assert [r["step"] for r in train_recs] == [5, 10, 15, 20, 25, 30]
    for k in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s"):
        assert all(np.isfinite(r[k]) for r in train_recs), k


@pytest.mark.slow
def test_exact_resume_across_late_switch(make_cfg):
    """20 steps straight == 10 steps, a crash, resume=true, 10 more (bit-identical losses).

    nvfp4 exercises the per-step stochastic-rounding keys; the late switch (last 25% of
    the steps in bf16) happens after the resume, so the phase is restored too."""
    common = ("recipe=nvfp4", "precision.late.fraction=0.25", "checkpoint_every=5", "eval_every=10")
    straight = make_cfg(*common, "out=" + str(Path(make_cfg().out).parent / "straight"))
    s1 = train(straight, progress=False)

    split = make_cfg(*common, "out=" + str(Path(make_cfg().out).parent / "split"))

    class Crash(Exception):
        pass

    def crash_after_10(rec):
        if rec["kind"] == "train" and rec["step"] == 12:
            raise Crash

    with pytest.raises(Crash):
        train(split, progress=False, callbacks=[crash_after_10])
    with Checkpointer(Path(split.out) / "checkpoints") as ck:
        assert ck.latest_step() == 10
    with pytest.raises(FileExistsError, match="resume=true"):
        train(split, progress=False)
    from dataclasses import replace

    s2 = train(replace(split, resume=True), progress=False)

    a = [
        (r["step"], r["loss"], r["grad_norm"], r["phase"]) for r in _records(straight.out, "train")
    ]
    b = [(r["step"], r["loss"], r["grad_norm"], r["phase"]) for r in _records(split.out, "train")]
    assert a == b and len(a) == 20
    assert a[14][3] == "main" and a[15][3] == "late"  # switch at step 15 (batch index 15)
    assert s1["final_val_loss"] == s2["final_val_loss"]
    assert s2["late_switch_step"] == 15
    events = [r["event"] for r in _records(split.out, "event")]
    assert events == ["precision", "precision", "resume", "late_switch"]  # one per start
    # A completed run re-invoked with resume=true returns its summary without training.
    s3 = train(replace(split, resume=True), progress=False)
    assert s3["final_val_loss"] == s2["final_val_loss"]


@pytest.mark.slow
def test_nonfinite_skip_then_abort_keeps_last_checkpoint(make_cfg):
    cfg = make_cfg(
        "inject_nonfinite_steps=[3,7,8,9]",
        "max_nonfinite_in_a_row=3",
        "checkpoint_every=5",
        "eval_every=0",
        "steps=12",
    )
    with pytest.raises(TrainingAborted, match="3 non-finite.*step 5") as e:
        train(cfg, progress=False)
    s = e.value.summary
    assert s["status"] == "aborted" and s["nonfinite_steps"] == 4 and s["steps"] == 9
    assert json.loads((Path(cfg.out) / "summary.json").read_text())["status"] == "aborted"
    events = [(r["event"], r["step"]) for r in _records(cfg.out, "event")]
    assert events == [
        ("precision", 0),
        ("nonfinite", 3),
        ("nonfinite", 7),
        ("nonfinite", 8),
        ("nonfinite", 9),
        ("abort", 9),
    ]
    train_recs = {r["step"]: r for r in _records(cfg.out, "train")}
    assert train_recs[4]["nonfinite"] == 1 and np.isfinite(train_recs[4]["loss"])
    with Checkpointer(Path(cfg.out) / "checkpoints") as ck:
        assert ck.all_steps() == [5]
    model, _, meta = load_checkpoint(cfg.out)
    assert meta["step"] == 5 and meta["nonfinite_total"] == 1
    leaves = jax.tree.leaves(
        jax.tree.map(lambda x: np.isfinite(np.asarray(x)).all(), model.embed.embedding[...])
    )
    assert all(leaves)


@pytest.mark.slow
def test_grad_accumulation_matches_one_batch(make_cfg, tmp_path):
    """bf16: 2 microbatches of 4 average to the gradient of one batch of 8 (same rows)."""
    runs = {}
    for accum in (1, 2):
        cfg = make_cfg(
            f"grad_accum={accum}", "steps=3", "eval_every=0", f"out={tmp_path / f'accum{accum}'}"
        )
        train(cfg, progress=False)
        runs[accum] = [r["loss"] for r in _records(cfg.out, "train")]
    np.testing.assert_allclose(runs[1], runs[2], rtol=2e-3)
