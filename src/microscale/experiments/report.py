"""The report of a comparison: ``summary.json``, ``report.md``, ``convergence.png``, ``gap.png``.

Every gap is paired (see :mod:`microscale.experiments.stats`): per seed, a run's final
validation loss against its reference's, both trained from that seed's initialisation and
data order. The comparisons are every run vs ``bf16``, every run vs ``fp8``, and ``mxfp4``
and the ablations vs full ``nvfp4`` (each when both runs are in the set). ``summary.json``
carries, per comparison (``comparisons["<run>_vs_<ref>"]``): ``gap_mean``, ``gap_ci95``
[lo, hi], ``gap_half_width``, ``gap_sd``, ``n_seeds``, ``eval_se`` (the evaluation's own SE
of the mean gap), ``per_seed`` and ``eval_se_per_seed`` (by seed), ``seeds_for_target``
(seeds a ``target`` half-width would need at the measured sd) and ``verdict`` (words).
The ``runs`` table keeps its keys; with several seeds its losses are seed means and its
``rel_gap_vs_*`` are the paired mean gaps.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from microscale.colors import style
from microscale.config import to_dict
from microscale.experiments import stats
from microscale.experiments.runs import ABLATIONS, CONTROLS
from microscale.files import atomic_write_text, save_figure
from microscale.fingerprint import fingerprint_line, numerics_fingerprint
from microscale.outputs import TrainingRun

if TYPE_CHECKING:
    from microscale.experiments.compare_config import CompareConfig
    from microscale.train import TrainConfig

# CI half-width (points of relative gap) a comparison must reach to be called resolved.
TARGET_HALF_WIDTH = 0.5

# The paper's published results (arXiv 2509.25149), each as a paired comparison here:
# (what was published, run, reference, published direction: +1 = run worse, -1 = better).
PAPER_ANCHORS = (
    ("NVFP4 vs FP8: ~1-1.5% worse in loss (12B, 10T tokens)", "nvfp4", "fp8", +1),
    ("NVFP4 vs BF16: ~1.5% worse (8B, 1T tokens)", "nvfp4", "bf16", +1),
    ("MXFP4 vs BF16: ~2.5% worse (8B, 1T), i.e. worse than NVFP4", "mxfp4", "nvfp4", +1),
    ("removing the RHT hurts", "nvfp4_no_rht", "nvfp4", +1),
    ("removing stochastic rounding hurts", "nvfp4_no_sr", "nvfp4", +1),
    ("1x16 instead of 16x16 weight blocks hurts", "nvfp4_1d", "nvfp4", +1),
    ("no bf16 blocks (all FP4) hurts (diverges at 12B)", "nvfp4_all_fp4", "nvfp4", +1),
    ("late switch to bf16 closes most of the gap", "nvfp4_late_bf16", "nvfp4", -1),
)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a crash
            continue
    return out


def weight_bits_per_param(cfg: TrainConfig, precision: dict | None = None) -> float:
    """Average stored bits per parameter of the model's weights under ``cfg``'s rules
    (or ``precision``, a run summary's {layer: recipe}, when the run chose its own, as
    ``precision.kind=sensitivity`` does).

    Quantized linear kernels count their fprop weight format's ``bits_per_element``;
    embeddings, norms, the LM head and bf16 layers count 16.
    """
    import jax
    from flax import nnx

    from microscale.model import Transformer, assignments, iter_linears
    from microscale.ops import get_recipe

    rules = cfg.precision_rules()
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), rules=rules))
    assigned = precision or assignments(model, rules)
    total = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    bits = 16.0 * total
    for path, layer in iter_linears(model):
        n = math.prod(layer.kernel.shape)
        recipe = assigned.get(path)
        if recipe:
            bits += n * (get_recipe(recipe).fprop_w.spec.bits_per_element - 16.0)
    return bits / total


def _curves(run_dir: Path) -> list[tuple[int, float]]:
    """(tokens, loss) per evaluation; the logged training loss when there are fewer than
    two evaluations (``eval_every=0``: only the final one)."""
    recs = _read_jsonl(run_dir / TrainingRun.METRICS)
    for kind, key in (("eval", "val_loss"), ("train", "loss_avg")):
        by_step = {}
        for r in recs:  # a resumed run may repeat a step: keep the last
            if r.get("kind") == kind and r.get(key) is not None:
                by_step[r["step"]] = (r["tokens"], r[key])
        if len(by_step) >= 2:
            break
    return [v for _, v in sorted(by_step.items())]


def _machine() -> dict[str, Any]:
    import jax

    from microscale.ops import get_recipe
    from microscale.ops.backend import resolve_backend

    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device": getattr(dev, "device_kind", str(dev)),
        "devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "machine": platform.machine(),
        "backend_nvfp4": resolve_backend("auto", get_recipe("nvfp4")),
    }


def comparison_pairs(runs: tuple[str, ...]) -> list[tuple[str, str]]:
    """(run, reference) pairs reported for a run set, in reading order."""
    pairs = [(r, "bf16") for r in runs if r != "bf16" and "bf16" in runs]
    pairs += [(r, "fp8") for r in runs if r not in ("bf16", "fp8") and "fp8" in runs]
    pairs += [(r, "nvfp4") for r in runs if "nvfp4" in runs and (r in ABLATIONS or r == "mxfp4")]
    pairs += [(r, CONTROLS[r]) for r in runs if r in CONTROLS and CONTROLS[r] in runs]
    return pairs


def compare_pair(
    run: str, ref: str, per_seed: dict[str, dict[int, dict]], target: float = TARGET_HALF_WIDTH
) -> dict[str, Any]:
    """One paired comparison from the run summaries (``per_seed[name][seed]``)."""
    x = {s: r.get("final_val_loss") for s, r in per_seed[run].items()}
    y = {s: r.get("final_val_loss") for s, r in per_seed[ref].items()}
    gaps = stats.paired_gaps(x, y)
    ci = stats.mean_ci(list(gaps.values()))
    se_seed = {}
    for s in gaps:
        xb = (per_seed[run][s].get("final_val_batch_losses") or {}).get("val")
        yb = (per_seed[ref][s].get("final_val_batch_losses") or {}).get("val")
        se_seed[s] = stats.eval_se(xb, yb) if xb and yb else None
    heldout = {}
    names = {k for r in per_seed[run].values() for k in (r.get("final_val_losses") or {})}
    for k in sorted(names - {"val"}):
        hx = {s: (r.get("final_val_losses") or {}).get(k) for s, r in per_seed[run].items()}
        hy = {s: (r.get("final_val_losses") or {}).get(k) for s, r in per_seed[ref].items()}
        hc = stats.mean_ci(list(stats.paired_gaps(hx, hy).values()))
        heldout[k] = {"gap_mean": hc["mean"], "gap_ci95": hc["ci95"]}
    return {
        "run": run,
        "ref": ref,
        "gap_mean": ci["mean"],
        "gap_ci95": ci["ci95"],
        "gap_half_width": ci["half_width"],
        "gap_sd": ci["sd"],
        "n_seeds": ci["n"],
        "eval_se": stats.combined_eval_se(list(se_seed.values())),
        "per_seed": {str(s): g for s, g in gaps.items()},
        "eval_se_per_seed": {str(s): v for s, v in se_seed.items()},
        "seeds_for_target": stats.seeds_needed(ci["sd"], target),
        "target_half_width": target,
        "resolved": ci["half_width"] is not None and ci["half_width"] <= target,
        "heldout": heldout,
        "verdict": stats.verdict(run, ref, ci),
    }


def _timings(out: Path) -> dict[str, Any]:
    p = out / "timings.json"
    t = json.loads(p.read_text()) if p.exists() else {}
    wall = sum(v["wall_s"] for v in t.values())
    cpu = sum(v["cpu_s"] for v in t.values())
    return {
        "runs": t,
        "wall_s": wall,
        "cpu_s": cpu,
        # both cores busy for the whole run: the idle 2-core machine's wall time
        "idle_2core_estimate_s": cpu / 2,
    }


def _trained_rate(s: dict[str, Any]) -> float | None:
    rate = s.get("tokens_per_s")
    return None if rate is None else rate * s.get("seed_batch", 1)


def _run_summary(
    cfg: CompareConfig, name: str, by_seed: dict[int, dict], comparisons: dict[str, Any]
) -> dict[str, Any]:
    """One run's row of ``summary.json``: its seed means and its gaps to bf16 and fp8."""
    sums = list(by_seed.values())
    val = stats.mean_ci([s.get("final_val_loss") for s in sums])
    other: dict[str, list] = {}
    for s in sums:
        for k, v in (s.get("final_val_losses") or {}).items():
            if k != "val":
                other.setdefault(k, []).append(v)
    r = {
        "recipe": sums[0].get("recipe"),
        "final_val_loss": val["mean"],
        "final_val_loss_std": val["sd"],
        "val_ppl": math.exp(val["mean"]) if val["mean"] is not None else None,
        "final_train_loss": stats.mean_ci([s.get("final_train_loss") for s in sums])["mean"],
        "heldout_losses": {k: stats.mean_ci(v)["mean"] for k, v in other.items()},
        "tokens": sums[0].get("tokens"),
        # the rate this recipe's tokens were trained at: a seed batch's runs share one clock,
        # so a run's own tokens/s times the batch's size (experiments/seeds.py)
        "tokens_per_s": stats.mean_ci([_trained_rate(s) for s in sums])["mean"],
        "status": sorted({s.get("status") for s in sums}),  # type: ignore[type-var]
        "seeds": len(sums),
        "per_seed_val_loss": {str(k): s.get("final_val_loss") for k, s in by_seed.items()},
        "weight_bits_per_param": weight_bits_per_param(
            cfg.run_config(name, cfg.seeds[0]), sums[0].get("precision")
        ),
    }
    for ref in ("bf16", "fp8"):
        c = comparisons.get(f"{name}_vs_{ref}")
        r[f"rel_gap_vs_{ref}"] = 0.0 if name == ref else (c["gap_mean"] if c else None)
    c = comparisons.get(f"{name}_vs_bf16")
    r["heldout_gap_vs_bf16"] = (
        {k: v["gap_mean"] for k, v in c["heldout"].items()}
        if c
        else {k: 0.0 for k in r["heldout_losses"]}
    )
    return r


def _setup(cfg: CompareConfig, first: dict[str, Any], out: Path) -> dict[str, Any]:
    """The ``setup`` section of ``summary.json``, from the config and the first run's summary."""
    b = cfg.base
    return {
        "model": to_dict(b.model),
        "params": first.get("params"),
        "tokens": first.get("tokens"),
        "steps": b.steps,
        "seq_len": b.data.seq_len,
        "batch_size": b.data.batch_size,
        "lr": b.optim.lr,
        "min_lr_ratio": b.optim.min_lr_ratio,
        "schedule": b.optim.schedule,
        "eval_batches": len((first.get("final_val_batch_losses") or {}).get("val") or []),
        "eval_tokens": len((first.get("final_val_batch_losses") or {}).get("val") or [])
        * (b.data.eval_batch_size or b.data.batch_size)
        * b.data.seq_len,
        "corpus": b.data.corpus,
        "corpus_hash": first.get("corpus_hash"),
        "unigram_entropy": first.get("unigram_entropy"),
        "unigram_entropies": first.get("unigram_entropies"),
        "seeds": list(cfg.seeds),
        "target_half_width": TARGET_HALF_WIDTH,
        "timings": _timings(out),
        "machine": _machine(),
        "numerics": numerics_fingerprint("compare"),
    }


def write_report(cfg: CompareConfig) -> dict[str, Any]:
    """Collect the run folders into ``summary.json``, ``report.md`` and the two plots."""
    out = Path(cfg.out)
    dirs = cfg.run_dirs()
    per_seed: dict[str, dict[int, dict]] = {r: {} for r in cfg.runs}
    for (name, seed), d in dirs.items():
        p = d / TrainingRun.SUMMARY
        if not p.exists():
            raise FileNotFoundError(
                f"run {name!r} (seed {seed}) has no summary at {p}; re-run compare"
            )
        per_seed[name][seed] = json.loads(p.read_text())

    comparisons = {
        f"{r}_vs_{ref}": compare_pair(r, ref, per_seed) for r, ref in comparison_pairs(cfg.runs)
    }
    runs = {
        name: _run_summary(cfg, name, by_seed, comparisons) for name, by_seed in per_seed.items()
    }

    setup = _setup(cfg, per_seed[cfg.runs[0]][cfg.seeds[0]], out)
    summary = {"runs": runs, "comparisons": comparisons, "setup": setup}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    _plots(out, {name: {s: _curves(dirs[(name, s)]) for s in cfg.seeds} for name in cfg.runs})
    atomic_write_text(out / "report.md", render_markdown(summary))
    return summary


def _fmt(v: float | None, spec: str = ".4f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _gap_cell(c: dict | None) -> str:
    if c is None:
        return "—"
    if c["gap_half_width"] is None:
        return _fmt(c["gap_mean"], "+.2f", "%")
    return f"{c['gap_mean']:+.2f} ± {c['gap_half_width']:.2f}%"


def _results_table(runs: dict[str, Any], comps: dict[str, Any]) -> list[str]:
    """The report's title and its table: one row per run, gaps paired per seed."""
    heldout_names = sorted({k for r in runs.values() for k in r["heldout_losses"]})
    head = (
        [
            "run",
            "recipe",
            "train loss",
            "val loss",
            "val ppl",
            "gap vs bf16 (95% CI)",
            "gap vs fp8 (95% CI)",
        ]
        + [f"{k} gap vs bf16" for k in heldout_names]
        + ["tokens/s", "weight bits/param"]
    )
    lines = ["# microscale compare", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runs.items():
        val = _fmt(r["final_val_loss"])
        if r["final_val_loss_std"] is not None:
            val += f" ± {r['final_val_loss_std']:.4f} sd"
        label = name if r["status"] == ["completed"] else f"{name} ({'/'.join(r['status'])})"
        row = [
            label,
            r["recipe"] or "",
            _fmt(r["final_train_loss"]),
            val,
            _fmt(r["val_ppl"], ".3f"),
            "0 (reference)" if name == "bf16" else _gap_cell(comps.get(f"{name}_vs_bf16")),
            "0 (reference)" if name == "fp8" else _gap_cell(comps.get(f"{name}_vs_fp8")),
        ]
        for k in heldout_names:
            row.append(_fmt(r["heldout_gap_vs_bf16"].get(k), "+.2f", "%"))
        row += [_fmt(r["tokens_per_s"], ",.0f"), _fmt(r["weight_bits_per_param"], ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _setup_lines(setup: dict[str, Any]) -> list[str]:
    """The report's setup bullets: model, evaluation, data, seeds, time, machine, code."""
    m, t = setup["machine"], setup["timings"]
    return [
        f"- model: {setup['params']:,} parameters (d_model {setup['model']['d_model']}, "
        f"{setup['model']['n_layers']} layers, {setup['model']['n_heads']} heads), "
        f"{setup['steps']} steps x {setup['batch_size']} x {setup['seq_len']} tokens = "
        f"{setup['tokens']:,} tokens per run; peak lr {setup['lr']:g}, {setup['schedule']} "
        f"to {setup['min_lr_ratio']:g} x peak",
        f"- evaluation: {setup['eval_batches']} fixed batches = {setup['eval_tokens']:,} "
        "validation tokens per final eval",
        f"- data: `{setup['corpus']}` (sha256 `{setup['corpus_hash']}`), unigram entropy of "
        f"the val split {_fmt(setup['unigram_entropy'])} nats/token",
        f"- seeds: {setup['seeds']} (a seed sets the initialisation and the data order)",
        (
            f"- time: {t['wall_s'] / 60:.1f} min wall, {t['cpu_s'] / 60:.1f} min CPU (user+sys) "
            f"for the {len(t['runs'])} runs trained by `compare` here "
            f"({t['cpu_s'] / max(t['wall_s'], 1e-9):.2f} cores busy on average; CPU / 2 = "
            f"{t['idle_2core_estimate_s'] / 60:.1f} min is a lower bound on a 2-core machine's "
            "wall time)"
            if t["runs"]
            else "- time: not recorded (no run was trained by `compare` in this folder)"
        ),
        f"- machine: {m['platform']} ({m['device']}), {m['devices']} device(s), "
        f"{m['cpu_count']} CPU cores, jax {m['jax']}; NVFP4 GEMM backend: "
        f"{m['backend_nvfp4']}",
        fingerprint_line(setup.get("numerics")),
    ]


def render_markdown(summary: dict[str, Any]) -> str:
    runs, comps, setup = summary["runs"], summary["comparisons"], summary["setup"]
    lines = _results_table(runs, comps)
    lines += [
        "",
        "Gaps are paired per seed (same initialisation and data order) and given as "
        "mean ± the 95% Student-t half-width over seeds; val loss is the seed mean ± sd.",
        "",
        "## Verdicts",
        "",
        *[f"- {c['verdict']}" for c in comps.values()],
        "",
        "## Resolution",
        "",
        *resolution(summary),
        "",
        "## Against the paper",
        "",
        *paper_table(comps),
        "",
        "![convergence](convergence.png)",
        "",
        "![gap to bf16](gap.png)",
        "",
        "## Setup",
        "",
        *_setup_lines(setup),
        "",
        "## Reading",
        "",
        *reading(summary),
        "",
    ]
    return "\n".join(lines)


def resolution(summary: dict[str, Any]) -> list[str]:
    """How precise the headline comparisons are, against the target half-width."""
    out = []
    for key in ("nvfp4_vs_bf16", "nvfp4_vs_fp8"):
        c = summary["comparisons"].get(key)
        if c is None:
            continue
        if c["gap_half_width"] is None:
            out.append(f"- `{key}`: one seed, no interval; add seeds (`--seeds 0,1,2,...`).")
            continue
        ev = (
            f"; the evaluation's own SE is {c['eval_se']:.3f} points"
            if c["eval_se"] is not None
            else ""
        )
        state = "resolved" if c["resolved"] else "NOT resolved"
        need = (
            f"; at the measured seed sd ({c['gap_sd']:.2f} points) a half-width of "
            f"{c['target_half_width']} needs {c['seeds_for_target']} seeds"
            if c["seeds_for_target"]
            else ""
        )
        out.append(
            f"- `{key}`: 95% CI half-width {c['gap_half_width']:.2f} points with "
            f"{c['n_seeds']} seeds -- {state} to ±{c['target_half_width']} points"
            f"{need}{ev}."
        )
    return out


def paper_table(comps: dict[str, dict]) -> list[str]:
    """The published anchors next to the measured paired gaps: agrees / disagrees / not
    resolved (the interval contains zero)."""
    lines = ["| published (arXiv 2509.25149) | here | agreement |", "|---|---|---|"]
    for text, run, ref, sign in PAPER_ANCHORS:
        c = comps.get(f"{run}_vs_{ref}")
        if c is None or c["gap_mean"] is None:
            continue
        here = f"`{run}` vs `{ref}`: {_gap_cell(c)}"
        if c["gap_ci95"] is None:
            word = "not resolved (one seed)"
        else:
            lo, hi = c["gap_ci95"]
            if lo > 0 or hi < 0:
                word = "agrees (direction)" if (lo > 0) == (sign > 0) else "disagrees"
            else:
                word = "not resolved at this size (CI contains 0)"
        lines.append(f"| {text} | {here} | {word} |")
    if len(lines) == 2:
        return ["(no run pair of the published results in this run set)"]
    return lines + [
        "",
        "The published gaps are at 8-12B parameters and 1-10T tokens; these "
        "are at the size above. Agreement is in direction; magnitudes at this "
        "size are not predictions of 12B (see `--sizes` for the trend).",
    ]


def reading(summary: dict[str, Any]) -> list[str]:
    """A plain-language account of what the numbers show and what they do not."""
    runs, comps, setup = summary["runs"], summary["comparisons"], summary["setup"]
    out = []
    ent = setup.get("unigram_entropy")
    b = runs.get("bf16")
    if b and b["final_val_loss"] is not None and ent:
        v = b["final_val_loss"]
        if v < ent:
            out.append(
                f"- The bf16 run reached a validation loss of {v:.3f} nats/token, "
                f"{'well ' if v < 0.8 * ent else ''}below the corpus's unigram entropy "
                f"({ent:.3f}): the model learned structure beyond token frequencies."
            )
        else:
            out.append(
                f"- The bf16 run's validation loss ({v:.3f} nats/token) is NOT below "
                f"the unigram entropy ({ent:.3f}): the model is undertrained, so the "
                "gaps below say little; train longer (steps=...)."
            )
    nv = comps.get("nvfp4_vs_bf16")
    if nv and nv["gap_mean"] is not None:
        out.append(f"- Headline: {nv['verdict']}")
        n8 = comps.get("nvfp4_vs_fp8")
        if n8:
            out.append(f"- Against FP8: {n8['verdict']}")
    if len(setup["seeds"]) < 2:
        out.append(
            "- Only one seed was run: the gaps above are single measurements, not "
            "verdicts (docs/design.md#statistics). Use `--seeds 0,1,2,...`."
        )
    sd = b and b.get("final_val_loss_std")
    if sd and nv and nv["gap_sd"] is not None:
        out.append(
            f"- Seed spread: bf16's own final loss moves by "
            f"{100 * sd / b['final_val_loss']:.2f}% (sd over seeds), the paired "
            f"nvfp4-bf16 gap by {nv['gap_sd']:.2f} points; the interval narrows as "
            "1/sqrt(seeds)."
        )
    out.append(
        "- What this does not show: behaviour at billions of parameters and trillions "
        "of tokens (the paper's regime), downstream-task accuracy, or speed on FP4 "
        "hardware (the GEMMs here are emulated unless the backend says native)."
    )
    return out


def _seed_band(
    by_seed: dict[int, list[tuple[int, float]]],
) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(tokens, mean, min, max)`` over the seeds at the tokens every seed has a point."""
    series = [dict(pts) for pts in by_seed.values() if pts]
    if not series:
        return [], [], [], []
    ts = sorted(set(series[0]).intersection(*series[1:]))
    vals = [[s[t] for s in series] for t in ts]
    return ts, [sum(v) / len(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def _plots(out: Path, curves: dict[str, dict[int, list[tuple[int, float]]]]) -> None:
    """``convergence.png`` (each run's mean over its seeds, with the min-max band) and
    ``gap.png`` (the paired gap to bf16 with its 95% interval); each run in its colour of
    :data:`microscale.colors.STYLES`, the same in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    n_seeds = max((len(by_seed) for by_seed in curves.values()), default=0)
    for name, by_seed in curves.items():
        ts, mean, lo, hi = _seed_band(by_seed)
        if not ts:
            continue
        st = style(name)
        line = "--" if name in ABLATIONS else "-"
        cut = len(ts) // 3  # zoom: the last two thirds, where the gaps show
        for a, k in ((ax, 0), (zoom, cut)):
            a.plot(ts[k:], mean[k:], line, color=st.color, marker=st.marker, ms=2, label=name)
            a.fill_between(ts[k:], lo[k:], hi[k:], color=st.color, alpha=0.15, lw=0)
    ax.set_yscale("log")
    seeds = f"mean of {n_seeds} seeds, band: min to max" if n_seeds > 1 else "one seed"
    ax.set_title(f"Loss vs tokens ({seeds}; log scale)")
    zoom.set_title("Last two thirds of training")
    for a in (ax, zoom):
        a.set_xlabel("training tokens")
        a.set_ylabel("val loss (train loss without evals), nats/token")
        a.grid(alpha=0.3)
    save_figure(fig, out / "convergence.png", legend_ax=zoom)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ref = curves.get("bf16", {})
    for name, by_seed in curves.items():
        if name == "bf16":
            continue
        gaps: dict[int, list[float]] = {}
        for s, pts in by_seed.items():
            r = dict(ref.get(s, []))
            for t, v in pts:
                if t > 0 and t in r:
                    gaps.setdefault(t, []).append(100 * (v - r[t]) / r[t])
        if not gaps:
            continue
        ts = sorted(gaps)
        cis = [stats.mean_ci(gaps[t]) for t in ts]
        err = [c["half_width"] or 0.0 for c in cis]
        ax.errorbar(
            ts,
            [c["mean"] for c in cis],
            yerr=err,
            capsize=3,
            color=style(name).color,
            marker=style(name).marker,
            ms=3,
            ls="--" if name in ABLATIONS else "-",
            label=name,
        )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("paired loss gap to bf16 (%), 95% CI")
    ax.set_title("Gap to bf16 vs tokens (mean over seeds; train loss without evals)")
    ax.grid(alpha=0.3)
    save_figure(fig, out / "gap.png", legend_ax=ax)
