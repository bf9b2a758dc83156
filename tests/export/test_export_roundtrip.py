"""microscale -> export -> import is exact: packed bytes, block scales, global and input
scales identical; re-export writes the same bytes; layouts convert losslessly."""

import filecmp
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from microscale.data import ByteTokenizer, load_tokenizer
from microscale.export import (
    export_checkpoint,
    fused_groups,
    input_decode_scales,
    linear_paths,
    quantize_linear_weights,
    read_checkpoint,
    resolve_layers,
    to_hf_orientation,
)
from microscale.export.layouts import exact_reciprocal
from microscale.export.params import flat_params
from microscale.formats import QArray, dequantize, quantize


def leaves_equal(a: QArray, b: QArray) -> None:
    assert a.spec == b.spec and a.axis == b.axis and tuple(a.shape) == tuple(b.shape)
    for x, y in ((a.data, b.data), (a.scales, b.scales), (a.global_scale, b.global_scale)):
        if x is None:
            assert y is None
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_round_trip_is_exact(tiny_model, tiny_cfg, mixed, tmp_path, layout):
    fmts = dict(mixed)
    if layout == "compressed-tensors":
        fmts.update(
            {
                "layers.1.mlp.gate_proj": "mxfp4",
                "layers.1.mlp.up_proj": "mxfp4",
                "layers.1.attn.o_proj": "mxfp8",
            }
        )
    amax = {p: 1.5 + 0.25 * i for i, p in enumerate(linear_paths(tiny_cfg))}
    export_checkpoint(
        tiny_model,
        tmp_path / "a",
        layout=layout,
        layer_formats=fmts,
        input_amax=amax,
        dtype="float32",
    )
    ck = read_checkpoint(tmp_path / "a")
    assert ck.layout == layout and ck.config == tiny_cfg
    lay = resolve_layers(tiny_cfg, fmts, activations=True)
    want = quantize_linear_weights(flat_params(tiny_model), tiny_cfg, lay)
    assert ck.layers == lay
    for p in linear_paths(tiny_cfg):
        got = ck.params[f"{p}.kernel"]
        if lay[p].quantized:
            leaves_equal(got, want[p])
        else:
            np.testing.assert_array_equal(got, np.asarray(want[p]))
    scales = input_decode_scales(tiny_cfg, lay, amax)
    assert set(ck.input_scales) == set(scales)
    for p, s in scales.items():
        assert ck.input_scales[p] == s, p
    src = flat_params(tiny_model)
    for name in ("embed.embedding", "final_norm.scale", "layers.1.mlp_norm.scale"):
        np.testing.assert_array_equal(ck.params[name], np.asarray(src[name]))
    # re-export of what was read: the same bytes
    export_checkpoint(ck, tmp_path / "b", layout=layout, dtype="float32")
    assert filecmp.cmp(
        tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors", shallow=False
    )
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads(
        (tmp_path / "b" / "config.json").read_text()
    )


def test_layout_conversion_keeps_the_packed_bytes(tiny_model, tiny_cfg, tmp_path):
    amax = dict.fromkeys(linear_paths(tiny_cfg), 2.0)
    export_checkpoint(tiny_model, tmp_path / "ct", input_amax=amax)
    ct = read_checkpoint(tmp_path / "ct")
    export_checkpoint(ct, tmp_path / "mo", layout="modelopt")
    mo = read_checkpoint(tmp_path / "mo")
    assert mo.layout == "modelopt" and mo.layers == ct.layers
    for p in linear_paths(tiny_cfg):
        leaves_equal(mo.params[f"{p}.kernel"], ct.params[f"{p}.kernel"])
        assert mo.input_scales[p] == ct.input_scales[p]


def test_prequantized_weights_in_either_orientation(tiny_model, tiny_cfg, tmp_path):
    """PTQ hands over QArrays: kernel orientation (K, N) axis 0 or HF (N, K) axis 1 give
    the same files, and packing along K is orientation-independent."""
    params = flat_params(tiny_model)
    lay = resolve_layers(tiny_cfg, "nvfp4")
    q = quantize_linear_weights(params, tiny_cfg, lay)
    group_amax = {
        p: max(float(jnp.max(jnp.abs(params[f"{m}.kernel"]))) for m in g)
        for g in fused_groups(tiny_cfg)
        for p in g
    }
    for p in linear_paths(tiny_cfg):  # quantizing W^T along its last axis: same bytes
        w = jnp.asarray(params[f"{p}.kernel"])
        hf = quantize(w.T, "nvfp4", axis=-1, amax=group_amax[p])
        a = to_hf_orientation(q[p])
        assert np.asarray(a.data).tobytes() == np.asarray(hf.data).tobytes()
        assert np.asarray(a.scales).tobytes() == np.asarray(hf.scales).tobytes()
    export_checkpoint(
        {**params, **{f"{p}.kernel": v for p, v in q.items()}}, tmp_path / "k", config=tiny_cfg
    )
    export_checkpoint(
        {**params, **{f"{p}.kernel": to_hf_orientation(v) for p, v in q.items()}},
        tmp_path / "h",
        config=tiny_cfg,
    )
    export_checkpoint(tiny_model, tmp_path / "m")
    for other in ("h", "m"):
        assert filecmp.cmp(
            tmp_path / "k" / "model.safetensors",
            tmp_path / other / "model.safetensors",
            shallow=False,
        )


def test_prequantized_group_needs_one_global_scale(tiny_model, tiny_cfg, tmp_path):
    params = flat_params(tiny_model)
    bad = {
        **params,
        **{
            k: quantize(jnp.asarray(v), "nvfp4", axis=0)  # own amax each
            for k, v in params.items()
            if ".attn." in k
        },
    }
    with pytest.raises(ValueError, match="different global scales"):
        export_checkpoint(
            bad,
            tmp_path,
            config=tiny_cfg,
            layer_formats={p: "nvfp4" for p in linear_paths(tiny_cfg) if ".attn." in p},
        )


def test_16x16_tiles_export_as_repeated_row_scales(tiny_model, tiny_cfg, tmp_path):
    """Training's 2-D weight tiles store one scale per 16x16 tile; the layouts want one per
    1x16 row segment: the tile scale is repeated and the decoded values are unchanged."""
    params = flat_params(tiny_model)
    tiles = {}
    for g in fused_groups(tiny_cfg):
        amax = max(float(jnp.max(jnp.abs(params[f"{p}.kernel"]))) for p in g)
        for p in g:
            tiles[f"{p}.kernel"] = quantize(
                jnp.asarray(params[f"{p}.kernel"]), "nvfp4", axis=0, block_shape=(16, 16), amax=amax
            )
    export_checkpoint({**params, **tiles}, tmp_path, config=tiny_cfg)
    ck = read_checkpoint(tmp_path)
    for p in linear_paths(tiny_cfg):
        np.testing.assert_array_equal(
            np.asarray(dequantize(ck.params[f"{p}.kernel"])),
            np.asarray(dequantize(tiles[f"{p}.kernel"])),
        )


def test_sharded_export_reads_back(tiny_model, tiny_cfg, tmp_path):
    res = export_checkpoint(tiny_model, tmp_path, shard_bytes=20_000)
    shards = [f for f in res.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in res.files
    ck = read_checkpoint(tmp_path)
    want = quantize_linear_weights(
        flat_params(tiny_model), tiny_cfg, resolve_layers(tiny_cfg, None)
    )
    for p in linear_paths(tiny_cfg):
        leaves_equal(ck.params[f"{p}.kernel"], want[p])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]  # one layer's tensors share a shard
    mod = "model.layers.1.self_attn.q_proj"
    assert (
        len({wm[f"{mod}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")})
        == 1
    )


def test_bf16_export_and_tokenizer(tiny_model, tiny_cfg, tmp_path):
    export_checkpoint(tiny_model, tmp_path, layer_formats="bf16", tokenizer=ByteTokenizer())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["eos_token_id"] == 256
    ck = read_checkpoint(tmp_path)
    assert ck.layout == "hf"
    src = flat_params(tiny_model)
    for name, v in src.items():
        np.testing.assert_array_equal(
            ck.params[name], np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float32)
        )
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    text = "héllo wörld\n\tdef f(x): return x  # ✓"
    assert tok.encode(text) == ByteTokenizer().encode(text) and tok.eos_id == 256
    assert tok.decode(tok.encode(text) + [256]) == text


def test_exact_reciprocal_inverts():
    rng = np.random.default_rng(0)
    for amax in np.exp(rng.uniform(-20, 20, 2000)).astype(np.float32):
        s_dec = np.float32(np.float32(1) / (np.float32(2688) / amax))
        r = exact_reciprocal(s_dec)
        assert np.float32(np.float32(1) / r) == s_dec
        assert abs(r / (2688 / amax) - 1) < 1e-6


def test_import_model_gives_a_transformer(tiny_model, tiny_cfg, tmp_path):
    from microscale.export import import_model

    export_checkpoint(tiny_model, tmp_path, dtype="float32")
    model, cfg = import_model(tmp_path)
    assert cfg == tiny_cfg
    ck = read_checkpoint(tmp_path)
    got = {k: np.asarray(v) for k, v in flat_params(model).items()}
    for k, v in ck.dequantized_params().items():
        np.testing.assert_array_equal(got[k], np.asarray(v))


def test_float16_checkpoint_reads(tiny_model, tmp_path):
    export_checkpoint(tiny_model, tmp_path, layer_formats="bf16", dtype="float16")
    ck = read_checkpoint(tmp_path, param_dtype="bfloat16")
    assert ck.config.param_dtype == "bfloat16"
    for name, v in flat_params(tiny_model).items():
        want = np.asarray(v).astype(np.float16).astype(ml_dtypes.bfloat16)
        assert ck.params[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(ck.params[name], want)
