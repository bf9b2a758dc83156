"""S replicates of a compare run: S sequential ``microscale train`` runs vs one S-seed batch.

    python benchmarks/seeds.py                       # S = 6 and 20, bf16 and nvfp4
    python benchmarks/seeds.py --sizes 6 --recipes nvfp4 --steps 150

Both sides train the compare presets' regime (``experiments/compare_config.py``'s ``REGIME`` on
the ``tiny`` config: the 0.16M-parameter model, the stdlib corpus) for ``--steps`` steps
with the final evaluation, into fresh folders, in this one process, one after the other:

* **sequential**: ``microscale.train.train`` once per seed (what ``seed_batch=1`` does);
* **batched**: ``microscale.experiments.seeds.train_seeds`` on the S configs (one program).

Printed per recipe and S: the wall time of each side (compilation included, as a user
waits for it; the JAX compilation cache is off so that neither side reuses the other's
programs), the training tokens/s of all S runs together (the runs' own ``tokens_per_s``,
compile steps excluded, summed for the sequential side because its runs take turns;
the batch's runs share one clock), and the ratios batched / sequential. Also the load
average before and after (a shared machine moves both sides alike only roughly: run it on
an idle one). Not a test; nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax

from microscale.config import apply_overrides
from microscale.experiments.compare_config import REGIME
from microscale.experiments.seeds import train_seeds
from microscale.train import TrainConfig, train


def _configs(recipe: str, n: int, steps: int, root: Path) -> list[TrainConfig]:
    base = apply_overrides(TrainConfig.tiny(), [*REGIME, f"steps={steps}", f"recipe={recipe}"])
    return [
        apply_overrides(base, {"seed": s, "data.seed": s, "out": str(root / f"{recipe}-s{s}")})
        for s in range(n)
    ]


def _sequential(cfgs: list[TrainConfig]) -> tuple[float, float, list[float]]:
    t0 = time.perf_counter()
    sums = [train(c, progress=False) for c in cfgs]
    wall = time.perf_counter() - t0
    # the runs take turns: together they trained at the harmonic sum of their rates
    busy = sum(s["tokens"] / s["tokens_per_s"] for s in sums)
    return wall, sum(s["tokens"] for s in sums) / busy, [s["final_val_loss"] for s in sums]


def _batched(cfgs: list[TrainConfig]) -> tuple[float, float, list[float]]:
    t0 = time.perf_counter()
    sums = train_seeds(cfgs, progress=False)
    wall = time.perf_counter() - t0
    return wall, sum(s["tokens_per_s"] for s in sums), [s["final_val_loss"] for s in sums]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="6,20", help="comma-separated seed counts S")
    p.add_argument("--recipes", default="bf16,nvfp4")
    p.add_argument("--steps", type=int, default=150, help="steps per run (compare's: 150)")
    args = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, {args.steps} steps per run\n")
    rows = []
    root = Path(tempfile.mkdtemp(prefix="seeds-bench-"))
    try:
        for n in (int(x) for x in args.sizes.split(",")):
            for recipe in args.recipes.split(","):
                cfgs = _configs(recipe, n, args.steps, root / "seq")
                seq = _sequential(cfgs)
                bat = _batched(
                    [dataclasses.replace(c, out=c.out.replace("/seq/", "/bat/")) for c in cfgs]
                )
                same = "yes" if seq[2] == bat[2] else "no"
                rows.append((recipe, n, seq, bat, same))
                print(
                    f"{recipe} S={n}: sequential {seq[0]:.0f} s ({seq[1]:,.0f} tok/s), batched "
                    f"{bat[0]:.0f} s ({bat[1]:,.0f} tok/s): wall x{seq[0] / bat[0]:.2f}, "
                    f"tokens/s x{bat[1] / seq[1]:.2f}; same final val losses: {same}",
                    flush=True,
                )
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(
        "| recipe | S | sequential wall | batched wall | wall ratio | sequential tok/s |"
        " batched tok/s | tok/s ratio | same val losses |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for recipe, n, seq, bat, same in rows:
        print(
            f"| {recipe} | {n} | {seq[0]:.0f} s | {bat[0]:.0f} s | {seq[0] / bat[0]:.2f} | "
            f"{seq[1]:,.0f} | {bat[1]:,.0f} | {bat[1] / seq[1]:.2f} | {same} |"
        )


if __name__ == "__main__":
    main()
