"""The output folders microscale writes, one owner each (docs/design.md#architecture).

Each kind of output is one class of :mod:`~microscale.outputs.folders` that owns its file
names (constants), its ``detect(path)`` and what ``microscale verify`` checks in it;
:func:`kind_of` is the one answer to "what is this path?". What a folder stores is a
typed record read back by its owner (:class:`~microscale.outputs.report.QuantizeReport`,
``QuantizeOutput.read_report``). Below ``export``, ``ptq`` and ``train``, above
``files`` and ``integrity``: it reads names and small JSON files, never a model.
"""

from microscale.outputs.folders import (
    CHECKS,
    KINDS,
    CheckpointFolder,
    CheckpointStep,
    ExportFolder,
    GGUFFile,
    NotAnOutputError,
    OutputKind,
    QuantizeOutput,
    SafetensorsFile,
    TrainingRun,
    VerifyPlan,
    kind_of,
)
from microscale.outputs.report import REPORT_VERSION, QuantizeReport

__all__ = [
    "CHECKS",
    "KINDS",
    "REPORT_VERSION",
    "CheckpointFolder",
    "CheckpointStep",
    "ExportFolder",
    "GGUFFile",
    "NotAnOutputError",
    "OutputKind",
    "QuantizeOutput",
    "QuantizeReport",
    "SafetensorsFile",
    "TrainingRun",
    "VerifyPlan",
    "kind_of",
]
