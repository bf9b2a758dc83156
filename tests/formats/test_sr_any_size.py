"""Stochastic rounding for arrays of any size (past 2^32 elements).

``uniform_for_rounding`` numbers elements with 32-bit counters; an array with more than
``SR_INDEX_LIMIT`` elements splits its dimensions into groups and folds the outer group
indices into the hash. The tests lower the limit so that path runs on small arrays.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microscale.formats import elements
from microscale.formats.quantize import _quantize_dequantize


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(elements, "SR_INDEX_LIMIT", 256)
    return 256


@pytest.mark.parametrize(
    "shape, limit, groups",
    [
        ((64, 32, 16), 2**32, [(0, 3)]),
        ((64, 32, 16), 512, [(1, 3), (0, 1)]),
        ((64, 32, 16), 256, [(2, 3), (1, 2), (0, 1)]),
        ((2**21, 2**13), 2**32, [(1, 2), (0, 1)]),  # a Llama-8B up_proj dY at 2M tokens
        ((2**16, 2**16), 2**32, [(0, 2)]),  # exactly 2^32 elements: one counter
        ((2**16, 2**16 + 1), 2**32, [(1, 2), (0, 1)]),
        ((3, 2**31, 2, 2), 2**32, [(2, 4), (1, 2), (0, 1)]),
        ((5, 1, 7), 7, [(1, 3), (0, 1)]),
    ],
)
def test_index_groups_table(shape, limit, groups):
    got = elements._index_groups(shape, limit)
    assert got == groups
    for start, stop in got:
        assert int(np.prod(shape[start:stop])) <= limit
    assert sorted(d for g in got for d in range(*g)) == list(range(len(shape)))


def test_one_dimension_past_the_limit_is_refused():
    with pytest.raises(ValueError, match=r"dimension 1 of shape \(2, 300\) has 300"):
        elements._index_groups((2, 300), 256)


def _u(key, shape):
    return np.asarray(elements.uniform_for_rounding(key, shape))  # eager: reads the limit


def test_grouped_uniforms_deterministic_uniform_independent(small_limit):
    shape = (64, 32, 16)  # 2^15 elements in groups (16), (32), (64)
    a = _u(jax.random.key(3), shape)
    np.testing.assert_array_equal(a, _u(jax.random.key(3), shape))
    assert np.mean(a == _u(jax.random.key(4), shape)) < 1e-3
    assert a.min() >= 0 and a.max() < 1
    # Uniform: chi-square over 64 equal bins (df 63: mean 63, sd 11.2; bound ~ +6 sd).
    counts = np.bincount((a * 64).astype(int).ravel(), minlength=64)
    expect = a.size / 64
    assert np.sum((counts - expect) ** 2 / expect) < 130
    # Independent: no correlation between any two rows of the outer groups (each row of
    # 512 draws: corr sd ~ 1/sqrt(512); 2016 pairs, bound 5.5 sd).
    rows = a.reshape(64, -1)
    corr = np.corrcoef(rows)[np.triu_indices(64, 1)]
    assert np.abs(corr).max() < 5.5 / np.sqrt(rows.shape[1])
    # ... and no row repeats (or shifts) another row's draws: 24-bit values shared between
    # two rows, anywhere, occur at the rate of chance (2016 * 512^2 / 2^24 ~ 31 expected).
    bits = (rows * 2**24).astype(np.int64)
    shared = sum(len(np.intersect1d(bits[i], bits[j])) for i in range(64) for j in range(i))
    assert shared < 80
    # Within a row, neighbours across the (16) and (32) group boundaries are uncorrelated.
    flat = rows.ravel()
    for lag in (1, 16, 512):
        c = np.corrcoef(flat[:-lag], flat[lag:])[0, 1]
        assert abs(c) < 6 / np.sqrt(flat.size), lag


def test_elements_with_outer_index_zero_keep_the_single_counter_draws(small_limit):
    key = jax.random.key(5)
    grouped = _u(key, (64, 16))  # groups (16), (64)
    elements.SR_INDEX_LIMIT = 2**32
    plain = _u(key, (64, 16))
    np.testing.assert_array_equal(grouped[0], plain[0])
    assert not np.any(grouped[1:] == plain[1:])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_sr_unbiased_with_grouped_indices(small_limit, fmt):
    # The formats-level unbiasedness test of test_quantize.py, with the grouped path:
    # 400 keys, every element within 6 standard errors of its input.
    x = jnp.asarray(np.random.default_rng(8).standard_normal((8, 64)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 400)

    @jax.jit
    @jax.vmap
    def sr(key):
        v, s = _quantize_dequantize(
            x, fmt, rounding="stochastic", key=key, dtype=jnp.float32, with_global_scale=True
        )
        return v * s

    deq = np.asarray(sr(keys))
    step = deq.max(0) - deq.min(0)
    err = np.abs(deq.mean(0) - np.asarray(x))
    live = step > 0
    assert live.mean() > 0.8
    assert np.all(err[live] <= 6 * step[live] / (2 * np.sqrt(len(keys))) + 1e-6)


SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import microscale as ms
    from microscale.formats import elements
    elements.SR_INDEX_LIMIT = 2**10  # grouped counters on a small array
    assert len(jax.devices()) == 8
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("a", "b")))
    key = jax.random.key(7)
    for fmt, axis in [("nvfp4", -1), ("nvfp4", 0), ("mxfp8", -1)]:
        f = jax.jit(lambda x: ms.dequantize(ms.quantize(x, fmt, axis=axis,
                                                         rounding="stochastic", key=key)))
        ref, got = np.asarray(f(jnp.asarray(x))), np.asarray(f(xs))
        assert np.array_equal(ref, got), (fmt, axis)
        assert not np.array_equal(ref, np.asarray(ms.dequantize(ms.quantize(x, fmt,
                                                                             axis=axis))))
    print("OK")
""")


@pytest.mark.slow
def test_grouped_sr_same_bits_sharded_and_unsharded(fake_devices):
    assert "OK" in fake_devices(SHARDED)


@pytest.mark.parametrize("limit", [2**32, 512, 256, 64])
@pytest.mark.parametrize(
    "starts, sizes",
    [
        ((0, 0, 0), (64, 32, 16)),  # the whole array
        ((16, 0, 0), (16, 32, 16)),  # rows
        ((0, 8, 0), (64, 8, 16)),  # a middle dimension
        ((32, 24, 8), (32, 8, 8)),  # a box along every dimension
        ((63, 31, 15), (1, 1, 1)),  # the last element
    ],
)
def test_window_draws_the_whole_arrays_samples(monkeypatch, limit, starts, sizes):
    """``window=(starts, sizes)`` (a device's slice of an operand) draws exactly the whole
    array's samples in that box, with one counter or grouped ones."""
    monkeypatch.setattr(elements, "SR_INDEX_LIMIT", limit)
    shape, key = (64, 32, 16), jax.random.key(5)
    whole = _u(key, shape)
    box = tuple(slice(a, a + n) for a, n in zip(starts, sizes, strict=True))
    got = np.asarray(elements.uniform_for_rounding(key, shape, (starts, sizes)))
    np.testing.assert_array_equal(got, whole[box])
    traced = jax.jit(lambda s: elements.uniform_for_rounding(key, shape, (s, sizes)))
    np.testing.assert_array_equal(np.asarray(traced(jnp.asarray(starts))), whole[box])
