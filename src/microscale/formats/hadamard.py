"""Random Hadamard transform (RHT) for the NVFP4 wgrad recipe.

``H_n`` (Sylvester construction, n a power of two >= 2) scaled by ``1/sqrt(n)`` is
orthonormal and symmetric: ``H H^T = I``. The randomised transform is
``R = diag(s) H`` with a random sign vector ``s`` drawn once from a seed; ``R^T R = I``.

Applied blockwise along an axis of length L (a multiple of n): each length-n chunk
``v`` becomes ``v R``. For the wgrad GEMM ``dW = X^T dY`` contracting over tokens T,
transforming both operands along T leaves the product unchanged,
``(X^T R_T)(R_T^T dY) = X^T dY`` with ``R_T = blockdiag(R)``, while spreading outliers
across the 16 tokens of each block before FP4 quantization.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=16)
def _hadamard_np(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(np.float32(n))


def _check_size(n: int) -> int:
    n = int(n)
    if n < 2 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two >= 2 (e.g. 16), got {n}")
    return n


def hadamard_matrix(n: int, dtype=jnp.float32) -> jax.Array:
    """Orthonormal n x n Sylvester-Hadamard matrix."""
    return jnp.asarray(_hadamard_np(_check_size(n)), dtype)


def random_signs(seed_or_key, n: int) -> jax.Array:
    """A +-1 float32 vector of length n from an int seed or a PRNG key."""
    key = seed_or_key
    if isinstance(seed_or_key, int | np.integer):
        key = jax.random.key(int(seed_or_key))
    return jax.random.rademacher(key, (n,), jnp.float32)


def random_hadamard(x: jax.Array, axis: int = -1, *, size: int = 16, seed_or_key=0,
                    inverse: bool = False) -> jax.Array:
    """Apply ``diag(s) H`` (or its inverse ``H diag(s)``) to each size-chunk along ``axis``.

    The length along ``axis`` must be a multiple of ``size``. Computed in float32,
    returned in ``x``'s dtype.
    """
    size = _check_size(size)
    x = jnp.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % size:
        raise ValueError(f"random_hadamard: length {n} along axis {axis} is not a multiple "
                         f"of the transform size {size}")
    r = random_signs(seed_or_key, size)[:, None] * hadamard_matrix(size)  # diag(s) H
    if inverse:
        r = r.T
    xm = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
    shp = xm.shape
    y = (xm.reshape(shp[:-1] + (n // size, size)) @ r).reshape(shp)
    return jnp.moveaxis(y, -1, axis).astype(x.dtype)
