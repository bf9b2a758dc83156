"""The public API rejects bad arguments with microscale's own errors, naming the value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import microscale as ms

X = jnp.linspace(-3, 3, 64, dtype=jnp.float32).reshape(2, 32)

BAD = [
    # (id, call, error type, message fragment)
    ("amax-negative", lambda: ms.quantize(X, "nvfp4", amax=-1.0), ValueError, "amax=-1.0"),
    ("amax-negative-fp8", lambda: ms.quantize(X, "fp8_e4m3", amax=-0.5), ValueError, "-0.5"),
    ("amax-negative-array", lambda: ms.quantize(X, "nvfp4", amax=jnp.float32(-2)), ValueError,
     "-2"),
    ("amax-vector", lambda: ms.quantize(X, "nvfp4", amax=[1.0, 2.0]), ValueError, "scalar"),
    ("amax-string", lambda: ms.quantize(X, "nvfp4", amax="big"), ValueError, "big"),
    ("qdq-amax-negative", lambda: ms.formats.quantize_dequantize(X, "nvfp4", amax=-1.0),
     ValueError, "amax"),
    ("dequantize-int8", lambda: ms.dequantize(ms.quantize(X, "nvfp4"), jnp.int8), TypeError,
     "int8"),
    ("dequantize-int32", lambda: ms.dequantize(ms.quantize(X, "mxfp8"), np.int32), TypeError,
     "int32"),
    ("dequantize-bool", lambda: ms.dequantize(ms.quantize(X, "fp8_e4m3"), bool), TypeError,
     "bool"),
    ("qdq-uint8", lambda: ms.formats.quantize_dequantize(X, "nvfp4", dtype=jnp.uint8),
     TypeError, "uint8"),
    ("empty-rows", lambda: ms.quantize(jnp.zeros((0, 16)), "nvfp4"), ValueError, "empty"),
    ("empty-cols", lambda: ms.quantize(jnp.zeros((4, 0)), "nvfp4"), ValueError, "(4, 0)"),
    ("empty-1d-fp8", lambda: ms.quantize(jnp.zeros((0,)), "fp8_e4m3"), ValueError, "empty"),
    ("empty-mx", lambda: ms.quantize(jnp.zeros((0, 32)), "mxfp4"), ValueError, "empty"),
    ("key-int", lambda: ms.quantize(X, "nvfp4", rounding="stochastic", key=0), TypeError,
     "key=0"),
    ("key-str", lambda: ms.quantize(X, "nvfp4", rounding="stochastic", key="abc"), TypeError,
     "abc"),
    ("key-wrong-shape", lambda: ms.quantize(X, "nvfp4", rounding="stochastic",
                                            key=jnp.zeros(3, jnp.uint32)), TypeError, "key="),
    ("key-float", lambda: ms.quantize(X, "mxfp4", rounding="stochastic",
                                      key=jnp.zeros(2, jnp.float32)), TypeError, "PRNG key"),
    ("qdot-key-int", lambda: ms.qdot(X, X.T, "nvfp4", key=5), TypeError, "key=5"),
]


@pytest.mark.parametrize("call,exc,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_api_argument(call, exc, fragment):
    with pytest.raises(exc) as e:
        call()
    assert fragment in str(e.value)
    assert type(e.value).__module__ in ("builtins",), type(e.value)


def test_good_keys_and_amax_still_work():
    q1 = ms.quantize(X, "nvfp4", rounding="stochastic", key=jax.random.key(0))
    q2 = ms.quantize(X, "nvfp4", rounding="stochastic", key=jax.random.PRNGKey(0))
    assert q1.shape == q2.shape == X.shape
    assert ms.quantize(X, "nvfp4", amax=0.0).shape == X.shape  # zero amax: scale 1
    y = jax.jit(lambda x, a: ms.dequantize(ms.quantize(x, "nvfp4", amax=a)))(X, 3.0)
    assert y.dtype == jnp.float32 and bool(jnp.isfinite(y).all())
