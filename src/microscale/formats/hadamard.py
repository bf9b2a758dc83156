"""Random Hadamard transform (RHT) for the NVFP4 wgrad recipe.

``H_n`` (Sylvester construction, n a power of two >= 2) scaled by ``1/sqrt(n)`` is
orthonormal and symmetric: ``H H^T = I``. The randomised transform is
``R = diag(s) H`` with a random sign vector ``s`` drawn once from a seed; ``R^T R = I``.

Applied blockwise along an axis of length L (a multiple of n): each length-n chunk
``v`` becomes ``v R``. For the wgrad GEMM ``dW = X^T dY`` contracting over tokens T,
transforming both operands along T leaves the product unchanged,
``(X^T R_T)(R_T^T dY) = X^T dY`` with ``R_T = blockdiag(R)``, while spreading outliers
across the 16 tokens of each block before FP4 quantization.

The same bits on every machine. The transform is not a matrix product: a dot's float32
summation order is the kernel's choice (XLA:CPU's YNNPACK and Eigen kernels sum the 16
products in different orders), and rounding the rotated operand to bfloat16 or FP4 then
depends on that order wherever a value lands near a rounding tie. It is computed with
elementwise float32 operations in one fixed order instead, each correctly rounded by
IEEE 754 on any hardware: ``v * s`` (exact), the Sylvester butterfly
``H_m = [[H_m/2, H_m/2], [H_m/2, -H_m/2]]`` from the chunk's halves down to pairs (halves
``(a, b) -> (a + b, a - b)``), then ``* (1/sqrt(n))`` in float32. The inverse runs the
butterfly on ``v`` and multiplies by ``s * (1/sqrt(n))``. The only inexact product (for n
not a power of 4) comes last, so no compiler can contract it with an addition into an FMA
that rounds once instead of twice. XLA fuses all stages into one pass over the array.
"""

from __future__ import annotations

import functools
from typing import Any

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


def random_hadamard(
    x: jax.Array,
    axis: int = -1,
    *,
    size: int = 16,
    seed_or_key=0,
    inverse: bool = False,
    dtype=None,
) -> jax.Array:
    """Apply ``diag(s) H`` (or its inverse ``H diag(s)``) to each size-chunk along ``axis``.

    The length along ``axis`` must be a multiple of ``size``. Computed in float32 with a
    fixed order of operations (see the module doc), so the result is the same bits on
    every machine; returned in ``dtype`` (default: ``x``'s dtype).
    """
    size = _check_size(size)
    x = jnp.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % size:
        raise ValueError(
            f"random_hadamard: length {n} along axis {axis} is not a multiple "
            f"of the transform size {size}"
        )
    out_dtype = x.dtype if dtype is None else dtype
    if isinstance(seed_or_key, int | np.integer):
        with jax.ensure_compile_time_eval():  # a constant, not a kernel
            signs: Any = np.asarray(random_signs(seed_or_key, size))
    else:
        signs = random_signs(seed_or_key, size)
    return _hadamard_butterfly(x, signs, axis=axis, size=size, inverse=inverse).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("axis", "size", "inverse"))
def _hadamard_butterfly(x: jax.Array, signs, *, axis: int, size: int, inverse: bool) -> jax.Array:
    """The float32 transform of :func:`random_hadamard`, in the fixed order of the module
    doc (its own jit, so a jaxpr names it)."""
    n = x.shape[axis]
    pre, post = x.shape[:axis], x.shape[axis + 1 :]
    chunks = pre + (n // size,)  # never merged with the within-chunk axis, so a sharded
    y = x.astype(jnp.float32).reshape(chunks + (size,) + post)  # axis stays sharded
    pair = axis + 2  # the (a, b) axis of each stage's view
    m = size
    while m >= 2:  # H_m = [[H_m/2, H_m/2], [H_m/2, -H_m/2]]: halves (a, b) -> (a+b, a-b)
        z = y.reshape(chunks + (size // m, 2, m // 2) + post)
        a = jax.lax.slice_in_dim(z, 0, 1, axis=pair)
        b = jax.lax.slice_in_dim(z, 1, 2, axis=pair)
        if m == size and not inverse:  # v * s (exact), fused into the first stage
            half = _along(signs.astype(jnp.float32), pair + 1, z.ndim)
            a = a * jax.lax.slice_in_dim(half, 0, size // 2, axis=pair + 1)
            b = b * jax.lax.slice_in_dim(half, size // 2, size, axis=pair + 1)
        y = (a + _along(np.array([1, -1], np.float32), pair, z.ndim) * b).reshape(
            chunks + (size,) + post
        )  # exact: b * +-1
        m //= 2
    last = signs.astype(jnp.float32) * _scale(size) if inverse else np.full(size, _scale(size))
    return (y * _along(last, axis + 1, y.ndim)).reshape(x.shape)  # the one inexact product


def _scale(n: int) -> np.float32:
    """``1/sqrt(n)`` in float32 (exact for n a power of 4)."""
    return np.float32(1.0 / np.sqrt(n))


def _along(v, axis: int, ndim: int):
    """``v`` (1-D) shaped to broadcast along ``axis`` of an ``ndim``-array."""
    shape = [1] * ndim
    shape[axis] = v.shape[0]
    return v.reshape(shape)
