"""One calibrator for ``quantize activations=true`` and ``export activations=true``
(:mod:`microscale.ptq.run`): the same checkpoint and calibration text give the same input
amax table, on the same batches."""

from __future__ import annotations

import numpy as np
import pytest

from microscale.data import DataConfig, load_data
from microscale.inference import export_run as export_module
from microscale.ptq import QuantizeConfig, calibration_batches
from microscale.train import load_checkpoint
from microscale.workflows import quantize_run


def test_batches_by_count_are_the_batches_by_tokens(corpus_dir, tmp_path):
    """Export asks for batches, quantize for tokens: n batches are n * rows * seq tokens,
    drawn after the evaluation windows."""
    data = load_data(
        DataConfig(
            corpus=corpus_dir,
            heldout="none",
            seq_len=32,
            batch_size=4,
            eval_batches=2,
            val_fraction=0.2,
            cache_dir=str(tmp_path / "cache"),
        )
    )
    by_count, desc = calibration_batches(data, seed=3, n_batches=3)
    by_tokens, desc_t = calibration_batches(data, seed=3, n_tokens=3 * 4 * 32)
    assert by_count.shape == (3, 4, 33)
    np.testing.assert_array_equal(by_count, by_tokens)
    assert desc == desc_t == {"split": "val", "offset": 2 * 4 * 32 + 1, "corpus": corpus_dir}
    with pytest.raises(TypeError, match="n_tokens or n_batches"):
        calibration_batches(data, seed=0)


@pytest.mark.slow
def test_quantize_and_export_calibrate_the_same_amax(trained_run, tmp_path, monkeypatch):
    seen = {}

    def spy(model, batches, **kw):
        seen["batches"] = np.asarray(batches)
        seen["amax"] = real(model, batches, **kw)
        return seen["amax"]

    real = export_module.input_amax
    monkeypatch.setattr(export_module, "input_amax", spy)
    export_module.export_run(trained_run, tmp_path / "e", activations=True, calib_batches=2)
    data = load_checkpoint(trained_run)[1].data
    rows = data.eval_batch_size or data.batch_size
    assert seen["batches"].shape == (2, rows, data.seq_len + 1)
    cfg = QuantizeConfig(
        activations=True,
        calib_tokens=2 * rows * data.seq_len,  # export's calib_batches=2
        budget=6.0,
        formats=("nvfp4", "fp8_e4m3", "bf16"),
        uniform_formats=("nvfp4", "bf16"),
        pareto_budgets=(),
        ptq_effects=False,
    )
    result = quantize_run(trained_run, tmp_path / "q", cfg)
    assert result.calibration["batches"] == 2
    assert result.act_amax == seen["amax"]  # exactly: one function on the same batches
