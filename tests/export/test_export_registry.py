"""The layout registry: one row per layout, one detect(path) for which layout a path holds
(what kind of output it is: tests/test_outputs.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from microscale.export import flat_params
from microscale.export.registry import (
    KINDS,
    Layout,
    detect,
    get_layout,
    layout_names,
)
from microscale.formats import dequantize, quantize
from microscale.outputs import QuantizeOutput, TrainingRun, kind_of


def _folder(root, name, files=(), dirs=()):
    d = root / name
    d.mkdir()
    for f, text in files:
        (d / f).write_text(text)
    for sub in dirs:
        (d / sub).mkdir()
    return d


def test_detect_recognizes_each_kind_by_its_files(tmp_path):
    ct = json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}})
    mo = json.dumps({"quantization_config": {"quant_method": "modelopt"}})
    run = _folder(tmp_path, "run", [("config.yaml", "")], ["checkpoints"])
    q = _folder(tmp_path, "q", [("report.json", "{}"), ("precision_rules.json", "{}")])
    assert detect(run) is None and detect(q) is None  # output kinds: microscale.outputs
    assert kind_of(run) is TrainingRun and kind_of(q) is QuantizeOutput
    cases = {
        "compressed-tensors": _folder(tmp_path, "ct", [("config.json", ct)]),
        "modelopt": _folder(tmp_path, "mo", [("config.json", mo)]),
        "hf": _folder(tmp_path, "hf", [("config.json", "{}")]),
        "microscale": _folder(tmp_path, "ms", [("manifest.json", "{}")]),
    }
    # ModelOpt's own file marks the layout even without a quantization_config
    cases["modelopt (hf_quant_config.json)"] = _folder(
        tmp_path, "mo2", [("config.json", "{}"), ("hf_quant_config.json", "{}")]
    )
    gguf = tmp_path / "m.bin"
    gguf.write_bytes(b"GGUF" + bytes(8))
    cases["gguf"] = gguf
    for name, path in cases.items():
        assert detect(path).name == name.split(" (")[0], name
    # unknown or unreadable configs are left to the reader, which names the problem
    assert (
        detect(
            _folder(
                tmp_path,
                "gptq",
                [("config.json", json.dumps({"quantization_config": {"quant_method": "gptq"}}))],
            )
        ).name
        == "hf"
    )
    assert detect(_folder(tmp_path, "bad", [("config.json", "{not json")])).name == "hf"
    assert detect(_folder(tmp_path, "empty")) is None
    assert detect(tmp_path / "missing") is None
    (tmp_path / "notes.txt").write_text("hello")
    assert detect(tmp_path / "notes.txt") is None


def test_first_matching_row_wins(tmp_path):
    # a run folder that also holds an HF config.json is a run (the kinds come first)
    both = _folder(tmp_path, "both", [("config.yaml", ""), ("config.json", "{}")], ["checkpoints"])
    assert kind_of(both) is TrainingRun
    # an HF folder beside a manifest is read as the HF folder
    assert (
        detect(_folder(tmp_path, "x", [("config.json", "{}"), ("manifest.json", "{}")])).name
        == "hf"
    )


def test_layout_rows_and_names():
    rows = [k for k in KINDS if isinstance(k, Layout)]
    assert [r.name for r in rows] == list(layout_names())
    assert set(layout_names()) == {"compressed-tensors", "modelopt", "hf", "gguf", "microscale"}
    assert layout_names(single_file=True) == ("gguf",)
    assert len({k.name for k in KINDS}) == len(KINDS)
    for r in rows:
        assert get_layout(r.name) is r
        assert r.description and callable(r.write) and callable(r.read)
    with pytest.raises(ValueError, match=r"layout 'onnx': expected one of compressed-tensors"):
        get_layout("onnx")


@pytest.mark.parametrize("name", ["compressed-tensors", "modelopt", "hf"])
def test_each_hf_layout_writes_what_it_detects_and_reads(tiny_model, tiny_cfg, tmp_path, name):
    row = get_layout(name)
    formats = {"hf": "bf16", "modelopt": "nvfp4"}.get(name, "fp8_e4m3")
    res = row.write(tiny_model, tmp_path / name, layer_formats=formats)
    assert res.layout == name and res.config == tiny_cfg
    assert detect(res.path) is row
    params, cfg = row.read(res.path)
    assert cfg.d_model == tiny_cfg.d_model
    ref = flat_params(tiny_model)
    assert set(params) == set(ref)
    for k, v in ref.items():  # bf16 storage; quantized kernels within a few steps
        v = np.asarray(v)
        if formats != "bf16" and k.endswith("_proj.kernel"):
            err = np.linalg.norm(params[k] - v) / np.linalg.norm(v)
            assert err < (0.15 if formats == "nvfp4" else 0.05), (k, err)
        else:
            np.testing.assert_allclose(params[k], v, rtol=0.01, atol=0.002, err_msg=k)


def test_hf_layout_refuses_quantized_layers(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="layout='hf' stores float weights only"):
        get_layout("hf").write(tiny_model, tmp_path / "x", layer_formats="nvfp4")


def test_gguf_row_writes_and_reads_a_file(tiny_model, tiny_cfg, tmp_path):
    pytest.importorskip("gguf")
    from microscale.data import ByteTokenizer

    row = get_layout("gguf")
    res = row.write(
        tiny_model,
        tmp_path / "m.gguf",
        layer_formats="bf16",
        tokenizer=ByteTokenizer(),
        dtype="float32",
    )
    assert res.describe()["layout"] == "gguf" and detect(res.path) is row
    params, cfg = row.read(res.path)
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size) == (tiny_cfg.n_layers, tiny_cfg.d_model, 257)
    for k, v in flat_params(tiny_model).items():  # float32: exact, RoPE rows put back
        np.testing.assert_array_equal(params[k], np.asarray(v, np.float32), err_msg=k)
    with pytest.raises(ValueError, match="GGUF stores weights only"):
        row.write(tiny_model, tmp_path / "n.gguf", activations=True)
    with pytest.raises(ValueError, match="shard_bytes=5: a GGUF is one file"):
        row.write(tiny_model, tmp_path / "n.gguf", shard_bytes=5)


def test_microscale_row_stores_ptq_weights(tiny_model, tmp_path):
    """The row moved out of ptq/report.py: write_manifest / read_manifest round trip."""
    row = get_layout("microscale")
    params = flat_params(tiny_model)
    path = "layers.0.attn.q_proj"

    class Weight:  # what PTQ holds per layer
        qarray = quantize(np.asarray(params[f"{path}.kernel"]).T, "nvfp4", axis=-1)
        format, amax, scale_multiplier = "nvfp4", 1.5, 1.0

    desc = row.write(
        tmp_path / "ck",
        params=params,
        weights={path: Weight},
        activations=True,
        input_amax={path: 2.5},
        rules={"default": "bf16"},
    )
    assert desc["files"] == ["model.safetensors", "manifest.json"]
    assert detect(tmp_path / "ck") is row
    flat, cfg = row.read(tmp_path / "ck")
    assert cfg is None and set(flat) == set(params)
    np.testing.assert_array_equal(
        flat[f"{path}.kernel"], np.asarray(dequantize(Weight.qarray, np.float32)).T
    )
    np.testing.assert_array_equal(flat["embed.embedding"], np.asarray(params["embed.embedding"]))
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["layers"][path]["input_amax"] == 2.5
    assert manifest["format"] == "microscale-ptq" and manifest["rules"] == {"default": "bf16"}


def test_hf_quant_rows_are_the_registry_rows_of_hf_style_layouts(tiny_cfg, tmp_path):
    from microscale.export import LAYOUTS, CheckpointError, hf_config, read_checkpoint
    from microscale.export.hflayouts import HF_QUANT, hf_quant

    assert LAYOUTS == tuple(HF_QUANT) == ("compressed-tensors", "modelopt")
    for name, q in HF_QUANT.items():
        row = get_layout(name)
        assert row.hf_folder and row.quantized and row.description == q.description
    assert hf_quant("modelopt").global_scale == "weight_scale_2"
    with pytest.raises(ValueError, match=r"layout='awq': expected one of \('compressed-tensors'"):
        hf_quant("awq")
    cfg = {**hf_config(tiny_cfg, dtype="float32"), "quantization_config": {"quant_method": "gptq"}}
    folder = _folder(tmp_path, "gptq", [("config.json", json.dumps(cfg))])
    with pytest.raises(
        CheckpointError, match="quant_method='gptq': expected 'compressed-tensors' or 'modelopt'"
    ):
        read_checkpoint(folder)


def test_export_run_is_the_library_function_behind_the_cli(tiny_model, tmp_path):
    from microscale.export import read_checkpoint
    from microscale.inference.export_run import export_run

    plain = get_layout("hf").write(tiny_model, tmp_path / "plain")  # float weights (bf16)
    assert detect(plain.path).name == "hf" and set(plain.layers.values()) == {"bf16"}
    res = export_run(plain.path, tmp_path / "ct")  # a float folder: NVFP4 by default
    assert detect(res.path).name == "compressed-tensors"
    assert set(res.layers.values()) == {"nvfp4"} and res.config.d_model == 64
    mo = export_run(res.path, tmp_path / "mo", layout="modelopt")  # conversion keeps bytes
    a, b = read_checkpoint(res.path), read_checkpoint(mo.path)
    for k, q in a.params.items():
        if hasattr(q, "data"):
            np.testing.assert_array_equal(np.asarray(q.data), np.asarray(b.params[k].data))
    with pytest.raises(ValueError, match="layout 'onnx': expected one of"):
        export_run(plain.path, tmp_path / "x", layout="onnx")
    with pytest.raises(ValueError, match="calib_batches=2 has no effect without activations"):
        export_run(plain.path, tmp_path / "y", calib_batches=2)
    with pytest.raises(
        ValueError, match="activations=True with layout=gguf: a GGUF stores weights only"
    ):
        export_run(plain.path, tmp_path / "z.gguf", layout="gguf", activations=True)
    with pytest.raises(FileNotFoundError, match="neither a training run"):
        export_run(tmp_path, tmp_path / "w")  # a folder of folders, none a model


def test_the_refusals_come_from_the_row():
    """Each capability a caller reads is a field: weights-only layouts refuse input scales
    with their own reason, and the table formats a search may score are the rows'."""
    from microscale.export.registry import KINDS, Layout, stored_embed_formats, table_values

    for row in (k for k in KINDS if isinstance(k, Layout)):
        if row.weights_only is None:
            row.refuse_activations()  # stores input scales: nothing to refuse
            assert row.input_scales
        else:
            with pytest.raises(ValueError, match=re.escape(row.weights_only)):
                row.refuse_activations()
        assert bool(row.embed_formats) == (row.embed_values is not None), row.name
    assert set(stored_embed_formats()) == set(get_layout("gguf").embed_formats)
    with pytest.raises(ValueError, match="no layout stores a token embedding in it"):
        table_values(np.zeros((4, 32), np.float32), "nvfp4")
