"""Suite-wide settings and fixtures.

* deterministic hypothesis examples (a CI run never flakes on a new random example; run
  with HYPOTHESIS_PROFILE=explore to search afresh);
* ``corpus_dir``: a small fixed text corpus (~40 standard-library modules);
* ``fake_devices``: run a script in a child process that sees 8 CPU devices
  (``--xla_force_host_platform_device_count`` must be set before jax is imported, and
  this process has already imported it);
* ``hang_guard_s``: the one wall-clock limit a test may put on a child process;
* ``native_on_cpu``: script lines that let a child process compile the native block-scaled
  GEMM on CPU (see the fixture);
* one JAX persistent compilation cache per run (:func:`pytest_configure`), shared by the
  xdist workers and every child process they start: a program that several tests compile
  (the same model and recipe, a CLI child's step) compiles once. It starts empty, so a run
  costs what it costs on a fresh clone, and is deleted at the end; set
  ``JAX_COMPILATION_CACHE_DIR`` to keep one of your own instead.

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
import tempfile
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


_RUN_CACHE: list[str] = []  # the cache folder this process made (the xdist controller)


def pytest_configure(config: pytest.Config) -> None:
    """The run's compilation cache: made by the first pytest process (the xdist
    controller, or the only process) before any worker or child starts, and handed on in
    the environment. Every program is cached (no minimum compile time): most of the
    suite's programs compile in well under a second, and tests compile them again."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return  # a worker of this run, a child, or the user's own cache
    folder = tempfile.mkdtemp(prefix="microscale-tests-jax-cache-")
    _RUN_CACHE.append(folder)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if "jax" in sys.modules:  # read from the environment at import: too late for this one
        import jax

        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _RUN_CACHE:
        shutil.rmtree(folder, ignore_errors=True)


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
        # The parent's XLA_FLAGS stay (a CPU variant of tests/cpu_variants.py reaches the
        # child too); only the device count is this fixture's.
        kept = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        full_env = dict(
            os.environ,
            XLA_FLAGS=" ".join([*kept, "--xla_force_host_platform_device_count=8"]),
            JAX_PLATFORMS="cpu",
            **(env or {}),
        )
        proc = subprocess.run(
            [sys.executable, "-c", script, *args],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout

    return run


NATIVE_ON_CPU = """
import jax, jax.numpy as jnp
from jax._src.interpreters import mlir
from jax._src.cudnn import scaled_matmul_stablehlo as smh
from microscale.ops import backend


def reference(a, b, sa, sb, *, preferred_element_type):
    f = lambda v, s: v.astype(jnp.float32) * jnp.repeat(
        s.astype(jnp.float32), v.shape[-1] // s.shape[-1], axis=-1)
    return (jnp.einsum("bmk,bnk->bmn", f(a, sa), f(b, sb),
                       precision=jax.lax.Precision.HIGHEST).astype(preferred_element_type),)


mlir.register_lowering(smh._scaled_matmul_p,
                       mlir.lower_fun(reference, multiple_results=True), platform="cpu")
backend.device_capability = lambda: (10, 0)
"""


@pytest.fixture(scope="session")
def native_on_cpu() -> str:
    """Lines for a child script: the capability probe reports Blackwell (10, 0), and
    ``jax.nn.scaled_matmul``'s primitive gets a CPU lowering by its documented reference
    formula (float32, highest precision). JAX's own partitioning of the primitive and
    microscale's rule around it are what a GPU compile would use."""
    return NATIVE_ON_CPU
