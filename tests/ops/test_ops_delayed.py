"""Delayed scaling: tensor scales from an amax history carried through the custom VJP."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from microscale.formats import fake_quantize
from microscale.model import PrecisionRules, apply_rules
from microscale.ops import SLOTS, Recipe, get_recipe, qdot
from microscale.ops.delayed import AmaxHistory, DelayedScalingDot, overwrite_amax_histories
from microscale.ops.dot import init_amax_history

HI = jax.lax.Precision.HIGHEST


def _data(m=24, k=32, n=16):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k)) * 3
    w = jax.random.normal(kw, (k, n)) / np.sqrt(k)
    dy = jax.random.normal(kd, (m, n)) * 0.01
    return x, w, dy


def _grads(recipe, x, w, dy, hist):
    def f(x, w, h):
        return jnp.sum(qdot(x, w, recipe, amax_history=h) * dy)

    y = qdot(x, w, recipe, amax_history=hist)
    return (y,) + jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, hist)


def test_history_cotangent_is_the_next_history():
    """Each row gets this call's amax pushed in front; the oldest entry drops out."""
    recipe = get_recipe("fp8_delayed")
    x, w, dy = _data()
    hist = jax.random.uniform(jax.random.key(1), (6, recipe.amax_history_len))
    *_, new = _grads(recipe, x, w, dy, hist)
    amax = {"x": np.abs(x).max(), "w": np.abs(w).max(), "dy": np.abs(dy).max()}
    want_now = [amax[s.split("_")[1]] for s in SLOTS]
    np.testing.assert_allclose(np.asarray(new[:, 0]), want_now, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(new[:, 1:]), np.asarray(hist[:, :-1]))


def test_scales_come_from_the_history_not_the_tensor():
    """With a history max of 2x / 0.25x the true amax, the operands are quantized with
    that amax: coarser, or saturated at the format's max."""
    recipe = get_recipe("fp8_delayed")
    x, w, dy = _data()
    for factor in (2.0, 0.25):
        amax = {
            "fprop_x": np.abs(x).max(),
            "fprop_w": np.abs(w).max(),
            "dgrad_dy": np.abs(dy).max(),
            "dgrad_w": np.abs(w).max(),
            "wgrad_x": np.abs(x).max(),
            "wgrad_dy": np.abs(dy).max(),
        }
        hist = (
            init_amax_history(recipe).at[:, 5].set(jnp.asarray([amax[s] for s in SLOTS]) * factor)
        )
        y, dx, dw, _ = _grads(recipe, x, w, dy, hist)

        def fq(t, slot, amax=amax, factor=factor):
            spec = getattr(recipe, slot)
            return fake_quantize(t, spec.format, amax=amax[slot] * factor)

        np.testing.assert_allclose(
            y, jnp.matmul(fq(x, "fprop_x"), fq(w, "fprop_w"), precision=HI), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            dx,
            jnp.matmul(fq(dy, "dgrad_dy"), fq(w, "dgrad_w").T, precision=HI),
            rtol=1e-5,
            atol=1e-7,
        )
        np.testing.assert_allclose(
            dw,
            jnp.matmul(fq(x, "wgrad_x").T, fq(dy, "wgrad_dy"), precision=HI),
            rtol=1e-5,
            atol=1e-7,
        )
        # ... and differs from current scaling, which would use the true amax.
        assert not np.array_equal(np.asarray(y), np.asarray(qdot(x, w, "fp8")))


def test_most_recent_uses_the_newest_entry_only():
    """amax_compute="most_recent": an older, huge amax in the window is ignored, so a
    history holding the current amaxes up front reproduces current scaling exactly."""
    recipe = Recipe.fp8(scaling="delayed").replace(amax_compute="most_recent")
    x, w, dy = _data()
    now = jnp.asarray([np.abs(t).max() for t in (x, w, dy, w, x, dy)])
    hist = init_amax_history(recipe).at[:, 1].set(1e6).at[:, 0].set(now)
    y, dx, dw, _ = _grads(recipe, x, w, dy, hist)
    y0, pb = jax.vjp(lambda x, w: qdot(x, w, "fp8"), x, w)
    dx0, dw0 = pb(dy)
    for a, b in ((y, y0), (dx, dx0), (dw, dw0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_use_is_refused_with_a_clear_error():
    x, w, _ = _data()
    with pytest.raises(ValueError, match="delayed scaling: pass amax_history"):
        qdot(x, w, "fp8_delayed")
    with pytest.raises(ValueError, match="uses current scaling"):
        qdot(x, w, "fp8", amax_history=init_amax_history("fp8_delayed"))
    with pytest.raises(ValueError, match=r"shape \(6, 3\).*expects \(6, 16\)"):
        qdot(x, w, "fp8_delayed", amax_history=jnp.zeros((6, 3)))
    with pytest.raises(ValueError, match="per-tensor scale.*mxfp8"):
        Recipe.mx("mxfp8").replace(scaling="delayed")
    with pytest.raises(ValueError, match="unknown scaling 'late'"):
        Recipe.fp8(scaling="late")
    with pytest.raises(ValueError, match="needs a delayed-scaling recipe"):
        DelayedScalingDot("fp8")


def test_precision_rules_refuse_delayed_recipes():
    model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="delayed scaling.*DelayedScalingDot"):
        apply_rules(model, PrecisionRules.uniform("fp8_delayed"))


def test_nnx_training_carries_the_history():
    """An nnx.Linear with DelayedScalingDot trains under nnx.jit; the history fills with
    the per-step amaxes and training tracks current-scaling FP8."""
    kx, ky = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (64, 32))
    y = jnp.tanh(x @ jax.random.normal(ky, (32, 16)) / 4)

    def train(dot_general, steps=6):
        layer = nnx.Linear(32, 16, dot_general=dot_general, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(layer, optax.adam(3e-2), wrt=nnx.Param)

        @nnx.jit
        def step(layer, opt):
            diff = nnx.DiffState(0, nnx.Any(nnx.Param, AmaxHistory))
            loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean(), argnums=diff)(
                layer
            )
            opt.update(layer, nnx.filter_state(grads, nnx.Param))
            overwrite_amax_histories(layer, grads)
            return loss

        return layer, [float(step(layer, opt)) for _ in range(steps)]

    layer, losses = train(DelayedScalingDot("fp8_delayed"))
    assert losses[-1] < 0.7 * losses[0]
    hist = np.asarray(layer.dot_general.amax_history[...])
    # fprop_x row: x is fixed, so every filled entry is amax(x); 6 steps of 16 filled.
    np.testing.assert_allclose(hist[SLOTS.index("fprop_x"), :6], np.abs(x).max(), rtol=1e-6)
    assert (hist[:, 6:] == 0).all() and (hist[:, :6] > 0).all()
    # The weight row follows the weights as they train.
    w_row = hist[SLOTS.index("fprop_w"), :6]
    assert len(set(w_row.tolist())) > 1
    _, ref = train(lambda *a, **k: jax.lax.dot_general(*a, **k))
    assert abs(losses[-1] - ref[-1]) < 0.1 * ref[-1]
