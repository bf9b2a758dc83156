"""Where the suite's time goes: a pytest plugin that records, per test, its CPU seconds and
the seconds JAX spent compiling in it.

``pytest -p suite_clock`` with ``SUITE_CLOCK_DIR=<folder>`` set writes one JSON file per
process (each xdist worker, or the one process) into that folder: ``{nodeid: {"cpu": s,
"wall": s, "start": unix s, "compile": s, "lower": s, "trace": s, "compiles": n, "hits": n}}`` for setup, call and
teardown together (a fixture's cost lands on the first test that asks for it). ``cpu`` is user + system time
of the process and of the child processes it has waited for, so a test that runs
``microscale`` in a subprocess counts the child's CPU; ``compile`` (XLA's backend
compile), ``lower`` (jaxpr to MLIR) and ``trace`` are JAX's own duration events
(`jax.monitoring`) in this process only, not in the children; ``compiles`` counts the
backend compiles (a hit of JAX's persistent compilation cache is one, and is quick) and
``hits`` the persistent cache's hits. CPU seconds hold when the
machine is loaded; wall seconds do not. A pytest that a test starts in a child process
records nothing of its own (its CPU is already its parent test's). ``benchmarks/suite_times.py``
adds the files up per module.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
}
CACHE_HIT = "/jax/compilation_cache/cache_hits"
_record: dict[str, dict[str, float]] = {}
_current: dict[str, float] | None = None
_active = False  # recording: SUITE_CLOCK_DIR set, and not a pytest run inside a test
NESTED = "SUITE_CLOCK_IN_TEST"  # set while a test runs, so that its child processes see it


def _cpu() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _on_duration(event: str, duration: float, **_: object) -> None:
    key = EVENTS.get(event)
    if key is not None and _current is not None:
        _current[key] = _current.get(key, 0.0) + duration
        if key == "compile":
            _current["compiles"] += 1


def _on_event(event: str, **_: object) -> None:
    if event == CACHE_HIT and _current is not None:
        _current["hits"] += 1


def pytest_configure(config: pytest.Config) -> None:
    global _active
    _active = bool(os.environ.get("SUITE_CLOCK_DIR")) and not os.environ.get(NESTED)
    if _active:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    global _current
    if not _active:
        yield
        return
    os.environ[NESTED] = "1"
    _current = dict.fromkeys(("compile", "lower", "trace", "start", "compiles", "hits"), 0.0)
    cpu, wall = _cpu(), time.perf_counter()
    _current["start"] = time.time()
    yield
    _current["cpu"] = _cpu() - cpu
    _current["wall"] = time.perf_counter() - wall
    _record[item.nodeid] = _current
    _current = None
    del os.environ[NESTED]


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = os.environ.get("SUITE_CLOCK_DIR")
    if _active and folder and _record:
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}-{os.getpid()}.json").write_text(json.dumps(_record))
