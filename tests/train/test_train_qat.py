"""QAT: fine-tune with the allocation `microscale quantize` searched, then export it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microscale.model import PrecisionRules, rules_for_training
from microscale.train import train


@pytest.mark.slow
def test_qat_trains_the_searched_allocation_and_export_writes_it(make_cfg, tmp_path, capsys):
    from microscale.cli import main
    from microscale.ptq import QuantizeConfig
    from microscale.workflows import quantize_run

    src = make_cfg("steps=10", f"out={tmp_path / 'src'}")
    train(src, progress=False)
    q = tmp_path / "q"
    res = quantize_run(
        src.out,
        q,
        QuantizeConfig(
            budget=6.0,
            formats=("nvfp4", "fp8_e4m3", "bf16"),
            calib_tokens=256,
            pareto_budgets=(),
            ptq_effects=False,
            uniform_formats=("nvfp4", "bf16"),
        ),
        layout="microscale",
    )
    formats = res.allocation.formats
    assert len(set(formats.values())) > 1  # a mixed allocation
    assert "trained" not in res.points  # a positional bf16 run trained no allocation

    qat = make_cfg(
        f"init_from={q}",
        "precision.kind=rules",
        f"precision.rules={q / 'precision_rules.json'}",
        "steps=2",
        "eval_every=1",
        f"out={tmp_path / 'qat'}",
    )
    s = train(qat, progress=False)
    assert s["init_from"]["weights"] == "master"
    rules = rules_for_training(PrecisionRules.load(q / "precision_rules.json"), "backward")
    assert s["precision"] == {p: rules.resolve_name(p) for p in s["precision"]}
    # the run's first evaluation is the fake-quantized model: near the PTQ loss measured by
    # quantize (RTN tensor scales here, MSE-searched ones there), far from bf16's
    evals = [json.loads(x) for x in Path(qat.out, "metrics.jsonl").read_text().splitlines()]
    v0 = next(r["val_loss"] for r in evals if r["kind"] == "eval" and r["step"] == 0)
    assert v0 == pytest.approx(res.points["searched"]["val_loss"], rel=0.02)

    # quantize of the QAT run evaluates the allocation it trained with, export's allocation
    from microscale.ptq import trained_allocation
    from microscale.train import load_checkpoint

    assert trained_allocation(qat.out, load_checkpoint(qat.out)[1]) == formats
    assert trained_allocation(src.out, load_checkpoint(src.out)[1]) is None

    out = tmp_path / "export"
    assert main(["export", "--model", qat.out, "--out", str(out)]) == 0, capsys.readouterr().err
    marker = next(out.glob("*microscale*.json"))
    layers = json.loads(marker.read_text())["layers"]
    assert {p: v["weights"] for p, v in layers.items()} == formats


@pytest.mark.slow
def test_rules_with_custom_recipes_train(make_cfg, tmp_path):
    """A quantize output's rules hold recipes that are not presets (ptq_<fmt>+bf16_...)."""
    from microscale.ptq import allocation_rules

    rules = allocation_rules(
        {
            "layers.0.attn.q_proj": "fp8_e4m3",
            "layers.0.attn.k_proj": "fp8_e4m3",
            "layers.0.attn.v_proj": "fp8_e4m3",
            "layers.1.mlp.down_proj": "nvfp4",
        }
    )
    path = tmp_path / "rules.json"
    rules.save(path)
    s = train(
        make_cfg(
            "precision.kind=rules", f"precision.rules={path}", "steps=1", f"out={tmp_path / 'r'}"
        ),
        progress=False,
    )
    assert s["status"] == "completed"
    assert s["precision"]["layers.0.attn.q_proj"] == "ptq_fp8_e4m3+bf16_backward_inputs"
    assert s["precision"]["layers.1.mlp.down_proj"] == "ptq_nvfp4+bf16_backward_inputs"
