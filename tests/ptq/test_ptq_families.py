"""`quantize_model` on every family (sensitivity, search, GPTQ, AWQ, the written
checkpoint): the family's own parameters (Qwen2's biases, Qwen3's q/k norms) travel
through the fold and the export, and the checkpoint read back computes what the pipeline
evaluated.

Bound: the searched allocation's validation perplexity from the pipeline against the
packed checkpoint in the inference engine, rel 1e-2: the pipeline evaluates with the
training `Transformer` (bf16 recipe on the quantized values), the engine decodes the
same values beside bfloat16 GEMMs of its own order; both round the same products to
bfloat16, a ~2^-9 relative difference per layer on a perplexity near the vocabulary's 257.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

from microscale.data import ByteTokenizer
from microscale.export import read_checkpoint
from microscale.export.registry import get_layout
from microscale.inference import InferenceModel
from microscale.model import ModelConfig, Transformer, linear_paths
from microscale.ptq import QuantizeConfig, WeightPTQ, quantize_model, write_outputs

FAMILIES = {
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3", attn_head_dim=32),
    "mistral": dict(family="mistral", sliding_window=16),
    "gemma3": dict(family="gemma3", sliding_window=16, sliding_window_pattern=2),
}
CFG = QuantizeConfig(
    budget=5.5,
    formats=("nvfp4", "fp8_e4m3", "bf16"),
    uniform_formats=("nvfp4", "bf16"),
    pareto_budgets=(),
    ptq=WeightPTQ(scale_grid=(0.8, 1.0, 1.2), method="gptq", gptq_block=32),
    ptq_effects=False,
    awq=True,
    awq_alphas=(0.0, 0.5),
)


def _model(changes: dict) -> Transformer:
    cfg = ModelConfig(
        vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
        max_seq_len=64, **changes,
    )  # fmt: skip
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "bias" or "q_norm" in path or "k_norm" in path:  # off their init
            p.set_value(p[...] + 0.3 * np.random.default_rng(len(path)).standard_normal(p.shape))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_quantize_every_family_with_gptq_and_awq(family, token_batches, tmp_path):
    model = _model(FAMILIES[family])
    calib, evals = token_batches
    result = quantize_model(model, calib, evals, CFG)
    write_outputs(result, tmp_path, model_config=model.config)
    ck = read_checkpoint(tmp_path / "checkpoint")
    assert ck.config == model.config
    params = ck.dequantized_params()
    folded = result.engine.params
    for name in ("attn.v_proj.bias", "attn.q_norm.scale", "attn.k_norm.scale"):
        key = f"layers.0.{name}"
        if key not in params:
            continue
        want = folded["layers"][0]
        for part in name.split("."):
            want = want[part]
        np.testing.assert_allclose(
            np.asarray(params[key], np.float32), np.asarray(want, np.float32), rtol=1e-2
        )
    assert any(k.endswith(".bias") for k in params) == (family == "qwen2")
    engine = InferenceModel.from_checkpoint(ck)
    ppl = engine.evaluate_ppl(evals.reshape(-1, evals.shape[-1]))["ppl"]
    assert ppl == pytest.approx(result.points["searched"]["val_ppl"], rel=1e-2)
    # the fold moved v_proj's bias with its columns: without AWQ the bias is the model's
    if family == "qwen2":
        plain = quantize_model(model, calib, evals, dataclasses.replace(CFG, awq=False))
        assert np.asarray(plain.engine.params["layers"][0]["attn"]["v_proj"]["bias"]).tolist() == (
            np.asarray(model.layers[0].attn.v_proj.bias[...]).tolist()
        )


# llama.cpp's graphs that drop the MLP's tensor scale (export/gguf/arch.py's Arch.unscaled)
GGUF_UNSCALED_MLP = {"qwen2": True, "qwen3": False, "mistral": False, "gemma3": True}
GGUF_CHANGES = {"gemma3": {"sliding_window_pattern": 6}, "mistral": {"sliding_window": None}}


@pytest.mark.parametrize("family", sorted(GGUF_UNSCALED_MLP))
def test_gguf_layout_restricts_the_search_where_llama_cpp_drops_the_scale(family):
    """The GGUF layout's candidates record: no NVFP4 on the MLP of qwen2 and gemma3
    (llama.cpp's graph applies no tensor scale there), every format elsewhere."""
    # (gemma3: llama.cpp's own layer pattern, 6; mistral: no window, as llama.cpp runs it)
    changes = {**FAMILIES[family], **GGUF_CHANGES.get(family, {})}
    changes = {k: v for k, v in changes.items() if v is not None}
    cfg = _model(changes).config
    cands = get_layout("gguf").candidates(cfg, QuantizeConfig.for_gguf(fp4=True).formats)
    mlp = [p for p in linear_paths(cfg) if ".mlp." in p]
    if GGUF_UNSCALED_MLP[family]:
        assert sorted(cands) == sorted(mlp)
        assert all("nvfp4" not in f and "mxfp4" in f for f in cands.values())
    else:
        assert cands == {}
    assert get_layout("compressed-tensors").candidates is None


@pytest.mark.slow
def test_quantize_for_gguf_on_qwen2_writes_what_llama_cpp_runs(token_batches, tmp_path):
    """With the layout's candidates the search keeps NVFP4 off Qwen2's MLP, so the GGUF is
    written (the export refused the NVFP4 MLP the search used to choose), and the
    attention may still take NVFP4."""
    model = _model(FAMILIES["qwen2"])
    calib, evals = token_batches
    cfg = QuantizeConfig.for_gguf(fp4=True, budget=4.5, pareto_budgets=(), ptq_effects=False)
    cands = get_layout("gguf").candidates(model.config, cfg.formats)
    result = quantize_model(model, calib, evals, cfg, candidates=cands)
    chosen = result.allocation.formats
    assert all(chosen[p] != "nvfp4" for p in cands)
    assert any(f == "nvfp4" for p, f in chosen.items() if p not in cands and p.startswith("layers"))
    said: list[str] = []
    write_outputs(
        result, tmp_path / "q", model_config=model.config, tokenizer=ByteTokenizer(),
        layout="gguf", log=said.append,
    )  # fmt: skip
    assert (tmp_path / "q" / "model.gguf").is_file(), said
