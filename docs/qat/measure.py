"""PTQ vs PTQ + QAT on the QAT test bed, paired over seeds (docs/qat/README.md).

    python docs/qat/measure.py --seeds 0,1,2,3,4 --root runs/qat [--qat-fraction 0.1]

Per seed ``S`` (every stage is skipped when its output exists, so the command resumes):

1. ``microscale train`` the test bed (``TESTBED`` below) with ``seed=S`` -> ``src-S``;
2. ``microscale quantize budget=5.0`` weight-only and ``activations=true`` -> ``q-S-w``, ``q-S-w4a4``:
   val ppl of bf16, uniform NVFP4 and the searched allocation (PTQ alone), on
   ``eval_batches=`` (32) validation batches of 16 x 128 tokens;
3. QAT: ``microscale train init_from=q-S-M rules=q-S-M/precision_rules.json`` for
   ``qat_fraction`` of the test bed's steps (forward-only recipes, straight-through
   gradients; learning rate ``--qat-lr``) -> ``qat-S-M``;
4. ``microscale quantize`` of the QAT run with step 2's flags -> ``qq-S-M``: the QAT model
   with the allocation it trained with (what ``microscale export`` writes for it), on the
   same evaluation batches as step 2: point ``trained``, rounded to nearest as its forward
   pass trained and as export writes it (static input amax under W4A4, as export), and
   point ``trained_ptq``, through step 2's PTQ choices (MSE tensor scale, 4-over-6); under
   W4A4 also rounded to nearest with the per-batch input amax of its forward pass
   (``static_act_scales=false``) -> ``qqm-S-w4a4``;
5. control: the same fine-tune in bf16 (``ft-S``, no rules), then step 2's PTQ search
   (``qf-S-M``) and the round-to-nearest one (``qfm-S-M``): it separates quantization
   awareness from the extra tokens.

Per seed: relative ppl gaps to the source's bf16; the recovered fraction of the searched
allocation's gap, ``(ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_bf16)``, and against the control,
``(ppl_ctrl_PTQ - ppl_QAT) / (ppl_ctrl_PTQ - ppl_ctrl_bf16)`` (QAT deployed as export
writes it, the control with step 2's PTQ choices, quantize's defaults); QAT vs control as
a relative ppl difference. Mean and 95% Student-t interval over seeds (paired: one source
model per seed). Writes ``ROOT/results.json`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# The test bed: a narrow model (d_model 64, ~0.2M linear weights) trained on ~4M tokens,
# 20x its parameters, so that 4-bit rounding costs measurable perplexity.
TESTBED = (
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=192",
    "steps=2000",
    "eval_every=500",
    "tensorboard=false",
)
BUDGET = "5.0"


def sh(*args: str) -> None:
    print("+ microscale " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "microscale", *args], check=True)


def train_source(root: Path, seed: int) -> Path:
    """The test bed of ``seed``: ``root/src-S``, trained unless it exists."""
    src = root / f"src-{seed}"
    if not (src / "summary.json").is_file():
        sh("train", "--config", "tiny", "-q", *TESTBED, f"seed={seed}", f"out={src}", "resume=true")
    return src


def ptq_flags(mode: str, eval_batches: str) -> list[str]:
    """``microscale quantize`` flags of the PTQ-alone runs (``mode``: w or w4a4)."""
    return [
        f"budget={BUDGET}",
        "ptq_effects=false",
        f"pareto_budgets={BUDGET}",
        "-q",
        f"eval_batches={eval_batches}",
    ] + (["activations=true"] if mode == "w4a4" else [])


def ci(xs: list[float]) -> dict:
    """Mean and 95% Student-t interval over seeds (the compare harness's statistics)."""
    from microscale.experiments.stats import mean_ci

    c = mean_ci(xs)
    lo, hi = c["ci95"] or (None, None)
    return {"mean": c["mean"], "n": c["n"], "lo": lo, "hi": hi}


def add_testbed_arguments(ap: argparse.ArgumentParser) -> None:
    """The test bed's shared options: seeds, run root, PTQ modes, evaluation batches."""
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--root", default="runs/qat")
    ap.add_argument("--modes", default="w,w4a4")
    ap.add_argument(
        "--eval-batches",
        default="32",
        help="validation batches of 16 x 128 tokens for every PTQ evaluation",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    add_testbed_arguments(ap)
    ap.add_argument("--qat-fraction", type=float, default=0.1)
    ap.add_argument("--qat-lr", default="3e-4")
    a = ap.parse_args()
    root = Path(a.root)
    steps = int(next(o for o in TESTBED if o.startswith("steps=")).split("=")[1])
    qat_steps = max(1, round(a.qat_fraction * steps))
    rows = []
    seeds, modes = [int(s) for s in a.seeds.split(",")], a.modes.split(",")
    for seed in seeds:
        src = train_source(root, seed)
        for mode in modes:
            flags = ptq_flags(mode, a.eval_batches)
            q, qat, qq = (root / f"{k}-{seed}-{mode}" for k in ("q", "qat", "qq"))
            if not (q / "report.json").is_file():
                sh("quantize", "--model", str(src), "--out", str(q), *flags)
            if not (qat / "summary.json").is_file():
                sh(
                    "train",
                    "--config",
                    "tiny",
                    "-q",
                    *TESTBED,
                    f"seed={seed}",
                    f"steps={qat_steps}",
                    f"eval_every={qat_steps}",
                    "optim.warmup_steps=10",
                    f"optim.lr={a.qat_lr}",
                    f"init_from={q}",
                    f"rules={q / 'precision_rules.json'}",
                    f"out={qat}",
                    "resume=true",
                )
            if not (qq / "report.json").is_file():
                sh("quantize", "--model", str(qat), "--out", str(qq), *flags)
            # control: the same fine-tune in bf16 (more tokens, no quantization awareness)
            ft, qf = root / f"ft-{seed}", root / f"qf-{seed}-{mode}"
            if not (ft / "summary.json").is_file():
                sh(
                    "train",
                    "--config",
                    "tiny",
                    "-q",
                    *TESTBED,
                    f"seed={seed}",
                    f"steps={qat_steps}",
                    f"eval_every={qat_steps}",
                    "optim.warmup_steps=10",
                    f"optim.lr={a.qat_lr}",
                    f"init_from={src}",
                    f"out={ft}",
                    "resume=true",
                )
            if not (qf / "report.json").is_file():
                sh("quantize", "--model", str(ft), "--out", str(qf), *flags)
            # the control rounded to nearest too; under W4A4 also the QAT model with the
            # per-batch input amax its forward pass trained with (export: static amax)
            rtn = flags + ["ptq.mse_scale=false", "ptq.four_over_six=false"]
            extra = {"qfm": (ft, rtn)}
            if mode == "w4a4":
                extra["qqm"] = (qat, rtn + ["static_act_scales=false"])
            for k, (src_dir, f) in extra.items():
                out = root / f"{k}-{seed}-{mode}"
                if not (out / "report.json").is_file():
                    sh("quantize", "--model", str(src_dir), "--out", str(out), *f)
            rows.append(_row(seed, mode, root))
    summary = {}
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        summary[mode] = {k: ci([r[k] for r in rs]) for k in rs[0] if k not in ("seed", "mode")}
    (root / "results.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "summary": summary,
                "qat_steps": qat_steps,
                "eval_batches": int(a.eval_batches),
                "qat_lr": a.qat_lr,
                "ptq": ptq_table(root, seeds, modes),
            },
            indent=2,
        )
    )
    _print(rows, summary)


def _row(seed: int, mode: str, root: Path) -> dict:
    """One seed's numbers (val ppl on the same evaluation batches throughout)."""

    def rep(kind: str) -> dict | None:
        f = root / f"{kind}-{seed}-{mode}" / "report.json"
        return json.loads(f.read_text()) if f.is_file() else None

    src, after, ctrl, ctrl_rtn, dynamic = (rep(k) for k in ("q", "qq", "qf", "qfm", "qqm"))
    if "trained_ptq" not in after["val_ppl"]:
        raise SystemExit(
            f"qq-{seed}-{mode}: no 'trained_ptq' point (made by an older "
            "microscale); delete the folder and rerun"
        )
    p, bf16 = src["val_ppl"], src["val_ppl"]["bf16"]
    # the QAT model with the allocation it trained with, rounded to nearest as it trained
    # and as export writes it (W4A4: static input amax, as export) / with quantize's PTQ
    qat, qat_ptq = after["val_ppl"]["trained"], after["val_ppl"]["trained_ptq"]
    c, c_rtn = ctrl["val_ppl"]["searched"], ctrl_rtn["val_ppl"]["searched"]

    def gap(x: float, ref: float = bf16) -> float:  # relative ppl difference in percent
        return 100 * (x - ref) / ref

    row = {
        "seed": seed,
        "mode": mode,
        "bf16": bf16,
        "ptq_uniform_nvfp4": p["uniform_nvfp4"],
        "ptq_searched": p["searched"],
        "searched_bits": src["effective_bits"],
        "qat_bf16": after["val_ppl"]["bf16"],
        "qat": qat,
        "qat_ptq": qat_ptq,
        # layers whose format a new search on the QAT weights would change
        "realloc_layers": sum(src["layers"][k] != after["layers"][k] for k in src["layers"]),
        # control: bf16 fine-tune of the same length, then the PTQ search (default / RTN)
        "ctrl_bf16": ctrl["val_ppl"]["bf16"],
        "ctrl": c,
        "ctrl_rtn": c_rtn,
        "ptq_gap_uniform_nvfp4": gap(p["uniform_nvfp4"]),
        "ptq_gap_searched": gap(p["searched"]),
        "qat_gap": gap(qat),
        "qat_ptq_gap": gap(qat_ptq),
        "ctrl_gap": gap(c),
        "ctrl_rtn_gap": gap(c_rtn),
        "qat_vs_ctrl": gap(qat, c),
        "qat_ptq_vs_ctrl": gap(qat_ptq, c),
        "qat_vs_ctrl_rtn": gap(qat, c_rtn),
        # own rounding minus quantize's PTQ choices, on the QAT model and on the control
        "qat_rounding": gap(qat, qat_ptq),
        "ctrl_rounding": gap(c_rtn, c),
        # the fraction of the searched PTQ gap to the source's bf16 that QAT closes
        "recovered": (p["searched"] - qat) / (p["searched"] - bf16),
        # ... and the part due to quantization awareness: against the control's own PTQ
        # gap (the control also trains the extra tokens)
        "recovered_vs_ctrl": (c - qat) / (c - ctrl["val_ppl"]["bf16"]),
        # the fraction the control recovers by training alone
        "ctrl_recovered": (p["searched"] - c) / (p["searched"] - bf16),
    }
    if (
        mode == "w4a4" and dynamic is not None
    ):  # W4A4 QAT with the per-batch input amax it trained with
        row["qat_dynamic_gap"] = gap(dynamic["val_ppl"]["trained"])
        row["qat_dynamic_vs_static"] = gap(dynamic["val_ppl"]["trained"], qat)
    return row


def ptq_table(root: Path, seeds: list[int], modes: list[str]) -> dict:
    """PTQ alone on the source models: per allocation, the relative ppl gap to bf16 (percent)
    and effective bits; per paired comparison of the searched allocation, the loss
    difference in nats; each the mean and 95% interval over seeds. Prints markdown."""
    out = {}
    for mode in modes:
        reps = [json.loads((root / f"q-{s}-{mode}" / "report.json").read_text()) for s in seeds]
        labels = [k for k in reps[0]["points"] if not k.startswith("pareto_")]
        table = {
            k: {
                "gap": ci([100 * (r["val_ppl"][k] / r["val_ppl"]["bf16"] - 1) for r in reps]),
                "bits": ci([r["points"][k]["effective_bits"] for r in reps]),
            }
            for k in labels
        }
        paired = {
            k: ci([r["comparisons"][k]["dloss"] for r in reps]) for k in reps[0]["comparisons"]
        }
        if "searched_at_heuristic_bits" in reps[0]["points"]:  # the search at equal bits
            paired["searched_at_heuristic_bits - heuristic"] = ci(
                [
                    r["points"]["searched_at_heuristic_bits"]["val_loss"]
                    - r["points"]["heuristic"]["val_loss"]
                    for r in reps
                ]
            )
        out[mode] = {"points": table, "paired": paired}
        print(f"\nPTQ alone, {mode} ({len(seeds)} source models):\n")
        print("| allocation | effective bits | val ppl vs bf16 (95% CI over seeds) |")
        print("|---|---:|---|")
        for k, v in sorted(table.items(), key=lambda kv: -kv[1]["bits"]["mean"]):
            print(f"| {k} | {v['bits']['mean']:.2f} | {_band(v['gap'], pct=False)} |")
        print()
        for k, c in paired.items():
            band = "no interval" if c["lo"] is None else f"95% CI {c['lo']:+.4f} to {c['hi']:+.4f}"
            print(f"{mode}: {k}: {c['mean']:+.4f} nats ({band}, n={c['n']})")
    return out


def _band(c: dict, pct: bool) -> str:
    f = (lambda v: f"{v:.0%}") if pct else (lambda v: f"{v:+.2f}%")
    if c["lo"] is None:
        return f"{f(c['mean'])} (n={c['n']}, no interval)"
    return f"{f(c['mean'])} (95% CI {f(c['lo'])} to {f(c['hi'])}, n={c['n']})"


def _print(rows: list[dict], summary: dict) -> None:
    print(
        "| seed | mode | bf16 | PTQ nvfp4 | PTQ searched (bits) | QAT | QAT via PTQ | "
        "QAT bf16 | control bf16 | control PTQ | control RTN | re-searched layers |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['mode']} | {r['bf16']:.4f} | {r['ptq_uniform_nvfp4']:.4f} | "
            f"{r['ptq_searched']:.4f} ({r['searched_bits']:.2f}) | {r['qat']:.4f} | "
            f"{r['qat_ptq']:.4f} | {r['qat_bf16']:.4f} | {r['ctrl_bf16']:.4f} | "
            f"{r['ctrl']:.4f} | {r['ctrl_rtn']:.4f} | {r['realloc_layers']} |"
        )
    print()
    for mode, s in summary.items():
        for k, label in (
            ("ptq_gap_uniform_nvfp4", "PTQ uniform NVFP4 vs bf16"),
            ("ptq_gap_searched", "PTQ searched vs bf16"),
            ("qat_gap", "QAT (rounded as trained / exported) vs source bf16"),
            ("qat_ptq_gap", "QAT through quantize's PTQ vs source bf16"),
            ("qat_dynamic_gap", "QAT, per-batch input amax vs source bf16"),
            ("qat_dynamic_vs_static", "QAT, per-batch vs static input amax"),
            ("ctrl_gap", "control (bf16 fine-tune + PTQ) vs source bf16"),
            ("ctrl_rtn_gap", "control + RTN PTQ vs source bf16"),
            ("qat_vs_ctrl", "QAT vs control"),
            ("qat_ptq_vs_ctrl", "QAT through PTQ vs control"),
            ("qat_vs_ctrl_rtn", "QAT vs control, both RTN"),
            ("qat_rounding", "QAT model: RTN vs PTQ choices"),
            ("ctrl_rounding", "control: RTN vs PTQ choices"),
        ):
            if k in s:
                print(f"{mode}: {label}: {_band(s[k], pct=False)}")
        for k, label in (
            ("recovered", "recovered fraction of the PTQ gap"),
            ("ctrl_recovered", "the control's recovered fraction of the PTQ gap"),
            ("recovered_vs_ctrl", "recovered fraction vs the control"),
        ):
            print(f"{mode}: {label}: {_band(s[k], pct=True)}")


if __name__ == "__main__":
    main()
