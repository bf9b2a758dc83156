"""``microscale quantize`` has a pulse: a trained run folder in, every output file out."""

from __future__ import annotations

import json
from pathlib import Path

from microscale.cli import main


def test_cli_quantizes_a_training_run(trained_run, tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(["quantize", "--checkpoint", trained_run, "--out", str(out), "--budget", "6",
               "--formats", "nvfp4,fp8,bf16", "--calib-tokens", "256", "--seed", "1",
               "--pareto-budgets", "5,8", "--no-ptq-effects", "--no-compile-cache", "-q"])
    assert rc == 0, capsys.readouterr().err
    for name in ("precision_rules.json", "report.json", "report.md", "pareto.png",
                 "sensitivity.png"):
        assert (out / name).is_file(), name
    rep = json.loads((out / "report.json").read_text())
    assert rep["budget"] == 6.0 and rep["effective_bits"] <= 6.0
    assert set(rep["val_ppl"]) >= {"bf16", "uniform_nvfp4", "heuristic", "searched"}
    assert set(rep["layers"].values()) <= {"nvfp4", "fp8_e4m3", "bf16"}
    assert rep["calibration"]["tokens"] >= 256 and rep["calibration"]["seed"] == 1
    assert rep["method"] == "taylor" and rep["monotone"] is False  # the defaults
    assert set(rep["comparisons"]) >= {"searched - heuristic", "searched - uniform_nvfp4"}
    ck = rep["checkpoint"]
    assert Path(ck["path"]).is_dir() and ck["files"] and "fallback_reason" not in ck, ck
    assert "searched" in capsys.readouterr().out


def test_cli_bad_arguments_exit_2(trained_run, tmp_path, capsys):
    rc = main(["quantize", "--checkpoint", trained_run, "--out", str(tmp_path / "x"),
               "--formats", "nvfp4,int3", "-q", "--no-compile-cache"])
    assert rc == 2 and "unknown format" in capsys.readouterr().err
    rc = main(["quantize", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "y"), "-q",
               "--no-compile-cache"])
    assert rc == 2 and "not a microscale run folder" in capsys.readouterr().err
