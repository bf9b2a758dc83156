"""Text sources: which documents make up a corpus, how they split, and their content hash.

A *source* is read into a :class:`Documents` object: a sorted list of ``(name, text)`` pairs
with a fixed train/val assignment and a sha256 content hash. Tokenization happens later
(:mod:`microscale.data.corpus`), so the same documents serve any tokenizer.

Sources
-------
``"stdlib"`` (the default corpus; exists on every machine, no downloads)
    The ``.py`` files of the running Python's standard library
    (``sysconfig.get_paths()["stdlib"]``), excluding ``site-packages``/``dist-packages``,
    ``__pycache__``, ``lib-dynload``, ``config-*`` build folders, every test folder (any
    path component named ``test``, ``tests`` or ``idle_test``, e.g. ``test/``,
    ``lib2to3/tests/``, ``idlelib/idle_test/``), the build-specific ``_sysconfigdata_*.py``,
    ``pydoc_data/`` (prose, held out for ``stdlib-docs``) and any file that is not valid UTF-8.
    On CPython 3.11 that is ~733 files, ~12 MB.

``"stdlib-docs"`` (a second held-out corpus of a different kind: English prose, not code)
    The documentation that ships with the standard library and that the ``stdlib`` train split
    never contains: the topic texts of ``pydoc_data/topics.py`` (the language reference that
    ``help()`` shows) plus the docstrings (``ast.get_docstring``) of the ``stdlib`` *val* files.
    It has **only a val split** (its train split is empty): it measures whether a loss gap
    measured on code generalises to prose.

a path
    * a ``.jsonl`` file: one JSON object per line, its ``text`` field (name configurable) is
      one document; blank lines are skipped;
    * a folder: every file under it (recursive, sorted by relative path, hidden files skipped)
      matching the comma-separated glob ``pattern`` (default: all files); files that are not
      valid UTF-8 are skipped and counted;
    * any other file: one plain text document (UTF-8), split by position (see below).
    Pre-tokenized ``.bin`` files never come here: see :func:`microscale.data.corpus.load_corpus`.

Held-out split
--------------
Multi-document sources split **by document**: a document goes to val when
``sha256("microscale-split:" + key)`` read as a 64-bit fraction is below ``val_fraction``
(key = relative path for folders and the stdlib, the text itself for JSONL so duplicates never
straddle the split). The rule depends on nothing but the key, so it is identical on every
machine with the same files, and adding a file never moves another one. If no document
falls below the threshold, the one with the smallest hash goes to val. A single text file
(one document) splits by position: its last ``val_fraction`` of characters (cut at a line
break when there is one) is val.

Content hash
------------
``sha256`` over the sorted documents: for each, ``name`` (UTF-8), a NUL byte, the length of
the UTF-8 text as 8 little-endian bytes, then the text. It identifies the data, not the split.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import hashlib
import json
import os
import struct
import sysconfig
from pathlib import Path

# Folder names (any path component) that never belong to the stdlib corpus.
_STDLIB_EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "lib-dynload",
        "pydoc_data",
    }
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Documents:
    """A text source read into memory, with its fixed train/val assignment."""

    # Source name for reports: "stdlib", "stdlib-docs" or the resolved path.
    name: str
    # Sorted (document name, text) pairs assigned to the train split.
    train: tuple[tuple[str, str], ...]
    # Sorted (document name, text) pairs assigned to the val split.
    val: tuple[tuple[str, str], ...]
    # sha256 (hex) of all documents, see the module docstring.
    content_hash: str
    # Number of source files read (JSONL/text: 1).
    n_files: int
    # UTF-8 bytes of all documents.
    n_bytes: int
    # How the split was made, for run summaries.
    split: dict
    # Files skipped (not UTF-8), for run summaries.
    n_skipped: int = 0


def split_fraction(key: str) -> float:
    """Stable pseudo-random fraction in [0, 1) of a document key (its split coordinate)."""
    digest = hashlib.sha256(("microscale-split:" + key).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64


def content_hash(docs: list[tuple[str, str]]) -> str:
    """sha256 hex of sorted ``(name, text)`` documents (names, lengths and texts)."""
    h = hashlib.sha256()
    for name, text in sorted(docs):
        data = text.encode("utf-8")
        h.update(name.encode("utf-8") + b"\0" + struct.pack("<Q", len(data)))
        h.update(data)
    return h.hexdigest()


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")


def _split_by_key(
    docs: list[tuple[str, str, str]], val_fraction: float
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``docs`` = (name, text, key) -> (train, val) by :func:`split_fraction` of the key."""
    _check_fraction(val_fraction)
    if len(docs) < 2:
        raise ValueError(f"a split by document needs at least 2 documents, got {len(docs)}")
    fracs = [split_fraction(key) for _, _, key in docs]
    is_val = [f < val_fraction for f in fracs]
    if not any(is_val):
        is_val[min(range(len(docs)), key=fracs.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(docs)), key=fracs.__getitem__)] = False
    train = [(n, t) for (n, t, _), v in zip(docs, is_val, strict=True) if not v]
    val = [(n, t) for (n, t, _), v in zip(docs, is_val, strict=True) if v]
    return train, val


def _make(name, train, val, *, n_files, split, n_skipped=0) -> Documents:
    everything = train + val
    return Documents(
        name=name,
        train=tuple(sorted(train)),
        val=tuple(sorted(val)),
        content_hash=content_hash(everything),
        n_files=n_files,
        n_bytes=sum(len(t.encode("utf-8")) for _, t in everything),
        split=split,
        n_skipped=n_skipped,
    )


def stdlib_root() -> Path:
    """Folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """Sorted ``(relative path, text)`` of the stdlib corpus files (see module docstring)."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder {str(root)!r} does not exist")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune excluded folders in place so os.walk never descends into them.
        dirnames[:] = [
            d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS and not d.startswith("config-")
        ]
        for fname in filenames:
            if not fname.endswith(".py") or fname.startswith("_sysconfigdata"):
                continue
            path = Path(dirpath, fname)
            try:
                out.append((path.relative_to(root).as_posix(), path.read_bytes().decode("utf-8")))
            except (UnicodeDecodeError, OSError):
                continue
    out.sort()
    return out


def read_stdlib(val_fraction: float = 0.05, *, root: Path | None = None) -> Documents:
    """The default corpus: stdlib ``.py`` sources, split by a hash of the relative path."""
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no stdlib .py files found under {str(root or stdlib_root())!r}")
    train, val = _split_by_key([(n, t, n) for n, t in files], val_fraction)
    split = {"method": "document-hash", "key": "relative path", "val_fraction": val_fraction}
    return _make("stdlib", train, val, n_files=len(files), split=split)


def docstrings(source: str) -> list[str]:
    """Docstrings of a module's module/class/function nodes, in ``ast.walk`` order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for n in ast.walk(tree) if isinstance(n, nodes) and (d := ast.get_docstring(n))]


def _pydoc_topics(root: Path) -> list[tuple[str, str]]:
    path = root / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            try:
                topics = ast.literal_eval(node.value)
            except ValueError:
                return []
            return [
                (f"pydoc_data/topics.py:{k}", v)
                for k, v in sorted(topics.items())
                if isinstance(v, str) and v.strip()
            ]
    return []


def read_stdlib_docs(val_fraction: float = 0.05, *, root: Path | None = None) -> Documents:
    """Held-out prose: pydoc topics + docstrings of the stdlib val files (val split only)."""
    root = stdlib_root() if root is None else Path(root)
    code = read_stdlib(val_fraction, root=root)
    docs = _pydoc_topics(root)
    for rel, text in code.val:
        strings = docstrings(text)
        if strings:
            docs.append((f"{rel}:docstrings", "\n\n".join(strings)))
    if not docs:
        raise FileNotFoundError(f"no stdlib documentation found under {str(root)!r}")
    split = {
        "method": "val-only",
        "contents": "pydoc_data/topics.py + docstrings of stdlib val files",
        "stdlib_val_fraction": val_fraction,
    }
    return _make("stdlib-docs", [], docs, n_files=1 + len(code.val), split=split)


def read_jsonl(path: Path, val_fraction: float = 0.05, *, text_field: str = "text") -> Documents:
    """One document per JSON line (its ``text_field``), split by a hash of the text."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{str(path)!r} line {lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                raise ValueError(
                    f"{str(path)!r} line {lineno}: expected a JSON object with a string "
                    f"{text_field!r} field, got {type(obj).__name__}"
                    + (f" with keys {sorted(obj)[:8]}" if isinstance(obj, dict) else "")
                )
            docs.append((f"{lineno:09d}", obj[text_field], obj[text_field]))
    train, val = _split_by_key(docs, val_fraction)
    split = {"method": "document-hash", "key": "text", "val_fraction": val_fraction}
    return _make(str(path), train, val, n_files=1, split=split)


def read_folder(path: Path, val_fraction: float = 0.05, *, pattern: str | None = None) -> Documents:
    """Every (matching, UTF-8) file under ``path``, split by a hash of its relative path."""
    globs = [g.strip() for g in pattern.split(",") if g.strip()] if pattern else []
    docs, skipped = [], 0
    for p in path.rglob("*"):
        rel = p.relative_to(path).as_posix()
        if not p.is_file() or any(part.startswith(".") for part in rel.split("/")):
            continue
        if globs and not any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(p.name, g) for g in globs):
            continue
        try:
            docs.append((rel, p.read_bytes().decode("utf-8"), rel))
        except UnicodeDecodeError:
            skipped += 1
    if not docs:
        raise ValueError(
            f"folder {str(path)!r} has no UTF-8 text files"
            + (f" matching pattern {pattern!r}" if pattern else "")
            + (f" ({skipped} non-UTF-8 files skipped)" if skipped else "")
        )
    docs.sort()
    train, val = _split_by_key(docs, val_fraction)
    split = {"method": "document-hash", "key": "relative path", "val_fraction": val_fraction}
    return _make(str(path), train, val, n_files=len(docs), split=split, n_skipped=skipped)


def read_text_file(path: Path, val_fraction: float = 0.05) -> Documents:
    """One UTF-8 document; its last ``val_fraction`` (cut at a line break) is val."""
    _check_fraction(val_fraction)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{str(path)!r} is not a UTF-8 text file (byte {e.start})") from e
    if len(text) < 2:
        raise ValueError(f"text file {str(path)!r} is too small to split ({len(text)} chars)")
    cut = int(round(len(text) * (1.0 - val_fraction)))
    cut = min(max(cut, 1), len(text) - 1)
    nl = text.rfind("\n", 0, cut)
    if nl > 0 and cut - nl < max(1, len(text) // 100):
        cut = nl + 1
    split = {"method": "tail", "val_fraction": val_fraction, "val_chars": len(text) - cut}
    return Documents(
        name=str(path),
        train=((path.name, text[:cut]),),
        val=((path.name, text[cut:]),),
        content_hash=content_hash([(path.name, text)]),
        n_files=1,
        n_bytes=len(text.encode("utf-8")),
        split=split,
    )


def read_documents(
    source: str,
    val_fraction: float = 0.05,
    *,
    pattern: str | None = None,
    text_field: str = "text",
) -> Documents:
    """Dispatch a source name or path (not ``.bin``) to its reader; see the module docstring."""
    if source == "stdlib":
        return read_stdlib(val_fraction)
    if source == "stdlib-docs":
        return read_stdlib_docs(val_fraction)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"corpus {source!r}: no such file or folder; expected 'stdlib', 'stdlib-docs', "
            "a text file, a folder of text files, a .jsonl file or a pre-tokenized .bin file"
        )
    if path.is_dir():
        return read_folder(path, val_fraction, pattern=pattern)
    if path.suffix.lower() == ".jsonl":
        return read_jsonl(path, val_fraction, text_field=text_field)
    return read_text_file(path, val_fraction)
