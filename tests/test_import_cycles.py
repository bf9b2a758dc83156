"""No import cycle hidden inside a function: in the packages listed, a module imports its
sibling modules at the top, where a cycle would fail at import time, not inside a function
body where it hides (model/layers.py <-> model/rules.py and experiments/compare.py <-> report.py were)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import microscale

ROOT = Path(microscale.__file__).parent
PACKAGES = ["model", "ops", "formats", "experiments"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_level_imports_within_the_package(package):
    found = []
    for path in sorted((ROOT / package).glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        f"microscale.{package}"):
                    found.append(f"{path.name}:{node.lineno} {node.module}")
    assert found == [], found
