"""Each output folder's file names are spelled once, by its owner in ``microscale.outputs``
(docs/design.md#architecture): everything else reads the owner's constants
(``TrainingRun.CONFIG``, ``QuantizeOutput.REPORT``, ``ExportFolder.MARKER``, ...). A string
literal equal to one of those names anywhere else in ``src/microscale`` fails here, unless
:data:`ELSEWHERE` says why it names something else; docstrings, comments and longer strings
(messages, help texts) do not count. Modelled on ``tests/test_layout_names.py``.

The kinds' own names (``OutputKind.name``, and ``OutputKind.source``, the name a model
source is recorded under: "run", "quantize", "hf") are compared only in ``outputs/``:
elsewhere a comparison asks for the class (``kind is TrainingRun``).
"""

from __future__ import annotations

from pathlib import Path

from microscale.outputs import KINDS
from source_literals import SRC, compared_literals, string_literals

# Constants too generic to find as literals (dict keys, CLI argument names, orbax's item
# names): the folder names of a step and the model folder of a quantize output.
GENERIC = {"state", "meta", "metadata", "checksums", "checkpoint"}

# The names an owner gives: its upper-case string constants, suffixes aside.
NAMES = {
    value: kind.__name__
    for kind in reversed(KINDS)
    for key, value in vars(kind).items()
    if key.isupper()
    and key != "SUFFIX"
    and isinstance(value, str)
    and value not in GENERIC
    and not key.startswith("_")
}

# (module or folder prefix, literal): where a literal that equals an owner's name names
# something else, or is the name's source below outputs/.
ELSEWHERE = {
    ("integrity.py", "checksums.json"): "FILE_CHECKSUMS, below outputs: QuantizeOutput.CHECKSUMS "
    "is it",
    ("experiments/report.py", "summary.json"): "the compare folder's own summary",
    ("experiments/report.py", "report.md"): "the compare folder's own report",
    ("experiments/scaling.py", "summary.json"): "the scaling folder's own summary",
    ("experiments/scaling.py", "report.md"): "the scaling folder's own report",
    ("cli/compare.py", "report.md"): "the compare folder's report, printed",
    # export/ writes and reads the layouts' own files (HF's config.json, tokenizer files,
    # safetensors shards and their index, the microscale layout's manifest): ExportFolder
    # names them for detection and verify; test_export_folder_names_agree holds the two to
    # the same spelling.
    ("export/", "config.json"): "an HF folder's config, read and written by the layouts",
    ("export/", "tokenizer.json"): "an HF folder's tokenizer, read and written by the layouts",
    ("export/", "model.safetensors"): "the layouts' weight file",
    ("export/", "model.safetensors.index.json"): "the layouts' shard index",
    ("export/", "manifest.json"): "the microscale layout's manifest (export/manifest.py)",
}


# The kinds' names: what callers call them, and what a model source is recorded under.
KIND_NAMES = {k.name for k in KINDS} | {k.source for k in KINDS if k.source is not None}
# (folder prefix, literal): a comparison to a kind's name that compares something else.
COMPARED_ELSEWHERE = {
    ("export/", "hf"): "the plain HF layout's name, compared by its owner export/",
}


def _allowed(rel: str, name: str) -> bool:
    return any(rel.startswith(prefix) and name == lit for prefix, lit in ELSEWHERE)


def _name_literals(src: Path = SRC) -> dict[tuple[str, str], list[int]]:
    """``{(module, literal): [line, ...]}`` of the owners' names spelled under ``src``
    outside ``outputs/``."""
    return string_literals(NAMES, owner="outputs/", src=src)


def test_no_output_file_name_outside_its_owner():
    named = [
        f"{rel}:{','.join(map(str, lines))}: {name!r} (use {NAMES[name]}'s constant)"
        for (rel, name), lines in _name_literals().items()
        if not _allowed(rel, name)
    ]
    assert named == [], (
        "an output folder's file name spelled outside microscale.outputs (read its owner's "
        f"constant instead, or say in ELSEWHERE why it names something else): {named}"
    )


def test_every_exception_is_still_needed():
    found = _name_literals()
    stale = [k for k in ELSEWHERE if not any(r.startswith(k[0]) and n == k[1] for r, n in found)]
    assert stale == [], f"ELSEWHERE lists literals no longer there: {stale}"


def test_the_check_sees_a_name(tmp_path):
    """The check itself: a module spelling a run's config file is caught, its docstrings
    and a module under outputs/ are not."""
    (tmp_path / "ptq").mkdir()
    (tmp_path / "outputs").mkdir()
    (tmp_path / "ptq" / "x.py").write_text(
        '"""config.yaml"""\n\n\ndef f(out):\n    """report.json"""\n    return out / "config.yaml"\n'
    )
    (tmp_path / "outputs" / "y.py").write_text('NAME = "config.yaml"\n')
    assert _name_literals(tmp_path) == {("ptq/x.py", "config.yaml"): [6]}
    assert {"config.yaml", "report.json", "microscale_export.json", "model.gguf"} <= set(NAMES)


def test_no_kind_name_compared_outside_outputs():
    found = compared_literals(KIND_NAMES, owner="outputs/")
    named = [
        f"{rel}:{','.join(map(str, lines))}: {name!r}"
        for (rel, name), lines in found.items()
        if not any(rel.startswith(pre) and name == lit for pre, lit in COMPARED_ELSEWHERE)
    ]
    stale = [
        k for k in COMPARED_ELSEWHERE if not any(r.startswith(k[0]) and n == k[1] for r, n in found)
    ]
    assert stale == [], f"COMPARED_ELSEWHERE lists comparisons no longer there: {stale}"
    assert named == [], (
        "an output kind's name compared outside microscale.outputs (compare the kind, e.g. "
        f"`kind is TrainingRun`): {named}"
    )


def test_the_check_sees_a_compared_kind_name(tmp_path):
    """The check itself: ``kind == "hf"`` and ``kind in ("run", ...)`` are caught; the same
    names outside a comparison (a recorded value, a docstring) and under outputs/ are not."""
    (tmp_path / "train").mkdir()
    (tmp_path / "outputs").mkdir()
    (tmp_path / "train" / "x.py").write_text(
        '"""run"""\n\n\ndef f(kind):\n    rec = {"kind": "hf"}\n'
        '    return kind == "hf" or kind in ("run", "quantize")\n'
    )
    (tmp_path / "outputs" / "y.py").write_text('OK = kind == "hf"\n')
    assert compared_literals(KIND_NAMES, owner="outputs/", src=tmp_path) == {
        ("train/x.py", "hf"): [6],
        ("train/x.py", "run"): [6],
        ("train/x.py", "quantize"): [6],
    }
    assert {"run", "quantize", "hf", "quantize output"} <= KIND_NAMES


def test_export_folder_names_agree():
    """export/'s own spellings of the files ExportFolder names are the same names."""
    from microscale.export.manifest import MANIFEST
    from microscale.export.tensorfile import INDEX_NAME, SINGLE_NAME
    from microscale.outputs import ExportFolder

    assert MANIFEST == ExportFolder.MANIFEST
    assert (SINGLE_NAME, INDEX_NAME) == (ExportFolder.WEIGHTS, ExportFolder.INDEX)
