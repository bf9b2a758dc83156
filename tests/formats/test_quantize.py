"""quantize / dequantize: bit-exactness against independent references, properties, edges."""

import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import microscale as ms
from microscale.formats import (
    REGISTRY,
    block_scales_f32,
    get_format,
    quantize_dequantize,
    storage_bits,
    tensor_amax,
    unpack_nibbles,
)

BLOCK_FORMATS = [n for n, s in REGISTRY.items() if s.block_size is not None]
QUANT_FORMATS = [n for n, s in REGISTRY.items() if s.quantized]


def te_nvfp4_reference(x: np.ndarray):
    """Transformer Engine's NVFP4 formulas in plain numpy (float32 throughout; the block
    scale in TE's order, ``block_amax * (s_enc * fl(1/6))``: see test_scale_order.py)."""
    x = x.astype(np.float32)
    f32 = np.float32
    amax = np.abs(x).max()
    with np.errstate(divide="ignore"):
        s_enc = f32(448.0 * 6.0) / amax
    if amax == 0 or not np.isfinite(s_enc):
        s_enc = f32(1.0)
    s_dec = f32(1.0) / s_enc
    xb = x.reshape(x.shape[:-1] + (-1, 16))
    bamax = np.abs(xb).max(-1, keepdims=True)
    sb = np.minimum(bamax * (s_enc * (f32(1.0) / f32(6.0))), 448).astype(ml_dtypes.float8_e4m3fn)
    with np.errstate(divide="ignore"):
        enc = np.minimum(f32(1.0) / (sb.astype(f32) * s_dec), np.finfo(f32).max)
    y = np.clip(xb * enc, -6, 6)
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return codes.reshape(x.shape), sb[..., 0], s_dec


def _datasets():
    rng = np.random.default_rng(0)
    normal = rng.standard_normal((64, 256)).astype(np.float32)
    heavy = rng.standard_t(2, (64, 256)).astype(np.float32)
    mixed = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-12, 12, (64, 1)))).astype(
        np.float32
    )
    for d in (normal, heavy, mixed):
        d[5, 16:48] = 0.0  # two all-zero blocks
    return {"normal": normal, "heavy": heavy, "mixed": mixed}


@pytest.mark.parametrize("name", ["normal", "heavy", "mixed"])
def test_nvfp4_bit_identical_to_transformer_engine_formulas(name):
    x = _datasets()[name]
    codes, sb, s_dec = te_nvfp4_reference(x)
    q = ms.quantize(jnp.asarray(x), "nvfp4")
    np.testing.assert_array_equal(np.asarray(q.codes()), codes)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), sb.view(np.uint8))
    assert np.float32(q.global_scale) == s_dec
    assert q.scales.dtype == jnp.float8_e4m3fn and q.data.dtype == jnp.uint8
    assert q.data.shape == (64, 128) and q.scales.shape == (64, 16)


@pytest.mark.parametrize("name", ["normal", "heavy", "mixed"])
def test_nvfp4_and_mxfp8_bit_identical_to_jax_reference_quantizer(name):
    """On these datasets (no constructed near ties) TE's order, the default, and JAX's
    agree; test_scale_order.py has data where they differ and ``scale_order="jax"``."""
    from jax._src.cudnn import scaled_matmul_stablehlo as ref

    x = _datasets()[name]
    nonzero = np.ones(x.shape, bool)
    nonzero[5, 16:48] = False  # JAX's reference divides a zero block by its zero scale (NaN)
    q = ms.quantize(jnp.asarray(x), "nvfp4")
    cfg = ref.BlockScaleConfig(
        mode="nvfp4",
        block_size=16,
        data_type=jnp.float4_e2m1fn,
        scale_type=jnp.float8_e4m3fn,
        global_scale=q.global_scale,
        infer_only=False,
    )
    rq, rs = ref.quantize(jnp.asarray(x), cfg)
    np.testing.assert_array_equal(
        np.asarray(rs).view(np.uint8), np.asarray(q.scales).view(np.uint8)
    )
    rcodes = np.asarray(rq).view(np.uint8) & 0xF
    np.testing.assert_array_equal(rcodes[nonzero], np.asarray(q.codes())[nonzero])

    q8 = ms.quantize(jnp.asarray(x), "mxfp8")
    cfg8 = ref.BlockScaleConfig(
        mode="mxfp8",
        block_size=32,
        data_type=jnp.float8_e4m3fn,
        scale_type=jnp.float8_e8m0fnu,
        global_scale=None,
        infer_only=False,
    )
    rq8, rs8 = ref.quantize(jnp.asarray(x), cfg8)
    np.testing.assert_array_equal(
        np.asarray(rs8).view(np.uint8), np.asarray(q8.scales).view(np.uint8)
    )
    np.testing.assert_array_equal(
        np.asarray(rq8).view(np.uint8)[nonzero], np.asarray(q8.data).view(np.uint8)[nonzero]
    )


def test_nvfp4_block_scale_covers_all_e4m3_values():
    # One block per positive finite E4M3 value v, built so block_amax * s_enc / 6 == v
    # exactly (tensor amax fixed at 2688 -> s_enc = 1): the stored scale must be v.
    vals = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    x = np.zeros((len(vals), 16), np.float32)
    x[:, 0] = vals * 6
    q = ms.quantize(jnp.asarray(x), "nvfp4", amax=2688.0)
    np.testing.assert_array_equal(np.asarray(q.scales)[:, 0].astype(np.float32), vals)
    assert float(q.global_scale) == 1.0


def test_nvfp4_block_scale_clips_instead_of_nan():
    # A calibrated amax below the data's: block scales would exceed 448 -> clip, not NaN.
    x = jnp.full((1, 16), 100.0)
    q = ms.quantize(x, "nvfp4", amax=1.0)
    assert float(q.scales[0, 0].astype(jnp.float32)) == 448.0
    assert np.all(np.isfinite(np.asarray(ms.dequantize(q))))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_zero_tensor(fmt):
    q = ms.quantize(jnp.zeros((4, 64)), fmt)
    out = np.asarray(ms.dequantize(q))
    np.testing.assert_array_equal(out, 0)
    if q.global_scale is not None:
        assert float(q.global_scale) == 1.0


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_propagates_as_nan(fmt, bad):
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    x[1, 3] = bad
    out = np.asarray(ms.dequantize(ms.quantize(jnp.asarray(x), fmt)))
    spec = get_format(fmt)
    if not spec.has_tensor_scale:  # MX, Q8_0: the block holding it is NaN, the rest intact
        assert np.isnan(out[1, :32]).all() and np.isfinite(out[1, 32:]).all()
        assert np.isfinite(out[0]).all()
    else:  # tensor-scaled formats: everything is NaN
        assert np.isnan(out).all()


# Sizes past the point where XLA:CPU vectorises float max reductions (which then drop NaN:
# a (64, 128) float32 tensor with one NaN used to get a finite NVFP4 global scale), both
# element widths, NaN/Inf at the first, an inner and the last element, and 2D blocks.
@pytest.mark.slow
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "shape, block_shape", [((64, 128), None), ((8192,), None), ((128, 96), (16, 16))]
)
@pytest.mark.parametrize("bad, where", [(np.nan, 4133), (np.nan, -1), (-np.inf, 0)])
def test_nonfinite_propagates_at_any_size(fmt, dtype, shape, block_shape, bad, where):
    spec = get_format(fmt)
    if block_shape is not None and (spec.block_size is None or spec.block_size != 16):
        pytest.skip("2D blocks are exercised with the 16-element formats")
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    x.flat[where] = bad
    xj = jnp.asarray(x, dtype)
    amax = float(tensor_amax(xj))
    assert np.isnan(amax) if np.isnan(bad) else amax == np.inf
    kw = {} if block_shape is None else {"block_shape": block_shape}
    q = ms.quantize(xj, fmt, **kw)
    out = np.asarray(ms.dequantize(q))
    if spec.has_tensor_scale:  # one non-finite element makes the whole tensor NaN
        assert np.isnan(out).all()
    else:  # per-block scale only: exactly the blocks holding it are NaN
        bad_idx = np.unravel_index(where % x.size, shape)
        assert np.isnan(out[bad_idx])
        assert 0 < np.isnan(out).sum() <= spec.block_size
        assert np.isfinite(out[~np.isnan(out)]).all()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize(
    "shape, axis", [((3, 5, 40), -1), ((40, 7), 0), ((2, 33, 3), 1), ((17,), 0)]
)
def test_padding_any_axis_and_batch_dims(fmt, shape, axis):
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    q = ms.quantize(jnp.asarray(x), fmt, axis=axis)
    out = np.asarray(ms.dequantize(q))
    assert out.shape == shape
    # Quantizing along `axis` equals quantizing the moved array along the last axis.
    q2 = ms.quantize(jnp.moveaxis(jnp.asarray(x), axis, -1), fmt)
    np.testing.assert_array_equal(np.moveaxis(out, axis, -1), np.asarray(ms.dequantize(q2)))
    spec = get_format(fmt)
    if spec.packed:
        assert q.data.shape[axis % len(shape)] == -(-shape[axis] // spec.block_size) * 8 * (
            spec.block_size // 16
        )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_input_dtypes(fmt, dtype):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 64)), dtype)
    q = ms.quantize(x, fmt)
    q32 = ms.quantize(x.astype(jnp.float32), fmt)
    np.testing.assert_array_equal(np.asarray(ms.dequantize(q)), np.asarray(ms.dequantize(q32)))
    assert ms.dequantize(q, dtype).dtype == dtype


def test_tiny_and_subnormal_values():
    # Tensor of tiny magnitudes: the tensor scale brings them into range, exact codes.
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32) * 1e-30
    codes, sb, s_dec = te_nvfp4_reference(x)
    q = ms.quantize(jnp.asarray(x), "nvfp4")
    np.testing.assert_array_equal(np.asarray(q.codes()), codes)
    rel = np.abs(np.asarray(ms.dequantize(q)) - x).max() / np.abs(x).max()
    assert rel < 0.2
    # A block far below the tensor's amax: its E4M3 scale underflows to 0 -> zeros, finite.
    y = np.ones((1, 32), np.float32)
    y[0, 16:] = 1e-12
    out = np.asarray(ms.dequantize(ms.quantize(jnp.asarray(y), "nvfp4")))
    assert np.isfinite(out).all() and np.all(out[0, 16:] == 0) and np.all(out[0, :16] == 1)


def test_2d_blocks_weight_and_transpose_quantize_identically():
    w = np.random.default_rng(4).standard_t(3, (48, 80)).astype(np.float32)
    a = ms.dequantize(ms.quantize(jnp.asarray(w), "nvfp4", block_shape=(16, 16)))
    b = ms.dequantize(ms.quantize(jnp.asarray(w.T), "nvfp4", block_shape=(16, 16)))
    c = ms.dequantize(ms.quantize(jnp.asarray(w), "nvfp4", axis=0, block_shape=(16, 16)))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b).T)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    q = ms.quantize(jnp.asarray(w), "nvfp4", block_shape=(16, 16))
    assert q.scales.shape == (3, 5)
    # 1D blocks give different values for W and W^T (that is why 2D exists)
    d = ms.dequantize(ms.quantize(jnp.asarray(w.T), "nvfp4"))
    assert not np.array_equal(np.asarray(a), np.asarray(d).T)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quantize_dequantize_matches_two_step(fmt):
    x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 96)), jnp.float32)
    # float elements x E4M3/E8M0 scales are exact in bf16; int8 x float16 (Q8_0) is not
    dt = jnp.float32 if get_format(fmt).integer else jnp.bfloat16
    for kw in ({}, {"rounding": "stochastic", "key": jax.random.key(0)}):
        vals, scale = quantize_dequantize(x, fmt, dtype=dt, **kw)
        q = ms.quantize(x, fmt, **kw)
        np.testing.assert_array_equal(
            np.asarray(vals.astype(jnp.float32)),
            np.asarray(ms.dequantize(q, dt, with_global_scale=False).astype(jnp.float32)),
        )
        np.testing.assert_allclose(
            np.asarray(vals.astype(jnp.float32) * scale), np.asarray(ms.dequantize(q)), rtol=1e-6
        )


def test_bf16_passthrough():
    x = jnp.asarray([1.0, 1.00390625, 3.14159], jnp.float32)
    q = ms.quantize(x, "bf16")
    np.testing.assert_array_equal(
        np.asarray(ms.dequantize(q)), np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
    )


def test_jit_vmap_and_pytree():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, 4, 32)), jnp.float32)
    f = jax.jit(lambda x: ms.quantize(x, "nvfp4"))
    q = f(x[0])
    assert isinstance(q, ms.QArray)
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3
    qv = jax.vmap(lambda x: ms.quantize(x, "nvfp4"))(x)
    dv = jax.vmap(ms.dequantize)(qv)
    for i in range(3):  # vmapped: each example has its own tensor scale
        np.testing.assert_array_equal(
            np.asarray(dv[i]), np.asarray(ms.dequantize(ms.quantize(x[i], "nvfp4")))
        )


def test_stochastic_rounding_is_deterministic_per_key_and_really_stochastic():
    x = jnp.asarray(np.random.default_rng(7).standard_normal((32, 64)), jnp.float32)
    for fmt in QUANT_FORMATS:
        a = ms.quantize(x, fmt, rounding="stochastic", key=jax.random.key(1))
        b = ms.quantize(x, fmt, rounding="stochastic", key=jax.random.key(1))
        c = ms.quantize(x, fmt, rounding="stochastic", key=jax.random.key(2))
        n = ms.quantize(x, fmt)
        da, db, dc, dn = (np.asarray(ms.dequantize(q)) for q in (a, b, c, n))
        np.testing.assert_array_equal(da, db)
        assert not np.array_equal(da, dc), fmt
        assert not np.array_equal(da, dn), fmt


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "fp8_e4m3"])
def test_stochastic_rounding_unbiased(fmt):
    # Mean over K keys of the SR dequantization approaches x. An element's SR error is
    # bounded by its grid step d with variance <= d^2/4, so the mean over K keys has
    # std <= d / (2 sqrt(K)); every element must lie within 6 of those stds. Elements
    # that land on the grid or saturate at the format's max are deterministic (d = 0)
    # and are excluded from the bound (saturation is the one place SR is biased).
    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, 64)), jnp.float32)
    k = 400
    keys = jax.random.split(jax.random.key(0), k)
    deq = np.asarray(
        jax.jit(
            jax.vmap(lambda key: ms.dequantize(ms.quantize(x, fmt, rounding="stochastic", key=key)))
        )(keys)
    )
    mean = deq.mean(0)
    rne = np.asarray(ms.dequantize(ms.quantize(x, fmt)))
    step = deq.max(0) - deq.min(0)
    err = np.abs(mean - np.asarray(x))
    random_elems = step > 0
    assert random_elems.mean() > 0.8
    assert np.all(err[random_elems] <= 6 * step[random_elems] / (2 * np.sqrt(k)) + 1e-6)
    assert err.mean() < np.abs(rne - np.asarray(x)).mean() / 3  # SR mean beats RNE


# Few distinct shapes (each shape compiles once) and many values.
finite_arrays = st.sampled_from([1, 3]).flatmap(
    lambda rows: st.sampled_from([1, 4]).flatmap(
        lambda blocks: st.lists(
            st.floats(-1e4, 1e4, allow_nan=False, width=32),
            min_size=rows * blocks * 16,
            max_size=rows * blocks * 16,
        ).map(lambda v, r=rows, b=blocks: np.asarray(v, np.float32).reshape(r, b * 16))
    )
)


@settings(max_examples=50, deadline=None)
@given(finite_arrays)
def test_property_nvfp4_error_bound_and_idempotence(x):
    q = ms.quantize(jnp.asarray(x), "nvfp4")
    out = np.asarray(ms.dequantize(q))
    # Per element: |x - x^| <= half an E2M1 step * block scale * s_dec, where the step
    # at |x| is 0.5 (<2), 1 (<4), 2 (else) in scaled units; saturation can add up to
    # the E4M3 rounding of the block scale (<= 1/16 relative), so bound with 6.4.
    sb = np.asarray(block_scales_f32(q)).repeat(16, axis=-1) * float(q.global_scale)
    scaled = np.abs(x) / np.where(sb > 0, sb, np.inf)
    half_step = np.where(scaled < 2, 0.25, np.where(scaled < 4, 0.5, 1.0))
    bound = half_step * sb + np.maximum(scaled - 6, 0) * sb
    assert np.all(np.abs(x - out) <= bound * (1 + 1e-5) + 1e-30)
    # quantize(dequantize(q)) == q: same codes and block scales; the tensor scale is
    # recomputed from amax' = 6 * 448 * s_dec, equal to s_dec up to float32 rounding.
    # Blocks whose E4M3 scale underflowed to 0 decode to 0 whatever their codes (TE caps
    # the encode scale at FLT_MAX there), so their codes are compared through the values.
    q2 = ms.quantize(jnp.asarray(out), "nvfp4")
    live = np.repeat(np.asarray(q.scales, np.float32) != 0, 16, axis=-1)
    np.testing.assert_array_equal(np.asarray(q2.codes())[live], np.asarray(q.codes())[live])
    np.testing.assert_allclose(np.asarray(ms.dequantize(q2)), out, rtol=3e-7, atol=0)
    np.testing.assert_array_equal(
        np.asarray(q2.scales).view(np.uint8), np.asarray(q.scales).view(np.uint8)
    )
    np.testing.assert_allclose(float(q2.global_scale), float(q.global_scale), rtol=3e-7)


@settings(max_examples=30, deadline=None)
@given(finite_arrays, st.sampled_from(["mxfp4", "mxfp8", "fp8_e4m3", "fp8_e5m2"]))
def test_property_other_formats_idempotent(x, fmt):
    q = ms.quantize(jnp.asarray(x), fmt)
    q2 = ms.quantize(ms.dequantize(q), fmt)
    # Same element codes; MX scales are powers of two and come back exactly; a
    # per-tensor FP8 scale is recomputed from amax' and may move by float32 rounding.
    np.testing.assert_array_equal(
        np.asarray(q2.data).view(np.uint8), np.asarray(q.data).view(np.uint8)
    )
    np.testing.assert_allclose(
        np.asarray(q2.scales, np.float32), np.asarray(q.scales, np.float32), rtol=3e-7
    )


def test_bad_arguments_name_the_value():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="unknown format 'nvfp5'"):
        ms.quantize(x, "nvfp5")
    with pytest.raises(TypeError, match="int32"):
        ms.quantize(jnp.ones((4, 32), jnp.int32), "nvfp4")
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        ms.quantize(x, "nvfp4", axis=2)
    with pytest.raises(ValueError, match="extent 8 along axis 1"):
        ms.quantize(x, "nvfp4", block_shape=(16, 8))
    with pytest.raises(ValueError, match="does not fit"):
        ms.quantize(x, "nvfp4", block_shape=(1, 1, 16))
    with pytest.raises(ValueError, match="one scale per tensor"):
        ms.quantize(x, "fp8_e4m3", block_shape=(16,))
    with pytest.raises(ValueError, match="explicit key"):
        ms.quantize(x, "nvfp4", rounding="stochastic")
    with pytest.raises(ValueError, match="unknown rounding 'up'"):
        ms.quantize(x, "nvfp4", rounding="up")
    with pytest.raises(ValueError, match="scalar"):
        ms.quantize(jnp.float32(1.0), "nvfp4")


def test_registry_fields_and_storage():
    nv, mx4, mx8 = get_format("nvfp4"), get_format("mxfp4"), get_format("mxfp8")
    assert nv.bits_per_element == 4.5 and mx4.bits_per_element == 4.25
    assert mx8.bits_per_element == 8.25 and get_format("bf16").bits_per_element == 16
    assert nv.elem_dtype == ml_dtypes.float4_e2m1fn and nv.scale_dtype == ml_dtypes.float8_e4m3fn
    assert mx4.scale_dtype == ml_dtypes.float8_e8m0fnu
    assert storage_bits("nvfp4", (128, 256)) == 128 * 256 * 4.5 + 32
    q = ms.quantize(jnp.ones((128, 256)), "nvfp4")
    assert q.nbytes * 8 == storage_bits("nvfp4", (128, 256))


def test_mx_scale_rounding_default_and_override():
    # amax 7 in a block: OCP floor -> 2^(2-2) = 1 (7 saturates to 6);
    # NVIDIA ceil -> 2^ceil(log2(7/6)) = 2 (7/2 = 3.5 -> 4, no saturation).
    x = jnp.zeros((1, 32)).at[0, 0].set(7.0)
    floor = ms.quantize(x, "mxfp4")
    ceil = ms.quantize(x, "mxfp4", scale_rounding="ceil")
    assert float(block_scales_f32(floor)[0, 0]) == 1.0
    assert float(block_scales_f32(ceil)[0, 0]) == 2.0
    assert float(ms.dequantize(floor)[0, 0]) == 6.0 and float(ms.dequantize(ceil)[0, 0]) == 8.0
    assert float(block_scales_f32(ms.quantize(x, "mxfp8"))[0, 0]) == 2.0**-6  # ceil(log2 7/448)


def test_packed_data_matches_design_golden_vector():
    # DESIGN's golden rows, each in a 16-element block whose amax is 6: with amax=2688
    # (s_enc = 1) every block scale is exactly 1, so the elements encode unscaled.
    golden = [[0, 0.5, 4, -0.0], [-0.0, 1, -6, 3]]
    x = np.zeros((2, 16), np.float32)
    x[:, :4] = golden
    x[0, 4] = 6.0
    q = ms.quantize(jnp.asarray(x), "nvfp4", amax=2688.0)
    assert q.data.shape == (2, 8)
    np.testing.assert_array_equal(np.asarray(q.scales, np.float32), [[1.0], [1.0]])
    np.testing.assert_array_equal(np.asarray(q.data)[:, :2], [[0x10, 0x86], [0x28, 0x5F]])
    np.testing.assert_array_equal(np.asarray(q.data)[0, 2], 0x07)  # the 6 in element 4
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(q.data)), np.asarray(q.codes()))


SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import microscale as ms
    assert len(jax.devices()) == 8
    x = np.random.default_rng(0).standard_t(2, (64, 256)).astype(np.float32)
    x[3, 7] = 300.0  # the tensor amax lives on one shard only
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("a", "b")))
    for fmt in ["nvfp4", "mxfp4", "mxfp8", "fp8_e4m3"]:
        f = jax.jit(lambda x: ms.dequantize(ms.quantize(x, fmt)))
        ref = np.asarray(f(jnp.asarray(x)))
        got = np.asarray(f(xs))
        assert np.array_equal(ref, got), fmt
    q = jax.jit(lambda x: ms.quantize(x, "nvfp4"))(xs)
    assert float(q.global_scale) == np.float32(1) / (np.float32(2688) / np.float32(300))
    print("OK")
""")


@pytest.mark.slow
def test_sharded_equals_unsharded_8_devices(fake_devices):
    assert "OK" in fake_devices(SHARDED)


def test_underflowed_block_scale_decodes_to_zero():
    # A tensor amax so small that s_enc = 2688/amax overflows: s_enc falls back to 1 (TE),
    # the E4M3 block scale underflows to 0, the encode scale is capped at FLT_MAX, and the
    # block decodes to exact zeros (visible, finite), not to garbage.
    x = jnp.zeros((1, 16)).at[0, 15].set(1.5e-37)
    q = ms.quantize(x, "nvfp4")
    assert float(q.global_scale) == 1.0 and float(q.scales[0, 0].astype(jnp.float32)) == 0.0
    np.testing.assert_array_equal(np.asarray(ms.dequantize(q)), 0.0)
