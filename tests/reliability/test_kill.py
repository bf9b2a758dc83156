"""kill -9 of `export overwrite=true` and `quantize` at several moments: the output folder
holds the old complete output or the new complete one, never a mix, a stub or nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from microscale.cli import main
from microscale.export import read_checkpoint

from .conftest import child_env

pytestmark = pytest.mark.slow

ENV = child_env(JAX_PLATFORMS="cpu")


def _tmp_siblings(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


# Moments, as conditions polled on the file system while the command runs (so that the
# kill lands at the same stage on a fast or a slow machine).
def _started(out: Path) -> bool:  # holds the lock, nothing written yet
    return out.with_name(f".{out.name}.lock").exists()


def _writing(out: Path) -> bool:  # the temporary sibling folder exists
    return bool(_tmp_siblings(out))


def _late(out: Path) -> bool:  # the temporary folder's weights are (being) written
    return any(
        (t / "model.safetensors").exists()
        or (t / "checkpoint").exists()
        or any(t.glob(".model.safetensors.tmp-*"))
        for t in _tmp_siblings(out)
    )


def _kill_when(argv: list[str], cond: Callable[[], bool], timeout: float) -> bool:
    """Run ``microscale argv``; kill -9 it as soon as ``cond()`` holds. True if killed,
    False if it finished first. ``timeout``: the suite's hang guard (``hang_guard_s``)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "microscale", *argv],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    t0 = time.monotonic()
    try:
        while p.poll() is None:
            if cond():
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
                return True
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(argv)
            time.sleep(0.002)
        assert p.returncode == 0, p.stderr.read().decode()
        return False
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _export_layers(out: Path) -> set[str]:
    """The weight formats of an exported folder, read (and checksum-verified) in full."""
    ck = read_checkpoint(out)
    return {lq.weights for lq in ck.layers.values()}


@pytest.mark.parametrize("moment", ["started", "writing", "late", "done"])
def test_kill_export_overwrite(moment, tiny_run, tmp_path, capsys, hang_guard_s):
    out = tmp_path / "exp"
    assert main(["export", "-m", str(tiny_run), "--out", str(out), "formats=mxfp4"]) == 0
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    cond = {
        "started": lambda: _started(out),
        "writing": lambda: _writing(out),
        "late": lambda: _late(out),
        "done": lambda: False,
    }[moment]
    killed = _kill_when(
        ["export", "-m", str(tiny_run), "--out", str(out), "overwrite=true"], cond, hang_guard_s
    )
    assert killed == (moment != "done")
    formats = _export_layers(out)  # complete and intact, whichever it is
    if formats == {"mxfp4"}:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    else:
        assert formats == {"nvfp4"}
    # leftovers of the killed writer go away with the next export, which succeeds
    assert main(["export", "-m", str(tiny_run), "--out", str(out), "overwrite=true"]) == 0
    assert _export_layers(out) == {"nvfp4"}
    assert [p.name for p in out.parent.iterdir()] == ["exp"]


_Q = [
    "formats=nvfp4,fp8,bf16",
    "calib_tokens=256",
    "pareto_budgets=5,8",
    "ptq_effects=false",
    "--no-compile-cache",
    "-q",
]
_Q_FILES = {
    "precision_rules.json",
    "report.json",
    "report.md",
    "pareto.png",
    "sensitivity.png",
    "checkpoint",
    "checksums.json",
}


def _quantize_complete(out: Path) -> dict:
    assert {p.name for p in out.iterdir()} == _Q_FILES
    rules = json.loads((out / "precision_rules.json").read_text())
    assert rules["rules"]
    read_checkpoint(out / "checkpoint")
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("moment", ["started", "writing", "late"])
def test_kill_quantize(moment, tiny_run, tmp_path, capsys, hang_guard_s):
    out = tmp_path / "q"
    first = ["quantize", "-m", str(tiny_run), "--out", str(out), "budget=8", *_Q]
    assert main(first) == 0
    old_budget = _quantize_complete(out)["budget"]
    cond = {
        "started": lambda: _started(out),
        "writing": lambda: _writing(out),
        "late": lambda: _late(out),
    }[moment]
    _kill_when(
        ["quantize", "-m", str(tiny_run), "--out", str(out), "budget=5", "overwrite=true", *_Q],
        cond,
        hang_guard_s,
    )
    assert _quantize_complete(out)["budget"] in (old_budget, 5.0)
    again = ["quantize", "-m", str(tiny_run), "--out", str(out), "budget=5", "overwrite=true"]
    assert main([*again, *_Q]) == 0
    assert _quantize_complete(out)["budget"] == 5.0
    assert [p.name for p in out.parent.iterdir()] == ["q"]


def test_kill_fresh_quantize_leaves_nothing_half_written(tiny_run, tmp_path, hang_guard_s):
    """A first quantize killed while writing leaves no output folder (so no 0-byte
    precision_rules.json to trip over later), and a rerun completes."""
    out = tmp_path / "q"
    killed = _kill_when(
        ["quantize", "-m", str(tiny_run), "--out", str(out), *_Q],
        lambda: _writing(out),
        hang_guard_s,
    )
    assert killed and not out.exists()
    assert main(["quantize", "-m", str(tiny_run), "--out", str(out), *_Q]) == 0
    _quantize_complete(out)
