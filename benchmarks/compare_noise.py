"""Noise study for ``microscale compare``: which regime makes the paired NVFP4-vs-BF16 gap
resolvable, and at what cost?

For each setting (``key=value`` overrides of the ``tiny`` preset, on a 0.62M-parameter
model so that three seeds of every setting fit one session of a shared 2-core machine) it
trains bf16 and nvfp4 with the same seeds (a seed fixes initialisation and data order) and
measures

- the seed standard deviation of bf16's final validation loss,
- the seed standard deviation of the paired relative gap (nvfp4 - bf16) / bf16,
- the evaluation's own standard error of that gap (paired over fixed validation batches),
- the CPU time (user + sys) per run,

and from them the 95% CI half-width with n seeds, and the seeds a half-width of 0.5 points
needs. Every setting evaluates the final model on the same 128 x 16 x 128 = 262,144
validation tokens; the derived setting ``*_eval16k`` re-reads the same runs using only the
first 8 batches (16,384 tokens, the old default eval), which isolates the eval's share.

    python benchmarks/compare_noise.py                  # train what is missing, then report
    python benchmarks/compare_noise.py --report-only    # re-read finished runs

Runs go to ``runs/noise/<setting>`` (finished runs are reused), the report to
``docs/compare-noise/`` (``report.md``, ``summary.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODEL = [
    "model.d_model=128",
    "model.d_ff=256",
    "eval_every=0",
    "eval_batches=128",
    "data.eval_batch_size=16",
    "tensorboard=false",
]
# name -> (what it changes, overrides of the tiny preset on top of MODEL)
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "s1_lr3e-3_min0.1": (
        "the old default regime: peak lr 3e-3, cosine to 0.1 x peak",
        ["steps=150", "optim.warmup_steps=15"],
    ),
    "s2_lr1e-3_decay0": (
        "peak lr 1e-3, cosine to 0",
        ["steps=150", "optim.warmup_steps=15", "lr=1e-3", "optim.min_lr_ratio=0"],
    ),
    "s3_lr3e-3_decay0": (
        "peak lr 3e-3, cosine to 0",
        ["steps=150", "optim.warmup_steps=15", "optim.min_lr_ratio=0"],
    ),
    "s4_lr1e-3_decay0_d64": (
        "s2's schedule on a smaller model: d_model 64, d_ff 128",
        [
            "steps=150",
            "optim.warmup_steps=15",
            "lr=1e-3",
            "optim.min_lr_ratio=0",
            "model.d_model=64",
            "model.d_ff=128",
        ],
    ),
}
SHORT_EVAL = 8  # batches of the old default eval (8 x 16 x 128 = 16,384 tokens)
TARGET = 0.5


def _cpu_seconds(run_dir: Path) -> float | None:
    """CPU seconds of one run: ``timings.json`` of its compare, ``time.txt`` of a run
    started by hand (``/usr/bin/time``), or the last sample of ``cpu.log``."""
    t = run_dir / "time.txt"
    w = t.read_text().split() if t.exists() else []
    if "user" in w and "sys" in w:
        return float(w[w.index("user") + 1]) + float(w[w.index("sys") + 1])
    tj = run_dir.parent.parent / "timings.json"
    if tj.exists():
        v = json.loads(tj.read_text()).get(run_dir.name)
        if v:
            return v["cpu_s"]
    return None


def analyse(name: str, desc: str, cfg, n_batches: int | None = None) -> dict:
    from microscale.experiments import stats

    per = {}
    for (run, seed), d in cfg.run_dirs().items():
        p = d / "summary.json"
        if p.exists():
            s = json.loads(p.read_text())
            b = s["final_val_batch_losses"]["val"][:n_batches]
            per.setdefault(run, {})[seed] = {
                "loss": sum(b) / len(b),
                "batches": b,
                "cpu_s": _cpu_seconds(d),
                "params": s["params"],
                "tokens": s["tokens"],
            }
    bf, nv = per.get("bf16", {}), per.get("nvfp4", {})
    gaps = stats.paired_gaps(
        {k: v["loss"] for k, v in nv.items()}, {k: v["loss"] for k, v in bf.items()}
    )
    ci = stats.mean_ci(list(gaps.values()))
    se = [stats.eval_se(nv[s]["batches"], bf[s]["batches"]) for s in gaps]
    b = stats.mean_ci([v["loss"] for v in bf.values()])
    cpu = {
        r: stats.mean_ci([v["cpu_s"] for v in per.get(r, {}).values()])["mean"]
        for r in ("bf16", "nvfp4")
    }
    first = next(iter(bf.values()), {})
    return {
        "setting": name,
        "what": desc,
        "params": first.get("params"),
        "tokens": first.get("tokens"),
        "eval_tokens": len(first.get("batches", [])) * 2048,
        "seeds": sorted(gaps),
        "bf16_loss_mean": b["mean"],
        "bf16_loss_sd": b["sd"],
        "bf16_loss_sd_pct": 100 * b["sd"] / b["mean"] if b["sd"] else None,
        "gap_per_seed": {str(k): v for k, v in gaps.items()},
        "gap_mean": ci["mean"],
        "gap_sd": ci["sd"],
        "gap_ci95": ci["ci95"],
        "gap_half_width": ci["half_width"],
        "eval_se": stats.combined_eval_se(se),
        "eval_se_per_seed": se,
        "seeds_for_0.5": stats.seeds_needed(ci["sd"], TARGET),
        "cpu_s_per_run": cpu,
    }


def render(rows: list[dict]) -> str:
    def f(v, spec=".3f"):
        return "—" if v is None else format(v, spec)

    lines = [
        "# Noise study: can `microscale compare` resolve a 0.5-point gap?",
        "",
        "| setting | params | train tokens | eval tokens | n | bf16 loss (sd, % sd) | "
        "nvfp4-bf16 gap per seed (%) | gap mean ± 95% CI | gap sd | eval SE | "
        "seeds for ±0.5 | CPU s/run bf16, nvfp4 |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        seeds = ", ".join(f"{v:+.2f}" for v in r["gap_per_seed"].values())
        hw = r["gap_half_width"]
        lines.append(
            f"| `{r['setting']}`: {r['what']} | {r['params']:,} | {r['tokens']:,} | "
            f"{r['eval_tokens']:,} | {len(r['seeds'])} | {f(r['bf16_loss_mean'])} "
            f"({f(r['bf16_loss_sd'], '.4f')}, {f(r['bf16_loss_sd_pct'], '.2f')}%) | {seeds} | "
            f"{f(r['gap_mean'], '+.2f')} ± {f(hw, '.2f')} | {f(r['gap_sd'], '.2f')} | "
            f"{f(r['eval_se'], '.3f')} | {r['seeds_for_0.5'] or '—'} | "
            f"{f(r['cpu_s_per_run']['bf16'], '.0f')}, {f(r['cpu_s_per_run']['nvfp4'], '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--root", default="runs/noise")
    ap.add_argument("--docs", default="docs/compare-noise")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--notes", default=None, help="markdown file appended to the report")
    args = ap.parse_args(argv)

    from microscale.config import atomic_write_text
    from microscale.experiments.compare import CompareConfig, run_compare
    from microscale.train import enable_compilation_cache, resolve_config

    enable_compilation_cache()
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [n for n in names if n not in SETTINGS]
    if bad:
        print(f"unknown setting(s) {bad}; expected from {list(SETTINGS)}", file=sys.stderr)
        return 2
    seeds = tuple(int(s) for s in args.seeds.split(","))
    rows = []
    for n in names:
        desc, ov = SETTINGS[n]
        cfg = CompareConfig(
            base=resolve_config("tiny", MODEL + ov),
            runs=("bf16", "nvfp4"),
            seeds=seeds,
            out=f"{args.root}/{n}",
            parallel=args.parallel,
        )
        if not args.report_only:
            print(f"[noise] setting {n}: {desc}", flush=True)
            run_compare(cfg)
        rows.append(analyse(n, desc + ", eval 262k tokens", cfg))
        rows.append(
            analyse(n + "_eval16k", desc + ", eval 16k tokens (first 8 batches)", cfg, SHORT_EVAL)
        )
    rows = [r for r in rows if r["gap_mean"] is not None]  # settings with a finished pair
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    atomic_write_text(docs / "summary.json", json.dumps({"settings": rows}, indent=2))
    text = render(rows)
    if args.notes:
        text += "\n" + Path(args.notes).read_text()
    atomic_write_text(docs / "report.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
