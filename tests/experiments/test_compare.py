"""``microscale compare`` end to end on a very small model (has a pulse + report integrity)."""

import dataclasses
import json
import os

import pytest

from microscale.cli import main
from microscale.experiments.compare_config import PRESETS, CompareConfig

TINY = [
    "steps=6",
    "eval_every=3",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "seq_len=32",
    "batch_size=4",
    "eval_batches=2",
    "tensorboard=false",
]


@pytest.mark.slow
def test_compare_cli_report_matches_run_folders(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MICROSCALE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cmp"
    argv = [
        "compare",
        "--runs",
        "bf16,nvfp4",
        "--ablations",
        "nvfp4_no_sr",
        "--seeds",
        "0",
        "--quiet",
        *TINY,
        f"out={out}",
    ]
    assert main(argv) == 0
    for f in ("report.md", "convergence.png", "gap.png", "summary.json"):
        assert (out / f).stat().st_size > 0, f
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["runs"]) == ["bf16", "nvfp4", "nvfp4_no_sr"]
    report = (out / "report.md").read_text()
    for name, r in summary["runs"].items():
        run = json.loads((out / "runs" / name / "summary.json").read_text())
        assert r["final_val_loss"] == run["final_val_loss"]
        assert r["tokens"] == run["tokens"] == 6 * 4 * 32
        assert f"| {name} |" in report and f"{run['final_val_loss']:.4f}" in report
        for k in ("val_ppl", "rel_gap_vs_bf16", "rel_gap_vs_fp8", "tokens_per_s"):
            assert k in r
    assert summary["runs"]["bf16"]["rel_gap_vs_bf16"] == 0.0
    nv = summary["runs"]["nvfp4"]
    assert nv["rel_gap_vs_bf16"] == pytest.approx(
        100 * (nv["final_val_loss"] / summary["runs"]["bf16"]["final_val_loss"] - 1)
    )
    assert nv["weight_bits_per_param"] < summary["runs"]["bf16"]["weight_bits_per_param"] == 16
    assert "stdlib-docs" in nv["heldout_losses"]  # the second held-out corpus
    assert summary["setup"]["corpus_hash"] and summary["setup"]["machine"]["platform"]

    # Re-running with the same settings recomputes nothing: run folders are untouched.
    stamps = {p: os.stat(p).st_mtime_ns for p in out.glob("runs/*/summary.json")}
    assert main(argv) == 0
    assert stamps == {p: os.stat(p).st_mtime_ns for p in out.glob("runs/*/summary.json")}


def test_compare_rejects_unknown_run(capsys):
    assert main(["compare", "--runs", "bf16,nvfp5", "--quiet"]) == 2
    assert "nvfp5" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_a_valid_comparison(name):
    cfg = CompareConfig.preset(name)
    assert cfg.runs[0] == "bf16" and len(cfg.seeds) >= 2
    assert cfg.base.steps > 0 and cfg.base.eval_every == 0


def test_smoke_preset_is_the_default_regime_shortened():
    """The one-minute look trains the default's model on the default's data, only fewer
    steps, runs, seeds and evaluation batches (its time: benchmarks/timings.md)."""
    smoke, default = CompareConfig.preset("smoke"), CompareConfig.preset("default")
    assert smoke.base.model == default.base.model
    assert dataclasses.replace(smoke.base.data, eval_batches=64) == default.base.data
    assert smoke.base.data.eval_batches < default.base.data.eval_batches
    assert smoke.base.optim.lr == default.base.optim.lr
    assert smoke.base.steps < default.base.steps
    assert set(smoke.runs) < set(default.runs) and set(smoke.seeds) < set(default.seeds)
