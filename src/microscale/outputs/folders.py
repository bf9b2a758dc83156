"""The owners of the output folders: one class per kind microscale writes, each with its
file names, its ``detect(path)`` and what ``microscale verify`` checks in it.

=====================  ==================================================================
owner                  files (constants of the class)
=====================  ==================================================================
:class:`TrainingRun`   ``config.yaml``, ``checkpoints/`` (steps: :class:`CheckpointStep`),
                       ``damaged-checkpoints/``, ``metrics.jsonl``, ``summary.json``,
                       ``precision_rules.json``, ``tokenizer.json``
:class:`CheckpointStep` ``<step>/state/`` (orbax arrays), ``<step>/meta/metadata`` (JSON,
                       the arrays' CRC-32s under ``checksums``)
:class:`QuantizeOutput` ``report.json`` (:class:`~microscale.outputs.report.
                       QuantizeReport`), ``report.md``, ``precision_rules.json``,
                       ``checkpoint/`` or ``model.gguf``, ``pareto.png``,
                       ``sensitivity.png``, ``checksums.json``
:class:`ExportFolder`  ``config.json``, ``model.safetensors`` or shards and
                       ``model.safetensors.index.json``, ``microscale_export.json`` (the
                       export marker) or ``manifest.json`` (microscale's layout),
                       ``tokenizer.json``
:class:`GGUFFile`      one ``*.gguf`` file (magic ``GGUF``)
=====================  ==================================================================

Which *layout* an export folder or file holds is ``export.registry``'s question (its
``Layout`` rows); which *kind of output* a path is, is :func:`kind_of`'s, the one answer
for ``verify``, ``train init_from=``, ``export`` and ``quantize``. Detection reads file
names (and a GGUF's four magic bytes) only.

``verify_plan(path)`` of each class lists what ``microscale verify`` checks: ``(how,
path)`` pairs (``how`` one of :data:`CHECKS`) and notes. Every file a class names is in
its ``VERIFIED`` (covered by a checksum: a tensor's CRC-32, a step's ``meta``, or a
quantize output's ``checksums.json``) or in its ``UNVERIFIED`` with the reason
(``tests/test_output_names.py`` holds both to the constants).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import ClassVar

from microscale.files import atomic_write_json, read_json
from microscale.integrity import FILE_CHECKSUMS
from microscale.outputs.report import QuantizeReport

__all__ = [
    "CHECKS",
    "KINDS",
    "CheckpointFolder",
    "CheckpointStep",
    "ExportFolder",
    "GGUFFile",
    "NotAnOutputError",
    "OutputKind",
    "QuantizeOutput",
    "SafetensorsFile",
    "TrainingRun",
    "VerifyPlan",
    "kind_of",
]

# Shared by a run and a quantize output: the allocation training, PTQ, export and QAT read.
PRECISION_RULES = "precision_rules.json"
# A model's tokenizer, copied beside a run, an export, or a quantize output's checkpoint/.
TOKENIZER = "tokenizer.json"

# How verify checks an item (verify.py has one function per entry).
GGUF, SAFETENSORS, SAFETENSORS_INDEX = "gguf", "safetensors", "safetensors index"
ORBAX, FILE_LISTING, MISSING = "orbax checkpoint", "file checksums", "missing"
CHECKS = (GGUF, SAFETENSORS, SAFETENSORS_INDEX, ORBAX, FILE_LISTING, MISSING)


class NotAnOutputError(ValueError):
    """The path is not something microscale writes (or holds nothing to verify)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyPlan:
    """What ``microscale verify`` checks under one path."""

    # What the path is ("training run", "export folder (modelopt)", ...).
    what: str
    # (how, path): how is one of CHECKS.
    items: tuple[tuple[str, Path], ...]
    # Things seen and deliberately not checked.
    notes: tuple[str, ...] = ()


class OutputKind:
    """One kind of output: its name, its description and its ``detect``."""

    # The name callers use ("run", "quantize output", ...).
    name: ClassVar[str]
    # What it is, in a few words (errors, help texts).
    description: ClassVar[str]
    # The name a model source of this kind is recorded under (``init_from``'s and
    # ``quantize``'s ``source.kind``: "run", "quantize", "hf"); None for a kind that is no
    # model source. Callers compare kinds (``kind is TrainingRun``), never these names.
    source: ClassVar[str | None] = None
    # The files it names (constants of the class) that verify covers, and those it does
    # not, each with the reason.
    VERIFIED: ClassVar[tuple[str, ...]] = ()
    UNVERIFIED: ClassVar[dict[str, str]] = {}

    @classmethod
    def detect(cls, path: Path) -> bool:
        raise NotImplementedError

    @classmethod
    def verify_plan(cls, path: Path) -> VerifyPlan:
        raise NotImplementedError


def _steps(folder: Path) -> list[Path]:
    """Finished orbax steps (folders named by an integer) in step order."""
    return sorted(
        (d for d in folder.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name)
    )


class CheckpointStep(OutputKind):
    """One finished step of ``train/checkpoint.py``'s ``Checkpointer``: ``state/``
    (orbax StandardSave) and ``meta/`` (orbax JsonSave, file ``metadata``) with the
    state's CRC-32s under ``meta["checksums"]``."""

    name = "checkpoint step"
    description = "a checkpoint step (state/ + meta/)"
    STATE = "state"
    META = "meta"
    META_FILE = "metadata"  # orbax JsonSave's file in meta/
    CHECKSUMS = "checksums"  # the key of meta holding {tree path: crc32}
    VERIFIED = (STATE, META)

    @classmethod
    def detect(cls, path: Path) -> bool:
        return (path / cls.STATE).is_dir() and (path / cls.META).is_dir()

    @classmethod
    def steps(cls, folder: Path) -> list[Path]:
        """The finished steps under a ``checkpoints/`` folder, in step order."""
        return _steps(folder)

    @classmethod
    def verify_plan(cls, path: Path) -> VerifyPlan:
        return VerifyPlan(what=cls.name, items=((ORBAX, path),))


class CheckpointFolder(OutputKind):
    """A run's ``checkpoints/`` folder given by itself: its finished steps."""

    name = "checkpoint folder"
    description = "a checkpoints/ folder of finished steps"

    @classmethod
    def detect(cls, path: Path) -> bool:
        return path.is_dir() and any(CheckpointStep.detect(d) for d in _steps(path))

    @classmethod
    def verify_plan(cls, path: Path) -> VerifyPlan:
        return _steps_plan(cls.name, path, path)


def _steps_plan(what: str, path: Path, ckpts: Path, notes: tuple[str, ...] = ()) -> VerifyPlan:
    steps = _steps(ckpts) if ckpts.is_dir() else []
    if not steps:
        raise NotAnOutputError(
            f"{what} {str(path)!r} has no finished checkpoint under {ckpts} to verify"
        )
    return VerifyPlan(what=what, items=tuple((ORBAX, d) for d in steps), notes=notes)


class TrainingRun(OutputKind):
    """A training run folder (``microscale train``, ``microscale import``)."""

    name = "run"
    source = "run"
    description = "a microscale training run (config.yaml + checkpoints/)"
    CONFIG = "config.yaml"
    CHECKPOINTS = "checkpoints"
    DAMAGED = "damaged-checkpoints"  # steps a resume set aside (Checkpointer)
    METRICS = "metrics.jsonl"
    SUMMARY = "summary.json"
    RULES = PRECISION_RULES
    TOKENIZER = TOKENIZER
    VERIFIED = (CHECKPOINTS,)
    UNVERIFIED = {
        CONFIG: "each step's meta stores the resolved config; load_checkpoint compares the "
        "model's keys with it",
        DAMAGED: "steps set aside as damaged by a resume: listed, not checked",
        METRICS: "a log appended while training (no result is read from it)",
        SUMMARY: "written once at the end from the metrics; no weights",
        RULES: "derived from config.yaml (and a step's meta) at every start",
        TOKENIZER: "a copy of the source's tokenizer (data.tokenizer names it)",
    }

    @classmethod
    def detect(cls, path: Path) -> bool:
        return (path / cls.CONFIG).is_file() and (path / cls.CHECKPOINTS).is_dir()

    @classmethod
    def verify_plan(cls, path: Path) -> VerifyPlan:
        aside = path / cls.DAMAGED
        notes: tuple[str, ...] = ()
        if aside.is_dir() and any(aside.iterdir()):
            names = sorted(d.name for d in aside.iterdir())
            notes = (
                f"{aside}: {len(names)} step(s) set aside as damaged by an earlier "
                f"resume ({', '.join(names)}); not checked",
            )
        return _steps_plan("training run", path, path / cls.CHECKPOINTS, notes)


class GGUFFile(OutputKind):
    """One llama.cpp GGUF file (``microscale export layout=gguf``, a quantize output's
    ``model.gguf``)."""

    name = "GGUF file"
    description = "a llama.cpp GGUF file"
    SUFFIX = ".gguf"
    MAGIC = b"GGUF"

    @classmethod
    def detect(cls, path: Path) -> bool:
        if not path.is_file():
            return False
        if path.suffix.lower() == cls.SUFFIX:
            return True
        with open(path, "rb") as f:
            return f.read(len(cls.MAGIC)) == cls.MAGIC

    @classmethod
    def verify_plan(cls, path: Path) -> VerifyPlan:
        return VerifyPlan(what=cls.name, items=((GGUF, path),))


class SafetensorsFile(OutputKind):
    """One safetensors file (per-tensor CRC-32s in its ``__metadata__``)."""

    name = "safetensors file"
    description = "a .safetensors file"
    SUFFIX = ".safetensors"

    @classmethod
    def detect(cls, path: Path) -> bool:
        return path.is_file() and path.suffix == cls.SUFFIX

    @classmethod
    def verify_plan(cls, path: Path) -> VerifyPlan:
        return VerifyPlan(what=cls.name, items=((SAFETENSORS, path),))


class ExportFolder(OutputKind):
    """A model folder: an HF-style export (``config.json`` + safetensors; the marker
    ``microscale_export.json`` when microscale wrote it) or microscale's own layout
    (``model.safetensors`` + ``manifest.json``)."""

    name = "export folder"
    source = "hf"  # as a model source: an HF-style folder
    description = "an export folder (config.json + *.safetensors)"
    CONFIG = "config.json"
    WEIGHTS = "model.safetensors"
    INDEX = "model.safetensors.index.json"
    MARKER = "microscale_export.json"  # export/writer.py's provenance record
    MANIFEST = "manifest.json"  # microscale's layout (export/manifest.py)
    TOKENIZER = TOKENIZER
    VERIFIED = (WEIGHTS, INDEX)
    UNVERIFIED = {
        CONFIG: "an HF file its readers parse and check against the tensors",
        MARKER: "provenance only; nothing is read from it but the layout's name",
        MANIFEST: "the tensors it describes carry their own CRC-32s",
        TOKENIZER: "an HF file copied from the source",
    }

    @classmethod
    def detect(cls, path: Path) -> bool:
        return (path / cls.CONFIG).is_file() or (path / cls.MANIFEST).is_file()

    @classmethod
    def weight_items(cls, folder: Path) -> list[tuple[str, Path]]:
        """The index and the shards it names, or every ``*.safetensors`` file."""
        index = folder / cls.INDEX
        if not index.is_file():
            return [(SAFETENSORS, f) for f in sorted(folder.glob("*" + SafetensorsFile.SUFFIX))]
        items = [(SAFETENSORS_INDEX, index)]
        try:
            shards = sorted(set(json.loads(index.read_text("utf-8"))["weight_map"].values()))
        except Exception:  # noqa: BLE001 - reported when the index is checked
            shards = []
        for name in shards:
            if isinstance(name, str) and Path(name).name == name and (folder / name).is_file():
                items.append((SAFETENSORS, folder / name))
        return items

    @classmethod
    def layout_name(cls, folder: Path) -> str | None:
        """The layout its marker or manifest records, None without one."""
        for name in (cls.MARKER, cls.MANIFEST):
            try:
                obj = json.loads((folder / name).read_text("utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            layout = (obj.get("layout") or obj.get("format")) if isinstance(obj, dict) else None
            if isinstance(layout, str):
                return layout
        return None

    @classmethod
    def verify_plan(cls, path: Path) -> VerifyPlan:
        """Its weights (verify refuses a folder without any as no output)."""
        items = cls.weight_items(path)
        layout = cls.layout_name(path)
        what = f"export folder ({layout})" if layout else "model folder (safetensors)"
        return VerifyPlan(what=what, items=tuple(items))


class QuantizeOutput(OutputKind):
    """A ``microscale quantize`` output folder."""

    name = "quantize output"
    source = "quantize"
    description = (
        "a `microscale quantize` output (report.json + precision_rules.json + checkpoint/ "
        "or model.gguf)"
    )
    REPORT = "report.json"
    REPORT_MD = "report.md"
    RULES = PRECISION_RULES
    CHECKPOINT = "checkpoint"  # the model of a folder layout
    MODEL_GGUF = "model.gguf"  # the model of a single-file layout
    PARETO = "pareto.png"
    SENSITIVITY = "sensitivity.png"
    IMATRIX = "imatrix.gguf"  # a GGUF output's importance matrix, for llama-quantize
    CHECKSUMS = FILE_CHECKSUMS  # written last: the CRC-32 of every file but the weights
    VERIFIED = (
        REPORT,
        REPORT_MD,
        RULES,
        CHECKPOINT,
        MODEL_GGUF,
        PARETO,
        SENSITIVITY,
        IMATRIX,
        CHECKSUMS,
    )

    @classmethod
    def detect(cls, path: Path) -> bool:
        # an allocation of ggml's block types has no rules (no training recipe runs them)
        model = (path / cls.RULES).is_file() or (path / cls.MODEL_GGUF).is_file()
        return (path / cls.REPORT).is_file() and model

    @classmethod
    def model(cls, path: str | os.PathLike, *, single_file: bool | None = None) -> Path:
        """Where it keeps its model: ``model.gguf`` for a single-file layout, else
        ``checkpoint/`` (an HF-style or a microscale-layout folder). ``single_file=None``:
        whichever the output at ``path`` holds."""
        p = Path(path)
        if single_file is None:
            single_file = (p / cls.MODEL_GGUF).is_file()
        return p / cls.MODEL_GGUF if single_file else p / cls.CHECKPOINT

    @classmethod
    def read_report(cls, path: str | os.PathLike) -> QuantizeReport:
        """Its ``report.json`` as the record (errors name the file)."""
        where = Path(path) / cls.REPORT
        return QuantizeReport.from_dict(read_json(where, what="quantize report"), where=str(where))

    @classmethod
    def write_report(cls, path: str | os.PathLike, report: QuantizeReport) -> None:
        """Write ``report`` as its ``report.json`` (atomically)."""
        atomic_write_json(Path(path) / cls.REPORT, report.to_dict())

    @classmethod
    def verify_plan(cls, path: Path) -> VerifyPlan:
        """The model (its tensors' own CRC-32s), then every other file against
        ``checksums.json``."""
        ck = cls.model(path)
        items: list[tuple[str, Path]]
        if ck.is_file():
            items = [(GGUF, ck)]
        else:
            items = ExportFolder.weight_items(ck) if ck.is_dir() else []
        items = items or [(MISSING, ck)]
        return VerifyPlan(what=cls.name, items=(*items, (FILE_LISTING, path / cls.CHECKSUMS)))


# What kind_of tries, in order (a run or a quantize output may hold files of the others).
KINDS: tuple[type[OutputKind], ...] = (
    TrainingRun,
    QuantizeOutput,
    CheckpointStep,
    CheckpointFolder,
    ExportFolder,
    GGUFFile,
    SafetensorsFile,
)


def kind_of(path: str | os.PathLike) -> type[OutputKind] | None:
    """What ``path`` is: the first of :data:`KINDS` whose ``detect`` matches, None for
    anything else (a missing path, an unrelated file or folder)."""
    p = Path(path).expanduser()
    return next((k for k in KINDS if k.detect(p)), None)
