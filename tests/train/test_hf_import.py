"""`microscale import` and `train init_from=HF`: the model is config.json's, the tokenizer the
folder's, the weights the HF tensors bit for bit; what microscale cannot represent is refused
naming the key, and nothing half-made is left behind. A tokenizer that produces ids the
model cannot embed is refused by every command."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from microscale.cli import main
from microscale.config import ConfigError
from microscale.data import BPETokenizer, load_tokenizer, train_bpe
from microscale.export import TensorStore, export_checkpoint, ms_param_name
from microscale.model import ModelConfig, Transformer
from microscale.train import load_checkpoint, resolve_config

# Not the presets' values, so a default that leaks through would show: rope_theta 100000
# (SmolLM2's), eps 1e-6, untied, vocab 320 (more rows than the tokenizer's 300 ids).
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
WORDS = (
    "hello",
    "world",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "123",
    "4567",
    "émigré",
)


def _text(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text("\n".join(_text(3000)))
    return str(path)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """A plain bf16 HF Llama folder (written by microscale's exporter: no torch here)."""
    folder = tmp_path_factory.mktemp("hf") / "model"
    tok = train_bpe(_text(200, seed=1), 300)
    model = Transformer(MODEL, rngs=nnx.Rngs(3))
    export_checkpoint(model, folder, layer_formats="bf16", dtype="bfloat16", tokenizer=tok)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    return folder


@pytest.fixture(scope="module")
def big_tokenizer(hf, tmp_path_factory) -> Path:
    """The folder's tokenizer plus 40 added tokens: ids 300..339, past the 320 rows."""
    tok = load_tokenizer(hf / "tokenizer.json")
    tok.hf.add_tokens([f"<extra_{i}>" for i in range(40)])
    path = tmp_path_factory.mktemp("bigtok") / "tokenizer.json"
    BPETokenizer(tok.hf).save(path)
    assert load_tokenizer(path).vocab_size == 340
    return path


@pytest.fixture(scope="module")
def run(hf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "imported"
    assert main(["import", "--model", str(hf), "--out", str(out), "-q"]) == 0
    return out


def _edited(hf: Path, dst: Path, **changes) -> Path:
    shutil.copytree(hf, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_import_is_the_hf_model_bit_for_bit(hf, run):
    model, cfg, meta = load_checkpoint(run)
    assert cfg.model == MODEL  # every field of config.json: theta, eps, tying, vocab, context
    assert meta["step"] == 0 and meta["init_from"]["kind"] == "hf"
    # the run's tokenizer is the folder's own file, byte for byte, and the config names it
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (run / name).read_bytes() == (hf / name).read_bytes(), name
    assert cfg.data.tokenizer == str(run / "tokenizer.json")
    assert json.loads((run / "summary.json").read_text())["status"] == "imported"
    # the weights: float32 master copies of the bf16 tensors, exactly
    store = TensorStore(hf)
    params = {
        ".".join(str(p) for p in k): np.asarray(v[...])
        for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    assert len(params) == len(store.names()) == 2 + 1 + 2 * 9
    for name in store.names():
        stored = np.asarray(store.get(name))
        assert stored.dtype == ml_dtypes.bfloat16
        got = params[ms_param_name(name)]
        got = got.T if name.endswith("proj.weight") or name == "lm_head.weight" else got
        assert got.dtype == np.float32
        np.testing.assert_array_equal(
            got.astype(ml_dtypes.bfloat16).view(np.uint16), stored.view(np.uint16), err_msg=name
        )
        np.testing.assert_array_equal(got, stored.astype(np.float32), err_msg=name)
    assert main(["verify", str(run), "-q"]) == 0


@pytest.mark.slow
def test_imported_run_evaluates_like_the_folder(hf, run, corpus, capsys):
    out = []
    for m in (hf, run):
        assert main(["eval", "-m", str(m), "--data", corpus, "--seq-len", "32", "--json"]) == 0
        out.append(json.loads(capsys.readouterr().out))
    assert out[0]["tokens"] == out[1]["tokens"] > 1000
    assert out[0]["nll"] == out[1]["nll"]
    # eval --formats quantizes a plain HF folder's float weights in memory
    assert (
        main(
            [
                "eval",
                "-m",
                str(hf),
                "--data",
                corpus,
                "--seq-len",
                "32",
                "--json",
                "--formats",
                "nvfp4",
            ]
        )
        == 0
    )
    q = json.loads(capsys.readouterr().out)
    assert q["nll"] != out[0]["nll"] and abs(q["nll"] - out[0]["nll"]) < 0.05


def test_exports_of_the_run_carry_the_tokenizer_files(run, tmp_path, capsys):
    out = tmp_path / "ct"
    assert main(["export", "-m", str(run), "--out", str(out), "formats=bf16"]) == 0
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        assert (out / name).read_bytes() == (run / name).read_bytes(), name
    gguf = pytest.importorskip("gguf", exc_type=ImportError)
    path = tmp_path / "m.gguf"
    assert main(["export", "-m", str(run), "--out", str(path), "layout=gguf", "formats=bf16"]) == 0
    field = gguf.GGUFReader(path).fields["tokenizer.chat_template"]
    assert field.contents() == (run / "chat_template.jinja").read_text()


@pytest.mark.slow
def test_export_names_the_bits_of_the_linear_layers_and_of_the_whole_model(run, tmp_path, capsys):
    assert main(["export", "-m", str(run), "--out", str(tmp_path / "x"), "formats=nvfp4"]) == 0
    out = capsys.readouterr().out
    lin = MODEL.num_linear_params()
    whole = (4.5 * lin + 16 * (MODEL.num_params() - lin)) / MODEL.num_params()
    assert whole > 8  # this tiny model is mostly embedding and LM head
    assert f"4.500 bits per weight in the linear layers, {whole:.3f} in the whole model" in out, out


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 8.0}},
            "rope_scaling.rope_type='longrope'",
        ),
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mscale": 1.0}},
            "rope_scaling.mscale=1.0: not a parameter of rope_type 'linear'",
        ),
        ({"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]}, "model_type='gemma3'"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_interleaved": True}, "rope_interleaved"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 32}, "q_proj.weight' has shape"),  # a head_dim the tensors lack
        ({"intermediate_size": 256}, "gate_proj.weight' has shape [128, 64]"),  # tensors disagree
        ({"vocab_size": 288}, "300"),  # the tokenizer's 300 ids do not fit 288 rows
    ],
)
def test_import_refuses_what_it_cannot_represent(hf, tmp_path, capsys, change, expected):
    src = _edited(hf, tmp_path / "src", **change)
    out = tmp_path / "run"
    assert main(["import", "--model", str(src), "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing half-made


@pytest.mark.slow
def test_smollm2_config_json_imports(tmp_path):
    """SmolLM2-135M-Instruct's config.json as published (2 of its 30 layers, a smaller
    vocabulary): every field is read or harmless; 9 heads of 64, theta 100000, tied."""
    smol = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 576,
        "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536,
        "is_llama_config": True,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 9,
        "num_hidden_layers": 2,
        "num_key_value_heads": 3,
        "pad_token_id": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_interleaved": False,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3",
        "use_cache": True,
        "vocab_size": 512,
    }
    want = ModelConfig(
        vocab_size=512,
        d_model=576,
        n_layers=2,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
        max_seq_len=8192,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        init_std=smol["initializer_range"],
    )
    src = tmp_path / "smol"
    export_checkpoint(
        Transformer(want, rngs=nnx.Rngs(0)),
        src,
        layer_formats="bf16",
        tokenizer=train_bpe(_text(100), 300),
    )
    (src / "config.json").write_text(json.dumps(smol))
    assert main(["import", "--model", str(src), "--out", str(tmp_path / "run"), "-q"]) == 0
    _, cfg, _ = load_checkpoint(tmp_path / "run")
    assert cfg.model == want
    assert cfg.data.seq_len == 256


def test_import_refuses_a_missing_tokenizer_or_an_existing_out(hf, run, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf, src)
    (src / "tokenizer.json").unlink()
    assert main(["import", "--model", str(src), "--out", str(tmp_path / "r")]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    before = sorted(p.name for p in run.iterdir())
    assert main(["import", "--model", str(hf), "--out", str(run)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before


def test_import_leaves_nothing_when_the_weights_fail(hf, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf, src)
    w = src / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size - 1000])  # truncated
    assert main(["import", "--model", str(src), "--out", str(tmp_path / "r")]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_init_from_takes_the_model_and_tokenizer_of_the_source(hf, run, tmp_path):
    for src, where in ((hf, "config.json"), (run, "config.yaml")):
        cfg = resolve_config("tiny", [f"init_from={src}"])
        assert cfg.model == MODEL and cfg.data.seq_len == 64  # tiny's 128 > the context
        assert cfg.data.tokenizer == str(src / "tokenizer.json")
        # how the model runs may change; a shorter context too
        cfg = resolve_config(
            "tiny",
            [
                f"init_from={src}",
                "model.remat=full",
                "model.max_seq_len=32",
                "seq_len=32",
                "model.vocab_size=320",
                "data.tokenizer=byte",
            ],
        )
        assert cfg.model == MODEL.replace(remat="full", max_seq_len=32)
        assert cfg.data.tokenizer == "byte"
        # what defines the model may not
        for key, value, theirs in (
            ("model.d_ff", 256, "intermediate_size=128"),
            ("model.rope_theta", 10000.0, "rope_theta=100000.0"),
            ("model.tie_embeddings", True, "tie_word_embeddings=False"),
            ("model.max_seq_len", 128, "max_position_embeddings=64"),
        ):
            with pytest.raises(ConfigError) as e:
                resolve_config("tiny", [f"init_from={src}", f"{key}={value}"])
            msg = str(e.value)
            assert f"{key}={value}" in msg and where in msg, msg
            if where == "config.json":
                assert theirs in msg, msg
    # an HF folder without its tokenizer: the preset's byte tokenizer is not assumed
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer.json; name the model's own"):
        resolve_config("tiny", [f"init_from={bare}"])
    cfg = resolve_config("tiny", [f"init_from={bare}", f"data.tokenizer={hf / 'tokenizer.json'}"])
    assert cfg.model == MODEL


@pytest.mark.slow
def test_init_from_a_quantize_output_takes_its_model(run, corpus, tmp_path):
    from microscale.ptq import QuantizeConfig
    from microscale.workflows import quantize_run

    qcfg = QuantizeConfig(
        budget=4.5,
        formats=("nvfp4", "bf16"),
        calib_tokens=256,
        pareto_budgets=(),
        ptq_effects=False,
        uniform_formats=("nvfp4", "bf16"),
    )
    for layout, where in (("compressed-tensors", "checkpoint"), ("microscale", None)):
        q = tmp_path / layout
        quantize_run(run, q, qcfg, corpus=corpus, eval_batches=2, layout=layout)
        cfg = resolve_config("tiny", [f"init_from={q}"])
        assert cfg.model == MODEL, layout
        # the packed checkpoint's own tokenizer, or (microscale's layout) the run's
        assert cfg.data.tokenizer == str((q / where if where else run) / "tokenizer.json")


# ---------------------------------------------------------------------- tokenizer mismatch


@pytest.fixture(scope="module")
def mismatched(hf, run, big_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """The HF folder and the imported run, each with the 340-id tokenizer swapped in."""
    root = tmp_path_factory.mktemp("mismatched")
    hf_bad, run_bad = root / "hf", root / "run"
    shutil.copytree(hf, hf_bad)
    shutil.copytree(run, run_bad)
    for d in (hf_bad, run_bad):
        shutil.copyfile(big_tokenizer, d / "tokenizer.json")
    cfg = (run_bad / "config.yaml").read_text().replace(str(run), str(run_bad))
    (run_bad / "config.yaml").write_text(cfg)
    return {"hf": hf_bad, "run": run_bad, "tok": big_tokenizer}


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        [
            "train",
            "init_from={run}",
            "data.corpus={corpus}",
            "data.heldout=none",
            "steps=1",
            "tensorboard=false",
            "out={tmp}/t",
            "--no-compile-cache",
            "-q",
        ],
        [
            "train",
            "init_from={hf}",
            "data.corpus={corpus}",
            "data.heldout=none",
            "steps=1",
            "tensorboard=false",
            "out={tmp}/t",
            "--no-compile-cache",
            "-q",
        ],
        [
            "train",
            "init_from={good_run}",
            "data.tokenizer={tok}",
            "data.corpus={corpus}",
            "data.heldout=none",
            "steps=1",
            "tensorboard=false",
            "out={tmp}/t",
            "-q",
        ],
        ["eval", "-m", "{run}", "--data", "{corpus}"],
        ["eval", "-m", "{hf}", "--data", "{corpus}"],
        ["generate", "-m", "{run}", "-p", "hello"],
        ["generate", "-m", "{hf}", "-p", "hello"],
        ["quantize", "-m", "{run}", "--out", "{tmp}/q", "corpus={corpus}"],
        ["export", "-m", "{run}", "--out", "{tmp}/x"],
        ["export", "-m", "{run}", "--out", "{tmp}/x.gguf", "layout=gguf"],
    ],
    ids=[
        "train-run",
        "train-hf",
        "train-override",
        "eval-run",
        "eval-hf",
        "generate-run",
        "generate-hf",
        "quantize",
        "export",
        "export-gguf",
    ],
)
def test_every_command_refuses_ids_the_model_cannot_embed(
    argv, mismatched, run, corpus, tmp_path, capsys
):
    places = {**mismatched, "good_run": run, "corpus": corpus, "tmp": tmp_path}
    rc = main([a.format(**places) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "token ids up to 339 (340 ids)" in err and "model embeds 320" in err, err


SMOLLM2 = ModelConfig(  # SmolLM2-135M's shape: 30 blocks of 576, 9 heads, vocab 49152
    vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
    max_seq_len=8192, dim_multiple=32,
)  # fmt: skip


@pytest.mark.parametrize(
    "model, batch, seq, want",
    [
        # 4 B x 8 x 49152 = 1.5 MiB of logits per position: 170 fit 256 MiB -> 128
        (SMOLLM2, 8, 512, dict(loss_chunk=128, attention_chunk=0)),
        # scores 4 B x 8 x 9 x 4096 = 1.1 MiB per query position: 227 fit -> 128
        (SMOLLM2, 8, 4096, dict(loss_chunk=128, attention_chunk=128)),
        # one sequence: all 512 positions' logits (96 MiB) fit at once
        (SMOLLM2, 1, 512, dict(loss_chunk=0, attention_chunk=0)),
        (ModelConfig.preset("llama-1b"), 1, 2048, dict(loss_chunk=512, attention_chunk=1024)),
        (MODEL, 8, 64, None),  # below 50M parameters: the config's settings stand
    ],
    ids=["smollm2-8x512", "smollm2-8x4096", "smollm2-1x512", "llama1b-1x2048", "tiny"],
)
def test_memory_defaults_of_an_adopted_model(model, batch, seq, want):
    from microscale.train.init import memory_defaults

    got = memory_defaults(model, batch, seq)
    if want is None:
        assert got == {}
        return
    assert got == {**want, "remat": "full", "scan_layers": True}


def test_init_from_takes_the_sources_context_before_the_overrides(tmp_path):
    """data.seq_len past the preset's context but within the source's is not refused
    against the preset (tiny's 256), and an explicit model.remat wins over the defaults."""
    src = tmp_path / "long"
    model = MODEL.replace(max_seq_len=1024)
    export_checkpoint(
        Transformer(model, rngs=nnx.Rngs(0)), src, layer_formats="bf16",
        tokenizer=train_bpe(_text(100), 300),
    )  # fmt: skip
    cfg = resolve_config("tiny", [f"init_from={src}", "data.seq_len=512"])
    assert cfg.data.seq_len == 512 and cfg.model.max_seq_len == 1024
    with pytest.raises(ConfigError, match="data.seq_len=2048 exceeds model.max_seq_len=1024"):
        resolve_config("tiny", [f"init_from={src}", "data.seq_len=2048"])


# ---------------------------------------------------------------------- another family

GEMMA = ModelConfig(
    family="gemma3", vocab_size=320, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
    d_ff=128, max_seq_len=64, sliding_window=8, sliding_window_pattern=3,
    rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=32.0, norm_eps=1e-6,
)  # fmt: skip


@pytest.mark.slow
def test_init_from_a_gemma3_folder_trains_the_gemma3_model(corpus, tmp_path):
    """A Gemma 3 folder's model (local/global layers, their RoPE bases, the scores' scale)
    comes in whole, an override of what defines it is refused in config.json's names, and
    a training step runs from its weights (quantized in nvfp4: the same block)."""
    folder = tmp_path / "gemma"
    tok = train_bpe(_text(200, seed=1), 300)
    model = Transformer(GEMMA, rngs=nnx.Rngs(3))
    export_checkpoint(model, folder, layout="hf", dtype="float32", tokenizer=tok)
    cfg = resolve_config("tiny", [f"init_from={folder}"])
    assert cfg.model == GEMMA
    for key, value, theirs in (
        ("model.sliding_window_pattern", 6, "sliding_window_pattern=3"),
        ("model.rope_local_theta", 1e5, "rope_local_base_freq=10000.0"),
        ("model.query_pre_attn_scalar", 16.0, "query_pre_attn_scalar=32.0"),
    ):
        with pytest.raises(ConfigError) as e:
            resolve_config("tiny", [f"init_from={folder}", f"{key}={value}"])
        assert theirs in str(e.value), str(e.value)
    out = tmp_path / "t"
    argv = ["train", f"init_from={folder}", f"data.corpus={corpus}", "data.heldout=none",
            "steps=1", "recipe=nvfp4", "tensorboard=false", f"out={out}",
            "--no-compile-cache", "-q"]  # fmt: skip
    assert main(argv) == 0
    _, run_cfg, _ = load_checkpoint(out)
    assert run_cfg.model.family == "gemma3" and run_cfg.model.sliding_window_pattern == 3
