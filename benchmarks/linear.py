"""Forward+backward cost of one quantized linear layer, side by side with bf16 and qwix.

    python benchmarks/linear.py                      # large (2048x4096x4096) + tiny shapes
    python benchmarks/linear.py --shapes 256x256x1024 --reps 5 --recipes nvfp4,bf16

Each entry times ``jax.vjp`` of ``Y = X W`` followed by the pullback of a *random*
cotangent (an argument of the jitted function, so XLA cannot constant-fold the backward
as it would with a ``sum()`` loss). X and W are bfloat16, as a mixed-precision layer
sees them. Reported: median wall and process-CPU seconds over ``--reps`` runs after a
warm-up, and ratios to two baselines from the same run: ``jnp.dot bf16`` (plain autodiff
of a bf16 matmul, bf16 outputs) and microscale's ``bf16`` recipe (same GEMMs with float32
accumulation; faster on XLA:CPU). CPU time is the steadier number on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from _timing import time_wall_cpu  # noqa: E402
from microscale.ops import get_recipe, init_amax_history, make_dot_general  # noqa: E402

DNUMS = (((1,), (0,)), ((), ()))


def _qwix_nvfp4():
    """qwix's NVFP4 quantized-training dot_general: X and W in nvfp4 for fprop, dY in
    nvfp4 (1x16 tiles) for both backward GEMMs. What qwix does not do: no float32 tensor
    scale, no stochastic rounding, no Hadamard transform, and its backward GEMMs take the
    other operand (W in dgrad, X in wgrad) unquantized."""
    try:
        from qwix._src.core import dot_general_qt as dq
    except ImportError:  # pragma: no cover - optional dependency
        return None
    cfg = dq.DotGeneralQtConfig(
        lhs_qtype="nvfp4",
        rhs_qtype="nvfp4",
        tile_size=16,
        dlhs_grad_qtype="nvfp4",
        drhs_grad_qtype="nvfp4",
        dlhs_tile_size=16,
        drhs_tile_size=16,
    )
    return lambda x, w: dq.dot_general_qt(x, w, DNUMS, cfg)


def candidates(recipes: list[str], key):
    out = {"jnp.dot bf16": lambda x, w: jnp.dot(x, w)}
    for name in recipes:
        hist = init_amax_history(name) if get_recipe(name).delayed else None
        dg = make_dot_general(name, key=key, amax_history=hist)
        out[name] = lambda x, w, dg=dg: dg(x, w, DNUMS)
    q = _qwix_nvfp4()
    if q is not None:
        out["qwix nvfp4"] = q
    return out


def time_fwd_bwd(f, x, w, ct, reps: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds) of one jitted fwd+bwd."""

    @jax.jit
    def step(x, w, ct):
        y, pullback = jax.vjp(f, x, w)
        dx, dw = pullback(ct.astype(y.dtype))
        return y, dx, dw

    return time_wall_cpu(step, x, w, ct, repeats=reps, warmup=1)  # warm-up compiles


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shapes",
        default="2048x4096x4096,2048x192x512,2048x512x192",
        help="comma-separated MxKxN (tokens x in x out); default: the large shape and the tiny preset's MLP (16x128 tokens, d_model 192, d_ff 512)",
    )
    p.add_argument("--recipes", default="bf16,fp8,mxfp8,nvfp4")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    key = jax.random.key(0)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {jax.device_count()} device(s)")
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        kx, kw, kc = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
        ct = jax.random.normal(kc, (m, n), jnp.bfloat16)
        print(f"\nM x K x N = {m} x {k} x {n}   (fwd+bwd, median of {args.reps})")
        print(
            f"{'':16s} {'wall s':>8s} {'cpu s':>8s} {'x jnp.dot':>10s} {'x bf16':>8s}"
            f" {'cpu x jnp.dot':>14s} {'cpu x bf16':>11s}"
        )
        rows = {}
        for label, f in candidates(args.recipes.split(","), key).items():
            rows[label] = t, c = time_fwd_bwd(f, x, w, ct, args.reps)
            b0, b1 = rows["jnp.dot bf16"], rows.get("bf16", (t, c))
            print(
                f"{label:16s} {t:8.3f} {c:8.3f} {t / b0[0]:10.2f} {t / b1[0]:8.2f}"
                f" {c / b0[1]:14.2f} {c / b1[1]:11.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
