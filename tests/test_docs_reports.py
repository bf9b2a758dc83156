"""Reports under docs/ say when they are stale; the numerics fingerprint is what it claims.

Every report a command wrote under ``docs/`` is a row of ``docs/reports.toml``. A row
either records the current code's fingerprint (regenerate with
``python benchmarks/regenerate_docs.py --stale``) or says why it is kept.
"""

from __future__ import annotations

import json
import textwrap
import tomllib
from pathlib import Path

import pytest

from microscale import fingerprint as fpm
from microscale.fingerprint import (
    ENTRY_MODULES,
    closure,
    module_digest,
    numerics_fingerprint,
    recorded_fingerprint,
)

ROOT = Path(__file__).resolve().parent.parent
ROWS = tomllib.loads((ROOT / "docs" / "reports.toml").read_text())["report"]
REPORT_NAMES = ("summary.json", "report.json", "plan.json", "results.json")


def test_every_report_under_docs_is_a_row():
    found = {str(p.relative_to(ROOT)) for name in REPORT_NAMES for p in (ROOT / "docs").rglob(name)}
    rows = [r["path"] for r in ROWS]
    assert len(rows) == len(set(rows)), "a report is listed twice in docs/reports.toml"
    assert found == set(rows), (
        "docs/reports.toml and the reports under docs/ differ: "
        f"unlisted {sorted(found - set(rows))}, "
        f"missing {sorted(set(rows) - found)}"
    )


@pytest.mark.parametrize("row", ROWS, ids=[r["path"] for r in ROWS])
def test_report_is_current_or_says_why_it_is_kept(row):
    assert row["kind"] in ENTRY_MODULES, row
    if "kept" in row:
        assert len(row["kept"].split()) >= 5, f"{row['path']}: say why it is kept"
        return
    for key in ("command", "dest", "copy"):
        assert row.get(key), f"{row['path']}: a regenerated report needs {key!r}"
    have = recorded_fingerprint(ROOT / row["path"])
    want = numerics_fingerprint(row["kind"])["sha256"]
    assert have == want, (
        f"{row['path']} was produced by other code (fingerprint {have}, current {want}): "
        "regenerate it (python benchmarks/regenerate_docs.py --stale) or give a `kept` "
        "reason in docs/reports.toml"
    )


def _module(tmp_path: Path, source: str) -> str:
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(source))
    return path


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("def f(x):\n    return x + 1\n", "def f(x):\n    return x + 2\n", False),
        ("def f(x):\n    return x + 1\n", "def f(x: float) -> float:\n    return x + 1\n", True),
        (
            "def f(x):\n    return x + 1\n",
            "def f(x):\n    '''Adds one.'''\n    return (x +\n  1)\n",
            True,
        ),
        ("class C:\n    a: int = 1\n", "class C:\n    a: float = 1\n", False),  # a dataclass field
        ("x = 1.0\n", "x = 1.0  # one\n", True),
        ("x = 1.0\n", "x = 1.00000001\n", False),
        ("x = 1.0\n", '"""A module docstring."""\nx = 1.0\n', True),
        ("x = 1.0\n", '"""A module docstring."""\nx = 2.0\n', False),
    ],
    ids=[
        "constant",
        "arg-annotations",
        "docstring-format",
        "field-annotation",
        "comment",
        "literal",
        "module-docstring",
        "module-docstring-and-literal",
    ],
)
def test_digest_table(tmp_path, monkeypatch, a, b, same):
    digests = []
    for src in (a, b):
        path = _module(tmp_path, src)
        monkeypatch.setattr(fpm, "module_path", lambda _name, p=path: p)
        digests.append(module_digest("microscale.m"))
    assert (digests[0] == digests[1]) is same


def test_closure_follows_imports_at_any_level():
    mods = closure("microscale.plan.run")
    assert "microscale.plan.run" in mods and "microscale.ops.dot" in mods
    assert "microscale.formats.quantize" in mods  # through ops and model
    assert not any(m.startswith("microscale.cli") for m in mods)
    with pytest.raises(ValueError, match="not a module"):
        closure("microscale.nope")


def test_fingerprint_names_the_bad_command():
    with pytest.raises(ValueError, match="'train'"):
        numerics_fingerprint("train")


def test_fingerprint_records_the_versions_of_the_numerics_libraries():
    import importlib.metadata

    fp = numerics_fingerprint("compare")
    assert set(fpm.VERSIONED) >= {"jax", "jaxlib", "numpy", "flax", "optax"}
    assert fp["versions"] == {d: importlib.metadata.version(d) for d in fpm.VERSIONED}
    line = fpm.fingerprint_line(fp)
    for d in fpm.VERSIONED:
        assert f"{d} {fp['versions'][d]}" in line


def test_recorded_fingerprint_reads_every_report_shape(tmp_path):
    for name, data in (
        ("summary.json", {"setup": {"numerics": {"sha256": "ab"}}}),
        ("plan.json", {"numerics": {"sha256": "ab"}}),
        ("old.json", {"setup": {}}),
    ):
        (tmp_path / name).write_text(json.dumps(data))
    assert recorded_fingerprint(tmp_path / "summary.json") == "ab"
    assert recorded_fingerprint(tmp_path / "plan.json") == "ab"
    assert recorded_fingerprint(tmp_path / "old.json") is None
