"""Loading is safe: truncated files, wrong shapes or dtypes, missing or unexpected tensors,
bad scales and unsupported configs are rejected before use, naming the tensor / field."""

import json

import numpy as np
import pytest

from microscale.export import (
    CheckpointError,
    TensorStore,
    export_checkpoint,
    model_config_from_hf,
    read_checkpoint,
    write_safetensors,
)

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct")
    export_checkpoint(tiny_model, out)
    return out


def _copy_with(src, dst, change):
    """Copy the folder ``src`` to ``dst`` with ``change(tensors dict)`` applied."""
    dst.mkdir()
    store = TensorStore(src)
    tensors = {k: np.array(store.get(k)) for k in store.names()}
    change(tensors)
    write_safetensors(dst / "model.safetensors", tensors, {"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_reference_folder_reads(exported):
    assert read_checkpoint(exported).layout == "compressed-tensors"


def test_missing_tensor_named(exported, tmp_path):
    d = _copy_with(exported, tmp_path / "x", lambda t: t.pop(f"{Q}.weight_scale"))
    with pytest.raises(CheckpointError, match=rf"'{Q}\.weight_scale' is missing"):
        read_checkpoint(d)
    d = _copy_with(exported, tmp_path / "y", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is missing"):
        read_checkpoint(d)


def test_wrong_shape_named(exported, tmp_path):
    def change(t):
        t[f"{Q}.weight_packed"] = t[f"{Q}.weight_packed"][:, :-1].copy()

    d = _copy_with(exported, tmp_path / "x", change)
    with pytest.raises(
        CheckpointError,
        match=rf"'{Q}\.weight_packed' has shape \[64, 31\]; "
        r"expected \[64, 32\]",
    ):
        read_checkpoint(d)


def test_wrong_dtype_named(exported, tmp_path):
    def change(t):
        t[f"{Q}.weight_scale"] = t[f"{Q}.weight_scale"].astype(np.float32)

    d = _copy_with(exported, tmp_path / "x", change)
    with pytest.raises(
        CheckpointError,
        match=rf"'{Q}\.weight_scale' has dtype F32; "
        "expected F8_E4M3",
    ):
        read_checkpoint(d)


def test_unexpected_tensor_named(exported, tmp_path):
    def change(t):
        t[f"{Q}.input_global_scale"] = np.ones((1,), np.float32)  # W4A16 config

    d = _copy_with(exported, tmp_path / "x", change)
    with pytest.raises(CheckpointError, match=rf"'{Q}\.input_global_scale' is not expected"):
        read_checkpoint(d)


@pytest.mark.parametrize("value", [0.0, np.nan, np.inf, -1.0])
def test_bad_global_scale_named(exported, tmp_path, value):
    def change(t):
        t[f"{Q}.weight_global_scale"] = np.array([value], np.float32)

    d = _copy_with(exported, tmp_path / "x", change)
    with pytest.raises(CheckpointError, match=rf"'{Q}\.weight_global_scale'.*finite"):
        read_checkpoint(d)


def test_truncated_file_named(exported, tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    raw = (exported / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: len(raw) - 1000])
    (d / "config.json").write_text((exported / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"tensor '.*'.*truncated"):
        read_checkpoint(d)


def test_config_and_tensors_disagree(exported, tmp_path):
    """Config says 2 layers; tensors of a third layer are refused."""

    def change(t):
        t["model.layers.2.input_layernorm.weight"] = np.ones(64, np.float32)

    d = _copy_with(exported, tmp_path / "x", change)
    with pytest.raises(CheckpointError, match=r"layers\.2\.input_layernorm.*not expected"):
        read_checkpoint(d)
    d = _copy_with(exported, tmp_path / "y", lambda t: None)
    cfg = json.loads((exported / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="has shape"):
        read_checkpoint(d)


def test_unknown_quant_method_and_no_pickle(exported, tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    cfg = json.loads((exported / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method='gptq'"):
        read_checkpoint(d)
    # a pickle-only folder is never opened: there is no safetensors file to read
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle
    with pytest.raises(FileNotFoundError, match="safetensors"):
        read_checkpoint(d)


@pytest.mark.parametrize(
    "inputs, match",
    [
        (
            {"num_bits": 4, "type": "int", "group_size": 128, "strategy": "group"},
            "input_activations: input activations .* match no format",
        ),
        ("nvfp4", "input_activations: expected QuantizationArgs"),
    ],
)
def test_unreadable_input_activations_named(exported, tmp_path, inputs, match):
    d = tmp_path / "x"
    d.mkdir()
    cfg = json.loads((exported / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = inputs
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes((exported / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=match):
        read_checkpoint(d)


BASE = dict(
    model_type="llama",
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(rope_scaling={"rope_type": "longrope", "factor": 8.0}),
            "rope_scaling.rope_type='longrope': not supported by microscale's RoPE",
        ),
        (dict(rope_scaling={"type": "su"}), "rope_scaling.type='su': not supported"),
        (
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
            "rope_parameters has no 'factor'",
        ),
        (
            dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "rope_scaling has no 'low_freq_factor'",
        ),
        (
            dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "short_factor": [1.0]}),
            r"rope_scaling.short_factor=\[1.0\]: not a parameter of rope_type 'linear'",
        ),
        (
            dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0, "beta_fast": 8}),
            "rope_scaling.beta_fast=8: not a parameter of rope_type 'dynamic'",
        ),
        (
            dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
            "rope_scaling.partial_rotary_factor=0.5",
        ),
        (
            dict(rope_scaling={"rope_type": "linear", "type": "dynamic", "factor": 2.0}),
            "rope_scaling.rope_type='linear' and rope_scaling.type='dynamic'",
        ),
        (dict(rope_scaling={"rope_type": "linear", "factor": 0.5}), "rope_scaling.factor=0.5"),
        (dict(rope_scaling="llama3"), "rope_scaling='llama3': expected an object"),
        (
            dict(
                rope_scaling={"rope_type": "linear", "factor": 2.0},
                rope_parameters={"rope_type": "linear", "factor": 4.0},
            ),
            "two different RoPE scalings",
        ),
        (
            dict(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
            r"rope_theta=10000.0, rope_parameters.rope_theta=500000.0: two different RoPE bases",
        ),
        (dict(rope_theta=-1.0), "rope_theta=-1.0: expected a positive number"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(head_dim=33), "head_dim = 33 is odd"),
        (dict(model_type="gpt2"), "model_type='gpt2'"),
        (dict(hidden_size="64"), "hidden_size='64'"),
        (dict(hidden_size=None), "missing required field 'hidden_size'"),
        (dict(num_attention_heads=3), "num_attention_heads=3"),
    ],
)
def test_unsupported_configs_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf({**BASE, **change})


def test_an_explicit_head_dim_comes_in():
    assert model_config_from_hf({**BASE, "head_dim": 32}).head_dim == 32
    assert model_config_from_hf({**BASE, "head_dim": 32}).attn_head_dim == 32
    derived = model_config_from_hf({**BASE, "head_dim": BASE["hidden_size"] // 4})
    assert derived.attn_head_dim is None  # the derived width is not stored twice


def test_config_mapping():
    cfg = model_config_from_hf(
        {
            **BASE,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "max_position_embeddings": 4096,
        }
    )
    assert (cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (64, 128, 2, 4, 2)
    assert cfg.rope_theta == 5e5 and cfg.norm_eps == 1e-6 and cfg.tie_embeddings
    assert cfg.max_seq_len == 4096
    odd = model_config_from_hf(
        {
            **BASE,
            "hidden_size": 48,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "intermediate_size": 80,
        }
    )
    assert odd.dim_multiple == 16
