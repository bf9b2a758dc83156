"""``microscale train`` has a pulse: it trains, writes its files and reports bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from microscale.cli import main


def test_cli_bad_key_and_print_config(capsys):
    assert main(["train", "--config", "tiny", "optim.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'optim.lrr'" in err and "did you mean 'optim.lr'" in err
    assert main(["train", "--config", "tiny", "recipe=nvfp4", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "recipe: nvfp4" in out and "d_model: 192" in out


@pytest.mark.slow
def test_cli_trains(corpus_dir, tmp_path, hang_guard_s):
    out = tmp_path / "run"
    args = [
        "train",
        "--config",
        "tiny",
        "recipe=fp8",
        "steps=4",
        "eval_every=2",
        "log_every=1",
        "model.d_model=64",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        "model.d_ff=64",
        "model.n_layers=2",
        "seq_len=32",
        "batch_size=4",
        "eval_batches=1",
        f"corpus={corpus_dir}",
        "data.heldout=none",
        "data.val_fraction=0.2",
        f"out={out}",
    ]
    import jax

    env = dict(
        os.environ,
        MICROSCALE_CACHE=str(tmp_path / "cache"),
        MICROSCALE_JAX_CACHE=jax.config.jax_compilation_cache_dir or "0",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "microscale.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: fp8 val_loss" in proc.stdout  # plain progress lines off a TTY
    assert "fp8: 1 of 2 blocks quantized; blocks [1] in high precision" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"] == "fp8" and summary["steps"] == 4
    assert Path(out, "checkpoints", "4").is_dir()
    # Same out without resume=true: refused with a clear message, exit code 2.
    proc = subprocess.run(
        [sys.executable, "-m", "microscale.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard_s,
    )
    assert proc.returncode == 2 and "resume=true" in proc.stderr
