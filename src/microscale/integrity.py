"""Content checksums and finiteness checks for stored tensors.

Checkpoints (``train/checkpoint.py``), exported safetensors (``export/tensorfile.py``) and
GGUF files (``export/gguffile.py``) store a CRC-32 of every tensor's bytes when written,
and check it, plus that every floating-point value is finite, when read. A bit flip, a
truncated or a swapped file is then reported with the file and tensor it hit instead of
being computed on. :func:`microscale.verify.verify_path` (``microscale verify``) checks a
whole output without loading a model.

CRC-32 (``zlib.crc32``, the checksum of zip and PNG) detects every burst error of up to 32
bits and any other corruption with probability 1 - 2^-32 per tensor; it is not a
cryptographic hash (it does not defend against deliberate tampering). It is the fastest
checksum in the standard library and releases the GIL, so tensors are hashed in parallel
threads. ``benchmarks/integrity.py`` measures the cost against saving and loading.

Files that store no checksums of their own (reports, allocations, configs, tokenizers,
plots) are listed, with the CRC-32 of their bytes, in the folder's :data:`FILE_CHECKSUMS`
(:func:`write_file_checksums` when the folder is written, :func:`check_file_checksums` by
``microscale verify``): ``{"format": "microscale-file-crc32", "version": 1, "files":
{relative POSIX path: 8 hex digits}}``. Weight files (``.safetensors``, ``.gguf``) are left
out: their tensors carry checksums of their own, which ``verify`` checks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from microscale.files import atomic_write_json

__all__ = [
    "FILE_CHECKSUMS",
    "CorruptDataError",
    "FolderCheck",
    "check_file_checksums",
    "check_finite",
    "crc32",
    "crc32_many",
    "file_crc32",
    "listed_bytes",
    "root_cause",
    "silence_checkpoint_reader_noise",
    "tree_path_parts",
    "verify_crc32",
    "write_file_checksums",
]

_CHUNK = 1 << 26  # hash in 64 MiB pieces: zlib takes at most 4 GiB at once


class CorruptDataError(ValueError):
    """Stored data fails its checksum, is not finite, or cannot be decoded."""


def crc32(array) -> str:
    """CRC-32 of an array's bytes (C order), or of a bytes-like object, as 8 hex digits."""
    if isinstance(array, (bytes, bytearray, memoryview)):
        array = np.frombuffer(array, np.uint8)
    a = np.ascontiguousarray(np.asarray(array))
    flat = a.reshape(-1).view(np.uint8) if a.size else np.zeros(0, np.uint8)
    c = 0
    for i in range(0, flat.size, _CHUNK):
        c = zlib.crc32(flat[i : i + _CHUNK].data, c)
    return f"{c:08x}"


def _pool_size() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def crc32_many(
    arrays: Mapping[str, object], *, on_done: Callable[[str], None] | None = None
) -> dict[str, str]:
    """``{name: crc32}`` of many arrays, hashed in parallel threads; ``on_done(name)`` is
    called (from a worker thread) after each array, e.g. to advance a progress bar."""
    names = list(arrays)

    def one(n: str) -> str:
        c = crc32(arrays[n])
        if on_done is not None:
            on_done(n)
        return c

    if len(names) < 2:
        return {n: one(n) for n in names}
    with ThreadPoolExecutor(_pool_size()) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def verify_crc32(arrays: Mapping[str, object], expected: Mapping[str, str], *, where: str) -> None:
    """Raise :class:`CorruptDataError` naming ``where`` and the first tensor whose CRC-32
    differs from ``expected`` (tensors without an expected value are not checked)."""
    names = [n for n in arrays if n in expected]
    got = crc32_many({n: arrays[n] for n in names})
    bad = [n for n in names if got[n] != str(expected[n]).lower()]
    if bad:
        n = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CorruptDataError(
            f"{where}: tensor {n!r} fails its checksum (crc32 {got[n]}, "
            f"stored {expected[n]}){more}: the file is damaged"
        )


# ------------------------------------------------------------------ files of a folder

FILE_CHECKSUMS = "checksums.json"  # the listing of a folder's files (module doc)
_FILE_FORMAT, _FILE_VERSION = "microscale-file-crc32", 1
# Files that carry per-tensor checksums of their own (checked by their own readers).
_OWN_CHECKSUMS = (".safetensors", ".gguf")


def file_crc32(path: str | os.PathLike, *, on_bytes: Callable[[int], None] | None = None) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits (:func:`crc32`'s value for the same bytes),
    read in pieces; ``on_bytes(n)`` after each piece."""
    c = 0
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
            c = zlib.crc32(piece, c)
            if on_bytes is not None:
                on_bytes(len(piece))
    return f"{c:08x}"


def _listed_files(folder: Path) -> list[str]:
    """The files :func:`write_file_checksums` lists: every file under ``folder`` but weight
    files and the listing itself, as sorted relative POSIX paths."""
    return sorted(
        f.relative_to(folder).as_posix()
        for f in folder.rglob("*")
        if f.is_file() and f.suffix not in _OWN_CHECKSUMS and f.name != FILE_CHECKSUMS
    )


def listed_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the files a listing of ``folder`` covers (a progress bar's total)."""
    folder = Path(folder)
    return sum((folder / n).stat().st_size for n in _listed_files(folder))


def write_file_checksums(folder: str | os.PathLike) -> dict[str, str]:
    """Write ``folder``'s :data:`FILE_CHECKSUMS` (the module doc): the CRC-32 of every file
    under it that stores no checksums of its own. Call it last, once every file is
    written. Returns ``{relative path: crc32}``."""
    folder = Path(folder)
    sums = {name: file_crc32(folder / name) for name in _listed_files(folder)}
    atomic_write_json(
        folder / FILE_CHECKSUMS, {"format": _FILE_FORMAT, "version": _FILE_VERSION, "files": sums}
    )
    return sums


@dataclasses.dataclass(frozen=True)
class FolderCheck:
    """What :func:`check_file_checksums` found."""

    # Files the listing names (0 when there is no readable listing).
    files: int
    # Files compared with their stored checksum.
    checked: int
    # Whether the folder stores a listing at all (False: written before there was one).
    checksums: bool
    # (relative path, or None for the listing as a whole; message naming the file).
    problems: tuple[tuple[str | None, str], ...] = ()


def _read_listing(path: Path) -> tuple[dict[str, str] | None, str | None]:
    """The ``files`` map of a listing, or None and what is wrong with it."""
    damaged = f"{path} is damaged"
    try:
        obj = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{damaged}: it is not a readable JSON file ({e})"
    files = obj.get("files") if isinstance(obj, dict) else None
    if (
        not isinstance(obj, dict)
        or obj.get("format") != _FILE_FORMAT
        or not isinstance(files, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        return None, f"{damaged}: expected {{'format': {_FILE_FORMAT!r}, 'files': {{path: crc32}}}}"
    return files, None


def check_file_checksums(
    folder: str | os.PathLike, *, on_bytes: Callable[[int], None] | None = None
) -> FolderCheck:
    """Compare every file ``folder``'s :data:`FILE_CHECKSUMS` lists with its stored CRC-32;
    each problem names the file (changed, missing, or a name that leaves the folder).
    ``on_bytes(n)`` counts the bytes read."""
    folder = Path(folder)
    listing = folder / FILE_CHECKSUMS
    if not listing.is_file():
        return FolderCheck(len(_listed_files(folder)), 0, False)
    files, why = _read_listing(listing)
    if files is None:
        return FolderCheck(0, 0, True, ((None, str(why)),))
    problems: list[tuple[str | None, str]] = []
    checked = 0
    for name, stored in files.items():
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append((name, f"{listing} names {name!r}, outside the folder: it is damaged"))
        elif not path.is_file():
            problems.append((name, f"{path} is missing (listed in {FILE_CHECKSUMS})"))
        else:
            got = file_crc32(path, on_bytes=on_bytes)
            checked += 1
            if got != stored.lower():
                problems.append(
                    (
                        name,
                        f"{path} fails its checksum (crc32 {got}, stored {stored} in "
                        f"{FILE_CHECKSUMS}): the file was changed after it was written",
                    )
                )
    return FolderCheck(len(files), checked, True, tuple(problems))


def _is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or "float" in dtype.name  # + ml_dtypes


def check_finite(items: Iterable[tuple[str, object]], *, where: str) -> None:
    """Raise :class:`CorruptDataError` naming ``where`` and the first floating-point tensor
    holding a NaN or infinity."""
    for name, x in items:
        a = np.asarray(x)
        if not (_is_float(a.dtype) and a.size):
            continue
        ok = np.isfinite(a.astype(np.float32) if a.dtype.itemsize < 4 else a)
        if not ok.all():
            n_bad = int(a.size - np.count_nonzero(ok))
            raise CorruptDataError(
                f"{where}: tensor {name!r} holds {n_bad} non-finite "
                f"value(s) (NaN or infinity) of {a.size}"
            )


# ------------------------------------------------------------------ checkpoint reading


def tree_path_parts(path) -> tuple[str, ...]:
    """A pytree key path as plain strings (dict keys, sequence indices and attribute names
    alike), so an orbax metadata tree (string keys) and a live tree compare."""
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def root_cause(e: BaseException) -> str:
    """The first line of the innermost cause (tensorstore names the array and file there;
    the outer orbax messages are pages of spec dumps), at most 300 characters."""
    while (inner := e.__cause__ or e.__context__) is not None:
        e = inner
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def _is_checkpoint_reader_noise(u) -> bool:
    """An unraisable exception from orbax's readers after a failed read (see
    :func:`silence_checkpoint_reader_noise`)."""
    if (
        u.object is None
        and isinstance(u.exc_value, RuntimeError)
        and str(u.exc_value) == "Event loop is closed"
    ):
        return True
    code = getattr(u.object, "cr_code", None)
    if code is not None and "orbax" in code.co_filename:
        return True
    return _from_checkpoint_reader(u.exc_value)


def _from_checkpoint_reader(exc: BaseException | None) -> bool:
    """Whether ``exc`` was raised by orbax's or tensorstore's reading code: a frame of its
    traceback lies in orbax, or tensorstore names the OCDBT database it failed to read."""
    if exc is None:
        return False
    tb = exc.__traceback__
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return "OCDBT database" in str(exc)


class _AbandonedReaderFutures(logging.Filter):
    """Drops asyncio's "<Future class> exception was never retrieved" records whose exception
    came from the checkpoint reader (see :func:`silence_checkpoint_reader_noise`)."""

    _microscale = True

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).split("\n", 1)[0].endswith("exception was never retrieved"):
            return True  # Future, Task, _GatheringFuture, ...: asyncio names the class
        exc = record.exc_info[1] if record.exc_info else None
        return not _from_checkpoint_reader(exc)


def silence_checkpoint_reader_noise() -> None:
    """When a checkpoint read fails, orbax's asynchronous readers go on failing after the
    exception that reports it, in two ways, both printed after the call has returned:

    - tensorstore's threads complete futures of the asyncio loop orbax has already closed
      (``RuntimeError('Event loop is closed')``) and abandoned orbax coroutines die with
      their exceptions; each goes to :data:`sys.unraisablehook`;
    - futures that failed with the read error are garbage-collected unretrieved, and
      asyncio logs each ("Future exception was never retrieved") with its traceback.

    Either prints dozens to thousands of lines. Called before every read (idempotent, for
    the rest of the process), this drops exactly those and passes every other unraisable
    exception and asyncio record on."""
    log = logging.getLogger("asyncio")
    if not any(getattr(f, "_microscale", False) for f in log.filters):
        log.addFilter(_AbandonedReaderFutures())
    hook = sys.unraisablehook
    if getattr(hook, "_microscale", False):
        return

    def filtered(u):
        if not _is_checkpoint_reader_noise(u):
            hook(u)

    filtered._microscale = True  # type: ignore[attr-defined]
    sys.unraisablehook = filtered
