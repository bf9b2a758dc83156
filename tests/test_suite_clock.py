"""tests/suite_clock.py and benchmarks/suite_times.py: a pytest run records each test's
CPU and JAX compile seconds, and the script adds them up per module."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import jax, jax.numpy as jnp

def test_compiles():
    jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(8)).block_until_ready()

def test_burns_cpu_in_a_child():
    import subprocess, sys
    subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)

def test_plain():
    assert True

def test_runs_pytest_in_a_child(tmp_path):
    import subprocess, sys
    (tmp_path / "test_inner.py").write_text("def test_inner():\\n    pass\\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_clock",
                    "-p", "no:cacheprovider", str(tmp_path)], check=True)
"""


@pytest.mark.slow
def test_a_run_is_recorded_per_test_and_added_up_per_module(tmp_path, hang_guard_s):
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(MODULE))
    clock = tmp_path / "clock"
    # a run of its own, also when this test runs in a clocked suite (whose plugin would
    # otherwise see a pytest started by a test, and record nothing)
    outer = ("SUITE_CLOCK_IN_TEST", "PYTEST_ADDOPTS")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    env.update(SUITE_CLOCK_DIR=str(clock), PYTHONPATH=str(ROOT / "tests"))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "suite_clock",
            "-p",
            "no:cacheprovider",
            "test_probe.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard_s,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (record,) = [json.loads(f.read_text()) for f in clock.glob("*.json")]
    t = {k.split("::")[1]: v for k, v in record.items()}
    # one file: the child pytest of test_runs_pytest_in_a_child recorded nothing
    assert set(t) == {
        "test_compiles",
        "test_burns_cpu_in_a_child",
        "test_plain",
        "test_runs_pytest_in_a_child",
    }
    assert t["test_compiles"]["compile"] > 0 and t["test_compiles"]["trace"] > 0
    assert t["test_plain"]["compile"] == 0 == t["test_burns_cpu_in_a_child"]["compile"]
    # the child's CPU (a 3M-term sum, tens of ms at least) is counted in its test
    assert t["test_burns_cpu_in_a_child"]["cpu"] > t["test_plain"]["cpu"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "suite_times.py"), str(clock)],
        capture_output=True,
        text=True,
        check=True,
        timeout=hang_guard_s,
    ).stdout
    row = next(line for line in out.splitlines() if "test_probe.py" in line)
    assert row.split("|")[2].strip() == "4"  # tests in the module
    total = next(line for line in out.splitlines() if "all modules" in line)
    assert float(total.split("|")[3]) == pytest.approx(sum(v["cpu"] for v in t.values()), abs=1)
    assert all(v["start"] > 0 for v in t.values())
    worker = out.split(str(clock))[-1]
    assert "4 tests" in worker
    # test_compiles' one program: compiled, or served by a persistent cache (a run's own)
    assert t["test_compiles"]["compiles"] >= 1 and t["test_plain"]["compiles"] == 0
    assert t["test_compiles"]["hits"] <= t["test_compiles"]["compiles"]
    assert f"{sum(v['compiles'] for v in t.values()):.0f} compiles" in worker


def test_the_script_names_an_empty_folder(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "suite_times.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0 and f"{tmp_path}: no suite_clock files" in run.stderr
