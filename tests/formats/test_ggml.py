"""ggml's block types (formats/ggml.py) against ggml itself and the ``gguf`` package.

Always run: the decoders equal ``gguf.quants.dequantize`` on random valid blocks of every
type; the encoders of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 equal ``gguf.quants.quantize`` (a port of
ggml's reference quantizers); every encoder, with and without an importance matrix,
reproduces golden digests of the bytes that ggml's ``ggml_quantize_chunk`` wrote for a
fixed table (computed with the prebuilt libggml-base of ``@node-llama-cpp/linux-x64``
3.22.1, ggml 0.25.1, commit 0ad4a86).

With ``MICROSCALE_LIBGGML=/path/to/libggml-base.so`` the encoders are compared with ggml
itself, byte for byte: a 20k-block table here, and 2^20 blocks per type and weighting in
the slow tier, drawn from nine distributions (normal, uniform, Student-t, integer grids
full of rounding ties, sparse, float16-subnormal scales, all-positive, one outlier per
32, bfloat16-rounded) over 18 orders of magnitude, plus all-zero, constant,
single-value and huge rows.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import quants

from microscale.formats import REGISTRY
from microscale.formats.ggml import (
    dequantize_ggml,
    fallback_format,
    ggml_codes,
    ggml_grid,
    ggml_with_codes,
    libggml_quantize,
    quantize_ggml,
    row_bytes,
)
from microscale.formats.spec import GGML_FORMATS, get_ggml_format

TYPES = list(GGML_FORMATS)
LIB = os.environ.get("MICROSCALE_LIBGGML")
needs_lib = pytest.mark.skipif(
    not LIB,
    reason="no ggml library (set MICROSCALE_LIBGGML=.../libggml-base.so, e.g. from npm "
    "@node-llama-cpp/linux-x64)",
)


def _gtype(fmt: str):
    return gguf.GGMLQuantizationType(get_ggml_format(fmt).ggml_type)


def table(rng: np.random.Generator, rows: int, ncol: int) -> np.ndarray:
    """``rows x ncol`` float32, each row from one of nine distributions and scales."""
    kinds = rng.integers(0, 9, rows)
    x = np.empty((rows, ncol), np.float32)
    for k in range(9):
        r = np.nonzero(kinds == k)[0]
        n = len(r)
        sc = np.exp(rng.uniform(-12, 6, (n, 1)))
        if k == 0:
            v = rng.standard_normal((n, ncol)) * sc
        elif k == 1:
            v = rng.uniform(-1, 1, (n, ncol)) * sc
        elif k == 2:
            v = rng.standard_t(2, (n, ncol)) * sc
        elif k == 3:  # integer grids with an offset: rounding ties everywhere
            v = (rng.integers(0, 16, (n, ncol)) - rng.integers(0, 16, (n, 1))) * sc
        elif k == 4:  # sparse
            v = rng.standard_normal((n, ncol)) * (rng.random((n, ncol)) < 0.1) * sc
        elif k == 5:  # scales below float16's normal range
            v = rng.standard_normal((n, ncol)) * np.exp(rng.uniform(-25, -14, (n, 1)))
        elif k == 6:  # all positive (a minimum above zero)
            v = np.abs(rng.standard_normal((n, ncol))) * sc + sc
        elif k == 7:  # one outlier per 32
            v = rng.standard_normal((n, ncol)) * sc
            at = rng.integers(0, 32, (n, ncol // 32)) + 32 * np.arange(ncol // 32)
            np.put_along_axis(v, at, 100 * np.broadcast_to(sc, at.shape), 1)
        else:  # bfloat16-rounded weights: few distinct values, many equal
            v = (rng.standard_normal((n, ncol)) * sc).astype(np.float32)
            v = (v.view(np.uint32) & 0xFFFF0000).view(np.float32)
        x[r] = v
    x[0] = 0  # all zero
    x[1] = 0
    x[1, 3] = 1e-7  # one tiny value
    x[2] = 1.0  # constant
    x[3, ::7] = -3e4  # huge, every 7th
    x[4, :] = -0.0  # negative zeros
    return x


def _weights(rng: np.random.Generator, ncol: int) -> dict[str, np.ndarray | None]:
    zeros = np.where(rng.random(ncol) < 0.3, 0, rng.random(ncol))
    return {
        "none": None,
        "imatrix": (rng.random(ncol) ** 3).astype(np.float32),
        "imatrix_zeros": zeros.astype(np.float32),
    }


def test_rows_match_ggml_type_traits():
    for name, spec in GGML_FORMATS.items():
        size, nbytes = gguf.GGML_QUANT_SIZES[_gtype(name)]
        assert (spec.super_block or spec.block_size, spec.block_bytes) == (size, nbytes)
        assert _gtype(name).name.lower() == name
        assert spec.bits_per_element == nbytes * 8 / size
    # ggml rows other than Q8_0 have no JAX quantizer, so REGISTRY does not hold them
    assert [n for n in GGML_FORMATS if n in REGISTRY] == ["q8_0"]
    assert REGISTRY["q8_0"] is GGML_FORMATS["q8_0"]


def _random_blocks(rng, fmt: str, nblocks: int) -> np.ndarray:
    """Random bytes with every float16 field a random finite half."""
    spec = get_ggml_format(fmt)
    b = rng.integers(0, 256, (nblocks, spec.block_bytes), dtype=np.uint8)
    halves = np.abs(rng.standard_normal(nblocks * 2) * 10.0 ** rng.uniform(-9, 3, nblocks * 2))
    halves = (halves * np.sign(rng.standard_normal(nblocks * 2))).astype(np.float16)
    h = halves.view(np.uint8).reshape(nblocks, 4)
    at = {"q2_k": [80, 82], "q3_k": [108], "q6_k": [208]}.get(fmt, [0, 2])
    if not spec.has_block_min and fmt not in ("q2_k",):
        at = at[:1]
    for i, o in enumerate(at):
        b[:, o : o + 2] = h[:, 2 * i : 2 * i + 2]
    return b


@pytest.mark.parametrize("fmt", TYPES)
def test_decode_equals_gguf(fmt):
    spec = get_ggml_format(fmt)
    b = _random_blocks(np.random.default_rng(spec.ggml_type), fmt, 4096)
    n = spec.super_block or spec.block_size
    ours = dequantize_ggml(b, fmt, 4 * n)
    ref = quants.dequantize(b.reshape(-1, 4 * spec.block_bytes), _gtype(fmt))
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_encode_equals_gguf_reference_quantizer(fmt):
    # On normal data. On table() gguf's numpy port itself leaves ggml in 11 (Q4_0, Q5_0)
    # and 25 (Q4_1, Q5_1) of 2048 blocks (negative zeros, float16-subnormal scales),
    # where ours equals ggml (test_encode_equals_ggml, the golden digests).
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((256, 256)) * np.exp(rng.uniform(-8, 4, (256, 1)))).astype(np.float32)
    np.testing.assert_array_equal(quantize_ggml(x, fmt), quants.quantize(x, _gtype(fmt)))


# sha256 (first 16 hex digits) of ggml_quantize_chunk's bytes for table(rng(37), 64, 512)
# and _weights(rng(38), 512), from libggml-base (npm @node-llama-cpp/linux-x64 3.22.1).
GOLDEN: dict[tuple[str, str], str] = {
    ("q4_0", "none"): "4e78b5f636155bd6",
    ("q4_0", "imatrix"): "95acea1a44354120",
    ("q4_0", "imatrix_zeros"): "8a8f25189e3fcec9",
    ("q4_1", "none"): "3cdfce6c13cc0118",
    ("q4_1", "imatrix"): "b35559e37dc45b2e",
    ("q4_1", "imatrix_zeros"): "f30d4b4517c5600a",
    ("q5_0", "none"): "010113d15d047f73",
    ("q5_0", "imatrix"): "fba10456112026a7",
    ("q5_0", "imatrix_zeros"): "ede57ee589492416",
    ("q5_1", "none"): "1ff1e75b7f6b8c64",
    ("q5_1", "imatrix"): "cc68231460b0f565",
    ("q5_1", "imatrix_zeros"): "95797d91c8c3f2b3",
    ("q8_0", "none"): "c2e97bb283f8cce8",
    ("q8_0", "imatrix"): "c2e97bb283f8cce8",
    ("q8_0", "imatrix_zeros"): "c2e97bb283f8cce8",
    ("q2_k", "none"): "a9b7ad2b1e1e2753",
    ("q2_k", "imatrix"): "00cc769d03463a64",
    ("q2_k", "imatrix_zeros"): "b8cfd41162423de3",
    ("q3_k", "none"): "7e4b11304553dd3d",
    ("q3_k", "imatrix"): "61381962103ab465",
    ("q3_k", "imatrix_zeros"): "1c1e716b53bff27a",
    ("q4_k", "none"): "818f4983cfe34518",
    ("q4_k", "imatrix"): "e3be05d24d98bd08",
    ("q4_k", "imatrix_zeros"): "4732c5c4d1fa7e00",
    ("q5_k", "none"): "68d84e0987d8f997",
    ("q5_k", "imatrix"): "a5c84ae143582395",
    ("q5_k", "imatrix_zeros"): "fcefb258daea845e",
    ("q6_k", "none"): "0dcb7fbaae46379d",
    ("q6_k", "imatrix"): "a7ef0f0af68673be",
    ("q6_k", "imatrix_zeros"): "95816a1376b9ca7b",
    ("iq4_nl", "none"): "3580bc24d210ceeb",
    ("iq4_nl", "imatrix"): "af2ee5fc92f9acdc",
    ("iq4_nl", "imatrix_zeros"): "92157ce8c67fcc9e",
    ("iq4_xs", "none"): "3bcbc3c3e08e922f",
    ("iq4_xs", "imatrix"): "1540560195af76a2",
    ("iq4_xs", "imatrix_zeros"): "cdd9c4964182143a",
}


def _golden_inputs():
    x = table(np.random.default_rng(37), 64, 512)
    return x, _weights(np.random.default_rng(38), 512)


@pytest.mark.parametrize("weights", ["none", "imatrix", "imatrix_zeros"])
@pytest.mark.parametrize("fmt", TYPES)
def test_encode_golden_bytes(fmt, weights):
    x, ws = _golden_inputs()
    got = quantize_ggml(x, fmt, ws[weights])
    assert got.shape == (64, row_bytes(fmt, 512))
    assert hashlib.sha256(got.tobytes()).hexdigest()[:16] == GOLDEN[fmt, weights]


@pytest.mark.parametrize("fmt", ["q2_k", "q4_k", "q5_k"])
def test_negative_sub_block_scale(fmt):
    # A super-block of float16-subnormal values with an imatrix with zeros, found by the
    # 2^20-block table: one sub-block's weighted fit has a negative scale, which
    # make_qp_quants stores as the uint8 254; Q4_K's imatrix encoder packs it as it is
    # (Q5_K's caps it at 63). The bytes are ggml's (npm @node-llama-cpp/linux-x64 3.22.1).
    case = np.load(Path(__file__).with_name("ggml_negative_subscale.npz"))
    got = quantize_ggml(case["x"][None], fmt, case["imatrix"])[0]
    np.testing.assert_array_equal(got, case[fmt])


def test_round_trip_error_is_small():
    x = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    for fmt in TYPES:
        y = dequantize_ggml(quantize_ggml(x, fmt), fmt, 512)
        rel = float(np.mean((y - x) ** 2) / np.mean(x**2))
        bits = get_ggml_format(fmt).elem_bits
        assert rel < 4.0 ** -(bits - 1.5), (fmt, rel)


def test_fallback_rule_is_llama_quant_cpp():
    # llama-quant.cpp, tensor_type_fallback: a row width that 256 does not divide
    want = {
        "q2_k": "q4_0",
        "q3_k": "q4_0",
        "q4_k": "q5_0",
        "q5_k": "q5_1",
        "q6_k": "q8_0",
        "iq4_xs": "iq4_nl",
    }
    for fmt in TYPES:
        assert fallback_format(fmt, 4096) == fmt
        assert fallback_format(fmt, 576) == want.get(fmt, fmt)  # SmolLM2's 576 = 18 x 32
        assert fallback_format(fmt, 100) == "f16"
    with pytest.raises(ValueError, match="not a multiple of 256"):
        quantize_ggml(np.zeros((2, 576), np.float32), "q4_k")


def _check_against_ggml(x, fmt, weights):
    spec = get_ggml_format(fmt)
    ours = quantize_ggml(x, fmt, weights).reshape(-1, spec.block_bytes)
    ref = libggml_quantize(x, fmt, weights, lib=LIB).reshape(-1, spec.block_bytes)
    bad = np.nonzero((ours != ref).any(1))[0]
    assert bad.size == 0, f"{fmt}: {bad.size} of {len(ref)} blocks differ, first {bad[:5]}"
    return len(ref)


@needs_lib
@pytest.mark.parametrize("fmt", TYPES)
def test_encode_equals_ggml(fmt):
    spec = get_ggml_format(fmt)
    rng = np.random.default_rng(100 + spec.ggml_type)  # type: ignore[operator]
    ncol = 1024 if spec.super_block else 576  # 576: a width 256 does not divide
    x = table(rng, 20480 * 32 // ncol, ncol)
    for w in _weights(rng, ncol).values():
        _check_against_ggml(x, fmt, w)


@needs_lib
@pytest.mark.parametrize("fmt", TYPES)
def test_golden_digests_are_ggml(fmt):
    x, ws = _golden_inputs()
    for name, w in ws.items():
        ref = libggml_quantize(x, fmt, w, lib=LIB)
        assert hashlib.sha256(ref.tobytes()).hexdigest()[:16] == GOLDEN[fmt, name]


@needs_lib
@pytest.mark.slow
@pytest.mark.parametrize("fmt", TYPES)
def test_encode_equals_ggml_million_blocks(fmt):
    spec = get_ggml_format(fmt)
    rng = np.random.default_rng(1000 + spec.ggml_type)  # type: ignore[operator]
    ncol = 4096
    nblocks = 2**20 if not spec.super_block else 2**17  # 2^17 super-blocks: 2^20 x 32
    rows = nblocks * (spec.super_block or 32) // ncol
    for w in _weights(rng, ncol).values():
        for part in range(0, rows, 256):
            _check_against_ggml(table(rng, 256, ncol), fmt, w)
            del part


# ---------------------------------------------------------------- grids and codes

# Each type's levels, written out from ggml's dequantize_row_* (the code is the stored
# bits as an index: Q8_0's int8 + 128, Q3_K's low 2 bits + 4 x its hmask bit).
LEVELS = {
    "q4_0": list(range(-8, 8)),
    "q4_1": list(range(16)),
    "q5_0": list(range(-16, 16)),
    "q5_1": list(range(32)),
    "q8_0": list(range(-128, 128)),
    "q2_k": list(range(4)),
    "q3_k": list(range(-4, 4)),
    "q4_k": list(range(16)),
    "q5_k": list(range(32)),
    "q6_k": list(range(-32, 32)),
    "iq4_nl": [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
    "iq4_xs": [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
}


def test_levels_table_covers_every_type():
    assert sorted(LEVELS) == sorted(TYPES)


@pytest.mark.parametrize("fmt", TYPES)
def test_grid_values_of_the_codes_are_the_decoder(fmt):
    """On random bytes (every bit pattern of the code and scale fields): the levels are the
    table's, and ``scale * levels[code] + offset`` is ``dequantize_ggml`` to the bit."""
    spec = get_ggml_format(fmt)
    n = spec.super_block or spec.block_size
    b = _random_blocks(np.random.default_rng(spec.ggml_type + 100), fmt, 2048)
    grid, codes = ggml_grid(b, fmt, 4 * n), ggml_codes(b, fmt, 4 * n)
    assert grid.levels.tolist() == LEVELS[fmt]
    assert codes.shape == (512, 4 * n) and codes.min() >= 0 and codes.max() < len(LEVELS[fmt])
    want = dequantize_ggml(b, fmt, 4 * n)
    np.testing.assert_array_equal(grid.values(codes).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", TYPES)
def test_with_codes_rewrites_only_the_codes(fmt):
    """``with_codes(b, codes(b)) == b`` on random bytes and on the encoder's; new codes
    read back as given and leave every scale byte as it was."""
    spec = get_ggml_format(fmt)
    n = spec.super_block or spec.block_size
    rng = np.random.default_rng(spec.ggml_type + 200)
    b = _random_blocks(rng, fmt, 1024).reshape(256, -1)
    x, ws = _golden_inputs()
    enc = quantize_ggml(x, fmt, ws["imatrix"])
    for data, width in ((b, 4 * n), (enc, 512)):
        assert np.array_equal(ggml_with_codes(data, fmt, ggml_codes(data, fmt, width)), data)
    new = rng.integers(0, len(LEVELS[fmt]), (64, 512))
    moved = ggml_with_codes(enc, fmt, new)
    assert np.array_equal(ggml_codes(moved, fmt, 512), new)
    grid = ggml_grid(enc, fmt, 512)
    assert np.array_equal(ggml_grid(moved, fmt, 512).scale, grid.scale)
    kept = moved.reshape(-1, spec.block_bytes) != enc.reshape(-1, spec.block_bytes)
    assert kept.any()  # the codes moved, and only inside one contiguous span of bytes
    cols = np.nonzero(kept.any(0))[0]
    assert np.array_equal(
        dequantize_ggml(moved, fmt, 512).view(np.uint32), grid.values(new).view(np.uint32)
    )
    assert cols.max() - cols.min() + 1 <= spec.block_bytes - 2  # d is never rewritten


@pytest.mark.parametrize("fmt", TYPES)
def test_nearest_is_the_closest_decoded_level(fmt):
    """Against brute force over every level: the nearest decoded value (ties to the lower
    code), on the encoder's grids and on values between, beyond and on the levels."""
    x, ws = _golden_inputs()
    grid = ggml_grid(quantize_ggml(x, fmt, ws["none"]), fmt, 512)
    rng = np.random.default_rng(5)
    every = np.stack(
        [grid.values(np.full(x.shape, c)) for c in range(len(grid.levels))], -1
    ).astype(np.float64)
    span = np.abs(every).max(-1, keepdims=True)
    probes = [x, x * 1.7, rng.uniform(-1.3, 1.3, x.shape) * span[..., 0]]
    probes.append(every[..., rng.integers(0, len(grid.levels))])  # exactly on a level
    for v in probes:
        got = grid.nearest(v)
        dist = np.abs(every - np.asarray(v, np.float64)[..., None])
        want = dist.argmin(-1)  # the first (lowest code) of equal distances
        np.testing.assert_array_equal(got, want)


def test_grid_refusals():
    b = quantize_ggml(np.ones((2, 64), np.float32), "q4_0")
    with pytest.raises(ValueError, match=r"ggml_with_codes\(q4_0\): codes .* 0\.\.15"):
        ggml_with_codes(b, "q4_0", np.full((2, 64), 16))
    with pytest.raises(ValueError, match=r"ggml_with_codes\(q4_0\): codes .* 0\.\.15"):
        ggml_with_codes(b, "q4_0", np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match=r"ggml_with_codes\(q4_0\): 4 blocks of bytes"):
        ggml_with_codes(b, "q4_0", np.zeros((1, 64), np.int32))
    with pytest.raises(ValueError, match=r"ggml_grid\(q4_0\): 18 bytes are not whole rows"):
        ggml_grid(b.reshape(-1)[:18], "q4_0", 64)


def test_sigma2_is_the_rows_mean_square_by_default():
    """Q4_0 .. Q5_1 with an imatrix weight by ``qw sqrt(sigma2 + x^2)``: passing the row's
    own mean square changes nothing; another value moves the scales; a bad one is named."""
    x, ws = _golden_inputs()
    for fmt in ("q4_0", "q4_1", "q5_0", "q5_1"):
        base = quantize_ggml(x, fmt, ws["imatrix"])
        own = np.zeros(64, np.float32)  # ggml's float32 sum, element by element
        for col in (x * x).T:
            own += col
        own /= np.float32(512)
        same = quantize_ggml(x, fmt, ws["imatrix"], sigma2=own)
        assert np.array_equal(same, base), fmt
        assert not np.array_equal(quantize_ggml(x, fmt, ws["imatrix"], sigma2=own * 50), base)
        # without an imatrix (and for the other types) sigma2 is not read
        assert np.array_equal(quantize_ggml(x, fmt, sigma2=own * 50), quantize_ggml(x, fmt))
    with pytest.raises(ValueError, match=r"quantize_ggml\(q4_0\): sigma2 of shape \(3,\)"):
        quantize_ggml(x, "q4_0", ws["imatrix"], sigma2=np.ones(3))
