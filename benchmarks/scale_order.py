"""How often NVFP4 blocks differ between Transformer Engine's float32 order (microscale's
default) and JAX's reference quantizer.

For each dataset (many tensors, each with its own tensor scale) it counts blocks, E4M3
scales and E2M1 codes that differ from ``ms.quantize(x, "nvfp4")`` for:
  * ``scale_order="jax"`` (JAX's order, microscale's global scale ``1 / s_enc``);
  * JAX's own ``scaled_matmul_stablehlo.quantize`` with ``global_scale = amax / 2688``
    (the global scale a JAX user computes; it differs from ``1 / s_enc`` in the last bit
    for some tensors). Codes of all-zero blocks (JAX: 0 * inf = NaN) are not compared.

Run:  python benchmarks/scale_order.py [--tensors 256]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import microscale as ms


def _quantizer(**kw):
    def one(x):
        q = ms.quantize(x, "nvfp4", **kw)
        return q.codes(), q.scales.view(jnp.uint8)

    return jax.jit(jax.vmap(one))


@jax.jit
def _jax_reference(x):
    from jax._src.cudnn import scaled_matmul_stablehlo as ref

    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 2))
    cfg = ref.BlockScaleConfig(
        mode="nvfp4",
        block_size=16,
        data_type=jnp.float4_e2m1fn,
        scale_type=jnp.float8_e4m3fn,
        global_scale=(amax / 2688.0)[:, None, None, None],
        infer_only=False,
    )
    rq, rs = ref.quantize(x, cfg)
    return jax.lax.bitcast_convert_type(rq, jnp.uint4).astype(jnp.uint8), rs.view(jnp.uint8)


def datasets(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (n, 64, 1024)
    spread = 10.0 ** (rng.uniform(-4, 4, (n, 1, 1)) + rng.uniform(-4, 0, (n, 64, 1)))
    normal = rng.standard_normal(shape, dtype=np.float32)
    heavy = (rng.standard_t(3, shape) * spread).astype(np.float32)
    # Values on a coarse grid (as after an earlier rounding): many exact products.
    grid = (np.round(normal * 8) / 8 * 2.0 ** rng.integers(-8, 8, (n, 1, 1))).astype(np.float32)
    return {
        "normal f32": normal,
        "t(3), 8-decade spread, f32": heavy,
        "t(3), 8-decade spread, bf16": heavy.astype(ml_dtypes.bfloat16),
        "normal bf16": normal.astype(ml_dtypes.bfloat16),
        "1/8 grid x 2^k, f32": grid,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=256)
    args = ap.parse_args()
    te, jax_order = _quantizer(), _quantizer(scale_order="jax")
    print(
        "| data | blocks | scale_order='jax': blocks / scales / codes differing | "
        "JAX reference (gs = amax/2688): blocks / scales / codes |"
    )
    print("|---|---:|---|---|")
    for name, x in datasets(args.tensors).items():
        xj = jnp.asarray(x)
        c0, s0 = (np.asarray(a) for a in te(xj))
        live = np.repeat(s0 != 0, 16, -1) | (x.astype(np.float32) != 0)
        cells = []
        for c, s in ((np.asarray(a) for a in f(xj)) for f in (jax_order, _jax_reference)):
            dc = (c != c0) & live
            db = dc.reshape(-1, 16).any(1) | (s != s0).reshape(-1)
            cells.append(f"{db.sum()} / {np.count_nonzero(s != s0)} / {dc.sum()}")
        print(f"| {name} | {s0.size:,} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
