"""The docs stand alone: the README is short and its links and preset list are true, the code
cites sections of docs/design.md that exist, nothing cites a file outside the repository,
and the docs site builds in strict mode (when mkdocs is installed: ``pip install -e
'.[docs]'``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from microscale.model import list_presets

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PRESET_LINE = re.compile(r"Model presets: (.*?)\(`microscale\.model\.list_presets\(\)`\)", re.S)


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    keep = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".txt", ""}
    return [
        REPO / f
        for f in out.stdout.split()
        if Path(f).suffix in keep and (REPO / f).is_file() and f != "tests/test_docs.py"
    ]


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; reference material belongs in docs/"


@pytest.mark.parametrize("path", ["README.md", "docs/training.md"])
def test_preset_lists_are_the_registry(path):
    found = PRESET_LINE.findall((REPO / path).read_text())
    assert found, f"{path}: no 'Model presets: ... (`microscale.model.list_presets()`)' line"
    for text in found:
        assert re.findall(r"`([a-z0-9-]+)`", text) == list_presets(), text


def test_readme_links_resolve():
    text = README.read_text()
    links = [t for t in re.findall(r"\]\(([^)]+)\)", text) if "://" not in t]
    assert links
    missing = [t for t in links if not (REPO / t.split("#")[0]).exists()]
    assert missing == [], missing


# The commands whose flags before key=value were removed (their REMOVED_FLAGS tables).
REMOVED_FLAG_TABLES = ("export", "quantize")
# Reports and notes that name the removed spellings on purpose.
NAMES_REMOVED = ("docs/release-notes.md",)


def _removed_flags(command: str) -> dict[str, str]:
    import importlib

    return importlib.import_module(f"microscale.cli.{command}").REMOVED_FLAGS


def _current_flags() -> set[str]:
    """Every option some command still takes (``eval --data``, ``generate --formats``)."""
    import argparse

    from microscale.cli import COMMANDS, command_parser

    flags: set[str] = set()
    for name in COMMANDS:
        _, parser = command_parser(name)  # with the shared options (--list-keys)
        flags |= {
            s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings
        }
    return flags


def _pages() -> list[Path]:
    skip = ("docs/compare", "docs/plan/", *NAMES_REMOVED)
    docs = [p for p in sorted((REPO / "docs").rglob("*.md"))]
    return [README, *(p for p in docs if not str(p.relative_to(REPO)).startswith(skip))]


@pytest.mark.parametrize("command", REMOVED_FLAG_TABLES)
def test_docs_use_key_value_not_removed_flags(command):
    """The README and docs spell options as the CLI takes them (``budget=5.0``), never as
    the removed flags (``--budget 5.0``); a flag another command still takes (``eval
    --data``) counts only on a line that names this command."""
    current = _current_flags()
    used = []
    for page in _pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for flag in _removed_flags(command):
                if flag in current and not re.search(rf"\b{command}\b", line):
                    continue
                if re.search(rf"{re.escape(flag)}(?![\w-])", line):
                    used.append(f"{page.relative_to(REPO)}:{n}: {flag}")
    assert used == [], f"removed {command} flags in use (write key=value): {used}"


def test_release_notes_name_every_removed_flag_and_what_replaces_it():
    notes = (REPO / "docs/release-notes.md").read_text()
    for command in REMOVED_FLAG_TABLES:
        section = notes.split(f"#### `microscale {command}` flags")[1].split("####")[0]
        for flag, new in _removed_flags(command).items():
            row = [ln for ln in section.splitlines() if re.match(rf"\| `{flag}[ `]", ln)]
            assert len(row) == 1 and f"`{new}`".replace("|", "\\|") in row[0], (flag, row)


def _slug(heading: str) -> str:
    """The anchor mkdocs' toc gives a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", s)


def test_code_cites_design_sections_that_exist():
    anchors = {
        _slug(m) for m in re.findall(r"^#+ (.+)$", (REPO / "docs/design.md").read_text(), re.M)
    }
    cited = set()
    for path in (REPO / "src").rglob("*.py"):
        for anchor in re.findall(r"docs/design\.md#([\w-]+)", path.read_text()):
            cited.add(anchor)
            assert anchor in anchors, f"{path}: docs/design.md has no section #{anchor}"
    assert cited, "the code cites docs/design.md"


def test_nothing_cites_a_file_outside_the_repository():
    bad = []
    for path in _tracked_text_files():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if "DESIGN.md" in line or "../shared" in line:
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert bad == [], "\n".join(bad)


def test_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
