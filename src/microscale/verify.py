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
                           stored in ``meta["checksums"]``, floats finite: the
                           checkpointer's own check (:func:`microscale.train.checkpoint.
                           check_step`). Steps set aside in ``damaged-checkpoints/``
                           are listed, not checked.
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

What a path is and which files are checked is its owner's answer
(:func:`microscale.outputs.kind_of`, each kind's ``verify_plan``); this module only checks.
Anything else (a missing path, a folder or file that is not one of the above) raises
:class:`NotAnOutputError` (or ``FileNotFoundError``) before any work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from microscale.integrity import (
    CorruptDataError,
    check_file_checksums,
    listed_bytes,
    silence_checkpoint_reader_noise,
)
from microscale.outputs import (
    CheckpointStep,
    ExportFolder,
    NotAnOutputError,
    QuantizeOutput,
    TrainingRun,
    kind_of,
)
from microscale.outputs.folders import (
    FILE_LISTING,
    GGUF,
    MISSING,
    ORBAX,
    SAFETENSORS,
    SAFETENSORS_INDEX,
)
from microscale.train.checkpoint import check_step

__all__ = [
    "FileReport",
    "NotAnOutputError",
    "Problem",
    "VerifyResult",
    "output_kind",
    "silence_orbax_noise",
    "verify_path",
]


@dataclasses.dataclass(frozen=True)
class Problem:
    # The damaged tensor, or None when the file as a whole is (header, unreadable step).
    tensor: str | None
    message: str


@dataclasses.dataclass(frozen=True)
class FileReport:
    """The result for one file (or checkpoint step folder)."""

    path: Path
    # How it was checked: one of microscale.outputs.CHECKS ("gguf", "safetensors",
    # "safetensors index", "orbax checkpoint", "file checksums" or "missing").
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


def _nbytes(how: str, path: Path) -> int:
    """Bytes an item's check reads (a progress bar's total)."""
    if how == ORBAX:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if how == FILE_LISTING:
        return listed_bytes(path.parent)
    return path.stat().st_size if how != MISSING else 0


def _discover(path: Path) -> tuple[str, list[_Item], list[str]]:
    """(what the path is, the items to check, notes): its owner's ``verify_plan``
    (:func:`microscale.outputs.kind_of`); raises for anything else."""
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    kind = kind_of(path)
    if path.is_file() and kind is None:
        raise NotAnOutputError(
            f"{str(path)!r} is not a microscale output: expected a .gguf or .safetensors "
            "file, or a folder (training run, export, quantize output, checkpoint step)"
        )
    if not path.is_dir() and kind is None:
        raise NotAnOutputError(f"{str(path)!r} is neither a file nor a folder")
    plan = kind.verify_plan(path) if kind is not None else None
    if plan is None or not plan.items:
        raise NotAnOutputError(
            f"{str(path)!r} is not a microscale output: expected a training run "
            f"({TrainingRun.CONFIG} + {TrainingRun.CHECKPOINTS}/), a checkpoint step "
            f"({CheckpointStep.STATE}/ + {CheckpointStep.META}/), an export folder "
            f"({ExportFolder.CONFIG} + *.safetensors), a quantize output "
            f"({QuantizeOutput.REPORT} + {QuantizeOutput.CHECKPOINT}/ or "
            f"{QuantizeOutput.MODEL_GGUF}), or a .gguf / .safetensors file"
        )
    items = [_Item(how, p, _nbytes(how, p)) for how, p in plan.items]
    return plan.what, items, list(plan.notes)


def output_kind(path) -> str:
    """What ``path`` is ("GGUF file", "training run", "export folder (modelopt)", ...);
    raises ``FileNotFoundError`` / :class:`NotAnOutputError` when it is nothing microscale
    writes. Reads only names and small JSON files."""
    return _discover(Path(path))[0]


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
        GGUF,
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
            item.path, SAFETENSORS, 0, 0, True, (Problem(None, _strip(str(e), item.path)),)
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
        SAFETENSORS,
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
            item.path, SAFETENSORS_INDEX, 0, 0, True, (Problem(None, _strip(str(e), item.path)),)
        )
    # The index has no checksum of its own; consistent with every shard = as good as it gets.
    return FileReport(item.path, SAFETENSORS_INDEX, len(store), 0, True)


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


def _check_step(item: _Item, step: _Progress) -> FileReport:
    """One step folder, by the checkpointer's own check (:func:`~microscale.train.
    checkpoint.check_step`: restore into numpy, CRC-32s, finiteness)."""
    res = check_step(item.path, step)
    problems = tuple(Problem(t, m) for t, m in res.problems)
    return FileReport(item.path, ORBAX, res.tensors, res.checked, res.checksums, problems)


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
        MISSING,
        0,
        0,
        True,
        (Problem(None, f"{item.path} is missing (the output's model files)"),),
    )


_CHECKS = {
    GGUF: _check_gguf,
    SAFETENSORS: _check_safetensors,
    SAFETENSORS_INDEX: _check_index,
    ORBAX: _check_step,
    FILE_LISTING: _check_files,
    MISSING: _check_missing,
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
