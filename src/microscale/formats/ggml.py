"""ggml's block types as exact numpy codecs: the bytes llama.cpp's quantizer writes.

``quantize_ggml(x, fmt, imatrix)`` returns what ggml's ``ggml_quantize_chunk(type, x, dst,
0, rows, n_per_row, imatrix)`` writes, bit for bit (tested against the prebuilt library on
millions of blocks); ``dequantize_ggml`` is ggml's ``dequantize_row_*`` (equal to the
``gguf`` package's dequantizers). Rows are ``GGML_FORMATS`` (``spec.py``). Everything is
float32 in ggml's order of operations: sums run element by element from ``0``, products
and quotients round once each (no fused multiply-add), so every tie goes as in C.

Notation. ``x`` is one block, ``n`` its length; ``f16(v)`` float16 with round-to-nearest
even; ``rint`` ggml's ``nearest_int`` (the float32 ``v + 1.5 * 2^23`` trick: ties to
even); ``amax = max|x|`` and ``mx`` the first element that reaches it (``0`` for an
all-zero block); ``eps = 1e-15``.

Byte layouts (little endian; ``q`` the unsigned codes, ``h`` a half, ``[n]`` bytes):

========= ===== ====== ============================================================
type      block bytes  layout (decode)
========= ===== ====== ============================================================
q4_0      32    18     h d, [16] q nibbles: j low, j + 16 high (``d * (q - 8)``)
q4_1      32    20     h d, h m, [16] nibbles (``d * q + m``)
q5_0      32    22     h d, [4] bit 4 of code j in bit j, [16] nibbles (``d * (q - 16)``)
q5_1      32    24     h d, h m, [4] bit 4, [16] nibbles (``d * q + m``)
q8_0      32    34     h d, [32] int8 (``d * q``)
q2_k      256   84     [16] sub-scale | sub-min << 4, [64] 2-bit codes, h d, h dmin
q3_k      256   110    [32] hmask (bit 2), [64] 2-bit codes, [12] 6-bit scales, h d
q4_k      256   144    h d, h dmin, [12] 6-bit scales and mins, [128] nibbles
q5_k      256   176    h d, h dmin, [12] scales and mins, [32] bit 4, [128] nibbles
q6_k      256   210    [128] low nibbles, [64] 2 high bits, [16] int8 scales, h d
iq4_nl    32    18     h d, [16] nibbles indexing kvalues_iq4nl (``d * kv[q]``)
iq4_xs    256   136    h d, u16 scales' high 2 bits, [4] low nibbles, [128] nibbles
========= ===== ====== ============================================================

K-quant sub-blocks (16 or 32 long) decode as ``d * sc * q - dmin * m`` (``q2_k``, ``q4_k``,
``q5_k``), ``d * (sc - 32) * (q - 4)`` (``q3_k``), ``d * sc * (q - 32)`` (``q6_k``, int8
``sc``), ``d * (sc - 32) * kv[q]`` (``iq4_xs``). The 2-bit fields pack four codes a byte,
elements ``l, l + 32, l + 64, l + 96`` of each 128 at bit pairs 0, 2, 4, 6; the 6-bit
scales of ``q4_k``/``q5_k`` are scale ``j < 4`` in byte ``j``, min in ``j + 4``, and for
``j >= 4`` their low nibbles in byte ``j + 4``, high bits in bits 6-7 of bytes ``j - 4``
and ``j``; ``q3_k``'s sixteen 6-bit scales are nibbles in bytes 0-7 (``j`` low, ``j + 8``
high) and 2-bit pairs in bytes 8-11.

Encoders without importance weights (ggml's ``quantize_row_*_ref``):

* ``q4_0`` / ``q5_0``: ``d = mx / -2^(b-1)``, ``id = d ? 1/d : 0``, code
  ``min(2^b - 1, trunc(x * id + 2^(b-1) + 0.5))``.
* ``q4_1`` / ``q5_1``: ``d = (max - min) / (2^b - 1)``, code ``trunc((x - min) * id + 0.5)``
  (``q4_1`` capped at 15), ``m = f16(min)``.
* ``q8_0``: ``d = amax / 127``, code ``roundf(x * id)`` (half away from zero).
* ``q4_k`` / ``q5_k`` / ``q2_k``: per sub-block, weights ``w = sqrt(mean x^2) + |x|``
  (``q2_k``: ``|x|``) and a least-squares fit ``x ~ s * l + min`` with ``min <= 0`` over the
  row's ``ggml_search`` grid of inverse scales ``(rmin + rdelta * i + nmax) / (max - min)``
  (make_qkx2_quants, squared or absolute error). The super-block's ``d = f16(max s / 63)``
  (``q2_k``: ``/ 15``), each ``sc = min(63, rint(63 s / max s))``, likewise ``dmin`` and the
  minimums; codes are then ``clip(rint((x + dmin * m) / (d * sc)), 0, nmax)``.
* ``q6_k``: per 16, ``make_qx_quants`` (weights ``x^2``: the scale ``-(nmax + 0.1 i) / mx``,
  ``i = -9..9``, with the best weighted least-squares fit); ``d = f16(max s / -128)``
  with the signed largest scale, int8 ``sc = min(127, rint(-128 s / max s))``, codes
  ``clip(rint(x / (d * sc)), -32, 31) + 32``.
* ``q3_k``: per 16, make_q3_quants (``rint(-4 x / mx)``, then five passes that move one
  code at a time where that raises the ``x^2``-weighted fit), ``d = f16(max s / -32)``,
  ``sc = clip(rint(-32 s / max s), -32, 31) + 32``, codes ``clip(rint(x / (d * (sc - 32))),
  -4, 3) + 4``.
* ``iq4_nl`` / ``iq4_xs`` (ggml's ``quantize_iq4_nl`` / ``quantize_iq4_xs``): per 32,
  weights ``x^2`` (with an imatrix ``qw * sqrt(2 mean_sb x^2 + x^2)``), nearest codebook
  entry of ``x / d`` for ``d = mx / 127`` and the 15 scales ``(i - 127) / mx``,
  ``i = -7..7``, keeping the best weighted fit; ``iq4_nl`` stores ``f16`` of it and
  re-picks the codes with it; ``iq4_xs`` stores ``d = f16(max s / -32)`` (signed largest)
  and 6-bit ``clip(rint(s / d), -32, 31) + 32``, re-picking codes with ``d * l``.
  Nearest is ggml's ``best_index_int8``: ties go up.

With importance weights ``qw`` (one float per column, llama.cpp's imatrix), ggml uses a
different encoder for every type but Q8_0: weights ``qw * sqrt(sigma2 + x^2)`` with
``sigma2`` the mean of ``x^2`` over the row (Q4_0 .. Q5_1), ``2 x`` that over the
super-block (Q3_K, Q4_K, Q5_K) or ``1 x`` (Q2_K); Q6_K takes ``qw`` itself. The scale
search is make_qx_quants for the symmetric types (Q4_0, Q5_0, Q3_K sub-blocks, Q6_K) and
make_qkx3_quants (the grid ``(-0.9 + 0.05 i + nmax) / (max - min)``, ``i = 0..36``,
squared error) for those with minimums; the K-quants' sub-scales and minimums then go
through make_qp_quants (8 or 16 non-negative values, weights the sub-blocks' summed
weights) or, for Q3_K, make_qx_quants with ``nmax = 32``. A sub-block fit can come out
with a small negative scale (seen on float16-subnormal data); make_qp_quants then stores
its code as a wrapped uint8 (254), which Q5_K caps at 63 and Q4_K and Q2_K pack as it is
(its high bits spill as C's uint8 arithmetic spills them): reproduced, and tested.

Rows must hold whole blocks (a multiple of 32, or of 256 with super-blocks).
``fallback_format`` gives the type llama.cpp's ``tensor_type_fallback`` writes instead when
a tensor's row width is not a multiple of 256: Q2_K, Q3_K -> Q4_0; Q4_K -> Q5_0; Q5_K ->
Q5_1; Q6_K -> Q8_0; IQ4_XS -> IQ4_NL; and F16 if the fallback's 32 do not divide it either.
Non-finite inputs are outside ggml's contract (C leaves them undefined: Q4_0 and IQ4_NL write
an all-zero block for one NaN), so both encoders (``quantize_ggml``, ``libggml_quantize``)
refuse them, as the GGUF writer above them does: a ``ValueError`` naming the type, the
shape and the first bad index and value. Importance weights must be finite, ``>= 0`` and
one per column (`_check_imatrix`, for every type, Q8_0 included, though it ignores them);
``dequantize_ggml`` takes whole blocks of bytes, and says how many it expected.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from microscale.formats.spec import FormatSpec, get_ggml_format, get_weight_format, weight_only

__all__ = [
    "GgmlGrid",
    "dequantize_ggml",
    "fallback_format",
    "ggml_codes",
    "ggml_grid",
    "ggml_with_codes",
    "layer_format",
    "libggml_quantize",
    "quantize_ggml",
    "row_bytes",
    "row_sigma2",
]

F32 = np.float32
_EPS = F32(1e-15)
_CHUNK = 8192  # blocks per vectorized step (arrays of [n, _CHUNK] stay in cache)


# ---------------------------------------------------------------- float32 primitives


def _f(v) -> np.ndarray:
    return np.asarray(v, dtype=F32)


def _rint(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: ``bits(v + 12582912.f) & 0x7fffff - 0x400000`` (exact on any v)."""
    with np.errstate(all="ignore"):
        s = (_f(v) + F32(12582912.0)).view(np.int32)
    return (s & 0x007FFFFF) - 0x00400000


def _seqsum(t: np.ndarray) -> np.ndarray:
    """``acc = 0; acc += t[i]`` over axis 0 in order, in float32 (C's loop)."""
    acc = np.zeros(t.shape[1:], F32)
    for row in t:
        acc += row
    return acc


def _f16(v) -> np.ndarray:
    """float32 -> the uint16 bits of its float16 (RNE, subnormals kept: ggml's software
    GGML_FP32_TO_FP16)."""
    with np.errstate(all="ignore"):
        return _f(v).astype(np.float16).view(np.uint16)


def _h2f(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(np.float16).astype(F32)


def _div(a, b) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _f(np.divide(_f(a), _f(b), dtype=F32))


def _inv_or_zero(d: np.ndarray) -> np.ndarray:
    """``d ? 1/d : 0`` in float32."""
    return np.where(d != 0, _div(1.0, np.where(d != 0, d, 1)), F32(0))


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(amax, mx)`` over axis 0: the first element whose ``|x|`` is the largest
    (``amax < |v|`` updates), ``mx = 0`` when no element beats the initial 0."""
    ax = np.abs(x)
    i = ax.argmax(0)
    amax = np.take_along_axis(ax, i[None], 0)[0]
    mx = np.where(amax > 0, np.take_along_axis(x, i[None], 0)[0], F32(0))
    return amax, mx


def _first_min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """C's ``if (v < min) min = v`` (and ``>`` for max) over axis 0: the first element
    reaching each, so a block of signed zeros keeps its first zero's sign."""
    mn = np.take_along_axis(x, x.argmin(0)[None], 0)[0]
    return mn, np.take_along_axis(x, x.argmax(0)[None], 0)[0]


def _err():
    return np.errstate(all="ignore")


# ---------------------------------------------------------------- ggml's scale searches
# All take element-major arrays [n, B] (n elements of B blocks) and return per-block
# results; each is the C routine of the same name, vectorized over blocks.


def _make_qx_quants(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, w): ``(scale, L)``, L in 0..2 nmax - 1."""
    amax, mx = _first_absmax(x)
    zero = amax < _EPS
    with _err():
        iscale = _div(-nmax, mx)
        lf = np.clip(_rint(iscale * x), -nmax, nmax - 1)
        L = lf.copy()
        lf32 = lf.astype(F32)
        wx = w * x
        sumlx = _seqsum(wx * lf32)
        suml2 = _seqsum(w * lf32 * lf32)
        scale = np.where(suml2 != 0, _div(sumlx, suml2), F32(0))
        best = scale * sumlx
        for i in range(-9, 10):
            if i == 0:
                continue
            iscale = _div(-(F32(nmax) + F32(0.1) * F32(i)), mx)
            li_ = np.clip(_rint(iscale * x), -nmax, nmax - 1)
            l32 = li_.astype(F32)
            sumlx = _seqsum(wx * l32)
            suml2 = _seqsum(w * l32 * l32)
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(take, li_, L)
            scale = np.where(take, _div(sumlx, suml2), scale)
            best = np.where(take, scale * sumlx, best)
    return np.where(zero, F32(0), scale), np.where(zero, 0, L + nmax)


def _make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants(n, nmax, x, L, do_rmse=true): ``(scale, L)``, L in 0..2 nmax - 1."""
    amax, mx = _first_absmax(x)
    zero = amax < _EPS
    n = x.shape[0]
    with _err():
        iscale = _div(-nmax, mx)
        L = np.clip(_rint(iscale * x), -nmax, nmax - 1)
        w = x * x
        wx = w * x
        lf = L.astype(F32)
        sumlx = _seqsum(wx * lf)
        suml2 = _seqsum(w * lf * lf)
        for _ in range(5):  # a pass that changes nothing leaves the next one nothing to do
            for i in range(n):
                li = L[i].astype(F32)
                slx = sumlx - wx[i] * li
                sl2 = suml2 - w[i] * li * li
                new = np.clip(_rint(_div(x[i] * sl2, slx)), -nmax, nmax - 1)
                nf = new.astype(F32)
                slx2 = slx + wx[i] * nf
                sl22 = sl2 + w[i] * nf * nf
                take = (
                    (slx > 0)
                    & (new != L[i])
                    & (sl22 > 0)
                    & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
                )
                L[i] = np.where(take, new, L[i])
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
        scale = np.where(suml2 > 0, _div(sumlx, suml2), F32(0))
    return np.where(zero, F32(0), scale), np.where(zero, 0, L + nmax)


def _make_qkx(
    x: np.ndarray,
    nmax: int,
    w: np.ndarray,
    rmin: float,
    rdelta: float,
    nstep: int,
    mad: bool,
    strict_empty: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants (``strict_empty``: ``max == min`` is empty) and make_qkx3_quants
    (``max <= min``): ``(scale, the_min, L)`` with ``x ~ scale * L - the_min``."""
    n = x.shape[0]
    mn, mxv = _first_min_max(x)
    sum_w = w[0].copy()
    sum_x = sum_w * x[0]
    for i in range(1, n):
        sum_w = sum_w + w[i]
        sum_x = sum_x + w[i] * x[i]
    mn = np.where(mn > 0, F32(0), mn)
    empty = (mxv == mn) if strict_empty else (mxv <= mn)

    def err(scale, m, L):
        diff = scale * L.astype(F32) + m - x
        diff = np.abs(diff) if mad else diff * diff
        return _seqsum(w * diff)

    with _err():
        rng = mxv - mn
        iscale = _div(nmax, rng)
        scale = _div(1.0, iscale)
        L = np.clip(_rint(iscale * (x - mn)), 0, nmax)
        best = err(scale, mn, L)
        m = mn
        for i in range(nstep + 1):  # ggml's min moves with each accepted fit
            iscale = _div(F32(rmin) + F32(rdelta) * F32(i) + F32(nmax), mxv - m)
            la = np.clip(_rint(iscale * (x - m)), 0, nmax)
            lf = la.astype(F32)
            wl = w * lf
            sum_l = _seqsum(wl)
            sum_l2 = _seqsum(wl * lf)
            sum_xl = _seqsum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            ts = _div(sum_w * sum_xl - sum_x * sum_l, D)
            tm = _div(sum_l2 * sum_x - sum_l * sum_xl, D)
            pos = tm > 0
            tm = np.where(pos, F32(0), tm)
            ts = np.where(pos, _div(sum_xl, sum_l2), ts)
            cur = err(ts, tm, la)
            take = (D > 0) & (cur < best)
            L = np.where(take, la, L)
            best = np.where(take, cur, best)
            scale = np.where(take, ts, scale)
            m = np.where(take, tm, m)
    return (
        np.where(empty, F32(0), scale),
        np.where(empty, -mn, -m),
        np.where(empty, 0, L),
    )


def _make_qp_quants(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qp_quants(n, nmax, x, L, w) on non-negative x: ``(scale, L)``, L in 0..nmax."""
    n = x.shape[0]
    mx = np.maximum(x.max(0), F32(0))
    zero = mx < _EPS
    with _err():
        iscale = _div(nmax, mx)
        L = _rint(iscale * x) & 0xFF
        scale = _div(1.0, iscale)
        diff = x - scale * L.astype(F32)
        best = _seqsum(w * diff * diff)
        for i in range(-4, 5):
            if i == 0:
                continue
            isc = _div(F32(0.1) * F32(i) + F32(nmax), mx)
            sc = _div(1.0, isc)
            li_ = np.minimum(nmax, _rint(isc * x))
            diff = x - sc * li_.astype(F32)
            mse = _seqsum(w * diff * diff)
            take = mse < best
            best = np.where(take, mse, best)
            iscale = np.where(take, isc, iscale)
        li_ = np.minimum(nmax, _rint(iscale * x))
        L = li_ & 0xFF
        lf = li_.astype(F32)
        wx = w * x
        sumlx = _seqsum(wx * lf)
        suml2 = _seqsum(w * lf * lf)
        for _ in range(5):
            for i in range(n):
                li = L[i].astype(F32)
                slx = sumlx - wx[i] * li
                sl2 = suml2 - w[i] * li * li
                new = np.minimum(nmax, _rint(_div(x[i] * sl2, slx)))
                nf = new.astype(F32)
                slx2 = slx + wx[i] * nf
                sl22 = sl2 + w[i] * nf * nf
                take = (
                    (slx > 0)
                    & (sl2 > 0)
                    & (new != L[i])
                    & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
                )
                L[i] = np.where(take, new & 0xFF, L[i])
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
        scale = np.where(suml2 > 0, _div(sumlx, suml2), F32(0))
    return np.where(zero, F32(0), scale), np.where(zero, 0, L)


def _best_index(v: np.ndarray, values: np.ndarray) -> np.ndarray:
    """best_index_int8: the nearest codebook entry, a tie going to the upper one."""
    mu = np.clip(np.searchsorted(values, v, side="right"), 1, len(values) - 1)
    lo, hi = values[mu - 1], values[mu]
    with _err():
        idx = np.where(v - lo < hi - v, mu - 1, mu)
    idx = np.where(v <= values[0], 0, idx)
    return np.where(v >= values[-1], len(values) - 1, idx)


# ---------------------------------------------------------------- packing helpers


def _nibbles(L: np.ndarray) -> np.ndarray:
    """[B, 32k] codes -> [B, 16k] bytes: per 32, code j low nibble, code j + 16 high."""
    b = L.reshape(L.shape[0], -1, 2, 16).astype(np.uint8)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(L.shape[0], -1)


def _high_bits(L: np.ndarray, bit: int) -> np.ndarray:
    """[B, 32] codes -> [B, 4] bytes: bit ``bit`` of code j in bit j of a uint32."""
    h = ((L.astype(np.uint32) >> bit) & 1) << np.arange(32, dtype=np.uint32)
    return h.sum(1, dtype=np.uint32).astype("<u4").reshape(-1, 1).view(np.uint8)


def _crumbs(L: np.ndarray) -> np.ndarray:
    """[B, 256] 2-bit codes -> [B, 64]: element ``l + 32 k`` of each 128 at bits 2k."""
    b = L.reshape(L.shape[0], 2, 4, 32).astype(np.uint8)
    return (b[:, :, 0] | (b[:, :, 1] << 2) | (b[:, :, 2] << 4) | (b[:, :, 3] << 6)).reshape(
        L.shape[0], 64
    )


def _h(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits, "<u2").reshape(-1, 1).view(np.uint8)


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's twelve bytes from eight 6-bit scales and minimums [B, 8]."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _unpack_k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], 1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return sc, m


def _pack_q3_scales(l6: np.ndarray) -> np.ndarray:
    """Q3_K's twelve bytes from sixteen 6-bit values [B, 16]."""
    l6 = l6.astype(np.uint8)
    out = np.zeros((l6.shape[0], 12), np.uint8)
    out[:, 0:8] = (l6[:, 0:8] & 0xF) | ((l6[:, 8:16] & 0xF) << 4)
    hi = (l6 >> 4).reshape(-1, 4, 4)  # [B, j // 4, j % 4]
    out[:, 8:12] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return out


def _unpack_q3_scales(s: np.ndarray) -> np.ndarray:
    lo = np.concatenate([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], 1)
    hi = (s[:, None, 8:12] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3
    return (lo | (hi.reshape(-1, 16) << 4)).astype(np.int32) - 32


# ---------------------------------------------------------------- encoders per codec
# Each takes blocks x [B, P] (P = super_block or block_size) in float32 and weights
# qw [B, P] (None without an imatrix) plus ``sig`` [B] (the row's mean of x^2, legacy
# types with an imatrix) and returns [B, block_bytes].


def _enc_q8(spec: FormatSpec, x, qw, sig):
    xt = x.T
    amax = np.abs(xt).max(0)
    d = _div(amax, 127)
    q = xt * _inv_or_zero(d)
    t = np.trunc(q)  # roundf (half away from zero); q - t is exact
    q = t + np.copysign((np.abs(q - t) >= F32(0.5)).astype(F32), q)
    return np.concatenate([_h(_f16(d)), _pack_codes(spec, q.T.astype(np.int32) + 128)], 1)


def _enc_sym(spec: FormatSpec, x, qw, sig):
    half = 1 << (spec.elem_bits - 1)
    xt = x.T
    if qw is None:
        _, mx = _first_absmax(xt)
        d = _div(mx, -half)
        with _err():
            L = np.trunc(xt * _inv_or_zero(d) + F32(half + 0.5)).astype(np.int32)
        L = np.minimum(2 * half - 1, L)
    else:
        with _err():
            w = qw.T * np.sqrt(sig + xt * xt)
        d, L = _make_qx_quants(xt, half, w)
    return np.concatenate([_h(_f16(d)), _pack_codes(spec, L.T)], 1)


def _enc_asym(spec: FormatSpec, x, qw, sig):
    nmax = (1 << spec.elem_bits) - 1
    xt = x.T
    if qw is None:
        mn, mx = _first_min_max(xt)
        d = _div(mx - mn, nmax)
        with _err():
            L = np.trunc((xt - mn) * _inv_or_zero(d) + F32(0.5)).astype(np.int32)
        L = (np.minimum(15, L) if spec.elem_bits == 4 else L) & 0xFF
        m = mn
    else:
        with _err():
            w = qw.T * np.sqrt(sig + xt * xt)
        d, the_min, L = _make_qkx(xt, nmax, w, -0.9, 0.05, 36, False, strict_empty=False)
        m = -the_min
    return np.concatenate([_h(_f16(d)), _h(_f16(m)), _pack_codes(spec, L.T)], 1)


def _sub(x: np.ndarray, n: int) -> np.ndarray:
    """[B, 256] -> element-major sub-blocks [n, B, 256 / n]."""
    return np.ascontiguousarray(x.reshape(x.shape[0], -1, n).transpose(2, 0, 1))


def _sigma2(x: np.ndarray, factor: float) -> np.ndarray:
    """``factor * sum x^2 / P`` over each block's P elements, summed in order."""
    s = _seqsum(np.ascontiguousarray((x * x).T))
    return _div(F32(factor) * s, x.shape[1])


def _requant(x, d, dm, nmax, lo=0):
    """Codes for sub-blocks [n, B, S] with decoded scales d (and offsets dm) [B, S];
    None where d == 0 (ggml keeps the search's codes there)."""
    with _err():
        v = x if dm is None else x + dm
        return np.clip(_rint(_div(v, d)), lo, nmax)


def _k_ref_super_scales(scales, mins, q4: bool):
    """The reference K-quant encoders' super-block pair ``(ls, lm, dh, mh)`` from sub-block
    scales and minimums [B, S]: ``d = f16(max s / top)``, ``sc = rint(top * s / max s)``
    (top 15, uncapped: Q2_K; top 63, capped: Q4_K / Q5_K)."""
    max_scale, max_min = scales.max(1), mins.max(1)
    max_scale = np.where(max_scale > 0, max_scale, F32(0))
    max_min = np.where(max_min > 0, max_min, F32(0))
    top = F32(15 if q4 else 63)
    with _err():
        inv_s = np.where(max_scale > 0, _div(top, max_scale), F32(0))[:, None]
        inv_m = np.where(max_min > 0, _div(top, max_min), F32(0))[:, None]
        ls = _rint(inv_s * scales) & 0xFF
        lm = _rint(inv_m * mins) & 0xFF
    if q4:  # Q2_K: no cap; a zero max leaves zeros; the byte keeps 4 + 4 bits
        byte = (
            np.where(max_scale[:, None] > 0, ls, 0) | (np.where(max_min[:, None] > 0, lm, 0) << 4)
        ) & 0xFF
        ls, lm = byte & 0xF, byte >> 4
    else:
        ls, lm = np.minimum(63, ls), np.minimum(63, lm)
    dh = _f16(np.where(max_scale > 0, _div(max_scale, top), F32(0)) if q4 else _div(max_scale, top))
    mh = _f16(np.where(max_min > 0, _div(max_min, top), F32(0)) if q4 else _div(max_min, top))
    return ls, lm, dh, mh


def _enc_k_asym(spec: FormatSpec, x, qw, sig):
    n = spec.block_size
    assert n is not None and spec.ggml_search is not None
    nmax = (1 << spec.elem_bits) - 1
    xs = _sub(x, n)  # [n, B, S]
    B, S = x.shape[0], xs.shape[2]
    q4 = spec.sub_scale_bits == 4
    if qw is None:
        rmin, rdelta, nstep, mad = spec.ggml_search
        if q4:
            w = np.abs(xs)
        else:
            av = np.sqrt(_div(_seqsum(xs * xs), n))
            w = av + np.abs(xs)
        scales, mins, L = _make_qkx(
            xs.reshape(n, -1), nmax, w.reshape(n, -1), rmin, rdelta, nstep, mad, True
        )
        scales, mins = scales.reshape(B, S), mins.reshape(B, S)
        L = L.reshape(n, B, S)
        ls, lm, dh, mh = _k_ref_super_scales(scales, mins, q4)
    else:
        sigma2 = _sigma2(x, 1.0 if q4 else 2.0)
        qws = _sub(qw, n)
        with _err():
            w = qws * np.sqrt(sigma2[None, :, None] + xs * xs)
        sw = _seqsum(w)  # [B, S]
        scales, mins, L = _make_qkx(
            xs.reshape(n, -1), nmax, w.reshape(n, -1), -0.9, 0.05, 36, False, False
        )
        scales, mins = scales.reshape(B, S), mins.reshape(B, S)
        L = L.reshape(n, B, S)
        top_i = 15 if q4 else 63
        d_blk, ls = _make_qp_quants(np.ascontiguousarray(scales.T), top_i, sw.T)
        m_blk, lm = _make_qp_quants(np.ascontiguousarray(mins.T), top_i, sw.T)
        ls, lm = ls.T, lm.T
        if spec.elem_bits == 5:  # quantize_row_q5_K_impl caps at 63; Q4_K's does not, so a
            ls, lm = np.minimum(63, ls), np.minimum(63, lm)  # negative scale wraps (254)
        dh, mh = _f16(d_blk), _f16(m_blk)
    # The codes are re-picked with the scales as stored (uint8 wrap-around included).
    if q4:
        sbytes = ((ls | (lm << 4)) & 0xFF).astype(np.uint8)
        ls, lm = sbytes & 0xF, sbytes >> 4
    else:
        sbytes = _pack_k4_scales(ls & 0xFF, lm & 0xFF)
        ls, lm = _unpack_k4_scales(sbytes)
    d = _h2f(dh)[:, None] * ls.astype(F32)
    dm = _h2f(mh)[:, None] * lm.astype(F32)
    L = np.where(d != 0, _requant(xs, d, dm, nmax), L)
    codes = _pack_codes(spec, L.transpose(1, 2, 0).reshape(B, -1))  # [B, 256] codes
    if q4:
        return np.concatenate([sbytes, codes, _h(dh), _h(mh)], 1)
    return np.concatenate([_h(dh), _h(mh), sbytes, codes], 1)


def _enc_k_sym(spec: FormatSpec, x, qw, sig):
    q6 = spec.sub_scale_bits == 8
    half = 1 << (spec.elem_bits - 1)
    xs = _sub(x, 16)  # [16, B, 16]
    B = x.shape[0]
    flat = xs.reshape(16, -1)
    if q6:
        w = flat * flat if qw is None else _sub(qw, 16).reshape(16, -1)
        scales, L = _make_qx_quants(flat, half, w)
    elif qw is None:
        scales, L = _make_q3_quants(flat, half)
    else:
        sigma2 = _sigma2(x, 2.0)
        with _err():
            w3 = _sub(qw, 16) * np.sqrt(sigma2[None, :, None] + xs * xs)
        sw = _seqsum(w3)  # [B, 16]
        scales, L = _make_qx_quants(flat, half, w3.reshape(16, -1))
    scales = scales.reshape(B, 16)
    L = L.reshape(16, B, 16)
    if q6:
        amax, mxs = _first_absmax(scales.T)
        zero = amax < _EPS
        with _err():
            iscale = _div(-128.0, mxs)
            dh = _f16(_div(1.0, iscale))
            sc = np.minimum(127, _rint(iscale[:, None] * scales))
        sc = ((sc + 128) & 0xFF) - 128
        d = _h2f(dh)[:, None] * sc.astype(F32)
        L = np.where(d != 0, _requant(xs, d, None, half - 1, -half) + half, L)
        codes = _pack_codes(spec, L.transpose(1, 2, 0).reshape(B, 256))
        out = np.concatenate([codes, sc.astype(np.int8).view(np.uint8), _h(dh)], 1)
        out[zero] = 0
        return out
    if qw is None:
        _, mxs = _first_absmax(scales.T)
        nz = mxs != 0
        with _err():
            iscale = _div(-32.0, np.where(nz, mxs, 1))
            li_ = _rint(iscale[:, None] * scales)
        li_ = ((li_ + 128) & 0xFF) - 128  # int8_t l = nearest_int(...)
        l6 = np.where(nz[:, None], np.clip(li_, -32, 31) + 32, 0)
        dh = np.where(nz, _f16(_div(1.0, iscale)), _f16(F32(0)))
    else:
        d_blk, l6 = _make_qx_quants(np.ascontiguousarray(scales.T), 32, sw.T)
        l6 = l6.T
        dh = _f16(d_blk)
    sb = _pack_q3_scales(l6)
    sc = _unpack_q3_scales(sb)
    d = _h2f(dh)[:, None] * sc.astype(F32)
    L = np.where(d != 0, _requant(xs, d, None, half - 1, -half) + half, L)
    codes = _pack_codes(spec, L.transpose(1, 2, 0).reshape(B, 256))
    return np.concatenate([codes, sb, _h(dh)], 1)


def _iq4_scale(xt, w, values, ntry):
    """quantize_row_iq4_nl_impl's per-32 search: ``(scale, empty)`` over [32, B]."""
    amax, mx = _first_absmax(xt)
    empty = amax < _EPS
    v0 = F32(values[0])
    with _err():
        d = _div(-mx, v0)
        iv = _div(1.0, d)

        def fit(scale_inv):
            q = values[_best_index(scale_inv * xt, values)]
            wq = w * q
            return _seqsum(wq * xt), _seqsum(wq * q)

        sumqx, sumq2 = fit(iv)
        d = np.where(sumq2 > 0, _div(sumqx, sumq2), F32(0))
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            sumqx, sumq2 = fit(_div(F32(itry + int(values[0])), mx))
            take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(take, _div(sumqx, sumq2), d)
            best = np.where(take, d * sumqx, best)
    return np.where(empty, F32(0), d), empty


def _enc_iq4(spec: FormatSpec, x, qw, sig):
    assert spec.elem_values is not None
    values = np.asarray(spec.elem_values, F32)
    P = x.shape[1]
    B = x.shape[0]
    xs = _sub(x, 32)  # [32, B, S]
    S = xs.shape[2]
    if qw is None:
        w = xs * xs
    else:
        sigma2 = _div(_seqsum(np.ascontiguousarray((x * x).T)) * F32(2.0 / P), 1)
        with _err():
            w = _sub(qw, 32) * np.sqrt(sigma2[None, :, None] + xs * xs)
    scales, _ = _iq4_scale(xs.reshape(32, -1), w.reshape(32, -1), values, 7)
    scales = scales.reshape(B, S)
    if spec.super_block is None:
        dh = _f16(scales[:, 0])
        idl = _inv_or_zero(scales[:, 0])[:, None]
        L = _best_index(idl * x, values)
        return np.concatenate([_h(dh), _pack_codes(spec, L)], 1)
    amax, mxs = _first_absmax(scales.T)
    d = -mxs / F32(32)
    dh = _f16(d)
    with _err():
        li_ = np.clip(_rint(_inv_or_zero(d)[:, None] * scales), -32, 31)
        dl = d[:, None] * li_.astype(F32)
        idl = _inv_or_zero(dl)
    L = _best_index(idl[None] * xs, values).transpose(1, 2, 0).reshape(B, P)
    l6 = (li_ + 32).astype(np.uint16)
    sl = (l6 & 0xF).astype(np.uint8).reshape(B, -1, 2)
    scales_l = sl[:, :, 0] | (sl[:, :, 1] << 4)
    sh = ((l6 >> 4) << (2 * np.arange(S, dtype=np.uint16))).sum(1, dtype=np.uint16)
    return np.concatenate([_h(dh), _h(sh), scales_l, _pack_codes(spec, L)], 1)


_ENCODERS = {
    "q8": _enc_q8,
    "sym": _enc_sym,
    "asym": _enc_asym,
    "k_asym": _enc_k_asym,
    "k_sym": _enc_k_sym,
    "iq4": _enc_iq4,
}


# ---------------------------------------------------------------- public API


def _block_elems(spec: FormatSpec) -> int:
    n = spec.super_block or spec.block_size
    assert n is not None
    return n


def row_bytes(fmt: str | FormatSpec, n_per_row: int) -> int:
    """Bytes of one row of ``n_per_row`` elements (which must hold whole blocks)."""
    spec = get_ggml_format(fmt)
    n = _block_elems(spec)
    if isinstance(n_per_row, bool) or not isinstance(n_per_row, int | np.integer):
        raise ValueError(f"{spec.name}: n_per_row={n_per_row!r}: expected a positive int")
    if n_per_row <= 0 or n_per_row % n:
        raise ValueError(
            f"{spec.name}: a row of {n_per_row} is not a multiple of {n} "
            f"(rows hold whole blocks of {n} values)"
        )
    assert spec.block_bytes is not None
    return int(n_per_row) // n * spec.block_bytes


def _float_rows(x, spec: FormatSpec, who: str) -> np.ndarray:
    """``x`` as float32 ``[..., n_per_row]`` of whole blocks, every value finite: else a
    ValueError naming ``who``, the type, the shape and the first bad index and value."""
    a = np.asarray(x)
    if a.dtype.kind not in "biuf" and not (a.dtype.kind == "V" and "float" in a.dtype.name):
        raise ValueError(
            f"{who}({spec.name}): x of dtype {a.dtype} (shape {a.shape}): expected real numbers"
        )
    if a.ndim == 0:
        raise ValueError(f"{who}({spec.name}): x needs at least one dimension, got a scalar")
    row_bytes(spec, a.shape[-1])
    with np.errstate(over="ignore"):  # a float64 past float32's range: named below
        f = np.asarray(a, F32)
    bad = ~np.isfinite(f)
    if bad.any():
        at = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), a.shape))
        past = " (past float32's range)" if np.isfinite(a[at]) else ""
        raise ValueError(
            f"{who}({spec.name}): x of shape {a.shape} holds {int(bad.sum())} non-finite "
            f"value(s) in float32, the first x[{', '.join(map(str, at))}] = {a[at]!s}{past}; "
            "ggml's encoders need finite values (C leaves the block undefined)"
        )
    return f


def _check_imatrix(imatrix, spec: FormatSpec, n_per_row: int, who: str) -> np.ndarray | None:
    """llama.cpp's importance weights: one finite value ``>= 0`` per column (``[n_per_row]``),
    else a ValueError naming what is wrong; None stays None. Every type checks them."""
    if imatrix is None:
        return None
    a = np.asarray(imatrix)
    what = f"{who}({spec.name}): imatrix of shape {a.shape}"
    if a.dtype.kind not in "biuf" and not (a.dtype.kind == "V" and "float" in a.dtype.name):
        raise ValueError(f"{what}, dtype {a.dtype}: expected real numbers")
    if a.size != n_per_row or a.ndim > 1 and a.shape[-1] != n_per_row:
        raise ValueError(f"{what}: expected one weight per column, shape ({n_per_row},)")
    w = np.asarray(a, F32).reshape(-1)
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        i = int(np.argmax(bad))
        kind = "non-finite" if not np.isfinite(w[i]) else "negative"
        raise ValueError(
            f"{what} holds {int(bad.sum())} non-finite or negative weight(s), the first "
            f"imatrix[{i}] = {w[i]!s} ({kind}); expected finite weights >= 0"
        )
    return w


def fallback_format(fmt: str | FormatSpec, n_per_row: int) -> str:
    """The type llama.cpp writes for a ``fmt`` tensor whose rows are ``n_per_row`` long
    (llama-quant.cpp's tensor_type_fallback): ``fmt`` itself when its blocks divide the
    row, else its ``ggml_fallback`` (and ``"f16"`` when that does not divide it either)."""
    spec = get_ggml_format(fmt)
    if n_per_row % _block_elems(spec) == 0:
        return spec.name
    if spec.ggml_fallback is not None:
        fb = get_ggml_format(spec.ggml_fallback)
        if n_per_row % _block_elems(fb) == 0:
            return fb.name
    return "f16"


def layer_format(fmt: str, n_per_row: int) -> str:
    """The weight format a layer with rows of ``n_per_row`` inputs is stored in when asked
    for ``fmt``: ``fmt`` itself, or, for one of ggml's block types whose blocks do not divide
    the row, the type llama.cpp writes instead (:func:`fallback_format`), ``"bf16"`` where
    that is F16 (no ggml type holds the row; bf16 is microscale's unquantized format). A
    format with a JAX quantizer is returned as it is (its own checks apply)."""
    spec = get_weight_format(fmt)
    if not weight_only(spec):
        return fmt
    stored = fallback_format(spec, n_per_row)
    return "bf16" if stored == "f16" else stored


def row_sigma2(x) -> np.ndarray:
    """The mean of ``x^2`` over each row of ``x [rows, n]`` as ggml sums it (float32, element
    by element): what Q4_0 .. Q5_1's importance weights add (``quantize_ggml``'s sigma2)."""
    rows = np.asarray(x, F32)
    return _div(_seqsum(np.ascontiguousarray((rows * rows).T)), rows.shape[-1])


def quantize_ggml(x, fmt: str | FormatSpec, imatrix=None, *, sigma2=None) -> np.ndarray:
    """ggml's bytes for ``x`` ``[..., n_per_row]`` (float32; rows of whole blocks):
    ``[..., row_bytes]`` uint8, what ``ggml_quantize_chunk`` writes. ``imatrix``: one
    importance weight per column (llama.cpp's imatrix), as ggml takes it. ``sigma2``: one
    float per row, the mean of ``x^2`` that Q4_0 .. Q5_1's importance weights add (default:
    over the row itself, :func:`row_sigma2`, as ggml; GPTQ encodes a block of a longer row
    and passes that row's); only those types with an imatrix read it."""
    spec = get_ggml_format(fmt)
    x = _float_rows(x, spec, "quantize_ggml")
    n_per_row = x.shape[-1]
    rb = row_bytes(spec, n_per_row)
    rows = x.reshape(-1, n_per_row)
    P = _block_elems(spec)
    qw = _check_imatrix(imatrix, spec, n_per_row, "quantize_ggml")
    sig = None
    if spec.ggml_codec == "q8":
        qw = None  # ggml's Q8_0 has no weighted encoder
    if qw is not None and spec.ggml_codec in ("sym", "asym"):  # mean of x^2 over the row
        sig = row_sigma2(rows)
        if sigma2 is not None:
            given = np.asarray(sigma2, F32).reshape(-1)
            if given.shape != sig.shape or not np.all(np.isfinite(given) & (given >= 0)):
                raise ValueError(
                    f"quantize_ggml({spec.name}): sigma2 of shape {np.shape(sigma2)}: "
                    f"expected one finite value >= 0 per row ({sig.shape[0]} rows)"
                )
            sig = given
    blocks = rows.reshape(-1, P)
    per_row = n_per_row // P
    enc = _ENCODERS[spec.ggml_codec]  # type: ignore[index]
    assert spec.block_bytes is not None
    out = np.empty((blocks.shape[0], spec.block_bytes), np.uint8)
    for s in range(0, blocks.shape[0], _CHUNK):
        e = min(s + _CHUNK, blocks.shape[0])
        g = np.arange(s, e)
        w = None if qw is None else qw.reshape(per_row, P)[g % per_row]
        sg = None if sig is None else sig[g // per_row]
        out[s:e] = enc(spec, blocks[s:e], w, sg)
    return out.reshape(*x.shape[:-1], rb)


# ---------------------------------------------------------------- grids and codes
# Every type decodes as ``scale * levels[code] + offset``: ``levels`` one ascending table
# per type (below), ``scale`` and ``offset`` each element's decoded block scale and minimum
# (float32, ggml's products: ``d * sc``, ``dmin * m``), ``code`` the stored bits as an index
# into ``levels``. Table (``z = 2^(b-1)``):
#
# ========================= =================== =========================================
# type                      levels              scale / offset
# ========================= =================== =========================================
# q8_0                      -128 .. 127         d (code = int8 + 128)
# q4_0, q5_0                -z .. z - 1         d
# q4_1, q5_1                0 .. 2^b - 1        d / m
# q2_k, q4_k, q5_k          0 .. 2^b - 1        d * sc / -(dmin * m), per 16 or 32
# q3_k                      -4 .. 3             d * (sc - 32), per 16 (code = low 2 bits +
#                                               4 * hmask bit)
# q6_k                      -32 .. 31           d * sc, per 16
# iq4_nl, iq4_xs            kvalues_iq4nl       d; d * (sc - 32), per 32
# ========================= =================== =========================================
#
# ``x + (-y) == x - y`` in IEEE arithmetic, so the negated minimum decodes as ggml's
# ``d * sc * q - dmin * m``. The codes occupy one contiguous byte span of each block
# (``_code_span``): ``with_codes`` rewrites only that span.


def _levels(spec: FormatSpec) -> np.ndarray:
    """The type's ascending level table (float32), indexed by code."""
    if spec.elem_values is not None:
        return np.asarray(spec.elem_values, F32)
    n = 1 << spec.elem_bits
    zero = 0 if spec.has_block_min or spec.ggml_codec == "k_asym" else n // 2
    return (np.arange(n) - zero).astype(F32)


def _code_span(spec: FormatSpec) -> tuple[int, int]:
    """The bytes ``[start, stop)`` of a block that hold its codes."""
    assert spec.block_bytes is not None
    kind, end = spec.ggml_codec, spec.block_bytes
    if kind == "q8":
        return 2, end
    if spec.super_block is None:  # q4_0 .. q5_1, iq4_nl: after d (and m)
        return (4 if spec.has_block_min else 2), end
    if kind == "iq4":
        return 8, end
    if kind == "k_asym":
        return (16, 80) if spec.sub_scale_bits == 4 else (16, end)
    return (0, 192) if spec.sub_scale_bits == 8 else (0, 96)


_SHIFT2 = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]


def _nib(q: np.ndarray) -> np.ndarray:
    """[B, 16k] bytes -> [B, 32k] codes (the inverse of ``_nibbles``)."""
    q = q.reshape(q.shape[0], -1, 1, 16)
    return np.concatenate([q & 0xF, q >> 4], 2).reshape(q.shape[0], -1).astype(np.int32)


def _uncrumbs(q: np.ndarray) -> np.ndarray:
    """[B, 64] bytes -> [B, 256] 2-bit codes (the inverse of ``_crumbs``)."""
    return ((q.reshape(q.shape[0], 2, 1, 32) >> _SHIFT2) & 3).reshape(q.shape[0], 256)


def _pack_codes(spec: FormatSpec, L: np.ndarray) -> np.ndarray:
    """Codes [B, P] (indices into ``_levels``) -> the bytes of ``_code_span`` [B, n]."""
    kind, B = spec.ggml_codec, L.shape[0]
    if kind == "q8":
        return (L - 128).astype(np.int8).view(np.uint8)
    if spec.super_block is None or kind == "iq4":  # q4_0 .. q5_1, iq4_nl, iq4_xs
        lo = _nibbles(L & 0xF)
        return np.concatenate([_high_bits(L, 4), lo], 1) if spec.elem_bits == 5 else lo
    if kind == "k_asym" and spec.sub_scale_bits == 4:  # q2_k
        return _crumbs(L & 3)
    if kind == "k_asym":  # q4_k, q5_k: per 64, code j low nibble, j + 32 high
        Lq = L.reshape(B, 4, 2, 32)
        lo = (Lq & 0xF).astype(np.uint8)
        parts = [(lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(B, 128)]
        if spec.elem_bits == 5:  # bit 4 of element 32 i + j in bit i of byte j
            hb = (Lq >> 4).astype(np.uint8) << (
                2 * np.arange(4, dtype=np.uint8)[None, :, None, None]
                + np.arange(2, dtype=np.uint8)[None, None, :, None]
            )
            parts.insert(0, hb.reshape(B, 8, 32).sum(1, dtype=np.uint8))
        return np.concatenate(parts, 1)
    if spec.sub_scale_bits == 8:  # q6_k
        Lq = L.reshape(B, 2, 4, 32)
        lo = (Lq & 0xF).astype(np.uint8)
        ql = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(B, 128)
        hi = (Lq >> 4).astype(np.uint8)
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
        return np.concatenate([ql, qh.reshape(B, 64)], 1)
    hm = (L > 3).reshape(B, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    return np.concatenate([hm.sum(1, dtype=np.uint8), _crumbs(L & 3)], 1)  # q3_k


def _unpack_codes(spec: FormatSpec, b: np.ndarray) -> np.ndarray:
    """Blocks [B, block_bytes] -> their codes [B, P] (int32 indices into ``_levels``)."""
    kind, B = spec.ggml_codec, b.shape[0]
    start, stop = _code_span(spec)
    c = b[:, start:stop]
    if kind == "q8":
        return c.view(np.int8).astype(np.int32) + 128
    if spec.super_block is None or kind == "iq4":
        if spec.elem_bits != 5:
            return _nib(c)
        v = np.ascontiguousarray(c[:, :4]).view("<u4").reshape(B, 1)
        return _nib(c[:, 4:]) | (((v >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)
    if kind == "k_asym" and spec.sub_scale_bits == 4:
        return _uncrumbs(c).astype(np.int32)
    if kind == "k_asym":
        qs = c[:, -128:].reshape(B, 4, 1, 32)
        q = np.concatenate([qs & 0xF, qs >> 4], 2).reshape(B, 8, 32).astype(np.int32)
        if spec.elem_bits == 5:
            hb = c[:, :32].reshape(B, 1, 32) >> np.arange(8, dtype=np.uint8)[None, :, None]
            q = q | ((hb & 1).astype(np.int32) << 4)
        return q.reshape(B, 256)
    if spec.sub_scale_bits == 8:
        ql = c[:, :128].reshape(B, 2, 1, 64)
        ql = np.concatenate([ql & 0xF, ql >> 4], 2).reshape(B, 2, 4, 32)
        qh = c[:, 128:192].reshape(B, 2, 1, 32) >> _SHIFT2
        return (ql | ((qh & 3) << 4)).astype(np.int32).reshape(B, 256)
    hm = c[:, :32].reshape(B, 1, 32) >> np.arange(8, dtype=np.uint8)[None, :, None]
    return _uncrumbs(c[:, 32:96]).astype(np.int32) + 4 * (hm & 1).reshape(B, 256)


def _half(s: np.ndarray) -> np.ndarray:
    """[B, 2] little-endian bytes -> float32 of the float16 [B, 1]."""
    return _h2f(s[:, 0].astype(np.uint16) | (s[:, 1].astype(np.uint16) << 8))[:, None]


def _grid_blocks(spec: FormatSpec, b: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Blocks [B, block_bytes] -> each element's decoded scale and offset [B, P] (the
    offset None for the types without minimums)."""
    kind, B = spec.ggml_codec, b.shape[0]
    P = _block_elems(spec)

    def each(v: np.ndarray) -> np.ndarray:  # [B, S] per sub-block -> [B, P]
        return np.repeat(v, P // v.shape[1], axis=1)

    if spec.super_block is None:  # q8_0, q4_0 .. q5_1, iq4_nl
        d = each(_half(b[:, :2]))
        return d, (each(_half(b[:, 2:4])) if spec.has_block_min else None)
    if kind == "iq4":  # iq4_xs: 6-bit sub-scales, low nibbles in bytes 4-7, high in a u16
        sh = (_half_bits(b[:, 2:4]).reshape(B, 1) >> (2 * np.arange(8, dtype=np.uint16))) & 3
        s4 = b[:, 4:8].reshape(B, 4, 1)
        sl = np.concatenate([s4 & 0xF, s4 >> 4], 2).reshape(B, 8)
        sc = (sl | (sh.astype(np.uint8) << 4)).astype(np.int32) - 32
        return each(_half(b[:, :2]) * sc.astype(F32)), None
    if kind == "k_asym" and spec.sub_scale_bits == 4:  # q2_k
        sc = b[:, :16]
        d, dmin = _half(b[:, 80:82]), _half(b[:, 82:84])
        return each(d * (sc & 0xF).astype(F32)), each(-(dmin * (sc >> 4).astype(F32)))
    if kind == "k_asym":  # q4_k, q5_k
        sc, m = _unpack_k4_scales(b[:, 4:16])
        d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
        return each(d * sc.astype(F32)), each(-(dmin * m.astype(F32)))
    if spec.sub_scale_bits == 8:  # q6_k: int8 sub-scales
        return each(_half(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(F32)), None
    return each(_half(b[:, 108:110]) * _unpack_q3_scales(b[:, 96:108]).astype(F32)), None


def _half_bits(s: np.ndarray) -> np.ndarray:
    return s[:, 0].astype(np.uint16) | (s[:, 1].astype(np.uint16) << 8)


def _on_grid(scale, offset, levels, codes) -> np.ndarray:
    """``scale * levels[codes] + offset`` in float32: the decoded values."""
    v = _f(scale) * levels[codes]
    return v if offset is None else v + _f(offset)


def _dec_blocks(spec: FormatSpec, b: np.ndarray) -> np.ndarray:
    """[B, block_bytes] -> [B, P] float32 (ggml's dequantize_row_*)."""
    scale, offset = _grid_blocks(spec, b)
    return _on_grid(scale, offset, _levels(spec), _unpack_codes(spec, b))


@dataclass(frozen=True)
class GgmlGrid:
    """The values each element of ggml's bytes can take with its blocks' scales fixed:
    ``scale * levels[code] + offset`` (the table above), as :func:`ggml_grid` reads them.
    GPTQ rounds its error-updated columns on it (:func:`~microscale.ptq.gptq.gptq_ggml`)."""

    # [rows, n_per_row] float32: each element's decoded block (or sub-block) scale
    scale: np.ndarray
    # [rows, n_per_row] float32 added after the product (the minimums); None: no minimums
    offset: np.ndarray | None
    # [L] float32, ascending: the level of each code
    levels: np.ndarray

    def values(self, codes, cols=slice(None)) -> np.ndarray:
        """The float32 values of ``codes`` at columns ``cols`` (as ggml decodes them)."""
        off = None if self.offset is None else self.offset[:, cols]
        return _on_grid(self.scale[:, cols], off, self.levels, codes)

    def nearest(self, x, cols=slice(None)) -> np.ndarray:
        """The code of the level nearest each of ``x`` (shaped as ``scale[:, cols]``), by
        the decoded values' distance; a tie goes to the lower code."""
        x = np.asarray(x, np.float64)
        s = self.scale[:, cols].astype(np.float64)
        o = 0.0 if self.offset is None else self.offset[:, cols].astype(np.float64)
        n = len(self.levels)
        with _err():
            # a zero scale decodes every code alike: the lowest code (t below every level)
            t = np.where(s != 0, (x - o) / np.where(s != 0, s, 1.0), -np.inf)
        i = np.searchsorted(self.levels.astype(np.float64), t)
        best = np.zeros(np.shape(t), np.int32)
        gap = np.full(np.shape(t), np.inf)
        for c in (i - 2, i - 1, i, i + 1):  # t's rounding can move the index by one
            c = np.clip(c, 0, n - 1).astype(np.int32)
            e = np.abs(self.values(c, cols).astype(np.float64) - x)
            take = e < gap
            best, gap = np.where(take, c, best), np.where(take, e, gap)
        return best


def ggml_grid(data, fmt: str | FormatSpec, n_per_row: int) -> GgmlGrid:
    """The grid of ggml's bytes ``[..., row_bytes]``: each element's scale and offset
    ``[rows, n_per_row]`` and the type's level table (:class:`GgmlGrid`)."""
    spec = get_ggml_format(fmt)
    b = _blocks(data, spec, n_per_row, "ggml_grid")
    scale, offset = _grid_blocks(spec, b)
    return GgmlGrid(
        scale.reshape(-1, n_per_row),
        None if offset is None else offset.reshape(-1, n_per_row),
        _levels(spec),
    )


def ggml_codes(data, fmt: str | FormatSpec, n_per_row: int) -> np.ndarray:
    """The codes of ggml's bytes: int32 ``[rows, n_per_row]``, indices into the type's
    level table (``ggml_grid(...).values(ggml_codes(...))`` is ``dequantize_ggml``)."""
    spec = get_ggml_format(fmt)
    return _unpack_codes(spec, _blocks(data, spec, n_per_row, "ggml_codes")).reshape(-1, n_per_row)


def ggml_with_codes(data, fmt: str | FormatSpec, codes) -> np.ndarray:
    """ggml's bytes ``[rows, row_bytes]`` with every element's code replaced by ``codes``
    ``[rows, n_per_row]`` (indices into the level table) and the scales kept: the bytes
    ggml's encoder would write had it picked these codes."""
    spec = get_ggml_format(fmt)
    c = np.asarray(codes)
    n = len(_levels(spec))
    if c.ndim != 2 or c.dtype.kind not in "iu" or c.size and (c.min() < 0 or c.max() >= n):
        raise ValueError(
            f"ggml_with_codes({spec.name}): codes of shape {c.shape}, dtype {c.dtype}: "
            f"expected integer codes 0..{n - 1}, [rows, n_per_row]"
        )
    b = _blocks(data, spec, c.shape[1], "ggml_with_codes").copy()
    if b.shape[0] * _block_elems(spec) != c.size:
        raise ValueError(
            f"ggml_with_codes({spec.name}): {b.shape[0]} blocks of bytes for codes of "
            f"shape {c.shape}"
        )
    start, stop = _code_span(spec)
    b[:, start:stop] = _pack_codes(spec, c.reshape(b.shape[0], -1).astype(np.int32))
    return b.reshape(c.shape[0], -1)


def dequantize_ggml(data, fmt: str | FormatSpec, n_per_row: int) -> np.ndarray:
    """ggml's bytes ``[..., row_bytes]`` (or flat) -> float32 ``[rows, n_per_row]``."""
    spec = get_ggml_format(fmt)
    return _dec_blocks(spec, _blocks(data, spec, n_per_row, "dequantize_ggml")).reshape(
        -1, n_per_row
    )


def _blocks(data, spec: FormatSpec, n_per_row: int, who: str) -> np.ndarray:
    """ggml's bytes of whole rows (any shape, or ``bytes``) as blocks [B, block_bytes],
    else a ValueError naming ``who``, what was given and what a row takes."""
    rb = row_bytes(spec, n_per_row)
    assert spec.block_bytes is not None
    if isinstance(data, bytes | bytearray | memoryview):
        data = np.frombuffer(data, np.uint8)
    a = np.asarray(data)
    if a.dtype not in (np.uint8, np.int8):
        raise ValueError(
            f"{who}({spec.name}): data of dtype {a.dtype} (shape {a.shape}): "
            "expected ggml's bytes (uint8)"
        )
    per = (
        f"{spec.name} blocks are {spec.block_bytes} bytes ({_block_elems(spec)} values), "
        f"a row of {n_per_row} values {rb} bytes"
    )
    if (
        a.size % rb
    ):  # (any shape of whole rows is taken: [rows, row bytes], [blocks, block bytes], flat)
        if a.ndim >= 2:
            want = (*a.shape[:-1], rb)
            raise ValueError(
                f"{who}({spec.name}): data of shape {a.shape} ({a.size} bytes) is "
                f"not whole rows: {per}; expected shape {want} ({int(np.prod(want))} bytes)"
            )
        raise ValueError(
            f"{who}({spec.name}): {a.size} bytes are not whole rows: {per}; "
            f"expected a multiple of {rb} bytes (e.g. {max(1, a.size // rb) * rb})"
        )
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1, spec.block_bytes)


# ---------------------------------------------------------------- ggml itself (reference)


def libggml_quantize(x, fmt: str | FormatSpec, imatrix=None, lib: str | None = None) -> np.ndarray:
    """The same bytes from ggml's own ``ggml_quantize_chunk`` in a libggml-base shared
    library (``lib``, else ``$MICROSCALE_LIBGGML``; e.g. the prebuilt one in the npm package
    ``@node-llama-cpp/linux-x64``): the reference the codecs are tested against."""
    spec = get_ggml_format(fmt)
    path = lib or os.environ.get("MICROSCALE_LIBGGML")
    if not path:
        raise RuntimeError("no libggml: set MICROSCALE_LIBGGML=/path/to/libggml-base.so")
    x = np.ascontiguousarray(_float_rows(x, spec, "libggml_quantize"))
    n_per_row = x.shape[-1]
    nrows = x.size // n_per_row
    rb = row_bytes(spec, n_per_row)
    out = np.zeros(nrows * rb, np.uint8)
    qw = _check_imatrix(imatrix, spec, n_per_row, "libggml_quantize")
    qw = None if qw is None else np.ascontiguousarray(qw)
    so = _load(path)
    fp = ctypes.POINTER(ctypes.c_float)
    got = so.ggml_quantize_chunk(
        spec.ggml_type,
        x.ctypes.data_as(fp),
        out.ctypes.data_as(ctypes.c_void_p),
        0,
        nrows,
        n_per_row,
        None if qw is None else qw.ctypes.data_as(fp),
    )
    if got != out.size:
        raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes, expected {out.size}")
    return out.reshape(*x.shape[:-1], rb)


_LIBS: dict[str, ctypes.CDLL] = {}


def _load(path: str) -> ctypes.CDLL:
    if path not in _LIBS:
        so = ctypes.CDLL(path)
        so.ggml_quantize_chunk.restype = ctypes.c_size_t
        so.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_float),
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.POINTER(ctypes.c_float),
        ]
        _LIBS[path] = so
    return _LIBS[path]
