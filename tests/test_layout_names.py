"""No module outside ``export/`` branches on a layout's name: what a layout stores (weights
only or not, one file or a folder, its embedding formats, its quantize preset) is a field of
its :class:`~microscale.export.registry.Layout` row, read by the callers
(docs/design.md#architecture). A string literal equal to a layout's name anywhere else in
``src/microscale`` fails here, unless :data:`NOT_A_LAYOUT` says why it names something
else; docstrings, comments and help text inside longer strings do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

from microscale.export.registry import layout_names
from source_literals import SRC, string_literals

# (module, literal): a literal that equals a layout's name but names something else.
NOT_A_LAYOUT = {
    ("fingerprint.py", "microscale"): "the package's name (the modules a hash covers)",
    ("cli/__init__.py", "microscale"): "the program's name (argparse's prog)",
    ("data/corpus.py", "microscale"): "the cache folder's name (~/.cache/microscale)",
    ("outputs/folders.py", "hf"): "ExportFolder.source: what a model source that is an HF "
    "folder is recorded as, not a layout",
    ("outputs/folders.py", "gguf"): "verify's check kind of a GGUF file, not a layout",
}

# (module, literal): a row read by its name in a function named after that layout, which
# branches on nothing (the row's fields are what it reads).
READS_A_ROW = {
    ("ptq/config.py", "gguf"): "QuantizeConfig.for_gguf: the GGUF row's quantize_preset",
}


def _layout_literals(src: Path = SRC) -> dict[tuple[str, str], list[int]]:
    """``{(module, literal): [line, ...]}`` of the layout names spelled under ``src``."""
    return string_literals(set(layout_names()), owner="export/", src=src)


def test_no_layout_name_outside_export():
    found = _layout_literals()
    named = [
        f"{rel}:{','.join(map(str, lines))}: {name!r}"
        for (rel, name), lines in found.items()
        if (rel, name) not in NOT_A_LAYOUT and (rel, name) not in READS_A_ROW
    ]
    assert named == [], (
        "a layout's name spelled outside export/ (read a field of its Layout row "
        f"instead, or say in NOT_A_LAYOUT why it is not a layout): {named}"
    )


def test_every_exception_is_still_needed():
    found = _layout_literals()
    stale = [k for k in (*NOT_A_LAYOUT, *READS_A_ROW) if k not in found]
    assert stale == [], f"NOT_A_LAYOUT / READS_A_ROW list literals no longer there: {stale}"


def test_the_check_sees_a_branch_on_a_name(tmp_path):
    """The check itself: a module comparing a layout's name is caught, its docstrings and
    a module under export/ are not."""
    (tmp_path / "ptq").mkdir()
    (tmp_path / "export").mkdir()
    (tmp_path / "ptq" / "x.py").write_text(
        '"""gguf"""\n\n\ndef f(row):\n    """hf"""\n    return row.name == "gguf"\n'
    )
    (tmp_path / "export" / "y.py").write_text('NAME = "gguf"\n')
    assert _layout_literals(tmp_path) == {("ptq/x.py", "gguf"): [6]}


def test_ptq_reads_layouts_through_the_registry():
    """ptq/ imports no layout's internals (``export.gguf``'s tables, ``embed_values``):
    what it needs is a field of the row or a function of ``export.registry``."""
    found = {}
    for path in sorted((SRC / "ptq").rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mod = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [mod or ""]
            if any(n.startswith("microscale.export.gguf") for n in names):
                found[rel] = node.lineno
    assert found == {}, found
