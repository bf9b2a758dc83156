"""Exhaustive element-codec tables (E2M1, E4M3, E5M2, E8M0) and nibble packing."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from microscale.formats import elements

ALL16 = np.arange(16, dtype=np.uint8)
ALL256 = np.arange(256, dtype=np.uint8)


def _e2m1_table() -> np.ndarray:
    """Reference decode of all 16 codes via ml_dtypes' float4_e2m1fn (low nibble)."""
    return ALL16.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def test_e2m1_decode_all_codes():
    got = np.asarray(elements.e2m1_decode(jnp.asarray(ALL16)))
    np.testing.assert_array_equal(got, _e2m1_table())
    # sign bit is bit 3: code 8 is -0
    assert np.signbit(got[8]) and got[8] == 0
    np.testing.assert_array_equal(got[:8], elements.E2M1_VALUES)


def test_e2m1_encode_every_value_roundtrips():
    vals = _e2m1_table()
    codes = np.asarray(elements.e2m1_encode(jnp.asarray(vals)))
    np.testing.assert_array_equal(codes, ALL16)


@pytest.mark.parametrize(
    "x, expected",
    [
        # Ties go to the even code (mantissa bit 0), as in IEEE round-half-even.
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
        (-0.25, -0.0),
        (-0.75, -1.0),
        (-5.0, -4.0),
        # Just off the ties.
        (0.2500001, 0.5),
        (0.7499999, 0.5),
        (4.9999995, 4.0),
        (5.0000005, 6.0),
        # Saturation at +-6 (no inf/NaN in E2M1).
        (6.5, 6.0),
        (1e30, 6.0),
        (-7.0, -6.0),
        # Tiny values round to signed zero.
        (1e-30, 0.0),
        (-0.1, -0.0),
    ],
)
def test_e2m1_rne_ties_and_saturation(x, expected):
    code = elements.e2m1_encode(jnp.float32(x))
    got = float(elements.e2m1_decode(code))
    assert got == expected and np.signbit(got) == np.signbit(expected)


def test_e2m1_rne_matches_ml_dtypes_dense():
    # Every midpoint and a dense sweep (both signs): identical to ml_dtypes' RNE cast.
    grid = np.linspace(-7, 7, 28001, dtype=np.float32)
    mids = (elements.E2M1_VALUES[1:] + elements.E2M1_VALUES[:-1]) / 2
    x = np.concatenate([grid, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 10)])
    x = x.astype(np.float32)
    got = np.asarray(elements.e2m1_decode(elements.e2m1_encode(jnp.asarray(x))))
    want = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_golden_pack_vector():
    x = jnp.asarray([[0, 0.5, 4, -0.0], [-0.0, 1, -6, 3]], jnp.float32)
    packed = np.asarray(elements.pack_nibbles(elements.e2m1_encode(x)))
    np.testing.assert_array_equal(packed, np.array([[0x10, 0x86], [0x28, 0x5F]], np.uint8))


@pytest.mark.parametrize("n", [2, 4, 6, 64])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_pack_unpack_inverse_all_code_pairs(n, axis):
    rng = np.random.default_rng(n)
    shape = [n, n]
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    packed = elements.pack_nibbles(jnp.asarray(codes), axis)
    assert packed.shape[axis] == n // 2
    np.testing.assert_array_equal(np.asarray(elements.unpack_nibbles(packed, axis)), codes)


def test_pack_all_256_pairs_matches_formula():
    lo, hi = np.meshgrid(ALL16, ALL16, indexing="ij")
    codes = np.stack([lo.ravel(), hi.ravel()], axis=-1)  # (256, 2)
    packed = np.asarray(elements.pack_nibbles(jnp.asarray(codes)))[:, 0]
    np.testing.assert_array_equal(packed, (codes[:, 0] | (codes[:, 1] << 4)).astype(np.uint8))
    np.testing.assert_array_equal(np.sort(packed), ALL256)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even length"):
        elements.pack_nibbles(jnp.zeros((3,), jnp.uint8))


@pytest.mark.parametrize(
    "dtype, emax", [(ml_dtypes.float8_e4m3fn, 448.0), (ml_dtypes.float8_e5m2, 57344.0)]
)
def test_float8_encode_all_256_codes(dtype, emax):
    vals = ALL256.view(dtype).astype(np.float32)
    finite = np.isfinite(vals)
    got = np.asarray(elements.float8_encode(jnp.asarray(vals[finite]), dtype, emax))
    np.testing.assert_array_equal(got.view(np.uint8), ALL256[finite])
    # Saturation instead of NaN on overflow (a plain cast gives NaN/inf here).
    big = np.asarray(elements.float8_encode(jnp.asarray([1e9, -1e9], jnp.float32), dtype, emax))
    np.testing.assert_array_equal(big.astype(np.float32), [emax, -emax])


def test_float8_rne_ties_e4m3():
    # Between 1.0 (0x38) and 1.125 (0x39) the tie 1.0625 goes to the even code 0x38;
    # between 1.125 and 1.25 (0x3A) the tie 1.1875 goes to 0x3A.
    got = np.asarray(
        elements.float8_encode(
            jnp.asarray([1.0625, 1.1875], jnp.float32), ml_dtypes.float8_e4m3fn, 448.0
        )
    )
    np.testing.assert_array_equal(got.view(np.uint8), [0x38, 0x3A])


def test_e8m0_decode_all_256_bytes():
    got = np.asarray(elements.e8m0_to_float(jnp.asarray(ALL256)))
    want = ALL256.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(got[1:255], want[1:255])
    assert got[0] == np.float32(2.0**-127) and np.isnan(got[255])


def test_e8m0_divide_exact_for_all_finite_bytes():
    x = jnp.float32(1.5)
    got = np.asarray(elements.e8m0_divide(x, jnp.asarray(ALL256[1:255])))
    want = 1.5 / 2.0 ** (ALL256[1:255].astype(np.float64) - 127)
    # Results that are normal float32 are exact; XLA:CPU flushes subnormal results to 0.
    normal = (np.abs(want) < 3.4e38) & (np.abs(want) >= 2.0**-126)
    np.testing.assert_array_equal(got[normal], want[normal].astype(np.float32))


@pytest.mark.parametrize("elem_max, emax", [(6.0, 2), (448.0, 8)])
def test_e8m0_scale_rules(elem_max, emax):
    rng = np.random.default_rng(0)
    amax = np.concatenate(
        [
            2.0 ** rng.uniform(-100, 100, 2000),
            2.0 ** rng.integers(-100, 100, 200).astype(np.float64),  # exact powers of two
            elem_max * 2.0 ** rng.integers(-50, 50, 200).astype(np.float64),
        ]
    ).astype(np.float32)
    floor = np.asarray(elements.e8m0_from_amax(jnp.asarray(amax), elem_max, emax, "floor"))
    ceil = np.asarray(elements.e8m0_from_amax(jnp.asarray(amax), elem_max, emax, "ceil"))
    a64 = amax.astype(np.float64)
    np.testing.assert_array_equal(floor.astype(int) - 127, np.floor(np.log2(a64)) - emax)
    np.testing.assert_array_equal(ceil.astype(int) - 127, np.ceil(np.log2(a64 / elem_max)))
    # ceil never saturates: amax / scale <= elem_max; floor may exceed it (OCP).
    assert np.all(a64 / 2.0 ** (ceil.astype(int) - 127) <= elem_max)
    assert np.any(a64 / 2.0 ** (floor.astype(int) - 127) > elem_max)


def test_e8m0_nonfinite_amax_gives_nan_scale():
    out = elements.e8m0_from_amax(jnp.asarray([np.nan, np.inf], jnp.float32), 6.0, 2, "floor")
    np.testing.assert_array_equal(np.asarray(out), [255, 255])


def test_stochastic_e2m1_changes_rounding_and_is_unbiased():
    # 1.1 lies between 1.0 and 1.5: RNE always gives 1.0; SR gives 1.5 with p = 0.2.
    n = 200_000
    y = jnp.full((n,), 1.1, jnp.float32)
    u = elements.uniform_for_rounding(jax.random.key(0), (n,))
    vals = np.asarray(elements.e2m1_decode(elements.e2m1_encode(y, "stochastic", u)))
    assert set(np.unique(vals)) == {1.0, 1.5}
    # mean of n Bernoulli(0.2) * 0.5 + 1: std of the mean is 0.5*sqrt(.16/n) ~ 4.5e-4; 5 sigma
    assert abs(vals.mean() - 1.1) < 5 * 0.5 * np.sqrt(0.16 / n)


def test_stochastic_float8_changes_rounding_and_is_unbiased():
    n = 200_000
    # 1.03 lies between E4M3 1.0 and 1.125: p_up = 0.24.
    y = jnp.full((n,), -1.03, jnp.float32)
    u = elements.uniform_for_rounding(jax.random.key(1), (n,))
    q = elements.float8_encode(y, ml_dtypes.float8_e4m3fn, 448.0, "stochastic", u)
    vals = np.asarray(q).astype(np.float32)
    assert set(np.unique(vals)) == {-1.0, -1.125}
    assert abs(vals.mean() + 1.03) < 5 * 0.125 * np.sqrt(0.24 * 0.76 / n)
    # Representable values are left alone.
    exact = elements.float8_encode(
        jnp.full((100,), 1.125, jnp.float32), ml_dtypes.float8_e4m3fn, 448.0, "stochastic", u[:100]
    )
    assert np.all(np.asarray(exact).astype(np.float32) == 1.125)


def test_uniform_for_rounding_determinism_and_range():
    a = elements.uniform_for_rounding(jax.random.key(3), (32, 48))
    b = elements.uniform_for_rounding(jax.random.key(3), (32, 48))
    c = elements.uniform_for_rounding(jax.random.key(4), (32, 48))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    a = np.asarray(a)
    assert a.min() >= 0 and a.max() < 1
    assert abs(a.mean() - 0.5) < 0.03 and abs(a.std() - np.sqrt(1 / 12)) < 0.02


@pytest.mark.parametrize(
    "dtype", [ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
)
def test_float_round_matches_ml_dtypes_on_all_midpoints(dtype):
    # Every representable value, every midpoint between neighbours (ties: half to even),
    # one float32 ulp either side of each midpoint, and log-uniform random magnitudes.
    fi = ml_dtypes.finfo(dtype)
    n = 16 if fi.bits == 4 else 256
    vals = np.arange(n, dtype=np.uint8)
    vals = (vals & 0xF if fi.bits == 4 else vals).view(dtype).astype(np.float32)
    vals = np.unique(np.abs(vals[np.isfinite(vals)]))
    mids = (vals[1:] + vals[:-1]) / 2
    rng = np.random.default_rng(0)
    rand = (
        2.0 ** rng.uniform(np.log2(float(fi.smallest_subnormal)) - 2, np.log2(float(fi.max)), 20000)
    ).astype(np.float32)
    x = np.concatenate([vals, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), rand])
    x = np.concatenate([x, -x]).astype(np.float32)
    got = np.asarray(elements.float_round(jnp.asarray(x), dtype, float(fi.max)))
    want = x.astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(
    "dtype,elem_max",
    [
        (ml_dtypes.float4_e2m1fn, 6.0),
        (ml_dtypes.float8_e4m3fn, 448.0),
        (ml_dtypes.float8_e5m2, 57344.0),
    ],
)
def test_float_round_sign_is_the_inputs_on_every_bit_pattern_class(dtype, elem_max, rounding):
    """The sign comes from ``y``'s sign bit on zeros, infinities, NaNs (any payload; a
    payload that carries into the sign bit rounds to -0), subnormals and saturating values:
    the bits equal ``where(signbit(y), -v, v)`` of the rounded magnitude ``v``."""
    mags = np.array(
        [0, 1, 0x00000001, 0x007FFFFF, 0x3F800000, 0x3FC00001, 0x7F7FFFFF, 0x7F800000,
         0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x3E800000, 0x40A00000],
        np.uint32,
    )  # fmt: skip
    bits = np.concatenate([mags, mags | np.uint32(0x80000000)])
    y = jnp.asarray(bits.view(np.float32))
    u = jnp.linspace(0.0, 0.99, y.shape[0], dtype=jnp.float32)
    got = np.asarray(elements.float_round(y, dtype, elem_max, rounding, u)).view(np.uint32)
    mag = np.asarray(elements.float_round(jnp.abs(y), dtype, elem_max, rounding, u))
    want = np.where(np.signbit(np.asarray(y)), -mag, mag).view(np.uint32)
    np.testing.assert_array_equal(got, want)
