"""The compare report on synthetic run folders: paired gaps, intervals, schema, verdicts.

Each run folder gets a ``summary.json`` as the trainer writes it, with losses chosen so the
paired per-seed gaps are known exactly; no training happens.
"""

import json
import math
from pathlib import Path

import pytest

from microscale.experiments import CompareConfig, write_report
from microscale.train import resolve_config

SMALL = [
    "model.d_model=64",
    "model.n_layers=4",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "seq_len=32",
    "batch_size=4",
]
# bf16 losses move a lot between seeds; the paired gaps do not.
BF16 = {0: 2.00, 1: 2.20, 2: 1.80}
GAPS = {  # % per seed vs bf16
    "fp8": {0: 0.1, 1: -0.1, 2: 0.3},
    "nvfp4": {0: 2.0, 1: 2.5, 2: 1.5},
    "nvfp4_no_sr": {0: 2.0, 1: 2.6, 2: 1.4},
}


def _loss(run, seed):
    return BF16[seed] * (1 + GAPS[run][seed] / 100) if run in GAPS else BF16[seed]


def _batches(mean, seed, run):
    # four batches around the mean; the paired difference has a known spread
    wob = [0.01, -0.01, 0.02, -0.02] if run == "bf16" else [0.02, -0.02, 0.01, -0.01]
    return [mean + w for w in wob]


@pytest.fixture()
def cmp_dir(tmp_path):
    base = resolve_config("tiny", SMALL)
    cfg = CompareConfig(
        base=base,
        runs=("bf16", "fp8", "nvfp4", "nvfp4_no_sr"),
        seeds=(0, 1, 2),
        out=str(tmp_path / "cmp"),
    )
    for (name, seed), d in cfg.run_dirs().items():
        d.mkdir(parents=True)
        v = _loss(name, seed)
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "status": "completed",
                    "recipe": cfg.run_config(name, seed).recipe,
                    "final_val_loss": v,
                    "final_val_losses": {"val": v, "docs": v + 0.5},
                    "final_val_batch_losses": {"val": _batches(v, seed, name)},
                    "final_train_loss": v,
                    "tokens": 768,
                    "tokens_per_s": 100.0,
                    "params": 1000,
                    "corpus_hash": "abc",
                    "unigram_entropy": 3.0,
                }
            )
        )
    return cfg


def test_paired_gap_mean_ci_and_schema(cmp_dir):
    s = write_report(cmp_dir)
    c = s["comparisons"]["nvfp4_vs_bf16"]
    # gaps 2.0, 2.5, 1.5: mean 2.0, sd 0.5, half-width 4.303 * 0.5 / sqrt(3) = 1.2421
    assert c["gap_mean"] == pytest.approx(2.0)
    assert c["gap_sd"] == pytest.approx(0.5)
    h = 4.303 * 0.5 / math.sqrt(3)
    assert c["gap_ci95"] == pytest.approx([2.0 - h, 2.0 + h], rel=1e-3)
    assert c["n_seeds"] == 3
    assert c["per_seed"] == pytest.approx({"0": 2.0, "1": 2.5, "2": 1.5})
    # eval: d_b = [.01, -.01, -.01, .01], sd = sqrt(4e-4 / 3); se = 100 sd / 2 / L_bf16
    sd_d = math.sqrt(4e-4 / 3)
    for seed, se in c["eval_se_per_seed"].items():
        assert se == pytest.approx(100 * sd_d / 2 / BF16[int(seed)], rel=1e-6)
    want = math.sqrt(sum((100 * sd_d / 2 / b) ** 2 for b in BF16.values())) / 3
    assert c["eval_se"] == pytest.approx(want, rel=1e-6)
    assert c["seeds_for_target"] == 7  # sd 0.5 -> t(6) 0.5 / sqrt(7) = 0.462 <= 0.5
    assert c["resolved"] is False
    assert "is worse than `bf16` by 2.00%" in c["verdict"]
    for key in ("gap_mean", "gap_ci95", "n_seeds", "eval_se", "per_seed"):
        assert key in s["comparisons"]["fp8_vs_bf16"]
    # the pairs: every run vs bf16 and fp8, the ablation vs nvfp4
    assert set(s["comparisons"]) == {
        "fp8_vs_bf16",
        "nvfp4_vs_bf16",
        "nvfp4_no_sr_vs_bf16",
        "nvfp4_vs_fp8",
        "nvfp4_no_sr_vs_fp8",
        "nvfp4_no_sr_vs_nvfp4",
    }
    # fp8: gaps .1, -.1, .3 -> mean .1, sd .2, CI contains 0
    assert "no difference detected" in s["comparisons"]["fp8_vs_bf16"]["verdict"]
    # runs keep their keys; rel_gap_vs_bf16 is the paired mean
    r = s["runs"]["nvfp4"]
    for k in (
        "recipe",
        "final_val_loss",
        "final_val_loss_std",
        "val_ppl",
        "rel_gap_vs_bf16",
        "rel_gap_vs_fp8",
        "heldout_losses",
        "heldout_gap_vs_bf16",
        "tokens",
        "tokens_per_s",
        "status",
        "seeds",
        "weight_bits_per_param",
    ):
        assert k in r, k
    assert r["rel_gap_vs_bf16"] == pytest.approx(2.0)
    assert s["runs"]["bf16"]["rel_gap_vs_bf16"] == 0.0
    assert s["runs"]["bf16"]["final_val_loss"] == pytest.approx(2.0)
    assert s["runs"]["bf16"]["final_val_loss_std"] == pytest.approx(0.2)
    on_disk = json.loads((Path(cmp_dir.out) / "summary.json").read_text())
    assert on_disk["comparisons"]["nvfp4_vs_bf16"]["n_seeds"] == 3


def test_report_prints_verdicts_resolution_and_paper_anchors(cmp_dir):
    write_report(cmp_dir)
    md = (Path(cmp_dir.out) / "report.md").read_text()
    assert "## Verdicts" in md and "is worse than `bf16` by 2.00%" in md
    assert "+2.00 ± 1.24%" in md  # the table's CI cell
    assert "NOT resolved to ±0.5 points" in md and "needs 7 seeds" in md
    # no_sr vs nvfp4: gaps 0, +0.1, -0.1 points of bf16 -> CI contains 0
    assert "| removing stochastic rounding hurts |" in md
    assert "not resolved at this size" in md
    assert "| NVFP4 vs FP8" in md
    for f in ("convergence.png", "gap.png"):
        assert (Path(cmp_dir.out) / f).stat().st_size > 0


def test_one_seed_is_not_a_verdict(tmp_path):
    base = resolve_config("tiny", SMALL)
    cfg = CompareConfig(base=base, runs=("bf16", "nvfp4"), seeds=(0,), out=str(tmp_path))
    for (name, seed), d in cfg.run_dirs().items():
        d.mkdir(parents=True)
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "status": "completed",
                    "recipe": name,
                    "final_val_loss": _loss(name, seed),
                    "final_val_losses": {"val": _loss(name, seed)},
                    "tokens": 1,
                    "params": 1,
                }
            )
        )
    s = write_report(cfg)
    c = s["comparisons"]["nvfp4_vs_bf16"]
    assert c["gap_ci95"] is None and c["n_seeds"] == 1 and c["eval_se"] is None
    assert "not a verdict" in c["verdict"]


def test_scaling_report_fits_the_trend_across_sizes(tmp_path):
    from microscale.experiments.compare import CompareConfig as CC
    from microscale.experiments.scaling import ScalingConfig, write_scaling_report

    base = resolve_config("tiny", SMALL[4:])  # seq_len / batch only; sizes set the model
    sc = ScalingConfig(
        compare=CC(base=base, runs=("bf16", "nvfp4"), seeds=(0, 1), out=str(tmp_path)),
        sizes=("0.16M", "0.6M", "1.7M"),
        tokens_per_param=0.01,
        min_steps=5,
    )
    # the gap falls by exactly 1 point per decade of parameters, +-0.1 between seeds
    for size in sc.sizes:
        c = sc.size_config(size)
        n = c.base.model.num_params()
        assert c.base.steps == max(5, round(0.01 * n / c.base.tokens_per_step))
        for (name, seed), d in c.run_dirs().items():
            d.mkdir(parents=True)
            gap = 5 - math.log10(n) + (0.1 if seed else -0.1)
            v = 2.0 * (1 + gap / 100) if name == "nvfp4" else 2.0
            (d / "summary.json").write_text(
                json.dumps(
                    {
                        "status": "completed",
                        "recipe": name,
                        "final_val_loss": v,
                        "final_val_losses": {"val": v},
                        "tokens": c.base.steps * 128,
                        "params": n,
                    }
                )
            )
    s = write_scaling_report(sc)
    t = s["trends"]["nvfp4_vs_bf16"]
    assert t["fit"]["slope"] == pytest.approx(-1.0)
    assert t["fit"]["n_points"] == 6
    assert t["direction"] == "shrinks"
    assert t["at_paper_size"]["gap"] == pytest.approx(5 - math.log10(12e9), abs=1e-6)
    assert list(s["sizes"]) == ["0.16M", "0.6M", "1.7M"]
    md = (tmp_path / "report.md").read_text()
    assert "the gap shrinks with size" in md and "tokens = 0.01 x parameters" in md
    assert (tmp_path / "scaling.png").stat().st_size > 0


def test_scaling_config_rejects_bad_sizes():
    from microscale.experiments.scaling import ScalingConfig

    with pytest.raises(ValueError, match="0.1M"):
        ScalingConfig(sizes=("0.1M", "1.7M"))
    with pytest.raises(ValueError, match="two or more"):
        ScalingConfig(sizes=("1.7M",))


@pytest.mark.parametrize(
    "runs, expected",
    [
        (("bf16", "nvfp4"), [("nvfp4", "bf16")]),
        (
            ("bf16", "fp8", "nvfp4", "mxfp4"),
            [
                ("fp8", "bf16"),
                ("nvfp4", "bf16"),
                ("mxfp4", "bf16"),
                ("nvfp4", "fp8"),
                ("mxfp4", "fp8"),
                ("mxfp4", "nvfp4"),
            ],
        ),
        # an ablation is read against nvfp4; the adaptive choice also against its warm-up control
        (
            ("nvfp4", "nvfp4_adaptive", "nvfp4_warmup"),
            [
                ("nvfp4_adaptive", "nvfp4"),
                ("nvfp4_warmup", "nvfp4"),
                ("nvfp4_adaptive", "nvfp4_warmup"),
            ],
        ),
        (("nvfp4", "nvfp4_adaptive"), [("nvfp4_adaptive", "nvfp4")]),  # no control in the set
    ],
)
def test_comparison_pairs(runs, expected):
    from microscale.experiments.report import comparison_pairs

    assert comparison_pairs(runs) == expected


def test_tokens_per_s_is_the_rate_tokens_were_trained_at(cmp_dir):
    """A seed batch's runs share one clock: a run's own tokens/s (100 here) times the
    batch's size is the rate its recipe was trained at; runs trained alone count once."""
    for (name, _), d in cmp_dir.run_dirs().items():
        if name == "nvfp4":
            s = json.loads((d / "summary.json").read_text())
            (d / "summary.json").write_text(json.dumps({**s, "seed_batch": 3}))
    runs = write_report(cmp_dir)["runs"]
    assert runs["nvfp4"]["tokens_per_s"] == pytest.approx(300.0)
    assert runs["bf16"]["tokens_per_s"] == pytest.approx(100.0)


# ---------------------------------------------------------------------- figures


def _captured(monkeypatch, *modules) -> list:
    """The figures the ``modules`` save, as ``(file name, figure)``, kept open for their
    artists (the files are still written)."""
    figs: list = []

    def keep(fig, path, **kw):
        figs.append((Path(path).name, fig))
        fig.savefig(path)

    for module in modules:
        monkeypatch.setattr(module, "save_figure", keep)
    return figs


def _colours(fig) -> dict[str, str]:
    """{label: colour hex} of every labelled line and error bar of a figure's axes."""
    from matplotlib.colors import to_hex

    out: dict[str, str] = {}
    for ax in fig.axes:
        for c in ax.containers:
            if c.get_label() and not c.get_label().startswith("_"):
                out.setdefault(c.get_label(), to_hex(c.lines[0].get_color()))
        for line in ax.get_lines():
            label = line.get_label()
            if label and not label.startswith("_"):
                got = to_hex(line.get_color())
                assert out.setdefault(label, got) == got, (label, got, out[label])
    return out


# seed -> losses at tokens 0, 100, ..., 500 (nvfp4 and the ablation a little above bf16)
SEED_CURVES = {
    name: {
        s: [(100 * i, (3.0 - 0.2 * i) * (1 + off + 0.01 * s)) for i in range(6)] for s in (0, 1, 2)
    }
    for name, off in (("bf16", 0.0), ("fp8", 0.001), ("nvfp4", 0.02), ("nvfp4_no_sr", 0.03))
}


def test_each_recipe_is_one_colour_in_every_figure(tmp_path, monkeypatch):
    """convergence.png, gap.png, scaling.png and quantize's pareto.png draw a recipe (or
    its format) in the colour of microscale.colors, whatever else is drawn and in what
    order; the table's colours are distinct."""
    from matplotlib.colors import to_hex

    from microscale import files
    from microscale.colors import STYLES, style
    from microscale.experiments import report
    from microscale.experiments.runs import RUNS
    from microscale.ptq import report as ptq_report

    figs = _captured(monkeypatch, report, ptq_report)
    report._plots(tmp_path, SEED_CURVES)
    # the same runs in another order, and fewer of them: the colours stay
    report._plots(tmp_path, {k: SEED_CURVES[k] for k in ("nvfp4", "bf16")})
    ptq_report.plot_pareto(
        {
            "budget": 5.0,
            "points": {
                "bf16": {"kind": "uniform", "effective_bits": 16.0, "val_ppl": 10.0},
                **{
                    f"uniform_{f}": {"kind": "uniform", "effective_bits": b, "val_ppl": 11.0}
                    for f, b in (("nvfp4", 4.5), ("fp8_e4m3", 8.0), ("mxfp4", 4.25))
                },
                "heuristic": {"kind": "heuristic", "effective_bits": 6.0, "val_ppl": 10.5},
                "searched": {"kind": "searched", "effective_bits": 5.0, "val_ppl": 10.4},
            },
        },
        tmp_path / "pareto.png",
    )
    names = [n for n, _ in figs]
    assert names == ["convergence.png", "gap.png", "convergence.png", "gap.png", "pareto.png"]
    seen: dict[str, set[str]] = {}
    for _, fig in figs[:4]:
        for label, colour in _colours(fig).items():
            seen.setdefault(label, set()).add(colour)
    assert set(seen) == set(SEED_CURVES)
    for label, colours in seen.items():
        assert colours == {to_hex(style(label).color)}, (label, colours)
    # pareto: each uniform point in its format's colour (fp8_e4m3 is fp8's)
    pareto = figs[4][1].axes[0]
    squares = [ln for ln in pareto.get_lines() if ln.get_marker() == "s"]
    assert sorted(to_hex(ln.get_color()) for ln in squares) == sorted(
        to_hex(style(f).color) for f in ("bf16", "nvfp4", "fp8", "mxfp4")
    )
    others = {to_hex(ln.get_color()) for ln in pareto.get_lines() if ln.get_marker() != "s"}
    formats = {to_hex(style(f).color) for f in ("bf16", "nvfp4", "fp8", "mxfp4", "mxfp8", "q8_0")}
    assert not others & formats, others  # searched / heuristic: no format's colour
    # scaling.png: each trend in its run's colour
    from microscale.experiments import scaling, stats

    sizes = {
        s: {
            "params": n,
            "comparisons": {
                k: {"gap_mean": g, "gap_half_width": 0.1}
                for k, g in (("nvfp4_vs_bf16", 1.0), ("fp8_vs_bf16", 0.1))
            },
        }
        for s, n in (("a", 1e5), ("b", 1e6), ("c", 1e7))
    }
    fit = stats.loglinear_fit([1e5, 1e6, 1e7], [1.2, 1.0, 0.7])
    trends = {k: {"fit": fit} for k in ("fp8_vs_bf16", "nvfp4_vs_bf16")}
    files_figs = _captured(monkeypatch, files)
    scaling._plot(tmp_path / "scaling.png", sizes, trends)
    [(_, fig)] = files_figs
    got = _colours(fig)
    assert got == {k: to_hex(style(k.split("_vs_")[0]).color) for k in trends}, got
    assert got["nvfp4_vs_bf16"] == to_hex(style("nvfp4").color) == seen["nvfp4"].pop()
    # every run compare knows has its own entry; no two entries share a colour
    assert set(RUNS) <= set(STYLES)
    hexes = [to_hex(s.color) for s in STYLES.values()]
    assert len(set(hexes)) == len(hexes)


def test_convergence_shows_every_seed(tmp_path, monkeypatch):
    """The convergence line is the mean over the seeds and its band spans their min and
    max at every point (not the first seed alone)."""
    import numpy as np

    from microscale.experiments import report

    figs = _captured(monkeypatch, report)
    report._plots(tmp_path, {"bf16": SEED_CURVES["bf16"]})
    full = figs[0][1].axes[0]
    [line] = [ln for ln in full.get_lines() if ln.get_label() == "bf16"]
    seeds = np.array([[v for _, v in pts] for pts in SEED_CURVES["bf16"].values()])
    np.testing.assert_allclose(line.get_ydata(), seeds.mean(0))
    [band] = full.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(seeds.min()) and ys.max() == pytest.approx(seeds.max())
    assert "mean of 3 seeds" in full.get_title()
