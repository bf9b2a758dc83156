"""AWQ-style activation-aware scales (microscale.ptq.awq): the fold keeps the model's
function, alpha 0 is the identity, the chosen scales lower a layer's quantized output
error, quantize_model runs with them end to end, and an unknown structure is refused."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from microscale.config import apply_overrides
from microscale.formats import dequantize, quantize
from microscale.model import ModelConfig, Transformer, iter_linears
from microscale.ptq import QuantizeConfig, WeightPTQ, awq_fold, quantize_model, write_outputs
from microscale.ptq.awq import awq_plan, awq_scales, fold_scales
from microscale.ptq.tap import intercept_linears


def _f32_logits(model: Transformer, tokens: np.ndarray) -> np.ndarray:
    """The model's logits with every GEMM in float32 (the linear layers through a hook,
    the LM head in numpy): the exact-arithmetic function up to float32 rounding."""
    mods = dict(iter_linears(model))

    def hook(path, call, x):
        return x.astype(jnp.float32) @ mods[path].kernel[...].astype(jnp.float32)

    with intercept_linears(model, hook):
        x = np.asarray(model.features(jnp.asarray(tokens)), np.float64)
    if model.config.tie_embeddings:
        return x @ np.asarray(model.embed.embedding[...], np.float64).T
    return x @ np.asarray(model.lm_head.kernel[...], np.float64)


def _cfg(n_heads: int, n_kv_heads: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=257,
        d_model=64,
        n_layers=2,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=128,
        max_seq_len=64,
        tie_embeddings=tied,
        compute_dtype="float32",
    )


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 257, size=(2, 4, 33)).astype(np.int32)


@pytest.mark.parametrize(
    "heads,kv,tied",
    [(2, 2, True), (2, 2, False), (4, 2, True), (2, 1, False), (4, 4, False)],
    ids=["mha-tied", "mha-untied", "gqa2-tied", "mqa-untied", "mha4-untied"],
)
def test_fold_keeps_the_float32_function(heads, kv, tied):
    model = Transformer(_cfg(heads, kv, tied), rngs=nnx.Rngs(1))
    toks = _tokens()[0, :, :-1]
    want = _f32_logits(model, toks)
    folded = nnx.clone(model)
    rng = np.random.default_rng(2)
    plan = awq_plan(folded)
    assert len(plan) == 8 and {g.kind for g in plan} == {"norm", "columns"}
    for g in plan:  # every group scaled, strongly (s spans ~e^+-6)
        d_in = dict(iter_linears(folded))[g.layers[0]].kernel.shape[0]
        s = np.exp(2 * rng.standard_normal(d_in // g.repeat)).astype(np.float32)
        if g.repeat > 1:  # one scale per kv channel, repeated over its query heads
            s = np.repeat(s.reshape(-1, 1, g.head_dim), g.repeat, axis=1).reshape(-1)
        fold_scales(folded, g, s)
    got = _f32_logits(folded, toks)
    changed = [
        ka
        for (ka, a), (_, b) in zip(
            nnx.to_flat_state(nnx.state(model, nnx.Param)),
            nnx.to_flat_state(nnx.state(folded, nnx.Param)),
            strict=True,
        )
        if not np.array_equal(np.asarray(a[...]), np.asarray(b[...]))
    ]
    assert len(changed) == 2 * 9, changed  # 7 kernels and 2 norms per block
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize(
    "changes",
    [
        dict(family="qwen2"),
        dict(family="qwen3", attn_head_dim=32),
        dict(family="mistral"),
        dict(family="gemma3", sliding_window=4, sliding_window_pattern=2),
    ],
    ids=lambda c: c["family"],
)
def test_fold_keeps_the_float32_function_of_every_family(changes):
    """Qwen2's v_proj bias is divided with its columns; Qwen3's q/k norms sit after the
    projections, where the fold leaves q and k unchanged; Gemma 3's norms multiply by
    ``1 + w``, so the fold divides ``1 + w``, and its GeGLU's up columns fold as SwiGLU's."""
    model = Transformer(_cfg(4, 2, False).replace(**changes), rngs=nnx.Rngs(1))
    for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "bias" or "norm" in str(path[-2]):  # off their init
            p.set_value(p[...] + 0.5 * np.random.default_rng(len(path)).standard_normal(p.shape))
    toks = _tokens()[0, :, :-1]
    want = _f32_logits(model, toks)
    folded = nnx.clone(model)
    rng = np.random.default_rng(2)
    for g in awq_plan(folded):
        d_in = dict(iter_linears(folded))[g.layers[0]].kernel.shape[0]
        s = np.exp(2 * rng.standard_normal(d_in // g.repeat)).astype(np.float32)
        if g.repeat > 1:
            s = np.repeat(s.reshape(-1, 1, g.head_dim), g.repeat, axis=1).reshape(-1)
        fold_scales(folded, g, s)
    np.testing.assert_allclose(
        _f32_logits(folded, toks), want, rtol=0, atol=2e-5 * np.abs(want).max()
    )


def test_fold_of_a_wrong_repeat_is_caught():
    """The check above can fail: scales that differ between the query heads of one kv
    group cannot fold into v_proj, and the function changes."""
    model = Transformer(_cfg(4, 2, True), rngs=nnx.Rngs(1))
    toks = _tokens()[0, :, :-1]
    want = _f32_logits(model, toks)
    (o,) = [g for g in awq_plan(model) if g.name == "layers.0.attn.o"]
    assert o.repeat == 2 and o.head_dim == 16
    folded = nnx.clone(model)
    fold_scales(folded, o, np.linspace(0.5, 2.0, 64).astype(np.float32))
    assert np.abs(_f32_logits(folded, toks) - want).max() > 1e-3 * np.abs(want).max()


def test_alpha_zero_is_the_identity(tiny_model, token_batches):
    calib, _ = token_batches
    folded, info = awq_fold(tiny_model, calib, alphas=(0.0,))
    assert folded is not tiny_model
    assert {g["alpha"] for g in info["groups"].values()} == {0.0}
    assert all(g["s_min"] == g["s_max"] == 1.0 for g in info["groups"].values())
    for (ka, a), (kb, b) in zip(
        nnx.to_flat_state(nnx.state(tiny_model, nnx.Param)),
        nnx.to_flat_state(nnx.state(folded, nnx.Param)),
        strict=True,
    ):
        assert ka == kb
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    assert info["tokens"] == calib.shape[0] * calib.shape[1] * (calib.shape[2] - 1)


def test_awq_fold_leaves_the_model_untouched(token_batches):
    model = Transformer(_cfg(4, 2, True), rngs=nnx.Rngs(3))
    before = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    folded, info = awq_fold(model, token_batches[0], alphas=(1.0,))
    assert any(g["alpha"] == 1.0 for g in info["groups"].values())
    for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(v[...]), before[k])


def _outlier_layer(n_in: int, n_out: int, seed: int):
    """Inputs with a few outlier channels (x30) and a random kernel [in, out]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((512, n_in)).astype(np.float32)
    x[:, rng.choice(n_in, size=max(2, n_in // 32), replace=False)] *= 30.0
    w = (rng.standard_normal((n_in, n_out)) * 0.05).astype(np.float32)
    return x, w


def _rtn_values(w: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(dequantize(quantize(jnp.asarray(w.T), fmt, axis=-1))).T


# (format, bound on the chosen scales' output error / plain RTN's). NVFP4's E4M3 block
# scale puts a scaled-up salient weight (its block's max) on the grid exactly: large gains.
# MXFP4's power-of-two scale maps the block max anywhere in [4, 8) of E2M1's coarse top,
# so scaling buys nothing measurable on these layers (alpha 0, no change, is kept: never
# worse); MXFP8's finer elements gain a little (1-15% here).
BOUNDS = {"nvfp4": 0.8, "mxfp8": 0.99, "mxfp4": 1.0}


@pytest.mark.parametrize("fmt", list(BOUNDS))
@pytest.mark.parametrize("shape", [(128, 64), (256, 96)], ids=["128x64", "256x96"])
def test_scales_lower_the_output_error_of_an_outlier_layer(fmt, shape):
    x, w = _outlier_layer(*shape, seed=shape[0] + shape[1])
    x64 = x.astype(np.float64)
    alpha, s, errors = awq_scales(
        [w], np.abs(x).mean(axis=0), x64.T @ x64, fmt=fmt, ptq=WeightPTQ.rtn()
    )
    ref = x64 @ w
    plain = np.sum((ref - x64 @ _rtn_values(w, fmt)) ** 2)
    # the chosen scales, applied by hand: (X / s) Q(diag(s) W)
    q = _rtn_values(w * s[:, None], fmt)
    scaled = np.sum((ref - (x64 / s) @ q) ** 2)
    assert errors[0.0] == pytest.approx(plain, rel=1e-3)
    assert errors[alpha] == pytest.approx(scaled, rel=1e-3)
    assert min(errors.values()) == errors[alpha] and scaled <= plain * (1 + 1e-6)
    if BOUNDS[fmt] < 1:
        assert alpha > 0 and scaled < BOUNDS[fmt] * plain, (fmt, shape, alpha, scaled / plain)


CFG = QuantizeConfig(
    budget=5.5,
    formats=("nvfp4", "fp8_e4m3", "bf16"),
    uniform_formats=("nvfp4", "bf16"),
    pareto_budgets=(),
    ptq=WeightPTQ(scale_grid=(0.8, 1.0, 1.2)),
    ptq_effects=False,
    awq=True,
    awq_alphas=(0.0, 0.5, 1.0),
)


def test_quantize_model_with_awq_writes_loadable_outputs(tiny_model, token_batches, tmp_path):
    export = pytest.importorskip("microscale.export")
    calib, evals = token_batches
    result = quantize_model(tiny_model, calib, evals, CFG)
    rep = write_outputs(result, tmp_path, model_config=tiny_model.config)
    assert rep["checkpoint"]["layout"] == "compressed-tensors"
    awq = rep["awq"]
    assert awq["tokens"] == result.calibration["tokens"] and awq["format"] == "nvfp4"
    assert len(awq["groups"]) == 8
    assert all(g["alpha"] in (0.0, 0.5, 1.0) for g in awq["groups"].values())
    assert all(g["error"] <= g["error_alpha0"] for g in awq["groups"].values())
    assert "awq_s" in result.timings
    md = (tmp_path / "report.md").read_text()
    assert "## AWQ scales" in md and "| layers.0.attn.qkv |" in md
    back = export.read_checkpoint(tmp_path / "checkpoint").dequantized_params()
    for p, w in result.weights.items():  # the folded model's quantized weights
        want = w.values.astype("bfloat16") if w.format == "bf16" else w.values
        np.testing.assert_array_equal(
            np.asarray(back[f"{p}.kernel"], np.float32), np.asarray(want, np.float32)
        )
    params = result.engine.params
    for i in range(2):  # the folded norms are what the checkpoint carries
        for n in ("attn_norm", "mlp_norm"):
            got = np.asarray(back[f"layers.{i}.{n}.scale"], np.float32)
            np.testing.assert_allclose(
                got, np.asarray(params["layers"][i][n]["scale"], np.float32), rtol=1e-2
            )
    scaled = [n for n, g in awq["groups"].items() if g["alpha"] > 0]
    assert scaled, awq  # something was folded, or the test shows nothing
    # the folded bf16 reference: the same function up to bf16 rounding
    plain = quantize_model(tiny_model, calib, evals, dataclasses.replace(CFG, awq=False))
    assert "awq" not in plain.report().to_dict()
    assert result.points["bf16"]["val_ppl"] == pytest.approx(
        plain.points["bf16"]["val_ppl"], rel=1e-2
    )


def test_awq_config_keys_and_validation():
    cfg = apply_overrides(QuantizeConfig(), ["awq=true", "awq_alphas=0,0.25,0.5"])
    assert cfg.awq and cfg.awq_alphas == (0.0, 0.25, 0.5) and cfg.awq_format == "nvfp4"
    assert not QuantizeConfig().awq
    with pytest.raises(ValueError, match="awq_alphas"):
        QuantizeConfig(awq=True, awq_alphas=(0.5, 2.0))
    with pytest.raises(ValueError, match="awq_format"):
        QuantizeConfig(awq=True, awq_format="bf16")


class _Toy(nnx.Module):
    def __init__(self):
        self.embed = nnx.Embed(257, 32, rngs=nnx.Rngs(0))
        self.proj = nnx.Linear(32, 257, rngs=nnx.Rngs(0))

    def __call__(self, tokens):
        return self.proj(self.embed(tokens))


def test_unfoldable_structure_is_refused(tiny_model, token_batches):
    with pytest.raises(ValueError, match=r"AWQ cannot fold .* layer 'proj'"):
        awq_fold(_Toy(), token_batches[0])
    broken = nnx.clone(tiny_model)
    del broken.layers[1].mlp_norm
    with pytest.raises(ValueError, match=r"layer 'layers\.1\.mlp\.gate_proj'.*mlp_norm"):
        awq_plan(broken)
    with pytest.raises(ValueError, match=r"AWQ cannot fold .* layer 'proj'"):
        quantize_model(_Toy(), *token_batches, dataclasses.replace(CFG, pin=()))
