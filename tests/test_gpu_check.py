"""benchmarks/gpu_check.sh runs to the end without a GPU, skipping (and saying so) what
needs one, and writes its files under $OUT."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


@pytest.mark.slow
def test_gpu_check_runs_to_the_end(tmp_path, hang_guard_s):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=hang_guard_s
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    lines = dict(line.split(": ", 1) for line in summary.splitlines())
    assert set(lines) >= {"device", "gpu_tests", "fp8_native", "linear", "train", "compare"}
    assert lines["gpu_tests"].startswith("ok")
    assert (tmp_path / "out" / "device.txt").read_text().startswith("jax ")
    tests = (tmp_path / "out" / "gpu_tests.txt").read_text()
    assert "passed" in tests
    if "no NVIDIA GPU" in lines["device"]:
        assert "skipped" in tests  # the on-device comparisons
        for part in ("fp8_native", "linear", "train", "compare"):
            assert lines[part].startswith("skipped")
