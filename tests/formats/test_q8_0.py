"""ggml's Q8_0 as a registry format, against the reference in ggml/src/ggml-quants.c.

``quantize_row_q8_0_ref``: per block of 32, ``d = amax / 127`` (float32), ``id = d ? 1/d : 0``,
``qs = roundf(x * id)`` (C rounding: half away from zero), ``d`` stored as IEEE half;
``dequantize_row_q8_0``: ``qs * fp16_to_fp32(d)``. The reference below is a scalar
transcription of those two C functions.
"""

import math

import numpy as np
import pytest

import microscale as ms
from microscale.formats import elements, get_format


def _roundf(v: float) -> float:  # C roundf: half away from zero
    return math.copysign(math.floor(abs(v) + 0.5), v) if abs(v) < 2**23 else v


def _ref_q8_0(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d_out, q_out = [], []
    for blk in row.astype(np.float32).reshape(-1, 32):
        amax = np.float32(0)
        for v in blk:
            amax = max(amax, np.float32(abs(v)))
        d = np.float32(amax / np.float32(127))
        inv = np.float32(np.float32(1) / d) if d != 0 else np.float32(0)
        d_out.append(np.float16(d))
        q_out.append([int(_roundf(float(np.float32(v * inv)))) for v in blk])
    return np.array(d_out, np.float16), np.array(q_out, np.int8).reshape(-1)


def test_registry_row():
    spec = get_format("q8_0")
    assert (spec.block_size, spec.elem_bits, spec.scale_bits) == (32, 8, 16)
    assert spec.bits_per_element == 8.5  # ggml: 34 bytes per 32 weights
    assert spec.integer and not spec.packed and not spec.has_tensor_scale


@pytest.mark.parametrize(
    "y, want",
    [
        (0.5, 1),
        (-0.5, -1),
        (1.5, 2),
        (2.5, 3),
        (-2.5, -3),
        (0.49999997, 0),
        (126.5, 127),
        (200.0, 127),
        (-0.2, -0.0),
        (float("nan"), 0),
    ],
)
def test_int_round_is_c_roundf_with_saturation(y, want):
    got = float(elements.int_round(np.float32(y), 127.0))
    assert got == want and math.copysign(1, got) == math.copysign(1, want)


@pytest.mark.parametrize("scale", [1.0, 3e-3, 2e-6, 300.0])
def test_matches_ggml_reference(scale):
    rng = np.random.default_rng(int(scale * 1e6) % 2**31)
    x = (rng.standard_normal((6, 96)) * scale).astype(np.float32)
    x[0, :32] = 0  # zero block
    p2 = np.float32(2.0 ** round(math.log2(scale)))  # d = p2 exactly: x * id = k + 0.5 ties
    x[1, 32:64] = p2 * np.append(np.arange(31) + 0.5, 127)
    x[2, :32] = rng.standard_t(2, 32) * scale  # heavy tail
    q = ms.quantize(x, "q8_0")
    for r in range(x.shape[0]):
        d, qs = _ref_q8_0(x[r])
        np.testing.assert_array_equal(np.asarray(q.scales[r]).view(np.uint16), d.view(np.uint16))
        np.testing.assert_array_equal(np.asarray(q.data[r]), qs)
        want = qs.reshape(-1, 32).astype(np.float32) * d.astype(np.float32)[:, None]
        np.testing.assert_array_equal(np.asarray(ms.dequantize(q))[r], want.reshape(-1))


def test_matches_gguf_package_quantizer():
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    x = (np.random.default_rng(1).standard_normal((16, 128)) * 0.05).astype(np.float32)
    q = ms.quantize(x, "q8_0")
    ours = np.concatenate(
        [
            np.asarray(q.scales).reshape(16, 4, 1).view(np.uint8),
            np.asarray(q.data).reshape(16, 4, 32).view(np.uint8),
        ],
        axis=-1,
    )
    ref = quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(ours.reshape(16, -1), ref)
