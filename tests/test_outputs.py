"""The output folders' owners (microscale.outputs): one kind_of, each kind's names and what
verify checks, and the quantize report's record."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from microscale.outputs import (
    KINDS,
    CheckpointFolder,
    CheckpointStep,
    ExportFolder,
    GGUFFile,
    NotAnOutputError,
    QuantizeOutput,
    QuantizeReport,
    SafetensorsFile,
    TrainingRun,
    kind_of,
)
from microscale.outputs.folders import FILE_LISTING, MISSING, ORBAX, SAFETENSORS


def _make(root: Path, files: list[str], dirs: list[str] = ()) -> Path:
    root.mkdir(parents=True)
    for d in dirs:
        (root / d).mkdir(parents=True)
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("{}")
    return root


def test_kind_of_each_kind(tmp_path):
    run = _make(tmp_path / "run", ["config.yaml"], ["checkpoints/2/state", "checkpoints/2/meta"])
    q = _make(tmp_path / "q", ["report.json", "precision_rules.json"], ["checkpoint"])
    ex = _make(tmp_path / "ex", ["config.json", "model.safetensors"])
    own = _make(tmp_path / "own", ["manifest.json"])
    gguf = tmp_path / "m.bin"
    gguf.write_bytes(b"GGUF\x03\x00")
    st = tmp_path / "w.safetensors"
    st.write_bytes(b"")
    found = {
        run: TrainingRun,
        run / "checkpoints": CheckpointFolder,
        run / "checkpoints" / "2": CheckpointStep,
        q: QuantizeOutput,
        ex: ExportFolder,
        own: ExportFolder,
        gguf: GGUFFile,
        tmp_path / "x.gguf": None,  # missing
        st: SafetensorsFile,
        _make(tmp_path / "other", ["notes.txt"]): None,
    }
    for path, kind in found.items():
        assert kind_of(path) is kind, path


def test_every_name_an_owner_gives_is_verified_or_says_why():
    for kind in KINDS:
        names = {
            v for k, v in vars(kind).items() if k.isupper() and isinstance(v, str) and "." in v
        } | {v for k, v in vars(kind).items() if k in ("CHECKPOINTS", "DAMAGED", "CHECKPOINT")}
        names -= {getattr(kind, "SUFFIX", None)}
        assert names <= set(kind.VERIFIED) | set(kind.UNVERIFIED), (kind, names)
        assert not set(kind.VERIFIED) & set(kind.UNVERIFIED), kind


def test_verify_plans(tmp_path):
    run = _make(tmp_path / "run", ["config.yaml"], ["checkpoints/10/state", "checkpoints/10/meta"])
    (run / "checkpoints" / "2" / "state").mkdir(parents=True)
    (run / "checkpoints" / "2" / "meta").mkdir()
    (run / "damaged-checkpoints" / "4-1").mkdir(parents=True)
    plan = TrainingRun.verify_plan(run)
    assert plan.items == ((ORBAX, run / "checkpoints" / "2"), (ORBAX, run / "checkpoints" / "10"))
    assert len(plan.notes) == 1 and "4-1" in plan.notes[0]
    empty = _make(tmp_path / "empty", ["config.yaml"], ["checkpoints"])
    with pytest.raises(NotAnOutputError, match="no finished checkpoint"):
        TrainingRun.verify_plan(empty)
    q = _make(tmp_path / "q", ["report.json", "precision_rules.json"])
    assert QuantizeOutput.verify_plan(q).items == (
        (MISSING, q / "checkpoint"),
        (FILE_LISTING, q / "checksums.json"),
    )
    ex = _make(tmp_path / "ex", ["config.json", "a.safetensors", "b.safetensors"])
    (ex / "microscale_export.json").write_text(json.dumps({"layout": "modelopt"}))
    plan = ExportFolder.verify_plan(ex)
    assert plan.what == "export folder (modelopt)"
    assert plan.items == ((SAFETENSORS, ex / "a.safetensors"), (SAFETENSORS, ex / "b.safetensors"))


def test_quantize_output_model_path(tmp_path):
    q = _make(tmp_path / "q", ["report.json", "precision_rules.json"])
    assert QuantizeOutput.model(q) == q / "checkpoint"
    assert QuantizeOutput.model(q, single_file=True) == q / "model.gguf"
    (q / "model.gguf").write_bytes(b"GGUF")
    assert QuantizeOutput.model(q) == q / "model.gguf"


def test_report_round_trip_keeps_keys_and_order(tmp_path):
    rep = QuantizeReport(budget=5.0, layers={"a": "nvfp4"}, calibration={"run_dir": "r", "step": 3})
    d = rep.to_dict()
    names = [f.name for f in dataclasses.fields(QuantizeReport)]
    optional = {"embedding", "embed_format", "awq", "checkpoint", "numerics", "version"}
    assert list(d) == [n for n in names if n not in optional]
    full = dataclasses.replace(rep, embedding={"format": "q8_0"}, embed_format="q8_0", awq={})
    assert list(full.to_dict())[-3:] == ["embedding", "embed_format", "awq"]
    QuantizeOutput.write_report(tmp_path, full)
    text = (tmp_path / "report.json").read_text()
    assert text == json.dumps(full.to_dict(), indent=2) + "\n"
    assert QuantizeOutput.read_report(tmp_path) == full


def test_report_reading_is_tolerant_and_versioned(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"calibration": {"step": 2}, "new_key": 1}))
    assert QuantizeOutput.read_report(tmp_path).calibration == {"step": 2}
    later = QuantizeReport(version=2).to_dict()
    assert later["version"] == 2
    (tmp_path / "report.json").write_text(json.dumps(later))
    with pytest.raises(ValueError, match="report version 2"):
        QuantizeOutput.read_report(tmp_path)
    (tmp_path / "report.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        QuantizeOutput.read_report(tmp_path)
