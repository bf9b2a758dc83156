"""Python examples in the docs, run as written: a block marked ``<!-- test: NAME -->``
right above its fence is one a test executes (the rest of a page's blocks are shown only)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
_MARKED = re.compile(r"<!-- test: ([\w-]+) -->\n```python\n(.*?)```", re.S)


def marked_blocks(page: str) -> dict[str, str]:
    """``{name: code}`` of the marked blocks of ``docs/<page>``."""
    return dict(_MARKED.findall((DOCS / page).read_text()))


def run_block(page: str, name: str) -> tuple[dict, str]:
    """Execute one marked block in the current folder: ``(its globals, what it printed)``."""
    shown, scope = io.StringIO(), {}
    with contextlib.redirect_stdout(shown):
        exec(compile(marked_blocks(page)[name], str(DOCS / page), "exec"), scope)
    return scope, shown.getvalue()
