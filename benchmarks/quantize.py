"""NVFP4 quantize+pack of a 4096x4096 float32 array under jax.jit on this machine.

Side by side in one run:
  * microscale: codes packed two per byte + E4M3 block scales + FP32 tensor scale;
  * JAX's reference quantizer (jax._src.cudnn.scaled_matmul_stablehlo.quantize, nvfp4
    mode, with the tensor amax computed in the same jit so both do the same work);
  * qwix's nvfp4 quantizer (absmax calibration, tiles of 16) if qwix is installed;
  * one elementwise pass over the array (x * 2): the memory floor.
The peers return unpacked float4 arrays; microscale also packs.

Run:  python benchmarks/quantize.py [--n 4096] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import microscale as ms  # noqa: E402
from _timing import print_table, time_fn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((args.n, args.n)), jnp.float32)

    def ours(x):
        q = ms.quantize(x, "nvfp4")
        return q.data, q.scales, q.global_scale

    rows = [("microscale nvfp4 quantize+pack", time_fn(jax.jit(ours), x, repeats=args.repeats))]

    from jax._src.cudnn import scaled_matmul_stablehlo as ref

    def jax_ref(x):
        gs = jnp.max(jnp.abs(x)) / jnp.float32(2688.0)
        cfg = ref.BlockScaleConfig(
            mode="nvfp4",
            block_size=16,
            data_type=jnp.float4_e2m1fn,
            scale_type=jnp.float8_e4m3fn,
            global_scale=gs,
            infer_only=False,
        )
        return ref.quantize(x, cfg)

    rows.append(
        ("jax reference nvfp4 (unpacked)", time_fn(jax.jit(jax_ref), x, repeats=args.repeats))
    )
    try:
        from qwix._src.core import qarray as qwix_qarray

        how = qwix_qarray.HowToQuantize(qtype="nvfp4", tiled_axes={1: 16})
        rows.append(
            (
                "qwix nvfp4 (unpacked)",
                time_fn(jax.jit(lambda x: qwix_qarray.quantize(x, how)), x, repeats=args.repeats),
            )
        )
    except ImportError:
        print("qwix not installed (pip install qwix): skipping that peer")
    rows.append(
        (
            "elementwise x*2 (memory floor)",
            time_fn(jax.jit(lambda x: x * 2), x, repeats=args.repeats),
        )
    )
    print(
        f"# {args.n}x{args.n} float32, jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{os.cpu_count()} cores"
    )
    print_table(rows, baseline=rows[0][0])
    peers = [ms_ for name, ms_ in rows[1:] if "floor" not in name]
    if peers:
        print(f"\nspeed-up over the faster peer: {min(peers) / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
