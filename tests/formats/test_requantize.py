"""requantize: quantizing with given scales (what GPTQ needs) against quantize itself and an
independent numpy rounding."""

import jax.numpy as jnp
import numpy as np
import pytest

from microscale.formats import (
    block_scales_f32,
    dequantize,
    quantize,
    requantize,
    requantize_values,
)

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt,kw",
    [
        ("nvfp4", {}),
        ("nvfp4", {"four_over_six": True}),
        ("nvfp4", {"amax": 2.5}),
        ("mxfp4", {}),
        ("mxfp8", {}),
        ("fp8_e4m3", {}),
        ("fp8_e5m2", {}),
        ("bf16", {}),
    ],
)
@pytest.mark.parametrize("shape", [(16, 96), (5, 70)])  # 70: padded last block
def test_own_scales_reproduce_quantize_exactly(fmt, kw, shape):
    x = _x(shape)
    q = quantize(x, fmt, axis=-1, **kw)
    r = requantize(x, q)
    assert r.shape == q.shape and r.block_shape == q.block_shape
    np.testing.assert_array_equal(
        np.asarray(r.data).view(np.uint8) if r.spec.packed else np.asarray(r.data, np.float32),
        np.asarray(q.data).view(np.uint8) if q.spec.packed else np.asarray(q.data, np.float32),
    )
    np.testing.assert_array_equal(np.asarray(dequantize(r)), np.asarray(dequantize(q)))
    y = x * np.float32(0.83)  # other values: the unpacked path decodes the same
    np.testing.assert_array_equal(
        np.asarray(requantize_values(y, q)), np.asarray(dequantize(requantize(y, q)))
    )


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_other_values_round_to_nearest_with_the_given_scales(fmt):
    x = _x((8, 64), 1)
    q = quantize(x, fmt, axis=-1)
    y = x * np.float32(0.7) + np.float32(0.05)  # other values, same scales
    r = requantize(y, q)
    np.testing.assert_array_equal(
        np.asarray(r.scales.astype(jnp.float32)), np.asarray(q.scales.astype(jnp.float32))
    )
    bs = q.spec.block_size
    scale = np.repeat(np.asarray(block_scales_f32(q)), bs, axis=-1)
    if q.global_scale is not None:
        scale = scale * np.float32(q.global_scale)
    z = np.abs(y / scale)  # independent: nearest E2M1 magnitude, saturating at 6
    want = np.sign(y) * E2M1_GRID[np.argmin(np.abs(z[..., None] - E2M1_GRID), axis=-1)] * scale
    np.testing.assert_allclose(np.asarray(dequantize(r)), want, rtol=1e-6, atol=0)


def test_q8_0_divides_by_the_stored_scale():
    x = _x((4, 64), 2)
    q = quantize(x, "q8_0", axis=-1)
    r = requantize(x, q)
    step = np.repeat(np.asarray(block_scales_f32(q)), 32, axis=-1)
    assert np.all(np.abs(np.asarray(dequantize(r)) - np.asarray(dequantize(q))) <= step)


def test_bad_arguments_name_the_value():
    q = quantize(_x((4, 32)), "nvfp4", axis=-1)
    with pytest.raises(ValueError, match=r"shape \(4, 16\).*shape \(4, 32\)"):
        requantize(_x((4, 16)), q)
    with pytest.raises(TypeError, match="got ndarray"):
        requantize(_x((4, 32)), np.zeros(3))
