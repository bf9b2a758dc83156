"""The string literals of microscale's source that name something an owner module spells
(a layout's name, an output folder's file name or kind), for the tests that keep those
names in their owner (tests/test_layout_names.py, tests/test_output_names.py)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection
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


def _outside_docstrings(tree: ast.AST) -> set[int]:
    """The ids of the constants that are no docstring."""
    return {id(n) for n in ast.walk(tree) if isinstance(n, ast.Constant)} - _docstrings(tree)


def _compared(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are an operand of a comparison (``kind ==
    "hf"``), or an element of a tuple, list or set operand (``kind in ("run", "hf")``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                elts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else []
                out.update(id(n) for n in (operand, *elts) if isinstance(n, ast.Constant))
    return out


def _literals(
    names: Collection[str], owner: str, src: Path, counted: Callable[[ast.AST], set[int]]
) -> dict[tuple[str, str], list[int]]:
    """``{(module, literal): [line, ...]}`` of the literals in ``names`` spelled under ``src``
    outside the ``owner`` folder, among the constants ``counted`` picks in a module."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel.startswith(owner):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        ids = counted(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in names
                and id(node) in ids
            ):
                found.setdefault((rel, node.value), []).append(node.lineno)
    return found


def string_literals(
    names: Collection[str], *, owner: str, src: Path = SRC
) -> dict[tuple[str, str], list[int]]:
    """``{(module, literal): [line, ...]}`` of the literals in ``names`` spelled under
    ``src`` outside the ``owner`` folder (``"export/"``), docstrings aside."""
    return _literals(names, owner, src, _outside_docstrings)


def compared_literals(
    names: Collection[str], *, owner: str, src: Path = SRC
) -> dict[tuple[str, str], list[int]]:
    """``{(module, literal): [line, ...]}`` of the literals in ``names`` that a comparison
    under ``src`` outside the ``owner`` folder compares something to."""
    return _literals(names, owner, src, _compared)
