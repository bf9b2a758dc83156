"""What one quantized GEMM costs XLA to compile: optimized HLO size and compile seconds.

For each recipe, ``qdot(x, w, recipe)`` and its VJP on an incoming gradient ``dy`` (the
forward GEMM and both backward GEMMs, every operand quantized as the recipe says; ``dy``
is an argument, so XLA cannot fold its quantization into a constant as it does for the
gradient of ``sum(y)``); ``x [4, 32, 64]``, ``w [64, 128]``, ``dy [4, 32, 128]``, float32.
With ``--model``, instead the loss and gradient of the 2-layer model of
tests/train/test_loss_chunk.py with every linear layer in the recipe.

It prints the lines of the optimized HLO module, its fusions (kernels), and the least
seconds over ``--repeats`` fresh ``jit`` objects (each traced and compiled anew, no
cache) of ``lower(...)`` (tracing and lowering: Python) and of ``.compile()`` (XLA), with
the load average before and after. The test suite's time is mostly such compiles
(benchmarks/timings.md, "Test suite").

Run:  python benchmarks/compile_cost.py [--recipes bf16,nvfp4] [--repeats 7] [--model] [--dump DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import time

import jax
import jax.numpy as jnp

import microscale as ms

RECIPES = ("bf16", "fp8", "mxfp8", "nvfp4", "mxfp4")


def _step(recipe: str):
    def fwd_bwd(x, w, dy, key):
        y, vjp = jax.vjp(lambda a, b: ms.qdot(a, b, recipe, key=key), x, w)
        return (y, *vjp(dy))

    return fwd_bwd


def _model_step(recipe: str):
    """``value_and_grad`` of the loss of a 2-layer model (tests/train/test_loss_chunk.py's)
    with every linear layer in ``recipe``, and its arguments."""
    from flax import nnx

    from microscale.model import ModelConfig, PrecisionRules, Transformer
    from microscale.train.step import lm_loss

    cfg = ModelConfig(
        vocab_size=300, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=128,
        max_seq_len=64, dim_multiple=16,
    )  # fmt: skip
    rules = None if recipe == "bf16" else PrecisionRules(default=recipe)
    graph, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), rules=rules), nnx.Param, ...)

    def loss(p, tokens, key):
        return lm_loss(nnx.merge(graph, p, rest), tokens, key)

    tokens = jax.ShapeDtypeStruct((4, 41), jnp.int32)
    return jax.value_and_grad(loss), (params, tokens, jax.random.key(3))


def measure(
    recipe: str, repeats: int, dump: str | None = None, model: bool = False
) -> tuple[int, int, float, float]:
    """(HLO lines, fusions, least trace-and-lower seconds, least compile seconds) of one
    recipe's qdot fwd+bwd (or, with ``model``, of a 2-layer model's loss and gradient)."""
    x = jax.ShapeDtypeStruct((4, 32, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    dy = jax.ShapeDtypeStruct((4, 32, 128), jnp.float32)
    key = jax.random.key(0)
    lowers, times, text = [], [], ""
    for _ in range(repeats):
        # a fresh function each time: traced and compiled again (jit caches by function)
        step, args = _model_step(recipe) if model else (_step(recipe), (x, w, dy, key))
        fn = jax.jit(step)
        t0 = time.perf_counter()
        lowered = fn.lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        times.append(time.perf_counter() - t1)
        lowers.append(t1 - t0)
        text = compiled.as_text()
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{recipe}.hlo.txt"), "w") as f:
            f.write(text)
    fusions = len(re.findall(r"^\s*(?:ROOT )?\S+ = \S+ fusion\(", text, re.M))
    return len(text.splitlines()), fusions, min(lowers), min(times)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dump", default=None, help="write each optimized HLO module here")
    p.add_argument("--model", action="store_true", help="a 2-layer model's loss and gradient")
    args = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load average {_load()}")
    print("| recipe | HLO lines | fusions | trace + lower s | compile s |")
    print("|---|---:|---:|---:|---:|")
    for recipe in args.recipes.split(","):
        lines, fusions, lower, secs = measure(recipe, args.repeats, args.dump, args.model)
        print(f"| {recipe} | {lines} | {fusions} | {lower:.3f} | {secs:.3f} |")
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
