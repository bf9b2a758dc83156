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
import json
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx

from microscale.export import flat_params
from microscale.export.gguf.arch import ARCHS, stored_rows, tensor_name
from microscale.export.gguf.llamacpp import llama_cpp_available
from microscale.export.gguf.to_hf import read_gguf_params
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
from microscale.ptq.gptq import gptq_ggml
from microscale.ptq.imatrix import collect_imatrix
from microscale.ptq.problem import check_quantize_budget
from microscale.ptq.report import write_outputs
from microscale.ptq.weights import WeightCache, WeightPTQ, quantize_group
from microscale.train import load_checkpoint

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
    with pytest.raises(ValueError, match=r"method='gptq' needs one input Hessian per kernel"):
        quantize_group([w], "q4_0", WeightPTQ(method="gptq"))
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


def test_quantize_model_runs_gptq_on_the_ggml_grids(wide_run):
    """``ptq.method=gptq`` with ggml's types: each layer's bytes are GPTQ's on the type's
    grid (:func:`gptq_ggml`) with the engine's input Hessian and the calibration imatrix,
    not the encoder's; the report's errors are those bytes'."""
    model, calib, _ = wide_run
    cfg = dataclasses.replace(GGUF_LIKE, ptq=WeightPTQ(method="gptq"), uniform_formats=("bf16",))
    res = quantize_model(model, calib, calib, cfg)
    im = collect_imatrix(model, calib).mean_sq()
    hs = res.engine.input_hessians(calib)
    n_ggml = 0
    for p, f in res.allocation.formats.items():
        if not weight_only(get_weight_format(f)):
            continue
        n_ggml += 1
        t = np.asarray(res.engine.kernels[p]).T
        data = np.asarray(res.weights[p].qarray.data)
        assert np.array_equal(data, gptq_ggml(t, hs[p], f, importance=im[p])), p
        assert not np.array_equal(data, quantize_ggml(t, f, im[p])), p
    assert n_ggml > 0


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


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt", "microscale"])
def test_layouts_that_hold_no_ggml_bytes_refuse_before_writing(wide_run, tmp_path, layout):
    _, _, res = wide_run
    with pytest.raises(ValueError, match=r"^formats: q.*are stored by layout=gguf only$"):
        write_outputs(res, tmp_path / "q", layout=layout)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(activations=True), r"activations=true: q4_k quantize weights only"),
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


def _quantize(run: str, out, *keys: str) -> int:
    """``microscale quantize --model run --out out layout=gguf *keys`` with small settings."""
    from microscale.cli import main

    small = ("calib_tokens=256", "pareto_budgets=5", "ptq_effects=false", "--no-compile-cache")
    return main(["quantize", "--model", run, "--out", str(out), "layout=gguf", *keys, *small, "-q"])


@pytest.mark.slow
def test_cli_quantize_writes_ggml_types_into_the_gguf(trained_run, tmp_path, capsys):
    """``quantize layout=gguf`` with ggml's 32-wide types (TINY's rows are 64 inputs): the
    file holds each layer in its searched type, ggml's bytes of the engine's kernel under
    the importance matrix written beside it; no precision_rules.json (no training recipe
    runs these types), and the output is still a quantize output (verify, eval)."""
    gguf = pytest.importorskip("gguf")
    from microscale.cli import main
    from microscale.export.gguf.imatrix import read_imatrix

    out = tmp_path / "qg"
    rc = _quantize(
        trained_run,
        out,
        "formats=q4_0,iq4_nl,q5_1,q8_0,bf16",
        "uniform_formats=q4_0,iq4_nl,bf16",
        "heuristic=q8_0,q4_0",
        "budget=5.0",
    )
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert not (out / "precision_rules.json").exists()
    assert rep["effective_bits"] <= 5.0
    ggml_layers = {p: f for p, f in rep["layers"].items() if f in ONLY}
    assert ggml_layers, rep["layers"]
    reader = gguf.GGUFReader(out / "model.gguf")
    tensors = {t.name: t for t in reader.tensors}
    im = read_imatrix(out / "imatrix.gguf")
    model, _, _ = load_checkpoint(trained_run)
    run_params = {k: np.asarray(v, np.float32) for k, v in flat_params(model).items()}
    head_dim = model.config.head_dim
    for p, f in ggml_layers.items():
        name = f"{tensor_name(p)}.weight"
        t = tensors[name]
        assert t.tensor_type.value == GGML_FORMATS[f].ggml_type, (p, f)
        w = run_params[f"{p}.kernel"].T  # HF [out, in]
        rows = stored_rows(ARCHS["llama"], f"{p}.kernel", w.shape[0], head_dim)
        w = w if rows is None else w[rows]
        want = quantize_ggml(w, f, im[name])
        assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), p
    assert main(["verify", str(out)]) == 0
    # microscale's own GGUF reader (export, import) decodes each layer back to its values
    back, _ = read_gguf_params(out / "model.gguf")
    for p, f in ggml_layers.items():
        w = run_params[f"{p}.kernel"]
        name = f"{tensor_name(p)}.weight"
        want = dequantize_ggml(quantize_ggml(w.T, f, im[name]), f, w.shape[0]).T
        assert np.array_equal(back[f"{p}.kernel"], want), p


def _llama_quantize() -> str | None:
    """llama.cpp's quantizer: ``MICROSCALE_LLAMA_QUANTIZE`` or ``llama-quantize`` on PATH."""
    return os.environ.get("MICROSCALE_LLAMA_QUANTIZE") or shutil.which("llama-quantize")


@pytest.fixture(scope="module")
def q4_0_output(trained_run, tmp_path_factory):
    """``quantize layout=gguf`` with Q4_0 the only quantized candidate: every block linear in
    Q4_0 under the imatrix beside it (the LM head is pinned bf16 by default)."""
    out = tmp_path_factory.mktemp("q4_0") / "q"
    rc = _quantize(
        trained_run,
        out,
        "formats=q4_0",
        "uniform_formats=q4_0,bf16",
        "heuristic=bf16,q4_0",
        "budget=16",
    )
    assert rc == 0
    return out


@pytest.mark.slow
@pytest.mark.skipif(
    _llama_quantize() is None,
    reason="no llama-quantize (build llama.cpp's tools/quantize; MICROSCALE_LLAMA_QUANTIZE=path)",
)
def test_llama_quantize_with_our_imatrix_writes_our_bytes(trained_run, q4_0_output, tmp_path):
    """llama.cpp's own quantizer, given the run's float32 GGUF and the imatrix.gguf beside
    quantize's output, writes every block linear's Q4_0 bytes exactly as microscale did
    (measured: 14 of TINY's 14 block linears in Q4_0 in both files, all 14 identical)."""
    from microscale.cli import main

    src = tmp_path / "f32.gguf"
    argv = ["export", "--model", trained_run, "--out", str(src), "layout=gguf"]
    assert main([*argv, "formats=bf16", "dtype=float32"]) == 0
    dst = tmp_path / "llama_q4_0.gguf"
    done = subprocess.run(
        [
            _llama_quantize(),
            "--imatrix",
            str(q4_0_output / "imatrix.gguf"),
            str(src),
            str(dst),
            "Q4_0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    gguf = pytest.importorskip("gguf")
    ours = {t.name: t for t in gguf.GGUFReader(q4_0_output / "model.gguf").tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(dst).tensors}
    rep = json.loads((q4_0_output / "report.json").read_text())
    compared = 0
    for p, f in rep["layers"].items():
        name = f"{tensor_name(p)}.weight"
        if f != "q4_0" or theirs[name].tensor_type.name != "Q4_0":
            continue
        assert ours[name].tensor_type.name == "Q4_0"
        assert np.array_equal(np.asarray(ours[name].data), np.asarray(theirs[name].data)), name
        compared += 1
    print(f"\n{compared} tensors in Q4_0 compared, byte for byte")
    assert compared >= len([p for p in rep["layers"] if p.startswith("layers.")]) // 2, compared


@pytest.mark.slow
@pytest.mark.skipif(
    llama_cpp_available() is None,
    reason="no llama.cpp (pip install '.[llama]' or set MICROSCALE_LIBLLAMA)",
)
def test_llama_cpp_runs_the_ggml_types_as_microscale_decodes_them(q4_0_output):
    """llama.cpp's logits of the file against microscale's model with the values the file
    decodes to (float32 compute): the float32 GGUFs' bound, since both compute with the same
    weights (measured with a llama.cpp built from llama-cpp-python 0.3.36's sources: rel L2
    3.1e-4, top-1 27/27)."""
    from microscale.export.gguf.llamacpp import LlamaCpp, logits_agreement
    from microscale.inference import InferenceModel

    path = q4_0_output / "model.gguf"
    params, cfg = read_gguf_params(path)
    ids = list(b"def f(x):\n    return x + 1\n")
    ref = InferenceModel.from_params(params, cfg, formats=None, compute_dtype=jax.numpy.float32)
    llm = LlamaCpp(path, n_ctx=cfg.max_seq_len)
    try:
        rel, top1 = logits_agreement(
            llm.logits(ids), np.asarray(ref.logits(np.asarray([ids], np.int32)))[0]
        )
    finally:
        llm.close()
    print(f"\nllama.cpp vs microscale, ggml Q4_0: rel L2 {rel:.2e}, top-1 {top1}/{len(ids)}")
    assert rel <= 2e-3 and top1 >= 0.95 * len(ids)


# Rows of 96 inputs (q/k/v/o, gate/up) hold 32-wide blocks but no K-quant super-block;
# down_proj's rows of 256 hold both.
NARROW = ModelConfig(
    vocab_size=257, d_model=96, n_layers=2, n_heads=3, n_kv_heads=1, d_ff=256, max_seq_len=64
)


@pytest.fixture(scope="module")
def narrow_run():
    model = Transformer(NARROW, rngs=nnx.Rngs(1))
    toks = np.random.default_rng(1).integers(0, 257, size=(4, 4, 33)).astype(np.int32)
    cfg = dataclasses.replace(
        GGUF_LIKE,
        formats=("q4_k", "q6_k", "bf16"),
        uniform_formats=("q4_k", "bf16"),
        budget=6.0,
    )
    logs: list[str] = []
    res = quantize_model(model, toks[:2], toks[2:], cfg, log=logs.append)
    return res, logs


def test_a_type_the_rows_cannot_hold_falls_back_as_llama_cpp_writes_it(narrow_run):
    """llama.cpp writes Q4_K on 96-wide rows as Q5_0 and Q6_K as Q8_0: the search offers
    those layers the fallbacks instead (scored like the rest), a uniform point stores them
    so and is priced so, and the weights are the fallback's bytes."""
    res, logs = narrow_run
    assert res.config.formats == ("q4_k", "q6_k", "bf16", "q5_0", "q8_0")
    assert any("q4_k cannot hold the rows of 12 layer(s) (96 inputs)" in m for m in logs)
    bits = {"q4_k": 4.5, "q6_k": 6.5625, "q5_0": 5.5, "q8_0": 8.5, "bf16": 16.0}
    checked = set()
    for p, f in res.allocation.formats.items():
        wide = p.endswith("down_proj")
        assert f in (("q4_k", "q6_k", "bf16") if wide else ("q5_0", "q8_0", "bf16")), (p, f)
        assert res.weights[p].format == f
        k = np.asarray(res.engine.kernels[p])
        q = res.weights[p].qarray
        if weight_only(get_weight_format(f)):  # ggml's bytes, under the layer's importance
            want = quantize_ggml(k.T, f, res.imatrix.mean_sq()[p])
            assert np.array_equal(np.asarray(q.data), want), (p, f)
            checked.add(f)
        elif f == "q8_0":  # the JAX quantizer: ggml's values (Q8_0 takes no importance)
            want = dequantize_ggml(quantize_ggml(k.T, f), f, k.shape[0])
            assert np.array_equal(np.asarray(dequantize(q)), want), (p, f)
            checked.add(f)
    assert checked, res.allocation.formats  # the budget (6 bits) leaves some layer quantized
    point = res.points["uniform_q4_k"]
    numel = res.numel
    stored = {p: "q4_k" if p.endswith("down_proj") else "q5_0" for p in numel}
    want_bits = sum(bits[stored[p]] * numel[p] for p in numel) / sum(numel.values())
    assert point["linear_bits"] == pytest.approx(want_bits)


def test_a_pin_the_rows_cannot_hold_is_refused(narrow_run):
    res, _ = narrow_run
    cfg = dataclasses.replace(res.config, pin=((r"layers\.0\.attn\.q_proj", "q4_k"),))
    with pytest.raises(ValueError, match=r"^pin: q4_k cannot hold layers\.0\.attn\.q_proj: "):
        check_quantize_budget(res.engine.model(), cfg)


def test_the_budget_check_prices_the_fallbacks():
    """The cheapest allocation of NARROW under q4_k,bf16 is Q5_0 on the 96-wide rows and
    Q4_K on down_proj (not 4.5 bits everywhere): a budget between is refused up front."""
    model = Transformer(NARROW, rngs=nnx.Rngs(1))
    cfg = QuantizeConfig(formats=("q4_k", "bf16"), uniform_formats=("bf16",), budget=4.6)
    with pytest.raises(ValueError, match=r"below the cheapest allocation \(5\.2500 bits"):
        check_quantize_budget(model, cfg)
    check_quantize_budget(model, dataclasses.replace(cfg, budget=5.4))
