"""Paired perplexity differences between points of ``microscale quantize`` reports.

Each argument is ``REPORT_DIR:POINT`` (a folder holding ``report.json``, a point name of its
``points``: ``bf16``, ``uniform_nvfp4``, ``searched``, ...). The first is the reference; for
every other one, the mean per-batch loss difference to it with its 95% Student-t interval
over the evaluation batches (``microscale.experiments.stats.mean_ci``), shown as a
perplexity ratio, and the fraction of the reference's gap to ``--to`` it closes,
``(ppl_ref - ppl) / (ppl_ref - ppl_to)``. Points of different runs pair when the runs were
evaluated on the same batches (the same model, corpus and ``--eval-batches``); the batch
count is checked.

Run:  python benchmarks/paired_points.py /tmp/r:uniform_nvfp4 /tmp/g:uniform_nvfp4 \\
          /tmp/g:searched --to /tmp/r:bf16
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from microscale.experiments.stats import mean_ci


def load(spec: str) -> tuple[str, dict]:
    folder, _, point = spec.rpartition(":")
    rep = json.loads((Path(folder) / "report.json").read_text())
    if point not in rep["points"]:
        raise SystemExit(f"{spec}: no point {point!r}; the report has {sorted(rep['points'])}")
    p = rep["points"][point]
    if "batch_losses" not in p:
        raise SystemExit(f"{spec}: no per-batch losses (a report of an older microscale)")
    return spec, p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("points", nargs="+", help="REPORT_DIR:POINT; the first is the reference")
    ap.add_argument(
        "--to", default=None, help="REPORT_DIR:POINT the gap is measured to (e.g. bf16)"
    )
    a = ap.parse_args()
    ref_name, ref = load(a.points[0])
    to = load(a.to)[1] if a.to else None
    r = np.asarray(ref["batch_losses"])
    print(f"reference {ref_name}: ppl {ref['val_ppl']:.4f} @ {ref['effective_bits']:.2f} bits")
    print("| point | effective bits | val ppl | vs reference (95% CI) | gap closed |")
    print("|---|---:|---:|---:|---:|")
    for spec in a.points[1:]:
        _, p = load(spec)
        x = np.asarray(p["batch_losses"])
        if x.shape != r.shape:
            raise SystemExit(f"{spec}: {x.size} evaluation batches, the reference {r.size}")
        c = mean_ci(list(x - r))
        lo, hi = c["ci95"] or (math.nan, math.nan)
        pct = [100 * (math.exp(v) - 1) for v in (c["mean"], lo, hi)]
        closed = (
            ""
            if to is None
            else f"{(ref['val_ppl'] - p['val_ppl']) / (ref['val_ppl'] - to['val_ppl']):.0%}"
        )
        print(
            f"| {spec} | {p['effective_bits']:.2f} | {p['val_ppl']:.4f} | "
            f"{pct[0]:+.2f}% [{pct[1]:+.2f}, {pct[2]:+.2f}] | {closed} |"
        )


if __name__ == "__main__":
    main()
