"""RTN vs GPTQ vs GPTQ + search on the QAT test bed, weights only and W4A4 (issue #23).

    python docs/ptq/testbed.py --seeds 0,1,2 --root runs/qat

The same table as SmolLM2's in docs/ptq/real-model.md, on the QAT test bed (the narrow
model trained long that docs/qat/README.md describes; ``TESTBED`` in docs/qat/measure.py,
whose source runs ``src-S`` this driver shares and reuses). Per seed ``S`` and mode
(weights only ``w``, ``w4a4``), every stage skipped when its output exists:

1. ``microscale train`` the test bed with ``seed=S`` -> ``src-S`` (as docs/qat/measure.py);
2. ``microscale quantize budget=5.0`` three times, on the same ``eval_batches=`` (32)
   validation batches of 16 x 128 tokens:
   ``r-S-M`` plain round to nearest (``ptq.mse_scale=false ptq.four_over_six=false``),
   ``q-S-M`` quantize's default RTN choices (MSE tensor scale, four over six; the run
   docs/qat/measure.py makes for its PTQ stage) and
   ``g-S-M`` GPTQ with those choices (``ptq.method=gptq``; under W4A4 with each
   format's quantized-input Hessians).

Per seed, each point's val ppl relative to bf16, the fraction of plain-RTN uniform NVFP4's
ppl gap to bf16 it closes, ``(ppl_rtn - ppl) / (ppl_rtn - ppl_bf16)``, and paired loss
differences on the evaluation batches; then the mean and 95% Student-t interval over seeds
(paired: one source model per seed). Writes ``ROOT/ptq_table.json``, prints markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "qat"))
from measure import add_testbed_arguments, ci, ptq_flags, sh, train_source  # noqa: E402  (the test bed's one definition)

# run prefix: (label, extra quantize flags)
RUNS = {
    "r": ("RTN", ["ptq.mse_scale=false", "ptq.four_over_six=false"]),
    "q": ("RTN + MSE scale + four over six", []),
    "g": ("GPTQ + MSE scale + four over six", ["ptq.method=gptq"]),
}
# table rows: (row label, run prefix, point)
ROWS = (
    ("bf16", "r", "bf16"),
    ("uniform NVFP4, RTN", "r", "uniform_nvfp4"),
    ("uniform NVFP4, RTN + MSE scale + four over six", "q", "uniform_nvfp4"),
    ("uniform NVFP4, GPTQ + MSE scale + four over six", "g", "uniform_nvfp4"),
    ("uniform MXFP4, RTN", "r", "uniform_mxfp4"),
    ("uniform MXFP4, GPTQ + MSE scale + four over six", "g", "uniform_mxfp4"),
    ("searched at 5.0 bits, RTN", "r", "searched"),
    ("searched at 5.0 bits, RTN + MSE scale + four over six", "q", "searched"),
    ("searched at 5.0 bits, GPTQ + MSE scale + four over six", "g", "searched"),
)
# paired comparisons (a, b): loss(a) - loss(b) on the same batches
PAIRS = (
    (("g", "uniform_nvfp4"), ("r", "uniform_nvfp4")),
    (("g", "uniform_nvfp4"), ("q", "uniform_nvfp4")),
    (("g", "searched"), ("g", "uniform_nvfp4")),
    (("g", "searched"), ("q", "searched")),
    (("g", "searched"), ("r", "uniform_nvfp4")),
    (("g", "searched"), ("r", "bf16")),
)


def run_seed(root: Path, seed: int, modes: list[str], eval_batches: str) -> None:
    src = train_source(root, seed)
    for mode in modes:
        flags = ptq_flags(mode, eval_batches)
        for prefix, (_, extra) in RUNS.items():
            out = root / f"{prefix}-{seed}-{mode}"
            if not (out / "report.json").is_file():
                sh("quantize", "--model", str(src), "--out", str(out), *flags, *extra)


def _loss(rep: dict, point: str) -> list[float]:
    p = rep["points"][point]
    if "batch_losses" not in p:
        raise SystemExit(
            f"{rep['_dir']}: no per-batch losses (made by an older microscale); "
            "delete the folder and rerun"
        )
    return p["batch_losses"]


def seed_row(root: Path, seed: int, mode: str) -> dict:
    """One seed's numbers: per row the gap to bf16 (percent), the fraction of plain-RTN
    NVFP4's gap closed, effective bits; per pair the mean loss difference (nats)."""
    reps = {}
    for k in RUNS:
        d = root / f"{k}-{seed}-{mode}"
        reps[k] = dict(json.loads((d / "report.json").read_text()), _dir=str(d))
    ppl = {label: reps[k]["points"][pt]["val_ppl"] for label, k, pt in ROWS}
    bf16, rtn = ppl["bf16"], ppl["uniform NVFP4, RTN"]
    row = {
        label: {
            "gap": 100 * (ppl[label] / bf16 - 1),
            "ppl": ppl[label],
            "closed": (rtn - ppl[label]) / (rtn - bf16),
            "bits": reps[k]["points"][pt]["effective_bits"],
        }
        for label, k, pt in ROWS
    }
    pairs, batch_ci = {}, {}
    for (ka, pa), (kb, pb) in PAIRS:
        a, b = _loss(reps[ka], pa), _loss(reps[kb], pb)
        if len(a) != len(b):
            raise SystemExit(
                f"seed {seed} {mode}: {ka}/{pa} and {kb}/{pb} were evaluated on "
                f"{len(a)} and {len(b)} batches; rerun with one --eval-batches"
            )
        name = f"{RUNS[ka][0]} {pa} - {RUNS[kb][0]} {pb}"
        pairs[name] = sum(a) / len(a) - sum(b) / len(b)
        # the same difference with its interval over this seed's evaluation batches
        batch_ci[name] = ci([x - y for x, y in zip(a, b, strict=True)])
    return {"points": row, "pairs": pairs, "pairs_over_batches": batch_ci}


def _band(c: dict, fmt) -> str:
    if c["lo"] is None:
        return f"{fmt(c['mean'])} (n={c['n']})"
    return f"{fmt(c['mean'])} [{fmt(c['lo'])}, {fmt(c['hi'])}]"


def table(root: Path, seeds: list[int], mode: str) -> dict:
    rows = [seed_row(root, s, mode) for s in seeds]
    points = {
        label: {
            k: ci([r["points"][label][k] for r in rows]) for k in ("gap", "closed", "bits", "ppl")
        }
        for label, _, _ in ROWS
    }
    pairs = {k: ci([r["pairs"][k] for r in rows]) for k in rows[0]["pairs"]}
    print(f"\n{mode} ({len(seeds)} seeds; mean [95% CI over seeds]):\n")
    print("| allocation | effective bits | val ppl | vs bf16 | RTN NVFP4 gap closed |")
    print("|---|---:|---:|---:|---:|")
    for label, v in points.items():
        closed = (
            ""
            if label in ("bf16", "uniform NVFP4, RTN")
            else _band(v["closed"], lambda x: f"{x:.0%}")
        )
        print(
            f"| {label} | {v['bits']['mean']:.2f} | {v['ppl']['mean']:.4f} | "
            f"{_band(v['gap'], lambda x: f'{x:+.2f}%')} | {closed} |"
        )
    print()
    for k, c in pairs.items():
        print(f"{mode}: {k}: {_band(c, lambda x: f'{x:+.4f}')} nats")
    for s, r in zip(seeds, rows, strict=True):  # each seed over its evaluation batches
        for k, c in r["pairs_over_batches"].items():
            print(
                f"{mode}, seed {s} (95% CI over batches): {k}: "
                f"{_band(c, lambda x: f'{x:+.4f}')} nats"
            )
    return {"points": points, "pairs": pairs, "per_seed": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_testbed_arguments(ap)
    a = ap.parse_args()
    root = Path(a.root)
    seeds, modes = [int(s) for s in a.seeds.split(",")], a.modes.split(",")
    for seed in seeds:
        run_seed(root, seed, modes, a.eval_batches)
    out = {mode: table(root, seeds, mode) for mode in modes}
    (root / "ptq_table.json").write_text(
        json.dumps({"seeds": seeds, "eval_batches": int(a.eval_batches), "tables": out}, indent=2)
    )


if __name__ == "__main__":
    main()
