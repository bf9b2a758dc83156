"""PTQ vs PTQ + QAT on the QAT test bed, paired over seeds (docs/qat/README.md).

    python docs/qat/measure.py --seeds 0,1,2 --root runs/qat [--qat-fraction 0.1]

Per seed ``S`` (every stage is skipped when its output exists, so the command resumes):

1. ``microscale train`` the test bed (``TESTBED`` below) with ``seed=S`` -> ``src-S``;
2. ``microscale quantize --budget 5.0`` weight-only and ``--w4a4`` -> ``q-S-w``, ``q-S-w4a4``:
   val ppl of bf16, uniform NVFP4 and the searched allocation (PTQ alone);
3. QAT: ``microscale train init_from=q-S-M rules=q-S-M/precision_rules.json`` for
   ``qat_fraction`` of the test bed's steps (forward-only recipes, straight-through
   gradients; learning rate ``--qat-lr``) -> ``qat-S-M``;
4. ``microscale quantize`` of the QAT run with the same flags -> ``qq-S-M``: PTQ of the
   fine-tuned weights (the same PTQ choices and evaluation batches as step 2);
5. control: the same fine-tune in bf16 (``ft-S``, no rules) and its PTQ (``qf-S-M``), which
   separates quantization awareness from the extra tokens.

Recovered fraction of the gap to bf16, per seed: ``(ppl_PTQ - ppl_QAT) / (ppl_PTQ -
ppl_bf16)`` (the source's bf16 ppl), and against the control ``(ppl_ctrl_PTQ - ppl_QAT) /
(ppl_ctrl_PTQ - ppl_ctrl_bf16)``, for the searched allocation and uniform NVFP4. Mean and
95% Student-t interval over seeds (paired: one source model per seed). Writes
``ROOT/results.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# The test bed: a narrow model (d_model 64, ~0.2M linear weights) trained on ~4M tokens,
# 20x its parameters, so that 4-bit rounding costs measurable perplexity.
TESTBED = ("model.d_model=64", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=192",
           "steps=2000", "eval_every=500", "tensorboard=false")
BUDGET = "5.0"


def sh(*args: str) -> None:
    print("+ microscale " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "microscale", *args], check=True)


def ci(xs: list[float]) -> dict:
    """Mean and 95% Student-t interval over seeds (the compare harness's statistics)."""
    from microscale.experiments.stats import mean_ci

    c = mean_ci(xs)
    lo, hi = c["ci95"] or (None, None)
    return {"mean": c["mean"], "n": c["n"], "lo": lo, "hi": hi}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--root", default="runs/qat")
    ap.add_argument("--qat-fraction", type=float, default=0.1)
    ap.add_argument("--qat-lr", default="3e-4")
    ap.add_argument("--modes", default="w,w4a4")
    a = ap.parse_args()
    root = Path(a.root)
    steps = int(next(o for o in TESTBED if o.startswith("steps=")).split("=")[1])
    qat_steps = max(1, round(a.qat_fraction * steps))
    rows = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        src = root / f"src-{seed}"
        if not (src / "summary.json").is_file():
            sh("train", "--config", "tiny", "-q", *TESTBED, f"seed={seed}", f"out={src}",
               "resume=true")
        for mode in a.modes.split(","):
            flags = ["--budget", BUDGET, "--no-ptq-effects", "--pareto-budgets", BUDGET, "-q"]
            flags += ["--w4a4"] if mode == "w4a4" else []
            q, qat, qq = (root / f"{k}-{seed}-{mode}" for k in ("q", "qat", "qq"))
            if not (q / "report.json").is_file():
                sh("quantize", "--checkpoint", str(src), "--out", str(q), *flags)
            if not (qat / "summary.json").is_file():
                sh("train", "--config", "tiny", "-q", *TESTBED, f"seed={seed}",
                   f"steps={qat_steps}", f"eval_every={qat_steps}", "optim.warmup_steps=10",
                   f"optim.lr={a.qat_lr}", f"init_from={q}",
                   f"rules={q / 'precision_rules.json'}", f"out={qat}", "resume=true")
            if not (qq / "report.json").is_file():
                sh("quantize", "--checkpoint", str(qat), "--out", str(qq), *flags)
            # control: the same fine-tune in bf16 (more tokens, no quantization awareness)
            ft, qf = root / f"ft-{seed}", root / f"qf-{seed}-{mode}"
            if not (ft / "summary.json").is_file():
                sh("train", "--config", "tiny", "-q", *TESTBED, f"seed={seed}",
                   f"steps={qat_steps}", f"eval_every={qat_steps}", "optim.warmup_steps=10",
                   f"optim.lr={a.qat_lr}", f"init_from={src}", f"out={ft}", "resume=true")
            if not (qf / "report.json").is_file():
                sh("quantize", "--checkpoint", str(ft), "--out", str(qf), *flags)
            ptq = json.loads((q / "report.json").read_text())["val_ppl"]
            after = json.loads((qq / "report.json").read_text())["val_ppl"]
            ctrl = json.loads((qf / "report.json").read_text())["val_ppl"]
            row = {"seed": seed, "mode": mode, "bf16": ptq["bf16"],
                   "qat_bf16": after["bf16"], "ctrl_bf16": ctrl["bf16"]}
            for k in ("uniform_nvfp4", "searched"):
                row[f"ptq_{k}"], row[f"qat_{k}"] = ptq[k], after[k]
                # PTQ alone: the paired relative ppl gap to the source's bf16, in percent
                row[f"ptq_gap_{k}"] = 100 * (ptq[k] - ptq["bf16"]) / ptq["bf16"]
                row[f"qat_gap_{k}"] = 100 * (after[k] - ptq["bf16"]) / ptq["bf16"]
                row[f"ctrl_{k}"] = ctrl[k]
                row[f"recovered_{k}"] = (ptq[k] - after[k]) / (ptq[k] - ptq["bf16"])
                # against the bf16 fine-tune of the same length: the part that is due to
                # quantization awareness, as a fraction of that model's own PTQ gap
                row[f"recovered_vs_ctrl_{k}"] = (ctrl[k] - after[k]) / (ctrl[k] - ctrl["bf16"])
            rows.append(row)
    summary = {}
    for mode in a.modes.split(","):
        rs = [r for r in rows if r["mode"] == mode]
        summary[mode] = {k: ci([r[k] for r in rs]) for k in rs[0]
                         if k not in ("seed", "mode")}
    (root / "results.json").write_text(json.dumps({"rows": rows, "summary": summary,
                                                   "qat_steps": qat_steps,
                                                   "qat_lr": a.qat_lr}, indent=2))
    print("| seed | mode | bf16 | PTQ nvfp4 | PTQ searched | QAT bf16 | QAT nvfp4 | "
          "QAT searched | recovered (nvfp4) | recovered (searched) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seed']} | {r['mode']} | {r['bf16']:.4f} | {r['ptq_uniform_nvfp4']:.4f} | "
              f"{r['ptq_searched']:.4f} | {r['qat_bf16']:.4f} | {r['qat_uniform_nvfp4']:.4f} | "
              f"{r['qat_searched']:.4f} | {r['recovered_uniform_nvfp4']:.1%} | "
              f"{r['recovered_searched']:.1%} |")
    for mode, s in summary.items():
        for k in ("ptq_gap_uniform_nvfp4", "ptq_gap_searched", "qat_gap_uniform_nvfp4",
                  "qat_gap_searched"):
            c = s[k]
            band = "n=1, no interval" if c["lo"] is None else \
                f"95% CI {c['lo']:+.2f}..{c['hi']:+.2f}, n={c['n']}"
            print(f"{mode} {k}: mean {c['mean']:+.2f}% ({band})")
        for k in ("recovered_uniform_nvfp4", "recovered_searched",
                  "recovered_vs_ctrl_uniform_nvfp4", "recovered_vs_ctrl_searched"):
            c = s[k]
            band = "n=1, no interval" if c["lo"] is None else \
                f"95% CI {c['lo']:.1%}..{c['hi']:.1%}, n={c['n']}"
            print(f"{mode} {k}: mean {c['mean']:.1%} ({band})")


if __name__ == "__main__":
    main()
