"""docs/ptq/testbed.py's table (RTN vs GPTQ vs GPTQ + search on the QAT test bed) from
synthetic quantize reports: gaps, the fraction of RTN NVFP4's gap closed, paired
differences from the per-batch losses, and its refusals."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "ptq" / "testbed.py"


@pytest.fixture(scope="module")
def testbed():
    spec = importlib.util.spec_from_file_location("ptq_testbed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(root: Path, name: str, losses: dict[str, list[float]]) -> None:
    points = {
        k: {
            "val_ppl": math.exp(float(np.mean(v))),
            "val_loss": float(np.mean(v)),
            "effective_bits": 4.5 if "4" in k else 16.0,
            "batch_losses": v,
        }
        for k, v in losses.items()
    }
    (root / name).mkdir(parents=True)
    (root / name / "report.json").write_text(json.dumps({"points": points}))


def _seed(root: Path, seed: int, rng) -> dict[str, dict[str, list[float]]]:
    base = list(2.0 + 0.1 * rng.standard_normal(4))
    out = {}
    for k, shift in (("r", 0.10), ("q", 0.08), ("g", 0.04)):
        pts = {
            "bf16": base,
            "uniform_nvfp4": [b + shift for b in base],
            "uniform_mxfp4": [b + 2 * shift for b in base],
            "searched": [b + shift / 2 for b in base],
        }
        _write(root, f"{k}-{seed}-w", pts)
        out[k] = pts
    return out


def test_table_gaps_closed_fractions_and_pairs(testbed, tmp_path, capsys):
    rng = np.random.default_rng(0)
    made = {s: _seed(tmp_path, s, rng) for s in (0, 1, 2)}
    got = testbed.table(tmp_path, [0, 1, 2], "w")
    for s in (0, 1, 2):
        row = got["per_seed"][s]["points"]
        ppl = {k: math.exp(np.mean(v)) for k, v in made[s]["g"].items()}
        rtn = math.exp(np.mean(made[s]["r"]["uniform_nvfp4"]))
        want = (rtn - ppl["searched"]) / (rtn - ppl["bf16"])
        assert row["searched at 5.0 bits, GPTQ + MSE scale + four over six"][
            "closed"
        ] == pytest.approx(want)
        assert row["uniform NVFP4, RTN"]["gap"] == pytest.approx(100 * (math.exp(0.1) - 1))
        pair = got["per_seed"][s]["pairs"][
            "GPTQ + MSE scale + four over six uniform_nvfp4 - RTN uniform_nvfp4"
        ]
        assert pair == pytest.approx(0.04 - 0.10)
        over = got["per_seed"][s]["pairs_over_batches"][
            "GPTQ + MSE scale + four over six searched - RTN bf16"
        ]
        assert over["mean"] == pytest.approx(0.02) and over["n"] == 4
    assert "RTN NVFP4 gap closed" in capsys.readouterr().out


def test_reports_without_batch_losses_are_refused(testbed, tmp_path):
    _seed(tmp_path, 0, np.random.default_rng(1))
    rep = tmp_path / "g-0-w" / "report.json"
    data = json.loads(rep.read_text())
    del data["points"]["uniform_nvfp4"]["batch_losses"]
    rep.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="no per-batch losses"):
        testbed.seed_row(tmp_path, 0, "w")
