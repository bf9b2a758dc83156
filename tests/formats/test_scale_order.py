"""NVFP4 block scales in Transformer Engine's exact float32 order, and JAX's order on request.

The reference below is written from TE's ``compute_decoding_scaling_factor``
(``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``): the E4M3 block scale is
``block_amax * (s_enc * fp4_max_inv)`` with ``fp4_max_inv = 1.0f / 6.0f`` (float32),
clipped to 448 and cast with round-to-nearest-even. It uses numpy and ml_dtypes only, no
microscale code. The data is built so that the order of the float32 operations matters:
other orders of the same formula must disagree with it on this data (a power check).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import microscale as ms
from microscale.formats import quantize_dequantize

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
ORDERS = ("te", "s_enc/6", "amax/6*s_enc", "jax")


def nvfp4_reference(x: np.ndarray, order: str = "te"):
    """NVFP4 of each tensor ``x[t]`` (float32 values; blocks of 16 along the last axis).

    Returns (codes uint8 [T, ..., C], scale bytes uint8 [T, ..., C/16], s_dec [T]).
    ``order`` picks how the block scale is evaluated in float32:
      "te":           block_amax * (s_enc * fl(1/6))      Transformer Engine
      "s_enc/6":      block_amax * (s_enc / 6)
      "amax/6*s_enc": block_amax / 6 * s_enc
      "jax":          JAX's reference as XLA compiles it (each division by a
                      broadcast value becomes a multiplication by its reciprocal):
                      xs = x * fl(1/s_dec), sb = max|xs| * fl(1/6),
                      y = xs * fl(1/sb) (0 stays 0)
    """
    x = np.asarray(x, F32)
    t = x.shape[0]
    tail = (1,) * (x.ndim - 1)
    amax = np.abs(x).reshape(t, -1).max(1).reshape((t,) + tail + (1,))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s_enc = F32(448.0 * 6.0) / amax
        s_enc = np.where((amax == 0) | ~np.isfinite(s_enc), F32(1.0), s_enc).astype(F32)
        s_dec = (F32(1.0) / s_enc).astype(F32)
        xb = x.reshape(x.shape[:-1] + (-1, 16))
        bamax = np.abs(xb).max(-1, keepdims=True)
        inv6 = F32(1.0) / F32(6.0)
        if order == "te":
            p = bamax * (s_enc * inv6)
        elif order == "s_enc/6":
            p = bamax * (s_enc / F32(6.0))
        elif order == "amax/6*s_enc":
            p = bamax / F32(6.0) * s_enc
        elif order == "jax":
            xs = xb * (F32(1.0) / s_dec)
            p = np.abs(xs).max(-1, keepdims=True) * inv6
        else:
            raise ValueError(order)
        sb = np.minimum(p, F32(448.0)).astype(E4M3)
        sbf = sb.astype(F32)
        if order == "jax":
            y = np.where(xs == 0, xs, xs * (F32(1.0) / sbf))
        else:
            enc = np.minimum(F32(1.0) / (sbf * s_dec), np.finfo(F32).max)
            y = xb * enc
        codes = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return codes.reshape(x.shape), sb[..., 0].view(np.uint8), s_dec.reshape(t)


# E4M3 midpoints between consecutive positive finite values (subnormals included) and
# E2M1 rounding midpoints: where the last float32 bit decides the rounding.
_E4M3_POS = np.arange(0, 127, dtype=np.uint8).view(E4M3).astype(np.float64)
E4M3_MIDPOINTS = (_E4M3_POS[:-1] + _E4M3_POS[1:]) / 2
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _ulps(v: np.ndarray, k: np.ndarray) -> np.ndarray:
    """float32 ``v`` moved ``k`` ulps (k may be negative), elementwise."""
    bits = v.astype(F32).view(np.int32).astype(np.int64) + k
    return bits.astype(np.int32).view(F32)


def random_f32_tensors(n_tensors=256, rows=64, cols=1024, seed=0):
    """``n_tensors`` tensors of 64x1024 (4096 blocks each; 2^20 blocks for 256).

    Tensor amax spread over 10 decades, block amax within a tensor over 6 more (down to
    underflowing E4M3 scales), normal and heavy-tailed elements, all-zero blocks, and in
    one block of 8 a near tie: the block amax is within 3 float32 ulps of mapping onto an
    E4M3 midpoint, and its other elements within 3 ulps of E2M1 midpoints.
    """
    rng = np.random.default_rng(seed)
    nb = cols // 16
    blocks = (n_tensors, rows, nb)
    mag = 10.0 ** (rng.uniform(-5, 5, (n_tensors, 1, 1)) + rng.uniform(-6, 0, blocks))
    heavy = rng.random(blocks) < 0.3  # normal / uniform: a heavy tail
    mag = np.where(heavy, mag * 0.05, mag).astype(F32)[..., None]
    x = rng.standard_normal(blocks + (16,), dtype=F32) * mag
    x[heavy] /= rng.random((int(heavy.sum()), 16), dtype=F32) + F32(0.05)
    x[rng.random(blocks) < 0.01] = 0.0
    # Near ties, from the tensor's s_enc (unchanged: tie blocks stay below the amax).
    amax = np.abs(x).reshape(n_tensors, -1).max(1).astype(np.float64)
    s_enc = (F32(2688.0) / amax.astype(F32)).astype(F32)
    prod = (s_enc * (F32(1.0) / F32(6.0))).astype(np.float64)
    tie = rng.random(blocks) < 0.125
    n = int(tie.sum())
    tensor = np.broadcast_to(np.arange(n_tensors)[:, None, None], blocks)[tie]
    m = rng.choice(E4M3_MIDPOINTS, size=n)
    b = _ulps((m / prod[tensor]).astype(F32), rng.integers(-3, 4, n))
    unit = m / 448.0 * amax[tensor] / 6.0  # ~ block scale * s_dec
    t = rng.choice(E2M1_MIDPOINTS, size=(n, 16)) * rng.choice([-1.0, 1.0], size=(n, 16))
    e = _ulps((t * unit[:, None]).astype(F32), rng.integers(-3, 4, (n, 16)))
    e = np.where(np.abs(e) < b[:, None], e, F32(0.0))
    e[:, 0] = b * rng.choice([-1.0, 1.0], size=n)
    x[tie] = e
    return x.reshape(n_tensors, rows, cols)


def random_bf16_tensors(n_tensors=256, rows=64, cols=1024, seed=1):
    """bfloat16-valued tensors, same spreads; in half of them the tensor amax is
    ``a = 448 * 2^e`` and one block in 8 has block amax ``m * 2^e`` for an E4M3 midpoint
    ``m`` (bf16-exact), so ``block_amax * s_enc / 6`` lands on a rounding tie (or within
    an ulp of one, depending on the order of the float32 operations)."""
    rng = np.random.default_rng(seed + 100)
    nb = cols // 16
    xb = random_f32_tensors(n_tensors, rows, cols, seed).reshape(n_tensors, rows, nb, 16)
    for t in np.flatnonzero(rng.random(n_tensors) < 0.5):
        scale = 2.0 ** int(rng.integers(-20, 20))
        xb[t] *= F32(0.5 * 448.0 * scale / np.abs(xb[t]).max())
        tie = rng.random((rows, nb)) < 0.125
        m = rng.choice(E4M3_MIDPOINTS, size=int(tie.sum())) * scale
        blk = rng.uniform(-0.99, 0.99, (len(m), 16)) * m[:, None]
        blk[:, 0] = m * rng.choice([-1.0, 1.0], size=len(m))
        xb[t][tie] = blk
        xb[t, 0, 0, 0] = 448.0 * scale  # the tensor amax
    return xb.reshape(n_tensors, rows, cols).astype(ml_dtypes.bfloat16)


def _quantizer(**kw):
    def one(x):
        q = ms.quantize(x, "nvfp4", **kw)
        return q.codes(), q.scales.view(jnp.uint8), q.global_scale

    return jax.jit(jax.vmap(one))  # one tensor scale per x[t]


_te, _jax_order = _quantizer(), _quantizer(scale_order="jax")


def _ours(x, f=_te):
    return tuple(np.asarray(a) for a in f(jnp.asarray(x)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "make", [random_f32_tensors, random_bf16_tensors], ids=["float32", "bfloat16"]
)
def test_nvfp4_equals_te_order_on_a_million_blocks(make):
    x = make()
    assert x.size // 16 >= 1_000_000
    codes, scales, s_dec = _ours(x)
    x32 = x.astype(F32)
    r_codes, r_scales, r_dec = nvfp4_reference(x32, "te")
    assert np.count_nonzero(scales != r_scales) == 0
    assert np.count_nonzero(codes != r_codes) == 0
    np.testing.assert_array_equal(s_dec, r_dec)
    # The data spans >= 8 decades of block amax and has live, subnormal and zero scales.
    bamax = np.abs(x32).reshape(-1, 16).max(1)
    assert np.log10(bamax[bamax > 0].max() / bamax[bamax > 0].min()) >= 8
    sc = r_scales.view(E4M3).astype(F32)
    assert (sc == 0).mean() > 0.005 and (sc >= 2.0**-6).mean() > 0.5
    assert ((sc > 0) & (sc < 2.0**-6)).any()
    if make is random_f32_tensors:
        # Power: each other order of the same formula moves some scales on this data.
        for order in ORDERS[1:]:
            assert np.count_nonzero(nvfp4_reference(x32[:64], order)[1] != r_scales[:64]) > 0


@jax.jit
def _jax_reference(x, s_dec):
    """JAX's reference quantizer, jitted, one global scale per tensor ``x[t]``."""
    from jax._src.cudnn import scaled_matmul_stablehlo as ref

    cfg = ref.BlockScaleConfig(
        mode="nvfp4",
        block_size=16,
        data_type=jnp.float4_e2m1fn,
        scale_type=jnp.float8_e4m3fn,
        global_scale=s_dec[:, None, None, None],
        infer_only=False,
    )
    rq, rs = ref.quantize(x, cfg)
    return jax.lax.bitcast_convert_type(rq, jnp.uint4).astype(jnp.uint8), rs.view(jnp.uint8)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make", [random_f32_tensors, random_bf16_tensors], ids=["float32", "bfloat16"]
)
def test_scale_order_jax_bit_identical_to_jax_reference(make):
    x = make(60, 64, 256, seed=11)  # 61,440 blocks, near ties included
    x[:, 5, 16:48] = 0  # all-zero blocks: JAX divides 0 by a 0 scale there
    codes, scales, s_dec = _ours(x, _jax_order)
    r_codes, r_scales = (np.asarray(a) for a in _jax_reference(jnp.asarray(x), s_dec))
    np.testing.assert_array_equal(scales, r_scales)
    live = np.repeat(scales != 0, 16, axis=-1) | (x.astype(F32) != 0)
    assert (~live).sum() >= 60 * 32
    np.testing.assert_array_equal(codes[live], r_codes[live])
    # The independent numpy model of JAX's order agrees everywhere.
    n_codes, n_scales, _ = nvfp4_reference(x.astype(F32), "jax")
    np.testing.assert_array_equal(scales, n_scales)
    np.testing.assert_array_equal(codes, n_codes)
    # The default (TE's order) is a different computation: on this data some blocks differ.
    te_codes, te_scales, _ = _ours(x)
    assert np.count_nonzero(te_scales != scales) > 0
    assert np.count_nonzero(te_codes != codes) > 0
    # quantize_dequantize follows the same order.
    vals, gs = jax.vmap(
        lambda t: quantize_dequantize(t, "nvfp4", scale_order="jax", dtype=jnp.float32)
    )(jnp.asarray(x))
    deq = jax.vmap(lambda t: ms.dequantize(ms.quantize(t, "nvfp4", scale_order="jax")))(
        jnp.asarray(x)
    )
    np.testing.assert_array_equal(np.asarray(vals * gs[:, None, None]), np.asarray(deq))


def test_scale_order_is_validated():
    with pytest.raises(ValueError, match="unknown scale_order 'cuda'"):
        ms.quantize(jnp.ones((2, 16)), "nvfp4", scale_order="cuda")
