"""Sensitivity scores on a tiny model: the one-pass gradient score equals a direct
per-layer computation; KL / loss scores; taps; determinism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from microscale.ptq import (
    ActQuant,
    Engine,
    WeightPTQ,
    intercept_linears,
    kl_loss_scores,
    next_token_loss,
    quantize_weight,
    score,
)

FMTS = ("nvfp4", "mxfp4", "bf16")


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model)


@pytest.fixture(scope="module")
def qweights(engine):
    return {
        f: {p: quantize_weight(engine.kernels[p], f, WeightPTQ.rtn()) for p in engine.paths}
        for f in FMTS
    }


def _tap_one(engine, params, path, eps, tokens):
    """``(loss, (X, Y))``: the loss with ``eps`` added to layer ``path``'s output only, and
    that layer's input and output (a hook of its own, not Engine.grad_terms')."""
    model = nnx.merge(engine.graphdef, nnx.State(params), engine.rest)
    seen = {}

    def hook(p, call, x):
        y = call(x)
        if p == path:
            seen["x"], seen["y"] = x, y
            y = y + eps.astype(y.dtype)
        return y

    with intercept_linears(model, hook):
        loss = next_token_loss(model, tokens)
    return loss, (seen["x"], seen["y"])


def _direct_score(engine, tokens, path, wq_values) -> float:
    """s = sum((dL/dY * (Y_q - Y))^2) for ONE layer, from scratch: Y and Y_q measured by
    running the model twice (fp, and with only this layer's kernel replaced), dL/dY by
    differentiating the loss w.r.t. a perturbation of this layer's output only."""

    def run(params, eps, tokens):
        return _tap_one(engine, params, path, eps, tokens)

    @jax.jit
    def both(params, qparams, eps, tokens):
        (_, (_, y)), g = jax.value_and_grad(run, argnums=1, has_aux=True)(params, eps, tokens)
        _, (_, yq) = run(qparams, eps, tokens)
        return jnp.sum(jnp.square(g * (yq.astype(jnp.float32) - y.astype(jnp.float32))))

    out = engine.kernels[path].shape[1]
    eps = jnp.zeros(tokens[:, :-1].shape + (out,), jnp.float32)
    return float(
        both(engine.params, engine.with_kernels({path: wq_values}), eps, jnp.asarray(tokens))
    )


@pytest.mark.slow
def test_gradient_score_matches_direct_per_layer_computation(engine, qweights, token_batches):
    calib, _ = token_batches
    got = score(engine, calib[:1], qweights, "gradient")
    for path, f in (("layers.0.attn.v_proj", "nvfp4"), ("layers.1.mlp.down_proj", "mxfp4")):
        direct = _direct_score(engine, calib[0], path, qweights[f][path].values)
        # Y_q - Y measured from two bf16 forward passes vs X dW in float32
        assert got[path][f] == pytest.approx(direct, rel=0.05), (path, f)
        assert got[path]["bf16"] == 0.0
    # batches add up; the same inputs give the same scores
    two = score(engine, calib, qweights, "gradient")
    one_b = score(engine, calib[1:], qweights, "gradient")
    p = engine.paths[0]
    assert two[p]["nvfp4"] == pytest.approx(got[p]["nvfp4"] + one_b[p]["nvfp4"], rel=1e-6)
    assert score(engine, calib[:1], qweights, "gradient") == got


@pytest.mark.slow
def test_gradient_linear_term_equals_kernel_gradient(engine, qweights, token_batches):
    """sum(dL/dY * X dW) == <dL/dW, dW>: the tapped X and dL/dY agree with the ordinary
    parameter gradient (no tap involved on that side)."""
    calib, _ = token_batches
    tokens = jnp.asarray(calib[0])
    path = "layers.1.attn.q_proj"
    dw = qweights["nvfp4"][path].values.astype(jnp.bfloat16).astype(jnp.float32) - engine.kernels[
        path
    ].astype(jnp.bfloat16).astype(jnp.float32)

    def loss_of_kernel(k):
        params = engine.with_kernels({path: k})
        return next_token_loss(nnx.merge(engine.graphdef, nnx.State(params), engine.rest), tokens)

    gw = jax.jit(jax.grad(loss_of_kernel))(engine.kernels[path])
    ref = float(jnp.sum(gw * dw))

    def tapped(eps):
        return _tap_one(engine, engine.params, path, eps, tokens)

    out = engine.kernels[path].shape[1]
    g, (x, _) = jax.jit(jax.grad(tapped, has_aux=True))(jnp.zeros(tokens[:, :-1].shape + (out,)))
    got = float(jnp.sum(g * (x.astype(jnp.float32) @ dw)))
    assert got == pytest.approx(ref, rel=0.03, abs=1e-9)


@pytest.mark.slow
def test_kl_and_loss_scores(engine, qweights, token_batches):
    calib, _ = token_batches
    kl, dloss = kl_loss_scores(engine, calib[:1], qweights)
    p = "layers.0.attn.q_proj"
    assert kl[p]["bf16"] == pytest.approx(0.0, abs=1e-7)
    assert kl[p]["nvfp4"] > 0 and kl[p]["mxfp4"] > 0
    base = engine.loss(engine.params, calib[:1])
    direct = engine.loss(engine.with_kernels({p: qweights["nvfp4"][p].values}), calib[:1])
    assert dloss[p]["nvfp4"] == pytest.approx(direct - base, abs=1e-6)


@pytest.mark.slow
def test_w4a4_scores_include_input_quantization(engine, qweights, token_batches):
    calib, _ = token_batches
    amax = engine.input_amax(calib)
    assert all(v > 0 for v in amax.values())
    w = score(engine, calib[:1], qweights, "gradient")
    wa = score(engine, calib[:1], qweights, "gradient", activations=True, act_amax=amax)
    p = "layers.0.mlp.up_proj"
    assert wa[p]["bf16"] == 0.0
    assert wa[p]["nvfp4"] > w[p]["nvfp4"]  # quantizing the input adds error


def test_engine_leaves_the_model_alone(tiny_model):
    from microscale.model import PrecisionRules, assignments

    before = assignments(tiny_model)
    tiny_model.set_rules(PrecisionRules(default="nvfp4"))
    try:
        e = Engine(tiny_model)
        assert set(assignments(tiny_model).values()) == {"nvfp4"}  # untouched
        model = nnx.merge(e.graphdef, nnx.State(e.params), e.rest)
        assert set(assignments(model).values()) == {"bf16"}  # the engine's copy: bf16
        # ... attending in query chunks (the model's own setting is left as it was)
        assert model.config.attention_chunk == 128 == model.layers[0].attn.attention_chunk
        assert tiny_model.config.attention_chunk == 0 == tiny_model.layers[0].attn.attention_chunk
        e2 = Engine(tiny_model, attention_chunk=None)
        own = nnx.merge(e2.graphdef, nnx.State(e2.params), e2.rest)
        assert own.layers[0].attn.attention_chunk == 0
    finally:
        tiny_model.set_rules(PrecisionRules(default=before[next(iter(before))]))


@pytest.mark.slow
def test_tap_outside_its_block_raises(tiny_model):
    e = Engine(tiny_model)
    model = nnx.merge(e.graphdef, nnx.State(e.params), e.rest)
    tokens = jnp.zeros((1, 4), jnp.int32)
    with intercept_linears(model, lambda p, call, x: call(x)):
        copy = nnx.clone(model)  # copies of tapped layers, unknown to the hook table
        with pytest.raises(RuntimeError, match="outside its intercept_linears block"):
            copy(tokens)
    # classes are restored: the model runs normally afterwards
    logits = model(tokens)
    assert logits.shape == (1, 4, 257)
    assert np.isfinite(np.asarray(logits)).all()


def test_taylor_terms_combine_first_and_second_order(engine, qweights, token_batches):
    """taylor = linear + (N/2) token_fisher per batch, averaged over batches; the linear
    term is the signed first-order change (it sums per batch like the Fisher term)."""
    calib, _ = token_batches
    deltas = {
        f: {
            p: qweights[f][p].values.astype(jnp.bfloat16).astype(jnp.float32)
            - engine.kernels[p].astype(jnp.bfloat16).astype(jnp.float32)
            for p in engine.paths
        }
        for f in FMTS
    }
    per = [engine.grad_terms(calib[i : i + 1], deltas) for i in range(2)]
    n_tok = calib.shape[1] * (calib.shape[2] - 1)
    tay = score(engine, calib, qweights, "taylor")
    for p in engine.paths[:4]:
        want = (
            sum(t["linear"][p]["nvfp4"] + 0.5 * n_tok * t["token_fisher"][p]["nvfp4"] for t in per)
            / 2
        )
        assert tay[p]["nvfp4"] == pytest.approx(want, rel=1e-4, abs=1e-12)
        assert tay[p]["bf16"] == 0.0
        assert per[0]["fisher"][p]["nvfp4"] > 0 and per[0]["token_fisher"][p]["nvfp4"] > 0
    # packed candidates (dY = X W_q - X W) and dense deltas (dY = X dW) agree to float32
    # rounding; a wrong term or batch would not
    grad = score(engine, calib[:1], qweights, "gradient")
    for p, row in per[0]["fisher"].items():
        assert grad[p] == pytest.approx(row, rel=2e-5, abs=1e-15), p
    signs = {np.sign(per[0]["linear"][p][f]) for p in engine.paths for f in ("nvfp4", "mxfp4")}
    assert signs == {-1.0, 1.0}  # the first-order term is signed


def test_taylor_tracks_the_measured_loss_change(engine, qweights, token_batches):
    """The one-pass taylor estimate follows the measured per-layer loss change (the
    "loss" method: one forward per layer and format) in sign and size."""
    calib, _ = token_batches
    tay = score(engine, calib[:1], qweights, "taylor")
    _, dloss = kl_loss_scores(engine, calib[:1], qweights)
    est = np.array([tay[p][f] for p in engine.paths for f in ("nvfp4", "mxfp4")])
    meas = np.array([dloss[p][f] for p in engine.paths for f in ("nvfp4", "mxfp4")])
    assert np.corrcoef(est, meas)[0, 1] > 0.9
    big = np.abs(meas) > 0.2 * np.abs(meas).max()
    assert big.sum() >= 3 and np.all(np.sign(est[big]) == np.sign(meas[big]))


def _outputs(engine, params, tokens) -> dict:
    """Every linear layer's output on ``tokens`` (used under eval_shape for shapes)."""
    model = nnx.merge(engine.graphdef, nnx.State(params), engine.rest)
    ys = {}

    def hook(path, call, x):
        ys[path] = call(x)
        return ys[path]

    with intercept_linears(model, hook):
        next_token_loss(model, tokens)
    return ys


def _all_at_once_terms(engine, tokens, deltas):
    """The Taylor terms from scratch: ONE compiled function capturing every layer's ``X``
    and ``dL/dY`` and holding every layer's dense delta in every format."""

    def f(params, tokens, deltas):
        def fwd(eps):
            model = nnx.merge(engine.graphdef, nnx.State(params), engine.rest)
            xs = {}

            def hook(path, call, x):
                xs[path] = x
                y = call(x)
                return y + eps[path].astype(y.dtype)

            with intercept_linears(model, hook):
                loss = next_token_loss(model, tokens)
            return loss, xs

        shapes = jax.eval_shape(lambda: _outputs(engine, params, tokens))
        eps = {p: jnp.zeros(s.shape, jnp.float32) for p, s in shapes.items()}
        _, vjp, xs = jax.vjp(fwd, eps, has_aux=True)
        (g,) = vjp(jnp.float32(1.0))
        out = {}
        for fmt, d in deltas.items():
            out[fmt] = {}
            for p in engine.paths:
                dy = xs[p].astype(jnp.float32) @ d[p]
                gp = g[p].astype(jnp.float32)
                lin = jnp.sum(gp * dy)
                tok = jnp.sum(jnp.square(jnp.sum(gp * dy, -1)))
                out[fmt][p] = jnp.stack(
                    [
                        jnp.sum(jnp.square(gp * dy)),
                        lin,
                        tok,
                        lin + 0.5 * np.prod(gp.shape[:-1]) * tok,
                    ]
                )
        return out

    return jax.device_get(jax.jit(f)(engine.params, jnp.asarray(tokens), deltas))


@pytest.mark.parametrize("method", ["taylor", "gradient"])
def test_streamed_scores_equal_the_all_at_once_scores(engine, qweights, token_batches, method):
    """Scoring computes each layer's terms inside the backward pass, decoding its packed
    candidates there (one compiled call per batch, each layer in its own branch); the
    scores are those of a plain float32 computation from the captured ``X`` and ``dL/dY``
    with every layer's dense delta in every format, to float32 rounding."""
    calib, _ = token_batches
    deltas = {
        f: {
            p: qweights[f][p].values.astype(jnp.bfloat16).astype(jnp.float32)
            - engine.kernels[p].astype(jnp.bfloat16).astype(jnp.float32)
            for p in engine.paths
        }
        for f in FMTS
    }
    per = [_all_at_once_terms(engine, b, deltas) for b in calib]
    got = score(engine, calib, qweights, method)
    i = 3 if method == "taylor" else 0
    for p in engine.paths:
        for f in FMTS:
            want = sum(float(t[f][p][i]) for t in per)
            want = want / len(per) if method == "taylor" else want
            # the scores' GEMMs run on bf16 operands with float32 accumulation and form
            # dY as X W_q - X W (engine._layer_terms): float32 rounding of dY, ~1e-6,
            # which the signed sum linear + (N/2) token_fisher can amplify (3e-5 seen)
            assert got[p][f] == pytest.approx(want, rel=1e-4, abs=1e-12), (p, f)


def test_static_and_dynamic_input_scales_share_one_compile(engine, qweights, token_batches):
    """W4A4 evaluation compiles once per palette: whether the input amax is static (the
    calibrated one) or dynamic (each batch's own) is a traced input too, and either gives
    the loss of quantizing every input with that amax (dynamic: ``amax=None``)."""
    from microscale.ptq.engine import _qact

    calib, _ = token_batches
    assign = {p: "nvfp4" for p in engine.paths}
    params = engine.with_kernels({p: qweights["nvfp4"][p].values for p in engine.paths})
    amax = engine.input_amax(calib)
    before = len(engine._jit_cache)
    dynamic = engine.batch_losses(params, calib, ActQuant.matching(assign, None, ("nvfp4",)))
    static = engine.batch_losses(params, calib, ActQuant.matching(assign, amax, ("nvfp4",)))
    assert len(engine._jit_cache) == before + 1

    @jax.jit
    def direct(tokens, amax):
        model = nnx.merge(engine.graphdef, nnx.State(params), engine.rest)

        def hook(path, call, x):
            return call(_qact(x, "nvfp4", None if amax is None else amax[path]))

        with intercept_linears(model, hook):
            return next_token_loss(model, tokens)

    static_amax = {p: jnp.float32(a) for p, a in amax.items()}
    for i, b in enumerate(calib):
        assert dynamic[i] == pytest.approx(float(direct(b, None)), rel=1e-6)
        assert static[i] == pytest.approx(float(direct(b, static_amax)), rel=1e-6)
    assert not np.array_equal(dynamic, static)


@pytest.mark.parametrize("method", ["taylor", "gradient"])
def test_score_pass_measures_the_input_amax(engine, qweights, token_batches, method):
    """The one-pass methods capture every layer's input anyway: ``input_amax`` gets the
    amax the calibrate phase's forward passes measure (quantize then skips that phase
    for weight-only round-to-nearest runs), and the scores are the same with or without
    it. The other methods refuse it, naming the method."""
    calib, _ = token_batches
    got: dict[str, float] = {}
    with_amax = score(engine, calib, qweights, method, input_amax=got)
    want = engine.input_amax(calib)
    assert set(got) == set(engine.paths)
    for p in engine.paths:
        # two compiled programs computing the same forward: equal to float32 rounding
        assert got[p] == pytest.approx(want[p], rel=1e-6), p
    assert with_amax == score(engine, calib, qweights, method)
    with pytest.raises(ValueError, match="method='kl'"):
        score(engine, calib, qweights, "kl", input_amax={})
