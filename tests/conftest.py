"""Suite-wide settings and fixtures.

* deterministic hypothesis examples (a CI run never flakes on a new random example; run
  with HYPOTHESIS_PROFILE=explore to search afresh);
* ``corpus_dir``: a small fixed text corpus (~40 standard-library modules);
* ``fake_devices``: run a script in a child process that sees 8 CPU devices
  (``--xla_force_host_platform_device_count`` must be set before jax is imported, and
  this process has already imported it);
* ``hang_guard_s``: the one wall-clock limit a test may put on a child process.

No test measures or limits speed: a busy machine makes every step slower, and a test must
not fail because of it. Child processes get one limit, :data:`HANG_GUARD_S`, that only
ends a process which has hung (a deadlock, a child waiting for input): one hour, more than
ten times the slowest child of the suite on a 2-core machine at load average 4.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> str:
    """~40 standard-library modules copied to a folder (a small, fixed corpus)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 40_000)[:40]
    out = tmp_path_factory.mktemp("corpus")
    for p in files:
        shutil.copy(p, out / p.name)
    return str(out)


HANG_GUARD_S = 3600  # ends a hung child process; never a speed check (see above)


@pytest.fixture(scope="session")
def hang_guard_s() -> int:
    """The wall-clock limit for a child process (:data:`HANG_GUARD_S`)."""
    return HANG_GUARD_S


@pytest.fixture(scope="session")
def fake_devices():
    """``run(script, *args, env=None) -> stdout`` on 8 fake CPU devices; fails the test
    (with the child's stderr) when the script exits non-zero."""

    def run(script: str, *args: str, env: dict | None = None) -> str:
        full_env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                        JAX_PLATFORMS="cpu", **(env or {}))
        proc = subprocess.run([sys.executable, "-c", script, *args], env=full_env,
                              capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout

    return run
