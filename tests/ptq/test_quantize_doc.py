"""docs/quantize.md's in-memory example, run as written: a model built in Python, its
calibration batches from a generator, and the folder ``write_outputs`` leaves, which
``microscale`` reads back as a quantize output with the allocation the search chose."""

from __future__ import annotations

import json

import pytest

from doc_blocks import marked_blocks, run_block
from microscale.export import read_checkpoint
from microscale.outputs import QuantizeOutput, kind_of


def test_the_in_memory_example_runs_as_written(tmp_path, monkeypatch):
    assert set(marked_blocks("quantize.md")) == {"in-memory"}
    monkeypatch.chdir(tmp_path)
    scope, shown = run_block("quantize.md", "in-memory")
    result = scope["result"]
    printed = shown.strip().splitlines()[-1]
    assert printed == str(result.allocation.formats)
    assert len(result.allocation.formats) == 14  # 2 blocks x 7 linear layers
    assert result.allocation.effective_bits <= 6.0 + 1e-9
    out = tmp_path / "out" / "q"
    assert kind_of(out) is QuantizeOutput
    report = json.loads((out / QuantizeOutput.REPORT).read_text())
    assert report["layers"] == result.allocation.formats
    ck = read_checkpoint(out / QuantizeOutput.CHECKPOINT)  # the folder vLLM is given
    assert ck.config.d_model == 64 and ck.config.n_layers == 2


@pytest.mark.parametrize("name", ["quantize_model", "write_outputs", "QuantizeConfig"])
def test_the_example_uses_the_public_api(name):
    import microscale.ptq as ptq

    assert name in ptq.__all__
