"""The public API rejects bad arguments with microscale's own errors, naming the value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import microscale as ms
from microscale.model import ModelConfig

X = jnp.linspace(-3, 3, 64, dtype=jnp.float32).reshape(2, 32)

BAD = [
    # (id, call, error type, message fragment)
    ("amax-negative", lambda: ms.quantize(X, "nvfp4", amax=-1.0), ValueError, "amax=-1.0"),
    ("amax-negative-fp8", lambda: ms.quantize(X, "fp8_e4m3", amax=-0.5), ValueError, "-0.5"),
    (
        "amax-negative-array",
        lambda: ms.quantize(X, "nvfp4", amax=jnp.float32(-2)),
        ValueError,
        "-2",
    ),
    ("amax-vector", lambda: ms.quantize(X, "nvfp4", amax=[1.0, 2.0]), ValueError, "scalar"),
    ("amax-string", lambda: ms.quantize(X, "nvfp4", amax="big"), ValueError, "big"),
    (
        "qdq-amax-negative",
        lambda: ms.formats.quantize_dequantize(X, "nvfp4", amax=-1.0),
        ValueError,
        "amax",
    ),
    (
        "dequantize-int8",
        lambda: ms.dequantize(ms.quantize(X, "nvfp4"), jnp.int8),
        TypeError,
        "int8",
    ),
    (
        "dequantize-int32",
        lambda: ms.dequantize(ms.quantize(X, "mxfp8"), np.int32),
        TypeError,
        "int32",
    ),
    ("dequantize-bool", lambda: ms.dequantize(ms.quantize(X, "fp8_e4m3"), bool), TypeError, "bool"),
    (
        "qdq-uint8",
        lambda: ms.formats.quantize_dequantize(X, "nvfp4", dtype=jnp.uint8),
        TypeError,
        "uint8",
    ),
    ("empty-rows", lambda: ms.quantize(jnp.zeros((0, 16)), "nvfp4"), ValueError, "empty"),
    ("empty-cols", lambda: ms.quantize(jnp.zeros((4, 0)), "nvfp4"), ValueError, "(4, 0)"),
    ("empty-1d-fp8", lambda: ms.quantize(jnp.zeros((0,)), "fp8_e4m3"), ValueError, "empty"),
    ("empty-mx", lambda: ms.quantize(jnp.zeros((0, 32)), "mxfp4"), ValueError, "empty"),
    ("key-int", lambda: ms.quantize(X, "nvfp4", rounding="stochastic", key=0), TypeError, "key=0"),
    (
        "key-str",
        lambda: ms.quantize(X, "nvfp4", rounding="stochastic", key="abc"),
        TypeError,
        "abc",
    ),
    (
        "key-wrong-shape",
        lambda: ms.quantize(X, "nvfp4", rounding="stochastic", key=jnp.zeros(3, jnp.uint32)),
        TypeError,
        "key=",
    ),
    (
        "key-float",
        lambda: ms.quantize(X, "mxfp4", rounding="stochastic", key=jnp.zeros(2, jnp.float32)),
        TypeError,
        "PRNG key",
    ),
    ("qdot-key-int", lambda: ms.qdot(X, X.T, "nvfp4", key=5), TypeError, "key=5"),
    ("amax-nan", lambda: ms.quantize(X, "nvfp4", amax=jnp.nan), ValueError, "amax=nan"),
    ("amax-inf", lambda: ms.quantize(X, "nvfp4", amax=np.inf), ValueError, "amax=inf"),
    ("amax-minus-inf", lambda: ms.quantize(X, "fp8_e4m3", amax=-np.inf), ValueError, "amax=-inf"),
    (
        "amax-nan-array",
        lambda: ms.quantize(X, "nvfp4", amax=jnp.float32(jnp.nan)),
        ValueError,
        "finite",
    ),
    (
        "qdq-amax-nan",
        lambda: ms.formats.quantize_dequantize(X, "nvfp4", amax=float("nan")),
        ValueError,
        "finite",
    ),
    ("input-int", lambda: ms.quantize(X.astype(jnp.int32), "nvfp4"), TypeError, "int32"),
    ("input-uint8", lambda: ms.quantize(X.astype(jnp.uint8), "mxfp4"), TypeError, "uint8"),
    (
        "input-complex",
        lambda: ms.quantize(X.astype(jnp.complex64), "nvfp4"),
        TypeError,
        "complex64",
    ),
    (
        "model-layers-huge",
        lambda: ModelConfig(n_layers=10**9),
        ValueError,
        "n_layers=1,000,000,000",
    ),
    ("model-vocab-huge", lambda: ModelConfig(vocab_size=2**23), ValueError, "vocab_size=8,388,608"),
    ("model-seq-huge", lambda: ModelConfig(max_seq_len=2**30), ValueError, "max_seq_len"),
    (
        "model-params-huge",
        lambda: ModelConfig(d_model=65536, n_heads=64, n_kv_heads=8, d_ff=262144, n_layers=1024),
        ValueError,
        "parameters",
    ),
    ("compare-seeds-repeated", lambda: _compare_config(seeds=(0, 1, 0)), ValueError, "[0, 1, 0]"),
]


def _compare_config(**kw):
    from microscale.experiments.compare import CompareConfig

    return CompareConfig(**kw)


# Narrow float inputs (already-quantized values) are widened to float32, exactly: the same
# result as quantizing their float32 values, for every format.
NARROW = [
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz,
    jnp.float8_e8m0fnu,
    jnp.float4_e2m1fn,
]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "fp8_e4m3", "q8_0"])
@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_narrow_float_inputs_quantize_as_their_float32_values(dtype, fmt):
    x = (X * 7).astype(dtype)
    got, want = ms.quantize(x, fmt), ms.quantize(x.astype(jnp.float32), fmt)
    for a, b in (
        (got.data, want.data),
        (got.scales, want.scales),
        (got.global_scale, want.global_scale),
    ):
        if b is None:
            assert a is None
            continue
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8) if np.asarray(a).dtype.itemsize == 1 else np.asarray(a),
            np.asarray(b).view(np.uint8) if np.asarray(b).dtype.itemsize == 1 else np.asarray(b),
        )


def test_model_sizes_at_the_limits_are_accepted():
    """The size limits refuse typos, not large models: Llama-3.1-405B's shape passes."""
    cfg = ModelConfig(
        d_model=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        d_ff=53248,
        vocab_size=128256,
        max_seq_len=131072,
    )
    assert 4.0e11 < cfg.num_params() < 4.2e11


@pytest.mark.parametrize(
    "text,value",
    [
        ("1e6", 10**6),
        ("2.5e3", 2500),
        ("1_000", 1000),
        ("9007199254740992", 2**53),
        ("1e15", 10**15),
    ],
)
def test_integers_in_scientific_notation(text, value):
    """An int field takes a whole number in scientific notation when a float holds it
    exactly (<= 2^53); beyond that, and for fractions, a clear error."""
    from microscale.config import apply_overrides
    from microscale.train import TrainConfig

    assert apply_overrides(TrainConfig.tiny(), [f"steps={text}"]).steps == value


@pytest.mark.parametrize(
    "text,fragment",
    [("1e30", "2^53"), ("2.5", "2.5"), ("1e-3", "1e-3"), ("nan", "nan"), ("inf", "inf")],
)
def test_integer_fields_refuse_inexact_numbers(text, fragment):
    from microscale.config import ConfigError, apply_overrides
    from microscale.train import TrainConfig

    with pytest.raises(ConfigError) as e:
        apply_overrides(TrainConfig.tiny(), [f"steps={text}"])
    assert fragment in str(e.value)


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
