"""quantize_model end to end on a tiny model: report, budget, groups, pins, rules, files,
checkpoint round trip, W4A4, determinism."""

from __future__ import annotations

import json

import numpy as np
import pytest

from microscale.formats import dequantize
from microscale.ops import get_recipe
from microscale.ptq import (
    QuantizeConfig,
    WeightPTQ,
    calibration_windows,
    heuristic_allocation,
    quantize_model,
    read_own_checkpoint,
    write_outputs,
)

CFG = QuantizeConfig(
    budget=5.5,
    formats=("nvfp4", "mxfp4", "fp8_e4m3", "bf16"),
    uniform_formats=("nvfp4", "fp8_e4m3", "bf16"),
    pareto_budgets=(4.5, 6.0),
    pin=((r"layers\.1\.attn\.o_proj", "bf16"),),
    ptq=WeightPTQ(scale_grid=(0.8, 1.0, 1.2)),
)


@pytest.fixture(scope="module")
def result(tiny_model, token_batches):
    calib, evals = token_batches
    return quantize_model(tiny_model, calib, evals, CFG)


@pytest.mark.slow
def test_report_contents(result):
    rep = result.report().to_dict()
    for key in (
        "budget",
        "effective_bits",
        "val_ppl",
        "layers",
        "scores",
        "scores_raw",
        "act_amax",
        "weight_stats",
        "ptq_effects",
        "calibration",
        "points",
    ):
        assert key in rep, key
    assert set(rep["val_ppl"]) >= {"bf16", "uniform_nvfp4", "heuristic", "searched"}
    assert rep["budget"] == 5.5 and rep["effective_bits"] <= 5.5
    assert set(rep["layers"]) == set(result.paths) and len(result.paths) == 14
    assert all(np.isfinite(v) and v > 1 for v in rep["val_ppl"].values())
    assert rep["points"]["uniform_nvfp4"]["effective_bits"] == pytest.approx(
        (4.5 * sum(result.numel.values()) + 11.5 * result.numel["layers.1.attn.o_proj"])
        / sum(result.numel.values())
    )
    # both averages, named: the linear layers, and the whole model (other params at 16 bits)
    lin = sum(result.numel.values())
    other = result.engine.other_numel
    assert other > 0 and rep["linear_bits"] == rep["effective_bits"]  # the budget's measure
    for pt in rep["points"].values():
        assert pt["model_bits"] == pytest.approx(
            (pt["linear_bits"] * lin + 16 * other) / (lin + other)
        )
    assert rep["model_bits"] > rep["linear_bits"] and rep["points"]["bf16"]["model_bits"] == 16
    eff = rep["ptq_effects"]
    assert set(eff["weights"]["uniform_nvfp4"]) == {"rtn", "mse_scale", "four_over_six", "both"}
    assert set(eff["weights"]["uniform_fp8_e4m3"]) == {"rtn", "mse_scale"}
    assert set(eff["activations"]["uniform_nvfp4"]) == {"weight_only", "dynamic", "static"}
    # the run's own choices (both) are its uniform point, and its searched point
    assert eff["weights"]["uniform_nvfp4"]["both"] == rep["val_ppl"]["uniform_nvfp4"]
    assert eff["weights"]["searched"]["both"] == rep["val_ppl"]["searched"]
    assert json.loads(json.dumps(rep)) is not None


def test_released_weights_are_computed_again_the_same(tiny_model):
    """The PTQ-effects table forgets each variant's weights after use (memory): the
    variant's entries go, the others stay, and asking again gives the same bits."""
    from microscale.ptq.engine import Engine
    from microscale.ptq.weights import WeightCache

    engine = Engine(tiny_model)
    w = WeightCache(engine, {p: p for p in engine.paths})
    rtn, kept = WeightPTQ.rtn(), WeightPTQ()
    first = {f: w.get(f, rtn) for f in ("nvfp4", "fp8_e4m3")}
    held = w.get("nvfp4", kept)
    w.release(rtn)
    assert w.get("nvfp4", kept) is held  # another variant: still held
    for f, before in first.items():
        again = w.get(f, rtn)
        assert again is not before
        for p in engine.paths:
            np.testing.assert_array_equal(np.asarray(again[p].values), np.asarray(before[p].values))


def test_allocation_respects_groups_pins_and_rules(result):
    a = result.allocation.formats
    assert a["layers.1.attn.o_proj"] == "bf16"
    for i in range(2):
        assert len({a[f"layers.{i}.attn.{n}_proj"] for n in "qkv"}) == 1
        assert a[f"layers.{i}.mlp.gate_proj"] == a[f"layers.{i}.mlp.up_proj"]
    for p, f in a.items():  # the PrecisionRules say the same, layer by layer
        assert get_recipe(result.rules.resolve(p)).fprop_w.format == f
        assert not get_recipe(result.rules.resolve(p)).fprop_x.quantized
    # searched points never exceed their budgets
    for label, pt in result.points.items():
        if "budget" in pt:
            assert pt["effective_bits"] <= pt["budget"] + 1e-9, label
    # fused groups share one tensor scale
    q, k = result.weights["layers.0.attn.q_proj"], result.weights["layers.0.attn.k_proj"]
    assert q.amax == k.amax


def test_heuristic_allocation():
    paths = [
        f"layers.{i}.{m}"
        for i in range(4)
        for m in ("attn.q_proj", "attn.k_proj", "mlp.up_proj", "mlp.down_proj")
    ]
    h = heuristic_allocation(paths, "fp8_e4m3", "nvfp4", pinned={"layers.3.attn.q_proj": "bf16"})
    assert h["layers.0.attn.q_proj"] == "fp8_e4m3" and h["layers.3.mlp.up_proj"] == "fp8_e4m3"
    assert h["layers.1.mlp.down_proj"] == "fp8_e4m3" and h["layers.2.attn.k_proj"] == "nvfp4"
    assert h["layers.3.attn.q_proj"] == "bf16"


def test_files_and_own_checkpoint_roundtrip(result, tmp_path):
    write_outputs(result, tmp_path, layout="microscale")
    for name in (
        "precision_rules.json",
        "report.json",
        "report.md",
        "pareto.png",
        "sensitivity.png",
        "checkpoint/model.safetensors",
        "checkpoint/manifest.json",
        "checksums.json",
    ):
        assert (tmp_path / name).is_file(), name
    # the listing covers every file but the weights (whose tensors store their own CRC-32s)
    listed = json.loads((tmp_path / "checksums.json").read_text())["files"]
    assert set(listed) == {
        "precision_rules.json",
        "report.json",
        "report.md",
        "pareto.png",
        "sensitivity.png",
        "checkpoint/manifest.json",
    }
    from microscale.model import PrecisionRules

    rules = PrecisionRules.load(tmp_path / "precision_rules.json")
    assert rules == result.rules
    qs, params, manifest = read_own_checkpoint(tmp_path / "checkpoint")
    for p, w in result.weights.items():
        np.testing.assert_array_equal(np.asarray(dequantize(qs[p])).T, np.asarray(w.values))
        assert manifest["layers"][p]["format"] == w.format
    assert "embed.embedding" in params
    md = (tmp_path / "report.md").read_text()
    assert "| searched |" in md and "layers.0.attn.q_proj" in md


@pytest.mark.slow
def test_w4a4_and_determinism(tiny_model, token_batches):
    calib, evals = token_batches
    cfg = QuantizeConfig(
        budget=6.0,
        formats=("nvfp4", "fp8_e4m3", "bf16"),
        uniform_formats=("nvfp4", "bf16"),
        pareto_budgets=(),
        ptq=WeightPTQ.rtn(),
        activations=True,
        ptq_effects=False,
    )
    a = quantize_model(tiny_model, calib, evals, cfg)
    b = quantize_model(tiny_model, calib, evals, cfg)
    assert a.allocation.formats == b.allocation.formats
    assert a.scores == b.scores and a.val_ppl == b.val_ppl
    p = next(p for p, f in a.allocation.formats.items() if f != "bf16")
    assert get_recipe(a.rules.resolve(p)).fprop_x.quantized


def test_calibration_windows_are_seeded_and_disjoint_from_eval():
    toks = np.arange(10_000, dtype=np.int32)
    a = calibration_windows(toks, n_tokens=600, seq_len=32, rows=4, seed=3, start=5000)
    b = calibration_windows(toks, n_tokens=600, seq_len=32, rows=4, seed=3, start=5000)
    c = calibration_windows(toks, n_tokens=600, seq_len=32, rows=4, seed=4, start=5000)
    assert a.shape == (5, 4, 33)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 5000
    assert np.all(np.diff(a, axis=-1) == 1)  # contiguous windows
    assert calibration_windows(toks[:50], n_tokens=600, seq_len=32, rows=4, seed=0) is None


def test_config_validation_messages():
    with pytest.raises(ValueError, match="budget"):
        QuantizeConfig(budget=0)
    for keys in ({"formats": ("bf16",)}, {"formats": ("bf16",), "awq": True, "budget": 16}):
        with pytest.raises(ValueError, match=r"formats=bf16: no quantized format, .*nvfp4,bf16"):
            QuantizeConfig(**keys)
    with pytest.raises(ValueError, match="unknown format"):
        QuantizeConfig(formats=("nvfp4", "fp3"))
    with pytest.raises(ValueError, match="method"):
        QuantizeConfig(method="hessian")
    with pytest.raises(ValueError, match="regex"):
        QuantizeConfig(pin=(("(", "bf16"),))
    assert QuantizeConfig(formats="nvfp4, bf16").formats == ("nvfp4", "bf16")


# (id, QuantizeConfig keys, the error's text): a budget below the cheapest allocation (the
# layers' sizes, candidates, groups and pins decide it; no score does) is refused before
# any phase, AWQ's included, has started. TINY: 14 linear layers, 32,896 embedding values.
BELOW_CHEAPEST = [
    (
        "every-format",
        {"budget": 2.0},
        "budget 2.0 bits/element is below the cheapest "
        "allocation (4.2500 bits/element: every layer in its cheapest allowed format)",
    ),
    ("nvfp4-bf16", {"budget": 4.4, "formats": ("nvfp4", "bf16")}, "(4.5000 bits/element"),
    ("awq", {"budget": 2.0, "awq": True}, "budget 2.0 bits/element is below the cheapest"),
    ("pinned-bf16", {"budget": 8.0, "pin": ((".*", "bf16"),)}, "(16.0000 bits/element"),
    ("embedding-searched", {"budget": 4.0, "count_other_params": True}, "(4.3070 bits/"),
    (
        "embedding-bf16",
        {"budget": 4.0, "count_other_params": True, "embed_formats": ("bf16",)},
        "(7.2388 bits/element",
    ),
]


@pytest.mark.parametrize(
    "keys, expected", [c[1:] for c in BELOW_CHEAPEST], ids=[c[0] for c in BELOW_CHEAPEST]
)
def test_budget_below_the_cheapest_is_refused_before_any_work(
    tiny_model, token_batches, keys, expected
):
    from microscale.ptq import check_quantize_budget

    cfg = QuantizeConfig(**keys)
    with pytest.raises(ValueError) as e:
        check_quantize_budget(tiny_model, cfg)
    assert expected in str(e.value), str(e.value)
    logged: list[str] = []
    calib, evals = token_batches
    with pytest.raises(ValueError) as e2:
        quantize_model(tiny_model, calib, evals, cfg, log=logged.append)
    assert str(e2.value) == str(e.value)
    assert logged == []  # no phase began (AWQ, calibration, scoring)


def test_export_layout_roundtrip(result, tiny_model, tmp_path):
    """The checkpoint goes through microscale.export (compressed-tensors) and reads back to
    exactly the weights PTQ chose (MSE scale and four-over-six included)."""
    export = pytest.importorskip("microscale.export")
    rep = write_outputs(result, tmp_path, model_config=tiny_model.config)
    ck = rep["checkpoint"]
    assert ck["layout"] == "compressed-tensors" and "fallback_reason" not in ck, ck
    back = export.read_checkpoint(tmp_path / "checkpoint").dequantized_params()
    for p, w in result.weights.items():
        np.testing.assert_array_equal(
            np.asarray(back[f"{p}.kernel"], np.float32),
            np.asarray(w.values.astype("bfloat16"), np.float32)
            if w.format == "bf16"
            else np.asarray(w.values),
        )


def test_default_method_is_taylor_and_monotone_follows_the_sign(result):
    cfg = QuantizeConfig()
    assert cfg.method == "taylor" and cfg.calib_tokens == 65536
    assert not cfg.use_monotone  # signed loss changes: no monotone correction
    assert not QuantizeConfig(method="loss").use_monotone
    assert QuantizeConfig(method="gradient").use_monotone
    assert QuantizeConfig(method="kl").use_monotone
    assert QuantizeConfig(method="taylor", monotone=True).use_monotone
    assert not QuantizeConfig(method="gradient", monotone=False).use_monotone
    # the fixture run (default method): raw taylor scores go to the search as they are
    assert result.config.method == "taylor" and result.report().monotone is False
    assert result.scores == result.scores_raw


def test_paired_comparisons_and_markdown(result, tmp_path):
    from microscale.ptq.report import write_markdown

    rep = result.report().to_dict()
    comp = rep["comparisons"]
    assert set(comp) == {"searched - heuristic", "searched - uniform_nvfp4", "searched - bf16"}
    pts = rep["points"]
    for name, c in comp.items():
        ref = name.split(" - ")[1]
        assert c["dloss"] == pytest.approx(
            pts["searched"]["val_loss"] - pts[ref]["val_loss"], abs=1e-9
        )
        assert c["batches"] == 2 and c["se"] >= 0
        if c["se"] > 0:
            assert c["t"] == pytest.approx(c["dloss"] / c["se"])
        # each point's per-batch losses pair the same way (benchmarks/paired_points.py)
        d = np.subtract(pts["searched"]["batch_losses"], pts[ref]["batch_losses"])
        assert len(d) == 2 and np.mean(d) == pytest.approx(c["dloss"], abs=1e-9)
    for p in pts.values():
        assert np.mean(p["batch_losses"]) == pytest.approx(p["val_loss"], abs=1e-9)
    write_markdown(rep, tmp_path / "a.md")
    md = (tmp_path / "a.md").read_text()
    assert "## Paired differences" in md and "| searched - heuristic |" in md
    assert "measured WORSE than round-to-nearest" not in md or any(
        row["both"] > row["rtn"] for row in rep["ptq_effects"]["weights"].values() if "both" in row
    )
    # a PTQ choice that measured worse than RTN is called out
    bad = json.loads(json.dumps(rep))
    bad["ptq_effects"]["weights"]["uniform_nvfp4"].update(rtn=1.0, both=2.0)
    write_markdown(bad, tmp_path / "b.md")
    md = (tmp_path / "b.md").read_text()
    assert "measured WORSE than round-to-nearest on uniform_nvfp4" in md
    assert "| uniform_nvfp4 | 1.0000 |" in md and md.count("| rtn |") >= 1


@pytest.mark.slow
@pytest.mark.parametrize("activations", [False, True])
def test_trained_allocation_point(tiny_model, token_batches, activations, tmp_path):
    """A QAT run's own allocation is evaluated as the point "trained", rounded to nearest
    (as QAT and export round), exactly as the same allocation evaluated as a uniform point
    of a round-to-nearest run; "trained_ptq" with the run's PTQ choices, exactly as that
    run's uniform point; pins win; a format outside the candidates (mxfp8 here) still runs,
    inputs included; paired differences come with it."""
    from microscale.ptq.report import write_markdown

    calib, evals = token_batches
    base = dict(
        budget=6.0,
        formats=("nvfp4", "fp8_e4m3", "bf16"),
        pareto_budgets=(),
        activations=activations,
        ptq_effects=False,
        pin=((r"layers\.1\.attn\.o_proj", "bf16"),),
    )
    uniform = ("nvfp4", "mxfp8", "bf16")
    ref = {
        name: quantize_model(
            tiny_model, calib, evals, QuantizeConfig(**base, ptq=ptq, uniform_formats=uniform)
        )
        for name, ptq in (("rtn", WeightPTQ.rtn()), ("ptq", WeightPTQ()))
    }
    assert "trained" not in ref["rtn"].points  # nothing trained -> no such point
    paths = ref["rtn"].paths
    for fmt in ("nvfp4", "mxfp8"):
        got = quantize_model(
            tiny_model,
            calib,
            evals,
            QuantizeConfig(**base, ptq=WeightPTQ(), uniform_formats=("nvfp4", "bf16")),
            trained=dict.fromkeys(paths, fmt),
        )
        for label, r in (("trained", ref["rtn"]), ("trained_ptq", ref["ptq"])):
            t, u = got.points[label], r.points[f"uniform_{fmt}"]
            assert t["kind"] == label
            assert t["val_loss"] == pytest.approx(u["val_loss"], abs=1e-6), (fmt, label)
            assert t["effective_bits"] == pytest.approx(u["effective_bits"])  # o_proj pinned
            c = got.comparisons[f"{label} - bf16"]
            assert c["dloss"] == pytest.approx(
                t["val_loss"] - got.points["bf16"]["val_loss"], abs=1e-9
            )
        assert {"trained - uniform_nvfp4", "searched - bf16"} <= set(got.comparisons)
    rep = got.report().to_dict()
    write_markdown(rep, tmp_path / "r.md")
    assert "`trained_ptq`: the same allocation" in (tmp_path / "r.md").read_text()
    # with round-to-nearest PTQ the two points would be one: only "trained"
    rtn = quantize_model(
        tiny_model,
        calib,
        evals,
        QuantizeConfig(**base, ptq=WeightPTQ.rtn(), uniform_formats=("nvfp4", "bf16")),
        trained=dict.fromkeys(paths, "nvfp4"),
    )
    assert "trained" in rtn.points and "trained_ptq" not in rtn.points
    with pytest.raises(ValueError, match=r"no format for 1 layer.*layers\.0\.attn\.q_proj"):
        quantize_model(
            tiny_model,
            calib,
            evals,
            QuantizeConfig(**base),
            trained={p: "nvfp4" for p in paths if p != "layers.0.attn.q_proj"},
        )
