"""``microscale compare``: the same model, data order, initialisation and token budget,
trained once per recipe, and the convergence curves, perplexities and gaps between them.

What makes the comparison fair: every run is the *same* :class:`~microscale.train.TrainConfig`
except for the precision fields a run changes (``recipe``, ``bf16_last``, ``late_switch``);
so the initial weights (``seed``), the batches (``data.seed``), the learning-rate schedule
and the number of tokens are identical. A run is a call of :func:`microscale.train.train`
(nothing here re-implements training) into ``OUT/runs/<name>``; a finished run is found by
the trainer's resume logic and not recomputed when the command is re-run.

Runs (``RUNS``): the baselines ``bf16``, ``fp8``, ``mxfp8``, ``nvfp4``, ``mxfp4`` and the
NVFP4 ablations ``nvfp4_no_rht``, ``nvfp4_no_sr``, ``nvfp4_1d`` (1x16 weight blocks),
``nvfp4_all_fp4`` (no bf16 blocks), ``nvfp4_fwd_only`` (FP4 only in the forward GEMM) and
``nvfp4_late_bf16`` (the last 18% of tokens in bf16, the paper's Appendix D).

Outputs: ``report.md``, ``convergence.png``, ``gap.png``, ``summary.json`` (see
:func:`write_report`), all written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from microscale.config import apply_overrides, dump_yaml, to_dict
from microscale.files import atomic_write_text, atomic_writer
from microscale.train import TrainConfig, TrainingAborted, train

# name -> the overrides that make this run differ from the base config.
RUNS: dict[str, dict[str, Any]] = {
    "bf16": {"recipe": "bf16"},
    "fp8": {"recipe": "fp8"},
    "mxfp8": {"recipe": "mxfp8"},
    "nvfp4": {"recipe": "nvfp4"},
    "mxfp4": {"recipe": "mxfp4"},
    "nvfp4_no_rht": {"recipe": "nvfp4_no_rht"},
    "nvfp4_no_sr": {"recipe": "nvfp4_no_sr"},
    "nvfp4_1d": {"recipe": "nvfp4_1d"},
    "nvfp4_all_fp4": {"recipe": "nvfp4", "bf16_last": 0, "bf16_first": 0},
    "nvfp4_fwd_only": {"recipe": "nvfp4_fwd_only"},
    "nvfp4_late_bf16": {"recipe": "nvfp4", "late_switch.fraction": 0.18,
                        "late_switch.mode": "full"},
}
BASELINES = ("bf16", "fp8", "mxfp8", "nvfp4", "mxfp4")
ABLATIONS = tuple(n for n in RUNS if n not in BASELINES)
# Fields a run is allowed to change; everything else must match across runs.
PRECISION_FIELDS = ("recipe", "bf16_first", "bf16_last", "late_switch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareConfig:
    """One comparison: a base training config and the runs to train from it."""

    # The shared training config (model, data, optimizer, steps, seed, ...).
    base: TrainConfig = TrainConfig()
    # Runs to train, names from RUNS (baselines first).
    runs: tuple[str, ...] = BASELINES
    # Initialisation/SR seeds; several seeds give mean and spread per run.
    seeds: tuple[int, ...] = (0,)
    # Output folder.
    out: str = "runs/compare"
    # Concurrent training processes (one device group each); 1 = in this process.
    parallel: int = 1

    def __post_init__(self):
        unknown = [r for r in self.runs if r not in RUNS]
        if unknown:
            raise ValueError(f"unknown run(s) {unknown}; expected names from {list(RUNS)}")
        if not self.runs:
            raise ValueError("runs is empty; expected at least one of " + str(list(RUNS)))
        if len(set(self.runs)) != len(self.runs):
            raise ValueError(f"runs {list(self.runs)} lists a run twice")
        if not self.seeds or any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds={self.seeds}: expected one or more ints >= 0")
        if self.parallel < 1:
            raise ValueError(f"parallel={self.parallel}: expected an int >= 1")

    def run_dirs(self) -> dict[tuple[str, int], Path]:
        root = Path(self.out) / "runs"
        multi = len(self.seeds) > 1
        return {(r, s): root / (f"{r}-seed{s}" if multi else r)
                for r in self.runs for s in self.seeds}

    def run_config(self, name: str, seed: int) -> TrainConfig:
        cfg = apply_overrides(self.base, {**RUNS[name], "seed": seed})
        out = str(self.run_dirs()[(name, seed)])
        return dataclasses.replace(cfg, out=out, resume=True)

    def settings_hash(self) -> str:
        """Identifies the comparison's settings (not its output folder)."""
        d = {"base": to_dict(dataclasses.replace(self.base, out=None, resume=False)),
             "runs": list(self.runs), "seeds": list(self.seeds)}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def find_previous(base_dir: str | os.PathLike, settings_hash: str) -> Path | None:
    """The newest ``compare-*`` folder under ``base_dir`` made with the same settings."""
    base = Path(base_dir)
    if not base.is_dir():
        return None
    for d in sorted(base.glob("compare-*"), reverse=True):
        try:
            if json.loads((d / "compare.json").read_text())["settings_hash"] == settings_hash:
                return d
        except (OSError, ValueError, KeyError):
            continue
    return None


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


def _run_subprocess(cfg: TrainConfig, env_extra: dict[str, str]) -> subprocess.Popen:
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    yaml_path = run_dir / "compare_config.yaml"
    dump_yaml(cfg, yaml_path)
    cmd = [sys.executable, "-m", "microscale.cli", "train", "--config", str(yaml_path),
           "--quiet"]
    log = open(run_dir / "train.log", "ab")  # noqa: SIM115 - closed by the caller's wait
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **env_extra})


def _device_groups(n: int) -> list[dict[str, str]]:
    """Environment per process: GPUs split into n groups; on CPU nothing to split."""
    import jax

    devs = jax.devices()
    if devs[0].platform != "gpu" or len(devs) < n:
        return [{} for _ in range(n)]
    ids = [d.id for d in devs]
    per = len(ids) // n
    return [{"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids[i * per:(i + 1) * per]))}
            for i in range(n)]


def run_compare(cfg: CompareConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train every run (skipping finished ones), then write the report. Returns summary."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "compare.json", json.dumps(
        {"settings_hash": cfg.settings_hash(), "config": to_dict(cfg)}, indent=2))
    dump_yaml(cfg.base, out / "base_config.yaml")
    jobs = [(name, seed, cfg.run_config(name, seed)) for name in cfg.runs for seed in cfg.seeds]
    t0 = time.perf_counter()
    if cfg.parallel == 1:
        for i, (name, seed, rcfg) in enumerate(jobs):
            if progress:
                print(f"[compare] run {i + 1}/{len(jobs)}: {name} (seed {seed}) -> {rcfg.out}",
                      flush=True)
            try:
                train(rcfg, progress=progress)
            except TrainingAborted as e:  # e.g. all-FP4 diverging: report it, go on
                if progress:
                    print(f"[compare] {name} aborted: {e}", flush=True)
    else:
        envs = _device_groups(cfg.parallel)
        pending = list(jobs)
        running: list[tuple[str, subprocess.Popen, dict]] = []
        failed = []
        while pending or running:
            while pending and len(running) < cfg.parallel:
                name, seed, rcfg = pending.pop(0)
                env = envs[len(running) % len(envs)]
                running.append((name, _run_subprocess(rcfg, env), env))
                if progress:
                    print(f"[compare] started {name} (seed {seed}) in a subprocess", flush=True)
            time.sleep(1.0)
            for item in list(running):
                code = item[1].poll()
                if code is not None:
                    running.remove(item)
                    if code not in (0, 1):  # 1: aborted (non-finite), summary written
                        failed.append(item[0])
        if failed:
            raise RuntimeError(f"run(s) {failed} failed; see their train.log under {out}/runs")
    if progress:
        print(f"[compare] all runs done in {time.perf_counter() - t0:.0f} s; writing report",
              flush=True)
    return write_report(cfg)


# ------------------------------------------------------------------------------ report


def _rel_gap(x: float | None, ref: float | None) -> float | None:
    if x is None or ref is None or not math.isfinite(x) or not math.isfinite(ref):
        return None
    return 100.0 * (x - ref) / ref


def _mean_std(vals: Sequence[float | None]) -> tuple[float | None, float | None]:
    v = [x for x in vals if x is not None and math.isfinite(x)]
    if not v:
        return None, None
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
    return m, s


def weight_bits_per_param(cfg: TrainConfig) -> float:
    """Average stored bits per parameter of the model's weights under ``cfg``'s rules.

    Quantized linear kernels count their fprop weight format's ``bits_per_element``;
    embeddings, norms, the LM head and bf16 layers count 16.
    """
    import jax
    from flax import nnx

    from microscale.model import Transformer, assignments, iter_linears
    from microscale.ops import get_recipe

    rules = cfg.precision_rules()
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0), rules=rules))
    assigned = assignments(model, rules)
    total = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    bits = 16.0 * total
    for path, layer in iter_linears(model):
        n = math.prod(layer.kernel.shape)
        recipe = assigned.get(path)
        if recipe:
            bits += n * (get_recipe(recipe).fprop_w.spec.bits_per_element - 16.0)
    return bits / total


def _curves(run_dir: Path) -> list[tuple[int, float, dict]]:
    evs = [r for r in _read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]
    by_step = {}
    for r in evs:  # a resumed run may repeat a step: keep the last
        by_step[r["step"]] = (r["tokens"], r["val_loss"], r.get("val_losses", {}))
    return [(t, v, extra) for _, (t, v, extra) in sorted(by_step.items())]


def _machine() -> dict[str, Any]:
    import jax

    from microscale.ops import get_recipe
    from microscale.ops.backend import resolve_backend

    dev = jax.devices()[0]
    return {"platform": dev.platform, "device": getattr(dev, "device_kind", str(dev)),
            "devices": jax.device_count(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "machine": platform.machine(),
            "backend_nvfp4": resolve_backend("auto", get_recipe("nvfp4"))}


def write_report(cfg: CompareConfig) -> dict[str, Any]:
    """Collect the run folders into ``summary.json``, ``report.md`` and the two plots."""
    out = Path(cfg.out)
    dirs = cfg.run_dirs()
    per_seed: dict[str, list[dict]] = {r: [] for r in cfg.runs}
    for (name, _seed), d in dirs.items():
        p = d / "summary.json"
        if not p.exists():
            raise FileNotFoundError(f"run {name!r} has no summary at {p}; re-run compare")
        per_seed[name].append(json.loads(p.read_text()))

    runs: dict[str, dict[str, Any]] = {}
    for name, sums in per_seed.items():
        val, val_sd = _mean_std([s.get("final_val_loss") for s in sums])
        other = {}
        for s in sums:
            for k, v in (s.get("final_val_losses") or {}).items():
                if k != "val":
                    other.setdefault(k, []).append(v)
        runs[name] = {
            "recipe": sums[0].get("recipe"),
            "final_val_loss": val,
            "final_val_loss_std": val_sd,
            "val_ppl": math.exp(val) if val is not None else None,
            "final_train_loss": _mean_std([s.get("final_train_loss") for s in sums])[0],
            "heldout_losses": {k: _mean_std(v)[0] for k, v in other.items()},
            "tokens": sums[0].get("tokens"),
            "tokens_per_s": _mean_std([s.get("tokens_per_s") for s in sums])[0],
            "status": sorted({s.get("status") for s in sums}),
            "seeds": len(sums),
            "weight_bits_per_param": weight_bits_per_param(
                cfg.run_config(name, cfg.seeds[0])),
        }
    ref_bf16 = runs.get("bf16", {}).get("final_val_loss")
    ref_fp8 = runs.get("fp8", {}).get("final_val_loss")
    for r in runs.values():
        r["rel_gap_vs_bf16"] = _rel_gap(r["final_val_loss"], ref_bf16)
        r["rel_gap_vs_fp8"] = _rel_gap(r["final_val_loss"], ref_fp8)
        ho_ref = runs.get("bf16", {}).get("heldout_losses", {})
        r["heldout_gap_vs_bf16"] = {k: _rel_gap(v, ho_ref.get(k))
                                    for k, v in r["heldout_losses"].items()}

    first = per_seed[cfg.runs[0]][0]
    setup = {
        "model": to_dict(cfg.base.model),
        "params": first.get("params"),
        "tokens": first.get("tokens"),
        "steps": cfg.base.steps,
        "seq_len": cfg.base.data.seq_len,
        "batch_size": cfg.base.data.batch_size,
        "corpus": cfg.base.data.corpus,
        "corpus_hash": first.get("corpus_hash"),
        "unigram_entropy": first.get("unigram_entropy"),
        "unigram_entropies": first.get("unigram_entropies"),
        "seeds": list(cfg.seeds),
        "machine": _machine(),
    }
    summary = {"runs": runs, "setup": setup}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    curves = {name: _curves(dirs[(name, cfg.seeds[0])]) for name in cfg.runs}
    _plots(out, curves)
    atomic_write_text(out / "report.md", render_markdown(cfg, summary))
    return summary


def _fmt(v: float | None, spec: str = ".4f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def render_markdown(cfg: CompareConfig, summary: dict[str, Any]) -> str:
    runs, setup = summary["runs"], summary["setup"]
    heldout_names = sorted({k for r in runs.values() for k in r["heldout_losses"]})
    head = ["run", "recipe", "train loss", "val loss", "val ppl", "gap vs bf16",
            "gap vs fp8"] + [f"{k} loss (gap vs bf16)" for k in heldout_names] + [
            "tokens/s", "weight bits/param"]
    lines = ["# microscale compare", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runs.items():
        val = _fmt(r["final_val_loss"])
        if r["final_val_loss_std"] is not None:
            val += f" ± {r['final_val_loss_std']:.4f}"
        label = name if r["status"] == ["completed"] else f"{name} ({'/'.join(r['status'])})"
        row = [label, r["recipe"] or "", _fmt(r["final_train_loss"]), val,
               _fmt(r["val_ppl"], ".3f"), _fmt(r["rel_gap_vs_bf16"], "+.2f", "%"),
               _fmt(r["rel_gap_vs_fp8"], "+.2f", "%")]
        for k in heldout_names:
            row.append(f"{_fmt(r['heldout_losses'].get(k))} "
                       f"({_fmt(r['heldout_gap_vs_bf16'].get(k), '+.2f', '%')})")
        row += [_fmt(r["tokens_per_s"], ",.0f"), _fmt(r["weight_bits_per_param"], ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    m = setup["machine"]
    lines += [
        "", "![convergence](convergence.png)", "", "![gap to bf16](gap.png)", "",
        "## Setup", "",
        f"- model: {setup['params']:,} parameters (d_model {setup['model']['d_model']}, "
        f"{setup['model']['n_layers']} layers, {setup['model']['n_heads']} heads), "
        f"{setup['steps']} steps x {setup['batch_size']} x {setup['seq_len']} tokens = "
        f"{setup['tokens']:,} tokens per run",
        f"- data: `{setup['corpus']}` (sha256 `{setup['corpus_hash']}`), unigram entropy of "
        f"the val split {_fmt(setup['unigram_entropy'])} nats/token",
        f"- seeds: {setup['seeds']}",
        f"- machine: {m['platform']} ({m['device']}), {m['devices']} device(s), "
        f"{m['cpu_count']} CPU cores, jax {m['jax']}; NVFP4 GEMM backend: "
        f"{m['backend_nvfp4']}",
        "", "## Reading", "", *reading(summary), ""]
    return "\n".join(lines)


def reading(summary: dict[str, Any]) -> list[str]:
    """A plain-language account of what the numbers show and what they do not."""
    runs, setup = summary["runs"], summary["setup"]
    out = []
    ent = setup.get("unigram_entropy")
    b = runs.get("bf16")
    if b and b["final_val_loss"] is not None and ent:
        v = b["final_val_loss"]
        if v < ent:
            out.append(f"- The bf16 run reached a validation loss of {v:.3f} nats/token, "
                       f"{'well ' if v < 0.8 * ent else ''}below the corpus's unigram entropy "
                       f"({ent:.3f}): the model learned structure beyond token frequencies.")
        else:
            out.append(f"- The bf16 run's validation loss ({v:.3f} nats/token) is NOT below "
                       f"the unigram entropy ({ent:.3f}): the model is undertrained, so the "
                       "gaps below say little; train longer (steps=...).")
    for name, r in runs.items():
        g = r["rel_gap_vs_bf16"]
        if name == "bf16" or g is None:
            continue
        g8 = r["rel_gap_vs_fp8"]
        extra = f" and {g8:+.2f}% vs fp8" if (g8 is not None and name != "fp8") else ""
        ho = ", ".join(f"{k}: {v:+.2f}%" for k, v in r["heldout_gap_vs_bf16"].items()
                       if v is not None)
        out.append(f"- `{name}`: final val loss {g:+.2f}% vs bf16{extra}"
                   + (f" (second held-out corpus {ho})" if ho else "") + ".")
    nv = runs.get("nvfp4")
    if nv and nv["rel_gap_vs_bf16"] is not None:
        g = nv["rel_gap_vs_bf16"]
        out.append(
            f"- The paper reports NVFP4 about 1-1.5% above FP8 in loss at 12B parameters and "
            f"10T tokens; here, at {setup['params']:,} parameters and {setup['tokens']:,} "
            f"tokens, NVFP4 is {g:+.2f}% vs bf16"
            + (f" and {nv['rel_gap_vs_fp8']:+.2f}% vs fp8" if nv["rel_gap_vs_fp8"] is not None
               else "") + ".")
        abl = {k: runs[k]["rel_gap_vs_bf16"] for k in ABLATIONS
               if k in runs and runs[k]["rel_gap_vs_bf16"] is not None}
        noise = _noise_pct(runs)
        if abl:
            out.append(f"- Ablations (gap vs bf16; full nvfp4 {g:+.2f}%): "
                       + ", ".join(f"`{k}` {v:+.2f}%" for k, v in abl.items()) + ".")
            if noise is None:
                out.append("  With one seed the run-to-run spread is unknown, so an ablation "
                           "that differs from nvfp4 by a percent or two is not evidence that "
                           "the component helps or hurts; add `--seeds 0,1,2`.")
            else:
                tol = 2 * noise
                for k, v in abl.items():
                    d = v - g
                    verdict = ("within noise of nvfp4" if abs(d) <= tol else
                               "worse than nvfp4: the removed part helps here" if d > 0 else
                               "better than nvfp4: the removed part does not help here")
                    out.append(f"  - `{k}`: {d:+.2f} points vs nvfp4, {verdict} "
                               f"(2 x seed std = {tol:.2f} points).")
        elif abs(g) > 2:
            out.append("- The NVFP4 gap exceeds 2%: run the ablations "
                       "(`--ablations all`) to see which part of the recipe it comes from.")
    if len(setup["seeds"]) < 2:
        out.append("- Only one seed was run, so run-to-run noise is not measured: gaps of a "
                   "few tenths of a percent may be noise. Use `--seeds 0,1,2` for a spread.")
    out.append("- What this does not show: behaviour at billions of parameters and trillions "
               "of tokens (the paper's regime), downstream-task accuracy, or speed on FP4 "
               "hardware (the GEMMs here are emulated unless the backend says native).")
    return out


def _noise_pct(runs: dict[str, dict[str, Any]]) -> float | None:
    """Largest seed standard deviation of a final val loss, in % of that loss."""
    vals = [100 * r["final_val_loss_std"] / r["final_val_loss"] for r in runs.values()
            if r.get("final_val_loss_std") and r.get("final_val_loss")]
    return max(vals) if vals else None


def _plots(out: Path, curves: dict[str, list[tuple[int, float, dict]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["axes.prop_cycle"] = plt.cycler(color=plt.get_cmap("tab20").colors)
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, pts in curves.items():
        if not pts:
            continue
        style = "--" if name in ABLATIONS else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=2, label=name)
        tail = pts[len(pts) // 3:]  # zoom: the last two thirds, where the gaps show
        zoom.plot([p[0] for p in tail], [p[1] for p in tail], style, marker="o", ms=2,
                  label=name)
    ax.set_yscale("log")
    ax.set_title("Validation loss vs tokens (log scale)")
    zoom.set_title("Last two thirds of training")
    for a in (ax, zoom):
        a.set_xlabel("training tokens")
        a.set_ylabel("validation loss (nats/token)")
        a.grid(alpha=0.3)
    zoom.legend(fontsize=8)
    fig.tight_layout()
    _save_fig(fig, out / "convergence.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ref = {p[0]: p[1] for p in curves.get("bf16", [])}
    for name, pts in curves.items():
        if name == "bf16":
            continue
        xs = [(t, 100 * (v - ref[t]) / ref[t]) for t, v, _ in pts if t in ref and t > 0]
        if xs:
            ax.plot([x[0] for x in xs], [x[1] for x in xs], "--" if name in ABLATIONS else "-",
                    marker="o", ms=3, label=name)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("relative val-loss gap to bf16 (%)")
    ax.set_title("Gap to bf16 vs tokens")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save_fig(fig, out / "gap.png")
    plt.close(fig)


def _save_fig(fig, path: Path) -> None:
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
