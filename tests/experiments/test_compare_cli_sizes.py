"""``microscale compare --sizes`` end to end on two tiny sizes (has a pulse)."""

import json

import pytest

from microscale.cli import main

FAST = [
    "seq_len=32",
    "batch_size=4",
    "eval_batches=2",
    "data.eval_batch_size=4",
    "eval_every=0",
    "tensorboard=false",
]


@pytest.mark.slow
def test_compare_sizes_writes_scaling_plot_and_trend(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROSCALE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "sizes"
    argv = [
        "compare",
        "--sizes",
        "0.16M,0.6M",
        "--runs",
        "bf16,nvfp4",
        "--seeds",
        "0,1",
        "--tokens-per-param",
        "0.0001",
        "--min-steps",
        "2",
        "--quiet",
        *FAST,
        f"out={out}",
    ]
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert list(s["sizes"]) == ["0.16M", "0.6M"]
    assert s["sizes"]["0.16M"]["params"] < s["sizes"]["0.6M"]["params"]
    assert s["trends"]["nvfp4_vs_bf16"]["fit"]["n_points"] == 4
    assert (out / "scaling.png").stat().st_size > 0
    assert "## Trend" in (out / "report.md").read_text()
    for size in ("0.16M", "0.6M"):
        assert (out / size / "report.md").exists()
