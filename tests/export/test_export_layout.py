"""Exported layouts verified independently of microscale's reader: plain numpy following
the published compressed-tensors / ModelOpt layouts (golden nibble vector included), and
compressed-tensors' own decompressor when it is installed."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from microscale.export import (
    LayerQuant,
    TensorStore,
    export_checkpoint,
    fused_groups,
    hf_module,
    linear_paths,
    quantize_linear_weights,
    resolve_layers,
)
from microscale.export.params import flat_params
from microscale.export.writer import layer_tensors
from microscale.formats import dequantize, quantize

# ---------------------------------------------------------------- plain numpy decoders
# Written from the published layouts only (E2M1 table, E4M3 bit fields, E8M0 exponent).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def np_e4m3(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 0x7
    v = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return (s * v).astype(np.float32)


def np_unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """uint8 [N, K/2] -> E2M1 values [N, K]: element 2i = low nibble of byte i."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return E2M1[codes & 7] * np.where(codes & 8, np.float32(-1), np.float32(1))


def np_block(scale: np.ndarray, block: int) -> np.ndarray:
    return np.repeat(scale, block, axis=1)


def raw(store: TensorStore, name: str) -> np.ndarray:
    """Tensor bytes reinterpreted as plain numpy (uint8 for the 1-byte float types)."""
    a = store.get(name)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a)


def np_dequant_ct(store, mod, fmt) -> np.ndarray:
    if fmt == "nvfp4":
        vals = np_unpack_fp4(raw(store, f"{mod}.weight_packed"))
        sc = np_block(np_e4m3(raw(store, f"{mod}.weight_scale")), 16)
        gs = raw(store, f"{mod}.weight_global_scale")
        assert gs.shape == (1,) and gs.dtype == np.float32
        return (vals * sc) * (np.float32(1) / gs[0])  # weight_global_scale = 2688 / amax
    if fmt == "fp8_e4m3":
        return np_e4m3(raw(store, f"{mod}.weight")) * raw(store, f"{mod}.weight_scale")[0]
    if fmt == "mxfp4":
        e = raw(store, f"{mod}.weight_scale").astype(np.int64)
        return np_unpack_fp4(raw(store, f"{mod}.weight_packed")) * np_block(
            np.exp2(e - 127).astype(np.float32), 32
        )
    if fmt == "mxfp8":
        e = raw(store, f"{mod}.weight_scale").astype(np.int64)
        return np_e4m3(raw(store, f"{mod}.weight")) * np_block(
            np.exp2(e - 127).astype(np.float32), 32
        )
    raise AssertionError(fmt)


def np_dequant_modelopt(store, mod, fmt) -> np.ndarray:
    if fmt == "nvfp4":
        vals = np_unpack_fp4(raw(store, f"{mod}.weight"))
        sc = np_block(np_e4m3(raw(store, f"{mod}.weight_scale")), 16)
        s2 = raw(store, f"{mod}.weight_scale_2")  # amax / 2688
        assert s2.shape == () and s2.dtype == np.float32
        return (vals * sc) * s2
    if fmt == "fp8_e4m3":
        return np_e4m3(raw(store, f"{mod}.weight")) * raw(store, f"{mod}.weight_scale")
    raise AssertionError(fmt)


def expected_weights(model, layer_formats, activations=False):
    """microscale's own quantization (formats.quantize with the group amax), [N, K]."""
    cfg = model.config
    lay = resolve_layers(cfg, layer_formats, activations=activations)
    q = quantize_linear_weights(flat_params(model), cfg, lay)
    return lay, {
        p: (np.asarray(dequantize(v)).T if lay[p].quantized else None) for p, v in q.items()
    }


# ---------------------------------------------------------------- golden vector


def test_golden_nibble_vector_in_both_layouts():
    w = np.zeros((2, 16), np.float32)  # HF orientation [N, K]
    w[0, :4] = [0, 0.5, 4, -0.0]
    w[1, :4] = [-0.0, 1, -6, 3]
    w[:, 15] = 6.0  # block amax 6 and tensor amax 6: every value sits on the E2M1 grid
    q = quantize(jnp.asarray(w.T), "nvfp4", axis=0)  # microscale kernel orientation [K, N]
    ct = layer_tensors("compressed-tensors", "m", q, LayerQuant(weights="nvfp4"), None)
    assert ct["m.weight_packed"].dtype == np.uint8 and ct["m.weight_packed"].shape == (2, 8)
    assert ct["m.weight_packed"][:, :2].tolist() == [[0x10, 0x86], [0x28, 0x5F]]
    assert ct["m.weight_scale"].dtype == ml_dtypes.float8_e4m3fn
    assert ct["m.weight_scale"].shape == (2, 1)
    assert float(ct["m.weight_global_scale"][0]) == pytest.approx(448 * 6 / 6.0)
    # decode scale = 1 / weight_global_scale, exactly microscale's s_dec
    s_dec = np.float32(1) / ct["m.weight_global_scale"][0]
    assert s_dec == np.float32(np.asarray(q.global_scale))
    got = (
        np_unpack_fp4(ct["m.weight_packed"])
        * np_block(np_e4m3(ct["m.weight_scale"].view(np.uint8)), 16)
        * s_dec
    )
    np.testing.assert_array_equal(got, np.asarray(dequantize(q)).T)
    np.testing.assert_allclose(got, w, rtol=2e-7)  # s_dec = fl(6/2688): an ulp off 1/448
    mo = layer_tensors("modelopt", "m", q, LayerQuant(weights="nvfp4"), None)
    assert mo["m.weight"].tobytes() == ct["m.weight_packed"].tobytes()
    assert mo["m.weight_scale_2"].shape == ()
    assert float(mo["m.weight_scale_2"]) == pytest.approx(6.0 / 2688)


# ---------------------------------------------------------------- whole model, numpy


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_numpy_decode_matches_microscale(tiny_model, tiny_cfg, mixed, tmp_path, layout):
    TINY = tiny_cfg
    fmts = dict(mixed)
    if layout == "compressed-tensors":  # MX formats have no ModelOpt name
        fmts.update(
            {
                "layers.1.mlp.gate_proj": "mxfp4",
                "layers.1.mlp.up_proj": "mxfp4",
                "layers.0.attn.o_proj": "mxfp8",
            }
        )
    # ModelOpt's FP8 is W8A8 only: give it calibrated input scales
    amax = None if layout == "compressed-tensors" else dict.fromkeys(linear_paths(TINY), 2.0)
    export_checkpoint(tiny_model, tmp_path, layout=layout, layer_formats=fmts, input_amax=amax)
    store = TensorStore(tmp_path)
    lay, want = expected_weights(tiny_model, fmts)
    params = flat_params(tiny_model)
    decode = np_dequant_ct if layout == "compressed-tensors" else np_dequant_modelopt
    for p in linear_paths(TINY):
        mod = hf_module(p)
        if not lay[p].quantized:
            got = store.get(f"{mod}.weight")
            assert got.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(
                got, np.asarray(params[f"{p}.kernel"]).T.astype(ml_dtypes.bfloat16)
            )
            continue
        got = decode(store, mod, lay[p].weights)
        np.testing.assert_array_equal(got, want[p], err_msg=p)  # bit exact
        # and close to the float weights: the quantization is real, not a copy
        w = np.asarray(params[f"{p}.kernel"]).T
        assert np.abs(got - w).max() < 0.25 * np.abs(w).max()
    assert store.get("model.embed_tokens.weight").shape == (257, 64)
    assert "lm_head.weight" not in store  # tied


def test_fused_groups_share_the_global_scale(tiny_model, tiny_cfg, tmp_path):
    TINY = tiny_cfg
    export_checkpoint(tiny_model, tmp_path)
    store = TensorStore(tmp_path)
    for group in fused_groups(TINY):
        gs = {float(store.get(f"{hf_module(p)}.weight_global_scale")[0]) for p in group}
        assert len(gs) == 1, group
        amax = max(
            float(np.abs(np.asarray(flat_params(tiny_model)[f"{p}.kernel"])).max()) for p in group
        )
        assert list(gs)[0] == pytest.approx(448 * 6 / amax, rel=1e-6)
    # different groups get different scales (the weights have outliers in places)
    q = {float(store.get(f"{hf_module(p)}.weight_global_scale")[0]) for p in linear_paths(TINY)}
    assert len(q) > 2


def test_compressed_tensors_config(tiny_model, mixed, tmp_path):
    export_checkpoint(tiny_model, tmp_path, layer_formats=mixed)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "mixed-precision" and qc["quantization_status"] == "compressed"
    groups = {g["format"]: g for g in qc["config_groups"].values()}
    assert set(groups) == {"nvfp4-pack-quantized", "float-quantized"}
    nv = groups["nvfp4-pack-quantized"]
    assert nv["weights"]["num_bits"] == 4 and nv["weights"]["group_size"] == 16
    assert nv["weights"]["strategy"] == "tensor_group" and nv["input_activations"] is None
    assert "model.layers.0.self_attn.q_proj" in nv["targets"]
    assert "model.layers.1.mlp.up_proj" not in nv["targets"]
    assert groups["float-quantized"]["weights"]["strategy"] == "tensor"
    assert qc["ignore"][:2] == ["lm_head", "model.embed_tokens"]
    assert "model.layers.1.mlp.gate_proj" in qc["ignore"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 64
    # uniform NVFP4: one group targeting "Linear"
    export_checkpoint(tiny_model, tmp_path / "u")
    qc = json.loads((tmp_path / "u" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    assert [g["targets"] for g in qc["config_groups"].values()] == [["Linear"]]


def test_modelopt_config(tiny_model, tiny_cfg, mixed, tmp_path):
    export_checkpoint(
        tiny_model,
        tmp_path,
        layout="modelopt",
        layer_formats=mixed,
        input_amax={p: 3.0 for p in linear_paths(tiny_cfg)},
    )
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "MIXED_PRECISION"
    ql = hq["quantized_layers"]
    assert ql["model.layers.0.self_attn.q_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert ql["model.layers.0.self_attn.o_proj"] == {"quant_algo": "FP8"}
    assert "model.layers.1.mlp.gate_proj" not in ql
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "modelopt" and cfg["quantized_layers"] == ql
    store = TensorStore(tmp_path)
    for p, algo in ql.items():  # every W4A4 / W8A8 layer has its input scale
        s = store.get(f"{p}.input_scale")
        assert s.shape == () and s.dtype == np.float32
        want = 3.0 / (2688 if algo["quant_algo"] == "NVFP4" else 448)
        assert float(s) == pytest.approx(want, rel=1e-6)


def test_w4a4_compressed_tensors_has_every_input_scale(tiny_model, tiny_cfg, tmp_path):
    TINY = tiny_cfg
    amax = {p: 2.0 + i for i, p in enumerate(linear_paths(TINY))}
    export_checkpoint(tiny_model, tmp_path, input_amax=amax)
    store = TensorStore(tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    (g,) = qc["config_groups"].values()
    assert g["input_activations"]["dynamic"] == "local"
    for group in fused_groups(TINY):
        want = 448 * 6 / max(amax[p] for p in group)  # fused layers share it
        for p in group:
            s = store.get(f"{hf_module(p)}.input_global_scale")
            assert s.shape == (1,) and float(s[0]) == pytest.approx(want, rel=1e-6)


def test_w4a4_without_calibration_is_refused(tiny_model, tiny_cfg, tmp_path):
    amax = {p: 1.0 for p in linear_paths(tiny_cfg) if p != "layers.1.mlp.down_proj"}
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj.*input_amax"):
        export_checkpoint(tiny_model, tmp_path, input_amax=amax)


def test_fused_group_format_mismatch_is_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"k_proj.*fused"):
        export_checkpoint(
            tiny_model,
            tmp_path,
            layer_formats={
                "layers.0.attn.q_proj": "nvfp4",
                "layers.0.attn.k_proj": "fp8_e4m3",
                "layers.0.attn.v_proj": "nvfp4",
            },
        )
    with pytest.raises(ValueError, match="ModelOpt layout has no quant_algo"):
        export_checkpoint(tiny_model, tmp_path, layout="modelopt", layer_formats="mxfp4")


# ---------------------------------------------------------------- compressed-tensors itself


def test_compressed_tensors_decompressor_agrees(tiny_model, tiny_cfg, mixed, tmp_path):
    TINY = tiny_cfg
    ct = pytest.importorskip("compressed_tensors", exc_type=ImportError)
    torch = pytest.importorskip("torch", exc_type=ImportError)
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from safetensors.torch import load_file

    fmts = dict(mixed, **{"layers.1.mlp.gate_proj": "mxfp4", "layers.1.mlp.up_proj": "mxfp4"})
    export_checkpoint(
        tiny_model, tmp_path, layer_formats=fmts, input_amax={p: 4.0 for p in linear_paths(TINY)}
    )
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)  # the package accepts our config
    tensors = load_file(str(tmp_path / "model.safetensors"))
    lay, want = expected_weights(tiny_model, fmts, activations=True)
    checked = set()
    for g in qc["config_groups"].values():
        scheme = QuantizationScheme.model_validate(g)
        comp = BaseCompressor.get_value_from_registry(g["format"])
        for mod in g["targets"]:
            local = {k[len(mod) + 1 :]: v for k, v in tensors.items() if k.startswith(mod + ".")}
            names = set(comp.compression_param_names(scheme)) - {"weight"}
            assert names <= set(local), (mod, names - set(local))  # nothing missing
            got = comp.decompress(local, scheme)["weight"].float().numpy()
            p = next(q for q in linear_paths(TINY) if hf_module(q) == mod)
            # compressed-tensors decodes into bfloat16: one bf16 rounding apart at most
            np.testing.assert_allclose(got, want[p], rtol=2**-8, atol=1e-30, err_msg=mod)
            checked.add(lay[p].weights)
    assert checked == {"nvfp4", "fp8_e4m3", "mxfp4"}
    del ct, torch


# ---------------------------------------------------------------- per-layer formats


def test_resolve_layers_from_rules_and_mappings(tiny_cfg):
    from microscale.model import PrecisionRules

    rules = PrecisionRules.for_recipe("nvfp4", tiny_cfg.n_layers)  # last block stays bf16
    lay = resolve_layers(tiny_cfg, rules)
    assert lay["layers.0.mlp.down_proj"] == LayerQuant(weights="nvfp4")
    assert lay["layers.1.attn.q_proj"] == LayerQuant(weights="bf16")
    w4a4 = resolve_layers(tiny_cfg, rules, activations=True)
    assert w4a4["layers.0.attn.o_proj"] == LayerQuant(weights="nvfp4", inputs="nvfp4")
    fp8 = resolve_layers(tiny_cfg, PrecisionRules.uniform("fp8"), activations=True)
    assert set(fp8.values()) == {LayerQuant(weights="fp8_e4m3", inputs="fp8_e4m3")}
    # HF module names work as keys; omitted layers stay bf16; W4A8 by explicit LayerQuant
    m = resolve_layers(
        tiny_cfg,
        {
            "model.layers.0.mlp.down_proj": "fp8_e4m3",
            "layers.1.mlp.down_proj": {"weights": "nvfp4", "inputs": "fp8_e4m3"},
        },
    )
    assert m["layers.0.mlp.down_proj"].weights == "fp8_e4m3"
    assert m["layers.1.mlp.down_proj"] == LayerQuant(weights="nvfp4", inputs="fp8_e4m3")
    assert m["layers.0.attn.q_proj"] == LayerQuant()
    with pytest.raises(ValueError, match="'layers.9.attn.q_proj' is not a linear layer"):
        resolve_layers(tiny_cfg, {"layers.9.attn.q_proj": "nvfp4"})
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        resolve_layers(tiny_cfg, "int4")
