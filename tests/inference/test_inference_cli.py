"""The CLI has a pulse: a tiny model trained for a few steps is exported (both layouts),
then generates text and reports its perplexity from the packed folder and from the run."""

import json
import random

import pytest

from microscale.cli import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 3-step training run of a tiny model on a small text corpus."""
    from microscale.data import DataConfig
    from microscale.model import ModelConfig
    from microscale.train import OptimConfig, TrainConfig, train

    root = tmp_path_factory.mktemp("cli")
    rnd = random.Random(0)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "cats",
        "sleep",
    ]
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rnd.choice(words) for _ in range(12)) for _ in range(300)))
    mp = pytest.MonkeyPatch()
    mp.setenv("MICROSCALE_CACHE", str(root / "cache"))
    cfg = TrainConfig(
        model=ModelConfig(
            vocab_size=257,
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=128,
            max_seq_len=64,
        ),
        data=DataConfig(
            corpus=str(corpus), heldout="none", seq_len=32, batch_size=4, eval_batches=1, prefetch=0
        ),
        optim=OptimConfig(warmup_steps=1),
        steps=3,
        eval_every=0,
        log_every=1,
        tensorboard=False,
        out=str(root / "run"),
    )
    train(cfg, progress=False)
    yield root
    mp.undo()


@pytest.mark.slow
def test_export_generate_eval(run_dir, tmp_path, capsys):
    run, corpus, out = run_dir / "run", run_dir / "corpus.txt", tmp_path / "ct"
    assert main(["export", "--model", str(run), "--out", str(out)]) == 0
    assert "14 x nvfp4" in capsys.readouterr().out
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / f).is_file()
    assert (
        main(["generate", "--model", str(out), "--prompt", "the quick", "-n", "8", "--stats"]) == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("the quick")
    assert "[stats] packed linear layers: 14" in text and "ratio 0.28" in text
    assert (
        main(
            [
                "eval",
                "--model",
                str(out),
                "--data",
                str(corpus),
                "--seq-len",
                "32",
                "--batch-size",
                "2",
                "--batches",
                "2",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] == 2 * 2 * 32 and 1 < res["ppl"] < 257
    assert abs(res["memory"]["ratio"] / (4.5 / 16) - 1) < 0.02


@pytest.mark.slow
def test_modelopt_w4a4_mixed_export(run_dir, tmp_path, capsys):
    run, out = run_dir / "run", tmp_path / "mo"
    formats = json.dumps(
        {
            "layers": {
                **{f"layers.{i}.attn.o_proj": "fp8_e4m3" for i in (0, 1)},
                **{
                    f"layers.{i}.{k}": "nvfp4"
                    for i in (0, 1)
                    for k in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.down_proj")
                },
            }
        }
    )
    assert (
        main(
            [
                "export",
                "--model",
                str(run),
                "--out",
                str(out),
                "layout=modelopt",
                f"formats={formats}",
                "activations=true",
                "calib_batches=1",
            ]
        )
        == 0
    )
    assert "4 x bf16" in capsys.readouterr().out
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "MIXED_PRECISION"
    assert hq["quantized_layers"]["model.layers.1.self_attn.o_proj"] == {"quant_algo": "FP8"}
    assert (
        main(
            [
                "generate",
                "--model",
                str(out),
                "--prompt",
                "a",
                "-n",
                "4",
                "-t",
                "0.8",
                "--top-k",
                "20",
                "--top-p",
                "0.9",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("a")


def test_run_dir_directly_and_errors(run_dir, tmp_path, capsys):
    run = run_dir / "run"
    assert (
        main(
            [
                "eval",
                "--model",
                str(run),
                "--formats",
                "nvfp4",
                "--batch-size",
                "2",
                "--batches",
                "1",
                "--stats",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "ppl" in out and "[stats] packed linear layers: 14" in out
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist; expected an exported model folder" in capsys.readouterr().err
    assert main(["export", "--model", str(run), "--out", str(tmp_path / "x"), "formats=nvfp5"]) == 2
    assert "unknown format 'nvfp5'" in capsys.readouterr().err


def test_hf_folder_to_nvfp4(tmp_path, capsys):
    """An unquantized HF folder is quantized (NVFP4 by default); a packed one converts."""
    from flax import nnx

    from microscale.data import ByteTokenizer
    from microscale.export import export_checkpoint, read_checkpoint
    from microscale.model import ModelConfig, Transformer

    cfg = ModelConfig(
        vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    export_checkpoint(
        Transformer(cfg, rngs=nnx.Rngs(0)),
        tmp_path / "hf",
        layer_formats="bf16",
        tokenizer=ByteTokenizer(),
    )
    assert main(["export", "-m", str(tmp_path / "hf"), "-o", str(tmp_path / "ct")]) == 0
    assert "14 x nvfp4" in capsys.readouterr().out
    assert (
        main(
            [
                "export",
                "-m",
                str(tmp_path / "ct"),
                "-o",
                str(tmp_path / "mo"),
                "layout=modelopt",
            ]
        )
        == 0
    )
    ct, mo = read_checkpoint(tmp_path / "ct"), read_checkpoint(tmp_path / "mo")
    assert mo.layout == "modelopt" and mo.tokenizer_file is not None
    q1, q2 = ct.params["layers.0.mlp.up_proj.kernel"], mo.params["layers.0.mlp.up_proj.kernel"]
    assert q1.data.tobytes() == q2.data.tobytes()
    # --activations on a packed folder keeps its weight formats and adds input scales
    corpus = tmp_path / "calib.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 600)
    mp = pytest.MonkeyPatch()
    mp.setenv("MICROSCALE_CACHE", str(tmp_path / "cache"))
    try:
        assert (
            main(
                [
                    "export",
                    "-m",
                    str(tmp_path / "ct"),
                    "-o",
                    str(tmp_path / "a4"),
                    "activations=true",
                    f"corpus={corpus}",
                    "calib_batches=1",
                ]
            )
            == 0
        )
    finally:
        mp.undo()
    assert "14 x nvfp4/a:nvfp4" in capsys.readouterr().out
    a4 = read_checkpoint(tmp_path / "a4")
    assert {lq.weights for lq in a4.layers.values()} == {"nvfp4"}
    assert set(a4.input_scales) == set(a4.layers)
