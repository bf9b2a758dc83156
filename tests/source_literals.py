"""The string literals of microscale's source that name something an owner module spells
(a layout's name, an output folder's file name), for the tests that keep those names in
their owner (tests/test_layout_names.py, tests/test_output_names.py)."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "microscale"


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that stand alone as statements (docstrings and the
    attribute docstrings under a field)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def string_literals(
    names: Collection[str], *, owner: str, src: Path = SRC
) -> dict[tuple[str, str], list[int]]:
    """``{(module, literal): [line, ...]}`` of the literals in ``names`` spelled under
    ``src`` outside the ``owner`` folder (``"export/"``), docstrings aside."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel.startswith(owner):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in names
                and id(node) not in skip
            ):
                found.setdefault((rel, node.value), []).append(node.lineno)
    return found
