"""microscale.files: atomic writes, atomic folders, the folder lock, output-path checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from microscale import files
from microscale.files import (
    FolderLock,
    FolderLockedError,
    atomic_folder,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    atomic_write_yaml,
    atomic_writer,
    check_output_dir,
    lock_folder,
)

from .conftest import child_env


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(
    "write,read,value",
    [
        (atomic_write_bytes, lambda p: p.read_bytes(), b"\x00\xffabc"),
        (atomic_write_text, lambda p: p.read_text(encoding="utf-8"), "héllo\n"),
        (atomic_write_json, lambda p: json.loads(p.read_text()), {"a": [1, 2.5, None]}),
        (
            atomic_write_yaml,
            lambda p: __import__("yaml").safe_load(p.read_text()),
            {"b": 1, "a": [2]},
        ),
    ],
)
def test_atomic_writes_roundtrip_and_leave_no_temporaries(tmp_path, write, read, value):
    p = tmp_path / "sub" / "f"
    write(p, value)
    assert read(p) == value
    write(p, value)  # replacing works too
    assert _siblings(p.parent) == ["f"]


def test_atomic_writer_keeps_old_content_on_error(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_writer(p) as f:
        f.write(b"half")
        raise RuntimeError("killed")
    assert p.read_bytes() == b"old"
    assert _siblings(tmp_path) == ["f.bin"]


def test_atomic_writer_rejects_append_mode(tmp_path):
    with pytest.raises(ValueError, match="'ab'"), atomic_writer(tmp_path / "x", "ab"):
        pass


def test_atomic_write_json_can_refuse_nan(tmp_path):
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"v": float("nan")}, allow_nan=False)
    assert not (tmp_path / "x.json").exists()


def test_atomic_folder_creates_replaces_and_refuses(tmp_path):
    out = tmp_path / "out"
    with atomic_folder(out) as d:
        assert not out.exists()
        (d / "a").write_text("1")
    assert (out / "a").read_text() == "1"
    with pytest.raises(FileExistsError, match="out"), atomic_folder(out):
        pass
    with atomic_folder(out, overwrite=True) as d:
        (d / "b").write_text("2")
        assert (out / "a").read_text() == "1"  # old intact while the new one is written
    assert _siblings(out) == ["b"]
    assert _siblings(tmp_path) == ["out"]


def test_atomic_folder_error_keeps_old(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("old")
    with pytest.raises(KeyError), atomic_folder(out, overwrite=True) as d:
        (d / "a").write_text("new, half")
        raise KeyError("boom")
    assert (out / "a").read_text() == "old"
    assert _siblings(tmp_path) == ["out"]


def test_atomic_folder_refuses_a_file(tmp_path):
    f = tmp_path / "out"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"), atomic_folder(f, overwrite=True):
        pass


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_folder_with_and_without_atomic_swap(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    new, dest = tmp_path / "new", tmp_path / "dest"
    new.mkdir()
    dest.mkdir()
    (new / "n").write_text("new")
    (dest / "o").write_text("old")
    files.replace_folder(new, dest)
    assert _siblings(dest) == ["n"]
    assert _siblings(tmp_path) == ["dest"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_a_killed_writer_are_recovered(tmp_path):
    """A writer killed between the two renames of the fallback left the old folder aside
    and no OUT: the next writer moves it back before anything else; dead temporaries go."""
    pid = _dead_pid()
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{pid}-0"
    old.mkdir()
    (old / "a").write_text("old")
    (tmp_path / f".out.tmp-{pid}").mkdir()
    with pytest.raises(FileExistsError), atomic_folder(out):
        pass
    assert (out / "a").read_text() == "old"
    assert _siblings(tmp_path) == ["out"]


def test_killed_file_writers_temporaries_are_removed_by_the_next_write(tmp_path):
    """A file writer killed after creating its temporary (a GGUF export, a JSON report)
    left ``.NAME.tmp-PID-N``: the next write of NAME removes it. A live writer's temporary
    (this process's, another live PID's) and other names' are left alone."""
    dead, live = _dead_pid(), os.getppid()
    out = tmp_path / "model.gguf"
    stale = [tmp_path / f".model.gguf.tmp-{dead}-0", tmp_path / f".model.gguf.tmp-{dead}-7"]
    kept = [tmp_path / f".model.gguf.tmp-{live}-0", tmp_path / f".other.gguf.tmp-{dead}-0"]
    for p in stale + kept:
        p.write_bytes(b"half a file")
    atomic_write_bytes(out, b"GGUF")
    assert out.read_bytes() == b"GGUF"
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)


def test_check_output_dir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="'.*file' is a file"):
        check_output_dir(f)
    with pytest.raises(NotADirectoryError, match="so nothing can be created under it"):
        check_output_dir(f / "sub" / "out")
    with pytest.raises(PermissionError, match="not writable"):
        check_output_dir("/proc/microscale-test/out")
    assert check_output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert (tmp_path / "a").is_dir() and _siblings(tmp_path / "a") == []


def test_check_output_file(tmp_path):
    from microscale.files import check_output_file

    f = tmp_path / "m.gguf"
    assert check_output_file(f) == f
    f.write_text("old")
    with pytest.raises(FileExistsError, match="overwrite"):
        check_output_file(f)
    assert check_output_file(f, overwrite=True) == f
    with pytest.raises(IsADirectoryError, match="is a folder"):
        check_output_file(tmp_path)
    with pytest.raises(PermissionError, match="not writable"):
        check_output_file("/proc/microscale-test/m.gguf")


def test_lock_is_reentrant_and_released(tmp_path):
    out = tmp_path / "run"
    with lock_folder(out) as lk, lock_folder(out):
        assert lk.path.read_text().strip() == str(os.getpid())
    assert not lk.path.exists()
    with lock_folder(out):  # free again
        pass


_HOLDER = textwrap.dedent("""
    import sys, time
    from microscale.files import lock_folder
    with lock_folder(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(60)
""")


def test_lock_two_real_processes(tmp_path):
    out = tmp_path / "run"
    env = child_env()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FolderLockedError) as e:  # at once: a wait would outlast the test
            FolderLock(out).acquire()
        assert str(out) in str(e.value) and f"PID {holder.pid}" in str(e.value)
        holder.kill()  # kill -9: the kernel releases the lock, nothing goes stale
        holder.wait()
        with lock_folder(out):
            pass
    finally:
        holder.kill()
        holder.wait()
