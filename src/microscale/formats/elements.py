"""Element codecs: E2M1 codes, 8-bit float casts, integer and float rounding, nibble
packing, E8M0 scales.

All functions are elementwise jnp code (jit/vmap friendly) working on float32 inputs
that have already been divided by their scale.

E2M1 (FP4) magnitudes by 3-bit index: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
Round-to-nearest-even with saturation at 6 puts the decision points at the midpoints
0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; a tie goes to the even index (the code whose
mantissa bit is 0): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
That is seven comparisons, which XLA fuses into one pass; the comparisons are ``>``
at ties that round down and ``>=`` at ties that round up.

Stochastic rounding of ``|y|`` between grid neighbours ``lo <= |y| < hi`` rounds up
with probability ``(|y| - lo) / (hi - lo)``, so ``E[round(y)] = y`` exactly
(saturated values excepted). The uniform comes from an explicit key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

# (threshold, tie rounds up?) for RNE on |y|.
_E2M1_RNE_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def round_to_float(
    a: jax.Array,
    mant_bits: int,
    min_exp: int,
    rounding: str = "nearest",
    u: jax.Array | None = None,
) -> jax.Array:
    """Round float32 magnitudes ``a >= 0`` to a narrower float format, in float32.

    The format has ``mant_bits`` explicit mantissa bits and smallest normal exponent
    ``min_exp`` (E2M1: 1, 0; E4M3: 3, -6; E5M2: 2, -14); saturation is the caller's
    ``min(a, max)`` before this. Done with integer arithmetic on the float32 bits rather
    than casts through float8/float4, which XLA:CPU emulates in software:

    * normal range: keep ``mant_bits`` of float32's 23 mantissa bits. RNE adds
      ``half ulp - 1 + kept LSB`` and clears the dropped bits (a carry into the exponent
      is the correct result); truncation clears them;
    * subnormal range (``a < 2^min_exp``): a fixed quantum ``2^(min_exp - mant_bits)``;
      ``jnp.round`` rounds half to even.

    Stochastic: ``lo`` = truncation, ``hi = lo + ulp(lo)``, up with probability
    ``(a - lo) / ulp(lo)``, so ``E[result] = a``. NaN stays NaN.
    """
    drop = 23 - mant_bits
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    quantum = jnp.float32(2.0 ** (min_exp - mant_bits))
    sub = a < jnp.float32(2.0**min_exp)
    if rounding == "nearest":
        half = jnp.uint32((1 << (drop - 1)) - 1)
        r = (bits + half + ((bits >> drop) & 1)) & jnp.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)
        normal = jax.lax.bitcast_convert_type(r, jnp.float32)
        return jnp.where(sub, jnp.round(a / quantum) * quantum, normal)
    if rounding != "stochastic":
        raise ValueError(f"unknown rounding {rounding!r}; expected 'nearest' or 'stochastic'")
    if u is None:
        raise ValueError("stochastic rounding needs uniform samples u")
    lo_bits = bits & jnp.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)
    lo_n = jax.lax.bitcast_convert_type(lo_bits, jnp.float32)
    # ulp of lo's binade: 2^(exponent - mant_bits), built from the exponent bits.
    ulp_n = jax.lax.bitcast_convert_type(
        (lo_bits & jnp.uint32(0x7F800000)) - jnp.uint32(mant_bits << 23), jnp.float32
    )
    lo = jnp.where(sub, jnp.floor(a / quantum) * quantum, lo_n)
    ulp = jnp.where(sub, quantum, ulp_n)
    return jnp.where(u * ulp < (a - lo), lo + ulp, lo)


def e2m1_encode(y: jax.Array, rounding: str = "nearest", u: jax.Array | None = None) -> jax.Array:
    """float32 values (already scaled into the E2M1 range) -> uint8 codes 0..15.

    Saturates at +-6. The sign bit follows the sign of ``y`` (so -0.1 -> code 8, -0).
    NaN inputs give code 7 or 15 (+-6); callers mark NaN blocks through the scale.
    """
    a = jnp.minimum(jnp.abs(y), 6.0)
    if rounding == "nearest":
        idx = jnp.zeros(a.shape, jnp.uint8)
        for t, up in _E2M1_RNE_THRESHOLDS:
            idx = idx + ((a >= t) if up else (a > t)).astype(jnp.uint8)
    else:
        q = jnp.minimum(round_to_float(a, 1, 0, rounding, u), 6.0)
        # value -> index: [0, 2) -> 2q, {2, 3} -> q + 2, {4, 6} -> q / 2 + 4.
        idx = jnp.where(q < 2.0, 2.0 * q, jnp.where(q < 4.0, q + 2.0, 0.5 * q + 4.0))
        idx = idx.astype(jnp.uint8)
    sign = jnp.signbit(y).astype(jnp.uint8) << 3
    return idx | sign


def float_round(
    y: jax.Array, elem_dtype, elem_max: float, rounding: str = "nearest", u: jax.Array | None = None
) -> jax.Array:
    """float32 -> the nearest value of ``elem_dtype`` (saturating at +-elem_max), float32.

    The value-domain quantizer for every element format (fake quantization); the sign
    of ``y`` is kept (tiny negatives become -0).
    """
    fi = ml_dtypes.finfo(elem_dtype)
    y = jnp.asarray(y)
    a = jnp.minimum(jnp.abs(y), jnp.float32(elem_max))
    v = jnp.minimum(
        round_to_float(a, int(fi.nmant), int(fi.minexp), rounding, u), jnp.float32(elem_max)
    )
    if y.dtype != jnp.float32:
        return jnp.where(jnp.signbit(y), -v, v)
    # ``where(signbit(y), -v, v)`` on every bit pattern (negation flips the sign bit) as
    # one XOR of bit patterns: two operations fewer per element to compile.
    sign = jax.lax.bitcast_convert_type(y, jnp.uint32) & jnp.uint32(0x80000000)
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(v, jnp.uint32) ^ sign, jnp.float32
    )


def e2m1_decode(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """uint8 codes 0..15 -> values (arithmetic, no gather)."""
    mag = (codes & 7).astype(jnp.float32)
    val = jnp.where(mag < 4.0, 0.5 * mag, jnp.where(mag < 6.0, mag - 2.0, 2.0 * mag - 8.0))
    val = jnp.where((codes & 8) != 0, -val, val)
    return val.astype(dtype)


def int_round(
    y: jax.Array, elem_max: float, rounding: str = "nearest", u: jax.Array | None = None
) -> jax.Array:
    """float32 -> the nearest integer, saturating at +-elem_max, as float32.

    ``"nearest"`` rounds half away from zero, C's ``roundf`` (what ggml's Q8_0 reference
    quantizer uses): ``floor(|y|) + floor(2 (|y| - floor(|y|)))`` with ``y``'s sign, exact
    for every float32. ``"stochastic"`` rounds ``|y|`` up with probability
    ``|y| - floor(|y|)`` (unbiased). NaN gives 0: callers mark NaN blocks through the scale.
    """
    a = jnp.minimum(jnp.abs(y), jnp.float32(elem_max))
    f = jnp.floor(a)
    if rounding == "nearest":
        r = f + jnp.floor(2 * (a - f))
    elif rounding == "stochastic":
        if u is None:
            raise ValueError("stochastic rounding needs uniform samples u")
        r = jnp.where(u < a - f, f + 1, f)
    else:
        raise ValueError(f"unknown rounding {rounding!r}; expected 'nearest' or 'stochastic'")
    r = jnp.where(jnp.isnan(y), jnp.float32(0), jnp.minimum(r, jnp.float32(elem_max)))
    return jnp.where(jnp.signbit(y), -r, r)


def float8_encode(
    y: jax.Array, dtype, elem_max: float, rounding: str = "nearest", u: jax.Array | None = None
) -> jax.Array:
    """float32 -> an 8-bit float dtype, saturating at +-elem_max (never NaN from overflow).

    Rounds in the value domain (:func:`float_round`), then casts the exact result.
    """
    return float_round(y, dtype, elem_max, rounding, u).astype(dtype)


def abs_bits_max(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``max(|x|)`` over ``axes`` (keepdims), computed on the bit patterns.

    Clearing the sign bit makes a float's bit pattern monotone in its magnitude, so an
    unsigned-integer max gives the magnitude max exactly; NaN patterns sort above Inf,
    so NaN propagates. For 16-bit floats this is ~3x faster on XLA:CPU than a float
    reduction (which converts to float32 first).
    """
    nbits = jnp.dtype(x.dtype).itemsize * 8
    utype = {16: jnp.uint16, 32: jnp.uint32}[nbits]
    b = jax.lax.bitcast_convert_type(x, utype) & utype((1 << (nbits - 1)) - 1)
    for ax in sorted(axes):  # outer block axes first: their reductions vectorise best
        if b.shape[ax] > 1:
            b = jnp.max(b, axis=ax, keepdims=True)
    return jax.lax.bitcast_convert_type(b, x.dtype)


def pack_nibbles(codes: jax.Array, axis: int = -1) -> jax.Array:
    """uint8 codes (0..15), even length along ``axis`` -> uint8, half as long.

    Element 2i goes to the low nibble, 2i+1 to the high nibble.
    """
    axis = axis % codes.ndim
    n = codes.shape[axis]
    if n % 2:
        raise ValueError(f"pack_nibbles needs an even length along axis {axis}, got {n}")
    if axis == codes.ndim - 1 and n % 4 == 0:
        # Fast path (~3x on XLA:CPU): view 4 codes as one little-endian uint32 and
        # gather its four low nibbles into 16 bits, so the loop stays contiguous.
        v = jax.lax.bitcast_convert_type(codes.reshape(codes.shape[:-1] + (n // 4, 4)), jnp.uint32)
        p = (v & 0xF) | ((v >> 4) & 0xF0) | ((v >> 8) & 0xF00) | ((v >> 12) & 0xF000)
        out = jax.lax.bitcast_convert_type(p.astype(jnp.uint16), jnp.uint8)
        return out.reshape(codes.shape[:-1] + (n // 2,))
    shp = codes.shape[:axis] + (n // 2, 2) + codes.shape[axis + 1 :]
    c = codes.reshape(shp)
    lo = jax.lax.index_in_dim(c, 0, axis + 1, keepdims=False)
    hi = jax.lax.index_in_dim(c, 1, axis + 1, keepdims=False)
    return (lo & 0xF) | (hi << 4)


def unpack_nibbles(packed: jax.Array, axis: int = -1) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: uint8 -> uint8 codes, twice as long along ``axis``."""
    axis = axis % packed.ndim
    m = packed.shape[axis]
    if axis == packed.ndim - 1 and m % 2 == 0:
        # Fast path: two packed bytes (one uint16) spread into four code bytes (a uint32).
        v = jax.lax.bitcast_convert_type(
            packed.reshape(packed.shape[:-1] + (m // 2, 2)), jnp.uint16
        ).astype(jnp.uint32)
        u = (v & 0xF) | ((v & 0xF0) << 4) | ((v & 0xF00) << 8) | ((v & 0xF000) << 12)
        return jax.lax.bitcast_convert_type(u, jnp.uint8).reshape(packed.shape[:-1] + (2 * m,))
    lo = packed & 0xF
    hi = packed >> 4
    both = jnp.stack([lo, hi], axis=axis + 1)
    shp = packed.shape[:axis] + (packed.shape[axis] * 2,) + packed.shape[axis + 1 :]
    return both.reshape(shp)


def e8m0_from_amax(amax: jax.Array, elem_max: float, elem_emax: int, rule: str) -> jax.Array:
    """Block amax (float32) -> E8M0 scale as its raw biased-exponent byte (uint8).

    ``"floor"`` (OCP MX v1.0): ``floor(log2 amax) - emax_elem``.
    ``"ceil"`` (NVIDIA): ``ceil(log2(amax / elem_max))`` computed on the float32
    quotient's bits exactly as cuDNN / JAX's reference do. Non-finite amax -> 0xFF (NaN).
    """
    if rule == "floor":
        bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32)
        exp = (bits >> 23).astype(jnp.int32) & 0xFF
        e = jnp.clip(exp - elem_emax, 0, 254)
    elif rule == "ceil":
        r = amax.astype(jnp.float32) / jnp.float32(elem_max)
        bits = jax.lax.bitcast_convert_type(r, jnp.uint32)
        exp = ((bits >> 23) & 0xFF).astype(jnp.int32)
        mant = bits & 0x7FFFFF
        round_up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
        e = jnp.clip(jnp.where(round_up, exp + 1, exp), 0, 254)
    else:
        raise ValueError(f"unknown MX scale rounding {rule!r}; expected 'floor' or 'ceil'")
    e = jnp.where(jnp.isfinite(amax), e, 255)
    return e.astype(jnp.uint8)


def _pow2(e: jax.Array) -> jax.Array:
    """2^e for integer e in [-126, 127] via the float32 bit pattern (no subnormals)."""
    return jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def e8m0_to_float(byte: jax.Array) -> jax.Array:
    """E8M0 byte -> float32 2^(byte-127); 0xFF -> NaN.

    Byte 0 (2^-127) is a float32 subnormal, which XLA on CPU flushes to zero; it only
    occurs for blocks whose amax is itself below ~2^-125, so it decodes as 2^-127 here
    but products with it flush to zero on CPU.
    """
    e = byte.astype(jnp.int32) - 127
    val = jnp.where(e < -126, jnp.float32(2.0**-127), _pow2(jnp.maximum(e, -126)))
    return jnp.where(byte == 255, jnp.float32(jnp.nan), val)


def e8m0_divide(x: jax.Array, byte: jax.Array) -> jax.Array:
    """x / 2^(byte-127), exact, as two multiplications by normal powers of two."""
    e = 127 - byte.astype(jnp.int32)
    a = e // 2
    out = (x * _pow2(a)) * _pow2(e - a)
    return jnp.where(byte == 255, jnp.float32(jnp.nan), out)


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijective avalanche mix of a uint32."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


# Most elements one 32-bit counter numbers. Arrays with more elements split their
# dimensions into groups of at most this many (tests lower it to run that path small).
SR_INDEX_LIMIT = 2**32
_GOLDEN = 0x9E3779B9  # odd multipliers (golden ratio; xxHash's PRIME32_2)
_PRIME2 = 0x85EBCA77


def _index_groups(shape: tuple[int, ...], limit: int) -> list[tuple[int, int]]:
    """Contiguous dimension ranges ``[start, stop)``, innermost first, each holding at
    most ``limit`` elements; one range when the whole array fits."""
    groups, stop, size = [], len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] > limit:
            raise ValueError(
                f"stochastic rounding: dimension {d} of shape {tuple(shape)} has "
                f"{shape[d]} elements; at most {limit} per dimension are supported"
            )
        if size * shape[d] > limit:
            groups.append((d + 1, stop))
            stop, size = d + 1, 1
        size *= shape[d]
    groups.append((0, stop))
    return groups


def _group_index(shape: tuple[int, ...], start: int, stop: int, window=None) -> jax.Array:
    """The uint32 row-major index over dimensions ``[start, stop)``, size 1 elsewhere;
    with a ``window`` ``(starts, sizes)``, only that box of ``shape`` (``starts`` may be
    traced)."""
    if window is None:
        n = 1
        for d in shape[start:stop]:
            n *= d
        return jax.lax.iota(jnp.uint32, n).reshape(
            [s if start <= i < stop else 1 for i, s in enumerate(shape)]
        )
    starts, sizes = window
    index, stride = jnp.zeros((1,) * len(shape), jnp.uint32), 1
    for d in range(stop - 1, start - 1, -1):
        at = jax.lax.iota(jnp.uint32, sizes[d]) + jnp.asarray(starts[d]).astype(jnp.uint32)
        index = index + at.reshape([sizes[d] if i == d else 1 for i in range(len(shape))]) * (
            jnp.uint32(stride)
        )
        stride *= shape[d]
    return index


def uniform_for_rounding(key: jax.Array, shape: tuple[int, ...], window=None) -> jax.Array:
    """Uniform [0, 1) float32 samples for stochastic rounding, one per element.

    A counter-based generator: two 32-bit seeds are drawn from ``key`` with
    ``jax.random``, then each element's index is hashed (two rounds of the MurmurHash3
    finaliser). Unlike materialising ``jax.random.uniform`` (threefry, ~20x the cost of
    the quantizer itself on CPU) this fuses into the quantization loop. Same key -> same
    samples; 24 bits of resolution (a rounding bias of at most 2^-25 of a grid step).
    Indices follow the global shape, so sharded and unsharded calls draw the same samples.

    Any size: an array of at most 2^32 elements hashes its row-major index ``i``:
    ``fmix(fmix(i * G + s0) ^ s1)``. A larger one splits its dimensions into groups of at
    most 2^32 elements (innermost first; one dimension may not exceed 2^32): ``i`` is the
    index within the innermost group, and the indices ``o`` of the outer groups are folded
    into the second round, ``fmix(fmix(i * G + s0) ^ s1 ^ fold)`` with
    ``fold = fmix((fold' ^ o) * P)`` chained over the outer groups. ``fold`` is 0 where
    every outer index is 0 (those elements draw what one counter would give them), and
    distinct outer indices give unrelated second-round inputs: no row repeats or shifts
    another row's samples, as adding an offset to the counter would.

    ``window=(starts, sizes)``: only the samples of that box of ``shape`` (a device's
    slice of a larger operand: ``starts`` may be traced), exactly those of the whole array,
    without drawing the rest.
    """
    seeds = jax.random.bits(key, (2,), jnp.uint32)
    shape = tuple(int(d) for d in shape)
    groups = _index_groups(shape, SR_INDEX_LIMIT)
    h = _fmix32(_group_index(shape, *groups[0], window) * jnp.uint32(_GOLDEN) + seeds[0])
    fold = None
    for start, stop in reversed(groups[1:]):  # outermost first
        o = _group_index(shape, start, stop, window)
        fold = _fmix32((o if fold is None else fold ^ o) * jnp.uint32(_PRIME2))
    if fold is not None:
        h = h ^ fold
    h = _fmix32(h ^ seeds[1])
    if window is not None:
        h = jnp.broadcast_to(h, tuple(window[1]))
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
