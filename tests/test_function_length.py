"""No function in ``src/`` is longer than `MAX_LINES` lines unless its docstring says why,
and none is longer than `HARD_MAX_LINES`, whatever it says.

A function's length runs from its ``def`` line to its last line (docstring, comments and
nested functions included). A longer one needs a paragraph in its docstring that starts
with ``Long:`` and gives the reason in at least `MIN_REASON` characters; a function with
such a paragraph that is no longer long fails too, so the reasons leave with the length.
Past `HARD_MAX_LINES` no reason is enough: split it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import microscale

ROOT = Path(microscale.__file__).parent
MAX_LINES = 80
HARD_MAX_LINES = 120
MIN_REASON = 40
_REASON = re.compile(r"^\s*Long: (.+?)(?:\n\s*\n|\Z)", re.M | re.S)


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _reason(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    m = _REASON.search(ast.get_docstring(fn) or "")
    return " ".join(m.group(1).split()) if m else None


def check(source: str, where: str) -> list[str]:
    """The problems of every function in ``source``: longer than the hard cap, too long
    without a reason, a reason too short to say anything, or a reason on a function that
    is not long."""
    found = []
    for fn in _functions(ast.parse(source)):
        n = fn.end_lineno - fn.lineno + 1
        reason = _reason(fn)
        at = f"{where}:{fn.lineno} {fn.name} ({n} lines)"
        if n > HARD_MAX_LINES:
            found.append(f"{at}: over {HARD_MAX_LINES} lines, with or without a reason; split it")
        elif n > MAX_LINES and reason is None:
            found.append(f"{at}: split it, or say why not in a 'Long: ...' docstring paragraph")
        elif reason is not None and len(reason) < MIN_REASON:
            found.append(f"{at}: the reason {reason!r} is too short to be one")
        elif reason is not None and n <= MAX_LINES:
            found.append(f"{at}: no longer than {MAX_LINES} lines; drop its 'Long:' paragraph")
    return found


def test_no_long_function_without_a_reason_and_none_past_the_cap():
    found = []
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 50  # the walk sees the package
    for path in files:
        found += check(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert found == [], "\n".join(found)


def _function(n_lines: int, doc: str) -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(n_lines - 2))
    return f'def f():\n    """{doc}"""\n{body}'


def test_the_check_can_fail():
    """A function one line over fails without a reason and passes with one; a reason on a
    short function, or a token one, fails; past the hard cap a reason does not help."""
    reason = "Long: one pass over shared state whose parts would need six arguments each."
    assert _function(MAX_LINES, "Short.").count("\n") == MAX_LINES
    assert check(_function(MAX_LINES, "Short."), "m") == []
    assert len(check(_function(MAX_LINES + 1, "Too long."), "m")) == 1
    assert check(_function(MAX_LINES + 1, f"Too long.\n\n    {reason}\n    "), "m") == []
    assert len(check(_function(10, f"Short.\n\n    {reason}\n    "), "m")) == 1
    assert len(check(_function(MAX_LINES + 1, "Too long.\n\n    Long: big.\n    "), "m")) == 1
    long_doc = f"Long.\n\n    {reason}\n    "  # 3 lines more than a one-line docstring
    assert _function(HARD_MAX_LINES - 3, long_doc).count("\n") == HARD_MAX_LINES
    assert check(_function(HARD_MAX_LINES - 3, long_doc), "m") == []
    assert len(check(_function(HARD_MAX_LINES - 2, long_doc), "m")) == 1
    assert len(check(_function(HARD_MAX_LINES + 1, "Too long."), "m")) == 1
