"""PTQ beyond round-to-nearest: MSE tensor scale, four over six, shared group scales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microscale.formats import dequantize, get_format, quantize
from microscale.ptq import WeightPTQ, four_over_six, quantize_group, quantize_weight


def _weights(seed: int, shape=(96, 64), heavy: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_t(3, size=shape) if heavy else rng.normal(size=shape)
    return (0.02 * w).astype(np.float32)


def _sq(a, b) -> float:
    return float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "fp8_e4m3"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mse_scale_and_four_over_six_never_worse_than_rtn(fmt, seed):
    w = _weights(seed, heavy=seed == 1)
    rtn = quantize(w.T, fmt, axis=-1)  # RTN reference straight from formats
    rtn_err = _sq(dequantize(rtn).T, w)
    for ptq in (WeightPTQ(four_over_six=False), WeightPTQ(mse_scale=False), WeightPTQ()):
        q = quantize_weight(w, fmt, ptq)
        err = _sq(q.values, w)
        assert err <= rtn_err * (1 + 1e-6), (ptq, err, rtn_err)
        assert q.rel_mse_rtn == pytest.approx(rtn_err / _sq(w, 0), rel=1e-5)
        # the stored QArray (export layout [out, in]) decodes to exactly the values used
        np.testing.assert_array_equal(np.asarray(dequantize(q.qarray)).T, np.asarray(q.values))
        assert q.qarray.shape == (w.shape[1], w.shape[0]) and q.qarray.axis == 1


def test_rtn_options_reproduce_formats_quantize():
    w = _weights(2)
    q = quantize_weight(w, "nvfp4", WeightPTQ.rtn())
    ref = quantize(w.T, "nvfp4", axis=-1)
    np.testing.assert_array_equal(np.asarray(q.qarray.data), np.asarray(ref.data))
    assert q.scale_multiplier == 1.0 and q.four_fraction == 0.0


def test_mse_scale_passes_a_tensor_amax():
    w = _weights(3, heavy=True)
    q = quantize_weight(w, "nvfp4", WeightPTQ(four_over_six=False))
    assert q.amax == pytest.approx(float(np.abs(w).max()) * q.scale_multiplier, rel=1e-6)
    ref = quantize(w.T, "nvfp4", axis=-1, amax=jnp.float32(q.amax))
    np.testing.assert_array_equal(
        np.asarray(q.qarray.scales.view(jnp.uint8)), np.asarray(ref.scales.view(jnp.uint8))
    )
    # MX has no tensor scale: nothing to search, amax None
    assert quantize_weight(w, "mxfp4").amax is None


@pytest.mark.parametrize("seed", range(4))
def test_four_over_six_never_worse_per_block(seed):
    x = _weights(seed, shape=(64, 128), heavy=seed % 2 == 1)
    q46 = four_over_six(x)
    q6 = quantize(x, "nvfp4", axis=-1)
    e46 = ((np.asarray(dequantize(q46)) - x) ** 2).reshape(64, -1, 16).sum(-1)
    e6 = ((np.asarray(dequantize(q6)) - x) ** 2).reshape(64, -1, 16).sum(-1)
    assert np.all(e46 <= e6)
    assert np.mean(e46 < e6) > 0.05  # it does pick the max->4 scale for some blocks
    assert float(q46.global_scale) == float(q6.global_scale)


def test_four_over_six_block_maps_max_to_four():
    """A block of [0.75, 1, ...] * m: max->6 rounds 0.75m to 4.5 -> 4 or 5 -> the grid
    {4, 6} is coarse; max->4 puts 0.75m exactly on 3 and m on 4. (A second row holds the
    tensor amax: the block at the amax could only map to 4 with a larger tensor amax, its
    E4M3 scale would exceed 448 -- the MSE scale search's c = 1.5 covers that.)"""
    row = np.zeros((2, 16), np.float32)
    row[0, :8] = 0.75
    row[0, 8] = 1.0
    row[1, 0] = 2.625  # tensor amax: the block scale bamax * 2688 / 2.625 / 4 = 256, exact
    q = four_over_six(row)
    np.testing.assert_allclose(np.asarray(dequantize(q)), row, rtol=0, atol=1e-7)
    vals = np.abs(
        np.asarray(
            dequantize(
                q.__class__(
                    q.data, q.scales, jnp.float32(1.0), q.spec, q.axis, q.shape, q.block_shape
                )
            )
        )
    )[0]
    # element codes: max maps to 4 (block scale * 4 == block max / global scale)
    assert vals.max() / vals[vals > 0].min() == pytest.approx(4 / 3)


def test_four_over_six_rejects_other_formats():
    with pytest.raises(ValueError, match="E2M1 elements with E4M3 block scales.*mxfp4"):
        four_over_six(np.ones((2, 32), np.float32), "mxfp4")
    with pytest.raises(ValueError, match="2-D"):
        four_over_six(np.ones((32,), np.float32))


def test_group_shares_one_tensor_scale():
    a, b = _weights(4, shape=(64, 64)), 3 * _weights(5, shape=(64, 32))
    qa, qb = quantize_group([a, b], "nvfp4")
    assert float(qa.qarray.global_scale) == float(qb.qarray.global_scale)
    assert qa.amax == qb.amax
    assert qa.amax == pytest.approx(
        max(np.abs(a).max(), np.abs(b).max()) * qa.scale_multiplier, rel=1e-6
    )
    fa, fb = quantize_group([a, b], "fp8_e4m3")
    assert float(fa.qarray.scales) == float(fb.qarray.scales)


def test_bf16_passthrough_and_validation():
    w = _weights(6)
    q = quantize_weight(w, "bf16")
    np.testing.assert_array_equal(
        np.asarray(q.values), np.asarray(jnp.asarray(w).astype(jnp.bfloat16), np.float32)
    )
    assert not get_format(q.format).quantized
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(np.ones((4, 4, 4), np.float32), "nvfp4")
    with pytest.raises(ValueError, match="scale_grid"):
        WeightPTQ(scale_grid=(0.5, -1.0))
    with pytest.raises(ValueError, match="unknown format"):
        quantize_weight(w, "int4")


def test_deterministic():
    w = _weights(7, heavy=True)
    a, b = quantize_weight(w, "nvfp4"), quantize_weight(w, "nvfp4")
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a.qarray, b.qarray))
