"""Budgeted precision search on synthetic scores: Llama-shaped models x 5 formats.

Side by side in one run, per model size and budget: microscale's exact dynamic program
("dp"), the same program through scipy.optimize.milp (HiGHS, "milp"), and a greedy
baseline (start everything in the cheapest format, repeatedly upgrade the group with the
best score drop per extra bit while the budget allows) for the quality ratio. Scores
are random (exponential, seeded): the point is solve time and optimality, not accuracy.

Run:  python benchmarks/search.py [--blocks 16,32,80] [--budgets 4.5,4.8,6] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from microscale.formats import get_format
from microscale.ptq import Problem, group_layers, search

FORMATS = ("nvfp4", "mxfp4", "mxfp8", "fp8_e4m3", "bf16")
# Llama-3-8B projection shapes (elements) by module name.
SHAPES = {
    "q": 4096 * 4096,
    "k": 4096 * 1024,
    "v": 4096 * 1024,
    "o": 4096 * 4096,
    "gate": 4096 * 14336,
    "up": 4096 * 14336,
    "down": 14336 * 4096,
}


def problem(n_blocks: int, seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    paths = [f"layers.{i}.attn.{n}_proj" for i in range(n_blocks) for n in "qkvo"]
    paths += [f"layers.{i}.mlp.{n}_proj" for i in range(n_blocks) for n in ("gate", "up", "down")]
    numel = {p: SHAPES[p.split(".")[-1][:-5]] for p in paths}
    # a cheaper format scores worse: scale a per-layer sensitivity by a per-format factor
    factor = {"mxfp4": 2.0, "nvfp4": 1.0, "fp8_e4m3": 0.1, "mxfp8": 0.09, "bf16": 0.0}
    scores = {}
    for p in paths:
        s = float(rng.lognormal(0, 1.5))
        scores[p] = {f: s * factor[f] * float(rng.uniform(0.8, 1.2)) for f in FORMATS}
    return Problem(formats=FORMATS, scores=scores, numel=numel, groups=group_layers(paths))


def greedy(prob: Problem, budget: float) -> float:
    names, members, options = prob.group_options()
    total = prob.total_numel()
    bits = [{f: float(c) for f, c, _ in o} for o in options]
    score = [{f: s for f, _, s in o} for o in options]
    cur = [min(o, key=lambda x: x[1])[0] for o in options]
    used = sum(bits[g][cur[g]] for g in range(len(names)))
    cap = budget * total
    while True:
        best = None
        for g in range(len(names)):
            for f in bits[g]:
                extra = bits[g][f] - bits[g][cur[g]]
                gain = score[g][cur[g]] - score[g][f]
                if extra > 0 and gain > 0 and used + extra <= cap:
                    r = gain / extra
                    if best is None or r > best[0]:
                        best = (r, g, f, extra)
        if best is None:
            return sum(score[g][cur[g]] for g in range(len(names)))
        _, g, f, extra = best
        cur[g], used = f, used + extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="16,32,80")
    ap.add_argument("--budgets", default="4.5,4.8,6.0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bits = {f: get_format(f).bits_per_element for f in FORMATS}
    print(f"formats {bits}")
    print("| layers | budget | dp ms | milp ms | milp/dp time | greedy/optimal score |")
    print("|---:|---:|---:|---:|---:|---:|")
    for nb in (int(x) for x in args.blocks.split(",")):
        prob = problem(nb, args.seed)
        for b in (float(x) for x in args.budgets.split(",")):
            t0 = time.perf_counter()
            dp = search(prob, b, solver="dp")
            t1 = time.perf_counter()
            mi = search(prob, b, solver="milp")
            t2 = time.perf_counter()
            assert abs(dp.total_score - mi.total_score) <= 1e-6 * max(1.0, dp.total_score)
            g = greedy(prob, b)
            print(
                f"| {len(prob.numel)} | {b} | {1e3 * (t1 - t0):.1f} | {1e3 * (t2 - t1):.1f} | "
                f"{(t2 - t1) / (t1 - t0):.1f} | {g / dp.total_score:.4f} |"
            )


if __name__ == "__main__":
    main()
