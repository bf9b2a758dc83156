"""Numerics fingerprints: which code produced a report's numbers.

Every report a command writes (``compare``'s ``summary.json``, ``quantize``'s
``report.json``, ``plan``'s ``plan.json``) records :func:`numerics_fingerprint` of that
command under ``"numerics"``. A report whose fingerprint differs from the current code's
was produced by other code, and its numbers may no longer be what the command prints
(``tests/test_docs_reports.py`` checks every report under ``docs/``).

What is hashed: the source of every module of the package that the command's entry module
imports, transitively (any import, at any level of the file: what a function imports at
call time is code the command runs). Each module is reduced to what can change a number:

* its syntax tree, so comments, blank lines and formatting do not count;
* without docstrings, and without the annotations of function arguments and return values
  (neither is executed). Annotations of assignments are kept: a dataclass field is one.

The serialization walks the tree itself, field by field, skipping empty fields, so the
same source gives the same hash on every Python that parses it. Library versions
(:data:`VERSIONED`) are recorded next to the hash, not in it: they are facts about the machine
that produced the report, which a reader compares by eye, like the CPU.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
from functools import cache
from pathlib import Path

PACKAGE = "microscale"
ROOT = Path(__file__).resolve().parent

# command -> the module whose import closure determines that command's numbers
ENTRY_MODULES: dict[str, str] = {
    "compare": "microscale.experiments.compare",
    "quantize": "microscale.workflows.quantize",
    "plan": "microscale.plan.run",
}


def module_path(name: str) -> Path:
    """The source file of package module ``name`` (a package's ``__init__.py``)."""
    rel = Path(*name.split(".")[1:])
    pkg = ROOT / rel / "__init__.py"
    return pkg if pkg.exists() else (ROOT / rel).with_suffix(".py")


def _absolute(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _exists(name: str) -> bool:
    return name.split(".")[0] == PACKAGE and module_path(name).exists()


def imports_of(name: str) -> set[str]:
    """The package modules that module ``name`` imports anywhere in its file."""
    path = module_path(name)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, path.name == "__init__.py")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for full in names:
            parts = full.split(".")
            # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
            found.update(
                p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if _exists(p)
            )
    return found


@cache
def closure(entry: str) -> tuple[str, ...]:
    """``entry`` and every package module it imports, transitively, sorted."""
    if not _exists(entry):
        raise ValueError(f"{entry!r} is not a module of {PACKAGE}")
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imports_of(name) - seen)
    return tuple(sorted(seen))


def _strip(tree: ast.AST) -> ast.AST:
    """``tree`` without docstrings and argument/return annotations (in place)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        if isinstance(node, ast.arg):
            node.annotation = None
    return tree


def _serialize(node, out: list[str]) -> None:
    """A version-stable text of a syntax tree: node type, then its non-empty fields."""
    if isinstance(node, ast.AST):
        out.append(type(node).__name__ + "(")
        for field in node._fields:
            value = getattr(node, field, None)
            if value is None or value == []:
                continue
            out.append(field + "=")
            _serialize(value, out)
            out.append(",")
        out.append(")")
    elif isinstance(node, list):
        out.append("[")
        for item in node:
            _serialize(item, out)
            out.append(",")
        out.append("]")
    else:
        out.append(repr(node))


def module_digest(name: str) -> str:
    """The sha256 of module ``name``'s normalized syntax tree."""
    path = module_path(name)
    parts: list[str] = []
    _serialize(_strip(ast.parse(path.read_text(encoding="utf-8"), str(path))), parts)
    return hashlib.sha256("".join(parts).encode()).hexdigest()


# The libraries whose versions a report records: the numerics run through them (flax's
# layers and initializers, optax's optimizer), so a report's numbers can move with them
# while the hash does not (seen: compare's fourth digit between two venvs, 2026-12-07).
VERSIONED = ("jax", "jaxlib", "numpy", "flax", "optax")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def numerics_fingerprint(command: str) -> dict:
    """The fingerprint ``command``'s reports record: ``sha256`` over the normalized source
    of its entry module's import closure, the number of modules, and library versions."""
    if command not in ENTRY_MODULES:
        raise ValueError(
            f"no numerics fingerprint for command {command!r}; known: {sorted(ENTRY_MODULES)}"
        )
    modules = closure(ENTRY_MODULES[command])
    h = hashlib.sha256()
    for name in modules:
        h.update(f"{name}\n{module_digest(name)}\n".encode())
    return {
        "command": command,
        "sha256": h.hexdigest()[:16],
        "modules": len(modules),
        "versions": {d: _version(d) for d in VERSIONED},
    }


def fingerprint_line(fp: dict | None) -> str:
    """The line a markdown report prints for its fingerprint (or for its absence)."""
    if not fp:
        return "- numerics fingerprint: none recorded (written before fingerprints existed)"
    versions = ", ".join(f"{k} {v}" for k, v in fp.get("versions", {}).items() if v)
    return (
        f"- numerics fingerprint: `{fp['sha256']}` (`{fp['command']}`'s code, "
        f"{fp['modules']} modules; {versions})"
    )


def recorded_fingerprint(path) -> str | None:
    """The fingerprint hash a report file records (``summary.json``: under ``setup``;
    ``report.json``/``plan.json``: at the top), or None."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    fp = data.get("numerics") or (data.get("setup") or {}).get("numerics")
    return fp.get("sha256") if isinstance(fp, dict) else None
