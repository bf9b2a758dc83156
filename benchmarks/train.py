"""Training throughput of whole models: tokens/s per recipe, ratios, and MFU.

    python benchmarks/train.py                         # tiny + small, bf16 / fp8 / nvfp4
    python benchmarks/train.py --presets tiny --recipes bf16,nvfp4,mxfp4 --rounds 5

For each preset and recipe this builds the real training step (``microscale.train``:
sharded float32 master weights, AdamW, the preset's precision rules, quantized GEMMs
through ``microscale.ops``) and times ``--steps`` optimizer steps on random tokens after
two warm-up steps (compilation excluded); the recipes are timed in interleaved rounds
and each keeps its best round, so background load affects them alike. Reported side by
side, in one run:

* tokens/s and the ratio to bf16 of the same preset (target on CPU: nvfp4 >= 0.6x);
* model-FLOPs utilisation: ``tokens/s * flops_per_token / peak``, where
  ``flops_per_token`` is the PaLM 6N + attention count (``ModelConfig.flops_per_token``)
  and ``peak`` is this machine's bf16 matmul rate (float32 accumulation) measured here
  on a large square GEMM (best of several runs) -- the rate a perfectly efficient bf16
  step would reach.

On CPU the low-precision recipes are *emulated* (quantize -> bf16 GEMM), so they can
only be slower than bf16; the ratio measures the emulation overhead, not a speed-up.
``small`` uses a reduced batch (``--small-batch``) to keep the run short.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from microscale.train import TrainConfig, build_state
from microscale.train.mesh import BATCH_AXES
from microscale.train.optim import lr_schedule
from microscale.train.step import make_train_step


def matmul_peak(n: int = 2048, dtype=jnp.bfloat16, reps: int = 10) -> float:
    """FLOP/s of an ``n x n x n`` matmul in ``dtype`` with float32 accumulation."""
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), dtype)
    b = jax.random.normal(k2, (n, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(a, b))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)  # the best run: a peak, not a typical rate


class StepRunner:
    """The compiled training step of one config on a fixed random batch."""

    def __init__(self, cfg: TrainConfig):
        st = build_state(cfg)
        spec = PartitionSpec(None, BATCH_AXES, None)
        self.fn = make_train_step(
            st.graphdefs["main"],
            st.tx,
            lr_schedule(cfg.optim, 1000),
            seed=cfg.seed,
            param_shardings=st.param_shardings,
            opt_shardings=st.opt_shardings,
            batch_sharding=NamedSharding(st.mesh, spec),
        )
        d = cfg.data
        rng = np.random.default_rng(0)
        batch = rng.integers(
            0,
            cfg.model.vocab_size,
            (d.grad_accum, d.batch_size // d.grad_accum, d.seq_len + 1),
            dtype=np.int32,
        )
        self.batch = jax.device_put(batch, NamedSharding(st.mesh, spec))
        self.st, self.params, self.opt, self.i = st, st.params, st.opt_state, 0
        self.run(2)  # compile + warm-up

    def run(self, n: int) -> float:
        """Mean seconds per step over ``n`` steps."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.params, self.opt, m = self.fn(
                self.params, self.opt, self.st.rest, self.batch, jnp.int32(self.i)
            )
            self.i += 1
        jax.block_until_ready((self.params, m))
        return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--recipes", default="bf16,fp8,nvfp4")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and entry")
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved timing rounds; the best round counts"
    )
    ap.add_argument(
        "--small-batch",
        type=int,
        default=4,
        help="sequences per step for the small preset (CPU-friendly)",
    )
    ap.add_argument("--small-seq", type=int, default=256)
    args = ap.parse_args(argv)

    peak = matmul_peak()
    peak32 = matmul_peak(dtype=jnp.float32)
    print(
        f"# microscale train benchmark: {jax.default_backend()} x{jax.device_count()}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__}"
    )
    print(
        f"measured matmul peak: bf16 {peak / 1e9:,.0f} GFLOP/s, "
        f"f32 {peak32 / 1e9:,.0f} GFLOP/s (2048^3)\n"
    )
    print("| preset | recipe | tokens/step | s/step | tokens/s | x bf16 | MFU (bf16 peak) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        base = TrainConfig.preset(preset)
        if preset.strip() == "small":
            base = dataclasses.replace(
                base,
                data=dataclasses.replace(
                    base.data, batch_size=args.small_batch, grad_accum=1, seq_len=args.small_seq
                ),
            )
        tokens = base.tokens_per_step
        fpt = base.model.flops_per_token(base.data.seq_len)
        recipes = [r.strip() for r in args.recipes.split(",")]
        runners = {r: StepRunner(dataclasses.replace(base, recipe=r)) for r in recipes}
        # Interleaved rounds, best round per recipe: background load hits all alike.
        best = {r: float("inf") for r in recipes}
        for _ in range(args.rounds):
            for r in recipes:
                best[r] = min(best[r], runners[r].run(args.steps))
        ref = tokens / best["bf16"] if "bf16" in best else None
        for r in recipes:
            tps = tokens / best[r]
            ratio = f"{tps / ref:.2f}" if ref else "-"
            print(
                f"| {preset} | {r} | {tokens} | {best[r]:.3f} | {tps:,.0f} | {ratio} | "
                f"{100 * tps * fpt / peak:.1f}% |",
                flush=True,
            )
        del runners
    return 0


if __name__ == "__main__":
    sys.exit(main())
