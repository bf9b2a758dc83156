"""``microscale quantize --model`` takes what ``train init_from=`` takes: an HF Llama
folder end to end (its own tokenizer on ``--corpus``), a quantize output, and the same
named error for anything else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flax import nnx

from microscale.cli import main
from microscale.data import train_bpe
from microscale.export import export_checkpoint, read_checkpoint
from microscale.model import ModelConfig, Transformer

# Untied, rope_theta / eps off the presets' values; 300 BPE ids in 320 embedding rows.
MODEL = ModelConfig(
    vocab_size=320,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=128,
    max_seq_len=64,
    rope_theta=100000.0,
    norm_eps=1e-6,
    tie_embeddings=False,
)
ARGS = (
    "budget=6",
    "formats=nvfp4,fp8,bf16",
    "calib_tokens=256",
    "eval_batches=2",
    "pareto_budgets=5,8",
    "ptq_effects=false",
    "--no-compile-cache",
    "-q",
)


@pytest.fixture(scope="module")
def hf(tmp_path_factory, corpus_dir) -> Path:
    """A bf16 HF Llama folder with a BPE tokenizer trained on the test corpus."""
    folder = tmp_path_factory.mktemp("hf") / "model"
    texts = [p.read_text() for p in sorted(Path(corpus_dir).glob("*.py"))[:10]]
    export_checkpoint(
        Transformer(MODEL, rngs=nnx.Rngs(3)),
        folder,
        layer_formats="bf16",
        dtype="bfloat16",
        tokenizer=train_bpe(texts, 300),
    )
    return folder


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MICROSCALE_CACHE", str(tmp_path_factory.getbasetemp() / "ms-cache"))


@pytest.mark.slow
def test_hf_folder_quantizes_end_to_end(hf, corpus_dir, tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(["quantize", "--model", str(hf), f"corpus={corpus_dir}", "--out", str(out), *ARGS])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert rep["effective_bits"] <= 6.0
    assert set(rep["layers"].values()) <= {"nvfp4", "fp8_e4m3", "bf16"}
    assert len(rep["layers"]) == 2 * 7  # every linear layer of the two blocks
    cal = rep["calibration"]
    assert cal["corpus"] == corpus_dir and cal["tokens"] >= 256
    assert cal["source"]["kind"] == "hf" and cal["source"]["weights"] == "master"
    # the text was tokenized with the folder's own tokenizer
    assert cal["tokenizer"] == str((hf / "tokenizer.json").absolute())
    ppl = rep["val_ppl"]
    # a random model: perplexity near its 320 embedding rows, not the byte vocabulary's 257
    assert all(300 < v < 340 for v in ppl.values()), ppl
    # weight-only round to nearest: the score pass measures the input amax (no calibrate)
    phases = {"setup", "quantize_weights", "score", "search", "evaluate"}
    assert set(rep["act_amax"]) == set(rep["layers"]) and min(rep["act_amax"].values()) > 0
    assert set(rep["timings"]) == {f"{p}_s" for p in phases}
    assert set(rep["peak_rss_gb"]) == phases and all(v > 0 for v in rep["peak_rss_gb"].values())
    # the output is a model folder for everything downstream: weights, config, tokenizer
    ck = read_checkpoint(out / "checkpoint")
    assert ck.config.vocab_size == 320 and not ck.config.tie_embeddings
    assert (out / "checkpoint" / "tokenizer.json").read_text() == (
        hf / "tokenizer.json"
    ).read_text()
    # ... and quantize takes it back (its run is an HF folder: the dequantized weights,
    # on the corpus its report names)
    rc = main(["quantize", "--model", str(out), "--out", str(tmp_path / "again"), *ARGS])
    assert rc == 0, capsys.readouterr().err
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert again["calibration"]["source"]["kind"] == "quantize"
    assert again["calibration"]["source"]["weights"] == "dequantized"
    assert again["calibration"]["corpus"] == corpus_dir


@pytest.mark.slow
def test_hf_folder_default_corpus_is_said(hf, tmp_path, capsys):
    rc = main(
        [
            "quantize",
            "--model",
            str(hf),
            "--out",
            str(tmp_path / "q"),
            *[a for a in ARGS if a != "-q"],
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "no corpus=: calibrating and evaluating on 'stdlib'" in capsys.readouterr().out
    rep = json.loads((tmp_path / "q" / "report.json").read_text())
    assert rep["calibration"]["corpus"] == "stdlib"


def test_model_folder_errors(hf, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    rc = main(["quantize", "--model", str(bare), "--out", str(tmp_path / "x"), "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "--model" in err and "is not a model folder" in err
    notok = tmp_path / "notok"
    notok.mkdir()
    for f in hf.iterdir():
        if f.name != "tokenizer.json":
            (notok / f.name).write_bytes(f.read_bytes())
    rc = main(["quantize", "--model", str(notok), "--out", str(tmp_path / "y"), "-q"])
    assert rc == 2 and "has no tokenizer.json" in capsys.readouterr().err
    rc = main(["quantize", "--model", str(hf), "step=3", "--out", str(tmp_path / "z"), "-q"])
    assert rc == 2 and "step=3 applies to a training run folder" in capsys.readouterr().err
