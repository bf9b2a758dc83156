"""Safe file output: atomic writes, atomic folders, one writer per folder, early path checks.

Every file and folder microscale writes goes through this module, so that a process killed
at any moment leaves either the old content or the new one, never a mix or a stub:

* :func:`atomic_writer` (and :func:`atomic_write_bytes` / ``_text`` / ``_json`` / ``_yaml``)
  writes into a temporary sibling ``.NAME.tmp-PID-N``, flushes it to disk (``fsync``) and
  renames it over ``NAME`` (``os.replace``: atomic on POSIX). On an exception the temporary
  file is removed and ``NAME`` is untouched; a killed writer's temporary file is removed by
  the next write of ``NAME``.
* :func:`atomic_folder` yields a temporary sibling folder ``.NAME.tmp-PID``; when the block
  ends without an exception the folder replaces ``NAME``. An existing ``NAME`` (only with
  ``overwrite=True``) is swapped out in one step (Linux ``renameat2(RENAME_EXCHANGE)``; two
  renames elsewhere) and deleted only after the new folder is in place. Leftovers of killed
  writers (temporary siblings of dead PIDs) are removed, or moved back, on the next call.
* :class:`FolderLock` / :func:`lock_folder`: one writer per output folder, with an OS lock
  (``fcntl.flock``) on the sibling file ``.NAME.lock`` -- the kernel drops it when the holder
  dies, so it never goes stale. A second writer fails at once with
  :class:`FolderLockedError`, naming the folder and the holder's PID. Re-entrant within a
  process.
* :func:`check_output_dir`: before any work, the output must not be a file and its parent
  must be writable (tested by creating a probe file: permission bits lie to root);
  :func:`check_replace_dir`: that, and an existing non-empty output is replaced only with
  ``overwrite`` (the rule of ``export`` and ``quantize`` alike).
* A full disk, a full quota or a read-only file system (``ENOSPC``, ``EDQUOT``, ``EROFS``,
  and numpy's errno-less short write "N requested and M written") met by
  :func:`atomic_writer` or :func:`atomic_folder` becomes one :class:`DiskWriteError` that
  names the output path, the cause, the bytes needed where known and that nothing was
  written; :func:`check_free_space` (and ``atomic_writer(size=)``) refuses before the
  first byte when the file system has less room than a known output size.

This module imports only the standard library (``yaml`` lazily).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DiskWriteError",
    "FolderLock",
    "FolderLockedError",
    "atomic_folder",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_write_yaml",
    "atomic_writer",
    "check_free_space",
    "check_output_dir",
    "check_output_file",
    "check_replace_dir",
    "lock_folder",
    "read_json",
    "read_text",
    "replace_folder",
]

_counter = itertools.count()


def _tmp_sibling(path: Path, tag: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{next(_counter)}")


# ----------------------------------------------------------------------------- full disks


class DiskWriteError(OSError):
    """A write failed for lack of room (``ENOSPC``, ``EDQUOT``) or on a read-only file
    system (``EROFS``); the message names the output path, the cause, the bytes needed
    where known and that nothing was written (the partial output is removed)."""


_DISK_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
}
# numpy's ``tofile`` / ``fromfile`` short write: an OSError without an errno.
_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")
# tensorstore (orbax checkpoints) reports the errno as text in a ValueError.
_TEXT_ERRNO = re.compile(r"\[os_error_code='(\d+)'\]")


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding ``path`` (its
    nearest existing ancestor); None where the OS cannot tell."""
    p = Path(path).absolute()
    for anc in (p, *p.parents):
        if anc.exists():
            try:
                st = os.statvfs(anc)
            except OSError:
                return None
            return st.f_bavail * st.f_frsize
    return None


def _bytes(n: int) -> str:
    return f"{n:,} bytes" if n < 2**20 else f"{n / 2**20:,.1f} MiB ({n:,} bytes)"


def check_free_space(
    path: str | os.PathLike, needed: int, *, what: str = "output", floor: bool = False
) -> None:
    """Refuse, before any byte is written, when the file system holding ``path`` has less
    room than ``needed`` bytes (the known size of what will be written there; ``floor``:
    the least it can be, said as "at least")."""
    free = free_bytes(path)
    if free is not None and needed > free:
        raise _disk_write_error(errno.ENOSPC, Path(path), what, needed, free, floor=floor)


def _disk_write_error(
    cause: int,
    path: Path,
    what: str,
    needed: int | None,
    free: int | None,
    floor: bool = False,
    outcome: str = "nothing was written",
) -> DiskWriteError:
    detail = _DISK_CAUSES[cause]
    if cause != errno.EROFS:
        least = "at least " if floor else ""
        parts = ([f"{least}{_bytes(needed)} needed"] if needed else []) + (
            [f"{_bytes(free)} free"] if free is not None else []
        )
        if parts:
            detail += ": " + ", ".join(parts)
    err = DiskWriteError(f"cannot write {what} {str(path)!r}: {detail}; {outcome}")
    err.errno = cause  # (not .filename: str() stays the one sentence above)
    err.needed = needed  # type: ignore[attr-defined]
    return err


def disk_cause(e: BaseException) -> int | None:
    """The errno of a full disk, full quota or read-only file system behind ``e`` (an
    ``OSError``, numpy's errno-less short write, or tensorstore's text); None for others."""
    if isinstance(e, OSError) and e.errno in _DISK_CAUSES:
        return e.errno
    text = str(e)
    if isinstance(e, OSError) and e.errno is None and _SHORT_WRITE.search(text):
        return errno.ENOSPC
    m = _TEXT_ERRNO.search(text)
    if m and int(m.group(1)) in _DISK_CAUSES:
        return int(m.group(1))
    return None


def disk_error(
    e: BaseException,
    path: Path,
    *,
    what: str,
    needed: int | None = None,
    outcome: str = "nothing was written",
) -> DiskWriteError | None:
    """``e`` (a write's error) as one :class:`DiskWriteError` naming ``path`` when it is a
    full disk, quota or read-only file system (``outcome``: what is left); None otherwise."""
    if isinstance(e, DiskWriteError):
        needed = getattr(e, "needed", None) if needed is None else needed
    cause = disk_cause(e)
    if cause is None:
        return None
    return _disk_write_error(cause, path, what, needed, free_bytes(path), outcome=outcome)


# ----------------------------------------------------------------------------- files


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike,
    mode: str = "wb",
    *,
    encoding: str | None = None,
    size: int | None = None,
    what: str = "file",
) -> Iterator[IO]:
    """``with atomic_writer(p, "wb") as f: ...``: ``f`` is a temporary sibling of ``p``; at
    the end of the block it is synced and renamed to ``p``. The parent folder is created if
    missing. On an exception nothing is renamed and the temporary file is removed. ``size``
    (the bytes to be written, where known) is checked against the free space first; a full
    disk or read-only file system raises :class:`DiskWriteError` naming ``p``."""
    if mode not in ("w", "wb", "wt"):
        raise ValueError(f"atomic_writer mode={mode!r}: expected 'w', 'wt' or 'wb'")
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise disk_error(e, path, what=what, needed=size) or e from None
    _recover(path)  # a killed writer's temporary file (dead PID) goes first
    if size is not None:
        check_free_space(path, size, what=what)
    tmp = _tmp_sibling(path)
    if "b" not in mode and encoding is None:
        encoding = "utf-8"
    try:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        err = disk_error(e, path, what=what, needed=size)
        if err is not None:
            raise err from None
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_writer`)."""
    with atomic_writer(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_writer`)."""
    with atomic_writer(path, "w") as f:
        f.write(text)


def atomic_write_json(
    path: str | os.PathLike,
    obj: Any,
    *,
    indent: int | None = 2,
    sort_keys: bool = False,
    allow_nan: bool = True,
) -> None:
    """``obj`` as JSON (plus a final newline) written atomically. ``allow_nan=False``
    raises on NaN/infinity (which strict JSON readers reject) instead of writing them."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, allow_nan=allow_nan)
    atomic_write_text(path, text + "\n")


def atomic_write_yaml(path: str | os.PathLike, obj: Any) -> None:
    """Plain data (dicts, lists, scalars) as YAML, keys in insertion order, atomically."""
    import yaml

    atomic_write_text(
        path, yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=100)
    )


# ----------------------------------------------------------------------------- folders


def save_figure(
    fig: Any, path: str | os.PathLike, *, legend_ax: Any = None, dpi: int = 120
) -> None:
    """Finish a matplotlib figure and write it as PNG atomically, then close it: a legend on
    ``legend_ax`` when it has labelled artists, ``tight_layout``, save, ``plt.close``."""
    import matplotlib.pyplot as plt

    if legend_ax is not None and legend_ax.get_legend_handles_labels()[0]:
        legend_ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    plt.close(fig)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(path: Path, tag: str) -> list[Path]:
    """Siblings ``.NAME.<tag>-PID[-N]`` whose PID is dead (a killed writer's leftovers)."""
    out = []
    prefix = f".{path.name}.{tag}-"
    with contextlib.suppress(OSError):
        for p in path.parent.iterdir():
            if p.name.startswith(prefix):
                pid = p.name[len(prefix) :].split("-")[0]
                if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                    out.append(p)
    return out


def _recover(path: Path) -> None:
    """Undo a killed :func:`atomic_folder`: move back an old folder set aside by the two-
    rename fallback (when ``path`` is missing), then delete dead writers' temporaries."""
    for old in _leftovers(path, "old"):
        if not path.exists():
            os.rename(old, path)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in _leftovers(path, "tmp"):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc_renameat2():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_renameat2 = _libc_renameat2()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step; False where the OS or file system cannot."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {b} into place: {os.strerror(err)}", str(b))


def replace_folder(new: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Move folder ``new`` to ``dest``; an existing ``dest`` is replaced, and removed only
    once ``new`` is in place (atomically where the OS can swap two paths)."""
    new, dest = Path(new), Path(dest)
    if not dest.exists():
        os.rename(new, dest)
        return
    if not dest.is_dir():
        raise NotADirectoryError(f"{dest} is a file; expected a folder to replace")
    if _exchange(new, dest):
        shutil.rmtree(new)  # now the old content
        return
    old = _tmp_sibling(dest, "old")
    os.rename(dest, old)
    os.rename(new, dest)
    shutil.rmtree(old)


@contextlib.contextmanager
def atomic_folder(
    path: str | os.PathLike, *, overwrite: bool = False, what: str = "output folder"
) -> Iterator[Path]:
    """``with atomic_folder(out) as tmp: write into tmp``: on success ``tmp`` replaces
    ``out`` (:func:`replace_folder`); on an exception ``tmp`` is deleted and ``out`` is
    untouched. An existing ``out`` raises ``FileExistsError`` unless ``overwrite``. A full
    disk or read-only file system, met by any write inside, raises :class:`DiskWriteError`
    naming ``out`` (and the bytes needed where the failing write knew them)."""
    path = Path(path).absolute()
    _recover(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; expected an output folder")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite to replace it")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise disk_error(e, path, what=what) or e from None
    try:
        yield tmp
        replace_folder(tmp, path)
    except BaseException as e:
        _remove_settled(tmp)
        err = disk_error(e, path, what=what)
        if err is not None:
            raise err from None
        raise


def _remove_settled(folder: Path, *, tries: int = 40, pause: float = 0.05) -> None:
    """Delete ``folder``, again while a writer that outlived the failure still adds to it
    (a failed orbax save: tensorstore finishes its other writes in its own threads, after
    the save has raised), until it stays gone for one ``pause`` (at most ``tries`` times)."""
    for _ in range(tries):
        shutil.rmtree(folder, ignore_errors=True)
        time.sleep(pause)
        if not folder.exists():
            return


# ----------------------------------------------------------------------------- locks


class FolderLockedError(OSError):
    """Another live process is writing the same output folder."""


_held: dict[str, list] = {}  # lock file -> [fd, count]
_held_guard = threading.Lock()


def _lock_file(folder: Path) -> Path:
    if not folder.name:
        raise ValueError(f"{folder}: the file system root cannot be an output folder")
    return folder.with_name(f".{folder.name}.lock")


class FolderLock:
    """Exclusive OS lock for writing ``folder`` (see the module docstring).

    ``acquire()`` fails at once with :class:`FolderLockedError` when another process holds
    it; the same process may acquire it again (counted). ``release()`` undoes one acquire.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder).absolute()
        self.path = _lock_file(self.folder)

    def acquire(self) -> FolderLock:
        key = str(self.path)
        with _held_guard:
            if key in _held:
                _held[key][1] += 1
                return self
            while True:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                except OSError as e:
                    raise OSError(
                        e.errno,
                        f"cannot lock output folder {self.folder}: {e.strerror} ({e.filename})",
                    ) from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
                    os.close(fd)
                    raise FolderLockedError(
                        f"{self.folder} is being written by another process (PID {holder}, "
                        f"lock {self.path}); wait for it to finish or choose another "
                        "output folder"
                    ) from None
                # The holder before us may have unlinked the file after we opened it:
                # then we hold a lock on a deleted file; start again on the current one.
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            _held[key] = [fd, 1]
        return self

    def release(self) -> None:
        key = str(self.path)
        with _held_guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _held[key]
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # while still locked: nobody can be mid-acquire on it
            os.close(entry[0])

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(folder: str | os.PathLike) -> FolderLock:
    """``with lock_folder(out): ...`` -- :class:`FolderLock` as a context manager."""
    return FolderLock(folder)


# ----------------------------------------------------------------------------- reading


def read_text(path: str | os.PathLike, *, what: str = "file") -> str:
    """A UTF-8 text file's content; a missing, unreadable or non-UTF-8 file raises an error
    (``FileNotFoundError`` / ``ValueError``) that names the file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise IsADirectoryError(f"{what} {str(p)!r} is a folder; expected a file") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {str(p)!r} does not exist") from None
    except OSError as e:
        raise OSError(f"cannot read {what} {str(p)!r}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} {str(p)!r} is not UTF-8 text (byte {e.start}: {data[e.start : e.start + 1]!r})"
        ) from None


def read_json(path: str | os.PathLike, *, what: str = "JSON file") -> Any:
    """A JSON file's content; errors name the file and, for bad JSON, the line and column
    (an empty file -- e.g. from a killed non-atomic writer -- is called empty)."""
    text = read_text(path, what=what)
    if not text.strip():
        raise ValueError(f"{what} {str(path)!r} is empty; expected JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{what} {str(path)!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None


# ----------------------------------------------------------------------------- checks


def check_output_dir(path: str | os.PathLike, *, what: str = "output folder") -> Path:
    """Fail fast, before any work, when ``path`` cannot become an output folder: it is a
    file, a component of it is a file, or its parent (where the folder, or its temporary
    sibling, is created) is not writable. Creates the parent folders. Returns the path."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(f"{what} {str(path)!r} is a file; expected a folder")
    _check_parent(p, what, path)
    return p


def check_replace_dir(
    path: str | os.PathLike,
    *,
    overwrite: bool,
    what: str = "output folder",
    earlier: Callable[[Path], bool] | None = None,
    earlier_what: str = "an earlier output",
) -> Path:
    """The one rule of every command that writes an output folder (``export``,
    ``quantize``), before any work: :func:`check_output_dir`, and an existing non-empty
    folder is refused unless ``overwrite``; with ``overwrite`` it is replaced only when
    ``earlier(folder)`` says it is an earlier output of the same command (``earlier_what``
    in the message), so ``overwrite=true`` never deletes someone else's data."""
    out = check_output_dir(path, what=what)
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{what} {str(path)!r} is not empty; pass overwrite=True "
                "(CLI: overwrite=true) to replace it"
            )
        if earlier is not None and not earlier(out):
            raise FileExistsError(
                f"refusing to overwrite {str(path)!r}: it does not look like {earlier_what}"
            )
    return out


def check_input_dir(path: str | os.PathLike, *, what: str, expected: str) -> Path:
    """``path`` as an existing input folder, or an error that says what it is instead
    (missing, a file and its size, not a folder) and what was ``expected``."""
    p = Path(path).expanduser()
    shown = f"{what}{'' if not what or what.endswith('=') else ' '}{str(path)!r}"
    if p.is_dir():
        return p
    if not p.exists():
        raise FileNotFoundError(f"{shown} does not exist; expected {expected}")
    if p.is_file():
        kind = f"a file ({p.stat().st_size:,} bytes{', ' + p.suffix if p.suffix else ''})"
    else:
        kind = "not a regular file or folder"
    raise NotADirectoryError(f"{shown} is {kind}; expected {expected}")


def check_output_file(
    path: str | os.PathLike, *, what: str = "output file", overwrite: bool = False
) -> Path:
    """As :func:`check_output_dir` for an output *file*: not a folder, not existing unless
    ``overwrite``, and its folder writable."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise IsADirectoryError(f"{what} {str(path)!r} is a folder; expected a file path")
    if p.exists() and not overwrite:
        raise FileExistsError(
            f"{what} {str(path)!r} exists; pass overwrite=true (overwrite=True) to replace it"
        )
    _check_parent(p, what, path)
    return p


def _check_parent(p: Path, what: str, given) -> None:
    shown = repr(str(given))
    parent = p.absolute().parent
    for anc in (parent, *parent.parents):
        if anc.exists():
            if not anc.is_dir():
                raise NotADirectoryError(
                    f"{what} {shown}: {anc} is a file, so nothing can be created under it"
                )
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for d in (parent, p) if p.is_dir() else (parent,):
            probe = d / f".{p.name or 'out'}.probe-{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(probe)
    except OSError as e:
        raise PermissionError(
            f"{what} {shown} is not writable: {e.strerror or e} ({e.filename or parent})"
        ) from None
