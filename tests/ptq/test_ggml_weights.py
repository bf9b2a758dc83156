"""ggml's block types as the PTQ engine's weight formats (issue #53).

A layer in Q4_K, IQ4_XS, ... is encoded by ggml's own quantizer (``formats/ggml.py``, bit for
bit ``ggml_quantize_chunk``) with its importance weights, llama.cpp's imatrix measured on the
calibration batches; what the engine computes with (``QuantizedWeight.values``, the fake
quantizer) is ggml's decoding of those bytes. These tests hold each of those to a plain
reference: the codec called directly on the transposed kernel, the imatrix collected directly
from the engine's model, the block bytes counted by hand.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

from microscale.formats import (
    REGISTRY,
    dequantize,
    get_weight_format,
    ggml_qarray,
    storage_bits,
    weight_only,
)
from microscale.formats.ggml import dequantize_ggml, libggml_quantize, quantize_ggml
from microscale.formats.spec import GGML_FORMATS
from microscale.model import ModelConfig, Transformer
from microscale.ptq import QuantizeConfig, quantize_model
from microscale.ptq.imatrix import collect_imatrix
from microscale.ptq.report import write_outputs
from microscale.ptq.weights import WeightCache, WeightPTQ, quantize_group

ONLY = [f for f in GGML_FORMATS if weight_only(GGML_FORMATS[f])]
# Block elements per type (a K-quant's super-block): the rows below hold whole blocks.
SPAN = {f: GGML_FORMATS[f].super_block or GGML_FORMATS[f].block_size for f in GGML_FORMATS}


def _kernel(k: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((k, n)) * rng.uniform(0.5, 2.0, (k, 1))).astype(np.float32)


def test_weight_only_is_the_ggml_rows_without_a_jax_quantizer():
    assert set(ONLY) == set(GGML_FORMATS) - set(REGISTRY)
    assert "q8_0" in GGML_FORMATS and not weight_only(get_weight_format("q8_0"))
    assert not any(weight_only(s) for s in REGISTRY.values())
    for f in GGML_FORMATS:
        assert get_weight_format(f) is (REGISTRY.get(f) or GGML_FORMATS[f])
    with pytest.raises(ValueError, match=r"unknown format 'q4_9'.*ggml's \[.*'q4_k'"):
        get_weight_format("q4_9")


@pytest.mark.parametrize("fmt", ONLY)
def test_group_is_ggmls_encoder_and_values_its_decoder(fmt):
    """Each member's bytes are ``quantize_ggml(W^T, fmt, its importance)``; the values the
    engine computes with decode them (the fake quantizer is decode(encode)); without
    importance weights, ggml's plain encoder (the ``rel_mse_rtn`` reference)."""
    k = 2 * SPAN[fmt]
    ws = [_kernel(k, 24, 1), _kernel(k, 8, 2)]
    rng = np.random.default_rng(3)
    imp = [rng.uniform(0.0, 4.0, k).astype(np.float32) for _ in ws]
    got = quantize_group(ws, fmt, WeightPTQ.rtn(), importance=imp)
    plain = quantize_group(ws, fmt, WeightPTQ.rtn())
    for w, im, q, p in zip(ws, imp, got, plain, strict=True):
        want = quantize_ggml(w.T, fmt, im)
        assert np.array_equal(np.asarray(q.qarray.data), want)
        assert np.array_equal(np.asarray(p.qarray.data), quantize_ggml(w.T, fmt))
        vals = dequantize_ggml(want, fmt, k).T
        assert np.array_equal(np.asarray(q.values), vals)
        assert q.format == fmt and q.amax is None and q.scale_multiplier == 1.0
        rel = float(np.sum((vals - w) ** 2) / np.sum(w * w))
        assert q.rel_mse == pytest.approx(rel, rel=1e-5)
        assert q.rel_mse_rtn == pytest.approx(p.rel_mse, rel=1e-6)
        assert storage_bits(fmt, q.qarray.shape) == want.size * 8


@pytest.mark.skipif(
    not os.environ.get("MICROSCALE_LIBGGML"),
    reason="no ggml library (set MICROSCALE_LIBGGML=.../libggml-base.so)",
)
@pytest.mark.parametrize("fmt", ONLY)
def test_group_equals_ggml_itself(fmt):
    """The engine's bytes for a kernel and its importance weights are ggml's own
    ``ggml_quantize_chunk``'s for the transposed kernel and the same weights."""
    k = SPAN[fmt]
    w = _kernel(k, 16, 8)
    imp = np.random.default_rng(9).uniform(0.0, 3.0, k).astype(np.float32)
    (q,) = quantize_group([w], fmt, WeightPTQ.rtn(), importance=[imp])
    assert np.array_equal(np.asarray(q.qarray.data), libggml_quantize(w.T, fmt, imp))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k", "iq4_xs"])
def test_ggml_qarray_decodes_alike_under_jit(fmt):
    x = _kernel(3, SPAN[fmt], 4)
    q = ggml_qarray(x, fmt)
    eager = np.asarray(dequantize(q))
    assert np.array_equal(np.asarray(jax.jit(dequantize)(q)), eager)
    assert np.array_equal(eager, dequantize_ggml(quantize_ggml(x, fmt), fmt, SPAN[fmt]))


def test_q8_0_takes_the_jax_quantizer_and_ignores_importance():
    """Q8_0 is in both tables (the same row): its QArray is the JAX quantizer's, whose values
    are ggml's (``ggml_quantize_chunk`` has no weighted Q8_0 encoder)."""
    x = _kernel(4, 64, 5)
    q = ggml_qarray(x, "q8_0", np.ones(64, np.float32))
    assert q.scales is not None
    want = dequantize_ggml(quantize_ggml(x, "q8_0"), "q8_0", 64)
    assert np.array_equal(np.asarray(dequantize(q)), want)


def test_group_refusals():
    w = _kernel(32, 8, 6)
    with pytest.raises(ValueError, match="GPTQ on ggml's q4_0 grid is not built yet"):
        quantize_group([w], "q4_0", WeightPTQ(method="gptq"), hessians=[np.eye(32)])
    with pytest.raises(ValueError, match="2 importance arrays for 1 kernels"):
        quantize_group([w], "q4_0", importance=[None, None])
    with pytest.raises(ValueError, match=r"q4_k: a row of 32 is not a multiple of 256"):
        quantize_group([w], "q4_k")


# A model whose every linear has 256 inputs: the K-quants' super-blocks fit every layer.
WIDE = ModelConfig(
    vocab_size=257, d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=256, max_seq_len=64
)
GGUF_LIKE = QuantizeConfig(
    budget=5.0,
    formats=("q4_k", "q6_k", "q8_0", "bf16"),
    uniform_formats=("q4_k", "iq4_xs", "nvfp4", "bf16"),
    heuristic=("q6_k", "q4_k"),
    pareto_budgets=(),
    ptq=WeightPTQ.rtn(),
    ptq_effects=False,
)


@pytest.fixture(scope="module")
def wide_run():
    model = Transformer(WIDE, rngs=nnx.Rngs(0))
    toks = np.random.default_rng(0).integers(0, 257, size=(4, 4, 33)).astype(np.int32)
    calib, evals = toks[:2], toks[2:]
    return model, calib, quantize_model(model, calib, evals, GGUF_LIKE)


def test_quantize_model_encodes_each_layer_with_its_imatrix(wide_run):
    """The searched allocation's weights are ggml's bytes of each kernel under the imatrix
    of the calibration batches (collected here directly from the model); the search counts
    each type's block bytes (Q4_K 144 bytes / 256, Q6_K 210 / 256)."""
    model, calib, res = wide_run
    im = collect_imatrix(model, calib).mean_sq()
    kernels = dict(res.engine.kernels)
    fmts = res.allocation.formats
    assert set(fmts.values()) <= set(GGUF_LIKE.formats)
    assert res.rules is None  # no training recipe runs ggml's types
    bits = {"q4_k": 144 * 8 / 256, "q6_k": 210 * 8 / 256, "q8_0": 8.5, "bf16": 16.0}
    numel = res.numel
    spent = sum(bits[fmts[p]] * numel[p] for p in fmts) / sum(numel[p] for p in fmts)
    assert res.allocation.effective_bits == pytest.approx(spent)
    assert spent <= GGUF_LIKE.budget
    n_ggml = 0
    for p, f in fmts.items():
        w = res.weights[p]
        assert w.format == f
        if weight_only(get_weight_format(f)):
            n_ggml += 1
            want = quantize_ggml(np.asarray(kernels[p]).T, f, im[p])
            assert np.array_equal(np.asarray(w.qarray.data), want)
    assert n_ggml > 0
    assert res.timings["imatrix_s"] > 0
    assert {"uniform_q4_k", "uniform_iq4_xs", "uniform_nvfp4", "bf16"} <= set(res.points)


def test_importance_moves_the_bytes(wide_run):
    """A layer's own importance weights are the ones used: scaling one input column's
    importance up changes that layer's bytes and no other's."""
    model, _, res = wide_run
    eng = res.engine
    groups = {p: p for p in eng.paths}
    rng = np.random.default_rng(7)
    imp = {p: rng.uniform(0.5, 1.5, eng.kernels[p].shape[0]) for p in eng.paths}
    base = WeightCache(eng, groups, None, imp).get("q4_k", WeightPTQ.rtn())
    p0 = eng.paths[0]
    moved = dict(imp, **{p0: imp[p0] * np.where(np.arange(imp[p0].size) == 3, 1e4, 1.0)})
    got = WeightCache(eng, groups, None, moved).get("q4_k", WeightPTQ.rtn())
    for p in eng.paths:
        same = np.array_equal(np.asarray(got[p].qarray.data), np.asarray(base[p].qarray.data))
        assert same == (p != p0), p


def test_the_writers_refuse_an_allocation_of_ggml_types_for_now(wide_run, tmp_path):
    _, _, res = wide_run
    with pytest.raises(ValueError, match=r"^write_outputs: the allocation holds ggml's block"):
        write_outputs(res, tmp_path / "q")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(activations=True), r"activations=true: q4_k quantize weights only"),
        (dict(ptq=WeightPTQ(method="gptq")), r"GPTQ on ggml's grids \(q4_k\) is not built"),
        (dict(awq=True, awq_format="q4_k"), r"awq_format='q4_k': expected a quantized format"),
        (dict(formats=("q4_9", "bf16")), r"QuantizeConfig.formats: unknown format 'q4_9'"),
    ],
)
def test_config_refusals(kw, match):
    base = dict(formats=("q4_k", "bf16"), uniform_formats=("bf16",))
    with pytest.raises(ValueError, match=match):
        QuantizeConfig(**{**base, **kw})


def test_weight_only_formats_lists_every_place_a_format_enters():
    cfg = QuantizeConfig(
        formats=("nvfp4", "bf16"),
        uniform_formats=("iq4_nl", "bf16"),
        heuristic=("q6_k", "nvfp4"),
        pin=((r"lm_head", "q5_0"),),
    )
    assert cfg.weight_only_formats() == ("iq4_nl", "q6_k", "q5_0")
    assert dataclasses.replace(cfg, uniform_formats=("bf16",)).weight_only_formats() == (
        "q6_k",
        "q5_0",
    )
