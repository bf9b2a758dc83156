"""``microscale compare --sizes``: the paired gaps at several model sizes and their trend.

The paper's claim is about behaviour at 8-12B parameters. A CPU cannot train that, but it
can show which way the gap moves as the model grows. For each size the same runs and seeds
are trained (a :class:`~microscale.experiments.compare.CompareConfig` per size, in
``OUT/<size>``) on a token budget proportional to the size:

    tokens = tokens_per_param x params   (rounded to whole steps, at least ``min_steps``)

so every size sees the same number of tokens per parameter (the paper's runs use ~80-800
tokens per parameter; a CPU affords far fewer, which the report states). The learning-rate
schedule, batch and sequence length are the base config's at every size.

The trend of each comparison is the ordinary-least-squares fit ``gap = a + b log10(params)``
over every (size, seed) gap (:func:`~microscale.experiments.stats.loglinear_fit`); its slope
interval says whether the gap shrinks (whole interval below 0), grows (above 0) or is flat
within the resolution, and the fit extrapolated to 12B parameters is put next to the paper's
figure -- with the caveat that four decades of extrapolation from one decade of data, at a
far smaller token budget, is a direction rather than a prediction.

Outputs in ``OUT``: ``scaling.png`` (gap vs parameters, log axis, 95% CI bars, one line per
comparison, fitted trend and its band), ``report.md``, ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from microscale.colors import style
from microscale.config import apply_overrides
from microscale.experiments import stats
from microscale.experiments.compare import CompareConfig, run_compare
from microscale.experiments.report import write_report
from microscale.files import atomic_write_text

# size name -> model overrides of the tiny shape family (4 heads, 2 kv heads, byte vocab).
# "0.05M" has 2 heads of 16 (NVFP4 and FP8 only: MX formats need dims in blocks of 32).
SIZES: dict[str, dict[str, Any]] = {
    "0.05M": {"d_model": 32, "d_ff": 96, "n_heads": 2, "n_kv_heads": 1, "dim_multiple": 16},
    "0.16M": {"d_model": 64, "d_ff": 128},
    "0.6M": {"d_model": 128, "d_ff": 256},
    "1.7M": {"d_model": 192, "d_ff": 512},
    "3.2M": {"d_model": 256, "d_ff": 768},
    "9.8M": {"d_model": 384, "d_ff": 1024, "n_layers": 6},
}
# The paper's size for the extrapolation (NVFP4 vs FP8 at 12B, ~1-1.5%).
PAPER_PARAMS = 12e9
# Comparisons plotted and fitted (when both runs are in the set).
TREND_PAIRS = (("nvfp4", "bf16"), ("nvfp4", "fp8"), ("mxfp4", "bf16"), ("fp8", "bf16"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """A size sweep: one comparison per model size, token budgets proportional to size."""

    # Runs, seeds and the shared training config (its model is replaced per size).
    compare: CompareConfig = CompareConfig()
    # Size names from SIZES, smallest first.
    sizes: tuple[str, ...] = ("0.16M", "0.6M", "1.7M")
    # Training tokens per model parameter at every size.
    tokens_per_param: float = 1.0
    # Lower bound on optimizer steps (the smallest models would otherwise barely train).
    min_steps: int = 100

    def __post_init__(self):
        bad = [s for s in self.sizes if s not in SIZES]
        if bad:
            raise ValueError(f"unknown size(s) {bad}; expected names from {list(SIZES)}")
        if len(self.sizes) < 2 or len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"sizes={list(self.sizes)}: expected two or more distinct sizes")
        if not self.tokens_per_param > 0:
            raise ValueError(f"tokens_per_param={self.tokens_per_param}: expected > 0")
        if self.min_steps < 1:
            raise ValueError(f"min_steps={self.min_steps}: expected >= 1")

    def size_config(self, size: str) -> CompareConfig:
        """The comparison at one size: its model, its step budget, its folder."""
        base = self.compare.base
        model = dataclasses.replace(base.model, **SIZES[size])
        steps = max(
            self.min_steps, round(self.tokens_per_param * model.num_params() / base.tokens_per_step)
        )
        warm = max(1, round(steps * base.optim.warmup_steps / base.steps))
        every = base.eval_every and max(1, steps // max(1, base.steps // base.eval_every))
        cfg = apply_overrides(
            dataclasses.replace(base, model=model),
            {"steps": steps, "optim.warmup_steps": warm, "eval_every": every},
        )
        return dataclasses.replace(self.compare, base=cfg, out=str(Path(self.compare.out) / size))


def run_scaling(cfg: ScalingConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train every size (finished runs are reused), then write the trend report."""
    for i, size in enumerate(cfg.sizes):
        if progress:
            c = cfg.size_config(size)
            print(
                f"[sizes] {i + 1}/{len(cfg.sizes)}: {size} ({c.base.model.num_params():,} "
                f"params, {c.base.steps} steps = {c.base.steps * c.base.tokens_per_step:,} "
                "tokens)",
                flush=True,
            )
        run_compare(cfg.size_config(size), progress=progress)
    return write_scaling_report(cfg)


def trend(points: list[tuple[float, list[float]]]) -> dict[str, Any] | None:
    """Fit and read one comparison's (params, per-seed gaps) points."""
    xs = [p for p, gs in points for _ in gs]
    ys = [g for _, gs in points for g in gs]
    try:
        fit = stats.loglinear_fit(xs, ys)
    except ValueError:
        return None
    lo, hi = fit["slope_ci95"]
    word = (
        "grows" if lo > 0 else "shrinks" if hi < 0 else "has no resolved trend (flat within the CI)"
    )
    return {"fit": fit, "direction": word, "at_paper_size": stats.predict(fit, PAPER_PARAMS)}


def write_scaling_report(cfg: ScalingConfig) -> dict[str, Any]:
    per_size = {}
    for size in cfg.sizes:
        sc = cfg.size_config(size)
        s = write_report(sc)
        ref = s["runs"].get("bf16") or next(iter(s["runs"].values()))
        per_size[size] = {
            "params": s["setup"]["params"],
            "tokens": s["setup"]["tokens"],
            "ref_run": "bf16" if "bf16" in s["runs"] else next(iter(s["runs"])),
            "ref_val_loss": ref["final_val_loss"],
            "unigram_entropy": s["setup"]["unigram_entropy"],
            "steps": sc.base.steps,
            "comparisons": s["comparisons"],
            "timings": s["setup"]["timings"],
        }
    trends = {}
    for run, ref in TREND_PAIRS:
        key = f"{run}_vs_{ref}"
        pts = [
            (v["params"], [g for g in v["comparisons"][key]["per_seed"].values()])
            for v in per_size.values()
            if key in v["comparisons"]
        ]
        t = trend(pts) if pts else None
        if t:
            trends[key] = t
    summary = {
        "sizes": per_size,
        "trends": trends,
        "rule": {"tokens_per_param": cfg.tokens_per_param, "min_steps": cfg.min_steps},
        "seeds": list(cfg.compare.seeds),
        "runs": list(cfg.compare.runs),
    }
    out = Path(cfg.compare.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    _plot(out / "scaling.png", per_size, trends)
    atomic_write_text(out / "report.md", render_scaling(cfg, summary))
    return summary


def _size_row(name: str, v: dict[str, Any], keys: list[str]) -> list[str]:
    """One size's row: its parameters, steps, tokens, reference loss and each gap's CI."""
    loss = v["ref_val_loss"]
    row = [
        name,
        f"{v['params']:,}",
        str(v["steps"]),
        f"{v['tokens']:,}",
        "—" if loss is None else f"{loss:.3f} ({v['ref_run']})",
    ]
    for k in keys:
        c = v["comparisons"].get(k)
        if c is None or c["gap_mean"] is None:
            row.append("—")
        elif c["gap_ci95"] is None:
            row.append(f"{c['gap_mean']:+.2f}% (1 seed)")
        else:
            row.append(f"{c['gap_mean']:+.2f}% ({c['gap_ci95'][0]:+.2f}...{c['gap_ci95'][1]:+.2f})")
    return row


def _trend_lines(trends: dict[str, dict]) -> list[str]:
    """One bullet per trend: slope per decade of parameters and the 12B extrapolation."""
    out = []
    for k, t in trends.items():
        f, p = t["fit"], t["at_paper_size"]
        lo, hi = f["slope_ci95"]
        out.append(
            f"- `{k}`: the gap {t['direction']} with size: slope {f['slope']:+.2f} "
            f"points per decade of parameters (95% CI {lo:+.2f} to {hi:+.2f}, "
            f"{f['n_points']} size x seed points). Extrapolated to 12B parameters: "
            f"{p['gap']:+.1f}% (95% CI {p['ci95'][0]:+.1f} to {p['ci95'][1]:+.1f})."
        )
    return out


def render_scaling(cfg: ScalingConfig, summary: dict[str, Any]) -> str:
    sizes, trends = summary["sizes"], summary["trends"]
    keys = [
        k
        for k in (f"{r}_vs_{f}" for r, f in TREND_PAIRS)
        if any(k in v["comparisons"] for v in sizes.values())
    ]
    head = ["size", "params", "steps", "tokens", "val loss (reference run)"] + [
        f"{k} (95% CI)" for k in keys
    ]
    lines = [
        "# microscale compare --sizes",
        "",
        "![scaling](scaling.png)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(_size_row(name, v, keys)) + " |" for name, v in sizes.items()]
    ent = next(iter(sizes.values()))["unigram_entropy"]
    if ent:
        lines += [
            "",
            f"The val split's unigram entropy is {ent:.3f} nats/token: a loss near "
            "it means a model that has learned little beyond token frequencies, where "
            "a precision gap has little to act on.",
        ]
    cpu = sum(v["timings"]["cpu_s"] for v in sizes.values())
    wall = sum(v["timings"]["wall_s"] for v in sizes.values())
    lines += ["", "## Trend", ""]
    lines += _trend_lines(trends)
    if "nvfp4_vs_fp8" in trends or "nvfp4_vs_bf16" in trends:
        lines.append(
            "- The paper: NVFP4 about 1-1.5% above FP8 at 12B parameters and 10T "
            "tokens (~800 tokens per parameter), ~1.5% above BF16 at 8B and 1T."
        )
    lines += [
        "- Caveat: this fit spans one decade or so of sizes at "
        f"{cfg.tokens_per_param:.3g} tokens per parameter (at least {cfg.min_steps} steps), "
        "the paper is four decades further at hundreds of tokens per parameter. A log-linear "
        "trend may bend, and the extrapolated interval only covers the noise of this fit, "
        "not that model error: read the extrapolation as a direction, not a prediction.",
        "",
        "## Setup",
        "",
        f"- token rule: tokens = {cfg.tokens_per_param:.3g} x parameters, rounded to whole "
        f"steps of {cfg.compare.base.tokens_per_step:,} tokens, at least {cfg.min_steps} "
        "steps; same batch, sequence length, peak lr and schedule shape at every size",
        f"- runs: {', '.join(cfg.compare.runs)}; seeds {list(cfg.compare.seeds)} "
        "(paired within a size)",
        (
            f"- time: {wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU (user+sys) for the runs "
            f"trained by `compare` ({cpu / max(wall, 1e-9):.2f} cores busy on average; CPU / 2 = "
            f"{cpu / 120:.1f} min is a lower bound on a 2-core machine's wall time)"
            if cpu
            else "- time: not recorded (no run was trained by `compare` in these folders)"
        ),
        "- per-size reports: " + ", ".join(f"[{s}]({s}/report.md)" for s in sizes),
        "",
    ]
    return "\n".join(lines)


def _plot(path: Path, sizes: dict[str, dict], trends: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from microscale.files import save_figure

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    params = [v["params"] for v in sizes.values()]
    for i, (key, t) in enumerate(trends.items()):
        pts = [
            (v["params"], v["comparisons"][key])
            for v in sizes.values()
            if key in v["comparisons"] and v["comparisons"][key]["gap_mean"] is not None
        ]
        xs = [p * (1 + 0.03 * i) for p, _ in pts]  # a small offset keeps bars apart
        ys = [c["gap_mean"] for _, c in pts]
        err = [c["gap_half_width"] or 0.0 for _, c in pts]
        st = style(key.split("_vs_")[0])  # the run's colour in compare's figures
        color = st.color
        ax.errorbar(
            xs, ys, yerr=err, capsize=3, color=color, marker=st.marker, ls="none", label=key
        )
        f = t["fit"]
        grid = [min(params) * (max(params) / min(params)) ** (j / 40) for j in range(41)]
        pred = [stats.predict(f, g) for g in grid]
        ax.plot(grid, [p["gap"] for p in pred], color=color, lw=1)
        ax.fill_between(
            grid,
            [p["ci95"][0] for p in pred],
            [p["ci95"][1] for p in pred],
            color=color,
            alpha=0.12,
        )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("paired final val-loss gap (%), 95% CI")
    ax.set_title("Gap vs model size (log-linear fit, 95% band)")
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path, legend_ax=ax)
