"""quantize / dequantize for every registry row, and the :class:`QArray` container.

NVFP4 (exactly Transformer Engine's formulas and float32 order; docs/design.md#scales):

    s_enc = 2688 / amax(|x|)            (float32; 1 when amax == 0 or not finite)
    s_dec = 1 / s_enc                   (QArray.global_scale)
    sb    = e4m3_rne(min(block_amax * (s_enc * fp32(1/6)), 448))      (QArray.scales)
    enc   = min(1 / (float(sb) * s_dec), FLT_MAX)                     (zero block -> 0s)
    code  = e2m1_rne(clip(x * enc, -6, 6))                            (QArray.data, packed)
    x^    = e2m1(code) * sb * s_dec

The block scale is written in TE's order on purpose: ``compute_decoding_scaling_factor``
in TE's ``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh`` multiplies the block
amax by ``s_enc * fp4_max_inv`` with ``fp4_max_inv = 1.0f / 6.0f`` a float32 constant.
``block_amax * (s_enc / 6)`` (true division) or ``block_amax / 6 * s_enc`` round
differently in the last float32 bit and move ~0.05% of E4M3 scales one step; the
tests pin TE's order with a numpy reference on 2^20 blocks, near ties included.

``scale_order="jax"`` instead reproduces JAX's reference quantizer
(``jax._src.cudnn.scaled_matmul_stablehlo.quantize``, nvfp4 mode) as XLA compiles it,
given the same global scale. JAX writes ``xs = x / s_dec``, ``sb = amax(|xs|) / 6``,
``y = xs / sb``; XLA's algebraic simplifier turns every division by a broadcast value
into a multiplication by its float32 reciprocal, so what runs is

    r = fl(1 / s_dec);  xs = x * r
    sb = e4m3_rne(min(amax(|xs|) * fp32(1/6), 448))
    code = e2m1_rne(clip(xs * fl(1 / sb), -6, 6))

It applies the global scale first and the block scale last. On continuous random data
it agrees with TE's order in all but ~1 block per million; on data built near rounding
ties, in ~99.4% of blocks (docs/formats.md, tests). Zero elements of an all-zero block stay zero
codes (JAX computes 0 * inf = NaN there); both decode to zeros.

MX (OCP v1.0): one E8M0 power of two per 32 elements (rule: see ``spec.py``), elements
``x / 2^k`` rounded to E2M1 / E4M3 with saturation. FP8 per-tensor (current scaling):
``scale = amax / elem_max``, elements ``clip(x / scale)`` cast with RNE. ggml Q8_0: int8
elements and a float16 scale per 32 (``spec.py`` has the exact rule).

Blocks. ``block_shape`` gives the block extent per dimension, aligned to the trailing
dimensions of ``x`` (``(16, 16)`` on a weight: one scale per 16x16 tile, so ``W`` and
``W^T`` quantize to the same values). Without it, blocks are ``spec.block_size``
long along ``axis`` and 1 elsewhere. The extent along ``axis`` must equal the
format's block size. Scales have the rank of ``x``: dimension ``d`` has
``ceil(shape[d] / block[d])`` entries.

Edge cases (all tested):
* lengths not a multiple of the block: zero-padded internally; ``data``/``scales``
  keep the padded size, ``dequantize`` returns the original shape;
* an all-zero tensor or block quantizes to zero codes with a zero scale (NVFP4
  global scale 1), and dequantizes to exact zeros;
* NaN/Inf in the input is *propagated, never hidden*: for NVFP4 and FP8 the global
  scale becomes NaN so the whole dequantized tensor is NaN; for MX the affected
  block's E8M0 scale is NaN (0xFF), as the OCP spec defines. Under ``jit`` nothing
  can raise on data, so this is the one consistent rule; check
  ``jnp.isfinite(dequantize(q)).all()`` where that matters;
* float32/bfloat16/float16 inputs are computed in float32; integer inputs raise.

The tensor amax is a plain ``jnp.max`` over the whole array, so under ``jit`` with
sharded inputs XLA inserts the cross-device reduction: the global scale is global.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from microscale.formats import elements
from microscale.formats.ggml import dequantize_ggml, quantize_ggml, row_bytes
from microscale.formats.spec import FormatSpec, get_format, get_weight_format, weight_only

FLT_MAX = float(np.finfo(np.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized array: a JAX pytree (``data``, ``scales``, ``global_scale`` are leaves).

    * ``data`` — 4-bit formats: uint8, two codes per byte along ``axis`` (element 2i
      in the low nibble, sign in bit 3); 8-bit formats: the float8 array; bf16: the
      bf16 array.
    * ``scales`` — NVFP4: float8_e4m3fn per block; MX: float8_e8m0fnu per block;
      per-tensor FP8: float32 scalar; bf16: None.
    * ``global_scale`` — NVFP4: float32 scalar in the decode direction (amax/2688);
      otherwise None.
    """

    data: jax.Array
    scales: jax.Array | None
    global_scale: jax.Array | None
    # static metadata
    spec: FormatSpec = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    block_shape: tuple[int, ...] | None = dataclasses.field(metadata=dict(static=True))

    @property
    def format(self) -> str:
        return self.spec.name

    @property
    def nbytes(self) -> int:
        """Bytes held by the leaves (padded storage)."""
        leaves = [x for x in (self.data, self.scales, self.global_scale) if x is not None]
        return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))

    def codes(self) -> jax.Array:
        """Unpacked element codes (4-bit formats) or the element array, padded shape."""
        if self.spec.packed:
            return elements.unpack_nibbles(self.data, self.axis)
        return self.data


def _check_input(x, axis: int) -> tuple[jax.Array, int]:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize expects a floating-point array, got dtype {x.dtype}")
    if x.dtype.itemsize < 2:  # float8 / float4 values (already quantized): exact in float32
        x = x.astype(jnp.float32)
    if x.ndim == 0:
        raise ValueError("quantize expects an array with at least one dimension, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"axis {axis} is out of range for an array of rank {x.ndim} "
            f"(expected {-x.ndim} <= axis < {x.ndim})"
        )
    return x, axis % x.ndim


def _resolve_blocks(spec: FormatSpec, shape, axis: int, block_shape) -> tuple[int, ...] | None:
    if spec.block_size is None:
        if block_shape is not None:
            raise ValueError(
                f"format {spec.name!r} uses one scale per tensor; "
                f"block_shape={block_shape!r} does not apply (expected None)"
            )
        return None
    ndim = len(shape)
    if block_shape is None:
        ones = [1] * ndim
        ones[axis] = spec.block_size
        return tuple(ones)
    bs = tuple(int(b) for b in block_shape)
    if len(bs) > ndim or any(b < 1 for b in bs):
        raise ValueError(
            f"block_shape={block_shape!r} does not fit an array of shape "
            f"{tuple(shape)} (expected at most {ndim} positive extents)"
        )
    blocks = (1,) * (ndim - len(bs)) + bs
    if blocks[axis] != spec.block_size:
        raise ValueError(
            f"block_shape={block_shape!r} has extent {blocks[axis]} along axis "
            f"{axis}; format {spec.name!r} needs {spec.block_size} there"
        )
    return blocks


def _blockify(x: jax.Array, blocks: tuple[int, ...]) -> jax.Array:
    """(d0, d1, ...) -> (d0/b0, b0, d1/b1, b1, ...) (x already padded); a dimension with
    block extent 1 stays whole. Size-1 dimensions would be free in principle, but XLA:CPU
    gives them a layout of their own and copies whole tensors to change it."""
    shp = []
    for d, b in zip(x.shape, blocks, strict=True):
        shp += [d // b, b] if b > 1 else [d]
    return x.reshape(shp)


def _inner_axes(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """Axes of a :func:`_blockify` result that run inside a block."""
    axes, pos = [], 0
    for b in blocks:
        if b > 1:
            axes.append(pos + 1)
        pos += 2 if b > 1 else 1
    return tuple(axes)


def _block_view(scales: jax.Array, blocks: tuple[int, ...]) -> jax.Array:
    """A scale array (one entry per block) shaped to broadcast against :func:`_blockify`."""
    return scales.reshape(
        [d for s, b in zip(scales.shape, blocks, strict=True) for d in ((s, 1) if b > 1 else (s,))]
    )


def _uniform(key, shape, blocks=None, part=()):
    """Uniforms for stochastic rounding of an array of (:func:`_blockify`-ed, with
    ``blocks``) shape ``shape``; the key was checked in :func:`_prepare`.

    ``part`` (``(axis, parts, index)`` triples, distinct axes): the array is slice
    ``index`` of ``parts`` equal slices along each ``axis`` of a larger array (a device's
    shard), and draws the uniforms of that array, sliced. Blockifying keeps the row-major
    order, so the slice of the larger array's samples along the blockified ``axis`` (its
    block-count dimension) is exactly this slice's: the shards round as the whole does.
    Only the slice's samples are drawn (``window``), not the whole array's."""
    whole, starts = list(shape), [0] * len(shape)
    for axis, parts, index in part:
        dim = axis if blocks is None else sum(2 if b > 1 else 1 for b in blocks[:axis])
        whole[dim] *= parts
        starts[dim] = index * shape[dim]
    return elements.uniform_for_rounding(
        key, tuple(whole), (starts, tuple(shape)) if part else None
    )


def _encode(
    x,
    spec: FormatSpec,
    rounding: str,
    key,
    blocks,
    amax,
    scale_rounding,
    four_over_six=False,
    scale_order="te",
    part=(),
):
    """Shared core of quantize / quantize_dequantize (blocks is not None).

    Long: the scale computation of every scale kind (E4M3 in Transformer Engine's or
    JAX's order and with four-over-six, E8M0, float16) in the operation order that makes
    it bit-identical to Transformer Engine; split, that order would span functions.

    Returns ``y`` (the input divided by its block scales, blockified float32, still to
    be rounded to the element format), the uniforms for stochastic rounding (or None),
    the block scales as float32 (blockified, broadcastable against ``y``), the same
    scales in their stored dtype (scale-array shape), the global scale (or None) and
    the padded shape. ``part``: the stochastic-rounding slice (:func:`_uniform`).
    """
    shape = x.shape
    for a, _, _ in part:
        if shape[a] % blocks[a]:
            raise ValueError(
                f"a slice of length {shape[a]} along axis {a} does not hold whole blocks "
                f"of {blocks[a]}: its stochastic rounding cannot be the whole's"
            )
    pads = [(0, -d % b) for d, b in zip(shape, blocks, strict=True)]
    if any(p for _, p in pads):
        x = jnp.pad(x, pads)
    xb_in = _blockify(x, blocks)
    xb = xb_in.astype(jnp.float32)
    xf_shape = x.shape
    inner = _inner_axes(blocks)
    # max|x| per block on the sign-cleared bit patterns (exact; NaN sorts above Inf, so it
    # propagates). A float max/min reduction does not: XLA:CPU's vectorised float reductions
    # drop NaN on arrays past a few thousand elements. The integer max is also the faster.
    bamax = elements.abs_bits_max(xb_in, inner).astype(jnp.float32)
    u = _uniform(key, xb.shape, blocks, part) if rounding == "stochastic" else None

    global_scale = None
    if spec.scale_kind == "e4m3":
        t_amax = tensor_amax(bamax) if amax is None else jnp.asarray(amax, jnp.float32)
        s_enc = jnp.float32(spec.scale_max * spec.elem_max) / t_amax
        s_enc = jnp.where((t_amax == 0) | ~jnp.isfinite(s_enc), jnp.float32(1.0), s_enc)
        s_dec = jnp.float32(1.0) / s_enc
        global_scale = jnp.where(jnp.isfinite(t_amax), s_dec, jnp.float32(jnp.nan))

        def scaled(target):
            # bamax >= 0; the float32 constant 1/target, as TE's fp4_max_inv (module doc).
            inv = jnp.float32(np.float32(1.0) / np.float32(target))
            if scale_order == "te":
                sb = elements.float_round(bamax * (s_enc * inv), spec.scale_dtype, spec.scale_max)
                return sb, _e4m3_divide(xb, sb, s_dec)
            # JAX's reference as compiled (module doc): x * fl(1/s_dec) first, the block
            # scale from its amax (max|x * r| = max|x| * r: rounding is monotone), then
            # x * r * fl(1/sb). Reciprocals of the unbroadcast values, as XLA forms them.
            # The barrier keeps XLA from folding 1 / (1 / s_enc) back into s_enc.
            r = jnp.float32(1.0) / jax.lax.optimization_barrier(s_dec)
            sb = elements.float_round((bamax * r) * inv, spec.scale_dtype, spec.scale_max)
            xs = xb * r
            return sb, jnp.where(xs == 0, xs, xs * (jnp.float32(1.0) / sb))

        sb, y = scaled(spec.elem_max)
        if four_over_six:
            # "4 over 6" (Cook et al. 2025): also try mapping each block's max to 4 (finer
            # steps near the max, at the cost of range), keep whichever decodes closer.
            sb4, y4 = scaled(4.0)

            def err(sb_, y_):
                d = elements.float_round(y_, spec.elem_dtype, spec.elem_max) * sb_ * s_dec - xb
                return jnp.sum(d * d, axis=inner, keepdims=True)

            use4 = err(sb4, y4) < err(sb, y)
            sb, y = jnp.where(use4, sb4, sb), jnp.where(use4, y4, y)
        scales = sb  # float32 holding exact E4M3 values
        stored = sb.astype(spec.scale_dtype)  # exact (small array; DCE'd when unused)
    elif spec.scale_kind == "e8m0":
        if four_over_six:
            raise ValueError(
                f"four_over_six needs E4M3 block scales; format {spec.name!r} "
                f"has scale_kind={spec.scale_kind!r}"
            )
        rule = scale_rounding or spec.scale_rounding
        assert rule is not None  # an e8m0 format has its scale rounding
        byte = elements.e8m0_from_amax(bamax, spec.elem_max, spec.elem_emax, rule)
        y = elements.e8m0_divide(xb, byte)
        scales = elements.e8m0_to_float(byte)
        stored = jax.lax.bitcast_convert_type(byte, spec.scale_dtype)
    elif spec.scale_kind == "f16":
        # ggml Q8_0 (quantize_row_q8_0_ref): d = amax / 127 in float32, elements x * (1/d)
        # (d == 0: zeros), d stored as float16 and decoded from that float16.
        if four_over_six:
            raise ValueError(
                f"four_over_six needs E4M3 block scales; format {spec.name!r} "
                f"has scale_kind={spec.scale_kind!r}"
            )
        d = bamax / jnp.float32(spec.elem_max)
        y = _f16_divide(xb, d)
        stored = d.astype(spec.scale_dtype)
        scales = stored.astype(jnp.float32)
    else:  # pragma: no cover - registry rows are fixed
        raise AssertionError(spec.scale_kind)

    stored = stored.reshape([s for i, s in enumerate(bamax.shape) if i not in inner])
    return y, u, scales, stored, global_scale, xf_shape


def _e4m3_divide(xb, sb, s_dec):
    """``x / (sb * s_dec)`` in Transformer Engine's order: times ``min(1 / (sb * s_dec),
    FLT_MAX)`` (a zero block scale gives zeros)."""
    return xb * jnp.minimum(jnp.float32(1.0) / (sb * s_dec), jnp.float32(FLT_MAX))


def _f16_divide(xb, d):
    """ggml's ``x * (1 / d)`` (``d == 0``: zeros)."""
    return xb * jnp.where(d == 0, jnp.float32(0), jnp.float32(1) / jnp.where(d == 0, 1, d))


SCALE_ORDERS = ("te", "jax")


def _round_elements(y, spec: FormatSpec, rounding: str, u) -> jax.Array:
    """Scaled values -> the element grid (float32): integers (Q8_0) or a float format."""
    if spec.integer:
        return elements.int_round(y, spec.elem_max, rounding, u)
    return elements.float_round(y, spec.elem_dtype, spec.elem_max, rounding, u)


def _prepare(x, fmt, axis, rounding, key, block_shape, scale_order="te"):
    spec = get_format(fmt)
    x, axis = _check_input(x, axis)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"unknown rounding {rounding!r}; expected 'nearest' or 'stochastic'")
    if scale_order not in SCALE_ORDERS:
        raise ValueError(
            f"unknown scale_order {scale_order!r}; expected one of {list(SCALE_ORDERS)}"
        )
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs an explicit key (jax.random.key(...))")
    return spec, x, axis, _resolve_blocks(spec, x.shape, axis, block_shape)


def tensor_amax(x) -> jax.Array:
    """max|x| over the whole array as float32, NaN-propagating (the amax that sets a
    per-tensor scale). Computed on bit patterns (:func:`elements.abs_bits_max`): a float
    max reduction on XLA:CPU drops NaN once it vectorises, hiding a NaN behind a finite scale."""
    x = jnp.asarray(x)
    if jnp.dtype(x.dtype).itemsize not in (2, 4):
        x = x.astype(jnp.float32)
    return elements.abs_bits_max(x, tuple(range(x.ndim))).reshape(()).astype(jnp.float32)


def _tensor_round(x, spec: FormatSpec, rounding: str, key, amax, part=()):
    """Per-tensor scaling: (``x / scale`` rounded to the element grid, float32; ``scale``)."""
    t_amax = tensor_amax(x) if amax is None else jnp.asarray(amax, jnp.float32)
    scale = jnp.where(t_amax == 0, jnp.float32(1.0), t_amax / jnp.float32(spec.elem_max))
    scale = jnp.where(jnp.isfinite(t_amax), scale, jnp.float32(jnp.nan))
    xf = x.astype(jnp.float32)
    u = _uniform(key, xf.shape, None, part) if rounding == "stochastic" else None
    return _tensor_elements(xf, spec, scale, rounding, u), scale


def _tensor_elements(xf, spec: FormatSpec, scale, rounding: str = "nearest", u=None):
    """``xf / scale`` rounded to the element grid (float32): per-tensor formats."""
    return elements.float_round(xf / scale, spec.elem_dtype, spec.elem_max, rounding, u)


def _parts(x, slice_of, slice_index) -> tuple:
    """``(axis, parts, index)`` triples of ``x``'s place in a larger tensor (:func:`_uniform`)."""
    return tuple(
        (a % x.ndim, parts, i) for (a, parts), i in zip(slice_of, slice_index, strict=True)
    )


def _quantize(
    x,
    fmt: str | FormatSpec,
    *,
    axis: int = -1,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    block_shape: tuple[int, ...] | None = None,
    amax: jax.Array | float | None = None,
    scale_rounding: str | None = None,
    four_over_six: bool = False,
    scale_order: str = "te",
    slice_of: tuple[tuple[int, int], ...] = (),
    slice_index: tuple = (),
) -> QArray:
    """Quantize ``x`` to format ``fmt`` with blocks along ``axis``.

    Args:
      x: floating-point array (float32, bfloat16, float16; float8 and float4 values are
        widened to float32, exactly), any rank >= 1.
      fmt: a registry name ("nvfp4", "mxfp4", "mxfp8", "fp8_e4m3", "fp8_e5m2", "bf16")
        or a :class:`FormatSpec`.
      axis: the block (contraction) axis; 4-bit codes are packed along it.
      rounding: "nearest" (round-to-nearest-even) or "stochastic" (needs ``key``).
      key: PRNG key for stochastic rounding; the same key gives the same result.
      block_shape: block extents per trailing dimension, e.g. ``(16, 16)``.
      amax: tensor amax to use instead of ``max|x|`` (NVFP4 and FP8: a shared or
        calibrated tensor scale). Values beyond it saturate.
      scale_rounding: MX scale rule override, "floor" (OCP) or "ceil" (NVIDIA).
      four_over_six: E4M3-scaled formats (NVFP4): per block, map the block max to 4
        instead of 6 when that decodes with a lower squared error (Cook et al. 2025).
        The result is an ordinary NVFP4 tensor; only the choice of scale differs.
      scale_order: E4M3 block scales: "te" (Transformer Engine's float32 order, the
        default) or "jax" (JAX's reference quantizer's order; see the module doc).
        MX and per-tensor formats compute the same either way.
      slice_of, slice_index: ``x`` is one slice of a larger tensor, as in
        :func:`quantize_dequantize`; with ``amax`` set to the larger tensor's, the result
        is exactly that slice of the larger tensor's quantization.
    """
    spec, x, axis, blocks = _prepare(x, fmt, axis, rounding, key, block_shape, scale_order)
    part = _parts(x, slice_of, slice_index)
    shape = tuple(x.shape)
    if not spec.quantized:
        return QArray(x.astype(spec.elem_dtype), None, None, spec, axis, shape, None)
    if blocks is None:  # per-tensor scaling (FP8 current scaling)
        vals, scale = _tensor_round(x, spec, rounding, key, amax, part)
        return QArray(vals.astype(spec.elem_dtype), scale, None, spec, axis, shape, None)
    y, u, scales, stored, global_scale, padded = _encode(
        x, spec, rounding, key, blocks, amax, scale_rounding, four_over_six, scale_order, part
    )
    if spec.packed:
        codes = elements.e2m1_encode(y, rounding, u).reshape(padded)
        data = elements.pack_nibbles(codes, axis)
    else:
        data = _round_elements(y, spec, rounding, u).astype(spec.elem_dtype).reshape(padded)
    return QArray(data, stored, global_scale, spec, axis, shape, blocks)


def _quantize_dequantize(
    x,
    fmt: str | FormatSpec,
    *,
    axis: int = -1,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    block_shape: tuple[int, ...] | None = None,
    amax: jax.Array | float | None = None,
    scale_rounding: str | None = None,
    dtype: Any = jnp.bfloat16,
    with_global_scale: bool = False,
    four_over_six: bool = False,
    scale_order: str = "te",
    slice_of: tuple[tuple[int, int], ...] = (),
    slice_index: tuple = (),
) -> tuple[jax.Array, jax.Array]:
    """Fused ``quantize`` + ``dequantize`` without packing (for emulated GEMMs).

    Returns ``(values, tensor_scale)`` where ``values`` are exactly the dequantized
    elements times their block scales in ``dtype`` (E2M1 x E4M3 and E4M3 x E8M0
    products are exact in bfloat16) and ``tensor_scale`` is the float32 scalar still
    to apply (NVFP4: ``global_scale``; FP8: the per-tensor scale; otherwise 1).
    With ``with_global_scale=True`` it is applied and the returned scale is 1.
    Bit-identical to ``dequantize(quantize(x, ...), dtype, with_global_scale=...)``.

    ``slice_of=((axis, parts), ...)`` with one ``slice_index`` per entry (may be traced,
    e.g. mesh axis indices under ``shard_map``): ``x`` is slice ``index`` of ``parts``
    equal slices along each ``axis`` of a larger tensor, and stochastic rounding draws
    that tensor's uniforms (a slice must hold whole blocks along each ``axis``). With
    ``amax`` set to the larger tensor's, the result is exactly that slice of its result.
    """
    spec, x, axis, blocks = _prepare(x, fmt, axis, rounding, key, block_shape, scale_order)
    part = _parts(x, slice_of, slice_index)
    one = jnp.float32(1.0)
    if not spec.quantized:
        return x.astype(spec.elem_dtype).astype(dtype), one
    if blocks is None:
        vals, scale = _tensor_round(x, spec, rounding, key, amax, part)
        if with_global_scale:
            return (vals * scale).astype(dtype), one
        return vals.astype(dtype), scale
    y, u, scales, stored, global_scale, padded = _encode(
        x, spec, rounding, key, blocks, amax, scale_rounding, four_over_six, scale_order, part
    )
    # Round in the value domain: no codes, no packing, no float8 casts.
    vals = _round_elements(y, spec, rounding, u)
    out = _scale_blocks(
        vals * scales, global_scale if with_global_scale else None, padded, tuple(x.shape)
    )
    gs = one if (global_scale is None or with_global_scale) else global_scale
    return out.astype(dtype), gs


def _requantize_scaled(x, q: QArray):
    """``x`` padded and divided by ``q``'s scales: (``y`` blockified float32, padded shape)."""
    blocks, spec = q.block_shape, q.spec
    assert blocks is not None and q.scales is not None  # a block-scaled QArray
    pads = [(0, -d % b) for d, b in zip(x.shape, blocks, strict=True)]
    if any(p for _, p in pads):
        x = jnp.pad(x, pads)
    xb = _blockify(x, blocks).astype(jnp.float32)
    if spec.scale_kind == "e8m0":
        byte = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
        return elements.e8m0_divide(xb, _block_view(byte, blocks)), x.shape
    sb = _block_view(block_scales_f32(q), blocks)
    return (
        _e4m3_divide(xb, sb, q.global_scale) if spec.scale_kind == "e4m3" else _f16_divide(xb, sb)
    ), x.shape


def requantize_values(x, q: QArray) -> jax.Array:
    """``dequantize(requantize(x, q))`` as float32 without packing codes (traceable; no
    argument checks): the rounding GPTQ's column loop runs once per column."""
    spec, blocks = q.spec, q.block_shape
    x = jnp.asarray(x)
    if not spec.quantized:
        return x.astype(spec.elem_dtype).astype(jnp.float32)
    if blocks is None:
        return _tensor_elements(x.astype(jnp.float32), spec, q.scales) * q.scales
    y, padded = _requantize_scaled(x, q)
    vb = _round_elements(y, spec, "nearest", None)
    if spec.scale_kind == "e8m0":
        vb = vb * _block_view(block_scales_f32(q), blocks)
    else:
        vb = vb * _block_view(block_scales_f32(q), blocks)
    return _scale_blocks(vb, q.global_scale, padded, tuple(x.shape))


def _requantize(x, q: QArray) -> QArray:
    """Quantize ``x`` with the scales of ``q`` (see :func:`requantize`)."""
    spec, blocks = q.spec, q.block_shape
    x, axis = _check_input(x, q.axis)
    if not spec.quantized:
        return QArray(x.astype(spec.elem_dtype), None, None, spec, axis, q.shape, None)
    if blocks is None:
        vals = _tensor_elements(x.astype(jnp.float32), spec, q.scales)
        return QArray(vals.astype(spec.elem_dtype), q.scales, None, spec, axis, q.shape, None)
    y, padded = _requantize_scaled(x, q)
    if spec.packed:
        data = elements.pack_nibbles(elements.e2m1_encode(y).reshape(padded), axis)
    else:
        data = _round_elements(y, spec, "nearest", None).astype(spec.elem_dtype)
        data = data.reshape(padded)
    return QArray(data, q.scales, q.global_scale, spec, axis, q.shape, blocks)


_requantize_jit = jax.jit(_requantize)


def requantize(x, q: QArray) -> QArray:
    """Quantize ``x`` (the shape ``q`` was quantized from) with ``q``'s scales: its block
    scales and tensor scale, round to nearest. Error-compensating PTQ (GPTQ) fixes a block's
    scales once and rounds updated values with them. For a ``q`` from :func:`quantize`
    (scale order "te", nearest) ``requantize(x, quantize(x, ...))`` equals it exactly; values
    beyond a block's range saturate. ggml Q8_0 divides by the stored float16 scale here
    (:func:`quantize` by the float32 one before it is stored), so it may differ in the last
    step there."""
    if not isinstance(q, QArray):
        raise TypeError(f"requantize expects a QArray of scales, got {type(q).__name__}")
    if tuple(jnp.shape(x)) != q.shape:
        raise ValueError(
            f"requantize: x has shape {tuple(jnp.shape(x))}; the scales were "
            f"made for shape {q.shape}"
        )
    return _requantize_jit(x, q)


def block_scales_f32(q: QArray) -> jax.Array:
    """The block scales as float32 (E4M3 value, E8M0 power of two or float16), scale-array
    shape."""
    assert q.scales is not None  # a scaled QArray
    if q.spec.scale_kind == "e8m0":
        return elements.e8m0_to_float(jax.lax.bitcast_convert_type(q.scales, jnp.uint8))
    return q.scales.astype(jnp.float32)


def _scale_blocks(
    out: jax.Array, global_scale, padded: tuple[int, ...], shape: tuple[int, ...]
) -> jax.Array:
    """Scaled values in blockified layout -> float32, original shape (global applied)."""
    if global_scale is not None:
        out = out * global_scale
    out = out.reshape(padded)
    if padded != shape:
        out = out[tuple(slice(0, d) for d in shape)]
    return out


def _decode_blocks(q: QArray, codes: jax.Array, with_global_scale: bool) -> jax.Array:
    """Unpacked codes (padded shape) -> float32 values in the original shape."""
    vals = elements.e2m1_decode(codes) if q.spec.packed else codes.astype(jnp.float32)
    sc = block_scales_f32(q)
    assert q.block_shape is not None  # a block-scaled QArray
    vb = _blockify(vals, q.block_shape) * _block_view(sc, q.block_shape)
    return _scale_blocks(vb, q.global_scale if with_global_scale else None, vals.shape, q.shape)


def _dequantize(
    q: QArray, dtype: Any = jnp.float32, *, with_global_scale: bool = True
) -> jax.Array:
    """Decode a :class:`QArray` back to ``dtype`` with its original shape.

    ``with_global_scale=False`` leaves NVFP4's float32 tensor scale (and FP8's
    per-tensor scale) out: ``E2M1 x E4M3`` products are exact in bfloat16, so a GEMM
    can run on these values and apply ``q.global_scale`` to its float32 output.
    """
    spec = q.spec
    if not spec.quantized:
        return q.data.astype(dtype)
    if weight_only(spec):
        return _decode_ggml(q).astype(dtype)
    if q.block_shape is None:
        vals = q.data.astype(jnp.float32)
        if with_global_scale:
            assert q.scales is not None  # a per-tensor scaled QArray
            vals = vals * q.scales
        return vals.astype(dtype)
    return _decode_blocks(q, q.codes(), with_global_scale).astype(dtype)


def _decode_ggml(q: QArray) -> jax.Array:
    """A ggml QArray's values: ggml's own decoder (numpy, a host callback under jit)."""
    spec, shape = q.spec, q.shape

    def host(data):
        return dequantize_ggml(np.asarray(data), spec, shape[-1]).reshape(shape)

    return jax.pure_callback(host, jax.ShapeDtypeStruct(shape, jnp.float32), q.data)


def ggml_qarray(x, fmt: str | FormatSpec, imatrix=None, *, data=None) -> QArray:
    """``x`` ``[..., K]`` in a weight format along its last axis, as a :class:`QArray`.

    One of ggml's block types (:func:`~microscale.formats.spec.weight_only`): ``data`` holds
    ggml's bytes ``[..., row bytes]`` (uint8), exactly what ``ggml_quantize_chunk`` writes
    with the importance weights ``imatrix`` (one per column, llama.cpp's imatrix; None:
    ggml's plain encoder), and :func:`dequantize` decodes them as ggml does; ``scales`` and
    ``global_scale`` are None (the blocks hold their scales). Any other format:
    :func:`quantize` along the last axis (``imatrix`` is ignored, as ggml's Q8_0 ignores it).
    ``data``: ggml's bytes of ``x`` already encoded another way (GPTQ on the type's grid,
    :func:`~microscale.ptq.gptq.gptq_ggml`), taken as they are in place of the encoder's.
    """
    spec = get_weight_format(fmt)
    if not weight_only(spec):
        return quantize(x, spec, axis=-1)
    a = np.asarray(jax.device_get(x) if isinstance(x, jax.Array) else x, np.float32)
    if data is None:
        data = quantize_ggml(a, spec, imatrix)
    elif np.shape(data) != (*a.shape[:-1], row_bytes(spec, a.shape[-1])):
        raise ValueError(
            f"ggml_qarray({spec.name}): data of shape {np.shape(data)} for x of shape "
            f"{a.shape}: expected {(*a.shape[:-1], row_bytes(spec, a.shape[-1]))}"
        )
    return QArray(jnp.asarray(data), None, None, spec, a.ndim - 1, tuple(a.shape), None)


_STATIC = (
    "fmt",
    "axis",
    "rounding",
    "block_shape",
    "scale_rounding",
    "four_over_six",
    "scale_order",
)
_quantize_jit = jax.jit(_quantize, static_argnames=_STATIC + ("slice_of",))
_quantize_dequantize_jit = jax.jit(
    _quantize_dequantize, static_argnames=_STATIC + ("dtype", "with_global_scale", "slice_of")
)
_dequantize_jit = jax.jit(_dequantize, static_argnames=("dtype", "with_global_scale"))


def check_prng_key(key) -> None:
    """Raise ``TypeError`` naming ``key`` unless it is None or a JAX PRNG key (typed, or
    raw uint32 ``[..., 2]``)."""
    if key is None:
        return
    dt = getattr(key, "dtype", None)
    ok = dt is not None and (
        jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)
        or (dt == jnp.uint32 and tuple(jnp.shape(key)[-1:]) == (2,))
    )
    if not ok:
        raise TypeError(f"key={key!r}: expected a JAX PRNG key (jax.random.key(seed))")


def _check_key_amax(x, key, amax) -> None:
    """Eager checks of the traced arguments (values only when concrete)."""
    if math.prod(jnp.shape(x)) == 0:
        raise ValueError(
            f"quantize got an empty array of shape {tuple(np.shape(x))}: nothing "
            "to quantize (expected at least one element)"
        )
    check_prng_key(key)
    if amax is not None and not isinstance(amax, jax.core.Tracer):
        a = np.asarray(amax, dtype=np.float64) if not isinstance(amax, str) else None
        if a is None or a.ndim != 0:
            raise ValueError(f"amax={amax!r}: expected a scalar max |x| >= 0")
        if not np.isfinite(a):
            raise ValueError(
                f"amax={float(a)}: expected a finite max |x| >= 0 (a NaN or "
                "infinite amax would turn every value into NaN or zero)"
            )
        if a < 0:
            raise ValueError(
                f"amax={float(a)}: expected a max |x| >= 0 (a negative amax "
                "would flip the scale's sign)"
            )


def _check_dtype(dtype) -> jnp.dtype:
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"dtype={dt}: expected a floating-point dtype (dequantized values are not integers)"
        )
    return dt


def _static_args(x, fmt, axis, block_shape, dtype=None):
    """Normalise arguments so they hash (jit static args) and validate eagerly."""
    spec = get_format(fmt)
    if block_shape is not None:
        try:
            block_shape = tuple(int(b) for b in block_shape)
        except TypeError:
            raise ValueError(f"block_shape={block_shape!r} must be a tuple of ints") from None
    if not isinstance(axis, int | np.integer):
        raise TypeError(f"axis must be an int, got {axis!r}")
    dtype = None if dtype is None else _check_dtype(dtype)
    return spec, int(axis), block_shape, dtype


@functools.wraps(_quantize)
def quantize(
    x,
    fmt,
    *,
    axis=-1,
    rounding="nearest",
    key=None,
    block_shape=None,
    amax=None,
    scale_rounding=None,
    four_over_six=False,
    scale_order="te",
    slice_of=(),
    slice_index=(),
) -> QArray:
    spec, axis, block_shape, _ = _static_args(x, fmt, axis, block_shape)
    _check_key_amax(x, key, amax)
    slice_of = _check_slices(x, slice_of, slice_index)
    return _quantize_jit(
        x,
        spec,
        axis=axis,
        rounding=rounding,
        key=key,
        block_shape=block_shape,
        amax=amax,
        scale_rounding=scale_rounding,
        four_over_six=bool(four_over_six),
        scale_order=scale_order,
        slice_of=slice_of,
        slice_index=slice_index,
    )


def _check_slices(x, slice_of, slice_index) -> tuple[tuple[int, int], ...]:
    """``slice_of`` normalised (hashable, axes >= 0); raises on a malformed one."""
    nd = jnp.ndim(x)
    try:
        out = tuple((int(a) % max(nd, 1), int(p)) for a, p in slice_of)
        ok = all(p >= 1 and -nd <= int(a) < nd for a, p in slice_of)
    except (TypeError, ValueError):
        ok = False
    if not ok or len(slice_index) != len(slice_of) or len({a for a, _ in out}) != len(out):
        raise ValueError(
            f"slice_of={slice_of!r}, slice_index={slice_index!r}: expected (axis, parts) "
            f"pairs on distinct axes of x (rank {nd}), parts >= 1, one index each"
        )
    return out


@functools.wraps(_quantize_dequantize)
def quantize_dequantize(
    x,
    fmt,
    *,
    axis=-1,
    rounding="nearest",
    key=None,
    block_shape=None,
    amax=None,
    scale_rounding=None,
    dtype=jnp.bfloat16,
    with_global_scale=False,
    four_over_six=False,
    scale_order="te",
    slice_of=(),
    slice_index=(),
):
    spec, axis, block_shape, dtype = _static_args(x, fmt, axis, block_shape, dtype)
    _check_key_amax(x, key, amax)
    slice_of = _check_slices(x, slice_of, slice_index)
    return _quantize_dequantize_jit(
        x,
        spec,
        axis=axis,
        rounding=rounding,
        key=key,
        block_shape=block_shape,
        amax=amax,
        scale_rounding=scale_rounding,
        dtype=dtype,
        with_global_scale=bool(with_global_scale),
        four_over_six=bool(four_over_six),
        scale_order=scale_order,
        slice_of=slice_of,
        slice_index=slice_index,
    )


@functools.wraps(_dequantize)
def dequantize(q: QArray, dtype=jnp.float32, *, with_global_scale: bool = True) -> jax.Array:
    if not isinstance(q, QArray):
        raise TypeError(f"dequantize expects a QArray, got {type(q).__name__}")
    return _dequantize_jit(q, dtype=_check_dtype(dtype), with_global_scale=bool(with_global_scale))


def fake_quantize(x, fmt: str | FormatSpec, **kwargs) -> jax.Array:
    """``dequantize(quantize(x, fmt, **kwargs))`` in ``x``'s dtype (a plain-jnp reference)."""
    x = jnp.asarray(x)
    return dequantize(quantize(x, fmt, **kwargs), x.dtype)


def storage_bits(spec: FormatSpec | str, shape) -> int:
    """Exact bits a tensor of ``shape`` occupies in ``spec`` (padding and scales included;
    a ggml block type: whole rows of its blocks)."""
    spec = get_weight_format(spec)
    n = math.prod(shape)
    if weight_only(spec):
        return math.prod(shape[:-1]) * row_bytes(spec, int(shape[-1])) * 8
    if not spec.quantized:
        return n * spec.elem_bits
    if spec.block_size is None:
        return n * spec.elem_bits + 32
    padded_last = -(-shape[-1] // spec.block_size) * spec.block_size
    n_pad = math.prod(shape[:-1]) * padded_last
    bits = n_pad * spec.elem_bits + (n_pad // spec.block_size) * spec.scale_bits
    return bits + (32 if spec.has_global_scale else 0)
