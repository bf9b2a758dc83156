"""init_from=: fine-tuning starts where the source model's evaluation ended, for every source
kind (run folder, `microscale quantize` output, HF Llama folder); mismatches are named."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from microscale.train import train

# Same weights, same validation batches: the bf16 evaluation repeats to float32 noise.
SAME = 1e-4


def _records(out, kind):
    lines = Path(out, "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _eval_at(out, step):
    return next(r["val_loss"] for r in _records(out, "eval") if r["step"] == step)


def _event(out, name):
    return next(r for r in _records(out, "event") if r["event"] == name)


@pytest.fixture
def source_run(make_cfg, tmp_path):
    cfg = make_cfg(
        "steps=10",
        "eval_every=5",
        "checkpoint_every=5",
        "keep_checkpoints=3",
        f"out={tmp_path / 'src'}",
    )
    train(cfg, progress=False)
    return cfg


@pytest.mark.slow
def test_init_from_run_latest_and_given_step(make_cfg, source_run, tmp_path):
    src = source_run.out
    ft = make_cfg(
        f"init_from={src}",
        "steps=4",
        "eval_every=2",
        "optim.warmup_steps=2",
        f"out={tmp_path / 'ft'}",
    )
    s = train(ft, progress=False)
    # starts where the source's last evaluation ended, then keeps learning
    assert abs(_eval_at(ft.out, 0) - _eval_at(src, 10)) < SAME
    assert s["init_from"]["kind"] == "run" and s["init_from"]["step"] == 10
    assert s["init_from"]["weights"] == "master"
    ev = _event(ft.out, "init_from")
    assert ev["step"] == 0 and ev["source"]["path"] == src
    # fresh optimizer and schedule: step 1's learning rate is the new warmup's first value
    first = _records(ft.out, "train")[0]
    assert first["step"] == 1 and first["lr"] < ft.optim.lr
    # an earlier step of the source
    ft5 = make_cfg(f"init_from={src}", "init_step=5", "steps=2", f"out={tmp_path / 'ft5'}")
    s5 = train(ft5, progress=False)
    assert abs(_eval_at(ft5.out, 0) - _eval_at(src, 5)) < SAME
    assert s5["init_from"]["step"] == 5
    assert abs(_eval_at(ft5.out, 0) - _eval_at(src, 10)) > 10 * SAME  # really step 5


@pytest.mark.slow
def test_init_from_quantize_output_master_then_dequantized(make_cfg, source_run, tmp_path):
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
    for layout in ("microscale", "compressed-tensors"):
        q = tmp_path / f"q-{layout}"
        res = quantize_run(source_run.out, q, qcfg, layout=layout)
        assert set(res.allocation.formats.values()) == {"nvfp4"}
        # the quantized run's master weights
        ft = make_cfg(f"init_from={q}", "steps=1", f"out={tmp_path / ('m-' + layout)}")
        s = train(ft, progress=False)
        assert s["init_from"]["kind"] == "quantize" and s["init_from"]["weights"] == "master"
        assert abs(_eval_at(ft.out, 0) - _eval_at(source_run.out, 10)) < SAME
        # the source run is gone: the packed checkpoint's dequantized weights, and it says so
        report = json.loads((q / "report.json").read_text())
        report["calibration"]["run_dir"] = str(tmp_path / "gone")
        (q / "report.json").write_text(json.dumps(report))
        ft = make_cfg(f"init_from={q}", "steps=1", f"out={tmp_path / ('d-' + layout)}")
        s = train(ft, progress=False)
        assert s["init_from"]["weights"] == "dequantized"
        assert "dequantized" in s["init_from"]["note"] and "gone" in s["init_from"]["note"]
        # = the uniform-NVFP4 PTQ loss the quantize run measured on the same batches
        # (bf16 rounding of the decoded weights differs by the last bit only)
        assert abs(_eval_at(ft.out, 0) - report["points"]["uniform_nvfp4"]["val_loss"]) < 2e-3


@pytest.mark.slow
def test_init_from_hf_llama_matches_transformers_loss(make_cfg, tmp_path):
    torch = pytest.importorskip("torch", exc_type=ImportError)
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    from microscale.data import load_data

    ft = make_cfg("steps=2", "eval_every=1", f"out={tmp_path / 'ft'}")
    m = ft.model
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.d_ff,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        max_position_embeddings=m.max_seq_len,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )  # far from a fresh init: the loss shows whose weights run
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)

    batches = load_data(ft.data).val_batches("val")
    with torch.no_grad():
        losses = []
        for b in batches:
            t = torch.tensor(np.asarray(b), dtype=torch.long)
            logits = hf(t[:, :-1]).logits.float()
            losses.append(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1)
                ).item()
            )
    ref = float(np.mean(losses))
    assert abs(ref - math.log(m.vocab_size)) > 0.5

    s = train(
        make_cfg("steps=2", "eval_every=1", f"init_from={folder}", f"out={tmp_path / 'ft'}"),
        progress=False,
    )
    assert s["init_from"]["kind"] == "hf" and s["init_from"]["weights"] == "master"
    # microscale's forward rounds matmul operands to bf16 (the bf16 recipe): ~1e-3 nats
    assert abs(_eval_at(ft.out, 0) - ref) < 0.02 * ref


@pytest.mark.slow
def test_mismatches_are_all_named(make_cfg, source_run, tmp_path):
    wide = make_cfg(
        f"init_from={source_run.out}", "model.d_ff=128", "steps=1", f"out={tmp_path / 'x'}"
    )
    with pytest.raises(ValueError) as e:
        train(wide, progress=False)
    msg = str(e.value)
    # the cause first, then a short table: the first four mismatches and the count
    assert msg.index("model.d_ff=64 (config: 128)") < msg.index("6 mismatch(es)")
    for name in (
        "layers.0.mlp.gate_proj.kernel",
        "layers.0.mlp.up_proj.kernel",
        "layers.0.mlp.down_proj.kernel",
        "layers.1.mlp.down_proj.kernel",
    ):
        assert f"{name} has shape" in msg, name
    assert "layers.1.mlp.up_proj.kernel" not in msg and msg.endswith("; and 2 more")
    # the failed run leaves no half-made folder; a folder that existed before is kept
    assert not (tmp_path / "x").exists()
    (tmp_path / "y").mkdir()
    with pytest.raises(ValueError):
        train(dataclasses.replace(wide, out=str(tmp_path / "y")), progress=False)
    assert (tmp_path / "y").is_dir()
    # a deeper model: the new block's parameters are missing, each named
    from microscale.export.hf import param_shapes
    from microscale.train.init import check_init_shapes, load_init_weights

    weights, src = load_init_weights(source_run.out)
    deep = source_run.model.replace(n_layers=3)
    with pytest.raises(ValueError) as e:
        check_init_shapes(weights, param_shapes(deep), src, deep)
    msg = str(e.value)
    assert "layers.2.mlp_norm.scale is missing" in msg
    assert "layers.2.attn.q_proj.kernel is missing" in msg
    assert "model.n_layers=2 (config: 3)" in msg and "9 mismatch(es)" in msg
    assert "down_proj" not in msg and msg.endswith("; and 5 more")
    # a model of another size altogether: one short line, not one entry per parameter
    big = source_run.model.replace(n_layers=40, d_model=128)
    with pytest.raises(ValueError) as e:
        check_init_shapes(weights, param_shapes(big), src, big)
    assert len(str(e.value)) < 700 and "more" in str(e.value), str(e.value)


# (overrides, text of the one line, refused before the run folder and its checkpointer
# exist). {empty}: an empty folder; {gguf}: a GGUF file; {quantize}: a folder that detects
# as a quantize output (report.json + precision_rules.json) but names no source run.
BAD_INIT_FROM = [
    (["init_from=/nonexistent/model"], "does not exist", True),
    (["init_step=3"], "init_step=3 needs init_from", True),
    (["init_from={empty}"], "is not a model folder", True),
    (["init_from={gguf}"], "model.gguf' is a file (", True),
    (["init_from={empty}/no-such-run"], "no-such-run' does not exist; expected", True),
    (["init_from={quantize}", "init_step=2"], "applies to a run folder", False),
]


@pytest.mark.parametrize("overrides, expected, early", BAD_INIT_FROM)
def test_bad_init_from_is_one_line(
    make_cfg, tmp_path, capsys, monkeypatch, overrides, expected, early
):
    """Each bad source is one line, exit 2, like ``microscale import`` and ``quantize`` give
    for the same path (``check_model_source``); a path that is no model folder is refused
    before the run folder and its checkpointer exist (whose background clean-up, racing the
    removal of a run that never started, used to end in orbax's traceback), and no folder
    is left behind."""
    from microscale.cli import main
    from microscale.train import loop

    empty = tmp_path / "empty"
    empty.mkdir()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    quantize = tmp_path / "q"
    quantize.mkdir()
    for name in ("report.json", "precision_rules.json"):
        (quantize / name).write_text("{}")
    built = []
    real = loop.Checkpointer
    monkeypatch.setattr(loop, "Checkpointer", lambda *a, **k: built.append(a) or real(*a, **k))
    cfg = make_cfg()
    args = [o.format(empty=empty, gguf=gguf, quantize=quantize) for o in overrides]
    m = cfg.model
    rc = main(
        [
            "train",
            "--config",
            "tiny",
            "-q",
            "--no-compile-cache",
            f"model.d_model={m.d_model}",
            f"model.n_heads={m.n_heads}",
            f"model.n_kv_heads={m.n_kv_heads}",
            f"model.d_ff={m.d_ff}",
            f"data.corpus={cfg.data.corpus}",
            "data.heldout=none",
            f"data.cache_dir={cfg.data.cache_dir}",
            "tensorboard=false",
            f"out={tmp_path / 'o'}",
            "steps=1",
            *args,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
    assert lines[0].startswith("microscale train: error: "), err
    assert (built == []) is early, built
    assert not (tmp_path / "o").exists()


def test_checkpointer_close_waits_for_its_cleanup(tmp_path):
    """Closing a checkpointer waits for the removal of a killed save's leftovers that
    opening it started in the background, so the folder can be removed right after."""
    import shutil

    from microscale.train import Checkpointer

    (tmp_path / "c" / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)
    ck = Checkpointer(tmp_path / "c")
    ck.close()
    assert getattr(ck._mgr, "_cleanup_tmp_directory_future", None) is None
    assert not (tmp_path / "c" / "3.orbax-checkpoint-tmp-1").exists()
    shutil.rmtree(tmp_path / "c")
