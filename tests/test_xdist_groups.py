"""The suite's ``xdist_group`` marks hold: under the README's ``pytest -n 2`` (with
``--dist=loadgroup`` from pyproject's addopts) the tests of one group run on one worker, so
a module fixture that compiles a whole sharded program runs once, not once per worker.

pytest 9.2 with pytest-xdist 3.8 broke this without a word (xdist appends the group to a
node id that pytest 9.2 no longer reads): every group was spread over both workers, and the
two plan modules compiled their programs twice (about 340 CPU s of a 40-minute suite).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import os, pytest

pytestmark = pytest.mark.xdist_group("{group}")

@pytest.mark.parametrize("i", range(4))
def test_where(i):
    with open({out!r}, "a") as f:
        f.write(f"{group} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
"""


@pytest.mark.slow
def test_a_group_runs_on_one_worker(tmp_path, hang_guard_s):
    out = tmp_path / "where.txt"
    for group in ("alpha", "beta"):
        (tmp_path / f"test_{group}.py").write_text(
            textwrap.dedent(MODULE.format(group=group, out=str(out)))
        )
    # the project's own settings (addopts with --dist=loadgroup), the probe modules' tests
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"},
        capture_output=True,
        text=True,
        timeout=hang_guard_s,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in out.read_text().splitlines()]
    assert len(rows) == 8
    for group in ("alpha", "beta"):
        workers = {w for g, w in rows if g == group}
        assert len(workers) == 1, (group, rows)
