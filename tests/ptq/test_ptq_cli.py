"""``microscale quantize`` has a pulse: a trained run folder in, every output file out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microscale.cli import main
from microscale.export.gguf.imatrix import read_imatrix


@pytest.mark.slow
def test_cli_quantizes_a_training_run(trained_run, tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(
        [
            "quantize",
            "--model",
            trained_run,
            "--out",
            str(out),
            "budget=6",
            "formats=nvfp4,fp8,bf16",
            "calib_tokens=256",
            "seed=1",
            "pareto_budgets=5,8",
            "ptq_effects=false",
            "--no-compile-cache",
            "-q",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    for name in (
        "precision_rules.json",
        "report.json",
        "report.md",
        "pareto.png",
        "sensitivity.png",
    ):
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
    rc = main(
        [
            "quantize",
            "--model",
            trained_run,
            "--out",
            str(tmp_path / "x"),
            "formats=nvfp4,int3",
            "-q",
            "--no-compile-cache",
        ]
    )
    assert rc == 2 and "unknown format" in capsys.readouterr().err
    rc = main(
        [
            "quantize",
            "--model",
            str(tmp_path),
            "--out",
            str(tmp_path / "y"),
            "-q",
            "--no-compile-cache",
        ]
    )
    assert rc == 2 and "is not a model folder" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_target_gguf_writes_a_gguf_of_native_formats(trained_run, tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "qg"
    rc = main(
        [
            "quantize",
            "--model",
            trained_run,
            "--out",
            str(out),
            "layout=gguf",
            "budget=5.0",
            "calib_tokens=256",
            "pareto_budgets=5",
            "ptq_effects=false",
            "--no-compile-cache",
            "-q",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    # the preset: ggml's block types (a K-quant on rows it cannot hold: llama.cpp's fallback)
    preset = ["q3_k", "q4_0", "q4_k", "q5_0", "q5_k", "q6_k", "q8_0", "bf16"]
    assert rep["formats"] == [*preset, "q5_1"]  # q5_k's fallback on these 64-wide rows
    assert set(rep["layers"].values()) <= set(rep["formats"])
    assert rep["effective_bits"] <= 5.0 and "uniform_q8_0" in rep["val_ppl"]
    assert rep["checkpoint"]["layout"] == "gguf" and not (out / "checkpoint").exists()
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out / "model.gguf").tensors}
    # the importance matrix of the calibration text, one entry per linear weight of the file
    imatrix = read_imatrix(out / "imatrix.gguf")
    tensors = gguf.GGUFReader(out / "model.gguf").tensors
    linear = [t.name for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    assert sorted(imatrix) == sorted(n for n in linear if n.endswith(".weight"))
    assert all(v.ndim == 1 and (v > 0).all() for v in imatrix.values())
    assert main(["verify", str(out)]) == 0  # it is under checksums.json
    names = {"attn.q_proj": "attn_q", "attn.o_proj": "attn_output", "mlp.down_proj": "ffn_down"}
    for p, f in rep["layers"].items():
        kind = p.split(".", 2)[2]
        if kind in names:
            assert types[f"blk.{p.split('.')[1]}.{names[kind]}.weight"] == f.upper(), p
    # the quantize output and the run itself export to GGUF through `microscale export`
    for src, name in ((trained_run, "run.gguf"), (str(out), None)):
        if name is None:
            rc = main(
                [
                    "export",
                    "--model",
                    src,
                    "layout=gguf",
                    "--out",
                    str(tmp_path / "again.gguf"),
                ]
            )
            assert (
                rc == 2
                and "already holds its model as a llama.cpp GGUF file" in capsys.readouterr().err
            )
            continue
        rc = main(
            [
                "export",
                "--model",
                src,
                "layout=gguf",
                "--out",
                str(tmp_path / name),
                "formats=mxfp4",
            ]
        )
        assert rc == 0, capsys.readouterr().err
        assert "wrote" in capsys.readouterr().out


def test_cli_target_gguf_refuses_formats_llama_cpp_lacks(trained_run, tmp_path, capsys):
    rc = main(
        [
            "quantize",
            "--model",
            trained_run,
            "--out",
            str(tmp_path / "x"),
            "layout=gguf",
            "formats=nvfp4,fp8,bf16",
            "-q",
            "--no-compile-cache",
        ]
    )
    assert rc == 2 and "no native fp8_e4m3" in capsys.readouterr().err
