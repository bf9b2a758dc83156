"""Full and read-only disks (issue 58): every write names its path and the cause, the bytes
needed where known and that nothing was written; the error line is the last thing on
stderr (no library's teardown after it); no partial output is left.

A real full disk is a small tmpfs, mounted in a user + mount namespace
(``unshare -rm``; it vanishes with the process) or, for root without ``unshare``, mounted
and unmounted around the command. Where neither works (a container without user
namespaces or ``CAP_SYS_ADMIN``) the CLI rows skip, saying so; the unit rows below them
fake the errors and run everywhere.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from microscale.files import (
    DiskWriteError,
    atomic_folder,
    atomic_write_bytes,
    atomic_writer,
    check_free_space,
    disk_cause,
)

from .conftest import TRAIN_ARGS

_MOUNT_SH = 'mount -t tmpfs -o size={size} tmpfs "$0"{ro} && exec "$@"'


def _try(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _how(tmp: Path) -> str | None:
    """'unshare', 'root' or None: how this machine makes a small tmpfs."""
    probe = tmp / "probe"
    probe.mkdir()
    if shutil.which("unshare") and _try(
        ["unshare", "-rm", "sh", "-c", _MOUNT_SH.format(size="64k", ro=""), str(probe), "true"]
    ):
        return "unshare"
    if os.geteuid() == 0 and _try(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)]):
        _try(["umount", str(probe)])
        return "root"
    return None


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """``run(dir, argv, size=, read_only=)``: ``microscale argv`` with a fresh tmpfs of
    ``size`` at ``dir``; returns the CompletedProcess (the tmpfs's content is listed in
    its ``.left`` attribute: what the command left there)."""
    how = _how(tmp_path_factory.mktemp("disk-probe"))
    if how is None:
        pytest.skip("no small tmpfs here: neither `unshare -rm` nor mount as root works")
    cli = [sys.executable, "-c", "import sys; from microscale.cli import main; sys.exit(main())"]

    def run(mnt: Path, argv: list[str], *, size: str = "32k", read_only: bool = False):
        mnt.mkdir(parents=True, exist_ok=True)
        ro = ' && mount -o remount,ro tmpfs "$0"' if read_only else ""
        list_left = ["sh", "-c", 'ls -A "$0"', str(mnt)]
        if how == "unshare":
            # what the command left is listed inside the namespace, into DIR.left
            script = _MOUNT_SH.format(size=size, ro=ro).replace(
                'exec "$@"', '{ "$@"; rc=$?; ls -A "$0" > "$0.left"; exit $rc; }'
            )
            r = subprocess.run(
                ["unshare", "-rm", "sh", "-c", script, str(mnt), *cli, *argv],
                capture_output=True,
                text=True,
                timeout=300,
            )
            r.left = Path(f"{mnt}.left").read_text().split()  # type: ignore[attr-defined]
            return r
        subprocess.run(
            ["sh", "-c", _MOUNT_SH.format(size=size, ro=ro), str(mnt), "true"], check=True
        )
        try:
            r = subprocess.run(cli + argv, capture_output=True, text=True, timeout=300)
            r.left = subprocess.run(  # type: ignore[attr-defined]
                list_left, capture_output=True, text=True
            ).stdout.split()
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
        return r

    return run


NOTHING = r"; nothing was written$"
FULL = r": no space left on the device: ([\d,]+ bytes needed, )?[\d,]+ bytes free" + NOTHING
ROWS = {
    "export gguf, full": (
        ["export", "-m", "{run}", "--out", "{mnt}/m.gguf", "layout=gguf"],
        rf"^microscale export: error: cannot write GGUF file '{{mnt}}/m\.gguf'{FULL}",
        "needed",
    ),
    "export compressed-tensors, full": (
        ["export", "-m", "{run}", "--out", "{mnt}/ct"],
        rf"^microscale export: error: cannot write output folder '{{mnt}}/ct'{FULL}",
        "needed",
    ),
    "import, full": (
        ["import", "--model", "{hf}", "--out", "{mnt}/imp"],
        rf"^microscale import: error: cannot write output folder '{{mnt}}/imp'{FULL}",
        None,
    ),
    "quantize, full": (
        ["quantize", "-m", "{run}", "--out", "{mnt}/q", "--quiet", "formats=nvfp4,bf16",
         "pareto_budgets=8", "uniform_formats=nvfp4", "ptq_effects=false", "budget=16"],
        # refused before the analysis: the least the output can take does not fit
        r"^microscale quantize: error: cannot write quantize output folder '{mnt}/q': no space "
        r"left on the device: at least [\d,]+ bytes needed, [\d,]+ bytes free" + NOTHING,
        "needed",
    ),
    "train, full at its first checkpoint": (
        ["train", *TRAIN_ARGS, "data.corpus={corpus}", "out={mnt}/run", "--quiet"],
        r"^microscale train: error: cannot write checkpoint folder '{mnt}/run/checkpoints': no "
        r"space left on the device: [\d,]+ bytes free; the step being saved was not kept "
        r"\(earlier steps are intact\)$",
        "run",
    ),
    "export gguf, read-only": (
        ["export", "-m", "{run}", "--out", "{mnt}/m.gguf", "layout=gguf"],
        r"^microscale export: error: --out '{mnt}/m\.gguf' is not writable: Read-only file "
        r"system \({mnt}/\.m\.gguf\.probe-\d+\)$",
        "ro",
    ),
    "import, read-only": (
        ["import", "--model", "{hf}", "--out", "{mnt}/imp"],
        r"^microscale import: error: --out '{mnt}/imp' is not writable: Read-only file "
        r"system \({mnt}/\.imp\.probe-\d+\)$",
        "ro",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tiny_run) -> Path:
    """``tiny_run`` as a plain HF folder (bf16 safetensors), an input of ``import``."""
    from microscale.cli import main

    out = tmp_path_factory.mktemp("disk-hf") / "hf"
    assert main(["export", "-m", str(tiny_run), "--out", str(out), "layout=hf"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "last", "kind"), ROWS.values(), ids=list(ROWS))
def test_a_full_or_read_only_disk_is_one_last_line(
    tmp_path, small_disk, tiny_run, tiny_hf, words_corpus, argv, last, kind
):
    mnt = tmp_path / "disk"
    fill = {"run": str(tiny_run), "hf": str(tiny_hf), "mnt": str(mnt), "corpus": str(words_corpus)}
    size = "300k" if kind == "run" else "32k"  # a run: its config and logs fit, a step not
    r = small_disk(mnt, [a.format(**fill) for a in argv], read_only=kind == "ro", size=size)
    lines = r.stderr.rstrip("\n").splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert re.search(last.replace("{mnt}", re.escape(str(mnt))), lines[-1]), lines[-1]
    assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr
    assert sum("error" in line for line in lines) == 1, r.stderr
    if kind == "needed":  # the output's size is known before writing: said
        assert "bytes needed" in lines[-1]
    if kind == "run":  # a run keeps what it wrote before the step (orbax removes the
        return  # step's temporary folder when the run is resumed)
    assert r.left == [], f"left on the disk: {r.left}"  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- unit rows


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize(
    ("raise_", "match"),
    [
        (_enospc, r"cannot write file '.*/out\.bin': no space left on the device: .*free; nothing was written$"),
        (lambda: (_ for _ in ()).throw(OSError("32896 requested and 21024 written")), r"out\.bin': no space left on the device"),
        (lambda: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")), r"out\.bin': read-only file system; nothing was written$"),
        (lambda: (_ for _ in ()).throw(OSError(errno.EDQUOT, "Disk quota exceeded")), r"out\.bin': disk quota exceeded: .*; nothing was written$"),
    ],
    ids=["ENOSPC", "numpy short write", "EROFS", "EDQUOT"],
)  # fmt: skip
def test_atomic_writer_names_the_path_and_leaves_nothing(tmp_path, raise_, match):
    out = tmp_path / "out.bin"
    with pytest.raises(DiskWriteError, match=match) as e, atomic_writer(out) as f:
        f.write(b"partial")
        raise_()
    assert e.value.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
    assert list(tmp_path.iterdir()) == []


def test_other_errors_pass_unchanged(tmp_path):
    with pytest.raises(OSError, match=r"^\[Errno 5\] boom$"), atomic_writer(tmp_path / "x") as f:
        f.write(b"1")
        raise OSError(errno.EIO, "boom")
    assert disk_cause(ValueError("nothing to do with disks")) is None


def test_a_known_size_is_refused_before_the_first_byte(tmp_path):
    huge = 1 << 62
    full = r"out\.bin': no space left on the device: .* needed, .* free; nothing was written$"
    with pytest.raises(DiskWriteError, match=full), atomic_writer(tmp_path / "out.bin", size=huge):
        pytest.fail("the block ran")
    with pytest.raises(DiskWriteError, match=r"bytes\) needed"):
        check_free_space(tmp_path / "new" / "file", huge, what="file")
    check_free_space(tmp_path, 1, what="file")
    assert list(tmp_path.iterdir()) == []


def test_atomic_folder_names_the_folder_for_any_write_inside(tmp_path):
    """A write deep inside the temporary folder (its own atomic_writer, or tensorstore's
    text from an orbax save) is named as the output folder, whose temporary is gone."""
    out = tmp_path / "out"
    named = r"output folder '.*/out': no space left .* 99 bytes needed"
    with pytest.raises(DiskWriteError, match=named), atomic_folder(out) as tmp:  # noqa: SIM117
        with atomic_writer(tmp / "a" / "b.bin", size=99) as f:  # tmp: from the line above
            _enospc(f)
    named = r"output folder '.*/out': no space left"
    with pytest.raises(DiskWriteError, match=named), atomic_folder(out):
        raise ValueError(
            "RESOURCE_EXHAUSTED: Error writing local file ...: Failed to write 3282 bytes "
            "to file 12: No space left on device [os_error_code='28']"
        )
    assert list(tmp_path.iterdir()) == []


def test_numpy_short_write_is_recognised():
    assert disk_cause(OSError("4608 requested and 3456 written")) == errno.ENOSPC
    assert disk_cause(OSError(errno.ENOSPC, "x")) == errno.ENOSPC


def test_a_closed_loop_callback_is_kept_off_stderr():
    """The unraisable error of a tensorstore write finishing after orbax closed its loop
    is dropped (microscale.train.checkpoint); any other reaches the previous hook."""
    from microscale.train.checkpoint import _closed_loop_callback

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as exc:
        caught = exc

    class U:
        exc_value = caught
        exc_traceback = caught.__traceback__

    assert _closed_loop_callback(U())
    other = RuntimeError("Event loop is closed")

    class V:
        exc_value = other
        exc_traceback = None

    assert not _closed_loop_callback(V())


def test_write_safetensors_states_its_size(tmp_path):
    """The safetensors writer passes its exact size: a file that cannot fit is refused
    with the bytes it needs."""
    from microscale.export.tensorfile import write_safetensors

    named = r"safetensors file '.*x\.safetensors'.* needed"
    with pytest.raises(DiskWriteError, match=named), pytest.MonkeyPatch.context() as mp:
        mp.setattr("microscale.files.free_bytes", lambda _p: 10)
        write_safetensors(tmp_path / "x.safetensors", {"w": np.ones(64, np.float32)})
    assert list(tmp_path.iterdir()) == []
    atomic_write_bytes(tmp_path / "ok", b"1")
