"""Check any output microscale wrote against the checksums stored in it, without loading a
model (numpy, memory maps and CRC-32 only; no arrays on a device).

    from microscale.verify import verify_path
    res = verify_path("out/model.gguf")      # or an export / quantize / run folder
    res.exit_code                             # 0 ok, 1 damaged, 3 no checksums stored
    [(f.path, p.tensor, p.message) for f in res.damaged for p in f.problems]

What a path may be, and what is checked:

=========================  ==========================================================
GGUF file (``*.gguf``)     the header CRC and every tensor's CRC
                           (:mod:`microscale.export.gguffile`)
safetensors file           the header (:func:`~microscale.export.tensorfile.
                           read_safetensors_header`), every tensor's CRC from
                           ``__metadata__["microscale.crc32"]``, floats finite
export folder              ``config.json`` + ``model.safetensors`` or shards and their
                           index (``microscale export``, compressed-tensors / ModelOpt;
                           a quantize output's ``checkpoint/``, either layout): the index
                           against the shards, then every file as above
training run               every finished step under ``checkpoints/`` (or a
                           ``checkpoints/`` folder, or one step folder): the step's
                           ``meta`` JSON, then each array of ``state/`` restored by orbax
                           into numpy one batch at a time and compared with the CRC-32s
                           stored in ``meta["checksums"]`` (``train/checkpoint.py``),
                           floats finite. Steps set aside in ``damaged-checkpoints/`` are
                           listed, not checked.
quantize output            its ``checkpoint/`` folder or ``model.gguf``, then every other
                           file (``report.json``, ``precision_rules.json``, configs,
                           tokenizer, plots) against the CRC-32s of its
                           ``checksums.json`` (:func:`microscale.integrity.
                           check_file_checksums`)
=========================  ==========================================================

Each file (or checkpoint step) gets a :class:`FileReport`: ``ok`` (every tensor matches
its stored checksum), ``damaged`` (problems name the tensor, or ``None`` for the file as a
whole: a header that does not parse or fails its checksum, an unreadable step) or
``unverified`` (no checksums stored: written before microscale stored them; the file was
still parsed, and safetensors / checkpoint floats checked for being finite). A quantize
output's listed files are one report (kind ``"file checksums"``, counted in files); JSON
and tokenizer files elsewhere carry no checksums and are not checked.

Anything else (a missing path, a folder or file that is not one of the above) raises
:class:`NotAnOutputError` (or ``FileNotFoundError``) before any work.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from microscale.export.registry import QUANTIZE_OUTPUT, RUN, Layout, detect, quantize_output_model
from microscale.integrity import (
    FILE_CHECKSUMS,
    CorruptDataError,
    check_file_checksums,
    check_finite,
    crc32_many,
    listed_bytes,
    root_cause,
    silence_checkpoint_reader_noise,
    tree_path_parts,
)

__all__ = [
    "FileReport",
    "NotAnOutputError",
    "Problem",
    "VerifyResult",
    "output_kind",
    "silence_orbax_noise",
    "verify_path",
]

# train/checkpoint.py's layout: <step>/state (orbax StandardSave), <step>/meta (orbax
# JsonSave, file "metadata") with the state's CRC-32s under "checksums".
_STATE, _META, _META_FILE, _META_CRC = "state", "meta", "metadata", "checksums"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BATCH_BYTES = 1 << 28  # checkpoint arrays restored per orbax call (then verified, dropped)


class NotAnOutputError(ValueError):
    """The path is not something microscale writes (or holds nothing to verify)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    # The damaged tensor, or None when the file as a whole is (header, unreadable step).
    tensor: str | None
    message: str


@dataclasses.dataclass(frozen=True)
class FileReport:
    """The result for one file (or checkpoint step folder)."""

    path: Path
    # "gguf", "safetensors", "safetensors index", "orbax checkpoint", "file checksums"
    # or "missing".
    kind: str
    # Tensors found (0 when the file cannot be parsed); files listed for "file checksums".
    tensors: int
    # Tensors (files) compared with a stored checksum.
    checked: int
    # Whether the file stores checksums.
    checksums: bool
    problems: tuple[Problem, ...] = ()
    # What ``tensors`` counts, in the summary ("tensor"; "file" for "file checksums").
    unit: str = "tensor"

    @property
    def status(self) -> str:
        """``damaged``, ``ok`` or ``unverified`` (no checksums stored)."""
        if self.problems:
            return "damaged"
        return "ok" if self.checksums else "unverified"

    def summary(self) -> str:
        """One line: the path, kind and what was found."""
        head = f"{self.path} ({self.kind})"
        units = f"{self.unit}s"
        if self.problems:
            bad = sorted({p.tensor for p in self.problems if p.tensor is not None})
            what = f"{len(bad)} of {self.tensors} {units} damaged" if bad else "damaged (see below)"
            return f"{head}: {what}"
        if not self.checksums:
            return (
                f"{head}: no checksums stored (written before microscale stored them); "
                f"{self.tensors} {units} {'parsed' if self.unit == 'tensor' else 'found'}, "
                "contents not verified"
            )
        return f"{head}: {self.checked} {units} match their CRC-32s"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "status": self.status,
            "tensors": self.tensors,
            "checked": self.checked,
            "checksums": self.checksums,
            "problems": [{"tensor": p.tensor, "message": p.message} for p in self.problems],
        }


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Every file checked under one path."""

    path: Path
    # What the path is ("GGUF file", "training run", "export folder (modelopt)", ...).
    what: str
    files: tuple[FileReport, ...]
    # Things seen and deliberately not checked (damaged-checkpoints/ set aside by resume).
    notes: tuple[str, ...] = ()

    @property
    def damaged(self) -> list[FileReport]:
        return [f for f in self.files if f.problems]

    @property
    def unverified(self) -> list[FileReport]:
        return [f for f in self.files if f.status == "unverified"]

    @property
    def exit_code(self) -> int:
        """1: something is damaged; 3: nothing damaged but some file stores no checksums;
        0: every file matches its checksums."""
        return 1 if self.damaged else 3 if self.unverified else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "what": self.what,
            "exit_code": self.exit_code,
            "files": [f.to_dict() for f in self.files],
            "notes": list(self.notes),
        }


@dataclasses.dataclass(frozen=True)
class _Item:
    kind: str
    path: Path
    nbytes: int


# ---------------------------------------------------------------------- discovery


def _folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _steps(ckpt_dir: Path) -> list[Path]:
    """Finished orbax steps (folders named by an integer) in step order."""
    return sorted(
        (d for d in ckpt_dir.iterdir() if d.is_dir() and d.name.isdigit()),
        key=lambda d: int(d.name),
    )


def _is_step(p: Path) -> bool:
    return (p / _STATE).is_dir() and (p / _META).is_dir()


def _safetensors_items(folder: Path) -> list[_Item]:
    index = folder / _SAFETENSORS_INDEX
    if index.is_file():
        items = [_Item("safetensors index", index, 0)]
        try:
            shards = sorted(set(json.loads(index.read_text("utf-8"))["weight_map"].values()))
        except Exception:  # noqa: BLE001 - reported when the index is checked
            shards = []
        for name in shards:
            if isinstance(name, str) and Path(name).name == name and (folder / name).is_file():
                items.append(_Item("safetensors", folder / name, (folder / name).stat().st_size))
        return items
    files = sorted(folder.glob("*.safetensors"))
    return [_Item("safetensors", f, f.stat().st_size) for f in files]


def _discover(path: Path) -> tuple[str, list[_Item], list[str]]:
    """(what the path is, the items to check, notes); raises for anything else."""
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    kind = detect(path)
    if path.is_file():
        if isinstance(kind, Layout) and kind.single_file:
            return "GGUF file", [_Item("gguf", path, path.stat().st_size)], []
        if path.suffix == ".safetensors":
            return "safetensors file", [_Item("safetensors", path, path.stat().st_size)], []
        raise NotAnOutputError(
            f"{str(path)!r} is not a microscale output: expected a .gguf or .safetensors "
            "file, or a folder (training run, export, quantize output, checkpoint step)"
        )
    if not path.is_dir():
        raise NotAnOutputError(f"{str(path)!r} is neither a file nor a folder")
    notes: list[str] = []
    ckpts, what = None, None
    if kind is RUN:
        ckpts, what = path / "checkpoints", "training run"
        aside = path / "damaged-checkpoints"
        if aside.is_dir() and any(aside.iterdir()):
            names = sorted(d.name for d in aside.iterdir())
            notes.append(
                f"{aside}: {len(names)} step(s) set aside as damaged by an earlier "
                f"resume ({', '.join(names)}); not checked"
            )
    elif _is_step(path):
        return "checkpoint step", [_Item("orbax checkpoint", path, _folder_bytes(path))], []
    elif any(_is_step(d) for d in _steps(path)):
        ckpts, what = path, "checkpoint folder"
    if ckpts is not None:
        steps = _steps(ckpts)
        assert what is not None  # set with ckpts
        if not steps:
            raise NotAnOutputError(
                f"{what} {str(path)!r} has no finished checkpoint under {ckpts} to verify"
            )
        return what, [_Item("orbax checkpoint", d, _folder_bytes(d)) for d in steps], notes
    if kind is QUANTIZE_OUTPUT:
        ck = quantize_output_model(path)
        files = _Item("file checksums", path / FILE_CHECKSUMS, listed_bytes(path))
        if ck.is_file():
            return "quantize output", [_Item("gguf", ck, ck.stat().st_size), files], []
        items = _safetensors_items(ck) if ck.is_dir() else []
        if not items:
            items = [_Item("missing", ck, 0)]
        return "quantize output", [*items, files], []
    if isinstance(kind, Layout):  # an HF-style or microscale-layout folder
        items = _safetensors_items(path)
        if items:
            return _folder_kind(path), items, []
    raise NotAnOutputError(
        f"{str(path)!r} is not a microscale output: expected a training run (config.yaml + "
        "checkpoints/), a checkpoint step (state/ + meta/), an export folder (config.json + "
        "*.safetensors), a quantize output (report.json + checkpoint/ or model.gguf), or a "
        ".gguf / .safetensors file"
    )


def output_kind(path) -> str:
    """What ``path`` is ("GGUF file", "training run", "export folder (modelopt)", ...);
    raises ``FileNotFoundError`` / :class:`NotAnOutputError` when it is nothing microscale
    writes. Reads only names and small JSON files."""
    return _discover(Path(path))[0]


def _folder_kind(path: Path) -> str:
    for name in ("microscale_export.json", "manifest.json"):
        with contextlib.suppress(Exception):
            obj = json.loads((path / name).read_text("utf-8"))
            layout = obj.get("layout") or obj.get("format")
            if isinstance(layout, str):
                return f"export folder ({layout})"
    return "model folder (safetensors)"


# ---------------------------------------------------------------------- checks


class _Progress:
    """Counts one item's bytes into ``on_bytes`` (thread-safe), never past its size."""

    def __init__(self, item: _Item, on_bytes: Callable[[int], None] | None):
        self.left, self.on_bytes, self.lock = item.nbytes, on_bytes, threading.Lock()

    def __call__(self, n: int) -> None:
        if self.on_bytes is None:
            return
        with self.lock:
            n = max(0, min(int(n), self.left))
            self.left -= n
        if n:
            self.on_bytes(n)

    def finish(self) -> None:
        self(self.left)


def _strip(msg: str, path: Path) -> str:
    """A message without a leading ``<path>: `` (the report line names the file)."""
    for p in (str(path), str(path.parent)):
        if msg.startswith(p + ": "):
            return msg[len(p) + 2 :]
    return msg


def _check_gguf(item: _Item, step: _Progress) -> FileReport:
    from microscale.export.gguffile import check_gguf

    res = check_gguf(item.path, progress=step)
    return FileReport(
        item.path,
        "gguf",
        res.tensors,
        res.checked,
        res.checksums,
        tuple(Problem(t, _strip(m, item.path)) for t, m in res.problems),
    )


def _check_safetensors(item: _Item, step: _Progress) -> FileReport:
    from microscale.export.tensorfile import SafetensorsError, TensorStore

    try:
        store = TensorStore(item.path)
    except (CorruptDataError, SafetensorsError, OSError, ValueError) as e:
        return FileReport(
            item.path, "safetensors", 0, 0, True, (Problem(None, _strip(str(e), item.path)),)
        )
    sums = store.checksums
    problems = []
    for name in store.names():
        if sums and name not in sums:
            problems.append(
                Problem(
                    name,
                    f"tensor {name!r} has no stored checksum although "
                    "the file stores them; the header is damaged",
                )
            )
        try:
            store.get(name)
        except (SafetensorsError, CorruptDataError) as e:
            problems.append(Problem(name, _strip(str(e), item.path)))
        info = store.infos[name]
        step(info.end - info.begin)
    return FileReport(
        item.path,
        "safetensors",
        len(store),
        len(set(sums) & set(store.infos)),
        bool(sums),
        tuple(problems),
    )


def _check_index(item: _Item, step: _Progress) -> FileReport:
    from microscale.export.tensorfile import SafetensorsError, TensorStore

    try:
        store = TensorStore(item.path.parent)
    except (CorruptDataError, SafetensorsError, OSError, ValueError) as e:
        return FileReport(
            item.path, "safetensors index", 0, 0, True, (Problem(None, _strip(str(e), item.path)),)
        )
    # The index has no checksum of its own; consistent with every shard = as good as it gets.
    return FileReport(item.path, "safetensors index", len(store), 0, True)


_KEYSTR_TOKEN = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]|\.([A-Za-z_]\w*)")


def _keystr_parts(s: str) -> tuple[str, ...]:
    """``"['opt_state'][1].mu['layers'][0]"`` -> ``('opt_state', '1', 'mu', 'layers', '0')``:
    a ``jax.tree_util.keystr`` (the names ``meta["checksums"]`` uses) as plain strings,
    comparable with the paths of an orbax metadata tree (dict keys there are strings)."""
    return tuple(str(ast.literal_eval(a)) if a else b for a, b in _KEYSTR_TOKEN.findall(s))


def silence_orbax_noise() -> Callable[[], None]:
    """Keep orbax's and tensorstore's side noise off the terminal: the unraisable
    exceptions of its readers after a failed read
    (:func:`~microscale.integrity.silence_checkpoint_reader_noise`, for the rest of the
    process: some arrive after the call returns), asyncio's "Task exception was never
    retrieved" and absl's warning for each bare step folder read. Returns a function that
    restores the two loggers' levels. The failure itself is reported, with the tensor,
    through the exception orbax raises."""
    silence_checkpoint_reader_noise()
    loggers = [
        (logging.getLogger(n), lvl)
        for n, lvl in (("absl", logging.ERROR), ("asyncio", logging.CRITICAL))
    ]
    old_levels = [lg.level for lg, _ in loggers]
    for lg, lvl in loggers:
        lg.setLevel(lvl)

    def undo() -> None:
        for (lg, _), lvl in zip(loggers, old_levels, strict=True):
            lg.setLevel(lvl)

    return undo


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    undo = silence_orbax_noise()
    try:
        yield
    finally:
        undo()


def _read_meta_checksums(step_dir: Path, problems: list[Problem]) -> dict[str, str] | None:
    """``meta["checksums"]`` of a step (None when none are stored or meta is unreadable)."""
    meta_file = step_dir / _META / _META_FILE
    try:
        meta = json.loads(meta_file.read_text("utf-8"))
    except FileNotFoundError:
        problems.append(Problem(None, f"{meta_file} is missing"))
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(Problem(None, f"{meta_file} is not JSON ({e}); the metadata is damaged"))
        return None
    sums = meta.get(_META_CRC) if isinstance(meta, dict) else None
    if sums is not None and not (
        isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())
    ):
        problems.append(
            Problem(
                None,
                f"{meta_file}: {_META_CRC!r} is not an object of "
                "checksums; the metadata is damaged",
            )
        )
        return None
    return sums


def _nbytes(m) -> int:
    """Bytes of an array (or its metadata: ``shape`` and ``dtype``)."""
    return int(np.prod(m.shape, dtype=np.int64)) * np.dtype(m.dtype).itemsize


def _batches(leaves: list) -> list[list]:
    """``(path, metadata)`` leaves in restore batches of at most ``_BATCH_BYTES`` (a larger
    array alone)."""
    batches: list[list] = [[]]
    size = 0
    for leaf in leaves:
        if batches[-1] and size + _nbytes(leaf[1]) > _BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(leaf)
        size += _nbytes(leaf[1])
    return batches


def _check_arrays(
    named: dict[str, np.ndarray], sums: dict[str, str] | None, where: Path, problems: list[Problem]
) -> int:
    """Check restored arrays against the stored checksums (``sums``; None: none stored)
    and for non-finite values, appending to ``problems``; returns how many were hashed."""
    stored: dict[str, str] = sums or {}
    got = crc32_many({n: a for n, a in named.items() if sums and n in sums})
    for n, a in named.items():
        if n in got and got[n] != str(stored[n]).lower():
            problems.append(
                Problem(n, f"tensor {n!r} fails its checksum (crc32 {got[n]}, stored {stored[n]})")
            )
            continue
        if sums and n not in sums:
            problems.append(
                Problem(
                    n,
                    f"tensor {n!r} has no stored checksum although "
                    "the step stores them; the metadata is damaged",
                )
            )
        try:
            check_finite([(n, a)], where=str(where))
        except CorruptDataError as e:
            problems.append(Problem(n, _strip(str(e), where)))
    return len(got)


def _is_array(m: Any) -> bool:
    """Whether an orbax metadata leaf describes an array."""
    return hasattr(m, "shape") and hasattr(m, "dtype")


def _orbax_tree(ckptr, state: Path) -> tuple[Any, str]:
    """The array metadata tree of an orbax step's ``state`` (None when unreadable) and
    what is wrong when it is None."""
    try:
        tree = getattr(ckptr.metadata(state).item_metadata, "tree", None)
        why = (
            "orbax reads no array metadata from it (state/_METADATA or its OCDBT index is "
            "damaged, truncated or missing)"
        )
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds
        tree, why = (
            None,
            f"its array metadata cannot be read (a damaged, truncated or "
            f"missing file): {root_cause(e)}",
        )
    return tree, why


def _restore_selected(ckptr, state: Path, tree: Any, selected: list) -> dict:
    """The arrays of ``selected`` (``(path, metadata)`` pairs) restored into numpy, keyed
    by tree path; every other array is skipped (a placeholder)."""
    import jax
    import orbax.checkpoint as ocp

    chosen = {p for p, _ in selected}

    def pick(make):
        return lambda p, m: (make(m) if p in chosen else ocp.PLACEHOLDER) if _is_array(m) else m

    out = ckptr.restore(
        state,
        args=ocp.args.PyTreeRestore(
            item=jax.tree_util.tree_map_with_path(pick(lambda m: m), tree, is_leaf=_is_array),
            restore_args=jax.tree_util.tree_map_with_path(
                pick(lambda _: ocp.RestoreArgs(restore_type=np.ndarray)), tree, is_leaf=_is_array
            ),
        ),
    )
    return {
        p: np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(out)[0] if p in chosen
    }


def _check_step(item: _Item, step: _Progress) -> FileReport:
    """One orbax step folder of ``train/checkpoint.py`` (see the module doc): arrays are
    restored into numpy a batch at a time (a failed batch again one array at a time, to
    name the damaged one), hashed, checked finite and dropped."""
    import jax
    import orbax.checkpoint as ocp

    kind = "orbax checkpoint"
    state = item.path.absolute() / _STATE  # orbax resolves relative paths elsewhere
    problems: list[Problem] = []
    sums = _read_meta_checksums(item.path, problems)
    by_parts = {_keystr_parts(k): k for k in (sums or {})}
    ckptr = ocp.PyTreeCheckpointer()
    tree, why = _orbax_tree(ckptr, state)
    if tree is None:
        problems.append(Problem(None, f"{state}: {why}"))
        return FileReport(item.path, kind, 0, 0, sums is not None, tuple(problems))
    leaves = [
        (p, m)
        for p, m in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_array)[0]
        if _is_array(m)
    ]

    def name_of(path) -> str:
        return by_parts.get(tree_path_parts(path), jax.tree_util.keystr(path))

    def restore(selected: list) -> dict:
        return _restore_selected(ckptr, state, tree, selected)

    batches = _batches(leaves)
    seen: set[tuple[str, ...]] = set()
    checked = 0
    for batch in batches:
        try:
            arrays = restore(batch)
        except Exception:  # noqa: BLE001 - find which arrays, one at a time (below)
            arrays = None
        if arrays is None:  # outside the handler: each error's own cause, not the batch's
            arrays = {}
            for p, m in batch:
                try:
                    arrays.update(restore([(p, m)]))
                except Exception as e:  # noqa: BLE001
                    seen.add(tree_path_parts(p))
                    problems.append(
                        Problem(
                            name_of(p),
                            f"tensor {name_of(p)!r} cannot be "
                            "restored (a damaged, truncated or "
                            f"missing file): {root_cause(e)}",
                        )
                    )
        named = {name_of(p): a for p, a in arrays.items()}
        seen.update(tree_path_parts(p) for p in arrays)
        del arrays
        checked += _check_arrays(named, sums, item.path, problems)
        step(sum(_nbytes(m) for _, m in batch))
        del named
    for parts, n in sorted(by_parts.items(), key=lambda kv: kv[1]):
        if parts not in seen:
            problems.append(
                Problem(
                    n,
                    f"tensor {n!r} has a stored checksum but is not in "
                    f"{state}; the checkpoint is damaged",
                )
            )
    return FileReport(item.path, kind, len(leaves), checked, sums is not None, tuple(problems))


def _check_files(item: _Item, step: _Progress) -> FileReport:
    """A quantize output's files without checksums of their own, against its listing."""
    res = check_file_checksums(item.path.parent, on_bytes=step)
    return FileReport(
        item.path,
        item.kind,
        res.files,
        res.checked,
        res.checksums,
        tuple(Problem(name, msg) for name, msg in res.problems),
        unit="file",
    )


def _check_missing(item: _Item, step: _Progress) -> FileReport:
    return FileReport(
        item.path,
        "missing",
        0,
        0,
        True,
        (Problem(None, f"{item.path} is missing (the output's model files)"),),
    )


_CHECKS = {
    "gguf": _check_gguf,
    "safetensors": _check_safetensors,
    "safetensors index": _check_index,
    "orbax checkpoint": _check_step,
    "file checksums": _check_files,
    "missing": _check_missing,
}


def verify_path(
    path,
    *,
    on_start: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_file: Callable[[FileReport], None] | None = None,
) -> VerifyResult:
    """Check every file of the output at ``path`` against its stored checksums (module
    doc) and return what was found; a damaged file is reported, never raised.

    ``on_start(total_bytes)`` is called once the files are known, ``on_bytes(n)`` as they
    are read (a progress bar), ``on_file(report)`` after each file.
    Raises ``FileNotFoundError`` / :class:`NotAnOutputError` when ``path`` is not an
    output microscale writes."""
    path = Path(path)
    what, items, notes = _discover(path)
    if on_start is not None:
        on_start(sum(i.nbytes for i in items))
    reports = []
    for item in items:
        step = _Progress(item, on_bytes)
        with _quiet_orbax():
            rep = _CHECKS[item.kind](item, step)
        step.finish()
        reports.append(rep)
        if on_file is not None:
            on_file(rep)
    return VerifyResult(path=path, what=what, files=tuple(reports), notes=tuple(notes))
