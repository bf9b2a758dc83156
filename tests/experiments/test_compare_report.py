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
