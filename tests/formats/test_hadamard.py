"""Random Hadamard transform: orthonormal, invertible, seeded, invisible inside X^T dY."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microscale.formats import hadamard_matrix, random_hadamard, random_signs


@pytest.mark.parametrize("n", [2, 16, 32, 128])
def test_hadamard_orthonormal_and_symmetric(n):
    h = np.asarray(hadamard_matrix(n), np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    assert np.all(np.abs(np.abs(h) - 1 / np.sqrt(n)) < 1e-7)


@pytest.mark.parametrize("n", [0, 1, 12, 24])
def test_bad_sizes(n):
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(n)


def test_signs_from_seed_and_key():
    a, b = random_signs(7, 16), random_signs(7, 16)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert set(np.unique(np.asarray(a))) <= {-1.0, 1.0}
    assert not np.array_equal(np.asarray(a), np.asarray(random_signs(8, 16)))
    np.testing.assert_array_equal(np.asarray(random_signs(jax.random.key(7), 16)), np.asarray(a))


@pytest.mark.parametrize("size", [16, 32])
def test_inverse_and_norm_preserving(size):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 8)), jnp.float32)
    y = random_hadamard(x, axis=0, size=size, seed_or_key=3)
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(y), axis=0), np.linalg.norm(np.asarray(x), axis=0), rtol=1e-5
    )
    back = random_hadamard(y, axis=0, size=size, seed_or_key=3, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-5)
    assert not np.allclose(np.asarray(y), np.asarray(x))


def test_invisible_in_wgrad_product():
    # dW = X^T dY contracting over tokens: transforming both along tokens cancels.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((48, 20)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((48, 12)), jnp.float32)
    xr = random_hadamard(x, axis=0, seed_or_key=11)
    dyr = random_hadamard(dy, axis=0, seed_or_key=11)
    np.testing.assert_allclose(np.asarray(xr.T @ dyr), np.asarray(x.T @ dy), atol=1e-4)


def test_spreads_outliers():
    x = np.zeros((16, 1), np.float32)
    x[3] = 16.0
    y = np.asarray(random_hadamard(jnp.asarray(x), axis=0, seed_or_key=0))
    np.testing.assert_allclose(np.abs(y), 4.0, rtol=1e-6)  # one spike -> flat 16/sqrt(16)


def test_length_must_divide():
    with pytest.raises(ValueError, match="not a multiple"):
        random_hadamard(jnp.ones((24, 2)), axis=0)
