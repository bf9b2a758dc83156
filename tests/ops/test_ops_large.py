"""Recipes at the sizes they are for, checked without allocating (abstract shapes)."""

import jax
import jax.numpy as jnp
import pytest

from microscale.ops import qdot


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4_rht_sr"])
def test_train_step_lowers_with_dy_past_2_33_elements(recipe):
    """A Llama-8B ``up_proj`` at 2M tokens per microbatch: dY is [2^21, 2^13] (2^34
    elements, stochastic rounding in dgrad and wgrad). The step (forward, both gradients,
    an SGD update of the float32 master weight) must trace and lower to StableHLO."""
    m, k, n = 2**21, 64, 2**13
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.float32)

    def step(x, w, key):
        def loss(w):
            y = qdot(x, w.astype(jnp.bfloat16), recipe, key=key)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        value, grad = jax.value_and_grad(loss)(w)
        return value, w - 1e-3 * grad

    key = jax.eval_shape(lambda: jax.random.key(0))
    value, new_w = jax.eval_shape(step, x, w, key)
    assert new_w.shape == (k, n) and new_w.dtype == jnp.float32
    text = jax.jit(step).lower(x, w, key).as_text()
    assert f"{m}x{n}" in text  # the dY-sized tensors are in the program
